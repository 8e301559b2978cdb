"""Restoring the newest undamaged checkpoint on every process (private to
jreplicate.checkpoint).

:func:`restore_newest` walks a manager's complete steps, newest first: every process
agrees on each step's metadata (a mismatch with ``init_fn()``'s state or a later format
is an error at once), reads it (format 2: every process its own shards, when the
directory is shared; else the chief, who broadcasts), and agrees on the damage; the
damaged steps newer than the one restored are moved aside by the chief. The reading
itself is :mod:`jreplicate.checkpoint.restore`'s.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jreplicate.checkpoint import restore as reading
from jreplicate.checkpoint.agreement import agree, broadcast, share
from jreplicate.checkpoint.checks import mismatch, one_line
from jreplicate.checkpoint.errors import CheckpointError
from jreplicate.checkpoint.leaves import zeros_like
from jreplicate.checkpoint.tree import FORMAT_2, logical


def restore_newest(m, steps: list[int], template: Any,
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


def _agreed_metadata(m, path: str, template: Any, where: str):
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


def _read_everywhere(m, path: str, meta: tuple, template: Any,
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
    return reading.finish(value, tree, views, template, targets, m._place), None


def _read_on_chief(m, path: str, meta: tuple | None, template: Any,
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
        m._place(x, t) for x, t in zip(treedef.flatten_up_to(host), targets,
                                          strict=True)]), None


def _set_damaged_aside(m, damaged: list[tuple[int, str]]) -> None:
    def chief_moves():
        if not m.is_chief:
            return None, None
        for s, why in damaged:
            try:
                m._set_aside(s, "damaged", why)
            except OSError as e:
                return None, (f"checkpoint {s} in {m._dir} is damaged ({why}) and "
                              f"cannot be moved aside: {one_line(e)}. Remove "
                              f"{os.path.join(m._dir, str(s))}.")
        return None, None
    if damaged:
        _, err = share(m, chief_moves, "moving damaged checkpoints aside")
        if err:
            raise CheckpointError(err)
