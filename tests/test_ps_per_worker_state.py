"""ParameterServerStrategy.create_per_worker_state (TensorFlow's per-worker variables,
read with ON_READ aggregation): state built on each worker by fn, that each step
receives as its worker's and returns updated with jr.ps.update_worker_state.

The rules checked, against NumPy references of exactly the steps that succeeded: a
worker's state moves by exactly the steps whose RemoteValue got their outputs, in the
order they ran there (every succeeded step's output is one link of its worker's chain
of states, never two links, never none); a failed, cancelled or refused step and a
step whose worker was lost leave it unchanged; a rerun updates only the worker that ran
it; a replaced or restored worker rebuilds it with fn; reads on the driver see, per
worker, whole states; a new state unlike the old fails its step before the push.
"""

import os
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.per_worker import (
    PerWorkerArg,
    WorkerValues,
    aggregate,
    take_updates,
)
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import local_ray  # noqa: F401 (one Ray for the module)

LR = 0.5


def _build_id():
    """A number of its own for each fn call (in any process: a Ray actor too)."""
    return np.int32(int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF)


def _check_finite(x):
    if np.isnan(np.asarray(x)).any():
        raise FloatingPointError("the step's input is NaN")


def _job(num_workers=3, g=1, num_ps=1, **kw):
    """w (3 floats) trained by sgd(LR) with gradient x (each step's argument); the
    state {"born", "n", "sum"}: the fn call that built it, the steps that updated it
    and the sum of their x (from 100 * worker_index)."""
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers,
                                   num_replicas_in_sync=g, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)

    def step(ctx, w, opt, state, x):
        jax.debug.callback(_check_finite, x)
        u, opt = tx.update(x, opt, w)
        new = {"born": state["born"], "n": state["n"] + 1, "sum": state["sum"] + x}
        return optax.apply_updates(w, u), opt, jr.ps.update_worker_state(new)

    return s, rep, w, opt, step, s.create_per_worker_state(_state_fn)


def _state_fn(wc):
    """The state of _job's steps: the fn call that built it, the steps that updated it
    and the sum of their x (from 100 * worker_index)."""
    return {"born": _build_id(), "n": np.int32(0),
            "sum": np.full(3, 100.0 * wc.worker_index, np.float32)}


def _xs(n, seed=0, bad=()):
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-4, 5, size=3).astype(np.float32) for _ in range(n)]
    for i in bad:
        xs[i] = np.full(3, np.nan, np.float32)
    return xs


def _outcome(v):
    try:
        return v.fetch()
    except Exception as e:  # noqa: BLE001 - the step's error, or its cancellation
        return e


