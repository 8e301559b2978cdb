"""Donated state, the program cache's hold on step functions, and the JAX compat layer."""

import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate import _jax_compat
from tests._models import init_mlp, mlp, per_example_loss

# Toy steps here all-reduce replicated values (ctx.all_sum of a module's own state) as
# the computation they check, which Replicator.run warns about as a pmap habit
# (jr.ReplicationHabitWarning, an error in this suite): allowed in this module.
pytestmark = pytest.mark.filterwarnings("ignore::jreplicate.ReplicationHabitWarning")

TX = optax.adam(1e-2)


def _setup(rep):
    with rep.scope():
        p = init_mlp(jax.random.key(0))
        return p, TX.init(p)


def _train_step(ctx, x, y, p, o):
    g = jax.grad(lambda p: jr.compute_average_loss(per_example_loss(mlp(p, x), y), 64))(p)
    u, o = TX.update(g, o, p)
    return optax.apply_updates(p, u), o


def _batch(rep):
    rng = np.random.default_rng(0)
    n = rep.num_replicas
    x = rng.normal(size=(n, 64 // n, 16)).astype(np.float32)
    y = rng.integers(0, 10, size=(n, 64 // n)).astype(np.int32)
    return jr.PerReplica(jnp.asarray(x)), jr.PerReplica(jnp.asarray(y))


def test_donated_state_is_consumed_and_results_are_unchanged():
    rep = jr.Replicator(jr.MirroredStrategy())
    x, y = _batch(rep)
    p, o = _setup(rep)
    ref = rep.run(_train_step, None, x, y, p, o)
    p2, o2 = rep.run(_train_step, None, x, y, p, o, donate_argnums=(2, 3))
    assert all(a.is_deleted() for a in jax.tree.leaves((p, o)))
    assert not any(a.is_deleted() for a in jax.tree.leaves((x.array, y.array)))
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves((p2, o2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match=r"argument \[2\]\S* is an array that was "
                                         r"donated.*Pass the value that run returned"):
        rep.run(_train_step, None, x, y, p, o)


def test_an_evaluation_step_never_loses_its_parameters():
    rep = jr.Replicator(jr.MirroredStrategy())
    x, y = _batch(rep)
    p, _ = _setup(rep)
    for _ in range(2):
        loss = rep.run(lambda ctx, x, y, p: ctx.all_sum(jr.compute_average_loss(
            per_example_loss(mlp(p, x), y), 64)), None, x, y, p)
    assert not any(a.is_deleted() for a in jax.tree.leaves(p))
    assert np.isfinite(float(loss))


def test_nnx_state_is_donated_by_default_and_the_module_stays_usable():
    from flax import nnx
    rep = jr.Replicator(jr.MirroredStrategy())
    with rep.scope():
        model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    before = np.asarray(jnp.copy(model.kernel.get_value()))  # (a NumPy view pins it)
    buffers = [s.data.unsafe_buffer_pointer()
               for s in model.kernel.get_value().addressable_shards]

    def step(ctx, model):
        model.kernel[...] = model.kernel[...] + 1
        return ctx.all_sum(jnp.sum(model.kernel[...]))

    rep.run(step, None, model)
    assert [s.data.unsafe_buffer_pointer()  # donated: the old buffers hold the new state
            for s in model.kernel.get_value().addressable_shards] == buffers
    old = model.kernel.get_value()  # held elsewhere now: copied, never donated
    rep.run(step, None, model)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), before + 2)
    np.testing.assert_allclose(np.asarray(old), before + 1)


def test_donate_argnums_errors_name_the_fix():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    w = rep.replicate(jnp.ones(3))
    with pytest.raises(ValueError, match=r"argument \[0\] is donated.*also passed as "
                                         r"argument \[1\].*jnp.copy"):
        rep.run(lambda ctx, a, b: (a + b,), None, w, w, donate_argnums=(0,))
    assert not w.is_deleted()
    for bad in (5, (0, 3), ("a",), (True,), -1):
        with pytest.raises(ValueError, match=r"donate_argnums=.*positions must be ints"):
            rep.run(lambda ctx, a, b: a, None, jnp.ones(2), jnp.ones(2), donate_argnums=bad)


def _peak(compiled):
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def test_peak_memory_with_donation_equals_hand_written_jit_with_donate_argnums():
    rep = jr.Replicator(jr.MirroredStrategy())
    x, y = _batch(rep)
    p, o = _setup(rep)
    ours = _peak(rep._executor.compiled(_train_step, False, None, (x, y, p, o),
                                        donate_argnums=(2, 3)))
    ours_kept = _peak(rep._executor.compiled(_train_step, False, None, (x, y, p, o)))

    def body(x, y, p, o):
        return _train_step(None, x[0], y[0], p, o)

    hand = jax.jit(jax.shard_map(body, mesh=rep.mesh, in_specs=(P("replica"), P("replica"),
                                                                 P(), P()),
                                 out_specs=(P(), P()), axis_names={"replica"}),
                   donate_argnums=(2, 3))
    theirs = _peak(hand.lower(x.array, y.array, p, o).compile())
    assert ours / theirs <= 1.05, (ours, theirs)
    assert ours_kept > ours  # without donation the old state stays alive during the step


def test_cache_does_not_keep_step_functions_or_their_closures_alive():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))

    class Big:
        def __init__(self):
            self.data = np.ones(1 << 20, np.float32)

    refs = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the recompilation warning, tested below
        for _ in range(5):
            big = Big()
            refs.append(weakref.ref(big))
            scale = float(big.data[0])
            rep.run(lambda ctx, w, big=big, scale=scale:
                    w * scale + ctx.all_sum(big.data[:1].sum()), None, jnp.ones(2))
            del big
    gc.collect()
    assert [r() for r in refs] == [None] * 5
    assert len(rep._executor._cache) <= 1  # programs of freed functions are dropped


def test_one_cache_holds_a_functions_programs_and_steady_calls_and_drops_them_together():
    """The executor's ProgramCache is the only store of compiled programs: the
    steady-state calls hang off their function's entry, go when the program they serve
    is evicted (least recently used first), and go with the function."""
    from types import SimpleNamespace

    from jreplicate.execution.cache import CallShape, ProgramCache

    cache = ProgramCache(2)

    def f(x):
        return x

    def g(x):
        return x

    built = []

    def build(call):
        built.append(call)
        return SimpleNamespace(name=len(built))

    p1 = cache.put(f, "k1", build)
    entry = cache.find(f)
    shape = CallShape("tree", False, None, ())
    cache.record(entry, shape, SimpleNamespace(program=p1))
    # The steady-state path looks calls up with a plain tuple of CallShape's fields.
    assert entry.steady[("tree", False, None, ())].program is p1
    assert cache.get(f, "k1") is p1 and cache.find(g) is None
    built[0](3)  # the program calls f through a weak reference
    cache.put(f, "k2", build)
    cache.put(g, "k1", build)  # evicts f's least recently used program, k1
    assert len(cache) == 2 and cache.get(f, "k1") is None
    assert entry.steady == {}  # dropped with the program it served
    del f, built[:]
    gc.collect()
    assert [e.fn() for e in cache.entries()] == [g] and len(cache) == 1


def test_recompiling_new_function_objects_warns_once_with_the_fix():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    w = jnp.ones(2)
    with pytest.warns(UserWarning, match=r"compiled the step function <lambda>.*8 different "
                                         r"function objects.*Build the step function once"):
        for _ in range(8):
            rep.run(lambda ctx, w: w * 2, None, w)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            rep.run(lambda ctx, w: w * 2, None, w)  # warned once per code object
        step = lambda ctx, w: w + 1  # noqa: E731
        for _ in range(20):
            rep.run(step, None, w)  # one function object: no warning


@pytest.fixture
def two_pass_out_specs(monkeypatch):
    monkeypatch.setattr(_jax_compat, "FORCE_TWO_PASS_OUT_SPECS", True)


def test_jax_here_chooses_out_specs_in_one_pass():
    assert _jax_compat.single_pass_out_specs()


def test_out_specs_fallback_gives_the_same_results(two_pass_out_specs):
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
    traces = []

    def f(ctx, w):
        traces.append(1)
        return {"same": ctx.all_sum(w), "differs": w * ctx.replica_id}

    for _ in range(3):
        out = rep.run(f, None, jnp.ones(3))
    assert len(traces) == 2  # the eval_shape pass and the real one, once per signature
    assert isinstance(out["same"], jax.Array) and out["same"].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out["same"]), np.full(3, 4.0))
    assert isinstance(out["differs"], jr.PerReplica)
    assert [float(v[0]) for v in out["differs"]] == [0.0, 1.0, 2.0, 3.0]
    # A device loop and model-sharded state go through the fallback too.
    rep2 = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
    total, ids = rep2.run(lambda ctx, t: (t + ctx.all_sum(1.0), ctx.replica_id), None,
                          jnp.float32(0), steps=3)
    assert float(total) == 12 and ids.array.shape == (4, 3)
