"""Checkpoints where features meet.

* ``ParameterServerStrategy.restore(state)`` took any state with the right number of
  shards: another placement raised a bare ``KeyError`` after the live shards were shut
  down, and another dtype, shape or optimizer was loaded silently (a bfloat16 job went on
  in float32, adam's state was fed to sgd).
* Orbax names an array by its keys joined with ``"."``: ``{"a.b": x, "a": {"b": y}}``
  was saved as one array (the save said it wrote), and restore then called the
  checkpoint damaged.
* 64-bit leaves (Python numbers, NumPy float64/int64) with ``jax_enable_x64`` off were
  saved as 64-bit, so no ``init_fn`` could restore them (``jax.eval_shape`` gives 32-bit),
  and the error asked for the impossible.
* A donated (deleted) array, or a zero-size one, given to ``save`` raised JAX's or
  Orbax's words without the path or the fix.
* Across processes the restored state was broadcast with a sum (``-0.0`` came back
  ``+0.0``) and placed with ``device_put``, whose equality check across processes
  fails on NaN: a state holding a NaN could not be restored at all.

Every restored value is compared bit for bit with what was saved.
"""

from __future__ import annotations

import errno
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.checkpoint import CheckpointError, CheckpointManager
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)


@pytest.fixture(scope="module")
def rep():
    return jr.Replicator(jr.MirroredStrategy())


