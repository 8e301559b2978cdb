"""A PS worker on one device places the pulled parameters without a copy and forwards
the parameters its step returns unchanged: values bit for bit, never aliased memory
that anybody can write."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate._jax_compat import alias_host_arrays
from jreplicate.ps.closure import Closure, HostBatch
from jreplicate.ps.shard import Decision
from jreplicate.ps.worker import PSWorker
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

# Values an update by +0.0 would change (-0.0), or that must survive untouched.
SPECIAL = np.array([-0.0, 0.0, 1e-45, -1e-45, 3.4e38, -2.5, np.inf, -np.inf],
                   np.float32)


def _aligned(a: np.ndarray, writeable: bool = False) -> np.ndarray:
    """A copy of ``a`` at a 64-byte aligned address (as Ray's object store gives)."""
    raw = np.empty(a.nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    out.setflags(write=writeable)
    return out


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_])
def test_alias_host_arrays_aliases_only_read_only_arrays(dtype):
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    base = np.arange(24).reshape(4, 6).astype(dtype)
    read_only, writable = _aligned(base), _aligned(base, writeable=True)
    got_ro, got_w = alias_host_arrays([read_only, writable], sharding, device)
    for got in (got_ro, got_w):
        assert got.dtype == base.dtype and got.shape == base.shape
        np.testing.assert_array_equal(np.asarray(got), base)
    assert np.shares_memory(np.asarray(got_ro), read_only)  # CPU: no copy
    # A writable array is copied: changing it afterwards changes no jax value.
    writable[...] = np.zeros_like(base)
    np.testing.assert_array_equal(np.asarray(got_w), base)


def test_alias_host_arrays_canonicalises_dtypes_as_jax_does():
    device = jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = _aligned(np.linspace(0, 1, 8))  # float64, read-only
    (got,) = alias_host_arrays([x], sharding, device)
    want = jax.device_put(np.array(x), sharding)
    assert got.dtype == want.dtype  # float32 unless jax_enable_x64
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


class _Client:
    """One shard's answers, in memory: every pull returns ``params`` (read-only,
    aligned, as from Ray's object store); pushes are recorded."""

    token_gated = False
    ordered = False
    between_shards = None

    def __init__(self, params):
        self.params = params
        self.pushed = []
        self.shards = [self]

    def pull(self):
        return [0], self.params

    def push(self, push_id, worker, fetched, grads, attempt=0):
        self.pushed.append(grads)
        return Decision("applied", 0)

    def push_pull(self, push_id, worker, fetched, grads):
        self.pushed.append(grads)
        return Decision("applied", 0), [0], self.params


def _params():
    return {"w": _aligned(np.stack([SPECIAL, SPECIAL[::-1]])),
            "b": _aligned(np.array([-0.0, 1.5, -0.0], np.float32))}


def _loss(p, x):
    finite = jnp.where(jnp.isfinite(p["w"]), p["w"], 0.0)
    return jnp.sum(finite * jnp.sum(x)) + jnp.sum(jnp.tanh(p["b"]) * x[..., :3])


STEPS = {
    # name: (outputs from (p, u, o), whether they are the pulled params unchanged)
    "apply_updates": (lambda p, u, o: (optax.apply_updates(p, u), o), True),
    "params itself": (lambda p, u, o: (p, o), True),
    "updates added by hand": (lambda p, u, o: (jax.tree.map(jnp.add, p, u), o), True),
    "scaled params": (lambda p, u, o: (jax.tree.map(lambda a: a * 2.0, p), o), False),
    "updates only": (lambda p, u, o: (u, o), False),
    "both": (lambda p, u, o: ((optax.apply_updates(p, u), p), o), True),
}


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("reuse", [False, True])
def test_worker_outputs_are_the_step_exactly(name, reuse):
    outputs, unchanged = STEPS[name]
    params = _params()
    client = _Client(params)
    tx = jr.ps.pushable(optax.adam(1e-3))
    opt = jax.tree.map(np.asarray, tx.init(jax.tree.map(np.array, params)))
    worker = PSWorker(0, jax.devices()[:1], client, opt)
    worker.return_params = True

    def step(ctx, batch, p, o):
        g = jax.grad(_loss)(p, batch)
        u, o = tx.update(g, o, p)
        return outputs(p, u, o)

    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(1, 8)
    batch = HostBatch([[x]], jax.tree.structure(0))
    for i in range(3):  # the first runs compile; the later take the steady path
        out, decision = worker.run(Closure(i, step, True, batch, (None, None), 0, 1,
                                           fn_key=7, reuse=reuse and i > 0))
        assert decision.kind == "applied"
        new = out[0]
        if unchanged:
            for tree in new if name == "both" else (new,):
                for k in params:
                    # Bit for bit: -0.0 stays -0.0 (an update by +0.0 would flip it).
                    np.testing.assert_array_equal(_bits(tree[k]), _bits(params[k]))
                    assert np.shares_memory(np.asarray(tree[k]), params[k])  # no copy
        elif name == "scaled params":  # computed by XLA (which flushes subnormals)
            for k in params:
                np.testing.assert_array_equal(
                    np.asarray(new[k]), np.asarray(jax.jit(lambda a: a * 2.0)(params[k])))
        else:  # the zero updates: -0.0 everywhere, equal to zero
            for k in params:
                np.testing.assert_array_equal(np.asarray(new[k]), 0.0)
        # The pushed gradient is jax.grad's on one device, computed independently.
        want = jax.grad(_loss)(jax.tree.map(np.array, params), x)
        for k in params:
            np.testing.assert_array_equal(client.pushed[-1][k], np.asarray(want[k]))
    # The pulled arrays were never written (read-only memory stays as pulled).
    np.testing.assert_array_equal(_bits(params["w"]),
                                  _bits(np.stack([SPECIAL, SPECIAL[::-1]])))


