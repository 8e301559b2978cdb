"""ParameterServerStrategy on Ray (carrier="ray"): shards and workers as Ray actors.

One local Ray instance for the module, with its temporary and session files in a short
temporary directory of its own (removed after); every wait is bounded. Skipped only where Ray is not
installed (the `test` extra installs it).
"""

import gc
import os
import pathlib
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.handle import Carrier, RemoteShardHandle
from jreplicate.ps.ray.carrier import ensure_ray
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests._sockets import is_loopback, listening_sockets

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")


def private_ray(**options):
    """Starts the Ray instance the library starts itself (no address given; ``options``
    for its ``ray.init``), yields its directory, and shuts it down."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # no token file in the home dir
    # A short directory of its own: Ray's socket paths under it must fit in 107 bytes
    # (pytest's temporary directories under pytest-xdist do not).
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="jr-ray-"))
    saved = {k: os.environ.pop(k, None) for k in ("RAY_ADDRESS", "RAY_TMPDIR")}
    os.environ["RAY_TMPDIR"] = str(tmp)
    try:
        ensure_ray(**options)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v
    yield tmp
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray():
    """The Ray instance the library starts itself (no address given)."""
    yield from private_ray()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ray_started_by_the_library_listens_on_loopback_only(local_ray):
    """GCS, raylet, agents, workers: every listening socket of Ray's processes (children
    of this one) is on loopback, and no dashboard listens."""
    @ray.remote(num_cpus=0)
    class Probe:
        def ping(self):
            return "pong"

    probe = Probe.remote()
    assert ray.get(probe.ping.remote(), timeout=120) == "pong"
    sockets = listening_sockets(os.getpid())
    print("\n".join(f"{pid} {addr}:{port} {cmd[:70]}" for pid, cmd, addr, port in sockets))
    assert len(sockets) >= 4, sockets  # GCS, raylet (2), the workers
    assert all(is_loopback(addr) for _, _, addr, _ in sockets), sockets
    # Ray 2.60 runs its dashboard head process even then, but it serves nothing.
    assert not any("dashboard" in cmd for _, cmd, _, _ in sockets), sockets
    ray.kill(probe)


def _job(tx_fn, **kw):
    s = jr.ParameterServerStrategy(num_ps=2, carrier="ray", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(4)
        tx = jr.ps.pushable(tx_fn())
        opt = tx.init(w)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt, jnp.sum(w)

    return s, rep, w, opt, step


def _invariant(s, scheduled=None):
    for led in s.ledger():
        assert led["pushes"] == led["applied"] + led["stale"] + led["backup"] + \
            led["duplicate"], led
        if scheduled is not None:
            assert led["applied"] == scheduled, led


def test_async_on_ray_with_a_worker_killed_at_40_percent(local_ray):
    assert any(local_ray.iterdir())  # Ray's session files are under the test's tmp dir
    s, rep, w, opt, step = _job(lambda: optax.sgd(0.01), num_workers=4)
    v = rep.run(step, None, w, opt)
    rep.join()
    assert isinstance(v.fetch()[2], np.ndarray)
    for k in range(4):
        jrt.set_worker_delay(s, k, 0.01)
    values = [rep.run(step, None, w, opt) for _ in range(30)]
    end = time.monotonic() + 60
    while s.stats()["completed"] < 1 + 12 and time.monotonic() < end:
        time.sleep(0.005)
    jrt.kill_worker(s, 2, when="process")  # ray.kill: Ray's failure detection reports it
    s._executor.coordinator.join(timeout=120)
    st = s.stats()
    assert st["alive"][2] is False and st["completed"] == 31
    assert all(v.done() for v in values)
    _invariant(s, scheduled=31)
    np.testing.assert_allclose(s.parameters(), np.full(4, -0.01 * 31), rtol=1e-5)
    # A lost shard actor: a clear error, at once.
    for _ in range(100):
        rep.run(step, None, w, opt)
    t0 = time.monotonic()
    jrt.kill_shard(s, 1)
    with pytest.raises(jr.ps.ParameterServerError, match="shard"):
        s._executor.coordinator.join(timeout=60)
    print(f"Ray: lost shard surfaced by join after {time.monotonic() - t0:.3f} s")
    assert time.monotonic() - t0 < 30
    s.shutdown()


def test_token_gated_on_ray(local_ray):
    s, rep, w, opt, step = _job(lambda: jr.sync_replicas(
        optax.sgd(0.1), replicas_to_aggregate=2, total_num_replicas=3), num_workers=3)
    for _ in range(18):
        rep.run(step, None, w, opt)
    s._executor.coordinator.join(timeout=120)
    _invariant(s)
    gs = s.global_step
    assert gs >= 4 and s._executor.shard_step(1) == gs
    carrier = s._executor._carrier  # one typed interface, shards called by method
    assert isinstance(carrier, Carrier)
    assert all(isinstance(h, RemoteShardHandle) for h in carrier.client.shards)
    np.testing.assert_allclose(s.parameters(), np.full(4, -0.1 * gs), rtol=1e-5)
    s.shutdown()


def test_per_worker_input_is_read_in_the_worker_actors(local_ray):
    """PER_WORKER input: input_fn runs in each worker actor's process (with its
    InputContext); a step ships no batch; at the end of every pipeline run raises
    StopIteration; the parameters are the sum of the batches applied."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier="ray")
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def input_fn(ctx):  # [pipeline, index, the reading process's pid]
        return [np.array([ctx.input_pipeline_id, i, os.getpid()], np.float32)
                for i in range(3)]

    def step(ctx, x, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * x))(w), opt, w)
        return optax.apply_updates(w, u), opt, x

    it = rep.prepare_input(input_fn)
    values = []
    for _ in range(200):
        try:
            values.append(rep.run(step, it, w, opt))
        except StopIteration:
            break
        if len(values) >= 7:
            rep.join()
    rep.join()
    used = []
    for v in values:
        try:
            used.append((v.worker, np.asarray(v.fetch()[2]).reshape(3)))
        except StopIteration:
            pass
    assert sorted((int(b[0]), int(b[1])) for _, b in used) == \
        [(p, i) for p in range(2) for i in range(3)]
    assert all(int(b[0]) == wk for wk, b in used)
    assert os.getpid() not in {int(b[2]) for _, b in used}  # read in the actors
    np.testing.assert_allclose(s.parameters(), -sum(b for _, b in used), rtol=1e-6)
    _invariant(s, scheduled=6)
    s.shutdown()


