"""RemoteValue and the errors of parameter-server training (TF2 ``ClusterCoordinator``)."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import jax
import numpy as np

from jreplicate.context import PerReplica


class WorkerLostError(RuntimeError):
    """A worker died or became unusable; its step is rescheduled on another worker.

    Raise it from a step to simulate a worker failure (the step runs again elsewhere).

    Example (the first try of step 0 "loses" its worker; the step runs again):
      >>> import jax.numpy as jnp, optax, jreplicate as jr
      >>> ps = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, sgd = jnp.ones(2), jr.ps.pushable(optax.sgd(0.5))
      ...     state = sgd.init(params)
      >>> tries = []
      >>> def step(ctx, params, state):
      ...     tries.append(1)
      ...     if len(tries) == 1:
      ...         raise jr.ps.WorkerLostError("simulated preemption")
      ...     sgd.update(jnp.ones(2), state, params)
      >>> rep.run(step, None, params, state).fetch()
      >>> rep.join()
      >>> len(tries), ps.parameters().tolist()  # applied once, by the second try
      (2, [0.5, 0.5])
      >>> ps.shutdown()
    """


class StepOutputsLostError(WorkerLostError):
    """A step's update was applied, on every shard, but its outputs are lost.

    Its worker was lost after its push was applied and before its outputs reached the
    driver: a worker that held them died (on Ray, outputs stay on the worker until
    fetched), or the step was not run again to recompute them (another step raised
    first and the steps behind it were cancelled, the strategy shut down, or its reruns
    were given up). Count such a step as applied: in asynchronous mode
    ``applied = scheduled - failed - cancelled``, where ``failed`` does not count it.
    Read the parameters from the shards (``strategy.parameters()``) rather than from
    the step's outputs.

    Example (counting the steps whose update is in):
      >>> import jreplicate as jr
      >>> issubclass(jr.ps.StepOutputsLostError, jr.ps.WorkerLostError)
      True
      >>> def applied(values):
      ...     n = 0
      ...     for v in values:
      ...         try:
      ...             v.fetch()
      ...         except jr.ps.StepOutputsLostError:
      ...             pass  # applied; its outputs are gone
      ...         except Exception:  # noqa: BLE001 - failed or cancelled: not applied
      ...             continue
      ...         n += 1
      ...     return n
    """


class ParameterServerError(RuntimeError):
    """A parameter-server shard failed; training cannot continue (restore a checkpoint).

    Raised by :meth:`RemoteValue.fetch`, :meth:`jreplicate.Replicator.join` and the next
    :meth:`jreplicate.Replicator.run` once a shard is lost (closed, or its Ray actor died
    and could not be restarted; a shard's update raising is the step's own
    :class:`ShardUpdateError` instead, unless it raised after another shard applied the
    same push: then the shards disagree and this is raised). The shards' state may then be
    inconsistent: restore the last checkpoint (``CheckpointManager.restore_or``) into a
    new strategy.

    Example (catching it around a training loop):
      >>> import jreplicate as jr
      >>> try:
      ...     raise jr.ps.ParameterServerError("shard 1 lost: its actor died ...")
      ... except jr.ps.ParameterServerError as e:
      ...     print("restore the last checkpoint:", e)
      restore the last checkpoint: shard 1 lost: its actor died ...
    """


class ShardUpdateError(RuntimeError):
    """A parameter-server shard's optimizer update raised for one step's push.

    The error is the step's own (TF2's application errors): raised by that step's
    :meth:`RemoteValue.fetch` and by :meth:`jreplicate.Replicator.join`, never retried on
    another worker. No shard applied any piece of the push (each ledger counts it as
    ``failed``), the shards' parameters and optimizer state are as before it, the workers
    stay alive and the other steps run. The optax transformation the shards apply to
    their pieces of the parameters raised: fix it, or the gradients the step pushes.

    Attributes:
      shard: the shard whose update raised.
      step_id: the step whose push it was.
      error_type, error_message: the original exception's type name and message (for an
        exception raised in a host callback, the one the callback raised).

    Example (the transformation rejects a gradient above 50):
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jreplicate as jr
      >>> def check(g):
      ...     top = max(float(np.max(x)) for x in jax.tree.leaves(g))
      ...     if top > 50:
      ...         raise ValueError(f"gradient too large: {top}")
      >>> def update(g, state, params=None):
      ...     jax.debug.callback(check, g)
      ...     return jax.tree.map(lambda x: -0.5 * x, g), state
      >>> checked_sgd = optax.GradientTransformation(lambda p: optax.EmptyState(), update)
      >>> ps = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, tx = jnp.zeros(2), jr.ps.pushable(checked_sgd)
      ...     state = tx.init(params)
      >>> def step(ctx, g, params, state):
      ...     tx.update(g, state, params)
      >>> good = rep.run(step, np.ones(2, np.float32), params, state)
      >>> bad = rep.run(step, np.full(2, 99, np.float32), params, state)
      >>> try:
      ...     rep.join()
      ... except jr.ps.ShardUpdateError as e:
      ...     print(e.shard, e.step_id, e.error_type, e.error_message)
      0 1 ValueError gradient too large: 99.0
      >>> ps.parameters().tolist(), ps.ledger()[0]["failed"]  # only the good push applied
      ([-0.5, -0.5], 1)
      >>> ps.shutdown()
    """

    def __init__(self, shard: int, step_id: int, error_type: str, error_message: str):
        super().__init__(
            f"parameter-server shard {shard}'s optimizer update raised for the push of "
            f"step {step_id}: {error_type}: {error_message}. No shard applied that push "
            "(each ledger counts it as failed) and it is not retried; the workers and "
            "the other steps go on. The optax transformation the shards apply to their "
            "pieces of the parameters (the tx of jr.ps.pushable(tx)) raised: fix it, or "
            "the gradients the step pushes.")
        self.shard, self.step_id = shard, step_id
        self.error_type, self.error_message = error_type, error_message

    @classmethod
    def of(cls, error: BaseException, *, shard: int, step_id: int) -> ShardUpdateError:
        """The error for ``error``, raised by shard ``shard``'s update of ``step_id``'s
        push (a host callback's exception, which JAX reports as a runtime error with the
        callback's traceback, is named by the callback's own type and message)."""
        return cls(shard, step_id, *original_error(error))

    def __reduce__(self):  # crosses Ray with its fields (the original may not pickle)
        return (ShardUpdateError, (self.shard, self.step_id, self.error_type,
                                   self.error_message))


#: A traceback's last line: ``ValueError: message`` (module-qualified names too).
_RAISED = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)): (.*)$")


def original_error(error: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of ``error``, or of the exception a host callback raised
    when ``error`` is JAX's runtime error carrying the callback's traceback."""
    kind, message = type(error).__name__, str(error)
    if "Traceback (most recent call last)" in message:
        for line in reversed(message.strip().splitlines()):
            m = _RAISED.match(line)
            if m:
                return m.group(1).rpartition(".")[2], m.group(2)
    return kind, message


