"""Preemption: every process stops at the same save, writes it, and exits 42.

A preemptible host gets SIGTERM (or the platform's notice, which JAX turns into the
same) some time before it goes away. :class:`PreemptionWatch` turns that notice, on any
process, into one decision every process takes at the same
:meth:`jreplicate.checkpoint.CheckpointManager.save` call; the manager then writes that
call's state whatever ``save_interval_steps`` says and, with ``exit_on_preemption=True``,
raises :class:`Preempted` (a ``SystemExit`` with status :data:`EXIT_PREEMPTED`, 42) on
every process. ``python -m jreplicate.cluster.launch`` restarts such a group, and
``restore_or_initialize`` resumes from the checkpoint just written.

How the processes agree (:meth:`PreemptionWatch.check`, once per ``save`` call):

* **With** ``jax.distributed`` **and its preemption service** (on by default): JAX's
  sync manager (``multihost_utils.reached_preemption_sync_point``). Its C++ handler
  owns SIGTERM: a process that gets it tells the coordination service, every process
  reports the last id it passed, and every process returns True at ``max + 1``. The id
  passed is this process's count of ``check`` calls, never the user's step: the
  protocol needs ids that every process passes in the same order and that grow by one
  (a device loop's steps jump by K). The count is process-wide, not per manager, so
  several managers, one after the other or side by side, share it: with a count per
  manager, the ids would start again at 0 in the next manager, and a process still in
  the first one and a process already in the next could stop in different managers.
* **Otherwise** (one process without ``jax.distributed``, or the service switched
  off with ``jax_enable_preemption_service=False``): a Python SIGTERM handler, which
  can only be installed from the main thread, sets a flag and calls the handler that
  was there before (a Python one; not the default, which would end the process). With
  several processes, each ``check`` all-gathers the flags (one round trip of the
  key-value store), so every process stops at the first call after any process got
  the signal. Where no handler can be installed (a manager made outside the main
  thread) a warning says that preemption is not watched on this process; it still
  takes part in the agreement.

Do not install a Python SIGTERM handler yourself in a job with ``jax.distributed``: it
silently replaces JAX's C++ one (``signal.getsignal`` does not show it) and turns the
notice off (docs/guides/multi_process.md, "Preemption").
"""

from __future__ import annotations

import itertools
import logging
import signal
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import jax

from jreplicate import _wire
from jreplicate.cluster.agreement import Agreement
from jreplicate.cluster.watchdog import EXIT_PREEMPTED

logger = logging.getLogger("jreplicate")

__all__ = ["EXIT_PREEMPTED", "Preempted", "PreemptionWatch"]


class Preempted(SystemExit):
    """Raised by :meth:`CheckpointManager.save` on every process once the job is preempted
    and the checkpoint of that call is written (``exit_on_preemption=True``).

    A ``SystemExit``: left uncaught it ends the process with status ``code`` =
    :data:`EXIT_PREEMPTED` (42), with the interpreter's normal exit (``atexit``
    handlers, JAX's distributed shutdown; no traceback), which the launcher restarts.

    Attributes:
      step: the step of the checkpoint written before raising.

    Example (one process: the SIGTERM a preemptible host gets, then the next save):
      >>> import os, signal, tempfile, jax.numpy as jnp, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy())
      >>> mngr = jr.CheckpointManager(tempfile.mkdtemp(), rep, save_interval_steps=100)
      >>> mngr.save(1, {"w": jnp.zeros(2)})  # not a multiple of 100: nothing written
      False
      >>> os.kill(os.getpid(), signal.SIGTERM)
      >>> try:
      ...     mngr.save(2, {"w": jnp.ones(2)})
      ... except jr.checkpoint.Preempted as e:
      ...     print(e.code, e.step, mngr.complete_steps())
      42 2 [2]
    """

    def __init__(self, step: int):
        super().__init__(EXIT_PREEMPTED)
        self.step = step

    def __str__(self) -> str:
        return (f"preempted: checkpoint {self.step} is saved; exiting with status "
                f"{EXIT_PREEMPTED} (restart to resume from it)")


# One sync id per check, process-wide (see the module docstring).
_sync_ids = itertools.count()


