"""Adversarial checks of the steady-state path of run (jreplicate/execution/fast.py).

Each test first brings a call into steady state, then changes something between calls
and checks that the result (or the error) is the full path's: computed independently
in numpy, or by the full path itself (``fast._ARRAY = None`` disables the steady-state
path); the bugs it found are fixed and their tests are plain tests.
"""

import functools
import operator
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate.execution import fast, nnx_args

# Toy steps here all-reduce replicated values (ctx.all_sum of a module's own state) as
# the computation they check, which Replicator.run warns about as a pmap habit
# (jr.ReplicationHabitWarning, an error in this suite): allowed in this module.
pytestmark = pytest.mark.filterwarnings("ignore::jreplicate.ReplicationHabitWarning")


@pytest.fixture
def rep():
    return jr.Replicator(jr.MirroredStrategy())


def _pr(rep, x):
    """A PerReplica placed for rep's mesh."""
    return jr.PerReplica(jax.device_put(np.asarray(x), NamedSharding(rep.mesh, P("replica"))),
                         rep.mesh)


def _x(rep, value=1.0, shape=(3,)):
    return _pr(rep, np.full((rep.num_replicas,) + shape, value, np.float32))


def _leaves_equal(a, b):
    la = jax.tree.leaves(a, is_leaf=lambda v: isinstance(v, jr.PerReplica))
    lb = jax.tree.leaves(b, is_leaf=lambda v: isinstance(v, jr.PerReplica))
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        assert type(u) is type(v)
        u = u.array if isinstance(u, jr.PerReplica) else u
        v = v.array if isinstance(v, jr.PerReplica) else v
        assert np.asarray(u).dtype == np.asarray(v).dtype
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def _fast_and_full(monkeypatch, scenario):
    """``scenario()`` with the steady-state path, then on the full path only."""
    got = scenario()
    with monkeypatch.context() as mp:
        mp.setattr(fast, "_ARRAY", None)
        want = scenario()
    return got, want


def _add(ctx, x, w):
    return w + 1.0, ctx.all_sum(jnp.sum(x))


# -- plain arguments that change type or value range ---------------------------------

@pytest.mark.parametrize("bad", [np.int64(2**40), np.array([2**40, 1], np.int64), 2**40])
def test_an_int_argument_becomes_a_too_big_host_value(rep, counted, bad):
    x = _x(rep)

    def step(ctx, x, n):
        return x * jnp.sum(n)

    for _ in range(3):
        rep.run(step, x, rep.replicate(jnp.array([2, 2], jnp.int32)))
    assert counted["hit"] == 2
    with pytest.raises(ValueError, match="does not fit int32"):
        rep.run(step, x, bad)
    # and the steady state goes on afterwards, right
    out = rep.run(step, x, rep.replicate(jnp.array([3, 3], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(out.array), np.full((8, 3), 6.0))


def test_a_float_argument_becomes_1e300(rep):
    x = _x(rep)
    for _ in range(3):
        rep.run(_add, x, jnp.float32(1.0))
    with pytest.raises(ValueError, match="does not fit float32"):
        rep.run(_add, x, 1e300)
    with pytest.raises(ValueError, match="does not fit float32"):
        rep.run(_add, x, np.float64(-1e300))


def test_python_scalars_as_arguments(rep, counted):
    x = _x(rep, 2.0)

    def step(ctx, x, a, b, flag):
        return x * a + b, jnp.where(flag, 1, 0)

    for k in range(4):
        y, f = rep.run(step, x, k, 0.5 * k, k % 2 == 0)
        np.testing.assert_allclose(np.asarray(y.array), np.full((8, 3), 2.0 * k + 0.5 * k))
        assert int(f) == (k % 2 == 0)
    assert counted["hit"] == 0  # Python numbers always take the full path
    for _ in range(3):  # int -> float in the same position: weak float, not int
        y, _ = rep.run(step, x, 1.5, 0.0, True)
        np.testing.assert_allclose(np.asarray(y.array), np.full((8, 3), 3.0))


def test_array_turned_into_numpy_and_back(rep, counted):
    x = _x(rep)
    w = rep.replicate(jnp.ones(3))
    for _ in range(3):
        w, _ = rep.run(_add, x, w)
    host = np.asarray(w) * 10  # float32 numpy: placed by the full path, right value
    out, s = rep.run(_add, x, host)
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 41.0))
    assert float(s) == 24.0
    out, _ = rep.run(_add, x, w)
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 5.0))


