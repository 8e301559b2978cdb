"""Weight-update-sharded (ZeRO) state through :class:`jreplicate.CheckpointManager`
(one process, 8 devices): saved from ``weight_update_sharding="optimizer"`` and
``"parameters"``, in single steps and device loops, with the saved arrays donated to
the next step at once; restored with ``shardings=rep.state_shardings(...)`` sharded as
it was saved (each leaf's sharding and bytes per device), onto 8 devices and resharded
onto 4; training then goes on as if never interrupted.

The trap this guards (T3 of the checkpoint plan): ``jax.eval_shape(init_fn)`` forgets
where ``init_fn`` puts its arrays, so without ``shardings=`` the restored state is
replicated (the memory promise broken, silently, until the next ``run`` reshards it).

References: the uninterrupted run of the same job on the same devices (bit for bit: the
same program on the same shards), and on another replica count the 8-device run (to
float tolerance: the reduction order differs), both trained here, never restored.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jreplicate as jr

D_IN, D_OUT, GLOBAL_BATCH, STEPS, SAVE_AT = 64, 32, 32, 8, 4
rng = np.random.default_rng(0)
X = rng.normal(size=(STEPS * GLOBAL_BATCH, D_IN)).astype(np.float32)
Y = (X @ rng.normal(size=(D_IN, D_OUT)) / 8).astype(np.float32)
tx = optax.adam(0.01)


def init():
    params = {"w": jnp.zeros((D_IN, D_OUT)), "b": jnp.zeros(D_OUT)}
    return params, tx.init(params)


def step(ctx, batch, params, opt):
    x, y = batch

    def loss_fn(p):
        err = x @ p["w"] + p["b"] - y
        return jr.compute_average_loss(jnp.sum(err ** 2, -1), GLOBAL_BATCH)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, ctx.all_sum(loss)


def input_fn_starting_at(first_step):
    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        for i in range(first_step * GLOBAL_BATCH, len(X), b):
            yield X[i:i + b], Y[i:i + b]
    return input_fn


def strategy(mode, devices=8):
    return jr.MirroredStrategy(devices=jax.devices()[:devices], weight_update_sharding=mode)


def train(rep, state, first, last, k, mngr=None):
    """Steps ``first`` to ``last`` in device loops of ``k``, donating the state, saving
    (with ``mngr``) at every run boundary. Returns the state and the host copy of the
    state handed to ``save`` at ``SAVE_AT`` (taken before the next step donates it)."""
    inputs = rep.prepare_input(input_fn_starting_at(first))
    params, opt = state
    at, saved = first, None
    while at < last:
        params, opt, _ = rep.run(step, inputs, params, opt, steps=loop(k),
                                 donate_argnums=(0, 1))
        at += k
        if mngr is not None and mngr.save(at, (params, opt)):
            saved = jax.tree.map(np.array, (params, opt))  # values as the save saw them
    return (params, opt), saved


def loop(k):
    """``run``'s ``steps=``: single steps for 1 (``steps=1`` is a device loop of one)."""
    return k if k > 1 else None


def bits(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
                     for x in leaves]


def bytes_per_device(x):
    return {s.data.nbytes for s in x.addressable_shards}


def fresh_state(rep, shardings=None):
    with rep.scope():
        return jax.jit(init, out_shardings=shardings)() if shardings else init()


