"""Flax NNX modules among ``run``'s arguments: found, split, merged, written back (private).

Flax is imported only once the program has imported ``flax.nnx`` itself: before that,
no argument can be an NNX module, and a step on plain pytrees never pays for the import.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax

from jreplicate._jax_compat import varying_axes
from jreplicate._tree import path_str, report
from jreplicate.context import PerReplica

_MAX_ENTRIES = 64


def _is_per_replica(x: Any) -> bool:
    return isinstance(x, PerReplica)


def _has_graph_node(x: Any) -> bool:
    from flax import nnx
    is_graph_node = nnx.graph.is_graph_node

    def is_node(y: Any) -> bool:
        # Concrete arrays are never graph nodes; skip flax's slower test (~10 us each).
        if isinstance(y, jax.Array) and not isinstance(y, jax.core.Tracer):
            return False
        return is_graph_node(y)

    return any(is_node(leaf) for leaf in jax.tree.leaves(x, is_leaf=is_node))


class NodePositions:
    """Which arguments hold Flax NNX graph nodes, cached by structure and leaf types
    (a graph node that is not a pytree shows up as a leaf of its own type)."""

    def __init__(self):
        self._cache: dict = {}

    def __call__(self, args: tuple) -> tuple[int, ...]:
        if "flax.nnx" not in sys.modules:
            return ()
        leaves, treedef = jax.tree.flatten(args, is_leaf=_is_per_replica)
        sig = (treedef, tuple(map(type, leaves)))
        pos = self._cache.get(sig)
        if pos is None:
            pos = tuple(i for i, a in enumerate(args) if _has_graph_node(a))
            if len(self._cache) >= _MAX_ENTRIES:
                self._cache.clear()
            self._cache[sig] = pos
        return pos


class PytreeDef:
    """The static part of NNX arguments split as JAX pytrees (flax >= 0.11 modules are
    pytrees): a tree structure whose leaves are the Variables' values. Several times
    faster than ``nnx.split``/``nnx.update``; used when no Variable is shared."""

    __slots__ = ("treedef",)

    def __init__(self, treedef: Any):
        self.treedef = treedef

    def __hash__(self) -> int:
        return hash(self.treedef)

    def __eq__(self, other: Any) -> bool:
        # (type(self), not the module's global: a cache entry may be dropped while the
        # interpreter exits, after the module's globals are gone)
        return type(other) is type(self) and other.treedef == self.treedef


def is_variable(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.Variable`` (False while flax.nnx is not imported: then
    no argument can hold one)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.Variable)


def split_fast(nodes: tuple) -> tuple[PytreeDef, list, list] | None:
    """``(definition, values, Variables)`` of NNX nodes as pytrees, or None where that
    does not apply (a shared Variable, a Variable holding a pytree rather than one
    array)."""
    variables, vdef = jax.tree.flatten(nodes, is_leaf=is_variable)
    if not variables or not all(map(is_variable, variables)) \
            or len(set(map(id, variables))) != len(variables):
        return None
    sig = variable_signature(variables)
    cached = _FULL_DEFS.get(vdef)
    if cached is None or cached.signature != sig:  # new, or a Variable changed type/metadata
        leaves, treedef = jax.tree.flatten(nodes)
        if len(leaves) != len(variables):
            return None
        if len(_FULL_DEFS) > _MAX_ENTRIES:
            _FULL_DEFS.clear()
        cached = _FULL_DEFS[vdef] = _FullDef(treedef, sig)
    values = [v.get_value() for v in variables]
    if not jax.tree_util.all_leaves(values):
        return None  # a Variable holding a pytree of one leaf ({"w": array})
    return PytreeDef(cached.treedef), values, variables


def variable_signature(variables: list) -> list:
    """What the full pytree structure of NNX nodes records of their Variables beyond
    their positions: each one's type and metadata (``nnx.Param`` vs ``nnx.BatchStat``,
    sharding annotations, ...). Two calls with equal signatures and equal
    Variables-as-leaves structures have equal full structures."""
    return [(type(v), v.get_metadata()) for v in variables]


class _FullDef(NamedTuple):
    """The full pytree structure of NNX nodes with Variables as leaves of one structure."""

    treedef: Any      # the full structure (the Variables' values as leaves)
    signature: list   # its Variables' variable_signature


_FULL_DEFS: dict[Any, _FullDef] = {}


def split(args: tuple, node_pos: tuple[int, ...]) -> tuple[Any, Any, tuple, list | None]:
    """``(definition, state, plain args, Variables)`` for the NNX arguments at
    ``node_pos``; Variables is None when the slower ``nnx.split`` path is taken."""
    from flax import nnx
    nodes = tuple(args[i] for i in node_pos)
    fast = split_fast(nodes)
    if fast is not None:
        graphdef, state, variables = fast
    else:
        (graphdef, state), variables = nnx.split(nodes), None
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        raise TypeError(
            f"Replicator.run: argument {node_pos[0]} is a Flax NNX module traced "
            "by an outer jax.jit, and its state can't be written back from inside "
            "it. Call run outside jax.jit (it compiles the step itself), or pass "
            "the module's state as a pytree: nnx.split(module)."
        )
    plain = tuple(a for i, a in enumerate(args) if i not in node_pos)
    return graphdef, state, plain, variables


def merge(graphdef: Any, state: Any) -> tuple:
    if isinstance(graphdef, PytreeDef):
        return jax.tree.unflatten(graphdef.treedef, state)
    from flax import nnx
    return nnx.merge(graphdef, state)


def state_of(nodes: tuple, graphdef: Any) -> Any:
    if isinstance(graphdef, PytreeDef):
        return jax.tree.leaves(nodes)
    from flax import nnx
    return nnx.split(nodes)[1]


def write_back(args: tuple, node_pos: tuple[int, ...], new_state: Any,
               variables: list | None) -> None:
    if variables is not None:
        for v, x in zip(variables, new_state, strict=True):
            v.set_value(x)
        return
    from flax import nnx
    nnx.update(tuple(args[i] for i in node_pos), new_state)


def interleave(plain: tuple, nodes: tuple, node_pos: tuple) -> list:
    """The arguments in the user's order: NNX nodes back at ``node_pos``."""
    if not node_pos:
        return list(plain)
    args, it_plain, it_nodes = [], iter(plain), iter(nodes)
    for i in range(len(plain) + len(nodes)):
        args.append(next(it_nodes) if i in node_pos else next(it_plain))
    return args


