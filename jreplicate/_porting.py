"""Batches, state and step functions shaped for ``jax.pmap``, told apart from legitimate
ones where that can be done (private).

Code ported from ``jax.pmap`` brings three shapes that ``Replicator.run`` would otherwise
take silently, or fail on deep inside JAX or optax:

* **A pmap-shaped batch** ``[devices, b, ...]`` (``flax.training.common_utils.shard``,
  a loader that reshapes for pmap). Given to ``run`` as a global batch, every replica
  gets ``[1, b, ...]``; yielded by an input function as a per-replica element, every
  replica gets the whole ``[devices, b, ...]``. The rule (:func:`pmap_shape`): at least
  two leaves, every leaf ``[n, b, ...]`` with ``n`` the number of replicas, of this
  process's replicas or of its devices, and one ``b`` for all. Shapes alone cannot tell
  such a batch from a legitimate batch of one example per replica whose leaves share
  their second dimension (a language model's tokens and targets ``[8, T]`` on 8
  replicas), so a match is a :class:`PmapShapedBatchWarning`. It is an error where the
  input function said its per-replica batch size (``ctx.get_per_replica_batch_size``)
  and the element's second dimension is that size while its first is not. A single-leaf
  batch is never flagged (``[8, T]`` alone is too often legitimate).
* **State with a device axis** (``flax.jax_utils.replicate``, a ``jax.pmap`` output):
  an argument every leaf of which is a ``jax.Array`` ``[n, ...]`` split one row per
  device over ``n >= 2`` devices (another mesh than the strategy's), holding ``n``
  identical rows, or carrying the mesh axis name of ``jax_utils.replicate`` or of
  ``jax.pmap``: an error (:func:`device_axis_errors`). An argument whose rows differ is
  taken as it is (each replica sees the whole array).
* **A jitted step** (``@jax.jit`` / ``@nnx.jit`` left on it): an error
  (:func:`check_step`); a jitted function called inside the step is fine.

Every check reads shapes, shardings and (for device-axis candidates, once) values only,
so every process of a job decides alike.
"""

from __future__ import annotations

import functools
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jreplicate._jax_compat import jit_wrapper_type
from jreplicate._tree import path_str


class PmapShapedBatchWarning(UserWarning):
    """A batch looks shaped for ``jax.pmap`` (``[devices, b, ...]`` on every leaf).

    Silence it where such a batch is meant (one example per replica whose leaves share
    their second dimension) by its category.

    Example (8 replicas, one sequence each):
      >>> import warnings, numpy as np, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy())
      >>> batch = {"tokens": np.zeros((8, 32), np.int32),
      ...          "targets": np.zeros((8, 32), np.int32)}
      >>> with warnings.catch_warnings():
      ...     warnings.simplefilter("ignore", jr.input.PmapShapedBatchWarning)
      ...     rows = rep.run(lambda ctx, b: b["tokens"].shape[0], batch)
      >>> int(rows)
      1
    """


#: Mesh axis names that only ``flax.jax_utils.replicate`` and ``jax.pmap`` give arrays.
_PMAP_AXES = frozenset({"_device_put_sharded", "_internal_pmap_axis_name"})
_LISTED = 4  # leaves shown in a message
_SILENCE = ("If this is meant (one example per replica, leaves sharing their second "
            "dimension), silence it with warnings.filterwarnings('ignore', "
            "category=jr.input.PmapShapedBatchWarning).")


def device_counts(num_replicas: int, local_replicas: int) -> frozenset[int]:
    """The leading dimensions a pmap-shaped batch may have: the number of replicas, of
    this process's replicas and of its devices (``common_utils.shard``'s), above 1."""
    return frozenset(n for n in (num_replicas, local_replicas, jax.local_device_count())
                     if n > 1)


def pmap_shape(shapes: Sequence[tuple], counts: frozenset[int]) -> tuple[int, int] | None:
    """``(n, b)`` when every shape is ``[n, b, ...]`` with ``n`` in ``counts`` and one
    ``b``, over at least two shapes; else None.

    Example:
      >>> pmap_shape([(8, 16, 28, 28, 1), (8, 16)], frozenset({8}))
      (8, 16)
      >>> pmap_shape([(8, 28, 28, 1), (8,)], frozenset({8})) is None  # a global batch of 8
      True
    """
    if len(shapes) < 2 or any(len(s) < 2 for s in shapes):
        return None
    n, b = shapes[0][:2]
    if n not in counts or any(s[:2] != (n, b) for s in shapes):
        return None
    return n, b


