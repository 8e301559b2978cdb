"""The compiled step of a strategy with ``weight_update_sharding`` set (private).

:class:`SplitJit` stands where :class:`~jreplicate.execution.program.Program` keeps its
``jax.jit``: called (or traced, or lowered) the first time, it traces today's program
once, plans the split (:mod:`jreplicate.execution.weight_update`), and compiles the split
program (:mod:`jreplicate.execution.split`) with ``jax.jit``. The plan fixes the
sharding each input is stored with (:attr:`SplitJit.in_shardings`): the executor places
arguments that way before calling (a replicated argument is resharded once), so that
one executable serves every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate import _jax_compat as jc
from jreplicate._tree import path_str
from jreplicate.execution import fast, nnx_args, split, weight_update
from jreplicate.execution.weight_update import InputRole, UpdatePlan
from jreplicate.layout import Layout

_log = logging.getLogger("jreplicate")


class Loop(NamedTuple):
    """A device loop's shape: K steps of the split step in one ``lax.scan``."""

    steps: int
    has_batch: bool
    num_batch: int  # flat input leaves of the batch (stacked [replicas, K, ...])
    num_plain: int  # of the plain arguments (carried: the first outputs)
    num_state: int  # of the NNX state (carried: the last outputs)


class SplitJit:
    """The ``jax.jit`` of a step's split program, built at its first use.

    Args:
      call: today's program function of the flat inputs (``shard_map`` of the body).
      roles: called after the first trace of ``call``: per flat input, its
        :class:`InputRole` (which state leaf it is, and which flat output is its new
        value), from what the trace learned.
      layout: the strategy's layout.
      donate: the flat input indices donated.
      options: XLA compiler options.
      manual: the mesh axes the body is manual over.
      name: the step's name, for the log.
    """

    def __init__(self, call: Callable, roles: Callable[[], tuple[InputRole, ...]],
                 layout: Layout, donate: tuple[int, ...], options: dict | None,
                 manual: frozenset, name: str, loop: Loop | None = None,
                 outputs: Callable[[], tuple] | None = None):
        self._call, self._roles, self._layout = call, roles, layout
        self._loop, self._outputs = loop, outputs
        self._donate, self._options, self._manual, self._name = donate, options, manual, name
        self._jitted: Any = None
        self._traced: Any = None
        self.plan: UpdatePlan | None = None
        #: Per flat input, the sharding the program takes it with (None: as it comes).
        self.in_shardings: tuple = ()
        #: Per flat output, the sharding its value is stored with (None: the program's).
        self.out_shardings: tuple = ()

    @property
    def planned(self) -> bool:
        return self._jitted is not None

    def ensure(self, arrays: list) -> None:
        """Traces, plans and builds the program for inputs like ``arrays`` (once)."""
        if self._jitted is not None:
            return
        loop = self._loop
        one = arrays if loop is None else [  # one step's batch: [replicas, ...]
            jax.ShapeDtypeStruct(x.shape[:1] + x.shape[2:], x.dtype) if k < loop.num_batch
            else x for k, x in enumerate(arrays)]
        self._traced = jax.jit(self._call).trace(*one)
        closed = self._traced.jaxpr
        index = jc.shard_map_equation(closed)
        if index is None:
            raise RuntimeError(
                "weight_update_sharding: the traced step holds no single shard_map "
                "equation (an unexpected JAX change); create the strategy without "
                "weight_update_sharding.")
        # a jax.jit nested in the step (jax.jit(jax.grad(loss))) holds the gradient
        # sum in its own jaxpr: inlined, the planner sees (and scatters) it
        closed = jc.inline_calls_in_body(closed, index)
        outer, eqn = closed.jaxpr, closed.jaxpr.eqns[index]
        body = eqn.params["jaxpr"]
        flat_roles = self._roles()
        roles = _body_roles(outer, eqn, flat_roles)
        layout = self._layout
        plan = weight_update.plan(
            body, roles, layout.replica_axis, layout.weight_update_sharding,
            layout.num_replicas, layout.min_weight_shard_size)
        body_out = _body_out_specs(body, eqn, plan, roles)
        mesh = layout.mesh
        self.in_shardings = tuple(
            _input_sharding(outer, eqn, plan, roles, k, mesh) for k in range(len(outer.invars)))
        out_index = {v: k for k, v in enumerate(eqn.outvars)}
        self.out_shardings = tuple(
            NamedSharding(mesh, body_out[out_index[v]])
            if jc.is_var(v) and v in out_index and body_out[out_index[v]] is not None
            else None for v in outer.outvars)
        program = split.build(closed, index, plan, mesh, self._manual, body_out)
        if loop is not None:
            num_out, per_replica = self._outputs()
            program = _scanned(program, loop, num_out, per_replica, self.out_shardings)
        self._jitted = jax.jit(_guarded(program), donate_argnums=self._donate,
                               compiler_options=self._options)
        self.plan = plan
        _report(plan, roles, layout, self._name)
        _report_kept_calls(body, layout, self._name)

    def __call__(self, *arrays):
        self.ensure(list(arrays))
        return self._jitted(*arrays)

    def trace(self, *arrays):
        """Today's (unsplit) program traced: the step's own trace, as the pmap-habit
        check reads it."""
        self.ensure(list(arrays))
        return self._traced

    def lower(self, *arrays):
        self.ensure(list(arrays))
        return self._jitted.lower(*arrays)


