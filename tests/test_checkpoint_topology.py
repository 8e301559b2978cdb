"""Checkpoints restored onto another topology (one process, 8 simulated devices).

State saved from a 4x2 ("replica", "model") mesh, sharded P('replica'), P(None,
'model'), P('replica', 'model'), replicated, and NumPy leaves, restores onto 8, 4, 2x2
and 1 device: bit for bit equal to the NumPy references, on the shardings asked for
(``shardings=``), or replicated by default. Damage to a format-2 step (a changed data
file, deleted data files, a truncated manifest, a flipped byte) moves it aside only when an
older step restores, and the error names the array or its box; a target that does not
divide a leaf is refused naming it; a format-1 directory written by jreplicate before
issue 31 (``tests/data/checkpoint_format1.tar.gz``) still restores. The class: hypothesis
draws leaves (dtypes stored as they are and as their bits, NumPy or sharded any way on
any of the topologies) and targets on any other, and every one restores bit for bit on
its target.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tarfile

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate.checkpoint import CheckpointError, CheckpointManager
from tests.data.make_checkpoint_format1 import state as format1_state

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SPECS = {"rows": P("replica"), "cols": P(None, "model"), "both": P("replica", "model"),
         "rep": P()}


def reference(step: int) -> dict:
    rng = np.random.default_rng(step)
    # Large enough that OCDBT keeps the data in the process's files, not inline.
    out = {k: rng.standard_normal((64, 32)).astype(np.float32) for k in SPECS}
    out["bf16"] = rng.standard_normal((64, 16)).astype(ml_dtypes.bfloat16)
    out["host"] = {"count": np.array(step, np.int32),
                   "table": rng.integers(0, 9, (3, 5)).astype(np.int8)}
    return out


def _abstract(step: int = 0) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), reference(step))


def _saved_state(strategy, step: int) -> dict:
    ref = reference(step)
    out = {k: jax.device_put(ref[k], NamedSharding(strategy.mesh, SPECS[k])) for k in SPECS}
    out["bf16"] = jax.device_put(ref["bf16"], NamedSharding(strategy.mesh, P("replica")))
    out["host"] = ref["host"]  # NumPy leaves
    return out


def _save(path, steps=(1,)) -> None:
    strategy = jr.MirroredStrategy(logical_devices_per_replica=2)  # 4 x 2
    with CheckpointManager(path, strategy) as m:
        for step in steps:
            assert m.save(step, _saved_state(strategy, step), force=True)


def _bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _assert_equal(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.dtype(g.dtype) == w.dtype and g.shape == w.shape
        assert _bits(g) == _bits(w)


TOPOLOGIES = {
    "8": lambda: jr.MirroredStrategy(),
    "4": lambda: jr.MirroredStrategy(devices=jax.devices()[:4]),
    "2x2": lambda: jr.MirroredStrategy(devices=jax.devices()[4:], logical_devices_per_replica=2),
    "1": lambda: jr.MirroredStrategy(devices=[3]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("topology") / "ckpt"
    _save(path, steps=(1, 2))
    return path


@pytest.mark.parametrize("name", sorted(TOPOLOGIES))
def test_restores_bit_for_bit_on_the_shardings_asked_for(saved, tmp_path, name):
    strategy = TOPOLOGIES[name]()
    mesh = strategy.mesh
    axes = set(mesh.axis_names)
    wanted = {k: NamedSharding(mesh, spec if set(a for a in spec if a) <= axes else P())
              for k, spec in SPECS.items()}
    wanted["bf16"] = NamedSharding(mesh, P("replica"))
    wanted["host"] = NamedSharding(mesh, P())
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    with CheckpointManager(path, strategy) as m:
        step, state = m.restore_or_initialize(_abstract, shardings=wanted)
        assert step == 2
        _assert_equal(state, reference(2))
        for k in SPECS:
            assert state[k].sharding == wanted[k], (k, state[k].sharding)
        assert state["bf16"].sharding == wanted["bf16"]
        assert state["host"]["table"].sharding == wanted["host"]
    with CheckpointManager(path, strategy) as m:  # by default: replicated on the mesh
        step, state = m.restore_or_initialize(_abstract)
        _assert_equal(state, reference(2))
        for leaf in jax.tree.leaves(state):
            assert leaf.sharding.is_fully_replicated
            assert set(leaf.sharding.device_set) == set(mesh.devices.flat)


def test_a_prefix_of_shardings_and_shape_dtype_structs_are_accepted(saved, tmp_path):
    strategy = TOPOLOGIES["4"]()
    rows = NamedSharding(strategy.mesh, P("replica"))
    target = jax.ShapeDtypeStruct((64, 32), np.float32, sharding=rows)
    shutil.copytree(saved, tmp_path / "ckpt")
    with CheckpointManager(tmp_path / "ckpt", strategy) as m:
        _, state = m.restore_or_initialize(_abstract, shardings={
            "rows": target, "cols": rows, "both": None, "rep": None, "bf16": rows,
            "host": None})
    assert state["rows"].sharding == rows and state["cols"].sharding == rows
    assert state["both"].sharding.is_fully_replicated
    shard = state["rows"].addressable_shards[0]
    assert shard.data.shape == (16, 32)  # a quarter of the rows per device, not all of them
    _assert_equal(state, reference(2))


def test_a_target_that_does_not_divide_a_leaf_is_refused_naming_it(saved, tmp_path):
    strategy = jr.MirroredStrategy(devices=jax.devices()[:3])
    shutil.copytree(saved, tmp_path / "ckpt")
    with CheckpointManager(tmp_path / "ckpt", strategy) as m, pytest.raises(
            ValueError, match=re.escape(
                "['rows'] float32[64, 32] cannot be placed as P('replica',) on 3 devices "
                "along dimension 0 (replica): 3 does not divide 64. Pass shardings= for it")):
        m.restore_or_initialize(_abstract, shardings={
            "rows": NamedSharding(strategy.mesh, P("replica")), "cols": None, "both": None,
            "rep": None, "bf16": None, "host": None})
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]


# -- damage -----------------------------------------------------------------------------
def _changed_data(step_dir) -> None:
    """Step 2's data replaced by another state's (valid files, but other values): only
    the digests can tell."""
    other = step_dir.parent.parent / "other"
    _save(other, steps=(7,))
    item, theirs = step_dir / "default", other / "7" / "default"
    for name in os.listdir(item):
        if name not in ("_METADATA", "commit_success.txt"):
            p = item / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
            src = theirs / name
            (shutil.copytree if src.is_dir() else shutil.copy)(src, p)


def _deleted_data(step_dir) -> None:
    """The data files gone: one process's Orbax merges its ``ocdbt.process_0`` into the
    step's own tree (tests/test_checkpoint_every_process.py deletes a process's
    directory of a checkpoint written by two)."""
    item = step_dir / "default"
    shutil.rmtree(item / "d")
    for p in item.glob("ocdbt.process_*"):
        shutil.rmtree(p)


def _truncated_manifest(step_dir) -> None:
    manifest = step_dir / "default" / "manifest.ocdbt"
    manifest.write_bytes(manifest.read_bytes()[:10])


def _flipped_byte(step_dir) -> None:
    """A byte flipped in the middle of every data file (those of the merged tree and
    the process's)."""
    item = step_dir / "default"
    for d in [item / "d", *item.glob("ocdbt.process_*/d")]:
        for f in sorted(d.iterdir()):
            raw = bytearray(f.read_bytes())
            raw[len(raw) // 2] ^= 0x40
            f.write_bytes(bytes(raw))


DAMAGE = {"changed_data": _changed_data, "deleted_data": _deleted_data,
          "truncated_manifest": _truncated_manifest, "flipped_byte": _flipped_byte}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_step_is_moved_aside_only_when_an_older_one_restores(saved, tmp_path, kind,
                                                                     caplog):
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    DAMAGE[kind](path / "2")
    only2 = tmp_path / "only2"
    only2.mkdir()
    shutil.copytree(path / "2", only2 / "2")
    saver = jr.MirroredStrategy(logical_devices_per_replica=2)  # the boxes it saved
    as_saved = {k: NamedSharding(saver.mesh, spec) for k, spec in SPECS.items()}
    as_saved.update(bf16=NamedSharding(saver.mesh, P("replica")), host=None)
    with CheckpointManager(only2, saver) as m, pytest.raises(
            CheckpointError, match="every checkpoint in .* is damaged") as e:
        m.restore_or_initialize(_abstract, shardings=as_saved)
    assert sorted(os.listdir(only2)) == ["2"]  # nothing moved
    strategy = TOPOLOGIES["4"]()
    if kind == "changed_data":  # the digest names the array and its box
        assert re.search(r"box \[\d+:\d+, \d+:\d+\] of \['\w+'\] does not match its digest",
                         str(e.value)), str(e.value)
    with caplog.at_level(logging.WARNING, "jreplicate"), \
            CheckpointManager(path, strategy) as m:
        step, state = m.restore_or_initialize(_abstract)
    assert step == 1
    _assert_equal(state, reference(1))
    names = sorted(os.listdir(path))
    assert names[0] == "1" and names[1].startswith("2.damaged-"), names
    assert "is damaged" in caplog.text


def test_a_changed_array_is_named_when_read_onto_other_boxes(saved, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    _changed_data(path / "2")
    shutil.rmtree(path / "1")
    with CheckpointManager(path, TOPOLOGIES["1"]()) as m, pytest.raises(
            CheckpointError, match=r"the data at \['\w+'\] does not match its digest"):
        m.restore_or_initialize(_abstract)


# -- format 1 ---------------------------------------------------------------------------
def _format1(tmp_path):
    with tarfile.open(os.path.join(DATA, "checkpoint_format1.tar.gz")) as t:
        t.extractall(tmp_path, filter="data")
    return tmp_path / "format1"


def _format1_abstract():
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), format1_state(0))


@pytest.mark.parametrize("name", ["8", "2x2"])
def test_a_format_1_directory_still_restores(tmp_path, name):
    path = _format1(tmp_path)
    strategy = TOPOLOGIES[name]()
    rows = NamedSharding(strategy.mesh, P("replica"))
    with CheckpointManager(path, strategy) as m:
        step, state = m.restore_or_initialize(_format1_abstract, shardings={
            "w": rows, "b": None, "q": None, "opt": None})
        assert step == 2
        _assert_equal(state, format1_state(2))
        assert state["w"].sharding == rows
        m.save(3, state)  # and training goes on, in format 2
    with CheckpointManager(path, strategy) as m:
        step, state = m.restore_or_initialize(_format1_abstract)
    assert step == 3
    _assert_equal(state, format1_state(2))


def test_a_damaged_format_1_step_is_found_by_its_crc(tmp_path):
    path = _format1(tmp_path)
    _flipped_byte(path / "2")
    with CheckpointManager(path, TOPOLOGIES["4"]()) as m:
        step, state = m.restore_or_initialize(_format1_abstract)
    assert step == 1
    _assert_equal(state, format1_state(1))
    assert any(n.startswith("2.damaged-") for n in os.listdir(path))


def test_a_later_format_is_refused_naming_the_fix(saved, tmp_path):
    import json
    path = tmp_path / "ckpt"
    shutil.copytree(saved, path)
    meta = path / "2" / "default" / "_METADATA"
    text = meta.read_text()
    assert '"format": 2' in text
    meta.write_text(text.replace('"format": 2', '"format": 3'))
    json.loads(meta.read_text())
    with CheckpointManager(path, TOPOLOGIES["4"]()) as m, pytest.raises(
            CheckpointError, match="written by a later jreplicate .* upgrade jreplicate"):
        m.restore_or_initialize(_abstract)
    assert sorted(os.listdir(path)) == ["1", "2"]


# -- the class: any saved sharding, any target ---------------------------------------------
PROPERTY_DTYPES = ["float32", "bfloat16", "int8", "uint4", "bool", "complex64", "float8_e4m3"]


def _spec(draw, mesh) -> P:
    axes = list(mesh.axis_names)
    first = draw(st.sampled_from([None, *axes]))
    rest = [a for a in axes if a != first]
    second = draw(st.sampled_from([None, *rest]))
    return P(first, second)


@settings(max_examples=10, deadline=None)
@given(st.data())
def test_any_saved_sharding_restores_bit_for_bit_on_any_target(data):
    import tempfile
    draw = data.draw
    savers = {**TOPOLOGIES, "4x2": lambda: jr.MirroredStrategy(logical_devices_per_replica=2)}
    saver = savers[draw(st.sampled_from(sorted(savers)))]()
    restorer = savers[draw(st.sampled_from(sorted(savers)))]()
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    want, saved, targets = {}, {}, {}
    for i in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(PROPERTY_DTYPES))
        dtype = np.dtype(getattr(ml_dtypes, name, None) or name)
        shape = (8 * draw(st.integers(1, 2)), 8 * draw(st.integers(1, 2)))
        raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, np.uint8)
        value = raw.view(dtype).reshape(shape) if dtype.kind not in "b" else \
            (raw % 2).astype(bool).reshape(shape)
        if jax.dtypes.itemsize_bits(dtype) == 4:
            value = (raw % 16).view(dtype).reshape(shape)
        key = f"leaf{i}"
        want[key] = value
        if draw(st.booleans()):
            saved[key] = value  # a NumPy leaf
        else:
            saved[key] = jax.device_put(value, NamedSharding(saver.mesh, _spec(draw, saver.mesh)))
        targets[key] = draw(st.sampled_from([None, NamedSharding(
            restorer.mesh, _spec(draw, restorer.mesh))]))
    path = tempfile.mkdtemp()
    try:
        with CheckpointManager(path, saver) as m:
            m.save(5, saved, force=True)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in want.items()}
        with CheckpointManager(path, restorer) as m:
            step, got = m.restore_or_initialize(lambda: abstract, shardings=targets)
    finally:
        shutil.rmtree(path)
    assert step == 5
    _assert_equal(got, want)
    for k, target in targets.items():
        expected = target or NamedSharding(restorer.mesh, P())
        assert got[k].sharding.is_equivalent_to(expected, 2), (k, got[k].sharding, expected)
