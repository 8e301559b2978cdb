"""Per-worker values under :class:`jreplicate.ParameterServerStrategy`, as TensorFlow's
``ClusterCoordinator`` per-worker resources (``PerWorkerValues``).

``strategy.create_per_worker_value(fn)`` returns a :class:`PerWorkerValue`: the driver
never calls ``fn``. Passed as an argument of ``rep.run(step, ...)``, it is replaced, on
the worker that runs the step, by that worker's own value, built there by
``fn(WorkerContext(worker_index, num_workers, num_replicas_in_sync))`` at its first step
that takes it (its thread, or its Ray actor) and kept for the next ones: ``fn`` runs
once per worker (again on a worker Ray restarted in a new process). The value is read
only: a pytree of arrays the step takes as it takes any argument (replicated over the
worker's sync group). An error ``fn`` raises is the step's error (``fetch``/``join``);
the next step that takes the value on that worker calls ``fn`` again.

The workers let their values go when the :class:`PerWorkerValue` is collected on the
driver (after the last step scheduled with it has ended: each step holds it).

**Per-worker state** (TensorFlow's per-worker variables, read with ON_READ
aggregation): ``strategy.create_per_worker_state(fn)`` returns a :class:`PerWorkerState`,
built on each worker as a :class:`PerWorkerValue`, that a step updates JAX's way, state
in and state out: the step receives its worker's state and returns the new value
wrapped in :func:`update_worker_state` anywhere in its outputs (one per state argument,
matched in the order of the arguments). The rules (see :meth:`WorkerValues.commit`):

* the new value is that worker's state from the next step there on exactly when the
  step succeeds, i.e. when its ``RemoteValue`` gets its outputs (where the marker is
  replaced by the new value). A step that raises, is cancelled (its push refused), or
  whose worker is lost in it leaves the state as it was; a step rerun on another
  worker updates the state of the worker whose run returned its outputs, never both;
* the new value has the structure, shapes and dtypes of the state the step received
  (as a ``lax.scan`` carry), one value per worker: over a sync group of
  ``num_replicas_in_sync`` replicas it must be the same on every replica (reduce a
  per-replica value, e.g. ``ctx.all_sum``). Else the step fails before it pushes;
* :meth:`PerWorkerState.read` on the driver returns each worker's state (NumPy) after
  the last step that succeeded there, or aggregated over the workers (``"sum"``,
  ``"mean"``); a worker holds no state (None) until a step taking it started there
  (``fn`` builds it then: a step that fails leaves ``fn``'s value);
* a replaced worker (``max_worker_restarts``, a Ray actor restarted) and every worker
  after ``strategy.restore`` rebuild their state with ``fn``: it is not in
  ``strategy.state()`` (checkpoints), as TensorFlow re-creates per-worker resources.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str
from jreplicate.context import PerReplica

_KEYS = itertools.count()


@dataclasses.dataclass(frozen=True)
class WorkerContext:
    """What ``fn`` of
    :meth:`jreplicate.ParameterServerStrategy.create_per_worker_value` is told: the
    worker it builds the value for (``0 <= worker_index < num_workers``) and the
    replicas of that worker's sync group.

    Example:
      >>> import jreplicate as jr
      >>> wc = jr.ps.WorkerContext(worker_index=1, num_workers=3, num_replicas_in_sync=1)
      >>> f"worker {wc.worker_index} of {wc.num_workers}"
      'worker 1 of 3'
    """

    worker_index: int
    num_workers: int
    num_replicas_in_sync: int


@dataclasses.dataclass
class PerWorkerArg:
    """A scheduled step's argument that the worker replaces by its own value."""

    key: int
    fn: Callable[[WorkerContext], Any]
    num_workers: int
    #: The driver's PerWorkerValue, held by the scheduled step (not sent).
    keep: Any = dataclasses.field(default=None, compare=False, repr=False)
    #: A :class:`PerWorkerState`: the step returns its new value.
    state: bool = False

    def __getstate__(self) -> dict:
        return {**self.__dict__, "keep": None}


