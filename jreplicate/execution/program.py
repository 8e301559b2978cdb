"""The compiled program of one step signature: ``jax.jit`` over ``jax.shard_map`` (private).

The step's inputs arrive as flat leaves of the kinds of :class:`ArgKind`: replicated
(in spec ``P()``), model-sharded (in spec ``P()`` too: it keeps its sharding, since the
step is manual over the replica axis only) and per-replica (a :class:`PerReplica`,
stacked on a leading replica axis, in spec ``P(layout.replica_axis)``). Flax NNX graph nodes
among the arguments arrive as a state pytree and are merged inside the step, where
their random streams draw per replica (:mod:`jreplicate.execution.nnx_rngs`). Output
specs are chosen per leaf from whether the value varies across replicas (see
:mod:`jreplicate._jax_compat`).

With ``steps=K`` the program is a device loop: ``lax.scan`` over the leading step axis
of the batch, carrying the step's arguments (which the step returns first, in order)
and NNX state; its other outputs are stacked ``[K, ...]``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jreplicate import _jax_compat
from jreplicate._jax_compat import varying_axes
from jreplicate._tree import flatten_arrays, path_str
from jreplicate.context import MaskedBatch, ReplicaContext, tracing_step
from jreplicate.execution import fast, nnx_args, nnx_rngs, sharded_program
from jreplicate.layout import Layout


class ArgKind(enum.Enum):
    """How a flat input leaf enters the program."""

    #: The same value on every replica (in spec ``P()``).
    REPLICATED = "replicated"
    #: A :class:`PerReplica`: one row per replica (in spec ``P(replica axis)``).
    PER_REPLICA = "per_replica"
    #: Replicated over the replicas, split over the model axis: its new value keeps the
    #: split (:attr:`LeafKind.spec`).
    MODEL_SHARDED = "model_sharded"

    __hash__ = object.__hash__  # members are singletons: identity's hash, in C (fast keys)


class LeafKind(NamedTuple):
    """An input leaf's :class:`ArgKind`, with its spec when it is model-sharded."""

    kind: ArgKind
    spec: Any = None  # MODEL_SHARDED: the leaf's PartitionSpec over the mesh


