"""ParameterServerStrategy across shards: token-gated training equals single-shard
training under push-time kills, bounded staleness bounds staleness, a slow token take
is not starvation (true starvation: test_ps_sync_and_faults.py), snapshots are
consistent (embedded carrier)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.client import ShardClient
from jreplicate.ps.faults import FaultPlan
from jreplicate.ps.placement import place_parameters
from jreplicate.ps.shard import PSShard, TokenTimeoutError, _sync_state
from jreplicate.sync.state import take_token as real_take
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_embedded import _linear

LR = 0.1


def _loss(w):
    # Every leaf's gradient depends on the others: a worker that pulled shard 0 at one
    # step and shard 1 at another computes a different gradient.
    return jnp.sum((w["a"] * w["b"] + w["c"] - 1.0) ** 2) + 0.1 * jnp.sum(w["a"] ** 2)


def _w0():
    return {"a": jnp.linspace(0.5, 1.5, 4), "b": jnp.linspace(-1.0, 1.0, 4),
            "c": jnp.zeros(4)}


def _reference(steps):
    """Single-shard token-gated training: every accepted gradient of global step s is
    computed from step s's parameters, so each update is one gradient step."""
    w, grad = _w0(), jax.jit(jax.grad(_loss))
    for _ in range(steps):
        w = jax.tree.map(lambda p, g: p - LR * g, w, grad(w))
    return w


def _coupled(**kw):
    s = jr.ParameterServerStrategy(num_ps=3, num_workers=3, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = _w0()
        tx = jr.ps.pushable(jr.sync_replicas(optax.sgd(LR), replicas_to_aggregate=2,
                                          total_num_replicas=3))
        opt = tx.init(w)

    def step(ctx, w, opt):
        u, opt = tx.update(jax.grad(_loss)(w), opt, w)
        return optax.apply_updates(w, u), opt

    return s, rep, w, opt, step


def _assert_shards_agree(s):
    gs = s.global_step
    assert [s._executor.shard_step(i) for i in range(s.num_ps)] == [gs] * s.num_ps
    ledgers = [{k: v for k, v in led.items() if k != "staleness"} for led in s.ledger()]
    assert all(led == ledgers[0] for led in ledgers), ledgers
    for led in ledgers:
        assert led["pushes"] == led["applied"] + led["stale"] + led["backup"] + \
            led["duplicate"]
    return gs


@pytest.mark.parametrize("seed", range(4))
def test_token_gated_shards_equal_single_shard_training_under_push_kills(seed):
    """3 shards (one leaf each), 2 of 3 gradients per step (a backup), random delays,
    a worker killed between its push to shard 0 and the others at a random point: the
    parameters are those of single-shard training after the same number of steps."""
    rng = np.random.default_rng(seed)
    s, rep, w, opt, step = _coupled(max_worker_restarts=0)
    assert s.placement.assignment == [0, 1, 2]
    for k in range(3):
        jrt.set_worker_delay(s, k, float(rng.uniform(0.0, 0.02)))
    values = [rep.run(step, None, w, opt) for _ in range(24)]
    kill_after, victim = int(rng.integers(2, 12)), int(rng.integers(0, 3))
    end = time.monotonic() + 60
    while s.stats()["completed"] < kill_after and time.monotonic() < end:
        time.sleep(0.002)
    jrt.kill_worker(s, victim, when="push")
    rep.join()
    st = s.stats()
    assert all(v.done() for v in values) and st["completed"] == 24
    assert st["alive"][victim] is False and st["rescheduled"] == 1, st
    gs = _assert_shards_agree(s)
    assert gs >= 5
    ref = _reference(gs)
    for k, v in s.parameters().items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    s.shutdown()


def test_a_worker_lost_mid_push_holds_the_tokens_until_every_shard_has_the_step():
    """Shard 0 accepts (and completes step 0 with) a push whose worker dies before the
    other shard gets it: no token of step 1 is handed out while shard 1 is at step 0;
    settling the push (what the coordinator does for a lost worker) commits the pieces
    the worker staged, and the rerun of the step is a duplicate everywhere."""
    tx = jr.sync_replicas(optax.sgd(1.0), replicas_to_aggregate=1, total_num_replicas=1)
    params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    pl = place_parameters(params, 2)
    shards = [PSShard(i, pl.split(params)[i], tx, num_shards=2) for i in range(2)]

    faults = FaultPlan()
    faults.kill(0, "push")  # worker 0 dies between shard 0 and shard 1
    client = ShardClient(shards, pl, token_gated=True, faults=faults)
    grads = {"a": np.ones(2, np.float32), "b": np.full(2, 2.0, np.float32)}
    with pytest.raises(jr.ps.WorkerLostError, match="after pushing to shard 0"):
        client.push(0, 0, [0], grads, attempt=1)
    assert (shards[0].step, shards[1].step) == (1, 0)
    assert not shards[0].takeable()
    with pytest.raises(TokenTimeoutError):
        shards[0].take_token(time.monotonic() + 0.2)
    client.settle(0)
    assert shards[1].step == 1 and shards[0].takeable()
    assert shards[0].take_token(time.monotonic() + 1) == 1
    rerun = {"a": np.full(2, 5.0, np.float32), "b": np.full(2, 5.0, np.float32)}
    d = client.push(0, 1, [1], rerun, attempt=2)
    assert d.duplicate and d.kind == "applied" and d.step == 0
    np.testing.assert_array_equal(client.pull()[1]["a"], [-1.0, -1.0])
    np.testing.assert_array_equal(client.pull()[1]["b"], [-2.0, -2.0])
    for sh in shards:
        assert sh.ledger.counts == {"applied": 1, "stale": 0, "backup": 0, "duplicate": 1,
                                    "failed": 0}


@pytest.mark.parametrize("tau", [0, 1, 3])
def test_max_staleness_bounds_the_staleness_of_every_applied_update(tau):
    """4 workers, one a 10x straggler: no shard applies an update more than tau updates
    stale (tau = 0: sequential); workers wait instead of pushing stale gradients."""
    s, rep, w, opt, step = _linear(num_workers=4, max_staleness=tau)
    for k in range(4):
        jrt.set_worker_delay(s, k, 0.005)
    jrt.set_worker_delay(s, 3, 0.05)
    for _ in range(24):
        rep.run(step, None, w, opt)
    rep.join()
    st = s.stats()
    assert st["completed"] == 24 and st["max_alongside"] <= tau
    for led in s.ledger():
        assert led["applied"] == 24 and led["stale"] == 0, led
        assert max(led["staleness"]) <= tau, led["staleness"]
        if tau == 0:
            assert led["staleness"] == {0: 24}
    np.testing.assert_allclose(s.parameters()["b"], np.full(3, -12.0))
    s.shutdown()


def test_a_push_staler_than_max_staleness_is_dropped_and_counted():
    """The shard guarantees the bound whatever reaches it."""
    sh = PSShard(0, {"0": np.zeros(2, np.float32)}, optax.sgd(1.0), max_staleness=1)
    for pid in range(3):
        assert sh.push(pid, 0, pid, {"0": np.ones(2, np.float32)}).kind == "applied"
    assert sh.push(3, 1, 1, {"0": np.ones(2, np.float32)}).kind == "stale"  # 2 stale
    assert sh.ledger.counts["stale"] == 1 and dict(sh.ledger.staleness) == {0: 3}
    np.testing.assert_array_equal(sh.pull()[1]["0"], [-3.0, -3.0])


def _token_gated(num_ps=2, **kw):
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=2, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"a": jnp.zeros(4), "b": jnp.zeros(4)}
        tx = jr.ps.pushable(jr.sync_replicas(optax.sgd(0.1), replicas_to_aggregate=2,
                                          total_num_replicas=2))
        opt = tx.init(w)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w["a"]) + jnp.sum(w["b"]))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    for k in range(2):
        jrt.set_worker_delay(s, k, 0.01)
    return s, rep, w, opt, step


