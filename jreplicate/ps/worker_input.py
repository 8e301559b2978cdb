"""Input read on the workers (``InputReplicationMode.PER_WORKER`` under
:class:`jreplicate.ParameterServerStrategy`), as TensorFlow's
``ClusterCoordinator.create_per_worker_dataset``.

``rep.prepare_input(input_fn)`` returns a :class:`WorkerInputIterator`: the driver
never calls ``input_fn`` and never reads a batch. Each ``rep.run(step, it, ...)``
schedules a closure whose batch is a :class:`WorkerInput` marker (no data); the worker
that runs it takes its next ``num_replicas_in_sync`` elements from its own pipeline,
built on the worker (its thread, or its Ray actor) by ``input_fn(InputContext(
input_pipeline_id=worker, num_input_pipelines=num_workers, ...))`` at its first step.

Semantics:

* each worker reads its pipeline in order, one element per replica of its sync group
  per step; with no faults every element is used exactly once;
* at-least-once execution: a step rerun after its worker died reads the next element of
  the new worker's pipeline; what the dead worker's pipeline still held is read by the
  worker that replaces it (``max_worker_restarts``, Ray's ``max_restarts``), first the
  elements of the step it died in where no shard decided that step's push (see
  :meth:`WorkerPipelines.hand_back`), or never, once the worker is lost for good (as in
  TensorFlow). The push ledger stays exact (one application per step id): on
  the shards the dead worker's push reached before it died (killed mid-push), the
  rerun's push is a duplicate, so there the element the rerun read is consumed but not
  applied; in asynchronous mode with several shards, the shards the push had not
  reached apply the rerun's gradient, computed from that element (a push is not atomic
  across shards there; token-gated mode stages the pieces and applies the first run's
  everywhere);
* a failed step keeps its elements: a step that read them and failed before any shard
  applied it (its function raised, its token wait was cancelled or timed out, a shard's
  update raised for its push) leaves them for the next step of the same sweep on that
  worker, as SPMD strategies retry a failed step's batch (once: if that step fails
  too, they are consumed, so that an element every step fails on cannot fail every
  later step of the sweep on that worker and keep the sweep from ending);
* partial batches (:mod:`jreplicate.input.partial`): a step that reads a pipeline's
  final element as a partial batch is dropped with a warning, and the pipeline is
  exhausted; a partial batch that the pipeline follows with more elements, or an
  element whose leaves disagree on the batch length, is that step's error
  (``RemoteValue.fetch()`` and ``join`` raise it) and the next step reads on;
* end of input: a worker whose pipeline is exhausted hands the step back (it runs on a
  worker that still has input) and takes no more steps of this iterator; once every
  live worker's pipeline is exhausted, the steps still queued are not run (their
  ``RemoteValue.fetch()`` raises ``StopIteration``; ``join`` does not: the end of input
  is no failure) and ``rep.run(step, it, ...)`` raises ``StopIteration``;
* ``reinitialize()`` starts a new sweep: every worker's pipeline restarts before that
  worker's first step scheduled after it. A step scheduled before it reads the sweep
  it was scheduled in, on a worker still in that sweep, or is not run
  (``StopIteration``); it never reads an element of the new sweep, and the end of the
  old sweep never ends the new one;
* freed: the pipeline on every worker (the source and what it buffered) is freed when
  the iterator is closed or collected. Collected: each scheduled step holds its
  iterator, so the driver letting it go (``del``, rebinding the name) frees the
  pipelines once the last step scheduled from it has ended (a weakref finalizer): no
  step is lost. ``close()`` frees them at once: a step already reading finishes (its
  push is applied as any other), and a step scheduled from it that has not begun
  reading is not run, as at the end of input (its ``RemoteValue.fetch()`` raises
  ``StopIteration``; ``join`` does not raise); a closed iterator schedules nothing
  more. On Ray the worker actor drops it with its next call (``close()``: a call of
  its own, after the steps sent before).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any

from jreplicate import _porting
from jreplicate._tree import path_str, report
from jreplicate.input import partial
from jreplicate.input.context import InputContext, InputReplicationMode
from jreplicate.input.iterator import InputIterator, _flatten
from jreplicate.input.sources import Pipeline
from jreplicate.ps.config import PSConfig

_KEYS = itertools.count()


class InputEnded(Exception):
    """A worker's pipeline is exhausted: the step goes back to the queue (not an error).

    ``generation`` is the sweep (``reinitialize()`` count) of the step that found the
    end: the end of an older sweep says nothing of the current one."""

    def __init__(self, key: int, worker: int, generation: int = 0):
        super().__init__(f"worker {worker}: the input pipeline {key} is exhausted")
        self.key, self.worker, self.generation = key, worker, generation

    def __reduce__(self):  # crosses Ray
        return (InputEnded, (self.key, self.worker, self.generation))


@dataclasses.dataclass
class WorkerInput:
    """A scheduled step's batch under ``PER_WORKER``: which iterator to read on the
    worker. ``input_fn`` is None where the worker has it already (Ray sends it once)."""

    key: int
    generation: int
    input_fn: Callable | None
    num_workers: int
    num_replicas: int
    #: The driver's iterator, held by the scheduled step so that the iterator (and
    #: with it the workers' pipelines) outlives every step scheduled from it: letting
    #: the iterator go never drops a queued step. Not sent (see ``__getstate__``).
    keep: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "keep": None}  # (the driver's, not the worker's)

    @property
    def sweep(self) -> tuple[int, int]:
        """``(key, generation)``: the sweep of the input this step reads."""
        return self.key, self.generation


@dataclasses.dataclass
class WorkerInputs:
    """A scheduled step's batch read from several per-worker iterators
    (``rep.run(step, (it1, it2), ...)``): the tuple of their elements, each read from
    the worker's pipeline of its iterator."""

    markers: tuple[WorkerInput, ...]

    @property
    def sweep(self) -> tuple:
        """The sweeps read together: this tuple's end of input is its own (the step
        ends where any of its iterators ends)."""
        return tuple(m.sweep for m in self.markers)


