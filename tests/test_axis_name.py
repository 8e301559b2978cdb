"""The replica axis name is the user's choice (``axis_name=`` on every strategy): a
``jax.pmap`` program's ``"batch"`` works unchanged, and every part of the library that
speaks of the replica axis (collectives, PerReplica, input, losses, sync_replicas,
device loops, logical devices, donation, checkpoints, the parameter server's sync
groups) follows it. References are one-device computations or the default name's run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from tests._optional import installed

# -- the strategies, each with a replica axis name ---------------------------------------

FACTORIES = {
    "mirrored-8": lambda name: jr.MirroredStrategy(axis_name=name),
    "mirrored-1": lambda name: jr.MirroredStrategy(devices=[0], axis_name=name),
    "mirrored-4x2": lambda name: jr.MirroredStrategy(logical_devices_per_replica=2,
                                                     axis_name=name),
    "tpu-8": lambda name: jr.TPUStrategy(devices=jax.devices(), axis_name=name),
    "multi-worker-1-process": lambda name: jr.MultiWorkerStrategy(axis_name=name),
    # one worker whose sync group of 2 replicas all-reduces over the named axis
    "ps-1x2": lambda name: jr.ParameterServerStrategy(num_ps=2, num_workers=1,
                                                      num_replicas_in_sync=2, axis_name=name),
}

STEPS, PER = 3, 2
_RNG = np.random.default_rng(0)
XS = _RNG.normal(size=(STEPS, 16, 5)).astype(np.float32)
YS = _RNG.normal(size=(STEPS, 16, 2)).astype(np.float32)
W0 = {"w": jnp.asarray(_RNG.normal(size=(5, 2)), jnp.float32), "b": jnp.zeros(2)}
WD = 0.01


def _reference(n: int) -> dict:
    """One device, the global batch (the first ``n * PER`` rows), mean loss plus the
    penalty once."""
    tx = optax.sgd(0.1, momentum=0.9)
    p, o = W0, tx.init(W0)
    for s in range(STEPS):
        x, y = XS[s, :n * PER], YS[s, :n * PER]
        g = jax.grad(lambda p, x=x, y=y: jnp.mean(jnp.sum((x @ p["w"] + p["b"] - y) ** 2, -1))
                     + WD * jnp.sum(p["w"] ** 2))(p)
        u, o = tx.update(g, o, p)
        p = optax.apply_updates(p, u)
    return p


def _train(strategy) -> tuple[dict, list, list]:
    """Three steps of a step written with the axis's NAME (a pmap program's collectives)
    and the library's helpers; returns the parameters, the names the step saw and the
    global losses."""
    rep = jr.Replicator(strategy)
    name, n, g = strategy.axis_name, rep.num_replicas, rep.num_replicas_in_sync
    gb = g * PER  # the examples of one update: one sync group's
    tx = jr.ps.pushable(optax.sgd(0.1, momentum=0.9))
    with rep.scope():
        p = jax.tree.map(jnp.array, W0)
        o = tx.init(p)
    seen = []

    def step(ctx, batch, p, o):
        seen.append(ctx.axis_name)
        x, y = batch
        count = jax.lax.psum(jnp.float32(x.shape[0]), name)  # by the name, as pmap code

        def loss_fn(p):
            per_example = jnp.sum((x @ p["w"] + p["b"] - y) ** 2, -1)
            return (jr.compute_average_loss(per_example, gb)
                    + jr.scale_regularization_loss(WD * jnp.sum(p["w"] ** 2)))

        loss, grads = jax.value_and_grad(loss_fn)(p)
        u, o = tx.update(grads, o, p)
        return optax.apply_updates(p, u), o, jax.lax.psum(loss, name), count

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(gb)
        return [(XS[s, r * b:(r + 1) * b], YS[s, r * b:(r + 1) * b])
                for s in range(STEPS) for r in range(ctx.num_replicas)]

    inputs = rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.SINGLE,
                               enforce_ordering=True)
    losses = []
    for _ in range(STEPS):
        out = rep.run(step, inputs, p, o)
        if isinstance(out, jr.ps.RemoteValue):
            rep.join()
            out = out.fetch()
            losses.append(float(np.asarray(out[2]).reshape(-1)[0]))
        else:
            p, o, loss, count = out
            assert float(count) == n * PER
            losses.append(float(loss))
    rep.join()
    if isinstance(strategy, jr.ParameterServerStrategy):
        p = strategy.parameters()
        strategy.shutdown()
    return jax.tree.map(np.asarray, p), sorted(set(seen)), losses


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_every_strategy_trains_the_same_under_a_chosen_axis_name(kind):
    ref = _reference(jr.Replicator(FACTORIES[kind]("replica")).num_replicas_in_sync)
    runs = {}
    for name in ("replica", "batch"):
        strategy = FACTORIES[kind](name)
        assert strategy.axis_name == name == strategy.layout.replica_axis
        assert strategy.mesh.axis_names == (name, jr.MODEL_AXIS)
        runs[name] = _train(strategy)
    (p_default, seen_default, l_default), (p_batch, seen_batch, l_batch) = \
        runs["replica"], runs["batch"]
    assert seen_default == ["replica"] and seen_batch == ["batch"]
    # The name changes nothing else: the same program, the same numbers.
    for a, b in zip(jax.tree.leaves(p_batch), jax.tree.leaves(p_default)):
        np.testing.assert_array_equal(a, b)
    assert l_batch == l_default
    for a, b in zip(jax.tree.leaves(p_batch), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_repr_names_a_chosen_axis_only():
    assert "axis_name" not in repr(jr.MirroredStrategy())
    assert repr(jr.MirroredStrategy(devices=[0, 1], axis_name="batch")) == \
        "MirroredStrategy(num_replicas=2, axis_name='batch')"


# -- collectives, PerReplica and input by name ------------------------------------------

def test_collectives_per_replica_values_and_input_use_the_chosen_name():
    strategy = jr.MirroredStrategy(devices=jax.local_devices()[:4], axis_name="batch")
    rep = jr.Replicator(strategy)
    n = rep.num_replicas
    assert rep.mesh.axis_names == ("batch", "model")

    def step(ctx, x):
        assert ctx.axis_name == "batch"
        return {
            "ids": ctx.replica_id,
            "index": jax.lax.axis_index("batch"),
            "psum": jax.lax.psum(x, "batch"),
            "pmean": jax.lax.pmean(x, "batch"),
            "pmax": jax.lax.pmax(x, "batch"),
            "gather": jax.lax.all_gather(x, "batch"),
            "all_sum": ctx.all_sum(x),
            "all_gather": ctx.all_gather(x),
            "broadcast": ctx.broadcast(x, 2),
            "own": x,
        }

    x = jnp.arange(n * 3, dtype=jnp.float32).reshape(n, 3)
    out = rep.run(step, x)
    rows = np.asarray(x)
    assert [int(i) for i in out["ids"]] == [int(i) for i in out["index"]] == list(range(n))
    np.testing.assert_array_equal(out["psum"], rows.sum(0, keepdims=True))
    np.testing.assert_array_equal(out["pmean"], rows.mean(0, keepdims=True))
    np.testing.assert_array_equal(out["pmax"], rows.max(0, keepdims=True))
    np.testing.assert_array_equal(out["all_sum"], rows.sum(0, keepdims=True))
    for r in range(n):  # (JAX's all_gather is typed per replica; ctx's is replicated)
        np.testing.assert_array_equal(out["gather"][r], rows[:, None])
    np.testing.assert_array_equal(out["all_gather"], rows[:, None])
    np.testing.assert_array_equal(out["broadcast"], rows[2:3])
    own = out["own"]
    assert isinstance(own, jr.PerReplica) and own.axis_name == "batch"
    assert own.array.sharding.spec == P("batch")
    # A PerReplica passed back, and per-replica input from prepare_input, by name too.
    again = rep.run(lambda ctx, v: jax.lax.psum(v, "batch"), None, own)
    np.testing.assert_array_equal(again, rows.sum(0, keepdims=True))
    inputs = rep.prepare_input(lambda ctx: iter([np.full((2,), ctx.input_pipeline_id)] * 2),
                               replication_mode=jr.InputReplicationMode.PER_REPLICA)
    element = inputs.get_next()
    assert element.axis_name == "batch" and element.array.sharding.spec == P("batch")
    got = rep.run(lambda ctx, b: (b, jax.lax.psum(b, "batch")), inputs)
    assert [v.tolist() for v in got[0]] == [[r, r] for r in range(n)]
    np.testing.assert_array_equal(got[1], np.full(2, sum(range(n))))
    np.testing.assert_array_equal(rep.reduce("sum", got[0]), np.full(2, sum(range(n))))


# (all-reduces a replicated value on purpose: a pmap habit run warns about)
@pytest.mark.filterwarnings("ignore::jreplicate.ReplicationHabitWarning")
def test_the_same_step_on_two_names_compiles_for_each():
    """Programs are never shared across names: a step whose collectives follow
    ``ctx.axis_name`` runs under both, one that names ``"batch"`` only under it (in
    either order, so no program compiled for one name serves the other)."""
    by_ctx = lambda ctx, x: jax.lax.psum(x, ctx.axis_name)  # noqa: E731
    by_name = lambda ctx, x: jax.lax.psum(x, "batch")  # noqa: E731
    devices = jax.local_devices()[:2]
    for order in (("batch", "replica"), ("replica", "batch")):
        for name in order:
            rep = jr.Replicator(jr.MirroredStrategy(devices=devices, axis_name=name))
            assert float(rep.run(by_ctx, None, 1.5)) == 3.0
            if name == "batch":
                assert float(rep.run(by_name, None, 1.5)) == 3.0
            else:
                with pytest.raises(NameError, match=r"axis_name='batch'"):
                    rep.run(by_name, None, 1.5)


@pytest.mark.parametrize("per_replica", [True, False])
def test_a_step_naming_another_axis_gets_the_fix(per_replica):
    """JAX says ``NameError: unbound axis name`` for a value varying over the replicas
    and a bare AssertionError (jax 0.12) for a replica-invariant one: both explained."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    x = jnp.ones((2, 3)) if per_replica else jnp.float32(1.0)
    with pytest.raises(NameError) as info:
        rep.run(lambda ctx, x: jax.lax.pmean(x, "batch"), x if per_replica else None,
                *(() if per_replica else (x,)))
    text = str(info.value)
    assert text.startswith("unbound axis name: batch.")  # JAX's words: a search finds it
    assert "replica axis is 'replica'" in text
    assert "jr.MirroredStrategy(axis_name='batch')" in text and "ctx.axis_name" in text


