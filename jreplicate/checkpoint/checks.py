"""Checks and messages of jreplicate.checkpoint (private): whether a stored checkpoint
matches the state ``init_fn`` builds, what is wrong with a directory path, and keeping
Orbax's noise off the output."""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import sys
from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str
from jreplicate.checkpoint.tree import (
    Norm,
    has_leaves,
    is_array_spec,
    normalised,
    spec,
    template_leaves,
)


def one_line(e: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, without TensorStore's specs and at most
    ``limit`` characters (Orbax's messages run to many long lines)."""
    lines = str(e).strip().splitlines()
    text = (lines[0] if lines else "").split(" [tensorstore_spec")[0]
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(e).__name__}: {text}".rstrip(": ")


def path_problem(directory: str, e: OSError) -> str:
    """What is wrong with ``directory`` (or the path ``e`` names), and the fix."""
    where = e.filename or directory
    existing = directory
    while existing and not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if existing != directory and existing and not os.path.isdir(existing):
        why = f"{existing} is a file, where a directory is needed"
    elif os.path.lexists(directory) and not os.path.isdir(directory):
        why = f"{directory} is a file, not a directory"
    elif isinstance(e, PermissionError):
        why = f"no permission to write {where}"
    elif e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"cannot write to {directory}: the disk is full ({e.strerror}: {where}). "
                "Nothing older was deleted for it. Free space on that disk (or raise the "
                "quota), or give a directory on another disk.")
    else:
        why = f"{e.strerror or one_line(e)}: {where}"
    return (f"cannot use {directory} as the checkpoint directory: {why}. Give a directory "
            "path that the chief (process 0) can create and write.")


@contextlib.contextmanager
def quiet_orbax():
    """Keeps the noise of an Orbax failure that jreplicate reports itself, in one line,
    off the output: Orbax's and absl's error logs, asyncio's "Task exception was never
    retrieved" for the reads abandoned with it, and TensorStore's late callbacks into
    Orbax's closed event loop ("RuntimeError: Event loop is closed") and Orbax's read
    coroutines closed with their error pending, printed as unraisable exceptions,
    possibly later: filtered for good (logged at debug level)."""
    _install_unraisable_filter()
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    except BaseException:  # broad: cleanup whatever ended the block, then re-raised
        gc.collect()  # the abandoned tasks report now, while quiet
        raise
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def mismatch(stored: Any, template: Any, what: str) -> str | None:
    """How the stored tree of array metadata differs from ``template``, or None.

    Paths are matched by the rule of :mod:`jreplicate.checkpoint.tree` (empty nodes and
    one-element wrappers do not count); the message lists, in init_fn()'s terms and the
    checkpoint's, what only one side has and what differs in shape or dtype, then the fix.
    """
    want = template_leaves(template)
    specs = jax.tree.leaves(template)
    have = normalised(stored)
    missing = [f"{p} {spec(specs[i])}" for n, (p, i) in want.items() if n not in have]
    extra = [f"{path_str(p) or 'the root'} {spec(m)}" for n, (p, m) in have.items()
             if n not in want]
    differ, casts = [], []
    for n, (p, i) in want.items():
        m = have[n][1] if n in have else None
        if m is not None and spec(m) != spec(specs[i]):
            if jax.dtypes.canonicalize_dtype(m.dtype) != np.dtype(m.dtype):
                differ.append(
                    f"{p} is {spec(m)} in the checkpoint, which JAX holds only with "
                    "jax_enable_x64 on: enable it before any JAX work "
                    "(jax.config.update('jax_enable_x64', True)) to restore it")
                continue
            cast = tuple(m.shape) == tuple(np.shape(specs[i]))
            differ.append(f"{p} is {spec(m)} in the checkpoint but init_fn() gives "
                          f"{spec(specs[i])}" + (", and restoring would cast it" * cast))
            casts += [f"{np.dtype(m.dtype).name} at {p}"] * cast
    if not (missing or extra or differ):
        return None
    lengths = _lengths(stored, template)
    if lengths:  # leaves under a sequence of another length: said once, by its length
        under = [n for n, _ in lengths]
        missing = [f"{p} {spec(specs[i])}" for n, (p, i) in want.items()
                   if n not in have and not _within(n, under)]
        extra = [f"{path_str(p) or 'the root'} {spec(m)}" for n, (p, m) in have.items()
                 if n not in want and not _within(n, under)]
        differ = [text for _, text in lengths] + differ
    first = (differ[0] if differ else
             f"init_fn()'s state has {missing[0]}, which the checkpoint lacks" if missing
             else f"the checkpoint has {extra[0]}, which init_fn()'s state lacks")
    lines = [f"{what} does not match init_fn()'s state: {first}."]
    for title, items in (("only in init_fn()'s state", missing),
                         ("only in the checkpoint", extra), ("different", differ)):
        if items and len(missing + extra + differ) > 1:  # one is said in the first line
            lines.append(f"  {title} ({len(items)}): {_listing(items)}")
    order = [spec(m) for _, m in have.values()]
    if not differ and order == [spec(specs[i]) for _, i in want.values()]:
        lines.append("  The checkpoint holds the same arrays in the same order, under other "
                     "paths (e.g. a transform added to an optax.chain, or a named wrapper): "
                     "jreplicate restores by path, never by guessing from the order.")
    fix = f" (make init_fn() build {casts[0]})" if casts else ""
    lines.append("The checkpoint is left where it is. Restore it with an init_fn that builds "
                 f"the state it holds{fix}: the same paths, shapes and dtypes (empty nodes "
                 "such as None, {} or optax.EmptyState, and one-element tuples such as "
                 "optax.chain(tx)'s, do not matter); or give a new directory to start from "
                 "step 0.")
    return "\n".join(lines)


