"""Which stored array goes where in init_fn()'s state, and checksums of the stored data
(private to jreplicate.checkpoint).

The matching rule
-----------------
Orbax writes a pytree in its serialized form: every container becomes a dict (dicts,
NamedTuples, dataclasses, NNX ``State`` and ``Variable``: by key or field name) or a list
(tuples and lists), and no type name is stored. A checkpoint is restored into init_fn()'s
state exactly when both hold the same arrays under the same paths, where a path is
compared after two normalisations, and nowhere else:

1. **Leafless nodes hold no data.** ``None``, ``{}``, ``()``, ``optax.EmptyState()``
   contribute nothing, and trailing leafless elements of a sequence are dropped: adam's
   ``(ScaleByAdamState, EmptyState)`` and adamw's ``(ScaleByAdamState, EmptyState,
   EmptyState)`` agree, as do ``{"w": w}`` and ``{"w": w, "extra": None}``. A leafless
   element *before* one with data keeps every index as it is: nothing is renumbered.
2. **A sequence of one element is transparent**: ``optax.chain(tx)``'s state
   ``(tx_state,)`` is ``tx``'s.

Dict keys and field names, and the indices of sequences of several elements, are always
compared. Why this cannot put an array in the wrong place: both normalisations only
delete path entries, and only entries that tell no two arrays of the tree apart (two
arrays part at a node with at least two elements holding data, whose names or indices
are kept); so each stored array has at most one place in init_fn()'s state, the one
with its own names and indices, and the flatten order is kept. Everything else is a
:class:`~jreplicate.checkpoint.CheckpointError` naming both structures: a transform
added in front of a chain (``optax.chain(clip, adam)`` moves adam's arrays from
``[0]`` to ``[1][0]``), a named wrapper (``inject_hyperparams``'s ``inner_state``), a
renamed key, another shape or dtype (a cast on restore would be silently wrong).
Matching by order instead would guess, and a wrong guess (a teacher's weights restored
as the student's) is a silent wrong answer. Type names are not on disk, so a state
whose NamedTuple has another name but the same fields, shapes and dtypes restores
(into init_fn()'s types): Orbax cannot tell them apart, and neither can jreplicate.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str
from jreplicate.checkpoint import dtypes
from jreplicate.checkpoint.digest import digest_np

FORMAT = 1  # of the checksum table in the checkpoint's custom metadata (CRC-32, chief)
FORMAT_2 = 2  # digests per array and per box, written by every process
Norm = tuple  # a normalised path: ("k", name) and ("i", index) entries


def is_array_spec(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def has_leaves(node: Any) -> bool:
    return node is not None and (is_array_spec(node) or bool(jax.tree.leaves(node)))


def _children(node: Any) -> list[tuple[Any, Any, Any]]:
    """``(entry, key, child)`` for each child of a container node."""
    if isinstance(node, dict):
        return [(("k", str(k)), jax.tree_util.DictKey(k), v) for k, v in node.items()]
    if isinstance(node, (list, tuple)) and not hasattr(node, "_fields"):
        return [(("i", i), jax.tree_util.SequenceKey(i), v) for i, v in enumerate(node)]
    pairs = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    out = []
    for path, child in pairs:
        key = path[0]
        name = getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))
        index = isinstance(key, (jax.tree_util.SequenceKey, jax.tree_util.FlattenedIndexKey))
        out.append(((("i", name) if index else ("k", str(name))), key, child))
    return out


def normalised(tree: Any, is_leaf=is_array_spec) -> dict[Norm, tuple[tuple, Any]]:
    """``{normalised path: (key path, leaf)}`` of a tree in Orbax's serialized form."""
    out: dict[Norm, tuple[tuple, Any]] = {}

    def walk(node, norm, path):
        if is_leaf(node):
            out[norm] = (path, node)
            return
        kids = _children(node) if node is not None else []
        if kids and kids[0][0][0] == "i":
            while kids and not has_leaves(kids[-1][2]):
                kids.pop()  # trailing leafless elements: no data, no index to keep
            if len(kids) == 1:  # a one-element sequence: a wrapper
                walk(kids[0][2], norm, path + (kids[0][1],))
                return
        for entry, key, child in kids:
            walk(child, norm + (entry,), path + (key,))
    walk(tree, (), ())
    return out