#: The kinds of leaves that carry no spec.
REPLICATED = LeafKind(ArgKind.REPLICATED)
PER_REPLICA = LeafKind(ArgKind.PER_REPLICA)


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a compiled program depends on besides the function itself."""

    has_batch: bool
    treedef: Any            # of (batch, plain args, NNX state)
    graphdef: Any           # of the NNX arguments, or None
    node_pos: tuple[int, ...]
    kinds: tuple[LeafKind, ...]  # per flat leaf
    steps: int | None
    donate: tuple[int, ...]  # flat leaf indices donated to the program
    donate_args: tuple = ()  # the donated plain arguments (donation.DonatedArgument)


class Program:
    """One compiled step and what its (single) trace learned about the outputs."""

    def __init__(self, fn: Callable, sig: Signature, layout: Layout):
        self.specs: list = []
        self.out_tree: Any = None
        self.num_out = 0
        self.per_replica: tuple[bool, ...] | None = None  # per flat output, after a call
        self.returns_args = False  # the outputs begin with the plain arguments' new values
        self.habits_checked = False  # its trace was read for pmap habits (execution.habits)
        self.kinds = sig.kinds  # per flat input
        axis = layout.replica_axis
        in_specs = tuple(P(axis) if k.kind is ArgKind.PER_REPLICA else P()
                         for k in sig.kinds)
        sharded = layout.weight_update_sharding is not None
        # With weight_update_sharding, a device loop scans the split step outside the
        # manual region (execution.sharded_program): the body is one step of it.
        body = _one_step_body(fn, sig, layout, self) if sharded and sig.steps is not None \
            else _body(fn, sig, layout, self)
        # Manual over the replica axis only when a replica spans several devices (the
        # model axis stays automatic); else over the whole (replicas, 1) mesh.
        partial = layout.logical_devices_per_replica > 1
        manual = frozenset({axis}) if partial else frozenset(layout.mesh.axis_names)
        call = _jax_compat.shard_map_per_leaf_out_specs(
            body, mesh=layout.mesh, in_specs=in_specs, axis=axis, manual_axes=manual,
            specs=self.specs)
        options = _jax_compat.compiler_options(layout.first_devices[0].platform, partial)
        self.jitted_donate = sig.donate  # flat input indices donated
        self.donate_args = sig.donate_args
        #: With weight_update_sharding: the split program, planned at its first use.
        self.split: sharded_program.SplitJit | None = None
        if layout.weight_update_sharding is not None:
            loop = None if sig.steps is None else sharded_program.Loop(
                sig.steps, sig.has_batch, *[c.num_leaves for c in sig.treedef.children()])
            self.split = sharded_program.SplitJit(
                call, lambda: sharded_program.roles(
                    sig.treedef, sig.kinds, sig.node_pos, self.returns_args, self.num_out,
                    sig.graphdef),
                layout, sig.donate, options, manual, sharded_program.step_name(fn), loop,
                lambda: (self.num_out, self.outputs_per_replica()))
            self.jitted = self.split
            self.jitted_nested = sharded_program.nested_refused(layout.weight_update_sharding)
            return
        self.jitted = jax.jit(call, donate_argnums=sig.donate, compiler_options=options)
        # Under an outer jax.jit, whose compilation options are the caller's.
        self.jitted_nested = jax.jit(call, donate_argnums=sig.donate) if options \
            else self.jitted

    def outputs_per_replica(self) -> tuple[bool, ...]:
        if self.per_replica is None:
            self.per_replica = tuple(s != P() for s in self.specs)
        return self.per_replica


def _body(fn: Callable, sig: Signature, layout: Layout, program: Program) -> Callable:
    axis = layout.replica_axis
    graphdef = sig.graphdef
    m = layout.logical_devices_per_replica

    def body(*blocks):
        if fast.retrace_guarded():
            raise fast.Retrace  # a steady-state call with a new signature: full path
        vals = [b[0] if k.kind is ArgKind.PER_REPLICA else b
                for b, k in zip(blocks, sig.kinds)]
        batch, plain, state = jax.tree.unflatten(sig.treedef, vals)
        ctx = ReplicaContext(axis_name=axis, num_replicas=layout.num_replicas,
                             num_replicas_in_sync=layout.num_replicas_in_sync,
                             logical_devices_per_replica=m)
        with tracing_step(axis):
            if sig.steps is None:
                out, new_state = _call(fn, ctx, sig, batch, plain, state)
                program.returns_args = _returns_args(out, plain)
            else:
                out, new_state = _loop(fn, ctx, sig, batch, plain, state, axis)
                program.returns_args = True
        flat = _out_leaves(out, program)
        if graphdef is not None:
            flat += nnx_args.state_leaves(new_state, state, axis, graphdef, sig.node_pos)
        return _keep_model_shardings(flat, [b.shape for b in blocks], sig, program)

    return body


def _one_step_body(fn: Callable, sig: Signature, layout: Layout, program: Program
                   ) -> Callable:
    """One step of a device loop, as a body of the flat inputs with one step's batch:
    the outputs are the new plain arguments (with the old ones' dtypes), the step's other
    outputs, then the NNX state; the loop itself is outside (sharded_program.Loop)."""
    axis = layout.replica_axis
    graphdef = sig.graphdef

    def body(*blocks):
        if fast.retrace_guarded():
            raise fast.Retrace
        vals = [b[0] if k.kind is ArgKind.PER_REPLICA else b
                for b, k in zip(blocks, sig.kinds)]
        batch, plain, state = jax.tree.unflatten(sig.treedef, vals)
        ctx = ReplicaContext(axis_name=axis, num_replicas=layout.num_replicas,
                             num_replicas_in_sync=layout.num_replicas_in_sync,
                             logical_devices_per_replica=layout.logical_devices_per_replica)
        whole: list = []
        with tracing_step(axis):
            try:
                carry, extra = _step(fn, ctx, sig, batch, Carry(plain, state), axis, whole,
                                     changed="retry")
            except _StateChanged:
                raise ValueError(
                    "Replicator.run(..., steps=K) with weight_update_sharding: the step "
                    "changes the dtype or shape of NNX state (e.g. an int counter assigned "
                    "a float). Assign each Variable a value of its own dtype "
                    "(x.astype(v.dtype)), or run one step without steps= first.") from None
        program.returns_args = True
        if whole[0]:
            out = carry.plain[0]
        else:
            out = (*carry.plain, *extra) if plain else extra
        flat = _out_leaves(out, program)
        if graphdef is not None:
            flat += jax.tree.leaves(carry.state)
        return _keep_model_shardings(flat, [b.shape for b in blocks], sig, program)

    return body


def _keep_model_shardings(flat: list, in_shapes: list, sig: Signature,
                          program: Program) -> list:
    """The new values of model-sharded arguments keep the arguments' shardings: leaves
    of plain arguments the step returned first (``return params, opt_state, ...``),
    and NNX state. (XLA's propagation would otherwise be free to choose.)"""
    batch_t, plain_t, state_t = sig.treedef.children()
    nb, np_, ns = batch_t.num_leaves, plain_t.num_leaves, state_t.num_leaves
    pairs = []
    if program.returns_args:
        pairs += [(nb + t, t) for t in range(min(np_, program.num_out))]
    pairs += [(nb + np_ + t, program.num_out + t) for t in range(ns)]
    for i, k in pairs:
        kind = sig.kinds[i]
        if kind.kind is ArgKind.MODEL_SHARDED and flat[k].shape == in_shapes[i]:
            flat[k] = jax.lax.with_sharding_constraint(flat[k], kind.spec)
    return flat


def _call(fn: Callable, ctx: ReplicaContext, sig: Signature, batch: Any, plain: tuple,
          state: Any) -> tuple[Any, Any]:
    if isinstance(batch, MaskedBatch):  # padded input: the mask goes to ctx.batch_mask
        ctx, batch = ctx.with_batch_mask(batch.mask), batch.batch
    nodes = nnx_args.merge(sig.graphdef, state) if sig.graphdef is not None else ()
    args = nnx_args.interleave(plain, nodes, sig.node_pos)
    folded = nnx_rngs.fold_streams(nodes, ctx)  # each replica its own random streams
    try:
        out = fn(ctx, batch, *args) if sig.has_batch else fn(ctx, *args)
    except ValueError as e:
        better = nnx_args.explain_closure(e)
        if better is None:
            raise
        raise better from e
    except (NameError, AssertionError) as e:
        name = _jax_compat.unbound_axis_in(e)
        if name is None:
            raise
        raise _unbound_axis(name, ctx.axis_name) from e
    out = nnx_rngs.restore(folded, out, ctx)  # the replicated keys leave the step
    if sig.graphdef is None:
        return out, None
    nnx_args.check_static_unchanged(sig.graphdef, state, nodes, sig.node_pos)
    return out, nnx_args.state_of(nodes, sig.graphdef)


def _unbound_axis(name: str, axis: str) -> NameError:
    """JAX's error for an unbound axis ``name`` in a step, explained: the step names an
    axis that is not the strategy's replica axis ``axis``."""
    return NameError(
        f"unbound axis name: {name}. Replicator.run: the step uses mesh axis {name!r} "
        f"(e.g. jax.lax.pmean(x, {name!r}) or nnx.BatchNorm(..., axis_name={name!r}), as "
        "in a jax.pmap program), "
        f"but this strategy's replica axis is {axis!r}. Create the strategy with "
        f"axis_name={name!r} (e.g. jr.MirroredStrategy(axis_name={name!r})), or use "
        "ctx.axis_name in the step."
    )


class Carry(NamedTuple):
    """What a device loop carries from one step to the next."""

    plain: tuple  # the plain arguments' values
    state: Any    # the NNX arguments' state (None: none)


class _StateChanged(Exception):
    """Raised while tracing a device loop: a step gave NNX state another dtype or shape."""


def _loop(fn: Callable, ctx: ReplicaContext, sig: Signature, batch: Any, plain: tuple,
          state: Any, axis: str) -> tuple[Any, Any]:
    """``sig.steps`` steps in one ``lax.scan``; returns ``(outputs, final NNX state)``.

    A step that gives NNX state a new dtype (an int counter assigned a float, a bf16
    parameter updated in f32) changes it for good in K separate runs (run writes the
    promoted value back, and the next run starts from it). A scan carry keeps one type,
    so such a loop runs its first step alone and the others from its state; a step that
    changes it again is an error naming the Variable."""
    whole = []  # set while tracing: the step returned its only argument, not a tuple
    carry0 = Carry(_strong(plain), _strong(state))
    try:
        final, ys = _scan(fn, ctx, sig, batch, carry0, sig.steps, axis, whole,
                          changed="retry")
    except _StateChanged:
        first = jax.tree.map(lambda x: x[0], batch)
        carry1, y1 = _step(fn, ctx, sig, first, carry0, axis, whole, changed=None)
        carry1 = carry1._replace(state=_strong(carry1.state))
        if sig.steps == 1:
            final, ys = carry1, jax.tree.map(lambda y: y[None], y1)
        else:
            rest = jax.tree.map(lambda x: x[1:], batch)
            final, ys = _scan(fn, ctx, sig, rest, carry1, sig.steps - 1, axis, whole,
                              changed="error")
            ys = _stack_first(y1, ys)
    (returned_whole,) = whole
    if returned_whole:
        (arg,) = final.plain
        return arg, final.state
    if plain:
        return (*final.plain, *ys), final.state
    return ys, final.state


def _scan(fn, ctx, sig, batch, carry0, length, axis, whole, changed):
    def one(carry, batch_t):
        return _step(fn, ctx, sig, batch_t, carry, axis, whole, changed)

    return jax.lax.scan(one, carry0, batch if sig.has_batch else None, length=length)


def _step(fn: Callable, ctx: ReplicaContext, sig: Signature, batch_t: Any, carry: Carry,
          axis: str, whole: list, changed: str | None) -> tuple[Carry, Any]:
    """One step of a device loop: ``(new carry, outputs)``. When the NNX state comes out
    with another dtype or shape: ``changed="retry"`` raises :class:`_StateChanged`,
    ``"error"`` the user's error, None keeps the new one."""
    plain_c, state_c = carry
    out, new_state = _call(fn, ctx, sig, batch_t, plain_c, state_c)
    new_plain, extra, is_whole = _split_carry(out, plain_c, sig.node_pos)
    whole[:] = [is_whole]
    new_plain = _match_carry(new_plain, plain_c, axis)
    if sig.graphdef is not None:
        nnx_args.state_leaves(new_state, state_c, axis, sig.graphdef, sig.node_pos)
        if changed is not None:
            moved = [(i, o, n) for i, (o, n) in enumerate(zip(
                jax.tree.leaves(state_c), jax.tree.leaves(new_state)))
                if (o.shape, o.dtype) != (jnp.shape(n), jnp.result_type(n))]
            if moved and changed == "retry":
                raise _StateChanged
            if moved:
                raise _state_changed_again(sig, state_c, moved)
            new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state,
                                     state_c)
    return Carry(new_plain, new_state), extra


def _stack_first(y1: Any, ys: Any) -> Any:
    """The first step's outputs stacked before the other steps' ``[K-1, ...]``."""
    def stack(path, a, b):
        if (jnp.shape(a), jnp.result_type(a)) != (b.shape[1:], b.dtype):
            raise ValueError(
                f"Replicator.run(..., steps=K): the step's output {path_str(path) or 'root'} "
                f"has shape {jnp.shape(a)} and dtype {jnp.result_type(a)} at the first "
                f"step but {b.shape[1:]} and {b.dtype} at later ones (the step changed the "
                "dtype of NNX state its output depends on), so the K outputs can't be "
                "stacked. Cast the output (e.g. .astype(jnp.float32)), or set the "
                "Variable's dtype before the loop.")
        return jnp.concatenate([jnp.asarray(a)[None], b])

    return jax.tree_util.tree_map_with_path(stack, y1, ys)


def _state_changed_again(sig: Signature, state: Any, moved: list) -> ValueError:
    paths = nnx_args.state_paths(sig.graphdef, state, sig.node_pos)
    listing = ", ".join(f"{paths[i]} ({o.dtype}{list(o.shape)} -> "
                        f"{jnp.result_type(n)}{list(jnp.shape(n))})" for i, o, n in moved[:5])
    return ValueError(
        f"Replicator.run(..., steps=K): the step changes the dtype or shape of NNX state at "
        f"every step: {listing}. K separate runs would recompile at each one; a device "
        "loop carries each Variable with one dtype and shape. Assign the Variable a value "
        "of its own dtype (x.astype(v.dtype)), or give it the dtype it ends up with "
        "before the loop."
    )


def _carry_form(out: Any, plain: tuple) -> str | None:
    """How ``out`` holds the plain arguments' new values: ``"prefix"`` (its first
    ``len(plain)`` elements, in order), ``"whole"`` (one argument, returned alone), or
    None (it does not; so also when there are no plain arguments)."""
    n = len(plain)
    if n == 0:
        return None
    structs = [jax.tree.structure(p) for p in plain]
    if isinstance(out, (tuple, list)) and len(out) >= n and all(
            jax.tree.structure(o) == s for o, s in zip(out[:n], structs)):
        return "prefix"
    return "whole" if n == 1 and jax.tree.structure(out) == structs[0] else None


def _returns_args(out: Any, plain: tuple) -> bool:
    """Whether ``out`` begins with values shaped like the plain arguments, in order (or,
    for one argument, is its new value)."""
    return _carry_form(out, plain) is not None


def _strong(tree: Any) -> Any:
    """The leaves with weak types made strong (a scan carry must keep one type)."""
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, jnp.asarray(x).dtype), tree)


