"""Pytree helpers shared by the modules (private)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def path_str(path: tuple) -> str:
    """Renders a key path as ``['a'][0].b`` (empty for the root)."""
    return jax.tree_util.keystr(path)


def is_array_like(x: Any) -> bool:
    """True for JAX arrays/tracers, numpy arrays/scalars and Python numbers."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def flatten_arrays(tree: Any, message: Callable[[tuple, Any], str],
                   what: str = "") -> tuple[list, Any]:
    """``tree_flatten_with_path`` that raises ``TypeError(message(path, leaf))`` naming
    every leaf that is not array-like (see :func:`report`; ``what`` heads the list)."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    report([TypeError(message(path, leaf)) for path, leaf in pairs
            if not is_array_like(leaf)], what)
    return pairs, treedef


class LeafErrors(TypeError, ValueError):
    """Several leaves of one pytree are wrong, some by type and some by value: caught by
    ``except TypeError`` and by ``except ValueError`` alike."""


#: At most this many leaves are listed in one error; the rest are counted.
MAX_LISTED = 12


def report(problems: list[Exception], what: str) -> None:
    """Raises the leaf ``problems`` of one pytree at once, or returns if there are none.

    One problem is raised as it is (its one-line message names the leaf, the path and
    the fix). Several are raised as one error, headed by ``what``, with one bullet per
    leaf (the ``what: `` each message starts with is said once), as
    ``jax/_src/shard_map.py`` reports every bad spec at once: fixing one leaf never
    just uncovers the next. The error is a ``TypeError`` if they all are, a
    ``ValueError`` if they all are, otherwise a :class:`LeafErrors` (both).

    Example:
      >>> report([TypeError("f(x): ['a'] is a str"), TypeError("f(x): ['b'] is a str")],
      ...        "f(x)")
      Traceback (most recent call last):
      TypeError: f(x): 2 leaves are wrong:
        - ['a'] is a str
        - ['b'] is a str
    """
    if len(problems) == 1:
        raise problems[0]
    if not problems:
        return
    prefix = f"{what}: " if what else ""
    bullets = [str(e).removeprefix(prefix) if prefix else str(e)
               for e in problems[:MAX_LISTED]]
    more = len(problems) - len(bullets)
    lines = [f"{prefix}{len(problems)} leaves are wrong:"]
    lines += ["  - " + b.replace("\n", "\n    ") for b in bullets]
    if more:
        lines.append(f"  ... and {more} more (fix these and run again to see them)")
    kinds = {type(e) for e in problems}
    kind = (kinds.pop() if len(kinds) == 1 else
            TypeError if all(issubclass(k, TypeError) for k in kinds) else
            ValueError if all(issubclass(k, ValueError) for k in kinds) else LeafErrors)
    raise kind("\n".join(lines))


def map_checked(fn: Callable[[tuple, Any], Any], tree: Any, what: str,
                is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``tree_map_with_path(fn, tree)`` where ``fn`` checks each leaf and may raise
    ``TypeError``/``ValueError`` for it: every leaf is checked, then the problems are
    raised together by :func:`report`."""
    problems: list[Exception] = []

    def leaf(path, x):
        try:
            return fn(path, x)
        except (TypeError, ValueError) as e:
            problems.append(e)
            return None

    out = jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_leaf)
    report(problems, what)
    return out


def covers(index: tuple, shape: tuple) -> bool:
    """Whether a shard's ``index`` (slices) spans the whole of each dimension of ``shape``."""
    return all(s.start in (None, 0) and s.stop in (None, d) for s, d in zip(index, shape))


def check_array_leaves(tree: Any, what: str) -> None:
    """Raises TypeError naming every leaf of ``tree`` that is not array-like."""
    flatten_arrays(tree, lambda path, leaf: (
        f"{what}: the leaf at {what_path(path)} is a {type(leaf).__name__}, not an "
        "array. Collectives and replicated computation work on pytrees of arrays "
        "(jax.Array, numpy arrays or Python numbers); remove the leaf or close over "
        "it as a constant in your step function instead."), what)


def what_path(path: tuple) -> str:
    s = path_str(path)
    return f"path {s}" if s else "the root"