def template_leaves(template: Any) -> dict[Norm, tuple[str, int]]:
    """``{normalised path: (init_fn's path, leaf index)}``: the template in the form Orbax
    would write it (the leaves numbered in init_fn()'s flatten order)."""
    import orbax.checkpoint as ocp
    pairs = jax.tree_util.tree_leaves_with_path(template)
    ids = jax.tree.unflatten(jax.tree.structure(template), list(range(len(pairs))))
    serial = ocp.tree.serialize_tree(ids, keep_empty_nodes=True)
    return {norm: (path_str(pairs[i][0]) or "the root", i)
            for norm, (_, i) in normalised(serial, lambda x: isinstance(x, int)).items()}


def spec(x: Any) -> str:
    return f"{np.dtype(x.dtype).name}[{', '.join(map(str, np.shape(x)))}]"


def state_digest(tree: Any) -> str:
    """A hex digest of a tree's leaf paths, shapes and dtypes: the same on every process
    that builds the same state (node data such as a function's address is left out)."""
    rows = [f"{path_str(p)} {spec(x)}" for p, x in jax.tree_util.tree_leaves_with_path(tree)]
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


# -- checksums ---------------------------------------------------------------------------
def tokens(path: tuple) -> list[str]:
    """A stored path's entries as strings (the rows of the checkpoint's table)."""
    return _tokens(path)


def _tokens(path: tuple) -> list[str]:
    return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def _crc(x: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8))


def name_clash(host: Any, what: str) -> None:
    """Raises ValueError when two arrays of ``host`` would be stored under one name:
    Orbax names an array by its keys joined with ``"."``, so ``{"a.b": x}`` and
    ``{"a": {"b": y}}`` are one file, and one array would overwrite the other."""
    import orbax.checkpoint as ocp
    serial = ocp.tree.serialize_tree(host, keep_empty_nodes=True)
    seen: dict[str, str] = {}
    for path, _ in jax.tree_util.tree_leaves_with_path(serial):
        name, here = ".".join(_tokens(path)), path_str(path) or "the root"
        if name in seen:
            a, b = sorted((seen[name], here))
            raise ValueError(
                f"{what}: {a} and {b} would be stored under one name, {name!r} (Orbax "
                "names an array by its keys joined with '.'), and one would overwrite the "
                "other. Rename a key so that the joined names differ (e.g. replace the "
                "'.' in dict keys).")
        seen[name] = here


def table_v2(serial: Any, digests: list, views: list) -> dict:
    """Format 2's custom metadata: for each stored array (``serial``: the saved tree in
    Orbax's serialized form, leaves as stored), its path tokens, stored dtype, shape,
    digest and per-box digests (``digests``: :func:`jreplicate.checkpoint.digest.
    digest_array`'s result per leaf, in flatten order); and ``views``, ``[tokens,
    dtype name]`` of each array stored as its bits."""
    rows = []
    pairs = jax.tree_util.tree_leaves_with_path(serial)
    for (p, x), (total, boxes) in zip(pairs, digests, strict=True):
        rows.append([_tokens(p), np.dtype(x.dtype).name, list(np.shape(x)), list(total),
                     [[[list(b) for b in box], list(d)] for box, d in boxes]])
    return {"jreplicate": {"format": FORMAT_2, "arrays": rows, "views": views}}


def view_rows(state: Any) -> list:
    """``[tokens, dtype name]`` of each leaf of ``state`` (its own dtypes) that is
    stored as its bits."""
    import orbax.checkpoint as ocp
    serial = ocp.tree.serialize_tree(state, keep_empty_nodes=True)
    return [[_tokens(p), np.dtype(x.dtype).name]
            for p, x in jax.tree_util.tree_leaves_with_path(serial)
            if dtypes.storage_dtype(x.dtype) != np.dtype(x.dtype)]


def read_format(custom: Any) -> int | None:
    """The format of jreplicate's record in a checkpoint's custom metadata (None: none)."""
    entry = custom.get("jreplicate") if isinstance(custom, dict) else None
    if not isinstance(entry, dict):
        return None
    fmt = entry.get("format")
    return fmt if isinstance(fmt, int) and not isinstance(fmt, bool) else None


def read_table(custom: Any) -> dict[tuple, tuple] | None:
    """``{stored path tokens: (dtype, shape, crc)}`` (format 1) or ``{tokens: (dtype,
    shape, digest, {box: digest})}`` (format 2), or None for a checkpoint without one
    (written by an older jreplicate, or by Orbax directly). Raises ValueError when the
    table is there but malformed (the metadata file was changed)."""
    fmt = read_format(custom)
    if fmt not in (FORMAT, FORMAT_2):
        return None  # none, or a format of a later jreplicate (refused by the caller)
    entry = custom["jreplicate"]
    try:
        if fmt == FORMAT:
            return {tuple(t): (d, tuple(s), int(c)) for t, d, s, c in entry["arrays"]}
        return {tuple(t): (d, tuple(s), (int(g[0]), int(g[1])),
                           {tuple(tuple(int(v) for v in b) for b in box): (int(h[0]), int(h[1]))
                            for box, h in boxes})
                for t, d, s, g, boxes in entry["arrays"]}
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ValueError(f"its checksum table is malformed ({e!r})") from None


