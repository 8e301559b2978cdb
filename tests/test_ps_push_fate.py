"""The fate of a push, thread-free: :mod:`jreplicate.ps.fate` on its own.

A hypothesis state machine drives the pure fate modules as the shards, the client and
the coordinator do (no threads, no JAX): steps push to every shard (token-gated: staged
on the other shards, decided by a small reference driver on shard 0, committed;
asynchronous: applied by each shard on its own), workers die in the middle of a push
(the lost push settled, the shards asked, the step rerun or given up), steps end
without pushing (skipped), the shards are told which steps ended (forget), and the
ledgers and the driver's record are saved and restored. Against a reference of "each
step applied exactly once by every shard, or skipped by every shard, or named half
applied; never silently half": after every rule each ended step's fate agrees across
the shards' ledgers and the record, no shard applies an id twice, and the other shards
fed exactly shard 0's accepted pushes in shard 0's order.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from jreplicate.ps.fate import (
    FORGET,
    SKIPPED,
    Counters,
    Decision,
    Ledger,
    ShardBook,
    StepRecord,
    TokenRelease,
    check_history,
    decided_ids,
    driver_decision,
    ids_to_ask,
    judge_live,
    lost_updates,
    needs_ack,
    push_fate,
    settle_restart,
)
from jreplicate.ps.remote import ParameterServerError


class _Driver:
    """A reference ``sync_replicas`` host driver: ``k`` fresh gradients complete a step;
    a gradient of an older step is stale."""

    def __init__(self, k: int):
        self.k, self.gs, self.acc, self.stale = k, 0, 0, 0

    def push(self, local_step: int) -> tuple[Counters, Counters]:
        before = Counters(self.gs, self.acc, self.stale, 0)
        if local_step < self.gs:
            self.stale += 1
        else:
            self.acc += 1
            if self.acc == self.k:
                self.gs, self.acc = self.gs + 1, 0
        return before, Counters(self.gs, self.acc, self.stale, 0)


def _logged(book: ShardBook, log: list) -> ShardBook:
    """Every ledger entry of ``book`` logged as ``(push id, kind)``."""
    led = book.ledger
    orig = led.record

    def record(push_id, kind, staleness=None):
        orig(push_id, kind, staleness)
        log.append((push_id, kind))

    led.record = record
    return book


class FateMachine(RuleBasedStateMachine):
    """Steps, pushes, lost workers and restores over 2-3 shards' pure books."""

    @initialize(shards=st.integers(2, 3), token=st.booleans(),
                k=st.integers(1, 3))
    def build(self, shards, token, k):
        self.n, self.token = shards, token
        self.logs = [[] for _ in range(shards)]
        self.books = [_logged(ShardBook(i), self.logs[i]) for i in range(shards)]
        self.driver = _Driver(k)
        self.release = TokenRelease(0, shards)
        self.record = StepRecord()
        self.steps = {}  # id -> "running" | "completed" | "skipped" | "half"
        self.attempts = {}  # id -> runs so far
        self.fstep = [0] * shards  # each other shard's step (token-gated)
        self.fed = [[] for _ in range(shards)]  # (step, pieces) fed, in order
        self.accepted = []  # (step, index, pieces) shard 0 accepted, in order
        self.next_id = 0
        self.stopped = False  # a step ended half applied: training stopped
        self.saved = self._state()  # the last state() (shards restart from it)
        self.skipped = set()  # the ids skipped on every shard

    # -- what the shards, the client and the coordinator do ----------------------------
    def _state(self) -> dict:
        """What ``strategy.state()`` saves of the fate (no step running)."""
        return {"next_step_id": np.array(self.next_id),
                "steps": self.record.to_arrays(self.next_id),
                "shards": [{"ledger": b.ledger.to_arrays()} for b in self.books]}

    def _feed(self, j: int) -> None:
        book = self.books[j]
        while True:
            gs, done = self.fstep[j], False
            while not done:
                ready, pieces = book.next_piece(gs)
                if not ready:
                    return
                book.fed_one(gs)
                self.fed[j].append((gs, pieces))
                done = book.completes(gs)
            book.step_done(gs)
            self.fstep[j] = gs + 1

    def _commit(self, j: int, pid: int, d: Decision) -> None:
        if self.books[j].commit(pid, d):
            self._feed(j)

    def _push_token(self, pid: int, upto: int, stale: bool) -> Decision:
        """Stages on every other shard, shard 0 decides, commits on shards 1..upto."""
        run = self.attempts[pid]
        pieces = (pid, run)
        for j in range(1, self.n):
            self.books[j].stage(pid, run, pieces)
        d = self.books[0].duplicate(pid, self.driver.gs)
        if d is None:
            local_step = self.driver.gs - (stale and self.driver.gs > 0)
            d = driver_decision(*self.driver.push(local_step), attempt=run)
            self.books[0].decided_by_driver(pid, d)
            self.release.decided(d)
            if d.kind == "applied":
                self.accepted.append((d.step, d.index, pieces))
        for j in range(1, upto + 1):
            self._commit(j, pid, d)
        return d

    def _push_async(self, pid: int, upto: int) -> None:
        for j in range(upto + 1):
            book = self.books[j]
            if book.duplicate(pid, 0) is None:
                book.ledger.record(pid, "applied", 0)

    def _skip_everywhere(self, pid: int) -> None:
        self.skipped.add(pid)
        for j in range(self.n):
            self._commit(j, pid, SKIPPED)

    # -- rules -------------------------------------------------------------------------
    @precondition(lambda self: not self.stopped and len(self.running()) < 4)
    @rule()
    def schedule(self):
        self.steps[self.next_id] = "running"
        self.attempts[self.next_id] = 0
        self.next_id += 1

    def _pick(self, data) -> int:
        """A running step, or a new one (scheduled now)."""
        running = self.running()
        if len(running) < 4 and data.draw(st.booleans(), label="new step"):
            self.schedule()
            return self.next_id - 1
        return data.draw(st.sampled_from(running)) if running else self._pick(data)

    @precondition(lambda self: not self.stopped)
    @rule(data=st.data(), stale=st.booleans())
    def push(self, data, stale):
        pid = self._pick(data)
        if self.token:
            self._push_token(pid, self.n - 1, stale)
        else:
            self._push_async(pid, self.n - 1)
        self.record.completed(pid)
        self.steps[pid] = "completed"

    @precondition(lambda self: not self.stopped)
    @rule(data=st.data(), stale=st.booleans(), settles=st.booleans(),
          gives_up=st.booleans())
    def push_and_die(self, data, stale, settles, gives_up):
        """The worker dies after shard 0 and some of the others took the push."""
        pid = self._pick(data)
        upto = data.draw(st.integers(0, self.n - 2), label="shards past 0 reached")
        if self.token:
            self._push_token(pid, upto, stale)
        else:
            self._push_async(pid, upto)
        self._worker_lost(pid, settles, gives_up)

    def _worker_lost(self, pid: int, settles: bool, gives_up: bool) -> None:
        # The coordinator settles the lost push (token-gated: shard 0's decision
        # committed on the others; a shard call may fail), then asks the shards.
        if self.token and settles:
            d = self.books[0].ledger.decisions.get(pid)
            if d is not None:
                for j in range(1, self.n):
                    self._commit(j, pid, d)
        self.record.note_fate(pid, [b.ledger.seen(pid) for b in self.books])
        self.attempts[pid] += 1
        if not gives_up:
            return  # rerun later, same id
        got = self.record.ended(pid, RuntimeError("lost"))
        if isinstance(got, ParameterServerError):
            self.steps[pid], self.stopped = "half", True
        elif got:
            self._skip_everywhere(pid)
            self.steps[pid] = "skipped"
        else:
            self.steps[pid] = "completed"

    @precondition(lambda self: not self.stopped)
    @rule(data=st.data())
    def ends_without_pushing(self, data):
        """The step raised, its token wait was cancelled, or it was not run."""
        pid = self._pick(data)
        if self.record.ended(pid, RuntimeError("raised")) is True:
            self._skip_everywhere(pid)
            self.steps[pid] = "skipped"
        else:  # a lost run of it pushed: its fate was noted
            self.steps[pid] = "half" if pid in self.record.half_applied else "completed"
            self.stopped = pid in self.record.half_applied

    @precondition(lambda self: not self.stopped)
    @rule()
    def forget(self):
        below = self.record.completed_ids.watermark
        for j in range(self.n):
            self._commit(j, below, FORGET)
        for book in self.books:
            assert all(i >= below for i in book.ledger.decisions)
            assert all(i >= below for i in book.staged)

    @precondition(lambda self: not self.stopped and not self.running())
    @rule()
    def save_and_restore(self):
        """``state()`` then ``restore(state)``: the ledgers and the record from arrays."""
        self.saved = self._state()
        self.record = StepRecord.from_arrays(self.saved["steps"], self.next_id)
        for j, book in enumerate(self.books):
            restored = ShardBook(j, Ledger.from_arrays(book.ledger.to_arrays()), book.fed)
            restored.ledger.decisions = dict(book.ledger.decisions)
            self.books[j] = _logged(restored, self.logs[j])

    @precondition(lambda self: self.stopped)
    @rule()
    def restore_after_the_stop(self):
        """Training stopped (a step half applied): every shard restored from a state
        saved at the next step (the ids before it all ended, at one global step)."""
        n, gs = self.next_id, self.driver.gs
        self.logs = [[] for _ in range(self.n)]
        self.books = [_logged(ShardBook(j, Ledger(watermark=n)), self.logs[j])
                      for j in range(self.n)]
        self.driver.acc, self.fstep = 0, [gs] * self.n
        self.fed, self.accepted = [[] for _ in range(self.n)], []
        self.record = StepRecord.from_arrays(self.record.to_arrays(n), n)
        self.steps, self.stopped, self.skipped = {}, False, set()
        self.saved = self._state()  # (the state restored)

    @precondition(lambda self: not self.token and not self.stopped and self.saved)
    @rule(data=st.data())
    def lose_a_shard_and_restart_it(self, data):
        """Asynchronous: shard ``j`` is lost (training stops; the running steps end
        unresolved, some having pushed to the other shards, some named half applied
        from a lost worker's push), then restarted from the last save."""
        j = data.draw(st.integers(0, self.n - 1), label="lost shard")
        live = [i for i in range(self.n) if i != j]
        for pid in self.running():
            if data.draw(st.booleans(), label=f"step {pid} pushed to the live shards"):
                for i in live:
                    if self.books[i].duplicate(pid, 0) is None:
                        self.books[i].ledger.record(pid, "applied", 0)
            got = self.record.ended(pid, RuntimeError("shard lost"), resolved=False)
            self.steps[pid] = "half" if isinstance(got, ParameterServerError) \
                else "unresolved"
        self.stopped = True
        # restart_shard(j, saved): as the executor does it
        stop, record = self.next_id, self.record
        check_history(j, self.saved, record, stop)
        arrays = {i: self.books[i].ledger.to_arrays() for i in live}
        lo = min([record.completed_ids.watermark, *(int(a["watermark"])
                                                    for a in arrays.values())])
        undecided = []
        for pid in ids_to_ask(arrays.values(), lo, stop, record.was_skipped,
                              record.completed_ids.seen):
            answers = [None if i == j else self.books[i].ledger.seen(pid)
                       for i in range(self.n)]
            fate, _, _ = judge_live(answers, live, record.was_skipped(pid),
                                    record.completed_ids.seen(pid))
            if fate == "half":  # refused: the live shards disagree (restore is the fix)
                assert pid in record.half_applied, pid  # (never silently half)
                return
            if fate == "undecided":
                undecided.append(pid)
        saved = self.saved["shards"][j]["ledger"]
        lost = lost_updates(saved, list(arrays.values()), record, stop)
        # The reference: to skip, the ended ids no live shard decided nor completed;
        # lost, the ids a shard applied (ever) that the saved ledger had not decided,
        # less the skipped ones.
        assert undecided == [p for p in range(lo, stop) if not record.completed_ids.seen(p)
                             and not any(self.books[i].ledger.seen(p) for i in live)]
        self.skipped |= set(undecided)
        mine = decided_ids(saved, 0, stop)
        applied = {p for log in self.logs for p, kind in log if kind == "applied"}
        assert lost == tuple(sorted(applied - mine - self.skipped)), lost
        for pid in undecided:
            for i in live:
                self._commit(i, pid, SKIPPED)
        restored = Ledger.from_arrays(saved)
        settle_restart(record, restored, undecided, lost, stop)
        assert record.completed_ids.watermark == restored.watermark == stop
        assert all(self.books[i].ledger.watermark >= stop for i in live)
        assert not record.half_applied  # resolved: state() saves again
        # Every id so far has ended and is accounted for (checked above).
        self.books[j] = _logged(ShardBook(j, restored), self.logs[j])
        self.steps, self.stopped = {}, False

    # -- the reference -----------------------------------------------------------------
    def running(self) -> list[int]:
        return sorted(i for i, s in self.steps.items() if s == "running")

    @invariant()
    def every_shard_applies_an_id_at_most_once(self):
        for log in self.logs:
            counted = [pid for pid, kind in log if kind != "duplicate"]
            assert len(counted) == len(set(counted)), log

    @invariant()
    def each_ended_step_is_applied_everywhere_skipped_everywhere_or_named(self):
        for pid, fate in self.steps.items():
            seen = [b.ledger.seen(pid) for b in self.books]
            kinds = [{k for i, k in log if i == pid and k != "duplicate"}
                     for log in self.logs]
            if fate == "completed":
                assert all(seen), (pid, seen)
                assert self.record.completed_ids.seen(pid)
                assert not self.record.was_skipped(pid)
                assert all(len(k) == 1 for k in kinds) and len(set.union(*kinds)) == 1, kinds
            elif fate == "skipped":
                assert all(seen), (pid, seen)
                assert self.record.was_skipped(pid)
                assert not any(kinds), kinds  # counted nowhere
            elif fate == "half":  # (after a lost shard, its ledger may have it too)
                assert pid in self.record.half_applied
            elif fate == "running":
                assert not self.record.completed_ids.seen(pid)

    @invariant()
    def the_record_and_the_ledgers_watermarks_agree(self):
        running = self.running()
        stop = min(running, default=self.next_id)
        if not self.stopped:
            assert self.record.completed_ids.watermark == stop
            for b in self.books:
                assert b.ledger.watermark >= stop

    @invariant()
    def the_other_shards_feed_shard_zeros_accepted_pushes_in_its_order(self):
        if not self.token:
            return
        for j in range(1, self.n):
            got = self.fed[j]
            want = [(s, p) for s, _, p in self.accepted][:len(got)]
            assert got == want, (j, got, want)
            # (a committed push is never waiting while the one before it is fed)
            assert self.fstep[j] <= self.driver.gs


