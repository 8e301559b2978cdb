"""Every per-step record of the parameter server stays bounded however long the job runs
(issue 28 item 6 and its class): the coordinator's record of ended steps (completed,
skipped, half applied, the fates of lost workers' pushes, the epochs of its history),
the shards' ledgers (decided ids, the decisions kept for reruns, staged pieces), the
statistics, and what ``state()`` saves of them. Each is a watermark (or a window of
fixed size) plus what the running steps need: O(steps in flight), not O(steps).

The 10,000-step run drives the coordinator, the shard client and real shards directly
(a failing step through the public API costs ~15 ms: JAX filters the traceback of an
error raised while tracing); shorter runs go through the public API, asynchronous and
token-gated.
"""

from __future__ import annotations

import contextlib
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps import admission, step_record
from jreplicate.ps.client import ShardClient
from jreplicate.ps.closure import Closure
from jreplicate.ps.coordinator import Coordinator
from jreplicate.ps.ledger import Ledger
from jreplicate.ps.placement import place_parameters
from jreplicate.ps.remote import WorkerLostError
from jreplicate.ps.shard import PSShard
from jreplicate.ps.step_record import StepRecord
from jreplicate.ps.worker import ApplicationError
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

BOUND_S = 60.0


def _bits_bound() -> int:
    """The most skip bits a record keeps with nothing running: its history, plus the
    chunk by which it moves on."""
    return step_record.HISTORY + step_record.HISTORY // 8


def _check_record(rec: StepRecord, stop: int) -> None:
    """``rec`` with no step running and every id below ``stop`` ended: bounded."""
    assert (rec.completed_ids.watermark, rec.completed_ids._decided) == (stop, set())
    assert not rec._fates and not rec.half_applied
    assert rec._bits.bit_length() <= _bits_bound()
    assert sys.getsizeof(rec._bits) <= _bits_bound() // 8 + 64
    assert stop - rec.history_start <= _bits_bound()
    assert len(rec.epochs) <= step_record.EPOCHS


def _check_ledger(led: Ledger, stop: int) -> None:
    assert (led.watermark, led._decided) == (stop, set())
    assert len(led.decisions) <= step_record.FORGET_EVERY


def _check_state_arrays(arrays: dict, first: dict) -> None:
    """The record saved in a state has the shapes it had at the first save."""
    assert {k: (v.shape, v.dtype) for k, v in arrays.items()} == \
        {k: (v.shape, v.dtype) for k, v in first.items()}


# -- the record on its own ---------------------------------------------------------------

def test_the_step_record_keeps_a_window_of_skip_bits_and_saves_them(monkeypatch):
    monkeypatch.setattr(step_record, "HISTORY", 64)
    rec = StepRecord()
    rng = np.random.default_rng(0)
    skipped = set()
    first = None
    for i in range(5000):
        if rng.random() < 0.3:
            rec.skip(i)
            skipped.add(i)
        else:
            rec.completed(i)
        if i % 500 == 499:
            _check_record(rec, i + 1)
            arrays = rec.to_arrays(i + 1)
            first = first or arrays
            _check_state_arrays(arrays, first)
            # the history it keeps is exact, the rest unknown (None)
            for j in range(max(0, i - 80), i + 1):
                want = (j in skipped) if j >= rec.history_start else None
                assert rec.was_skipped(j) is want
            assert rec.skipped == {j for j in skipped if j >= rec.history_start}
            back = StepRecord.from_arrays(arrays, i + 1)
            start = int(arrays["history_start"])
            assert i + 1 - 64 <= start <= i + 1
            assert back.skipped == {j for j in skipped if j >= start}
            assert back.token_at(i) == rec.token_at(i) is not None
            assert back.token_at(i + 1) != rec.token_at(i + 1)  # a new epoch
            assert back.completed_ids.watermark == i + 1


def test_restored_records_keep_at_most_epochs_epochs(monkeypatch):
    monkeypatch.setattr(step_record, "HISTORY", 1 << 12)
    rec = StepRecord()
    n = 0
    for _ in range(3 * step_record.EPOCHS):
        for _ in range(3):
            rec.completed(n)
            n += 1
        rec = StepRecord.from_arrays(rec.to_arrays(n), n)
        _check_record(rec, n)
    # the oldest epochs went, with the history of their ids
    assert len(rec.epochs) == step_record.EPOCHS
    assert rec.history_start == rec.epochs[0][0] == n - 3 * (step_record.EPOCHS - 1)
    assert rec.token_at(rec.history_start - 1) is None


@pytest.mark.parametrize("bad", [
    {"history_start": np.array(9, np.int32)},  # after the state's next step
    {"skipped": np.zeros(3, np.int32)},
    {"epochs": np.array([[4, 1], [2, 5]], np.int32)},  # not ascending
    {"epochs": np.array([[0, 1], [8, 5]], np.int32)},  # starts at the next step
])
def test_a_malformed_saved_record_is_refused(bad):
    rec = StepRecord()
    for i in range(8):
        rec.completed(i)
    arrays = {**rec.to_arrays(8), **bad}
    with pytest.raises(ValueError, match=r"state\['steps'\]"):
        StepRecord.from_arrays(arrays, 8)