def _listing(paths: Sequence[str], shapes: Sequence[tuple], cut: Callable) -> str:
    shown = ", ".join(f"{p}: {cut(s)}" for p, s in zip(paths[:_LISTED], shapes[:_LISTED]))
    more = len(paths) - _LISTED
    return shown + (f", ... ({more} more)" if more > 0 else "")


def check_global_batch(batch: Any, counts: frozenset[int], num_replicas: int,
                       is_leaf: Callable[[Any], bool]) -> None:
    """Warns (:class:`PmapShapedBatchWarning`) when the plain arrays of ``run``'s
    ``inputs``, global batches split over ``num_replicas``, are pmap-shaped."""
    pairs = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(batch, is_leaf=is_leaf)[0]
             if not is_leaf(x)]
    shapes = [tuple(np.shape(x)) for _, x in pairs]
    found = pmap_shape(shapes, counts)
    if found is None or found[0] % num_replicas:
        return  # (an indivisible batch gets run's own error)
    n, b = found
    paths = [path_str(p) or "the root" for p, _ in pairs]
    rows = n // num_replicas
    warnings.warn(PmapShapedBatchWarning(
        f"Replicator.run(fn, inputs): the inputs look shaped for jax.pmap: every leaf "
        f"is [{n}, {b}, ...] ({_listing(paths, shapes, tuple)}), as "
        f"flax.training.common_utils.shard makes them. A plain array in inputs is a "
        f"global batch split over the {num_replicas} replicas along its first axis, so "
        f"each replica gets {_listing(paths, shapes, lambda s: (rows,) + s[1:])} "
        f"(batch.shape[0] == {rows}, not {n * b // num_replicas}). Give run the global "
        "batch: drop common_utils.shard, or reshape each leaf with "
        f"x.reshape(-1, *x.shape[2:]). {_SILENCE}"), stacklevel=3)


def check_element(shapes: Sequence[tuple], paths: Sequence[str], counts: frozenset[int],
                  asked: int | None, where: str) -> PmapShapedBatchWarning | None:
    """The first step's per-replica element (its leaves' ``shapes`` and ``paths``) that
    an input function yielded: a warning to give when it is pmap-shaped, None when not.

    Raises:
      ValueError: it is certainly pmap-shaped: its second dimension is the per-replica
        batch size the input function asked for (``asked``), its first is not.
    """
    found = pmap_shape(shapes, counts)
    if found is None:
        return None
    n, b = found
    said = (f"every leaf is [{n}, {b}, ...] ({_listing(paths, shapes, tuple)}), as "
            "flax.training.common_utils.shard makes them for jax.pmap. Each replica takes "
            "one element as its own batch, so each would get a whole "
            f"[{n}, {b}, ...] element ({n} times its batch, with an extra axis)")
    fix = ("Yield per-replica batches: batch the dataset by "
           "ctx.get_per_replica_batch_size(global_batch_size) and drop "
           "common_utils.shard (or pass the global batch, x.reshape(-1, *x.shape[2:]), "
           "straight to rep.run(step, batch)).")
    if asked == b and n != b:
        raise ValueError(
            f"{where} is shaped for jax.pmap: input_fn asked "
            f"ctx.get_per_replica_batch_size(...) for {b} rows per replica, but {said}. "
            + fix)
    return PmapShapedBatchWarning(f"jreplicate: {where} looks shaped for jax.pmap: {said}. "
                                  f"{fix} {_SILENCE}")


# -- state with a device axis ---------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _device_rows(sharding: Any) -> int:
    """``n`` when an array ``[n, ...]`` of this sharding holds one row on each of the
    ``n >= 2`` devices of its mesh (split along its first axis only), else 0."""
    if not isinstance(sharding, NamedSharding):
        return 0
    spec = tuple(sharding.spec)
    if not spec or spec[0] is None or any(p is not None for p in spec[1:]):
        return 0
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    n = math.prod(sharding.mesh.shape[a] for a in axes)
    return n if n >= 2 and n == sharding.mesh.size else 0


