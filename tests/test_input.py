"""Distributed input: modes, contexts, sources, ordering, prefetch, partial batches."""

import threading
import time

import jax
import numpy as np
import pytest

import jreplicate as jr

M = jr.InputReplicationMode


def _rep(n=4):
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n]))


def _values(batch):
    return [np.asarray(v).tolist() for v in batch]


def test_input_context_per_mode():
    rep = _rep(4)
    seen = []

    def input_fn(ctx):
        seen.append((ctx.num_replicas, ctx.num_replicas_in_sync, ctx.input_pipeline_id,
                     ctx.num_input_pipelines))
        return lambda: np.zeros(1)

    rep.prepare_input(input_fn, M.SINGLE)
    rep.prepare_input(input_fn, M.PER_WORKER)
    rep.prepare_input(input_fn)  # default PER_WORKER
    rep.prepare_input(input_fn, M.PER_REPLICA)
    assert seen == [(4, 4, 0, 1), (4, 4, 0, 1), (4, 4, 0, 1)] + [(4, 4, r, 4) for r in range(4)]


def test_per_replica_batch_size():
    ctx = jr.InputContext(num_replicas=8, num_replicas_in_sync=8, input_pipeline_id=0,
                          num_input_pipelines=1)
    assert ctx.get_per_replica_batch_size(256) == 32
    with pytest.raises(ValueError, match="250 is not divisible by the 8 replicas.*248 or 256"):
        ctx.get_per_replica_batch_size(250)
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(0)
    with pytest.raises(TypeError, match="int"):
        ctx.get_per_replica_batch_size(256.0)


def test_global_batch_not_divisible_raises_from_prepare_input():
    rep = _rep(8)
    with pytest.raises(ValueError, match="100 is not divisible by the 8 replicas"):
        rep.prepare_input(lambda ctx: [np.zeros(ctx.get_per_replica_batch_size(100))])


def test_shared_pipeline_feeds_replicas_in_id_order():
    rep = _rep(4)
    it = rep.prepare_input(lambda ctx: iter(range(100)), M.SINGLE, enforce_ordering=True)
    batch = it.get_next()
    assert isinstance(batch, jr.PerReplica) and batch.array.shape == (4,)
    assert _values(batch) == [0, 1, 2, 3]
    assert _values(it.get_next()) == [4, 5, 6, 7]
    assert batch.array.sharding.spec == jax.sharding.PartitionSpec("replica")


def test_per_replica_pipelines_each_feed_their_replica():
    rep = _rep(4)
    for ordering in (True, False):
        it = rep.prepare_input(lambda ctx: ((ctx.input_pipeline_id * 100 + s) for s in range(3)),
                               M.PER_REPLICA, enforce_ordering=ordering)
        assert [_values(b) for b in it] == [[r * 100 + s for r in range(4)] for s in range(3)]


def test_enforce_ordering_reads_replica_0_first():
    rep = _rep(4)
    log, lock = [], threading.Lock()

    def input_fn(ctx):
        def read():
            time.sleep(0.02 * (4 - ctx.input_pipeline_id))  # later replicas answer faster
            with lock:
                log.append(ctx.input_pipeline_id)
            return np.int32(ctx.input_pipeline_id)
        return read

    it = rep.prepare_input(input_fn, M.PER_REPLICA, enforce_ordering=True)
    for _ in range(3):
        assert _values(it.get_next()) == [0, 1, 2, 3]
    assert log == [0, 1, 2, 3] * 3


def test_pytree_elements_and_step():
    rep = _rep(2)

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(4)
        for s in range(4):
            yield {"x": np.full((b, 3), s, np.float32), "y": np.arange(b) + 10 * s}

    it = rep.prepare_input(input_fn)
    out = rep.run(lambda ctx, batch: ctx.all_sum(batch["x"].sum() + batch["y"].sum()), it)
    # replica 0 takes element 0 (x zeros, y [0, 1]), replica 1 element 1 (x ones).
    assert float(out) == 0 + (0 + 1) + 6 + (10 + 11)
    out = rep.run(lambda ctx, batch: ctx.all_sum(batch["x"].sum()), it)
    assert float(out) == 2 * 6 + 3 * 6


