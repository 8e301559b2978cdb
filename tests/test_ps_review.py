"""Adversarial review of issue 18 items 6 and 8 (Ray pipelining, worker-held outputs,
Ray options, worker restarts, restart_shard): reproducers where the features meet.

Each confirmed defect's test is marked ``xfail(strict=True)`` with the defect in its
reason; the owners remove the mark with the fix. The unmarked tests pin behaviour that
was checked and found sound. Carrier-independent cases use the embedded carrier; the
Ray cases share one module-scoped Ray instance (tests/test_ps_ray.py's fixture).
"""

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
        tx = jr.pushable(optax.adam(0.1))
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

@pytest.mark.xfail(strict=True, reason=(
    "restart_shard checks only the params of the saved shard, not its opt_state: an "
    "opt_state of another shape fails inside optax with a raw TypeError ('add got "
    "incompatible shapes') that names neither the argument nor the fix, AFTER the "
    "carrier closed shard i (EmbeddedCarrier.restart_shard closes before building): a "
    "live shard's state is destroyed by a call that raised, and training stops with "
    "ParameterServerError 'shard 1 is replaced'"))
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


@pytest.mark.xfail(strict=True, reason=(
    "restart_shard does not check the opt_state's dtypes: a float64 optimizer state is "
    "accepted and silently cast to the shard's float32 (check_shard_state compares "
    "only the params)"))
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


@pytest.mark.xfail(strict=True, reason=(
    "restart_shard(i, state) of a shard that is NOT lost is accepted: the live shard "
    "is closed and rolled back to the saved step while the other shards keep theirs "
    "(here shard 1 back at step 3 beside shard 0 at step 7); the docstring says it "
    "brings a lost shard back. Expected: an error naming strategy.restore(state) (or "
    "an explicit opt-in)"))
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



@pytest.mark.xfail(strict=True, reason=(
    "ShardRestart.lost depends on the order of the restarts and on the carrier: with "
    "both shards lost and restarted from one save, the first report names the updates "
    "after the save (read from the other shard's CLOSED ledger, which the embedded "
    "carrier still serves; a dead Ray actor does not, so there it is empty too) and "
    "the second report names none, though shard 1 lost the same updates: a user told "
    "'nothing lost' for a shard rolled back 4 updates"))
def test_every_restarted_shard_reports_the_updates_it_lost():
    s, rep, params, opt, step = _adam_job()
    _steps(rep, step, params, opt, 3)
    state = s.state()
    _steps(rep, step, params, opt, 4)
    jrt.kill_shard(s, 0)
    jrt.kill_shard(s, 1)
    rep.run(step, None, params, opt)
    with pytest.raises(jr.ParameterServerError):
        rep.join()
    try:
        reports = [s.restart_shard(i, state) for i in (0, 1)]
        assert [r.step for r in reports] == [3, 3]
        for r in reports:
            assert set(range(3, 7)) <= set(r.lost), reports
    finally:
        s.shutdown()


def test_a_batch_the_step_cannot_take_is_the_steps_error_not_every_workers_death():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(2)
        tx = jr.pushable(optax.sgd(0.1))
        opt = tx.init(w)

    def step(ctx, b, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * b["x"]))(w), opt, w)
        return optax.apply_updates(w, u)

    it = rep.prepare_input(lambda ctx: [{"x": np.ones(2, np.float32), "name": np.array(
        "a.jpg")} for _ in range(4)], jr.InputReplicationMode.SINGLE)
    try:
        rep.run(step, it, w, opt)
        with pytest.raises(TypeError):
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