def _check_chains(s, values, xs, state, outputs_lost=False, base=None, unsure=False):
    """Every step that succeeded is one link of its worker's chain of states (keyed by
    the fn call that built it): link n holds the sum of x of links 1..n, each link
    once; each worker's read state is the last link of its newest chain (or fn's value
    where no step ran since it was built), and the parameters are the succeeded steps'.
    ``outputs_lost`` (Ray): steps that succeeded on a worker actor lost before their
    outputs were fetched (they are applied) leave gaps in the chains of builds no
    worker holds now; those are checked for links counted twice only.
    ``base``: the parameters and each shard's applied count before ``values`` ran;
    ``unsure``: a worker was lost meanwhile (see below).
    Returns the succeeded steps whose outputs were fetched."""
    outs = [_outcome(v) for v in values]
    ok = [(v, x, o) for v, x, o in zip(values, xs, outs) if not isinstance(o, Exception)]
    lost = [x for x, o in zip(xs, outs) if outputs_lost and isinstance(
        o, jr.ps.WorkerLostError) and "were held by worker" in str(o)]
    chains: dict = {}
    for v, x, o in ok:
        new = o[2]  # the marker's place holds the new value
        assert set(new) == {"born", "n", "sum"}, new
        chains.setdefault((v.worker, int(new["born"])), {})
        link = chains[(v.worker, int(new["born"]))]
        assert int(new["n"]) not in link, f"step {v.step_id}: state updated twice"
        link[int(new["n"])] = (x, np.asarray(new["sum"]))
    read = state.read()
    held = {(k, int(r["born"])) for k, r in enumerate(read) if r is not None}
    for (k, born), link in chains.items():
        if lost and (k, born) not in held:
            continue  # (a lost actor's build: some of its links' outputs lost with it)
        assert sorted(link) == list(range(1, len(link) + 1)), (k, sorted(link))
        total = np.full(3, 100.0 * k)
        for n in range(1, len(link) + 1):
            total = total + link[n][0]
            np.testing.assert_allclose(link[n][1], total, rtol=1e-6)
        mine = read[k]
        if mine is not None and int(mine["born"]) == born:
            assert int(mine["n"]) == len(link)
            np.testing.assert_allclose(mine["sum"], total, rtol=1e-6)
    for k, mine in enumerate(read):
        if mine is None:
            continue
        link = chains.get((k, int(mine["born"])), {})
        assert int(mine["n"]) == len(link), (k, mine, sorted(link))
    applied = [x for _, x, _ in ok] + lost
    # A step that ended in error after a run of it was lost (killed after pushing, then
    # cancelled) may be applied, on every shard or on some (the coordinator's record:
    # "half_applied", a ParameterServerError): the parameters are not the succeeded
    # steps' then (``unsure``). Its worker's state was not updated all the same.
    if unsure and any(isinstance(o, Exception) for o in outs):
        return ok
    p0, applied0 = base if base is not None else (np.zeros(3), [0] * len(s.ledger()))
    ref = -LR * np.sum(applied, axis=0) if applied else np.zeros(3)
    why = [(v.step_id, v.worker, v.attempts, type(o).__name__, str(o)[:200])
           for v, o in zip(values, outs) if isinstance(o, Exception)]
    np.testing.assert_allclose(np.asarray(s.parameters()) - p0, ref, rtol=1e-5, atol=1e-5,
                               err_msg=str(why))
    for led, a0 in zip(s.ledger(), applied0):
        assert led["applied"] - a0 == len(applied), (led, a0, len(applied), why)
    return ok


@pytest.mark.parametrize("g", [1, 2])
def test_each_worker_state_moves_by_exactly_its_succeeded_steps(g):
    s, rep, w, opt, step, state = _job(num_workers=3, g=g)
    assert state.read() == [None, None, None]  # fn never runs on the driver
    assert state.read("sum") is None
    xs = _xs(30)
    values = [rep.run(step, None, w, opt, state, x) for x in xs]
    rep.join()
    ok = _check_chains(s, values, xs, state)
    assert len(ok) == 30
    read = state.read()
    ran = sorted({v.worker for v in values})
    assert [k for k, r in enumerate(read) if r is not None] == ran
    # ON_READ aggregation: sum and mean over the workers that hold a state.
    held = [r for r in read if r is not None]
    got = state.read("sum")
    assert int(got["n"]) == 30 and got["n"].dtype == np.int32
    np.testing.assert_allclose(got["sum"], sum(r["sum"] for r in held), rtol=1e-6)
    np.testing.assert_allclose(state.read("mean")["sum"],
                               np.mean([r["sum"] for r in held], axis=0), rtol=1e-6)
    s.shutdown()


def test_a_failed_step_and_the_steps_cancelled_behind_it_leave_the_state_unchanged():
    s, rep, w, opt, step, state = _job(num_workers=1)
    jrt.set_worker_delay(s, 0, 0.02)
    xs = _xs(10, seed=1, bad=(4,))
    values = [rep.run(step, None, w, opt, state, x) for x in xs]
    with pytest.raises(Exception, match="input is NaN"):
        rep.join()
    ok = _check_chains(s, values, xs, state)
    assert [v.step_id for v, _, _ in ok] == [0, 1, 2, 3]
    assert isinstance(_outcome(values[5]), jr.ps.StepCancelledError)
    assert int(state.read()[0]["n"]) == 4
    more = _xs(3, seed=2)  # training goes on from the state of the 4 steps
    after = [rep.run(step, None, w, opt, state, x) for x in more]
    rep.join()
    _check_chains(s, values + after, xs + more, state)
    assert int(state.read()[0]["n"]) == 7
    s.shutdown()