class StepCancelledError(RuntimeError):
    """The step was not applied: training stopped first (an error, or shutdown).

    Raised by :meth:`RemoteValue.fetch` of a step that was scheduled but not applied:

    * another step raised first (TensorFlow's ``CancelledError``): the steps still
      queued are not run; a step already running on the embedded carrier finishes
      computing and its push is refused (one already pushing is applied and returns
      its outputs; on the Ray carrier running steps finish and push);
    * the strategy was shut down before it ran, or while it ran;
    * token-gated training cannot go on (``join`` cancels the token waits).

    In every case no shard applied the step's push (its id is skipped in the ledgers).

    Example (the strategy shuts down with steps still queued):
      >>> import time, jax.numpy as jnp, optax, jreplicate as jr
      >>> ps = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, sgd = jnp.ones(2), jr.ps.pushable(optax.sgd(0.5))
      ...     state = sgd.init(params)
      >>> def slow(ctx, params, state):
      ...     time.sleep(0.2)
      ...     sgd.update(jnp.ones(2), state, params)
      >>> futures = [rep.run(slow, None, params, state) for _ in range(4)]
      >>> ps.shutdown()
      >>> try:
      ...     futures[-1].fetch()
      ... except jr.ps.StepCancelledError as e:
      ...     print(e)
      the strategy shut down before this step ran
    """


