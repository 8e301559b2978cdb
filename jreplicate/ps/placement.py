"""Placement of parameter leaves on parameter-server shards.

Two policies, both computed once from the parameters' paths, shapes and dtypes:

* ``"round_robin"``: leaf ``i`` (in pytree flattening order) goes to shard ``i %
  num_shards``, as TensorFlow's ``replica_device_setter`` assigns variables to
  ``/job:ps/task:i`` in creation order.
* ``"size_balanced"``: leaves, largest first, go to the shard holding the fewest bytes so
  far; a leaf larger than ``min_slice_bytes`` and than an even share of the total is
  split along its first axis into up to ``num_shards`` slices of at least
  ``min_slice_bytes`` each (TensorFlow's ``min_max_variable_partitioner``), and the
  slices are placed like leaves.

A :class:`Placement` is inspectable (``parts``, ``shard_of``, ``bytes_per_shard``,
``str()``) and splits and joins numpy pytrees by shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str

POLICIES = ("round_robin", "size_balanced")


@dataclasses.dataclass(frozen=True)
class Part:
    """One piece of one leaf on one shard.

    Attributes:
      leaf: the leaf's index in flattening order.
      path: the leaf's key path, rendered (``"['w']"``).
      shard: the shard holding the piece.
      start, stop: the rows ``[start, stop)`` of the leaf's first axis held, or
        ``(0, None)`` for the whole leaf.
      key: the piece's name on its shard (``"3"``, or ``"3:0:128"`` for a slice).
    """

    leaf: int
    path: str
    shard: int
    start: int
    stop: int | None

    @property
    def key(self) -> str:
        return str(self.leaf) if self.stop is None else f"{self.leaf}:{self.start}:{self.stop}"


class Placement:
    """Which shard holds which leaf (or slice of a leaf) of the parameters.

    Build it with :func:`place_parameters`.
    """

    def __init__(self, parts: Sequence[Part], treedef: Any, shapes: Sequence[tuple],
                 dtypes: Sequence[np.dtype], num_shards: int, policy: str):
        self.parts = tuple(parts)
        self.treedef = treedef
        self.shapes = tuple(shapes)
        self.dtypes = tuple(dtypes)
        self.num_shards = num_shards
        self.policy = policy

    def shard_of(self, path: str) -> int | list[int]:
        """The shard of the leaf at ``path`` (as rendered in ``parts``), or the list of
        shards of its slices when it is split."""
        found = [p.shard for p in self.parts if p.path == path]
        if not found:
            paths = sorted({p.path for p in self.parts})
            raise KeyError(f"Placement.shard_of({path!r}): no such leaf; paths are {paths}.")
        return found[0] if len(found) == 1 else found

    @property
    def assignment(self) -> list[int]:
        """The shard of each whole leaf in flattening order (``-1`` for a split leaf)."""
        out = [-1] * len(self.shapes)
        for p in self.parts:
            if p.stop is None:
                out[p.leaf] = p.shard
        return out

    @property
    def bytes_per_shard(self) -> list[int]:
        """Bytes of parameters held by each shard."""
        total = [0] * self.num_shards
        for p in self.parts:
            total[p.shard] += _nbytes(self._piece_shape(p), self.dtypes[p.leaf])
        return total

    def _piece_shape(self, p: Part) -> tuple:
        shape = self.shapes[p.leaf]
        return shape if p.stop is None else (p.stop - p.start, *shape[1:])

    def split(self, tree: Any) -> list[dict[str, np.ndarray]]:
        """``tree``'s leaves (numpy arrays) as one ``{key: piece}`` dict per shard."""
        return self.split_leaves(self.treedef.flatten_up_to(tree))

    def split_leaves(self, leaves: Sequence[Any]) -> list[dict[str, np.ndarray]]:
        """:meth:`split` of a tree flattened (``treedef.flatten_up_to``)."""
        out: list[dict[str, np.ndarray]] = [{} for _ in range(self.num_shards)]
        for p in self.parts:
            x = np.asarray(leaves[p.leaf])
            out[p.shard][p.key] = x if p.stop is None else x[p.start:p.stop]
        return out

    def join(self, pieces: Sequence[dict[str, np.ndarray]]) -> Any:
        """The pytree assembled from one ``{key: piece}`` dict per shard."""
        chunks: dict[int, list] = {}
        for p in self.parts:
            chunks.setdefault(p.leaf, []).append((p.start, pieces[p.shard][p.key]))
        leaves = []
        for i in range(len(self.shapes)):
            got = sorted(chunks[i], key=lambda c: c[0])
            leaves.append(got[0][1] if len(got) == 1 else np.concatenate([c[1] for c in got]))
        return jax.tree.unflatten(self.treedef, leaves)

    def __str__(self) -> str:
        rows = [f"Placement({self.policy}, {self.num_shards} shards, bytes per shard "
                f"{self.bytes_per_shard})"]
        for p in self.parts:
            rows.append(f"  shard {p.shard}: {p.path or 'root'}"
                        + ("" if p.stop is None else f"[{p.start}:{p.stop}]")
                        + f" {self._piece_shape(p)} {np.dtype(self.dtypes[p.leaf]).name}")
        return "\n".join(rows)

    __repr__ = __str__


