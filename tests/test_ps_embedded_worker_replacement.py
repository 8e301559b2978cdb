"""The embedded carrier replaces a lost worker (``max_worker_restarts``, as Ray's
``max_restarts`` restarts a worker actor): a new worker with the lost one's index takes
steps again, its ``PER_WORKER`` pipeline going on where the lost one left off; every
step is applied once and every element of every pipeline is applied once (checked
against a NumPy sum of the elements), up to the limit, after which the worker stays
lost."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.5
N = 18  # steps per job


def _job(num_ps=2, num_workers=3, per_pipeline=40, **kw):
    """A linear loss sum(w * x): its gradient is the batch, so the parameters are -LR
    times the sum of the elements applied. Element i of pipeline p is [p, i, 1, 0]."""
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(4)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)

    def input_fn(ctx):
        return [np.array([ctx.input_pipeline_id, i, 1, 0], np.float32)
                for i in range(per_pipeline)]

    def step(ctx, x, w, opt):
        g = jax.grad(lambda w: jr.compute_average_loss(jnp.sum(w * x)[None], 1))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt, x

    for k in range(num_workers):
        jrt.set_worker_delay(s, k, 0.004)
    return s, rep, w, opt, step, rep.prepare_input(input_fn)


def _run_killing(s, rep, w, opt, step, it, kills, steps=N):
    """At least ``steps`` steps; ``kills``: (after this many completed steps, worker,
    when), each armed once the worker is back from the previous kill (skipped if it is
    lost for good), with steps scheduled until it fired."""
    values = []
    coord = s._executor.coordinator

    def until(cond, seconds=30.0):
        end = time.monotonic() + seconds
        while not cond():
            assert time.monotonic() < end, "the job did not get there in time"
            time.sleep(0.002)

    for after, victim, when in kills:
        while len(values) < min(after + 2, steps):
            values.append(rep.run(step, it, w, opt))
        until(lambda a=after: s.stats()["completed"] >= min(a, len(values)))
        until(lambda v=victim: v not in coord._ends.replacing)  # back, or lost for good
        if not s.stats()["alive"][victim]:
            continue
        fired = s.stats()["rescheduled"] + 1
        jrt.kill_worker(s, victim, when=when)
        while s.stats()["rescheduled"] < fired:
            if coord.pending < 2:
                values.append(rep.run(step, it, w, opt))
            time.sleep(0.002)
            assert len(values) < 10 * steps, "the kill never fired"
    values += [rep.run(step, it, w, opt) for _ in range(steps - len(values))]
    rep.join()
    return values


def _pulled(s, it):
    """Per pipeline, the elements read from it: not those held for its next step (a
    dead step's, handed back to a replacement that has not run since)."""
    out = []
    for ws in s._executor._carrier.workers:
        pipe = ws.inputs._pipes.get(it._key)
        held = pipe is not None and pipe.held is not None
        out.append(ws.inputs.read_count.get(it._key, 0) - held)
    return out


def _outputs(values):
    """(pipeline, element index) of each completed step's batch, and the reruns'."""
    used = [tuple(int(a) for a in np.asarray(v.fetch()[2]).reshape(-1)[:2]) for v in values]
    reruns = [used[k] for k, v in enumerate(values) if v.attempts > 1]
    return used, reruns


def _elements_sum(pulled, minus=()):
    total = sum((np.array([p, i, 1, 0], np.float64) for p, n in enumerate(pulled)
                 for i in range(n)), np.zeros(4))
    for p, i in minus:
        total -= np.array([p, i, 1, 0])
    return total


@pytest.mark.parametrize("victim", [0, 2])
def test_a_worker_killed_computing_is_replaced_and_every_element_applied_once(victim):
    s, rep, w, opt, step, it = _job()
    original = s._executor._carrier.workers[victim]
    values = _run_killing(s, rep, w, opt, step, it, [(4, victim, "compute")])
    st = s.stats()
    assert st["alive"] == [True] * 3 and st["replaced"] == 1, st
    assert st["rescheduled"] == 1 and st["completed"] == len(values), st
    carrier = s._executor._carrier
    assert carrier.workers[victim] is not original and carrier.restarts[victim] == 1
    for led in s.ledger():
        assert led["applied"] == len(values) and led["duplicate"] == 0, led
    used, reruns = _outputs(values)
    pulled = _pulled(s, it)
    # Each pipeline's elements are used once, none skipped: the victim's replacement
    # read the element of the step its predecessor died in first, then went on.
    for p in range(3):
        assert sorted(i for q, i in used if q == p) == list(range(pulled[p])), (p, used)
    assert len(reruns) == 1
    np.testing.assert_allclose(s.parameters(), -LR * _elements_sum(pulled), rtol=1e-6)
    s.shutdown()


def test_a_worker_killed_after_its_push_is_replaced_and_no_element_applied_twice():
    """One shard: ``when="push"`` kills the worker after its push was applied. Its
    elements were applied (the replacement does not read them again); the rerun's
    push is a duplicate, so the rerun's element is consumed and not applied."""
    s, rep, w, opt, step, it = _job(num_ps=1)
    values = _run_killing(s, rep, w, opt, step, it, [(4, 1, "push")])
    st = s.stats()
    assert st["alive"] == [True] * 3 and st["replaced"] == 1 and st["completed"] == len(values)
    led = s.ledger()[0]
    assert led["applied"] == len(values) and led["duplicate"] == 1, led
    used, reruns = _outputs(values)
    pulled = _pulled(s, it)
    for p in range(3):
        mine = sorted(i for q, i in used if q == p)
        assert len(set(mine)) == len(mine)  # no element read twice
        missing = sorted(set(range(pulled[p])) - set(mine))
        assert len(missing) == (1 if p == 1 else 0), (p, missing)  # the dead step's
    [rerun] = reruns
    np.testing.assert_allclose(s.parameters(), -LR * _elements_sum(pulled, [rerun]),
                               rtol=1e-6)
    s.shutdown()


def test_the_limit_is_honoured_then_the_worker_stays_lost():
    s, rep, w, opt, step, it = _job(max_worker_restarts=1)
    values = _run_killing(s, rep, w, opt, step, it,
                          [(3, 1, "compute"), (9, 1, "compute")])
    st = s.stats()
    assert st["replaced"] == 1 and st["alive"] == [True, False, True], st
    assert st["rescheduled"] == 2 and st["completed"] == len(values)
    assert s._executor._carrier.restarts == [0, 1, 0]
    for led in s.ledger():
        assert led["applied"] == len(values) and led["duplicate"] == 0
    used, _ = _outputs(values)
    pulled = _pulled(s, it)
    # The second death's element is left in the lost worker's pipeline (as before).
    for p in (0, 2):
        assert sorted(i for q, i in used if q == p) == list(range(pulled[p]))
    mine = sorted(i for q, i in used if q == 1)
    assert mine == list(range(pulled[1] - 1))
    total = _elements_sum(pulled, [(1, pulled[1] - 1)])
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6)
    s.shutdown()