def _counting_job(num_workers, carrier="ray"):
    """SGD(lr=1) on a loss whose gradient is -1 everywhere: shard i's piece counts the
    updates shard i applied, so the parameters a step returns say exactly which step of
    each shard it started from."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=num_workers, carrier=carrier,
                                   placement="round_robin")
    rep = jr.Replicator(s)
    with rep.scope():
        p = {"a": jnp.zeros(1), "b": jnp.zeros(1)}
        tx = jr.pushable(optax.sgd(1.0))
        opt = tx.init(p)

    def step(ctx, p, opt):
        g = jax.grad(lambda p: -jnp.sum(p["a"]) - jnp.sum(p["b"]))(p)
        u, opt = tx.update(g, opt, p)
        return p

    return s, rep, p, opt, step


@pytest.mark.usefixtures("local_ray")
def test_pipelined_staleness_is_that_of_the_parameters_each_step_used():
    """Two Ray workers, two steps in flight each (the second starting from what the
    first push returned), uneven delays. With every push applied, shard i applies its
    k-th update at step k, so the sum of its recorded staleness is
    N(N-1)/2 - sum(the step of shard i each update started from), and that step is the
    value of shard i's piece the step returned. Equal: every recorded fetched_step is
    the step of the parameters the step actually used (pulled or returned)."""
    n = 30
    s, rep, p, opt, step = _counting_job(2)
    for w, d in enumerate((0.0, 0.01)):
        jrt.set_worker_delay(s, w, d)
    values = [rep.run(step, None, p, opt) for _ in range(n)]
    rep.join()
    assert s._executor._carrier.depth == 2
    used = [v.fetch() for v in values]
    for i, key in enumerate(("a", "b")):
        assert s.placement.shard_of(f"['{key}']") == i
        led = s.ledger()[i]
        assert (led["applied"], led["stale"], led["duplicate"]) == (n, 0, 0), led
        started = [int(u[key][0]) for u in used]
        assert all(0 <= x < n for x in started), started
        recorded = sum(k * c for k, c in led["staleness"].items())
        assert recorded == n * (n - 1) // 2 - sum(started), (key, led["staleness"])
    np.testing.assert_allclose(s.parameters()["a"], [n])
    kept = rep.run(step, None, p, opt)
    rep.join()
    s.shutdown()
    t0 = time.monotonic()  # outputs held by a worker of a shut-down strategy: an error
    with pytest.raises(jr.WorkerLostError, match="held by worker"):
        kept.fetch()
    assert time.monotonic() - t0 < 30


@pytest.mark.usefixtures("local_ray")
@pytest.mark.xfail(strict=True, reason=(
    "RemoteValue.fetch(timeout=...) of a step that already finished is queued behind the "
    "worker actor's running steps (WorkerActor is single-threaded and runs fetch after "
    "its up-to-two queued run() calls; HeldOutputs.resolve ignores the timeout and uses "
    "300 s): here a 0.5 s fetch of a done value takes ~2 steps of 1 s. A done value "
    "must come back at once (or raise TimeoutError within the timeout)"))
def test_fetching_a_finished_step_does_not_wait_for_the_workers_later_steps():
    s, rep, p, opt, step = _counting_job(1)
    done = rep.run(step, None, p, opt)
    rep.join()
    jrt.set_worker_delay(s, 0, 1.0)
    later = [rep.run(step, None, p, opt) for _ in range(2)]
    time.sleep(0.3)  # the worker is in the first later step, the second queued behind
    t0 = time.monotonic()
    try:
        got = done.fetch(timeout=0.5)
        took = time.monotonic() - t0
    finally:
        rep.join()
        s.shutdown()
    assert float(got["a"][0]) == 0.0 and all(v.done() for v in later)
    assert took < 1.0, f"fetch(timeout=0.5) of a finished step took {took:.2f} s"


def _input_job(**kw):
    """One Ray worker reading elements 0, 1, 2, ... of its own pipeline (PER_WORKER);
    the loss sum(w * x) makes the parameters -(sum of the elements applied)."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier="ray", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(1)
        tx = jr.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def input_fn(ctx):
        return [np.array([i], np.float32) for i in range(40)]

    def step(ctx, x, w, opt):
        g = jax.grad(lambda w: jnp.sum(w * x))(w)
        u, opt = tx.update(g, opt, w)
        return x

    return s, rep, w, opt, step, rep.prepare_input(input_fn)


def _elements(values):
    return [int(np.ravel(v.fetch())[0]) for v in values]


@pytest.mark.usefixtures("local_ray")
@pytest.mark.xfail(strict=True, reason=(
    "a Ray worker restarted after its process died re-reads its PER_WORKER pipeline "
    "from the beginning (the replaced actor is sent the input_fn again and builds a new "
    "pipeline at element 0): elements already applied are applied again, silently "
    "(ledger: 0 duplicates), and worker_input.py documents a rerun reading 'the next "
    "element'. Here the steps after the crash read 0, 1, ... again"))
def test_a_restarted_ray_worker_does_not_read_its_input_again():
    s, rep, w, opt, step, it = _input_job()
    try:
        first = [rep.run(step, it, w, opt) for _ in range(3)]
        rep.join()
        assert _elements(first) == [0, 1, 2]
        jrt.set_worker_delay(s, 0, 0.5)
        second = [rep.run(step, it, w, opt) for _ in range(3)]
        time.sleep(0.25)  # inside the first of them
        jrt.kill_worker(s, 0, when="crash")
        rep.join()
        assert s.stats()["replaced"] == 1
        got = _elements(first + second)
        assert s.ledger()[0]["applied"] == 6
        assert len(set(got)) == len(got), f"elements read twice: {got}"
        np.testing.assert_allclose(s.parameters(), [-sum(got)])
    finally:
        s.shutdown()