def read_views(custom: Any) -> dict[tuple, str]:
    """``{stored path tokens: dtype name}`` of the arrays stored as their bits (empty
    for a checkpoint without a table, or saved before views were recorded). Raises
    ValueError when the record is malformed (the metadata file was changed)."""
    if read_format(custom) not in (FORMAT, FORMAT_2):
        return {}
    try:
        return {tuple(t): str(d) for t, d in custom["jreplicate"].get("views", [])}
    except (TypeError, ValueError) as e:
        raise ValueError(f"its record of arrays stored as bits is malformed ({e!r})") from None


def _viewed(stored: Any, views: dict[tuple, str]) -> dict[tuple, np.dtype | None]:
    """``{key path: dtype}`` of the stored arrays that ``views`` names (None: a dtype
    this process does not define); raises ValueError when a view names no stored
    array, or one not stored as the bits of its dtype."""
    out, found = {}, set()
    for path, m in jax.tree_util.tree_leaves_with_path(stored):
        tokens = tuple(_tokens(path))
        if tokens in views:
            found.add(tokens)
            dtype = dtypes.from_name(views[tokens])
            if dtype is not None and np.dtype(m.dtype) != dtypes.bits_dtype(dtype):
                raise ValueError(f"{path_str(path)} is stored as {np.dtype(m.dtype).name}, "
                                 f"not as the bits of {views[tokens]}")
            out[path] = dtype
    if set(views) - found:
        raise ValueError(f"it records bits of arrays it does not hold: "
                         f"{sorted(set(views) - found)[:3]}")
    return out


def logical(stored: Any, views: dict[tuple, str]) -> Any:
    """The stored tree of array metadata with each array stored as bits given its own
    dtype (a dtype this process does not define stays as stored: it mismatches)."""
    viewed = _viewed(stored, views)

    def leaf(path, m):
        dtype = viewed.get(path)
        return m if dtype is None else jax.ShapeDtypeStruct(tuple(m.shape), dtype)
    return jax.tree_util.tree_map_with_path(leaf, stored)


def unviewed(value: Any, stored: Any, views: dict[tuple, str]) -> Any:
    """The restored arrays with each stored as bits viewed back as its dtype."""
    viewed = _viewed(stored, views)

    def leaf(path, x):
        dtype = viewed.get(path)
        return x if dtype is None else np.asarray(x).view(dtype)
    return jax.tree_util.tree_map_with_path(leaf, value)


def metadata_problem(stored: Any, table: dict | None) -> str | None:
    """How the stored tree's arrays differ from those the chief wrote, or None."""
    if table is None:
        return None
    have = {tuple(_tokens(p)): (np.dtype(m.dtype).name, tuple(m.shape))
            for p, m in jax.tree_util.tree_leaves_with_path(stored)}
    want = {k: v[:2] for k, v in table.items()}
    if have != want:
        odd = sorted(set(have.items()) ^ set(want.items()))[:3]
        return f"its metadata disagrees with the arrays that were saved (e.g. {odd})"
    return None


def data_problem(value: Any, stored: Any, table: dict | None) -> str | None:
    """How the restored arrays differ from their metadata and checksums (format 1's
    CRC-32 or format 2's digest, computed on the host), or None."""
    meta = dict(jax.tree_util.tree_leaves_with_path(stored))
    got = jax.tree_util.tree_leaves_with_path(value)
    if len(got) != len(meta):
        return f"{len(got)} arrays read where its metadata lists {len(meta)}"
    for path, x in got:
        x, m = np.asarray(x), meta.get(path)
        if m is None or x.shape != tuple(m.shape) or x.dtype != np.dtype(m.dtype):
            return (f"the data at {path_str(path)} ({spec(x)}) disagrees with its metadata"
                    f" ({spec(m) if m is not None else 'none'})")
        want = table[tuple(_tokens(path))][2] if table is not None else None
        if want is not None and (digest_np(x) if isinstance(want, tuple) else _crc(x)) != want:
            return (f"the data at {path_str(path)} does not match its checksum (a file was "
                    "changed after the save)")
    return None