def markers(batch: Any) -> tuple[WorkerInput, ...]:
    """The per-worker inputs a step's batch reads (none for a driver-fed batch)."""
    if isinstance(batch, WorkerInput):
        return (batch,)
    return batch.markers if isinstance(batch, WorkerInputs) else ()


class _WorkerPipeline:
    """One iterator's pipeline on one worker, and the first step's element spec."""

    def __init__(self, pipeline: Pipeline, generation: int):
        self.pipeline, self.generation = pipeline, generation
        self.ended = False
        self.spec: tuple | None = None  # (treedef, [(shape, dtype)]) of the first step
        self.position = 0  # elements read since it was built or reinitialized
        #: A failed step's elements (:meth:`WorkerPipelines.put_back`), which the next
        #: step of this sweep takes before reading on.
        self.held: tuple[list, Any] | None = None
        #: The last step read the elements a failed step held: if it fails too, they
        #: are consumed (retried once: a step that fails on them every time, e.g. on a
        #: bad record, would otherwise fail every later step of the sweep here, for
        #: ever, and the sweep never end).
        self.retrying = False


class WorkerPipelines:
    """The pipelines of one worker (``g`` replicas), one per :class:`WorkerInput` key."""

    def __init__(self, index: int, g: int):
        self.index, self.g = index, g
        self._pipes: dict[int, _WorkerPipeline] = {}
        self.read_count: dict[int, int] = {}  # elements read, per key (for tests)
        # key -> (generation, elements): where a pipeline built here starts (a worker
        # restarted after its process died goes on where the lost one's steps ended).
        self.start_at: dict[int, tuple[int, int]] = {}
        #: Keys whose iterator was closed or collected on the driver: their pipelines
        #: are freed and never built again (a step reading one is not run).
        self.released: set[int] = set()
        # Releases not applied yet: release() may run on any thread (a finalizer run by
        # the garbage collector, on this worker's thread in the middle of a read too),
        # so it never waits for the lock; whoever holds it applies them on the way out.
        self._pending: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    def release(self, key: int) -> None:
        """Frees the pipeline of ``key`` (its iterator was closed or collected on the
        driver), now, or once the read that holds it ends; never blocks."""
        self._pending.append(key)
        self._apply_releases()

    def _apply_releases(self) -> None:
        while self._pending and self._lock.acquire(blocking=False):
            try:
                while self._pending:
                    key = self._pending.popleft()
                    self.released.add(key)
                    self._pipes.pop(key, None)
                    self.read_count.pop(key, None)
                    self.start_at.pop(key, None)
            finally:
                self._lock.release()
            # (re-checked: a release appended while the lock was held is applied here)

    def pipeline_count(self) -> int:
        """How many pipelines this worker holds (for tests and diagnostics)."""
        self._apply_releases()
        return len(self._pipes)

    def position(self, key: int) -> tuple[int, int] | None:
        """``(generation, elements read)`` of the pipeline of ``key`` (None: none)."""
        with self._lock:
            return self._position(key)

    def _position(self, key: int) -> tuple[int, int] | None:
        p = self._pipes.get(key)
        if p is None:
            return None  # (held elements are not read yet: a replacement reads them again)
        return p.generation, p.position - (self.g if p.held is not None else 0)

    def put_back(self, m: WorkerInput, elements: list, treedef: Any) -> None:
        """A step that read ``elements`` from this worker's pipeline of ``m`` failed
        before any shard applied it (its function raised, its token wait was cancelled
        or timed out, a shard's update raised): the next step of that sweep here takes
        them, as SPMD strategies retry a failed step's batch, instead of the element
        after them (which left those out of the sweep). A freed pipeline takes nothing."""
        with self._lock:
            p = self._pipes.get(m.key)
            if p is not None and p.generation == m.generation and p.held is None and \
                    not p.retrying:
                p.held = (elements, treedef)
        self._apply_releases()

    def hand_back(self, m: WorkerInput, elements: list, treedef: Any) -> None:
        """A worker died in a step that read ``elements`` and no shard decided its push:
        the worker replacing it (these pipelines, handed over) reads them first, as a
        Ray worker restarted after its process died reads them again. Unlike
        :meth:`put_back` it does not count as a retry (the step did not fail on them)."""
        p = self._pipes.get(m.key)
        if p is not None and p.generation == m.generation and p.held is None:
            p.held, p.retrying = (elements, treedef), False

    def read(self, m: WorkerInput) -> tuple[list, Any]:
        """The next step's elements (flat leaves per replica) and their structure.

        Raises:
          InputEnded: the pipeline is exhausted (or its final step is partial).
          Exception: what ``input_fn`` or the source raised.
        """
        self._apply_releases()
        try:
            with self._lock:
                if m.key in self.released:  # its iterator was closed on the driver
                    raise InputEnded(m.key, self.index, m.generation)
                return self._read(m)
        finally:
            self._apply_releases()  # (those that came while reading)

    def _read(self, m: WorkerInput) -> tuple[list, Any]:
        p = self._pipes.get(m.key)
        if p is None:
            ctx = InputContext(num_replicas=m.num_replicas, num_replicas_in_sync=self.g,
                               input_pipeline_id=self.index, num_input_pipelines=m.num_workers)
            p = self._pipes[m.key] = _WorkerPipeline(Pipeline(m.input_fn, ctx), m.generation)
            generation, skip = self.start_at.pop(m.key, (m.generation, 0))
            while generation == m.generation and p.position < skip and not p.ended:
                try:  # read by the steps of the process this one replaces
                    p.pipeline.next()
                    p.position += 1
                except StopIteration:
                    p.ended = True
        elif p.generation < m.generation:  # reinitialize() on the driver
            p.pipeline.reinitialize()
            p.generation, p.ended, p.position, p.held = m.generation, False, 0, None
        elif p.generation > m.generation:
            # A step scheduled before reinitialize(), whose sweep this worker left for
            # the next one: it reads no element of another sweep (the coordinator runs
            # it where its sweep goes on, or not at all).
            raise InputEnded(m.key, self.index, m.generation)
        p.retrying = p.held is not None
        if p.held is not None:  # a failed step's elements, read before the end if any
            got, p.held = p.held, None
            return got
        if p.ended:
            raise InputEnded(m.key, self.index, m.generation)
        elements, ended = [], False
        for k in range(self.g):
            try:
                elements.append(_flatten(p.pipeline.next(), self.index * self.g + k))
            except StopIteration:
                p.ended = ended = True
                if not elements:
                    raise InputEnded(m.key, self.index, m.generation) from None
                break
            self.read_count[m.key] = self.read_count.get(m.key, 0) + 1
            p.position += 1
        return self._check(p, m.key, elements, ended)

    def _check(self, p: _WorkerPipeline, key: int, elements: list, ended: bool
               ) -> tuple[list, Any]:
        """The step's elements, checked against the first step's (the rules of
        :mod:`jreplicate.input.partial`); ``ended``: the pipeline ran out after them.

        Raises:
          ValueError: an element is wrong, or is a partial batch that more elements
            follow (then the next step reads on after them).
          InputEnded: the step is dropped (with a warning): the pipeline ran out in it,
            or its last element is a final partial batch.
        """
        treedef = elements[0][1]
        if p.spec is None:
            leaves, _, paths = elements[0]
            ctx = p.pipeline.ctx
            warning = _porting.check_element(  # (raises again on a retry)
                [x.shape for x in leaves], [path_str(q) or "the root" for q in paths],
                _porting.device_counts(ctx.num_replicas, self.g), ctx._asked_batch_size,
                f"worker {self.index}: the input element of replica {self.index * self.g}")
            if warning is not None:
                warnings.warn(warning, stacklevel=2)
            p.spec = (treedef, [(x.shape, x.dtype) for x in leaves])
        problems, shorts = [], []
        for k, (leaves, td, paths) in enumerate(elements):
            rid = self.index * self.g + k
            if td != p.spec[0]:
                raise ValueError(
                    f"worker {self.index}: input element of replica {rid} has structure "
                    f"{td}, the first step's {p.spec[0]}. Every element must keep one "
                    "structure.")
            short, wrong = partial.rows_of(
                leaves, [path_str(q) or "the root" for q in paths], p.spec[1],
                f"worker {self.index}: input element of replica {rid}")
            problems += wrong
            if short is not None:
                shorts.append((k, short))
        report(problems, f"worker {self.index}: this step's input")
        step = (p.position - len(elements)) // self.g + 1
        for k, short in shorts:  # a later element, or the one read ahead, follows it?
            if k + 1 < len(elements) or (not ended and not p.pipeline.at_end()):
                problems.append(partial.mid_stream(
                    f"worker {self.index}: input element of replica "
                    f"{self.index * self.g + k} (input pipeline {self.index})", short, step))
        report(problems, f"worker {self.index}: this step's input")
        if ended:
            self._dropped(f"a final partial batch (an input pipeline ran out after "
                          f"{len(elements)} of {self.g} replicas got an element)")
            raise InputEnded(key, self.index, p.generation)
        if shorts:
            k, short = shorts[0]
            p.ended = True
            what = partial.detail(self.index * self.g + k, short)
            self._dropped(f"a final partial batch ({what})")
            raise InputEnded(key, self.index, p.generation)
        return [leaves for leaves, _, _ in elements], treedef

    def _dropped(self, what: str) -> None:
        warnings.warn(f"jreplicate: worker {self.index} dropped {what}; its input "
                      "pipeline is exhausted.", stacklevel=3)