def roles(treedef: Any, kinds: tuple, node_pos: tuple, returns_args: bool,
          num_out: int, graphdef: Any = None) -> tuple[InputRole, ...]:
    """Per flat input of a program of ``(batch, plain args, NNX state)`` leaves, its
    :class:`InputRole`, once the body was traced: the plain arguments' leaves are carried
    to the outputs the step returns first (``returns_args``), the NNX state's to the
    state outputs after the ``num_out`` step outputs."""
    batch_t, plain_t, _ = treedef.children()
    nb, np_ = batch_t.num_leaves, plain_t.num_leaves
    names = _leaf_names(treedef, node_pos, graphdef)
    out = []
    for k, kind in enumerate(kinds):
        spec = kind.spec if kind.kind.value == "model_sharded" else None
        if k < nb or kind.kind.value == "per_replica":
            out.append(InputRole(False, None, spec, names[k]))
            continue
        if k < nb + np_:
            t = k - nb
            to = t if returns_args and t < num_out else None
        else:
            to = num_out + k - nb - np_
        out.append(InputRole(True, to, spec, names[k]))
    return tuple(out)


def _leaf_names(treedef: Any, node_pos: tuple, graphdef: Any = None) -> list[str]:
    """Each flat input's name as the user passed it (``argument [1].mu['w']``; an NNX
    module's state as ``argument [0].linear.kernel``)."""
    dummy = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    state_names = None
    if graphdef is not None:
        try:
            state_names = nnx_args.state_paths(graphdef, dummy[2], node_pos)
        except Exception as e:  # noqa: BLE001 - names for a log line only
            _log.debug("jreplicate: no names for the NNX state leaves (%s)", e)
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(dummy)[0]:
        head = path[0].idx if path else 0
        if head == 1 and len(path) > 1:
            k = path[1].idx  # among the plain arguments; NNX arguments were taken out
            i = [j for j in range(k + len(node_pos) + 1) if j not in node_pos][k]
            out.append(f"argument [{i}]{path_str(path[2:])}")
        elif head == 2 and state_names is not None:
            out.append(state_names[len(out) - treedef.num_leaves + len(state_names)])
        else:
            out.append(("NNX state " if head == 2 else "batch ") + path_str(path[1:]))
    return out


def step_name(fn: Callable) -> str:
    """The user's step's name (``fn`` may be the program cache's weak call of it)."""
    inner = getattr(fn, "_ref", None)
    fn = inner() if callable(inner) else fn
    return getattr(fn, "__qualname__", type(fn).__name__)


