"""Checkpoints written in the background, and the outcome every process agrees on (private).

:class:`BackgroundWriter` writes one checkpoint at a time with Orbax's
``AsyncCheckpointer`` (used directly, not through ``ocp.CheckpointManager``, which
joins JAX's preemption protocol with the user's step numbers and waits on fixed
300 s barriers): :meth:`BackgroundWriter.start` returns once every leaf's
device-to-host copy is taken, and Orbax's thread writes the files, waits for the other
processes' writes and commits (``commit_success.txt``, then the rename of
``<step>.orbax-checkpoint-tmp`` to ``<step>``). A temporary directory is never a step,
so a write that fails or is killed leaves nothing that is restored.

A write that fails on one process must not leave the others waiting in Orbax's
``async_write_complete`` barrier for its whole timeout: Orbax is given
:class:`AbortableBarrier`, over the coordination service's key-value store, which a
failing process aborts for everyone at once.

:func:`settle` is the outcome exchange the manager runs before each save, and in
``wait_until_finished``, ``close`` and ``restore_or_initialize``: wait (bounded) for the
pending write, send ``{ok | error}`` through the manager's agreement, and return the
same :class:`Failure` on every process, naming the process whose write failed first.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from jreplicate import _jax_compat, _wire
from jreplicate.checkpoint.checks import one_line, path_problem, quiet_orbax

logger = logging.getLogger("jreplicate")

#: Orbax's suffix of a step's temporary directory while it is written.
TMP_SUFFIX = ".orbax-checkpoint-tmp"
#: The suffix of an old step being deleted (renamed first, so that a deletion cut
#: short never leaves a step that looks complete).
DELETING_SUFFIX = ".deleting"
#: What a process whose write was abandoned because a peer's failed reports.
ABORTED = "aborted: another process's write failed"



@dataclasses.dataclass(frozen=True)
class Failure:
    """The agreed failure of a write: the first process whose write failed, and why."""

    process: int
    error: str


class AbortableBarrier:
    """Orbax's ``barrier_sync_fn``: a barrier over the key-value store that any process
    can abort.

    Each process sets ``<round>/barrier/<key>/<pid>`` and polls ``<round>/`` until every
    process in ``processes`` has, or ``<round>/abort`` appears (then it raises
    :class:`RuntimeError` with the abort's reason), or ``timeout_ms`` passes (then
    :class:`TimeoutError` naming the processes that did not arrive). A round is one
    save (:meth:`begin`), so that a step written again after a failure never meets its
    old keys.
    """

    def __init__(self, prefix: str, processes: Sequence[int], process_index: int,
                 poll_s: float = 0.02):
        self._prefix = prefix
        self._processes = sorted(processes)
        self._pid = process_index
        self._poll_s = poll_s
        self._round = f"{prefix}/0"

    def begin(self, number: int) -> None:
        """Starts round ``number`` (the same on every process: one per save)."""
        self._round = f"{self._prefix}/{number}"

    def abort(self, why: str) -> None:
        """Lets every process waiting in this round's barriers go (best effort)."""
        if len(self._processes) < 2:
            return
        try:
            _jax_compat.distributed_client().key_value_set_bytes(
                f"{self._round}/abort", f"process {self._pid}: {why}"[:500].encode())
        except Exception:  # noqa: BLE001 - already set by a peer, or the service is gone
            logger.debug("jreplicate: checkpoint barrier abort not set", exc_info=True)

    def clear(self, number: int) -> None:
        """Deletes round ``number``'s keys (best effort; call once every process is past)."""
        if len(self._processes) < 2:
            return
        try:
            _jax_compat.distributed_client().key_value_delete(f"{self._prefix}/{number}/")
        except Exception:  # noqa: BLE001 - the keys are small; a leftover harms nothing
            logger.debug("jreplicate: checkpoint barrier keys not deleted", exc_info=True)

    def __call__(self, *, key: str, timeout_ms: int) -> None:
        if len(self._processes) < 2:
            return
        client = _jax_compat.distributed_client()
        base = f"{self._round}/barrier/{key}/"
        client.key_value_set_bytes(f"{base}{self._pid}", b"1")
        deadline = time.monotonic() + timeout_ms / 1000
        want = {f"{base}{p}" for p in self._processes}
        while True:
            entries = dict(client.key_value_dir_get_bytes(f"{self._round}/"))
            abort = entries.get(f"{self._round}/abort")
            if abort is not None:
                raise RuntimeError(f"{ABORTED} ({abort.decode(errors='replace')})")
            if want <= entries.keys():
                return
            if time.monotonic() > deadline:
                missing = [p for p in self._processes if f"{base}{p}" not in entries]
                raise TimeoutError(
                    f"processes {missing} did not finish writing within "
                    f"{timeout_ms / 1000:g}s (barrier {key})")
            time.sleep(self._poll_s)


