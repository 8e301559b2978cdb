"""Large arrays through Ray's object store in pieces (jreplicate.ps.ray.pieces).

Ray copies an out-of-band buffer over 1 MiB with six threads it starts for that copy;
the Ray carrier sends every array over 1 MiB (gradients to a shard, parameters back) as
1 MiB pieces and joins them on the other side. Checked here:

* a property over arrays of every dtype a model holds and many shapes and piece sizes:
  what unpickles is the array, bit for bit, read-only; a view where the pieces lie back
  to back (as in Ray's object), which keeps that memory alive on its own; a copy
  otherwise;
* the carrier's calls both ways (the worker's push, push_pull, check and stage; the
  shard actor's pull and push_pull replies) pickle no buffer over 1 MiB;
* through a real object store (tests/test_ps_ray_object_store.py): the joined array is
  a view of the object, 64-byte aligned, and a one-device worker places it without a
  copy.
"""

from __future__ import annotations

import gc
import pickle
from unittest import mock

import ml_dtypes
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.ps.ray import pieces
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32,
          np.uint8, np.bool_, np.complex64]
SMALL = 64 * 3  # PIECE_BYTES in the property: small arrays go in several pieces


def _as_ray_lays_out(obj, protocol=5):
    """``obj`` pickled, and unpickled from read-only views of its out-of-band buffers
    placed back to back in one block, each at a multiple of 64 bytes (Ray's layout for
    buffers of 2 KiB and more; under 2 KiB Ray aligns to 8, which a piece that follows
    whole 64-byte pieces already is). Returns the object and the block."""
    bufs: list = []
    data = pickle.dumps(obj, protocol=protocol, buffer_callback=bufs.append)
    raws = [b.raw() for b in bufs]
    offsets, at = [], 0
    for r in raws:
        offsets.append(at)
        at += -(-r.nbytes // 64) * 64
    block = bytearray(at + 64)
    view = memoryview(block)
    start = -np.frombuffer(block, np.uint8).ctypes.data % 64  # the block 64-aligned
    for r, o in zip(raws, offsets):
        view[start + o:start + o + r.nbytes] = r
    ro = view.toreadonly()
    out = pickle.loads(data, buffers=[ro[start + o:start + o + r.nbytes]
                                      for r, o in zip(raws, offsets)])
    return out, block


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=3)))
    n = int(np.prod(shape)) * dtype.itemsize
    a = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8).view(
        dtype).reshape(shape)
    if dtype == np.bool_:
        a = a.view(np.uint8) % 2 == 1
    if draw(st.booleans()) and a.shape[0] > 1:
        a = a[::2]  # a non-contiguous view: sent as its contiguous copy
    return a


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and \
        np.ascontiguousarray(a).tobytes() == b.tobytes()


@settings(deadline=None, max_examples=60)
@given(tree=st.dictionaries(st.text(min_size=1, max_size=4), arrays(), max_size=5),
       piece=st.sampled_from([64, SMALL, 64 * 16]))
def test_arrays_come_back_bit_exact_and_read_only(tree, piece):
    with mock.patch.object(pieces, "PIECE_BYTES", piece):
        sent = pieces.in_pieces(tree)
        assert [k for k, v in sent.items() if isinstance(v, pieces.Pieces)] == \
            [k for k, v in tree.items() if v.nbytes > piece]
        bufs: list = []
        pickle.dumps(sent, protocol=5, buffer_callback=bufs.append)
        assert all(b.raw().nbytes <= piece for b in bufs)
        laid_out, block = _as_ray_lays_out(sent)
        in_band = pickle.loads(pickle.dumps(sent, protocol=4))  # pieces apart: a copy
    for back in (laid_out, in_band):
        assert list(back) == list(tree)
        for k, a in tree.items():
            assert _same(a, back[k]), k
            assert not back[k].flags.writeable or not isinstance(sent[k], pieces.Pieces)
    for k in tree:
        if isinstance(sent[k], pieces.Pieces):  # a view of the block, not a copy
            lo = np.frombuffer(block, np.uint8).ctypes.data
            assert lo <= laid_out[k].ctypes.data < lo + len(block), k


def test_a_joined_view_keeps_its_memory_alive():
    a = np.arange(3000, dtype=np.float32)
    with mock.patch.object(pieces, "PIECE_BYTES", 1024):
        back, block = _as_ray_lays_out(pieces.in_pieces({"a": a}))
    lo = np.frombuffer(block, np.uint8).ctypes.data
    assert lo <= back["a"].ctypes.data < lo + len(block)
    del block
    gc.collect()
    np.testing.assert_array_equal(back["a"], a)


def test_small_arrays_and_other_values_pass_unchanged():
    small = np.zeros(10, np.float32)
    tree = {"s": small, "n": 3, "o": np.array([object()] * 100, dtype=object)}
    with mock.patch.object(pieces, "PIECE_BYTES", 64):
        sent = pieces.in_pieces(tree)
    assert sent["s"] is small and sent["n"] == 3 and sent["o"] is tree["o"]


def test_parts_of_the_wrong_size_are_an_error():
    with pytest.raises(ValueError, match="expected 16 bytes"):
        pieces.joined(np.float32, (4,), [np.zeros(8, np.uint8), np.zeros(4, np.uint8)])


def _buffers(obj) -> list[int]:
    bufs: list = []
    pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
    return [b.raw().nbytes for b in bufs]


BIG = {"w": np.ones((1024, 1024), np.float32), "b": np.zeros(1024, np.float32)}


def test_the_workers_calls_send_no_buffer_over_a_piece():
    """The worker's shard calls (proxy._ShardCalls) with a 4 MiB gradient: every
    argument pickles into buffers of at most 1 MiB (Ray copies a larger one with six
    threads it starts for it)."""
    pytest.importorskip("ray")
    from jreplicate.ps.ray.proxy import _ShardCalls

    sent = []

    class Method:
        def remote(self, *args):
            sent.append(args)

    class Actor:
        def __getattr__(self, name):
            return Method()

    calls = _ShardCalls(Actor())
    calls.push_pull(1, 0, 0, BIG)
    calls.push(1, 0, 0, BIG)
    calls.check(1, 0, BIG)
    calls.stage(1, 0, BIG)
    assert len(sent) == 4
    for args in sent:
        sizes = _buffers(args)
        assert sum(sizes) >= 4 << 20 and max(sizes) <= pieces.PIECE_BYTES, sizes


def test_the_shard_actors_replies_send_no_buffer_over_a_piece():
    """The shard actor's ``pull`` and ``push_pull`` (its class, called in this process)
    reply with the parameters in pieces; a worker reads them back exactly."""
    pytest.importorskip("ray")
    from jreplicate.ps.ray import actors

    shard_cls = actors.ShardActor.__ray_metadata__.modified_class.__mro__[1]
    shard = shard_cls(0, dict(BIG), optax.sgd(1.0), None)
    pulled = shard.pull()
    replied = shard.push_pull(1, 0, 0, {k: np.full_like(v, 0.5) for k, v in BIG.items()})
    for reply in (pulled, replied):
        sizes = _buffers(reply)
        assert sum(sizes) >= 4 << 20 and max(sizes) <= pieces.PIECE_BYTES, sizes
    back, _ = _as_ray_lays_out(replied)
    assert back[0].kind == "applied" and back[1] == 1
    np.testing.assert_array_equal(back[2]["w"], np.full((1024, 1024), 0.5, np.float32))
    np.testing.assert_array_equal(back[2]["b"], np.full(1024, -0.5, np.float32))