def test_prng_key_arguments(rep):
    x = _x(rep)

    def step(ctx, x, key):
        return jax.random.uniform(key, (3,)), jax.random.split(key)[0]

    key = jax.random.key(0)
    outs = [rep.run(step, x, key)[0] for _ in range(3)]
    want = jax.random.uniform(key, (3,))
    for o in outs:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(want))


# -- PerReplica values -------------------------------------------------------------------

def test_per_replica_from_another_replicators_mesh(rep):
    x = _x(rep)
    w = rep.replicate(jnp.ones(3))
    for _ in range(3):
        rep.run(_add, x, w)
    other = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[::-1]))
    # placed for rep's mesh, but labelled with the other Replicator's mesh
    foreign = jr.PerReplica(x.array, other.mesh)
    with pytest.raises(ValueError, match="PerReplica value from another Replicator"):
        rep.run(_add, foreign, w)
    made_there = _x(other)
    with pytest.raises(ValueError, match="PerReplica value from another Replicator"):
        rep.run(_add, made_there, w)


def test_per_replica_without_mesh_and_with_another_axis_name(rep):
    w = rep.replicate(jnp.ones(3))
    base = np.arange(24, dtype=np.float32).reshape(8, 3)
    x = _pr(rep, base)
    for _ in range(3):
        rep.run(_add, x, w)
    for pr in (jr.PerReplica(x.array), jr.PerReplica(x.array, rep.mesh, "replica"),
               jr.PerReplica(jnp.asarray(base))):
        for _ in range(2):
            _, s = rep.run(_add, pr, w)
            assert float(s) == float(base.sum())


def test_per_replica_whose_array_was_donated(rep, counted):
    def step(ctx, s, w):
        return s + w, ctx.all_sum(jnp.sum(s))

    s = _x(rep, 0.0)
    w = rep.replicate(jnp.ones(3))
    for _ in range(4):
        box = [s]  # its only holder: donated (a PerReplica two names hold is copied)
        del s
        s, _ = rep.run(step, None, box[0], w, donate_argnums=0)
    assert counted["hit"] >= 2
    old = box[0]
    assert old.array.is_deleted()
    with pytest.raises(ValueError, match=r"argument \[0\] is an array that was donated"):
        rep.run(step, None, old, w, donate_argnums=0)
    with pytest.raises(ValueError, match=r"argument \[0\] is an array that was donated"):
        rep.run(step, None, old, w)  # not donating this time: still the full path's error
    np.testing.assert_array_equal(np.asarray(s.array), np.full((8, 3), 4.0))


def test_deleted_second_argument_does_not_consume_the_donated_first(rep):
    x = _x(rep)

    def two(ctx, x, a, b):
        return a + b

    a, b = rep.replicate((jnp.ones(3), jnp.ones(3)))
    for _ in range(3):
        a = rep.run(two, x, a, b, donate_argnums=0)
    dead = rep.replicate(jnp.ones(3))
    dead.delete()
    fresh = rep.replicate(jnp.full(3, 2.0))
    with pytest.raises(ValueError, match=r"argument \[1\] is an array that was donated"):
        rep.run(two, x, fresh, dead, donate_argnums=0)
    assert not fresh.is_deleted()  # the failed call must not have donated it
    np.testing.assert_array_equal(np.asarray(rep.run(two, x, fresh, b)), np.full(3, 3.0))


# -- meshes, Replicators, configuration ------------------------------------------------

def test_one_step_function_two_replicators_with_different_devices():
    reps = [jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:4])),
            jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[2:8])),
            jr.Replicator(jr.MirroredStrategy(devices=[jax.devices()[i] for i in (7, 1)]))]

    def step(ctx, x, w):
        return w + ctx.all_sum(jnp.sum(x)), ctx.replica_id

    xs = [_x(r, 1.0) for r in reps]
    ws = [r.replicate(jnp.zeros(3)) for r in reps]
    for i in range(4):
        for r, x, k in zip(reps, xs, range(3)):
            ws[k], ids = r.run(step, x, ws[k])
            n = r.num_replicas
            np.testing.assert_array_equal(np.asarray(ws[k]), np.full(3, (i + 1) * 3.0 * n))
            np.testing.assert_array_equal([int(v) for v in ids], list(range(n)))
    # an argument of one Replicator passed to the other: the full path's result
    w_other = reps[0].replicate(jnp.ones(3))
    out, _ = reps[1].run(step, xs[1], w_other)
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 1 + 18.0))


