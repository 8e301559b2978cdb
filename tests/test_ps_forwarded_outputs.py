"""The PS worker's aliasing and forwarding (a worker on one device
places the pulled parameters without a copy and forwards ``params + zero updates``) and
of copying every NumPy array handed to the library (jax 0.12 on CPU aliases an aligned
NumPy array in ``device_put``).

Each test builds its reference independently (numpy, or the values pulled before the
step) and compares bit for bit where the result must be exact.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import local_ray  # noqa: F401 (one Ray for the module)


def _aligned(a: np.ndarray) -> np.ndarray:
    """A writable copy of ``a`` at a 64-byte aligned address (JAX on CPU aliases it)."""
    a = np.asarray(a)
    raw = np.empty(a.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _same_bits(got, want) -> None:
    got_l, want_l = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_l) == len(want_l)
    for g, w in zip(got_l, want_l):
        assert np.asarray(g).dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(_bits(g), _bits(w))


def _refill(tree, value) -> None:
    for x in jax.tree.leaves(tree):
        if isinstance(x, np.ndarray) and x.dtype.kind == "f":
            x[...] = value


# -- forwarding: only outputs that are a parameter plus the zero updates ------------------

# No subnormals: XLA on CPU flushes them where it computes, numpy does not.
_A = np.array([-0.0, 0.0, 1.5, -2.5, 3.0, -0.0, 7.0, 0.25], np.float32)
_B = np.array([20.0, -0.0, 8.0, -0.5, -7.5, 4.5, 0.0, -0.0], np.float32)


def _variants(p, u, g):
    """Outputs that must be computed (or forwarded to the right input) exactly."""
    add = lambda a, b: a + b  # noqa: E731
    f, uf = {k: p[k] for k in "ab"}, {k: u[k] for k in "ab"}
    return {
        "cross": {"a": p["b"] + u["a"], "b": p["a"] + u["b"]},  # another leaf's zeros
        "u_plus_p": jax.tree.map(add, u, p),
        "half": jax.tree.map(lambda a, b: a + 0.5 * b, f, uf),
        "doubled": optax.apply_updates(jax.tree.map(lambda a: a * 2.0, f), uf),
        "twice": (optax.apply_updates(p, u), optax.apply_updates(p, u)),
        "plus_u_u": jax.tree.map(lambda a, b: a + b + b, p, u),
        "mixed": {"a": p["a"] + u["a"], "b": p["b"] * 3.0},
        "u_plus_u_plus_p": jax.tree.map(lambda a, b: (b + b) + a, p, u),
        "plus_grads": jax.tree.map(add, p, g),  # not zeros: computed
    }


_GRADS = {"a": np.arange(8, dtype=np.float32), "b": np.ones(8, np.float32),
          "h": np.ones(8, ml_dtypes.bfloat16), "n": np.ones(8, np.int32)}


def _variants_numpy(p):
    f = {k: p[k] for k in "ab"}
    return {
        "cross": {"a": p["b"], "b": p["a"]},
        "u_plus_p": p, "half": f,
        "doubled": {k: v * np.float32(2) for k, v in f.items()},
        "twice": (p, p), "plus_u_u": p,
        "mixed": {"a": p["a"], "b": p["b"] * np.float32(3)},
        "u_plus_u_plus_p": p,
        "plus_grads": {k: v + _GRADS[k] for k, v in p.items()},
    }


@pytest.mark.parametrize("group", [1, 2])
def test_forwarded_outputs_are_the_step_outputs_exactly(group):
    """A worker on one device forwards ``p + zeros`` to the pulled ``p``; over a sync
    group of two the outputs are computed (the parameters donated). Either way each
    variant equals numpy on the parameters the step pulled, bit for bit, and the
    values fetched at once are still those after more steps ran (nothing aliased is
    ever written)."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1, num_replicas_in_sync=group,
                                   placement="round_robin")
    rep = jr.Replicator(s)
    init = {"a": jnp.asarray(_A), "b": jnp.asarray(_B),
            "h": jnp.asarray(_A, jnp.bfloat16), "n": jnp.arange(8, dtype=jnp.int32)}
    with rep.scope():
        tx = jr.ps.pushable(optax.sgd(0.25))
        opt = tx.init(init)

    def step(ctx, p, o):
        g = {k: jnp.asarray(v) for k, v in _GRADS.items()}
        u, o = tx.update(g, o, p)
        return _variants(p, u, g), o

    held = []
    for _ in range(3):
        pulled = jax.tree.map(np.array, s.parameters())
        value = rep.run(step, None, init, opt)
        rep.join()
        got, _ = value.fetch()
        _same_bits(got, _variants_numpy(pulled))
        held.append((value, jax.tree.map(np.array, got)))
    for _ in range(3):  # more pushes: the shards' parameters move on
        rep.run(step, None, init, opt)
    rep.join()
    for value, first in held:
        _same_bits(value.fetch()[0], first)
    s.shutdown()


