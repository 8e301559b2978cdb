"""weight_update_sharding=: state sharded over the replicas (ZeRO-1 / ZeRO-3).

References are one-device optax computed here on the concatenated global batch, never
by jreplicate.
"""

import inspect
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate.execution import sharded_program
from tests._models import init_mlp, make_data, mlp, per_example_loss

STRATEGIES = {
    "MirroredStrategy": lambda **kw: jr.MirroredStrategy(**kw),
    "TPUStrategy": lambda **kw: jr.TPUStrategy(devices=jax.devices(), **kw),
    "MultiWorkerStrategy": lambda **kw: jr.MultiWorkerStrategy(**kw),
}


# -- the option ---------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("level", [None, "optimizer", "parameters"])
def test_option_is_stored_on_the_layout(name, level):
    s = STRATEGIES[name](weight_update_sharding=level, min_weight_shard_size=0)
    assert s.weight_update_sharding == level
    assert s.layout.weight_update_sharding == level
    assert s.layout.min_weight_shard_size == 0
    assert (f"weight_update_sharding={level!r}" in repr(s)) == (level is not None)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("value, error, words", [
    ("zero3", ValueError, "is not a choice"),
    ("", ValueError, "is not a choice"),
    (True, TypeError, "must be None"),
    (1, TypeError, "must be None"),
])
def test_bad_level_names_argument_and_choices(name, value, error, words):
    with pytest.raises(error, match=words) as e:
        STRATEGIES[name](weight_update_sharding=value)
    msg = str(e.value)
    assert f"{name}(weight_update_sharding=" in msg
    assert "'optimizer'" in msg and "'parameters'" in msg


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError),
                                          (True, TypeError), ("8", TypeError)])
def test_bad_min_size(name, value, error):
    with pytest.raises(error, match=rf"{name}\(min_weight_shard_size="):
        STRATEGIES[name](weight_update_sharding="optimizer", min_weight_shard_size=value)


@pytest.mark.parametrize("cls", [jr.MirroredStrategy, jr.TPUStrategy, jr.MultiWorkerStrategy])
def test_options_are_keyword_only(cls):
    params = inspect.signature(cls).parameters
    for name, default in (("weight_update_sharding", None), ("min_weight_shard_size", 1024)):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default


def test_parameter_server_refuses_the_option():
    with pytest.raises(TypeError, match="weight_update_sharding"):
        jr.ParameterServerStrategy(num_ps=1, num_workers=1, weight_update_sharding="optimizer")


# -- training equals the one-device reference -----------------------------------------

GLOBAL_BATCH = 32
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "momentum": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), 3),
    "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
}


def _loss(params, x, y):
    return jnp.sum(per_example_loss(mlp(params, x), y)) / GLOBAL_BATCH


def _make_step(tx):
    def step(ctx, batch, params, opt_state):
        x, y = batch
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _reference(tx, params, data, steps):
    """One device, the whole global batch, plain optax (one jitted step)."""
    @jax.jit
    def one(params, opt_state, x, y):
        grads = jax.grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state = tx.init(params)
    for t in range(steps):
        params, opt_state = one(params, opt_state, data[0][t], data[1][t])
    return params, opt_state


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt, level", [
    ("sgd", "optimizer"), ("sgd", "parameters"), ("momentum", "optimizer"),
    ("adamw", "parameters"), ("multisteps", "optimizer"), ("clip_adam", "parameters")])
def test_training_equals_one_device_reference(opt, level):
    tx = OPTIMIZERS[opt]()
    params0 = init_mlp(jax.random.key(0))
    data = make_data(4, GLOBAL_BATCH)
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding=level,
                                            min_weight_shard_size=0))
    step = _make_step(tx)
    params, opt_state = params0, tx.init(params0)
    for t in range(4):
        params, opt_state, _ = rep.run(step, (data[0][t], data[1][t]), params, opt_state)
    _close((params, opt_state), _reference(tx, params0, data, 4))
    # the state the weight update alone reads is sharded (adam's moments, momentum)
    moments = [x for x in jax.tree.leaves(opt_state) if x.shape == (16, 32)]
    assert all(x.sharding.spec == P(None, "replica") for x in moments)
    assert all(not x.sharding.is_fully_replicated for x in moments)