# -- 10,000 steps through the coordinator, the client and real shards --------------------

class _Job:
    """A coordinator running planned steps on two shards of one scalar each through
    the shard client: each step completes, raises (skipped), pushes a gradient too
    stale for the shards (dropped), or loses its worker before or after pushing (run
    again: the rerun's push is a duplicate where the first was decided)."""

    KINDS = ("ok", "raise", "stale", "lost_before", "lost_after")

    def __init__(self, workers: int = 3, record: StepRecord | None = None,
                 shards: list | None = None):
        params = {"a": np.zeros((), np.float32), "b": np.zeros((), np.float32)}
        self.placement = place_parameters(params, 2)
        tx = optax.sgd(1.0)
        self.shards = shards or [PSShard(i, p, tx, num_shards=2, max_staleness=1 << 20)
                                 for i, p in enumerate(self.placement.split(params))]
        self.client = ShardClient(self.shards, self.placement, token_gated=False)
        self.plan: dict[int, str] = {}
        self.grads = {"a": np.ones((), np.float32), "b": np.ones((), np.float32)}
        self.co = Coordinator(
            [self._runner(w) for w in range(workers)], max_attempts=4,
            decided=self.client.decided, skip=self.client.skip,
            forget=self.client.forget, replace=lambda w: True, record=record)

    def _runner(self, w: int):
        def start(c: Closure, on_token_wait):
            def wait():
                kind = self.plan[c.step_id]
                if kind == "raise":
                    raise ApplicationError(ValueError("this step raises"))
                if kind == "lost_before" and c.attempt == 1:
                    raise WorkerLostError("lost before its push")
                fetched = [sh.step for sh in self.shards]
                if kind == "stale":
                    fetched = [f - (1 << 21) for f in fetched]  # dropped
                self.client.push(c.step_id, w, fetched, self.grads)
                if kind == "lost_after" and c.attempt == 1:
                    raise WorkerLostError("lost after its push")
                return c.step_id
            return wait
        return start

    def run(self, first: int, n: int, rng) -> None:
        kinds = rng.choice(self.KINDS, n, p=[0.8, 0.1, 0.04, 0.03, 0.03])
        for i, kind in enumerate(kinds, first):
            self.plan[i] = str(kind)
            try:
                self.co.schedule(Closure(i, None, False, None, (), 0, None))
            except ValueError:  # a step raised: the queued ones were cancelled (TF's)
                self.co.schedule(Closure(i, None, False, None, (), 0, None))
        try:
            self.co.join(timeout=BOUND_S)
        except ValueError:  # the first raising step's error
            pass
        for i in range(first, first + n):
            del self.plan[i]


def test_ten_thousand_steps_keep_every_record_bounded(monkeypatch):
    monkeypatch.setattr(step_record, "HISTORY", 1024)
    rng = np.random.default_rng(28)
    job = _Job()
    first_saved = None
    n, batch = 0, 250
    try:
        for k in range(10_000 // batch):
            job.run(n, batch, rng)
            n += batch
            rec = job.co.record
            _check_record(rec, n)
            assert len(rec.skipped) <= _bits_bound()
            for sh in job.shards:
                _check_ledger(sh.ledger, n)
                assert not sh._staged
            st = job.co.stats()
            assert all(len(t) <= admission.FINISH_TIMES for t in st.finish_times)
            saved = rec.to_arrays(n)
            first_saved = first_saved or saved
            _check_state_arrays(saved, first_saved)
            ledgers = [sh.state()["ledger"] for sh in job.shards]
            assert all(led["window"].shape == (1024,) for led in ledgers)
            if k % 10 == 9:  # a restore: a new coordinator from the saved record
                job.co.shutdown(wait=1.0)
                job = _Job(record=StepRecord.from_arrays(saved, n), shards=job.shards)
                assert job.co.record.epochs[-1][0] == n
        counts = [sh.ledger.counts for sh in job.shards]
        assert counts[0] == counts[1]
        assert counts[0]["stale"] > 0 and counts[0]["duplicate"] > 0
        assert 0 < len(job.co.record.skipped) <= _bits_bound()
    finally:
        job.co.shutdown(wait=1.0)


# -- the public API ----------------------------------------------------------------------

def _job(inner=None, **kw):
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, placement="round_robin", **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(()), "b": jnp.zeros(())}
        tx = jr.ps.pushable(inner or optax.sgd(1.0))
        opt = tx.init(params)

    def step(ctx, p, o):
        g = {"a": jnp.ones(()) + 0.0 * p["a"], "b": jnp.ones(()) + 0.0 * p["b"]}
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u)

    return s, rep, params, opt, step


def _bad(ctx, *args):
    raise ValueError("this step raises")


def _steps(rep, step, params, opt, n):
    for _ in range(n):
        rep.run(step, None, params, opt)
    try:
        rep.join()
    except ValueError:
        pass


