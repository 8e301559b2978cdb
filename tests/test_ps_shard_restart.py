"""ParameterServerStrategy.restart_shard: a lost shard brought back from a saved state
(issue 18 item 8). The embedded carrier here; tests/test_ps_ray.py runs the same
scenario on Ray."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

LR = 0.1
GRAD = {"a": 1.0, "b": 2.0}  # the loss is linear: every applied update adds -LR * GRAD


def _job(carrier, **kw):
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, carrier=carrier, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(params)

    def step(ctx, p, opt):
        g = jax.grad(lambda p: GRAD["a"] * jnp.sum(p["a"]) + GRAD["b"] * jnp.sum(p["b"]))(p)
        u, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, u), opt

    return s, rep, params, opt, step


def _run(rep, step, params, opt, n):
    return [rep.run(step, None, params, opt) for _ in range(n)]


def shard_restart_scenario(carrier: str) -> None:
    """8 steps, save, 5 steps, shard 1 lost, 3 steps fail, restart shard 1 from the
    save, 4 steps: each shard's parameters are what its ledger says it applied, the
    restarted shard holds the saved updates plus the new ones, and the report names the
    updates it lost (ids 8-12, and those of the failed steps shard 0 applied)."""
    s, rep, params, opt, step = _job(carrier)
    lost = s.placement.shard_of("['b']")
    live = 1 - lost
    _run(rep, step, params, opt, 8)
    rep.join()
    saved = s.state()
    _run(rep, step, params, opt, 5)
    rep.join()
    jrt.kill_shard(s, lost)
    _run(rep, step, params, opt, 3)
    with pytest.raises(jr.ps.ParameterServerError, match="restart_shard"):
        rep.join()
    with pytest.raises(jr.ps.ParameterServerError):  # stopped until the shard is back
        rep.run(step, None, params, opt)
    if carrier == "ray":  # the lost shard's actor cannot answer: a named error
        with pytest.raises(jr.ps.ParameterServerError, match=f"restart_shard\\({lost}, state"):
            s.ledger()
    report = s.restart_shard(lost, saved)
    applied_live = s.ledger()[live]["applied"]
    assert 13 <= applied_live <= 16
    assert (report.shard, report.step) == (lost, 8)
    # Lost: 8-12 and the failed steps (13-15) whose push reached the live shard.
    assert set(range(8, 13)) <= set(report.lost) <= set(range(8, 16))
    assert len(report.lost) == applied_live - 8 and list(report.lost) == sorted(report.lost)
    _run(rep, step, params, opt, 4)
    rep.join()
    ledger = s.ledger()
    for led in ledger:
        assert led["pushes"] == led["applied"] + led["stale"] + led["backup"] + \
            led["duplicate"], led
    assert ledger[lost]["applied"] == 8 + 4
    assert ledger[live]["applied"] == applied_live + 4
    got = s.parameters()
    # The restarted shard: the saved parameters plus the 4 later updates.
    saved_b = saved["shards"][lost]["params"]["1"]  # leaf 1, "b"
    np.testing.assert_allclose(got["b"], saved_b - 4 * LR * GRAD["b"], rtol=1e-6)
    np.testing.assert_allclose(got["b"], np.full(2, -12 * LR * GRAD["b"]), rtol=1e-6)
    np.testing.assert_allclose(got["a"], np.full(3, -(applied_live + 4) * LR * GRAD["a"]),
                               rtol=1e-6)
    s.shutdown()


def test_a_lost_shard_restarted_from_a_saved_state():
    shard_restart_scenario("embedded")


def test_restart_shard_refuses_what_it_cannot_do_honestly():
    s, rep, params, opt, step = _job("embedded")
    _run(rep, step, params, opt, 2)
    rep.join()
    state = s.state()
    with pytest.raises(ValueError, match=r"not in \[0, 2\)"):
        s.restart_shard(2, state)
    bad = {**state, "shards": [state["shards"][0], {
        **state["shards"][1], "params": {"1": np.zeros(3, np.float32)}}]}
    with pytest.raises(ValueError, match=r"piece '1' is float32\[3\] in the state"):
        s.restart_shard(1, bad)
    with pytest.raises(ValueError, match="same num_ps"):
        s.restart_shard(0, {**state, "shards": state["shards"][:1]})
    s.shutdown()
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(4)
        jr.ps.pushable(jr.sync_replicas(optax.sgd(0.1), replicas_to_aggregate=2,
                                     total_num_replicas=2)).init(w)
    with pytest.raises(ValueError, match=r"token-gated .* strategy.restore\(state\)"):
        s.restart_shard(1, s.state())
    s.shutdown()
