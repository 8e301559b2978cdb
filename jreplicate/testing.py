"""Fault injection for tests and benchmarks of :class:`jreplicate.ParameterServerStrategy`
and of :class:`jreplicate.CheckpointManager`'s background writes.

These functions kill workers and shards and slow workers down, or make a checkpoint
write fail or take longer, to test what a training job does when that happens in
production. They are not part of training:
they live here, not on the strategy: each updates the fault plan the strategy's carrier
was built with (``jreplicate.ps.faults.FaultPlan``, which the workers consult at
named points; on Ray each worker actor is sent its part), or kills a shard or a Ray
actor at once.

Example:
  >>> import jreplicate as jr
  >>> import jreplicate.testing as jrt
  >>> import jax.numpy as jnp, optax
  >>> strategy = jr.ParameterServerStrategy(num_ps=2, num_workers=4)
  >>> rep = jr.Replicator(strategy)
  >>> with rep.scope():
  ...     params = {"w": jnp.zeros(4), "b": jnp.zeros(2)}
  ...     opt_state = jr.ps.pushable(optax.sgd(0.1)).init(params)
  >>> jrt.set_worker_delay(strategy, 3, 0.05)      # worker 3 is a straggler
  >>> jrt.kill_worker(strategy, 1, when="push")    # dies between two shards' pushes
  >>> jrt.kill_worker(jr.MirroredStrategy(), 0)
  Traceback (most recent call last):
  TypeError: jreplicate.testing: strategy must be a ParameterServerStrategy, got MirroredStrategy.
"""

from __future__ import annotations

import errno
import threading

from jreplicate.checkpoint.manager import CheckpointManager
from jreplicate.ps.executor import ParameterServerExecutor
from jreplicate.strategies.parameter_server import ParameterServerStrategy

__all__ = ["delay_checkpoint_write", "fail_checkpoint_write", "kill_shard", "kill_worker",
           "set_worker_delay"]


def _executor(strategy: ParameterServerStrategy) -> ParameterServerExecutor:
    if not isinstance(strategy, ParameterServerStrategy):
        raise TypeError(f"jreplicate.testing: strategy must be a ParameterServerStrategy, "
                        f"got {type(strategy).__name__}.")
    return strategy._ex()


def kill_worker(strategy: ParameterServerStrategy, worker: int, *,
                when: str = "compute") -> None:
    """Worker ``worker`` dies during its next step.

    Args:
      strategy: the :class:`jreplicate.ParameterServerStrategy` (its parameters created).
      worker: the worker index, in ``[0, strategy.num_workers)``.
      when: ``"compute"`` (after computing its gradients), ``"push"`` (between its pushes
        to shard 0 and shard 1; with one shard, right after its push); with the
        embedded carrier a new worker then takes its place, up to
        ``max_worker_restarts`` times (default: every time; on Ray these two lose the
        worker for good); or with
        ``carrier="ray"``: ``"process"`` (its actor is killed now with ``ray.kill``,
        for good) or ``"crash"`` (its process is killed
        now, as by a crash or the OOM killer; Ray restarts the actor, up to
        ``max_restarts`` of ``ray_worker_options``, and it takes steps again).

    Raises:
      ValueError: ``worker`` is out of range or ``when`` is not one of the above.

    Example (worker 1 dies for good; its step runs again on worker 0, applied once):
      >>> import jax.numpy as jnp, optax, jreplicate as jr
      >>> ps = jr.ParameterServerStrategy(num_ps=1, num_workers=2, max_worker_restarts=0)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, sgd = jnp.zeros(2), jr.ps.pushable(optax.sgd(1.0))
      ...     state = sgd.init(params)
      >>> step = lambda ctx, p, s: sgd.update(jnp.ones(2), s, p)
      >>> kill_worker(ps, 1)
      >>> for _ in range(4):
      ...     _ = rep.run(step, None, params, state)
      >>> rep.join()
      >>> ps.parameters().tolist(), ps.stats()["completed"], ps.stats()["alive"]
      ([-4.0, -4.0], 4, [True, False])
      >>> ps.shutdown()
    """
    _executor(strategy).kill_worker(worker, when)


def set_worker_delay(strategy: ParameterServerStrategy, worker: int,
                     seconds: float) -> None:
    """Worker ``worker`` spends ``seconds`` more on each step (a straggler).

    Raises:
      ValueError: ``worker`` is out of range, or ``seconds`` is negative (or NaN).

    Example (worker 1 is a straggler: worker 0 takes most steps):
      >>> import jax.numpy as jnp, optax, jreplicate as jr
      >>> ps = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, sgd = jnp.zeros(2), jr.ps.pushable(optax.sgd(1.0))
      ...     state = sgd.init(params)
      >>> step = lambda ctx, p, s: sgd.update(jnp.ones(2), s, p)
      >>> set_worker_delay(ps, 1, 0.2)
      >>> for _ in range(6):
      ...     _ = rep.run(step, None, params, state)
      >>> rep.join()
      >>> ps.parameters().tolist()
      [-6.0, -6.0]
      >>> ps.shutdown()
    """
    _executor(strategy).set_worker_delay(worker, seconds)