class PerWorkerValue:
    """A value built once on each worker by a function (TensorFlow's
    ``PerWorkerValues``): pass it to ``rep.run`` and the step receives the value of
    the worker that runs it. Made by
    :meth:`jreplicate.ParameterServerStrategy.create_per_worker_value`.

    Example (each of 2 workers builds its own offset; each step sees its worker's):
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jreplicate as jr
      >>> strategy = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
      >>> rep = jr.Replicator(strategy)
      >>> with rep.scope():
      ...     w = jnp.zeros(2)
      ...     tx = jr.ps.pushable(optax.sgd(0.1))
      ...     opt = tx.init(w)
      >>> offset = strategy.create_per_worker_value(
      ...     lambda wc: np.full(2, wc.worker_index, np.float32))
      >>> def step(ctx, w, opt, offset):
      ...     u, opt = tx.update(jnp.ones(2), opt, w)
      ...     return optax.apply_updates(w, u), opt, offset
      >>> runs = [rep.run(step, None, w, opt, offset) for _ in range(4)]
      >>> rep.join()
      >>> all(float(r.fetch()[2][0]) == r.worker for r in runs)
      True
      >>> strategy.shutdown()
    """

    def __init__(self, fn: Callable[[WorkerContext], Any], num_workers: int,
                 release: Callable[[int], None]):
        self._key = next(_KEYS)
        self._fn, self._num_workers = fn, num_workers
        fin = weakref.finalize(self, release, self._key)
        fin.atexit = False

    def _arg(self) -> PerWorkerArg:
        return PerWorkerArg(self._key, self._fn, self._num_workers, keep=self)

    def __repr__(self) -> str:
        return f"PerWorkerValue({getattr(self._fn, '__name__', self._fn)!r}, " \
               f"workers={self._num_workers})"


class PerWorkerState(PerWorkerValue):
    """Per-worker state a step updates (TensorFlow's per-worker variables): built on
    each worker by ``fn`` as a :class:`PerWorkerValue`; the step receives its worker's
    state and returns the new one as ``jr.ps.update_worker_state(new)`` among its
    outputs. Made by :meth:`jreplicate.ParameterServerStrategy.create_per_worker_state`;
    the rules are in :mod:`jreplicate.ps.per_worker`.

    Example (each worker counts the examples its steps saw):
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jreplicate as jr
      >>> strategy = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
      >>> rep = jr.Replicator(strategy)
      >>> with rep.scope():
      ...     w = jnp.zeros(2)
      ...     tx = jr.ps.pushable(optax.sgd(0.1))
      ...     opt = tx.init(w)
      >>> seen = strategy.create_per_worker_state(lambda wc: np.zeros((), np.int32))
      >>> def step(ctx, w, opt, seen):
      ...     u, opt = tx.update(jnp.ones(2), opt, w)
      ...     return optax.apply_updates(w, u), opt, jr.ps.update_worker_state(seen + 8)
      >>> runs = [rep.run(step, None, w, opt, seen) for _ in range(5)]
      >>> rep.join()
      >>> int(seen.read("sum"))  # 5 steps of 8 examples, over the workers that ran them
      40
      >>> strategy.shutdown()
    """

    def __init__(self, fn: Callable[[WorkerContext], Any], num_workers: int,
                 release: Callable[[int], None], read: Callable[[int], list]):
        super().__init__(fn, num_workers, release)
        self._read = read

    def _arg(self) -> PerWorkerArg:
        return PerWorkerArg(self._key, self._fn, self._num_workers, keep=self, state=True)

    def read(self, reduce: str | None = None) -> Any:
        """Each worker's state, as of the last step that succeeded there (a snapshot per
        worker: a step running meanwhile is not seen until it ended; workers are read
        one after another, not at one instant). Read on the driver, as NumPy.

        Args:
          reduce: None: a list, one entry per worker: its state, or None where it holds
            none (no step taking this state started there since the worker was
            built, replaced or restored; on Ray, an actor that cannot be reached now,
            logged).
            ``"sum"`` or ``"mean"``: the states of the workers that hold one, summed or
            averaged leaf by leaf (TensorFlow's ON_READ aggregation); None if none does.

        Raises:
          ValueError: ``reduce`` is not None, ``"sum"`` or ``"mean"``, or the workers'
            states differ in structure or shape (``fn`` built them so).
        """
        if reduce not in (None, "sum", "mean"):
            raise ValueError(f"PerWorkerState.read(reduce={reduce!r}): reduce must be None "
                             "(one state per worker), 'sum' or 'mean'.")
        states = self._read(self._key)
        if reduce is None:
            return states
        return aggregate(states, reduce)

    def __repr__(self) -> str:
        return f"PerWorkerState({getattr(self._fn, '__name__', self._fn)!r}, " \
               f"workers={self._num_workers})"


