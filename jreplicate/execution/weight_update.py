"""The weight-update planner: where a traced step splits, and what is stored sharded (private).

With ``weight_update_sharding`` set, the step's body (the jaxpr traced inside
``jax.shard_map``, manual over the replica axis) splits in two:

* part **A** runs in ``shard_map`` as today: every equation whose result varies over the
  replicas, every collective or ``axis_index`` over the replica axis (also inside
  sub-jaxprs), every effect, and every equation whose result A reads;
* part **B** is the rest: replica-invariant equations whose results only feed the new
  state (and other invariant outputs). B runs after the ``shard_map``, in the same
  ``jax.jit``, on global arrays: GSPMD partitions it over the sharded state. Since an
  invariant value is the same on every replica, moving an equation from A to B cannot
  change a value.

State leaves are stored sharded over the replicas (:func:`jreplicate.layout.
weight_shard_dim`): at ``"optimizer"`` those A never reads (the optimizer state; a leaf
the forward pass reads stays replicated), at ``"parameters"`` every state leaf, gathered
in A right before the first equation that reads it. A sum over the replica axis whose
result only B reads (a gradient) becomes a reduce-scatter (``psum_scatter``).

:func:`plan` is pure: the same jaxpr gives the same plan on every process, so nothing
needs agreeing across processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jax.sharding import PartitionSpec as P

from jreplicate import _jax_compat as jc
from jreplicate.layout import weight_shard_dim, weight_shard_spec

#: Why a state leaf stays replicated (the planner's report, logged once per program).
READ_BY_FORWARD = "read by the forward pass"
NOT_DIVISIBLE = "no dimension divisible by {n}"
TOO_SMALL = "below min_weight_shard_size"
SCALAR = "a scalar"
EMPTY = "zero-size"


class InputRole(NamedTuple):
    """What the program knows of one body input, besides the jaxpr."""

    state: bool              # a plain argument's or NNX state's leaf (not the batch)
    carried_to: int | None   # the body output holding its new value (None: not returned)
    spec: Any = None         # its own (model) PartitionSpec, or None
    name: str = ""           # for the report: e.g. "argument [1]['mu']['w']"


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """How one traced body runs split, and how its state is stored.

    Attributes:
      axis: the replica mesh axis.
      a_eqns: indices of the body equations part A runs (in ``shard_map``), in order.
      b_eqns: indices of those part B runs (after it, on global arrays), in order.
      in_dims: per body input, the dimension it is stored sharded on (None: as today).
      out_dims: per body output, the dimension it is stored sharded on (None: as today).
      scatter: ``(equation index, operand index, dim)`` of each replica sum that becomes
        a reduce-scatter along ``dim``.
      a_out: the body variables part A returns (read by B, or body outputs).
      a_out_dims: per ``a_out``, the dimension its value is scattered on (None: whole).
      replicated: ``(input index, reason)`` of state leaves kept replicated.
      sums_state_gradients: a replica sum of a value shaped like a state input (a
        gradient) exists: a training step, whatever it returns.
    """

    axis: str
    a_eqns: tuple[int, ...]
    b_eqns: tuple[int, ...]
    in_dims: tuple[int | None, ...]
    out_dims: tuple[int | None, ...]
    scatter: tuple[tuple[int, int, int], ...]
    a_out: tuple[Any, ...]
    a_out_dims: tuple[int | None, ...]
    replicated: tuple[tuple[int, str], ...]
    sums_state_gradients: bool = False

    def in_spec(self, i: int, spec: Any) -> Any:
        """Body input ``i``'s stored spec, from its own ``spec`` (or None)."""
        d = self.in_dims[i]
        return spec if d is None else weight_shard_spec(spec, d, self.axis)

    @property
    def shards_anything(self) -> bool:
        return any(d is not None for d in self.in_dims) or bool(self.scatter)