class ZippedWorkerInputs(InputIterator):
    """``rep.run(step, (it1, it2, ...), ...)``: each step reads the next element of
    every iterator on the worker that runs it, and takes their tuple as its batch. The
    step ends (not run, ``StopIteration``) where any of them ends."""

    def __init__(self, owner: object, executor: Any,
                 iterators: tuple[WorkerInputIterator, ...]):
        self._owner, self._executor, self._iterators = owner, executor, iterators

    def get_next(self) -> WorkerInputs:
        batch = WorkerInputs(tuple(it.get_next() for it in self._iterators))
        if self._executor.sweep_exhausted(batch.sweep):
            raise StopIteration
        return batch

    def next_steps(self, k: int) -> Any:
        return self._iterators[0].next_steps(k)

    def put_back(self, item: Any, steps: int | None) -> None:
        """Markers hold no data: nothing to put back."""

    def close(self) -> None:
        """Nothing: the iterators it reads stay open (close them)."""


class WorkerInputIterator(InputIterator):
    """The driver's side of ``PER_WORKER`` input under ParameterServerStrategy: it
    holds no pipeline and reads nothing (see the module docstring).

    Each ``get_next()`` is a :class:`WorkerInput` marker for one scheduled step.
    """

    def __init__(self, owner: object, config: PSConfig, executor: Any,
                 input_fn: Callable[[InputContext], Any]):
        # Not InputIterator.__init__: that would call input_fn on the driver.
        self._owner, self._config, self._executor = owner, config, executor
        self._fn = input_fn
        self._key = next(_KEYS)
        self._generation = 0
        self._mode = InputReplicationMode.PER_WORKER
        self._closed = False
        # Collected without close(): its pipelines are freed on the workers all the same
        # (the carrier sends the release with each worker's next call; never at exit).
        self._release = weakref.finalize(self, executor.release_input, self._key)
        self._release.atexit = False

    @property
    def num_input_pipelines(self) -> int:
        """One pipeline per worker (each built on its worker)."""
        return self._config.num_workers

    @property
    def prefetching(self) -> bool:
        """Always False, as the workers read in line (a worker's read overlaps the others'
        steps)."""
        return False

    def get_next(self) -> WorkerInput:
        """A marker for the next scheduled step (the worker reads the batch).

        Raises:
          StopIteration: every live worker's pipeline is exhausted.
        """
        if self._closed:
            raise RuntimeError("the input iterator was closed; prepare a new one.")
        if self._executor.input_exhausted(self._key, self._generation):
            raise StopIteration
        return WorkerInput(self._key, self._generation, self._fn,
                           self._config.num_workers, self._config.num_replicas, keep=self)

    def reinitialize(self) -> list:
        """Starts a new sweep: every worker's pipeline restarts before that worker's
        first step scheduled after this call (steps scheduled before it read the old
        sweep, or are not run); returns ``[]``."""
        if self._closed:
            raise RuntimeError("the input iterator was closed; prepare a new one.")
        self._generation += 1
        self._executor.reset_input(self._key, self._generation)
        return []

    def close(self) -> None:
        """Frees this iterator's pipeline on every worker (see the module docstring:
        steps scheduled from it that have not begun reading are not run)."""
        self._closed = True
        if self._release.detach() is not None:
            self._executor.release_input(self._key, now=True)

    def next_steps(self, k: int) -> Any:
        raise ValueError(
            "Replicator.run(..., steps=K) under ParameterServerStrategy: device loops "
            "are not supported (each step is one push); call run once per step.")

    def put_back(self, item: Any, steps: int | None) -> None:
        """A marker holds no data: nothing to put back."""

    def __repr__(self) -> str:
        return (f"WorkerInputIterator(pipelines={self.num_input_pipelines}, "
                f"key={self._key})")