TestFateMachine = FateMachine.TestCase
TestFateMachine.settings = settings(max_examples=200, stateful_step_count=30,
                                    deadline=None)


# -- decisions -----------------------------------------------------------------------------

def test_driver_decisions_read_the_counters():
    c = Counters
    assert driver_decision(c(3, 1, 0, 0), c(3, 1, 1, 0), 0) == Decision("stale", 3)
    assert driver_decision(c(3, 1, 0, 0), c(3, 1, 0, 1), 0) == Decision("backup", 3)
    assert driver_decision(c(3, 1, 0, 0), c(3, 2, 0, 0), 2) == \
        Decision("applied", 3, 1, completes=False, attempt=2)
    assert driver_decision(c(3, 1, 0, 0), c(4, 0, 0, 0), 1) == \
        Decision("applied", 3, 1, completes=True, attempt=1)
    assert needs_ack(Decision("applied", 3, 1, completes=True), [4, 4])
    assert not needs_ack(Decision("applied", 3, 0), [3, 3])
    assert not needs_ack(Decision("stale", 3), [4])


def test_a_duplicate_returns_the_first_decision():
    book = ShardBook(0)
    first = Decision("applied", 5, 1, attempt=0)
    book.decided_by_driver(7, first)
    assert book.duplicate(8, 5) is None
    assert book.duplicate(7, 6) == Decision("applied", 5, 1, attempt=0, duplicate=True)
    assert book.ledger.counts["duplicate"] == 1
    book.failed(9, 6)
    assert book.duplicate(9, 6).kind == "failed"


