"""The Replicator contract, checked for every in-process strategy (see conftest)."""

import dataclasses
import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._models import init_mlp, mlp, per_example_loss


def _spmd_only(strategy, why):
    """Skips a check of SPMD semantics under ParameterServerStrategy, saying why."""
    if isinstance(strategy, jr.ParameterServerStrategy):
        pytest.skip(f"ParameterServerStrategy: {why}")


_SCHEDULED = ("run schedules the step on a worker and returns a RemoteValue (TF2 "
              "ClusterCoordinator), so outputs are not global arrays; see "
              "tests/test_ps_embedded.py")

def test_run_overloads(strategy):
    _spmd_only(strategy, _SCHEDULED)
    rep = jr.Replicator(strategy)
    n = rep.num_replicas
    assert rep.num_replicas_in_sync == n
    ids = rep.run(lambda ctx: ctx.replica_id)
    assert isinstance(ids, jr.PerReplica)  # depends on replica_id, even for n == 1
    assert [int(i) for i in ids] == list(range(n))
    w = rep.replicate(jnp.arange(3.0))
    out = rep.run(lambda ctx, w, s: w * s + ctx.all_sum(1.0), None, w, 2.0)
    np.testing.assert_array_equal(out, np.arange(3.0) * 2 + n)

    inputs = rep.prepare_input(lambda ctx: iter([np.full((2,), ctx.input_pipeline_id)] * 3),
                               replication_mode=jr.InputReplicationMode.PER_REPLICA)
    got = rep.run(lambda ctx, batch, w: (batch + w[0], ctx.num_replicas), inputs, w)
    assert got[1] == n or int(got[1]) == n
    assert isinstance(got[0], jr.PerReplica) and len(got[0]) == n
    for r, v in enumerate(got[0]):
        np.testing.assert_array_equal(v, [r, r])


def test_outputs_replicated_or_per_replica(strategy):
    _spmd_only(strategy, _SCHEDULED)
    rep = jr.Replicator(strategy)
    n = rep.num_replicas

    def f(ctx):
        same = ctx.all_sum(jnp.ones(2))
        differs = jnp.full((3,), ctx.replica_id, jnp.float32)
        return {"same": same, "differs": differs, "const": jnp.zeros(())}

    out = rep.run(f)
    assert isinstance(out["same"], jax.Array)
    assert out["same"].sharding.is_fully_replicated
    assert isinstance(out["const"], jax.Array)
    pr = out["differs"]
    assert isinstance(pr, jr.PerReplica)
    assert len(pr) == n and pr.shape == (3,)
    assert pr.array.shape == (n, 3) and isinstance(pr.array, jax.Array)
    # One global array, sharded over the replica devices: nothing gathered to one host.
    assert {s.device for s in pr.array.addressable_shards} == set(strategy.mesh.devices.flat)
    for r in range(n):
        assert pr[r].devices() == {strategy.devices[r]}
        np.testing.assert_array_equal(pr[r], np.full(3, r))
    np.testing.assert_array_equal(pr[-1], np.full(3, n - 1))
    with pytest.raises(IndexError):
        pr[n]
    np.testing.assert_array_equal(rep.reduce("sum", pr), np.full(3, n * (n - 1) / 2))
    np.testing.assert_allclose(rep.reduce("mean", pr), np.full(3, (n - 1) / 2))
    np.testing.assert_array_equal(rep.reduce("sum", out["same"]), np.full(2, n * n))
    local = rep.local_results(out)
    assert len(local) == n
    for r, tree in enumerate(local):
        np.testing.assert_array_equal(tree["differs"], np.full(3, r))
        assert tree["same"].devices() == set(strategy.layout.replica_devices[r])


