"""``ParameterServerStrategy.state()`` through :class:`jreplicate.CheckpointManager`:
saved from one job, restored into a job with another number of workers, other devices
and other sync groups (workers hold no state), bit for bit; another ``num_ps`` is
refused; the loop's ``save(step, lambda: ...)`` calls the function only when it writes.

The reference for "training goes on as if never interrupted" is an uninterrupted run of
the same job: the step's gradient does not depend on the parameters, so the shards
apply the same gradients in the same order whatever the workers' timing (adam's moments
included), and the parameters are a function of the step count alone.
"""

import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.checkpoint import CheckpointError
from tests._ps_helpers import (
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

SIZES = {"a": 6, "b": 3}
G = {"a": np.linspace(-1.0, 2.0, 6, dtype=np.float32), "b": np.float32([0.5, -3.0, 1.0])}


def _job(**strategy_kw):
    s, rep, w, opt, tx = sgd_job(SIZES, inner=optax.adam(0.1), **strategy_kw)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w["a"] * G["a"]) + jnp.sum(w["b"] * G["b"]))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    return s, rep, w, opt, step


def _train(job, steps, mngr=None, first=0):
    """``steps`` steps of ``job``; with ``mngr``, ``save`` at every step with a function
    (the documented loop). Returns how many times the function was called."""
    s, rep, w, opt, step = job
    calls = []

    def state():
        calls.append(1)
        rep.join()
        return s.state()

    for i in range(first + 1, first + steps + 1):
        rep.run(step, None, w, opt)
        if mngr is not None:
            mngr.save(i, state)
    rep.join()
    return len(calls)


def _bits(tree):
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(np.asarray(x).dtype, np.asarray(x).shape, np.asarray(x).tobytes())
                     for x in leaves]


