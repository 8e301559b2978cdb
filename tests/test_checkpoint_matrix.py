"""The checkpoint matrix (issue 15, items 2 and 10c): every kind of difference between a
checkpoint and init_fn's state, crossed with every kind of damage to the directory.

For every cell the user either gets back exactly the values of a step that was saved,
or a CheckpointError; a step is never moved aside for a mismatch (only for real damage,
and only when an older step is restored in its place); and restore never returns
init_fn's fresh state at step 0 while a committed step exists.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from jreplicate.checkpoint import COMMIT_MARKER, CheckpointError, CheckpointManager
from jreplicate.strategies.mirrored import MirroredStrategy

STEPS = (1, 2)  # every saved directory holds these two committed steps


def _params():
    return {"w": np.zeros((64, 32), np.float32), "b": np.zeros(4, np.float32)}


def _nnx_state():
    return nnx.state(nnx.Linear(64, 32, rngs=nnx.Rngs(0)))


# Each state a checkpoint is saved from, or restored into.
STATES = {
    "params": _params,
    "adam": lambda: (_params(), optax.adam(1e-3).init(_params())),
    "adamw": lambda: (_params(), optax.adamw(1e-3).init(_params())),
    "chain(adam)": lambda: (_params(), optax.chain(optax.adam(1e-3)).init(_params())),
    "chain(clip,adam)": lambda: (_params(), optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-3)).init(_params())),
    "+None": lambda: {**_params(), "n": None},
    "+{}": lambda: {**_params(), "e": {}, "t": ()},
    "+extra": lambda: {**_params(), "extra": np.zeros(2, np.float32)},
    "-b": lambda: {"w": _params()["w"]},
    "renamed": lambda: {"weights": _params()["w"], "b": _params()["b"]},
    "as_list": lambda: [_params()["b"], _params()["w"]],
    "int32": lambda: {"w": np.zeros((64, 32), np.int32), "b": np.zeros(4, np.float32)},
    "shape": lambda: {"w": np.zeros((64, 33), np.float32), "b": np.zeros(4, np.float32)},
    "nnx": _nnx_state,
    "nnx+extra": lambda: {"model": _nnx_state(), "step": np.zeros((), np.int32)},
}

# (saved from, restored into, whether the data must come back). Differences only in
# empty nodes or one-element wrappers restore; anything else is a CheckpointError.
MISMATCHES = [
    ("params", "params", True),
    ("adam", "adam", True),
    ("adam", "adamw", True),  # adamw adds an EmptyState
    ("adamw", "adam", True),
    ("adam", "chain(adam)", True),  # chain wraps the same state in a 1-tuple
    ("chain(adam)", "adam", True),
    ("params", "+None", True),
    ("+None", "params", True),
    ("params", "+{}", True),
    ("+{}", "params", True),
    ("nnx", "nnx", True),
    ("adam", "chain(clip,adam)", False),  # the arrays moved: [1][0] -> [1][1][0]
    ("params", "+extra", False),
    ("params", "-b", False),
    ("params", "renamed", False),
    ("params", "as_list", False),
    ("params", "int32", False),  # restoring would cast
    ("params", "shape", False),
    ("nnx", "nnx+extra", False),
]


def _largest_data_file(step_dir):
    files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs
             if os.sep + "d" + os.sep in os.path.join(r, f)]
    return max(files, key=os.path.getsize)


def _garble(step_dir):
    path = _largest_data_file(step_dir)
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i] ^= 0x5A
    open(path, "wb").write(bytes(data))


def _truncate(step_dir):
    path = _largest_data_file(step_dir)
    os.truncate(path, os.path.getsize(path) // 2)


def _delete(step_dir):
    os.remove(_largest_data_file(step_dir))


def _bad_metadata(step_dir):
    path = os.path.join(step_dir, "default", "_METADATA")
    os.truncate(path, os.path.getsize(path) // 2)


def _metadata_disagrees(step_dir):
    """Valid metadata that no longer lists one of the saved arrays."""
    path = os.path.join(step_dir, "default", "_METADATA")
    meta = json.load(open(path))
    arrays = [k for k, v in meta["tree_metadata"].items()
              if v["value_metadata"]["value_type"] == "np.ndarray"]
    del meta["tree_metadata"][arrays[0]]
    json.dump(meta, open(path, "w"))


def _uncommitted(root):
    """A newest step 3 whose save was cut short (no commit marker; data half written)."""
    shutil.copytree(os.path.join(root, "2"), os.path.join(root, "3"))
    os.remove(os.path.join(root, "3", COMMIT_MARKER))
    _truncate(os.path.join(root, "3"))


# name: (what it does to the directory, the steps it really damages)
DAMAGE = {"garbled": _garble, "truncated": _truncate, "deleted": _delete,
          "metadata": _bad_metadata, "metadata disagrees": _metadata_disagrees}
CORRUPTIONS = {"none": (lambda root: None, ()), "uncommitted newest": (_uncommitted, ())}
for _name, _fn in DAMAGE.items():
    CORRUPTIONS[f"{_name} newest, older good"] = (
        lambda root, fn=_fn: fn(os.path.join(root, "2")), (2,))
for _new, _old in (("garbled", "deleted"), ("metadata", "truncated")):  # no good step
    CORRUPTIONS[f"{_new} newest, {_old} older"] = (
        lambda root, a=DAMAGE[_new], b=DAMAGE[_old]: (a(os.path.join(root, "2")),
                                                      b(os.path.join(root, "1"))), STEPS)


def _values(name, step):
    """STATES[name]'s structure with distinct values for ``step`` (never the init ones)."""
    rng = np.random.default_rng([step, len(name)])
    return jax.tree.map(lambda x: (rng.standard_normal(np.shape(x)) * 100).astype(x.dtype)
                        + step, STATES[name]())