def test_callable_source_and_reinitialize_noop():
    rep = _rep(2)
    counter = iter(range(1000))
    it = rep.prepare_input(lambda ctx: lambda: np.int32(next(counter)), M.SINGLE)
    assert _values(it.get_next()) == [0, 1]
    assert it.reinitialize() == []
    assert _values(it.get_next()) == [2, 3]


def test_generator_reinitialize_calls_input_fn_again():
    rep = _rep(2)
    calls = []

    def input_fn(ctx):
        calls.append(ctx.input_pipeline_id)
        return (np.int32(i) for i in range(4))

    it = rep.prepare_input(input_fn, M.SINGLE)
    assert [_values(b) for b in it] == [[0, 1], [2, 3]]
    with pytest.raises(StopIteration):
        it.get_next()
    it.reinitialize()
    assert _values(it.get_next()) == [0, 1]
    assert calls == [0, 0]


class FakeTfDataset:
    """Stands in for tf.data.Dataset: only as_numpy_iterator() is used."""

    def __init__(self, n):
        self.n = n
        self.iterations = 0

    def as_numpy_iterator(self):
        self.iterations += 1
        return iter([np.array([i, i]) for i in range(self.n)])


def test_as_numpy_iterator_source():
    rep = _rep(2)
    ds = FakeTfDataset(4)
    it = rep.prepare_input(lambda ctx: ds, M.PER_REPLICA)
    assert [_values(b) for b in it] == [[[0, 0], [0, 0]], [[1, 1], [1, 1]],
                                        [[2, 2], [2, 2]], [[3, 3], [3, 3]]]
    it.reinitialize()
    assert _values(it.get_next()) == [[0, 0], [0, 0]]
    assert ds.iterations == 4


def test_grain_sources():
    grain = pytest.importorskip(
        "grain", reason="Grain is not installed: pip install 'jreplicate[examples]'")
    rep = _rep(2)
    data = np.arange(32, dtype=np.float32).reshape(16, 2)

    def map_ds(ctx):
        b = ctx.get_per_replica_batch_size(4)
        return (grain.MapDataset.source(data)[ctx.input_pipeline_id::ctx.num_input_pipelines]
                .batch(b))

    it = rep.prepare_input(map_ds, M.PER_REPLICA)
    first = it.get_next()
    np.testing.assert_array_equal(first[0], data[[0, 2]])
    np.testing.assert_array_equal(first[1], data[[1, 3]])
    assert len(list(it)) == 3
    it.reinitialize()
    np.testing.assert_array_equal(it.get_next()[1], data[[1, 3]])

    def loader(ctx):
        return grain.DataLoader(
            data_source=data, sampler=grain.samplers.IndexSampler(
                num_records=len(data), shuffle=False, num_epochs=1,
                shard_options=grain.sharding.ShardOptions(
                    shard_index=ctx.input_pipeline_id, shard_count=ctx.num_input_pipelines)),
            operations=[grain.transforms.Batch(batch_size=2)], worker_count=0)

    it = rep.prepare_input(loader, M.PER_REPLICA)
    batches = list(it)
    assert len(batches) == 4
    np.testing.assert_array_equal(batches[0][0], data[[0, 1]])
    np.testing.assert_array_equal(batches[0][1], data[[8, 9]])


@pytest.mark.parametrize("buffer", [1, 3])
def test_prefetch_gives_same_batches(buffer):
    rep = _rep(4)

    def input_fn(ctx):
        return (np.full((2,), s + 10 * ctx.input_pipeline_id, np.int32) for s in range(5))

    plain = [_values(b) for b in rep.prepare_input(input_fn, M.PER_REPLICA,
                                                    prefetch_on_device=False)]
    it = rep.prepare_input(input_fn, M.PER_REPLICA, prefetch_on_device=True,
                           prefetch_buffer_size=buffer)
    assert [_values(b) for b in it] == plain
    it.reinitialize()
    assert _values(it.get_next()) == plain[0]
    rep.finalize()


