"""sync_replicas, SPMD driver: every replica calls update together inside shard_map."""

import doctest
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate.sync.spmd
import jreplicate.sync.state
import jreplicate.sync.transform
from jreplicate.sync import (
    averaged_params,
    replica_grad,
    replica_value_and_grad,
    sync_replicas,
)


def _mesh(n):
    return jax.make_mesh((n,), ("replica",), devices=jax.devices()[:n])


def _shard(mesh, x):
    return jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("replica")))


def _init_mlp(key, sizes=(6, 16, 3)):
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        w = jax.random.normal(jax.random.fold_in(key, i), (a, b)) / np.sqrt(a)
        params.append({"w": w, "b": jnp.zeros(b)})
    return params


def _loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def _data(steps, n, b, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, n * b, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=(steps, n * b)).astype(np.int32)
    return x, y


@pytest.mark.parametrize("n", [2, 8])
def test_all_replicas_equals_one_device_on_global_batch(n):
    steps, b = 12, 4
    x, y = _data(steps, n, b)
    params0 = _init_mlp(jax.random.key(0))
    inner = optax.adam(3e-2)

    # one-device reference: plain adam on the concatenated global batch
    @jax.jit
    def ref_step(p, s, xb, yb):
        g = jax.grad(_loss)(p, xb, yb)
        u, s = inner.update(g, s, p)
        return optax.apply_updates(p, u), s

    p_ref, s_ref = params0, inner.init(params0)
    ema_ref = params0
    for t in range(steps):
        p_ref, s_ref = ref_step(p_ref, s_ref, x[t], y[t])
        ema_ref = jax.tree.map(lambda e, p: e - 0.5 * (e - p), ema_ref, p_ref)

    mesh = _mesh(n)
    tx = sync_replicas(inner, replicas_to_aggregate=n, variable_averages=0.5)

    def step(p, s, xb, yb):
        g = replica_grad(_loss)(p, xb, yb)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), P(), P("replica"), P("replica")), out_specs=(P(), P())
        )
    )
    p, s = params0, tx.init(params0)
    for t in range(steps):
        p, s = run(p, s, _shard(mesh, x[t]), _shard(mesh, y[t]))
    for a, r in zip(jax.tree.leaves(p), jax.tree.leaves(p_ref), strict=True):
        np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-6)
    assert int(s.global_step) == steps
    assert (int(s.dropped_backup), int(s.dropped_stale), int(s.num_accumulated)) == (0, 0, 0)
    for a, r in zip(jax.tree.leaves(averaged_params(s, p)), jax.tree.leaves(ema_ref), strict=True):
        np.testing.assert_allclose(a, r, rtol=2e-5, atol=2e-6)


def test_spmd_continues_gradients_pushed_by_the_host_driver():
    """A step started by host pushes is finished by an SPMD call (accumulators used)."""
    n = k = 4
    tx, call = _linear_step(n, k)
    w = jnp.zeros(3)
    state = tx.init(w)
    g0 = jnp.array([8.0, 0.0, -4.0])
    _, state = tx.update(g0, state, w)  # one host push: 3 more gradients needed
    assert int(state.num_accumulated) == 1
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    w, state = call(w, state, x, np.zeros(4, np.float32))
    # replicas 0-2 complete the step (ties: lower ids first); replica 3 is late and, with
    # no backup replicas configured, stale.
    np.testing.assert_allclose(w, -(g0 + x[0] + x[1] + x[2]) / 4, rtol=1e-6)
    assert (int(state.global_step), int(state.num_accumulated)) == (1, 0)
    assert (int(state.dropped_stale), int(state.dropped_backup)) == (1, 0)
    w2, state = call(w, state, x, np.zeros(4, np.float32))  # a fresh step: all four
    np.testing.assert_allclose(w2, w - x.mean(axis=0), rtol=1e-6)


