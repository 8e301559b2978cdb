"""A ``rep.run`` call made into a :class:`Closure` on the driver, under
:class:`jreplicate.ParameterServerStrategy`.

The step runs later, on a worker, with the parameters and optimizer state pulled from
the shards. So, when ``run`` is called, :class:`StepBuilder` finds which arguments are
the registered ``params`` and optimizer state (by identity: the worker substitutes the
shards' values), reads every other argument as of now (copies of NumPy values, the
graph and state of a Flax NNX module), refuses what no worker could receive, and gives
each step function a key the workers cache their compiled steps under.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate import _porting
from jreplicate._tree import host_copy, path_str, read_now, report
from jreplicate.context import PerReplica
from jreplicate.execution.cache import FunctionMap
from jreplicate.ps.closure import Closure, HostBatch
from jreplicate.ps.nnx_state import NnxArg
from jreplicate.ps.per_worker import PerWorkerValue
from jreplicate.ps.remote import is_key, to_host
from jreplicate.ps.run_arguments import check_run_arguments
from jreplicate.ps.worker_input import WorkerInput, WorkerInputs

#: Batches read on the workers (or assembled by the driver's iterator): passed as they are.
_WORKER_BATCHES = (HostBatch, WorkerInput, WorkerInputs)


class StepBuilder:
    """Makes the :class:`Closure` of each ``rep.run`` call of one executor.

    Args:
      on_function_freed: called with a step function's key when the function is freed
        here (from any thread, as a finalizer), so that the workers let their compiled
        copies go.
    """

    def __init__(self, on_function_freed: Callable[[int], None]):
        self.param_ids: tuple | None = None
        self.opt_ids: tuple | None = None
        self.fn_keys = FunctionMap(on_drop=on_function_freed)
        self.nnx_cache: dict[int, tuple] = {}  # id -> (weakref to node, treedef, leaves, NnxArg)
        self._next_key = 0
        self._warned_donation = False

    def register(self, params: Any, opt_state: Any) -> None:
        """The parameters and optimizer state ``tx.init`` registered: the arguments of
        ``run`` holding these very leaves are substituted on the worker."""
        self.param_ids = tuple(id(x) for x in jax.tree.leaves(params))
        self.opt_ids = tuple(id(x) for x in jax.tree.leaves(opt_state))

    def closure(self, step_id: int, fn: Callable, has_batch: bool, batch: Any,
                args: tuple, donate_argnums: tuple[int, ...],
                allow: frozenset) -> Closure:
        """The step of ``rep.run(fn, batch, *args)`` as of now, to run as ``step_id``.

        Raises:
          ValueError, TypeError: an argument no worker can receive (a donated array, a
            RemoteValue, a string, state with a leading device axis, ...), or no
            argument is the registered params; every problem named at once.
        """
        if donate_argnums and not self._warned_donation:
            self._warned_donation = True
            warnings.warn(
                f"Replicator.run(..., donate_argnums={tuple(donate_argnums)}) has no effect "
                "under ParameterServerStrategy: the step runs later on a worker, with the "
                "parameters pulled from the shards and copies of the other arguments, so "
                "nothing of the caller's is donated (the worker reuses its own buffers). "
                "The step is run as given; drop donate_argnums here to silence this.",
                UserWarning, stacklevel=4)  # the caller of Replicator.run
        p_idx = o_idx = None
        nnx_pos = self._nnx_positions(args)
        _check_device_axis(args, nnx_pos)
        check_run_arguments(
            None if isinstance(batch, _WORKER_BATCHES) else batch,
            args, {*nnx_pos, *(i for i, a in enumerate(args) if isinstance(a, PerWorkerValue))})
        for i, a in enumerate(args):
            if i in nnx_pos:
                if nnx_pos[i] == "model":
                    p_idx = i
                continue
            ids = tuple(id(x) for x in jax.tree.leaves(a))
            if ids == self.param_ids and p_idx is None:
                p_idx = i
            elif ids == self.opt_ids and o_idx is None:
                o_idx = i
        if p_idx is None:
            raise ValueError(
                "Replicator.run under ParameterServerStrategy: none of the step's arguments "
                "is the params passed to tx.init inside rep.scope(). Pass those params "
                "(the shards hold their current values; the worker substitutes them).")
        # The step runs later, on a worker: NumPy values are read now (copied), so that
        # refilling the caller's arrays after run returns never changes the step.
        # (a PerWorkerValue: each worker substitutes its own value)
        args = tuple(self._nnx_arg(a) if i in nnx_pos else None if i in (p_idx, o_idx)
                     else a._arg() if isinstance(a, PerWorkerValue)
                     else jax.tree.map(read_now, a) for i, a in enumerate(args))
        if batch is not None and not isinstance(batch, _WORKER_BATCHES):
            # (a PerReplica's array too: it may be the caller's NumPy array)
            batch = jax.tree.map(lambda x: host_copy(x.array if isinstance(
                x, PerReplica) else x), batch, is_leaf=lambda x: isinstance(x, PerReplica))
        key = self.fn_keys.get(fn)
        if key is None:
            key = self.fn_keys[fn] = self._next_key
            self._next_key += 1
        return Closure(step_id, fn, has_batch, batch, args, p_idx, o_idx, key, allow=allow)

    def _nnx_positions(self, args: tuple) -> dict[int, str]:
        """Flax NNX arguments: ``{index: "model"}`` for the module whose parameters the
        shards hold (found by identity), ``"other"`` for the rest (an ``nnx.Optimizer``)."""
        if "flax.nnx" not in sys.modules:
            return {}
        from flax import nnx
        out: dict[int, str] = {}
        wrt = nnx.Param
        for a in args:
            if isinstance(a, nnx.Optimizer):
                wrt = a.wrt
        for i, a in enumerate(args):
            if not nnx.graph.is_graph_node(a):
                continue
            out[i] = "other"
            if not isinstance(a, nnx.Optimizer):
                ids = tuple(id(x) for x in jax.tree.leaves(nnx.as_pure(nnx.state(a, wrt))))
                if ids == self.param_ids:
                    out[i] = "model"
        return out

    def _nnx_arg(self, node: Any) -> NnxArg:
        """The node's graph and numpy state as of this call, as every strategy reads its
        arguments when ``run`` is called: the caller may have changed the node since
        the last step (``model.eval()``, a variable set anew), and the scheduled step
        sees that (the parameters are the shards' all the same).

        The last call's result is reused while the node flattens (flax modules are
        pytrees: several times cheaper than ``nnx.split``) to the same structure and
        the same leaf objects, none of them a NumPy array (which may be refilled in
        place)."""
        leaves, treedef = jax.tree_util.tree_flatten(node)
        hit = self.nnx_cache.get(id(node))
        if hit is not None and hit[0]() is node and hit[1] == treedef and \
                len(hit[2]) == len(leaves) and all(a is b for a, b in zip(hit[2], leaves)):
            return hit[3]
        from flax import nnx
        graphdef, state = nnx.split(node)
        # (a NumPy value copied: the caller may refill it before the step runs; a
        # typed PRNG key, as an nnx.Rngs holds, which NumPy cannot, as a HostKey)
        arg = NnxArg(graphdef, jax.tree.map(
            lambda x: to_host(x) if is_key(x) else host_copy(x), state))
        reusable = not (len(leaves) == 1 and leaves[0] is node) and not any(
            isinstance(x, np.ndarray) for x in leaves)
        ref = None
        if reusable:
            # Held weakly: a node the caller lets go (a fresh nnx.Rngs each step) takes
            # its entry, and the state copied from it, with it.
            cache, key = self.nnx_cache, id(node)
            try:
                ref = weakref.ref(node, lambda r: cache.pop(key, None)
                                  if cache.get(key, (None,))[0] is r else None)
            except TypeError:  # (not weakly referable: not kept)
                ref = None
        if ref is not None:
            self.nnx_cache[id(node)] = (ref, treedef, leaves, arg)
        else:
            self.nnx_cache.pop(id(node), None)
        return arg


def _check_device_axis(args: tuple, nnx_pos: dict) -> None:
    """Refuses a plain argument holding state with a leading device axis
    (``flax.jax_utils.replicate``'s; see :func:`jreplicate._porting.device_axis_errors`)."""
    groups, leaves, owners = [], [], []
    for i, a in enumerate(args):
        if i in nnx_pos:
            continue
        xs = jax.tree.leaves(a)
        groups.append((f"argument [{i}]", range(len(leaves), len(leaves) + len(xs))))
        leaves += xs
        owners.append(i)

    def name(k: int) -> str:  # (pytree paths only for an error's message: 20-30 us a run)
        for (label, idx), i in zip(groups, owners):
            if k in idx:
                path = jax.tree_util.tree_flatten_with_path(args[i])[0][k - idx.start][0]
                return f"{label}{path_str(path)}"
        raise IndexError(k)

    report(_porting.device_axis_errors(groups, leaves, name), "Replicator.run")