def test_per_worker_pipelines_are_freed_in_the_worker_actors(local_ray):
    """A worker actor holds one pipeline per live iterator: those closed (at once) or
    let go (with the actor's next step) are freed; a closed iterator's queued step is
    not run (StopIteration), an iterator let go with its step queued still runs it."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier="ray")
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def input_fn(ctx):
        return [np.array([ctx.input_pipeline_id, i, 1], np.float32) for i in range(100)]

    def step(ctx, x, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * x))(w), opt, w)
        return optax.apply_updates(w, u), opt, x

    def counts():
        return [ray.get(a.pipeline_count.remote(), timeout=60)
                for a in s._executor._carrier.workers]

    values = []
    for k in range(10):
        it = rep.prepare_input(input_fn)
        values += [rep.run(step, it, w, opt) for _ in range(4)]
        if k % 2:
            rep.join()
            it.close()
        else:
            del it  # its steps hold it: they run, then it is freed
    rep.join()
    gc.collect()
    kept = rep.prepare_input(input_fn)
    values += [rep.run(step, kept, w, opt) for _ in range(4)]
    rep.join()
    readers = {v.worker for v in values[-4:]}  # kept's, on each worker that read it
    assert counts() == [int(k in readers) for k in range(2)]
    late = rep.prepare_input(input_fn)
    jrt.set_worker_delay(s, 0, 0.3)
    jrt.set_worker_delay(s, 1, 0.3)
    queued = [rep.run(step, late, w, opt) for _ in range(6)]
    late.close()
    rep.join()
    ran = [v for v in queued if _ran(v)]
    assert len(ran) < 6
    assert all(_ran(v) for v in values)
    total = sum(np.asarray(v.fetch()[2]).reshape(3) for v in values + ran)
    np.testing.assert_allclose(s.parameters(), -total, rtol=1e-6)
    _invariant(s, scheduled=len(values) + len(ran))
    s.shutdown()


def test_per_worker_values_and_two_iterators_in_the_worker_actors(local_ray):
    """A PerWorkerValue is built once in each worker actor (its process), and a step
    reading two per-worker iterators sees the matching elements of both, read there."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier="ray")
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def value_fn(wc):  # [worker, the building process's pid, a fresh random number]
        return np.array([wc.worker_index, os.getpid(), np.random.rand()], np.float32)

    def input_fn(tag):
        return lambda ctx: [np.array([ctx.input_pipeline_id, i, tag], np.float32)
                            for i in range(50)]

    def step(ctx, batch, w, opt, v):
        x, y = batch
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * (x + y)))(w), opt, w)
        return optax.apply_updates(w, u), opt, (x, y, v)

    v = s.create_per_worker_value(value_fn)
    it1, it2 = rep.prepare_input(input_fn(1)), rep.prepare_input(input_fn(2))
    out = [rep.run(step, (it1, it2), w, opt, v) for _ in range(8)]
    rep.join()
    total, built = np.zeros(3), {}
    for r in out:
        x, y, val = (np.asarray(a).reshape(3) for a in r.fetch()[2])
        assert x[0] == y[0] == val[0] == r.worker and x[1] == y[1]
        assert (x[2], y[2]) == (1, 2) and val[1] != os.getpid()  # built in the actor
        assert built.setdefault(r.worker, tuple(val)) == tuple(val)  # built once there
        total += x + y
    np.testing.assert_allclose(s.parameters(), -total, rtol=1e-6)
    s.shutdown()