def test_per_replica_args_roundtrip(strategy):
    _spmd_only(strategy, "a PerReplica value belongs to one worker's sync group, which "
               "a later step may not run on")
    rep = jr.Replicator(strategy)
    ids = rep.run(lambda ctx: ctx.replica_id * 2)
    doubled = rep.run(lambda ctx, x: x + ctx.replica_id, None, ids)
    assert [int(v) for v in doubled] == [3 * r for r in range(rep.num_replicas)]


def test_compiled_once_and_retraced_only_on_new_signature(strategy):
    _spmd_only(strategy, "each worker compiles the step for its own devices (once per "
               "worker and signature), and a step must push gradients")
    rep = jr.Replicator(strategy)
    traces = []

    def f(ctx, x):
        traces.append(jax.tree.map(jnp.shape, x))
        return ctx.all_sum(jax.tree.map(lambda v: v * (ctx.replica_id + 1), x))

    for _ in range(3):
        rep.run(f, None, jnp.ones(3))
    assert len(traces) == 1
    rep.run(f, None, jnp.ones(4))  # new shape
    rep.run(f, None, jnp.ones(3, jnp.int32))  # new dtype
    rep.run(f, None, {"a": jnp.ones(3)})  # new structure
    assert len(traces) == 4
    for _ in range(2):
        rep.run(f, None, jnp.ones(4))
        rep.run(f, None, {"a": jnp.ones(3)})
    assert len(traces) == 4
    # A Python float is weakly typed, a numpy float32 is not: two signatures, each once.
    for _ in range(2):
        rep.run(f, None, 2.0)
        rep.run(f, None, np.float32(2.0))
    assert len(traces) == 6


def test_training_matches_single_device(strategy):
    rep = jr.Replicator(strategy)
    n, per = rep.num_replicas, 4
    gb = n * per
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(5, gb, 16)).astype(np.float32)
    ys = rng.integers(0, 10, size=(5, gb)).astype(np.int32)
    if isinstance(strategy, jr.ParameterServerStrategy) and strategy.num_workers > 1:
        pytest.skip("ParameterServerStrategy: several asynchronous workers apply their "
                    "gradients in arrival order, not as one step; one worker (ps-1) is "
                    "sequential and checked here")
    tx = jr.ps.pushable(optax.sgd(0.1, momentum=0.9))  # the same step under every strategy
    params = init_mlp(jax.random.key(1))
    ref_p, ref_o = params, tx.init(params)
    for s in range(5):
        g = jax.grad(lambda p, s=s: per_example_loss(mlp(p, xs[s]), ys[s]).mean())(ref_p)
        u, ref_o = tx.update(g, ref_o, ref_p)
        ref_p = optax.apply_updates(ref_p, u)

    with rep.scope():
        p = init_mlp(jax.random.key(1))
        o = tx.init(p)

    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(per_example_loss(mlp(p, x), y), gb))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(gb)
        return [(xs[s, r * b:(r + 1) * b], ys[s, r * b:(r + 1) * b])
                for s in range(5) for r in range(ctx.num_replicas)]

    inputs = rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.SINGLE,
                               enforce_ordering=True)
    for _ in range(5):
        out = rep.run(step, inputs, p, o)
        if not isinstance(out, jr.ps.RemoteValue):
            p, o = out
    rep.join()  # scheduled steps (ParameterServerStrategy) finish here
    if isinstance(strategy, jr.ParameterServerStrategy):
        p = strategy.parameters()  # the shards hold the trained parameters
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref_p)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_scope_places_state_replicated(strategy):
    _spmd_only(strategy, "state created in scope lives on the PS shards "
               "(strategy.parameters()), not replicated on a mesh")
    rep = jr.Replicator(strategy)
    with rep.scope():
        with rep.scope():  # re-entrant
            w = jnp.zeros(4)
        state = optax.adam(1e-3).init({"w": w})
    for leaf in [w, *jax.tree.leaves(state)]:
        assert leaf.sharding.is_fully_replicated
        assert leaf.sharding.device_set == set(strategy.mesh.devices.flat)
    assert rep.initialize() == [] and rep.finalize() == []
    with rep.logical_device_for_variables(0):
        pass


