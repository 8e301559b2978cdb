"""The weight-update planner alone, on traced steps (jreplicate.execution.weight_update).

Property tests over optax chains, leaf shapes (dividing the replica count or not,
scalars, zero-size, rank 0-3) and replica counts: the plan partitions the body's
equations; part B reads no per-replica value and holds no collective over the replica
axis; every reduce-scatter replaces a sum over the replica axis that only part B reads;
what is stored sharded obeys the shard rule and the level; and the split program
computes what the body computes. A stateful test alternates single runs, device loops,
donation and replicated copies of the state (as restored), against a reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
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


@settings(deadline=None, max_examples=20)
@given(tx=st.sampled_from(sorted(TXS)), shapes=SHAPES, n=st.sampled_from([1, 2, 4, 8]),
       level=st.sampled_from(["optimizer", "parameters"]),
       min_size=st.sampled_from([0, 16]))
def test_plan_partitions_the_body(tx, shapes, n, level, min_size):
    _, _, closed, _, roles = _traced(TXS[tx](), shapes, n)
    _check_plan(closed, roles, level, n, min_size)


@settings(deadline=None, max_examples=4)
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


# -- stateful: runs, device loops, donation and replicated copies, against a reference --

class _Training:
    """One Replicator and step shared by every example (its programs compile once)."""

    def __init__(self):
        import jreplicate as jr
        self.jr = jr
        self.tx = optax.adamw(1e-2, weight_decay=0.1)
        self.rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="parameters",
                                                     min_weight_shard_size=0))
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(12, 16, 8)).astype(np.float32)
        tx = self.tx

        def loss(p, x):
            out = jnp.tanh(x @ p["w"]) @ p["v"] + p["b"]
            return (jnp.sum(out ** 2) + jnp.sum(jnp.tanh(x[:, :6] * p["c"]))) / 20

        def step(ctx, x, p, s):
            g = jax.grad(loss)(p, x)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        @jax.jit
        def reference(p, s, x):
            g = jax.grad(loss)(p, x)
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        self.step, self.reference = step, reference
        self.params0 = {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32) / 4,
                        "v": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32) / 4,
                        "b": jnp.zeros((8,), jnp.float32),
                        "c": jnp.ones((6,), jnp.float32)}  # no dimension divisible

    def iterator(self, start, k):
        def input_fn(ctx):
            bs = ctx.get_per_replica_batch_size(16)
            r = ctx.input_pipeline_id
            for t in range(start, start + k):
                yield self.x[t][r * bs:(r + 1) * bs]

        return self.rep.prepare_input(
            input_fn, replication_mode=self.jr.InputReplicationMode.PER_REPLICA)


_TRAINING: list = []


def _training() -> _Training:
    if not _TRAINING:
        _TRAINING.append(_Training())
    return _TRAINING[0]


class ShardedTrainingMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.t = _training()
        self.want = (self.t.params0, self.t.tx.init(self.t.params0))
        self.state = jax.tree.map(jnp.copy, self.want)  # (donated by the rules)
        self.step = 0

    def _advance(self, k):
        for i in range(self.step, self.step + k):
            self.want = self.t.reference(*self.want, self.t.x[i])
        self.step += k

    @precondition(lambda self: self.step < 12)
    @rule(donate=st.booleans())
    def run_one(self, donate):
        p, s = self.state
        self.state = None
        self.state = self.t.rep.run(self.t.step, self.t.x[self.step], p, s,
                                    donate_argnums=(0, 1) if donate else ())
        self._advance(1)

    @precondition(lambda self: self.step <= 10)
    @rule(donate=st.booleans())
    def run_loop(self, donate):
        p, s = self.state
        self.state = None
        self.state = self.t.rep.run(self.t.step, self.t.iterator(self.step, 2), p, s,
                                    steps=2, donate_argnums=(0, 1) if donate else ())
        self._advance(2)

    @rule()
    def replicated_copy(self):
        # as restored from a checkpoint, or created in scope(): resharded by the next run
        self.state = jax.device_put(self.state, self.t.rep.strategy.layout.replicated)

    @invariant()
    def equals_reference(self):
        for a, b in zip(jax.tree.leaves(self.state), jax.tree.leaves(self.want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


TestShardedTraining = ShardedTrainingMachine.TestCase
TestShardedTraining.settings = settings(max_examples=8, stateful_step_count=6, deadline=None,
                                       database=None, derandomize=True)
