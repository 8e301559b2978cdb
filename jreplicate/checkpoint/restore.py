"""Reading a checkpoint step, in both formats (private to jreplicate.checkpoint).

* **Format 1** (jreplicate before issue 31; data in ``<step>/default``): read by the
  chief alone as NumPy arrays, checked against each array's CRC-32, then broadcast
  by the manager.
* **Format 2** (data in ``<step>``, written by every process): every process reads
  the shards its target shardings give it (:func:`load_placed`, Orbax's
  ``StandardRestore`` with target ``ShapeDtypeStruct``s), then every process checks the
  restored global arrays against the saved digests (:func:`check_placed`, a
  collective: every process computes the same replicated values, so the damage
  decision is the same everywhere). Where the directory is not shared, the chief reads
  a format-2 step as NumPy (:func:`read_host`), checked by the NumPy digest.

The functions here return outcomes (``(value, None)`` or ``(None, what is wrong)``);
the manager agrees on them across processes and decides what to move aside.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str
from jreplicate.checkpoint import digest
from jreplicate.checkpoint.checks import one_line, quiet_orbax
from jreplicate.checkpoint.tree import (
    FORMAT_2,
    data_problem,
    logical,
    metadata_problem,
    normalised,
    read_format,
    read_table,
    read_views,
    spec,
    template_leaves,
    tokens,
    unviewed,
)


class Damaged(Exception):
    """A committed checkpoint's files are damaged (the message says how)."""


class TooNew(Exception):
    """A checkpoint written in a format this jreplicate does not know."""


def item_dir(directory: str, step: int) -> str:
    """Where step ``step``'s arrays are: ``<step>/default`` (format 1) or ``<step>``."""
    step_dir = os.path.join(directory, str(step))
    legacy = os.path.join(step_dir, "default")
    return legacy if os.path.isdir(legacy) else step_dir


def _handler():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointHandler()  # reads only: no barriers, no writes


def stored(path: str) -> tuple[Any, dict | None, dict, int | None]:
    """``(tree of array metadata, table, views, format)`` of the item at ``path``.

    Raises:
      Damaged: the metadata cannot be read, or disagrees with what was saved.
      TooNew: a later jreplicate wrote it.
    """
    from etils import epath
    try:
        with quiet_orbax():
            metadata = _handler().metadata(epath.Path(path))
        tree = getattr(metadata, "tree", metadata)
        if tree is None:
            raise Damaged("no metadata")
        custom = getattr(metadata, "custom_metadata", None)
        fmt = read_format(custom)
        table, views = read_table(custom), read_views(custom)
        logical(tree, views)  # raises ValueError when the record disagrees
    except (Damaged, MemoryError):  # no memory: not the checkpoint's fault
        raise
    except Exception as e:  # broad: whatever the damaged files make the reader
        # raise, the checkpoint is named damaged (and kept)
        raise Damaged(f"its files cannot be read: {one_line(e)}") from None
    if fmt is not None and fmt > FORMAT_2:
        raise TooNew(f"{path} was written by a later jreplicate (checkpoint format {fmt}; "
                     f"this one reads formats up to {FORMAT_2}): upgrade jreplicate to "
                     "restore it.")
    problem = metadata_problem(tree, table)
    if problem:
        raise Damaged(problem)
    return tree, table, views, fmt


def in_template(arrays: dict, template: Any) -> Any:
    """The stored arrays (``normalised`` form) in ``template``'s structure and types."""
    leaves = [None] * jax.tree.structure(template).num_leaves
    for norm, (_, i) in template_leaves(template).items():
        leaves[i] = arrays[norm][1]
    return jax.tree.unflatten(jax.tree.structure(template), leaves)


