"""Shared by the ParameterServerStrategy tests: every test is bounded in time, and the
small jobs and fault scenarios several files build."""

import faulthandler
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt

#: Seconds a parameter-server test may take before the process dumps every thread's
#: stack and exits (a hang fails CI with the stacks instead of waiting forever).
TEST_BOUND_S = 180


@pytest.fixture(autouse=True)
def bounded_test():
    faulthandler.dump_traceback_later(TEST_BOUND_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def sgd_job(sizes: Any, *, lr: float = 0.5, inner: Any = None, **strategy_kw: Any
            ) -> tuple:
    """A ``ParameterServerStrategy(**strategy_kw)`` whose parameters, zeros of
    ``sizes`` (a length, or a pytree of lengths), are registered with a pushable
    ``inner`` (default ``optax.sgd(lr)``). Returns ``(strategy, rep, params,
    opt_state, tx)``."""
    s = jr.ParameterServerStrategy(**strategy_kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jax.tree.map(jnp.zeros, sizes)
        tx = jr.ps.pushable(optax.sgd(lr) if inner is None else inner)
        opt = tx.init(w)
    return s, rep, w, opt, tx


def linear_job(num_ps: int = 2, **strategy_kw: Any) -> tuple:
    """A strategy with params ``{"a": 2, "b": 3}``, a pushable ``sgd(0.5)`` and a step
    whose gradient is 1 for every parameter (outputs: new params, opt state, sum of
    ``a`` as pulled). Returns ``(strategy, rep, params, opt_state, step)``."""
    s, rep, w, opt, tx = sgd_job({"a": 2, "b": 3}, num_ps=num_ps, **strategy_kw)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w["a"] - 1.0) + jnp.sum(w["b"]))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt, jnp.sum(w["a"])

    return s, rep, w, opt, step


def run_with_a_dead_worker(job: tuple, steps: int = 20, bound_s: float = 30.0
                           ) -> dict[str, Any]:
    """Three workers slowed a little, worker 2 killed while computing its next step,
    ``steps`` steps run; returns ``stats()`` after a join that must end within
    ``bound_s`` (the others do not wait for the dead worker)."""
    s, rep, w, opt, step = job
    for k in range(3):
        jrt.set_worker_delay(s, k, 0.005)
    jrt.kill_worker(s, 2, when="compute")
    for _ in range(steps):
        rep.run(step, None, w, opt)
    t0 = time.monotonic()
    s._executor.coordinator.join(timeout=bound_s)
    assert time.monotonic() - t0 < bound_s
    return s.stats()


def assert_every_step_ends(values: list, timeout: float) -> None:
    """Each RemoteValue of ``values`` ends within ``timeout`` seconds, with its outputs
    or a named error (after a shutdown: ``StepCancelledError`` or ``RuntimeError``)."""
    for v in values:
        try:
            v.fetch(timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"step {v.step_id} never ended after shutdown") from None
        except (jr.ps.StepCancelledError, RuntimeError):
            pass