def test_argument_on_a_permuted_mesh(rep):
    x = _x(rep)
    for _ in range(3):
        rep.run(_add, x, rep.replicate(jnp.ones(3)))
    perm = Mesh(np.array(jax.devices()[::-1]).reshape(8, 1), ("replica", "model"))
    w = jax.device_put(jnp.full(3, 5.0), NamedSharding(perm, P()))
    out, s = rep.run(_add, x, w)
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 6.0))
    assert float(s) == 24.0


def test_x64_toggled_between_calls(rep, monkeypatch):
    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r)
        w = r.replicate(jnp.ones(3))

        def step(ctx, x, w):
            return w * 3, jnp.arange(3), ctx.all_sum(jnp.sum(x)) / 7

        outs = [r.run(step, x, w) for _ in range(3)]
        try:
            jax.config.update("jax_enable_x64", True)
            outs += [r.run(step, x, w) for _ in range(2)]
        finally:
            jax.config.update("jax_enable_x64", False)
        outs += [r.run(step, x, w) for _ in range(2)]
        return outs

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got, want)
    assert got[3][1].dtype == jnp.int64 and got[-1][1].dtype == jnp.int32


def test_matmul_precision_changed_between_calls(rep, monkeypatch):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(8, 4, 16)).astype(np.float32)
    b = rng.normal(size=(16, 16)).astype(np.float32)

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x, w = _pr(r, a), r.replicate(jnp.asarray(b))

        def step(ctx, x, w):
            return ctx.all_sum(x @ w)

        outs = [r.run(step, x, w) for _ in range(2)]
        for prec in ("bfloat16", "float32", "highest"):
            with jax.default_matmul_precision(prec):
                outs += [r.run(step, x, w) for _ in range(2)]
        return outs

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got, want)


def test_clear_caches_and_disable_jit_after_steady_state(rep):
    x = _x(rep)
    w = rep.replicate(jnp.ones(3))
    for _ in range(3):
        rep.run(_add, x, w)
    jax.clear_caches()
    out, s = rep.run(_add, x, w)
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 2.0))
    with jax.disable_jit():
        out, s = rep.run(_add, x, w)
    np.testing.assert_array_equal(np.asarray(out), np.full(3, 2.0))
    assert float(s) == 24.0


def test_under_an_outer_jit_traced_and_concrete(rep, monkeypatch):
    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r, 2.0)
        w = r.replicate(jnp.ones(3))

        def step(ctx, x, w):
            return w * ctx.all_sum(jnp.sum(x)), x + ctx.replica_id

        for _ in range(3):
            r.run(step, x, w)
        closure = jax.jit(lambda y: r.run(step, x, w)[0] + y)  # concrete arrays
        traced = jax.jit(lambda w, xa: r.run(step, jr.PerReplica(xa, r.mesh), w))
        return [closure(jnp.float32(1.0)), traced(w, x.array), closure(jnp.float32(2.0)),
                r.run(step, x, w)]

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got, want)


def test_nested_run_with_concrete_closure_values_is_still_refused(rep):
    x = _x(rep)
    w = rep.replicate(jnp.ones(3))
    for _ in range(3):
        rep.run(_add, x, w)

    def outer(ctx):
        return rep.run(_add, x, w)[1]

    with pytest.raises(RuntimeError, match="inside a step that Replicator.run is running"):
        rep.run(outer)


# -- step function kinds ---------------------------------------------------------------

class _Scaler:
    def __init__(self, k):
        self.k = k

    def step(self, ctx, x, w):
        return w * self.k

    def __call__(self, ctx, x, w):
        return w * self.k + 1.0


class _Slotted:
    """A callable that cannot be weakly referenced."""

    __slots__ = ("k",)

    def __init__(self, k):
        self.k = k

    def __call__(self, ctx, x, w):
        return w * self.k - 1.0


def _scale(ctx, x, w, *, k):
    return w * k