def test_an_nnx_axis_name_module_in_a_step_of_another_axis_gets_the_fix():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        bn = nnx.BatchNorm(2, axis_name="batch", rngs=nnx.Rngs(0))
    with pytest.raises(NameError, match=r"axis_name='batch'"):
        rep.run(lambda ctx, x, bn: bn(x), jnp.ones((4, 2)), bn)
    with pytest.raises(NameError, match="^name 'undefined_name' is not defined\\s"):
        rep.run(lambda ctx: undefined_name, None)  # noqa: F821 - Python's own, untouched


def test_run_inside_a_step_of_another_axis_is_refused():
    outer = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    inner = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2],
                                              axis_name="batch"))
    with pytest.raises(RuntimeError, match="inside a step that Replicator.run is running"):
        outer.run(lambda ctx: inner.run(lambda c: c.replica_id))


# -- helpers whose axis defaults to the active run's ------------------------------------

def test_helpers_follow_the_active_axis_and_keep_an_explicit_one():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4],
                                            axis_name="batch"))

    def step(ctx, x):
        return (jr.scale_regularization_loss(jnp.float32(8.0)),
                jr.scale_regularization_loss([jnp.float32(8.0), x]),
                # an axis named outright that is not bound: outside a replica context
                jr.scale_regularization_loss(jnp.float32(8.0), axis_name="replica"),
                jr.compute_average_loss(x[None], 8))

    a, b, c, d = rep.run(step, None, jnp.float32(4.0))
    assert (float(a), float(b), float(c), float(d)) == (2.0, 3.0, 8.0, 0.5)
    assert float(jr.scale_regularization_loss(jnp.float32(8.0))) == 8.0  # outside run


