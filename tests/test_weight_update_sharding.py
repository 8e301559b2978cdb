"""weight_update_sharding=: state sharded over the replicas (ZeRO-1 / ZeRO-3).

References are one-device optax computed here on the concatenated global batch, never
by jreplicate.
"""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jreplicate as jr
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
    opt_state = tx.init(params)
    for t in range(steps):
        grads = jax.grad(_loss)(params, data[0][t], data[1][t])
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, opt_state


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("level", ["optimizer", "parameters"])
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


def test_layout_per_leaf_and_bytes_per_device():
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
    # "optimizer": the parameters, which the forward pass reads, stay replicated
    _, _, _, params, opt_state = _adam_run("optimizer", min_weight_shard_size=0)
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


def test_replicated_then_sharded_arguments_share_one_program():
    rep, step, batch, params, opt_state = _adam_run("parameters", steps=1,
                                                   min_weight_shard_size=0)
    with jax.log_compiles(True):
        import logging
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("jax").addHandler(handler)
        try:
            params, opt_state, _ = rep.run(step, batch, params, opt_state)
            params, opt_state, _ = rep.run(step, batch, params, opt_state)
        finally:
            logging.getLogger("jax").removeHandler(handler)
    compiled = [r for r in records if "Compiling" in r.getMessage() and "step" in
                r.getMessage() or "program" in r.getMessage()]
    assert not compiled, [r.getMessage() for r in compiled]


def test_none_keeps_todays_program():
    rep = jr.Replicator(jr.MirroredStrategy())
    tx = optax.adam(1e-2)
    params = init_mlp(jax.random.key(0))
    data = make_data(1, GLOBAL_BATCH)
    step = _make_step(tx)
    new, opt_state, _ = rep.run(step, (data[0][0], data[1][0]), params, tx.init(params))
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves((new, opt_state)))
    program = next(iter(rep._executor._cache._programs_for_tests()), None) \
        if hasattr(rep._executor._cache, "_programs_for_tests") else None
    assert program is None or program.split is None
