"""weight_update_sharding= with a step whose gradients come from a nested ``jax.jit``,
and with a step that does not return its state first.

References are one-device optax computed here on the concatenated global batch, never
by jreplicate, and the same step under ``weight_update_sharding=None``.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate import _jax_compat as jc
from tests._models import init_mlp, make_data, mlp, per_example_loss
from tests.test_weight_update_sharding import _close, _reference

GLOBAL_BATCH = 32
TX = optax.adam(1e-2)


def _loss(params, x, y):
    return jnp.sum(per_example_loss(mlp(params, x), y)) / GLOBAL_BATCH


def _grads_jit_value_and_grad(params, x, y):
    return jax.jit(jax.value_and_grad(_loss))(params, x, y)


_JITTED_GRAD = jax.jit(jax.grad(_loss))


def _grads_jit_called_twice(params, x, y):
    # the same jitted function (one cached jaxpr) on two halves of the local batch
    h = x.shape[0] // 2
    g1, g2 = _JITTED_GRAD(params, x[:h], y[:h]), _JITTED_GRAD(params, x[h:], y[h:])
    return _loss(params, x, y), jax.tree.map(jnp.add, g1, g2)


@functools.partial(jax.jit, static_argnums=3, donate_argnums=1)
def _static_donated(params, x, y, scale):
    return jax.jit(jax.value_and_grad(lambda p: scale * _loss(p, x, y)))(params)


def _grads_jit_in_jit_static_donated(params, x, y):
    return _static_donated(params, x * 1.0, y, 1.0)  # (x * 1.0: a value it may donate)


GRADS = {"value_and_grad": _grads_jit_value_and_grad, "called_twice": _grads_jit_called_twice,
         "nested_static_donated": _grads_jit_in_jit_static_donated}


def _step(grads_fn):
    def step(ctx, batch, params, opt_state):
        loss, grads = grads_fn(params, *batch)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _train(level, step, data, steps):
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding=level,
                                            min_weight_shard_size=0))
    params0 = init_mlp(jax.random.key(0))
    state = (params0, TX.init(params0))
    for t in range(steps):
        *state, _ = rep.run(step, (data[0][t], data[1][t]), *state)
    return rep, state


@pytest.mark.parametrize("kind, level", [
    ("value_and_grad", "optimizer"), ("value_and_grad", "parameters"),
    ("called_twice", "parameters"), ("nested_static_donated", "optimizer")])
def test_gradients_of_a_nested_jit_are_reduce_scattered(level, kind, caplog):
    step, data = _step(GRADS[kind]), make_data(2, GLOBAL_BATCH)
    with caplog.at_level("WARNING", logger="jreplicate"):
        rep, state = _train(level, step, data, 2)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # a correct step
    _close(state, _reference(TX, init_mlp(jax.random.key(0)), data, 2))
    if kind == "value_and_grad":  # and equal to the unsharded program's
        _close(state, _train(None, step, data, 2)[1])
    assert state[1][0].mu[0]["w"].sharding.spec == P(None, "replica")
    hlo = rep.compiled(step, (data[0][0], data[1][0]), *state).as_text()
    # a reduce-scatter per sharded gradient (w1, b1, w2); an all-reduce only for b2 [10]
    # (and the loss)
    assert len(re.findall(r"reduce-scatter\(", hlo)) >= 3
    reduced = re.findall(r"= f32\[([\d,]*)\][^=]*all-reduce\(", hlo)
    assert all(shape in ("10", "") for shape in reduced), reduced


def test_nested_jit_in_a_device_loop_equals_reference():
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="parameters",
                                            min_weight_shard_size=0))
    data = make_data(3, GLOBAL_BATCH)

    def input_fn(ctx):
        bs = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        r = ctx.input_pipeline_id
        for t in range(3):
            yield data[0][t][r * bs:(r + 1) * bs], data[1][t][r * bs:(r + 1) * bs]

    it = rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.PER_REPLICA)
    params0 = init_mlp(jax.random.key(0))
    step = _step(_grads_jit_called_twice)
    params, opt_state, _ = rep.run(step, it, params0, TX.init(params0), steps=3)
    _close((params, opt_state), _reference(TX, params0, data, 3))
    assert params[0]["w"].sharding.spec == P(None, "replica")


def test_a_nested_jit_left_whole_warns_with_the_fix(caplog, monkeypatch):
    # a call the inliner leaves whole (e.g. one with constants attached): the warning
    monkeypatch.setattr(jc, "_called_jaxpr", lambda eqn: None)
    step, data = _step(_grads_jit_value_and_grad), make_data(1, GLOBAL_BATCH)
    with caplog.at_level("WARNING", logger="jreplicate"):
        _, state = _train("optimizer", step, data, 1)
    (msg,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "inside the nested jax.jit" in msg and "stays an all-reduce" in msg
    assert "call jax.grad outside jax.jit inside the step" in msg
    _close(state, _reference(TX, init_mlp(jax.random.key(0)), data, 1))  # still right


# -- the inliner itself: same values, no nested call, each variable defined once --------

def _program(x, w):
    inner = jax.jit(lambda a, b: (jnp.sin(a) * b, a, 2.0))  # passes an input through

    @jax.jit
    def outer(a, b):
        y, same, two = inner(a, b)
        z, _, _ = inner(y + 1.0, b)  # the same jaxpr called twice
        return z * two, same

    u, v = outer(x, w)
    p, _ = outer(u, w)
    return p + v, jax.lax.cond(x[0] > 0, lambda: jax.jit(jnp.cos)(x), lambda: x)


def test_inline_calls_keeps_values_and_defines_each_variable_once():
    x, w = jnp.linspace(-1.0, 1.0, 8), jnp.arange(8.0)
    closed = jax.make_jaxpr(_program)(x, w)
    inlined = jc.inline_calls(closed.jaxpr)
    names = [e.primitive.name for e in inlined.eqns]
    assert "jit" not in names and "cond" in names  # control flow kept whole
    defined = [v for e in inlined.eqns for v in e.outvars if jc.is_var(v)]
    assert len(defined) == len(set(defined))
    got = jax.core.eval_jaxpr(inlined, closed.consts, x, w)
    want = _program(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    assert jc.inline_calls(inlined) is inlined  # nothing left to inline


# -- a step that does not return its state first -----------------------------------------

def _warnings(caplog, level, step, *args):
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding=level,
                                            min_weight_shard_size=0))
    data = make_data(1, GLOBAL_BATCH)
    with caplog.at_level("WARNING", logger="jreplicate"):
        caplog.clear()
        for _ in range(2):  # the warning comes once per program
            rep.run(step, (data[0][0], data[1][0]), *args)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_state_not_returned_first_warns_once_naming_the_argument(caplog):
    params = init_mlp(jax.random.key(0))
    tx = optax.sgd(0.1)

    def returns_a_dict(ctx, batch, params):
        grads = jax.grad(_loss)(params, *batch)
        return {"params": jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)}, 0.0

    (msg,) = _warnings(caplog, "parameters", returns_a_dict, params)
    assert "no output carries them back" in msg and "argument [0][0]['w']" in msg
    assert "Return the new state first, in argument order" in msg

    def state_last(ctx, batch, params, opt_state):
        new, opt_state, loss = _step_tx(tx)(ctx, batch, params, opt_state)
        return loss, new, opt_state

    (msg,) = _warnings(caplog, "parameters", state_last, params, tx.init(params))
    assert "argument [0]" in msg and "no output carries them back" in msg


def _step_tx(tx):
    def step(ctx, batch, params, opt_state):
        loss, grads = jax.value_and_grad(_loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


@pytest.mark.parametrize("level", ["optimizer", "parameters"])
def test_correct_and_evaluation_steps_do_not_warn(caplog, level):
    params = init_mlp(jax.random.key(0))

    def evaluate(ctx, batch, params):
        return ctx.all_sum(_loss(params, *batch))

    if level == "parameters":  # (the nested-jit steps above are checked too)
        assert _warnings(caplog, level, _step_tx(TX), params, TX.init(params)) == []
    assert _warnings(caplog, level, evaluate, params) == []
