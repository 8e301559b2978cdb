"""A prompt exit after Ctrl-C (private; imported by ``jreplicate`` for its exit hook).

After a KeyboardInterrupt ended the program, most of the exit is the interpreter's
teardown: its garbage collections over every object of JAX, NumPy and the program
(0.2-0.25 s of CPU after ``import jax``; on a loaded host the wall time is a multiple
of that). An exit hook freezes the garbage collector then (``gc.freeze()``: objects
alive now are never collected again), which leaves about 0.04 s of CPU from SIGINT to
the end (tests/test_exit.py).

Nothing a program saves is skipped: ``atexit`` handlers, ``weakref.finalize``
callbacks, ``logging.shutdown`` and ``with``/``finally`` blocks all run as before, and
objects freed by reference counting (an unreferenced open file, say) are still
finalized. Only objects kept alive by reference cycles until the very end are left to
the operating system, whose destructors Python does not promise to run at exit anyway.
Other exits (normal end, another exception) are left as they are.
"""

from __future__ import annotations

import atexit
import gc
import sys


def _interrupted() -> bool:
    """Whether the program ended by an uncaught KeyboardInterrupt (Python sets
    ``sys.last_exc`` when it prints the traceback of an uncaught exception)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return isinstance(exc, KeyboardInterrupt)


def _jax_counts_leaks() -> bool:
    """JAX's ``jax_debug_leaked_clients_on_clear_backends`` check collects garbage at
    exit to find leaked clients: frozen objects would look leaked."""
    jax = sys.modules.get("jax")
    try:
        return bool(jax.config.jax_debug_leaked_clients_on_clear_backends)
    except AttributeError:  # no jax, or a version without the flag
        return False


def on_exit() -> None:
    """The exit hook: freezes the garbage collector if Ctrl-C ended the program."""
    if _interrupted() and not _jax_counts_leaks():
        gc.freeze()


atexit.register(on_exit)
