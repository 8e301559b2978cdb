"""Placing a call's arguments as a weight-update-sharded program stores them (private).

A strategy with ``weight_update_sharding`` returns state sharded over the replica axis;
the same state may come back replicated (created in ``scope()``, restored from a
checkpoint) or sharded (from an earlier ``run``). Both select the same program (the
executor's cache key ignores the replica entry of a spec), and :func:`place` reshards
each argument to the sharding the program's plan stores it with, so that one executable
serves both. A resharded argument is a new array: the caller's one is left as it was
(and is what the caller drops, or donates).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate.layout import Layout


def without_axis(spec: P, axis: str) -> P:
    """``spec`` with the mesh axis ``axis`` taken out of every entry."""
    entries = []
    for part in spec:
        if isinstance(part, tuple):
            rest = tuple(a for a in part if a != axis)
            part = rest if len(rest) > 1 else (rest[0] if rest else None)
        elif part == axis:
            part = None
        entries.append(part)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def place(arrays: list, kinds: tuple, shardings: tuple, layout: Layout) -> None:
    """Reshards, in place in ``arrays``, each concrete array whose sharding is not the
    one the program takes it with: ``shardings[i]`` where the plan shards it; else, for
    a replicated or model-sharded leaf passed sharded over the replicas, the leaf's
    unsharded placement."""
    axis = layout.replica_axis
    for i, x in enumerate(arrays):
        if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
            continue
        want = shardings[i] if i < len(shardings) else None
        if want is None:
            if kinds[i].kind.value == "per_replica" or not _has_axis(x.sharding, axis):
                continue
            spec = kinds[i].spec if kinds[i].spec is not None else P()
            want = NamedSharding(layout.mesh, spec)
        if not _same(x.sharding, want, x.ndim):
            arrays[i] = _reshard(want)(x)


def _has_axis(s: Any, axis: str) -> bool:
    spec = getattr(s, "spec", None)
    if spec is None:
        return False
    return any(part == axis or (isinstance(part, tuple) and axis in part) for part in spec)


def _same(s: Any, want: NamedSharding, ndim: int) -> bool:
    try:
        return s == want or s.is_equivalent_to(want, ndim)
    except (AttributeError, TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=256)
def _reshard(sharding: NamedSharding) -> Any:
    """A jitted copy onto ``sharding`` (works for global arrays across processes)."""
    return jax.jit(lambda x: x, out_shardings=sharding)


def argument_shardings(kinds: tuple, stored: tuple, layout: Layout, treedef: Any,
                       node_pos: tuple, args: tuple, variables: list | None,
                       state: Any) -> tuple:
    """Per argument, the shardings of its new value (``Replicator.state_shardings``):
    the program's stored sharding per flat input (``stored``, None where it keeps the
    input's kind: replicated, model-sharded or per-replica), arranged as the arguments;
    an NNX argument's as an ``nnx.State``."""
    flat = []
    for i, kind in enumerate(kinds):
        s = stored[i] if i < len(stored) else None
        if s is None:
            value = kind.kind.value
            spec = kind.spec if value == "model_sharded" else \
                (P(layout.replica_axis) if value == "per_replica" else P())
            s = NamedSharding(layout.mesh, spec)
        flat.append(s)
    _, plain, new_state = jax.tree.unflatten(treedef, flat)
    if not node_pos:
        return tuple(plain)
    nodes = _nnx_shardings(args, node_pos, jax.tree.leaves(new_state), variables, state)
    plain_it = iter(plain)
    return tuple(nodes[i] if i in node_pos else next(plain_it) for i in range(len(args)))


def _nnx_shardings(args: tuple, node_pos: tuple, flat: list, variables: list | None,
                   state: Any) -> dict:
    """Per NNX argument position, an ``nnx.State`` of the shardings of its Variables'
    new values (``flat``: per NNX state leaf, in the program's order)."""
    from flax import nnx

    from jreplicate.execution import nnx_args
    if variables is not None:  # the Variables, in the order of flat
        by_id = {id(v): s for v, s in zip(variables, flat)}
        return {i: jax.tree.map(lambda v: by_id[id(v)], nnx.state(args[i]),
                                is_leaf=nnx_args.is_variable)
                for i in node_pos}
    whole = jax.tree.unflatten(jax.tree.structure(state), flat)
    return {i: whole[k] for k, i in enumerate(node_pos)}
