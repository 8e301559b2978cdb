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
    ((entry,),) = [f.steady.values() for f in rep._executor._cache.entries()]
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



@pytest.mark.parametrize("runs", [True, False], ids=["after-running", "before-running"])
def test_an_nnx_step_failing_at_run_time_keeps_or_names_the_consumed_state(
        rep, monkeypatch, runs):
    with rep.scope():
        m = _Net()
    for _ in range(2):
        rep.run(_nnx_step, None, m)
    ((entry,),) = [f.steady.values() for f in rep._executor._cache.entries()]
    real = entry.jitted

    def fails(*a):
        if runs:  # the program ran (and took the donated state), then failed
            jax.block_until_ready(real(*a))
        raise RuntimeError("RESOURCE_EXHAUSTED: simulated")

    monkeypatch.setattr(entry, "jitted", fails)
    with pytest.raises(RuntimeError, match="simulated") as info:
        rep.run(_nnx_step, None, m)
    notes = "".join(getattr(info.value, "__notes__", []))
    if runs:
        assert "the module was consumed" in notes and "nnx.clone" in notes
        with pytest.raises(ValueError, match="NNX module's state"):
            rep.run(_nnx_step, None, m)
    else:
        assert notes == ""
        np.testing.assert_array_equal(np.asarray(m.w.get_value()), np.arange(4.0) + 2)
        monkeypatch.undo()
        rep.run(_nnx_step, None, m)
        np.testing.assert_array_equal(np.asarray(m.w.get_value()), np.arange(4.0) + 3)


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


# -- item 3: donation never destroys an array another live object holds -----------------

class _Net(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(4.0))
        self.b = nnx.Param(jnp.ones(2))


def _nnx_step(ctx, m):
    m.w[...] = m.w[...] + 1.0
    m.b[...] = m.b[...] * 2.0
    return jnp.sum(m.w[...])


_HOLDERS = {
    "clone": lambda m: nnx.clone(m),                          # a best-model copy, a teacher
    "reference": lambda m: (m.w.get_value(), m.b.get_value()),  # teacher = model's arrays
    "ema-dict": lambda m: {"w": m.w.get_value(), "b": m.b.get_value()},
}


def _values(held):
    if isinstance(held, nnx.Module):
        held = (held.w.get_value(), held.b.get_value())
    elif isinstance(held, dict):
        held = (held["w"], held["b"])
    return [np.asarray(x) for x in held]


def _strategy(kind):
    if kind == "logical":
        return jr.MirroredStrategy(devices=jax.local_devices()[:4],
                                   logical_devices_per_replica=2)
    return jr.MirroredStrategy(devices=jax.local_devices()[:2])


@pytest.mark.parametrize("placement", ["replicated", "logical", "logical-variables"])
@pytest.mark.parametrize("mode", ["single", "steady-state", "full-path", "device-loop"])
@pytest.mark.parametrize("holder", sorted(_HOLDERS))
def test_nnx_donation_never_destroys_arrays_another_object_holds(
        holder, mode, placement, monkeypatch):
    rep = jr.Replicator(_strategy("logical" if placement != "replicated" else "plain"))
    if mode == "full-path":
        monkeypatch.setattr(fast, "_ARRAY", None)
    if placement == "logical-variables":
        with rep.logical_device_for_variables(1):
            m = _Net()
    else:
        with rep.scope():
            m = _Net()
    steps, k = (3, 3) if mode == "device-loop" else (None, 1)
    calls = 1 if mode == "single" else 3
    for _ in range(2):  # bring the call to steady state before the holder appears
        rep.run(_nnx_step, None, m, steps=steps)
    done = 2 * k
    held = _HOLDERS[holder](m)
    for _ in range(calls):
        rep.run(_nnx_step, None, m, steps=steps)
    np.testing.assert_array_equal(_values(held)[0], np.arange(4.0) + done)
    np.testing.assert_array_equal(_values(held)[1], np.ones(2) * 2.0 ** done)
    done += calls * k
    np.testing.assert_array_equal(np.asarray(m.w.get_value()), np.arange(4.0) + done)
    np.testing.assert_array_equal(np.asarray(m.b.get_value()), np.ones(2) * 2.0 ** done)


def test_an_unshared_nnx_state_is_still_donated_on_every_path(rep, monkeypatch, counted):
    copies = []
    real = jnp.copy
    from jreplicate.execution import donation
    monkeypatch.setattr(donation, "jnp", type("J", (), {"copy": staticmethod(
        lambda x: copies.append(x.shape) or real(x))}))
    with rep.scope():
        m = _Net()
    for steps in (None, 2):
        for _ in range(3):
            buffers = [s.data.unsafe_buffer_pointer() for s in m.w.get_value().addressable_shards]
            rep.run(_nnx_step, None, m, steps=steps)
            assert [s.data.unsafe_buffer_pointer()
                    for s in m.w.get_value().addressable_shards] == buffers
    assert copies == [] and counted["hit"] == 2  # (device loops take the full path)
    teacher = nnx.clone(m)
    rep.run(_nnx_step, None, m)
    assert sorted(copies) == [(2,), (4,)]  # copies of the shared leaves, once
    rep.run(_nnx_step, None, m)
    assert len(copies) == 2 and not teacher.w.get_value().is_deleted()