@functools.cache
def _linear_step(n, k, total=None, with_local_step=False):
    """Compiled SPMD step on w with loss sum(w * x_i): replica i's gradient is x_i."""
    mesh = _mesh(n)
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=k, total_num_replicas=total)

    def step(w, s, x, t, ls):
        g = replica_grad(lambda w: jnp.sum(w * x[0]))(w)
        kw = {"local_step": ls[0]} if with_local_step else {}
        u, s = tx.update(g, s, w, arrival_time=t[0], **kw)
        return optax.apply_updates(w, u), s

    run = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("replica"), P("replica"), P("replica")),
            out_specs=(P(), P()),
        )
    )

    def call(w, s, x, t, ls=None):
        ls = np.zeros(n, np.int32) if ls is None else ls
        return run(w, s, _shard(mesh, x), _shard(mesh, t), _shard(mesh, ls))

    return tx, call


@settings(deadline=None, max_examples=30)
@given(
    k=st.sampled_from([1, 5, 8]),
    times=st.lists(st.lists(st.integers(0, 4), min_size=8, max_size=8), min_size=1, max_size=3),
)
def test_backups_fastest_replicas_contribute(k, times):
    n = 8
    tx, call = _linear_step(n, k)
    rng = np.random.default_rng(len(times))
    w = jnp.zeros(3)
    s = tx.init(w)
    w_ref = np.zeros(3)
    for t in times:
        x = rng.normal(size=(n, 3)).astype(np.float32)
        w, s = call(w, s, x, np.asarray(t, np.float32))
        fastest = np.argsort(np.asarray(t), kind="stable")[:k]  # ties: lower replica id
        w_ref = w_ref - x[fastest].mean(axis=0)
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    assert int(s.global_step) == len(times)
    assert int(s.dropped_backup) == (n - k) * len(times) and int(s.dropped_stale) == 0


def test_multi_batch_replicas_spmd():
    """2 replicas, 5 gradients per update: rounds of 2 fill the accumulators."""
    n, k = 2, 5
    tx, call = _linear_step(n, k)
    rng = np.random.default_rng(0)
    w, s = jnp.zeros(2), tx.init(jnp.zeros(2))
    w_ref, acc, pending_steps = np.zeros(2), [], []
    for r in range(7):
        x = rng.normal(size=(n, 2)).astype(np.float32)
        t = np.array([1.0, 0.0] if r % 2 else [0.0, 1.0], np.float32)
        w, s = call(w, s, x, t)
        for i in np.argsort(t, kind="stable"):
            if len(acc) < k:
                acc.append(x[i])
            if len(acc) == k:
                w_ref = w_ref - np.mean(acc, axis=0)
                acc = []
                pending_steps.append(r)
                break  # the slower replica of this round arrives after the update
        np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
        assert int(s.num_accumulated) == len(acc)
    # Updates at rounds 2 and 5 (5 gradients each); there the slower replica lost the
    # race and, as no backup replicas are configured, counts as stale.
    assert pending_steps == [2, 5] and int(s.global_step) == 2
    assert (int(s.dropped_stale), int(s.dropped_backup)) == (2, 0)


def test_stale_local_steps_in_spmd():
    n, k = 4, 2
    tx, call = _linear_step(n, k, with_local_step=True)
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    w, s = jnp.zeros(3), tx.init(jnp.zeros(3))
    # global step is 0; replicas 0 and 2 carry old tokens (-1: late for the step
    # before, so backups; -3: stale). Replicas 1 and 3 are fresh and contribute.
    w, s = call(w, s, x, np.zeros(4, np.float32), np.array([-1, 0, -3, 0], np.int32))
    np.testing.assert_allclose(w, -(x[1] + x[3]) / 2)
    assert int(s.global_step) == 1
    assert (int(s.dropped_backup), int(s.dropped_stale)) == (1, 1)


