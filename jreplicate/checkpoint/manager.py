"""Checkpoints written by every process that holds state, restored onto any topology
(Supervisor's chief duties, at pod scale).

TensorFlow's ``Supervisor`` makes one task, the chief, initialise the model, write
checkpoints and recover from them. :class:`CheckpointManager` keeps the chief's
decisions (which step to restore, what is damaged, what to delete) and lets every
process write and read the shards it holds:

* :meth:`CheckpointManager.restore_or_initialize` runs on every process at start-up. The
  chief finds the complete checkpoints; every process reads the shards of the newest
  undamaged one that its target shardings (``shardings=``, see
  :mod:`jreplicate.checkpoint.targets`) give it, on this topology, whatever topology
  wrote it; or, if there is none, the state comes from ``init_fn``.
* :meth:`CheckpointManager.save` is called by every process. When every process sees
  the directory (a shared file system; a URL is refused), every process writes its own shards
  (Orbax multi-host: ``ocdbt.process_<i>/``), and no process ever holds a whole array
  sharded across processes. Otherwise the chief alone writes replicated (or fully
  addressable) state, as before, and state sharded across processes is refused.

Every process sees the directory when each reads, in ``<directory>/jreplicate.lock``,
the record the chief wrote there at construction (compared through the agreement): that
also proves the lock is this job's, so one-job-per-directory covers every process.

The checkpoint format (2; format 1, written by jreplicate before, restores through the
chief as before): Orbax's ``StandardCheckpointHandler`` data in ``<step>/default``, and
in its custom metadata each array's path, stored dtype, shape and a 64-bit digest of
its bits, for the whole array and for each distinct device shard (its *box*); see
:mod:`jreplicate.checkpoint.digest`. The digest does not depend on the sharding, so a
checkpoint written from 2 processes x 4 devices is checked when read onto 1 device.

A checkpoint is complete when its step directory holds Orbax's ``commit_success.txt``,
which Orbax writes as the last act of a save (before the atomic rename from its
temporary directory). Temporary directories of an interrupted save are deleted and step
directories without the marker are never restored; the chief moves the latter aside
(to ``<step>.incomplete-<time>``) so that later saves are not confused by them.

Only real damage moves a complete step aside: metadata that cannot be read, data files
lost, truncated or changed after the save (each array's digest is saved with it), or
metadata that disagrees with the data. Every process agrees on the damage (each reports
its read's outcome; the digests are computed as replicated values). Such a step is
moved to ``<step>.damaged-<time>``, with a warning, when an older complete step is
restored in its place; when every step is damaged, restore raises and moves nothing.

A checkpoint is restored only into a state with the same arrays (the same paths, shapes
and dtypes) as ``init_fn``'s, where empty nodes (``None``, ``{}``, ``optax.EmptyState``)
and one-element tuples (``optax.chain(tx)``'s state) do not count: adam's state restores
into adamw's. Any other difference is a :class:`CheckpointError` that lists what differs
on both sides and leaves the files where they are; never a silent cast, never a silent
restart at step 0. :mod:`jreplicate.checkpoint.tree` gives the rule and why it is safe.

One directory, one job: the chief holds ``<directory>/jreplicate.lock`` (see
:mod:`jreplicate.checkpoint.dirlock`) from construction to
:meth:`CheckpointManager.close`, so a second manager on the directory (two jobs started
by mistake) fails instead of overwriting the first one's steps. The lock dies with its
process, so a crashed job's restart takes it over.

Two seams (for the background writer and the preemption hook):

* ``self._writer``, a writer: ``start(step, tree, metadata)`` begins writing ``tree``
  (global jax.Arrays and NumPy leaves, as stored) as step ``step`` with Orbax custom
  metadata ``metadata``, on every process that writes; ``poll() -> bool`` is True once
  that write has ended (committed or failed) and never blocks; ``wait(deadline) -> str |
  None`` blocks until it has ended or ``time.monotonic()`` passes ``deadline`` (None: no
  bound) and returns None once committed, else the error's text; ``close()``.
  :class:`jreplicate.checkpoint.writer.BackgroundWriter` writes in the background
  (:meth:`CheckpointManager.save` returns once the device-to-host copies are taken).
  The manager agrees on every process's outcome at the next ``save``,
  ``wait_until_finished``, ``close`` or ``restore_or_initialize`` (at once with
  ``enable_async_checkpointing=False``) and raises the same error on every process.
* ``self._preempt``: ``check(call) -> bool``, called once at the start of every
  :meth:`CheckpointManager.save` with the manager's own count of ``save`` calls (0, 1,
  2, ..., the same on every process; never the user's step), True when every process
  saves at this call because a process is being preempted; ``close()``.
  :class:`_NoPreemption` never is (until the directory is open);
  :class:`jreplicate.checkpoint.preemption.PreemptionWatch` watches SIGTERM and JAX's
  preemption notice (it numbers JAX's sync points process-wide, across managers).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate import _wire
from jreplicate._jax_compat import unsupported_orbax
from jreplicate.checkpoint import agreement, chief_files, recover
from jreplicate.checkpoint.chief_files import COMMIT_MARKER
from jreplicate.checkpoint.digest import digest_array
from jreplicate.checkpoint.dirlock import LOCK_NAME, DirectoryLock
from jreplicate.checkpoint.dtypes import as_stored
from jreplicate.checkpoint.errors import CheckpointError
from jreplicate.checkpoint.leaves import (
    sharded_across_processes,
    to_host,
    to_saved,
)
from jreplicate.checkpoint.preemption import Preempted, PreemptionWatch
from jreplicate.checkpoint.targets import resolve
from jreplicate.checkpoint.tree import (
    name_clash,
    table_v2,
    view_rows,
)
from jreplicate.checkpoint.writer import (
    BackgroundWriter,
    failure_message,
    remove_debris,
    retain,
    settle,
    wait_for_writes,
)
from jreplicate.strategies.base import Strategy

logger = logging.getLogger("jreplicate")

T = TypeVar("T")


class _NoPreemption:
    """The preemption seam when nothing watches for preemption: never preempted."""

    def check(self, call: int) -> bool:
        del call
        return False

    def close(self) -> None:
        pass


class CheckpointManager:
    """Checkpoints of training state, written with Orbax by the processes holding it.

    Args:
      directory: where step directories (``<directory>/<step>``) are written. Every
        process should see it (a shared file system; not a URL) for state sharded across
        processes; replicated state needs only the chief's.
      strategy: the :class:`jreplicate.strategies.Strategy` (or a :class:`jreplicate.Replicator`)
        whose mesh the restored state is placed on, and whose processes agree on every
        decision.
      max_to_keep: the number of most recent checkpoints kept (``None``: all).
      save_interval_steps: :meth:`save` writes only at steps divisible by this (unless
        ``force=True``, or the job is preempted).
      enable_async_checkpointing: write in the background (Orbax's name): :meth:`save`
        returns once the device-to-host copies are taken, and a failed write is raised
        at the next call (see :meth:`save`). False: :meth:`save` returns once the
        checkpoint is committed.
      exit_on_preemption: once any process gets SIGTERM (or the platform's preemption
        notice), every process writes the state of the same :meth:`save` call, waits
        until it is committed and, when True, raises
        :class:`jreplicate.checkpoint.Preempted` (exit status 42); when False,
        :meth:`reached_preemption` says so and the program decides.

    Raises:
      CheckpointError: on every process, when the chief cannot create or write
        ``directory`` (the message names the path), or another manager (another job, or
        an unclosed manager of this process) holds the directory's lock.

    Example (state saved, then restored by a new manager, as after a restart):
      >>> import tempfile, jax.numpy as jnp, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy())
      >>> directory = tempfile.mkdtemp()
      >>> mngr = jr.CheckpointManager(directory, rep)
      >>> mngr.restore_or_initialize(lambda: {"w": jnp.zeros(2)})[0]  # nothing saved: 0
      0
      >>> mngr.save(3, {"w": jnp.ones(2)}, force=True)
      True
      >>> mngr.close()
      >>> mngr = jr.CheckpointManager(directory, rep)
      >>> step, state = mngr.restore_or_initialize(lambda: {"w": jnp.zeros(2)})
      >>> step, state["w"].tolist()
      (3, [1.0, 1.0])
      >>> mngr.close()

    A training loop (every process runs this; see ``tests/mp_scripts/train.py``)::

        mngr = CheckpointManager("/tmp/ckpt", rep, save_interval_steps=100)
        step, (params, opt) = mngr.restore_or_initialize(
            lambda: (init_params(key), tx.init(init_params(key))))
        inputs = rep.prepare_input(input_fn_starting_at(step))
        while step < num_steps:
            params, opt, loss = rep.run(train_step, inputs, params, opt)
            step += 1
            mngr.save(step, (params, opt))
        mngr.close()
    """

    def __init__(self, directory: str | os.PathLike, strategy: Any, *,
                 max_to_keep: int | None = 3, save_interval_steps: int = 1,
                 enable_async_checkpointing: bool = True, exit_on_preemption: bool = True):
        why = unsupported_orbax()
        if why is not None:
            raise ImportError(why)
        strategy = getattr(strategy, "strategy", strategy)  # a Replicator works too
        if not isinstance(strategy, Strategy):
            raise TypeError(
                "CheckpointManager(directory, strategy): strategy must be a jreplicate "
                f"Strategy or Replicator, got {type(strategy).__name__}."
            )
        if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
            raise TypeError(
                f"CheckpointManager(directory=...) must be a path, got {directory!r}."
            )
        chief_files.refuse_url(os.fspath(directory))
        if max_to_keep is not None and (isinstance(max_to_keep, bool)
                                        or not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(
                f"CheckpointManager(max_to_keep={max_to_keep!r}) must be an int >= 1, or None "
                "to keep every checkpoint."
            )
        if isinstance(save_interval_steps, bool) or not isinstance(save_interval_steps, int) \
                or save_interval_steps < 1:
            raise ValueError(
                f"CheckpointManager(save_interval_steps={save_interval_steps!r}) must be an "
                "int >= 1."
            )
        for name, flag in (("enable_async_checkpointing", enable_async_checkpointing),
                           ("exit_on_preemption", exit_on_preemption)):
            if not isinstance(flag, bool):
                raise TypeError(f"CheckpointManager({name}={flag!r}) must be True or False.")
        self._dir = os.path.abspath(os.fspath(directory))
        self._strategy = strategy
        self._max_to_keep = max_to_keep
        self._interval = save_interval_steps
        self._async = enable_async_checkpointing
        self._exit_on_preemption = exit_on_preemption
        self._sharding = NamedSharding(strategy.mesh, P())
        self._agreement = strategy.agreement("checkpoint")
        self._lock: DirectoryLock | None = None
        self._writer: Any = None
        self._pending: int | None = None  # the step written, its outcome not yet agreed
        self._preempt: Any = _NoPreemption()
        self._calls = 0  # save() calls: the preemption seam's counter
        self._preempted = False
        self._tidied = False
        wait_for_writes(self._dir)  # of a manager dropped without close()
        # The chief's failure (no permission, a file in the way, another job's lock) is
        # everybody's, at once: not a ClusterError on the others at their next agreement.
        _, err = agreement.share(
            self, lambda: (None, chief_files.open_directory(self) if self.is_chief else None),
            f"opening the checkpoint directory {self._dir}")
        if err:
            raise CheckpointError(err)
        self._unseen = chief_files.who_cannot_see(self)
        self._shared = self._unseen is None
        timeouts = getattr(strategy, "timeouts", None)
        self._writer = BackgroundWriter(
            self._dir, every_process=self._shared, num_processes=strategy.num_processes,
            process_index=strategy.process_index,
            key_prefix=getattr(self._agreement, "prefix", f"jreplicate/ckpt/{id(self)}"),
            timeout=timeouts.collective_timeout if timeouts is not None else 1200)
        self._preempt = PreemptionWatch(strategy.agreement("preemption"))
        self._last_written: int | None = None

    # -- facts ---------------------------------------------------------------------
    @property
    def directory(self) -> str:
        return self._dir

    @property
    def is_chief(self) -> bool:
        """True on the process that decides (worker 0)."""
        return self._strategy.process_index == 0

    @property
    def every_process_writes(self) -> bool:
        """Whether every process writes its own shards (every process sees the
        directory); False: the chief alone writes, replicated state only."""
        return self._shared

    def complete_steps(self) -> list[int]:
        """The steps with a complete checkpoint, as this process sees the directory."""
        if not os.path.isdir(self._dir):
            return []
        steps = []
        for name in os.listdir(self._dir):
            if name.isdigit() and os.path.isfile(os.path.join(self._dir, name, COMMIT_MARKER)):
                steps.append(int(name))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The chief's latest complete step, agreed by every process (None: none yet)."""
        step, err = agreement.share(self, lambda: (self._latest(), None), "the latest checkpoint")
        if err:
            raise CheckpointError(err)
        return step

    def reached_preemption(self, step: int) -> bool:
        """Whether the job is preempted: True on every process from the :meth:`save`
        call that wrote the preemption checkpoint on (call it after ``save``). For
        ``exit_on_preemption=False``; with True, that ``save`` raises
        :class:`jreplicate.checkpoint.Preempted` instead. ``step`` is the caller's, for
        Orbax's signature."""
        del step
        return self._preempted

    # -- restore / initialise ------------------------------------------------------
    def restore_or_initialize(self, init_fn: Callable[[], T], *,
                              shardings: Any = None) -> tuple[int, T]:
        """Returns ``(step, state)`` from the latest complete checkpoint, or ``(0, init_fn())``.

        Call it on every process. Every process evaluates ``init_fn`` (a
        parameter-less function returning a pytree of arrays, e.g. parameters and
        optimizer state): for the structure when restoring (traced with
        ``jax.eval_shape`` when possible), for the values when initialising. Each leaf
        is placed on its target sharding: ``shardings`` where given, else as
        ``init_fn`` places it when that is on the strategy's devices (state sharded over
        the ``"model"`` axis stays sharded, a logical device's state stays there), else
        replicated on the strategy's mesh (:mod:`jreplicate.checkpoint.targets`).

        Args:
          init_fn: builds the initial state.
          shardings: a pytree of ``jax.sharding.Sharding`` (or of
            ``jax.ShapeDtypeStruct`` with shardings; ``None`` for the default) in
            ``init_fn()``'s structure, or a prefix of it: where each leaf goes on this
            topology. Needed for state sharded over the replicas, whose sharding
            ``jax.eval_shape`` drops (e.g. ``rep.state_shardings(step, ...)``).

        A complete checkpoint whose files are damaged is moved aside with a warning when
        an older one is restored in its place.

        Raises:
          CheckpointError: on every process, when the latest undamaged checkpoint does
            not hold ``init_fn``'s arrays (paths added, removed or renamed; another shape
            or dtype: the message lists both sides, and the files stay where they are;
            empty nodes and one-element wrappers do not count); when every checkpoint is
            damaged (nothing is moved; the message names each and the fix); when a later
            jreplicate wrote it; or when the chief cannot move a damaged checkpoint aside.
          ValueError: a target sharding does not divide its leaf (the message names it).
        """
        if not callable(init_fn):
            raise TypeError(
                "restore_or_initialize(init_fn) needs a parameter-less function returning "
                f"the initial state, got {type(init_fn).__name__}."
            )
        self._settle()
        steps, err = chief_files.share_steps(self)
        if err:
            raise CheckpointError(err)
        if steps:
            what = "restore_or_initialize: init_fn() returned"
            template = recover.abstract(init_fn)
            abstract = recover.abstract_leaves(template, what)
            agreement.check_same_state(self, abstract)
            targets = resolve(template, shardings, self._strategy.mesh)
            step, state = recover.restore_newest(self, steps, abstract, targets)
            logger.info("jreplicate: restored state at step %d", step)
            return step, state
        return 0, recover.initialise(self, init_fn(), shardings)

    # -- save ----------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` writes at ``step`` (every ``save_interval_steps``)."""
        return step % self._interval == 0

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Writes ``state`` as checkpoint ``step``; call on every process, at every step.

        Every process writes the shards it holds (when every process sees the
        directory; else the chief writes, and ``state`` must be replicated or held by
        one process). With ``enable_async_checkpointing`` (the default) it returns once
        the device-to-host copies are taken: the state may then be donated or changed,
        and the files are written in the background. The step is listed
        (:meth:`complete_steps`, :meth:`latest_step`) once committed; a write that
        fails on any process is raised as the same :class:`.CheckpointError` on every
        process at the next :meth:`save`, :meth:`wait_until_finished`, :meth:`close` or
        :meth:`restore_or_initialize`, and that step is never restored. Without it,
        it returns once the checkpoint is complete. Costs nothing when it does not
        write.

        Args:
          step: the step's number (the K-step counter in device loops).
          state: a pytree of arrays, or a parameter-less function returning one,
            called only when this call writes.
          force: write whatever ``save_interval_steps`` says.

        Returns:
          True if a checkpoint was written; False if ``step`` is not a multiple of
          ``save_interval_steps`` (and ``force`` is False).

        Raises:
          ValueError: ``step`` is not an int in ``[0, 2**63 - 1]``, or a leaf of
            ``state`` cannot be saved (e.g. a :class:`jreplicate.PerReplica`, a donated
            array).
          TypeError: a leaf's dtype cannot be checkpointed (``float0``, strings: the
            message names the leaf and the fix); nothing is written.
          CheckpointError: a process could not write this checkpoint (blocking saves)
            or the previous one (background saves; raised on every process), or state
            sharded across processes while not every process sees the directory.
          jreplicate.checkpoint.Preempted: the job is preempted and this call's checkpoint
            is committed (every process; ``exit_on_preemption=True``): see
            docs/guides/multi_process.md, "Preemption".
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not (
                0 <= step <= _wire.MAX_INT64):
            raise ValueError(f"CheckpointManager.save(step={step!r}): step must be an int >= 0 "
                             f"that an int64 holds (at most {_wire.MAX_INT64}).")
        step = int(step)
        call, self._calls = self._calls, self._calls + 1
        preempted = self._preempt.check(call)
        self._preempted = self._preempted or preempted
        if not (force or preempted or self.should_save(step)):
            return False
        if not (preempted and step == self._last_written):  # not written twice
            self._settle()
            if _is_thunk(state):
                state = state()
            if jax.tree_util.treedef_is_leaf(jax.tree.structure(state)) and state is not None:
                # Orbax's StandardSave takes no bare array; a one-element tuple around it
                # does not count when matched with init_fn()'s state (tree.py's rule).
                state = (state,)
            what = "CheckpointManager.save(state)"
            if self._shared:
                self._save_everywhere(step, state, what)
            else:
                self._save_on_chief(step, state, what)
            self._last_written = step
        if preempted:
            self._stop(step)
        return True

    def _stop(self, step: int) -> None:
        """After the preemption checkpoint ``step`` is written: waits for its commit,
        says so (the launcher reads the line), and with ``exit_on_preemption`` closes
        the manager and raises :class:`Preempted` (every process alike)."""
        self.wait_until_finished()
        sys.stderr.write(f"jreplicate: preempted: every process saved checkpoint {step}"
                         + (f"; exiting with status {Preempted(step).code}\n"
                            if self._exit_on_preemption else "\n"))
        sys.stderr.flush()
        if self._exit_on_preemption:
            self.close()
            raise Preempted(step)

    def _save_everywhere(self, step: int, state: Any, what: str) -> None:
        tree = to_saved(state, what)
        name_clash(tree, what)
        stored = jax.tree.map(lambda x: x if isinstance(x, jax.Array) else as_stored(x), tree)
        metadata = self._table(stored, tree)  # every process: the same table
        self._write(step, stored, metadata)

    def _save_on_chief(self, step: int, state: Any, what: str) -> None:
        spanning = sharded_across_processes(state)
        if spanning:
            where, sharding = spanning[0]
            p, detail = self._unseen
            raise CheckpointError(
                f"process {p} cannot see {os.path.join(self._dir, LOCK_NAME)} written by "
                f"process 0 ({detail}): state sharded across processes ({where}, "
                f"{getattr(sharding, 'spec', sharding)}) is written by every process into "
                "one directory; give a directory every process can write (NFS, GCS), or "
                "save replicated state.")
        host = to_host(state, what, saving=True)
        name_clash(host, what)
        stored = jax.tree.map(as_stored, host)
        metadata = self._table(stored, host) if self.is_chief else {}
        self._write(step, stored, metadata)

    def _table(self, stored: Any, state: Any) -> dict:
        import orbax.checkpoint as ocp
        serial = ocp.tree.serialize_tree(stored, keep_empty_nodes=True)
        return table_v2(serial, [digest_array(x) for x in jax.tree.leaves(serial)],
                        view_rows(state))

    def _write(self, step: int, stored: Any, metadata: dict) -> None:
        """Starts the write through the writer seam on every process that writes; its
        outcome is agreed now (blocking saves, preemption) or at the next call."""
        _, err = agreement.share(
            self, lambda: (None, self._new_step_problem(step) if self.is_chief else None),
            f"writing checkpoint {step}")
        if err:
            raise CheckpointError(err)
        if self._shared or self.is_chief:
            self._writer.start(step, stored, metadata)
        self._pending = step
        if not self._async or self._preempted:
            self._settle()

    def _settle(self) -> None:
        """The outcome exchange of the pending write, on every process at the same
        call: wait for it (bounded), agree, then the chief applies ``max_to_keep``; or
        every process raises the same error."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        writes = self._writer is not None and (self._shared or self.is_chief)
        outcome = settle(self._writer if writes else None, self._agreement, step,
                         latest=self._latest, is_chief=self.is_chief)
        if outcome.failure is not None:
            if self.is_chief:  # every process's write has ended: delete its files
                remove_debris(self._dir)
            raise CheckpointError(failure_message(step, outcome.failure, outcome.latest))
        if self.is_chief:
            self._retain()

    def _new_step_problem(self, step: int) -> str | None:
        chief_files.tidy(self)
        steps = self.complete_steps()
        if step in steps:
            return (f"checkpoint {step} already exists in {self._dir}; save each step "
                    "once, or restore it with restore_or_initialize before training on.")
        if steps and step < max(steps):
            # Restore takes the newest step, so this one would never be restored, and
            # max_to_keep would delete older checkpoints for it.
            return (f"checkpoint {step} is older than checkpoint {max(steps)} in "
                    f"{self._dir}, which restore_or_initialize would restore instead of "
                    "it. Count steps on from the step restore_or_initialize returns, or "
                    "give a new directory to start a new run.")
        return None

    def _retain(self) -> None:
        """Deletes the oldest complete steps beyond ``max_to_keep`` (a warning if it
        cannot: never an error, nothing else is deleted)."""
        retain(self._dir, self.complete_steps(), self._max_to_keep)

    def wait_until_finished(self) -> None:
        """Blocks until the last save is committed; call it on every process.

        Raises:
          CheckpointError: on every process alike, when a process's write of the last
            save failed (the message names the process and its error; that step is
            incomplete and never restored). Each failure is raised once.
        """
        self._settle()

    def close(self) -> None:
        """Finishes pending writes, releases Orbax's resources and the directory's lock.

        Idempotent. A manager that is dropped, or whose process ends, without ``close()``
        releases the lock too, but a write still in flight when the program ends fails
        (Python starts no threads at exit, and Orbax's commit needs one): close the
        manager (or use ``with``) before the program ends. A new manager on the
        directory waits for this process's writes of a dropped one.

        Raises:
          CheckpointError: on every process alike, when the last write failed on a
            process (the resources and the lock are released first).
        """
        try:
            self._settle()  # the last write's failure, raised after what follows
        finally:
            try:
                if self._writer is not None:
                    self._writer.close()
                    self._writer = None
                self._preempt.close()
            finally:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _latest(self) -> int | None:
        if not self.is_chief:
            return None
        steps = self.complete_steps()
        return steps[-1] if steps else None


def _is_thunk(state: Any) -> bool:
    """Whether ``state`` is a parameter-less function to call (not a pytree: an
    equinox module is callable, but a pytree with leaves of its own)."""
    if not callable(state):
        return False
    leaves = jax.tree.leaves(state)
    return len(leaves) == 1 and leaves[0] is state