def read_host(path: str, tree: Any, table: dict | None, views: dict,
              template: Any) -> tuple[Any, str | None]:
    """The chief's read: ``(state as NumPy in template's structure, None)``, or
    ``(None, what is damaged)``. Read in the dtypes it was saved in (so that only damage
    can make the read fail), checked against the metadata and the table (CRC-32 or
    digest), arrays stored as bits viewed back."""
    import orbax.checkpoint as ocp
    from etils import epath
    target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree)
    try:
        with quiet_orbax():
            value = _handler().restore(epath.Path(path), args=ocp.args.StandardRestore(target))
    except MemoryError:
        raise
    except Exception as e:  # the data of a committed checkpoint is damaged
        return None, one_line(e)
    damage = data_problem(value, tree, table)
    if damage:
        return None, damage
    arrays = normalised(unviewed(value, tree, views))
    return in_template({k: (p, np.asarray(x)) for k, (p, x) in arrays.items()}, template), None


def _stored_targets(tree: Any, views: dict, template: Any, targets: list) -> Any:
    """Orbax's restore target in the stored structure: a ShapeDtypeStruct with the
    leaf's target sharding, or NumPy zeros for an array stored as its bits (viewed and
    placed after the read)."""
    paths = normalised(tree)
    index = {paths[n][0]: i for n, (_, i) in template_leaves(template).items() if n in paths}

    def leaf(path, m):
        if tuple(tokens(path)) in views:
            return np.zeros(m.shape, m.dtype)
        return jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=targets[index[path]])
    return jax.tree_util.tree_map_with_path(leaf, tree)


def load_placed(path: str, tree: Any, views: dict, template: Any,
                targets: list) -> tuple[Any, str | None]:
    """This process's read of a format-2 step onto ``targets``: ``(value in the stored
    structure, None)`` or ``(None, the error)``. Not collective; the manager agrees on
    the outcome before :func:`check_placed`."""
    import orbax.checkpoint as ocp
    from etils import epath
    target = _stored_targets(tree, views, template, targets)
    try:
        with quiet_orbax():
            return _handler().restore(epath.Path(path),
                                      args=ocp.args.StandardRestore(target)), None
    except MemoryError:
        raise
    except Exception as e:  # damaged or missing files: agreed on by the manager
        return None, one_line(e)


def _box_str(box: tuple) -> str:
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


def check_placed(value: Any, tree: Any, table: dict | None) -> str | None:
    """What of the restored arrays differs from the saved digests, or None. Collective:
    every process calls it with its part of the same global arrays, and gets the same
    answer."""
    meta = dict(jax.tree_util.tree_leaves_with_path(tree))
    got = jax.tree_util.tree_leaves_with_path(value)
    if len(got) != len(meta):
        return f"{len(got)} arrays read where its metadata lists {len(meta)}"
    for path, x in got:
        m = meta.get(path)
        if m is None or tuple(np.shape(x)) != tuple(m.shape) or np.dtype(x.dtype) != np.dtype(
                m.dtype):
            return (f"the data at {path_str(path)} ({spec(x)}) disagrees with its metadata"
                    f" ({spec(m) if m is not None else 'none'})")
        if table is None:
            continue
        _, _, want, want_boxes = table[tuple(tokens(path))]
        total, boxes = digest.digest_array(x)
        if total == want:
            continue
        bad = [b for b, d in boxes if want_boxes.get(b, d) != d]
        if bad and all(b in want_boxes for b, _ in boxes):
            return (f"box {_box_str(bad[0])} of {path_str(path)} does not match its digest "
                    "(a file was changed after the save)")
        return (f"the data at {path_str(path)} does not match its digest (a file was "
                "changed after the save)")
    return None


def finish(value: Any, tree: Any, views: dict, template: Any, targets: list,
           place: Any) -> Any:
    """The checked value in ``template``'s structure: arrays stored as bits viewed back
    and placed with ``place(host, sharding)``; the others as Orbax placed them."""
    arrays = normalised(unviewed(value, tree, views))
    index = {n: i for n, (_, i) in template_leaves(template).items()}
    out = {}
    for n, (p, x) in arrays.items():
        out[n] = (p, x if isinstance(x, jax.Array) else place(np.asarray(x), targets[index[n]]))
    return in_template(out, template)
