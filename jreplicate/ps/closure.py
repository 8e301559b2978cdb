"""A scheduled step and its parts, shared by the coordinator, the scheduler and the workers.

:class:`Closure` is what the coordinator queues and a worker runs; :class:`CancelFlag`
is how the coordinator cancels it in flight; :class:`HostBatch` is one step's input on
the host. None of them depends on the worker (:mod:`jreplicate.ps.worker`), so the
scheduling side imports them without the worker's JAX machinery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jreplicate.ps.remote import StepCancelledError


@dataclasses.dataclass
class HostBatch:
    """One step's input for one sync group, on the host: ``elements[k]`` are the flat
    leaves of replica ``k``'s element (see ``Executor.assemble``)."""

    elements: list
    treedef: Any


class CancelFlag:
    """Set by the coordinator when a scheduled step is cancelled because another step
    raised first (TensorFlow's cancellation of in-flight closures): the worker running
    it refuses its push (:meth:`PSWorker.run`). It does not cross processes: a copy
    unpickled on a Ray worker actor is a new flag, never set (those steps run on and
    push, the documented bound of that carrier)."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        self.reason = self.reason or reason

    def is_set(self) -> bool:
        return self.reason is not None

    def __reduce__(self):
        return (CancelFlag, ())


@dataclasses.dataclass
class Closure:
    """A scheduled step. ``args[param_index]`` and ``args[opt_index]`` are placeholders
    (None): the worker puts the pulled parameters and its copy of the state there."""

    step_id: int
    fn: Callable
    has_batch: bool
    batch: Any
    args: tuple
    param_index: int
    opt_index: int | None
    fn_key: int = -1  # the same function has the same key (Ray sends it once per worker)
    attempt: int = 0  # the run of the step (set by the coordinator)
    #: Start from the parameters the worker's previous push returned, if it has them
    #: (set by the Ray carrier for a step queued behind another on its worker).
    reuse: bool = False
    #: The pmap habits the step has on purpose (``Replicator.run(..., allow=...)``).
    allow: frozenset = frozenset()
    #: Set when the step is cancelled (another step raised first): its push is refused.
    cancel: CancelFlag = dataclasses.field(default_factory=CancelFlag, compare=False,
                                           repr=False)


def check_cancelled(c: Closure) -> None:
    """Raises StepCancelledError if ``c`` was cancelled (before it pushed)."""
    if c.cancel.is_set():
        raise StepCancelledError(c.cancel.reason)
