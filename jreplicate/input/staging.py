"""Prefetch staging of the input: single steps or device loops of K steps (private).

:class:`Staging` hands out the items of one :class:`jreplicate.InputIterator`, which
owns it and gives it its reads (a callable) and the placement of a batch (another). The
prefetch thread reads one step (or a device loop's K steps, placed with one transfer)
ahead; a switch between single steps and loops (or loops of another K) drains what was
prefetched and converts it, so nothing read is lost or reordered; the warnings of a read
(a dropped partial batch) travel with its item and are given when the caller takes it.

A device loop of K steps equals K separate runs: a run that raises puts its batches back
at the front of the input (:meth:`Staging.put_back`), for a retry of any form; a loop
is shorter than K only where K separate runs would stop, at the end of the input or at
an input error (the loop runs the complete steps before it, and the next read raises
the error); the thread reads on after an input error, as a caller reading in line would.
"""

from __future__ import annotations

import collections
import inspect
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate.context import PerReplica
from jreplicate.input import auto as auto_mod
from jreplicate.input import prefetch as prefetch_mod
from jreplicate.input.prefetch import Prefetcher


class Staging:
    """The prefetched items of one :class:`InputIterator`, single steps or loops.

    The iterator owns it and hands it what it needs: ``produce_host()`` reads one
    step's checked host elements (``(leaves per replica, treedef)``; raises
    StopIteration at the end of the input), ``assemble(leaves, treedef)`` places them
    as a global batch.

    Bound methods are held weakly (as :class:`~jreplicate.input.prefetch.Prefetcher`
    holds its own): the owner and its staging form no cycle, so an iterator dropped
    while it prefetches is freed at once and its prefetch thread ends.

    Args:
      produce_host: reads one step on the host.
      assemble: places host leaves on the devices.
      buffer: items to keep ready when prefetching (0: read on the calling thread).
      auto_prefetch: start reading in line and prefetch (with ``buffer``) where a trial
        shows it helps (see :mod:`jreplicate.input.auto`).
    """

    def __init__(self, produce_host: Callable[[], tuple[list, Any]],
                 assemble: Callable[[list, Any], Any], *, buffer: int,
                 auto_prefetch: bool = False):
        self._produce_host_now = _weakly(produce_host)
        self._assemble = _weakly(assemble)
        self._buffer = buffer
        #: The automatic choice of prefetch while it is undecided (else None).
        self.auto: auto_mod.AutoPrefetch | None = None
        self._auto_buffer = buffer
        if auto_prefetch and buffer:
            self.auto, self._buffer = auto_mod.AutoPrefetch(buffer), 0
        # Started by the first read, which says what to prefetch: single steps, or
        # device loops of self._chunk steps (see _prefetched).
        self._prefetcher: Prefetcher | None = None
        self._chunk: int | None = None
        # Items read but not taken, in order, each ("single", (batch, notes)),
        # ("chunk", ((batch, n), notes)), ("error", exception) or ("end", why): what the
        # prefetch thread had read ahead when it stopped, and batches put back.
        self._leftover: collections.deque = collections.deque()
        self._reform = False  # _leftover starts with items put back, in their own form
        # An input error met inside a device loop's reads, after its first step: raised
        # by the next read (see _produce_chunk).
        self._deferred: Exception | None = None
        self.closed = False
        self._producing = threading.local()  # the prefetch thread's warnings, per read

    # -- for the iterator ------------------------------------------------------------
    @property
    def prefetching(self) -> bool:
        """Whether items are read ahead on a background thread now."""
        return bool(self._buffer)

    def next(self, k: int | None) -> Any:
        """The next step's batch (``k`` None) or ``(batch, n)`` for a device loop of up
        to ``k`` steps: under automatic prefetch as :meth:`_auto_next` decides, else as
        :meth:`_read_next`."""
        if self.auto is not None:
            return self._auto_next(k)
        return self._read_next(k)

    def warn(self, message: str | Warning) -> None:
        """Gives a warning of the read under way: at once on the calling thread, or, on
        the prefetch thread, with the item it belongs to (when the caller takes it)."""
        notes = getattr(self._producing, "notes", None)
        if notes is not None:
            notes.append(message)
        else:
            warnings.warn(message, stacklevel=5)

    def close(self) -> None:
        """Stops the prefetch thread; reads raise until :meth:`restart`."""
        self.closed = True
        if self._prefetcher is not None:
            self._prefetcher.close()

    def restart(self) -> None:
        """Stops the prefetch thread (waiting for its read) and forgets what was read
        ahead or put back: the next read starts afresh (the iterator restarts its
        sources after this, so that no read races them)."""
        if self._prefetcher is not None:
            self._prefetcher.close(wait=True)
            self._prefetcher = None  # restarted by the next read
        self._deferred, self._reform = None, False
        self._leftover.clear()
        if self.auto is not None:
            self.auto.restart()
        self.closed = False

    def put_back(self, item: Any, steps: int | None) -> None:
        """Puts a taken item back at the front of the input: one step's batch (``steps``
        None) or a device loop's ``(batch, n)``. A run that raised consumed no input; the
        next read takes these steps first, as single steps or loops of any length."""
        self._leftover.appendleft(("single" if steps is None else "chunk", (item, [])))
        self._reform = True

    # -- reading -----------------------------------------------------------------------
    def _produce_host(self) -> tuple[list, Any]:
        if self._deferred is not None:  # met by the last device loop's reads
            error, self._deferred = self._deferred, None
            raise error
        return self._produce_host_now()

    def _produce(self) -> Any:
        return self._assemble(*self._produce_host())

    def _prefetched(self, k: int | None) -> Any:
        """The next prefetched item: one step's batch (``k`` None) or ``(batch, n)`` for a
        device loop of ``k`` steps, the next of which is staged while this one runs. A
        change between the two drains what was prefetched and converts it: nothing read
        is lost or reordered."""
        self._check_open()
        if self._prefetcher is None or self._chunk != k or self._reform:
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
        if self._chunk != k or self._reform:
            self._collect(k)
        return self._pop_leftover()

    def _pop_leftover(self) -> Any:
        kind, payload = self._leftover[0]
        if kind == "end":  # stays at the front: the end stays the end
            self._leftover[0] = ("end", None)  # its warnings are given once
            return self._end(payload)
        self._leftover.popleft()
        if kind == "error":  # raised once, in its place; what follows is read on
            raise payload
        return self._take(payload)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(
                "this input iterator was closed (Replicator.finalize() or "
                "InputIterator.close()); call its reinitialize() to read from the start "
                "again, or prepare_input for a new one."
            )

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
        auto = self.auto
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
            self._buffer, self.auto = self._auto_buffer, None
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
        elif err is not None and not isinstance(err, StopIteration):
            raise err
        raise StopIteration

    def _restart_prefetch(self, k: int | None) -> None:
        self._collect(k)
        self._prefetcher = Prefetcher(self._produce_noted, self._buffer)

    def _collect(self, k: int | None) -> None:
        """Stops the prefetch thread, if any, and keeps what it read ahead, after what was
        kept before, in ``_leftover``: as single steps (``k`` None) or loops of ``k``
        steps; sets ``_chunk`` to ``k``. A loop is shorter than ``k`` only before the end
        of the input or an input error: steps that do not fill a loop are completed by
        reads on this thread (see :meth:`_fill`)."""
        items = list(self._leftover)
        self._leftover.clear()
        if self._prefetcher is not None:
            form = "single" if self._chunk is None else "chunk"
            drained, self._prefetcher = self._prefetcher.drain(), None
            items += [("end", err) if got is prefetch_mod.END else
                      ("error", err) if got is prefetch_mod.ERROR else (form, got)
                      for got, err in drained]
        self._chunk, self._reform = k, False
        singles: list = []  # steps (batch, notes) not yet in a loop of k
        for kind, payload in items:
            if kind == "chunk" and (k is None or singles or payload[0][1] != k):
                singles += _split(payload)  # a loop of another length -> its steps
            elif kind == "single":
                singles.append(payload)
            else:
                self._keep_steps(singles, k)
                self._keep(kind, payload)
        try:
            marker = self._fill(singles, k)
        except BaseException:  # Ctrl-C: keep what was read; the next read fills the loop
            self._reform = True
            raise
        finally:
            self._keep_steps(singles, k)
        if marker is not None:
            self._keep(*marker)

    def _keep_steps(self, singles: list, k: int | None) -> None:
        """Appends ``singles`` to ``_leftover`` as single steps, or as loops of ``k``
        (the last one shorter if they do not fill it), and empties ``singles``."""
        if k is None:
            self._leftover.extend(("single", s) for s in singles)
        else:
            for i in range(0, len(singles), k):
                part = singles[i:i + k]
                batch = _stack_steps([b for b, _ in part])
                self._leftover.append(("chunk", ((batch, len(part)),
                                                 [m for _, ms in part for m in ms])))
        singles.clear()

    def _keep(self, kind: str, payload: Any) -> None:
        if kind != "end" or not self._leftover or self._leftover[-1][0] != "end":
            self._leftover.append((kind, payload))

    def _fill(self, singles: list, k: int | None) -> tuple | None:
        """Reads steps on this thread until ``singles`` fill loops of ``k`` (as K
        separate runs would read them); returns what stopped the reads early:
        ``("end", None)`` or ``("error", exception)``."""
        while k and len(singles) % k:
            try:
                singles.append((self._produce(), []))
            except StopIteration:
                return ("end", None)
            except Exception as e:  # broad: a source's error, raised at its step
                return ("error", e)
        return None

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
    def _produce_chunk(self) -> tuple[Any, int]:
        """Up to ``self._chunk`` steps read on the host and placed with one transfer.
        Fewer at the end of the input, or where a read raises after the first step (K
        separate runs would run the steps before it): the error is kept for the next
        read (:attr:`_deferred`). Interrupted (Ctrl-C) on the calling thread, the steps
        read so far are put back for the next read."""
        hosts = []
        for _ in range(self._chunk):
            try:
                hosts.append(self._produce_host())
            except StopIteration:
                break
            except prefetch_mod.InputClosedError:
                raise  # the process exits: the steps read never go on into JAX
            except Exception as e:  # broad: a source's error, deferred to its step
                if not hosts:
                    raise
                self._deferred = e
                break
            except BaseException:  # broad: Ctrl-C too: what was read goes back
                if hosts and getattr(self._producing, "notes", None) is None:
                    self.put_back(self._assemble_steps(hosts), len(hosts))
                raise
        if not hosts:
            raise StopIteration
        return self._assemble_steps(hosts)

    def _assemble_steps(self, hosts: list) -> tuple[Any, int]:
        """Steps read on the host (``_produce_host()`` results) as one device loop's
        ``(batch, n)``, placed with one transfer."""
        treedef = hosts[0][1]
        stacked = [[np.stack([h[0][r][j] for h in hosts]) for j in range(len(hosts[0][0][r]))]
                   for r in range(len(hosts[0][0]))]
        return self._assemble(stacked, treedef), len(hosts)


def _weakly(fn: Callable) -> Callable:
    """``fn``, holding its object weakly if it is a bound method; once the object is
    gone, a call raises StopIteration (only the prefetch thread of a dropped iterator
    can make one: it ends)."""
    if not inspect.ismethod(fn):
        return fn
    ref = weakref.WeakMethod(fn)

    def call(*args: Any) -> Any:
        method = ref()
        if method is None:
            raise StopIteration
        return method(*args)
    return call


def _split(payload: tuple) -> list:
    """A device loop's item ``((batch, n), notes)`` as its ``n`` steps ``(batch, notes)``
    (the notes go with the last)."""
    (batch, n), notes = payload
    return [(_step_of(batch, i), notes if i == n - 1 else []) for i in range(n)]


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


class _End(StopIteration):
    """The end of the input, as the prefetch thread saw it, with the warnings of the read
    that found it (given to the caller that reaches the end)."""

    def __init__(self, notes: list):
        super().__init__("end of input")
        self.notes = notes
