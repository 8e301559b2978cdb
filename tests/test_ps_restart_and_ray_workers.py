"""Ray pipelining, worker-held outputs, Ray options, worker restarts and restart_shard:
reproducers where the features meet.

Each confirmed defect's test is marked ``xfail(strict=True)`` with the defect in its
reason; the owners remove the mark with the fix. The unmarked tests pin behaviour that
was checked and found sound. Carrier-independent cases use the embedded carrier; the
Ray cases share one module-scoped Ray instance (tests/test_ps_ray.py's fixture).
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import local_ray  # noqa: F401 (one Ray for the module)


def _adam_job(num_ps=2, num_workers=2, carrier="embedded", **kw):
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, carrier=carrier,
                                   placement="round_robin", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
        tx = jr.ps.pushable(optax.adam(0.1))
        opt = tx.init(params)

    def step(ctx, p, opt):
        g = jax.grad(lambda p: jnp.sum(p["a"]) + 2.0 * jnp.sum(p["b"]))(p)
        u, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, u), opt

    return s, rep, params, opt, step


def _steps(rep, step, params, opt, n):
    vals = [rep.run(step, None, params, opt) for _ in range(n)]
    rep.join()
    return vals


def _with_shard(state, i, **piece):
    shards = list(state["shards"])
    shards[i] = {**shards[i], **piece}
    return {**state, "shards": shards}


# -- restart_shard(i, state) -------------------------------------------------------------

def test_restart_shard_with_a_mismatched_opt_state_is_an_error_that_loses_nothing():
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 3)
    state = s.state()
    bad = _with_shard(state, 1, opt_state=jax.tree.map(
        lambda x: np.zeros((7,), np.asarray(x).dtype) if np.asarray(x).ndim else x,
        state["shards"][1]["opt_state"]))
    try:
        with pytest.raises(ValueError, match=r"restart_shard\(1, state\).*opt_state"):
            s.restart_shard(1, bad)
    finally:
        # Whatever it raised, the shard it refused to replace still trains.
        before = s.ledger()[1]["applied"]
        _steps(rep, step, params, opt, 2)
        assert s.ledger()[1]["applied"] == before + 2
        s.shutdown()


def test_restart_shard_refuses_an_opt_state_of_another_dtype():
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 3)
    state = s.state()
    wide = _with_shard(state, 1, opt_state=jax.tree.map(
        lambda x: np.asarray(x, np.float64) if np.asarray(x).dtype == np.float32 else x,
        state["shards"][1]["opt_state"]))
    try:
        with pytest.raises(ValueError, match="float64"):
            s.restart_shard(1, wide)
    finally:
        s.shutdown()


def test_restart_shard_of_a_live_shard_is_refused():
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 3)
    state = s.state()
    _steps(rep, step, params, opt, 4)
    try:
        with pytest.raises((ValueError, RuntimeError), match="restore"):
            s.restart_shard(1, state)
    finally:
        s.shutdown()


def test_restart_shard_refuses_params_of_another_dtype_or_placement():
    """Sound: the params are checked (dtype, shape, keys) before anything is closed."""
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 2)
    state = s.state()
    p1 = state["shards"][1]["params"]
    wide = _with_shard(state, 1, params=jax.tree.map(lambda x: np.asarray(x, np.float64), p1))
    with pytest.raises(ValueError, match="float64"):
        s.restart_shard(1, wide)
    moved = _with_shard(state, 1, params=state["shards"][0]["params"])
    with pytest.raises(ValueError, match="same num_ps and placement"):
        s.restart_shard(1, moved)
    _steps(rep, step, params, opt, 2)  # nothing was closed
    assert [led["applied"] for led in s.ledger()] == [4, 4]
    s.shutdown()



def test_every_restarted_shard_reports_the_updates_it_lost():
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 3)
    state = s.state()
    _steps(rep, step, params, opt, 4)
    jrt.kill_shard(s, 0)
    jrt.kill_shard(s, 1)
    rep.run(step, None, params, opt)
    with pytest.raises(jr.ps.ParameterServerError):
        rep.join()
    try:
        reports = [s.restart_shard(i, state) for i in (0, 1)]
        assert [r.step for r in reports] == [3, 3]
        for r in reports:
            assert set(range(3, 7)) <= set(r.lost), reports
    finally:
        s.shutdown()



def test_restart_shard_refuses_a_state_from_a_later_timeline():
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 3)
    older = s.state()
    _steps(rep, step, params, opt, 4)
    later = s.state()
    s.restore(older)
    jrt.kill_shard(s, 1)
    rep.run(step, None, params, opt)
    with pytest.raises(jr.ps.ParameterServerError):
        rep.join()
    try:
        with pytest.raises(ValueError, match="restore"):
            s.restart_shard(1, later)
    finally:
        s.shutdown()

def test_a_batch_the_step_cannot_take_is_the_steps_error_not_every_workers_death():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(2)
        tx = jr.ps.pushable(optax.sgd(0.1))
        opt = tx.init(w)

    def step(ctx, b, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * b["x"]))(w), opt, w)
        return optax.apply_updates(w, u)

    it = rep.prepare_input(lambda ctx: [{"x": np.ones(2, np.float32), "name": np.array(
        "a.jpg")} for _ in range(4)], jr.InputReplicationMode.SINGLE)
    try:
        # (Read on the driver: the element check names the string leaf at once, in run;
        # before 2026-11-26 the worker's placement raised it, in join.)
        with pytest.raises(TypeError, match=r"\['name'\]"):
            rep.run(step, it, w, opt)
            rep.join()
        assert s.stats()["alive"] == [True, True]
    finally:
        s.shutdown()


def test_state_and_restart_shard_refuse_while_steps_are_in_flight():
    """Sound: state() and restart_shard() while steps are scheduled raise naming join."""
    s, rep, params, opt, step = _adam_job()
    jrt.set_worker_delay(s, 0, 0.2)
    jrt.set_worker_delay(s, 1, 0.2)
    _steps(rep, step, params, opt, 1)
    saved = s.state()
    for _ in range(4):
        rep.run(step, None, params, opt)
    with pytest.raises(RuntimeError, match="join"):
        s.state()
    with pytest.raises(RuntimeError, match="join"):
        s.restart_shard(1, saved)
    rep.join()
    assert [led["applied"] for led in s.ledger()] == [5, 5]
    s.shutdown()

# -- Ray: pipelined steps, outputs held on the workers, restarted workers ----------------

def _counting_job(num_workers, **kw):
    """SGD(lr=1). "a" (shard 0) and "b" (shard 1) have gradient -1: each counts the
    updates its shard applied, so the values a step returns say which step of each
    shard it started from. "c" (shard 0) has gradient x: it is -(sum of the batches
    applied)."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=num_workers, carrier="ray",
                                   placement="round_robin", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        p = {"a": jnp.zeros(1), "b": jnp.zeros(1), "c": jnp.zeros(2)}
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(p)

    def step(ctx, x, p, opt):
        g = jax.grad(lambda p: jnp.sum(p["c"] * x) - jnp.sum(p["a"]) - jnp.sum(p["b"]))(p)
        u, opt = tx.update(g, opt, p)
        return p["a"], p["b"], x

    def input_fn(ctx):
        return [np.array([ctx.input_pipeline_id, i], np.float32) for i in range(40)]

    return s, rep, p, opt, step, rep.prepare_input(input_fn)


