"""Flax NNX random streams inside ``run`` draw per replica (jreplicate/execution/nnx_rngs.py).

A one-device step over the global batch draws an independent dropout mask for every row;
replicated, every replica drew the same mask from the same replicated key (silently other
statistics). Each stream of the step's NNX arguments now draws from its key folded with
the replica's id, the original key leaves the step, and the counts advance as on one
device; ``jr.same_on_every_replica`` marks streams that should draw alike.

Every reference is the plain NNX program on one device: a fresh module built with the
same seed, its key replaced by ``jax.random.fold_in(key, replica)`` here.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr

nnx = pytest.importorskip("flax.nnx")

N = 8
ROWS = 64  # a mask's size


def _mask_step(ctx, drop):
    return drop(jnp.ones(ROWS)) != 0  # this replica's mask: a PerReplica


def _dropout(seed=3, rate=0.5):
    return nnx.Dropout(rate, rngs=nnx.Rngs(dropout=seed))


def _reference_masks(replica, calls, *, seed=3, rate=0.5, fold=True, base=None):
    """The masks one device draws in ``calls`` calls from the stream ``fold_in(key,
    replica)`` (or the key itself: ``fold=False``); ``base`` folds a step id first."""
    d = _dropout(seed, rate)
    k = d.rngs.key.get_value()
    if base is not None:
        k = jax.random.fold_in(k, base)
    if fold:
        k = jax.random.fold_in(k, replica)
    d.rngs.key.set_value(k)
    return [np.asarray(d(jnp.ones(ROWS)) != 0) for _ in range(calls)]


def _rows(masks) -> np.ndarray:
    assert isinstance(masks, jr.PerReplica), "the masks came back replicated"
    return np.asarray(masks.array)


def _key_bits(stream) -> np.ndarray:
    return np.asarray(jax.random.key_data(stream.key.get_value()))


# -- the default: one stream per replica ---------------------------------------------------
def test_each_replica_draws_the_fold_in_of_its_id_and_the_module_stays_replicated():
    """Regression (issue 29 item 3): every replica drew the same mask. Three calls (the
    third on the steady-state path): replica r's masks are one device's draws from
    fold_in(key, r), and the module keeps its key with the one-device count."""
    rep = jr.Replicator(jr.MirroredStrategy())
    drop = _dropout()
    key = _key_bits(drop.rngs)
    got = [_rows(rep.run(_mask_step, None, drop)) for _ in range(3)]
    for r in range(N):
        want = _reference_masks(r, 3)
        for c in range(3):
            np.testing.assert_array_equal(got[c][r], want[c])
    np.testing.assert_array_equal(_key_bits(drop.rngs), key)  # the replicated key
    assert int(drop.rngs.count.get_value()) == 3  # as three calls on one device


def test_a_chosen_replica_axis_name_folds_the_same_replica_ids():
    """MirroredStrategy(axis_name="batch") (pmap's name): the same per-replica streams."""
    rep = jr.Replicator(jr.MirroredStrategy(axis_name="batch"))
    rows = _rows(rep.run(_mask_step, None, _dropout()))
    for r in range(N):
        np.testing.assert_array_equal(rows[r], _reference_masks(r, 1)[0])


def test_masks_of_eight_replicas_agree_as_independent_draws():
    """Rate 0.5: two independent masks agree on about half the rows (identical: 1.0)."""
    rep = jr.Replicator(jr.MirroredStrategy())
    drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=11))
    masks = _rows(rep.run(lambda ctx, d: d(jnp.ones(4096)) != 0, None, drop))
    agree = [np.mean(masks[a] == masks[b]) for a, b in itertools.combinations(range(N), 2)]
    assert 0.47 < np.mean(agree) < 0.53 and max(agree) < 0.56, agree
    assert 0.47 < masks.mean() < 0.53  # still rate 0.5 on each