def test_replica_grad_and_sync_replicas_default_to_the_active_axis():
    """Under ``axis_name="batch"``, ``sync_replicas()`` must take the SPMD driver (its
    former default ``"replica"`` was unbound there, so each replica's call went to the
    host driver: one push per update instead of one per replica, silently)."""
    n = 4
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n],
                                            axis_name="batch"))
    tx = jr.sync_replicas(optax.sgd(1.0), replicas_to_aggregate=n)
    with rep.scope():
        w = jnp.zeros(2)
        state = tx.init(w)

    def step(ctx, x, w, state):
        g = jr.sync.replica_grad(lambda w: jnp.sum(w * x))(w)
        u, state = tx.update(g, state, w)
        return optax.apply_updates(w, u), state, g

    x = jnp.arange(1.0, n + 1)[:, None] * jnp.ones((n, 2))
    w, state, g = rep.run(step, x, w, state)
    assert isinstance(g, jr.PerReplica)  # each replica's own gradient
    np.testing.assert_array_equal(np.asarray(g.array)[:, 0], np.arange(1.0, n + 1))
    assert int(state.global_step) == 1 and int(state.num_accumulated) == 0
    np.testing.assert_allclose(w, -np.full(2, np.arange(1.0, n + 1).mean()))
    with pytest.raises(TypeError, match=r"sync_replicas\(axis_name=3\)"):
        jr.sync_replicas(optax.sgd(1.0), 2, axis_name=3)