@pytest.mark.usefixtures("local_ray")
def test_pipelined_staleness_and_per_worker_input_when_a_ray_worker_dies_mid_step():
    """Two Ray workers with uneven delays, two steps in flight each (the second starting
    from what the first push returned), reading their own pipelines; worker 1 dies
    computing a step.

    Staleness: shard i applies its k-th update at step k, so the sum of its recorded
    staleness is N(N-1)/2 - sum(the step of shard i each applied update started
    from), which is the value of shard i's counter the step returned. Equal: every
    recorded fetched_step is the step of the parameters the step used (pulled or
    returned by the previous push). Input: each step ran once; each worker's applied
    elements are its pipeline's in order with no gap (the step queued behind the fatal
    one read nothing on the dead worker); "c" = -(sum of the elements applied); ledger
    exact. Outputs held by a worker of a shut-down strategy: an error, not a hang."""
    n = 24
    s, rep, p, opt, step, it = _counting_job(2)
    try:
        for k, d in enumerate((0.0, 0.02)):
            jrt.set_worker_delay(s, k, d)
        values = [rep.run(step, it, p, opt) for _ in range(8)]
        rep.join()
        # Armed while idle (a call to a busy actor waits for its steps): worker 1 dies
        # in its next step, with the one started behind it never run there.
        jrt.kill_worker(s, 1, when="compute")
        values += [rep.run(step, it, p, opt) for _ in range(n - 8)]
        rep.join()
        assert s._executor._carrier.depth == 2 and s.stats()["alive"] == [True, False]
        outs = [v.fetch() for v in values]
        used = [tuple(int(e) for e in np.ravel(o[2])) for o in outs]
        assert len(set(used)) == n
        for k in range(2):
            mine = sorted(i for w, i in used if w == k)
            assert mine == list(range(len(mine))), (k, mine)
        np.testing.assert_allclose(s.parameters()["c"], -np.sum(used, axis=0))
        for i in range(2):
            led = s.ledger()[i]
            assert (led["applied"], led["stale"], led["duplicate"]) == (n, 0, 0), led
            started = [int(np.ravel(o[i])[0]) for o in outs]
            assert all(0 <= x < n for x in started), started
            recorded = sum(k * c for k, c in led["staleness"].items())
            assert recorded == n * (n - 1) // 2 - sum(started), (i, led["staleness"])
        kept = rep.run(step, it, p, opt)
        rep.join()
    finally:
        s.shutdown()
    t0 = time.monotonic()
    with pytest.raises(jr.ps.WorkerLostError, match="held by worker"):
        kept.fetch()
    assert time.monotonic() - t0 < 30