def test_bound_methods_of_different_objects(rep):
    x = _x(rep)
    w = rep.replicate(jnp.ones(3))
    objs = [_Scaler(float(k)) for k in range(1, 5)]
    for _ in range(3):
        for o in objs:  # a new bound method object each call, ids recycled
            np.testing.assert_array_equal(np.asarray(rep.run(o.step, x, w)), np.full(3, o.k))
    held = objs[2].step
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(rep.run(held, x, w)), np.full(3, 3.0))


def test_partials_callable_objects_and_unweakrefable_callables(rep, counted):
    x = _x(rep)
    w = rep.replicate(jnp.full(3, 2.0))
    fns = [(functools.partial(_scale, k=3.0), 6.0), (functools.partial(_scale, k=5.0), 10.0),
           (_Scaler(4.0), 9.0), (_Scaler(0.5), 2.0), (_Slotted(3.0), 5.0),
           (_Slotted(7.0), 13.0)]
    for _ in range(3):
        for fn, want in fns:
            np.testing.assert_array_equal(np.asarray(rep.run(fn, x, w)), np.full(3, want))
    assert counted["hit"] >= 2 * len(fns)


def test_builtin_step_functions(rep):
    get_id = operator.attrgetter("replica_id")  # a C callable: fn(ctx)
    for _ in range(3):
        ids = rep.run(get_id)
        assert [int(i) for i in ids] == list(range(8))
    count = operator.attrgetter("num_replicas")
    for _ in range(3):
        assert int(rep.run(count)) == 8


