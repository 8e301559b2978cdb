"""An exclusive lock on a directory, held by one process (private).

The lock is ``<directory>/jreplicate.lock``: an ``flock`` on the open file, which the
kernel releases when the holder exits, however it ends (a crash or SIGKILL leaves no
stale lock: the next holder takes the file over), plus the holder's pid, host, start
time and command written in the file for error messages. Releasing removes the file.
Where the file system has no ``flock`` (some network or FUSE file systems), the recorded
pid decides: a lock whose process no longer runs on this host (or whose pid now belongs
to a process started later) is stale and taken over.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
import weakref

LOCK_NAME = "jreplicate.lock"
logger = logging.getLogger("jreplicate")
_held: weakref.WeakSet[DirectoryLock] = weakref.WeakSet()  # this process's live locks


class LockHeldError(RuntimeError):
    """Another live process (or another object of this process) holds the lock.

    Attributes:
      holder: what the holder recorded (``pid``, ``host``, ``started``, ``command``),
        possibly empty.
    """

    def __init__(self, holder: dict):
        super().__init__(describe(holder) if holder else "another process")
        self.holder = holder

    @property
    def in_this_process(self) -> bool:
        return (self.holder.get("pid") == os.getpid()
                and self.holder.get("host") == socket.gethostname())


def _process_start(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), or None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        pass
    now = _process_start(pid)
    return start is None or now is None or now == start


def describe(info: dict) -> str:
    """``process 123 on host h (started 2026-01-01 10:00:00 UTC, 'python train.py')``."""
    started = info.get("started")
    when = (datetime.datetime.fromtimestamp(started, datetime.UTC)
            .strftime("%Y-%m-%d %H:%M:%S UTC") if isinstance(started, (int, float)) else "?")
    return (f"process {info.get('pid', '?')} on host {info.get('host', '?')} (started "
            f"{when}, {info.get('command', '?')!r})")


def _read(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


class DirectoryLock:
    """Holds ``<directory>/jreplicate.lock`` until :meth:`release` (or process exit).

    Args:
      directory: an existing directory.

    Raises:
      LockHeldError: another live holder has it; the message names that holder.
      OSError: the lock file cannot be created or written (e.g. no permission).
    """

    def __init__(self, directory: str):
        self.path = os.path.join(directory, LOCK_NAME)
        self._info = {"pid": os.getpid(), "host": socket.gethostname(),
                      "started": time.time(), "proc_start": _process_start(os.getpid()),
                      "command": " ".join(sys.argv)[:200] or sys.executable}
        self._fd: int | None = None
        for _ in range(10):  # a holder may unlink the file as it releases it: reopen then
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if self._lock(fd):
                    self._fd = fd
                    break
            except BaseException:  # broad: the descriptor is closed however the
                os.close(fd)  # lock attempt ends (Ctrl-C included), then re-raised
                raise
            os.close(fd)
        else:
            raise LockHeldError({})
        _held.add(self)

    def _lock(self, fd: int) -> bool:
        """Locks ``fd`` and records this process in it; False if the file was replaced
        meanwhile (try again)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held_by_flock = False
        except BlockingIOError:
            held_by_flock = True
        except OSError as e:  # no flock on this file system: the recorded pid decides
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            held_by_flock = None
        previous = _read(fd)
        if held_by_flock or (held_by_flock is None and previous and self._live(previous)):
            raise LockHeldError(previous)
        try:
            if not os.path.samestat(os.fstat(fd), os.stat(self.path)):
                return False
        except FileNotFoundError:  # released (unlinked) by its holder just now
            return False
        if previous.get("pid") is not None:
            logger.info("jreplicate: took over %s from %s, which no longer holds it",
                        self.path, describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self._info).encode(), 0)
        os.fsync(fd)
        return True

    def _live(self, info: dict) -> bool:
        if info.get("host") != socket.gethostname():
            return True  # another host's process: it cannot be checked from here
        pid = info.get("pid")
        if not isinstance(pid, int):
            return False
        if pid == os.getpid():
            return any(lock is not self and lock.path == self.path for lock in _held)
        return _pid_alive(pid, info.get("proc_start"))

    def release(self) -> None:
        """Gives the lock up and removes the file (idempotent)."""
        if self._fd is None:
            return
        _held.discard(self)
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while still locked: a new holder reopens a new file
        os.close(self._fd)  # releases the flock
        self._fd = None
