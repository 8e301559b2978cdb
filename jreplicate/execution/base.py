"""The executor protocol: how a strategy places state and runs steps."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jreplicate.layout import Layout

#: What :meth:`Executor.run_again` returns when the call needs the full :meth:`Executor.run`.
NOT_RUN = object()


class Executor(abc.ABC):
    """Runs the steps of one :class:`jreplicate.Replicator` for its strategy.

    SPMD strategies (Mirrored, MultiWorker, TPU) share
    :class:`jreplicate.execution.spmd.SPMDExecutor`; a strategy that is not SPMD (e.g.
    a parameter server scheduling steps on workers) implements the same methods.

    Example (the executor a strategy makes, driven directly, as Replicator does):
      >>> import jax.numpy as jnp, jreplicate as jr
      >>> from jreplicate.execution import Executor
      >>> ex = jr.MirroredStrategy().make_executor()
      >>> isinstance(ex, Executor), ex.layout.num_replicas
      (True, 8)
      >>> w = ex.place(jnp.ones(2))  # replicated for the replicas
      >>> w.sharding.is_fully_replicated
      True
      >>> ex.run(lambda ctx, w: ctx.all_sum(w * ctx.replica_id), False, None, (w,),
      ...        steps=None, donate_argnums=()).tolist()  # 0 + 1 + ... + 7
      [28.0, 28.0]
    """

    def __init__(self, layout: Layout):
        self.layout = layout

    @abc.abstractmethod
    def scope(self) -> contextlib.AbstractContextManager:
        """Context in which new state is created placed for the replicas."""

    def logical_device_scope(self, logical_device_id: int) -> contextlib.AbstractContextManager:
        """Context in which new state is placed on one logical device of every replica."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def place(self, tree: Any) -> Any:
        """``tree`` placed replicated for the replicas."""

    @abc.abstractmethod
    def assemble(self, elements: Sequence[Sequence[np.ndarray]], treedef: Any) -> Any:
        """One step's input: ``elements[k]`` are the flat leaves of local replica ``k``'s
        element (``k`` indexes ``layout.local_replica_ids``), leaf arrays of one shape per
        leaf position. Returns the pytree ``run`` receives as ``inputs``. A leaf may
        carry a leading axis of K steps (see :meth:`run`'s ``steps``). The arrays are
        the executor's from then on (on CPU a device array may alias host memory):
        callers pass copies nothing else writes."""

    def split_batch(self, batch: Any) -> Any:
        """``run``'s ``inputs`` given as a pytree: :class:`.PerReplica` leaves as they are,
        other leaves taken as global batches and split over the replicas."""
        return batch

    @abc.abstractmethod
    def run(self, fn: Callable, has_batch: bool, batch: Any, args: tuple, *,
            steps: int | None, donate_argnums: tuple[int, ...],
            allow: frozenset = frozenset()) -> Any:
        """Runs ``fn`` on every replica, once (``steps=None``) or as a loop of ``steps``
        steps over a batch whose per-replica leaves have a leading axis of that length.
        ``allow``: the names of the pmap habits not to warn about
        (:mod:`jreplicate.execution.habits`), read when a step is first compiled."""

    def run_again(self, fn: Callable, has_batch: bool, batch: Any, args: tuple,
                  steps: int | None, donate_argnums: tuple[int, ...]) -> Any:
        """Runs a call shaped like an earlier one without repeating its checks (the
        steady state of a training loop), or returns ``NOT_RUN`` (of
        ``jreplicate.execution.base``) for :meth:`run` to take it. Its result or error is
        always :meth:`run`'s."""
        return NOT_RUN

    def per_worker_input(self, owner: object, input_fn: Callable, *,
                         partial_batch: str = "drop") -> Any:
        """The iterator of ``prepare_input(input_fn)`` in ``PER_WORKER`` mode when the
        input is read where the steps run (a parameter server's workers), or None: the
        driver reads it (:class:`jreplicate.InputIterator`)."""
        return None

    @abc.abstractmethod
    def reduce(self, reduce_op: str, value: Any) -> Any:
        """Combines per-replica values over replicas (``"sum"`` or ``"mean"``)."""

    @abc.abstractmethod
    def local_results(self, value: Any) -> list[Any]:
        """This process's replicas' values, one pytree per local replica."""

    def join(self) -> None:
        """Waits for every step scheduled so far (synchronous executors: nothing)."""
        return None