@pytest.fixture(scope="module")
def strategy():
    return MirroredStrategy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, strategy):
    """``saved(name)``: a directory with steps 1 and 2 of STATES[name] (made once)."""
    made = {}

    def get(name):
        if name not in made:
            path = tmp_path_factory.mktemp("saved") / name.replace("(", "_").replace(")", "")
            with CheckpointManager(path, strategy) as m:
                for s in STEPS:
                    m.save(s, _values(name, s))
            made[name] = path
        return made[name]
    return get


def _listing(root):
    return sorted(os.listdir(root))


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.parametrize("saved_as,restored_as,restores", MISMATCHES,
                         ids=[f"{a}->{b}" for a, b, _ in MISMATCHES])
def test_data_back_exactly_or_an_error(saved, strategy, tmp_path, saved_as, restored_as,
                                       restores, corruption):
    root = tmp_path / "ckpt"
    shutil.copytree(saved(saved_as), root)
    corrupt, damaged = CORRUPTIONS[corruption]
    corrupt(str(root))
    before = _listing(root)
    good = [s for s in STEPS if s not in damaged]
    with CheckpointManager(root, strategy) as m:
        try:
            step, state = m.restore_or_initialize(STATES[restored_as])
        except CheckpointError as e:
            step, state, error = None, None, str(e)
        else:
            error = None
    after = _listing(root)
    moved = sorted(set(before) - set(after) - {"3"})  # "3": the uncommitted step
    if error is None:
        # Never init_fn's fresh state while a committed step exists: a saved step's data.
        assert step in STEPS, (step, after)
        want = jax.tree.leaves(_values(saved_as, step))
        got = jax.tree.leaves(state)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert np.asarray(g).dtype == w.dtype and np.array_equal(np.asarray(g), w)
        assert jax.tree.structure(state) == jax.tree.structure(
            jax.eval_shape(STATES[restored_as]))  # init_fn's containers
        assert restores and step == max(good), (step, error)  # the newest good step
        # Only the really damaged steps newer than the restored one were moved aside.
        assert moved == [str(s) for s in damaged if s > step], (before, after)
    else:
        assert not restores or not good, error  # data that matches comes back
        assert moved == [], (before, after)  # nothing moved aside when raising
        assert "init_fn" in error, error


# -- the matching rule, as a property (pure: no files) ----------------------------------
_EMPTIES = (None, {}, (), optax.EmptyState())


