"""The chief's work on the checkpoint directory (private to jreplicate.checkpoint).

Functions of a :class:`~jreplicate.checkpoint.CheckpointManager` ``m``: creating the
directory and taking its lock, finding whether every process sees it, deleting the
debris of interrupted saves and moving incomplete or damaged steps aside, and giving
the chief's complete steps to every process. A URL is refused as a directory.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

from jreplicate import _wire
from jreplicate.checkpoint.checks import one_line, path_problem
from jreplicate.checkpoint.dirlock import LOCK_NAME, DirectoryLock, LockHeldError
from jreplicate.checkpoint.errors import CheckpointError
from jreplicate.checkpoint.writer import remove_debris

logger = logging.getLogger("jreplicate")
#: The file Orbax writes into a step directory as the last act of a save: a step
#: directory without it is incomplete, never restored, and moved aside by the chief.
COMMIT_MARKER = "commit_success.txt"


def open_directory(m: Any) -> str | None:
    """Creates the directory and takes its lock; returns an error message or None."""
    path = m._dir
    try:
        os.makedirs(path, exist_ok=True)
        m._lock = DirectoryLock(path)
    except LockHeldError as e:
        who = ("another CheckpointManager, not closed, of the chief's process"
               if e.in_this_process else f"another job: {e}")
        fix = ("close() that manager first, or use it" if e.in_this_process else
               "stop the other job, or give this one another directory. If that job is "
               f"gone (e.g. it ran on another host), delete {os.path.join(path, LOCK_NAME)}")
        return (f"the checkpoint directory {path} is in use by {who}. Two managers "
                f"writing one directory overwrite each other's checkpoints: {fix}.")
    except OSError as e:
        return path_problem(path, e)
    weakref.finalize(m, m._lock.release)
    return None


def who_cannot_see(m: Any) -> tuple[int, str] | None:
    """``(process, why)`` of the first process that does not read the chief's lock
    record in the directory (the directory is not shared), or None."""
    if m._agreement is None:
        return None
    lock = os.path.join(m._dir, LOCK_NAME)

    def record() -> str | None:
        with open(lock, encoding="utf-8") as f:
            return f.read()
    mine: str | None = None
    error = None
    if m.is_chief:
        try:
            mine = record()
        except OSError as e:
            error = f"the chief cannot read its lock {lock}: {one_line(e)}"
    chief = m._agreement.exchange({"value": mine, "error": error},
                                     "the checkpoint directory's lock",
                                     _wire.CHIEF_TEXT)[0]
    if chief["error"]:
        raise CheckpointError(chief["error"])
    kind, detail = "ok", ""
    if not m.is_chief:
        try:
            if record() != chief["value"]:
                kind, detail = "error", "it reads another job's lock record there"
        except OSError as e:
            kind, detail = "error", one_line(e)
    outcomes = m._agreement.exchange({"kind": kind, "detail": detail},
                                        "a checkpoint outcome", _wire.CHECKPOINT_OUTCOME)
    for p, o in enumerate(outcomes):
        if o["kind"] != "ok":
            logger.info("jreplicate: process %d cannot see the checkpoint directory %s "
                        "(%s): the chief alone writes checkpoints", p, m._dir,
                        o["detail"])
            return p, o["detail"]
    return None


def tidy(m: Any) -> None:
    """The chief's first look at the directory: deletes the temporary directories of
    interrupted saves and moves incomplete steps aside."""
    if m._tidied:
        return
    m._tidied = True
    remove_debris(m._dir)
    complete = set(m.complete_steps())
    for name in os.listdir(m._dir):
        path = os.path.join(m._dir, name)
        if name.isdigit() and int(name) not in complete and os.path.isdir(path):
            set_aside(m, int(name), "incomplete", f"no {COMMIT_MARKER}")


def set_aside(m: Any, step: int, kind: str, why: str) -> None:
    path = os.path.join(m._dir, str(step))
    aside = f"{path}.{kind}-{int(time.time())}"
    logger.warning("jreplicate: checkpoint %s is %s (%s); moved it to %s", path, kind,
                   why, aside)
    os.rename(path, aside)


def share_steps(m: Any) -> tuple[list[int], str | None]:
    """The chief's complete steps, newest first, given to everyone."""
    steps, err = None, None
    if m.is_chief:
        try:
            tidy(m)
            steps = sorted(m.complete_steps(), reverse=True)
        except OSError as e:
            err = f"reading the checkpoints in {m._dir} failed: {one_line(e)}"
    if m._agreement is not None:
        chief = m._agreement.exchange({"value": steps, "error": err},
                                         "the checkpoints to restore",
                                         _wire.CHECKPOINT_STEPS)[0]
        steps, err = chief["value"], chief["error"]
    return steps or [], err


def refuse_url(directory: str) -> None:
    """Raises for a URL (``gs://bucket/ckpt``): the manager works through the local file
    system, where ``os.path.abspath`` would make it a relative directory ``gs:/bucket``
    on each host's own disk, lost with the host."""
    scheme, sep, _ = directory.partition("://")
    if sep and scheme.isidentifier():
        raise ValueError(
            f"CheckpointManager(directory={directory!r}): a {scheme}:// URL is not a "
            "path. CheckpointManager writes through the file system, so it would write "
            f"into a local directory named {scheme}: on each host. Mount the bucket "
            "(e.g. gcsfuse) on every host and give the mount's path.")