_INT32 = np.iinfo(np.int32)
_UINT32 = np.iinfo(np.uint32)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_fits(x: np.ndarray, where: str | Callable[[], str]) -> None:
    """Raises ValueError when JAX, with 64-bit types disabled, would change the values of
    the 64-bit numpy array ``x`` (ints wrapped modulo 2**32, floats, or the parts of
    complex numbers, turned into inf). ``where`` names the value (or is called to name
    it, only for the error)."""
    kind = native(x.dtype)  # (a big-endian int64 is checked as one)
    if kind not in (np.int64, np.uint64, np.float64, np.complex128) or not x.size:
        return
    if jax.config.jax_enable_x64:
        return
    if kind in (np.float64, np.complex128):
        parts = (x.real, x.imag) if kind == np.complex128 else (x,)
        big = max(float(np.max(np.abs(p), initial=0.0, where=np.isfinite(p)))
                  for p in parts)
        if big <= _FLOAT32_MAX:
            return
        target = "complex64" if kind == np.complex128 else "float32"
        bad, fix = big, f"scale it, or keep it as {kind.name}"
    else:
        info = _INT32 if kind == np.int64 else _UINT32
        lo, hi = int(x.min()), int(x.max())
        if info.min <= lo and hi <= info.max:
            return
        bad = lo if lo < info.min else hi
        target, fix = info.dtype.name, "e.g. split it into two int32 parts or use float64"
    where = where if isinstance(where, str) else where()
    raise ValueError(
        f"{where} holds {bad!r} ({kind.name}), which does not fit {target}: with JAX's "
        f"64-bit types disabled it would silently arrive changed (wrapped or inf). Convert "
        f"it to a type that holds it ({fix}), or enable 64-bit types before any JAX work: "
        "jax.config.update('jax_enable_x64', True)."
    )


#: The widest float and complex JAX holds (bytes): not NumPy's 80/128-bit ``longdouble``.
_WIDEST = {"f": 8, "c": 16}


@functools.lru_cache(maxsize=64)
def jax_can_hold(dtype: np.dtype) -> bool:
    """Whether a JAX array can hold NumPy ``dtype``: booleans and numbers, ml_dtypes'
    among them (bfloat16, float8, int4), but not strings, objects, records, datetimes,
    timedeltas (NumPy files ``timedelta64`` under its signed integers), ``longdouble``
    (``float128``, ``complex256``) or ``float0`` (which holds no data)."""
    return dtype.kind not in "mM" and dtype.itemsize <= _WIDEST.get(dtype.kind, 16) and (
        dtype == np.bool_ or bool(jax.dtypes.issubdtype(dtype, np.number)))


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (JAX refuses a big-endian ``>f4``)."""
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def read_now(x: Any) -> Any:
    """A NumPy leaf's values as of now: a copy, which nothing else writes (JAX on CPU
    may place an aligned NumPy array without a copy, jax 0.12's ``device_put`` even with
    ``may_alias=False``, so the caller refilling its array later would change what was
    placed), in native byte order (the same values: JAX cannot hold a big-endian array,
    e.g. one read from a FITS or network-order file); any other leaf (a ``jax.Array`` is
    immutable) as it is."""
    return np.array(x, dtype=native(x.dtype)) if isinstance(x, np.ndarray) else x


def host_copy(x: Any) -> np.ndarray:
    """:func:`read_now` as a NumPy array (a ``jax.Array`` as a view of its immutable
    buffer, a Python number as a 0-d array)."""
    return np.asarray(read_now(x))


def put_host_values(xs: list, sharding: Any, wheres: list[str | Callable[[], str]]
                    ) -> tuple[list, list[Exception]]:
    """Host data ``xs`` (NumPy, Python numbers, ``jax.Array``) each placed on the fully
    addressable ``sharding`` (one process), read now.

    (Across processes every process passes its own copies, which must be agreed on
    first, alike on every process: see :mod:`jreplicate.execution.agreed`.)

    Returns:
      The placed arrays (None where JAX refused a value) and one error per refused
      value, named by ``wheres``.
    """
    if not sharding.is_fully_addressable:
        raise RuntimeError("put_host_values places on one process's devices only; across "
                           "processes use jreplicate.execution.agreed")
    placed, problems = [], []
    for x, where in zip((read_now(x) for x in xs), wheres, strict=True):
        try:
            placed.append(jax.device_put(x, sharding))
        except (TypeError, ValueError, OverflowError) as e:
            placed.append(None)
            problems.append(_named(e, where))
    return placed, problems


def _named(e: Exception, where: str | Callable[[], str]) -> Exception:
    """``e`` (JAX's or NumPy's error placing a host value) as the same type, naming the
    value's place."""
    where = where if isinstance(where, str) else where()
    return type(e)(f"{where}: {e}") if isinstance(e, (TypeError, ValueError)) else \
        ValueError(f"{where}: {e}")


def deleted_array_error(where: str) -> ValueError:
    """The error for a leaf that was donated to an earlier step: ``where`` names it (an
    argument and its pytree path)."""
    return ValueError(
        f"Replicator.run: {where} is an array that was donated to an earlier step "
        "(run(..., donate_argnums=...), or an NNX module's old state) and no longer exists. "
        "Pass the value that run returned instead (params, opt_state = rep.run(step, ..., "
        "params, opt_state, donate_argnums=(0, 1))), or do not donate an argument you read "
        "again."
    )