def _sgd(ctx, p):
    return jax.tree.map(lambda x: x - 1.0, p), jnp.sum(jax.tree.leaves(p)[0])


@pytest.mark.parametrize("kind", ["leaf-reference", "same-dict", "shallow-copy",
                                  "per-replica"])
@pytest.mark.parametrize("mode", ["single", "steady-state", "full-path", "device-loop"])
def test_donate_argnums_never_destroys_arrays_another_object_holds(rep, kind, mode,
                                                                  monkeypatch):
    if mode == "full-path":
        monkeypatch.setattr(fast, "_ARRAY", None)
    steps, k = (3, 3) if mode == "device-loop" else (None, 1)
    if kind == "per-replica":
        p = jr.PerReplica(jax.device_put(
            np.zeros((rep.num_replicas, 3), np.float32),
            jax.sharding.NamedSharding(rep.mesh, jax.sharding.PartitionSpec("replica"))),
            rep.mesh)
    else:
        p = rep.replicate({"w": jnp.zeros(3), "v": jnp.ones(2)})
    for _ in range(2):
        p, _ = rep.run(_sgd, None, p, steps=steps, donate_argnums=0)
    held = {"leaf-reference": lambda: p["w"], "same-dict": lambda: p,
            "shallow-copy": lambda: dict(p), "per-replica": lambda: p}[kind]()
    def w(tree):
        tree = tree["w"] if isinstance(tree, dict) else tree
        return np.asarray(tree.array if isinstance(tree, jr.PerReplica) else tree)

    expect = np.full_like(w(held), -2 * k)
    for _ in range(1 if mode == "single" else 3):
        p, _ = rep.run(_sgd, None, p, steps=steps, donate_argnums=0)
    np.testing.assert_array_equal(w(held), expect)
    calls = 3 if mode == "single" else 5
    np.testing.assert_array_equal(w(p), np.full_like(expect, -calls * k))


# -- item 8: dropped step functions hold no memory --------------------------------------

def test_a_dropped_step_function_leaves_no_program_behind(rep):
    """The steady-state path's entries held each step function's compiled program (and
    what its trace captured) until 256 entries had accumulated."""
    import gc
    w = rep.replicate(jnp.ones(3))

    def make(c):
        def step(ctx, w):
            return w + jnp.sum(c)
        return step

    for i in range(3):
        step = make(np.full(1000, float(i), np.float32))
        for _ in range(2):
            np.testing.assert_array_equal(np.asarray(rep.run(step, None, w)),
                                          np.full(3, 1.0 + 1000.0 * i))
        del step
        gc.collect()
        assert rep._executor._cache.entries() == []
        assert len(rep._executor._cache) == 0


def test_dropped_step_functions_hold_at_most_1_5x_what_jax_jit_functions_hold():
    """RSS of a fresh process (bench/memory_per_step_fn.py), after gc.collect() and
    malloc_trim(0): 40 step functions each closing over 4 MiB, run once and dropped, hold
    no more than 1.5x what 40 jax.jit functions hold, plus 4 MiB of measurement noise
    (each leaked program costs ~0.6 MiB here)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import json, sys; sys.path.insert(0, 'bench'); import memory_per_step_fn as m; "
            "print(json.dumps(m.measure(40, 4.0, rounds=1)))")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    jit, run, grown = json.loads(out.stdout.strip().splitlines()[-1])
    assert run <= 1.5 * jit + 4.0, (run, jit)
    assert grown == [0, 0], grown  # no compiled program and no array outlives its step


@pytest.mark.parametrize("placement", ["model-sharded", "logical-variables"])
def test_donate_argnums_with_logical_devices_keeps_what_another_object_holds(placement):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    rep = jr.Replicator(_strategy("logical"))
    if placement == "model-sharded":
        p = {"w": jax.device_put(np.zeros((4, 4), np.float32),
                                 NamedSharding(rep.mesh, P(None, jr.MODEL_AXIS)))}
    else:
        with rep.scope(), rep.logical_device_for_variables(1):
            p = {"w": jnp.zeros((4, 4))}
    for _ in range(2):
        p, _ = rep.run(_sgd, None, p, donate_argnums=0)
    teacher = p["w"]
    for _ in range(2):
        p, _ = rep.run(_sgd, None, p, donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(teacher), np.full((4, 4), -2.0))
    np.testing.assert_array_equal(np.asarray(p["w"]), np.full((4, 4), -4.0))
