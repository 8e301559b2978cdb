"""ParameterServerStrategy's per-worker input pipelines (InputReplicationMode.PER_WORKER)
live as long as their iterator: close(), or the driver letting it go (del + gc), frees
the pipeline on every worker; an iterator still held keeps reading in order; steps
scheduled from a closed iterator either ran (read and applied once) or were not run
(StopIteration), never half."""

import gc
import threading

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.worker_input import InputEnded, WorkerInput, WorkerPipelines
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.5


def _job(num_workers=2, **kw):
    """A linear loss sum(w * x): the trained parameters are -LR * (sum of the batches
    applied), whatever the order. Elements are [pipeline id, index, tag, 1]."""
    s, rep, w, opt, tx = sgd_job(4, lr=LR, num_ps=1, num_workers=num_workers, **kw)

    def step(ctx, x, w, opt):
        g_ = jax.grad(lambda w: jr.compute_average_loss(jnp.sum(w * x)[None], 1))(w)
        u, opt = tx.update(g_, opt, w)
        return optax.apply_updates(w, u), opt, x

    return s, rep, w, opt, step


def _input_fn(tag, n=1000, sources=None):
    def input_fn(ctx):
        src = [np.array([ctx.input_pipeline_id, i, tag, 1], np.float32) for i in range(n)]
        if sources is not None:
            sources.append(src)
        return src
    return input_fn


def _batch(v):
    return np.asarray(v.fetch()[2]).reshape(4)


def _counts(s):
    """Pipelines each worker holds (its private dict: the same on the code before the
    release existed, so that this test fails there)."""
    return [len(w.inputs._pipes) for w in s._executor._carrier.workers]


@pytest.mark.parametrize("how", ["close", "del_gc"])
def test_a_hundred_prepared_inputs_hold_one_pipeline_per_worker(how):
    s, rep, w, opt, step = _job()
    applied = []
    for k in range(100):
        it = rep.prepare_input(_input_fn(k))
        applied += [rep.run(step, it, w, opt) for _ in range(3)]
        rep.join()
        assert max(_counts(s)) <= 2  # this one, and at most the one before (in flight)
        if how == "close":
            it.close()
        else:  # (freed by reference counting; the collector for cycles, if any)
            del it
            if k % 25 == 24:
                gc.collect()
    assert _counts(s) == [0, 0]
    keep = rep.prepare_input(_input_fn(100))
    applied += [rep.run(step, keep, w, opt) for _ in range(4)]
    rep.join()
    assert sorted(_counts(s)) == sorted(
        [1 if any(v.worker == k for v in applied[-4:]) else 0 for k in range(2)])
    total = sum(_batch(v) for v in applied)  # every step applied once
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6)


def test_the_sources_themselves_are_freed():
    """No reference to a freed pipeline's source is left anywhere (weakrefs die)."""
    s, rep, w, opt, step = _job()

    class Source(list):
        pass

    refs = []

    def input_fn(ctx):
        src = Source(np.full(4, i, np.float32) for i in range(50))
        refs.append(__import__("weakref").ref(src))
        return src

    for _ in range(5):
        it = rep.prepare_input(input_fn)
        for _ in range(4):
            rep.run(step, it, w, opt)
        rep.join()
        it.close()
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_an_iterator_still_held_keeps_reading_in_order():
    s, rep, w, opt, step = _job()
    kept = rep.prepare_input(_input_fn(100))
    values = [rep.run(step, kept, w, opt) for _ in range(4)]
    for k in range(10):  # others come and go around it
        other = rep.prepare_input(_input_fn(k))
        values += [rep.run(step, other, w, opt), rep.run(step, kept, w, opt)]
        if k % 2:
            values[-2].fetch()  # (close() would not run it if it had not begun)
            other.close()
        else:  # let go with its step queued: the step holds it, and runs
            del other
            gc.collect()
    rep.join()
    got = [(v.worker, _batch(v)) for v in values]
    for k in range(2):  # each worker read its own pipeline of `kept` in order, no gap
        mine = [int(b[1]) for wk, b in got if wk == k and b[2] == 100]
        assert mine == list(range(len(mine)))
    assert sum(1 for _, b in got if b[2] == 100) == 14
    total = sum(b for _, b in got)
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6)
    assert _counts(s) == [1 if any(wk == k and b[2] == 100 for wk, b in got) else 0
                          for k in range(2)]


