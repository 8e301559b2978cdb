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
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any

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


class WorkerValues:
    """The per-worker values of one worker (``g`` replicas), built on first use."""

    def __init__(self, index: int, g: int):
        self.index, self.g = index, g
        self._values: dict[int, Any] = {}
        self.built: dict[int, int] = {}  # fn calls per key (for tests)
        self._released: set[int] = set()
        self._lock = threading.Lock()

    def get(self, a: PerWorkerArg) -> Any:
        """This worker's value of ``a`` (built now by ``a.fn`` if not yet).

        Raises:
          Exception: what ``fn`` raised (the step's error; the next step calls it again).
        """
        with self._lock:
            if a.key in self._values:
                return self._values[a.key]
        value = a.fn(WorkerContext(self.index, a.num_workers, self.g))
        with self._lock:
            self.built[a.key] = self.built.get(a.key, 0) + 1
            if a.key not in self._released:
                self._values[a.key] = value
        return value

    def release(self, key: int) -> None:
        """Lets the value of ``key`` go (its PerWorkerValue was collected on the driver).
        Never blocks long: may run as a finalizer."""
        self._released.add(key)  # (a step of it still running keeps its own reference)
        self._values.pop(key, None)

    def count(self) -> int:
        """How many values this worker holds (for tests and diagnostics)."""
        return len(self._values)
