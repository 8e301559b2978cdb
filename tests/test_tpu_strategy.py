"""TPUStrategy on CPU devices (passed explicitly), mixed precision, cross-replica batch norm."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr
from jreplicate.strategies.tpu import tpu_mesh
from tests._optional import needs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_without_tpus_it_names_the_alternatives():
    with pytest.raises(ValueError, match=r"found no TPU devices.*8 cpu.*MirroredStrategy.*"
                                         r"devices=jax.devices\(\)"):
        jr.TPUStrategy()


def test_layout_from_make_mesh_with_logical_devices():
    s = jr.TPUStrategy(devices=jax.devices(), logical_devices_per_replica=2)
    assert s.mesh.axis_names == ("replica", "model")
    assert dict(s.mesh.shape) == {"replica": 4, "model": 2}
    assert all(t == jax.sharding.AxisType.Auto for t in s.mesh.axis_types)
    assert s.steps_per_run is None
    with pytest.raises(ValueError, match=r"8 devices per slice do not factor.*1, 2, 4, 8"):
        jr.TPUStrategy(devices=jax.devices(), logical_devices_per_replica=3)
    with pytest.raises(ValueError, match=r"steps_per_run=0\) must be an int >= 1"):
        jr.TPUStrategy(devices=jax.devices(), steps_per_run=0)
    with pytest.raises(ValueError, match=r"lists a device twice"):
        jr.TPUStrategy(devices=[jax.devices()[0]] * 2)


class _FakeTPU:
    """Just enough of a TPU device for mesh_utils: two slices of four chips."""

    platform, device_kind, core_on_chip = "tpu", "TPU v4", 0

    def __init__(self, i):
        self.id, self.slice_index, self.process_index = i, i // 4, i // 4
        self.coords = (i % 2, (i // 2) % 2, 0)

    def __repr__(self):
        return f"tpu{self.id}"


def test_multi_slice_mesh_puts_the_slices_outermost():
    devices = [_FakeTPU(i) for i in range(8)]
    mesh = tpu_mesh(devices, 2)
    grid = np.asarray(mesh.devices)
    assert grid.shape == (4, 2)
    # Replicas 0-1 on slice 0, 2-3 on slice 1: a replica never crosses DCN.
    assert [{d.slice_index for d in row} for row in grid] == [{0}, {0}, {1}, {1}]
    with pytest.raises(ValueError, match=r"4 devices per slice do not factor"):
        tpu_mesh(devices, 3)


def test_steps_per_run_makes_run_a_device_loop():
    rep = jr.Replicator(jr.TPUStrategy(devices=jax.devices()[:4], steps_per_run=3))
    data = [np.full((2,), i, np.float32) for i in range(7)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA)

    def step(ctx, batch, total):
        return total + ctx.all_sum(jnp.sum(batch)), ctx.all_sum(jnp.sum(batch))

    total = jnp.float32(0)
    sizes = []
    for _ in range(3):
        total, per_step = rep.run(step, inputs, total)
        sizes.append(per_step.shape[0])
    assert sizes == [3, 3, 1]
    assert float(total) == 4 * 2 * sum(range(7))
    # steps= overrides the strategy's default; run(fn) without input is one step.
    assert rep.run(lambda ctx: ctx.all_sum(1.0)).shape == ()


def _load_example(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs("sklearn")
def test_mixed_precision_example_keeps_float32_state_and_learns():
    mp = _load_example("mixed_precision")
    params, opt, losses, acc = mp.train(steps=60, steps_per_run=10)
    assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    assert {a.dtype for a in jax.tree.leaves(opt)} <= {jnp.dtype("float32"), jnp.dtype("int32")}
    assert len(losses) == 60 and losses[-1] < 0.5 * losses[0]
    assert acc > 0.85
    # The bfloat16 forward pass tracks the float32 one closely.
    _, _, losses32, acc32 = mp.train(steps=60, steps_per_run=10, dtype=jnp.float32)
    np.testing.assert_allclose(losses[:5], losses32[:5], rtol=3e-2)
    assert abs(acc - acc32) < 0.05


def _global_batch(n, per, d=3, seed=0):
    return np.random.default_rng(seed).normal(2.0, 3.0, size=(n, per, d)).astype(np.float32)


@pytest.mark.parametrize("strategy_fn", [
    lambda: jr.MirroredStrategy(),
    lambda: jr.TPUStrategy(devices=jax.devices(), logical_devices_per_replica=2),
])
def test_nnx_batch_norm_over_the_replica_axis_equals_the_global_batch(strategy_fn):
    from flax import nnx
    rep = jr.Replicator(strategy_fn())
    n, per = rep.num_replicas, 4
    x = _global_batch(n, per)
    with rep.scope():
        bn = nnx.BatchNorm(3, axis_name=jr.REPLICA_AXIS, momentum=0.5, rngs=nnx.Rngs(0))
    ref = nnx.BatchNorm(3, momentum=0.5, rngs=nnx.Rngs(0))
    inputs = rep.prepare_input(lambda ctx: iter([x[ctx.input_pipeline_id]] * 2),
                               jr.InputReplicationMode.PER_REPLICA)
    for _ in range(2):
        out = rep.run(lambda ctx, xb, bn: bn(xb), inputs, bn)
        want = ref(x.reshape(n * per, 3))
    got = np.concatenate([np.asarray(out[r]) for r in range(n)])
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(bn.mean[...]), np.asarray(ref.mean[...]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(bn.var[...]), np.asarray(ref.var[...]), rtol=1e-5)


def global_batch_norm(ctx, x, eps=1e-5):
    """The Replicator design's global batch normalisation, through all_sum."""
    local_mean = jnp.mean(x, axis=0)
    local_sq_mean = jnp.mean(jnp.square(x), axis=0)
    mean, sq_mean = ctx.all_sum([local_mean / ctx.num_replicas_in_sync,
                                 local_sq_mean / ctx.num_replicas_in_sync])
    var = sq_mean - jnp.square(mean)
    return (x - mean) * jax.lax.rsqrt(var + eps)


def test_rfc_global_batch_norm_through_all_sum():
    rep = jr.Replicator(jr.MirroredStrategy())
    n, per = rep.num_replicas, 5
    x = _global_batch(n, per, seed=1)
    out = rep.run(global_batch_norm, jr.PerReplica(jnp.asarray(x)))
    flat = x.reshape(n * per, 3).astype(np.float64)
    want = (flat - flat.mean(0)) / np.sqrt(flat.var(0) + 1e-5)
    got = np.concatenate([np.asarray(out[r]) for r in range(n)])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