def sharded_leaves(tree, n):
    return [x for x in jax.tree.leaves(tree) if bytes_per_device(x) == {x.nbytes // n}]


@pytest.fixture(scope="module", params=[("optimizer", 1), ("parameters", 1),
                                        ("optimizer", 2)],
                ids=lambda p: f"{p[0]}-steps{p[1]}")
def saved(request, tmp_path_factory):
    """Checkpoint ``SAVE_AT`` of an 8-replica job (``mode``, device loops of ``k``) with
    the live state it saved (its shardings), the values handed to save, and the
    parameters of the job run to ``STEPS`` uninterrupted."""
    mode, k = request.param
    directory = tmp_path_factory.mktemp(f"zero-{mode}-{k}")
    rep = jr.Replicator(strategy(mode))
    with jr.CheckpointManager(directory, rep, save_interval_steps=SAVE_AT) as mngr:
        live, values = train(rep, fresh_state(rep), 0, SAVE_AT, k, mngr)
    layout = jax.tree.map(lambda x: (x.sharding, bytes_per_device(x)), live)
    final, _ = train(rep, live, SAVE_AT, STEPS, k)
    return {"mode": mode, "k": k, "directory": directory, "layout": layout,
            "values": values, "final": jax.tree.map(np.array, final)}


def test_zero_state_is_sharded_before_the_save(saved):
    """The premise: the state saved holds leaves sharded over the 8 replicas (at
    "parameters", the parameters too)."""
    sizes = [b for _, b in jax.tree.leaves(saved["layout"], is_leaf=lambda t: isinstance(
        t, tuple) and len(t) == 2 and isinstance(t[1], set))]
    assert sizes
    mu_w = saved["layout"][1][0].mu["w"]
    assert mu_w[1] == {D_IN * D_OUT * 4 // 8}, mu_w
    w = saved["layout"][0]["w"]
    assert w[1] == ({D_IN * D_OUT * 4 // 8} if saved["mode"] == "parameters"
                    else {D_IN * D_OUT * 4}), w


def test_restored_with_shardings_as_saved_and_training_goes_on_bit_for_bit(saved):
    rep = jr.Replicator(strategy(saved["mode"]))
    abstract = jax.eval_shape(init)
    shardings = rep.state_shardings(step, rep.prepare_input(input_fn_starting_at(0)),
                                    *abstract, steps=loop(saved["k"]))
    with jr.CheckpointManager(saved["directory"], rep) as mngr:
        at, state = mngr.restore_or_initialize(init, shardings=shardings)
    assert at == SAVE_AT
    assert bits(state) == bits(saved["values"])
    for x, (sharding, per_device) in zip(
            jax.tree.leaves(state), jax.tree.leaves(
                saved["layout"], is_leaf=lambda t: isinstance(t, tuple) and len(t) == 2
                and isinstance(t[1], set)), strict=True):
        assert x.sharding.is_equivalent_to(sharding, x.ndim), (x.sharding, sharding)
        assert bytes_per_device(x) == per_device
    final, _ = train(rep, state, SAVE_AT, STEPS, saved["k"])
    assert bits(final) == bits(saved["final"])


def test_without_shardings_the_state_comes_back_replicated_and_equal(saved):
    """``jax.eval_shape(init)`` carries no placement: the state is restored replicated
    (the documented fallback), and the next run reshards it: the same values."""
    rep = jr.Replicator(strategy(saved["mode"]))
    with jr.CheckpointManager(saved["directory"], rep) as mngr:
        _, state = mngr.restore_or_initialize(init)
    assert bits(state) == bits(saved["values"])
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
    final, _ = train(rep, state, SAVE_AT, STEPS, saved["k"])
    np.testing.assert_allclose(final[0]["w"], saved["final"][0]["w"], rtol=1e-6, atol=1e-7)


def test_restored_onto_4_replicas_resharded(saved):
    rep = jr.Replicator(strategy(saved["mode"], devices=4))
    abstract = jax.eval_shape(init)
    shardings = rep.state_shardings(step, rep.prepare_input(input_fn_starting_at(0)),
                                    *abstract, steps=loop(saved["k"]))
    with jr.CheckpointManager(saved["directory"], rep) as mngr:
        _, state = mngr.restore_or_initialize(init, shardings=shardings)
    assert bits(state) == bits(saved["values"])
    mu_w = state[1][0].mu["w"]
    assert len(mu_w.sharding.device_set) == 4
    assert bytes_per_device(mu_w) == {D_IN * D_OUT * 4 // 4}
    assert len(sharded_leaves(state, 4)) == len(sharded_leaves(
        fresh_state(rep, shardings), 4))
    final, _ = train(rep, state, SAVE_AT, STEPS, saved["k"])
    for got, want in zip(jax.tree.leaves(final), jax.tree.leaves(saved["final"]),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_an_init_fn_jitted_with_the_state_shardings_restores_sharded_too(saved):
    """The other way to say where state goes: ``init_fn`` jitted with
    ``out_shardings=rep.state_shardings(...)`` (``jax.eval_shape`` keeps a jitted
    function's output shardings), as docs/guides/weight_update_sharding.md shows."""
    rep = jr.Replicator(strategy(saved["mode"]))
    shardings = rep.state_shardings(step, rep.prepare_input(input_fn_starting_at(0)),
                                    *jax.eval_shape(init), steps=loop(saved["k"]))
    with jr.CheckpointManager(saved["directory"], rep) as mngr:
        _, state = mngr.restore_or_initialize(jax.jit(init, out_shardings=shardings))
    assert bits(state) == bits(saved["values"])
    for x, (_, per_device) in zip(jax.tree.leaves(state), jax.tree.leaves(
            saved["layout"], is_leaf=lambda t: isinstance(t, tuple) and len(t) == 2
            and isinstance(t[1], set)), strict=True):
        assert bytes_per_device(x) == per_device


# -- Flax NNX on logical devices (replica x model), restored onto fewer replicas -------

nnx = pytest.importorskip("flax.nnx")
NNX_BATCH = 16
NNX_X = rng.normal(size=(6 * NNX_BATCH, 16)).astype(np.float32)
NNX_Y = rng.normal(size=(6 * NNX_BATCH, 5)).astype(np.float32)


class Net(nnx.Module):
    def __init__(self, rngs):
        split = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.l1 = nnx.Linear(16, 32, kernel_init=split, rngs=rngs)
        self.l2 = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def nnx_step(ctx, batch, model, opt):
    x, y = batch
    loss, grads = nnx.value_and_grad(lambda m: jr.compute_average_loss(
        jnp.sum((m(x) - y) ** 2, -1), NNX_BATCH))(model)
    opt.update(model, grads)
    return ctx.all_sum(loss)


def nnx_job(devices):
    rep = jr.Replicator(jr.MirroredStrategy(
        devices=jax.devices()[:devices], logical_devices_per_replica=2,
        weight_update_sharding="optimizer", min_weight_shard_size=0))
    with rep.scope():
        model = Net(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(0.01), wrt=nnx.Param)
    return rep, model, opt


def nnx_train(job, first, last):
    rep, model, opt = job

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(NNX_BATCH)
        for i in range(first * NNX_BATCH, last * NNX_BATCH, b):
            yield NNX_X[i:i + b], NNX_Y[i:i + b]

    inputs = rep.prepare_input(input_fn)
    for _ in range(first, last):
        rep.run(nnx_step, inputs, model, opt)
    return inputs


def test_nnx_state_on_logical_devices_restores_onto_fewer_replicas(tmp_path):
    """An NNX model split over "model" with its adam moments also split over the
    replicas (P('replica', 'model')), saved from 4 replicas x 2 (through a state
    function), restored onto 2 replicas x 2 with the shardings that job's step keeps,
    bit for bit, then trained on like the 8-device job (to float tolerance)."""
    job = nnx_job(8)
    nnx_train(job, 0, 3)
    with jr.CheckpointManager(tmp_path, job[0]) as mngr:
        mngr.save(3, lambda: (nnx.state(job[1]), nnx.state(job[2])))
    mu = job[2].opt_state[0].mu["l1"]["kernel"][...]
    assert mu.sharding.spec == P("replica", "model") and bytes_per_device(mu) == {
        mu.nbytes // 8}
    saved = jax.tree.map(np.array, (nnx.state(job[1]), nnx.state(job[2])))
    nnx_train(job, 3, 6)
    final = jax.tree.map(np.array, nnx.state(job[1]))

    rep, model, opt = small = nnx_job(4)
    probe = jax.ShapeDtypeStruct((NNX_BATCH // 2, 16), np.float32), jax.ShapeDtypeStruct(
        (NNX_BATCH // 2, 5), np.float32)  # a batch: only its shapes and dtypes
    shardings = rep.state_shardings(nnx_step, probe, model, opt)
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        at, (m_state, o_state) = mngr.restore_or_initialize(
            lambda: (nnx.state(model), nnx.state(opt)), shardings=shardings)
    assert at == 3 and bits((m_state, o_state)) == bits(saved)
    nnx.update(model, m_state)
    nnx.update(opt, o_state)
    mu = opt.opt_state[0].mu["l1"]["kernel"][...]
    assert mu.sharding.spec == P("replica", "model") and len(mu.sharding.device_set) == 4
    assert bytes_per_device(mu) == {mu.nbytes // 4}
    nnx_train(small, 3, 6)
    for got, want in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(final),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