def test_scope_places_nnx_modules_and_run_places_stray_arguments(strategy):
    _spmd_only(strategy, "NNX modules created in scope stay on the coordinator (the "
               "shards hold their parameters); NNX steps under the PS are checked in "
               "tests/test_ps_embedded.py")
    from flax import nnx

    rep = jr.Replicator(strategy)
    with rep.scope():
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    assert model.kernel[...].sharding.is_fully_replicated
    assert model.kernel[...].sharding.device_set == set(strategy.mesh.devices.flat)

    # Arguments created outside the scope (numpy, or committed to one device) are placed
    # replicated by run itself.
    host = np.arange(4.0, dtype=np.float32)
    on_one = jax.device_put(jnp.ones(4), jax.local_devices()[-1])  # the last device
    out = rep.run(lambda ctx, a, b: a + b + ctx.all_sum(0.0), None, host, on_one)
    np.testing.assert_array_equal(out, host + 1)
    assert out.sharding.device_set == set(strategy.mesh.devices.flat)
    assert out.sharding.is_fully_replicated


def test_per_replica_outputs_indexable_under_an_outer_jit(strategy):
    _spmd_only(strategy, "a scheduled step cannot run inside an outer jax.jit")
    rep = jr.Replicator(strategy)
    n = rep.num_replicas

    @jax.jit
    def f(w):
        ids = rep.run(lambda ctx, w: w * ctx.replica_id, None, w)
        return [ids[r] for r in range(len(ids))], ids[-1]

    values, last = f(jnp.float32(2.0))
    assert [float(v) for v in values] == [2.0 * r for r in range(n)]
    assert float(last) == 2.0 * (n - 1)


def test_randomness_same_unless_replica_id_folded_in(strategy):
    _spmd_only(strategy, _SCHEDULED)
    rep = jr.Replicator(strategy)
    key = jax.random.key(0)
    same = rep.run(lambda ctx, k: jax.random.normal(k, (2,)), None, key)
    assert not isinstance(same, jr.PerReplica)  # identical on every replica
    np.testing.assert_array_equal(same, jax.random.normal(key, (2,)))
    per = rep.run(lambda ctx, k: jax.random.normal(jax.random.fold_in(k, ctx.replica_id), (2,)),
                  None, key)
    assert isinstance(per, jr.PerReplica)
    for r, v in enumerate(per):
        np.testing.assert_array_equal(v, jax.random.normal(jax.random.fold_in(key, r), (2,)))


def test_parameter_server_run_overloads_and_group_collectives(strategy):
    """What the SPMD checks above say for ParameterServerStrategy: run(fn, inputs, *args)
    and run(fn, None, *args) schedule the same step, collectives reduce over the
    worker's sync group, per-replica input reaches each replica of the group."""
    if not isinstance(strategy, jr.ParameterServerStrategy):
        pytest.skip("ParameterServerStrategy only (the SPMD strategies are checked above)")
    rep = jr.Replicator(strategy)
    g = rep.num_replicas_in_sync
    assert rep.num_replicas == g * strategy.num_workers
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def step(ctx, batch, w, opt):
        grads = jax.grad(lambda w: jnp.sum(w) * ctx.all_sum(1.0) / ctx.num_replicas)(w)
        u, opt = tx.update(grads, opt, w)
        return optax.apply_updates(w, u), opt, batch + ctx.replica_id, ctx.all_sum(1)

    inputs = rep.prepare_input(lambda ctx: iter([np.full((2,), 10 * ctx.input_pipeline_id)] * 3),
                               replication_mode=jr.InputReplicationMode.PER_REPLICA)
    scheduled = rep.run(step, inputs, w, opt)
    no_input = rep.run(lambda ctx, w, opt: step(ctx, jnp.zeros(2, jnp.int32), w, opt)[:2],
                       None, w, opt)
    assert isinstance(scheduled, jr.ps.RemoteValue) and isinstance(no_input, jr.ps.RemoteValue)
    rep.join()
    _, _, per_replica, count = scheduled.fetch()
    assert int(count) == g
    np.testing.assert_array_equal(per_replica, [[11 * r] * 2 for r in range(g)])
    np.testing.assert_allclose(strategy.parameters(), np.full(3, -2.0))  # two pushes of 1
    assert rep.local_results(scheduled)[0][3] == g