def _bits(got, want):
    """Whether two pytrees hold the same leaves, bit for bit, dtype and shape alike."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got) != len(want):
        return False
    for g, w in zip(got, want, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes():
            return False
    return True


def _roundtrip(path, rep, state, init_fn=None):
    with CheckpointManager(path, rep) as m:
        m.save(1, state)
    with CheckpointManager(path, rep) as m:
        return m.restore_or_initialize(init_fn or (lambda: state))


# -- every dtype JAX holds comes back bit for bit -----------------------------------------
def _odd_values():
    return {
        "f32": np.array([-0.0, np.inf, -np.inf, 1e-45], np.float32),
        "nan": np.array([0x7FC00001, 0xFFC00000], np.uint32).view(np.float32),
        "bf16": np.array([-0.0, 3.0, np.nan], ml_dtypes.bfloat16),
        "f16": np.array([65504.0, -0.0], np.float16),
        "fp8": np.array([448.0, -0.0], ml_dtypes.float8_e4m3fn),
        "i4": np.array([-8, 7], ml_dtypes.int4),
        "i8": np.array([-128, 127], np.int8),
        "u32": np.array([2**32 - 1, 2**31], np.uint32),
        "bool": np.array([True, False]),
        "c64": np.array([-0.0 - 0.0j, 1j], np.complex64),
        "scalar": np.array(7, np.int32),
        "none": None,
        "empty": {},
    }


def test_odd_dtypes_and_values_come_back_bit_for_bit(tmp_path, rep):
    want = _odd_values()
    step, got = _roundtrip(tmp_path, rep, want)
    assert step == 1 and _bits(got, want)
    assert got["none"] is None and got["empty"] == {}


# -- Orbax's names: keys joined with "." ----------------------------------------------------
def test_keys_that_orbax_would_store_under_one_name_are_an_error_at_save(tmp_path, rep):
    state = {"a.b": jnp.array([1.0]), "a": {"b": jnp.array([2.0])}}
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(ValueError, match=re.escape(
                "['a']['b'] and ['a.b'] would be stored under one name, 'a.b'")):
            m.save(1, state)
        assert m.complete_steps() == []  # nothing that cannot be restored was written
    ok = {"a.b": jnp.array([1.0]), "c": {"b": jnp.array([2.0])}}  # dots alone are fine
    assert _bits(_roundtrip(tmp_path / "ok", rep, ok)[1], ok)


# -- 64-bit leaves with jax_enable_x64 off -------------------------------------------------
def test_python_numbers_are_saved_as_jax_holds_them(tmp_path, rep):
    state = {"w": jnp.arange(3.0), "lr": 0.5, "n": 3, "flag": True}
    step, got = _roundtrip(tmp_path, rep, state)
    assert step == 1
    assert got["lr"].dtype == jnp.float32 and float(got["lr"]) == 0.5
    assert got["n"].dtype == jnp.int32 and int(got["n"]) == 3
    assert got["flag"].dtype == jnp.bool_ and bool(got["flag"])
    with CheckpointManager(tmp_path / "big", rep) as m, pytest.raises(
            ValueError, match=r"\['n'\] holds 8589934592 \(int64\), which does not fit int32"):
        m.save(1, {"n": 2**33})


def test_a_64_bit_numpy_leaf_is_an_error_at_save_naming_the_fix(tmp_path, rep):
    assert not jax.config.jax_enable_x64
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(ValueError, match=re.escape(
                "['w'] is float64, which JAX holds as float32 while jax_enable_x64 is off: "
                "no init_fn() could restore it")):
            m.save(1, {"w": np.arange(3.0)})
        assert m.complete_steps() == []
        m.save(1, {"w": np.arange(3.0, dtype=np.float32)})


def test_a_64_bit_checkpoint_names_jax_enable_x64_on_restore(tmp_path, rep):
    """A checkpoint holding float64 (e.g. written with jax_enable_x64 on, or by Orbax)."""
    import orbax.checkpoint as ocp
    with ocp.CheckpointManager(tmp_path, item_handlers=ocp.StandardCheckpointHandler()) as m:
        m.save(3, args=ocp.args.StandardSave({"w": np.arange(3.0)}))
        m.wait_until_finished()
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(CheckpointError, match=re.escape(
                "['w'] is float64[3] in the checkpoint, which JAX holds only with "
                "jax_enable_x64 on: enable it before any JAX work "
                "(jax.config.update('jax_enable_x64', True)) to restore it")):
            m.restore_or_initialize(lambda: {"w": np.zeros(3)})
        assert m.complete_steps() == [3]


# -- leaves save cannot take -----------------------------------------------------------------
def test_a_donated_array_is_an_error_naming_the_path_and_the_fix(tmp_path, rep):
    with rep.scope():
        w = {"w": jnp.ones(4), "b": jnp.zeros(2)}
    new = rep.run(lambda ctx, w: jax.tree.map(lambda x: x + 1, w), None, w, donate_argnums=0)
    assert w["w"].is_deleted()
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(ValueError, match=re.escape(
                "['w'] was donated (its buffer was deleted)")) as e:
            m.save(1, w)
        assert "save the state the step returned" in str(e.value)
        assert m.complete_steps() == []
        m.save(1, new)
        _, got = m.restore_or_initialize(lambda: w)
    assert _bits(got, jax.tree.map(np.asarray, new))


def test_a_zero_size_array_is_an_error_naming_the_path(tmp_path, rep):
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(ValueError, match=re.escape(
                "['bias'] has zero size (float32[0, 3])")):
            m.save(1, {"w": jnp.ones(2), "bias": jnp.zeros((0, 3))})
        assert m.complete_steps() == []


def test_a_full_disk_is_named(tmp_path, rep, monkeypatch):
    from etils import epath
    cls = type(epath.Path(str(tmp_path)))
    with CheckpointManager(tmp_path, rep, max_to_keep=2) as m:
        m.save(1, {"w": jnp.ones(2)})
        m.save(2, {"w": jnp.ones(2) * 2})
        m.wait_until_finished()  # written before the disk fills

        def full(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))

        with monkeypatch.context() as mp:
            mp.setattr(cls, "write_text", full)
            m.save(3, {"w": jnp.ones(2) * 3})  # written in the background: raised next
            with pytest.raises(CheckpointError, match=r"checkpoint 3 was not written: process "
                               r"0 failed \(cannot write to .*the disk is full .*Free space"):
                m.wait_until_finished()
        assert m.complete_steps() == [1, 2]  # max_to_keep kept both: nothing lost
        m.save(3, {"w": jnp.ones(2) * 3})  # space again: the same step writes
        m.wait_until_finished()
        assert m.complete_steps() == [2, 3]
        _, got = m.restore_or_initialize(lambda: {"w": jnp.zeros(2)})
    assert _bits(got, {"w": np.full(2, 3.0, np.float32)})


# -- ParameterServerStrategy.restore checks the state before it replaces the shards ----------
def _ps_job(placement="size_balanced", dtype=jnp.float32, shapes=((3,), (5,), (7,), (2,)),
            tx=lambda: optax.adam(0.1)):
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, placement=placement)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {f"p{i}": jnp.zeros(sh, dtype) for i, sh in enumerate(shapes)}
        t = jr.ps.pushable(tx())
        opt = t.init(w)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: sum(jnp.sum(v.astype(jnp.float32) * (i + 1))
                                   for i, v in enumerate(w.values())))(w)
        u, opt = t.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    return s, rep, w, opt, step


@pytest.mark.parametrize("other,match", [
    (dict(placement="round_robin"), r"the state's shard 0 holds \['2', '3'\], this "
                                    r"strategy's shard 0 \['0', '2'\]"),
    (dict(dtype=jnp.bfloat16), r"piece '.' is float32\[.\] in the state, bfloat16\[.\] here"),
    (dict(shapes=((3,), (5,), (7,), (3,))), r"piece '3' is float32\[2\] in the state, "
                                             r"float32\[3\] here"),
    (dict(tx=lambda: optax.sgd(0.1)), r"the state.s opt_state of shard . is .*this strategy.s "
                                      r"optimizer makes"),
])
def test_ps_restore_of_another_jobs_state_is_an_error_and_keeps_the_shards(other, match):
    s, rep, w, opt, step = _ps_job()
    for _ in range(4):
        rep.run(step, None, w, opt)
    rep.join()
    saved = jax.tree.map(np.array, s.state())
    s.shutdown()
    s2, rep2, w2, opt2, step2 = _ps_job(**other)
    for _ in range(3):
        rep2.run(step2, None, w2, opt2)
    rep2.join()
    mine = jax.tree.map(np.array, s2.state())
    with pytest.raises(ValueError, match=r"^restore\(state\): " + match):
        s2.restore(saved)
    # Nothing was replaced: the shards hold what they held, and training goes on.
    assert _bits(s2.state(), mine)
    rep2.run(step2, None, w2, opt2)
    rep2.join()
    assert s2.ledger()[0]["applied"] == 4
    s2.shutdown()


def test_ps_restore_of_its_own_state_still_restores_exactly():
    s, rep, w, opt, step = _ps_job()
    for _ in range(4):
        rep.run(step, None, w, opt)
    rep.join()
    saved = jax.tree.map(np.array, s.state())
    for _ in range(3):
        rep.run(step, None, w, opt)
    rep.join()
    s.restore(saved)
    assert _bits(s.state(), saved)
    s.shutdown()


# -- across processes: the chief's bits, not a sum of them ----------------------------------
def test_restore_across_processes_gives_the_bits_back_nan_included(tmp_path):
    from tests.test_multi_worker_processes import SCRIPTS, _launch
    r = _launch(["--nproc", "2", "--devices-per-proc", "2",
                 str(SCRIPTS / "checkpoint_bits.py"), "--dir", str(tmp_path)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = re.findall(r"\[p(\d)\] RESULT (\S+) (\w+)", r.stdout)
    assert len(results) == 2 * 2 * 10, r.stdout[-3000:]
    wrong = [(p, name) for p, name, same in results if same != "True"]
    assert not wrong, wrong


# -- NNX: a model with a Dropout stream and its nnx.Optimizer, interrupted and resumed -----
def _nnx_job(rep):
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    with rep.scope():
        model = Model(nnx.Rngs(0, dropout=1))
        opt = nnx.Optimizer(model, optax.adam(0.05), wrt=nnx.Param)
    x = jnp.arange(rep.num_replicas * 4 * 3, dtype=jnp.float32).reshape(
        rep.num_replicas, 4, 3) / 50

    def step(ctx, xb, model, opt):
        loss, g = nnx.value_and_grad(lambda m: jr.compute_average_loss(
            jnp.sum(m(xb) ** 2, -1), 4 * rep.num_replicas))(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    return model, opt, lambda: float(rep.run(step, None, jr.PerReplica(x), model, opt))


def test_nnx_model_with_dropout_and_optimizer_resume_bit_for_bit(tmp_path, rep):
    """The key of an nnx.Rngs cannot be saved (the error says what to save instead); its
    counts can, and restored into a model built with the same seeds the dropout stream
    goes on where it was: the resumed losses are the uninterrupted run's, bit for bit."""
    from flax import nnx
    model, opt, step = _nnx_job(rep)
    uninterrupted = [step() for _ in range(6)]

    model, opt, step = _nnx_job(rep)
    first = [step() for _ in range(3)]
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(TypeError, match=re.escape(
                "save nnx.state(model, nnx.Not(nnx.RngKey))")):
            m.save(3, {"model": nnx.state(model), "opt": nnx.state(opt)})
        saved = {"model": nnx.state(model, nnx.Not(nnx.RngKey)), "opt": nnx.state(opt)}
        m.save(3, saved)
    model, opt, step = _nnx_job(rep)  # a restart: the same seeds
    with CheckpointManager(tmp_path, rep) as m:
        at, got = m.restore_or_initialize(lambda: {
            "model": nnx.state(model, nnx.Not(nnx.RngKey)), "opt": nnx.state(opt)})
    assert at == 3 and _bits(got, saved)
    nnx.update(model, got["model"])
    nnx.update(opt, got["opt"])
    assert first + [step() for _ in range(3)] == uninterrupted