class HostKey:
    """A typed PRNG key array (``jax.random.key``) on the host: NumPy cannot hold the
    key itself, so a worker sends its key data and implementation, and
    :meth:`RemoteValue.fetch` makes the key again (:func:`fetched`)."""

    __slots__ = ("data", "impl")

    def __init__(self, data: np.ndarray, impl: Any):
        self.data, self.impl = data, impl

    def __reduce__(self):
        return (HostKey, (self.data, self.impl))


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def to_host(x: Any, *, copy: bool = False) -> Any:
    """An output leaf on the host: a NumPy array (a copy with ``copy``), or a
    :class:`HostKey` for a typed key array (its data always copied)."""
    if isinstance(x, PerReplica):
        x = x.array
    if isinstance(x, HostKey):  # (copied to the host before)
        return x
    if is_key(x):
        return HostKey(np.array(jax.random.key_data(x)), jax.random.key_impl(x))
    return np.array(x) if copy else np.asarray(x)


def fetched(x: Any) -> Any:
    """What :meth:`RemoteValue.fetch` returns for an output leaf: a NumPy array, or a
    typed key array (on JAX's default device) for a typed key."""
    if not isinstance(x, HostKey):
        x = to_host(x)
    if isinstance(x, HostKey):
        return jax.random.wrap_key_data(x.data, impl=x.impl)
    return x


class RemoteValue:
    """The future result of a step scheduled by :meth:`jreplicate.Replicator.run` under
    :class:`jreplicate.ParameterServerStrategy`.

    Attributes:
      step_id: the scheduled step's id (also the id of its push).
      worker: the worker that ran it (None until it has run).

    Example (the step returns its loss; the value is a future of it):
      >>> import jax.numpy as jnp, optax, jreplicate as jr
      >>> ps = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, sgd = jnp.ones(3), jr.ps.pushable(optax.sgd(0.1))
      ...     state = sgd.init(params)
      >>> def loss_step(ctx, params, state):
      ...     sgd.update(2 * params, state, params)  # the gradient of sum(params**2)
      ...     return jnp.sum(params ** 2)
      >>> loss = rep.run(loss_step, None, params, state)  # scheduled: returns at once
      >>> float(loss.fetch()), loss.step_id  # waits for the step
      (3.0, 0)
      >>> rep.join()
      >>> ps.parameters().tolist()  # 1 - 0.1 * 2, applied by the shard
      [0.800000011920929, 0.800000011920929, 0.800000011920929]
      >>> ps.shutdown()
    """

    def __init__(self, step_id: int):
        self.step_id = step_id
        self.worker: int | None = None
        self.attempts = 0
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the step finished (successfully or not)."""
        return self._done.is_set()

    def fetch(self, timeout: float | None = None) -> Any:
        """Waits for the step and returns its outputs as numpy arrays (a
        :class:`jreplicate.PerReplica` leaf of a sync group becomes ``[group, ...]``;
        a typed PRNG key array, which NumPy cannot hold, comes back as a key array on
        JAX's default device).

        Args:
          timeout: seconds to wait at most (None: until the step finishes, which the
            strategy bounds: failed workers are replaced, a lost shard fails every step).

        Raises:
          TimeoutError: ``timeout`` passed first.
          Exception: the step's error (the function raised, or the step was cancelled).
        """
        start = time.monotonic()
        if not self._done.wait(timeout):
            raise TimeoutError(f"RemoteValue.fetch: step {self.step_id} did not finish "
                               f"within {timeout} s; call rep.join() to wait for all steps.")
        if self._error is not None:
            raise self._error
        value = self._value  # read once: another thread's fetch may replace it
        if hasattr(value, "resolve"):  # Ray: outputs still held by the worker
            left = None if timeout is None else timeout - (time.monotonic() - start)
            self._value = value = value.resolve(left)
        return jax.tree.map(fetched, value, is_leaf=lambda x: isinstance(x, PerReplica))

    get = fetch

    def _set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"RemoteValue(step {self.step_id}, {state}, worker={self.worker})"
