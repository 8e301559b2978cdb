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
(to ``<step>.incomplete``) so that later saves are not confused by them.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate._tree import path_str
from jreplicate.context import PerReplica
from jreplicate.strategies.base import Strategy

logger = logging.getLogger("jreplicate")

T = TypeVar("T")
COMMIT_MARKER = "commit_success.txt"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read (raised on every process alike)."""


class CheckpointManager:
    """Checkpoints of replicated training state, written by the chief with Orbax.

    Args:
      directory: where step directories (``<directory>/<step>``) are written. Only the
        chief's file system needs it.
      strategy: the :class:`jreplicate.Strategy` (or a :class:`jreplicate.Replicator`)
        whose mesh the restored state is placed on, and whose processes agree on every
        decision.
      max_to_keep: the number of most recent checkpoints kept (``None``: all).
      save_interval_steps: :meth:`save` writes only at steps divisible by this (unless
        ``force=True``).

    Example (every process runs this; see ``tests/mp_scripts/train.py``)::

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
                 max_to_keep: int | None = 3, save_interval_steps: int = 1):
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
        self._dir = os.path.abspath(os.fspath(directory))
        self._strategy = strategy
        self._max_to_keep = max_to_keep
        self._interval = save_interval_steps
        self._sharding = NamedSharding(strategy.mesh, P())
        self._devices = set(strategy.mesh.devices.flat)
        self._agreement = strategy.agreement("checkpoint")
        self._orbax = None
        if self.is_chief:
            os.makedirs(self._dir, exist_ok=True)

    # -- facts ---------------------------------------------------------------------
    @property
    def directory(self) -> str:
        return self._dir

    @property
    def is_chief(self) -> bool:
        """True on the process that writes checkpoints (worker 0)."""
        return self._strategy.worker_index == 0

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

        Raises:
          CheckpointError: the chief could not read the checkpoint (on every process).
        """
        if not callable(init_fn):
            raise TypeError(
                "restore_or_initialize(init_fn) needs a parameter-less function returning "
                f"the initial state, got {type(init_fn).__name__}."
            )
        step, err = self._share(lambda: (self._latest(), None), "the latest checkpoint")
        if err:
            raise CheckpointError(err)
        if step is None:
            template = init_fn()
            host = _to_host(template, "restore_or_initialize: init_fn() returned")
            restored = host
        else:
            template = _abstract(init_fn)
            host = _to_host(_zeros_like(template), "restore_or_initialize: init_fn() returned")
            restored = None
            if self.is_chief:
                restored, err = self._read(step, host)
            _, err = self._share(lambda: (None, err), f"reading checkpoint {step}")
            if err:
                raise CheckpointError(err)
        state = self._broadcast(restored if self.is_chief else host)
        placed = jax.tree.map(lambda x, t: jax.device_put(x, self._placement(t)),
                              state, template)
        logger.info("jreplicate: %s state at step %d", "restored" if step is not None
                    else "initialised", step or 0)
        return (step or 0), placed

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
        parameters and optimizer state). Returns once the chief's checkpoint is
        complete, with the same result on every process.

        Returns:
          True if a checkpoint was written; False if ``step`` is not a multiple of
          ``save_interval_steps`` (and ``force`` is False).

        Raises:
          ValueError: ``step`` is not a non-negative int, or a leaf of ``state`` is not
            replicated (e.g. a :class:`jreplicate.PerReplica`).
          CheckpointError: the chief could not write (raised on every process).
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"CheckpointManager.save(step={step!r}): step must be an int >= 0.")
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        host = _to_host(state, "CheckpointManager.save(state)")
        _, err = self._share(lambda: (None, self._write(step, host) if self.is_chief else None),
                             f"writing checkpoint {step}")
        if err:
            raise CheckpointError(err)
        return True

    def close(self) -> None:
        """Finishes pending writes and releases Orbax's resources."""
        if self._orbax is not None:
            self._orbax.wait_until_finished()
            self._orbax.close()
            self._orbax = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- chief's file work ---------------------------------------------------------
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
            self._orbax = ocp.CheckpointManager(self._dir, options=options)
        return self._orbax

    def _set_aside_incomplete(self) -> None:
        complete = set(self.complete_steps())
        for name in os.listdir(self._dir):
            path = os.path.join(self._dir, name)
            if name.isdigit() and int(name) not in complete and os.path.isdir(path):
                aside = f"{path}.incomplete-{int(time.time())}"
                logger.warning("jreplicate: checkpoint %s is incomplete (no %s); moved it to %s",
                               path, COMMIT_MARKER, aside)
                os.rename(path, aside)

    def _latest(self) -> int | None:
        if not self.is_chief:
            return None
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def _read(self, step: int, template: Any) -> tuple[Any, str | None]:
        import orbax.checkpoint as ocp
        try:
            value = self._manager().restore(step, args=ocp.args.StandardRestore(template))
        except Exception as e:  # reported to every process
            return None, (f"could not restore checkpoint {step} from {self._dir} "
                          f"({type(e).__name__}: {e}). If the state's structure changed, start "
                          "from a new directory; else remove the damaged step directory.")
        leaves = jax.tree.leaves(value)
        treedef = jax.tree.structure(template)
        if len(leaves) != treedef.num_leaves:
            return None, (f"checkpoint {step} in {self._dir} holds {len(leaves)} arrays but "
                          f"init_fn()'s state has {treedef.num_leaves}; start from a new "
                          "directory if the state's structure changed.")
        paths = [path_str(p) or "the root" for p, _ in jax.tree_util.tree_leaves_with_path(
            template)]
        for path, got, want in zip(paths, leaves, jax.tree.leaves(template), strict=True):
            if np.shape(got) != np.shape(want):  # the other processes expect init_fn's shape
                return None, (f"checkpoint {step} in {self._dir} holds {path} with shape "
                              f"{np.shape(got)} but init_fn() gives shape {np.shape(want)}; "
                              "start from a new directory if the state's shapes changed.")
        # Orbax restores containers as plain tuples/dicts: rebuild the template's types.
        return jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves]), None

    def _write(self, step: int, host: Any) -> str | None:
        import orbax.checkpoint as ocp
        try:
            mngr = self._manager()
            if step in mngr.all_steps():
                return (f"checkpoint {step} already exists in {self._dir}; save each step "
                        "once, or restore it with restore_or_initialize before training on.")
            mngr.save(step, args=ocp.args.StandardSave(host), force=True)
            mngr.wait_until_finished()
        except Exception as e:  # reported to every process
            return f"could not write checkpoint {step} to {self._dir} ({type(e).__name__}: {e})"
        return None

    # -- agreement -----------------------------------------------------------------
    def _share(self, chief_fn: Callable[[], tuple[Any, str | None]], what: str):
        """Runs ``chief_fn`` on the chief and gives its ``(value, error)`` to everyone."""
        value, err = chief_fn()
        if self._agreement is None:
            return value, err
        reports = self._agreement.all_gather(
            pickle.dumps((value, err) if self.is_chief else None), what)
        return pickle.loads(reports[0])

    def _broadcast(self, host: Any) -> Any:
        if self._strategy.num_workers == 1:
            return host
        from jax.experimental import multihost_utils
        leaves, treedef = jax.tree.flatten(host)
        leaves = multihost_utils.broadcast_one_to_all(leaves)
        return jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])


