"""Input elements: every bad leaf is named in one error (issue 16 item 4); one bad leaf
keeps its one-line message."""

import jax
import numpy as np
import pytest

import jreplicate as jr
from jreplicate._tree import LeafErrors
from jreplicate.input.protocol import ReadOutcome, decide


def _rep(n):
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n]))


def _bullets(error):
    return [line for line in str(error).splitlines() if line.startswith("  - ")]


def test_every_leaf_that_is_not_an_array_is_named():
    element = {"a": "text", "b": np.zeros(2, np.float32), "c": object(), "d": [None, "x"]}
    it = _rep(1).prepare_input(lambda ctx: iter([element]), prefetch_on_device=False)
    with pytest.raises(TypeError) as info:
        it.get_next()
    lines = str(info.value).splitlines()
    assert lines[0] == "input element of replica 0: 3 leaves are wrong:"
    bullets = _bullets(info.value)
    assert len(bullets) == 3
    for path, kind in (("['a']", "str"), ("['c']", "object"), ("['d'][1]", "str")):
        assert sum(f"has a {kind} at {path};" in b for b in bullets) == 1, (path, bullets)


def test_values_that_do_not_fit_and_non_arrays_are_named_together():
    big = np.array([2**40], np.int64)
    it = _rep(1).prepare_input(lambda ctx: iter([{"a": big, "b": "s", "c": big}]),
                               prefetch_on_device=False)
    with pytest.raises(LeafErrors) as info:  # a TypeError and a ValueError both
        it.get_next()
    bullets = _bullets(info.value)
    assert [b.split(" at ")[1].split()[0] for b in bullets] == ["['a']", "['b'];", "['c']"]
    assert "does not fit int32" in bullets[0] and "has a str" in bullets[1]


def test_one_bad_leaf_keeps_its_one_line_message():
    it = _rep(1).prepare_input(lambda ctx: iter([{"a": "text", "b": np.zeros(2)}]),
                               prefetch_on_device=False)
    with pytest.raises(TypeError) as info:
        it.get_next()
    assert str(info.value) == (
        "input element of replica 0 has a str at ['a']; elements must be pytrees of arrays "
        "(numpy arrays or Python numbers). Convert it, or drop it in input_fn.")


def _steps(second):
    first = {"x": np.zeros((4, 3), np.float32), "y": np.zeros(4, np.int32),
             "z": np.zeros(4, np.float32)}
    return lambda ctx: iter([first, second(ctx.input_pipeline_id)])


def test_every_leaf_whose_shape_or_dtype_changed_is_named_for_every_replica():
    def second(r):
        return {"x": np.zeros((4, 5), np.float32), "y": np.zeros(4, np.int32),
                "z": np.zeros(4, np.float64 if r else np.int32)}
    it = _rep(2).prepare_input(_steps(second), jr.InputReplicationMode.PER_REPLICA,
                               prefetch_on_device=False)
    it.get_next()
    with pytest.raises(ValueError) as info:
        it.get_next()
    assert str(info.value).splitlines()[0] == "this step's input: 4 leaves are wrong:"
    bullets = _bullets(info.value)
    want = [(0, "['x']", "(4, 5)"), (0, "['z']", "int32"), (1, "['x']", "(4, 5)"),
            (1, "['z']", "float64")]
    assert len(bullets) == len(want)
    for b, (rid, path, what) in zip(bullets, want):
        assert b.startswith(f"  - input element of replica {rid} at {path} has "), b
        assert what in b and "Elements must keep one shape and dtype" in b


def test_a_real_mismatch_is_not_taken_for_a_final_partial_batch():
    """A leaf that is only shorter (a final partial batch) after a leaf that is wrong:
    the wrong leaves are reported, the shorter one is not (as before)."""
    def second(r):
        return {"x": np.zeros((4, 5), np.float32), "y": np.zeros(2, np.int32),
                "z": np.zeros(4, np.float64)}
    it = _rep(1).prepare_input(_steps(second), prefetch_on_device=False)
    it.get_next()
    with pytest.raises(ValueError) as info:
        it.get_next()
    assert [b.split(" at ")[1].split()[0] for b in _bullets(info.value)] == ["['x']", "['z']"]


def test_padding_names_every_leaf_it_cannot_pad():
    def second(r):
        return {"x": np.zeros((2, 5), np.float32), "y": np.zeros(2, np.int32),
                "z": np.zeros(2, np.float64)}
    it = _rep(1).prepare_input(_steps(second), prefetch_on_device=False, partial_batch="pad")
    it.get_next()
    with pytest.raises(ValueError) as info:
        it.get_next()
    lines = str(info.value).splitlines()
    assert lines[0] == "input element of replica 0: 2 leaves are wrong:"
    bullets = _bullets(info.value)
    assert "at ['x'] has shape (2, 5)" in bullets[0] and "at ['z'] has shape (2,)" in bullets[1]
    assert all("With partial_batch='pad'" in b for b in bullets)


def test_several_bad_leaves_on_another_process_raise_the_same_kind():
    mine = ReadOutcome.error(LeafErrors("input element of replica 3: 2 leaves are wrong:"))
    d = decide([ReadOutcome.end(process=0), mine.at(1)], pad=False, single=False,
               num_replicas=4)
    assert type(d.error()) is LeafErrors