def test_late_gradients_after_the_update_are_stale_as_in_the_host_driver():
    n, k = 4, 2
    tx, call = _linear_step(n, k, total=n, with_local_step=True)  # 2 backups a step
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    ls = np.array([0, 0, -1, -1], np.int32)
    t = np.array([2.0, 0.0, 3.0, 1.0], np.float32)  # arrival order: 1, 3, 0, 2
    w, s = call(jnp.zeros(3), tx.init(jnp.zeros(3)), x, t, ls)
    # Replica 3 (late for the step before) arrives before replica 0 completes the step:
    # a backup. Replica 2 arrives after the update, two steps late: stale.
    np.testing.assert_allclose(w, -(x[0] + x[1]) / 2)
    assert (int(s.global_step), int(s.dropped_backup), int(s.dropped_stale)) == (1, 1, 1)
    # The host driver, fed the same pushes in arrival order, counts the same.
    wh, sh = jnp.zeros(3), tx.init(jnp.zeros(3))
    for r in np.argsort(t):
        u, sh = tx.update(jnp.asarray(x[r]), sh, wh, local_step=int(ls[r]))
        wh = optax.apply_updates(wh, u)
    np.testing.assert_allclose(wh, w)
    assert (int(sh.dropped_backup), int(sh.dropped_stale)) == (1, 1)


def test_summed_gradients_are_rejected():
    mesh = _mesh(4)
    tx = sync_replicas(optax.sgd(1.0), 4)

    def step(w, s, x):
        g = jax.grad(lambda w: jnp.sum(w * x))(w)  # summed over replicas by JAX
        return tx.update(g, s, w)

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica")), out_specs=(P(), P()))
    )
    with pytest.raises(ValueError, match=r"already SUMMED.*replica_value_and_grad"):
        run(jnp.zeros(()), tx.init(jnp.zeros(())), _shard(mesh, jnp.arange(4.0)))


def test_total_num_replicas_must_match_axis():
    mesh = _mesh(4)
    tx = sync_replicas(optax.sgd(1.0), 2, total_num_replicas=3)

    def step(w, s, x):
        return tx.update(replica_grad(lambda w: jnp.sum(w * x))(w), s, w)

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica")), out_specs=(P(), P()))
    )
    with pytest.raises(ValueError, match="pass total_num_replicas=4 or None"):
        run(jnp.zeros(()), tx.init(jnp.zeros(())), _shard(mesh, jnp.arange(4.0)))


def test_arrival_time_must_be_scalar():
    mesh = _mesh(2)
    tx = sync_replicas(optax.sgd(1.0), 2)

    def step(w, s, x):
        return tx.update(replica_grad(lambda w: jnp.sum(w * x))(w), s, w, arrival_time=x)

    run = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica")), out_specs=(P(), P()))
    )
    with pytest.raises(ValueError, match="arrival_time must be a scalar"):
        run(jnp.zeros(2), tx.init(jnp.zeros(2)), _shard(mesh, jnp.ones((2, 2))))


def test_replica_grad_helpers_give_own_gradient():
    mesh = _mesh(4)

    def f(w, x):
        return jnp.sum(w * x), x.sum()

    def step(w, x):
        (v, aux), g = replica_value_and_grad(f, has_aux=True)(w, x)
        g2, aux2 = replica_grad(f, has_aux=True)(w, x)
        return v[None], g, g2, aux2[None]

    x = jnp.arange(8.0).reshape(4, 2)
    for check_vma in (True, False):
        run = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P(), P("replica")),
                out_specs=(P("replica"), P("replica"), P("replica"), P("replica")),
                check_vma=check_vma,
            )
        )
        v, g, g2, aux = run(jnp.ones(2), _shard(mesh, x))
        np.testing.assert_allclose(g, x.reshape(-1))
        np.testing.assert_allclose(g2, x.reshape(-1))
        np.testing.assert_allclose(v, x.sum(axis=1))
        np.testing.assert_allclose(aux, x.sum(axis=1))
    # outside a replica context: plain jax.value_and_grad
    v, g = replica_value_and_grad(lambda w: jnp.sum(w * 3.0))(jnp.ones(2))
    assert float(v) == 6.0 and g.tolist() == [3.0, 3.0]