def plan(body: Any, roles: tuple[InputRole, ...], axis: str, level: str, n: int,
         min_size: int) -> UpdatePlan:
    """The plan for ``body`` (the ``core.Jaxpr`` of a step's ``shard_map``).

    Args:
      body: the body jaxpr; its inputs are described by ``roles``, one each.
      roles: per body input, its :class:`InputRole`.
      axis: the replica mesh axis (manual in the body).
      level: ``"optimizer"`` or ``"parameters"``.
      n: the number of replicas.
      min_size: leaves of fewer elements stay replicated.
    """
    eqns = body.eqns
    in_a = _part_a(eqns, axis)
    read_a = {v for i in range(len(eqns)) if in_a[i] for v in eqns[i].invars if jc.is_var(v)}
    read_b = {v for i in range(len(eqns)) if not in_a[i]
              for v in eqns[i].invars if jc.is_var(v)}
    outs = [v for v in body.outvars if jc.is_var(v)]
    in_dims, replicated = _input_dims(body, roles, read_a, level, n, min_size)
    out_dims = [None] * len(body.outvars)
    for i, r in enumerate(roles):
        if r.carried_to is not None and in_dims[i] is not None:
            out_dims[r.carried_to] = in_dims[i]
    # A sum over the replicas only B reads: reduce-scattered, on the dim of a sharded
    # input of the same shape (so B's update runs shard against shard) or by the rule.
    by_shape = {}
    for i, v in enumerate(body.invars):
        if in_dims[i] is not None:
            by_shape.setdefault(tuple(v.aval.shape), in_dims[i])
    scatter, scattered = [], {}
    out_set = set(outs)
    for i, e in enumerate(eqns):
        if not (in_a[i] and jc.sum_over(e, axis)):
            continue
        for k, (x, v) in enumerate(zip(e.invars, e.outvars)):
            if (not jc.is_var(v) or v in read_a or v in out_set or not jc.is_var(x)
                    or axis not in jc.aval_varying_axes(x.aval)):
                continue
            shape = tuple(v.aval.shape)
            d = by_shape.get(shape, weight_shard_dim(shape, None, n, min_size))
            if d is not None and shape[d] % n == 0:
                scatter.append((i, k, d))
                scattered[v] = d
    state_shapes = {tuple(v.aval.shape) for v, r in zip(body.invars, roles) if r.state}
    grads = any(jc.sum_over(e, axis) and any(
        tuple(v.aval.shape) in state_shapes for v in e.outvars) for e in eqns)
    a_made = [v for i in range(len(eqns)) if in_a[i] for v in eqns[i].outvars]
    a_out = tuple(v for v in a_made if jc.is_var(v) and (v in read_b or v in out_set))
    return UpdatePlan(
        axis=axis, a_eqns=tuple(i for i in range(len(eqns)) if in_a[i]),
        b_eqns=tuple(i for i in range(len(eqns)) if not in_a[i]),
        in_dims=tuple(in_dims), out_dims=tuple(out_dims), scatter=tuple(scatter),
        a_out=a_out, a_out_dims=tuple(scattered.get(v) for v in a_out),
        replicated=tuple(replicated), sums_state_gradients=grads)


def _part_a(eqns: list, axis: str) -> list[bool]:
    """Which equations part A runs: the seeds (varying results, replica collectives,
    effects), then, to a fixed point, the producers of what A reads and the readers of
    varying values."""
    in_a = [jc.replica_collective(e, axis) or jc.has_effects(e) or any(
        axis in jc.aval_varying_axes(v.aval) for v in e.outvars) for e in eqns]
    producer = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    varying = {v for e in eqns for v in e.outvars
               if axis in jc.aval_varying_axes(v.aval)}
    changed = True
    while changed:
        changed = False
        for i in range(len(eqns) - 1, -1, -1):
            e = eqns[i]
            if not in_a[i] and any(v in varying for v in e.invars if jc.is_var(v)):
                in_a[i] = changed = True
            if in_a[i]:
                for v in e.invars:
                    j = producer.get(v) if jc.is_var(v) else None
                    if j is not None and not in_a[j]:
                        in_a[j] = changed = True
    return in_a


def _input_dims(body: Any, roles: tuple[InputRole, ...], read_a: set, level: str, n: int,
                min_size: int) -> tuple[list, list]:
    """Per body input, the dimension it is stored sharded on, and the report of the
    state leaves kept replicated."""
    dims, why = [], []
    for i, (v, r) in enumerate(zip(body.invars, roles)):
        dim = None
        wanted = r.state and (r.carried_to is not None or
                              (level == "parameters" and v in read_a))
        if wanted and level == "optimizer" and v in read_a:
            why.append((i, READ_BY_FORWARD))
        elif wanted:
            shape = tuple(v.aval.shape)
            dim = weight_shard_dim(shape, r.spec, n, min_size)
            if dim is None:
                why.append((i, _reason(shape, r.spec, n, min_size)))
        dims.append(dim)
    return dims, why


def _reason(shape: tuple, spec: Any, n: int, min_size: int) -> str:
    size = 1
    for s in shape:
        size *= s
    if not shape:
        return SCALAR
    if size == 0:
        return EMPTY
    if size < min_size:
        return TOO_SMALL
    return NOT_DIVISIBLE.format(n=n)


def report(plan_: UpdatePlan, roles: tuple[InputRole, ...]) -> str:
    """One line per state leaf kept replicated, with its reason."""
    return "; ".join(f"{roles[i].name or f'input {i}'}: {why}" for i, why in plan_.replicated)


def spec_with(dim: int | None, spec: Any, axis: str) -> Any:
    """``spec`` (None: ``P()``) with ``axis`` on ``dim`` (None: unchanged)."""
    base = spec if spec is not None else P()
    return base if dim is None else weight_shard_spec(spec, dim, axis)