def nested_refused(level: str) -> Callable:
    """What a program under an outer ``jax.jit`` calls instead: an error with the fix."""
    def refuse(*arrays):
        raise TypeError(
            f"Replicator.run was called inside jax.jit (or another JAX transformation) "
            f"with a strategy created with weight_update_sharding={level!r}; the sharded "
            "step is compiled by Replicator.run itself, which needs concrete arrays. "
            "Call rep.run outside jax.jit (it compiles the step once already), or create "
            "the strategy without weight_update_sharding.")

    refuse.lower = refuse.trace = refuse
    return refuse


def _guarded(program: Callable) -> Callable:
    """``program``, refusing to be traced again by a steady-state call (jax.jit traces
    again only for inputs of other shapes or types, which the program's fixed jaxpr
    does not describe): the full path then builds the program of that signature."""
    def traced_once(*flat):
        if fast.retrace_guarded():
            raise fast.Retrace
        return program(*flat)

    return traced_once


def _scanned(one_step: Callable, loop: Loop, num_out: int, per_replica: tuple,
             out_shardings: tuple = ()) -> Callable:
    """K steps of ``one_step`` (the split program of one step) in a ``lax.scan`` outside
    the manual region: the plain arguments' and NNX state's leaves are carried, the
    other outputs stacked ``[K, ...]`` (per-replica ones ``[replicas, K, ...]``). The
    carry keeps the shardings one step stores its state with (``out_shardings``, per
    output of one step): else GSPMD picks the loop's (e.g. a parameter kept whole at
    ``"optimizer"`` split like its moments, then resharded before every call)."""
    nb, np_, ns = loop.num_batch, loop.num_plain, loop.num_state
    kept = [*range(np_), *range(num_out, num_out + ns)]
    carried = [out_shardings[k] if k < len(out_shardings) else None for k in kept]

    def keep(xs):
        return [x if s is None else jax.lax.with_sharding_constraint(x, s)
                for x, s in zip(xs, carried)]

    def program(*flat):
        batch = [jnp.moveaxis(x, 1, 0) for x in flat[:nb]]  # [K, replicas, ...]
        carry0 = keep([jax.lax.convert_element_type(x, x.dtype)  # strong
                       for x in flat[nb:]])

        def one(carry, xs):
            outs = one_step(*(xs or []), *carry)
            new = outs[:np_] + outs[num_out:]
            return keep([n.astype(c.dtype) for n, c in zip(new, carry)]), outs[np_:num_out]

        final, ys = jax.lax.scan(one, carry0, batch if loop.has_batch and nb else None,
                                 length=loop.steps)
        final = keep(final)
        ys = [jnp.moveaxis(y, 0, 1) if r else y
              for y, r in zip(ys, per_replica[np_:num_out])]
        return [*final[:np_], *ys, *final[np_:np_ + ns]]

    return program


def _body_roles(outer: Any, eqn: Any, flat: tuple[InputRole, ...]) -> tuple[InputRole, ...]:
    """The roles of the body's inputs (the flat inputs', through the ``shard_map``
    equation; a constant the trace hoisted is not state), with ``carried_to`` counted
    among the body's outputs."""
    flat_in = {v: k for k, v in enumerate(outer.invars)}
    body_out = {v: k for k, v in enumerate(eqn.outvars)}
    out = []
    for atom in eqn.invars:
        k = flat_in.get(atom) if jc.is_var(atom) else None
        if k is None:
            out.append(InputRole(False, None))
            continue
        r = flat[k]
        to = None
        if r.carried_to is not None and r.carried_to < len(outer.outvars):
            new = outer.outvars[r.carried_to]
            same = (tuple(new.aval.shape), new.aval.dtype) == \
                (tuple(atom.aval.shape), atom.aval.dtype)
            to = body_out.get(new) if same and jc.is_var(new) else None
        out.append(r._replace(carried_to=to))
    return tuple(out)


