"""Fault injection for tests and benchmarks of :class:`jreplicate.ParameterServerStrategy`.

These functions kill workers and shards and slow workers down, to test what a
training job does when that happens in production. They are not part of training:
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

from jreplicate.ps.executor import ParameterServerExecutor
from jreplicate.strategies.parameter_server import ParameterServerStrategy

__all__ = ["kill_shard", "kill_worker", "set_worker_delay"]


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
