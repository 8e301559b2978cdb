"""The checkpoint digest (jreplicate/checkpoint/digest.py): a 64-bit weighted sum of an
array's 32-bit lanes that is the same however the array is sharded.

The reference is a slow pure-Python loop over ``x.tobytes()``, written from the
definition (lanes of little-endian words, murmur3's ``fmix32`` weights made odd), not
from the implementation's NumPy or XLA code. Hypothesis draws the dtype (every dtype the
dtype tests offer that a checkpoint holds), the shape, the mesh (8, 2x4, 4x2) and the
spec; the device digest, its per-box table and the NumPy digest must equal the
reference, and any single flipped bit, or two unequal elements swapped, must change it.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate.checkpoint import digest
from jreplicate.checkpoint.dtypes import unsavable
from tests.test_checkpoint_dtypes import DTYPES, patterns

M = 0xFFFFFFFF
SAVABLE = sorted(n for n, d in DTYPES.items() if unsavable(d) is None)
MESHES = {"8": ((8,), ("replica",)), "2x4": ((2, 4), ("replica", "model")),
          "4x2": ((4, 2), ("replica", "model"))}


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M
    return h ^ (h >> 16)


def _ref_lanes(x: np.ndarray) -> list[list[int]]:
    """Each element's lanes, from its bytes (little-endian words)."""
    dtype = x.dtype
    raw = np.ascontiguousarray(x).tobytes()
    size = dtype.itemsize
    bits = jax.dtypes.itemsize_bits(dtype)
    out = []
    for k in range(0, len(raw), size):
        b = raw[k:k + size]
        if dtype.kind == "c":
            half = size // 2
            parts = [b[:half], b[half:]]
            words = [p[i:i + 4] for p in parts for i in range(0, half, 4)]
            out.append([int.from_bytes(w, "little") for w in words])
        elif size == 8:
            out.append([int.from_bytes(b[:4], "little"), int.from_bytes(b[4:], "little")])
        elif bits < 8:
            out.append([b[0] & ((1 << bits) - 1)])
        else:
            out.append([int.from_bytes(b, "little")])
    return out


def ref_digest(x: np.ndarray, box: tuple | None = None) -> tuple[int, int]:
    """The digest of ``x`` (or of the block ``box`` of it, by global lane index)."""
    lanes = _ref_lanes(x)
    per = len(lanes[0])
    inside = None
    if box is not None:
        grid = np.zeros(x.shape, bool)
        grid[tuple(slice(a, b) for a, b in box)] = True
        inside = grid.reshape(-1).tolist()
    out = []
    for seed in digest.SEEDS:
        total = 0
        for e, element in enumerate(lanes):
            if inside is not None and not inside[e]:
                continue
            for j, lane in enumerate(element):
                i = (e * per + j) & M
                total = (total + ((_fmix((i + seed) & M) | 1) * lane)) & M
        out.append(total)
    return out[0], out[1]


@st.composite
def placed(draw, dtypes=tuple(SAVABLE)):
    """``(host values, mesh name, spec)``: a few elements of a savable dtype's patterns."""
    name = draw(st.sampled_from(dtypes))
    dtype = DTYPES[name]
    mesh_name = draw(st.sampled_from(sorted(MESHES)))
    sizes, axes = MESHES[mesh_name]
    ndim = draw(st.integers(1, 3))
    free = list(axes)
    spec, shape = [], []
    for _ in range(ndim):
        choice = draw(st.sampled_from([None, *free, tuple(free)] if free else [None]))
        used = () if choice is None else choice if isinstance(choice, tuple) else (choice,)
        for a in used:
            free.remove(a)
        ways = int(np.prod([sizes[axes.index(a)] for a in used])) if used else 1
        shape.append(ways * draw(st.integers(1, 2)))
        spec.append(choice if not (isinstance(choice, tuple) and len(choice) == 1) else choice[0])
    pool = patterns(dtype)
    seed = draw(st.integers(0, 2**16))
    values = np.random.default_rng(seed).choice(pool, size=tuple(shape))
    return values.astype(dtype), mesh_name, P(*spec)


