"""A 64-bit digest of an array's bits that does not depend on its sharding (private to
jreplicate.checkpoint).

A checkpoint written by every process cannot carry a CRC-32 of each array: no process
holds a whole array, and the CRC of the shards one topology reads is not that of the
shards another wrote. The digest here is a weighted sum instead, so any sharding and
any reduction order give the same value:

* an element's bits are split into 32-bit **lanes** (1 for types of at most 32 bits,
  2 for 64-bit types, real and imaginary lanes for complex types; a sub-byte type's
  value is its ``bits`` low bits, as ``ml_dtypes`` stores it in a byte);
* ``H_s = sum_i w_s(i) * lane_i mod 2**32`` with ``w_s(i) = fmix32(i + seed_s) | 1``
  (murmur3's finaliser), ``i`` the lane's global row-major index, and two seeds: 64 bits.

Sums mod 2**32 are associative and commutative, so the value is the same for a sharded
``jax.Array`` (one jitted elementwise pass plus an 8-byte all-reduce), a NumPy array,
or the array read back onto another topology. Odd weights make any change inside one
lane change the sum. :func:`digest_array` also returns each distinct device shard's
digest (its *box*, ``[[start, stop], ...]`` per dimension), computed so that every
process holds the same table before Orbax writes it (Orbax writes custom metadata from
the primary process only). Lane indices wrap at 2**32 lanes (16 GiB of one array):
beyond that, weights repeat, so two changes 16 GiB apart could cancel.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SEEDS = (0x9E3779B9, 0x7F4A7C15)
_CHUNK = 1 << 22  # lanes per NumPy pass (bounds the host memory of digest_np)
Box = tuple[tuple[int, int], ...]


def _bits(dtype: Any) -> int:
    return jax.dtypes.itemsize_bits(np.dtype(dtype))


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _fmix32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


# -- NumPy --------------------------------------------------------------------------------
def lanes_np(x: Any) -> np.ndarray:
    """``x``'s lanes, flat, in row-major order (uint32)."""
    x = np.ascontiguousarray(x)
    dtype = x.dtype
    if dtype.kind == "c":
        part = np.float32 if dtype.itemsize == 8 else np.float64
        both = np.stack([x.real.astype(part), x.imag.astype(part)], axis=-1)
        return lanes_np(both)
    bits = _bits(dtype)
    if dtype == np.bool_:
        return x.view(np.uint8).reshape(-1).astype(np.uint32)
    if bits < 8:
        return (x.view(np.uint8).reshape(-1) & np.uint8((1 << bits) - 1)).astype(np.uint32)
    if dtype.itemsize == 8:
        return x.view(np.uint32).reshape(-1)  # little-endian: low word first
    return x.view(np.dtype(f"uint{8 * dtype.itemsize}")).reshape(-1).astype(np.uint32)


def digest_np(x: Any) -> tuple[int, int]:
    """The digest of a host array (the same as :func:`digest_array` gives on device).

    Arrays of at least ``XLA_FROM`` elements that XLA computes on exactly (JAX holds
    their dtype as it is) are digested by the jitted code on a CPU device, ten times
    faster than NumPy's passes; the rest, and everything where JAX has no CPU device,
    by NumPy (:func:`numpy_digest`)."""
    x = np.asarray(x)
    cpu = _cpu_device() if x.size >= XLA_FROM and on_device(x.dtype) and \
        jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype else None
    if cpu is None:
        return numpy_digest(x)
    total = np.asarray(_total_fn(x.ndim)(jax.device_put(x, cpu)))
    return int(total[0]), int(total[1])


XLA_FROM = 1 << 16  # elements: below, NumPy's passes cost less than a dispatch


@functools.cache
def _cpu_device() -> Any:
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU backend out: NumPy then
        return None


def numpy_digest(x: Any) -> tuple[int, int]:
    """:func:`digest_np` computed by NumPy alone (any dtype, any size)."""
    lanes = lanes_np(x)
    out = []
    for seed in SEEDS:
        total = np.uint32(0)
        for start in range(0, lanes.size, _CHUNK):
            part = lanes[start:start + _CHUNK]
            idx = (np.arange(start, start + part.size, dtype=np.uint64)
                   & np.uint64(0xFFFFFFFF)).astype(np.uint32)
            w = _fmix32_np(idx + np.uint32(seed)) | np.uint32(1)
            total = total + np.sum(w * part, dtype=np.uint32)
        out.append(int(total))
    return out[0], out[1]


# -- device -------------------------------------------------------------------------------
def on_device(dtype: Any) -> bool:
    """Whether a jax.Array of ``dtype`` is digested on its devices (else: on the host).
    XLA cannot compute on 1-bit and 6-bit types."""
    return _bits(dtype) not in (1, 6)


def _lanes(x: jax.Array) -> jax.Array:
    """``x``'s lanes as ``x.shape + (lanes,)`` (uint32)."""
    dtype = np.dtype(x.dtype)
    if dtype.kind == "c":
        part = jnp.float32 if dtype.itemsize == 8 else jnp.float64
        both = jnp.stack([jnp.real(x).astype(part), jnp.imag(x).astype(part)], axis=-1)
        lanes = _lanes(both)
        return lanes.reshape(x.shape + (-1,))
    bits = _bits(dtype)
    if dtype == np.bool_:
        return x.astype(jnp.uint32)[..., None]
    if bits < 8:
        unsigned = jnp.dtype(f"uint{bits}")
        if dtype != unsigned:
            x = lax.bitcast_convert_type(x, unsigned)
        return x.astype(jnp.uint32)[..., None]
    if dtype.itemsize == 8:
        return lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = jnp.dtype(f"uint{8 * dtype.itemsize}")
    if dtype != unsigned:
        x = lax.bitcast_convert_type(x, unsigned)
    return x.astype(jnp.uint32)[..., None]


