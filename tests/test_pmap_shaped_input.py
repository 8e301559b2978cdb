"""Batches shaped for ``jax.pmap`` (``[devices, b, ...]``, as
``flax.training.common_utils.shard`` makes them) are told apart from legitimate batches
on every input path: a plain global batch given to ``run`` (a warning: shapes alone
can't be sure), an input function's elements (an error where ``input_fn`` asked for its
per-replica batch size, else a warning), under device loops, padding, prefetch and the
parameter-server workers. Look-alikes (a global batch of one example per replica with
rank-1 labels) are never flagged, and legitimate batches give the step what one device
would get."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr
from jreplicate import _porting

N = 8  # replicas (tests/conftest.py: 8 simulated devices)


@functools.cache
def _rep():
    return jr.Replicator(jr.MirroredStrategy())


def _sizes(ctx, batch):
    """Each leaf's leading dimension on this replica, and the sum of the batch."""
    return ([jnp.asarray(x.shape[0]) for x in jax.tree.leaves(batch)],
            ctx.all_sum(sum(x.sum() for x in jax.tree.leaves(batch))))


def _shard(tree):  # flax.training.common_utils.shard, on 8 devices
    return jax.tree.map(lambda x: x.reshape((N, -1) + x.shape[1:]), tree)


def _pmap_warnings(record):
    return [w for w in record if issubclass(w.category, jr.input.PmapShapedBatchWarning)]


# -- a global batch given to run --------------------------------------------------------
def test_a_sharded_global_batch_warns_with_the_shapes_and_the_fix():
    batch = {"image": np.ones((128, 4, 4, 1), np.float32), "label": np.ones(128, np.int32)}
    with pytest.warns(jr.input.PmapShapedBatchWarning) as record:
        rows, _ = _rep().run(_sizes, _shard(batch))
    msg = str(record[0].message)
    for part in ("['image']: (8, 16, 4, 4, 1)", "['label']: (8, 16)", "(1, 16, 4, 4, 1)",
                 "batch.shape[0] == 1, not 16", "common_utils.shard",
                 "x.reshape(-1, *x.shape[2:])", "PmapShapedBatchWarning"):
        assert part in msg, part
    assert record[0].filename == __file__  # points at the user's call
    assert [int(r) for r in rows] == [1, 1]  # what the warning says each replica got
    # The fix: the global batch gives each replica 16 rows.
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.input.PmapShapedBatchWarning)
        rows, _ = _rep().run(_sizes, batch)
    assert [int(r) for r in rows] == [16, 16]


def test_the_warning_can_be_silenced_by_its_category():
    tokens = {"tokens": np.ones((N, 32), np.int32), "targets": np.ones((N, 32), np.int32)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=jr.input.PmapShapedBatchWarning)
        rows, _ = _rep().run(_sizes, tokens)  # one sequence per replica: meant
    assert not _pmap_warnings(record)
    assert [int(r) for r in rows] == [1, 1]


def test_a_global_batch_of_one_example_per_replica_with_rank_1_labels_is_not_flagged():
    batch = {"image": np.ones((N, 28, 28, 1), np.float32), "label": np.arange(N)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.input.PmapShapedBatchWarning)
        rows, total = _rep().run(_sizes, batch)
        _rep().run(_sizes, {"x": np.ones((N, 5, 3), np.float32)})  # one leaf: never
        _rep().run(_sizes, jr.PerReplica(jnp.ones((N, 16, 3))))  # explicit: meant
    assert [int(r) for r in rows] == [1, 1]
    assert float(total) == N * 28 * 28 + sum(range(N))


def _rule(shapes):
    """The documented rule, written out independently of jreplicate._porting."""
    return (len(shapes) >= 2 and all(len(s) >= 2 for s in shapes)
            and all(s[0] == N for s in shapes) and len({s[1] for s in shapes}) == 1)


@st.composite
def _batch_shapes(draw):
    """Leaf shapes of a batch: random, or (half the time) built pmap-shaped and then
    perhaps broken in one place (another leading or second dimension, a rank-1 leaf)."""
    dims = st.sampled_from([1, 2, 3])
    if not draw(st.booleans()):
        return [(draw(st.sampled_from([N, 2 * N, 3 * N])),) + tuple(draw(st.lists(dims,
                max_size=3))) for _ in range(draw(st.integers(1, 4)))]
    b = draw(dims)
    shapes = [(N, b) + tuple(draw(st.lists(dims, max_size=2)))
              for _ in range(draw(st.integers(1, 4)))]
    k = draw(st.integers(0, len(shapes) - 1))
    broken = draw(st.sampled_from(["none", "lead", "second", "rank 1"]))
    if broken == "lead":
        shapes[k] = (2 * N,) + shapes[k][1:]
    elif broken == "second":
        shapes[k] = (N, b + 1) + shapes[k][2:]
    elif broken == "rank 1":
        shapes[k] = (N,)
    return shapes