def _body_out_specs(body: Any, eqn: Any, plan: UpdatePlan,
                    roles: tuple[InputRole, ...]) -> list:
    """Per body output, the spec its value is stored with: sharded as planned; else,
    when part B makes it (or it passes an input through), replicated with its input's
    model spec; else None (as part A leaves it)."""
    model = [None] * len(body.outvars)
    for r in roles:
        if r.carried_to is not None:
            model[r.carried_to] = r.spec
    a_out = set(plan.a_out)
    out = []
    for k, (v, s) in enumerate(zip(body.outvars, eqn.params["out_specs"])):
        if plan.out_dims[k] is not None:
            out.append(weight_update.spec_with(plan.out_dims[k], model[k], plan.axis))
        elif s == P() and not (jc.is_var(v) and v in a_out):
            out.append(model[k] if model[k] is not None else P())
        else:
            out.append(None)
    return out


def _input_sharding(outer: Any, eqn: Any, plan: UpdatePlan, roles: tuple, k: int,
                    mesh: Any) -> NamedSharding | None:
    """The sharding flat input ``k`` is stored with, when the plan shards it."""
    v = outer.invars[k]
    for j, atom in enumerate(eqn.invars):
        if atom is v and plan.in_dims[j] is not None:
            return NamedSharding(mesh, plan.in_spec(j, roles[j].spec))
    return None


def _report(plan: UpdatePlan, roles: tuple, layout: Layout, name: str) -> None:
    sharded = sum(d is not None for d in plan.in_dims)
    carried = any(r.carried_to is not None for r in roles)
    if not sharded and not carried and plan.sums_state_gradients:
        _log.warning(
            "jreplicate: weight_update_sharding=%r found no state the step %s updates: "
            "return the new state first (`return params, opt_state, loss`) or update an "
            "NNX Optimizer in place; nothing is sharded.",
            layout.weight_update_sharding, name)
        return
    lost = [r.name or f"input {i}" for i, (d, r) in enumerate(zip(plan.in_dims, roles))
            if d is not None and r.carried_to is None and r.state]
    if lost and plan.sums_state_gradients:
        _log.warning(
            "jreplicate: weight_update_sharding=%r, step %s: %d inputs are stored sharded "
            "but no output carries them back (%s%s): they are resharded on every call "
            "and their new values returned replicated. Return the new state first, in "
            "argument order (`return params, opt_state, loss` for a step of `(ctx, "
            "batch, params, opt_state)`, each with its argument's structure).",
            layout.weight_update_sharding, name, len(lost), ", ".join(lost[:4]),
            f", and {len(lost) - 4} more" if len(lost) > 4 else "")
    if not carried:  # an evaluation step: nothing to report
        return
    kept = weight_update.report(plan, roles)
    _log.info(
        "jreplicate: weight_update_sharding=%r, step %s: %d state leaves sharded over "
        "%d replicas, %d gradients reduce-scattered%s", layout.weight_update_sharding,
        name, sharded, layout.num_replicas, len(plan.scatter),
        f"; kept replicated: {kept}" if kept else "")


def _report_kept_calls(body: Any, layout: Layout, name: str) -> None:
    """Warns of the nested calls left whole (:func:`jreplicate._jax_compat.nested_calls`)
    that sum over the replicas: such a gradient sum stays an all-reduce."""
    kept = [str(e.params.get("name", e.primitive.name)) for e in jc.nested_calls(body)
            if jc.replica_collective(e, layout.replica_axis)]
    if kept:
        _log.warning(
            "jreplicate: weight_update_sharding=%r, step %s: the replica sum (a "
            "gradient's) inside the nested jax.jit %s is not split out: it stays an "
            "all-reduce, not a reduce-scatter; call jax.grad outside jax.jit inside the "
            "step.", layout.weight_update_sharding, name, ", ".join(sorted(set(kept))))