def _trees():
    from hypothesis import strategies as st
    containers = lambda kids: st.one_of(  # noqa: E731
        st.lists(kids, max_size=3), st.lists(kids, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abc"), kids, max_size=3))
    return st.recursive(st.just(0), containers, max_leaves=8).map(
        lambda t: jax.tree.unflatten(jax.tree.structure(t),
                                     list(range(1, jax.tree.structure(t).num_leaves + 1))))


def _has_data(t):
    return bool(jax.tree.leaves(t))


def _harmless(t, draw):
    """``t`` with empty nodes added and one-element wrappers added or removed."""
    from hypothesis import strategies as st
    if isinstance(t, dict):
        t = {k: _harmless(v, draw) for k, v in t.items()}
        if draw(st.booleans()):
            t["zz"] = draw(st.sampled_from(_EMPTIES))
    elif isinstance(t, (list, tuple)):
        t = type(t)(_harmless(v, draw) for v in t)
        if len(t) == 1 and draw(st.booleans()):
            return t[0]  # unwrap
        if draw(st.booleans()):
            t = type(t)([*t, draw(st.sampled_from(_EMPTIES))])
    return (t,) if draw(st.booleans()) and draw(st.booleans()) else t


def _harmful(t):
    """``t`` with data moved: an empty node before a data element, or a key renamed."""
    if isinstance(t, (list, tuple)) and _has_data(t):
        return type(t)([None, *t])
    if isinstance(t, dict):
        for k, v in t.items():
            if _has_data(v):
                return {**{j: w for j, w in t.items() if j != k}, k + "_renamed": v}
    return None


def _placed(tree):
    """Which saved leaf (by its value) the rule puts at each normalised path."""
    from jreplicate.checkpoint.tree import template_leaves
    leaves = jax.tree.leaves(tree)
    return {norm: leaves[i] for norm, (_, i) in template_leaves(tree).items()}


def _stored(tree):
    import orbax.checkpoint as ocp

    from jreplicate.checkpoint.tree import normalised
    serial = ocp.tree.serialize_tree(tree, keep_empty_nodes=True)
    return {n: v for n, (_, v) in normalised(serial, lambda x: isinstance(x, int)).items()}


def test_matching_rule_ignores_empty_nodes_and_wrappers_but_never_moves_data():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=80, deadline=None)
    @given(_trees(), st.data())
    def check(saved_tree, data):
        stored = _stored(saved_tree)
        assert sorted(stored.values()) == jax.tree.leaves(saved_tree)  # every array, once
        edited = _harmless(saved_tree, data.draw)
        assert _placed(edited) == stored, (saved_tree, edited)
        moved = _harmful(saved_tree)
        if moved is not None:
            assert _placed(moved) != stored, (saved_tree, moved)
    check()


# -- across strategies, NNX, checkpoints written without jreplicate's checksums -----------
def _equal(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    return len(got) == len(want) and all(
        np.asarray(g).dtype == w.dtype and np.array_equal(np.asarray(g), w)
        for g, w in zip(got, want, strict=True))


def test_saved_under_one_strategy_restored_under_another(tmp_path):
    eight, one = MirroredStrategy(), MirroredStrategy(devices=[0])
    for saver, restorer, name in ((eight, one, "adam"), (one, eight, "nnx")):
        path = tmp_path / name
        with CheckpointManager(path, saver) as m:
            replicated = jax.device_put(_values(name, 5), jax.sharding.NamedSharding(
                saver.mesh, jax.sharding.PartitionSpec()))
            m.save(5, replicated)
        with CheckpointManager(path, restorer) as m:
            step, state = m.restore_or_initialize(STATES[name])
        assert step == 5 and _equal(state, _values(name, 5))
        for leaf in jax.tree.leaves(state):  # placed on the restoring strategy's devices
            assert set(leaf.sharding.device_set) == set(restorer.mesh.devices.flat)
    model = nnx.Linear(64, 32, rngs=nnx.Rngs(1))
    nnx.update(model, state)  # an NNX state restores into a module
    assert np.array_equal(np.asarray(model.kernel[...]), _values("nnx", 5)["kernel"][...])


def test_checkpoint_written_by_orbax_alone_restores(tmp_path, strategy):
    import orbax.checkpoint as ocp
    with ocp.CheckpointManager(tmp_path, item_handlers=ocp.StandardCheckpointHandler()) as m:
        m.save(3, args=ocp.args.StandardSave(_values("adam", 3)))  # no checksum table
        m.wait_until_finished()
    with CheckpointManager(tmp_path, strategy) as m:
        step, state = m.restore_or_initialize(STATES["adamw"])
    assert step == 3 and _equal(state, _values("adam", 3))
