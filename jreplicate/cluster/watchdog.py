"""Exit watchdogs: a process of a multi-process job ends on time, saying why.

:func:`start_init_watchdog` ends a process whose start-up outlives
``initialization_timeout`` (status :data:`EXIT_INIT_TIMEOUT`), instead of leaving it
blocked in ``jax.distributed.initialize``.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from jreplicate.cluster.spec import ClusterSpec, Timeouts

#: Exit status of a process that could not join the cluster within
#: ``initialization_timeout`` (``os.EX_TEMPFAIL``: try again later).
EXIT_INIT_TIMEOUT = 75


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