def _split_carry(out: Any, plain: tuple, node_pos: tuple) -> tuple[tuple, Any, bool]:
    """Splits a loop step's output into the new arguments (its first ``len(plain)``
    elements) and the per-step outputs."""
    n = len(plain)
    if n == 0:
        return (), out, False
    form = _carry_form(out, plain)
    if form == "prefix":
        return tuple(out[:n]), tuple(out[n:]), False
    if form == "whole":
        return (out,), (), True
    got = (f"a tuple of {len(out)} elements" if isinstance(out, (tuple, list))
           else f"a {type(out).__name__}")
    names = ", ".join(f"argument [{i}]" for i in range(n + len(node_pos)) if i not in node_pos)
    raise ValueError(
        f"Replicator.run(..., steps=K) carries the step's arguments from one step to the "
        f"next, so the step must return their new values first, in order ({names}; Flax "
        f"NNX modules are carried without being returned), then any per-step outputs: "
        f"`return params, opt_state, loss`. It returned {got} whose first {n} element(s) "
        "do not have the arguments' structures. An evaluation step returns its "
        "arguments unchanged: `return params, metrics`."
    )


def _match_carry(new: tuple, old: tuple, axis: str) -> tuple:
    """The new arguments with the old ones' dtypes and replication, or an error."""
    def leaf(path, x, o):
        x = jnp.asarray(x)
        where = f"argument {path_str(path)}"
        if x.shape != o.shape or x.dtype != o.dtype:
            raise ValueError(
                f"Replicator.run(..., steps=K): the step returned {where} with shape "
                f"{x.shape} and dtype {x.dtype}, but it came in with shape {o.shape} and "
                f"dtype {o.dtype}. A device loop carries each argument with one shape and "
                "dtype: return the new value in the argument's dtype (e.g. .astype(...))."
            )
        x = jax.lax.convert_element_type(x, o.dtype)
        vx, vo = axis in varying_axes(x), axis in varying_axes(o)
        if vx and not vo:
            kind = nnx_args.BATCH_STAT if "batch_stats" in where else nnx_args.OTHER
            raise ValueError(
                f"Replicator.run(..., steps=K): the step returned {where} different on "
                "each replica, but it is replicated state carried to the next step. "
                f"{nnx_args.varying_hint(kind, axis)} (Or pass a PerReplica value if each "
                "replica keeps its own.)"
            )
        if vo and not vx:
            x = jax.lax.pcast(x, axis, to="varying")
        return x

    return tuple(jax.tree_util.tree_map_with_path(leaf, new, old))


def _out_leaves(out: Any, program: Program) -> list:
    pairs, out_tree = flatten_arrays(out, lambda path, x: (
        f"the step function returned a {type(x).__name__} at output "
        f"{path_str(path) or 'root'}; outputs must be pytrees of arrays. Return "
        "arrays only, and keep other values outside the step."))
    flat = [jnp.asarray(x) for _, x in pairs]
    program.out_tree, program.num_out = out_tree, len(flat)
    return flat