# -- refusals ------------------------------------------------------------------------------

REFUSING = {
    "MirroredStrategy": lambda name: jr.MirroredStrategy(axis_name=name),
    "TPUStrategy": lambda name: jr.TPUStrategy(devices=jax.devices(), axis_name=name),
    "MultiWorkerStrategy": lambda name: jr.MultiWorkerStrategy(axis_name=name),
    "ParameterServerStrategy": lambda name: jr.ParameterServerStrategy(axis_name=name),
}


@pytest.mark.parametrize("kind", sorted(REFUSING))
@pytest.mark.parametrize("bad, error, says", [
    ("model", ValueError, "clashes with the model axis: jr.MODEL_AXIS"),
    ("", ValueError, "must be a non-empty str"),
    (3, TypeError, "must be a str"),
    (None, TypeError, "must be a str"),
    (("batch",), TypeError, "must be a str"),
])
def test_a_bad_axis_name_is_refused_naming_the_argument_and_the_fix(kind, bad, error, says):
    with pytest.raises(error) as info:
        REFUSING[kind](bad)
    text = str(info.value)
    assert text.startswith(f"{kind}(axis_name={bad!r})") and says in text
    assert "axis_name='batch'" in text or "jr.REPLICA_AXIS" in text


@pytest.mark.parametrize("bad", ["\\", "a\\", "a\\\\", "x\\j", "'", "it's"])
def test_a_name_xla_cannot_compile_is_refused(bad):
    """A backslash or single quote in a mesh axis name fails XLA's compilation (jax
    0.12), and a name ending in two backslashes aborts the whole process: refused."""
    with pytest.raises(ValueError, match=r"XLA cannot carry .*axis_name='batch'"):
        jr.MirroredStrategy(devices=[0], axis_name=bad)


_NAMES = st.text(min_size=1, max_size=12).filter(
    lambda s: s != jr.MODEL_AXIS and "\\" not in s and "'" not in s)


@settings(deadline=None, max_examples=8)
@given(name=_NAMES)
def test_any_accepted_name_gives_the_default_names_numbers(name):
    """Whatever accepted str names the axis (unicode, spaces, punctuation, control
    characters, "replica" itself), collectives by that name and through ctx, and the
    helpers following the active axis, give what they give under the default name."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2],
                                            axis_name=name))
    assert rep.strategy.axis_name == name

    def step(ctx, x):
        x = x[0]
        return (jax.lax.psum(x, name), ctx.all_sum(x * 2), jax.lax.axis_index(name),
                jr.scale_regularization_loss(x), x)

    total, doubled, ids, reg, own = rep.run(step, jnp.array([1.0, 3.0]))
    assert (float(total), float(doubled)) == (4.0, 8.0)
    assert [int(i) for i in ids] == [0, 1] and [float(r) for r in reg] == [0.5, 1.5]
    assert isinstance(own, jr.PerReplica) and own.axis_name == name


# -- a Flax NNX model written for jax.pmap: BatchNorm(axis_name="batch") ------------------

class PmapNet(nnx.Module):
    """A model as a jax.pmap program writes it: batch statistics over axis "batch"."""

    def __init__(self, axis_name, *, rngs):
        self.l1 = nnx.Linear(5, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name=axis_name, momentum=0.8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


GB = 16  # the global batch: 8 replicas x 2, or 4 replicas x 4


def _bn_reference():
    """One device, the global batch, no axis: losses and the final state."""
    model = PmapNet(None, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    losses = []
    for s in range(STEPS):
        x, y = XS[s], YS[s]
        loss, g = nnx.value_and_grad(
            lambda m, x=x, y=y: jnp.mean(jnp.sum((m(x) - y) ** 2, -1)))(model)
        opt.update(model, g)
        losses.append(float(loss))
    return losses, nnx.state(model)


def _bn_inputs(rep):
    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GB)
        return [(XS[s, r * b:(r + 1) * b], YS[s, r * b:(r + 1) * b])
                for s in range(STEPS) for r in range(ctx.num_replicas)]

    return rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.SINGLE,
                             enforce_ordering=True)


def _bn_loss(m, x, y):
    return jr.compute_average_loss(jnp.sum((m(x) - y) ** 2, -1), GB)


def _bn_nnx(rep, steps):
    """The model and optimizer as NNX arguments (their state is donated by run)."""
    with rep.scope():
        model = PmapNet("batch", rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

    def step(ctx, batch, model, opt):
        loss, g = nnx.value_and_grad(lambda m: _bn_loss(m, *batch))(model)
        opt.update(model, g)
        return jax.lax.psum(loss, "batch")  # pmap code's all-reduce, by name

    inputs, losses = _bn_inputs(rep), []
    loop = steps or rep.strategy.steps_per_run  # a device loop of that many steps per run
    for _ in range(STEPS // (loop or 1)):
        losses += [float(v) for v in np.asarray(
            rep.run(step, inputs, model, opt, steps=steps)).reshape(-1)]
    return losses, nnx.state(model)


def _buffers(tree) -> set:
    """The device buffers of the leaves' shards (their addresses)."""
    return {shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
            for shard in x.addressable_shards}