def test_a_running_step_whose_push_is_refused_leaves_its_workers_state_unchanged():
    # Worker 1 computes slowly; a step on worker 0 raises meanwhile: worker 1's step
    # is refused at its push (StepCancelledError) and its new state is not kept.
    s, rep, w, opt, step, state = _job(num_workers=2)
    xs, values = _xs(1, seed=3), []
    values.append(rep.run(step, None, w, opt, state, xs[0]))  # compiled
    rep.join()
    jrt.set_worker_delay(s, 1, 0.5)
    refused = False
    for seed in range(20):  # until the good step lands on worker 1 (slow)
        pair = _xs(2, seed=10 + seed, bad=(1,))
        good = rep.run(step, None, w, opt, state, pair[0])
        bad = rep.run(step, None, w, opt, state, pair[1])
        with pytest.raises(Exception, match="input is NaN"):
            rep.join()
        xs += pair
        values += [good, bad]
        if isinstance(_outcome(good), jr.ps.StepCancelledError):
            assert good.worker is None or good.worker == 1
            refused = True
            break
    assert refused, "the good step never ran on the slow worker"
    _check_chains(s, values, xs, state)
    s.shutdown()


@pytest.mark.parametrize("when,restarts", [("compute", 0), ("push", 0),
                                           ("compute", None), ("push", None)])
def test_a_step_rerun_after_its_worker_was_lost_updates_only_the_worker_that_ran_it(
        when, restarts):
    """Worker 1 dies in a step (computing, or between its pushes to the two shards):
    the step runs again on another worker (or on worker 1's replacement), whose state
    it updates; worker 1's old state kept its completed steps only. Replaced, worker 1
    rebuilds its state with fn."""
    s, rep, w, opt, step, state = _job(num_workers=3, num_ps=2,
                                       max_worker_restarts=restarts)
    for k in range(3):
        jrt.set_worker_delay(s, k, 0.005)
    xs = _xs(200, seed=4)
    values = []
    end = time.monotonic() + 60
    while s.stats()["completed_by"][1] < 2:
        values.append(rep.run(step, None, w, opt, state, xs[len(values)]))
        rep.join()
        assert time.monotonic() < end
    old = state.read()[1]
    jrt.kill_worker(s, 1, when=when)
    while s.stats()["rescheduled"] < 1:
        if s._executor.coordinator.pending < 3:
            values.append(rep.run(step, None, w, opt, state, xs[len(values)]))
        time.sleep(0.002)
        assert time.monotonic() < end and len(values) < 150, "the kill never fired"
    values += [rep.run(step, None, w, opt, state, x) for x in xs[len(values):][:20]]
    rep.join()
    xs = xs[:len(values)]
    ok = _check_chains(s, values, xs, state)
    assert len(ok) == len(values)  # every step succeeded (one rerun)
    assert any(v.attempts > 1 for v in values)
    read = state.read()
    if restarts == 0:  # lost for good: its state is that of its completed steps
        assert s.stats()["alive"][1] is False
        assert int(read[1]["born"]) == int(old["born"])
        assert int(read[1]["n"]) == s.stats()["completed_by"][1]
    else:  # replaced: rebuilt by fn (a new build), from 0 once it ran a step
        assert s.stats()["replaced"] == 1
        assert read[1] is None or int(read[1]["born"]) != int(old["born"])
    s.shutdown()


def test_reads_while_steps_run_are_whole_states_one_per_worker():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=3)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(0.01))
        opt = tx.init(w)
    state = s.create_per_worker_state(
        lambda wc: {"n": np.int32(0), "twice": np.zeros(64, np.float32)})

    def step(ctx, w, opt, st):
        u, opt = tx.update(jnp.ones(3), opt, w)
        new = {"n": st["n"] + 1, "twice": st["twice"] + 2.0}
        return optax.apply_updates(w, u), opt, jr.ps.update_worker_state(new)

    for k in range(3):
        jrt.set_worker_delay(s, k, 0.002)
    reads, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            reads.append(state.read())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    values = [rep.run(step, None, w, opt, state) for _ in range(60)]
    rep.join()
    stop.set()
    t.join(10)
    assert len(reads) > 3
    last = [0, 0, 0]
    for r in reads:
        for k, one in enumerate(r):
            if one is None:
                assert last[k] == 0
                continue
            n = int(one["n"])
            np.testing.assert_array_equal(one["twice"], np.full(64, 2.0 * n))  # whole
            assert n >= last[k]  # never back in time
            last[k] = n
    final = state.read()
    by = [sum(v.worker == k for v in values) for k in range(3)]
    assert [0 if one is None else int(one["n"]) for one in final] == by
    s.shutdown()