def aggregate(states: list, reduce: str) -> Any:
    """The workers' ``states`` (None where a worker holds none) summed or averaged."""
    held = [s for s in states if s is not None]
    if not held:
        return None
    structures = {jax.tree.structure(s) for s in held}
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(s)) for s in held}
    if len(structures) > 1 or len(shapes) > 1:
        raise ValueError(
            f"PerWorkerState.read({reduce!r}): the workers' states differ in structure or "
            "shape (fn returned different ones per worker), so they cannot be "
            f"{'summed' if reduce == 'sum' else 'averaged'}; read(None) returns each.")
    # (in the states' dtype, as TensorFlow's aggregation; a mean of integers is float)
    total = jax.tree.map(lambda *xs: np.asarray(np.sum(np.stack(xs), axis=0,
                                                       dtype=np.result_type(xs[0]))), *held)
    if reduce == "sum":
        return total
    return jax.tree.map(lambda x: np.asarray(x / len(held)), total)


@jax.tree_util.register_pytree_node_class
class WorkerStateUpdate:
    """A step's output marking the new value of a :class:`PerWorkerState` (made by
    :func:`update_worker_state`). A pytree node: it passes through ``jax.jit``.

    Example:
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> marker = jr.ps.update_worker_state({"count": jnp.int32(1)})
      >>> isinstance(marker, jr.ps.WorkerStateUpdate), jax.tree.leaves(marker)
      (True, [Array(1, dtype=int32)])
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children[0])

    def __repr__(self) -> str:
        return f"WorkerStateUpdate({self.value!r})"


def update_worker_state(new_value: Any) -> WorkerStateUpdate:
    """Marks ``new_value``, returned by a step among its outputs, as the new value of the
    per-worker state the step took (a :class:`PerWorkerState`).
    A step taking several states returns one marker per state, in the order of its
    arguments. The step's ``RemoteValue`` holds ``new_value`` in the marker's place.

    Args:
      new_value: a pytree of arrays of the structure, shapes and dtypes of the state
        the step received, the same on every replica of the worker's sync group.

    Example (a pytree node: it passes through ``jax.jit`` with its value):
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> out = jax.jit(lambda n: (n * 2, jr.ps.update_worker_state(n + 1)))(jnp.int32(3))
      >>> int(out[1].value)
      4
    """
    return WorkerStateUpdate(new_value)


def take_updates(out: Any, sent: tuple, args: tuple, marked: bool = True
                 ) -> tuple[Any, list[tuple[int, Any]]]:
    """A step's outputs with each :class:`WorkerStateUpdate` replaced by its value, and
    ``(key, new value)`` for each :class:`PerWorkerState` argument of the step.

    Args:
      out: the step's outputs (on the worker, after it ran).
      sent: the step's arguments as scheduled (:class:`PerWorkerArg` for a state).
      args: the arguments the step received (the worker's states in their place).
      marked: whether a trace of the step returned a marker (:func:`has_marker`);
        without states or markers ``out`` is returned as it is.

    Raises:
      ValueError: the markers do not match the state arguments one for one, a state
        is passed twice, or a new value differs from the state in structure, shape or
        dtype (the step's error: it fails before it pushes).
    """
    states = [(i, a) for i, a in enumerate(sent) if isinstance(a, PerWorkerArg) and a.state]
    if not states and not marked:
        return out, []
    leaves, treedef = jax.tree.flatten(out)
    plan = _PLANS.get(treedef)
    if plan is None:
        if len(_PLANS) >= 64:  # (outputs of many structures: start again)
            _PLANS.clear()
        plan = _PLANS[treedef] = _unwrap_plan(treedef)
    stripped, spans = plan
    if len(spans) != len(states):
        raise ValueError(
            f"ParameterServerStrategy: the step took {len(states)} per-worker state(s) "
            f"(arguments {[i for i, _ in states]}) and returned "
            f"{len(spans)} jr.ps.update_worker_state(...) marker(s); return one per state, "
            "in the order of the arguments (the state unchanged: "
            "jr.ps.update_worker_state(state)). A value the step only reads is a "
            "strategy.create_per_worker_value(fn).")
    keys = [a.key for _, a in states]
    if len(set(keys)) != len(keys):
        raise ValueError(
            "ParameterServerStrategy: the same PerWorkerState is passed twice to one step "
            f"(arguments {[i for i, _ in states]}); pass it once.")
    found = []
    for (i, _), (start, stop, value_def, varies) in zip(states, spans):
        new = jax.tree.unflatten(value_def, leaves[start:stop])
        if varies or not _like(leaves[start:stop], value_def, args[i]):
            _check_like(new, args[i], i)  # (raises, naming the leaf)
        found.append(new)
    return (jax.tree.unflatten(stripped, leaves),
            [(a.key, new) for (_, a), new in zip(states, found)])


_PLANS: dict = {}  # output structure -> _unwrap_plan


def _unwrap_plan(treedef: Any) -> tuple[Any, list[tuple[int, int, Any, bool]]]:
    """For outputs of structure ``treedef``: the structure with each
    :class:`WorkerStateUpdate` node replaced by its value (the same leaves, in the same
    order), and per marker, in order, ``(first leaf, end leaf, its value's structure,
    whether a PerReplica is in it)``."""
    spans: list = []

    def unwrap(x: Any) -> Any:
        if not isinstance(x, WorkerStateUpdate):
            return x
        index = jax.tree.leaves(x.value)
        value_def = jax.tree.structure(x.value)
        varies = any(isinstance(y, PerReplica) for y in jax.tree.leaves(
            x.value, is_leaf=lambda y: isinstance(y, PerReplica)))
        spans.append((index[0] if index else 0, index[-1] + 1 if index else 0,
                       value_def, varies))
        return x.value

    numbered = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    stripped = jax.tree.map(unwrap, numbered,
                            is_leaf=lambda x: isinstance(x, WorkerStateUpdate))
    return jax.tree.structure(stripped), spans


def _like(new_leaves: list, new_def: Any, old: Any) -> bool:
    """Whether the new state's leaves and structure match ``old``'s, shape and dtype."""
    old_leaves, old_def = jax.tree.flatten(old)
    # (the kept leaves are in JAX's dtypes already: a dtype that differs is checked
    # again, canonicalised, by _check_like)
    return old_def == new_def and all(
        np.shape(a) == np.shape(b) and getattr(a, "dtype", None) == b.dtype
        for a, b in zip(old_leaves, new_leaves))


def has_marker(out: Any) -> bool:
    """Whether the outputs ``out`` hold a :class:`WorkerStateUpdate` (the worker asks at
    trace time, so that a step without states pays nothing per run)."""
    return any(isinstance(x, WorkerStateUpdate) for x in jax.tree.leaves(
        out, is_leaf=lambda x: isinstance(x, WorkerStateUpdate)))


def _check_like(new: Any, old: Any, index: int) -> None:
    """Refuses a new state ``new`` unlike the state ``old`` argument ``index`` was."""
    for path, x in jax.tree_util.tree_flatten_with_path(
            new, is_leaf=lambda x: isinstance(x, PerReplica))[0]:
        if isinstance(x, PerReplica):
            raise ValueError(
                f"ParameterServerStrategy: the new per-worker state of argument "
                f"[{index}]{path_str(path)} varies over its sync group's replicas; a "
                "worker keeps one state: reduce it over the group (e.g. ctx.all_sum, or "
                "ctx.all_sum(x) / ctx.num_replicas_in_sync) before returning it.")
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
    new_leaves, new_def = jax.tree.flatten(new)
    if old_def != new_def:
        raise ValueError(
            f"ParameterServerStrategy: the new per-worker state of argument [{index}] has "
            f"the structure {new_def}, the state {old_def}; return "
            "jr.ps.update_worker_state(new) with the state's structure.")
    for (path, a), b in zip(old_leaves, new_leaves):
        want = (tuple(np.shape(a)), _dtype(a))
        got = (tuple(np.shape(b)), _dtype(b))
        if want != got:
            raise ValueError(
                f"ParameterServerStrategy: the new per-worker state of argument "
                f"[{index}]{path_str(path)} has shape {got[0]} and dtype {got[1]}, the "
                f"state shape {want[0]} and dtype {want[1]}; a state keeps its shapes and "
                "dtypes (cast or reshape the new value).")


class WorkerValues:
    """The per-worker values and states of one worker (``g`` replicas), built on first
    use; a state is replaced by :meth:`commit`."""

    def __init__(self, index: int, g: int):
        self.index, self.g = index, g
        self._values: dict[int, Any] = {}
        self.built: dict[int, int] = {}  # fn calls per key (for tests)
        self.commits: dict[int, int] = {}  # states committed per key (for tests)
        self._released: set[int] = set()
        self._lock = threading.Lock()

    def get(self, a: PerWorkerArg) -> Any:
        """This worker's value of ``a`` (built now by ``a.fn`` if not yet).

        Raises:
          Exception: what ``fn`` raised (the step's error; the next step calls it again).
        """
        with self._lock:
            if a.key in self._values:
                return _fresh(self._values[a.key])
        value = a.fn(WorkerContext(self.index, a.num_workers, self.g))
        if a.state:  # (NumPy in JAX's dtypes: a state keeps the ones the step sees)
            value = jax.tree_util.tree_map_with_path(_canonical, value)
        with self._lock:
            self.built[a.key] = self.built.get(a.key, 0) + 1
            if a.key not in self._released:
                self._values.setdefault(a.key, value)
        return _fresh(value)

    def commit(self, updates: list[tuple[int, Any]]) -> None:
        """The states of a step that succeeded here replaced by its new values (called
        by the worker as its run returns the step's outputs: nothing of the step can
        fail after this)."""
        with self._lock:
            for key, value in updates:
                if key not in self._released:
                    self._values[key] = _fresh(value)  # (not the outputs' own nodes)
                    self.commits[key] = self.commits.get(key, 0) + 1

    def read(self, key: int) -> Any:
        """This worker's value of ``key`` as NumPy, or None if it holds none."""
        with self._lock:
            value = self._values.get(key)
        return None if value is None else jax.tree.map(np.asarray, value)

    def release(self, key: int) -> None:
        """Lets the value of ``key`` go (its PerWorkerValue was collected on the driver).
        Never blocks long: may run as a finalizer."""
        self._released.add(key)  # (a step of it still running keeps its own reference)
        self._values.pop(key, None)

    def count(self) -> int:
        """How many values this worker holds (for tests and diagnostics)."""
        return len(self._values)


def _dtype(x: Any) -> np.dtype:
    """The dtype a step sees for leaf ``x`` (JAX's canonical one)."""
    return jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else
                                         np.asarray(x).dtype)


def _fresh(value: Any) -> Any:
    """``value``'s pytree rebuilt around the same leaves: new ``nnx.Variable`` objects
    (pytree nodes) where it holds some, so that a step writing its NNX arguments back in
    place (:mod:`jreplicate.execution.nnx_args`) changes its own copy, never the value
    kept here (a failed step would otherwise change the state, and a step's outputs
    would share the next one's Variables)."""
    return jax.tree.map(lambda x: x, value)


def _canonical(path: tuple, x: Any) -> np.ndarray:
    """A leaf of a state as fn returned it, as NumPy in the dtype the step sees.

    Raises:
      TypeError: the leaf is not an array, a NumPy scalar or a number.
    """
    a = np.asarray(x)
    if a.dtype.kind not in "biufc":
        raise TypeError(
            f"create_per_worker_state(fn): fn returned {type(x).__name__} at "
            f"state{path_str(path)}; a state is a pytree of arrays (or numbers). Keep "
            "other values out of it (a PerWorkerValue, or the step function).")
    return a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)