@pytest.mark.usefixtures("local_ray")
@pytest.mark.xfail(strict=True, reason=(
    "a Ray worker whose process dies while it is idle is not noticed; the driver still "
    "believes the restarted actor holds the step function (RayCarrier._runner's 'sent' "
    "set), sends fn=None, and the step fails there (ActorUnavailableError while Ray "
    "restarts it, KeyError once restarted), reported as a worker loss and counted as an "
    "attempt although nothing ran: with max_attempts=1 the step fails (WorkerLostError "
    "'step 2 failed on 1 workers')"))
def test_a_ray_worker_that_crashed_while_idle_costs_no_attempt():
    s, rep, w, opt, step, it = _input_job(max_attempts=1)
    try:
        first = [rep.run(step, it, w, opt) for _ in range(2)]
        rep.join()
        jrt.kill_worker(s, 0, when="crash")
        time.sleep(1.0)
        second = [rep.run(step, it, w, opt) for _ in range(2)]
        rep.join()
        assert [v.attempts for v in second] == [1, 1]
        assert len(_elements(first + second)) == 4
    finally:
        s.shutdown()




@pytest.mark.usefixtures("local_ray")
@pytest.mark.xfail(strict=True, reason=(
    "a Ray worker restarted by Ray while idle (no step in flight) is not noticed; the "
    "driver believes the new actor holds the PER_WORKER input_fn (RayCarrier._runner's "
    "'sent_inputs'), so a NEW step function on that iterator reaches it with "
    "input_fn=None, which WorkerActor.run stores (setdefault) and WorkerPipelines "
    "calls: every step of that iterator on that worker then fails for good with the "
    "application error \"TypeError: 'NoneType' object is not callable\" (not retried, "
    "the worker never replaced)"))
def test_a_new_step_on_a_ray_worker_restarted_while_idle_reads_its_input():
    import ray

    s, rep, w, opt, step, it = _input_job()
    try:
        first = [rep.run(step, it, w, opt) for _ in range(2)]
        rep.join()
        actor = s._executor._carrier.workers[0]
        before = ray.get(actor.incarnation.remote(), timeout=60)
        jrt.kill_worker(s, 0, when="crash")
        end = time.monotonic() + 60
        while time.monotonic() < end:  # Ray restarted it (max_restarts)
            try:
                if ray.get(actor.incarnation.remote(), timeout=5) != before:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                time.sleep(0.2)

        def other_step(ctx, x, w, opt):
            return step(ctx, x, w, opt)

        second = [rep.run(other_step, it, w, opt) for _ in range(2)]
        rep.join()
        assert len(_elements(first + second)) == 4
    finally:
        s.shutdown()

# -- Ray options ---------------------------------------------------------------------------

@pytest.mark.xfail(strict=True, reason=(
    "ray_options._check_one lets through options that Ray itself refuses "
    "(ray_option_utils.validate_actor_options): they fail later, inside tx.init, with "
    "Ray's own error (no argument named, after the shard actors were started) instead "
    "of at ParameterServerStrategy(...)"))
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
@pytest.mark.xfail(strict=True, reason=(
    "a GPU worker (ray_worker_options={'num_gpus': g}) gets no runtime_env from "
    "worker_actor_options, so it inherits the environment of the process that started "
    "Ray: a CPU-only driver (JAX_PLATFORMS=cpu, as here) starting a local Ray gives its "
    "GPU workers JAX_PLATFORMS=cpu, and RayCarrier._check_ready only counts devices, "
    "never their platform: the 'GPU' worker silently trains on CPU"))
def test_a_gpu_workers_environment_does_not_pin_it_to_the_drivers_cpu():
    import os

    import ray

    from jreplicate.ps.ray_options import resolve, worker_actor_options

    assert os.environ.get("JAX_PLATFORMS") == "cpu"  # the tests' driver is CPU-only
    opts = worker_actor_options(resolve("ray_worker_options", {"num_gpus": 1}, 1)[0], 1)
    env = {k: v for k, v in opts.items() if k == "runtime_env"}

    @ray.remote(num_cpus=0)
    def platforms():
        return os.environ.get("JAX_PLATFORMS")

    # The GPU worker's environment (its options but the GPU this machine lacks).
    seen = ray.get(platforms.options(**env).remote(), timeout=120)
    assert seen != "cpu", f"a GPU worker would run with JAX_PLATFORMS={seen!r}"
