"""How the Ray carrier ships a large array through the object store: in pieces of at
most 1 MiB, sent without a copy and joined without one.

Ray copies each out-of-band buffer of a pickled object into its object store; a buffer
over 1 MiB is copied by ``parallel_memcopy`` on six threads that Ray starts and joins
for that one copy (``MEMCOPY_THREADS`` in its ``serialization.pxi``, fixed when Ray is
built). For the 4 MiB kernel of a 64-1024-1024-10 MLP on a loaded 2-core machine, a
``ray.put`` then took 2.3 ms of CPU and 3.8 ms of wall time, against 1.5-1.7 and
2.3-2.4 ms for the same bytes in four 1 MiB buffers, which Ray copies with one
``memcpy`` each.

:class:`Pieces` wraps such an array: pickled, it is its bytes as views of at most
:data:`PIECE_BYTES` (no copy); unpickled (:func:`joined`), it is the array again. The
pieces of one array lie back to back in the object (each but the last a multiple of 64
bytes, Ray's alignment), so the joined array is a read-only view of them, as Ray's own
arrays are; where they do not (another transport), it is their copy.

Example (what Ray's serializer does with a piece: ``__reduce__``, then the call it names):
  >>> import numpy as np
  >>> from jreplicate.ps.ray import pieces
  >>> tree = {"w": np.ones((1024, 1024), np.float32), "b": np.zeros(3, np.float32)}
  >>> sent = pieces.in_pieces(tree)
  >>> rebuild, (dtype, shape, parts) = sent["w"].__reduce__()
  >>> len(parts), max(p.nbytes for p in parts) <= pieces.PIECE_BYTES
  (4, True)
  >>> w = rebuild(dtype, shape, parts)
  >>> w.shape, w.dtype, bool((w == 1).all()), sent["b"] is tree["b"]
  ((1024, 1024), dtype('float32'), True, True)
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

#: The most bytes Ray copies with one ``memcpy`` (``kMemcopyDefaultThreshold``).
PIECE_BYTES = 1 << 20


class Pieces:
    """An array that pickles as its bytes in pieces of at most :data:`PIECE_BYTES`,
    and unpickles as the array (:func:`joined`)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __reduce__(self):
        a = self.array
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return joined, (a.dtype, a.shape, [flat[i:i + PIECE_BYTES]
                                           for i in range(0, flat.size, PIECE_BYTES)])


def _is_big(x: Any) -> bool:
    return isinstance(x, np.ndarray) and x.nbytes > PIECE_BYTES and not x.dtype.hasobject


def in_pieces_leaf(x: Any) -> Any:
    """``x`` wrapped in :class:`Pieces` if it is a NumPy array over :data:`PIECE_BYTES`,
    else ``x``."""
    return Pieces(x) if _is_big(x) else x


def in_pieces(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``tree`` (a ``{key: array}`` dict) with each NumPy array over
    :data:`PIECE_BYTES` wrapped in :class:`Pieces` (the others as they are)."""
    return {k: in_pieces_leaf(v) for k, v in tree.items()}


def joined(dtype: np.dtype, shape: tuple[int, ...], parts: Sequence[np.ndarray]
           ) -> np.ndarray:
    """The read-only array of ``dtype`` and ``shape`` whose bytes are ``parts`` (1-d
    ``uint8`` arrays) in order: a view of them where they lie back to back in memory
    (it keeps every part alive), else their copy.

    Raises:
      ValueError: the parts do not hold the array's bytes.
    """
    dtype = np.dtype(dtype)
    parts = [np.asarray(p) for p in parts]
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if any(p.dtype != np.uint8 or p.ndim != 1 for p in parts) or \
            sum(p.size for p in parts) != size:
        raise ValueError(f"pieces.joined: expected {size} bytes of a {dtype} array of shape "
                         f"{tuple(shape)} in 1-d uint8 parts, got "
                         f"{[(p.dtype.str, p.shape) for p in parts]}.")
    flat = _view(parts) if len(parts) > 1 else None
    if flat is None:
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
    out = flat.view(dtype).reshape(shape)
    out.flags.writeable = False
    return out


def _view(parts: list[np.ndarray]) -> np.ndarray | None:
    """One ``uint8`` view of ``parts`` if each starts where the one before ends (and
    all are contiguous), else None. The view holds every part (and so the memory each
    holds: Ray's object) for as long as it lives."""
    start = parts[0].ctypes.data
    at = start
    for p in parts:
        if not p.flags.c_contiguous or p.ctypes.data != at:
            return None
        at += p.size
    span = (ctypes.c_ubyte * (at - start)).from_address(start)
    span._parts = parts  # (a ctypes array keeps no reference to the memory it maps)
    return np.frombuffer(span, np.uint8)