# -- sync_replicas saved mid-accumulation, after a device loop ---------------------------
def test_sync_replicas_state_mid_accumulation_resumes_exactly(tmp_path, rep):
    """Host driver: one of two gradients of a step accumulated when saved; restored, the
    second completes the step exactly as without the interruption."""
    tx = jr.sync_replicas(optax.adam(0.1), replicas_to_aggregate=2, total_num_replicas=3)
    params = {"w": jnp.arange(4.0)}
    state = tx.init(params)
    for g, s in ((1.0, 0), (2.0, 0), (3.0, 0), (4.0, 1)):  # a step, a backup, then one more
        _, state = tx.update({"w": jnp.full(4, g)}, state, params, local_step=s)
    assert int(state.num_accumulated) == 1 and int(state.global_step) == 1
    with CheckpointManager(tmp_path, rep) as m:
        m.save(1, (params, state))
    with CheckpointManager(tmp_path, rep) as m:
        _, (p2, s2) = m.restore_or_initialize(lambda: (params, tx.init(params)))
    assert _bits((p2, s2), jax.tree.map(np.asarray, (params, state)))
    assert type(s2) is type(state) and type(s2.tokens) is type(state.tokens)
    want = tx.update({"w": jnp.full(4, 5.0)}, state, params, local_step=1)
    got = tx.update({"w": jnp.full(4, 5.0)}, s2, p2, local_step=1)
    assert _bits(got, want) and int(got[1].global_step) == 2