def test_new_partials_each_step_never_reuse_a_stale_program(rep):
    x = _x(rep)
    w = rep.replicate(jnp.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run warns of new function objects
        for k in range(10):
            fn = functools.partial(_scale, k=float(k))
            np.testing.assert_array_equal(np.asarray(rep.run(fn, x, w)), np.full(3, float(k)))
            del fn


# -- threads ---------------------------------------------------------------------------

def test_threads_same_and_different_step_functions(rep):
    def step_a(ctx, x, w):
        return w * 2.0 + ctx.all_sum(jnp.sum(x))

    def step_b(ctx, x, w):
        return w - 1.0

    errors, barrier = [], threading.Barrier(6)

    def worker(k):
        try:
            barrier.wait()
            fn = step_a if k % 2 else step_b
            for i in range(15):
                n = 3 + (i + k) % 3  # shapes change: traces race with steady-state calls
                x = _x(rep, float(k), (2,))
                w = rep.replicate(jnp.full(n, float(i), jnp.float32))
                out = np.asarray(rep.run(fn, x, w))
                want = i * 2.0 + 16.0 * k if k % 2 else i - 1.0
                if not np.array_equal(out, np.full(n, want, np.float32)):
                    errors.append((k, i, out, want))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((k, repr(e)))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert not fast.retrace_guarded()


# -- donation --------------------------------------------------------------------------

def _buffers(a):
    """The device buffers of ``a`` (a donated argument's are reused for the result)."""
    return [s.data.unsafe_buffer_pointer() for s in a.addressable_shards]


@pytest.mark.parametrize("forms", [(0, (0,), [0], (np.int64(0),), (0, 0)),
                                   ((), [], 0, ())])
def test_donate_argnums_forms_switched_in_steady_state(rep, forms):
    x = _x(rep)
    w = rep.replicate(jnp.zeros(3))
    for i, d in enumerate(forms * 2):
        before = _buffers(w)  # (holding w itself elsewhere would make run copy it)
        w, _ = rep.run(_add, x, w, donate_argnums=d)
        # Compared on the devices: on CPU, jaxlib 0.11 never donates a buffer NumPy has
        # read (np.asarray aliases it), so a host read here would defeat the next step's.
        assert bool(jnp.all(w == i + 1.0)), (i, d)
        donated = not (isinstance(d, (tuple, list)) and len(d) == 0)
        assert (_buffers(w) == before) == donated  # the donated buffers were reused


@pytest.mark.parametrize("donate", [np.int64(0), np.int32(0), np.array([0])],
                         ids=["int64", "int32", "array"])
def test_donate_argnums_as_numpy_integers(rep, donate):
    x = _x(rep)
    w = rep.replicate(jnp.zeros(3))
    before = _buffers(w)
    w, _ = rep.run(_add, x, w, donate_argnums=donate)
    np.testing.assert_array_equal(np.asarray(w), np.full(3, 1.0))
    assert _buffers(w) == before  # donated: its buffers were reused


def test_a_non_callable_step_with_bad_donate_argnums_names_the_step(rep):
    with pytest.raises(TypeError, match="must be callable"):
        rep.run("not a function", None, jnp.ones(3), donate_argnums=5)


def test_argument_passed_twice_with_and_without_donation(rep):
    x = _x(rep)

    def two(ctx, x, a, b):
        return a * 2.0 + b

    a = rep.replicate(jnp.ones(3))
    b = rep.replicate(jnp.ones(3))
    for _ in range(3):
        rep.run(two, x, a, b)
    np.testing.assert_array_equal(np.asarray(rep.run(two, x, a, a)), np.full(3, 3.0))
    for _ in range(3):
        a = rep.run(two, x, a, b, donate_argnums=0)
    with pytest.raises(ValueError, match="is donated .* but the same array is also passed"):
        rep.run(two, x, a, a, donate_argnums=(0,))
    assert not a.is_deleted()


# -- errors raised by the step after steady state ----------------------------------------

def test_step_raising_at_trace_time_after_steady_state(rep):
    x = _x(rep)

    def step(ctx, x, w):
        if w.shape == (5,):
            raise KeyboardInterrupt
        if w.shape == (6,):
            raise ValueError("step says no to 6")
        return w + 1.0

    w = rep.replicate(jnp.ones(3))
    for _ in range(3):
        w = rep.run(step, x, w)
    with pytest.raises(KeyboardInterrupt):
        rep.run(step, x, jnp.ones(5))
    assert not fast.retrace_guarded()
    with pytest.raises(ValueError, match="step says no to 6"):
        rep.run(step, x, jnp.ones(6))
    for _ in range(2):
        w = rep.run(step, x, w)
    np.testing.assert_array_equal(np.asarray(w), np.full(3, 6.0))


def test_step_failing_at_run_time_runs_once(rep):
    x = _x(rep)
    calls, fail = [], [False]

    def cb(v):
        calls.append(1)
        if fail[0]:
            raise RuntimeError("callback failed")
        return v

    def step(ctx, x, w):
        return jax.pure_callback(cb, jax.ShapeDtypeStruct(w.shape, w.dtype), w + 1.0)

    w = rep.replicate(jnp.ones(3))
    for _ in range(3):
        w = jax.block_until_ready(rep.run(step, x, w, donate_argnums=0))
    calls.clear()
    fail[0] = True
    with pytest.raises(Exception, match="callback"):  # noqa: B017 - XLA's runtime error
        jax.block_until_ready(rep.run(step, x, w, donate_argnums=0))
    assert len(calls) == rep.num_replicas  # run once, not again on the full path


# -- input iterators and device loops --------------------------------------------------

def _loop_step(ctx, batch, w):
    g = ctx.all_sum(jnp.sum(batch, axis=0)) / 16.0
    return w - 0.1 * g, ctx.all_sum(jnp.sum(batch))


def _loop_ref(xs, steps_per_call):
    w = np.zeros(3, np.float32)
    out = []
    for chunk in range(0, len(xs), steps_per_call):
        for x in xs[chunk:chunk + steps_per_call]:
            out.append(float(x.sum()))
            w = (w - 0.1 * (x.sum(axis=0) / 16.0)).astype(np.float32)
    return w, out


def test_device_loops_in_steady_state_with_a_short_final_loop(rep, counted):
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(8, 16, 3)).astype(np.float32)  # 8 steps of 16 examples

    def input_fn(ctx):
        r = ctx.input_pipeline_id
        return (xs[s, 2 * r:2 * r + 2] for s in range(len(xs)))

    it = rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA,
                           prefetch_on_device=False)
    w = rep.replicate(jnp.zeros(3))
    sums = []
    for want in (3, 3, 2):
        w, s = rep.run(_loop_step, it, w, steps=3)
        assert s.shape == (want,)
        sums.extend(np.asarray(s).tolist())
    with pytest.raises(StopIteration):
        rep.run(_loop_step, it, w, steps=3)
    ref_w, ref_sums = _loop_ref(xs, 3)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-5)
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-4)
    assert counted["hit"] >= 1  # the second 3-step loop


