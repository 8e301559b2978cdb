"""Flax NNX arguments of a parameter-server step: what carries from step to step.

Under :class:`jreplicate.ParameterServerStrategy` a step runs later, on a worker, on a
fresh copy of each NNX argument (:class:`NnxArg`): the parameters (``nnx.Param``) are
pulled from the shards, and the optimizer's state is the shards' too. Of the rest:

* **random streams** (``nnx.Rngs``): each step draws from its own stream, the
  argument's key folded with the step's id (:meth:`NnxArg.build`), so that no two steps
  share a dropout mask (every step drew the same one) and a rerun of a step (its worker
  died) draws what the first run drew;
* **any other state the step changes** (``nnx.BatchStat``, a cache, a custom
  ``nnx.Variable``) would be lost after every step: the first run of each step function
  on a worker checks it (:func:`check_nothing_lost`) and fails the step, naming the
  variable and the fix, instead of training silently without it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jreplicate.ps.remote import HostKey, fetched, is_key


@dataclasses.dataclass
class NnxArg:
    """A Flax NNX argument (a model, an ``nnx.Optimizer``) shipped to a worker as its
    graph definition and numpy state (a typed PRNG key as a
    :class:`jreplicate.ps.remote.HostKey`); each step runs on a fresh copy."""

    graphdef: Any
    state: Any

    def build(self, step_id: int | None = None) -> Any:
        """A fresh copy of the argument; with ``step_id``, its random streams (every
        ``nnx.RngKey``) folded with it: step ``step_id``'s own streams."""
        from flax import nnx
        node = nnx.merge(self.graphdef, jax.tree.map(
            lambda x: fetched(x) if isinstance(x, HostKey) else x, self.state))
        if step_id is not None:
            keys = nnx.state(node, nnx.RngKey)
            if jax.tree.leaves(keys):
                nnx.update(node, jax.tree.map(
                    lambda k: jax.random.fold_in(k, step_id), keys))
        return node


def check_nothing_lost(args: list, built: list) -> None:
    """Raises if the step changed NNX state that does not carry to the next step.

    Args:
      args: the closure's arguments (``NnxArg`` where an NNX argument was).
      built: the same arguments as the step ran them (the built copies, which the
        executor updated with the step's new state).

    Raises:
      ValueError: naming the argument, the variable's path and type, and the fix.
    """
    from flax import nnx
    lost = nnx.Not(nnx.Any(nnx.Param, nnx.RngState))
    for i, (a, node) in enumerate(zip(args, built)):
        if not isinstance(a, NnxArg) or isinstance(node, nnx.Optimizer):
            continue  # (the optimizer's state is the shards': the worker's is a snapshot)
        before = _flat(nnx.filter_state(a.state, lost))  # (as shipped: no model built)
        for path, (kind, new) in _flat(nnx.state(node, lost)).items():
            old = before.get(path)
            if old is not None and not np.array_equal(np.asarray(old[1]), np.asarray(new)):
                raise ValueError(
                    f"ParameterServerStrategy: the step changed the {kind} at "
                    f"'{'/'.join(map(str, path))}' of its argument {i}. Under "
                    "ParameterServerStrategy only the parameters (nnx.Param, held by the "
                    "shards) and the random streams carry from one step to the next: "
                    "every step runs on a fresh copy of the rest, so this change would be "
                    "lost after each step. Keep such state fixed in the step (e.g. "
                    "nnx.BatchNorm(use_running_average=True), or model.eval() for those "
                    "layers), keep it per worker (strategy.create_per_worker_state: the "
                    "step returns jr.ps.update_worker_state(nnx.state(...))), or train "
                    "with MirroredStrategy, which keeps it.")


def _flat(state: Any) -> dict[tuple, tuple[str, Any]]:
    """``{path: (variable type name, value)}`` of an ``nnx.State``."""
    from flax import nnx
    out = {}
    for path, var in nnx.to_flat_state(state):
        value = var.get_value() if hasattr(var, "get_value") else var
        if isinstance(value, HostKey):  # (a key as shipped: its data)
            value = value.data
        elif is_key(value):
            value = jax.random.key_data(value)
        out[tuple(path)] = (type(var).__name__, value)
    return out