@pytest.mark.filterwarnings("ignore:.*different function objects")
def test_a_new_state_the_step_cannot_keep_fails_the_step_before_its_push():
    """Each way a step can return a new state the worker cannot keep fails the step
    (its error names the fix), nothing is pushed, the state is unchanged."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, num_replicas_in_sync=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)
    state = s.create_per_worker_state(lambda wc: {"a": np.zeros(3, np.float32)})
    other = s.create_per_worker_state(lambda wc: np.int32(0))
    up = jr.ps.update_worker_state

    def returning(make):
        def step(ctx, w, opt, *states):
            u, opt = tx.update(jnp.ones(3), opt, w)
            return optax.apply_updates(w, u), opt, make(ctx, *states)
        return step

    cases = [
        ("no marker", (state,), lambda ctx, st: st, "returned 0"),
        ("two markers", (state,), lambda ctx, st: (up(st), up(st)), "returned 2"),
        ("a marker, no state", (), lambda ctx: up(jnp.zeros(3)), "took 0"),
        ("shape", (state,), lambda ctx, st: up({"a": jnp.zeros(4)}), r"\['a'\] has shape"),
        ("dtype", (state,), lambda ctx, st: up({"a": st["a"].astype(jnp.int32)}),
         "dtype int32"),
        ("structure", (state,), lambda ctx, st: up({"b": st["a"]}), "structure"),
        ("per replica", (state,),
         lambda ctx, st: up({"a": st["a"] + ctx.replica_id}), "varies over its sync"),
        ("twice", (state, state), lambda ctx, a, b: (up(a), up(b)), "passed twice"),
        ("order", (state, other), lambda ctx, a, b: (up(b), up(a)), "structure"),
    ]
    for name, states, make, message in cases:
        v = rep.run(returning(make), None, w, opt, *states)
        with pytest.raises(ValueError, match=message):
            v.fetch()
        with pytest.raises(ValueError, match=message):
            rep.join()  # (training stopped: raised once)
        assert s.stats()["completed"] == 0, name
        assert all(led["applied"] == 0 for led in s.ledger()), name
        np.testing.assert_array_equal(s.parameters(), np.zeros(3))
        assert all(r is None or np.array_equal(r["a"], np.zeros(3))
                   for r in state.read()), name
    # A step that returns a state's new value right after all that works.
    v = rep.run(returning(lambda ctx, a, b: (up({"a": a["a"] + 1}), up(b + 1))),
                None, w, opt, state, other)
    out = v.fetch()[2]
    np.testing.assert_array_equal(out[0]["a"], np.ones(3))
    assert int(out[1]) == 1 and int(other.read()[v.worker]) == 1
    s.shutdown()


def test_nnx_state_with_variables_as_per_worker_state_and_two_replicas_per_worker():
    """An nnx.State of Variables as the state, over sync groups of 2 replicas: the step
    merges it, updates its Variables and returns nnx.state(...). The executor writes
    NNX arguments back in place; the kept state never shares the step's Variables, so
    each step counts once (the first step of a function, run twice to compile, too)."""
    nnx = pytest.importorskip("flax.nnx")
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, num_replicas_in_sync=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)

    class Stats(nnx.Module):
        def __init__(self):
            self.count = nnx.BatchStat(jnp.zeros((), jnp.int32))
            self.total = nnx.BatchStat(jnp.zeros(3))

    graphdef = nnx.graphdef(Stats())
    state = s.create_per_worker_state(lambda wc: nnx.state(Stats()))
    it = rep.prepare_input(lambda ctx: [np.full(3, 10 * ctx.input_pipeline_id + i,
                                                 np.float32) for i in range(40)])

    def step(ctx, x, w, opt, st):
        u, opt = tx.update(jnp.zeros(3), opt, w)
        stats = nnx.merge(graphdef, st)
        stats.count[...] += 1
        stats.total[...] += ctx.all_sum(x)
        return optax.apply_updates(w, u), opt, jr.ps.update_worker_state(nnx.state(stats))

    values = [rep.run(step, it, w, opt, state) for _ in range(8)]
    rep.join()
    ref = {}
    for v in sorted(values, key=lambda v: v.step_id):
        k = v.worker
        n, total = ref.get(k, (0, np.zeros(3)))
        got = v.fetch()[2]
        assert isinstance(got, nnx.State)
        n += 1
        assert int(got["count"][...]) == n, (k, n, got)  # once per step
        total = np.asarray(got["total"][...])
        ref[k] = (n, total)
    for k, one in enumerate(state.read()):
        if k in ref:
            assert isinstance(one, nnx.State)
            assert int(one["count"][...]) == ref[k][0]
            np.testing.assert_allclose(one["total"][...], ref[k][1])
        else:
            assert one is None
    # each worker read its own pipeline's elements 10 k + i, two per step
    for k, (n, total) in ref.items():
        np.testing.assert_allclose(total, np.full(3, sum(10 * k + i for i in range(2 * n))))
    np.testing.assert_allclose(state.read("sum")["total"][...],
                               sum(total for _, total in ref.values()))
    s.shutdown()


def test_restore_rebuilds_the_states_and_the_checkpoint_holds_none(tmp_path):
    s, rep, w, opt, step, state = _job(num_workers=2)
    xs = _xs(6, seed=5)
    values = [rep.run(step, None, w, opt, state, x) for x in xs]
    rep.join()
    _check_chains(s, values, xs, state)
    saved = s.state()
    assert set(saved) == {"shards", "next_step_id", "steps", "names"}, set(saved)
    built = [int(r["born"]) for r in state.read() if r is not None]
    more = _xs(4, seed=6)
    after = [rep.run(step, None, w, opt, state, x) for x in more]
    rep.join()
    s.restore(saved)
    assert state.read() == [None, None]  # rebuilt by fn at the next step there
    v = rep.run(step, None, w, opt, state, more[0])
    new = v.fetch()[2]
    assert int(new["n"]) == 1 and int(new["born"]) not in built
    np.testing.assert_allclose(new["sum"], 100.0 * v.worker + more[0])
    del after
    s.shutdown()


def test_donate_argnums_naming_the_state_warns_and_reads_stay_whole():
    s, rep, w, opt, step, state = _job(num_workers=1)
    xs = _xs(4, seed=7)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = rep.run(step, None, w, opt, state, xs[0], donate_argnums=(3,))
        rep.join()
    assert any("donate_argnums" in str(c.message) for c in caught)
    before = state.read()[0]
    out = first.fetch()[2]
    values = [first] + [rep.run(step, None, w, opt, state, x) for x in xs[1:]]
    rep.join()
    _check_chains(s, values, xs, state)
    # what was read and fetched before stays as it was (NumPy copies, never donated)
    assert int(before["n"]) == 1 and int(out["n"]) == 1
    np.testing.assert_allclose(before["sum"], xs[0])
    s.shutdown()


def test_states_are_let_go_with_their_per_worker_state_and_arguments_are_checked():
    s, rep, w, opt, step, _ = _job(num_workers=2)
    import gc
    for _ in range(5):
        st = s.create_per_worker_state(lambda wc: {"born": np.int32(0), "n": np.int32(0),
                                                   "sum": np.zeros(3, np.float32)})
        rep.run(step, None, w, opt, st, np.ones(3, np.float32))
        del st
    rep.join()
    gc.collect()
    counts = [wk.values.count() for wk in s._executor._carrier.workers]
    assert counts == [0, 0]  # (_job's own state: no step took it, never built)
    state = s.create_per_worker_state(lambda wc: np.zeros(2, np.float32))
    assert isinstance(state, jr.ps.PerWorkerState) and "PerWorkerState" in repr(state)
    with pytest.raises(ValueError, match="reduce must be None"):
        state.read("max")
    with pytest.raises(TypeError, match="fn must be callable"):
        s.create_per_worker_state(3)
    s.shutdown()
    with pytest.raises(ValueError, match="Replicator first"):
        jr.ParameterServerStrategy(num_ps=1, num_workers=1).create_per_worker_state(
            lambda wc: 0)


# -- the pure parts: take_updates and aggregate against references ------------------------

_leaf = st.tuples(st.lists(st.integers(1, 3), max_size=2),
                  st.sampled_from([np.float32, np.int32]))
_tree = st.dictionaries(st.sampled_from("abc"), _leaf, min_size=1, max_size=3)


def _make(spec, fill=0):
    return {k: np.full(tuple(shape), fill, dtype) for k, (shape, dtype) in spec.items()}


@settings(deadline=None, max_examples=150)
@given(old=_tree, new=_tree)
def test_take_updates_keeps_exactly_a_value_like_the_state(old, new):
    arg = PerWorkerArg(7, None, 1, state=True)
    marker = jr.ps.update_worker_state(_make(new, 1))
    out = ("loss", marker, [3])
    like = old == new
    if like:
        got, updates = take_updates(out, (None, arg), (None, _make(old)))
        assert got[0] == "loss" and got[2] == [3]
        assert updates[0][0] == 7  # the marker's place holds the new value's leaves
        assert all(a is b for a, b in zip(jax.tree.leaves(got[1]),
                                          jax.tree.leaves(updates[0][1])))
        assert jax.tree.structure(got[1]) == jax.tree.structure(_make(new))
    else:
        with pytest.raises(ValueError, match="argument \\[1\\]"):
            take_updates(out, (None, arg), (None, _make(old)))


@settings(deadline=None, max_examples=100)
@given(values=st.lists(st.one_of(st.none(), st.integers(-50, 50)), min_size=1,
                       max_size=5))
def test_aggregate_is_numpys_sum_and_mean_over_the_workers_holding_a_state(values):
    states = [None if v is None else {"x": np.array([v, 2 * v], np.int32),
                                      "y": np.float32(v) / 4} for v in values]
    held = [v for v in values if v is not None]
    if not held:
        assert aggregate(states, "sum") is None and aggregate(states, "mean") is None
        return
    got = aggregate(states, "sum")
    np.testing.assert_array_equal(got["x"], [sum(held), 2 * sum(held)])
    assert got["x"].dtype == np.int32
    np.testing.assert_allclose(aggregate(states, "mean")["y"], np.mean(held) / 4,
                               rtol=1e-6)


def test_worker_values_commit_only_while_the_key_is_held():
    vals = WorkerValues(0, 1)
    a = PerWorkerArg(1, lambda wc: np.float64(2.0), 1, state=True)
    assert vals.get(a).dtype == np.float32  # (JAX's dtype: the step sees float32)
    vals.commit([(1, np.float32(5.0))])
    assert float(vals.read(1)) == 5.0 and vals.commits == {1: 1}
    vals.release(1)
    vals.commit([(1, np.float32(6.0))])  # a step of it still running ends after
    assert vals.read(1) is None and vals.count() == 0
    bad = PerWorkerArg(2, lambda wc: {"name": "worker"}, 1, state=True)
    with pytest.raises(TypeError, match=r"str at state\['name'\]"):
        vals.get(bad)



def test_on_ray_a_crashed_worker_rebuilds_its_state_and_no_step_counts_twice(local_ray):
    """Per-worker state in the worker actors (built there, read from the driver while
    they run): worker 1's process is killed; Ray restarts it, its state is rebuilt by
    fn, the lost steps run again and each succeeded step is one link of one chain."""
    s, rep, w, opt, step, state = _job(num_workers=2, carrier="ray")
    for k in range(2):
        jrt.set_worker_delay(s, k, 0.02)
    xs = _xs(60, seed=8)
    values = [rep.run(step, None, w, opt, state, x) for x in xs[:30]]
    end = time.monotonic() + 60
    while s.stats()["completed_by"][1] < 3:
        assert time.monotonic() < end, "worker 1 ran no step"
        time.sleep(0.005)
    old = state.read()[1]  # (read while steps run)
    assert old is not None and int(old["n"]) >= 3
    jrt.kill_worker(s, 1, when="crash")
    values += [rep.run(step, None, w, opt, state, x) for x in xs[30:40]]
    s._executor.coordinator.join(timeout=120)
    while s.stats()["replaced"] < 1:
        assert time.monotonic() < end + 60, "worker 1 was not restarted"
        time.sleep(0.05)
    values += [rep.run(step, None, w, opt, state, x) for x in xs[40:]]
    s._executor.coordinator.join(timeout=120)
    outcomes = [_outcome(v) for v in values]
    print("outputs lost with worker 1:", sum(isinstance(o, Exception) for o in outcomes))
    assert all(not isinstance(o, Exception) or "were held by worker 1" in str(o)
               for o in outcomes), outcomes
    _check_chains(s, values, xs, state, outputs_lost=True)
    new = state.read()[1]
    assert new is None or int(new["born"]) != int(old["born"])  # rebuilt by fn
    s.shutdown()


@pytest.mark.parametrize("g", [1, 2])
def test_a_state_returned_unchanged_is_kept_as_it_was(g):
    """update_worker_state(state) with the state itself (an output the worker forwards
    from its input without a copy): kept, fetched and read as it was, and the next step
    updates it from there."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=g)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)
    state = s.create_per_worker_state(lambda wc: np.arange(3, dtype=np.float32))

    def same(ctx, w, opt, st):
        u, opt = tx.update(jnp.ones(3), opt, w)
        return optax.apply_updates(w, u), opt, jr.ps.update_worker_state(st)

    def plus(ctx, w, opt, st):
        u, opt = tx.update(jnp.ones(3), opt, w)
        return optax.apply_updates(w, u), opt, jr.ps.update_worker_state(st + 1)

    outs = [rep.run(f, None, w, opt, state).fetch()[2] for f in (same, same, plus, same)]
    for got, want in zip(outs, ([0, 1, 2], [0, 1, 2], [1, 2, 3], [1, 2, 3])):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.read()[0], [1, 2, 3])
    np.testing.assert_allclose(s.parameters(), np.full(3, -4 * LR))
    s.shutdown()