@functools.cache
def _handler_class() -> tuple[type, type]:
    """``(Handler, Save)``: Orbax's standard handler with faults, and its save arguments
    (Orbax finds a handler's arguments by its exact class, so they are registered)."""
    import orbax.checkpoint as ocp

    class Handler(ocp.StandardCheckpointHandler):
        """Orbax's handler, plus faults run once in the background of the next save
        (:mod:`jreplicate.testing`)."""

        def __init__(self, **kwargs: Any):
            super().__init__(**kwargs)
            self.faults: list[Callable[[], None]] = []

        async def async_save(self, directory, item=None, save_args=None, args=None):
            futures = list(await super().async_save(directory, item, save_args, args) or [])
            faults, self.faults = self.faults, []
            return futures + [_Fault(faults)] if faults else futures

    @ocp.args.register_with_handler(Handler, for_save=True)
    class Save(ocp.args.StandardSave):
        pass

    @ocp.args.register_with_handler(Handler, for_restore=True)
    class Restore(ocp.args.StandardRestore):
        pass

    return Handler, Save


class _Fault:
    """A commit future that runs the injected faults (in Orbax's background thread)."""

    def __init__(self, faults: list[Callable[[], None]]):
        self._faults = faults

    def result(self, timeout: float | None = None) -> None:
        del timeout
        for fault in self._faults:
            fault()


@dataclasses.dataclass
class _Pending:
    """The write in flight (or finished, its outcome not yet agreed)."""

    step: int
    number: int
    started: float
    returned: float = math.nan  # when start() returned (device-to-host copy taken)
    finished: float = math.nan
    error: str | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    reported: bool = False