def kill_shard(strategy: ParameterServerStrategy, shard: int) -> None:
    """Shard ``shard`` is lost (its state is gone); steps that reach it fail.

    Raises:
      ValueError: ``shard`` is out of range.

    Example (shard 1 is lost: training stops with an error, restore a checkpoint):
      >>> import jax, jax.numpy as jnp, optax, jreplicate as jr
      >>> ps = jr.ParameterServerStrategy(num_ps=2, num_workers=2)
      >>> rep = jr.Replicator(ps)
      >>> with rep.scope():
      ...     params, sgd = {'a': jnp.zeros(2), 'b': jnp.zeros(2)}, jr.ps.pushable(optax.sgd(1.0))
      ...     state = sgd.init(params)
      >>> step = lambda ctx, p, s: sgd.update(jax.tree.map(jnp.ones_like, p), s, p)
      >>> kill_shard(ps, 1)
      >>> try:
      ...     rep.run(step, None, params, state).fetch()
      ... except jr.ps.ParameterServerError as e:
      ...     print("lost:", str(e)[:40])
      lost: ...
      >>> ps.shutdown()
    """
    _executor(strategy).kill_shard(shard)


def _writer(mngr: CheckpointManager, process: int | None, what: str):
    """The background writer of ``mngr`` on this process if ``process`` (None: every
    process) is this one; None on the other processes."""
    if not isinstance(mngr, CheckpointManager):
        raise TypeError(f"jreplicate.testing.{what}: mngr must be a CheckpointManager, got "
                        f"{type(mngr).__name__}.")
    strategy = mngr._strategy
    if process is not None and (isinstance(process, bool) or not isinstance(process, int)
                                or not 0 <= process < strategy.num_processes):
        raise ValueError(f"jreplicate.testing.{what}(process={process!r}): process must be "
                         f"an int in [0, {strategy.num_processes}).")
    if process is not None and process != strategy.process_index:
        return None
    writer = mngr._writer
    if writer is None or not (mngr.every_process_writes or strategy.process_index == 0):
        raise ValueError(f"jreplicate.testing.{what}: process {strategy.process_index} does "
                         "not write this manager's checkpoints (it is closed, or only the "
                         "chief writes).")
    return writer


def fail_checkpoint_write(mngr: CheckpointManager, *, process: int = 0,
                          error: BaseException | None = None) -> None:
    """The next checkpoint write of process ``process`` fails in the background.

    The data is written, then the write fails as a full disk would (``error``, default
    ``OSError(ENOSPC)``) before the checkpoint is committed. Call it on every process
    (the others ignore it). The failure surfaces as the same
    :class:`jreplicate.checkpoint.CheckpointError` on every process at the next
    ``save``, ``wait_until_finished``, ``close`` or ``restore_or_initialize``.

    Raises:
      ValueError: ``process`` is out of range, or does not write ``mngr``'s checkpoints.

    Example (the write of checkpoint 1 fails; it is never listed):
      >>> import tempfile, jax.numpy as jnp, jreplicate as jr
      >>> mngr = jr.CheckpointManager(tempfile.mkdtemp(), jr.MirroredStrategy())
      >>> fail_checkpoint_write(mngr)
      >>> mngr.save(1, {"w": jnp.ones(2)})
      True
      >>> try:
      ...     mngr.wait_until_finished()
      ... except jr.checkpoint.CheckpointError as e:
      ...     print(str(e).split(" (")[0])
      checkpoint 1 was not written: process 0 failed
      >>> mngr.complete_steps()
      []
      >>> mngr.close()
    """
    if error is None:
        error = OSError(errno.ENOSPC, "No space left on device (injected by "
                                      "jreplicate.testing.fail_checkpoint_write)")
    if not isinstance(error, BaseException):
        raise TypeError(f"jreplicate.testing.fail_checkpoint_write(error=...) must be an "
                        f"exception, got {type(error).__name__}.")
    writer = _writer(mngr, process, "fail_checkpoint_write")
    if writer is not None:
        def fail() -> None:
            raise error
        writer.handler.faults.append(fail)


def delay_checkpoint_write(mngr: CheckpointManager, until: float | threading.Event, *,
                           process: int | None = None) -> None:
    """The next checkpoint write of process ``process`` (None: every process) takes
    ``until`` seconds longer, or waits until the event ``until`` is set, before its
    commit: a slow file system, or a write held open by a test.

    Raises:
      ValueError: ``process`` is out of range, or does not write ``mngr``'s checkpoints,
        or ``until`` is a negative number.

    Example (``save`` returns while the write is held; it commits once released):
      >>> import tempfile, threading, jax.numpy as jnp, jreplicate as jr
      >>> mngr = jr.CheckpointManager(tempfile.mkdtemp(), jr.MirroredStrategy())
      >>> release = threading.Event()
      >>> delay_checkpoint_write(mngr, release)
      >>> mngr.save(1, {"w": jnp.ones(2)})
      True
      >>> mngr.complete_steps()
      []
      >>> release.set(); mngr.wait_until_finished(); mngr.complete_steps()
      [1]
      >>> mngr.close()
    """
    if isinstance(until, threading.Event):
        wait = until.wait
    elif isinstance(until, (int, float)) and not isinstance(until, bool) and until >= 0:
        wait = threading.Event().wait
        until = float(until)
    else:
        raise ValueError(f"jreplicate.testing.delay_checkpoint_write(until={until!r}) must "
                         "be seconds >= 0 or a threading.Event.")
    writer = _writer(mngr, process, "delay_checkpoint_write")
    if writer is not None:
        if isinstance(until, threading.Event):
            writer.handler.faults.insert(0, wait)
        else:
            writer.handler.faults.insert(0, lambda: wait(until))