def test_a_commit_of_a_run_never_staged_is_refused_and_records_nothing():
    book = ShardBook(2)
    book.stage(4, 0, "pieces of run 0")
    with pytest.raises(RuntimeError, match=r"PSShard 2: push 4 \(run 1\) .* never staged"):
        book.commit(4, Decision("applied", 0, 0, attempt=1))
    assert not book.ledger.seen(4) and book.ledger.pushes == 0


def test_a_step_taking_another_number_of_gradients_than_shard_zero_is_named():
    book = ShardBook(1)
    book.stage(0, 0, "g0")
    book.commit(0, Decision("applied", 0, 0, completes=False))
    assert book.next_piece(0) == (True, "g0")
    book.fed_one(0)
    book.need[0] = 2  # shard 0 said the step took 2
    book.fed = 3
    with pytest.raises(RuntimeError, match="step 0 took 2 gradients on shard 0 but 3"):
        book.step_done(0)


def test_too_stale_drops_beyond_the_bound_only():
    book = ShardBook(0)
    assert book.too_stale(0, 10, 3, None) is None
    assert book.too_stale(1, 10, 3, 3) is None
    assert book.too_stale(2, 10, 4, 3) == Decision("stale", 10)
    assert book.ledger.counts["stale"] == 1 and book.ledger.seen(2)