def _bn_functional_donated(rep, steps):
    """The state as plain pytrees (nnx.split), donated with donate_argnums."""
    tx = optax.sgd(0.1, momentum=0.9)
    with rep.scope():
        graphdef, params, stats = nnx.split(PmapNet("batch", rngs=nnx.Rngs(0)),
                                            nnx.Param, nnx.BatchStat)
        params, stats = nnx.as_pure(params), nnx.as_pure(stats)  # arrays, not Variables
        opt_state = tx.init(params)

    def step(ctx, batch, params, stats, opt_state):
        def loss_fn(params, stats):
            m = nnx.merge(graphdef, params, stats)
            return _bn_loss(m, *batch), nnx.as_pure(nnx.state(m, nnx.BatchStat))

        (loss, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params, stats)
        u, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, u), stats, opt_state, jax.lax.psum(loss, "batch")

    inputs, losses = _bn_inputs(rep), []
    for _ in range(STEPS // (steps or 1)):
        before = _buffers((params, stats, opt_state))  # (holding none of the arrays)
        params, stats, opt_state, loss = rep.run(step, inputs, params, stats, opt_state,
                                                 steps=steps, donate_argnums=(0, 1, 2))
        assert before & _buffers((params, stats, opt_state))  # donated: buffers reused
        losses += [float(v) for v in np.asarray(loss).reshape(-1)]
    return losses, nnx.merge_state(params, stats)


BN_CASES = {
    "8-replicas": (lambda: jr.MirroredStrategy(axis_name="batch"), _bn_nnx, None),
    "device-loop-3": (lambda: jr.MirroredStrategy(axis_name="batch"), _bn_nnx, 3),
    "logical-devices-2": (lambda: jr.MirroredStrategy(logical_devices_per_replica=2,
                                                      axis_name="batch"), _bn_nnx, None),
    "donated-pytrees": (lambda: jr.MirroredStrategy(axis_name="batch"),
                        _bn_functional_donated, None),
    "donated-pytrees-loop-3-logical-2": (
        lambda: jr.MirroredStrategy(logical_devices_per_replica=2, axis_name="batch"),
        _bn_functional_donated, 3),
    "tpu-steps-per-run-3": (lambda: jr.TPUStrategy(devices=jax.devices(), axis_name="batch",
                                                   steps_per_run=3), _bn_nnx, None),
}


@pytest.mark.parametrize("case", sorted(BN_CASES))
def test_pmap_batch_norm_trains_as_one_device_on_the_global_batch(case):
    """``nnx.BatchNorm(axis_name="batch")`` under ``axis_name="batch"``: its batch
    statistics are the global batch's (the losses, the parameters and the running
    mean and variance equal one device's on the concatenated batch)."""
    make, train, steps = BN_CASES[case]
    losses, state = train(jr.Replicator(make()), steps)
    ref_losses, ref_state = _bn_reference()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    have, want = jax.tree.leaves(state), jax.tree.leaves(ref_state)
    assert len(have) == len(want) == 8  # two Linear layers (2 each), BatchNorm (4)
    for a, b in zip(have, want):
        assert not isinstance(a, jr.PerReplica)  # running statistics stay replicated
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The running statistics moved (so the comparison above is not of two initial states).
    assert not np.allclose(np.asarray(state["bn"]["mean"][...]), 0.0)


# -- checkpoints: the axis name is not part of a checkpoint ------------------------------

@pytest.mark.parametrize("saved_as, restored_as", [("replica", "batch"), ("batch", "replica")])
def test_a_checkpoint_restores_under_another_axis_name(tmp_path, saved_as, restored_as):
    def make(name):
        rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2, axis_name=name))

        def init():
            with rep.scope():  # w split over the model axis, b replicated
                w = jax.device_put(jnp.arange(16.0).reshape(2, 8),
                                   NamedSharding(rep.mesh, P(None, jr.MODEL_AXIS)))
                return {"w": w, "b": jnp.ones(3)}

        return rep, init

    rep, init = make(saved_as)
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        step, state = mngr.restore_or_initialize(init)
        assert step == 0
        state = rep.run(lambda ctx, s: jax.tree.map(
            lambda x: x + jax.lax.psum(1.0, saved_as), s), None, state)
        assert mngr.save(1, state, force=True)
    saved = jax.tree.map(np.asarray, state)

    rep, init = make(restored_as)
    with jr.CheckpointManager(tmp_path, rep) as mngr:
        step, state = mngr.restore_or_initialize(init)
    assert step == 1
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert state["w"].sharding.mesh.axis_names == (restored_as, jr.MODEL_AXIS)
    assert state["w"].sharding.spec == P(None, jr.MODEL_AXIS)  # still split
    out = rep.run(lambda ctx, s: jax.tree.map(
        lambda x: x + jax.lax.psum(1.0, restored_as), s), None, state)
    np.testing.assert_array_equal(np.asarray(out["w"]), saved["w"] + 4)


