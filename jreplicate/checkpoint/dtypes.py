"""How each dtype is stored in a checkpoint (private to jreplicate.checkpoint).

Orbax writes arrays with TensorStore, which stores most of JAX's dtypes as they are,
but not all of them (TensorStore 0.1.86 lacks ``uint4``, ``uint2``, ``int1``,
``uint1``, ``float6_e2m3fn``, ``float6_e3m2fn`` and ``float8_e4m3``: Orbax failed
part-way through its write with ``Unsupported data type``). A leaf of such a dtype is
stored as its bits, an array of the unsigned integer of its item size (``uint8`` for
every one of these), and the checkpoint's custom metadata records its dtype (the
checksum table's ``views``), so a restore views the bits back: bit for bit, never
converted. Whether a dtype is stored as it is or as its bits is asked of TensorStore,
so a later TensorStore that stores ``uint4`` stores it as it is; either checkpoint
restores.

A reader that does not know the record (an older jreplicate) sees the ``uint8``
array, and refuses to restore it into init_fn()'s ``uint4`` as another dtype; it never
casts. What cannot be stored exactly at all (``float0``, strings, objects, records) is
refused by :func:`unsavable` before anything is written.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

_WIDTHS = (1, 2, 4, 8)  # item sizes with an unsigned integer to hold their bits


def unsavable(dtype: Any) -> str | None:
    """Why a leaf of ``dtype`` cannot be checkpointed, with the fix; None when it can
    (JAX's bool and numeric dtypes: stored as they are, or as their bits)."""
    dtype = np.dtype(dtype)
    name = dtype.name
    if dtype == jax.dtypes.float0:
        return ("float0, the type of the gradient of an integer input, which holds no "
                "data. Leave it out of the saved state (rebuild it with "
                "np.zeros(shape, jax.dtypes.float0) after restoring)")
    if dtype.kind in "USOT" or isinstance(dtype, np.dtypes.StringDType):
        return (f"{dtype}, which is not a numeric dtype: a checkpoint holds arrays of "
                "numbers. Keep strings and objects out of the saved state (or encode "
                "strings as bytes: np.frombuffer(s.encode(), np.uint8))")
    numeric = jax.dtypes.issubdtype(dtype, np.number) or dtype == np.bool_
    if not numeric or dtype.fields is not None or (
            not _native(dtype) and dtype.itemsize not in _WIDTHS):
        return (f"{name}, which a checkpoint cannot hold exactly. Save a numeric view of "
                "its bytes instead (x.view(np.uint8)) and view it back after restoring")
    return None


def storage_dtype(dtype: Any) -> np.dtype:
    """The dtype a leaf of ``dtype`` is stored as: itself when TensorStore stores it,
    else the unsigned integer of its item size (its bits)."""
    dtype = np.dtype(dtype)
    return dtype if _native(dtype) else bits_dtype(dtype)


def bits_dtype(dtype: Any) -> np.dtype:
    """The unsigned integer dtype of ``dtype``'s item size."""
    return np.dtype(f"uint{8 * np.dtype(dtype).itemsize}")


@functools.cache
def _native(dtype: np.dtype) -> bool:
    import tensorstore as ts
    try:
        return np.dtype(ts.dtype(dtype).numpy_dtype) == dtype
    except (ValueError, TypeError):  # "No TensorStore data type corresponding to ..."
        return False


def as_stored(x: np.ndarray) -> np.ndarray:
    """``x`` as it is written: itself, or a view of its bits."""
    stored = storage_dtype(x.dtype)
    return x if stored == x.dtype else x.view(stored)


def from_name(name: str) -> np.dtype | None:
    """The dtype named ``name`` (NumPy's or ml_dtypes'), or None when this process's
    NumPy and ml_dtypes do not define it."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes
        kind = getattr(ml_dtypes, name, None)
        return np.dtype(kind) if isinstance(kind, type) else None