@settings(max_examples=30, deadline=None)
@given(_batch_shapes())
def test_property_flagged_exactly_when_pmap_shaped_and_legit_batches_run_exactly(shapes):
    rng = np.random.default_rng(len(shapes))
    batch = {f"l{k}": rng.integers(0, 5, s).astype(np.float32) for k, s in enumerate(shapes)}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rows, total = _rep().run(_sizes, batch)
    assert bool(_pmap_warnings(record)) == _rule(shapes)
    # Flagged or not, the batch is split as documented: each replica its rows.
    assert [int(r) for r in rows] == [s[0] // N for s in shapes]
    np.testing.assert_allclose(float(total), sum(float(x.sum()) for x in batch.values()))


# -- elements of an input function ------------------------------------------------------
def _loader(asked, n_steps=3, rows=16, pmap=True):
    """An input function yielding, one element per replica per step, pmap-shaped
    elements (a global batch of 8 * rows rows as [8, rows, ...], as common_utils.shard
    makes it) or per-replica batches of ``rows`` rows; ``asked``: it calls
    ctx.get_per_replica_batch_size(8 * rows) first."""
    def input_fn(ctx):
        if asked:
            assert ctx.get_per_replica_batch_size(rows * N) == rows
        for k in range(n_steps * N):
            b = rows * N if pmap else rows
            x = np.full((b, 3), k, np.float32)
            y = np.full((b,), k, np.int32)
            yield ({"x": x.reshape(N, rows, 3), "y": y.reshape(N, rows)} if pmap
                   else {"x": x, "y": y})
    return input_fn


@pytest.mark.parametrize("mode", ["one step", "device loop", "pad", "prefetch"])
def test_a_pmap_shaped_element_is_an_error_where_input_fn_said_its_batch_size(mode):
    rep = _rep()
    kw = {"partial_batch": "pad"} if mode == "pad" else \
        {"prefetch_on_device": True} if mode == "prefetch" else {}
    steps = 2 if mode == "device loop" else None
    it = rep.prepare_input(_loader(asked=True), **kw)
    for _ in range(2):  # raised again: nothing runs unchecked after the first error
        with pytest.raises(ValueError) as e:
            rep.run(_sizes, it, steps=steps)
        msg = str(e.value)
        for part in ("input element of replica 0", "shaped for jax.pmap",
                     "get_per_replica_batch_size(...) for 16 rows", "common_utils.shard",
                     "['x']: (8, 16, 3)", "['y']: (8, 16)",
                     "ctx.get_per_replica_batch_size(global_batch_size)"):
            assert part in msg, (part, msg)
    it.close()


def test_per_replica_batches_from_input_fn_are_not_flagged_and_run():
    rep = _rep()
    it = rep.prepare_input(_loader(asked=True, pmap=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.input.PmapShapedBatchWarning)
        rows, total = rep.run(_sizes, it)
    assert [int(r) for r in rows] == [16, 16]
    assert float(total) == 16 * 3 * sum(range(N)) + 16 * sum(range(N))


def test_a_pmap_shaped_element_warns_where_input_fn_did_not_say_its_batch_size():
    rep = _rep()
    it = rep.prepare_input(_loader(asked=False))
    with pytest.warns(jr.input.PmapShapedBatchWarning, match=r"looks shaped for jax.pmap"):
        rows, _ = rep.run(_sizes, it)
    assert [int(r) for r in rows] == [N, N]  # what the warning says: a whole element


def test_check_element_is_certain_only_when_the_second_dimension_is_the_asked_size():
    counts = frozenset({N})
    shapes, paths = [(N, 4, 3), (N, 4)], ["['x']", "['y']"]
    with pytest.raises(ValueError):
        _porting.check_element(shapes, paths, counts, 4, "e")
    assert isinstance(_porting.check_element(shapes, paths, counts, None, "e"),
                      jr.input.PmapShapedBatchWarning)
    # Asked for 8 = the leading dimension: [8, 4] may be a batch of 8; not certain.
    assert isinstance(_porting.check_element(shapes, paths, counts, N, "e"),
                      jr.input.PmapShapedBatchWarning)
    assert _porting.check_element([(4, 3), (4,)], paths, counts, 4, "e") is None


# -- the parameter-server workers' input ------------------------------------------------
def test_parameter_server_workers_refuse_a_pmap_shaped_element():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(0.1))
        opt = tx.init(w)

    def step(ctx, batch, w, opt):
        g = jax.grad(lambda w: jr.compute_average_loss(batch["x"] @ w, 16))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    def input_fn(ctx):  # a pmap loader: 8 devices of 16 rows; one replica asks for 16
        assert ctx.get_per_replica_batch_size(16) == 16
        while True:
            yield {"x": np.ones((N, 16, 3), np.float32), "y": np.ones((N, 16), np.int32)}

    try:
        v = rep.run(step, rep.prepare_input(input_fn), w, opt)
        with pytest.raises(ValueError, match=r"worker 0: the input element of replica 0 is "
                                             r"shaped for jax.pmap"):
            v.fetch()
        np.testing.assert_array_equal(s.parameters(), np.zeros(3))  # nothing applied
    finally:
        s.shutdown()