def test_single_steps_from_an_iterator_with_a_padded_final_batch(rep, monkeypatch):
    rng = np.random.default_rng(4)
    xs = rng.normal(size=(37, 3)).astype(np.float32)  # 37 examples, global batch 16

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())

        def input_fn(ctx):
            rows = np.arange(len(xs))[ctx.input_pipeline_id::8]
            return (xs[rows[i:i + 2]] for i in range(0, len(rows), 2))

        it = r.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA,
                             prefetch_on_device=False, partial_batch="pad")

        def step(ctx, b, w):
            m = ctx.batch_mask if ctx.batch_mask is not None else jnp.ones(b.shape[0])
            return w + ctx.all_sum(jnp.sum(b * m[:, None], 0)), ctx.all_sum(jnp.sum(m))

        w, counts = r.replicate(jnp.zeros(3)), []
        for _ in range(3):
            w, c = r.run(step, it, w)
            counts.append(float(c))
        return w, counts

    (got_w, got_c), (want_w, want_c) = _fast_and_full(monkeypatch, scenario)
    assert got_c == want_c and sum(got_c) == 37.0
    np.testing.assert_array_equal(np.asarray(got_w), np.asarray(want_w))
    np.testing.assert_allclose(np.asarray(got_w), xs.sum(0), rtol=1e-5, atol=1e-5)


# -- Flax NNX modules ------------------------------------------------------------------

class _Two(nnx.Module):
    def __init__(self):
        self.p = nnx.Param(jnp.ones(3))
        self.q = nnx.Param(jnp.ones(3))


class _TwoOther(nnx.Module):
    def __init__(self):
        self.p = nnx.Param(jnp.full(3, 3.0))
        self.q = nnx.BatchStat(jnp.zeros(3))


def _double_params(ctx, x, m):
    """Doubles every nnx.Param of m (only Params), returns the sum of m.p."""
    nnx.update(m, jax.tree.map(lambda v: v * 2.0, nnx.state(m, nnx.Param)))
    return ctx.all_sum(jnp.sum(m.p[...]))


def _nnx_state(m):
    return [np.asarray(v) for v in jax.tree.leaves(nnx.state(m))]


def test_nnx_variable_value_changes_dtype_then_shape(rep, monkeypatch):
    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r)
        with r.scope():
            m = _Two()
        outs = [r.run(_double_params, x, m) for _ in range(3)]
        with r.scope():
            m.q.set_value(jnp.ones(3, jnp.bfloat16))
        outs += [r.run(_double_params, x, m) for _ in range(2)]
        with r.scope():
            m.p.set_value(jnp.ones(5))
        outs += [r.run(_double_params, x, m) for _ in range(2)]
        m.q.set_value(np.full(3, 7.0, np.float32))  # a host value
        outs += [r.run(_double_params, x, m) for _ in range(2)]
        return outs, _nnx_state(m), m.q[...].dtype

    (g, gs, gd), (w, ws, wd) = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(g, w)
    _leaves_equal(gs, ws)
    assert gd == wd
    np.testing.assert_array_equal(gs[0], np.full(5, 16.0))  # ones(5), doubled 4 times


def test_nnx_submodule_replaced(rep, monkeypatch):
    class Outer(nnx.Module):
        def __init__(self):
            self.sub = _Two()
            self.r = nnx.Param(jnp.zeros(3))

    def step(ctx, x, m):
        m.r[...] = m.r[...] + m.sub.p[...] + 10.0 * m.sub.q[...]
        m.sub.p[...] = m.sub.p[...] + 1.0
        return ctx.all_sum(jnp.sum(m.r[...]))

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r)
        with r.scope():
            m = Outer()
        outs = [r.run(step, x, m) for _ in range(3)]
        with r.scope():
            m.sub = _Two()  # same structure, new Variables
            m.sub.q[...] = jnp.full(3, 2.0)
        outs += [r.run(step, x, m) for _ in range(2)]
        with r.scope():
            m.sub = _TwoOther()  # another class: another structure
        outs += [r.run(step, x, m) for _ in range(2)]
        return outs, _nnx_state(m)

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got, want)


