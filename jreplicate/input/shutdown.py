"""The input pipeline at interpreter exit: whether the exit began, and who is reading.

At exit, :func:`jreplicate.input.prefetch.stop_all` calls :func:`begin_exit` and waits
for the prefetch threads, except those inside a read from a user's source
(:func:`threads_reading`): such a read runs user code, not JAX, and may stall, so it is
not waited for. Instead :meth:`jreplicate.input.sources.Pipeline.next` brackets each
read with :func:`start_read` and :func:`end_read`, and :func:`check_read_kept` then
raises :class:`InputClosedError` on a daemon thread once the exit began, so the thread
never goes on into JAX while the runtime is torn down. Both sides meet here, below
both: neither :mod:`~jreplicate.input.prefetch` nor :mod:`~jreplicate.input.sources`
imports the other.
"""

from __future__ import annotations

import collections
import threading
from _thread import get_ident

_exiting = threading.Event()
_readers: collections.Counter[int] = collections.Counter()  # thread -> reads in progress
_lock = threading.Lock()


class InputClosedError(RuntimeError):
    """A read was abandoned because its input iterator was closed or the process exits."""


def begin_exit() -> None:
    """Marks the exit begun: reads ending from now on, on daemon threads, raise."""
    _exiting.set()


def exiting() -> bool:
    """True once the interpreter has started to exit (the exit hook has run)."""
    return _exiting.is_set()


def start_read() -> None:
    """Records that this thread entered a read from a user's source."""
    with _lock:
        _readers[get_ident()] += 1


def end_read() -> None:
    """Records that this thread's innermost read from a user's source returned."""
    ident = get_ident()
    with _lock:
        _readers[ident] -= 1
        if _readers[ident] <= 0:
            del _readers[ident]


def threads_reading() -> set[int]:
    """Threads now inside a read from a source (user code, not JAX); once the process
    began to exit, such a read raises instead of returning (see :func:`check_read_kept`)."""
    with _lock:
        return set(_readers)


def check_read_kept() -> None:
    """Raises :class:`InputClosedError` for a read that ended, on a daemon thread, after
    the exit began.

    Checked after the read left :func:`threads_reading`: a daemon thread (prefetch,
    reader), which the exit does not wait for, must not go on into JAX. A non-daemon
    thread (a user's training thread outliving the main thread) is joined before
    teardown and keeps its element.
    """
    if _exiting.is_set() and threading.current_thread().daemon:
        raise InputClosedError("the process is exiting; the element read is dropped.")