def test_a_slow_first_token_take_does_not_cancel_steps(monkeypatch):
    """The token queue's first use takes 1.5 s (as its compilation did under load):
    steps that take a token are not starving, and join lets them finish."""
    import jreplicate.ps.shard_update as shard_mod

    calls = []

    def slow_take(opt_state):
        if not calls:
            time.sleep(1.5)
        calls.append(1)
        return real_take(opt_state)

    monkeypatch.setattr(shard_mod, "take_token", slow_take)
    s, rep, w, opt, step = _token_gated()
    for _ in range(4):  # the last two take tokens with nothing else queued
        rep.run(step, None, w, opt)
    rep.join()
    for _ in range(4):
        rep.run(step, None, w, opt)
    rep.join()
    gs = s.global_step
    assert gs >= 3 and s.stats()["completed"] == 8 and calls
    np.testing.assert_allclose(s.parameters()["b"], np.full(4, -0.1 * gs), rtol=1e-6)
    s.shutdown()


def test_state_while_steps_are_scheduled_names_join():
    s, rep, w, opt, step = _linear(num_workers=2)
    for k in range(2):
        jrt.set_worker_delay(s, k, 0.05)
    for _ in range(6):
        rep.run(step, None, w, opt)
    with pytest.raises(RuntimeError, match=r"rep\.join\(\)"):
        s.state()
    rep.join()
    state = s.state()
    assert [int(sh["step"]) for sh in state["shards"]] == [6, 6]
    s.shutdown()


def test_a_snapshot_mid_step_restores_and_trains_on_exactly():
    """Snapshot with one accepted gradient of an incomplete step: every shard holds it
    in its accumulators (as its ledger says), so the restored job completes that step
    and trains on as one shard would."""
    s, rep, w, opt, step = _token_gated()
    for _ in range(6):
        rep.run(step, None, w, opt)
    rep.join()
    for _ in range(3):
        if int(_sync_state(s.state()["shards"][0]["opt_state"]).num_accumulated) == 1:
            break
        rep.run(step, None, w, opt)
        rep.join()
    state = s.state()
    acc = [int(_sync_state(sh["opt_state"]).num_accumulated) for sh in state["shards"]]
    assert acc == [1, 1]
    assert len({int(sh["step"]) for sh in state["shards"]}) == 1
    applied = [int(sh["ledger"]["counts"][0]) for sh in state["shards"]]
    assert applied[0] == applied[1] == 2 * int(state["shards"][0]["step"]) + 1
    s.shutdown()

    s2, rep2, w2, opt2, step2 = _token_gated()
    s2.restore(state)
    for _ in range(6):
        rep2.run(step2, None, w2, opt2)
    rep2.join()
    gs = _assert_shards_agree(s2)
    assert gs > int(state["shards"][0]["step"])
    for v in s2.parameters().values():
        np.testing.assert_allclose(v, np.full(4, -0.1 * gs), rtol=1e-5)
    s2.shutdown()