def test_nnx_variable_shared_between_two_arguments(rep, monkeypatch):
    class One(nnx.Module):
        def __init__(self, v):
            self.v = v

    def step(ctx, x, a, b):
        a.v[...] = a.v[...] + 1.0
        b.v[...] = b.v[...] * 3.0
        return ctx.all_sum(jnp.sum(a.v[...]))

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r)
        with r.scope():
            a, b = One(nnx.Param(jnp.ones(3))), One(nnx.Param(jnp.ones(3)))
        outs = [r.run(step, x, a, b) for _ in range(3)]
        b.v = a.v  # one Variable reached from both arguments
        outs += [r.run(step, x, a, b) for _ in range(2)]
        outs += [r.run(step, x, a, a) for _ in range(2)]  # the same module twice
        return outs, np.asarray(a.v[...]), a.v is b.v

    (g, ga, gs), (w, wa, ws) = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(g, w)
    np.testing.assert_array_equal(ga, wa)
    assert gs and ws


def _tied_values(r):
    """Steady state, then two Variables made to hold one jax.Array (as in
    ``ema.p.set_value(model.p.get_value())``)."""
    x = _x(r)
    with r.scope():
        m = _Two()
    outs = [r.run(_double_params, x, m) for _ in range(3)]
    m.q.set_value(m.p.get_value())
    try:
        outs.append(r.run(_double_params, x, m))
    except Exception as e:  # noqa: BLE001 - compared below
        outs.append(type(e))
    return outs


def test_nnx_variables_holding_the_same_array_same_outcome(rep, monkeypatch):
    got, want = _fast_and_full(monkeypatch, lambda: _tied_values(
        jr.Replicator(jr.MirroredStrategy())))
    _leaves_equal(got[:3], want[:3])
    assert got[3] is want[3] or float(got[3]) == float(want[3])


def test_nnx_variables_holding_the_same_array_run(rep):
    out = _tied_values(rep)
    assert not isinstance(out[3], type)
    assert float(out[3]) == 8 * 3 * 16.0


def test_nnx_module_inside_a_list_with_a_plain_array(rep, monkeypatch):
    class Counter(nnx.Module):
        def __init__(self):
            self.n = nnx.Variable(jnp.zeros((), jnp.float32))

    def step(ctx, x, model, pack):
        inner, arr = pack
        model.n[...] = model.n[...] + 1.0
        inner.n[...] = inner.n[...] + jnp.sum(arr)
        return ctx.all_sum(model.n[...] + inner.n[...])

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r)
        with r.scope():
            model, inner = Counter(), Counter()
            arr = r.replicate(jnp.full(2, 0.5))
        pack = [inner, arr]  # written back in place: the list holds the new array
        outs = [r.run(step, x, model, pack) for _ in range(4)]
        return outs, float(model.n[...]), float(inner.n[...])

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got[0], want[0])
    assert got[1:] == want[1:] == (4.0, 4.0)


def test_nnx_static_attribute_changed_between_calls(rep, monkeypatch):
    class Scaled(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3))
            self.scale = 2.0

    def step(ctx, x, m):
        m.w[...] = m.w[...] * m.scale
        return ctx.all_sum(jnp.sum(m.w[...]))

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _x(r)
        with r.scope():
            m = Scaled()
        outs = [r.run(step, x, m) for _ in range(3)]
        m.scale = 3.0
        outs += [r.run(step, x, m) for _ in range(2)]
        return outs, _nnx_state(m)

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got, want)
    np.testing.assert_array_equal(got[1][0], np.full(3, 8.0 * 9.0))


class _NoStore(dict):
    """nnx_args._FULL_DEFS that never remembers (so the full path always re-derives the
    module's definition, with each Variable's type)."""

    def __setitem__(self, key, value):
        pass


class _Decay(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(3), lr_mult=0.25)


def _decay(ctx, x, m):
    m.w[...] = m.w[...] - m.w.lr_mult


def _variable_swapped(r, change):
    """Steady state, then a Variable replaced by one holding the same value with another
    type (a Param frozen as a BatchStat for fine-tuning: a Param-only update must leave
    it alone) or other metadata (a per-parameter learning-rate multiplier). Returns the
    values after one more step, and what they must be."""
    x = _x(r)
    with r.scope():
        m = _Two() if change == "type" else _Decay()
    step = _double_params if change == "type" else _decay
    for _ in range(3):
        r.run(step, x, m)
    with r.scope():
        if change == "type":
            m.q = nnx.BatchStat(m.q.get_value())
        else:
            m.w = nnx.Param(m.w.get_value(), lr_mult=0.125)
    r.run(step, x, m)
    if change == "type":
        return [np.asarray(m.p[...]), np.asarray(m.q[...])], [np.full(3, 16.0),
                                                              np.full(3, 8.0)]
    return [np.asarray(m.w[...])], [np.full(3, 1 - 3 * 0.25 - 0.125)]