def _adam_run(level, steps=2, **strategy):
    tx = optax.adam(1e-2)
    params0 = init_mlp(jax.random.key(0))
    data = make_data(steps, GLOBAL_BATCH)
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding=level, **strategy))
    step = _make_step(tx)
    params, opt_state = params0, tx.init(params0)
    for t in range(steps):
        params, opt_state, _ = rep.run(step, (data[0][t], data[1][t]), params, opt_state)
    return rep, step, (data[0][0], data[1][0]), params, opt_state


def test_layout_per_leaf_and_bytes_per_device(caplog):
    # sizes (16, 32, 10): w1 [16, 32] -> dim 1, b1 [32] -> dim 0, w2 [32, 10] -> dim 0,
    # b2 [10] (no dimension divisible by 8) and count (a scalar) replicated
    _, _, _, params, opt_state = _adam_run("parameters", min_weight_shard_size=0)
    adam = opt_state[0]
    want = [{"w": P(None, "replica"), "b": P("replica")}, {"w": P("replica"), "b": P()}]
    for tree in (params, adam.mu, adam.nu):
        assert jax.tree.map(lambda x: x.sharding.spec, tree) == want
    assert adam.count.sharding.spec == P()

    def per_device(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    whole = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    kept = sum(x.nbytes for x in jax.tree.leaves((params, opt_state))
               if x.sharding.is_fully_replicated)
    assert per_device((params, opt_state)) == kept + (whole - kept) // 8
    # "optimizer": the parameters, which the forward pass reads, stay replicated (the
    # program's one INFO line says which leaves stay replicated, and why)
    with caplog.at_level("INFO", logger="jreplicate"):
        _, _, _, params, opt_state = _adam_run("optimizer", min_weight_shard_size=0)
    (line,) = [r.getMessage() for r in caplog.records if "kept replicated" in r.getMessage()]
    assert "argument [0][0]['w']: read by the forward pass" in line
    assert "argument [1][0].mu[1]['b']: no dimension divisible by 8" in line
    assert "argument [1][0].count: a scalar" in line
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(params))
    assert opt_state[0].mu[0]["w"].sharding.spec == P(None, "replica")


def test_min_weight_shard_size_keeps_small_leaves_replicated():
    _, _, _, params, opt_state = _adam_run("parameters", min_weight_shard_size=320)
    specs = jax.tree.map(lambda x: x.sharding.spec, params)
    # w1 has 512 elements, w2 320: sharded; the biases (32, 10) are below the size
    assert specs == [{"w": P(None, "replica"), "b": P()}, {"w": P("replica"), "b": P()}]


@pytest.mark.parametrize("level", ["optimizer", "parameters"])
def test_gradients_are_reduce_scattered(level):
    rep, step, batch, params, opt_state = _adam_run(level, steps=1, min_weight_shard_size=0)
    hlo = rep.compiled(step, batch, params, opt_state).as_text()
    # one reduce-scatter per sharded gradient (w1, b1, w2), all-reduce only for b2 [10]
    assert len(re.findall(r"reduce-scatter\(", hlo)) >= 3
    reduced = re.findall(r"= f32\[([\d,]*)\][^=]*all-reduce\(", hlo)
    assert all(shape in ("10", "") for shape in reduced), reduced


@pytest.mark.parametrize("m", [1, 2])
def test_replicated_then_sharded_arguments_share_one_program(m):
    # the first call takes replicated state (and reshards it), later calls the sharded
    # state it returned: one program, compiled once (also with a model axis, where a
    # spec naming a mesh axis otherwise selects a model-sharded program)
    rep, step, batch, params, opt_state = _adam_run(
        "parameters", steps=1, min_weight_shard_size=0, logical_devices_per_replica=m)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            for _ in range(2):
                params, opt_state, _ = rep.run(step, batch, params, opt_state)
    finally:
        logging.getLogger("jax").removeHandler(handler)
    compiled = [r.getMessage() for r in records if "Compiling" in r.getMessage()]
    assert not compiled, compiled
    assert len(rep._executor._cache) == 1  # one program of this step


def test_none_keeps_todays_program():
    rep = jr.Replicator(jr.MirroredStrategy())
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    data = make_data(1, GLOBAL_BATCH)
    step = _make_step(tx)
    new, opt_state, _ = rep.run(step, (data[0][0], data[1][0]), params, tx.init(params))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves((new, opt_state)))
    (entry,) = rep._executor._cache.entries()
    (program,) = entry.programs.values()
    assert program.split is None  # the split code is not entered
    assert not isinstance(program.jitted, sharded_program.SplitJit)


# -- device loops, NNX, inspection, errors ---------------------------------------------

