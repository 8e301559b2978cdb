"""Weight-update sharding where it meets the other features: device loops, donation,
Flax NNX, logical devices, padded input, ``axis_name``, ``sync_replicas``,
``optax.MultiSteps``, checkpoints, prefetch, and an old replicated copy passed again.

Every case trains against a one-device reference computed here with optax on the
concatenated global batch, and against the same strategy with
``weight_update_sharding=None``; a stateful machine mixes the features at random.
"""

from __future__ import annotations

import functools
import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr

LEVELS = ["optimizer", "parameters"]
GB = 32  # global batch: 4 rows per replica on 8 replicas
RTOL, ATOL = 2e-5, 2e-6


# -- model, data, reference ------------------------------------------------------------

def _init(seed=0):
    """w1 [16, 32], b1 [32] and w2 [32, 5] shard over 8 replicas (w2 on dimension 0);
    b2 [5] has no dimension 8 divides: it stays replicated."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 5)) / 6, "b2": jnp.full(5, 0.1, jnp.float32)}


def _mlp(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _per_example(p, x, y):
    return jnp.sum((_mlp(p, x) - y) ** 2, -1)


def _data(steps, seed=0):
    rng = np.random.default_rng(seed)
    xs = rng.normal(size=(steps, GB, 16)).astype(np.float32)
    ys = rng.normal(size=(steps, GB, 5)).astype(np.float32)
    return xs, ys


@functools.cache
def _ref_step(tx):
    @jax.jit
    def step(p, o, x, y, w):
        g = jax.grad(lambda p: jnp.sum(_per_example(p, x, y) * w) / GB)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o
    return step


def _reference(tx, params, xs, ys, masks=None, opt=None):
    """One device, plain optax: ``(params, opt_state)`` after ``len(xs)`` steps."""
    p = jax.tree.map(jnp.asarray, params)
    o = tx.init(p) if opt is None else opt
    for s in range(len(xs)):
        w = np.ones(len(xs[s]), np.float32) if masks is None else masks[s]
        p, o = _ref_step(tx)(p, o, xs[s], ys[s], w)
    return p, o


@functools.cache
def _train_step(tx):
    def step(ctx, batch, p, o):
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: jr.compute_average_loss(
            _per_example(p, x, y), GB))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, ctx.all_sum(loss)
    return step


ADAM = optax.adam(1e-2)
ADAMW = optax.adamw(1e-2, weight_decay=0.1)
_REPLICATORS: dict = {}


def _rep(level, cls=jr.MirroredStrategy, **kw):
    """One Replicator per configuration for the whole file (its programs are reused)."""
    key = (level, cls, tuple(sorted(kw.items())))
    if key not in _REPLICATORS:
        _REPLICATORS[key] = jr.Replicator(_strategy(level, cls, **kw))
    return _REPLICATORS[key]


def _strategy(level, cls=jr.MirroredStrategy, **kw):
    kw.setdefault("min_weight_shard_size", 0)
    if cls is jr.TPUStrategy:
        kw.setdefault("devices", jax.devices())
    return cls(weight_update_sharding=level, **kw)


def _input(rep, xs, ys, **kw):
    n = rep.num_replicas

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GB)
        return [(xs[s, r * b:(r + 1) * b], ys[s, r * b:(r + 1) * b])
                for s in range(len(xs)) for r in range(n)]
    return rep.prepare_input(input_fn, jr.InputReplicationMode.SINGLE,
                             enforce_ordering=True, **kw)


def _close(a, b, rtol=RTOL, atol=ATOL):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=rtol, atol=atol)


def _exact(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _spec_axes(x):
    s = x.sharding
    assert isinstance(s, NamedSharding), s
    out = set()
    for part in s.spec:
        out.update(part if isinstance(part, tuple) else (part,) if part else ())
    return out


def _sharded(x, axis="replica"):
    return axis in _spec_axes(x)


def _adam_moments(opt):
    """The moments of an ``optax.adam``/``adamw`` state (its ScaleByAdamState)."""
    found = [s for s in jax.tree.leaves(opt, is_leaf=lambda s: hasattr(s, "mu"))
             if hasattr(s, "mu")]
    assert found, opt
    return found[0]


def _check_layout(level, params, opt, axis="replica"):
    """Moments of every dividing leaf sharded; b2 [5] and the count replicated; the
    parameters sharded at "parameters" only."""
    m = _adam_moments(opt)
    for tree in (m.mu, m.nu):
        for k in ("w1", "b1", "w2"):
            assert _sharded(tree[k], axis), (k, tree[k].sharding)
        assert not _sharded(tree["b2"], axis), tree["b2"].sharding
    assert not _sharded(m.count, axis)
    for k in ("w1", "b1", "w2"):
        assert _sharded(params[k], axis) == (level == "parameters"), (k, params[k].sharding)
    assert not _sharded(params["b2"], axis)


def _train(rep, tx, xs, ys, *, steps=None, level=None, **input_kw):
    with rep.scope():
        p = jax.tree.map(jnp.asarray, _init())
        o = tx.init(p)
    inputs = _input(rep, xs, ys, **input_kw)
    step = _train_step(tx)
    k = steps or 1
    for _ in range(len(xs) // k):
        p, o, _ = rep.run(step, inputs, p, o, steps=steps)
    return p, o


# -- device loops ---------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("decay", [False, True])
def test_device_loop_equals_separate_runs_and_reference(level, decay):
    tx = ADAMW if decay else ADAM
    xs, ys = _data(4)
    rep = _rep(level)
    looped = _train(rep, tx, xs, ys, steps=4)
    single = _train(rep, tx, xs, ys)
    if decay and level == "optimizer":
        # Parameters kept replicated but read by the sharded update (the decayed
        # weights): XLA fuses that update differently inside the loop, to 1 ulp.
        _close(looped, single, rtol=1e-6, atol=1e-8)
    else:
        _exact(looped, single)
    _check_layout(level, *looped)
    _close(looped, _reference(tx, _init(), xs, ys))
    _close(looped, _train(_rep(None), tx, xs, ys, steps=4))


@pytest.mark.parametrize("level", LEVELS)
def test_tpu_steps_per_run(level):
    tx = ADAM
    xs, ys = _data(4)
    rep = _rep(level, jr.TPUStrategy, steps_per_run=2)
    p, o = _train(rep, tx, xs, ys, steps=2)
    _check_layout(level, p, o)
    _close((p, o), _reference(tx, _init(), xs, ys))


# -- donation -------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_donated_state_is_deleted_and_a_snapshot_survives(level):
    tx = ADAM
    xs, ys = _data(3)
    rep = _rep(level)
    step = _train_step(tx)
    inputs = _input(rep, xs, ys)
    with rep.scope():
        p = jax.tree.map(jnp.asarray, _init())
        o = tx.init(p)
    snapshot = {"w1": p["w1"], "mu": _adam_moments(o).mu}  # shares sub-trees
    want = jax.tree.map(np.asarray, snapshot)
    for t in range(len(xs) + 1):
        if t == 2:  # a snapshot of sharded state, taken from the program's own output
            snapshot["sharded"] = {"w1": p["w1"], "nu": _adam_moments(o).nu}
            want["sharded"] = jax.tree.map(np.asarray, snapshot["sharded"])
        if t == len(xs):
            break
        out = rep.run(step, inputs, p, o, donate_argnums=(0, 1))
        assert not any(x.is_deleted() for x in jax.tree.leaves(snapshot))
        if t == 1:  # the program's own (sharded) state: donated, nothing copied
            assert all(x.is_deleted() for x in jax.tree.leaves((p, o)))
        p, o, _ = out
        del out  # (else it holds the state passed next: copied, not donated)
    _exact(snapshot, want)
    _check_layout(level, p, o)
    _close((p, o), _reference(tx, _init(), xs, ys))


# -- NNX ------------------------------------------------------------------------------

class _Net(nnx.Module):
    def __init__(self, rngs, partition=None, dtype=jnp.float32):
        init = nnx.initializers.lecun_normal()
        k_init = init if partition is None else nnx.with_partitioning(init, partition)
        self.l1 = nnx.Linear(16, 32, kernel_init=k_init, param_dtype=dtype, rngs=rngs)
        self.l2 = nnx.Linear(32, 5, param_dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_step(ctx, batch, model, opt):
    x, y = batch

    def loss_fn(m):
        return jr.compute_average_loss(jnp.sum((m(x) - y) ** 2, -1), GB)

    loss, g = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, g)
    return ctx.all_sum(loss)


@functools.cache
def _nnx_reference(steps, tx, dtype=jnp.float32):
    xs, ys = _data(steps)
    model = _Net(nnx.Rngs(0), dtype=dtype)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for s in range(len(xs)):
        g = nnx.grad(lambda m, s=s: jnp.mean(jnp.sum((m(xs[s]) - ys[s]) ** 2, -1)))(model)
        opt.update(model, g)
    return model, opt


def _nnx_train(rep, xs, ys, tx, partition=None, dtype=jnp.float32, steps=None):
    with rep.scope():
        model = _Net(nnx.Rngs(0), partition, dtype)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    inputs = _input(rep, xs, ys)
    k = steps or 1
    for _ in range(len(xs) // k):
        rep.run(_nnx_step, inputs, model, opt, steps=steps)
    return model, opt


def _values(tree):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(nnx.state(tree))]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("steps", [None, 2])
def test_nnx_optimizer_in_place(level, steps):
    tx = ADAMW
    xs, ys = _data(4)
    model, opt = _nnx_train(_rep(level), xs, ys, tx, steps=steps)
    ref_model, ref_opt = _nnx_reference(len(xs), tx)
    _close(_values(model), _values(ref_model))
    _close(_values(opt), _values(ref_opt))
    plain_model, _ = _nnx_train(_rep(None), xs, ys, tx, steps=steps)
    _close(_values(model), _values(plain_model))
    m = _adam_moments(opt.opt_state)
    assert _sharded(m.mu["l1"]["kernel"][...])
    assert _sharded(m.nu["l2"]["kernel"][...])  # [32, 5]: dimension 0
    assert not _sharded(m.mu["l2"]["bias"][...])  # [5]
    assert _sharded(model.l1.kernel[...]) == (level == "parameters")


class _NormNet(nnx.Module):
    def __init__(self, rngs):
        # (no bias before the norm: its gradient is zero but for rounding, which adam
        # would turn into updates that differ with the order of summation)
        self.l1 = nnx.Linear(16, 32, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(32, axis_name="replica", rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.l2 = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


@functools.cache
def _norm_net_run(level):
    """Losses and state of 2 steps, then a device loop of 2, of a model with batch
    statistics (updated in the step, read only in evaluation) and dropout."""
    xs, ys = _data(4)
    rep = _rep(level)
    with rep.scope():
        model = _NormNet(nnx.Rngs(0, dropout=1))
        opt = nnx.Optimizer(model, ADAM, wrt=nnx.Param)
    inputs = _input(rep, xs, ys)
    losses = [rep.run(_nnx_step, inputs, model, opt) for _ in range(2)]
    losses += list(rep.run(_nnx_step, inputs, model, opt, steps=2))
    return np.asarray(losses), model, opt


@pytest.mark.parametrize("level", LEVELS)
def test_nnx_batch_statistics_and_dropout(level):
    losses, model, opt = _norm_net_run(level)
    want_losses, want_model, want_opt = _norm_net_run(None)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    keep = nnx.Not(nnx.RngState)  # (the keys: the same streams, advanced alike)
    _close(jax.tree.leaves(nnx.state((model, opt), keep)),
           jax.tree.leaves(nnx.state((want_model, want_opt), keep)))
    def raw(x):
        return jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    _exact(jax.tree.map(raw, jax.tree.leaves(nnx.state(model, nnx.RngState))),
           jax.tree.map(raw, jax.tree.leaves(nnx.state(want_model, nnx.RngState))))
    # The running statistics are only updated, never read, by a training step.
    assert _sharded(model.bn.mean[...])
    assert _sharded(_adam_moments(opt.opt_state).mu["l1"]["kernel"][...])


# -- logical devices (replica x model) --------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_model_sharded_state_keeps_its_model_axis(level, dtype):
    tx = ADAM
    xs, ys = _data(3)
    rep = _rep(level, logical_devices_per_replica=2)
    model, opt = _nnx_train(rep, xs, ys, tx, partition=(None, "model"), dtype=dtype)
    ref_model, ref_opt = _nnx_reference(len(xs), tx, dtype)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else {}
    _close(_values(model), _values(ref_model), **tol)
    _close(_values(opt), _values(ref_opt), **tol)
    mu = _adam_moments(opt.opt_state).mu["l1"]["kernel"][...]  # [16, 32], (None, model)
    assert mu.sharding.spec[1] == "model" and _sharded(mu), mu.sharding
    kernel = model.l1.kernel[...]
    assert "model" in _spec_axes(kernel)
    assert _sharded(kernel) == (level == "parameters")
    assert kernel.dtype == dtype


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("model_sharded", [False, True])
def test_device_loop_keeps_the_planned_layout_with_logical_devices(level, model_sharded):
    """A device loop's carried state comes back as the plan stores it (a parameter kept
    whole at "optimizer" must not come back split over the replicas, to be gathered
    again before the next call), with and without a "model" split."""
    tx = ADAM
    xs, ys = _data(2)
    rep = _rep(level, logical_devices_per_replica=2)
    with rep.scope():
        p = jax.tree.map(jnp.asarray, _init())
        if model_sharded:
            p["w1"] = jax.device_put(p["w1"], NamedSharding(rep.mesh, P(None, "model")))
        o = tx.init(p)
    p, o, _ = rep.run(_train_step(tx), _input(rep, xs, ys), p, o, steps=2)
    _check_layout(level, p, o)
    if model_sharded:
        assert "model" in _spec_axes(p["w1"]) and "model" in _spec_axes(
            _adam_moments(o).mu["w1"]), (p["w1"].sharding, _adam_moments(o).mu["w1"].sharding)
    _close((p, o), _reference(tx, _init(), xs, ys))


# -- padded input, axis_name, prefetch ---------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("steps", [None, 2])
def test_padded_final_batch_counts_real_rows_only(level, steps):
    tx = ADAM
    xs, ys = _data(3)
    rows = GB * 3 - 10  # the final global batch has 22 real rows of 32
    flat_x, flat_y = xs.reshape(-1, 16)[:rows], ys.reshape(-1, 5)[:rows]
    rep = _rep(level)

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GB)
        return [(flat_x[i:i + b], flat_y[i:i + b]) for i in range(0, rows, b)]

    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(
            _per_example(p, x, y), GB, sample_weight=ctx.batch_mask))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    inputs = rep.prepare_input(input_fn, jr.InputReplicationMode.SINGLE,
                               enforce_ordering=True, partial_batch="pad")
    with rep.scope():
        p = jax.tree.map(jnp.asarray, _init())
        o = tx.init(p)
    while True:  # steps=2: a loop of 2, then the padded step as a loop of 1
        try:
            p, o = rep.run(step, inputs, p, o, steps=steps)
        except StopIteration:
            break
    masks = np.ones((3, GB), np.float32)
    masks[2, 22:] = 0
    _check_layout(level, p, o)
    _close((p, o), _reference(tx, _init(), xs, ys, masks))


@pytest.mark.parametrize("level", LEVELS)
def test_axis_name_batch(level):
    tx = optax.sgd(0.1, momentum=0.9)
    xs, ys = _data(3)
    rep = _rep(level, axis_name="batch")
    p, o = _train(rep, tx, xs, ys)
    mom = jax.tree.leaves(o, is_leaf=lambda s: hasattr(s, "trace"))[0].trace
    assert _sharded(mom["w1"], "batch") and not _sharded(mom["b2"], "batch")
    assert _sharded(p["w1"], "batch") == (level == "parameters")
    _close((p, o), _reference(tx, _init(), xs, ys))


@pytest.mark.parametrize("level", LEVELS)
def test_prefetched_input(level):
    tx = ADAM
    xs, ys = _data(4)
    rep = _rep(level)
    p, o = _train(rep, tx, xs, ys, steps=4, prefetch_on_device=True)  # (the loop's program)
    _check_layout(level, p, o)
    _close((p, o), _reference(tx, _init(), xs, ys))


# -- optax wrappers ---------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_multi_steps(level):
    tx = optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), 2)
    xs, ys = _data(4)
    p, o = _train(_rep(level), tx, xs, ys)
    _close((p, o), _reference(tx, _init(), xs, ys))
    acc = o.acc_grads
    assert _sharded(acc["w1"]) and not _sharded(acc["b2"])


@pytest.mark.parametrize("level", LEVELS)
def test_sync_replicas_spmd(level):
    inner = ADAM
    tx = jr.sync_replicas(inner, 8)
    xs, ys = _data(3)
    rep = _rep(level)

    def step(ctx, batch, p, o):  # each replica's own gradient: sync_replicas averages
        x, y = batch
        g = jr.sync.replica_grad(lambda p: jnp.mean(_per_example(p, x, y)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    with rep.scope():
        p = jax.tree.map(jnp.asarray, _init())
        o = tx.init(p)
    inputs = _input(rep, xs, ys)
    for _ in range(3):
        p, o = rep.run(step, inputs, p, o)
    ref_p, ref_o = _reference(inner, _init(), xs, ys)
    _close(p, ref_p)
    _close(o.inner_state, ref_o)
    assert int(o.global_step) == 3
    m = _adam_moments(o.inner_state)
    assert _sharded(m.mu["w1"]) and not _sharded(m.mu["b2"])
    # The accumulators are read only where the update runs: sharded like the moments.
    assert _sharded(o.accumulators["w1"]), o.accumulators["w1"].sharding


def _reads_of(jaxpr, roots):
    """The equations of ``jaxpr`` reading ``roots`` or values computed from them."""
    from jax._src import core

    tainted, out = set(roots), []
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, core.Literal) and v in tainted for v in eqn.invars):
            out.append(eqn)
            tainted.update(eqn.outvars)
    return out


def _has_collective(eqn, axis):
    from jax._src import core

    names = set()
    for key in ("axes", "axis_name"):
        v = eqn.params.get(key)
        names.update(v if isinstance(v, (tuple, list, frozenset, set)) else (v,))
    if axis in names:
        return True
    return any(_has_collective(e, axis) for j in core.jaxprs_in_params(eqn.params)
               for e in j.eqns)


@pytest.mark.parametrize("k", [8, 4])
def test_sync_replicas_reads_accumulators_after_the_sum_only(k):
    """What weight-update sharding needs of sync_replicas: no equation that reads the
    accumulators (or a value computed from them) holds a collective over the replicas
    or gives a value that differs across them, so the accumulators can stay sharded."""
    mesh = jax.make_mesh((8,), ("replica",))
    tx = jr.sync_replicas(optax.adam(0.1), k)
    p = jax.device_put({"w": jnp.ones((8, 4))}, NamedSharding(mesh, P()))
    s = jax.device_put(tx.init(p), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((8, 8, 4)), NamedSharding(mesh, P("replica")))

    def step(p, s, x):
        g = jr.sync.replica_grad(lambda p: jnp.sum(p["w"] * x[0]))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    f = jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica")),
                      out_specs=(P(), P()))
    closed = jax.make_jaxpr(f)(p, s, x)
    (sm,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
    body = sm.params["jaxpr"]
    leaves = jax.tree.leaves((p, s))
    acc = [body.invars[i] for i, x in enumerate(leaves)
           if any(x is a for a in jax.tree.leaves(s.accumulators))]
    assert acc
    for eqn in _reads_of(body, acc):
        assert not _has_collective(eqn, "replica"), eqn
        assert all(not getattr(v.aval, "vma", ()) for v in eqn.outvars), eqn


# -- checkpoints ------------------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_checkpoint_restores_sharded_and_training_continues(level, tmp_path):
    tx = ADAM
    xs, ys = _data(4)
    rep = _rep(level)
    step = _train_step(tx)
    p, o = _train(rep, tx, xs[:2], ys[:2])
    with jr.CheckpointManager(tmp_path, rep) as m:
        assert m.save(2, (p, o), force=True)
    abstract = jax.eval_shape(lambda: (_init(), tx.init(_init())))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((GB,) + x.shape[2:], x.dtype),
                         (xs, ys))
    shardings = rep.state_shardings(step, batch, *abstract)
    with rep.scope():
        init = jax.jit(lambda: (jax.tree.map(jnp.asarray, _init()), tx.init(_init())),
                       out_shardings=shardings)
    with jr.CheckpointManager(tmp_path, rep) as m:
        if "shardings" in inspect.signature(m.restore_or_initialize).parameters:
            got, state = m.restore_or_initialize(init, shardings=shardings)
        else:
            got, state = m.restore_or_initialize(init)
    assert got == 2
    _exact(state, (p, o))
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
        assert x.sharding.is_equivalent_to(s, x.ndim), (x.sharding, s)
    _check_layout(level, *state)
    inputs = _input(rep, xs[2:], ys[2:])
    traced = len(rep._executor._cache)
    for _ in range(2):
        p, o, _ = rep.run(step, inputs, *state)
        state = (p, o)
    assert len(rep._executor._cache) == traced  # restored sharded: the same program
    _close(state, _reference(tx, _init(), xs, ys))


@pytest.mark.parametrize("level", LEVELS)
def test_state_moves_between_sharded_and_replicated_strategies(level):
    """Sharded state passed to a replicated strategy on the same devices, and back."""
    tx = ADAM
    xs, ys = _data(3)
    sharded, plain = _rep(level), _rep(None)
    step = _train_step(tx)
    with sharded.scope():
        p = jax.tree.map(jnp.asarray, _init())
        o = tx.init(p)
    for rep, t in ((sharded, 0), (plain, 1), (sharded, 2)):
        p, o, _ = rep.run(step, (xs[t], ys[t]), p, o)
        if rep is sharded:
            _check_layout(level, p, o)
    _close((p, o), _reference(tx, _init(), xs, ys))


# -- the old replicated copy passed again -----------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
def test_old_replicated_copy_again_one_program(level):
    tx = ADAM
    xs, ys = _data(2)
    rep = _rep(level)
    traces = []

    def step(ctx, batch, p, o):
        traces.append(1)
        return _train_step(tx)(ctx, batch, p, o)

    with rep.scope():
        p0 = jax.tree.map(jnp.asarray, _init())
        o0 = tx.init(p0)
    batch = (xs[0], ys[0])
    p1, o1, _ = rep.run(step, batch, p0, o0)  # replicated in, resharded once
    _check_layout(level, p1, o1)
    p2, o2, _ = rep.run(step, batch, p1, o1)  # sharded in
    n_traces, n_programs = len(traces), len(rep._executor._cache)
    compiles = _Compiles()
    logging.getLogger("jax").addHandler(compiles)
    try:
        with jax.log_compiles(True):
            for _ in range(2):  # the old replicated copy again, then the sharded state
                again_p, again_o, _ = rep.run(step, batch, p0, o0)
                _exact((again_p, again_o), (p1, o1))
                _check_layout(level, again_p, again_o)
                assert all(not x.is_deleted() for x in jax.tree.leaves((p0, o0)))
                got = rep.run(step, batch, p1, o1)
                _exact(got[:2], (p2, o2))
    finally:
        logging.getLogger("jax").removeHandler(compiles)
    assert (len(traces), len(rep._executor._cache)) == (n_traces, n_programs)
    assert not compiles.seen, compiles.seen  # (the resharding copies too are compiled once)
    _close((p1, o1), _reference(tx, _init(), xs[:1], ys[:1]))


class _Compiles(logging.Handler):
    """The compilations ``jax.log_compiles`` reports."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.seen = []

    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            self.seen.append(record.getMessage()[:120])


