"""Builds and caches the ``jax.jit(jax.shard_map(...))`` program of a step (private).

The step's inputs are flattened into leaves of two kinds: replicated (in spec ``P()``)
and per-replica (a :class:`PerReplica`, stacked on a leading replica axis, in spec
``P("replica")``). Flax NNX graph nodes among the arguments are split into a static
graph definition and a state pytree, merged inside the step, and their new state is
written back afterwards. Output specs are chosen per leaf in the same tracing pass,
from whether the value varies across the replica axis.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate._tree import flatten_arrays, is_array_like, path_str
from jreplicate.context import PerReplica, ReplicaContext
from jreplicate.strategies.base import Strategy

_MAX_ENTRIES = 64


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def _has_graph_node(x: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # flax is a dependency, but keep the core usable without it
        return False
    is_graph_node = nnx.graph.is_graph_node

    def is_node(y: Any) -> bool:
        # Concrete arrays are never graph nodes; skip flax's slower test (~10 us each).
        if isinstance(y, jax.Array) and not isinstance(y, jax.core.Tracer):
            return False
        return is_graph_node(y)

    return any(is_node(leaf) for leaf in jax.tree.leaves(x, is_leaf=is_node))


class _Entry:
    """One compiled step: a jitted function and what its last trace learned."""

    def __init__(self, jitted: Callable):
        self.jitted = jitted
        self.specs: list = []
        self.out_tree: Any = None
        self.num_out = 0


class StepCache:
    """Compiled steps of one Replicator, keyed by function and input signature."""

    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        self._mesh = strategy.mesh
        self._axis = strategy.axis_name
        self._num_replicas = strategy.num_replicas
        self._replicated = NamedSharding(self._mesh, P())
        self._stacked = P(self._axis)  # the out spec of a per-replica leaf
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._nodes: dict = {}

    def _node_positions(self, args: tuple) -> tuple[int, ...]:
        """Which arguments hold Flax NNX graph nodes, cached by structure and leaf types
        (a graph node that is not a pytree shows up as a leaf of its own type)."""
        leaves, treedef = jax.tree.flatten(args, is_leaf=_is_per_replica)
        sig = (treedef, tuple(map(type, leaves)))
        pos = self._nodes.get(sig)
        if pos is None:
            pos = tuple(i for i, a in enumerate(args) if _has_graph_node(a))
            if len(self._nodes) >= _MAX_ENTRIES:
                self._nodes.clear()
            self._nodes[sig] = pos
        return pos

    def call(self, fn: Callable, has_batch: bool, batch: Any, args: tuple) -> Any:
        node_pos = self._node_positions(args)
        graphdef, state = None, None
        if node_pos:
            from flax import nnx
            graphdef, state = nnx.split(tuple(args[i] for i in node_pos))
            if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
                raise TypeError(
                    f"Replicator.run: argument {node_pos[0]} is a Flax NNX module traced "
                    "by an outer jax.jit, and its state can't be written back from inside "
                    "it. Call run outside jax.jit (it compiles the step itself), or pass "
                    "the module's state as a pytree: nnx.split(module)."
                )
        plain = tuple(a for i, a in enumerate(args) if i not in node_pos)
        leaves, treedef = jax.tree.flatten((batch, plain, state), is_leaf=_is_per_replica)
        arrays, kinds = self._place(leaves, treedef, node_pos)
        key = (fn, has_batch, treedef, graphdef, node_pos, kinds,
               tuple((a.shape, a.dtype, getattr(a, "weak_type", False)) for a in arrays))
        entry = self._entries.get(key)
        if entry is None:
            if node_pos:
                _check_writable(tuple(args[i] for i in node_pos), state, node_pos)
            entry = self._build(fn, has_batch, treedef, graphdef, node_pos, kinds)
            self._entries[key] = entry
            if len(self._entries) > _MAX_ENTRIES:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        flat = entry.jitted(*arrays)
        outs = [PerReplica(x, self._mesh, self._axis) if s == self._stacked else x
                for x, s in zip(flat, entry.specs)]
        result = jax.tree.unflatten(entry.out_tree, outs[:entry.num_out])
        if node_pos:
            from flax import nnx
            new_state = jax.tree.unflatten(jax.tree.structure(state), outs[entry.num_out:])
            nnx.update(tuple(args[i] for i in node_pos), new_state)
        return result

    def _place(self, leaves: list, treedef: Any, node_pos: tuple) -> tuple[list, tuple]:
        arrays, kinds = [], []
        paths = None
        for i, x in enumerate(leaves):
            if isinstance(x, PerReplica):
                if x.mesh is not None and x.mesh != self._mesh:
                    raise ValueError(
                        "Replicator.run got a PerReplica value from another Replicator "
                        "(a different mesh). Pass values produced by this Replicator's "
                        "prepare_input or run."
                    )
                shape = getattr(x.array, "shape", ())
                if not shape or shape[0] != self._num_replicas:
                    # shard_map would split a longer leading axis into blocks and each
                    # replica would silently take its block's first row.
                    paths = paths or _leaf_paths(treedef, node_pos)
                    raise ValueError(
                        f"Replicator.run: {paths[i]} is a PerReplica whose array has shape "
                        f"{tuple(shape)}, but it needs a leading axis of one value per "
                        f"replica ({self._num_replicas}). Build it as PerReplica(array of "
                        f"shape [{self._num_replicas}, ...]), or pass a plain array to give "
                        "every replica the same value."
                    )
                arrays.append(x.array)
                kinds.append("r")
                continue
            if not is_array_like(x):
                paths = paths or _leaf_paths(treedef, node_pos)
                raise TypeError(
                    f"Replicator.run: {paths[i]} is a {type(x).__name__}, not an array. "
                    "Arguments must be pytrees of arrays; close over other values in fn "
                    "(e.g. functools.partial(step, name=...)), built once outside the "
                    "training loop: a new function object each step compiles each step."
                )
            if isinstance(x, jax.core.Tracer):
                pass  # under an outer jit: shard_map's in_specs place it
            elif not (isinstance(x, jax.Array) and x.sharding == self._replicated):
                x = jax.device_put(x, self._replicated)
            arrays.append(x)
            kinds.append("c")
        return arrays, tuple(kinds)

    def _build(self, fn, has_batch, treedef, graphdef, node_pos, kinds) -> _Entry:
        strategy, axis = self._strategy, self._axis
        in_specs = tuple(P(axis) if k == "r" else P() for k in kinds)

        def body(*blocks):
            vals = [b[0] if k == "r" else b for b, k in zip(blocks, kinds)]
            batch, plain, state = jax.tree.unflatten(treedef, vals)
            nodes = ()
            if graphdef is not None:
                from flax import nnx
                nodes = nnx.merge(graphdef, state)
            args = _interleave(plain, nodes, node_pos)
            ctx = ReplicaContext(axis_name=axis, num_replicas=strategy.num_replicas,
                                 num_replicas_in_sync=strategy.num_replicas_in_sync)
            out = fn(ctx, batch, *args) if has_batch else fn(ctx, *args)
            flat = _out_leaves(out, entry)
            if graphdef is not None:
                from flax import nnx
                flat += _state_leaves(nnx.split(nodes)[1], jax.tree.structure(state), axis)
            specs = [P(axis) if axis in _vma(x) else P() for x in flat]
            entry.specs[:] = specs
            return [x[None] if s == P(axis) else x for x, s in zip(flat, specs)]

        def outer(*arrays):
            # `entry.specs` is filled by `body` itself: shard_map matches out_specs to the
            # outputs only after calling body (jax 0.12, pinned <0.13), so one tracing
            # pass both runs fn and chooses P() or P("replica") per output leaf.
            # test_compiled_once_and_retraced_only_on_new_signature guards this.
            return jax.shard_map(body, mesh=self._mesh, in_specs=in_specs,
                                 out_specs=entry.specs)(*arrays)

        entry = _Entry(jax.jit(outer))
        return entry


def _vma(x: jax.Array) -> frozenset:
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def _interleave(plain: tuple, nodes: tuple, node_pos: tuple) -> list:
    args, it_plain, it_nodes = [], iter(plain), iter(nodes)
    for i in range(len(plain) + len(nodes)):
        args.append(next(it_nodes) if i in node_pos else next(it_plain))
    return args


def _out_leaves(out: Any, entry: _Entry) -> list:
    pairs, out_tree = flatten_arrays(out, lambda path, x: (
        f"the step function returned a {type(x).__name__} at output "
        f"{path_str(path) or 'root'}; outputs must be pytrees of arrays. Return "
        "arrays only, and keep other values outside the step."))
    flat = [jnp.asarray(x) for _, x in pairs]
    entry.out_tree, entry.num_out = out_tree, len(flat)
    return flat


def _check_writable(nodes: tuple, state: Any, node_pos: tuple) -> None:
    """Fails before the step, not halfway through writing its results back, when an
    argument holds NNX modules and plain arrays in a container that can't be updated in
    place (a tuple). Writing the current state back changes nothing."""
    from flax import nnx
    try:
        nnx.update(nodes, state)
    except ValueError as e:
        raise ValueError(
            f"Replicator.run: argument(s) {list(node_pos)} hold Flax NNX modules together "
            f"with plain values in a container that can't be updated in place ({e}). Pass "
            "the modules and the arrays as separate arguments, or keep the arrays in an "
            "nnx.Module or a list."
        ) from e


def _state_leaves(new_state: Any, structure: Any, axis: str) -> list:
    if jax.tree.structure(new_state) != structure:
        raise ValueError(
            "the step function changed the structure of a Flax NNX module's state (it "
            "added or removed variables). Create all variables before Replicator.run."
        )
    pairs = jax.tree_util.tree_flatten_with_path(new_state)[0]
    for path, x in pairs:
        if axis in _vma(x):
            raise ValueError(
                f"the step function left NNX state {path_str(path)} different on each "
                "replica, so it can't be written back to the replicated module. Aggregate "
                "it first, e.g. `ctx.all_sum(x) / ctx.num_replicas`."
            )
    return [x for _, x in pairs]


def _leaf_paths(treedef: Any, node_pos: tuple) -> list[str]:
    """Names each leaf of ``(batch, plain args, NNX state)`` as the user passed it: a plain
    argument's index counts the NNX arguments taken out before it."""
    dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    names = {"0": "the input batch", "1": "argument", "2": "an NNX module's state"}
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(dummy, is_leaf=_is_per_replica)[0]:
        head = names.get(str(path[0].idx), "input") if path else "input"
        if head == "argument" and len(path) > 1:
            k = path[1].idx  # index among the plain arguments
            i = [j for j in range(k + len(node_pos) + 1) if j not in node_pos][k]
            out.append(f"argument [{i}]{path_str(path[2:])}")
        else:
            out.append(f"{head} {path_str(path[1:])}".strip())
    return out