def test_through_replicator():
    import jreplicate as jr

    if not hasattr(jr, "Replicator"):
        pytest.skip("jreplicate.Replicator not available")
    n, k, steps = 8, 6, 5
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(steps, n, 3)).astype(np.float32)
    ts = rng.permutation(np.tile(np.arange(n, dtype=np.float32), (steps, 1)).T).T

    rep = jr.Replicator(jr.MirroredStrategy())
    tx = sync_replicas(optax.sgd(0.5), replicas_to_aggregate=k)
    with rep.scope():
        w = jnp.zeros(3)
        state = tx.init(w)

    def step(ctx, batch, w, state):
        x, t = batch
        g = replica_grad(lambda w: jnp.sum(w * x), axis_name=ctx.axis_name)(w)
        u, state = tx.update(g, state, w, arrival_time=t)
        return optax.apply_updates(w, u), state

    w_ref = np.zeros(3)
    for i in range(steps):
        batch = (jr.PerReplica(jnp.asarray(xs[i])), jr.PerReplica(jnp.asarray(ts[i])))
        w, state = rep.run(step, batch, w, state)
        fastest = np.argsort(ts[i], kind="stable")[:k]
        w_ref = w_ref - 0.5 * xs[i][fastest].mean(axis=0)
    assert not isinstance(w, jr.PerReplica)
    np.testing.assert_allclose(np.asarray(w), w_ref, rtol=1e-5, atol=1e-6)
    assert int(state.global_step) == steps and int(state.dropped_backup) == (n - k) * steps


@pytest.mark.parametrize(
    "module", [jreplicate.sync.state, jreplicate.sync.spmd, jreplicate.sync.transform]
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_replicated_arrival_schedule_matches_per_replica_times_without_a_gather():
    """A vector of every replica's arrival time, the same on all replicas, selects the
    same fastest replicas as per-replica scalars, and needs no all-reduce for it."""
    n, k = 8, 6
    mesh = _mesh(n)
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=k)

    def step(w, s, x, times):
        g = replica_grad(lambda w: jnp.sum(w * x[0]))(w)
        u, s = tx.update(g, s, w, arrival_time=times)
        return optax.apply_updates(w, u), s

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica"), P()),
                                out_specs=(P(), P())))
    _, per_replica = _linear_step(n, k)
    rng = np.random.default_rng(3)
    w_vec = w_sc = jnp.zeros(3)
    s_vec = s_sc = tx.init(w_vec)
    for _ in range(3):
        x = rng.normal(size=(n, 3)).astype(np.float32)
        t = rng.exponential(size=n).astype(np.float32)
        w_vec, s_vec = run(w_vec, s_vec, _shard(mesh, x), jnp.asarray(t))
        w_sc, s_sc = per_replica(w_sc, s_sc, x, t)
        np.testing.assert_allclose(w_vec, w_sc, rtol=1e-6)
    assert int(s_vec.dropped_backup) == int(s_sc.dropped_backup) == 3 * (n - k)

    def step_scalar(w, s, x, times):
        return step(w, s, x, times[0])

    run_scalar = jax.jit(jax.shard_map(step_scalar, mesh=mesh,
                                       in_specs=(P(), P(), P("replica"), P("replica")),
                                       out_specs=(P(), P())))

    def all_reduces(fn, times):
        hlo = fn.lower(w_vec, s_vec, _shard(mesh, x), times).as_text()
        return hlo.count("all_reduce") + hlo.count("all-reduce")

    assert all_reduces(run, jnp.asarray(t)) < all_reduces(run_scalar, _shard(mesh, t))


def test_arrival_vector_errors():
    n = 4
    mesh = _mesh(n)
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=3)

    def step(w, s, x, times):
        g = replica_grad(lambda w: jnp.sum(w * x[0]))(w)
        return tx.update(g, s, w, arrival_time=times)

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica"), P()),
                                out_specs=(P(), P())))
    w = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"shape \(3,\).*\(4,\)"):
        run(w, tx.init(w), _shard(mesh, np.ones((n, 3), np.float32)), jnp.zeros(3))


# -- arrival order with NaN, infinities, ties and -0.0 (issue 15, item 7) --------------