def test_rngs_argument_and_streams_inside_modules_both_draw_per_replica():
    """An nnx.Rngs passed to the step (two named streams) and the stream a model's
    Dropout keeps; a model whose Dropout appears twice (a shared submodule: the
    nnx.split path) draws twice per call from one folded stream."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.again = self.drop  # shared: one stream, two draws per call

    def step(ctx, net, rngs):
        a = net.drop(jnp.ones(ROWS)) != 0
        b = net.again(jnp.ones(ROWS)) != 0
        return a, b, jax.random.normal(rngs.noise(), (4,)), jax.random.normal(rngs(), (4,))

    rep = jr.Replicator(jr.MirroredStrategy())
    net, rngs = Net(nnx.Rngs(dropout=3)), nnx.Rngs(5, noise=7)
    a, b, noise, default = (_rows(x) for x in rep.run(step, None, net, rngs))
    for r in range(N):
        want = _reference_masks(r, 2)
        np.testing.assert_array_equal(a[r], want[0])
        np.testing.assert_array_equal(b[r], want[1])
        for got, seed in ((noise, 7), (default, 5)):
            k = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), r), 0)
            np.testing.assert_array_equal(got[r], jax.random.normal(k, (4,)))
    assert int(net.drop.rngs.count.get_value()) == 2
    assert int(rngs.noise.count.get_value()) == int(rngs.default.count.get_value()) == 1


@nnx.jit
def _jitted(d, x):
    return d(x)


_TRANSFORMS = {
    "nnx.jit": lambda d, x: _jitted(d, x),
    "nnx.remat": lambda d, x: nnx.remat(lambda d, x: d(x))(d, x),
    "nnx.cond": lambda d, x: nnx.cond(True, lambda d: d(x), lambda d: d(x) * 2, d),
}


@pytest.mark.parametrize("transform", sorted(_TRANSFORMS))
def test_flax_transforms_inside_the_step_draw_per_replica(transform):
    """A Flax transform inside the step hands back a new value of the folded key (not
    the object the step got): the module still keeps its replicated key."""
    rep = jr.Replicator(jr.MirroredStrategy())
    drop = _dropout()
    key = _key_bits(drop.rngs)
    f = _TRANSFORMS[transform]
    rows = _rows(rep.run(lambda ctx, d: f(d, jnp.ones(ROWS)) != 0, None, drop))
    for r in range(N):
        np.testing.assert_array_equal(rows[r], _reference_masks(r, 1)[0])
    np.testing.assert_array_equal(_key_bits(drop.rngs), key)
    assert int(drop.rngs.count.get_value()) == 1


def test_a_key_the_step_reseeds_is_kept():
    """A replicated key the step sets itself (nnx.reseed) is the step's, written back."""
    rep = jr.Replicator(jr.MirroredStrategy())
    drop = _dropout()

    def step(ctx, d):
        nnx.reseed(d, dropout=42)
        return d(jnp.ones(ROWS)) != 0

    rep.run(step, None, drop)
    seeded = jax.random.fold_in(jax.random.key(42), 0)  # reseed's key: Rngs(42)'s first
    np.testing.assert_array_equal(_key_bits(drop.rngs),
                                  np.asarray(jax.random.key_data(seeded)))
    assert int(drop.rngs.count.get_value()) == 1


def test_one_replica_draws_what_the_plain_nnx_program_draws():
    """One replica folds nothing: the port of a one-device program is bit-identical,
    dropout included."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:1]))
    drop = _dropout()
    got = [np.asarray(rep.run(_mask_step, None, drop)) for _ in range(2)]
    want = _reference_masks(0, 2, fold=False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.reshape(-1), w)


def test_logical_devices_of_one_replica_draw_its_mask():
    """4 replicas x 2 logical devices: the replica's id, not the device's, is folded in;
    both devices of a replica hold the same mask."""
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
    drop = _dropout()
    masks = rep.run(_mask_step, None, drop)
    rows = _rows(masks)
    assert rows.shape == (4, ROWS)
    for r in range(4):
        np.testing.assert_array_equal(rows[r], _reference_masks(r, 1)[0])
    by_replica: dict = {}
    for shard in masks.array.addressable_shards:
        by_replica.setdefault(shard.index[0].start or 0, []).append(np.asarray(shard.data))
    assert len(by_replica) == 4
    for blocks in by_replica.values():
        assert len(blocks) == 2
        np.testing.assert_array_equal(blocks[0], blocks[1])


def test_device_loop_equals_k_separate_calls():
    """steps=K: per step and per replica, the masks of K separate calls; the counts
    after the loop equal one device's after K draws."""
    k = 3
    rep = jr.Replicator(jr.MirroredStrategy())
    looped, single = _dropout(), _dropout()
    stacked = _rows(rep.run(_mask_step, None, looped, steps=k))  # [N, K, ROWS]
    assert stacked.shape == (N, k, ROWS)
    for s in range(k):
        np.testing.assert_array_equal(stacked[:, s], _rows(rep.run(_mask_step, None, single)))
    assert int(looped.rngs.count.get_value()) == int(single.rngs.count.get_value()) == k
    np.testing.assert_array_equal(_key_bits(looped.rngs), _key_bits(single.rngs))


def test_split_state_argument_draws_per_replica_and_returns_the_replicated_key():
    """The functional form: ``nnx.split`` state passed to the step, merged there and
    returned. Its streams draw per replica; the state returned (and the one written
    back in place) holds the original key and the advanced count, replicated."""
    drop = _dropout()
    graphdef, state = nnx.split(drop)
    key = _key_bits(drop.rngs)

    def step(ctx, state):
        d = nnx.merge(graphdef, state)
        mask = d(jnp.ones(ROWS)) != 0
        return nnx.state(d), mask

    rep = jr.Replicator(jr.MirroredStrategy())
    new_state, masks = rep.run(step, None, state)
    rows = _rows(masks)
    for r in range(N):
        np.testing.assert_array_equal(rows[r], _reference_masks(r, 1)[0])
    out_key = new_state["rngs"]["key"].get_value()
    assert not isinstance(out_key, jr.PerReplica)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(out_key)), key)
    assert int(new_state["rngs"]["count"].get_value()) == 1
    assert int(state["rngs"]["count"].get_value()) == 1  # written back in place


