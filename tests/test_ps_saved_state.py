"""``ParameterServerStrategy.state()`` / ``restore(state)``'s reading and checks
(:mod:`jreplicate.ps.saved_state`), thread-free: a state is taken only when no step is
pending and the shards agree, and a state read back is either the saved one exactly or
refused with an error naming ``restore`` and the fix (never a half-read state)."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.ps import saved_state
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.fate.record import StepRecord


def _shard(step: int) -> dict:
    led = Ledger()
    for pid in range(step):
        led.record(pid, "applied", 0)
    return {"params": {"w": np.full(2, float(step), np.float32)},
            "opt_state": {"count": np.array(step, np.int32)},
            "step": np.array(step, np.int32), "ledger": led.to_arrays()}


class _Coordinator(SimpleNamespace):
    """What snapshot reads of a coordinator; ``pending`` may change between reads."""

    @property
    def pending(self):
        return self.pendings.pop(0) if len(self.pendings) > 1 else self.pendings[0]


def _parts(steps, pendings=(0,), half=None):
    c = _Coordinator(pendings=list(pendings), half_applied=dict(half or {}),
                     record=StepRecord(max(steps)))
    carrier = SimpleNamespace(shard_state=lambda i: _shard(steps[i]))
    return c, carrier


def test_a_snapshot_holds_every_shard_the_next_id_and_the_record():
    c, carrier = _parts([3, 3])
    got = saved_state.snapshot(c, carrier, 2, token_gated=False, next_id=3)
    assert [int(sh["step"]) for sh in got["shards"]] == [3, 3]
    assert int(got["next_step_id"]) == 3
    assert set(got["steps"]) == {"history_start", "skipped", "epochs"}


@pytest.mark.parametrize("pendings,half,steps,gated,match", [
    ((2,), None, [3, 3], False, "2 steps are scheduled or running"),
    ((0, 1), None, [3, 3], False, "steps were scheduled while the shards were read"),
    ((0,), {5: "a worker lost mid-push"}, [3, 3], False, "step 5's push is on some"),
    ((0,), None, [3, 2], True, r"global steps \[3, 2\]"),
])
def test_a_snapshot_is_refused_when_the_shards_may_disagree(pendings, half, steps, gated,
                                                            match):
    c, carrier = _parts(steps, pendings, half)
    with pytest.raises(RuntimeError, match=match):
        saved_state.snapshot(c, carrier, 2, token_gated=gated, next_id=3)


def test_async_shards_at_different_steps_are_a_consistent_snapshot():
    c, carrier = _parts([3, 2])  # (one step's push failed on shard 1 only: skipped)
    saved_state.snapshot(c, carrier, 2, token_gated=False, next_id=3)


def _state(n=2):
    c, carrier = _parts([3] * n)
    return saved_state.snapshot(c, carrier, n, token_gated=False, next_id=3)


def test_a_state_reads_back_exactly():
    state = _state()
    restored, next_id, record = saved_state.read_state(state, 2)
    assert next_id == 3
    for k, v in record.to_arrays(3).items():
        np.testing.assert_array_equal(v, state["steps"][k])
    for r, sh in zip(restored, state["shards"]):
        np.testing.assert_array_equal(r["params"]["w"], sh["params"]["w"])
        assert r["step"] == 3 and r["ledger"].watermark == 3


def test_a_state_without_its_record_reads_back_as_all_ended():
    state = _state()
    del state["steps"]
    _, next_id, record = saved_state.read_state(state, 2)
    assert next_id == 3 and record.was_skipped(2) is not True


_MUTATIONS = {
    "no shards": lambda s: s.pop("shards"),
    "no next id": lambda s: s.pop("next_step_id"),
    "shards not a list": lambda s: s.__setitem__("shards", 3),
    "a shard without its ledger": lambda s: s["shards"][0].pop("ledger"),
    "a shard without its step": lambda s: s["shards"][1].pop("step"),
    "a ledger without its watermark": lambda s: s["shards"][0]["ledger"].pop("watermark"),
}


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(sorted(_MUTATIONS)), min_size=1, max_size=3, unique=True))
def test_a_damaged_state_is_refused_naming_restore_and_the_fix(mutations):
    state = _state()
    for m in mutations:
        try:
            _MUTATIONS[m](state)
        except (KeyError, TypeError, AttributeError):
            pass  # (an earlier mutation took what this one changes)
    with pytest.raises(ValueError, match=r"restore\(state\): the state is not a "
                                         r"strategy\.state\(\)|restore: the state has"):
        saved_state.read_state(state, 2)


def test_another_number_of_shards_is_refused_naming_num_ps():
    with pytest.raises(ValueError, match="the state has 3 shards, this strategy 2; "
                                         "restore with the same num_ps"):
        saved_state.read_state(_state(3), 2)