def test_state_after_a_donating_device_loop_saves_and_resumes_exactly(tmp_path, rep):
    tx = optax.adam(0.1)
    x = np.arange(rep.num_replicas * 2 * 3, dtype=np.float32).reshape(-1, 3) / 10

    def init():
        p = {"w": jnp.ones(3)}
        return p, tx.init(p)

    def step(ctx, batch, p, o):
        g = jax.grad(lambda p: jr.compute_average_loss(
            (batch @ p["w"]) ** 2, x.shape[0]))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    def train(p, o, k):
        def batches():
            while True:
                yield x.reshape(rep.num_replicas, -1, 3)[0]
        it = rep.prepare_input(lambda ctx: batches())
        return rep.run(step, it, p, o, steps=k, donate_argnums=(0, 1))

    with rep.scope():
        p, o = init()
    p, o = train(p, o, 4)
    want = jax.tree.map(np.asarray, train(*jax.tree.map(jnp.array, (p, o)), 3))
    with CheckpointManager(tmp_path, rep) as m:
        m.save(4, (p, o))
    with CheckpointManager(tmp_path, rep) as m:
        at, (p2, o2) = m.restore_or_initialize(init)
    assert at == 4 and _bits((p2, o2), (p, o))
    assert _bits(train(p2, o2, 3), want)


# -- a save killed midway (SIGKILL: no handler runs) ----------------------------------------
_KILLED_MID_SAVE = """
import os, signal, sys
import numpy as np
from etils import epath
import jreplicate as jr
directory, target, nth = sys.argv[1], sys.argv[2], int(sys.argv[3])
m = jr.CheckpointManager(directory, jr.MirroredStrategy(), max_to_keep=2)
for s in (1, 2):
    m.save(s, {"w": np.full(3, s, np.float32), "n": np.array(s, np.int32)})
m.wait_until_finished()  # steps 1 and 2 committed; step 3's write is killed
cls = type(epath.Path(directory))
orig, calls = getattr(cls, target), [0]
def hook(self, *a, **k):
    calls[0] += 1
    if calls[0] == nth:
        print("DYING", self, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return orig(self, *a, **k)
setattr(cls, target, hook)
m.save(3, {"w": np.full(3, 3, np.float32), "n": np.array(3, np.int32)})
m.wait_until_finished()
print("SURVIVED", flush=True)
"""


