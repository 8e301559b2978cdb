"""Restoring the newest undamaged checkpoint, or initialising, on every process
(private to jreplicate.checkpoint).

:func:`restore_newest` walks a manager's complete steps, newest first: every process
agrees on each step's metadata (a mismatch with ``init_fn()``'s state or a later format
is an error at once), reads it (format 2: every process its own shards, when the
directory is shared; else the chief, who broadcasts), and agrees on the damage; the
damaged steps newer than the one restored are moved aside by the chief. The reading
itself is :mod:`jreplicate.checkpoint.restore`'s. :func:`initialise` places
``init_fn()``'s state (the chief's values, broadcast) when there is no checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate._tree import native
from jreplicate.checkpoint import agreement, chief_files
from jreplicate.checkpoint import restore as reading
from jreplicate.checkpoint.agreement import agree, broadcast, share
from jreplicate.checkpoint.checks import mismatch, one_line
from jreplicate.checkpoint.errors import CheckpointError
from jreplicate.checkpoint.leaves import check_not_key, spans_processes, to_host, zeros_like
from jreplicate.checkpoint.targets import resolve
from jreplicate.checkpoint.tree import FORMAT_2, logical

logger = logging.getLogger("jreplicate")


def restore_newest(m: Any, steps: list[int], template: Any,
                   targets: list) -> tuple[int, Any]:
    """``(step, state)`` of the newest undamaged checkpoint among ``steps`` (newest
    first). A mismatch with ``template`` is an error at once, whatever older steps
    hold. The damaged steps newer than the one restored are moved aside; when none
    is restored nothing is moved (an error)."""
    damaged: list[tuple[int, str]] = []
    for step in steps:
        path = reading.item_dir(m._dir, step)
        where = f"checkpoint {step} in {m._dir}"
        kind, detail, meta = _agreed_metadata(m, path, template, where)
        if kind in ("mismatch", "error"):
            raise CheckpointError(detail + "".join(
                f"\n(Newer checkpoint {s} is damaged: {why}.)" for s, why in damaged))
        if kind == "ok":
            state, damage = (_read_everywhere(m, path, meta, template, targets)
                             if m._shared and meta[3] == FORMAT_2 else
                             _read_on_chief(m, path, meta, template, targets))
            if damage is None:
                _set_damaged_aside(m, damaged)
                return step, state
            detail = damage
        damaged.append((step, detail))
    listed = "; ".join(f"{s}: {why}" for s, why in damaged[:5]) + (
        f"; and {len(damaged) - 5} more" if len(damaged) > 5 else "")
    raise CheckpointError(
        f"every checkpoint in {m._dir} is damaged ({listed}). Nothing was moved and "
        "training does not restart from step 0 on its own: restore the files from a "
        f"copy, or move the step directories out of {m._dir} to start from "
        "init_fn() at step 0.")


def _agreed_metadata(m: Any, path: str, template: Any, where: str):
    """``(kind, detail, (tree, table, views, format))``: the step's metadata as
    every process reads it (or the chief alone, when the directory is not shared),
    and the agreed outcome: ok, damaged, or an error (a mismatch, a later format)."""
    meta = None

    def read() -> tuple[str, str]:
        nonlocal meta
        try:
            meta = reading.stored(path)
        except reading.Damaged as e:
            return "damaged", str(e)
        except reading.TooNew as e:
            return "error", str(e)
        except Exception as e:  # broad: any read error is shared, not raised
            # on one process alone (the others would hang)
            return "error", f"reading {path} failed: {one_line(e)}"
        differs = mismatch(logical(meta[0], meta[2]), template, where)
        return ("mismatch", differs) if differs else ("ok", "")
    if m._shared or m.is_chief:
        kind, detail = read()
    else:
        kind, detail = "ok", ""
    kind, detail = agree(m, kind, detail, "a checkpoint's metadata",
                               chief_only=not m._shared)
    return kind, detail, meta


def _read_everywhere(m: Any, path: str, meta: tuple, template: Any,
                     targets: list) -> tuple[Any, str | None]:
    """Every process reads its shards of a format-2 step; the outcome is agreed,
    then the digests are checked (collectively: the same answer everywhere)."""
    tree, table, views, _ = meta
    value, error = reading.load_placed(path, tree, views, template, targets)
    kind, detail = agree(m, "damaged" if error else "ok", error or "",
                               "reading a checkpoint")
    if kind != "ok":
        return None, detail
    damage = reading.check_placed(value, tree, table)
    if damage:
        return None, damage
    return reading.finish(value, tree, views, template, targets,
                          functools.partial(place, m)), None


def _read_on_chief(m: Any, path: str, meta: tuple | None, template: Any,
                   targets: list) -> tuple[Any, str | None]:
    """The chief reads (format 1, or a directory only it sees) and broadcasts."""
    value = None

    def chief_reads() -> tuple[str, str]:
        nonlocal value
        if not m.is_chief:
            return "ok", ""
        tree, table, views, _ = meta
        try:
            value, damage = reading.read_host(path, tree, table, views, template)
        except Exception as e:  # broad: shared, never raised on the chief alone
            return "error", f"reading the checkpoints in {m._dir} failed: {one_line(e)}"
        return ("damaged", damage) if damage else ("ok", "")
    kind, detail = agree(m, *chief_reads(), "reading a checkpoint", chief_only=True)
    if kind == "error":
        raise CheckpointError(detail)
    if kind != "ok":
        return None, detail
    host = broadcast(m, value if m.is_chief else
                           zeros_like(template, "restore_or_initialize"))
    treedef = jax.tree.structure(template)
    return jax.tree.unflatten(treedef, [
        place(m, x, t) for x, t in zip(treedef.flatten_up_to(host), targets,
                                          strict=True)]), None


def _set_damaged_aside(m: Any, damaged: list[tuple[int, str]]) -> None:
    def chief_moves():
        if not m.is_chief:
            return None, None
        for s, why in damaged:
            try:
                chief_files.set_aside(m, s, "damaged", why)
            except OSError as e:
                return None, (f"checkpoint {s} in {m._dir} is damaged ({why}) and "
                              f"cannot be moved aside: {one_line(e)}. Remove "
                              f"{os.path.join(m._dir, str(s))}.")
        return None, None
    if damaged:
        _, err = share(m, chief_moves, "moving damaged checkpoints aside")
        if err:
            raise CheckpointError(err)


def initialise(m: Any, template: Any, shardings: Any) -> Any:
    """``init_fn()``'s state on every process: arrays sharded across processes as
    they are (moved to their target), the rest the chief's values, broadcast."""
    what = "restore_or_initialize: init_fn() returned"
    targets = resolve(template, shardings, m._strategy.mesh)
    host = to_host(jax.tree.map(lambda x: None if spans_processes(x) else x, template),
                   what)
    agreement.check_same_state(m, host)
    host = agreement.broadcast(m, host)
    treedef = jax.tree.structure(template)
    leaves = []
    for x, h, target in zip(treedef.flatten_up_to(template), treedef.flatten_up_to(host),
                            targets, strict=True):
        if h is None:
            leaves.append(x if x.sharding == target else
                          jax.jit(lambda a: a, out_shardings=target)(x))
        else:
            leaves.append(place(m, h, target))
    logger.info("jreplicate: initialised state at step 0")
    return jax.tree.unflatten(treedef, leaves)


