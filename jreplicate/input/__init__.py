"""Distributed input: ``input_fn`` becomes the per-replica batches each step consumes.

Where things live: ``context.py`` holds :class:`InputReplicationMode` (how many
pipelines: one, one per worker, one per replica) and :class:`InputContext` (what
``input_fn`` is told); ``sources.py`` what ``input_fn`` may return and how it is read;
``iterator.py`` :class:`InputIterator`, which reads elements, checks them, assembles
global sharded batches and, across processes, agrees on end of input and errors through
``protocol.py`` (each process's typed read outcome and the pure decision from them);
``staging.py`` the prefetch staging of single steps and device loops, ``prefetch.py``
its background threads and ``auto.py`` the automatic choice of prefetch; ``partial.py``
what a partial batch is and where one may be dropped; ``padding.py`` exact final
batches (``partial_batch="pad"``, ``batch_mask``); ``shutdown.py`` the pipeline at
interpreter exit; :class:`PmapShapedBatchWarning` (defined with the other checks of
batches shaped for ``jax.pmap``, in ``jreplicate/_porting.py``) says a batch looks like
one. The input layer sits beside the executors: it imports
the strategy protocol and the layout, never a concrete strategy.
"""

from jreplicate._porting import PmapShapedBatchWarning
from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.iterator import InputIterator

__all__ = ["InputContext", "InputIterator", "InputReplicationMode", "PmapShapedBatchWarning"]