@pytest.mark.parametrize("target,nth", [("write_text", 1), ("rename", 1), ("rename", 2)])
def test_a_save_killed_midway_loses_nothing_committed(tmp_path, rep, target, nth):
    import subprocess
    import sys

    from tests.test_multi_worker_processes import ROOT
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(tmp_path), target,
                        str(nth)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -9 and "DYING" in r.stdout, r.stdout + r.stderr[-3000:]
    with CheckpointManager(tmp_path, rep, max_to_keep=2) as m:
        assert m.complete_steps() == [1, 2]
        step, got = m.restore_or_initialize(
            lambda: {"w": np.zeros(3, np.float32), "n": np.array(0, np.int32)})
        assert step == 2 and _bits(got, {"w": np.full(3, 2, np.float32),
                                         "n": np.array(2, np.int32)})
        for s in (3, 4):
            m.save(s, {"w": np.full(3, s, np.float32), "n": np.array(s, np.int32)})
    names = sorted(os.listdir(tmp_path))
    assert names == ["3", "4"], names  # the debris went; max_to_keep kept the newest two


def test_a_step_older_than_the_newest_is_an_error_that_deletes_nothing(tmp_path, rep):
    """A run whose step count went back (it ignored the step restore_or_initialize
    returned): Orbax wrote the old step and deleted an older checkpoint for it under
    max_to_keep, and every restart restored the newest step, not the run's."""
    with CheckpointManager(tmp_path, rep, max_to_keep=2) as m:
        m.save(5, {"w": jnp.ones(2) * 5})
        m.save(6, {"w": jnp.ones(2) * 6})
        with pytest.raises(CheckpointError, match=re.escape(
                "checkpoint 1 is older than checkpoint 6 in")) as e:
            m.save(1, {"w": jnp.ones(2)})
        assert "Count steps on from the step restore_or_initialize returns" in str(e.value)
        assert m.complete_steps() == [5, 6]
        m.save(7, {"w": jnp.ones(2) * 7})
        m.wait_until_finished()
        assert m.complete_steps() == [6, 7]


def test_an_init_fn_that_cannot_be_traced_restores_what_it_initialised(tmp_path, rep):
    """Not traceable, returning NumPy float64: initialised as float32 (as JAX holds it),
    and its own checkpoint was then refused as "float32 in the checkpoint but init_fn()
    gives float64"."""
    def init():
        w = jnp.zeros(3)
        return {"w": np.asarray(w).astype(np.float64) + float(w.sum()), "lr": 0.5}

    with CheckpointManager(tmp_path, rep) as m:
        step, state = m.restore_or_initialize(init)
        assert step == 0 and state["w"].dtype == jnp.float32
        m.save(1, {"w": state["w"] + 1, "lr": state["lr"]})
    with CheckpointManager(tmp_path, rep) as m:
        step, got = m.restore_or_initialize(init)
    assert step == 1 and _bits(got, {"w": np.ones(3, np.float32), "lr": np.float32(0.5)})


def test_ps_restore_of_a_token_gated_state_of_another_configuration_is_an_error():
    def job(k):
        s = jr.ParameterServerStrategy(num_ps=2, num_workers=k, token_timeout=5)
        rep = jr.Replicator(s)
        with rep.scope():
            w = jnp.zeros(4)
            tx = jr.ps.pushable(jr.sync_replicas(optax.sgd(0.1), replicas_to_aggregate=k))
            opt = tx.init(w)

        def step(ctx, w, opt):
            u, opt = tx.update(jnp.ones(4), opt, w)
            return optax.apply_updates(w, u), opt
        return s, rep, w, opt, step

    s, rep, w, opt, step = job(2)
    for _ in range(4):
        rep.run(step, None, w, opt)
    rep.join()
    saved = s.state()
    s.shutdown()
    s2, rep2, w2, opt2, step2 = job(3)
    try:
        # (The saved job handed out 2 tokens per step, this one 3: its queue would run dry.)
        with pytest.raises(ValueError, match="replicas_to_aggregate"):
            s2.restore(saved)
        for _ in range(3):  # refused: the job's own shards go on
            rep2.run(step2, None, w2, opt2)
        rep2.join()
        assert s2.global_step == 1
    finally:
        s2.shutdown()
    s3, rep3, w3, opt3, step3 = job(2)  # the same configuration restores and goes on
    try:
        s3.restore(saved)
        g = s3.global_step
        for _ in range(2):
            rep3.run(step3, None, w3, opt3)
        rep3.join()
        assert s3.global_step == g + 1
    finally:
        s3.shutdown()