def check_writable(args: tuple, node_pos: tuple, state: Any) -> None:
    """Fails before the step, not halfway through writing its results back, when an
    argument holds NNX modules and plain arrays in a container that can't be updated in
    place (a tuple). Writing the current state back changes nothing."""
    from flax import nnx
    try:
        nnx.update(tuple(args[i] for i in node_pos), state)
    except ValueError as e:
        raise ValueError(
            f"Replicator.run: argument(s) {list(node_pos)} hold Flax NNX modules together "
            f"with plain values in a container that can't be updated in place ({e}). Pass "
            "the modules and the arrays as separate arguments, or keep the arrays in an "
            "nnx.Module or a list."
        ) from e


def state_leaves(new_state: Any, state: Any, axis: str, graphdef: Any,
                 node_pos: tuple) -> list:
    """The leaves of a module's new state, checked to be writable back: the structure
    of ``state`` (the state the step got), identical on every replica (every leaf that
    is not is named, :func:`jreplicate._tree.report`)."""
    if jax.tree.structure(new_state) != jax.tree.structure(state):
        raise ValueError(
            "the step function changed the structure of a Flax NNX module's state (it "
            "added or removed variables). Create all variables before Replicator.run."
        )
    leaves = jax.tree.leaves(new_state)
    varying = [k for k, x in enumerate(leaves) if axis in varying_axes(x)]
    if varying:
        paths = state_paths(graphdef, state, node_pos)
        kinds = state_kinds(graphdef, state)
        report([ValueError(
            f"the step function left NNX state {paths[k]} different on each replica, so "
            f"it can't be written back to the replicated module. "
            f"{varying_hint(kinds[k], axis)}") for k in varying], "Replicator.run")
    return leaves


#: What :func:`varying_hint` tells apart.
BATCH_STAT, METRIC, OTHER = "batch_stat", "metric", "other"


def state_kinds(graphdef: Any, state: Any) -> list[str]:
    """The kind of each leaf of NNX state, for :func:`varying_hint`: an ``nnx.BatchStat``
    (BatchNorm's running statistics), an ``nnx.metrics`` metric's state, or other."""
    from flax import nnx
    n = len(jax.tree.leaves(state))
    nodes = merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), range(n)))
    metric = getattr(getattr(nnx, "metrics", None), "MetricState", ())
    kinds = [OTHER] * n
    for v in jax.tree.leaves(nodes, is_leaf=is_variable):
        if not is_variable(v):
            continue
        kind = BATCH_STAT if isinstance(v, nnx.BatchStat) else \
            METRIC if metric and isinstance(v, metric) else OTHER
        for k in jax.tree.leaves(v.get_value()):
            if isinstance(k, int) and 0 <= k < n:
                kinds[k] = kind
    return kinds


def varying_hint(kind: str, axis: str) -> str:
    """The fix for replicated state a step left different on each replica (the
    replica axis ``axis``), by the state's kind (:func:`state_kinds`)."""
    if kind == BATCH_STAT:
        return (
            "It is a BatchNorm's running statistics, computed from each replica's own "
            f"batch: create the layer with axis_name={axis!r} (nnx.BatchNorm(..., "
            f"axis_name={axis!r}); Linen: nn.BatchNorm(..., axis_name={axis!r})), which "
            "computes the statistics over the replicas' batches together, as one device "
            "would over the global batch.")
    if kind == METRIC:
        return (
            "It is an nnx.metrics metric's state, updated with each replica's own values. "
            "Update metrics with values that are the same on every replica: the loss as "
            "ctx.all_sum(loss) where loss = jr.compute_average_loss(per_example_loss, "
            "global_batch_size) (the global batch's mean), and per-example values gathered "
            "from every replica (logits=ctx.all_gather(logits).reshape(-1, "
            "*logits.shape[1:]), and labels alike); or return the per-replica values and "
            "update the metric outside run. (Averaging the metric's state with "
            "ctx.all_sum(x) / ctx.num_replicas gives a loss num_replicas times too small "
            "when the loss comes from compute_average_loss.)")
    return ("Aggregate it first (e.g. ctx.all_sum(x) / ctx.num_replicas for the mean over "
            "the replicas), or compute it from values that are the same on every replica.")


