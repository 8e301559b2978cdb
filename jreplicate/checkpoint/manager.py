"""Chief-written checkpoints, restored by every process on start (Supervisor's chief duties).

TensorFlow's ``Supervisor`` makes one task, the chief, initialise the model, write
checkpoints and recover from them, while the other tasks wait for the chief's state.
:class:`CheckpointManager` does the same for a :class:`jreplicate.Replicator` job:

* :meth:`CheckpointManager.restore_or_initialize` runs on every process at start-up:
  the chief (process 0) finds the latest **complete** checkpoint and reads it, or, if
  there is none, the state comes from ``init_fn``; either way every process receives
  the chief's state (broadcast through a collective, so other hosts need no access to
  the checkpoint directory) and gets it back placed replicated on the strategy's mesh.
* :meth:`CheckpointManager.save` is called by every process; the chief alone writes,
  with Orbax (``orbax-checkpoint``), and every process returns once the checkpoint is
  complete (or all raise the same error).

A checkpoint is complete when its step directory holds Orbax's ``commit_success.txt``,
which Orbax writes as the last act of a save (before the atomic rename from its
temporary directory). Temporary directories of an interrupted save and step
directories without the marker are never restored; the chief moves the latter aside
(to ``<step>.incomplete-<time>``) so that later saves are not confused by them.

Only real damage moves a complete step aside: metadata that cannot be read, data files
lost, truncated or changed after the save (each array's CRC-32 is saved with it), or
metadata that disagrees with the data. Such a step is moved to
``<step>.damaged-<time>``, with a warning, when an older complete step is restored in
its place; when every step is damaged, restore raises and moves nothing.

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
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate import _wire
from jreplicate._jax_compat import unsupported_orbax
from jreplicate._tree import native
from jreplicate.checkpoint.checks import mismatch, one_line, path_problem, quiet_orbax
from jreplicate.checkpoint.dirlock import LOCK_NAME, DirectoryLock, LockHeldError
from jreplicate.checkpoint.leaves import to_host, zeros_like
from jreplicate.checkpoint.preemption import Preempted, PreemptionWatch
from jreplicate.checkpoint.tree import (
    data_problem,
    logical,
    metadata_problem,
    name_clash,
    normalised,
    read_table,
    read_views,
    save_args,
    state_digest,
    template_leaves,
    unviewed,
)
from jreplicate.checkpoint.writer import (
    BackgroundWriter,
    failure_message,
    remove_debris,
    retain,
    settle,
)
from jreplicate.strategies.base import Strategy

logger = logging.getLogger("jreplicate")

T = TypeVar("T")
#: The file Orbax writes into a step directory as the last act of a save: a step
#: directory without it is incomplete, never restored, and moved aside by the chief.
COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (raised on every process alike).

    Example (the directory cannot be created: its parent is a file):
      >>> import os, tempfile, jreplicate as jr
      >>> parent = os.path.join(tempfile.mkdtemp(), "a_file")
      >>> open(parent, "w").close()
      >>> try:
      ...     jr.CheckpointManager(os.path.join(parent, "ckpt"), jr.MirroredStrategy())
      ... except jr.checkpoint.CheckpointError as e:
      ...     print(str(e).split(": ")[1])
      /tmp/.../a_file is a file, where a directory is needed. Give a directory path that ...
    """


class _Damaged(Exception):
    """A committed checkpoint's files are damaged (the message says how)."""