_CHANGES = pytest.mark.parametrize("change", ["type", "metadata"])


@_CHANGES
def test_nnx_variable_swapped_full_path_reference(monkeypatch, change):
    """The full path, with its definition cache disabled, is right (the reference)."""
    monkeypatch.setattr(nnx_args, "_FULL_DEFS", _NoStore())
    monkeypatch.setattr(fast, "_ARRAY", None)
    got, want = _variable_swapped(jr.Replicator(jr.MirroredStrategy()), change)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@_CHANGES
def test_nnx_variable_swapped_steady_state(monkeypatch, change):
    monkeypatch.setattr(nnx_args, "_FULL_DEFS", _NoStore())  # isolate fast.py
    got, want = _variable_swapped(jr.Replicator(jr.MirroredStrategy()), change)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)  # type: q doubled (16); metadata: old mult


@_CHANGES
def test_nnx_variable_swapped_full_path(monkeypatch, change):
    monkeypatch.setattr(fast, "_ARRAY", None)
    got, want = _variable_swapped(jr.Replicator(jr.MirroredStrategy()), change)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_nnx_train_eval_switch_with_dropout(rep, monkeypatch):
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 3, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    def step(ctx, x, m):
        return ctx.all_sum(jnp.sum(m.drop(m.lin(x))))

    xa = np.random.default_rng(0).normal(size=(8, 4, 3)).astype(np.float32)

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())
        x = _pr(r, xa)
        with r.scope():
            m = Net(nnx.Rngs(0))
        outs = [r.run(step, x, m) for _ in range(3)]
        m.eval()
        outs += [r.run(step, x, m) for _ in range(3)]
        m.train()
        outs += [r.run(step, x, m) for _ in range(2)]
        return outs

    got, want = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(got, want)
    assert float(got[3]) == float(got[4]) != float(got[6])  # eval: no dropout


def test_nnx_steps_loop_from_an_iterator_in_steady_state(rep, monkeypatch):
    xs = np.random.default_rng(5).normal(size=(7, 16, 3)).astype(np.float32)

    class Acc(nnx.Module):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(3))

    def step(ctx, b, m, w):
        m.total[...] = m.total[...] + ctx.all_sum(jnp.sum(b, 0))
        return w * 0.5 + 1.0, ctx.all_sum(jnp.sum(b))

    def scenario():
        r = jr.Replicator(jr.MirroredStrategy())

        def input_fn(ctx):
            k = ctx.input_pipeline_id
            return (xs[s, 2 * k:2 * k + 2] for s in range(len(xs)))

        it = r.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA,
                             prefetch_on_device=False)
        with r.scope():
            m = Acc()
        w, outs = r.replicate(jnp.zeros(3)), []
        for _ in range(3):  # 3 + 3 + 1
            w, s = r.run(step, it, m, w, steps=3)
            outs.append(s)
        return outs, np.asarray(w), np.asarray(m.total[...])

    (go, gw, gt), (wo, ww, wt) = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(go, wo)
    np.testing.assert_array_equal(gw, ww)
    np.testing.assert_array_equal(gt, wt)
    np.testing.assert_allclose(gt, xs.sum((0, 1)), rtol=1e-4)


def test_model_split_argument_after_replicated_steady_state(monkeypatch):
    def scenario():
        r = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
        x = _pr(r, np.ones((4, 2, 4), np.float32))

        def step(ctx, x, w):
            return w + ctx.all_sum(jnp.sum(x)), ctx.all_sum(jnp.sum(x @ w))

        w = r.replicate(jnp.ones((4, 6)))
        outs = []
        for _ in range(3):
            w, s = r.run(step, x, w)
            outs.append(s)
        w = jax.device_put(np.asarray(w), NamedSharding(r.mesh, P(None, jr.MODEL_AXIS)))
        for _ in range(2):
            w, s = r.run(step, x, w)
            outs.append(s)
        return outs, w, w.sharding.spec

    (go, gw, gspec), (wo, ww, wspec) = _fast_and_full(monkeypatch, scenario)
    _leaves_equal(go, wo)
    np.testing.assert_array_equal(np.asarray(gw), np.asarray(ww))
    assert gspec == wspec == P(None, jr.MODEL_AXIS)