def _ran(v):
    try:
        v.fetch()
        return True
    except StopIteration:
        return False


def test_a_crashed_worker_is_restarted_by_ray_and_takes_steps_again(local_ray):
    """Worker 1's process is killed while it runs steps (kill_worker(when="crash")):
    Ray restarts its actor (max_restarts), the coordinator reschedules the lost steps
    and gives the restarted worker steps again (its step function, resent); every
    scheduled step is applied exactly once on every shard."""
    s, rep, w, opt, step = _job(lambda: optax.sgd(0.01), num_workers=2)
    for k in range(2):
        jrt.set_worker_delay(s, k, 0.02)
    values = [rep.run(step, None, w, opt) for _ in range(40)]
    end = time.monotonic() + 60
    while s.stats()["completed_by"][1] < 3 and time.monotonic() < end:
        time.sleep(0.005)
    jrt.kill_worker(s, 1, when="crash")
    # Worker 1 takes some of these, so the crash is seen even if it was idle.
    values += [rep.run(step, None, w, opt) for _ in range(10)]
    s._executor.coordinator.join(timeout=120)
    while s.stats()["replaced"] < 1 and time.monotonic() < end + 60:
        time.sleep(0.05)
    replaced_at = s.stats()["completed_by"][1]
    values += [rep.run(step, None, w, opt) for _ in range(20)]
    s._executor.coordinator.join(timeout=120)
    st = s.stats()
    print(f"replaced={st['replaced']} rescheduled={st['rescheduled']} "
          f"completed_by={st['completed_by']} (worker 1 when replaced: {replaced_at})")
    assert st["replaced"] == 1 and st["alive"] == [True, True]
    assert st["completed"] == 70 and all(v.done() for v in values)
    assert st["completed_by"][1] > replaced_at  # the restarted worker ran steps again
    _invariant(s, scheduled=70)
    np.testing.assert_allclose(s.parameters(), np.full(4, -0.01 * 70), rtol=1e-5)
    s.shutdown()


def test_a_lost_shard_actor_restarted_from_a_saved_state(local_ray):
    """The scenario of tests/test_ps_shard_restart.py on Ray: the shard comes back as a
    new actor, which the driver and the worker actors call from then on."""
    from tests.test_ps_shard_restart import shard_restart_scenario
    shard_restart_scenario("ray")


def test_state_saved_from_ray_actors_restores_embedded_on_another_worker_count(
        local_ray, tmp_path):
    """Workers hold no state: ``strategy.state()`` of 2 Ray shard actors and 3 worker
    actors, saved by a CheckpointManager (the loop's ``save(step, lambda: ...)``),
    restores bit for bit into an embedded job of 1 worker, which trains on from there
    as the Ray job does."""
    s, rep, w, opt, step = _job(lambda: optax.adam(0.1), num_workers=3)
    with jr.CheckpointManager(tmp_path, rep, save_interval_steps=3) as mngr:
        for i in range(1, 7):
            rep.run(step, None, w, opt)
            mngr.save(i, lambda: (rep.join(), s.state())[1])
    saved = jax.tree.map(np.array, s.state())
    for _ in range(3):
        rep.run(step, None, w, opt)
    s._executor.coordinator.join(timeout=120)
    on_ray = s.parameters()
    s.shutdown()

    e = jr.ParameterServerStrategy(num_ps=2, num_workers=1, devices=jax.devices()[:3])
    rep_e = jr.Replicator(e)
    with rep_e.scope():
        w_e = jnp.zeros(4)
        tx = jr.ps.pushable(optax.adam(0.1))
        opt_e = tx.init(w_e)

    def step_e(ctx, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w))(w), opt, w)
        return optax.apply_updates(w, u), opt

    with jr.CheckpointManager(tmp_path, rep_e) as mngr:
        at, state = mngr.restore_or_initialize(e.state)
    assert at == 6
    e.restore(state)
    for got, want in zip(jax.tree.leaves(e.state()), jax.tree.leaves(saved), strict=True):
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    for _ in range(3):
        rep_e.run(step_e, None, w_e, opt_e)
    rep_e.join()
    np.testing.assert_array_equal(e.parameters(), on_ray)
    e.shutdown()