def test_embedded_step_returns_the_pulled_parameters_bit_for_bit():
    """End to end: the parameters a step returns are the ones it pulled, -0.0 kept."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    init = {"w": jnp.asarray(SPECIAL), "b": jnp.asarray([-0.0, 2.0], jnp.float32)}
    with rep.scope():
        tx = jr.ps.pushable(optax.sgd(0.1))
        opt = tx.init(init)

    def step(ctx, p, o):
        g = jax.grad(lambda p: jnp.sum(jnp.where(jnp.isfinite(p["w"]), p["w"], 0.0))
                     + jnp.sum(p["b"]))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    first = rep.run(step, None, init, opt)
    second = rep.run(step, None, init, opt)
    rep.join()
    got, _ = first.fetch()
    for k in init:
        np.testing.assert_array_equal(_bits(got[k]), _bits(init[k]))
    got2, _ = second.fetch()  # pulled after one sgd step on the shard
    np.testing.assert_array_equal(np.asarray(got2["b"]),
                                  np.float32([-0.0, 2.0]) - np.float32(0.1))
    s.shutdown()


def test_numpy_written_after_run_or_scope_changes_no_ps_value():
    """Parameters given to the shards, the arguments and batch of a step scheduled for
    later, and rep.replicate: read when given (the caller may refill its arrays)."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
    rep = jr.Replicator(s)
    params = {"w": _aligned(np.ones(64, np.float32), writeable=True),
              "v": _aligned(np.ones(32, np.float32), writeable=True)}
    with rep.scope():
        tx = jr.ps.pushable(optax.sgd(0.0))
        opt = tx.init(params)
    arg = _aligned(np.full(8, 3.0, np.float32), writeable=True)
    batch = _aligned(np.full((1, 8), 5.0, np.float32), writeable=True)
    replicated = rep.replicate(arg)

    def step(ctx, batch, p, o, x):
        g = jax.tree.map(jnp.zeros_like, p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u)["w"][0], x, batch

    import jreplicate.testing as jrt
    jrt.set_worker_delay(s, 0, 0.3)  # the step runs after the arrays are refilled
    value = rep.run(step, batch, params, opt, arg)
    for a in (params["w"], params["v"], arg, batch):
        a[...] = -1.0
    rep.join()
    w0, x, b = value.fetch()
    assert float(w0) == 1.0
    np.testing.assert_array_equal(x, 3.0)
    np.testing.assert_array_equal(np.asarray(b), 5.0)
    np.testing.assert_array_equal(s.parameters()["w"], 1.0)
    np.testing.assert_array_equal(s.parameters()["v"], 1.0)
    np.testing.assert_array_equal(np.asarray(replicated), 3.0)
    s.shutdown()


def test_donate_argnums_under_the_ps_warns_once_and_changes_nothing():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"w": jnp.ones(4)}
        tx = jr.ps.pushable(optax.sgd(0.5))
        opt = tx.init(params)

    def step(ctx, p, o):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        return optax.apply_updates(p, u), o

    with pytest.warns(UserWarning, match=r"donate_argnums=\(0, 1\)\) has no effect"):
        first = rep.run(step, None, params, opt, donate_argnums=(0, 1))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per strategy
        rep.run(step, None, params, opt, donate_argnums=(0, 1))
    rep.join()
    assert not params["w"].is_deleted()  # the caller's arrays are not donated
    np.testing.assert_array_equal(np.asarray(first.fetch()[0]["w"]), 1.0)
    np.testing.assert_array_equal(s.parameters()["w"], 0.0)
    s.shutdown()
