"""The Ray carrier's hot path: two steps in flight per worker actor, pushes that return
the parameters the next step starts from, outputs held on the workers until fetched.

Checked against the embedded carrier (which pulls before every step and returns its
outputs at once) on a deterministic schedule, and under a killed worker.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import _job, local_ray  # noqa: F401 (local_ray: one Ray)

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")


def _adam_job(carrier, num_workers=1, **kw):
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=num_workers, carrier=carrier,
                                   placement="round_robin", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"a": jnp.linspace(-1.0, 1.0, 8), "b": jnp.full((8, 3), 0.5)}
        tx = jr.ps.pushable(optax.adam(0.05))
        opt = tx.init(w)

    def step(ctx, w, opt):
        loss, g = jax.value_and_grad(
            lambda w: jnp.sum((w["b"].T @ w["a"] - 1.0) ** 2))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), loss

    return s, rep, w, opt, step


@pytest.mark.usefixtures("local_ray")
def test_lazily_fetched_outputs_and_staleness_equal_the_embedded_carrier():
    """One worker: each step starts from the parameters after the previous update, on
    Ray from what the previous push returned (its step was queued behind it), on the
    embedded carrier from a pull. Outputs fetched from the worker afterwards, the
    staleness histograms (all 0) and the final parameters are the same."""
    runs = {}
    for carrier in ("ray", "embedded"):
        s, rep, w, opt, step = _adam_job(carrier)
        values = [rep.run(step, None, w, opt) for _ in range(12)]
        rep.join()
        if carrier == "ray":
            assert s._executor._carrier.depth == 2  # pipelined
        runs[carrier] = ([v.fetch() for v in values], s.ledger(), s.parameters())
        s.shutdown()
    (ray_out, ray_led, ray_p), (emb_out, emb_led, emb_p) = runs["ray"], runs["embedded"]
    for k, (a, b) in enumerate(zip(ray_out, emb_out)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")
    assert [led["staleness"] for led in ray_led] == [led["staleness"] for led in emb_led] \
        == [{0: 12}, {0: 12}]
    for x, y in zip(jax.tree.leaves(ray_p), jax.tree.leaves(emb_p)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def _held(s) -> list[int]:
    carrier = s._executor._carrier
    return [len(ray.get(a.held_steps.remote(), timeout=60)) for a in carrier.workers]


@pytest.mark.usefixtures("local_ray")
def test_dropped_values_let_go_of_the_outputs_their_workers_hold():
    """Steps whose outputs are 4 MiB: a loop that keeps no RemoteValue leaves at most
    the last few outputs on the worker (before: all 40, in Ray's object store); kept
    values hold theirs until dropped; fetch after the worker holding them is lost names
    it."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier="ray")
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros((1024, 1024))
        tx = jr.ps.pushable(optax.sgd(0.01))
        opt = tx.init(w)

    def step(ctx, w, opt):
        u, opt = tx.update(jnp.ones_like(w), opt, w)
        return optax.apply_updates(w, u), w[0, :4]

    for _ in range(40):
        rep.run(step, None, w, opt)  # values dropped at once
    rep.join()
    assert sum(_held(s)) <= 3, _held(s)  # the last steps (their drops not sent yet)
    kept = [rep.run(step, None, w, opt) for _ in range(10)]
    rep.join()
    assert sum(_held(s)) >= 10
    np.testing.assert_allclose(kept[-1].fetch()[1], np.full(4, -0.01 * 49), rtol=1e-5)
    del kept
    for _ in range(8):
        rep.run(step, None, w, opt)
    rep.join()
    assert sum(_held(s)) <= 3, _held(s)
    v = rep.run(step, None, w, opt)
    rep.join()
    jrt.kill_worker(s, v.worker, when="process")
    with pytest.raises(jr.ps.WorkerLostError, match=f"held by worker {v.worker}"):
        v.fetch()
    s.shutdown()


@pytest.mark.usefixtures("local_ray")
def test_pipelined_steps_run_exactly_once_when_a_ray_worker_dies():
    """Three workers, two steps in flight each, one worker dying in a step: every step
    applied exactly once (no duplicate: the step queued behind the fatal one never ran
    there), the fatal step tried twice, every other step once."""
    s, rep, w, opt, step = _job(lambda: optax.sgd(0.01), num_workers=3)  # gradient 1
    for k in range(3):
        jrt.set_worker_delay(s, k, 0.01)
    values = [rep.run(step, None, w, opt) for _ in range(6)]
    rep.join()
    # Armed while idle (a call to a busy actor waits behind its steps): worker 1 dies in
    # its next step, and the one started behind it never runs there.
    jrt.kill_worker(s, 1, when="compute")
    values += [rep.run(step, None, w, opt) for _ in range(24)]
    rep.join()
    st = s.stats()
    assert st["completed"] == 30 and all(v.done() for v in values)
    assert sorted(v.attempts for v in values) == [1] * 29 + [2], \
        [(v.step_id, v.attempts) for v in values]
    assert st["rescheduled"] == 2, st  # the fatal step and the one queued behind it
    for led in s.ledger():
        assert (led["applied"], led["duplicate"], led["stale"]) == (30, 0, 0), led
    np.testing.assert_allclose(s.parameters(), np.full(4, -0.01 * 30), rtol=1e-5)
    s.shutdown()
