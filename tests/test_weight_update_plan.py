"""The weight-update planner alone, on traced steps (jreplicate.execution.weight_update).

Property tests over optax chains, leaf shapes (dividing the replica count or not,
scalars, zero-size, rank 0-3) and replica counts: the plan partitions the body's
equations; part B reads no per-replica value and holds no collective over the replica
axis; every reduce-scatter replaces a sum over the replica axis that only part B reads;
what is stored sharded obeys the shard rule and the level; and the split program
computes what the body computes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from jreplicate import _jax_compat as jc
from jreplicate.execution import split, weight_update
from jreplicate.execution.weight_update import InputRole
from jreplicate.layout import weight_shard_dim

AXIS = "replica"

TXS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
    "decay_sgd": lambda: optax.chain(optax.add_decayed_weights(1e-2), optax.sgd(0.1)),
    "schedule": lambda: optax.adam(optax.exponential_decay(1e-2, 10, 0.5)),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
}

SHAPES = st.lists(
    st.sampled_from([(), (0,), (3,), (8,), (16,), (4, 8), (6, 5), (8, 0), (2, 4, 8),
                     (5, 16), (1, 2, 3)]),
    min_size=1, max_size=4)


def _traced(tx, shapes, n):
    """The closed jaxpr of a replicated training step over ``n`` devices, its flat
    inputs (batch, params, opt state) and their roles."""
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(n, 1), (AXIS, "model"),
                axis_types=(AxisType.Auto, AxisType.Auto))
    params = [jnp.full(s, 0.5 + i, jnp.float32) for i, s in enumerate(shapes)]
    opt_state = tx.init(params)
    batch = jnp.arange(n * 2, dtype=jnp.float32).reshape(n, 2) / n

    def loss(p, x):
        return sum(jnp.sum(jnp.tanh(q * x.sum())) for q in p) + x.sum() * 0

    def body(x, p, s):
        g = jax.grad(loss)(p, x[0])
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    flat, tree = jax.tree.flatten((batch, params, opt_state))
    n_p, n_s = len(params), len(jax.tree.leaves(opt_state))
    in_specs = (P(AXIS),) + (P(),) * (n_p + n_s)

    def call(*f):
        return jax.tree.leaves(jax.shard_map(
            lambda *b: jax.tree.leaves(body(*jax.tree.unflatten(tree, b))),
            mesh=mesh, in_specs=in_specs, out_specs=P())(*f))

    closed = jax.jit(call).trace(*flat).jaxpr
    roles = (InputRole(False, None),) + tuple(
        InputRole(True, k) for k in range(n_p + n_s))
    return mesh, call, closed, flat, roles


def _check_plan(closed, roles, level, n, min_size):
    index = jc.shard_map_equation(closed)
    eqn = closed.jaxpr.eqns[index]
    body = eqn.params["jaxpr"]
    body_roles = tuple(roles[closed.jaxpr.invars.index(a)] for a in eqn.invars)
    plan = weight_update.plan(body, body_roles, AXIS, level, n, min_size)
    # A and B partition the body's equations, each in order
    assert sorted(plan.a_eqns + plan.b_eqns) == list(range(len(body.eqns)))
    assert list(plan.a_eqns) == sorted(plan.a_eqns)
    b_made = set()
    for i in plan.b_eqns:
        e = body.eqns[i]
        assert not jc.replica_collective(e, AXIS), e
        assert not jc.has_effects(e)
        for v in e.invars:
            if jc.is_var(v):
                assert AXIS not in jc.aval_varying_axes(v.aval), e
        b_made.update(e.outvars)
    # A reads nothing B makes
    for i in plan.a_eqns:
        assert not any(v in b_made for v in body.eqns[i].invars if jc.is_var(v))
    # scatters replace replica sums only B reads, along a dimension n divides
    read_a = {v for i in plan.a_eqns for v in body.eqns[i].invars if jc.is_var(v)}
    for i, k, d in plan.scatter:
        e = body.eqns[i]
        assert i in plan.a_eqns and jc.sum_over(e, AXIS)
        v = e.outvars[k]
        assert v not in read_a and v not in body.outvars
        assert v.aval.shape[d] % n == 0
    # storage: the shard rule, and at "optimizer" nothing the forward pass reads
    for j, (v, r) in enumerate(zip(body.invars, body_roles)):
        d = plan.in_dims[j]
        if d is None:
            continue
        assert r.state and d == weight_shard_dim(tuple(v.aval.shape), None, n, min_size)
        if level == "optimizer":
            assert v not in read_a
    return plan, index


@settings(deadline=None, max_examples=25)
@given(tx=st.sampled_from(sorted(TXS)), shapes=SHAPES, n=st.sampled_from([1, 2, 4, 8]),
       level=st.sampled_from(["optimizer", "parameters"]),
       min_size=st.sampled_from([0, 16]))
def test_plan_partitions_the_body(tx, shapes, n, level, min_size):
    _, _, closed, _, roles = _traced(TXS[tx](), shapes, n)
    _check_plan(closed, roles, level, n, min_size)


@settings(deadline=None, max_examples=5)
@given(tx=st.sampled_from(sorted(TXS)), shapes=SHAPES, n=st.sampled_from([2, 4, 8]),
       level=st.sampled_from(["optimizer", "parameters"]))
def test_split_program_computes_the_body(tx, shapes, n, level):
    mesh, call, closed, flat, roles = _traced(TXS[tx](), shapes, n)
    plan, index = _check_plan(closed, roles, level, n, 0)
    body_out = [None] * len(closed.jaxpr.eqns[index].outvars)
    program = split.build(closed, index, plan, mesh, frozenset(mesh.axis_names), body_out)
    want = jax.jit(call)(*flat)
    got = jax.jit(program)(*flat)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_collectives_are_matched_by_axis_not_name():
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), (AXIS, "model"))

    def f(x):
        return (jax.lax.psum(x, AXIS), jax.lax.pmax(x, AXIS),
                jax.lax.axis_index(AXIS)[None], jax.lax.psum(x, "model"), x + 1)

    closed = jax.make_jaxpr(jax.shard_map(f, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(
        jnp.ones((2, 3)))
    body = closed.jaxpr.eqns[0].params["jaxpr"]
    found = {e.primitive.name: (jc.replica_collective(e, AXIS), jc.sum_over(e, AXIS))
             for e in body.eqns}
    assert found["pmax"] == (True, False)
    assert found["axis_index"] == (True, False)
    sums = [e for e in body.eqns if jc.sum_over(e, AXIS)]
    assert len(sums) == 1 and jc.replica_collective(sums[0], AXIS)
    model_sums = [e for e in body.eqns if e.primitive.name.startswith("psum")
                  and not jc.replica_collective(e, AXIS)]
    assert model_sums  # a sum over another axis is not the replicas'


@pytest.mark.parametrize("shape, spec, n, min_size, want", [
    ((16, 32), None, 8, 0, 1),
    ((32, 16), None, 8, 0, 0),
    ((8, 8), None, 8, 0, 0),           # ties: the first
    ((6,), None, 8, 0, None),          # not divisible
    ((), None, 8, 0, None),            # scalar
    ((0, 8), None, 8, 0, 1),           # zero-size: replicated
    ((32, 16), P("model"), 8, 0, 1),   # dim 0 is the model axis's
    ((32, 16), None, 8, 1024, None),   # small
])
def test_shard_rule(shape, spec, n, min_size, want):
    if 0 in shape:
        want = None
    assert weight_shard_dim(shape, spec, n, min_size) == want