def test_prefetch_overlaps_reading_with_the_step():
    rep = _rep(2)

    def input_fn(ctx):
        def slow():
            time.sleep(0.05)
            return np.zeros(2, np.float32)
        return slow

    def consume(prefetch):
        it = rep.prepare_input(input_fn, M.SINGLE, prefetch_on_device=prefetch)
        it.get_next()
        t = time.perf_counter()
        for _ in range(5):
            time.sleep(0.1)  # the "step"
            it.get_next()
        it.close()
        return time.perf_counter() - t

    assert consume(True) < consume(False) - 0.2


def test_prefetch_propagates_errors():
    rep = _rep(2)

    def input_fn(ctx):
        yield np.zeros(2)
        yield np.zeros(2)
        raise RuntimeError("disk on fire")

    it = rep.prepare_input(input_fn, M.SINGLE, prefetch_on_device=True)
    assert _values(it.get_next()) == [[0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(RuntimeError, match="disk on fire"):
        it.get_next()


@pytest.mark.parametrize("length", [14, 16])  # runs out mid-step; a short element
def test_final_partial_batch_dropped_without_recompiling(length):
    rep = _rep(2)
    data = np.arange(length, dtype=np.float32)
    traces = []

    def input_fn(ctx):
        return (data[i:i + 3] for i in range(0, len(data), 3))  # 3,3,3,3,2 / 3,3,3,3,3,1

    def step(ctx, x):
        traces.append(1)
        return ctx.all_sum(x.sum())

    it = rep.prepare_input(input_fn, M.SINGLE, enforce_ordering=True)
    totals = []
    with pytest.warns(UserWarning, match="dropped a final partial batch"):
        while True:
            try:
                totals.append(float(rep.run(step, it)))
            except StopIteration:
                break
    assert totals == [data[:6].sum(), data[6:12].sum()]  # the rest is dropped
    assert len(traces) == 1
    with pytest.raises(StopIteration):
        it.get_next()


def test_bad_input_fn_results():
    rep = _rep(2)
    with pytest.raises(TypeError, match="neither iterable nor callable"):
        rep.prepare_input(lambda ctx: 42)
    with pytest.raises(TypeError, match="single element"):
        rep.prepare_input(lambda ctx: np.zeros((4, 2)))
    with pytest.raises(TypeError, match="single element"):
        rep.prepare_input(lambda ctx: {"x": np.zeros(2)})
    with pytest.raises(TypeError, match="must be callable"):
        rep.prepare_input([1, 2])
    with pytest.raises(TypeError, match="InputReplicationMode"):
        rep.prepare_input(lambda ctx: lambda: 1, "per_replica")
    with pytest.raises(ValueError, match="prefetch_buffer_size"):
        rep.prepare_input(lambda ctx: lambda: 1, prefetch_on_device=True, prefetch_buffer_size=0)


def test_bad_elements():
    rep = _rep(2)
    it = rep.prepare_input(lambda ctx: iter([{"x": np.zeros(2), "s": "name"}] * 2), M.SINGLE)
    with pytest.raises(TypeError, match=r"str at \['s'\]"):
        it.get_next()
    shapes = iter([np.zeros(2), np.zeros(3)])
    it = rep.prepare_input(lambda ctx: lambda: next(shapes), M.SINGLE)
    with pytest.raises(ValueError, match="replica 1 at the root has shape"):
        it.get_next()
    structs = iter([np.zeros(2), (np.zeros(2),)])
    it = rep.prepare_input(lambda ctx: lambda: next(structs), M.SINGLE)
    with pytest.raises(ValueError, match="structure"):
        it.get_next()


def test_elements_without_arrays_still_take_the_batch_slot():
    rep = _rep(2)
    for element in (None, {}, ()):
        it = rep.prepare_input(lambda ctx, e=element: lambda: e, M.SINGLE)
        out = rep.run(lambda ctx, batch, w: (batch, w * 2), it, np.float32(3.0))
        assert out[0] == element and float(out[1]) == 6.0


def test_prefetched_iterator_after_close_raises_instead_of_hanging():
    rep = _rep(2)

    def input_fn(ctx):
        def slow():
            time.sleep(0.2)  # the prefetch thread is mid-read when close() comes
            return np.int32(1)
        return slow

    it = rep.prepare_input(input_fn, M.SINGLE, prefetch_on_device=True)
    it.get_next()
    rep.finalize()
    result = []

    def read():
        try:
            it.get_next()
        except RuntimeError as e:
            result.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert result and "closed" in result[0] and "reinitialize()" in result[0]
    it.reinitialize()
    assert _values(it.get_next()) == [1, 1]
    it.close()


def test_reinitialize_opens_a_reiterable_source_once():
    rep = _rep(2)

    class Source:
        passes = 0

        def __iter__(self):
            Source.passes += 1
            return iter([np.int32(i) for i in range(4)])

    it = rep.prepare_input(lambda ctx: Source(), M.SINGLE)
    assert _values(it.get_next()) == [0, 1]
    it.reinitialize()
    assert _values(it.get_next()) == [0, 1]
    assert Source.passes == 2


def test_dropped_prefetching_iterators_release_their_threads():
    import gc

    rep = _rep(2)

    def prefetch_threads():
        return {t for t in threading.enumerate() if t.name == "jreplicate-prefetch"}

    # Track this test's threads only: other tests' dropped iterators may end meanwhile.
    before = prefetch_threads()
    its = [rep.prepare_input(lambda ctx: lambda: np.zeros(2, np.float32), M.SINGLE,
                             prefetch_on_device=True, prefetch_buffer_size=2)
           for _ in range(5)]
    for it in its:
        it.get_next()
    ours = prefetch_threads() - before
    assert len(ours) == 5
    del its, it
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in ours) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in ours)


