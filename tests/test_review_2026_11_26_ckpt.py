"""Review of 2026-11-26: checkpoints where features meet.

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

        def full(self, *a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))

        with monkeypatch.context() as mp:
            mp.setattr(cls, "write_text", full)
            with pytest.raises(CheckpointError, match=r"could not write checkpoint 3: .*"
                                                      r"the disk is full .*Free space"):
                m.save(3, {"w": jnp.ones(2) * 3})
        assert m.complete_steps() == [1, 2]  # max_to_keep kept both: nothing lost
        m.save(3, {"w": jnp.ones(2) * 3})  # space again: the same step writes
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
    assert len(results) == 2 * 2 * 8, r.stdout[-3000:]
    wrong = [(p, name) for p, name, same in results if same != "True"]
    assert not wrong, wrong