def _footprint(rec) -> int:
    """Bytes held per step by a coordinator's record (old and new layouts alike): its
    and its ledger's ints, and 8 bytes per entry of their sets, dicts and lists plus the
    entries' own size. Entries, not ``sys.getsizeof`` of a container: a dict keeps the
    capacity it once needed after its entries are deleted (how many steps were in
    flight at once, a matter of timing), which is no per-step growth."""
    size = 0
    for obj in (rec, getattr(rec, "completed_ids", None)):
        for v in vars(obj).values() if obj is not None else ():
            if isinstance(v, int) and not isinstance(v, bool):
                size += sys.getsizeof(v)
            elif isinstance(v, (set, dict, list)):
                size += 8 * len(v) + sum(sys.getsizeof(x) for x in v)
    return size


def test_the_record_of_skipped_steps_stays_bounded(monkeypatch):
    """Issue 28 item 6: the coordinator kept one int per failed step (600 after 600),
    while the shards keep a watermark. Now one bit per id of its history (64 here)."""
    monkeypatch.setattr(step_record, "HISTORY", 64, raising=False)
    s, rep, params, opt, step = _job()
    try:
        _steps(rep, step, params, opt, 2)
        sizes = []
        for _ in range(3):
            for _ in range(60):
                for fn in (_bad, step):
                    try:
                        rep.run(fn, None, params, opt)
                    except ValueError:  # a step raised: run raises it once (TF's
                        rep.run(fn, None, params, opt)  # schedule), then schedules again
            with contextlib.suppress(ValueError):  # the last error, unless run raised it
                rep.join()
            sizes.append(_footprint(s._ex().coordinator.record))
        assert sizes[2] <= sizes[1] + 64, sizes  # the third 60 kept no more
        assert len(s._ex().coordinator.skipped) <= 64 + 8
    finally:
        s.shutdown()


def test_a_public_run_keeps_every_record_and_the_state_bounded(monkeypatch):
    monkeypatch.setattr(step_record, "HISTORY", 64)
    monkeypatch.setattr(step_record, "FORGET_EVERY", 16)
    s, rep, params, opt, step = _job()
    ex = s._ex()
    try:
        first, done = None, 0
        for k in range(4):
            raised, values = 0, []
            for i in range(80):
                # A step raised: the queued ones were cancelled, and run raises it once
                # (TF's schedule) before this step is scheduled.
                fn = _bad if i % 10 == 3 else step
                try:
                    values.append(rep.run(fn, None, params, opt))
                except ValueError:
                    raised += 1
                    values.append(rep.run(fn, None, params, opt))
            try:
                rep.join()
            except ValueError:
                raised += 1
            assert raised >= 1
            for v in values:
                try:
                    v.fetch()
                    done += 1
                except (ValueError, jr.ps.StepCancelledError):
                    pass
            if k == 2:
                s.restore(s.state())
            state = s.state()
            shapes = jax_shapes(state)
            first = first or shapes
            assert shapes == first  # a state of fixed size
            _check_record(ex.coordinator.record, ex.next_id)
            for sh in ex._carrier.shards:
                _check_ledger(sh.ledger, ex.next_id)
        assert 0 < done <= 4 * 72
        assert [led["applied"] for led in s.ledger()] == [done] * 2
    finally:
        s.shutdown()


def jax_shapes(tree) -> list:
    import jax
    return [(np.shape(x), np.asarray(x).dtype) for x in jax.tree.leaves(tree)]


def test_token_gated_decisions_are_let_go_once_their_steps_ended(monkeypatch):
    """Shard 0 keeps each push's decision for a rerun of its step; one per push was
    kept for the whole job. Now the coordinator tells the shards, every FORGET_EVERY
    ended steps, below which id every step ended."""
    monkeypatch.setattr(step_record, "FORGET_EVERY", 16, raising=False)
    s, rep, params, opt, step = _job(jr.sync_replicas(optax.sgd(1.0), 1, 2))
    try:
        _steps(rep, step, params, opt, 200)
        shards = s._ex()._carrier.shards
        kinds = s.ledger()[0]
        assert kinds["applied"] + kinds["stale"] + kinds["backup"] == 200
        assert all(len(sh.ledger.decisions) <= 16 for sh in shards), \
            [len(sh.ledger.decisions) for sh in shards]
        assert all(sh.ledger.watermark == 200 for sh in shards)
    finally:
        s.shutdown()


def test_after_restore_the_record_of_completed_steps_is_a_watermark():
    """After restore(state) the coordinator's record of completed steps started at id
    0 while the steps went on from the state's next id: every later id was kept one by
    one for the rest of the job."""
    s, rep, params, opt, step = _job()
    try:
        _steps(rep, step, params, opt, 5)
        s.restore(s.state())
        _steps(rep, step, params, opt, 20)
        done = s._ex().coordinator.completed_ids
        assert (done.watermark, done._decided) == (25, set())
    finally:
        s.shutdown()
