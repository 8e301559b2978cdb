"""Hardening of run's execution (issue 15): a step that fails at run time runs once; a
NumPy argument is read at the call; device loops promote NNX state like separate runs;
donation never destroys an array another live object holds."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jreplicate as jr
from jreplicate.execution import fast


@pytest.fixture
def rep():
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))


def _iterator(rep, n, prefetch):
    data = [np.full((rep.num_replicas, 2), float(i), np.float32) for i in range(n)]
    return rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA,
                             prefetch_on_device=prefetch)


# -- item 6: a step that fails at run time runs once -------------------------------------

def test_a_step_failing_while_running_on_the_steady_state_path_runs_once(rep, monkeypatch):
    """The steady-state path used to catch every exception of the compiled call and run
    the step again on the full path (its callbacks and I/O twice). A run-time failure
    that run itself raises (on CPU most surface later, when a result is read; on GPU an
    out-of-memory error is raised by the call) is simulated by a program that runs and
    then raises."""
    calls = []

    def step(ctx, w):
        jax.debug.callback(lambda: calls.append(1))
        return w + 1.0

    w = rep.replicate(jnp.zeros(3))
    for _ in range(2):
        w = rep.run(step, None, w)
    jax.effects_barrier()
    (entry,) = rep._executor._fast._entries.values()
    real = entry.jitted

    def runs_then_fails(*a):
        jax.block_until_ready(real(*a))
        jax.effects_barrier()
        raise RuntimeError("RESOURCE_EXHAUSTED: simulated failure while running")

    monkeypatch.setattr(entry, "jitted", runs_then_fails)
    calls.clear()
    with pytest.raises(RuntimeError, match="simulated failure while running"):
        rep.run(step, None, w)
    jax.effects_barrier()
    assert len(calls) == rep.num_replicas  # once per replica: one run, not two


def test_a_callback_raising_at_run_time_runs_once_and_its_error_reaches_the_user(rep):
    calls = []

    def cb(x):
        calls.append(1)
        if len(calls) > 2 * rep.num_replicas:
            raise RuntimeError("callback failed")
        return x

    def step(ctx, w):
        y = jax.pure_callback(cb, jax.ShapeDtypeStruct(w.shape, w.dtype), w)
        return y + 1.0

    w = rep.replicate(jnp.zeros(3))
    for _ in range(2):
        w = rep.run(step, None, w)
    with pytest.raises(Exception, match="callback failed"):
        np.asarray(rep.run(step, None, w))
    assert len(calls) == 3 * rep.num_replicas
    assert not fast.retrace_guarded()


# -- item 5: a NumPy argument is read at the call ----------------------------------------

def _aligned(n):
    """A float32 array whose memory a CPU device array may alias (64-byte aligned)."""
    raw = np.empty(n + 16, np.float32)
    k = (-raw.ctypes.data % 64) // 4
    out = raw[k:k + n]
    out[:] = 1.0
    return out


def _gated_step(gates):
    """A step that waits for ``gates[0]`` before it reads its last argument ``a``."""
    def wait(x):
        gates[0].wait(timeout=5)
        return x

    def step(ctx, *args):
        a = args[-1]
        z = jax.pure_callback(wait, jax.ShapeDtypeStruct((), jnp.float32), jnp.float32(0))
        return (a, jnp.sum(a + z))

    return step


@pytest.mark.parametrize("steps", [None, 3], ids=["one-step", "device-loop"])
@pytest.mark.parametrize("inputs", ["none", "iterator", "prefetch"])
def test_refilling_a_numpy_argument_after_run_returns_never_changes_the_step(
        rep, steps, inputs):
    n = 4096
    gates = [None]
    step = _gated_step(gates)
    for call in range(3):  # the first call builds the program; later ones reuse it
        a = _aligned(n)
        gate = gates[0] = threading.Event()
        it = None if inputs == "none" else _iterator(rep, 6, inputs == "prefetch")
        out = rep.run(step, it, a, steps=steps)
        a[:] = 999.0  # the caller refills its buffer while the step may not have run
        gate.set()
        a_out, total = (np.asarray(x) for x in out)
        np.testing.assert_array_equal(a_out, np.ones_like(a_out), err_msg=f"call {call}")
        np.testing.assert_array_equal(total, np.full_like(total, float(n)))


# -- item 4: NNX state whose dtype a step changes: a device loop equals K runs -----------

class _Counter(nnx.Module):
    def __init__(self, dtype):
        self.count = nnx.Variable(jnp.zeros((), dtype))
        self.w = nnx.Param(jnp.ones(3, jnp.bfloat16))


def _promote(ctx, m):
    m.count.set_value(m.count.get_value() + 0.5)         # int32 -> float32 at the first step
    m.w.set_value(m.w.get_value() + jnp.float32(1e-3)) # bf16 -> float32 at the first step
    return m.count.get_value() + jnp.sum(m.w.get_value())


def _promote_batch(ctx, x, m):
    return _promote(ctx, m) + jnp.sum(x)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("with_input", [False, True])
def test_a_device_loop_promotes_nnx_state_as_separate_runs_do(rep, k, with_input):
    def make():
        with rep.scope():
            return _Counter(jnp.int32)

    step = _promote_batch if with_input else _promote
    separate, loop = make(), make()
    it_a = _iterator(rep, 2 * k, False) if with_input else None
    it_b = _iterator(rep, 2 * k, False) if with_input else None
    for _ in range(2):  # the second time from the promoted state (a float32 program)
        outs = [rep.run(step, it_a, separate) for _ in range(k)]
        got = rep.run(step, it_b, loop, steps=k)
        for name in ("count", "w"):
            a, b = getattr(separate, name).get_value(), getattr(loop, name).get_value()
            assert a.dtype == b.dtype == jnp.float32, name
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        np.testing.assert_array_equal(  # per replica: [replicas, K]
            np.asarray(got), np.stack([np.asarray(o) for o in outs], axis=-1))


def test_a_step_changing_nnx_state_dtype_at_every_step_is_an_error_naming_it(rep):
    class Grow(nnx.Module):
        def __init__(self):
            self.h = nnx.Variable(jnp.zeros((1,), jnp.float32))

    def step(ctx, m):
        m.h.set_value(jnp.concatenate([m.h.get_value(), m.h.get_value()]))  # a new shape each step
        return jnp.sum(m.h.get_value())

    with rep.scope():
        m = Grow()
    with pytest.raises(ValueError, match=r"argument \[0\]\.h .*float32\[2\] -> "
                                         r"float32\[4\].*one dtype and shape"):
        rep.run(step, None, m, steps=3)
    assert m.h.get_value().shape == (1,)  # nothing ran, nothing written back
