"""Partial batches: only a pipeline's *final* element may be a
partial batch, and a partial batch is one where every batched leaf is shorter by the
same number of rows.

Found 2026-11-26 (both lost data with only a warning):

1. With ``partial_batch="drop"`` a shorter element in the middle of a pipeline ended
   the whole iteration: an ``input_fn`` over several files, each ending in a partial
   batch, trained on the first file only. It is now an error naming the replica, the
   pipeline, the step, the leaf and the fix; the next step reads on after it. A
   shorter element that its pipeline really ends with is dropped as before (found by
   reading one element ahead, only at a shorter element). ``"pad"`` pads a shorter
   element wherever it is (its mask counts its real rows: nothing is lost).
2. An element whose leaves disagree on the batch length (``x`` shorter while ``y``
   keeps the full length, or ``x`` and ``y`` shorter by different amounts) was taken
   for a final partial batch; under ``"pad"`` one whose first leaf was shorter got a
   mask that hid the other leaves' real rows. Both are errors now.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

M = jr.InputReplicationMode
DROPPED = "dropped a final partial batch"


def _rep(n: int = 2) -> jr.Replicator:
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n]))


def _el(tag: int, rows: int = 4) -> dict:
    """An element of ``rows`` examples, each tagged ``tag`` (``y``) with features ``x``."""
    return {"x": np.full((rows, 2), tag, np.float32), "y": np.full(rows, tag, np.int32)}


def _files(ctx, files=3, rows=(4, 4, 4, 3)):
    """One pipeline over ``files`` files, each batched on its own: element ``i`` of file
    ``f`` is tagged ``10 * f + i``, and each file's last element is shorter."""
    for f in range(files):
        for i, n in enumerate(rows):
            yield _el(10 * f + i, n)


def _tags(ctx, batch):
    return batch["y"][0], ctx.all_sum(jnp.float32(batch["y"].shape[0]))


def _events(rep, it, steps, calls=30):
    """Runs ``it`` to its end: ``(events, warnings)``, where an event is a step's tags
    (one per replica) or ``("error", message)``; a device loop's steps are listed one
    by one, so a loop of K reads as K separate runs."""
    events = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            try:
                tags, rows = rep.run(_tags, it, steps=steps)
            except StopIteration:
                break
            except ValueError as e:
                events.append(("error", str(e)))
                continue
            a = np.asarray(tags.array).reshape(rep.num_replicas, -1)
            events += [tuple(a[:, s].tolist()) for s in range(a.shape[1])]
            assert set(np.asarray(rows).reshape(-1).tolist()) == {4.0 * rep.num_replicas}
        else:
            pytest.fail("the input never ended")
    return events, [str(w.message) for w in caught if "jreplicate" in str(w.message)]


def _error(step: int, replica: int, pipeline: int, leaf: str = r"\['x'\]", rows: int = 3):
    return re.compile(
        rf"input element of replica {replica} \(input pipeline {pipeline}\), read for step "
        rf"{step} of this sweep of the input, is a partial batch \({leaf} has {rows} rows, "
        r"the first step's elements 4\), but its pipeline has more elements after it\. "
        r".*partial_batch='pad', which pads every shorter element")


def _check_events(events, want):
    assert len(events) == len(want), events
    for got, w in zip(events, want):
        if isinstance(w, re.Pattern):
            assert got[0] == "error" and w.search(got[1]), got
        else:
            assert got == w


# -- 1. a shorter element mid-stream --------------------------------------------------
@pytest.mark.parametrize("mode", [M.SINGLE, M.PER_WORKER])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("steps", [None, 3])
def test_files_each_ending_short_raise_at_each_file_end_and_read_on(mode, prefetch, steps):
    """Three files of 4 elements (the last one of 3 rows) in one pipeline, 2 replicas a
    step: the end of files 1 and 2 is an error (the step that read it; the next reads
    file 2, 3), the end of file 3 is the pipeline's end, dropped with a warning. Before:
    the first shorter element ended the input (files 2 and 3 never read)."""
    rep = _rep()
    it = rep.prepare_input(_files, mode, prefetch_on_device=prefetch)
    events, warned = _events(rep, it, steps)
    _check_events(events, [(0, 1), _error(2, 1, 0), (10, 11), _error(4, 1, 0), (20, 21)])
    assert len(warned) == 1 and DROPPED in warned[0] and "replica 1 got 3 examples" in \
        warned[0]
    it.reinitialize()  # the same on the next sweep
    events, _ = _events(rep, it, steps)
    _check_events(events, [(0, 1), _error(2, 1, 0), (10, 11), _error(4, 1, 0), (20, 21)])