def _terms(x: jax.Array, shape: tuple | None = None,
           offsets: list | None = None) -> list[jax.Array]:
    """``w_s(i) * lane_i`` for each seed, shaped ``x.shape + (lanes,)``; ``x`` is the
    block at ``offsets`` (per dimension; None: 0) of an array of ``shape`` (None: x's)."""
    lanes = _lanes(x)
    full = tuple(shape if shape is not None else x.shape) + (lanes.shape[-1],)
    idx = jnp.zeros(lanes.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(lanes.ndim)):
        along = lax.broadcasted_iota(jnp.uint32, lanes.shape, d)
        if offsets is not None and d < len(offsets):
            along = along + offsets[d]
        idx = idx + along * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= full[d]
    return [(_fmix32(idx + jnp.uint32(s)) | jnp.uint32(1)) * lanes for s in SEEDS]


def _sums(terms: list[jax.Array]) -> jax.Array:
    """Each seed's sum mod 2**32, in one variadic reduction: XLA fuses it with the
    elementwise terms, so no array of terms is materialised."""
    zeros = [jnp.uint32(0)] * len(terms)
    sums = lax.reduce(terms, zeros, lambda a, b: [x + y for x, y in zip(a, b, strict=True)],
                      tuple(range(terms[0].ndim)))
    return jnp.stack(sums)


@functools.lru_cache(maxsize=256)
def _digest_fn(sharding: NamedSharding, shape: tuple):
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    everywhere = NamedSharding(mesh, P())

    used = {a for entry in spec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))}
    copies = [a for a in mesh.axis_names if a not in used]  # axes the array is copied on

    def local(block):  # one device's block: its offsets from the mesh position
        offsets = []
        for d, entry in enumerate(spec):
            axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
            k = jnp.uint32(0)
            for a in axes:
                k = k * jnp.uint32(mesh.shape[a]) + lax.axis_index(a).astype(jnp.uint32)
            offsets.append(k * jnp.uint32(block.shape[d] & 0xFFFFFFFF))
        first = jnp.bool_(True)  # only the first copy of a box is digested (in mesh
        for a in copies:         # order: the one digest_array keeps); others give 0
            first = first & (lax.axis_index(a) == 0)
        return lax.cond(first, lambda b: _sums(_terms(b, shape, offsets)),
                        lambda b: jnp.zeros(len(SEEDS), jnp.uint32), block)[None]

    # The whole array's digest is the sum of its distinct boxes' (they tile it): no
    # second pass, and nothing but the sums leaves the fused per-device loop.
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(*spec),
                                 out_specs=P(tuple(mesh.axis_names)), check_vma=False),
                   out_shardings=everywhere)


@functools.lru_cache(maxsize=256)
def _total_fn(ndim: int):
    del ndim  # part of the cache key only

    return jax.jit(lambda x: _sums(_terms(x)))


def full_box(shape: tuple) -> Box:
    return tuple((0, int(n)) for n in shape)


def _box(index: tuple, shape: tuple) -> Box:
    return tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in
                 zip(index, shape, strict=True)) if index else ()


def _host(x: jax.Array) -> np.ndarray:
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def digest_array(x: Any) -> tuple[tuple[int, int], list[tuple[Box, tuple[int, int]]]]:
    """``(digest, [(box, digest), ...])`` of a leaf: a NumPy array, or a jax.Array
    (computed on its devices; every process gets the same values, because both are
    replicated outputs). Boxes are the distinct device shards', in device order; a
    NumPy leaf, or an array not on a named sharding, has one box: the whole array."""
    shape = tuple(np.shape(x))
    if not isinstance(x, jax.Array) or not on_device(x.dtype):
        if isinstance(x, jax.Array):
            x = _host(x)  # checked by the caller: replicated or fully addressable
        total = digest_np(x)
        return total, [(full_box(shape), total)]
    sharding = x.sharding
    if not isinstance(sharding, NamedSharding) or x.ndim == 0:
        total = tuple(int(v) for v in _host(_total_fn(x.ndim)(x)))
        return (total[0], total[1]), [(full_box(shape), (total[0], total[1]))]
    per_device = _host(_digest_fn(sharding, shape)(x))
    where = sharding.devices_indices_map(shape)
    boxes: dict[Box, tuple[int, int]] = {}
    for k, device in enumerate(sharding.mesh.devices.flat):
        boxes.setdefault(_box(where[device], shape),
                         (int(per_device[k][0]), int(per_device[k][1])))
    total = [sum(d[s] for d in boxes.values()) & 0xFFFFFFFF for s in range(len(SEEDS))]
    return (total[0], total[1]), list(boxes.items())


def digest_only(x: Any) -> tuple[int, int]:
    """The digest of a leaf without its box table (the check after a restore)."""
    if not isinstance(x, jax.Array) or not on_device(x.dtype):
        return digest_np(_host(x) if isinstance(x, jax.Array) else x)
    total = _host(_total_fn(x.ndim)(x))
    return int(total[0]), int(total[1])
