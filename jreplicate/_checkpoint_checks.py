"""Checks and messages of jreplicate.checkpoint (private): whether a stored checkpoint
matches the state ``init_fn`` builds, what is wrong with a directory path, and keeping
Orbax's noise off the output."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str


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
    else:
        why = f"{e.strerror or one_line(e)}: {where}"
    return (f"cannot use {directory} as the checkpoint directory: {why}. Give a directory "
            "path that the chief (process 0) can create and write.")


@contextlib.contextmanager
def quiet_orbax():
    """Keeps the noise of an Orbax failure that jreplicate reports itself, in one line,
    off the output: Orbax's and absl's error logs, asyncio's "Task exception was never
    retrieved" for the reads abandoned with it, and TensorStore's late callbacks into
    Orbax's closed event loop ("RuntimeError: Event loop is closed", printed as
    unraisable exceptions, possibly later: filtered for good)."""
    _install_unraisable_filter()
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "asyncio")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    except BaseException:
        gc.collect()  # the abandoned tasks report now, while quiet
        raise
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def mismatch(stored: Any, template: Any, what: str) -> str | None:
    """How the stored tree of array metadata differs from ``template``, or None.

    Both are compared in Orbax's serialized form (containers as dicts and lists), where a
    template path and the stored path of the same leaf coincide.
    """
    import orbax.checkpoint as ocp
    pairs = jax.tree_util.tree_leaves_with_path(template)
    ids = jax.tree.unflatten(jax.tree.structure(template), list(range(len(pairs))))
    expected = {path_str(p): i for p, i in jax.tree_util.tree_leaves_with_path(
        ocp.tree.serialize_tree(ids, keep_empty_nodes=True))}
    have = {path_str(p): m for p, m in jax.tree_util.tree_leaves_with_path(stored)}
    fix = "start from a new directory if the state changed on purpose"
    missing = [path_str(pairs[i][0]) or "the root" for k, i in expected.items() if k not in have]
    extra = [k or "the root" for k in have if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"init_fn()'s state has {_listing(missing)}, which the checkpoint "
                         "lacks")
        if extra:
            parts.append(f"the checkpoint has {_listing(extra)}, which init_fn()'s state "
                         "lacks")
        return (f"{what} does not have the structure of init_fn()'s state: "
                + "; ".join(parts) + f". Rename them back if keys were renamed, or {fix}.")
    for key, i in expected.items():
        path, want = path_str(pairs[i][0]) or "the root", pairs[i][1]
        m = have[key]
        got_dtype, got_shape = np.dtype(getattr(m, "dtype", None)), tuple(m.shape)
        if got_shape != tuple(np.shape(want)):  # the other processes expect init_fn's
            return (f"{what} holds {path} with shape {got_shape} but init_fn() gives shape "
                    f"{tuple(np.shape(want))}; {fix} (e.g. another model size).")
        if got_dtype != want.dtype:
            return (f"{what} holds {path} as {_spec(got_dtype, got_shape)} but init_fn() "
                    f"gives {_spec(want.dtype, got_shape)}, and restoring would cast it. "
                    f"Make init_fn() build {got_dtype.name} there, or {fix}.")
    return None


def _spec(dtype: Any, shape: tuple) -> str:
    return f"{np.dtype(dtype).name}[{', '.join(map(str, shape))}]"


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:5])
    return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")




def _install_unraisable_filter() -> None:
    previous = sys.unraisablehook
    if getattr(previous, "_jreplicate", False):
        return

    def hook(unraisable):
        e = unraisable.exc_value
        if isinstance(e, RuntimeError) and str(e) == "Event loop is closed":
            return  # a read abandoned by a restore that already failed (and was reported)
        previous(unraisable)

    hook._jreplicate = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