def _per_replica_input(rep, data, steps):
    def input_fn(ctx):
        bs = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        r = ctx.input_pipeline_id
        for t in range(steps):
            yield data[0][t][r * bs:(r + 1) * bs], data[1][t][r * bs:(r + 1) * bs]

    return rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.PER_REPLICA)


def test_device_loop_equals_separate_runs(level="parameters"):
    tx = optax.adam(1e-2)
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding=level,
                                            min_weight_shard_size=0))
    data = make_data(4, GLOBAL_BATCH)
    params0 = init_mlp(jax.random.key(0))

    def step(ctx, batch, params, opt_state):
        params, opt_state, loss = _make_step(tx)(ctx, batch, params, opt_state)
        return params, opt_state, loss, ctx.replica_id

    looped = rep.run(step, _per_replica_input(rep, data, 4), params0, tx.init(params0),
                     steps=4)
    it = _per_replica_input(rep, data, 4)
    state = (params0, tx.init(params0))
    losses = []
    for _ in range(4):
        *state, loss, _ = rep.run(step, it, *state)
        losses.append(loss)
    _close(looped[:2], state)
    _close(looped[:2], _reference(tx, params0, data, 4))
    np.testing.assert_allclose(looped[2].array, np.stack([x.array for x in losses], 1),
                               rtol=1e-6)
    assert looped[3].array.shape == (8, 4)  # per-replica outputs: [replicas, K]
    assert looped[1][0].mu[0]["w"].sharding.spec == P(None, "replica")


def test_nnx_optimizer_state_is_written_back_sharded():
    from flax import nnx

    from tests._models import NnxMLP

    data = make_data(3, GLOBAL_BATCH)

    def train(level):
        rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding=level,
                                                min_weight_shard_size=0))
        with rep.scope():
            model = NnxMLP(rngs=nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)

        def step(ctx, batch, model, opt):
            def loss_fn(m):
                return jnp.sum(per_example_loss(m(batch[0]), batch[1])) / GLOBAL_BATCH
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss

        abstract = (jax.ShapeDtypeStruct((GLOBAL_BATCH, 16), jnp.float32),
                    jax.ShapeDtypeStruct((GLOBAL_BATCH,), jnp.int32))
        expected = rep.state_shardings(step, abstract, model, opt)  # nnx.States
        for t in range(3):
            rep.run(step, (data[0][t], data[1][t]), model, opt)
        for node, want in zip((model, opt), expected, strict=True):
            got = jax.tree.map(lambda x: x.sharding, nnx.state(node))
            assert jax.tree.leaves(got) == jax.tree.leaves(want)
        return model, opt

    ref_model, _ = train(None)
    model, opt = train("parameters")
    _close(nnx.state(model), nnx.state(ref_model))
    assert model.l1.kernel.get_value().sharding.spec == P(None, "replica")
    mu = [x for x in jax.tree.leaves(nnx.state(opt)) if x.shape == (16, 32)]
    assert mu and all(x.sharding.spec == P(None, "replica") for x in mu)


def test_state_shardings_from_abstract_arguments_match_run():
    tx = optax.adam(1e-2)
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="parameters",
                                            min_weight_shard_size=0))
    step = _make_step(tx)
    params0 = init_mlp(jax.random.key(0))
    abstract = jax.eval_shape(lambda p: (p, tx.init(p)), params0)
    batch = (jax.ShapeDtypeStruct((GLOBAL_BATCH, 16), jnp.float32),
             jax.ShapeDtypeStruct((GLOBAL_BATCH,), jnp.int32))
    shardings = rep.state_shardings(step, batch, *abstract)
    # init placed where run keeps the state: no replicated copy, and no resharding
    params, opt_state = jax.jit(lambda p: (p, tx.init(p)), out_shardings=shardings)(params0)
    data = make_data(1, GLOBAL_BATCH)
    new = rep.run(step, (data[0][0], data[1][0]), params, opt_state)[:2]
    got = jax.tree.map(lambda x: x.sharding, new)
    assert jax.tree.leaves(got) == jax.tree.leaves(shardings)


def test_run_under_jit_names_the_fix():
    tx = optax.sgd(0.1)
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="optimizer"))
    step = _make_step(tx)
    params = init_mlp(jax.random.key(0))
    data = make_data(1, GLOBAL_BATCH)
    with pytest.raises(TypeError, match="outside jax.jit.*without weight_update_sharding"):
        jax.jit(lambda p, s: rep.run(step, (data[0][0], data[1][0]), p, s))(
            params, tx.init(params))