SOURCE = {"num_ps": 2, "num_workers": 3}
TARGETS = {
    "1_worker_on_3_devices": {"num_ps": 2, "num_workers": 1, "devices": jax.devices()[:3]},
    "sync_groups_of_2": {"num_ps": 2, "num_workers": 2, "num_replicas_in_sync": 2,
                         "devices": jax.devices()[:6]},
    "4_workers_on_8_devices": {"num_ps": 2, "num_workers": 4},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoint 6 of a 2-shard, 3-worker job (saved with a function at every step,
    every 3 steps written), its state, and the parameters of the same job run 10 steps
    uninterrupted."""
    directory = tmp_path_factory.mktemp("ps")
    job = _job(**SOURCE)
    with jr.CheckpointManager(directory, job[1], save_interval_steps=3) as mngr:
        calls = _train(job, 6, mngr)
    assert calls == 2  # steps 3 and 6 only
    # Written in format 2 (each array's digest recorded), as the SPMD strategies' state.
    meta = json.loads((directory / "6" / "default" / "_METADATA").read_text())
    assert meta["custom_metadata"]["jreplicate"]["format"] == 2
    state = jax.tree.map(np.array, job[0].state())
    job[0].shutdown()
    ref = _job(**SOURCE)
    _train(ref, 10)
    params = ref[0].parameters()
    ref[0].shutdown()
    # adam with a constant gradient moves each parameter by lr * sign(g) per step.
    for k, g in G.items():
        np.testing.assert_allclose(params[k], -0.1 * 10 * np.sign(g), rtol=1e-4)
    return directory, state, params


@pytest.mark.parametrize("target", list(TARGETS))
def test_ps_state_restores_onto_other_workers_and_devices_bit_for_bit(saved, target):
    directory, state, uninterrupted = saved
    job = _job(**TARGETS[target])
    s = job[0]
    try:
        with jr.CheckpointManager(directory, job[1]) as mngr:
            at, got = mngr.restore_or_initialize(s.state)
        assert at == 6
        assert _bits(got) == _bits(state)
        s.restore(got)
        assert _bits(s.state()) == _bits(state)  # on the shards as saved, ledgers too
        _train(job, 4, first=6)
        assert s._executor.next_id == 10
        assert _bits(s.parameters()) == _bits(uninterrupted)
    finally:
        s.shutdown()


@pytest.mark.parametrize("num_ps", [1, 3])
def test_another_num_ps_is_refused_and_nothing_moves(saved, num_ps):
    directory = saved[0]
    job = _job(num_ps=num_ps, num_workers=1)
    try:
        with jr.CheckpointManager(directory, job[1]) as mngr:
            with pytest.raises(CheckpointError, match=r"does not match init_fn\(\)'s state"
                               r"(.|\n)*\['shards'\]") as e:
                mngr.restore_or_initialize(job[0].state)
            assert mngr.latest_step() == 6
        # The message says what differs, the number of shards, and lists no path on
        # both sides (num_ps 1's one-element list is transparent in the matching).
        assert (f"['shards'] holds 2 element(s) in the checkpoint but {num_ps} in "
                "init_fn()'s state") in str(e.value)
        assert "only in" not in str(e.value)
    finally:
        job[0].shutdown()


def test_save_calls_the_state_function_only_when_it_writes(tmp_path):
    """A function is called when the step is due or ``force=True``, never otherwise:
    there a ``state()`` with steps pending would raise, and a join would stall the
    loop at every step."""
    job = _job(num_ps=1, num_workers=1)
    s, rep, w, opt, step = job
    try:
        with jr.CheckpointManager(tmp_path, rep, save_interval_steps=5) as mngr:
            def never():
                raise AssertionError("called at a step that is not saved")

            rep.run(step, None, w, opt)
            assert mngr.save(1, never) is False
            assert mngr.save(2, lambda: (rep.join(), s.state())[1], force=True) is True
            mngr.wait_until_finished()
            assert mngr.complete_steps() == [2]
        with jr.CheckpointManager(tmp_path, rep) as mngr:
            at, got = mngr.restore_or_initialize(s.state)
        assert at == 2 and _bits(got) == _bits(s.state())
    finally:
        s.shutdown()


def test_a_state_function_and_its_value_write_the_same_checkpoint(tmp_path):
    """SPMD state given as a function is what the function returns; a pytree that is
    callable (an NNX module with ``__call__``) is state, never called."""
    rep = jr.Replicator(jr.MirroredStrategy())
    state = {"w": jnp.arange(4.0), "n": jnp.int32(3)}
    with jr.CheckpointManager(tmp_path / "value", rep) as m:
        m.save(1, state)
    with jr.CheckpointManager(tmp_path / "fn", rep) as m:
        m.save(1, lambda: state)
    for d in ("value", "fn"):
        with jr.CheckpointManager(tmp_path / d, rep) as m:
            _, got = m.restore_or_initialize(lambda: jax.tree.map(jnp.zeros_like, state))
        assert _bits(got) == _bits(state)

    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(3.0))

        def __call__(self, x):
            raise AssertionError("save called the module")

    with jr.CheckpointManager(tmp_path / "nnx", rep) as m:
        assert m.save(1, Model()) is True


def test_a_preempted_parameter_server_loop_saves_its_state_at_the_agreed_step(tmp_path):
    """SIGTERM mid-loop: the next ``save`` calls the state function (joining the steps)
    although the step is not due, writes it, and raises ``Preempted`` (exit 42); a job
    of another worker count resumes from that step and ends where an uninterrupted run
    does."""
    job = _job(**SOURCE)
    s, rep = job[0], job[1]
    calls = []

    def state():
        calls.append(1)
        rep.join()
        return s.state()

    # A handler of the test's own, which the manager's chains to: were the manager not
    # watching, the signal would end here (the test fails) instead of ending pytest.
    original = signal.signal(signal.SIGTERM, lambda *_: None)
    guard, at = signal.getsignal(signal.SIGTERM), 0
    try:
        with jr.CheckpointManager(tmp_path, rep, save_interval_steps=100) as mngr:
            with pytest.raises(jr.checkpoint.Preempted) as e:
                for at in range(1, 10):
                    rep.run(job[4], None, *job[2:4])
                    if at == 4:
                        os.kill(os.getpid(), signal.SIGTERM)
                    mngr.save(at, state)
        assert (e.value.code, e.value.step, at, len(calls)) == (42, 4, 4, 1)
        assert signal.getsignal(signal.SIGTERM) is guard  # the manager's handler is gone
        saved = jax.tree.map(np.array, s.state())
    finally:
        signal.signal(signal.SIGTERM, original)
        s.shutdown()
    target = _job(**TARGETS["1_worker_on_3_devices"])
    try:
        with jr.CheckpointManager(tmp_path, target[1]) as mngr:
            at, got = mngr.restore_or_initialize(target[0].state)
        assert at == 4 and _bits(got) == _bits(saved)
        target[0].restore(got)
        _train(target, 6, first=4)
        ref = _job(**SOURCE)
        _train(ref, 10)
        assert _bits(target[0].parameters()) == _bits(ref[0].parameters())
        ref[0].shutdown()
    finally:
        target[0].shutdown()


def _token_job(num_workers, total):
    s, rep, w, opt, tx = sgd_job(4, inner=jr.sync_replicas(
        optax.sgd(0.1), replicas_to_aggregate=2, total_num_replicas=total), num_ps=2,
        num_workers=num_workers)

    def step(ctx, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w))(w), opt, w)
        return optax.apply_updates(w, u), opt

    return s, rep, w, opt, step


def test_token_gated_state_restores_onto_other_worker_counts(tmp_path):
    """``sync_replicas`` state (tokens, accumulators, global step) saved from 2 workers
    restores into 3 workers and into 1 with the same aggregation, bit for bit, and
    training goes on from its global step (each step adds -0.1); another number of
    tokens per step is refused by ``restore`` before anything is replaced."""
    job = _token_job(2, 2)
    s, rep = job[0], job[1]
    try:
        with jr.CheckpointManager(tmp_path, rep, save_interval_steps=4) as mngr:
            _train(job, 8, mngr)
        saved, gs = jax.tree.map(np.array, s.state()), s.global_step
    finally:
        s.shutdown()
    assert gs >= 1
    for workers in (3, 1):
        s2, rep2, *_ = target = _token_job(workers, 2)
        try:
            with jr.CheckpointManager(tmp_path, rep2) as mngr:
                at, got = mngr.restore_or_initialize(s2.state)
            assert at == 8 and _bits(got) == _bits(saved)
            s2.restore(got)
            assert s2.global_step == gs
            _train(target, 6, first=8)
            assert s2.global_step > gs
            np.testing.assert_allclose(s2.parameters(), np.full(4, -0.1 * s2.global_step),
                                       rtol=1e-5)
        finally:
            s2.shutdown()
    s3, rep3, *_ = _token_job(3, 3)
    try:
        with jr.CheckpointManager(tmp_path, rep3) as mngr:
            _, got = mngr.restore_or_initialize(s3.state)
        before = _bits(s3.state())
        with pytest.raises(ValueError, match="hands out 2 tokens per step"):
            s3.restore(got)
        assert _bits(s3.state()) == before
    finally:
        s3.shutdown()


def test_a_state_restored_into_renamed_parameters_is_refused(tmp_path):
    """The shards keep parameters by position: ``{"a", "b"}`` saved and restored into
    ``{"b", "z"}`` (same shapes) would put ``a``'s values into ``b``. The state records
    the names, so ``restore`` refuses it, naming the parameter and the fix, and the
    shards stay as they were; a state saved before names were recorded still restores."""
    def job(names):
        s, rep, w, opt, tx = sgd_job({n: 4 for n in names}, num_ps=2, num_workers=1)

        def step(ctx, w, opt):
            g = {n: jnp.full(4, float(k + 1)) for k, n in enumerate(sorted(w))}
            u, opt = tx.update(g, opt, w)
            return optax.apply_updates(w, u), opt
        return s, rep, w, opt, step

    saved_job = job("ab")
    try:
        with jr.CheckpointManager(tmp_path, saved_job[1]) as mngr:
            _train(saved_job, 2, mngr)
        saved = jax.tree.map(np.array, saved_job[0].state())
    finally:
        saved_job[0].shutdown()
    renamed = job("bz")
    try:
        with jr.CheckpointManager(tmp_path, renamed[1]) as mngr:
            _, got = mngr.restore_or_initialize(renamed[0].state)
        before = _bits(renamed[0].state())
        with pytest.raises(ValueError, match=r"restore\(state\): the state's parameters are "
                           r"not this job's: parameter 0 in flattening order is \['b'\] "
                           r"here(.|\n)*Restore into a job whose parameters have the names"):
            renamed[0].restore(got)
        assert _bits(renamed[0].state()) == before
    finally:
        renamed[0].shutdown()
    same = job("ab")
    try:
        old = {k: v for k, v in saved.items() if k != "names"}  # saved before names were
        same[0].restore(old)
        assert _bits(same[0].parameters()) == _bits({"a": np.full(4, -1.0, np.float32),
                                                     "b": np.full(4, -2.0, np.float32)})
    finally:
        same[0].shutdown()


@pytest.mark.parametrize("stored,built", [([0, 1], [0]), ([0], [0, 1]), ([0, 1], [0, 1, 2])])
def test_a_sequence_of_another_length_is_named_by_its_length(stored, built):
    """The mismatch message of a sequence holding another number of elements names the
    sequence and both lengths, not the same paths on both sides: a one-element sequence
    is transparent in the matching, so its element's paths are not "only" on one side."""
    from jreplicate.checkpoint.checks import mismatch

    def leaf(i):
        return {"w": jax.ShapeDtypeStruct((2,), np.float32), "n": jax.ShapeDtypeStruct(
            (), np.int32)} if i < 2 else {"w": jax.ShapeDtypeStruct((2,), np.float32)}

    have = {"shards": [leaf(i) for i in stored], "step": jax.ShapeDtypeStruct((), np.int32)}
    want = {"shards": [leaf(i) for i in built], "step": jax.ShapeDtypeStruct((), np.int32)}
    text = mismatch(have, want, "checkpoint 1")
    assert (f"['shards'] holds {len(stored)} element(s) in the checkpoint but "
            f"{len(built)} in init_fn()'s state") in text
    assert "only in" not in text
    assert mismatch(have, have, "checkpoint 1") is None