@pytest.mark.parametrize("prefetch", [False, True])
def test_a_shorter_element_followed_in_its_own_step_reads_nothing_ahead(prefetch):
    """A shorter element that the step's next element follows is an error without a
    look-ahead; full steps never read ahead (the fast path is as it was)."""
    rep = _rep()
    reads = []

    def input_fn(ctx):
        for i, n in enumerate([4, 4, 3, 4, 4, 4]):
            reads.append(i)
            yield _el(i, n)

    it = rep.prepare_input(input_fn, M.SINGLE, prefetch_on_device=prefetch)
    np.testing.assert_array_equal(np.asarray(it.get_next()["y"].array)[:, 0], [0, 1])
    with pytest.raises(ValueError, match=_error(2, 0, 0)):
        it.get_next()
    np.testing.assert_array_equal(np.asarray(it.get_next()["y"].array)[:, 0], [4, 5])
    if not prefetch:
        assert reads == list(range(6))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the end at a step's start: nothing dropped
        with pytest.raises(StopIteration):
            it.get_next()


def test_full_steps_read_exactly_their_elements():
    rep = _rep()
    reads = []

    def input_fn(ctx):
        for i in range(100):
            reads.append(i)
            yield _el(i)

    it = rep.prepare_input(input_fn, M.SINGLE, prefetch_on_device=False)
    for _ in range(3):
        it.get_next()
    assert reads == list(range(6))


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("steps", [None, 2])
def test_per_replica_pipelines(ordered, prefetch, steps):
    """Several pipelines (PER_REPLICA): a shorter element that its pipeline follows with
    more is an error naming that replica and pipeline, whatever the others do (even
    where another pipeline ends in that step); one that ends its pipeline while the
    others go on is the final partial step, dropped as before."""
    rep = _rep()

    def run(sizes):
        def input_fn(ctx):
            return iter([_el(10 * ctx.input_pipeline_id + i, n)
                         for i, n in enumerate(sizes[ctx.input_pipeline_id])])
        it = rep.prepare_input(input_fn, M.PER_REPLICA, enforce_ordering=ordered,
                               prefetch_on_device=prefetch)
        return _events(rep, it, steps)

    events, warned = run([[4, 3, 4], [4, 4, 4]])  # pipeline 0 short mid-stream
    _check_events(events, [(0, 10), _error(2, 0, 0), (2, 12)])
    assert warned == []
    events, warned = run([[4, 4, 4, 4], [4, 3]])  # pipeline 1 ends short: the end
    _check_events(events, [(0, 10)])
    assert len(warned) == 1 and "replica 1 got 3 examples at ['x'], the others 4" in \
        warned[0]
    events, warned = run([[4, 3, 4], [4]])  # pipeline 1 ends where 0 is short mid-stream
    _check_events(events, [(0, 10), _error(2, 0, 0)])
    assert len(warned) == 1 and "ran out after 1 of 2 replicas" in warned[0]
    events, warned = run([[4, 3], [4, 2]])  # both end short: the final partial step
    _check_events(events, [(0, 10)])
    assert len(warned) == 1 and DROPPED in warned[0]


