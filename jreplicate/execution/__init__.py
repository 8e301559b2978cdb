"""Executors: how a strategy places state and runs steps."""

from jreplicate.execution.base import Executor
from jreplicate.execution.spmd import SPMDExecutor

__all__ = ["Executor", "SPMDExecutor"]
