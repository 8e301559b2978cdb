"""ParameterServerStrategy: a step reading several per-worker iterators,
``rep.run(step, (it1, it2), ...)``: on the worker that runs it, the step's batch is the
tuple of the next element of each of that worker's pipelines; the combination ends
where one of them ends, and the other's elements read for it are not lost."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.5


def _job(num_workers=2, g=1):
    s, rep, w, opt, tx = sgd_job(3, lr=LR, num_ps=1, num_workers=num_workers,
                                 num_replicas_in_sync=g)

    def step(ctx, batch, w, opt):
        x, y = batch
        g_ = jax.grad(lambda w: jnp.sum(w * (x + y["v"])))(w)
        u, opt = tx.update(g_, opt, w)
        return optax.apply_updates(w, u), opt, (x, y["v"])

    return s, rep, w, opt, step


def _fn(tag, n, as_dict=False):
    def input_fn(ctx):
        els = [np.array([ctx.input_pipeline_id, i, tag], np.float32) for i in range(n)]
        return [{"v": e} for e in els] if as_dict else els
    return input_fn


def _out(v, g=1):
    x, y = v.fetch()[2]
    return np.asarray(x).reshape(g, 3), np.asarray(y).reshape(g, 3)


@pytest.mark.parametrize("g", [1, 2])
def test_a_step_sees_the_matching_elements_of_both_iterators(g):
    s, rep, w, opt, step = _job(g=g)
    it1, it2 = rep.prepare_input(_fn(1, 40)), rep.prepare_input(_fn(2, 40, as_dict=True))
    out = [rep.run(step, (it1, it2), w, opt) for _ in range(12)]
    rep.join()
    total = np.zeros(3)
    seen = {0: [], 1: []}
    for v in out:
        x, y = _out(v, g)
        # both from the pipelines of the worker that ran it, the same position in each
        assert (x[:, 0] == v.worker).all() and (y[:, 0] == v.worker).all()
        np.testing.assert_array_equal(x[:, 1], y[:, 1])
        assert (x[:, 2] == 1).all() and (y[:, 2] == 2).all()
        seen[v.worker] += x[:, 1].astype(int).tolist()
        total += (x + y).sum(0)  # (the gradient of a per-replica batch sums them)
    for k in range(2):  # each worker's pipelines read in order, each element once
        assert seen[k] == list(range(len(seen[k])))
    np.testing.assert_allclose(s.parameters(), -LR * total, rtol=1e-6)


def test_the_shorter_iterator_ends_the_pair_and_the_other_loses_nothing():
    s, rep, w, opt, step = _job()
    it1, it2 = rep.prepare_input(_fn(1, 10)), rep.prepare_input(_fn(2, 3, as_dict=True))
    out = []
    with pytest.raises(StopIteration):
        for _ in range(100):
            out.append(rep.run(step, (it1, it2), w, opt))
            rep.join()
    rep.join()
    ran = []
    for v in out:
        try:
            ran.append((v.worker, *_out(v)))
        except StopIteration:
            pass
    assert sorted((wk, int(x[0, 1])) for wk, x, _ in ran) == \
        [(k, i) for k in range(2) for i in range(3)]
    # it1 alone goes on where the pairs ended on each worker: nothing read for a pair
    # that did not run was lost.

    def alone(ctx, x, w, opt):
        return step(ctx, (x, {"v": jnp.zeros_like(x)}), w, opt)

    more = [rep.run(alone, it1, w, opt) for _ in range(14)]
    rep.join()
    got = sorted((v.worker, int(_out(v)[0][0, 1])) for v in more)
    assert got == [(k, i) for k in range(2) for i in range(3, 10)]


def test_iterators_other_than_per_worker_ones_are_refused_at_run():
    s, rep, w, opt, step = _job()
    it1 = rep.prepare_input(_fn(1, 4))
    single = rep.prepare_input(lambda ctx: [np.zeros(3, np.float32)] * 4,
                               replication_mode=jr.InputReplicationMode.SINGLE)
    with pytest.raises(TypeError, match=r"inputs\[1\].*SINGLE"):
        rep.run(step, (it1, single), w, opt)
    other = jr.Replicator(jr.ParameterServerStrategy(num_ps=1, num_workers=1))
    with pytest.raises(ValueError, match=r"inputs\[1\] was prepared by another"):
        rep.run(step, (it1, other.prepare_input(_fn(1, 4))), w, opt)


def test_a_tuple_of_iterators_is_refused_early_under_an_spmd_strategy():
    rep = jr.Replicator(jr.MirroredStrategy())
    its = tuple(rep.prepare_input(lambda ctx: [np.zeros(8, np.float32)] * 2)
                for _ in range(2))
    with pytest.raises(TypeError, match="reads one"):
        rep.run(lambda ctx, b: b, its)