# -- a state machine of steps, failures, kills and reads against the chain model ----------

from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

_SHARED: dict = {}


def _shared_job():
    """One strategy for every example (compiled once); each example its own state."""
    if "job" not in _SHARED:
        _SHARED["job"] = _job(num_workers=3, num_ps=2)
        _SHARED["history"] = ([], [])  # every example's RemoteValues and their x
        for k in range(3):
            jrt.set_worker_delay(_SHARED["job"][0], k, 0.003)
    return _SHARED["job"]


class StepsFailuresKillsAndReads(RuleBasedStateMachine):
    """Steps (some raising), workers killed at compute or between their pushes (and
    replaced), reads while steps run, joins: after each join every state is its
    chain of the succeeded steps (_check_chains), and no read ever goes back."""

    def __init__(self):
        super().__init__()
        self.s, self.rep, self.w, self.opt, self.step, _ = _shared_job()
        self.state = self.s.create_per_worker_state(_state_fn)
        self.values, self.xs, self.seen = [], [], {}
        self.base = (np.asarray(self.s.parameters()),
                     [led["applied"] for led in self.s.ledger()])
        self.rescheduled = self.s.stats()["rescheduled"]

    def _run(self, x):
        try:
            v = self.rep.run(self.step, None, self.w, self.opt, self.state, x)
        except Exception:  # noqa: BLE001 - an earlier step's error, raised once here
            return
        self.values.append(v)
        self.xs.append(x)

    @rule(x=st.lists(st.integers(-3, 3), min_size=3, max_size=3), n=st.integers(1, 4))
    def run_steps(self, x, n):
        for _ in range(n):
            self._run(np.array(x, np.float32))

    @rule()
    def run_a_failing_step(self):
        self._run(np.full(3, np.nan, np.float32))

    @rule(k=st.integers(0, 2), when=st.sampled_from(["compute", "push"]))
    def kill(self, k, when):
        jrt.kill_worker(self.s, k, when=when)

    @rule()
    def join(self):
        try:
            self.rep.join()
        except Exception:  # noqa: BLE001 - a failing step's error, raised once
            pass
        _check_chains(self.s, self.values, self.xs, self.state, base=self.base,
                      unsure=self.s.stats()["rescheduled"] > self.rescheduled)

    @invariant()
    def reads_never_go_back(self):
        for k, one in enumerate(self.state.read()):
            if one is None:
                continue
            born, n = int(one["born"]), int(one["n"])
            assert n >= self.seen.get((k, born), 0), (k, born, n)
            self.seen[(k, born)] = n

    def teardown(self):
        try:
            self.join()
        finally:
            _SHARED["history"][0].extend(self.values)
            _SHARED["history"][1].extend(self.xs)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_steps_failures_kills_and_reads_keep_every_state_a_chain_of_its_steps():
    try:
        run_state_machine_as_test(StepsFailuresKillsAndReads, settings=settings(
            max_examples=15, stateful_step_count=10, deadline=None))
        values = _SHARED["history"][0]
        outcomes = [_outcome(v) for v in values]
        print(f"{len(values)} steps, {sum(not isinstance(o, Exception) for o in outcomes)} "
              f"succeeded, {sum(v.attempts > 1 for v in values)} rerun, "
              f"stats {_SHARED['job'][0].stats()}")
        assert values
    finally:
        if "job" in _SHARED:
            _SHARED.pop("job")[0].shutdown()
            _SHARED.pop("history")