class BackgroundWriter:
    """Writes checkpoints with one Orbax ``AsyncCheckpointer``, one at a time.

    The manager's writer seam: :meth:`start`, :meth:`poll`, :meth:`wait`, :meth:`close`.
    The data goes to ``<directory>/<step>/default`` (Orbax's composite layout, as
    :mod:`jreplicate.checkpoint.restore` reads it).

    Args:
      directory: the checkpoint directory.
      key_prefix: a key-value prefix unique to the manager and equal on every process.
      every_process: every process writes its own shards (else this process alone).
      num_processes: the job's processes.
      process_index: this process.
      timeout: seconds Orbax's background thread may take (the writes and its
        barriers), at least 1.
    """

    def __init__(self, directory: str, *, key_prefix: str, every_process: bool,
                 num_processes: int, process_index: int, timeout: float):
        import orbax.checkpoint as ocp
        self._dir = directory
        self._timeout = max(1, math.ceil(timeout))
        processes = range(num_processes) if every_process else [process_index]
        self.barrier = AbortableBarrier(f"{key_prefix}/writes", processes, process_index)
        options = (ocp.options.MultiprocessingOptions(primary_host=0) if every_process else
                   ocp.options.MultiprocessingOptions(primary_host=process_index,
                                                      active_processes={process_index}))
        handler, self._save_args = _handler_class()
        self.handler = handler(multiprocessing_options=options)
        self._orbax = ocp.AsyncCheckpointer(
            ocp.CompositeCheckpointHandler(
                default=self.handler,
                composite_options=ocp.CompositeOptions(multiprocessing_options=options)),
            async_options=ocp.options.AsyncOptions(
                timeout_secs=self._timeout, barrier_sync_fn=self.barrier,
                create_directories_asynchronously=False),
            multiprocessing_options=dataclasses.replace(
                options, barrier_sync_key_prefix=key_prefix.replace("/", "_")))
        self._count = 0
        self._pending: _Pending | None = None
        self._last: list[_Pending | None] = [None]  # read by the finaliser
        weakref.finalize(self, _report_at_exit, self._last)
        _live.add(self)

    @property
    def directory(self) -> str:
        return self._dir

    @property
    def timeout(self) -> int:
        """Seconds Orbax's background thread may take."""
        return self._timeout

    @property
    def pending(self) -> _Pending | None:
        """The write whose outcome is not yet agreed (None: none)."""
        return self._pending

    def start(self, step: int, tree: Any, metadata: dict | None = None) -> None:
        """Starts writing ``tree`` as checkpoint ``step``, with Orbax custom metadata
        ``metadata``; returns once the device-to-host copies are taken. A failure, here
        or in the background, is this write's outcome (see :meth:`wait`), never raised
        here, so that every process learns it at the same call."""
        import orbax.checkpoint as ocp
        if self._pending is not None and not self._pending.reported:
            raise RuntimeError("BackgroundWriter.start: the previous write is not settled")
        if self._pending is not None:  # every process is past its barriers: agreed
            self.barrier.clear(self._pending.number)
        self._count += 1
        pending = _Pending(step, self._count, time.monotonic())
        self._pending = self._last[0] = pending
        self.barrier.begin(pending.number)
        args = ocp.args.Composite(default=self._save_args(tree, custom_metadata=metadata))
        try:
            with quiet_orbax():
                self._orbax.save(os.path.join(self._dir, str(step)), args=args)
        except Exception as e:  # broad: the outcome of this process's write, agreed later
            self._drain()
            self._finish(pending, self._describe(e))
            return
        pending.returned = time.monotonic()
        threading.Thread(target=self._watch, args=(pending,), name=f"jreplicate-ckpt-{step}",
                         daemon=False).start()

    def _watch(self, pending: _Pending) -> None:
        try:
            self._orbax.wait_until_finished()
        except BaseException as e:  # broad: the outcome, agreed by every process
            self._drain()
            self._finish(pending, self._describe(e))
            return
        self._finish(pending, None)

    def _drain(self) -> None:
        """Collects the errors Orbax still holds from a failed write (its metadata
        writes raise theirs one at a time), so that none is raised again by the next
        write, which they do not concern."""
        for _ in range(16):
            try:
                with quiet_orbax():
                    self._orbax.wait_until_finished()
                return
            except BaseException:  # broad: the failed write's, already reported
                logger.debug("jreplicate: a further error of the failed checkpoint write",
                             exc_info=True)

    def _describe(self, e: BaseException) -> str:
        """An error's text for the message every process raises: what is wrong with
        the directory and the fix for an ``OSError`` (a full disk...), else one line."""
        if isinstance(e, OSError) and e.errno is not None and not isinstance(e, TimeoutError):
            return path_problem(self._dir, e)
        return one_line(e)

    def _finish(self, pending: _Pending, error: str | None) -> None:
        if error is not None and not error.startswith(f"RuntimeError: {ABORTED}"):
            self.barrier.abort(error)  # first: peers waiting for this process let go
        pending.error = error
        pending.finished = time.monotonic()
        if math.isnan(pending.returned):
            pending.returned = pending.finished
        pending.done.set()

    def poll(self) -> bool:
        """Whether the last write has ended (committed or failed); never blocks."""
        p = self._pending
        return p is None or p.done.is_set()

    def wait(self, deadline: float | None = None) -> str | None:
        """Waits for the last write until ``time.monotonic()`` passes ``deadline`` (None:
        Orbax's own bound, plus a margin); returns None once it committed (or nothing
        was written), else its error, which is then reported: each write's outcome is
        returned once. A write not ended by the deadline is aborted and reported as
        not finished."""
        p = self._pending
        if p is None or p.reported:
            return None
        bound = (self._timeout + 30 if deadline is None
                 else max(0.0, deadline - time.monotonic()))
        if not p.done.wait(bound):
            why = f"TimeoutError: the write did not end within {bound:.0f}s"
            self.barrier.abort(why)
            p.reported = True
            return why
        p.reported = True
        return p.error

    def close(self) -> None:
        """Waits for the last write (the manager reads its outcome first) and closes."""
        if self._pending is not None:
            self._pending.done.wait(self._timeout + 30)
        with quiet_orbax():
            self._orbax.close()


_live: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()  # kept alive while writing