def test_a_training_step_returning_no_state_warns(caplog):
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="optimizer"))
    tx = optax.sgd(0.1)
    params = init_mlp(jax.random.key(0))
    data = (make_data(1, GLOBAL_BATCH)[0][0], make_data(1, GLOBAL_BATCH)[1][0])

    def forgot_to_return_state(ctx, batch, params, opt_state):
        return _make_step(tx)(ctx, batch, params, opt_state)[2]  # the loss only

    def evaluate(ctx, batch, params):
        return ctx.all_sum(_loss(params, *batch))

    with caplog.at_level("WARNING", logger="jreplicate"):
        rep.run(evaluate, data, params)
        assert not caplog.text  # an evaluation step has no state to shard
        rep.run(forgot_to_return_state, data, params, tx.init(params))
    assert "found no state" in caplog.text and "return params, opt_state, loss" in caplog.text


def test_model_sharded_state_keeps_model_axis_in_bfloat16():
    # 4 replicas x 2 logical devices, state split over "model": the replica axis goes
    # on another dimension; bf16 collectives in the partially manual region compile
    from jax.sharding import NamedSharding

    x = np.random.default_rng(0).normal(size=(2, GLOBAL_BATCH, 16)).astype(np.float32)
    tx = optax.adam(1e-2)

    def loss(p, x):
        return jnp.sum((jnp.tanh(x @ p["w1"]) @ p["w2"]).astype(jnp.float32) ** 2)

    def step(ctx, x, p, s):
        g = jax.grad(loss)(p, x.astype(jnp.bfloat16))
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    def train(level):
        rep = jr.Replicator(jr.MirroredStrategy(
            logical_devices_per_replica=2, weight_update_sharding=level,
            min_weight_shard_size=0))
        with rep.scope():
            p = {"w1": jax.device_put(jnp.full((16, 32), 0.1, jnp.bfloat16),
                                      NamedSharding(rep.mesh, P(None, "model"))),
                 "w2": jax.device_put(jnp.full((32, 8), 0.1, jnp.bfloat16),
                                      NamedSharding(rep.mesh, P("model", None)))}
            s = tx.init(p)
        for t in range(2):
            p, s = rep.run(step, x[t], p, s)
        return p, s

    want = train(None)
    p, s = train("parameters")
    assert p["w1"].sharding.spec == P("replica", "model")
    assert p["w2"].sharding.spec == P("model", "replica")
    assert s[0].mu["w1"].sharding.spec == P("replica", "model")
    for a, b in zip(jax.tree.leaves((p, s)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-2)


def test_tpu_strategy_steps_per_run_and_axis_name():
    tx = optax.adam(1e-2)
    rep = jr.Replicator(jr.TPUStrategy(
        devices=jax.devices(), steps_per_run=2, axis_name="batch",
        weight_update_sharding="optimizer", min_weight_shard_size=0))
    data = make_data(2, GLOBAL_BATCH)
    params0 = init_mlp(jax.random.key(0))
    params, opt_state, _ = rep.run(_make_step(tx), _per_replica_input(rep, data, 2),
                                   params0, tx.init(params0))  # one loop of 2 steps
    _close((params, opt_state), _reference(tx, params0, data, 2))
    assert opt_state[0].mu[0]["w"].sharding.spec == P(None, "batch")


def test_step_returning_constants_and_its_input():
    # literal outputs of the traced body, and an argument returned unchanged besides its
    # new value (regression: a literal output raised "unhashable type: 'Literal'")
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="parameters",
                                            min_weight_shard_size=0))
    tx = optax.sgd(0.1)

    def step(ctx, x, w, s):
        g = jax.grad(lambda w: jnp.sum((x @ w) ** 2) / 64)(w)
        u, s = tx.update(g, s, w)
        return optax.apply_updates(w, u), s, 1.0, jnp.float32(2.0), w

    w0 = jnp.ones((4, 16))
    x = np.ones((64, 4), np.float32)
    w, _, one, two, old = rep.run(step, x, w0, tx.init(w0))
    assert (float(one), float(two)) == (1.0, 2.0)
    np.testing.assert_array_equal(old, w0)
    assert w.sharding.spec == P(None, "replica") and old.sharding.is_fully_replicated
    want = w0 - 0.1 * jax.grad(lambda w: jnp.sum((x @ w) ** 2) / 64)(w0)
    np.testing.assert_allclose(w, want, rtol=1e-6)