def test_token_release_waits_for_every_shard_and_holds_back_a_second_gradient():
    r = TokenRelease(0, 3)
    assert not r.released(1)
    r.ack([1])
    assert not r.released(1)
    r.ack([1, 1])
    assert r.released(1)
    r.ack([0, 0])  # (an older acknowledgement moves nothing back)
    assert r.released(1)
    assert not r.holds_back(1, 2, 2, True)  # k unknown yet
    r.decided(Decision("applied", 0, 1, completes=True))
    assert r.k == 2
    assert r.holds_back(1, 2, 2, True)
    assert not r.holds_back(1, 2, 2, False)
    r.live = 1  # a worker died: fewer than k alive
    assert not r.holds_back(1, 2, 2, True)


# -- reconciliation after a loss --------------------------------------------------------------

@pytest.mark.parametrize("answers, kind", [
    (None, "unknown"), ([True, True], "all"), ([True, False], "half"),
    ([True, None], "unknown"), ([False, False], None), ([True, False, None], "half")])
def test_push_fate_of_the_shards_answers(answers, kind):
    fate = push_fate(answers)
    assert (fate.kind if fate else None) == kind


def _arrays(decided: set[int]) -> dict[str, np.ndarray]:
    led = Ledger()
    for p in sorted(decided):
        led.record(p, "applied")
    return led.to_arrays()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_restart_names_exactly_the_lost_updates_and_brings_the_ledgers_up(data):
    """A lost shard restarted from a ledger saved earlier: the ids it lacks are those
    completed or decided by a live shard, not skipped, and not in its saved ledger;
    afterwards its ledger and the record have decided every id below the next one."""
    stop = data.draw(st.integers(1, 24))
    fates = data.draw(st.lists(st.sampled_from(["completed", "skipped", "lost_in"]),
                               min_size=stop, max_size=stop))
    saved_at = data.draw(st.integers(0, stop))
    record = StepRecord()
    for p, f in enumerate(fates):
        if f == "completed":
            record.completed(p)
        elif f == "skipped":
            record.skip(p)
    # (lost_in: ended while a shard was lost; decided by the live shards or by none)
    live_has = {p for p, f in enumerate(fates) if f == "completed" or
                (f == "lost_in" and data.draw(st.booleans(), label=f"live decided {p}"))}
    skipped = {p for p, f in enumerate(fates) if f == "skipped"}
    mine = {p for p in range(saved_at)} | {
        p for p in range(saved_at, stop) if p in live_has and data.draw(st.booleans())}
    restored = _arrays(mine)
    live = [_arrays(live_has | skipped)]
    wm = int(restored["watermark"])
    want = tuple(p for p in range(wm, stop) if p not in mine and p in live_has)
    assert lost_updates(restored, live, record, stop) == want

    asked = ids_to_ask(live, record.completed_ids.watermark, stop, record.was_skipped,
                       record.completed_ids.seen)
    undecided = [p for p in asked if judge_live([p in live_has or p in skipped], [0],
                                                record.was_skipped(p),
                                                record.completed_ids.seen(p))[0]
                 == "undecided"]
    assert undecided == [p for p, f in enumerate(fates) if f == "lost_in" and
                         p not in live_has]
    led = Ledger.from_arrays(restored)
    settle_restart(record, led, undecided, want, stop)
    assert record.completed_ids.watermark == stop and led.watermark == stop
    assert {p for p in range(stop) if record.was_skipped(p)} == skipped | set(undecided)


def test_judge_live_names_a_push_on_some_live_shards_only():
    assert judge_live([None, True, False], [1, 2], False, False) == ("half", [1], [2])
    assert judge_live([None, True, False], [1, 2], True, False)[0] == "decided"
    assert judge_live([None, False, False], [1, 2], False, False)[0] == "undecided"
    assert judge_live([None, False, False], [1, 2], False, True)[0] == "decided"


def test_decided_ids_reads_the_watermark_and_the_window_within_the_range():
    arrays = _arrays({0, 1, 2, 5, 9})
    assert decided_ids(arrays, 0, 10) == {0, 1, 2, 5, 9}
    assert decided_ids(arrays, 2, 6) == {2, 5}
