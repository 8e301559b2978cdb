"""A failed step consumes no input, a device loop equals K separate runs when a step or
the input raises, and no pipeline's error is swallowed (issue 15, items 4 and 5).

Every element encodes its index, and every step returns the elements it saw, so each
check is exact: the steps see the input in order, nothing lost, nothing twice.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr

M = jr.InputReplicationMode
N = 10  # elements per pipeline


def _rep(n=2):
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n]))


# Module-level steps: every test hits the same compiled programs.
def _see(ctx, batch, n):
    return n + 1, batch[0]


def _trace_fails(ctx, batch, n):
    raise RuntimeError("the step failed")


def _interrupted(ctx, batch, n):
    raise KeyboardInterrupt


def _run(rep, it, n, steps):
    """One call; the element indices each step saw (replica 0's), in order."""
    n, seen = rep.run(_see, it, n, steps=steps)
    return n, [int(x) for x in np.asarray(seen[0]).reshape(-1)]


def _fail(rep, it, n, steps, how):
    """A call of ``run`` that raises after it took its batch (trace, interrupt, or an
    argument rejected when the program is called)."""
    if how == "trace":
        with pytest.raises(RuntimeError, match="the step failed"):
            rep.run(_trace_fails, it, n, steps=steps)
    elif how == "interrupt":
        with pytest.raises(KeyboardInterrupt):
            rep.run(_interrupted, it, n, steps=steps)
    else:
        gone = rep.replicate(jnp.int32(0))
        gone.delete()
        with pytest.raises(ValueError, match="donated to an earlier step"):
            rep.run(_see, it, gone, steps=steps)


def _until_end(rep, it, n, steps):
    seen = []
    while True:
        try:
            n, got = _run(rep, it, n, steps)
        except StopIteration:
            return n, seen
        seen += got


def _elements(ctx):
    return iter([np.full((1,), i, np.float32) for i in range(N)])


@pytest.mark.parametrize("prefetch", [False, True, None])
@pytest.mark.parametrize("how", ["trace", "interrupt", "call"])
@pytest.mark.parametrize("retry", [None, 3, 4])
def test_a_failed_loop_keeps_its_batches_for_any_retry(prefetch, how, retry):
    rep = _rep()
    it = rep.prepare_input(_elements, M.PER_REPLICA, prefetch_on_device=prefetch)
    n, seen = rep.replicate(jnp.int32(0)), []
    n, got = _run(rep, it, n, None)  # one step first: the loop starts mid-stream
    seen += got
    _fail(rep, it, n, 4, how)
    _fail(rep, it, n, 4, how)  # and again: still nothing consumed
    n, got = _run(rep, it, n, retry)
    seen += got
    assert len(got) == (retry or 1)  # a loop of K runs K steps, whatever was put back
    n, rest = _until_end(rep, it, n, retry)
    assert seen + rest == list(range(N))
    assert int(n) == N


@pytest.mark.parametrize("prefetch", [False, True, None])
@pytest.mark.parametrize("how", ["trace", "call"])
def test_a_failed_single_step_keeps_its_batch_for_a_loop(prefetch, how):
    rep = _rep()
    it = rep.prepare_input(_elements, M.PER_REPLICA, prefetch_on_device=prefetch)
    n, seen = rep.replicate(jnp.int32(0)), []
    for steps in (3, None, None):  # 0-2 in a loop, then 3, then 4 fails twice
        n, got = _run(rep, it, n, steps)
        seen += got
    _fail(rep, it, n, None, how)
    _fail(rep, it, n, 2, how)
    n, got = _run(rep, it, n, 4)
    assert got == [5, 6, 7, 8]
    n, rest = _until_end(rep, it, n, None)
    assert seen + got + rest == list(range(N))


class _Source:
    """Elements 0, 1, ... ``n - 1``; reading element ``i`` in ``bad`` raises (once: the
    next read goes on with ``i + 1``, as a source that skips a bad record would)."""

    def __init__(self, n, bad, error=OSError):
        self.i, self.n, self.bad, self.error = 0, n, set(bad), error

    def __iter__(self):
        return self

    def __next__(self):
        i, self.i = self.i, self.i + 1
        if i >= self.n:
            raise StopIteration
        if i in self.bad:
            raise self.error(f"bad record {i}")
        return np.full((1,), i, np.float32)


def _events(rep, make, steps):
    """What the caller sees, step by step: ("ok", elements of the step), ("error", text)
    or ("end",); for a loop, each of its steps."""
    it, n, out = make(), rep.replicate(jnp.int32(0)), []
    while len(out) < 40:
        try:
            n, seen = rep.run(_see, it, n, steps=steps)
        except StopIteration:
            return out + [("end",)]
        except OSError as e:
            out.append(("error", str(e)))
            continue
        per_replica = np.asarray(seen.array).reshape(rep.num_replicas, -1)
        out += [("ok", per_replica[:, s].tolist()) for s in range(per_replica.shape[1])]
    raise AssertionError(f"no end after {out}")


@pytest.mark.filterwarnings("ignore:jreplicate. dropped a final partial batch")
@pytest.mark.parametrize("prefetch", [False, True, None])
@pytest.mark.parametrize("bad, length", [((5,), 14), ((0, 9), 16), ((4, 5, 6, 7), 17)])
@pytest.mark.parametrize("k", [2, 3])
def test_an_input_error_mid_loop_equals_k_separate_runs(prefetch, bad, length, k):
    """PER_WORKER on 2 replicas: a step reads elements 2s and 2s + 1. An element that
    raises fails its step (the other element of the step is consumed, as in a separate
    run); a loop runs the complete steps before it, and the next call raises."""
    rep = _rep()

    def make(pf):
        return lambda: rep.prepare_input(lambda ctx: _Source(length, bad), M.PER_WORKER,
                                         prefetch_on_device=pf)

    separate = _events(rep, make(False), None)
    assert ("error", f"bad record {bad[0]}") in separate
    assert _events(rep, make(prefetch), None) == separate
    assert _events(rep, make(prefetch), k) == separate


@pytest.mark.parametrize("prefetch", [False, True])
def test_an_input_error_mid_loop_runs_the_steps_before_it(prefetch):
    """A generator that raises at element 5 of a loop of 4 (2 replicas, PER_REPLICA): the
    loop returns steps 4 and 5 and the next call raises; then the input has ended."""
    rep = _rep()

    def input_fn(ctx):
        yield from (np.full((1,), i, np.float32) for i in range(6))
        raise OSError("disk on fire")

    it = rep.prepare_input(input_fn, M.PER_REPLICA, prefetch_on_device=prefetch)
    n = rep.replicate(jnp.int32(0))
    n, got = _run(rep, it, n, 4)
    assert got == [0, 1, 2, 3]
    n, got = _run(rep, it, n, 4)
    assert got == [4, 5] and int(n) == 6  # the state of every complete step
    with pytest.raises(OSError, match="disk on fire"):
        rep.run(_see, it, n, steps=4)
    with pytest.raises(StopIteration):
        rep.run(_see, it, n, steps=4)


def test_ctrl_c_while_a_loop_reads_keeps_the_steps_read():
    """Ctrl-C while reading step 2 of a loop of 4 (in line): K separate runs would have
    run steps 0 and 1; the loop keeps them for the next call, which fills it on."""
    rep = _rep()
    it = rep.prepare_input(lambda ctx: _Source(N, {2} if ctx.input_pipeline_id else (),
                                               KeyboardInterrupt),
                           M.PER_REPLICA, prefetch_on_device=False)
    n = rep.replicate(jnp.int32(0))
    with pytest.raises(KeyboardInterrupt):
        rep.run(_see, it, n, steps=4)
    n, got = _run(rep, it, n, 4)
    assert got == [0, 1, 3, 4]  # step 2's elements were being read: gone, as in line
    n, rest = _until_end(rep, it, n, 4)
    assert rest == [5, 6, 7, 8, 9] and int(n) == N - 1


# -- 5a: an error in one pipeline is never a quiet end ----------------------------------
def _pipelines(end_at, fail_at):
    """Per replica: ``end_at`` elements; replica 3 raises at element ``fail_at``,
    replica 5 has one element fewer (it ends in the step where replica 3 fails)."""
    def input_fn(ctx):
        r = ctx.input_pipeline_id
        for i in range(end_at - (r == 5)):
            if r == 3 and i == fail_at:
                raise OSError("pipeline 3 failed")
            yield np.full((2,), i, np.float32)
    return input_fn


def _mask_sum(ctx, batch, n):
    return n + 1, batch[0] * ctx.batch_mask[0]


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("steps", [None, 2])
@pytest.mark.parametrize("partial_batch", ["drop", "pad"])
def test_an_error_in_one_pipeline_is_raised_when_another_ends(prefetch, steps,
                                                             partial_batch):
    rep = _rep(8)
    it = rep.prepare_input(_pipelines(4, 3), M.PER_REPLICA, prefetch_on_device=prefetch,
                           partial_batch=partial_batch)
    step = _see if partial_batch == "drop" else _mask_sum
    n, ran = rep.replicate(jnp.int32(0)), 0
    while True:
        try:
            n, _ = rep.run(step, it, n, steps=steps)
        except OSError as e:
            assert "pipeline 3 failed" in str(e)
            break
        except StopIteration:
            pytest.fail(f"the error of pipeline 3 was swallowed after {ran} steps")
        ran += 1
    assert int(n) == 3  # the steps before the failing one all ran
    with pytest.raises(StopIteration):
        rep.run(step, it, n, steps=steps)