def _input_job(**kw):
    """One Ray worker reading elements 0, 1, 2, ... of its own pipeline (PER_WORKER);
    the loss sum(w * x) makes the parameters -(sum of the elements applied)."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier="ray", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(1)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def input_fn(ctx):
        return [np.array([i], np.float32) for i in range(40)]

    def step(ctx, x, w, opt):
        g = jax.grad(lambda w: jnp.sum(w * x))(w)
        u, opt = tx.update(g, opt, w)
        return x

    s._review_tx = tx
    return s, rep, w, opt, step, rep.prepare_input(input_fn)


def _elements(values):
    return [int(np.ravel(v.fetch())[0]) for v in values]


def _crash_and_wait(s, w=0):
    """Kills worker ``w``'s process (Ray restarts it) and waits until the new actor
    answers, with no step in flight: the driver is not told."""
    import ray

    actor = s._executor._carrier.workers[w]
    before = ray.get(actor.incarnation.remote(), timeout=60)
    jrt.kill_worker(s, w, when="crash")
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if ray.get(actor.incarnation.remote(), timeout=5) != before:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.2)
    raise TimeoutError("the worker actor was not restarted within 60 s")


@pytest.fixture(scope="module")
def one_ray_worker_faults(local_ray):  # noqa: F811 (the imported fixture)
    """One scenario on one Ray worker (PER_WORKER input), observed once for the tests
    below: a fetch of a finished step while the worker runs later ones; a crash in a
    step; a crash while idle, then the same step function; a crash while idle, then a
    new step function on the same iterator."""
    import ray

    obs = {}
    s, rep, w, opt, step, it = _input_job(ray_worker_options={"max_restarts": -1})
    try:
        first = [rep.run(step, it, w, opt) for _ in range(3)]
        rep.join()
        jrt.set_worker_delay(s, 0, 1.0)
        later = [rep.run(step, it, w, opt) for _ in range(2)]
        time.sleep(0.3)  # the worker is in the first later step, the second queued
        t0 = time.monotonic()
        obs["fetched"] = float(np.ravel(first[0].fetch(timeout=0.5))[0])
        obs["fetch_s"] = time.monotonic() - t0
        rep.join()
        before_crash = _elements(first + later)  # a crash loses the outputs it held
        # A crash in a step (Ray restarts the worker; the coordinator replaces it).
        jrt.set_worker_delay(s, 0, 0.5)
        second = [rep.run(step, it, w, opt) for _ in range(3)]
        time.sleep(0.25)
        jrt.kill_worker(s, 0, when="crash")
        rep.join()
        actor = s._executor._carrier.workers[0]
        obs["replaced"] = s.stats()["replaced"]
        obs["delay_after_restart"] = ray.get(actor.__ray_call__.remote(
            lambda self: self.worker.faults.get(0).delay), timeout=60)
        obs["elements"] = before_crash + _elements(second)
        obs["applied"] = s.ledger()[0]["applied"]
        obs["params"] = float(s.parameters()[0])
        jrt.set_worker_delay(s, 0, 0.0)
        # A crash while idle, then the same step function.
        _crash_and_wait(s)
        third = [rep.run(step, it, w, opt) for _ in range(2)]
        rep.join()
        obs["idle_attempts"] = [v.attempts for v in third]
        # A crash while idle, then a new step function on the same iterator.
        _crash_and_wait(s)

        def other_step(ctx, x, w, opt):
            return step(ctx, x, w, opt)

        fourth = [rep.run(other_step, it, w, opt) for _ in range(2)]
        try:
            rep.join()
            obs["new_fn_error"] = None
        except Exception as e:  # noqa: BLE001 (observed, asserted by a test)
            obs["new_fn_error"] = f"{type(e).__name__}: {e}"
        obs["new_fn_done"] = sum(v.done() and v._error is None for v in fourth)
        # A lost shard restarted from a save, then a crash while idle and a new step
        # function (no input): the restarted actor must call the restarted shard.
        tx = s._review_tx

        def plain_step(ctx, w, opt):
            u, opt = tx.update(jax.grad(lambda w: jnp.sum(w))(w), opt, w)
            return w

        rep.run(plain_step, None, w, opt)
        rep.join()
        saved = s.state()
        jrt.kill_shard(s, 0)
        rep.run(plain_step, None, w, opt)
        with pytest.raises(jr.ps.ParameterServerError):
            rep.join()
        s.restart_shard(0, saved)
        _crash_and_wait(s)

        def other_plain_step(ctx, w, opt):
            return plain_step(ctx, w, opt)

        fifth = rep.run(other_plain_step, None, w, opt)
        try:
            rep.join()
            obs["after_shard_restart_error"] = None
        except Exception as e:  # noqa: BLE001 (observed, asserted by a test)
            obs["after_shard_restart_error"] = f"{type(e).__name__}: {e}"
        obs["after_shard_restart_done"] = fifth.done() and fifth._error is None
        if obs["after_shard_restart_error"] is not None:
            s._executor.coordinator.resume()  # every shard is alive: go on
        # A step function Ray cannot serialize (it captures a lock): the user's error.
        lock = threading.Lock()

        def unpicklable_step(ctx, w, opt):
            with lock:
                return plain_step(ctx, w, opt)

        rep.run(unpicklable_step, None, w, opt)
        try:
            rep.join()
            obs["unpicklable_error"] = None
        except Exception as e:  # noqa: BLE001 (observed, asserted by a test)
            obs["unpicklable_error"] = f"{type(e).__name__}: {e}"
        obs["alive_after_unpicklable"] = s.stats()["alive"]
    finally:
        s.shutdown()
    return obs


def test_fetching_a_finished_step_does_not_wait_for_the_workers_later_steps(
        one_ray_worker_faults):
    obs = one_ray_worker_faults
    assert obs["fetched"] == 0.0
    assert obs["fetch_s"] < 1.0, f"fetch(timeout=0.5) of a finished step: {obs['fetch_s']:.2f} s"


def test_a_restarted_ray_worker_does_not_read_its_input_again(one_ray_worker_faults):
    obs = one_ray_worker_faults
    got = obs["elements"]
    assert obs["replaced"] == 1 and obs["applied"] == len(got) == 8
    assert obs["params"] == -sum(got)
    assert len(set(got)) == len(got), f"elements read twice: {got}"


def test_a_ray_worker_that_crashed_while_idle_costs_no_attempt(one_ray_worker_faults):
    assert one_ray_worker_faults["idle_attempts"] == [1, 1]


def test_a_new_step_on_a_ray_worker_restarted_while_idle_reads_its_input(
        one_ray_worker_faults):
    obs = one_ray_worker_faults
    assert obs["new_fn_error"] is None and obs["new_fn_done"] == 2


def test_a_ray_worker_restarted_while_idle_calls_the_restarted_shard(one_ray_worker_faults):
    obs = one_ray_worker_faults
    assert obs["after_shard_restart_error"] is None and obs["after_shard_restart_done"]


def test_a_step_ray_cannot_serialize_is_the_steps_error(one_ray_worker_faults):
    obs = one_ray_worker_faults
    assert "serializ" in (obs["unpicklable_error"] or ""), obs["unpicklable_error"]
    assert obs["alive_after_unpicklable"] == [True]


def test_a_restarted_ray_worker_keeps_its_settings(one_ray_worker_faults):
    assert one_ray_worker_faults["delay_after_restart"] == 0.5


# -- Ray options ---------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [
    {"resources": {"CPU": 1}},  # Ray: use num_cpus
    {"num_cpus": float("nan")},
    {"num_cpus": float("inf")},
    {"accelerator_type": 7},
    {"runtime_env": {"env_vars": ["XLA_FLAGS=--foo"]}},  # dict(env_vars) fails later
], ids=["resources-CPU", "nan", "inf", "accelerator-int", "env_vars-list"])
def test_options_ray_refuses_are_refused_when_the_strategy_is_created(opts):
    with pytest.raises((ValueError, TypeError), match="ray_worker_options"):
        jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier="ray",
                                   ray_worker_options=opts)


def test_options_errors_name_the_argument_and_the_actor():
    """Sound: a function of the index that raises or returns no dict, keys that are not
    strings, bools for numbers: errors naming the argument (and the actor)."""
    for opts, match in ((lambda w: 1 / 0, "raised for actor 0: ZeroDivisionError"),
                        (lambda w: None if w else {}, "for actor 1 must be a dict"),
                        ({1: 2}, "option names must be strings"),
                        ({"num_gpus": True}, "a number >= 0")):
        for _ in range(2):  # the same error on every call
            with pytest.raises((ValueError, TypeError), match=match):
                jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier="ray",
                                           ray_worker_options=opts)


@pytest.mark.usefixtures("local_ray")
def test_a_gpu_workers_environment_does_not_pin_it_to_the_drivers_cpu():
    import os

    import ray

    from jreplicate.ps.ray.options import resolve, worker_actor_options

    assert os.environ.get("JAX_PLATFORMS") == "cpu"  # the tests' driver is CPU-only
    opts = worker_actor_options(resolve("ray_worker_options", {"num_gpus": 1}, 1)[0], 1)
    env = {k: v for k, v in opts.items() if k == "runtime_env"}

    @ray.remote(num_cpus=0)
    def platforms():
        return os.environ.get("JAX_PLATFORMS")

    # The GPU worker's environment (its options but the GPU this machine lacks).
    seen = ray.get(platforms.options(**env).remote(), timeout=120)
    assert seen != "cpu", f"a GPU worker would run with JAX_PLATFORMS={seen!r}"


@pytest.mark.usefixtures("local_ray")
def test_a_gpu_shards_environment_does_not_pin_it_to_the_drivers_cpu():
    import os

    import ray

    from jreplicate.ps.ray.options import resolve, shard_actor_options

    assert os.environ.get("JAX_PLATFORMS") == "cpu"
    opts = shard_actor_options(resolve("ray_shard_options", {"num_gpus": 1}, 1)[0])
    env = {k: v for k, v in opts.items() if k == "runtime_env"}

    @ray.remote(num_cpus=0)
    def platforms():
        return os.environ.get("JAX_PLATFORMS")

    seen = ray.get(platforms.options(**env).remote(), timeout=120)
    assert seen != "cpu", f"a GPU shard would run with JAX_PLATFORMS={seen!r}"