def test_any_callable_is_a_step(strategy):
    """A step may be any callable: a dataclass instance (eq=True makes it unhashable),
    two equal but distinct ones, a bound method, a functools.partial; each runs its own
    code, and a dropped one frees its programs."""
    rep = jr.Replicator(strategy)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    @dataclasses.dataclass
    class Push:  # not hashable
        k: float

        def __call__(self, ctx, w, opt):
            u, opt = tx.update(jnp.full(3, -self.k), opt, w)  # sgd(1): w += k
            return optax.apply_updates(w, u), opt

    class Holder:
        def push(self, ctx, w, opt):
            return Push(4.0)(ctx, w, opt)

    holder = Holder()
    fns = [Push(1.0), Push(1.0), Push(2.0), holder.push,
           functools.partial(lambda ctx, w, opt, k: Push(k)(ctx, w, opt), k=8.0)]
    ps = isinstance(strategy, jr.ParameterServerStrategy)
    for fn in fns * 2:
        out = rep.run(fn, None, w, opt)
        if not ps:
            w, opt = out
    rep.join()
    got = strategy.parameters() if ps else w
    np.testing.assert_allclose(np.asarray(got), np.full(3, 2 * (1 + 1 + 2 + 4 + 8.0)))
    dropped = weakref.ref(fns[0])
    del fns, fn
    gc.collect()
    assert dropped() is None  # nothing of jreplicate keeps a step function alive


def _aligned_ones(n: int) -> np.ndarray:
    """A writable float32 array at a 64-byte aligned address: JAX on CPU aliases such an
    array when it places it (jax 0.12's device_put even with may_alias=False)."""
    raw = np.empty(n * 4 + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + n * 4].view(np.float32)
    out[...] = 1.0
    return out


def test_numpy_written_after_it_is_handed_over_changes_nothing(strategy, tmp_path):
    """Every way a NumPy array enters the library reads its values then: the caller
    refilling it afterwards changes no value the library holds or returns."""
    _spmd_only(strategy, "see tests/test_ps_forwarding.py (arguments of scheduled steps "
                         "and parameters given to the shards)")
    rep = jr.Replicator(strategy)
    given, arg, init = _aligned_ones(256), _aligned_ones(256), _aligned_ones(256)
    w = rep.replicate({"a": given})
    out = rep.run(lambda ctx, w, x: w["a"] + x, None, w, arg)
    saved = _aligned_ones(256)
    with jr.CheckpointManager(tmp_path / "ckpt", strategy) as m:
        _, state = m.restore_or_initialize(lambda: {"w": init})
        m.save(1, {"w": saved})
    for a in (given, arg, init, saved):
        a[...] = 7.0
    with jr.CheckpointManager(tmp_path / "ckpt", strategy) as m:
        step, back = m.restore_or_initialize(lambda: {"w": np.zeros(256, np.float32)})
    assert step == 1
    np.testing.assert_array_equal(np.asarray(jax.device_get(back["w"])), 1.0)
    np.testing.assert_array_equal(np.asarray(jax.device_get(w["a"])), 1.0)
    np.testing.assert_array_equal(np.asarray(jax.device_get(out)), 2.0)
    np.testing.assert_array_equal(np.asarray(jax.device_get(state["w"])), 1.0)
    again = rep.run(lambda ctx, w: w["a"] * 1.0, None, w)
    np.testing.assert_array_equal(np.asarray(jax.device_get(again)), 1.0)