# -- the parameter server's sync groups --------------------------------------------------

def test_parameter_server_sync_groups_all_reduce_over_the_chosen_name():
    """3 workers, each a sync group of 2 replicas on mesh axis "batch": a step's
    collectives by that name and through ctx reduce over the group, and each group
    makes one push per step."""
    strategy = jr.ParameterServerStrategy(num_ps=2, num_replicas_in_sync=2, axis_name="batch")
    assert strategy.axis_name == "batch" and strategy.num_workers == 3
    rep = jr.Replicator(strategy)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def step(ctx, batch, w, opt):
        # each replica's share of a gradient of 1 per element, summed by the group
        g = jax.grad(lambda w: jr.compute_average_loss(jnp.sum(w) * batch, 2))(w)
        u, opt = tx.update(g, opt, w)
        return (optax.apply_updates(w, u), opt, ctx.axis_name == "batch",
                jax.lax.psum(1, "batch"), ctx.all_sum(batch), jax.lax.axis_index("batch"))

    inputs = rep.prepare_input(lambda ctx: iter([np.ones((1,), np.float32)] * 6),
                               replication_mode=jr.InputReplicationMode.PER_REPLICA)
    results = [rep.run(step, inputs, w, opt) for _ in range(6)]
    rep.join()
    for value in results:
        _, _, named, count, summed, ids = value.fetch()
        assert named and int(count) == 2 and float(np.asarray(summed).reshape(-1)[0]) == 2.0
        assert [int(i) for i in np.asarray(ids).reshape(-1)] == [0, 1]
    np.testing.assert_allclose(strategy.parameters(), np.full(3, -6.0))  # 6 pushes of 1
    assert strategy.ledger()[0]["applied"] == 6
    strategy.shutdown()


if installed("ray"):
    from tests.test_ps_ray import local_ray  # noqa: F401 (this module's Ray instance)
else:
    @pytest.fixture
    def local_ray():
        pytest.skip("Ray is not installed: pip install 'jreplicate[ray]'")


def test_ray_workers_build_their_sync_groups_on_the_chosen_name(local_ray):
    """The Ray carrier's worker actors lay out their own sync-group mesh: it carries the
    strategy's axis_name too."""
    strategy = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=2,
                                          carrier="ray", axis_name="batch")
    rep = jr.Replicator(strategy)
    with rep.scope():
        w = jnp.zeros(2)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w) * jax.lax.psum(1.0, "batch") / 2)(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt, jax.lax.psum(ctx.replica_id, "batch")

    value = rep.run(step, None, w, opt)
    rep.join()
    assert int(np.asarray(value.fetch()[2]).reshape(-1)[0]) == 1  # 0 + 1
    np.testing.assert_allclose(strategy.parameters(), np.full(2, -1.0))
    strategy.shutdown()
