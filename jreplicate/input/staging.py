"""Prefetch staging of the input: single steps or device loops of K steps (private).

:class:`PrefetchStaging` is the part of :class:`jreplicate.InputIterator` that hands out
prefetched items. The prefetch thread reads one step (or a device loop's K steps, placed
with one transfer) ahead; a switch between single steps and loops drains what was
prefetched and converts it, so nothing read is lost or reordered; the warnings of a read
(a dropped partial batch) travel with its item and are given when the caller takes it.
"""

from __future__ import annotations

import collections
import threading
import warnings
from typing import Any

import jax
import numpy as np

from jreplicate.context import PerReplica
from jreplicate.input import auto as auto_mod
from jreplicate.input import prefetch as prefetch_mod
from jreplicate.input.prefetch import Prefetcher


class PrefetchStaging:
    """Mixin of :class:`InputIterator`: the prefetched items, single steps or loops.

    Uses the iterator's ``_buffer``, ``_pending``, ``_executor``, ``_auto`` (with
    ``_auto_buffer``), ``_produce()`` and ``_produce_host()``; keeps its own state (set
    up by :meth:`_init_staging`).
    """

    def _init_staging(self) -> None:
        # Started by the first read, which says what to prefetch: single steps, or
        # device loops of self._chunk steps (see _prefetched).
        self._prefetcher: Prefetcher | None = None
        self._chunk: int | None = None
        self._leftover: collections.deque = collections.deque()
        self._closed = False
        self._producing = threading.local()  # the prefetch thread's warnings, per read

    def _prefetched(self, k: int | None) -> Any:
        """The next prefetched item: one step's batch (``k`` None) or ``(batch, n)`` for a
        device loop of ``k`` steps, the next of which is staged while this one runs. A
        change between the two drains what was prefetched and converts it: nothing read
        is lost or reordered."""
        self._check_open()
        if self._prefetcher is None or self._chunk != k:
            self._restart_prefetch(k)
        if self._leftover:
            return self._pop_leftover()
        try:
            return self._take(self._prefetcher.get())
        except _End as e:
            return self._end(e)

    def _from_leftover(self, k: int | None) -> Any:
        """The next item read ahead before prefetching stopped (see :meth:`_stop_prefetch`),
        as a single step or a loop of up to ``k`` steps."""
        self._check_open()
        if self._chunk != k:
            self._collect(k)
        return self._pop_leftover()

    def _pop_leftover(self) -> Any:
        kind, payload = self._leftover[0]
        if kind == "end":  # stays at the front: the end stays the end
            self._leftover[0] = ("end", None)  # its warnings are given once
            return self._end(payload)
        self._leftover.popleft()
        return self._take(payload)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this input iterator was closed (Replicator.finalize() or "
                "InputIterator.close()); call its reinitialize() to read from the start "
                "again, or prepare_input for a new one."
            )

    def _next_item(self, k: int | None) -> Any:
        """The next step's batch (``k`` None) or ``(batch, n)`` for a device loop of up
        to ``k`` steps: under ``prefetch_on_device=None`` as :meth:`_auto_next` decides,
        else as :meth:`_read_next`."""
        if self._auto is not None:
            return self._auto_next(k)
        return self._read_next(k)

    def _read_next(self, k: int | None) -> Any:
        """The next item: prefetched, left from a prefetch that stopped, or read now."""
        if self._buffer:
            return self._prefetched(k)
        if self._leftover:
            return self._from_leftover(k)
        if k is None:
            return self._produce()
        self._chunk = k
        return self._produce_chunk()

    def _auto_next(self, k: int | None) -> Any:
        """The next item under ``prefetch_on_device=None``: read in line (timed) or, in a
        trial or for good, prefetched; see :mod:`jreplicate.input.auto`."""
        auto = self._auto
        if auto.trial or self._leftover:  # prefetched, or read ahead by the trial
            item = self._read_next(k)
        else:
            item = auto.read(lambda: self._read_next(k))
        verdict = auto.step_done()
        if verdict == auto_mod.TRY:
            self._buffer = self._auto_buffer
        elif verdict == auto_mod.STOP:
            self._stop_prefetch(k)
        elif verdict == auto_mod.KEEP:
            self._buffer, self._auto = self._auto_buffer, None
        return item

    def _stop_prefetch(self, k: int | None) -> None:
        """Back to reading in line: what the thread read ahead is handed out first."""
        self._collect(k)
        self._buffer = 0

    def _end(self, err: BaseException | None) -> Any:
        """Raises what the end of the prefetched input is: StopIteration (after its
        warnings), or the error that ended it."""
        if isinstance(err, _End):
            self._take((None, err.notes))
        elif err is not None:
            raise err
        raise StopIteration

    def _restart_prefetch(self, k: int | None) -> None:
        self._collect(k)
        self._prefetcher = Prefetcher(self._produce_noted, self._buffer)

    def _collect(self, k: int | None) -> None:
        """Stops the prefetch thread, if any, and keeps what it read ahead (and what was
        kept before) in ``_leftover``, as single steps (``k`` None) or loops of up to
        ``k`` steps; sets ``_chunk`` to ``k``."""
        items = list(self._leftover)
        self._leftover.clear()
        if self._prefetcher is not None:
            drained, self._prefetcher = self._prefetcher.drain(), None
            for got, err in drained:
                if got is prefetch_mod.END:
                    items.append(("end", err))
                else:
                    items.append(("single" if self._chunk is None else "chunk", got))
        singles: list = []  # consecutive single steps, joined into loops of up to k

        def flush():
            for i in range(0, len(singles), k or 1):
                part = singles[i:i + k]
                batch = _stack_steps([b for b, _ in part])
                notes = [m for _, ms in part for m in ms]
                self._leftover.append(("chunk", ((batch, len(part)), notes)))
            singles.clear()

        for kind, payload in items:
            if kind == "single" and k is not None:
                singles.append(payload)
                continue
            flush()
            if kind == "chunk" and k is None:  # a loop -> its single steps
                (batch, n), notes = payload
                self._leftover.extend(("single", (_step_of(batch, i), notes if i == n - 1
                                                   else [])) for i in range(n))
            elif kind != "end" or not self._leftover or self._leftover[-1][0] != "end":
                self._leftover.append((kind, payload))  # a loop of another length: as is
        flush()
        self._chunk = k

    def _produce_noted(self) -> tuple[Any, list]:
        """The prefetch thread's read: the item and the warnings it raised."""
        self._producing.notes = notes = []
        try:
            item = self._produce() if self._chunk is None else self._produce_chunk()
        except StopIteration:
            raise _End(notes) from None
        finally:
            self._producing.notes = None
        return item, notes

    def _take(self, got: tuple[Any, list]) -> Any:
        item, notes = got
        for message in notes:
            warnings.warn(message, stacklevel=5)
        return item

    # -- device loops ----------------------------------------------------------------
    def _get_steps(self, k: int) -> tuple[Any, int]:
        """The next ``k`` steps' inputs as one batch whose per-replica leaves have a
        leading step axis, and the number of steps it holds (fewer than ``k`` at the
        end of the input). Raises StopIteration when no step is left."""
        if self._pending is not None and self._pending[0] is not None:
            got, self._pending = self._pending[1], None
            return got
        if self._pending is not None:  # one step's batch, left by a failed run
            batch, self._pending = self._pending[1], None
            return _stack_steps([batch]), 1
        return self._next_item(k)

    def _produce_chunk(self) -> tuple[Any, int]:
        """Up to ``self._chunk`` steps read on the host and placed with one transfer."""
        hosts = []
        for _ in range(self._chunk):
            try:
                hosts.append(self._produce_host())
            except StopIteration:
                break
        if not hosts:
            raise StopIteration
        treedef = hosts[0][1]
        stacked = [[np.stack([h[0][r][j] for h in hosts]) for j in range(len(hosts[0][0][r]))]
                   for r in range(len(hosts[0][0]))]
        return self._executor.assemble(stacked, treedef), len(hosts)


def _step_of(batch: Any, i: int) -> Any:
    """Step ``i`` of a device loop's batch (per-replica leaves ``[replicas, steps, ...]``)."""
    return jax.tree.map(lambda x: PerReplica(x.array[:, i], x.mesh, x.axis_name), batch,
                        is_leaf=lambda x: isinstance(x, PerReplica))


@jax.jit
def _stack_leaves(arrays: list) -> jax.Array:
    return jax.numpy.stack(arrays, axis=1)  # [replicas, steps, ...], sharding kept


def _stack_steps(batches: list) -> Any:
    """Prefetched per-step batches (pytrees of PerReplica) stacked on a step axis."""
    def stack(*xs):
        return PerReplica(_stack_leaves([x.array for x in xs]), xs[0].mesh, xs[0].axis_name)
    return jax.tree.map(stack, *batches, is_leaf=lambda x: isinstance(x, PerReplica))


class _End(Exception):
    """The end of the input, as the prefetch thread saw it, with the warnings of the read
    that found it (given to the caller that reaches the end)."""

    def __init__(self, notes: list):
        super().__init__("end of input")
        self.notes = notes