@pytest.mark.parametrize("group", [1, 2])
def test_complex_parameters_come_back_bit_for_bit(group):
    """The zero updates are -0.0 in both parts of a complex value: p + u is p bit for
    bit where it is computed (a sync group of 2) as where it is forwarded (one device);
    -0.0 + 0.0j turned a -0.0 imaginary part into +0.0."""
    vals = np.array([complex(-0.0, -0.0), complex(1.0, -0.0), complex(-0.0, 2.0), 3 + 4j],
                    np.complex64)
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=group)
    rep = jr.Replicator(s)
    init = {"c": jnp.asarray(vals)}
    with rep.scope():
        tx = jr.ps.pushable(optax.sgd(0.1))
        opt = tx.init(init)

    def step(ctx, p, o):
        u, o = tx.update({"c": jnp.ones(4, jnp.complex64)}, o, p)
        return optax.apply_updates(p, u)

    value = rep.run(step, None, init, opt)
    rep.join()
    _same_bits(value.fetch()["c"], vals)
    s.shutdown()


def test_a_per_replica_argument_plus_zeros_stays_per_replica():
    """Over a sync group of 2, a PerReplica argument plus the zero updates (varying:
    never forwarded to a replicated input) is each replica's own value, -0.0 kept."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=2)
    rep = jr.Replicator(s)
    with rep.scope():
        init = jnp.ones(4)
        tx = jr.ps.pushable(optax.sgd(0.1))
        opt = tx.init(init)
    q = np.array([[-0.0, 1, 2, 3], [4, 5, -0.0, 7]], np.float32)

    def step(ctx, p, o, q):
        u, o = tx.update(jnp.ones(4), o, p)
        return q + u, optax.apply_updates(q, u), p + u

    value = rep.run(step, None, init, opt, jr.PerReplica(q))
    rep.join()
    _same_bits(value.fetch(), (q, q, np.ones(4, np.float32)))
    s.shutdown()


@pytest.mark.parametrize("group", [1, 2])
def test_arguments_returned_unchanged_keep_the_steps_dtypes(group):
    """A step returning some of its arguments unchanged gives what the same step gives
    under MirroredStrategy: the arguments as the step saw them (JAX's dtypes; the PS
    worker put back the runtime value itself, a Python scalar or a float64 array)."""
    args = (0.5, 3, True, np.arange(3, dtype=np.float64), np.arange(2, dtype=np.int64),
            [1.0, 2])
    got = {}
    for name, strategy in (
            ("ps", jr.ParameterServerStrategy(num_ps=1, num_workers=1,
                                              num_replicas_in_sync=group)),
            ("mirrored", jr.MirroredStrategy(devices=list(range(group))))):
        rep = jr.Replicator(strategy)
        with rep.scope():
            init = jnp.ones(4)
            tx = jr.ps.pushable(optax.sgd(0.1))
            opt = tx.init(init)

        def step(ctx, p, o, *rest, tx=tx):
            tx.update(jnp.ones(4), o, p)
            return rest

        out = rep.run(step, None, init, opt, *args)
        if name == "ps":
            rep.join()
            out = out.fetch()
            strategy.shutdown()
        got[name] = [np.asarray(x) for x in jax.tree.leaves(out)]
    for a, b in zip(got["ps"], got["mirrored"], strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("gated", [False, True])
def test_split_leaf_and_token_gated_outputs_are_numpy_sgd(gated):
    """A leaf split over two shards (the pull joins it: a writable copy, placed by a
    copy) next to a scalar aliased from a shard, asynchronous or token-gated: each
    step's returned and pulled parameters equal numpy SGD bit for bit, -0.0 kept."""
    a, g = np.resize(_A, 4096), np.resize(np.float32([0, 1, 0, 2, 3, 0, 1, 4]), 4096)
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1, placement="size_balanced",
                                   min_slice_bytes=1024)
    rep = jr.Replicator(s)
    init = {"a": jnp.asarray(a), "s": jnp.float32(-0.0)}
    with rep.scope():
        inner = optax.sgd(0.25)
        tx = jr.ps.pushable(jr.sync_replicas(inner, replicas_to_aggregate=1,
                                             total_num_replicas=1) if gated else inner)
        opt = tx.init(init)
    assert len(s.placement.parts) == 3  # "a" in two slices

    def step(ctx, p, o):
        u, o = tx.update({"a": jnp.asarray(g), "s": jnp.float32(0.0)}, o, p)
        return optax.apply_updates(p, u), p

    values = [rep.run(step, None, init, opt) for _ in range(5)]
    rep.join()
    p = {"a": a, "s": np.float32(-0.0)}
    for v in values:
        _same_bits(v.fetch(), (p, p))
        p = {"a": p["a"] + np.float32(-0.25) * g, "s": p["s"]}
    s.shutdown()