def _abstract(init_fn: Callable[[], Any]) -> Any:
    try:
        return jax.eval_shape(init_fn)
    except Exception:  # not traceable (e.g. numpy code): evaluate it
        return init_fn()


def _zeros_like(tree: Any) -> Any:
    def leaf(path, x):
        _check_not_key(x, path, "restore_or_initialize: init_fn() returned")
        return np.zeros(np.shape(x), x.dtype)
    return jax.tree_util.tree_map_with_path(leaf, tree)


def _check_not_key(x: Any, path: Any, what: str) -> None:
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        raise TypeError(
            f"{what}: {path_str(path) or 'the root'} is a PRNG key array ({x.dtype}); "
            "checkpoints hold plain arrays. Keep jax.random.key_data(key) in the state "
            "and rebuild the key with jax.random.wrap_key_data(...) after restoring."
        )


def _to_host(tree: Any, what: str) -> Any:
    """Numpy copies of a pytree's leaves, read from this process's devices."""
    def leaf(path, x):
        if isinstance(x, PerReplica):
            raise ValueError(
                f"{what}: {path_str(path) or 'the root'} is a PerReplica value (different on "
                "each replica); checkpoints hold replicated state. Reduce it first "
                "(Replicator.reduce or ctx.all_sum in the step), or leave it out."
            )
        _check_not_key(x, path, what)
        if isinstance(x, jax.Array):
            if x.is_fully_addressable:
                return np.asarray(x)
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            raise ValueError(
                f"{what}: {path_str(path) or 'the root'} is sharded across processes "
                f"({x.sharding}); checkpoints hold replicated state. Replicate it (e.g. "
                "return it aggregated from the step) before saving."
            )
        if isinstance(x, (np.ndarray, np.generic, bool, int, float, complex)):
            return np.asarray(x)
        if hasattr(x, "shape") and hasattr(x, "dtype"):  # ShapeDtypeStruct
            return np.zeros(x.shape, x.dtype)
        raise TypeError(
            f"{what}: {path_str(path) or 'the root'} is a {type(x).__name__}, not an array. "
            "Checkpointed state must be a pytree of arrays (for a Flax NNX module, "
            "checkpoint nnx.state(module))."
        )
    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=lambda x: isinstance(
        x, PerReplica))