class CheckpointManager:
    """Checkpoints of replicated training state, written by the chief with Orbax.

    Args:
      directory: where step directories (``<directory>/<step>``) are written. Only the
        chief's file system needs it.
      strategy: the :class:`jreplicate.strategies.Strategy` (or a :class:`jreplicate.Replicator`)
        whose mesh the restored state is placed on, and whose processes agree on every
        decision.
      max_to_keep: the number of most recent checkpoints kept (``None``: all).
      save_interval_steps: :meth:`save` writes only at steps divisible by this (unless
        ``force=True``, or the job is preempted).
      exit_on_preemption: once any process gets SIGTERM (or the platform's preemption
        notice), every process writes the state of the same :meth:`save` call and,
        when True, raises :class:`jreplicate.checkpoint.Preempted` (exit status 42);
        when False, :meth:`reached_preemption` says so and the program decides.

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
        if not isinstance(exit_on_preemption, bool):
            raise TypeError(f"CheckpointManager(exit_on_preemption={exit_on_preemption!r}) "
                            "must be True or False.")
        if not isinstance(enable_async_checkpointing, bool):
            raise TypeError("CheckpointManager(enable_async_checkpointing=...) must be True "
                            f"or False, got {enable_async_checkpointing!r}.")
        self._async = enable_async_checkpointing
        self._writer: BackgroundWriter | None = None
        self._pending: int | None = None  # the step being written, its outcome not agreed
        self._dir = os.path.abspath(os.fspath(directory))
        self._exit_on_preemption = exit_on_preemption
        self._preempted_at: int | None = None
        self._last_written: int | None = None
        self._strategy = strategy
        self._max_to_keep = max_to_keep
        self._interval = save_interval_steps
        self._sharding = NamedSharding(strategy.mesh, P())
        self._devices = set(strategy.mesh.devices.flat)
        self._agreement = strategy.agreement("checkpoint")
        self._preempt = PreemptionWatch(strategy.agreement("preemption"))
        self._orbax = None
        self._lock: DirectoryLock | None = None
        # The chief's failure (no permission, a file in the way, another job's lock) is
        # everybody's, at once: not a ClusterError on the others at their next agreement.
        _, err = self._share(lambda: (None, self._open_directory() if self.is_chief else None),
                             f"opening the checkpoint directory {self._dir}")
        if err:
            self._preempt.close()
            raise CheckpointError(err)

    # -- facts ---------------------------------------------------------------------
    @property
    def directory(self) -> str:
        return self._dir

    @property
    def is_chief(self) -> bool:
        """True on the process that writes checkpoints (worker 0)."""
        return self._strategy.process_index == 0

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
        step, err = self._share(lambda: (self._latest(), None), "the latest checkpoint")
        if err:
            raise CheckpointError(err)
        return step

    # -- restore / initialise ------------------------------------------------------
    def restore_or_initialize(self, init_fn: Callable[[], T]) -> tuple[int, T]:
        """Returns ``(step, state)`` from the latest complete checkpoint, or ``(0, init_fn())``.

        Call it on every process. Every process evaluates ``init_fn`` (a
        parameter-less function returning a pytree of arrays, e.g. parameters and
        optimizer state): for the structure when restoring (traced with
        ``jax.eval_shape`` when possible), for the values when initialising. The chief
        restores or initialises, and its values are broadcast, so every process returns
        the chief's state, placed as ``init_fn`` places it when that is on the
        strategy's devices (state sharded over the ``"model"`` axis stays sharded, a
        logical device's state stays there), else replicated on the strategy's mesh.

        A complete checkpoint whose files are damaged is moved aside with a warning when
        an older one is restored in its place.

        Raises:
          CheckpointError: on every process, when the latest undamaged checkpoint does
            not hold ``init_fn``'s arrays (paths added, removed or renamed; another shape
            or dtype: the message lists both sides, and the files stay where they are;
            empty nodes and one-element wrappers do not count); when every checkpoint is
            damaged (nothing is moved; the message names each and the fix); or when the
            chief cannot move a damaged checkpoint aside.
        """
        if not callable(init_fn):
            raise TypeError(
                "restore_or_initialize(init_fn) needs a parameter-less function returning "
                f"the initial state, got {type(init_fn).__name__}."
            )
        self._settle()
        step, err = self._share(lambda: (self._latest(), None), "the latest checkpoint")
        if err:
            raise CheckpointError(err)
        restored = None
        if step is not None:
            template = _abstract(init_fn)
            what = "restore_or_initialize: init_fn() returned"
            host = to_host(zeros_like(template, what), what)

            def chief_reads():
                nonlocal restored
                if not self.is_chief:
                    return None, None
                try:  # the chief's decision is everybody's: an error too, never a hang
                    found, restored, error = self._read_newest(host)
                except Exception as e:  # broad: any read error is shared, not raised
                    # on the chief alone (the others would hang)
                    return None, (f"reading the checkpoints in {self._dir} failed: "
                                  f"{one_line(e)}")
                return found, error

            # The step actually read: an older one when newer ones turn out damaged.
            step, err = self._share(chief_reads, "reading the latest checkpoint")
            if err:
                raise CheckpointError(err)
        if step is None:
            template = init_fn()
            host = to_host(template, "restore_or_initialize: init_fn() returned")
            restored = host
        self._check_same_state(host)
        state = self._broadcast(restored if self.is_chief else host)
        placed = jax.tree.map(lambda x, t: self._place(x, self._placement(t)),
                              state, template)
        logger.info("jreplicate: %s state at step %d", "restored" if step is not None
                    else "initialised", step or 0)
        return (step or 0), placed

    def _place(self, x: np.ndarray, sharding: Any) -> jax.Array:
        """``x`` on ``sharding``, unchanged. Across processes every process holds the same
        ``x`` (the chief's, broadcast), so each builds its own shards from it: the check
        ``device_put`` makes there (another gather, comparing values) fails on NaN."""
        held = jax.dtypes.canonicalize_dtype(x.dtype)  # init_fn()'s 64-bit NumPy values
        x = x if held == x.dtype else x.astype(held)
        if self._strategy.num_processes == 1:
            return jax.device_put(x, sharding)
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def _placement(self, template_leaf: Any) -> Any:
        """Where a restored leaf goes: where ``init_fn`` put it when that is on the
        strategy's devices (model-sharded state, a logical device), else replicated."""
        sharding = getattr(template_leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and not isinstance(
                template_leaf, jax.core.Tracer) and sharding.mesh.devices.size and set(
                sharding.mesh.devices.flat) <= self._devices:
            return sharding
        return self._sharding

    # -- save ----------------------------------------------------------------------
    def should_save(self, step: int) -> bool:
        """Whether :meth:`save` writes at ``step`` (every ``save_interval_steps``)."""
        return step % self._interval == 0

    def save(self, step: int, state: Any, *, force: bool = False) -> bool:
        """Writes ``state`` as checkpoint ``step`` from the chief; call on every process.

        ``state`` must be replicated (what :meth:`jreplicate.Replicator.run` returns for
        parameters and optimizer state), or a zero-argument function returning it, which
        is called only when this call writes (so a loop may call ``save`` at every step:
        ``mngr.save(step, lambda: (rep.join(), strategy.state())[1])`` joins a
        parameter server's steps only at the steps it saves). Returns once the chief's
        checkpoint is complete, with the same result on every process.

        Call it on every process at every step (or run of steps): that is where a
        preemption is noticed. The call at which the processes agree that the job is
        preempted writes whatever ``save_interval_steps`` says, then (with
        ``exit_on_preemption=True``) closes the manager and raises
        :class:`jreplicate.checkpoint.Preempted`.

        Returns:
          True if a checkpoint was written; False if ``step`` is not a multiple of
          ``save_interval_steps`` (and ``force`` is False).

        Raises:
          ValueError: ``step`` is not an int in ``[0, 2**63 - 1]``, or a leaf of
            ``state`` is not replicated (e.g. a :class:`jreplicate.PerReplica`).
          TypeError: a leaf's dtype cannot be checkpointed (``float0``, strings: the
            message names the leaf and the fix); nothing is written.
          CheckpointError: the chief could not write (raised on every process).
          jreplicate.checkpoint.Preempted: the job is preempted and this call's checkpoint
            is written (every process; ``exit_on_preemption=True``).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not (
                0 <= step <= _wire.MAX_INT64):
            raise ValueError(f"CheckpointManager.save(step={step!r}): step must be an int >= 0 "
                             f"that an int64 holds (at most {_wire.MAX_INT64}).")
        step = int(step)
        preempted = self._preempt.check()
        if preempted and self._preempted_at is None:
            self._preempted_at = step
        if not (force or preempted or self.should_save(step)):
            return False
        if not (preempted and step == self._last_written):
            self._settle()
            state = _evaluated(state)
            host = to_host(state, "CheckpointManager.save(state)", saving=True)
            name_clash(host, "CheckpointManager.save(state)")
            _, err = self._share(
                lambda: (None, self._write(step, host) if self.is_chief else None),
                f"writing checkpoint {step}")
            if err:
                raise CheckpointError(err)
            self._pending = step
            self._last_written = step
            if not self._async:
                self._settle()
        if preempted:
            self._settle()  # the preemption checkpoint is committed before anyone exits
            # The launcher reads this line (jreplicate.cluster.launch).
            sys.stderr.write(f"jreplicate: preempted: every process saved checkpoint {step}"
                             + (f"; exiting with status {Preempted(step).code}\n"
                                if self._exit_on_preemption else "\n"))
            sys.stderr.flush()
            if self._exit_on_preemption:
                self.close()
                raise Preempted(step)
        return True

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was preempted at or before ``step``: True on every process
        from the :meth:`save` call that wrote the preemption checkpoint on (call it
        after ``save(step, ...)``). For ``exit_on_preemption=False``; with True, that
        ``save`` raises :class:`jreplicate.checkpoint.Preempted` instead."""
        return self._preempted_at is not None and step >= self._preempted_at

    def wait_until_finished(self) -> None:
        """Blocks until the checkpoint being written is committed; call on every process.

        Raises:
          CheckpointError: on every process alike, when a process's write failed (the
            message names the process and the error; the step is not restored).
        """
        self._settle()

    def _settle(self) -> None:
        """The outcome exchange of the pending write (every process, same point)."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        outcome = settle(self._writer, self._agreement, step, latest=self._latest,
                         is_chief=self.is_chief)
        if outcome.failure is None:
            if self.is_chief:
                retain(self._dir, self.complete_steps(), self._max_to_keep)
                if self._orbax is not None:
                    self._orbax.reload()
            return
        if self.is_chief:
            remove_debris(self._dir)
        raise CheckpointError(failure_message(step, outcome.failure, outcome.latest))

    def close(self) -> None:
        """Finishes pending writes, releases Orbax's resources and the directory's lock.

        Idempotent. A manager that is dropped, or whose process ends, without ``close()``
        releases the lock too.
        """
        self._preempt.close()
        try:
            self._settle()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self._orbax is not None:
                self._orbax.close()
                self._orbax = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- chief's file work ---------------------------------------------------------
    def _open_directory(self) -> str | None:
        """Creates the directory and takes its lock; returns an error message or None."""
        path = self._dir
        try:
            os.makedirs(path, exist_ok=True)
            self._lock = DirectoryLock(path)
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
        weakref.finalize(self, self._lock.release)
        remove_debris(path)
        timeouts = getattr(self._strategy, "timeouts", None)
        self._writer = BackgroundWriter(
            path, key_prefix=f"jreplicate/checkpoint/{id(self)}",
            processes=[self._strategy.process_index],
            process_index=self._strategy.process_index,
            timeout=timeouts.collective_timeout if timeouts is not None else 1200)
        return None

    def _manager(self):
        if self._orbax is None:
            import orbax.checkpoint as ocp
            self._set_aside_incomplete()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self._max_to_keep, create=False, enable_async_checkpointing=False,
                # Debris of an interrupted save ("<step>.orbax-checkpoint-tmp-*") would
                # later be deleted in place of step <step>, which then outlives max_to_keep.
                cleanup_tmp_directories=True,
                multiprocessing_options=ocp.options.MultiprocessingOptions(
                    primary_host=jax.process_index(), active_processes={jax.process_index()}))
            self._orbax = ocp.CheckpointManager(self._dir, options=options,
                                                item_handlers=ocp.StandardCheckpointHandler())
        return self._orbax

    def _set_aside_incomplete(self) -> None:
        complete = set(self.complete_steps())
        for name in os.listdir(self._dir):
            path = os.path.join(self._dir, name)
            if name.isdigit() and int(name) not in complete and os.path.isdir(path):
                self._set_aside(int(name), "incomplete", f"no {COMMIT_MARKER}")

    def _set_aside(self, step: int, kind: str, why: str) -> None:
        path = os.path.join(self._dir, str(step))
        aside = f"{path}.{kind}-{int(time.time())}"
        logger.warning("jreplicate: checkpoint %s is %s (%s); moved it to %s", path, kind,
                       why, aside)
        os.rename(path, aside)
        if self._orbax is not None:
            self._orbax.reload()  # forget the step, so that it can be written again

    def _latest(self) -> int | None:
        if not self.is_chief:
            return None
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def _read_newest(self, template: Any) -> tuple[int | None, Any, str | None]:
        """``(step, state, error)`` of the newest undamaged checkpoint (step None: none).

        A mismatch with ``template`` is an error at once, whatever older steps hold. The
        damaged steps newer than the one restored are moved aside; when none is restored
        nothing is moved.
        """
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.complete_steps()):
            where = f"checkpoint {step} in {self._dir}"
            try:
                stored, table, views = self._stored(step)
            except _Damaged as e:
                damaged.append((step, str(e)))
                continue
            differs = mismatch(logical(stored, views), template, where)
            if differs:
                return None, None, differs + "".join(
                    f"\n(Newer checkpoint {s} is damaged: {why}.)" for s, why in damaged)
            value, damage = self._read(step, stored, (table, views), template)
            if damage is not None:
                damaged.append((step, damage))
                continue
            for s, why in damaged:
                try:
                    self._set_aside(s, "damaged", why)
                except OSError as e:
                    return None, None, (f"checkpoint {s} in {self._dir} is damaged ({why}) "
                                        f"and cannot be moved aside: {one_line(e)}. Remove "
                                        f"{os.path.join(self._dir, str(s))}.")
            return step, value, None
        if not damaged:
            return None, None, None
        listed = "; ".join(f"{s}: {why}" for s, why in damaged[:5]) + (
            f"; and {len(damaged) - 5} more" if len(damaged) > 5 else "")
        return None, None, (
            f"every checkpoint in {self._dir} is damaged ({listed}). Nothing was moved and "
            "training does not restart from step 0 on its own: restore the files from a "
            f"copy, or move the step directories out of {self._dir} to start from "
            "init_fn() at step 0.")

    def _stored(self, step: int) -> tuple[Any, dict | None, dict]:
        """The checkpoint's tree of array metadata (shapes and dtypes, as stored), its
        checksum table (None for a checkpoint saved without one) and its record of
        arrays stored as their bits (see :mod:`jreplicate.checkpoint.dtypes`), read
        quietly.

        Raises:
          _Damaged: the metadata cannot be read, or disagrees with what was saved.
        """
        try:
            with quiet_orbax():
                metadata = _item_handler().metadata(_item_dir(self._dir, step))
            tree = getattr(metadata, "tree", metadata)
            if tree is None:
                raise _Damaged("no metadata")
            custom = getattr(metadata, "custom_metadata", None)
            table, views = read_table(custom), read_views(custom)
            logical(tree, views)  # raises ValueError when the record disagrees
        except (_Damaged, MemoryError):  # no memory: not the checkpoint's fault
            raise
        except Exception as e:  # broad: whatever the damaged files make the reader
            # raise, the checkpoint is named damaged (and kept)
            raise _Damaged(f"its files cannot be read: {one_line(e)}") from None
        problem = metadata_problem(tree, table)
        if problem:
            raise _Damaged(problem)
        return tree, table, views

    def _read(self, step: int, stored: Any, records: tuple[dict | None, dict],
              template: Any) -> tuple[Any, str | None]:
        """``(state in template's structure, None)``, or ``(None, what is damaged)``.

        The data is read in the structure and dtypes it was saved in (so that only
        damage can make the read fail), checked against its metadata and checksums
        (``records``: the checksum table and the arrays stored as bits), the arrays
        stored as bits viewed back as their dtypes, then placed in ``template``'s
        structure by the rule of :mod:`jreplicate.checkpoint.tree`.
        """
        table, views = records
        import orbax.checkpoint as ocp
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), stored)
        try:
            with quiet_orbax():
                value = _item_handler().restore(_item_dir(self._dir, step),
                                                args=ocp.args.StandardRestore(target))
        except MemoryError:
            raise
        except Exception as e:  # the data of a committed checkpoint is damaged
            return None, one_line(e)
        damage = data_problem(value, stored, table)
        if damage:
            return None, damage
        arrays = normalised(unviewed(value, stored, views))
        leaves = [None] * jax.tree.structure(template).num_leaves
        for norm, (_, i) in template_leaves(template).items():
            leaves[i] = np.asarray(arrays[norm][1])
        # Orbax restores containers as plain lists/dicts: rebuild the template's types.
        return jax.tree.unflatten(jax.tree.structure(template), leaves), None

    def _write(self, step: int, host: Any) -> str | None:
        try:
            mngr = self._manager()
            steps = mngr.all_steps()
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
            self._writer.start(step, save_args(host))
        except OSError as e:  # reported to every process
            return f"could not write checkpoint {step}: " + path_problem(self._dir, e)
        except Exception as e:  # reported to every process
            return f"could not write checkpoint {step} to {self._dir} ({one_line(e)})"
        return None

    # -- agreement -----------------------------------------------------------------
    def _share(self, chief_fn: Callable[[], tuple[Any, str | None]], what: str):
        """Runs ``chief_fn`` on the chief and gives its ``(value, error)`` to everyone."""
        value, err = chief_fn()
        if self._agreement is None:
            return value, err
        mine = {"value": value, "error": err} if self.is_chief else \
            {"value": None, "error": None}
        chief = self._agreement.exchange(mine, what, _wire.CHIEF_RESULT)[0]
        return chief["value"], chief["error"]

    def _check_same_state(self, host: Any) -> None:
        """Raises on every process alike when init_fn() builds another structure, shape
        or dtype on some process (the broadcast would otherwise hang or fail on one)."""
        if self._agreement is None:
            return
        digests = self._agreement.all_gather(state_digest(host).encode(),
                                             "init_fn()'s state")
        others = [p for p, d in enumerate(digests) if d != digests[0]]
        if others:
            raise CheckpointError(
                f"restore_or_initialize: init_fn() builds another state on process "
                f"{others[0]} than on process 0 (other paths, shapes or dtypes); every "
                "process must build the same state (the same model and optimizer).")

    def _broadcast(self, host: Any) -> Any:
        if self._strategy.num_processes == 1:
            return host
        from jax.experimental import multihost_utils
        leaves, treedef = jax.tree.flatten(host)
        # As bytes: the broadcast sums the chief's values with the others' zeros, which
        # would turn -0.0 into +0.0 (and may change a NaN's payload); bytes sum exactly.
        raw = [np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves]
        raw = multihost_utils.broadcast_one_to_all(raw)
        return jax.tree.unflatten(treedef, [
            np.asarray(r, np.uint8).view(x.dtype).reshape(np.shape(x))
            for r, x in zip(raw, leaves, strict=True)])


def _item_dir(directory: str, step: int) -> Any:
    """Where step ``step``'s arrays are: ``<step>/default`` (written by
    ``ocp.CheckpointManager``) or ``<step>``."""
    from etils import epath
    step_dir = epath.Path(directory) / str(step)
    legacy = step_dir / "default"
    return legacy if legacy.is_dir() else step_dir


def _item_handler() -> Any:
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointHandler()  # reads only


def _abstract(init_fn: Callable[[], Any]) -> Any:
    try:
        return jax.eval_shape(init_fn)
    except Exception:  # not traceable (e.g. numpy code): evaluate it
        return jax.tree.map(_as_held, init_fn())


def _as_held(x: Any) -> Any:
    """A host leaf as JAX holds it (the dtypes ``jax.eval_shape`` gives, those the state
    ``init_fn`` initialises is placed with: a NumPy float64 is float32 with x64 off)."""
    if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
        a = np.asarray(x)
        return jax.ShapeDtypeStruct(a.shape, jax.dtypes.canonicalize_dtype(native(a.dtype)))
    return x


def _evaluated(state: Any) -> Any:
    """``state()`` when ``state`` is a zero-argument function (a callable pytree leaf:
    never a pytree such as an NNX module with a ``__call__``), else ``state``."""
    if callable(state) and jax.tree_util.treedef_is_leaf(jax.tree.structure(state)):
        return state()
    return state
