"""Argument checks and small helpers of :func:`jreplicate.sync_replicas` (private)."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jreplicate.sync import spmd
from jreplicate.sync.state import SyncReplicasState

I32 = jnp.int32


def check_count(name: str, value: Any, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1 ({meaning}), got {value!r}.")
    if value < 1:
        raise ValueError(f"{name} must be >= 1 ({meaning}), got {value}.")
    return int(value)


def check_num_tokens(num_tokens: Any, k: int, total: int) -> int:
    if num_tokens is None:
        return k
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, numbers.Integral):
        raise TypeError(f"num_tokens must be an int or None, got {num_tokens!r}.")
    if num_tokens < 0:
        raise ValueError(
            f"num_tokens must be >= 0, got {num_tokens}; leave num_tokens=None for "
            f"TensorFlow's default of replicas_to_aggregate ({k}) initial tokens."
        )
    tokens_needed = k - total
    if num_tokens < tokens_needed:
        raise ValueError(
            f"Too few tokens to finish the first step: {num_tokens} (given) vs "
            f"{tokens_needed} (needed). Pass num_tokens >= replicas_to_aggregate - "
            f"total_num_replicas ({k} - {total}), or leave num_tokens=None for {k}."
        )
    return int(num_tokens)


def as_scalar(value: Any, name: str, dtype: Any, kind: str) -> jax.Array:
    x = jnp.asarray(value)
    if x.shape != ():
        raise ValueError(
            f"{name} must be a scalar ({kind}) for this replica, got shape {x.shape}. "
            "Inside shard_map each replica passes its own scalar."
        )
    if dtype == I32 and not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer step (a token), got dtype {x.dtype}.")
    return x.astype(dtype)


def check_arrival_time(value: Any) -> None:
    """Raises for NaN in arrival times known now (not traced): a constant or NumPy value.

    Traced times cannot be checked inside a compiled step; there a NaN sorts after
    every number (see :func:`jreplicate.sync.spmd.arrives_before`).
    """
    if value is None or isinstance(value, jax.core.Tracer):
        return
    try:
        x = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        return  # as_scalar / replicated_vector name what is wrong with it
    if np.isnan(x).any():
        where = "" if x.ndim == 0 else f" at replica(s) {np.flatnonzero(np.isnan(x)).tolist()}"
        raise ValueError(
            f"arrival_time is NaN{where}, which places no replica in the arrival order. "
            "Pass a number for every replica: +inf for one that arrives after all others "
            "(equal times are ordered by replica id)."
        )


def check_grads(grads: Any, state: SyncReplicasState, params: Any) -> None:
    if not jax.tree.leaves(grads):
        raise ValueError(
            "sync_replicas: Must supply at least one gradient, but the gradients pytree "
            f"{grads!r} has no arrays. Pass the gradients of the trainable params, "
            "e.g. jax.grad(loss)(params)."
        )
    gdef, adef = jax.tree.structure(grads), jax.tree.structure(state.accumulators)
    if gdef != adef:
        raise ValueError(
            f"sync_replicas: the gradients have structure {gdef} but the state was "
            f"initialised for params of structure {adef}. Pass gradients of the same "
            "params that were given to tx.init (same keys and nesting)."
        )
    if params is not None and jax.tree.structure(params) != gdef:
        raise ValueError(
            f"sync_replicas: params has structure {jax.tree.structure(params)} but the "
            f"gradients have structure {gdef}; pass the params the gradients were "
            "computed for."
        )
    for (path, g), a in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0],
        jax.tree.leaves(state.accumulators),
        strict=True,
    ):
        if jnp.shape(g) != a.shape:
            raise ValueError(
                f"sync_replicas: gradient at {jax.tree_util.keystr(path)} has shape "
                f"{jnp.shape(g)} but its param has shape {a.shape}."
            )


def check_own_gradients(grads: Any, axis_name: str) -> None:
    if not spmd.tracks_varying(axis_name):
        return
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        if axis_name not in spmd.varying_axes(g):
            raise ValueError(
                f"sync_replicas: inside shard_map over {axis_name!r}, the gradient at "
                f"{jax.tree_util.keystr(path) or '<root>'} is the same on every replica. "
                "JAX returns gradients of replicated params already SUMMED over the "
                "replicas, but sync_replicas needs each replica's own gradient. Compute "
                "it with jreplicate.sync.replica_value_and_grad(loss)(params, "
                f"batch), or differentiate w.r.t. jax.lax.pcast(params, {axis_name!r}, "
                "to='varying')."
            )


def resolve_mask(variables_to_average: Any, params: Any) -> Any:
    if variables_to_average is None:
        return jax.tree.map(lambda _: True, params)
    mask = (
        variables_to_average(params) if callable(variables_to_average) else (variables_to_average)
    )
    try:
        return jax.tree.map(lambda m, _: bool(m), mask, params)
    except (ValueError, TypeError) as err:
        raise ValueError(
            "variables_to_average must be a pytree of bools with the structure of params "
            f"(or a function params -> such a pytree): {err}"
        ) from None


def compilable(args: Any) -> bool:
    """Whether ``args`` are concrete arrays/numbers only (not traced, nothing static)."""
    leaves = jax.tree.leaves(args)
    return all(
        isinstance(x, (jax.Array, np.ndarray, np.generic, numbers.Number))
        and not isinstance(x, (jax.core.Tracer, bool))
        for x in leaves
    )


def cast_like(g: Any, a: Any) -> Any:
    return g.astype(a.dtype)


def zero() -> jax.Array:
    # A new buffer each time: state leaves must not alias, or donating the state fails.
    return jnp.zeros((), I32)


def is_none(x: Any) -> bool:
    return x is None