def _sequences(tree: Any, is_leaf) -> dict[Norm, tuple[str, set[int]]]:
    """``{normalised path: (key path, lengths)}`` of the sequences of a serialized tree,
    each length counted as :func:`~jreplicate.checkpoint.tree.normalised` counts it
    (trailing leafless elements dropped; a one-element sequence, transparent there,
    shares its normalised path with what it wraps)."""
    out: dict[Norm, tuple[str, set[int]]] = {}

    def walk(node, norm, path):
        if is_leaf(node) or not isinstance(node, (dict, list, tuple)):
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, norm + (("k", str(k)),), path + (jax.tree_util.DictKey(k),))
            return
        kids = list(node)
        while kids and not has_leaves(kids[-1]):
            kids.pop()
        out.setdefault(norm, (path_str(path) or "the root", set()))[1].add(len(kids))
        for i, child in enumerate(kids):
            walk(child, norm if len(kids) == 1 else norm + (("i", i),),
                 path + (jax.tree_util.SequenceKey(i),))
    walk(tree, (), ())
    return out


def _lengths(stored: Any, template: Any) -> list[tuple[Norm, str]]:
    """The sequences (lists and tuples) that hold another number of elements with data
    in the checkpoint than in init_fn()'s state, e.g. a parameter-server state saved
    with 2 shards restored with 1: ``(normalised path, what differs)``."""
    import orbax.checkpoint as ocp
    leaves, treedef = jax.tree.flatten(template)
    serial = ocp.tree.serialize_tree(jax.tree.unflatten(treedef, range(len(leaves))),
                                     keep_empty_nodes=True)
    want = _sequences(serial, lambda x: isinstance(x, int))
    out = []
    for n, (where, have) in _sequences(stored, is_array_spec).items():
        if n in want and not have & want[n][1]:
            out.append((n, f"{where} holds {max(have)} element(s) in the checkpoint but "
                           f"{max(want[n][1])} in init_fn()'s state"))
    return out


def _within(norm: Norm, prefixes: list[Norm]) -> bool:
    return any(norm[:len(p)] == p for p in prefixes)


def _listing(items: list[str], limit: int = 6) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _install_unraisable_filter() -> None:
    previous = sys.unraisablehook
    if getattr(previous, "_jreplicate", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return  # a read abandoned by a restore that already failed (and was reported)
        code = getattr(unraisable.object, "cr_code", None)
        if code is not None and "orbax" in code.co_filename:
            # An Orbax read coroutine closed with its error pending: the restore of
            # damaged files that abandoned it failed, and that was reported.
            logging.getLogger("jreplicate").debug(
                "jreplicate: an abandoned Orbax read: %s", one_line(e) if e else None)
            return
        previous(unraisable)

    hook._jreplicate = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