def test_reinitialize_waits_for_a_slow_read_in_progress():
    rep = _rep(2)
    state = {"epoch": 0}

    def input_fn(ctx):
        epoch = state["epoch"]

        def gen():
            for i in range(100):
                if epoch == 0 and i == 2:
                    time.sleep(0.5)  # a slow read in flight when reinitialize is called
                yield np.int32(100 * epoch + i)
        return gen()

    it = rep.prepare_input(input_fn, M.SINGLE, prefetch_on_device=True)
    assert _values(it.get_next()) == [0, 1]
    time.sleep(0.1)  # the prefetch thread is now inside the slow read
    state["epoch"] = 1
    it.reinitialize()
    assert [_values(it.get_next()) for _ in range(3)] == [[100, 101], [102, 103], [104, 105]]
    it.close()


def test_a_source_that_reuses_its_buffer_never_changes_a_batch_already_read():
    """On CPU a transfer may alias host memory: every batch must be a copy."""
    rep = jr.Replicator(jr.MirroredStrategy())
    buf = np.zeros((2, 3), np.float32)

    def input_fn(ctx):
        for i in range(16):
            buf[:] = i  # the same buffer, refilled for every element
            yield buf

    for prefetch in (False, True):
        # One pipeline: the 8 elements of a step come from one generator, one after the
        # other, before the step's batch is built.
        it = rep.prepare_input(input_fn, prefetch_on_device=prefetch)
        b = it.get_next()
        np.testing.assert_array_equal(np.asarray(b.array)[:, 0, 0], np.arange(8))
    for prefetch in (False, True):
        it = rep.prepare_input(lambda ctx: input_fn(ctx), jr.InputReplicationMode.PER_REPLICA,
                               prefetch_on_device=prefetch, enforce_ordering=True)
        batches = [it.get_next() for _ in range(3)]
        for i, b in enumerate(batches):
            np.testing.assert_array_equal(np.asarray(b.array), np.full((8, 2, 3), i))


def test_a_plain_global_batch_changed_after_run_does_not_change_that_step():
    rep = jr.Replicator(jr.MirroredStrategy())
    x = np.ones((16, 3), np.float32)
    out = rep.run(lambda ctx, b: b * 1.0, x)  # a PerReplica made from x
    x[:] = 5.0
    np.testing.assert_array_equal(np.asarray(out.array), np.ones((8, 2, 3)))
