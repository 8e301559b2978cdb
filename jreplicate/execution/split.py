"""The split program: a traced step run as ``shard_map`` (part A) then GSPMD (part B) (private).

From a step's traced program (a closed jaxpr holding one ``shard_map`` equation) and its
:class:`~jreplicate.execution.weight_update.UpdatePlan`, :func:`build` makes the function
of the flat inputs that ``jax.jit`` compiles instead: part A in ``jax.shard_map``,
manual over the replica axis, with sharded inputs gathered where A first reads them and
gradients reduce-scattered; part B after it, on global arrays, partitioned by GSPMD
over the sharded state; each output constrained to its stored sharding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jreplicate import _jax_compat as jc
from jreplicate.execution.weight_update import UpdatePlan, spec_with


def build(closed: Any, index: int, plan: UpdatePlan, mesh: Any, manual: frozenset,
          out_specs: Sequence[Any]) -> Callable[..., list]:
    """The split program of ``closed`` (a traced program whose equation ``index`` is the
    step's ``shard_map``).

    Args:
      closed: the closed jaxpr of the step's program, as traced today.
      index: the index of its ``shard_map`` equation.
      plan: the plan of that equation's body.
      mesh: the strategy's mesh.
      manual: the mesh axes part A is manual over.
      out_specs: per body output, the spec its value is stored with (None: as part A or
        B leaves it).
    """
    outer = closed.jaxpr
    consts = list(closed.consts)

    def program(*flat):
        env = dict(zip(outer.constvars, consts))
        env.update(zip(outer.invars, flat))
        for j, e in enumerate(outer.eqns):
            invals = [jc.atom_value(a, env) for a in e.invars]
            outs = (_run_split(e, invals, plan, mesh, manual, out_specs) if j == index
                    else jc.eval_equation(e, invals))
            env.update(zip(e.outvars, outs))
        return [jc.atom_value(v, env) for v in outer.outvars]

    return program


def _run_split(eqn: Any, invals: list, plan: UpdatePlan, mesh: Any, manual: frozenset,
               out_specs: Sequence[Any]) -> list:
    body = eqn.params["jaxpr"]
    in_specs, body_out_specs = eqn.params["in_specs"], eqn.params["out_specs"]
    axis = plan.axis
    a_eqns = [body.eqns[i] for i in plan.a_eqns]
    read_a = {v for e in a_eqns for v in e.invars if jc.is_var(v)}
    a_in = [j for j, v in enumerate(body.invars) if v in read_a]
    a_in_specs = tuple(spec_with(plan.in_dims[j], None, axis)
                       if plan.in_dims[j] is not None else in_specs[j] for j in a_in)
    outspec_of = {}
    for v, s in zip(body.outvars, body_out_specs):
        if jc.is_var(v):  # (a literal output is no value of part A)
            outspec_of.setdefault(v, s)
    a_out_specs = tuple(
        spec_with(d, None, axis) if d is not None else outspec_of.get(v, P())
        for v, d in zip(plan.a_out, plan.a_out_dims))

    def run_a(*vals):
        return _run_a(body, plan, a_in, vals)

    a_vals = jax.shard_map(run_a, mesh=mesh, in_specs=a_in_specs, out_specs=a_out_specs,
                           axis_names=manual)(*[invals[j] for j in a_in])
    env = dict(zip(body.invars, invals))
    env.update(zip(plan.a_out, a_vals))
    for i in plan.b_eqns:
        e = body.eqns[i]
        vals = [jc.atom_value(a, env) for a in e.invars]
        if jc.is_sharding_constraint(e):  # an identity on values; its mesh is manual
            outs = vals
        else:
            outs = jc.eval_equation(e, vals)
        env.update(zip(e.outvars, outs))
    outs = [jc.atom_value(v, env, manual=False) for v in body.outvars]
    return [x if s is None else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))
            for x, s in zip(outs, out_specs)]


def _run_a(body: Any, plan: UpdatePlan, a_in: list, vals: Sequence) -> list:
    """Part A, inside ``shard_map``: the equations of ``plan.a_eqns`` on the blocks
    ``vals`` of the inputs ``a_in``."""
    axis = plan.axis
    env = {}
    pending = {}  # sharded inputs, gathered right before the first equation reading them
    for j, x in zip(a_in, vals):
        v = body.invars[j]
        env[v] = x
        if plan.in_dims[j] is not None:
            pending[v] = plan.in_dims[j]
    scatter: dict[int, dict[int, int]] = {}
    for i, k, d in plan.scatter:
        scatter.setdefault(i, {})[k] = d
    for i in plan.a_eqns:
        e = body.eqns[i]
        for v in e.invars:
            if jc.is_var(v) and v in pending:
                env[v] = jax.lax.all_gather(env[v], axis, axis=pending.pop(v), tiled=True,
                                            to="invarying")
        vals_i = [jc.atom_value(a, env) for a in e.invars]
        if i in scatter:
            outs = _scattered_sum(e, vals_i, scatter[i], axis)
        else:
            outs = jc.eval_equation(e, vals_i)
        env.update(zip(e.outvars, outs))
    return tuple(env[v] for v in plan.a_out)


def _scattered_sum(eqn: Any, vals: list, dims: dict[int, int], axis: str) -> list:
    """A replica sum with the operands ``dims`` names reduce-scattered along their dim;
    the others summed as the equation says."""
    outs: list = [None] * len(vals)
    kept = [k for k in range(len(vals)) if k not in dims]
    if kept:
        for k, x in zip(kept, jc.eval_equation(eqn, [vals[k] for k in kept])):
            outs[k] = x
    for k, d in dims.items():
        outs[k] = jax.lax.psum_scatter(vals[k], axis, scatter_dimension=d, tiled=True)
    return outs