def _candidate(x: Any, mesh: Any) -> bool:
    return (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
            and x.ndim >= 1 and not x.is_deleted() and x.shape[0] >= 2
            and _device_rows(x.sharding) == x.shape[0] and x.sharding.mesh != mesh)


def _fingerprinted(x: jax.Array) -> bool:
    return bool(_PMAP_AXES & set(x.sharding.mesh.axis_names))


def _rows_identical(x: jax.Array) -> bool:
    if not x.is_fully_addressable:
        return False
    shards = [np.asarray(s.data) for s in x.addressable_shards]
    return all(np.array_equal(shards[0], s) for s in shards[1:])


_CLEARED: dict = {}  # groups of candidates found to hold different rows (not flagged)


def device_axis_errors(groups: Sequence[tuple[str, Sequence[int]]], leaves: Sequence[Any],
                       name: Callable[[int], str], mesh: Any = None,
                       what: str = "Replicator.run") -> list[ValueError]:
    """An error for each argument (a ``(label, leaf indices)`` of ``groups``) that holds
    state with a leading device axis (see the module docstring); ``mesh``: the
    strategy's own (its per-replica arrays are not candidates)."""
    out = []
    for label, idx in groups:
        if not idx or not _candidate(leaves[idx[0]], mesh):
            continue  # (the common case: one look at the first leaf)
        xs = [leaves[i] for i in idx]
        if not all(_candidate(x, mesh) for x in xs):
            continue
        key = tuple((x.shape, x.dtype, x.sharding) for x in xs)
        if key in _CLEARED:
            continue
        if not (any(map(_fingerprinted, xs)) or all(map(_rows_identical, xs))):
            if len(_CLEARED) >= 64:
                _CLEARED.clear()
            _CLEARED[key] = True
            continue
        n = xs[0].shape[0]
        leaf = f"{len(xs)} leaves are" if len(xs) > 1 else "leaf is"
        out.append(ValueError(
            f"{what}: {label} has a leading device axis: its {leaf} [{n}, ...] with one "
            f"row on each of {n} devices (e.g. {name(idx[0])} of shape {xs[0].shape}), as "
            "flax.jax_utils.replicate or jax.pmap make state. run replicates state "
            f"itself, so each replica would get the whole [{n}, ...] array and a step "
            "written for one device fails or computes over the extra axis. Pass the "
            "state without the device axis: flax.jax_utils.unreplicate(state), or the "
            "state from before jax_utils.replicate (create it in rep.scope(), or place "
            "it with rep.replicate(state)). (If each replica should see the whole "
            "array, place it first with rep.replicate(x).)"))
    return out


# -- a jitted step ------------------------------------------------------------------------
def check_step(fn: Callable) -> None:
    """Raises when ``fn`` (or the function a ``functools.partial`` or bound method of it
    wraps) is jitted with ``jax.jit`` or ``nnx.jit``."""
    inner = fn
    for _ in range(8):  # (partials of partials, a bound method)
        if isinstance(inner, functools.partial):
            inner = inner.func
        elif hasattr(inner, "__func__") and not isinstance(inner, type):
            inner = inner.__func__
        else:
            break
    kind = _jit_kind(inner)
    if kind is None:
        return
    raise TypeError(
        f"Replicator.run(fn): the step is wrapped in {kind} (@{kind} left on it). run "
        "compiles the step itself (jax.jit over shard_map, one program per replica "
        "layout) and calls it with a ReplicaContext, which a jitted function can't take "
        f"as an argument. Remove @{kind} from the step; a jitted function called inside "
        "the step (a helper, a model's method) is fine."
        + (" run also writes Flax NNX modules' new state back, as nnx.jit did."
           if kind == "nnx.jit" else ""))


@functools.cache
def _pjit_type() -> type | None:
    return jit_wrapper_type()


def _jit_kind(fn: Any) -> str | None:
    t = _pjit_type()
    if t is not None and isinstance(fn, t):
        return "jax.jit"
    compilation = sys.modules.get("flax.nnx.transforms.compilation")
    wrapped = getattr(compilation, "JitWrapped", None)
    if wrapped is not None and isinstance(fn, wrapped):
        return "nnx.jit"
    return None