@pytest.mark.parametrize("seed", range(3))
def test_random_kills_at_compute_use_every_element_once(seed):
    """Random victims, kill points, shard counts and limits: every pipeline's elements
    are used once and applied once, every step once, and the replacements are those the
    limit allows."""
    rng = np.random.default_rng(seed)
    limit = int(rng.choice([-1, 1, 2]))
    s, rep, w, opt, step, it = _job(num_ps=int(rng.integers(1, 3)),
                                    max_worker_restarts=limit)
    kills = [(int(a), int(rng.integers(0, 3)), "compute")
             for a in sorted(rng.choice(np.arange(2, 14), 3, replace=False))]
    values = _run_killing(s, rep, w, opt, step, it, kills)
    st = s.stats()
    deaths = [0] * 3
    for _, v, _ in kills:  # a worker lost for good is not killed again
        deaths[v] += limit < 0 or deaths[v] <= limit
    allowed = [d if limit < 0 else min(d, limit) for d in deaths]
    assert s._executor._carrier.restarts == allowed, (kills, limit)
    assert st["replaced"] == sum(allowed) and st["completed"] == len(values)
    assert st["alive"] == [d == a for d, a in zip(deaths, allowed)], (st, kills)
    for led in s.ledger():
        assert led["applied"] == len(values) and led["duplicate"] == 0
    used, _ = _outputs(values)
    pulled = _pulled(s, it)
    lost = [(p, pulled[p] - 1) for p in range(3) if deaths[p] > allowed[p]]
    for p in range(3):
        mine = sorted(i for q, i in used if q == p)
        assert mine == list(range(pulled[p] - (1 if (p, pulled[p] - 1) in lost else 0)))
    np.testing.assert_allclose(s.parameters(), -LR * _elements_sum(pulled, lost),
                               rtol=1e-6)
    s.shutdown()


def test_no_restarts_keeps_todays_loss_for_good():
    s, rep, w, opt, step, it = _job(max_worker_restarts=0)
    values = _run_killing(s, rep, w, opt, step, it, [(3, 2, "compute")])
    st = s.stats()
    assert st["replaced"] == 0 and st["alive"] == [True, True, False]
    assert s.ledger()[0]["applied"] == len(values)
    s.shutdown()


def test_token_gated_with_a_backup_worker_replaces_workers_lost_at_compute_and_push():
    """2 of 3 gradients per update: workers killed mid-compute and between their pushes
    to two shards come back, take tokens again, and every update is one step."""
    s, rep, w, opt, tx = sgd_job(4, inner=jr.sync_replicas(
        optax.sgd(0.1), replicas_to_aggregate=2, total_num_replicas=3), num_ps=2,
        num_workers=3, token_timeout=30)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w))(w)  # 1 per element
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    for k in range(3):
        jrt.set_worker_delay(s, k, 0.004)
    for _ in range(6):
        rep.run(step, None, w, opt)
    rep.join()
    done_before = s.stats()["completed_by"]
    jrt.kill_worker(s, 1, when="compute")
    jrt.kill_worker(s, 2, when="push")
    for _ in range(24):
        rep.run(step, None, w, opt)
    rep.join()
    st = s.stats()
    assert st["replaced"] == 2 and st["alive"] == [True] * 3, st
    assert st["completed"] == 30
    assert all(a > b for a, b in zip(st["completed_by"][1:], done_before[1:])), st
    gs = s.global_step
    ledgers = s.ledger()
    for i, led in enumerate(ledgers):
        assert s._executor.shard_step(i) == gs
        assert led["pushes"] == led["applied"] + led["stale"] + led["backup"] + \
            led["duplicate"], led
        assert led["applied"] == ledgers[0]["applied"]
    # Each update averages two gradients of 1: the parameters moved 0.1 per update.
    np.testing.assert_allclose(s.parameters(), np.full(4, -0.1 * gs), rtol=1e-5)
    s.shutdown()


@pytest.mark.parametrize("bad", [-2, 1.5, True, "1"])
def test_max_worker_restarts_is_checked(bad):
    with pytest.raises(ValueError, match="max_worker_restarts"):
        jr.ParameterServerStrategy(num_ps=1, num_workers=1, max_worker_restarts=bad)


def test_max_worker_restarts_on_ray_names_ray_worker_options():
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match=r"ray_worker_options=\{'max_restarts': 2\}"):
        jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier="ray",
                                   max_worker_restarts=2)