# -- NumPy arrays handed to the library are read when given --------------------------------

def _adam_job():
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1, placement="round_robin")
    rep = jr.Replicator(s)
    init = {"a": jnp.ones(64), "b": jnp.full(32, 2.0)}
    with rep.scope():
        tx = jr.ps.pushable(optax.adam(0.1))
        opt = tx.init(init)

    def step(ctx, p, o):
        g = jax.grad(lambda p: jnp.sum(p["a"]) + jnp.sum(p["b"] ** 2))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    return s, rep, init, opt, step


def test_restore_reads_the_callers_numpy_state_when_given():
    """strategy.restore(state) copies a NumPy state: the embedded shards aliased it
    (host_shard_state's np.asarray, then device_put), so refilling it changed their
    parameters."""
    s, rep, init, opt, step = _adam_job()
    for _ in range(2):
        rep.run(step, None, init, opt)
    rep.join()
    saved = jax.tree.map(np.array, s.state())
    mine = jax.tree.map(_aligned, saved)
    s.restore(mine)
    restored = jax.tree.map(np.array, s.parameters())
    _refill(mine, 77.0)
    _same_bits(s.parameters(), restored)
    # Training goes on from the saved state, as a restore of an untouched copy does.
    for _ in range(2):
        rep.run(step, None, init, opt)
    rep.join()
    got = s.parameters()
    s.restore(jax.tree.map(np.array, saved))
    for _ in range(2):
        rep.run(step, None, init, opt)
    rep.join()
    _same_bits(got, s.parameters())
    s.shutdown()


def test_restart_shard_reads_the_callers_numpy_state_when_given():
    """restart_shard(i, state) copies the shard's NumPy state (it aliased it, as
    restore did)."""
    s, rep, init, opt, step = _adam_job()
    rep.run(step, None, init, opt)
    rep.join()
    saved = jax.tree.map(np.array, s.state())
    mine = jax.tree.map(_aligned, saved)
    jrt.kill_shard(s, 1)
    with pytest.raises(jr.ps.ParameterServerError):
        rep.run(step, None, init, opt)
        rep.join()
    s.restart_shard(1, mine)
    restored = jax.tree.map(np.array, s.parameters())
    _refill(mine, 77.0)
    _same_bits(s.parameters(), restored)
    s.shutdown()