# -- features mixed at random: a stateful machine against the reference ---------------

_TX = ADAMW
_XS, _YS = _data(16, seed=3)


def _eval_step(ctx, batch, p):
    x, y = batch
    return ctx.all_sum(jr.compute_average_loss(_per_example(p, x, y), GB))


class WeightUpdateMachine(RuleBasedStateMachine):
    """Runs one step, K steps, donated steps, an evaluation step, a checkpoint round trip
    and a switch to a replicated copy in any order; after each, the state equals the
    reference's."""

    @initialize(level=st.sampled_from(LEVELS))
    def start(self, level):
        self.level = level
        self.rep = _rep(level)
        with self.rep.scope():
            p = jax.tree.map(jnp.asarray, _init())
            self.state = (p, _TX.init(p))
        self.ref = (jax.tree.map(jnp.asarray, _init()), _TX.init(_init()))
        self.t = 0

    def _inputs(self, k):
        return _input(self.rep, _XS[self.t:self.t + k], _YS[self.t:self.t + k])

    def _advance(self, k):
        self.ref = _reference(_TX, self.ref[0], _XS[self.t:self.t + k],
                              _YS[self.t:self.t + k], opt=self.ref[1])
        self.t += k

    @rule(k=st.sampled_from([None, 2, 3]), donate=st.booleans())
    def run(self, k, donate):
        n = k or 1
        if self.t + n > len(_XS):
            return
        inputs = self._inputs(n)
        p, o, _ = self.rep.run(_train_step(_TX), inputs, *self.state, steps=k,
                               donate_argnums=(0, 1) if donate else ())
        self.state = (p, o)
        self._advance(n)

    @rule(t=st.integers(0, len(_XS) - 1))
    def evaluate(self, t):
        """An evaluation step reads the state (sharded or not) and returns no state."""
        loss = self.rep.run(_eval_step, (_XS[t], _YS[t]), self.state[0])
        want = jnp.mean(_per_example(self.ref[0], _XS[t], _YS[t]))
        np.testing.assert_allclose(float(loss), float(want), rtol=5e-5)
        assert not any(x.is_deleted() for x in jax.tree.leaves(self.state))

    @rule()
    def replicated_copy(self):
        host = jax.tree.map(np.asarray, self.state)
        self.state = self.rep.replicate(host)

    @rule()
    def checkpoint_round_trip(self):
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            with jr.CheckpointManager(d, self.rep) as m:
                m.save(self.t, self.state, force=True)
            template = jax.tree.map(np.asarray, self.state)
            with jr.CheckpointManager(d, self.rep) as m:
                step, self.state = m.restore_or_initialize(lambda: template)
            assert step == self.t

    @invariant()
    def equals_reference(self):
        if hasattr(self, "ref"):
            _close(self.state, self.ref, rtol=5e-5, atol=5e-6)


TestWeightUpdateMachine = WeightUpdateMachine.TestCase
TestWeightUpdateMachine.settings = settings(
    max_examples=4, stateful_step_count=6, deadline=None,
    suppress_health_check=list(HealthCheck))