def wait_for_writes(directory: str) -> None:
    """Waits for this process's unfinished writes into ``directory`` (of a manager
    dropped without ``close()``), so that a new manager there neither deletes their
    temporary files nor misses their step; a failure nobody was told of is logged."""
    for writer in list(_live):
        p = writer.pending
        if writer.directory != directory or p is None or p.reported:
            continue
        if not p.done.is_set():
            logger.warning("jreplicate: a CheckpointManager on %s was dropped without close() "
                           "while writing checkpoint %d; waiting for that write", directory,
                           p.step)
            p.done.wait(writer.timeout + 30)
        if p.done.is_set() and p.error is not None:
            p.reported = True
            logger.error("jreplicate: checkpoint %d in %s was not written (%s); its manager "
                         "was dropped without close(), which would have raised it", p.step,
                         directory, p.error)


def _report_at_exit(last: list[_Pending | None]) -> None:
    """Logs the failure of the last write if nobody settled it. A write still pending
    when the program ends fails too: Python (3.12) starts no thread once it shuts down,
    and Orbax's commit needs one, so a program must ``close()`` its manager."""
    p = last[0]
    if p is not None and not p.reported and p.done.is_set() and p.error is not None:
        logger.error("jreplicate: checkpoint %d was not written (%s); the error was never "
                     "reported: call CheckpointManager.wait_until_finished() or close() "
                     "before the program ends.", p.step, p.error)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The agreed outcome of a write (the same on every process).

    Attributes:
      step: the checkpoint written.
      failure: None if every process's write succeeded; else the first process whose
        write failed for its own reason (not because a peer's failure aborted it).
      latest: the chief's latest complete step once the write ended.
    """

    step: int
    failure: Failure | None
    latest: int | None


def settle(writer: BackgroundWriter | None, agreement: Any, step: int, *,
           latest: Callable[[], int | None], is_chief: bool) -> Outcome:
    """Waits (bounded) for the last write, of checkpoint ``step``, and agrees its outcome.

    Call it on every process at the same point whenever a write is pending; a process
    that does not write passes ``writer=None`` and reports success. ``latest`` runs on
    the chief, after its write ended.
    """
    mine = {"error": writer.wait(None) if writer is not None else None,
            "latest": latest() if is_chief else None}
    if agreement is None:
        outcomes = [mine]
    else:
        outcomes = agreement.exchange(mine, f"the outcome of writing checkpoint {step}",
                                      _wire.CHECKPOINT_WRITE)
    failed = [(p, m["error"]) for p, m in enumerate(outcomes) if m["error"] is not None]
    causes = [(p, e) for p, e in failed if ABORTED not in e] or failed
    return Outcome(step, Failure(*causes[0]) if causes else None, outcomes[0]["latest"])


def failure_message(step: int, failure: Failure, latest: int | None) -> str:
    """The error every process raises for a write that failed."""
    previous = (f"checkpoint {latest} is the latest" if latest is not None else
                "there is no complete checkpoint yet")
    return (f"checkpoint {step} was not written: process {failure.process} failed "
            f"({failure.error}); it is incomplete and will not be restored; {previous}.")


def remove_debris(directory: str) -> None:
    """Deletes the temporary directories of interrupted writes (the chief, at start and
    after a failed write), warning where one cannot be deleted."""
    if not os.path.isdir(directory):
        return
    for name in os.listdir(directory):
        head = name.split(TMP_SUFFIX)[0].split(DELETING_SUFFIX)[0]
        if (TMP_SUFFIX in name or DELETING_SUFFIX in name) and head.isdigit():
            path = os.path.join(directory, name)
            try:
                shutil.rmtree(path)
            except OSError as e:
                logger.warning("jreplicate: could not delete %s, left by an interrupted "
                               "checkpoint write: %s", path, one_line(e))


def retain(directory: str, steps: Sequence[int], max_to_keep: int | None) -> list[int]:
    """Deletes the oldest of the complete ``steps`` beyond ``max_to_keep`` (the chief,
    after a committed save); damaged or moved-aside steps are not in ``steps`` and are
    never deleted. A deletion that fails is a warning. Returns the steps deleted."""
    if max_to_keep is None:
        return []
    gone = []
    for step in sorted(steps)[:max(0, len(steps) - max_to_keep)]:
        path = os.path.join(directory, str(step))
        try:
            doomed = f"{path}{DELETING_SUFFIX}-{time.time_ns()}"
            os.rename(path, doomed)
            gone.append(step)
            shutil.rmtree(doomed)
        except OSError as e:
            logger.warning("jreplicate: could not delete old checkpoint %s (max_to_keep=%d): "
                           "%s", path, max_to_keep, one_line(e))
    return gone
