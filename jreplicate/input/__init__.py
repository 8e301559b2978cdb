"""Distributed input: replication modes, contexts, iterators."""

from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.iterator import InputIterator

__all__ = ["InputContext", "InputIterator", "InputReplicationMode"]