def _mesh(name: str) -> jax.sharding.Mesh:
    sizes, axes = MESHES[name]
    return jax.make_mesh(sizes, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))


def _flip(x: np.ndarray, bit: int) -> np.ndarray:
    """``x`` with one meaningful bit flipped (sub-byte types: a bit of the value)."""
    width = 1 if x.dtype == np.bool_ else jax.dtypes.itemsize_bits(x.dtype)
    raw = np.ascontiguousarray(x).copy().view(np.uint8).reshape(-1)
    if width < 8:
        element, b = divmod(bit % (x.size * width), width)
        raw[element] ^= np.uint8(1 << b)
    else:
        k = bit % (raw.size * 8)
        raw[k // 8] ^= np.uint8(1 << (k % 8))
    return raw.view(x.dtype).reshape(x.shape)


@settings(max_examples=40, deadline=None)
@given(placed(), st.integers(0, 10**6))
def test_device_digest_and_box_table_equal_the_reference_on_any_sharding(case, bit):
    host, mesh_name, spec = case
    if not digest.on_device(host.dtype):
        return  # 1- and 6-bit types are digested on the host (the test below)
    x = jax.device_put(host, NamedSharding(_mesh(mesh_name), spec))
    total, boxes = digest.digest_array(x)
    assert total == ref_digest(host)
    assert digest.digest_only(x) == total
    assert len({b for b, _ in boxes}) == len(boxes)
    covered = sum(int(np.prod([b - a for a, b in box])) for box, _ in boxes)
    assert covered == host.size  # the distinct boxes tile the array
    for box, value in boxes:
        assert value == ref_digest(host, box), (box, spec)
    flipped = _flip(host, bit)
    moved = jax.device_put(flipped, x.sharding)
    assert digest.digest_array(moved)[0] != total


@settings(max_examples=60, deadline=None)
@given(placed(), st.integers(0, 10**6))
def test_numpy_digest_equals_the_reference_and_sees_every_bit(case, bit):
    host, _, _ = case
    assert digest.digest_np(host) == ref_digest(host)
    assert digest.digest_np(_flip(host, bit)) != digest.digest_np(host)
    flat = host.reshape(-1)
    a, b = 0, flat.size - 1
    if flat[a:a + 1].tobytes() != flat[b:b + 1].tobytes():
        swapped = flat.copy()
        swapped[[a, b]] = swapped[[b, a]]
        assert digest.digest_np(swapped) != digest.digest_np(flat)


@pytest.mark.parametrize("name", SAVABLE)
def test_every_dtype_one_device_numpy_and_reference_agree(name):
    host = patterns(DTYPES[name])
    want = ref_digest(host)
    assert digest.digest_np(host) == want
    put = jax.device_put(host, jax.devices()[0])
    if put.dtype == host.dtype:  # JAX holds int1 as bool after a bool: its cache
        assert digest.digest_array(put)[0] == want


@pytest.mark.parametrize("name", SAVABLE)
def test_host_digest_through_xla_equals_numpy_for_every_dtype(name, monkeypatch):
    host = np.resize(patterns(DTYPES[name]), (3, 50))
    want = ref_digest(host)
    assert digest.numpy_digest(host) == want
    monkeypatch.setattr(digest, "XLA_FROM", 0)  # large arrays go through XLA on the CPU
    assert digest.digest_np(host) == want
    assert digest.digest_np(_flip(host, 77)) != want


def test_two_seeds_give_64_bits_and_a_scalar_works():
    x = np.float32(1.5)
    a, b = digest.digest_np(x)
    assert a != b and (a, b) == ref_digest(np.asarray(x))
    assert digest.digest_array(jax.device_put(x))[0] == (a, b)