def state_paths(graphdef: Any, state: Any, node_pos: tuple) -> list[str]:
    """Names each leaf of NNX state as the user reaches it: ``argument [1].linear.kernel``."""
    n = len(jax.tree.leaves(state))
    nodes = merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), range(n)))
    names = {}
    for path, k in jax.tree_util.tree_flatten_with_path(nodes)[0]:
        parts = [p for p in path[1:] if getattr(p, "name", None) != "value"]
        names[k] = f"argument [{node_pos[path[0].idx]}]{path_str(parts)}"
    return [names.get(k, f"an NNX Variable (state leaf {k})")
            for k in range(n)]


def note_failed_step(e: BaseException, variables: list) -> None:
    """Adds to an error raised while a step ran what became of the NNX state given to
    it, when it was consumed (donated to the failed step). (Otherwise the module keeps
    its values from before the step: run writes back only a step's results.)"""
    values = [v.get_value() for v in variables]
    dead = sum(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               and x.is_deleted() for x in values)
    if dead:
        e.add_note(
            f"jreplicate: the step failed while running, after the state of its Flax NNX "
            f"arguments was donated to it: {dead} of their {len(variables)} Variables "
            "now hold deleted arrays (the module was consumed). Restore it from a "
            "checkpoint or from a copy taken before run (nnx.clone(model): run never "
            "donates an array another object holds).")


_SIMPLE = (bool, int, float, complex, str, bytes, type(None))


def _static_attributes(node: Any, path: tuple = (), out: dict | None = None,
                       seen: set | None = None) -> dict:
    """The plain Python attributes (numbers, strings, None) of a graph of NNX objects,
    by path: what ``nnx.split`` keeps in the static graph definition."""
    from flax import nnx
    out = {} if out is None else out
    seen = set() if seen is None else seen
    if id(node) in seen:
        return out
    seen.add(id(node))
    if isinstance(node, nnx.Variable):
        return out
    if isinstance(node, (list, tuple)):
        items = enumerate(node)
    elif isinstance(node, dict):
        items = node.items()
    elif isinstance(node, (nnx.Module, getattr(nnx, "Pytree", nnx.Module),
                           getattr(nnx, "Object", nnx.Module))):
        items = ((k, v) for k, v in vars(node).items() if not k.startswith("_"))
    else:
        return out
    for k, v in items:
        if isinstance(v, _SIMPLE):
            out[path + (k,)] = v
        else:
            _static_attributes(v, path + (k,), out, seen)
    return out


def check_static_unchanged(graphdef: Any, state: Any, nodes: tuple, node_pos: tuple) -> None:
    """Raises when the step changed a plain Python attribute of an NNX module: that
    happens once, while tracing, and could not be written back."""
    from flax import nnx
    if isinstance(graphdef, PytreeDef):
        if jax.tree.structure(nodes) == graphdef.treedef:
            return
    elif nnx.split(nodes)[0] == graphdef:
        return
    before = _static_attributes(merge(graphdef, state))
    after = _static_attributes(nodes)
    changed = [p for p in sorted(set(before) | set(after), key=str)
               if before.get(p, "<absent>") != after.get(p, "<absent>")]
    def name(p):
        return f"argument [{node_pos[p[0]]}]" + "".join(
            f".{k}" if isinstance(k, str) else f"[{k}]" for k in p[1:])
    listing = ", ".join(f"{name(p)} ({before.get(p, '<absent>')!r} -> "
                        f"{after.get(p, '<absent>')!r})" for p in changed[:5])
    raise ValueError(
        "the step function changed a plain Python attribute of a Flax NNX module"
        + (f": {listing}" if listing else " (or added or removed a submodule)")
        + ". Such a change happens once, while the step is traced, not at every step, and "
        "cannot be written back to the module. Keep values that change in an "
        "nnx.Variable (e.g. self.count = nnx.Variable(jnp.array(0)); "
        "self.count[...] += 1), or change the attribute outside the step."
    )


def explain_closure(e: Exception) -> Exception | None:
    """jreplicate's error for Flax's, when a step closes over an NNX module."""
    if "different trace level" not in str(e):
        return None
    return ValueError(
        "the step function uses a Flax NNX module or nnx.Optimizer it closes over (e.g. "
        "one created in rep.scope() outside the step). Inside Replicator.run a module's "
        "state must come in as an argument so that run can replicate it and write the "
        "update back: pass the module and its optimizer to run, "
        "rep.run(step, inputs, model, optimizer), and take them as parameters of step."
    )