def test_ps_per_replica_numpy_batch_is_read_when_scheduled():
    """A PerReplica batch holding the caller's NumPy array is copied when the step is
    scheduled (np.asarray kept the array: refilled before the step ran, the step
    read the new values)."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    init = jnp.ones(4)
    with rep.scope():
        tx = jr.ps.pushable(optax.sgd(0.0))
        opt = tx.init(init)

    def step(ctx, batch, p, o):
        tx.update(jnp.zeros_like(p), o, p)
        return batch

    batch = _aligned(np.full((1, 64), 5.0, np.float32))
    jrt.set_worker_delay(s, 0, 0.3)  # the step runs after the array is refilled
    value = rep.run(step, jr.PerReplica(batch), init, opt)
    batch[...] = -1.0
    rep.join()
    got = value.fetch()
    np.testing.assert_array_equal(np.asarray(getattr(got, "array", got)), 5.0)
    s.shutdown()


def test_workers_optimizer_state_after_restore_is_the_registered_one():
    """The optimizer state a PS worker passes to the step is the one registered in
    ``rep.scope()`` (read then), before and after ``strategy.restore`` (which rebuilt
    the workers from the caller's state object as it was then)."""
    held = _aligned(np.full(64, 5.0, np.float32))
    base = optax.GradientTransformation(lambda p: {"k": held}, lambda u, s, p=None: (u, s))
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        init = jnp.ones(64)
        tx = jr.ps.pushable(base)
        opt = tx.init(init)

    def step(ctx, p, o):
        u, o = tx.update(jnp.ones(64), o, p)
        return o["k"] * 1.0

    s.restore(s.state())
    held[...] = -1.0
    value = rep.run(step, None, init, opt)
    rep.join()
    np.testing.assert_array_equal(value.fetch(), 5.0)
    s.shutdown()


def test_ps_nnx_numpy_state_is_read_when_scheduled():
    """An NNX module whose state holds the caller's NumPy array (a BatchStat): the
    scheduled step sees the values as of ``run``, as under MirroredStrategy (the PS
    executor kept the array itself: the step read the refilled values)."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(4))
            self.stat = nnx.BatchStat(_aligned(np.full(64, 5.0, np.float32)))

    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        model = Model()
        optimizer = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)

    def step(ctx, model, optimizer):
        optimizer.update(model, nnx.grad(lambda m: jnp.sum(m.w[...]))(model))
        return model.stat[...]

    jrt.set_worker_delay(s, 0, 0.3)  # the step runs after the array is refilled
    value = rep.run(step, None, model, optimizer)
    model.stat.get_value()[...] = -1.0
    rep.join()
    np.testing.assert_array_equal(value.fetch(), 5.0)
    s.shutdown()


# -- Ray: outputs of aliased, pipelined steps ---------------------------------------------

_G = np.array([0.0, 1.0, 0.0, 2.0, 3.0, 0.0, 1.0, 4.0], np.float32)
# Pieces of one shard each: one inline chunk (its bytes are aliased), several inline
# chunks (joined: a copy), and one through Ray's object store (aliased).
_SIZES = {"a": 8, "b": 50_000, "c": 300_000}


def _tiled(x: np.ndarray, n: int) -> np.ndarray:
    return np.resize(x, n)


def _sgd_outputs(carrier: str, n: int) -> list:
    """``n`` steps on one worker (on Ray two are in flight: the second starts from the
    parameters the first's push returned), every value fetched after the last ran."""
    s = jr.ParameterServerStrategy(num_ps=3, num_workers=1, carrier=carrier,
                                   placement="round_robin")
    rep = jr.Replicator(s)
    init = {k: jnp.asarray(_tiled(_A, m)) for k, m in _SIZES.items()}
    with rep.scope():
        tx = jr.ps.pushable(optax.sgd(0.25))
        opt = tx.init(init)

    def step(ctx, p, o):
        u, o = tx.update({k: jnp.asarray(_tiled(_G, m)) for k, m in _SIZES.items()}, o, p)
        return optax.apply_updates(p, u), p, jax.tree.map(lambda x: x * 2.0, p)

    values = [rep.run(step, None, init, opt) for _ in range(n)]
    rep.join()
    out = [v.fetch() for v in values]
    s.shutdown()
    return out


@pytest.mark.usefixtures("local_ray")
def test_ray_outputs_equal_the_embedded_carriers_bit_for_bit():
    """A Ray worker on one device aliases the arrays a pull returns and forwards the
    returned parameters; its outputs, held on the worker for every step until fetched
    at the end, equal the embedded carrier's and numpy's SGD bit for bit."""
    n = 10
    ray_out, embedded = _sgd_outputs("ray", n), _sgd_outputs("embedded", n)
    p = {k: _tiled(_A, m) for k, m in _SIZES.items()}
    for k in range(n):
        _same_bits(ray_out[k], embedded[k])
        _same_bits(ray_out[k], (p, p, {key: v * np.float32(2) for key, v in p.items()}))
        p = {key: v + np.float32(-0.25) * _tiled(_G, v.size) for key, v in p.items()}
