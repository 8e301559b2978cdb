"""What became of one run of a scheduled step on a worker, as a value.

A carrier's wait for a step (:meth:`jreplicate.ps.handle.StepCarrier.start`) returns
one of these; the :class:`~jreplicate.ps.coordinator.Coordinator` dispatches on its type
(``match``), never on exception types:

* :class:`Completed`: the step ran and pushed; ``value`` is its outputs.
* :class:`Failed`: the step's own error (its function, its input or a shard's update
  raised): not retried, and training stops (TF's application errors).
* :class:`Cancelled`: not applied: cancelled in flight (another step raised first),
  its token wait interrupted, or shut down.
* :class:`EndOfInput`: the worker's pipeline of the step's per-worker input is
  exhausted: the step goes back to the queue, uncounted.
* :class:`ShardLost`: a shard was lost (or closed) in the step; ``closed``: it was
  closed (as at shutdown) rather than found dead.
* :class:`WorkerLost`: the worker failed; the step may run again elsewhere.

A worker's run (:meth:`jreplicate.ps.worker.PSWorker.run`) returns one. Inside, the
run raises (:class:`ApplicationError` and those of :mod:`jreplicate.ps.remote`);
:func:`from_error` is the one table turning what it raised into an outcome, applied by
the worker itself (the embedded carrier) or, for what crossed Ray as a task error, by
the Ray carrier's wait.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from jreplicate.ps.remote import ParameterServerError, StepCancelledError
from jreplicate.ps.shard import ShardClosedError
from jreplicate.ps.worker_input import InputEnded


class ApplicationError(Exception):
    """The step function itself raised (not retried: TF's application errors)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error

    def __reduce__(self):  # crosses Ray with the original error
        return (ApplicationError, (self.error,))


class Completed(NamedTuple):
    """The step ran and pushed; ``value``: its outputs (or what fetches them);
    ``decision``: shard 0's decision of its push, where the worker knows it."""

    value: Any
    decision: Any = None


class Failed(NamedTuple):
    """The step's own error (not retried; training stops)."""

    error: BaseException


class Cancelled(NamedTuple):
    """The step was not applied: cancelled, its token wait interrupted, or shut down."""

    error: BaseException


class EndOfInput(NamedTuple):
    """The worker's pipeline of input ``key`` (sweep ``generation``) is exhausted."""

    key: int
    generation: int


class ShardLost(NamedTuple):
    """A shard was lost in the step (``closed``: closed, as at shutdown)."""

    error: BaseException
    closed: bool = False


class WorkerLost(NamedTuple):
    """The worker failed in the step (the step may run again elsewhere)."""

    error: BaseException


Outcome = Completed | Failed | Cancelled | EndOfInput | ShardLost | WorkerLost


def from_error(e: BaseException) -> Outcome:
    """The outcome of a run that raised ``e``: any error that is not the step's own, a
    cancellation, an end of input or a shard's is a failure of the worker."""
    if isinstance(e, InputEnded):
        return EndOfInput(e.key, e.generation)
    if isinstance(e, ApplicationError):
        return Failed(e.error)
    if isinstance(e, StepCancelledError):
        return Cancelled(e)
    if isinstance(e, ShardClosedError):
        return ShardLost(e, closed=True)
    if isinstance(e, ParameterServerError):  # the shards disagree (see ShardClient)
        return ShardLost(e)
    return WorkerLost(e)


def outcome_of(run: Callable[[], Any]) -> Outcome:
    """``Completed(run())``, or the outcome of the error ``run`` raised."""
    try:
        return Completed(run())
    except BaseException as e:  # noqa: BLE001 - broad on purpose: whatever a worker's
        # run raises ends its step (a device error, a kill, an interrupt are the
        # worker's failure); raised out of here it would end the coordinator's thread
        # with the step never ended
        return from_error(e)