@pytest.mark.parametrize("mode", [M.SINGLE, M.PER_REPLICA])
def test_a_read_ahead_that_raises_is_no_end_and_the_next_step_raises_it(mode):
    """The read ahead at a shorter element raises: the pipeline did not end there, so
    the step is a mid-stream partial batch; the read's error is the next step's (so
    that per-replica pipelines stay in step: each gives one element or error a step),
    and the step after it reads on."""
    rep = _rep()

    class Source:
        def __init__(self):
            self.items = iter([_el(0), _el(1), _el(2), _el(3, 3), OSError("bad record"),
                               _el(5), _el(6)])

        def __iter__(self):
            return self

        def __next__(self):
            item = next(self.items)
            if isinstance(item, Exception):
                raise item
            return item

    it = rep.prepare_input(lambda ctx: Source(), mode, prefetch_on_device=False)
    if mode is M.SINGLE:
        it.get_next()
        with pytest.raises(ValueError, match=_error(2, 1, 0)):
            it.get_next()
        with pytest.raises(OSError, match="bad record"):
            it.get_next()
        np.testing.assert_array_equal(np.asarray(it.get_next()["y"].array)[:, 0], [5, 6])
    else:
        for i in range(3):
            np.testing.assert_array_equal(np.asarray(it.get_next()["y"].array)[:, 0], [i, i])
        with pytest.raises(ValueError) as info:
            it.get_next()
        assert _error(4, 0, 0).search(str(info.value)) and "replica 1 (input pipeline 1)" in \
            str(info.value)
        with pytest.raises(OSError, match="bad record"):
            it.get_next()
        np.testing.assert_array_equal(np.asarray(it.get_next()["y"].array)[:, 0], [5, 5])


def test_a_callable_source_never_ends_so_a_shorter_element_is_an_error():
    rep = _rep()
    rows = iter([4, 4, 3, 4, 4, 4])
    it = rep.prepare_input(lambda ctx: lambda: _el(0, next(rows)), M.SINGLE,
                           prefetch_on_device=False)
    it.get_next()
    with pytest.raises(ValueError, match=_error(2, 0, 0)):
        it.get_next()
    it.get_next()  # reads on


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("steps", [None, 3])
def test_pad_pads_a_shorter_element_mid_stream_and_counts_every_example(prefetch, steps):
    """``"pad"`` pads every shorter element (its mask counts its rows) and reads on:
    every example of every file is seen once, on every sweep, with no error."""
    rep = _rep()
    it = rep.prepare_input(_files, M.SINGLE, prefetch_on_device=prefetch,
                           partial_batch="pad")

    def count(ctx, batch):
        m = ctx.batch_mask
        return ctx.all_sum(m.sum()), ctx.all_sum(jnp.sum(batch["y"] * m)), \
            ctx.all_sum(jnp.sum(batch["x"] * m[:, None]))

    for _ in range(2):
        n = total = xs = 0.0
        while True:
            try:
                c, t, x = rep.run(count, it, steps=steps)
            except StopIteration:
                break
            n, total, xs = n + float(np.sum(c)), total + float(np.sum(t)), \
                xs + float(np.sum(x))
        rows = [4, 4, 4, 3]
        assert n == 3 * 15
        want = sum((10 * f + i) * r for f in range(3) for i, r in enumerate(rows))
        assert total == want and xs == 2 * want
        it.reinitialize()


# -- 2. leaves that disagree on the batch length ----------------------------------------
@pytest.mark.parametrize("partial_batch", ["drop", "pad"])
@pytest.mark.parametrize("lengths", [(3, 4), (4, 3), (3, 2)])
@pytest.mark.parametrize("last", [True, False])
def test_leaves_that_disagree_on_the_batch_length_are_an_error(partial_batch, lengths, last):
    """``x`` and ``y`` of another number of rows in one element (one of them full, or
    both shorter by different amounts), last in its pipeline or not: an error naming
    the leaves and their rows, never a dropped or padded final batch."""
    rep = _rep(1)
    nx, ny = lengths
    bad = {"x": np.zeros((nx, 2), np.float32), "y": np.zeros(ny, np.int32)}
    elements = [_el(0), bad] + ([] if last else [_el(2)])
    it = rep.prepare_input(lambda ctx: iter(elements), M.SINGLE, prefetch_on_device=False,
                           partial_batch=partial_batch)
    it.get_next()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped
        with pytest.raises(ValueError) as info:
            it.get_next()
    msg = str(info.value)
    assert "['x']" in msg and "['y']" in msg, msg
    if partial_batch == "drop":
        assert (f"is no partial batch: its leaves disagree on the number of examples (rows "
                f"along the leading axis: ['x'] {nx} (first step 4), ['y'] {ny} (first step "
                "4))") in msg
    else:
        assert "by the same number of rows in every leaf" in msg


