"""InputIterator: reads per-replica elements and assembles global sharded batches."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jreplicate import _porting, _wire
from jreplicate._tree import check_fits, is_array_like, jax_can_hold, native, path_str, report
from jreplicate.input import padding, partial
from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.prefetch import ReaderPool
from jreplicate.input.protocol import Action, ReadOutcome, decide
from jreplicate.input.shutdown import InputClosedError
from jreplicate.input.sources import Pipeline
from jreplicate.input.staging import Staging
from jreplicate.strategies.base import Strategy

if TYPE_CHECKING:
    from jreplicate.execution.base import Executor


class InputIterator:
    """Per-step input for :meth:`jreplicate.Replicator.run`, from
    :meth:`jreplicate.Replicator.prepare_input`.

    Each step every replica takes the next element of the pipeline that feeds it; the
    elements are stacked into one global ``jax.Array`` per leaf, of shape
    ``[num_replicas, *element_shape]`` and sharded over the replicas, and returned as a
    pytree of :class:`jreplicate.PerReplica`.

    **Final partial batch** (``prepare_input(..., partial_batch=...)``). Elements must
    all have the structure and shapes of the first step, except a partial batch: every
    batched leaf shorter along its leading axis by the same number of rows (leaves that
    disagree are an error; see :mod:`jreplicate.input.partial`). With ``"drop"``
    (default), a step in which a pipeline runs out, or a replica's element is a partial
    batch that ends its pipeline, ends the iteration (StopIteration) and its elements
    are dropped with a warning, so a step never recompiles for a short batch; a partial
    batch that its pipeline follows with more elements is an error of the step that
    read it (dropping it would lose the rest of the input), found by reading one element
    ahead at a partial batch only. With ``"pad"`` a step with partial batches (at a
    pipeline's end or in its middle) or run-out pipelines is padded with zeros to the
    first step's shapes (a replica whose pipeline has run out gets all padding) and
    runs; the step reads ``ctx.batch_mask`` to count real examples only; the iteration
    ends when every pipeline has run out.

    **Failures.** A ``run`` that raises (its step fails to trace, an argument is
    rejected, Ctrl-C) consumes no input: its batch, or its device loop's batches, go
    back to the front of the iterator, in order, for the next ``run``, a single step or
    a loop of any length. An error reading the input (raised by ``input_fn``'s
    iterator, or by an element's check) is raised by the step that reads it, even when
    another pipeline ends in that step, and the next step reads on (across processes
    the input ends there, on every process); in a device loop the complete steps
    before it run (a shorter loop) and the next call raises it: a loop of K steps sees
    what K separate runs would, with or without prefetch.

    **Across processes** (:class:`jreplicate.MultiWorkerStrategy`): each step, every
    process reads its own replicas' elements and the processes agree on the outcome
    through the coordination service (about a millisecond on loopback; use
    ``prefetch_on_device=True`` to overlap it with the step), so they all stop at the
    same step, all raise the same error for elements whose shapes differ between
    processes or for a failing ``input_fn``, and none waits in a collective for a
    process that has stopped. In ``SINGLE`` mode worker 0 reads every replica's element
    and the batch is broadcast to the other processes (on the main thread).

    Example:
      >>> import itertools, numpy as np, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy())
      >>> inputs = rep.prepare_input(lambda ctx: itertools.count(np.float32(0)))
      >>> batch = next(inputs)  # one element per replica, stacked and sharded
      >>> batch
      PerReplica(num_replicas=8, shape=(), dtype=float32)
      >>> sorted(np.asarray(batch.array).tolist())
      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """

    def __init__(self, owner: object, strategy: Strategy, executor: Executor,
                 input_fn: Callable[[InputContext], Any], *,
                 replication_mode: InputReplicationMode, prefetch_buffer_size: int,
                 enforce_ordering: bool, partial_batch: str = "drop",
                 auto_prefetch: bool = False):
        self._owner = owner
        self._strategy = strategy
        self._executor = executor
        self._pad = padding.check_mode(partial_batch) == "pad"
        self._mode = replication_mode
        self._enforce_ordering = enforce_ordering
        self._pipelines, self._feeds = _make_pipelines(strategy, input_fn, replication_mode)
        self._spec: list | None = None
        self._first: tuple | None = None  # the first step's structure and leaf paths
        self._sweep = 1  # counts reinitialize(); dropped batches warn on every sweep
        self._step = 0  # steps read in this sweep (named by a mid-stream partial batch)
        self._exhausted = False
        # What a reinitialize() that did not reopen every pipeline raised: reads raise
        # until one succeeds (the pipelines are then in different sweeps).
        self._reopen_error: BaseException | None = None
        self._pool: ReaderPool | None = None
        # Across processes, every step's outcome is agreed first (see _produce_shared).
        self._agreement = strategy.agreement("input") if strategy.num_processes > 1 else None
        if self._agreement is not None and replication_mode is InputReplicationMode.SINGLE:
            prefetch_buffer_size = 0  # its broadcast is a collective: keep it on this thread
        # prefetch_on_device=None: read on the calling thread; prefetch (with this
        # buffer) where a trial shows it helps (see jreplicate.input.auto). Across
        # processes every process must read ahead alike (each read is an agreement
        # round with the others), and the agreement's round trip is worth hiding: on.
        self._staging = Staging(self._produce_host, self._assemble,
                                buffer=prefetch_buffer_size,
                                auto_prefetch=auto_prefetch and self._agreement is None)

    @property
    def replication_mode(self) -> InputReplicationMode:
        return self._mode

    @property
    def prefetching(self) -> bool:
        """Whether batches are read ahead on a background thread.

        Always with ``prefetch_on_device=True``, never with ``False``; with the default
        (None), once reads take more than a tenth of the time from one step to the next
        and a trial of a few steps shows prefetching makes steps faster (see
        :mod:`jreplicate.input.auto`), and always across processes (except in ``SINGLE``
        mode, whose broadcast stays on the calling thread)."""
        return self._staging.prefetching

    @property
    def num_input_pipelines(self) -> int:
        """Input pipelines on this process."""
        return len(self._pipelines)

    def get_next(self) -> Any:
        """The next inputs of every replica, as a pytree of :class:`PerReplica`.

        Raises:
          StopIteration: when a pipeline is exhausted (see the partial batch policy).
          Exception: what reading an element raised (the next call reads on).
        """
        return self._staging.next(None)

    # -- for Replicator.run (internal: not for user code) ------------------------------
    def belongs_to(self, owner: object) -> bool:
        """Whether ``owner`` (a :class:`jreplicate.Replicator`) prepared this iterator."""
        return self._owner is owner

    def next_steps(self, k: int) -> tuple[Any, int]:
        """The next ``k`` steps' inputs for a device loop, as one batch whose per-replica
        leaves have a leading step axis, and the number of steps it holds (fewer than
        ``k`` at the end of the input, or before an input error, which the next read
        raises).

        Raises:
          StopIteration: no step is left.
        """
        return self._staging.next(k)

    def put_back(self, item: Any, steps: int | None) -> None:
        """Puts a taken item back at the front of the input, for a ``run`` that raised
        (it consumed no input): one step's batch (``steps`` None) or a device loop's
        ``(batch, steps)``. The next read takes these steps first, as single steps or
        loops of any length."""
        self._staging.put_back(item, steps)

    def _warn(self, what: str | None) -> None:
        """Warns that ``what`` was dropped: at once on the calling thread, or, on the
        prefetch thread, with the item it belongs to (when the caller takes it)."""
        if what is None:
            return
        # The sweep number makes each sweep's warning a new one: Python shows a warning
        # once per message and location.
        self._staging.warn(f"jreplicate: dropped {what} on sweep {self._sweep} of the "
                           "input; the input iterator is exhausted.")

    def __iter__(self) -> InputIterator:
        return self

    def __next__(self) -> Any:
        return self.get_next()

    def reinitialize(self) -> list:
        """Restarts every pipeline from its beginning; returns ``[]`` (eager mode).

        Pipelines built from parameter-less callables are unaffected, and what was
        already read from them (prefetched) stays to be taken.

        Raises:
          Exception: what ``input_fn`` raised reopening a pipeline; the input is then
            unreadable (reads raise) until a ``reinitialize()`` succeeds.
        """
        # In SINGLE mode across processes only worker 0 has the pipeline, so only it
        # could tell that it is a callable: every process takes the full path (nothing
        # is prefetched there), or worker 0 kept its end (or put-back batches) while the
        # others forgot theirs and waited for it in the next step's agreement.
        shared_single = (self._agreement is not None
                         and self._mode is InputReplicationMode.SINGLE)
        if not self._staging.closed and self._pipelines and not shared_single and all(
                p.kind == "callable" for p in self._pipelines):
            self._sweep += 1
            return []
        self._staging.restart()  # first: no read may race the restarted sources
        self._reopen_error = None
        try:
            for p in self._pipelines:
                p.reinitialize()
        except BaseException as e:  # broad: however reopening fails, reads then raise
            self._reopen_error, self._exhausted = e, False  # reads raise, not end
            raise
        self._exhausted = False
        self._sweep += 1
        self._step = 0
        return []

    def close(self) -> None:
        """Stops the prefetch thread and the reader threads, if any."""
        self._staging.close()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- reading -----------------------------------------------------------------
    def _read(self, ids: tuple[int, ...]) -> list[Any]:
        """One element per replica fed here (``ids``), in that order, each flattened and
        copied as soon as it is read (see :func:`_flatten`), or :data:`padding.ENDED`
        where its pipeline ran out (StopIteration where every one did, or where the only
        pipeline ran out before the step's first element)."""
        if self._reopen_error is not None:
            e = self._reopen_error
            raise RuntimeError(
                f"this input iterator's reinitialize() failed ({type(e).__name__}: {e}), "
                "so its pipelines are not all at the start of a sweep; call "
                "reinitialize() again (it reopens them all) before reading.") from e

        def take(k):
            return _flatten(self._pipelines[self._feeds[k]].next(), ids[k])

        n = len(self._feeds)
        got = []
        if self._enforce_ordering or len(self._pipelines) == 1 or n == 1:
            error = None
            for k in range(n):
                try:
                    got.append(take(k))
                except StopIteration:
                    if not self._pad and len(self._pipelines) == 1:
                        if not got:
                            raise  # the end, at a step's start: nothing to drop
                        # The elements read are checked (a shorter one among them
                        # that more elements follow is an error; see _check_shapes).
                        got += [padding.ENDED] * (n - len(got))
                        break
                    # Every pipeline is read, in order, as the concurrent reads below
                    # do: another pipeline's error in this step is raised, not hidden
                    # by this end.
                    got.append(padding.ENDED)  # padded below while others have data
                except Exception as e:  # broad: a source's error is the step's
                    if len(self._pipelines) == 1 or isinstance(e, InputClosedError):
                        raise  # the step's elements read before it went with it
                    # Per-replica pipelines all take this step's element, as the
                    # concurrent reads do, so that they stay in step after the error.
                    error = error or e
                    got.append(padding.ENDED)
            if error is not None:
                raise error
            if got and all(e is padding.ENDED for e in got):
                raise StopIteration
            return got
        # Distinct pipelines per replica: read them concurrently, on daemon threads kept
        # for the iterator's life (a new pool per step costs milliseconds). A stalled
        # reader never holds up close() or the process's exit (e.g. on Ctrl-C).
        if self._pool is None:
            self._pool = ReaderPool(min(n, 8))
        results = self._pool.map(take, n)
        errors = [e for _, e in results]
        for e in errors:  # an error, even where another pipeline ended in this step
            if e is not None and not isinstance(e, StopIteration):
                raise e
        got = [padding.ENDED if e is not None else v for v, e in results]
        if all(v is padding.ENDED for v in got):
            raise StopIteration
        return got

    def _assemble(self, leaves: list, treedef: Any) -> Any:
        return self._executor.assemble(leaves, treedef)

    def _produce_host(self) -> tuple[list[list[np.ndarray]], Any]:
        """One step's checked host elements: the flat leaves of each local replica's
        element, and their tree structure."""
        if self._exhausted:
            raise StopIteration
        self._step += 1
        if self._agreement is not None:
            flat, treedef = self._produce_shared()
            return [leaves for leaves, _, _ in flat], treedef
        ids = self._strategy.local_replica_ids
        try:
            flat, treedef = self._check(self._read(ids), ids)
        except StopIteration:
            self._exhausted = True
            raise
        except _PartialBatch as e:
            self._exhausted = True
            self._warn(f"a final partial batch ({e})")
            raise StopIteration from None
        return [leaves for leaves, _, _ in flat], treedef

    def _check(self, flat: list[Any], ids: tuple[int, ...]) -> tuple[list, Any]:
        """The read elements (flattened; :data:`padding.ENDED` for a replica whose
        pipeline ran out) checked against each other and the first step.

        Raises:
          StopIteration: (``"drop"``) a pipeline ran out in this step, whose elements are
            dropped (with a warning), once they pass the checks.
          _PartialBatch: (``"drop"``) a final partial batch, to drop.
          ValueError: an element is wrong (see :meth:`_check_shapes`).
        """
        if self._pad:
            return self._check_padded(flat, ids)
        real = [k for k, e in enumerate(flat) if e is not padding.ENDED]
        treedef = self._check_structure([flat[k] for k in real], tuple(ids[k] for k in real))
        self._check_shapes(flat, ids)
        if len(real) < len(flat):
            self._warn(_dropped_message(len(real), len(flat)))
            raise StopIteration
        return flat, treedef

    def _check_structure(self, flat: list, ids: tuple[int, ...]) -> Any:
        """The common structure of one step's elements (the first step's for later
        steps); records the first step's element spec."""
        treedef = flat[0][1]
        for k, (_, td, paths) in enumerate(flat):
            if td != treedef:
                what = _difference((treedef, [path_str(p) or "the root" for p in flat[0][2]]),
                                   td, paths)
                raise ValueError(
                    f"input element of replica {ids[k]} has another structure than replica "
                    f"{ids[0]}'s in the same step: {what}. Every element of a step must "
                    "have one structure (same keys, same containers); fix input_fn."
                )
        if self._spec is None:  # the first step's element spec, kept for every step
            # Padded, from its largest element: a replica whose shard is shorter than a
            # batch (uneven PER_REPLICA shards) has a partial element even in the first
            # step. (Without padding a first step of two lengths stays an error: a drop
            # there would end the input at its start.)
            leaves, _, paths = max(flat, key=lambda f: sum(
                x.shape[0] for x in f[0] if x.ndim)) if self._pad else flat[0]
            self._check_pmap_shaped(flat[0], ids[0])  # (raises again on a retry)
            self._spec = [(x.shape, x.dtype) for x in leaves]
            self._first = (treedef, [path_str(p) or "the root" for p in paths])
        elif treedef != self._first[0]:
            raise _structure_changed(self._first, treedef, flat[0][2], ids[0])
        return treedef

    def _check_pmap_shaped(self, element: tuple, replica_id: int) -> None:
        """The first step's element of one replica, checked not to be shaped for
        ``jax.pmap`` (an error where input_fn said its per-replica batch size, else a
        :class:`~jreplicate.input.PmapShapedBatchWarning`; see ``jreplicate._porting``)."""
        leaves, _, paths = element
        asked = {p.ctx._asked_batch_size for p in self._pipelines} - {None}
        warning = _porting.check_element(
            [x.shape for x in leaves], [path_str(p) or "the root" for p in paths],
            _porting.device_counts(self._strategy.num_replicas,
                                   len(self._strategy.local_replica_ids)),
            asked.pop() if len(asked) == 1 else None,
            f"the input element of replica {replica_id}")
        if warning is not None:
            self._staging.warn(warning)

    def _check_padded(self, elements: list[Any], ids: tuple[int, ...]) -> tuple[list, Any]:
        """The step's (flattened) elements padded to the first step's shapes, each with
        its mask as a last leaf, under the structure of ``MaskedBatch(element, mask)``."""
        real = [k for k, e in enumerate(elements) if e is not padding.ENDED]
        flat = {k: elements[k] for k in real}
        treedef = self._check_structure([flat[k] for k in real], tuple(ids[k] for k in real))
        paths = flat[real[0]][2]
        b = padding.batch_size(self._spec, paths)
        out_def = padding.masked_treedef(treedef)
        out = []
        for k in range(len(elements)):
            if k in flat:
                leaves = padding.pad_element(flat[k][0], paths, self._spec, b, ids[k])
            else:
                leaves = padding.padding_element(self._spec, b)
            out.append((leaves, out_def, None))
        return out, out_def

    def _padding_for(self, spec: dict, n: int) -> tuple[list, Any]:
        """Elements for ``n`` local replicas whose pipelines ran out while other
        processes' did not, from the agreed spec (mask leaf included: all zeros), and
        their structure: this process's own if it saw an element, else rebuilt from the
        spec's description."""
        local = () if self._first is None else (padding.masked_treedef(self._first[0]),)
        treedef = _wire.rebuild(spec["tree"], local)
        leaves = [np.zeros(shape, dtype) for shape, dtype in _wire.leaf_specs(spec)]
        return [(list(leaves), treedef, None) for _ in range(n)], treedef

    def _produce_shared(self) -> Any:
        """One step across processes: read locally, agree, then all decide alike.

        Each process publishes the :class:`~jreplicate.input.protocol.ReadOutcome` of
        its read through the coordination service, as a checked JSON message; from the
        same outcomes every process takes the same :func:`~jreplicate.input.protocol.decide`
        decision, so no process raises while another waits in a collective. In SINGLE
        mode worker 0 reads every replica's element and the stacked batch is broadcast
        to the other processes.
        """
        strategy = self._strategy
        single = self._mode is InputReplicationMode.SINGLE
        ids = tuple(range(strategy.num_replicas)) if single else strategy.local_replica_ids
        flat, treedef, error = None, None, None
        seen = self._first is not None
        try:
            if self._feeds:
                flat, treedef = self._check(self._read(ids), ids)
            mine = ReadOutcome.data(
                None if flat is None else _wire.element_spec(treedef, flat[0][0]), seen=seen)
        except StopIteration:
            mine = ReadOutcome.end(seen=seen)
        except _PartialBatch as e:
            mine = ReadOutcome.partial(str(e), seen=seen)
        except Exception as e:  # shared below, so that every process raises it
            mine, error = ReadOutcome.error(e, seen=seen), e
        got = self._agreement.exchange(mine.to_wire(), "this step's input",
                                       ReadOutcome.from_wire)
        decision = decide([o.at(p) for p, o in enumerate(got)], pad=self._pad,
                          single=single, num_replicas=strategy.num_replicas)
        if decision.action is not Action.DATA:
            self._exhausted = True
        if decision.action is Action.RAISE:
            if decision.process == strategy.process_index and error is not None:
                raise error
            raise decision.error()
        if decision.action is Action.STOP:
            self._warn(decision.warning)
            raise StopIteration
        flat, built = self._build(decision, got, flat, len(ids))
        treedef = built or treedef
        if single:
            treedef = _wire.rebuild(decision.spec["tree"], (treedef,))
            flat = self._broadcast_single(flat, (treedef, _wire.leaf_specs(decision.spec)), ids)
        return flat, treedef

    def _build(self, decision: Any, got: list, flat: list | None, n: int) -> tuple:
        """``(elements, structure or None)``: this process's elements of the agreed
        spec where it must build them, from the spec (its pipelines ran out while
        others' did not: padding) or by widening its first step's batch; else as read.

        Every process knows which processes build (from every process's report), and
        when any does they agree on whether each could: a spec within the wire's
        limits may still be more than a process has memory for, and its error is then
        raised on every process, not on that one alone while the others wait in the
        step's collectives.
        """
        me, error, treedef = self._strategy.process_index, None, None
        builders = set(decision.pad) | {p for p, o in enumerate(got) if self._pad and (
            o.spec is not None and o.spec != decision.spec)}
        try:
            if me in decision.pad:  # others still have data: pad here
                flat, treedef = self._padding_for(decision.spec, n)
            elif me in builders:
                flat = self._widen(flat, decision.spec)  # the first step: another's batch
        except Exception as e:  # noqa: BLE001 - shared below, raised on every process
            error = f"{type(e).__name__}: {e}"
        if builders:
            reports = self._agreement.exchange(
                {"error": error and error[:2000]}, "building this step's padded input",
                _wire.BUILD_RESULT)
            failed = [(p, r["error"]) for p, r in enumerate(reports) if r["error"]]
            if failed:
                self._exhausted = True
                p, detail = failed[0]
                memory = ("MemoryError" in detail) * (
                    " The other processes' elements are that large: make the elements "
                    "smaller (a smaller batch or feature size), or give every process's "
                    "input as many elements.")
                raise ValueError(
                    f"process {p} could not build its input elements of this step from the "
                    f"agreed element spec ({_wire.spec_str(decision.spec)}): {detail}. Every "
                    "process raises this error." + memory)
        return flat, treedef

    def _widen(self, flat: list, spec: dict) -> list:
        """The first step's padded elements padded further to the agreed ``spec``, the
        largest process's (see :func:`~jreplicate.input.protocol.decide`), which
        becomes this process's element spec too."""
        shapes = [shape for shape, _ in _wire.leaf_specs(spec)]
        self._spec = [(shape, dtype) for shape, (_, dtype) in zip(shapes, self._spec)]
        return [([x if x.shape == shape else np.concatenate(
                      [x, np.zeros((shape[0] - x.shape[0],) + x.shape[1:], x.dtype)])
                  for x, shape in zip(leaves, shapes)], td, paths)
                for leaves, td, paths in flat]

    def _broadcast_single(self, flat: list | None, spec: tuple, ids: tuple) -> list:
        """Worker 0's elements of every replica, on every process (SINGLE mode)."""
        from jax.experimental import multihost_utils
        treedef, leaf_specs = spec
        if flat is not None:
            stacked = [np.stack([f[0][j] for f in flat]) for j in range(len(leaf_specs))]
        else:
            stacked = [np.zeros((len(ids),) + shape, dtype) for shape, dtype in leaf_specs]
        stacked = [np.asarray(x) for x in multihost_utils.broadcast_one_to_all(stacked)]
        return [([x[r] for x in stacked], treedef, None)
                for r in self._strategy.local_replica_ids]

    def _check_shapes(self, flat: list, ids: tuple[int, ...]) -> None:
        """Checks every element read against the first step's shapes and dtypes.

        Raises every wrong leaf of every replica's element at once; then, for a partial
        batch (see :mod:`jreplicate.input.partial`) that its pipeline follows with more
        elements (a later element of this step, or the one read ahead for the last),
        a ValueError; otherwise :class:`_PartialBatch` for a final partial batch.
        ``padding.ENDED`` entries (pipelines that ran out) are skipped.
        """
        problems, shorts = [], []
        for k, item in enumerate(flat):
            if item is padding.ENDED:
                continue
            leaves, _, paths = item
            short, wrong = partial.rows_of(
                leaves, [path_str(p) or "the root" for p in paths], self._spec,
                f"input element of replica {ids[k]}")
            problems += wrong
            if short is not None:
                shorts.append((k, short))
        report(problems, STEP)
        if not shorts:
            return
        for k, short in shorts:
            if not self._ends_after(flat, k):
                pipeline = self._pipelines[self._feeds[k]].ctx.input_pipeline_id
                problems.append(partial.mid_stream(
                    f"input element of replica {ids[k]} (input pipeline {pipeline})",
                    short, self._step))
        report(problems, STEP)
        k, short = shorts[0]
        raise _PartialBatch(partial.detail(ids[k], short))

    def _ends_after(self, flat: list, k: int) -> bool:
        """Whether the pipeline of step element ``k`` has no element after it: a later
        element of this step from the same pipeline says, else one read ahead."""
        feed = self._feeds[k]
        later = [flat[j] for j in range(k + 1, len(flat)) if self._feeds[j] == feed]
        if later:
            return later[0] is padding.ENDED
        return self._pipelines[feed].at_end()

#: What several bad leaves of one step's elements are reported under.
STEP = "this step's input"


class _PartialBatch(Exception):
    pass


def _difference(first: tuple, treedef: Any, paths: list) -> str:
    """How structure ``treedef`` (leaf ``paths``) differs from ``first``'s
    ``(treedef, rendered leaf paths)``: the leaf paths missing and new, or else the
    containers."""
    first_def, first_paths = first
    now = [path_str(p) or "the root" for p in paths]
    missing = [p for p in first_paths if p not in now]
    added = [p for p in now if p not in first_paths]
    return "; ".join(part for part in (
        f"missing {', '.join(missing)}" if missing else "",
        f"new {', '.join(added)}" if added else "") if part) or (
        f"the containers changed from {first_def} to {treedef}")


def _structure_changed(first: tuple, treedef: Any, paths: list, rid: int) -> ValueError:
    what = _difference(first, treedef, paths)
    return ValueError(
        f"input element of replica {rid} changed structure since the first step: {what}. "
        "Every element must keep the first step's structure (same keys, same containers); "
        "fix input_fn, or start a new iterator with prepare_input for the new structure."
    )


def _dropped_message(read: int, n: int) -> str | None:
    if not read:
        return None
    return (f"a final partial batch (an input pipeline ran out after {read} of {n} "
            "replicas got an element)")


def _flatten(element: Any, replica_id: int) -> tuple[list[np.ndarray], Any, tuple]:
    """An element's leaves as NumPy copies (checked), its structure and leaf paths. Copied
    as soon as read: a source may refill one buffer for every element it yields, and the
    device array made from the copy may alias it (see ``Executor.assemble``)."""
    leaves, treedef = jax.tree.flatten(element)
    paths = _paths_of(treedef)
    out, problems = [], []
    for x, path in zip(leaves, paths):
        if (type(x) is np.ndarray and x.dtype.itemsize < 8 and x.dtype.kind in "biuf"
                and x.dtype.isnative):
            out.append(x.copy())  # the common case, at once
            continue
        if not is_array_like(x):
            problems.append(TypeError(
                f"input element of replica {replica_id} has a {type(x).__name__} at "
                f"{path_str(path) or 'the root'}; elements must be pytrees of arrays "
                "(numpy arrays or Python numbers). Convert it, or drop it in input_fn."))
            continue
        x = np.array(x)
        x = x if x.dtype.isnative else x.astype(native(x.dtype))  # (same values)
        if not jax_can_hold(x.dtype):
            problems.append(TypeError(
                f"input element of replica {replica_id} at {path_str(path) or 'the root'} "
                f"has dtype {x.dtype}, which JAX arrays cannot hold (only numbers and "
                "booleans). Encode it as numbers in input_fn (e.g. token ids for text), "
                "or drop it."))
            continue
        try:
            check_fits(x, lambda path=path: f"input element of replica {replica_id} at "
                       f"{path_str(path) or 'the root'}")
        except ValueError as e:
            problems.append(e)
        out.append(x)
    report(problems, f"input element of replica {replica_id}")
    return out, treedef, paths




@functools.lru_cache(maxsize=256)
def _paths_of(treedef: Any) -> tuple:
    """The key path of each leaf of ``treedef`` (computed once per structure)."""
    dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    return tuple(p for p, _ in jax.tree_util.tree_flatten_with_path(dummy)[0])


def _make_pipelines(strategy: Strategy, input_fn: Callable, mode: InputReplicationMode):
    """Creates this process's pipelines; returns them and, per local replica, the index
    of the pipeline that feeds it."""
    local = strategy.local_replica_ids
    common = dict(num_replicas=strategy.num_replicas,
                  num_replicas_in_sync=strategy.num_replicas_in_sync)
    if mode is InputReplicationMode.PER_REPLICA:
        pipes = [Pipeline(input_fn, InputContext(input_pipeline_id=r,
                                                 num_input_pipelines=strategy.num_replicas,
                                                 **common)) for r in local]
        return pipes, list(range(len(local)))
    if mode is InputReplicationMode.PER_WORKER:
        ctx = InputContext(input_pipeline_id=strategy.process_index,
                           num_input_pipelines=strategy.num_processes, **common)
    elif mode is InputReplicationMode.SINGLE:
        ctx = InputContext(input_pipeline_id=0, num_input_pipelines=1, **common)
        if strategy.num_processes > 1:
            if strategy.agreement("input-single") is None:
                raise ValueError(
                    "InputReplicationMode.SINGLE across several processes needs a strategy "
                    "that distributes worker 0's batches (MultiWorkerStrategy)."
                )
            # Worker 0 reads every replica's element; the others receive them.
            if strategy.process_index != 0:
                return [], []
            return [Pipeline(input_fn, ctx)], [0] * strategy.num_replicas
    else:
        raise TypeError(
            "prepare_input(replication_mode=...) must be an InputReplicationMode "
            f"(SINGLE, PER_WORKER or PER_REPLICA), got {mode!r}."
        )
    return [Pipeline(input_fn, ctx)], [0] * len(local)