def test_a_raw_key_argument_is_the_same_on_every_replica():
    """A jax.random key is not a stream: it stays replicated (documented; fold in
    ctx.replica_id where it should differ)."""
    rep = jr.Replicator(jr.MirroredStrategy())
    out = rep.run(lambda ctx, k: jax.random.bernoulli(k, 0.5, (ROWS,)), None,
                  jax.random.key(0))
    assert not isinstance(out, jr.PerReplica)


# -- the opt-out ----------------------------------------------------------------------------
def test_marked_streams_draw_the_same_on_every_replica():
    """jr.same_on_every_replica after steady-state calls (the new metadata leaves the
    steady-state path): the masks come back replicated, the one-device draws of the
    unfolded key; marking by name leaves the other streams per replica."""
    rep = jr.Replicator(jr.MirroredStrategy())
    drop = _dropout()
    for _ in range(3):
        _rows(rep.run(_mask_step, None, drop))
    assert jr.same_on_every_replica(drop) is drop
    same = rep.run(_mask_step, None, drop)
    assert not isinstance(same, jr.PerReplica)
    np.testing.assert_array_equal(np.asarray(same), _reference_masks(0, 4, fold=False)[3])

    rngs = jr.same_on_every_replica(nnx.Rngs(noise=1, dropout=2), "noise")
    noise, mask = rep.run(lambda ctx, r: (jax.random.normal(r.noise(), (4,)),
                                          jax.random.bernoulli(r.dropout(), 0.5, (ROWS,))),
                          None, rngs)
    assert not isinstance(noise, jr.PerReplica)
    assert len({m.tobytes() for m in _rows(mask)}) == N


def test_same_on_every_replica_names_what_is_wrong():
    with pytest.raises(ValueError, match=r"holds no Flax NNX random stream.*nnx.Dropout"):
        jr.same_on_every_replica(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"no random stream named 'dropuot'; its streams "
                                         r"are 'dropout', 'params'"):
        jr.same_on_every_replica(nnx.Rngs(params=0, dropout=1), "dropuot")
    with pytest.raises(TypeError, match="stream names are strings"):
        jr.same_on_every_replica(nnx.Rngs(0), 0)


# -- parameter servers ------------------------------------------------------------------------
def test_sync_group_replicas_draw_their_own_streams_of_each_step():
    """ParameterServerStrategy with sync groups of 2: each step already draws from the
    model's streams folded with its id; within the group each replica then folds in
    its id. Workers (different steps) and replicas all differ."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=3))

    def step(ctx, net, optimizer):
        g = nnx.grad(lambda m: jnp.mean(m.lin(jnp.ones((2, 4))) ** 2))(net)
        optimizer.update(net, g)
        return net.drop(jnp.ones(ROWS)) != 0

    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, num_replicas_in_sync=2)
    rep = jr.Replicator(s)
    try:
        with rep.scope():
            net = Net(nnx.Rngs(0))
            opt = nnx.Optimizer(net, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)
        values = [rep.run(step, None, net, opt) for _ in range(4)]
        rep.join()
        masks = [np.asarray(v.fetch(timeout=60)) for v in values]
    finally:
        s.shutdown()
    seen = set()
    for v, m in zip(values, masks, strict=True):
        assert m.shape == (2, ROWS)
        for r in range(2):
            np.testing.assert_array_equal(m[r], _reference_masks(r, 1, base=v.step_id)[0])
            seen.add(m[r].tobytes())
    assert len(seen) == 8


# -- a property: any replica count, calls, loops and marks, against the reference ------------
_replicators: dict = {}  # by replica count: the examples share compiled programs


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([1, 2, 4, 8]), calls=st.lists(st.sampled_from([None, 2]),
                                                        min_size=1, max_size=3),
       marked=st.booleans(), rate=st.sampled_from([0.25, 0.5]))
def test_any_run_draws_one_device_streams_folded_with_the_replica(n, calls, marked, rate):
    """Single calls and device loops in any order, on 1 to 8 replicas, marked or not:
    replica r's k-th draw is one device's k-th draw from fold_in(key, r) (the key
    itself with one replica or a mark), and the count is the number of draws."""
    rep = _replicators.get(n) or _replicators.setdefault(
        n, jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n])))
    drop = _dropout(rate=rate)
    if marked:
        jr.same_on_every_replica(drop, "dropout")
    draws = []  # per draw: [replicas (1: replicated), ROWS]
    for k in calls:
        out = rep.run(_mask_step, None, drop, steps=k)
        per = isinstance(out, jr.PerReplica)
        rows = np.asarray(out.array) if per else np.asarray(out)[None]  # [n|1, (K,) ROWS]
        draws += [rows] if k is None else [rows[:, s] for s in range(k)]
    assert int(drop.rngs.count.get_value()) == len(draws)
    fold = n > 1 and not marked
    for r in range(n):
        want = _reference_masks(r, len(draws), rate=rate, fold=fold)
        for got, w in zip(draws, want, strict=True):
            np.testing.assert_array_equal(got[r if fold else 0], w)