def test_unbatched_leaves_keep_their_shape_in_a_final_partial_batch():
    """Leaves whose leading axis is not the batch (another length, or none) stay as
    they are in a final partial batch, which is dropped as before; changing one is an
    error."""
    rep = _rep(1)

    def el(rows, table=5):
        return {"x": np.zeros((rows, 2), np.float32), "table": np.zeros(table, np.float32),
                "scale": np.float32(1)}

    it = rep.prepare_input(lambda ctx: iter([el(4), el(3)]), M.SINGLE,
                           prefetch_on_device=False)
    it.get_next()
    with pytest.warns(UserWarning, match=DROPPED + r" \(replica 0 got 3 examples at \['x'\]"):
        with pytest.raises(StopIteration):
            it.get_next()
    it = rep.prepare_input(lambda ctx: iter([el(4), el(3, table=4)]), M.SINGLE,
                           prefetch_on_device=False)
    it.get_next()
    with pytest.raises(ValueError, match=r"\['table'\] 4 \(first step 5\), \['x'\] 3"):
        it.get_next()


# -- ParameterServerStrategy, PER_WORKER: the same rules on the worker ------------------
def _ps_job(g: int = 1):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=g,
                                   carrier="embedded")
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(2)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def step(ctx, batch, w, opt):
        grad = jax.grad(lambda w: jnp.sum(w * batch["x"]))(w)
        u, opt = tx.update(grad, opt, w)
        return optax.apply_updates(w, u), opt, batch["y"]

    return s, rep, w, opt, step


@pytest.mark.parametrize("g", [1, 2])
def test_ps_per_worker_a_shorter_element_mid_stream_is_that_steps_error(g):
    """A worker's pipeline of two files (4 + 4 elements, each ending shorter), ``g``
    elements a step: each file's end but the last is an error of the step that read it
    (raised once, by the next ``join``, as TensorFlow's coordinator does; the next step
    reads on); the last is dropped with a warning."""
    s, rep, w, opt, step = _ps_job(g)
    try:
        rows = [4, 4, 4, 3] if g == 2 else [4, 3]
        it = rep.prepare_input(lambda ctx: _files(ctx, files=2, rows=rows))
        first = rep.run(step, it, w, opt)
        rep.join()
        short = rep.run(step, it, w, opt)
        with pytest.raises(ValueError, match="is a partial batch"):
            rep.join()  # the step's error, once
        after = rep.run(step, it, w, opt)  # the error was raised: training goes on
        with pytest.warns(UserWarning, match="worker 0 dropped a final partial batch"):
            last = rep.run(step, it, w, opt)
            rep.join()
        outcomes = []
        for v in (first, short, after, last):
            try:
                outcomes.append(np.asarray(v.fetch()[2]).reshape(g, -1)[:, 0].tolist())
            except ValueError as e:
                outcomes.append(str(e))
            except StopIteration:
                outcomes.append("not run")
        assert outcomes[0] == list(range(g)) and outcomes[2] == [10 + i for i in range(g)]
        assert outcomes[1].startswith(
            f"worker 0: input element of replica {g - 1} (input pipeline 0), read for step "
            "2 of this sweep of the input, is a partial batch (['x'] has 3 rows"), outcomes
        assert outcomes[3] == "not run"
        with pytest.raises(StopIteration):
            rep.run(step, it, w, opt)
    finally:
        s.shutdown()


def test_ps_per_worker_leaves_that_disagree_are_an_error():
    s, rep, w, opt, step = _ps_job()
    try:
        bad = {"x": np.zeros((3, 2), np.float32), "y": np.zeros(4, np.int32)}
        it = rep.prepare_input(lambda ctx: [_el(0), bad])
        values = [rep.run(step, it, w, opt) for _ in range(2)]
        with pytest.raises(ValueError):
            rep.join()
        values[0].fetch()
        with pytest.raises(ValueError, match=r"worker 0: input element of replica 0 is no "
                           r"partial batch.*\['x'\] 3 \(first step 4\), \['y'\] 4"):
            values[1].fetch()
    finally:
        s.shutdown()