_N = 8
_ODD_TIMES = (np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 2.5, -3.0, np.float32(1e30),
              np.float32(-2.4e-41))  # subnormal: compares equal to 0.0 on the device


@functools.cache
def _onehot_step(k, vector, with_local_step):
    """Compiled step on w of shape (8,): replica i's gradient is the one-hot e_i, so the
    sum of the averaged gradients says exactly which replicas were selected."""
    mesh = _mesh(_N)
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=k)

    def step(w, s, t, ls):
        me = jax.lax.axis_index("replica")
        g = replica_grad(lambda w: jnp.sum(w * (jnp.arange(_N) == me)))(w)
        kw = {"local_step": ls[0]} if with_local_step else {}
        u, s = tx.update(g, s, w, arrival_time=t if vector else t[0], **kw)
        return u, s

    run = jax.jit(jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P() if vector else P("replica"), P("replica")),
        out_specs=(P(), P())))

    def call(t, ls):
        w = jnp.zeros(_N)
        t = jnp.asarray(t) if vector else _shard(mesh, t)
        return run(w, tx.init(w), t, _shard(mesh, ls))

    return call


def _reference_selection(t, fresh, k):
    """numpy: the documented order (-inf, numbers, +inf, NaN; ties by replica id;
    subnormal times equal 0.0, as XLA flushes denormals to zero); the first k fresh
    replicas in it."""
    t = np.where(np.abs(t) < np.finfo(np.float32).tiny, np.float32(0.0), t)
    nan = np.isnan(t)
    order = np.lexsort((np.arange(len(t)), np.where(nan, 0.0, t), nan))
    chosen = np.zeros(len(t))
    chosen[[i for i in order if fresh[i]][:k]] = 1.0
    return chosen


@settings(max_examples=40, deadline=None)
@given(
    times=st.lists(st.sampled_from(_ODD_TIMES) | st.floats(width=32), min_size=_N,
                   max_size=_N),
    fresh=st.lists(st.booleans(), min_size=_N, max_size=_N),
    k=st.sampled_from([1, 3, _N]),
    vector=st.booleans(),
    with_local_step=st.booleans(),
)
def test_any_arrival_times_select_exactly_the_first_fresh_replicas(
        times, fresh, k, vector, with_local_step):
    """Whatever the arrival times (NaN, +-inf, ties, -0.0), exactly min(k, fresh)
    gradients are averaged in: the first fresh ones in the documented total order."""
    t = np.array(times, np.float32)
    fresh = np.array(fresh) if with_local_step else np.ones(_N, bool)
    ls = np.where(fresh, 0, -3).astype(np.int32)  # -3: stale
    u, s = _onehot_step(k, vector, with_local_step)(t, ls)
    want = _reference_selection(t, fresh, k)
    assert want.sum() == min(k, fresh.sum())
    if fresh.sum() >= k:  # the step completes: sgd(1.0) of the average
        np.testing.assert_array_equal(np.asarray(u) * -k, want)
        assert (int(s.global_step), int(s.num_accumulated)) == (1, 0)
    else:  # still waiting: the accepted gradients are in the accumulators
        np.testing.assert_array_equal(np.asarray(u), 0.0)
        np.testing.assert_array_equal(np.asarray(s.accumulators), want)
        assert (int(s.global_step), int(s.num_accumulated)) == (0, fresh.sum())


@pytest.mark.parametrize("vector", [False, True])
def test_nan_arrival_time_known_at_trace_time_is_an_error(vector):
    mesh = _mesh(4)
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=2)
    times = np.array([0.0, np.nan, 1.0, 2.0], np.float32)

    def step(w, s):
        g = replica_grad(lambda w: jnp.sum(w * jax.lax.axis_index("replica")))(w)
        return tx.update(g, s, w, arrival_time=times if vector else np.float32(np.nan))

    run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P()), out_specs=(P(), P())))
    where = r" at replica\(s\) \[1\]" if vector else ""
    with pytest.raises(ValueError, match=rf"arrival_time is NaN{where}.*\+inf"):
        run(jnp.zeros(()), tx.init(jnp.zeros(())))
