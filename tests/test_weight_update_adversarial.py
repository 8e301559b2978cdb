"""weight_update_sharding= as an adversarial user uses it: optax habits, odd state, odd steps.

Every case compares the sharded run with ``weight_update_sharding=None`` and with a
one-device reference computed here (plain ``jax.jit`` of the same update on the whole
global batch), never by jreplicate. The feature meetings (device loops, donation, NNX,
logical devices, padded input, prefetch, checkpoints, processes) are tested elsewhere.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from tests._models import init_mlp, make_data, mlp, per_example_loss

GLOBAL_BATCH = 32
LEVELS = ("optimizer", "parameters")
DATA = make_data(3, GLOBAL_BATCH)
PARAMS = init_mlp(jax.random.key(0))


def _rep(level, n=8, **kw):
    return jr.Replicator(jr.MirroredStrategy(
        devices=jax.devices()[:n], weight_update_sharding=level, min_weight_shard_size=0,
        **kw))


def _batch(t):
    return DATA[0][t], DATA[1][t]


def _loss(params, x, y):
    return jnp.sum(per_example_loss(mlp(params, x), y)) / GLOBAL_BATCH


def _close(got, want, rtol=1e-5, atol=1e-6):
    got_l = jax.tree.leaves(got)
    want_l = jax.tree.leaves(want)
    assert len(got_l) == len(want_l)
    for a, b in zip(got_l, want_l, strict=True):
        if jnp.issubdtype(getattr(a, "dtype", None), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        if a.dtype.kind in "biu":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(a.astype(np.complex128), b.astype(np.complex128),
                                       rtol=rtol, atol=atol)


# -- a property: optax transforms x odd state leaves ------------------------------------

TRANSFORMS = {
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 4)),
    "masked": lambda: optax.masked(
        optax.adam(1e-2), [{"w": True, "b": False}, {"w": False, "b": True}]),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "s": optax.sgd(0.1, momentum=0.9)},
        [{"w": "a", "b": "s"}, {"w": "s", "b": "a"}]),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "prodigy": lambda: optax.contrib.prodigy(1.0),
    "schedule_free": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "ema_after_adam": lambda: optax.chain(optax.adam(1e-2), optax.ema(0.9)),
    "apply_if_finite": lambda: optax.apply_if_finite(optax.adamw(1e-2), 2),
    "warmup_cosine": lambda: optax.adamw(optax.warmup_cosine_decay_schedule(0., 1e-2, 2, 9)),
}

# name: (initial value, its update from (value, summed grads, ctx)); each
# new value is replica-invariant (state, not a PerReplica output)
EXTRAS = {
    "int_counter": (jnp.zeros((), jnp.int32), lambda v, g, ctx: v + 1),
    "bool_flag": (jnp.zeros((), bool), lambda v, g, ctx: v | (optax.tree.norm(g) > 100.0)),
    "prng_keys": (jax.random.split(jax.random.key(3), 16),
                  lambda v, g, ctx: jax.vmap(lambda k: jax.random.split(k)[0])(v)),
    "zero_size": (jnp.zeros((0, 8)), lambda v, g, ctx: v * 2.0),
    "scalar_sum": (jnp.zeros(()), lambda v, g, ctx: v + jnp.sum(g[0]["b"])),
    "complex": ((jnp.arange(64) * (1 + 1j)).astype(jnp.complex64).reshape(8, 8),
                lambda v, g, ctx: v * (1 - 0.1j) + jnp.sum(g[1]["b"])),
    "int_histogram": (jnp.zeros((16,), jnp.int32),  # a replica sum B alone reads
                      lambda v, g, ctx: v + ctx.all_sum(jnp.ones((16,), jnp.int32))),
    "grad_norm": (jnp.zeros(()), lambda v, g, ctx: optax.tree.norm(g)),
}


def _step(tx, extras):
    def step(ctx, batch, params, opt_state, extra):
        loss, grads = jax.value_and_grad(_loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = {k: EXTRAS[k][1](v, grads, ctx) for k, v in extra.items()}
        return optax.apply_updates(params, updates), opt_state, new, loss

    return step


def _reference(tx, extras, steps, n):
    """One device, the whole global batch: ``ctx.all_sum`` of a replica-invariant value
    is ``n`` times it."""
    class Ctx:
        all_sum = staticmethod(lambda v: v * n)

    @jax.jit
    def one(params, opt_state, extra, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        new = {k: EXTRAS[k][1](v, grads, Ctx) for k, v in extra.items()}
        return optax.apply_updates(params, updates), opt_state, new

    state = PARAMS, tx.init(PARAMS), {k: EXTRAS[k][0] for k in extras}
    for t in range(steps):
        state = one(*state, *_batch(t))
    return state


def _train(level, tx, extras, steps, n):
    rep = _rep(level, n)
    state = PARAMS, tx.init(PARAMS), {k: EXTRAS[k][0] for k in extras}
    for t in range(steps):
        *state, _ = rep.run(_step(tx, extras), _batch(t), *state)
    return tuple(state)


@settings(max_examples=2, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(sorted(TRANSFORMS)),
       extras=st.lists(st.sampled_from(sorted(EXTRAS)), min_size=1, max_size=4, unique=True),
       level=st.sampled_from(LEVELS), n=st.sampled_from([2, 8]))
def test_any_transform_and_state_equal_none_and_reference(name, extras, level, n):
    tx = TRANSFORMS[name]()
    got = _train(level, tx, extras, 2, n)
    _close(got, _reference(tx, extras, 2, n), rtol=2e-5, atol=2e-6)
    _close(got, _train(None, tx, extras, 2, n))


# -- steps an adversarial user writes --------------------------------------------------

TX = optax.adam(1e-2)


def _adam_step(ctx, batch, params, opt_state):
    loss, grads = jax.value_and_grad(_loss)(params, *batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


@jax.jit
def _adam_one(params, opt_state, x, y):
    return _adam_step(None, (x, y), params, opt_state)[:2]


def _adam_reference(steps, params=PARAMS):
    state = params, TX.init(params)
    for t in range(steps):
        state = _adam_one(*state, *_batch(t))
    return state


def _collective_steps():
    update = jax.jit(TX.update)

    def jitted_update(ctx, batch, params, opt_state):  # the update one jit equation
        loss, grads = jax.value_and_grad(_loss)(params, *batch)
        updates, opt_state = update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def broadcast_grads(ctx, batch, params, opt_state):  # replica 0's summed gradient
        loss, grads = jax.value_and_grad(_loss)(params, *batch)
        updates, opt_state = TX.update(ctx.broadcast(grads, 0), opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_max(loss)

    def gathered_grads(ctx, batch, params, opt_state):  # mean of n equal copies
        loss, grads = jax.value_and_grad(_loss)(params, *batch)
        grads = jax.tree.map(lambda g: jnp.mean(g, 0), ctx.all_gather(grads))
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)

    return [jitted_update, broadcast_grads, gathered_grads]


@pytest.mark.parametrize("step", _collective_steps(), ids=lambda f: f.__name__)
def test_collectives_on_gradients(step):
    # collectives on gradients stay in the replica part (shard_map); an update jitted by
    # the user is one equation of the update part: the one-device reference's values
    rep, state = _rep("parameters"), (PARAMS, TX.init(PARAMS))
    for t in range(2):
        *state, _ = rep.run(step, _batch(t), *state)
    _close(state, _adam_reference(2))


def test_state_moves_between_replicators_and_plain_jit():
    # sharded state goes on into a None Replicator, one of 4 replicas, another level,
    # a second Replicator on the same strategy, plain jax.jit, and an eval step
    want = _adam_reference(3)
    rep = _rep("parameters")
    state = tuple(rep.run(_adam_step, _batch(0), PARAMS, TX.init(PARAMS))[:2])
    for other in (_rep(None, 4), _rep("optimizer", 4)):
        _close(other.run(_adam_step, _batch(1), *state)[:2], _adam_reference(2))
    twin = jr.Replicator(rep.strategy)
    state = tuple(twin.run(_adam_step, _batch(1), *state)[:2])
    _close(state, _adam_reference(2))
    doubled = jax.jit(lambda p: jax.tree.map(lambda x: 2 * x, p))(state[0])
    _close(doubled, jax.tree.map(lambda x: 2 * x, _adam_reference(2)[0]))

    def evaluate(ctx, batch, params):
        return jnp.sum(per_example_loss(mlp(params, batch[0]), batch[1]))

    total = rep.reduce("sum", rep.run(evaluate, _batch(2), state[0]))
    np.testing.assert_allclose(
        total, jnp.sum(per_example_loss(mlp(_adam_reference(2)[0], DATA[0][2]), DATA[1][2])),
        rtol=1e-5)
    state = tuple(rep.run(_adam_step, _batch(2), *state)[:2])
    _close(state, want)


def test_changed_structure_recompiles_never_a_stale_plan():
    rep = _rep("parameters")
    state = tuple(rep.run(_adam_step, _batch(0), PARAMS, TX.init(PARAMS))[:2])
    wider = init_mlp(jax.random.key(1), sizes=(16, 64, 10))  # new shapes
    new = rep.run(_adam_step, _batch(0), wider, TX.init(wider))[:2]
    _close(new, _adam_reference(1, wider))
    assert new[0][0]["w"].sharding.spec == P(None, "replica")
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)  # new dtypes
    p, _, _ = rep.run(_adam_step, _batch(0), half, TX.init(half))
    assert p[0]["w"].dtype == jnp.bfloat16
    _close(rep.run(_adam_step, _batch(1), *state)[:2], _adam_reference(2))  # the old plan


def test_varying_state_stays_per_replica():
    # a step returning a per-replica value in a state slot (local batch statistics), or
    # an update reading a varying value: a PerReplica, as with None, never forced into a
    # sharded global array
    def step(ctx, batch, params, opt_state, stats):
        new, opt_state, loss = _adam_step(ctx, batch, params, opt_state)
        one = 1.0 + 0.0 * ctx.replica_id.astype(jnp.float32) * loss
        scaled = jax.tree.map(lambda p, q: p + one * (q - p), params, new)
        return new, opt_state, 0.9 * stats + 0.1 * jnp.mean(batch[0], 0), scaled

    outs = {}
    for level in (None, "parameters"):
        outs[level] = _rep(level).run(step, _batch(0), PARAMS, TX.init(PARAMS),
                                      jnp.zeros((16,)))
    got = outs["parameters"]
    assert isinstance(got[2], jr.PerReplica)
    assert all(isinstance(x, jr.PerReplica) for x in jax.tree.leaves(
        got[3], is_leaf=lambda x: isinstance(x, jr.PerReplica)))
    _close(got, outs[None])
    _close(outs["parameters"][:2], _adam_reference(1))


@pytest.mark.parametrize("size, sharded", [(512, True), (513, False)])
def test_min_weight_shard_size_edges(size, sharded):
    # w1 [16, 32] has 512 elements: a leaf of exactly min_weight_shard_size is sharded
    rep = jr.Replicator(jr.MirroredStrategy(weight_update_sharding="parameters",
                                            min_weight_shard_size=size))
    p, o, _ = rep.run(_adam_step, _batch(0), PARAMS, TX.init(PARAMS))
    assert (p[0]["w"].sharding.spec == P(None, "replica")) == sharded
    _close((p, o), _adam_reference(1))


def test_one_array_passed_as_two_donated_arguments():
    # the same parameters as two arguments, both donated, each updated differently
    def two(ctx, batch, a, b):
        grads = jax.grad(_loss)(a, *batch)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, a, grads),
                jax.tree.map(lambda p, g: p - 0.2 * g, b, grads))

    params = jax.tree.map(jnp.copy, PARAMS)
    a, b = _rep("parameters").run(two, _batch(0), params, params, donate_argnums=(0, 1))
    grads = jax.jit(jax.grad(_loss))(PARAMS, *_batch(0))
    _close(a, jax.tree.map(lambda p, g: p - 0.1 * g, PARAMS, grads))
    _close(b, jax.tree.map(lambda p, g: p - 0.2 * g, PARAMS, grads))


def test_flax_train_state_as_one_argument():
    # the Flax habit: one TrainState in, its apply_gradients out; the optimizer state
    # comes back sharded, the values equal the one-device reference
    from flax.training import train_state

    def apply(variables, x):
        return mlp(variables["params"], x)

    state = train_state.TrainState.create(apply_fn=apply, params=PARAMS, tx=TX)

    def step(ctx, batch, state):
        def loss(p):
            return jnp.sum(per_example_loss(state.apply_fn({"params": p}, batch[0]),
                                            batch[1])) / GLOBAL_BATCH

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rep = _rep("optimizer")
    for t in range(2):
        state = rep.run(step, _batch(t), state)
    _close((state.params, state.opt_state), _adam_reference(2))
    assert int(state.step) == 2
    assert state.opt_state[0].mu[0]["w"].sharding.spec == P(None, "replica")