def place(m: Any, x: np.ndarray, sharding: Any) -> jax.Array:
    """``x`` on ``sharding``, unchanged. Across processes every process holds the same
    ``x`` (the chief's, broadcast), so each builds its own shards from it: the check
    ``device_put`` makes there (another gather, comparing values) fails on NaN."""
    held = jax.dtypes.canonicalize_dtype(x.dtype)  # init_fn()'s 64-bit NumPy values
    x = x if held == x.dtype else x.astype(held)
    if m._strategy.num_processes == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def abstract(init_fn: Callable[[], Any]) -> Any:
    try:
        return jax.eval_shape(init_fn)
    except Exception:  # not traceable (e.g. numpy code): evaluate it
        return jax.tree.map(_as_held, init_fn())


def abstract_leaves(template: Any, what: str) -> Any:
    """The template's leaves as ShapeDtypeStructs (keys refused), for the structure
    checks; nothing is allocated."""
    def leaf(path, x):
        check_not_key(x, path, what)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    from jreplicate._tree import map_checked
    return map_checked(leaf, template, what)


def _as_held(x: Any) -> Any:
    """A host leaf as JAX holds it (the dtypes ``jax.eval_shape`` gives, those the state
    ``init_fn`` initialises is placed with: a NumPy float64 is float32 with x64 off)."""
    if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        a = np.asarray(x)
        return jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(native(a.dtype)))
    return x
