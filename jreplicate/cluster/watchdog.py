"""Exit watchdogs: a process of a multi-process job ends on time, saying why.

:func:`start_init_watchdog` ends a process whose start-up outlives
``initialization_timeout`` (status :data:`EXIT_INIT_TIMEOUT`), instead of leaving it
blocked in ``jax.distributed.initialize``; a preempted process exits with
:data:`EXIT_PREEMPTED` once its checkpoint is saved. :func:`install_fail_fast` makes an uncaught
exception end the process at once, so that its peers are not left waiting for it in a
collective; it is opt-in (``MultiWorkerStrategy(fail_fast=...)``, or
``JREPLICATE_FAIL_FAST=1``, which ``python -m jreplicate.cluster.launch`` sets).
:func:`settle_at_exit` makes a finishing process wait for the computations it dispatched
before the runtime shuts down, so that it never leaves a peer inside a collective.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

from jreplicate.cluster.spec import ClusterError, ClusterSpec, Timeouts

logger = logging.getLogger("jreplicate")

#: Exit status of a process that could not join the cluster within
#: ``initialization_timeout`` (``os.EX_TEMPFAIL``: try again later).
EXIT_INIT_TIMEOUT = 75

#: Exit status of a process that stopped because the job was preempted, after every
#: process saved the same checkpoint (:class:`jreplicate.checkpoint.Preempted`;
#: TensorFlow's restartable exit code). ``python -m jreplicate.cluster.launch`` restarts
#: a group whose processes all exit with it without counting a failure.
EXIT_PREEMPTED = 42

#: ``"1"``: strategies created with ``fail_fast=None`` install :func:`install_fail_fast`.
#: The launcher sets it for the processes of a job of more than one process.
ENV_FAIL_FAST = "JREPLICATE_FAIL_FAST"
_ON, _OFF = ("1", "true", "yes"), ("", "0", "false", "no")


def start_init_watchdog(spec: ClusterSpec, timeouts: Timeouts,
                        deadline: float) -> threading.Event:
    """Exits with a clear message if start-up outlives ``initialization_timeout``
    (``deadline``, on the ``time.monotonic`` clock).

    ``jax.distributed.initialize`` blocks in C++ and aborts on its own deadline with a
    message about RPC deadlines; this says what went wrong, on time. Set the returned
    event once start-up is over.
    """
    done = threading.Event()

    def watch():
        if done.wait(max(0.0, deadline - time.monotonic()) + 1.0):
            return
        me = "the coordinator" if spec.process_id == 0 else f"process {spec.process_id}"
        sys.stderr.write(
            f"jreplicate: MultiWorkerStrategy: {me} (process {spec.process_id} of "
            f"{spec.num_processes}) could not join the cluster at {spec.coordinator_address} "
            f"within initialization_timeout={timeouts.initialization_timeout:g}s "
            f"(cluster from {spec.source}). "
            + ("Not all processes connected: start all num_processes processes, with the "
               "same coordinator_address and distinct process_id values."
               if spec.process_id == 0 else
               "The coordinator accepted the connection but the job did not start: check that "
               "every process uses the same coordinator_address and num_processes.")
            + f" Exiting with status {EXIT_INIT_TIMEOUT}.\n")
        sys.stderr.flush()
        os._exit(EXIT_INIT_TIMEOUT)

    threading.Thread(target=watch, name="jreplicate-init-watchdog", daemon=True).start()
    return done


def fail_fast_requested(fail_fast: bool | None,
                        where: str = "MultiWorkerStrategy(fail_fast=...)") -> bool:
    """Whether to install :func:`install_fail_fast`.

    Args:
      fail_fast: ``True`` or ``False`` decide; ``None`` defers to the environment:
        ``JREPLICATE_FAIL_FAST=1`` asks for it (the launcher sets it for the processes
        of a job of more than one process).
      where: the argument, for error messages.

    Raises:
      TypeError: ``fail_fast`` is not a bool or None.
      ValueError: ``JREPLICATE_FAIL_FAST`` is neither on (``1``) nor off (``0``).
    """
    if fail_fast is not None:
        if not isinstance(fail_fast, bool):
            raise TypeError(f"{where} is {fail_fast!r}; it must be True, False or None "
                            f"(None: only if the environment sets {ENV_FAIL_FAST}=1).")
        return fail_fast
    value = os.environ.get(ENV_FAIL_FAST, "").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"environment variable {ENV_FAIL_FAST}={os.environ[ENV_FAIL_FAST]!r} "
                         "is neither 1 nor 0. Set it to 1 to end a process at its first "
                         "uncaught exception, 0 (or unset it) not to.")
    return value in _ON


_PEER_FAILURE_SIGNS = ("gloo", "connection closed by peer", "timed out waiting",
                       "heartbeat", "coordination service", "unavailable", "deadline")


def install_fail_fast(process_id: int, num_processes: int, timeouts: Timeouts) -> None:
    """Makes an uncaught exception end this process at once, explained (``sys.excepthook``).

    Why: after an uncaught exception, JAX's ``atexit`` handler waits in the distributed
    runtime's shutdown barrier, up to ``shutdown_timeout``, for peers that are
    themselves waiting in a collective for this process, so one process's exception
    would stall the whole group (and a launcher would see a peer abort first). The hook
    lets the previous hook print the traceback, then exits with status 1 (130 for
    KeyboardInterrupt) without ``atexit`` handlers: this process's connections close,
    the peers' collectives fail at once, and ``python -m jreplicate.cluster.launch``
    stops them and names this process and its exception. A dead or stuck peer surfaces
    as a terse runtime error from XLA or gloo (or a :class:`ClusterError` from
    jreplicate's agreements): the hook says, once, what it means. An interactive
    interpreter is not ended. Installing it twice keeps the first.

    Args:
      process_id: this process's id, for the message.
      num_processes: the number of processes of the job, for the message.
      timeouts: the job's timeouts, named in the message.
    """
    previous = sys.excepthook
    if getattr(previous, "_jreplicate", False):
        return
    t = timeouts

    def hook(kind, value, tb):
        previous(kind, value, tb)
        text = str(value).lower()
        if isinstance(value, ClusterError) or (
                issubclass(kind, RuntimeError) and any(s in text for s in _PEER_FAILURE_SIGNS)):
            sys.stderr.write(
                f"jreplicate: process {process_id} of {num_processes} "
                "stopped because a collective across processes failed: another process died "
                f"(detected at once, or within heartbeat_timeout={t.heartbeat_timeout:g}s) "
                "or stopped taking part (detected after collective_timeout="
                f"{t.collective_timeout:g}s). See that process's output for the cause (the "
                "launcher names the process that failed first).\n")
        if hasattr(sys, "ps1") or sys.flags.interactive:
            return  # a REPL carries on after an exception
        _exit_now(130 if issubclass(kind, KeyboardInterrupt) else 1)

    hook._jreplicate = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _exit_now(status: int) -> None:
    """Flushes output and logging, then ends the process without atexit handlers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to save
            pass
    try:
        logging.shutdown()
    except Exception:  # a faulty handler must not keep the process alive
        pass
    os._exit(status)


_settling = False


def settle_at_exit() -> None:
    """At interpreter exit, waits until the computations this process dispatched have
    finished, before JAX's own exit handler shuts the distributed runtime down.
    Installing it twice keeps the first.

    Why: computations are dispatched asynchronously, so a program's last steps may still
    run when its last line has run (their results unread, or dropped). JAX's exit
    handler waits in the runtime's shutdown barrier, after which each process leaves;
    one left with a step still to run while its peer, tearing its JAX client down,
    waited for that step's collective until ``collective_timeout`` (measured: 2
    processes, the last steps' results dropped, an input error agreed at the end: one
    process never exited in 5 of 7 runs). Waiting first means every process has done
    its share of every collective before any leaves.

    How: a trivial computation is run on each local device, after everything dispatched
    there (a device runs its computations in dispatch order: a GPU's or TPU's stream;
    on CPU, as measured with jaxlib 0.12), and every live array is waited for. Each
    wait is bounded by the collective timeout (a computation whose peer is gone fails).
    """
    global _settling
    if _settling:
        return
    _settling = True
    import atexit

    # atexit runs handlers last-registered first: this one runs before JAX's clean_up
    # (registered when jax was imported), which shuts the distributed runtime down.
    atexit.register(_settle)


def _settle() -> None:
    try:
        import jax
        import numpy as np
        bump = jax.jit(lambda x: x + 1)
        marks = [bump(jax.device_put(np.int32(0), d)) for d in jax.local_devices()]
        waits = marks + jax.live_arrays()
    except Exception as e:  # noqa: BLE001 - no backend left: nothing to wait for
        logger.debug("jreplicate: nothing to wait for at exit (%s)", e)
        return
    for a in waits:
        try:
            a.block_until_ready()
        except Exception as e:  # noqa: BLE001 - it failed: its error is raised where read
            logger.debug("jreplicate: a computation failed before exit (%s)", e)