def test_closing_while_steps_are_queued_runs_each_once_or_not_at_all():
    """Defined: a step that began reading finishes and is applied; a step not started
    yet is not run (StopIteration, as at the end of input); join does not raise; the
    closed iterator schedules nothing more, and a new one runs."""
    s, rep, w, opt, step = _job()
    jrt.set_worker_delay(s, 0, 0.05)
    jrt.set_worker_delay(s, 1, 0.05)
    it = rep.prepare_input(_input_fn(3))
    values = [rep.run(step, it, w, opt) for _ in range(30)]
    values[0].fetch()  # (then the other 29 need 0.7 s at least: most are still queued)
    it.close()
    rep.join()  # no error: the end of an input is no failure
    ran, not_run = [], 0
    for v in values:
        try:
            ran.append((v.worker, _batch(v)))
        except StopIteration:
            not_run += 1
    assert ran and not_run and len(ran) + not_run == 30
    for k in range(2):  # what ran read each worker's pipeline in order, once each
        mine = [int(b[1]) for wk, b in ran if wk == k]
        assert mine == list(range(len(mine)))
    np.testing.assert_allclose(s.parameters(), -LR * sum(b for _, b in ran), rtol=1e-6)
    assert _counts(s) == [0, 0]
    with pytest.raises(RuntimeError, match="closed"):
        rep.run(step, it, w, opt)
    with pytest.raises(RuntimeError, match="closed"):
        it.reinitialize()
    fresh = rep.prepare_input(_input_fn(4))
    assert _batch(rep.run(step, fresh, w, opt))[1] == 0


def _marker(key, gen=0):
    return WorkerInput(key, gen, _input_fn(key, n=3), num_workers=1, num_replicas=1)


def test_a_release_never_waits_for_a_read_in_progress():
    """A finalizer may run on the worker's own thread in the middle of a read (the
    garbage collector runs anywhere): release returns at once, and the read that holds
    the pipeline frees it on its way out."""
    pipes = WorkerPipelines(0, 1)
    pipes.read(_marker(1))
    with pipes._lock:  # a read in progress
        t = threading.Thread(target=pipes.release, args=(1,))
        t.start()
        t.join(5)
        assert not t.is_alive() and len(pipes._pipes) == 1
        pipes.release(1)  # on the reading thread itself: no deadlock
    assert pipes.pipeline_count() == 0
    with pytest.raises(InputEnded):  # never built again
        pipes.read(_marker(1))
    assert pipes.pipeline_count() == 0


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(["read", "release", "put_back"]),
                          st.integers(0, 3)), max_size=30))
def test_pipelines_held_match_a_reference_model(ops):
    """Against a reference: a pipeline is held iff it was read and not released; a
    released key is never read again; an unreleased one reads its elements in order
    (a failed step's elements put back are read again first, once), and ends after its
    last."""
    pipes = WorkerPipelines(0, 1)
    released, position, last, held, retrying = set(), {}, {}, {}, set()
    for op, key in ops:
        m = _marker(key)
        if op == "release":
            pipes.release(key)
            released.add(key)
        elif op == "put_back" and key in last:
            got = last.pop(key)
            pipes.put_back(m, *got)
            if key not in released and key not in held and key not in retrying:
                held[key] = int(got[0][0][0][1])
        elif op == "read":
            if key in released:
                with pytest.raises(InputEnded):
                    pipes.read(m)
                continue
            if key in held:
                want = held.pop(key)
                retrying.add(key)
            else:
                retrying.discard(key)
                want = position.get(key, 0)
                if want >= 3:
                    with pytest.raises(InputEnded):
                        pipes.read(m)
                    continue
                position[key] = want + 1
            got = pipes.read(m)
            assert int(got[0][0][0][1]) == want
            last[key] = got
        assert pipes.pipeline_count() == len(set(position) - released)