class _SigtermFlag:
    """The process's Python SIGTERM handler: installed by a watch when it is not the
    handler already, given back to the previous one when the last watch closes (if
    nobody replaced it meanwhile). It counts signals; a notice is consumed where the
    processes agree to stop, so that it makes one stop, as JAX's sync point does."""

    def __init__(self):
        self._lock = threading.Lock()
        self._users = 0
        self._previous: Any = None
        self.received = 0  # SIGTERMs handled
        self.consumed = 0  # of which acted on (or dropped when the last watch closed)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received += 1
        if self.received == self.consumed + 1:
            logger.warning("jreplicate: SIGTERM received: the job will stop at the next "
                           "CheckpointManager.save, after writing it")
        if callable(self._previous) and not _exits_at_once(self._previous):
            self._previous(signum, frame)

    def pending(self) -> int:
        """The count of signals received so far, when one is not yet acted on; else 0."""
        received = self.received
        return received if received > self.consumed else 0

    def consume(self, upto: int) -> None:
        self.consumed = max(self.consumed, upto)

    def acquire(self) -> bool:
        """Installs the handler unless it is SIGTERM's already; False when this is not
        the main thread (where Python allows no handler to be installed)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        with self._lock:
            if signal.getsignal(signal.SIGTERM) != self._handle:
                self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._users += 1
        return True

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            self.consumed = self.received  # a notice nobody acted on dies with them
            ours = signal.getsignal(signal.SIGTERM) == self._handle
            if ours and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self._previous if self._previous is not None
                              else signal.SIG_DFL)
            elif not ours:
                logger.debug("jreplicate: SIGTERM's handler was replaced after the "
                             "checkpoint manager's; left as it is")


_FLAG = _SigtermFlag()


def _exits_at_once(handler: Any) -> bool:
    """Whether ``handler`` is Ray's SIGTERM handler (``ray.init`` installs one that calls
    ``sys.exit`` at once): chained to, it would end the job before the agreed save, so
    the watch does not call it (it is still given back at close)."""
    module = getattr(handler, "__module__", None) or ""
    return module == "ray" or module.startswith("ray.")


def _service_running() -> bool:
    """Whether JAX's preemption sync manager runs (``jax.distributed`` started with
    ``jax_enable_preemption_service``, the default): the same on every process."""
    return jax.distributed.is_initialized() and bool(
        jax.config.jax_enable_preemption_service)


class PreemptionWatch:
    """Says, at each ``save`` call, whether every process stops there (module docstring).

    Args:
      agreement: the processes' channel for the flags when JAX's service does not run
        (``None`` for one process). It must be opened on every process alike.
      where: what is watching, for messages.
      ids: the sync ids given to JAX's service (tests); by default this process's
        count of checks, shared by every watch.
    """

    def __init__(self, agreement: Agreement | None, where: str = "CheckpointManager", *,
                 ids: Iterator[int] | None = None):
        self._agreement = agreement
        self._ids = _sync_ids if ids is None else ids
        self._service = _service_running()
        self._flag = False
        self._closed = False
        if not self._service:
            self._flag = _FLAG.acquire()
            if self._flag:  # a watch dropped unclosed (its manager collected) gives it back
                self._release = weakref.finalize(self, _FLAG.release)
            if not self._flag:
                logger.warning(
                    "jreplicate: %s was created outside the main thread, where no SIGTERM "
                    "handler can be installed: preemption (SIGTERM) is not watched on this "
                    "process%s. Create it in the main thread.", where,
                    "" if agreement is None else " (it still stops when another process is "
                    "preempted)")

    @property
    def mechanism(self) -> str:
        """``"jax"`` (JAX's preemption service), ``"signal"`` (a Python SIGTERM handler)
        or ``"none"`` (not watched on this process)."""
        return "jax" if self._service else "signal" if self._flag else "none"

    def check(self, call: int | None = None) -> bool:
        """Whether this call is where every process stops; the same on every process.
        Call it exactly once per ``save`` call, on every process.

        Args:
          call: the manager's own count of its ``save`` calls, for messages. JAX's
            sync point is given this process's count of checks instead, over every
            manager: with one count per manager, a manager closed and the next one
            opened would pass ids 0, 1, ... again, and processes on either side of the
            switch when the notice arrives could stop in different managers.

        Raises:
          ClusterError: a process did not take part in the agreement in time.
        """
        del call
        sync_id = next(self._ids)
        if self._service:
            from jax.experimental import multihost_utils
            return bool(multihost_utils.reached_preemption_sync_point(sync_id))
        pending = _FLAG.pending() if self._flag else 0
        stop = bool(pending)
        if self._agreement is not None:
            stop = any(m["noticed"] for m in self._agreement.exchange(
                {"noticed": stop}, "whether a process was preempted (SIGTERM)",
                _wire.PREEMPTION_NOTICE))
        if stop and pending:
            _FLAG.consume(pending)
        return stop

    def close(self) -> None:
        """Gives SIGTERM back to the handler it had before (idempotent)."""
        if not self._closed and self._flag:
            self._release()  # once: the finalizer does nothing after this
        self._closed = True
