"""The Ray carrier's wire form (jreplicate.ps.ray.wire): bytes back bit for bit.

A property over dicts of arrays of every dtype a model holds (floats including
bfloat16, integers, bool), every shape (0-d, empty, non-contiguous views) and every
chunk count: what ``unpack`` returns is what ``pack`` was given, same dtype, same
shape, same bytes. Plus the size rule (inline-sized chunks for small models; large
ones are not packed) and the error for a short buffer.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.ps.ray import wire

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int8, np.int32,
          np.int64, np.uint8, np.bool_, np.complex64]


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    raw = draw(st.binary(min_size=dtype.itemsize * int(np.prod(shape, dtype=np.int64)),
                         max_size=dtype.itemsize * int(np.prod(shape, dtype=np.int64))))
    a = np.frombuffer(raw, np.uint8).view(dtype).reshape(shape) if raw else \
        np.zeros(shape, dtype)
    if dtype == np.bool_:
        a = a.view(np.uint8) % 2 == 1
    if draw(st.booleans()) and a.ndim >= 1 and a.shape[0] > 1:
        a = a[::2]  # a non-contiguous view
    return a


@settings(deadline=None, max_examples=150)
@given(tree=st.dictionaries(st.text(min_size=1, max_size=6), arrays(), max_size=6),
       chunks=st.one_of(st.none(), st.integers(1, 9)))
def test_round_trip_is_bit_exact(tree, chunks):
    meta, parts = wire.pack(tree, chunks)
    assert all(p.dtype == np.uint8 and p.ndim == 1 for p in parts)
    # As the Ray carrier sends them: meta encoded, chunks as bytes; and as arrays.
    for back in (wire.unpack(meta, parts),
                 wire.unpack(wire.decode(wire.encode(meta)), wire.to_bytes(parts))):
        assert list(back) == list(tree)
        for k, a in tree.items():
            b = back[k]
            assert b.dtype == a.dtype and b.shape == a.shape, k
            assert np.ascontiguousarray(a).tobytes() == b.tobytes(), k  # bits, NaNs too


def test_chunk_rule_small_models_inline_large_ones_not_packed():
    small = {"w": np.zeros(85_000, np.float32)}  # 340 KB: the benchmark's MLP
    assert wire.fits_inline(small)
    _, parts = wire.pack(small)
    assert len(parts) == 4 and max(p.nbytes for p in parts) < wire.INLINE_LIMIT
    assert not wire.fits_inline({"w": np.zeros(1_200_000, np.float32)})  # 4.8 MB
    assert wire.chunk_count(0) == 1
    assert wire.nbytes({"a": np.ones(3, np.bool_), "b": np.ones(2)}) == 32


def test_arrays_start_aligned():
    meta, _ = wire.pack({"a": np.ones(3, np.bool_), "b": np.ones(3, np.float64)})
    assert [leaf.offset % 16 for leaf in meta.leaves] == [0, 0]


def test_short_buffer_is_an_error_not_garbage():
    meta, parts = wire.pack({"w": np.arange(10, dtype=np.float32)})
    with pytest.raises(ValueError, match="expected 48 bytes"):
        wire.unpack(meta, [parts[0][:-1]])


def test_encoded_meta_is_cached_and_checked():
    meta, _ = wire.pack({"w": np.arange(10, dtype=np.float32)})
    data = wire.encode(meta)
    assert wire.encode(wire.pack({"w": np.ones(10, np.float32)})[0]) is data  # equal meta
    assert wire.decode(data) == meta and wire.decode(bytes(data)) == meta
    for bad in (b'{"not": "meta"}', b"[[[1, 2]], 3]", b"\x80\x04"):
        with pytest.raises(ValueError, match="not an encoded Meta"):
            wire.decode(bad)
