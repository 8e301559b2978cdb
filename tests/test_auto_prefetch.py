"""prefetch_on_device=None: read on the calling thread; where reads cost, a trial of
prefetch, kept if it makes steps faster; no batch lost, repeated or reordered across
either switch."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr
from jreplicate.input import auto

N = 40


def _source(delay, n=N):
    def input_fn(ctx):
        for i in range(n):
            if delay:
                time.sleep(delay)
            yield np.full((2, 3), float(i), np.float32)
    return input_fn


def _step(ctx, x):
    return ctx.all_sum(jnp.sum(x))


def _work():
    """The rest of a training step on the host (as long as a slow read): what prefetch
    overlaps the reads with."""
    time.sleep(0.005)


def _expected(i, n):
    return float(i) * 6 * n


@pytest.fixture
def rep():
    return jr.Replicator(jr.MirroredStrategy())


def test_a_slow_source_turns_prefetch_on_and_loses_nothing(rep):
    it = rep.prepare_input(_source(0.005), jr.InputReplicationMode.PER_REPLICA)
    assert not it.prefetching
    got, switched_at = [], None
    for i in range(N):
        got.append(float(rep.run(_step, it)))
        _work()
        if switched_at is None and it.prefetching:
            switched_at = i
    with pytest.raises(StopIteration):
        rep.run(_step, it)
    assert switched_at is not None and switched_at <= auto.WARMUP + auto.WINDOW + 1
    assert it.prefetching and it._staging.auto is None  # the trial kept it
    assert got == [_expected(i, 8) for i in range(N)]


def test_a_fast_source_with_a_slower_loop_stays_on_the_calling_thread(rep):
    it = rep.prepare_input(_source(0), jr.InputReplicationMode.PER_REPLICA)
    got = []
    for _ in range(N):
        got.append(float(rep.run(_step, it)))
        # The rest of the training loop, long enough that reads stay well below
        # auto.SHARE of the cycle even on a loaded 2-core CI machine (at 10 ms, a read
        # slowed by the load once started a trial, which prefetch rightly won).
        time.sleep(0.05)
    assert not it.prefetching
    assert got == [_expected(i, 8) for i in range(N)]


def test_device_loops_switch_too_and_keep_the_order(rep):
    it = rep.prepare_input(_source(0.005), jr.InputReplicationMode.PER_REPLICA)

    def loop_step(ctx, x):
        return ctx.all_sum(jnp.sum(x))

    got = []
    while True:
        try:
            got.extend(float(v) for v in rep.run(loop_step, it, steps=3))
            _work()
        except StopIteration:
            break
    assert it.prefetching
    assert got == [_expected(i, 8) for i in range(N)]


@pytest.mark.parametrize("steps", [None, 2])
def test_a_trial_that_does_not_pay_goes_back_in_line_in_order(rep, monkeypatch, steps):
    monkeypatch.setattr(auto, "GAIN", 1.0)  # no trial can pay
    n = 2 * N if steps else N
    it = rep.prepare_input(_source(0.003, n), jr.InputReplicationMode.PER_REPLICA)
    got, seen_on = [], False
    while True:
        try:
            out = rep.run(_step, it, steps=steps)
        except StopIteration:
            break
        got.extend([float(out)] if steps is None else [float(v) for v in out])
        seen_on = seen_on or it.prefetching
    assert seen_on and not it.prefetching
    assert got == [_expected(i, 8) for i in range(n)]


def test_explicit_settings_are_kept(rep):
    on = rep.prepare_input(_source(0), jr.InputReplicationMode.PER_REPLICA,
                            prefetch_on_device=True)
    off = rep.prepare_input(_source(0.005), jr.InputReplicationMode.PER_REPLICA,
                            prefetch_on_device=False)
    assert on.prefetching
    for _ in range(15):
        rep.run(_step, on)
        rep.run(_step, off)
    assert on.prefetching and not off.prefetching


def test_a_sweep_after_the_switch_reads_from_the_start(rep):
    it = rep.prepare_input(_source(0.005), jr.InputReplicationMode.PER_REPLICA)
    for _ in range(N):
        rep.run(_step, it)
        _work()
    assert it.prefetching
    it.reinitialize()
    got = [float(rep.run(_step, it)) for _ in range(N)]
    assert got == [_expected(i, 8) for i in range(N)]


@pytest.mark.parametrize("bad", [1, "auto", 0.5])
def test_prefetch_on_device_must_be_none_or_a_bool(rep, bad):
    with pytest.raises(TypeError, match=r"prefetch_on_device=.* must be None"):
        rep.prepare_input(_source(0), prefetch_on_device=bad)