def _nbytes(shape: tuple, dtype: Any) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def place_parameters(params: Any, num_shards: int, policy: str = "round_robin", *,
                     min_slice_bytes: int = 256 << 10) -> Placement:
    """Assigns the leaves of ``params`` to ``num_shards`` parameter-server shards.

    Args:
      params: a pytree of arrays (or of objects with ``shape`` and ``dtype``).
      num_shards: the number of shards (>= 1).
      policy: ``"round_robin"`` (``replica_device_setter``'s order) or
        ``"size_balanced"`` (largest first onto the lightest shard, large leaves split).
      min_slice_bytes: ``"size_balanced"`` only: the smallest slice a split leaf is cut
        into (default 256 KiB); leaves below twice this are never split.

    Returns:
      A :class:`Placement`.

    Raises:
      ValueError: ``num_shards`` or ``policy`` is invalid, or ``params`` has no leaves.

    Example:
      >>> import numpy as np
      >>> p = place_parameters({f"v{i}": np.zeros(2) for i in range(2, 6)}, 3)
      >>> p.assignment
      [0, 1, 2, 0]
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) \
            or num_shards < 1:
        raise ValueError(f"num_shards={num_shards!r} must be an int >= 1 (the PS shards).")
    if policy not in POLICIES:
        raise ValueError(f"placement={policy!r} must be one of {POLICIES}.")
    pairs, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not pairs:
        raise ValueError("the parameters have no arrays to place on parameter servers.")
    shapes = [tuple(np.shape(x)) for _, x in pairs]
    dtypes = [np.dtype(getattr(x, "dtype", np.asarray(x).dtype)) for _, x in pairs]
    paths = [path_str(p) for p, _ in pairs]
    parts: list[Part] = []
    if policy == "round_robin":
        parts = [Part(i, paths[i], i % num_shards, 0, None) for i in range(len(pairs))]
    else:
        total = sum(_nbytes(s, d) for s, d in zip(shapes, dtypes))
        share = total / num_shards
        pieces = []  # (bytes, leaf, start, stop)
        for i, (s, d) in enumerate(zip(shapes, dtypes)):
            nb = _nbytes(s, d)
            rows = s[0] if s else 0
            n = min(num_shards, rows, nb // max(min_slice_bytes, 1)) if nb > share else 1
            if n >= 2:
                bounds = np.linspace(0, rows, n + 1).astype(int)
                for a, b in zip(bounds[:-1], bounds[1:]):
                    pieces.append((nb * (b - a) // rows, i, int(a), int(b)))
            else:
                pieces.append((nb, i, 0, None))
        load = [0] * num_shards
        for nb, i, a, b in sorted(pieces, key=lambda t: (-t[0], t[1], t[2])):
            k = min(range(num_shards), key=lambda j: (load[j], j))
            load[k] += nb
            parts.append(Part(i, paths[i], k, a, b))
        parts.sort(key=lambda p: (p.leaf, p.start))
    return Placement(parts, treedef, shapes, dtypes, num_shards, policy)
