"""The input's cross-process protocol without processes: typed outcomes, their JSON
messages, and the pure ``decide`` every process takes the same decision with."""

import itertools
import json

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate import _wire
from jreplicate.input.protocol import Action, Decision, ReadOutcome, decide

SPEC = json.loads(_wire.dumps(_wire.element_spec(jax.tree.structure({"x": 0}),
                                                 [np.zeros((4, 3), np.float32)])))
OTHER = json.loads(_wire.dumps(_wire.element_spec(jax.tree.structure({"x": 0}),
                                                  [np.zeros((5, 3), np.float32)])))
FIX = dict(pad=False, single=False, num_replicas=4)


def _at(*outcomes):
    return [o.at(p) for p, o in enumerate(outcomes)]


def test_every_process_has_data():
    d = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.data(SPEC)), **FIX)
    assert d == Decision(Action.DATA, spec=SPEC)


def test_every_process_ended_stops_without_a_warning():
    d = decide(_at(ReadOutcome.end(), ReadOutcome.end()), **FIX)
    assert d == Decision(Action.STOP)


def test_one_process_ends_early_stops_every_process_with_a_warning():
    d = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.end(), ReadOutcome.data(SPEC)), **FIX)
    assert d.action is Action.STOP
    assert d.warning == "the last step's input: process 1 ran out of input"


def test_a_partial_batch_stops_and_is_named():
    d = decide(_at(ReadOutcome.partial("replica 2 got 3 examples at root, the others 4"),
                   ReadOutcome.end()), **FIX)
    assert d.action is Action.STOP
    assert d.warning == ("the last step's input: process 0 had a partial batch (replica 2 "
                         "got 3 examples at root, the others 4); process 1 ran out of input")


def test_a_failed_read_is_raised_everywhere_the_lowest_process_first():
    boom = ReadOutcome.error(ValueError("corrupt record in shard 1"))
    other = ReadOutcome.error(KeyError("k"))
    d = decide(_at(ReadOutcome.end(), boom, other), **FIX)
    assert d.action is Action.RAISE and d.process == 1
    assert d.error_type is ValueError
    assert d.message == ("reading the input on process 1 failed, so every process stops: "
                         "ValueError: corrupt record in shard 1")
    e = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.data(SPEC), other), **FIX)
    assert type(e.error()) is RuntimeError and e.process == 2  # other classes: RuntimeError
    assert "KeyError: 'k'" in str(e.error())


def test_an_error_wins_over_an_end_and_a_spec_mismatch():
    t = ReadOutcome.error(TypeError("bad leaf"))
    d = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.data(OTHER), ReadOutcome.end(), t),
               **FIX)
    assert d.error_type is TypeError and d.process == 3


def test_mixed_specs_raise_a_listing_of_every_process():
    d = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.data(OTHER)), **FIX)
    assert d.action is Action.RAISE and d.error_type is ValueError and d.process is None
    assert ("the input elements differ across processes (process 0: float32[4, 3] in "
            "PyTreeDef({'x': *}); process 1: float32[5, 3] in PyTreeDef({'x': *}))") \
        in d.message
    assert "divisible by the number of replicas (4)" in d.message


def test_pad_pads_the_processes_that_ran_out_and_stops_when_all_did():
    pad = dict(FIX, pad=True)
    d = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.end(), ReadOutcome.end()), **pad)
    assert d == Decision(Action.DATA, spec=SPEC, pad=frozenset({1, 2}))
    assert decide(_at(ReadOutcome.end(), ReadOutcome.end()), **pad) == Decision(Action.STOP)


def test_single_mode_receivers_read_nothing():
    d = decide(_at(ReadOutcome.data(SPEC), ReadOutcome.data(None, seen=False)),
               **dict(FIX, single=True))
    assert d == Decision(Action.DATA, spec=SPEC)


def test_a_structure_only_its_reader_knows_cannot_be_rebuilt():
    opaque = dict(SPEC, tree={"opaque": "PyTreeDef(CustomNode(Foo[()], [*]))"})
    d = decide(_at(ReadOutcome.data(opaque), ReadOutcome.data(None, seen=False)),
               **dict(FIX, single=True))
    assert d.action is Action.RAISE and d.error_type is ValueError
    assert d.message.startswith("process(es) [1] must build input elements")
    assert d.message.endswith("or use InputReplicationMode.PER_WORKER.")
    d = decide(_at(ReadOutcome.data(opaque), ReadOutcome.end(seen=False)),
               **dict(FIX, pad=True))
    assert "or give every process's input at least one element." in d.message
    # A padded process that saw an element rebuilds the structure from its own.
    assert decide(_at(ReadOutcome.data(opaque), ReadOutcome.end(seen=True)),
                  **dict(FIX, pad=True)).action is Action.DATA


@pytest.mark.parametrize("outcomes", [
    [], [ReadOutcome.data(SPEC, process=1)],
    [ReadOutcome.data(SPEC), ReadOutcome.data(SPEC)],  # both process 0
    [ReadOutcome.data(None)],  # nothing read, nothing ended: no decision to take
])
def test_decide_refuses_outcomes_that_are_not_one_per_process(outcomes):
    with pytest.raises(ValueError, match="decide"):
        decide(outcomes, **FIX)


# -- any order of the same outcomes: the same decision ---------------------------------
_OUTCOMES = st.one_of(
    st.sampled_from([SPEC, OTHER, None]).map(ReadOutcome.data),
    st.booleans().map(lambda seen: ReadOutcome.end(seen=seen)),
    st.just(ReadOutcome.partial("replica 0 got 1 examples at root, the others 4")),
    st.sampled_from([ValueError("a"), TypeError("b"), OSError("c")]).map(ReadOutcome.error),
)


@settings(deadline=None, max_examples=50)
@given(st.lists(_OUTCOMES, min_size=1, max_size=4), st.booleans(), st.booleans(),
       st.randoms(use_true_random=False))
def test_every_order_of_the_outcomes_gives_the_same_decision(outcomes, pad, single, rnd):
    outcomes = _at(*outcomes)

    def decision(os):
        try:
            return decide(os, pad=pad, single=single, num_replicas=8)
        except ValueError as e:  # the same refusal, whatever the order
            return str(e)

    want = decision(outcomes)
    orders = list(itertools.permutations(outcomes))
    for order in rnd.sample(orders, min(len(orders), 6)):
        assert decision(list(order)) == want


# -- the wire --------------------------------------------------------------------------
@pytest.mark.parametrize("outcome", [
    ReadOutcome.data(SPEC), ReadOutcome.data(None, seen=False), ReadOutcome.end(seen=False),
    ReadOutcome.partial("replica 1 got 2 examples at ['x'], the others 4"),
    ReadOutcome.error(ValueError("corrupt record")),
])
def test_outcomes_round_trip_through_json(outcome):
    payload = json.loads(_wire.dumps(outcome.to_wire()))
    assert ReadOutcome.from_wire(payload) == outcome
    assert ReadOutcome.from_wire(payload, 3) == outcome.at(3)


def test_the_wire_format_is_the_input_report():
    """What processes exchanged before the protocol was typed: same fields, same check."""
    payload = ReadOutcome.error(TypeError("x"), seen=False).to_wire()
    assert _wire.input_report(payload) == {"status": "error", "detail": "TypeError: x",
                                           "error_type": "TypeError", "seen": False,
                                           "spec": None}


@pytest.mark.parametrize("payload, match", [
    (None, "an object with fields"),
    ([1, 2], "an object with fields"),
    ({"status": "ok"}, "must have the fields"),
    (dict(ReadOutcome.end().to_wire(), status="maybe"), "status must be one of"),
    (dict(ReadOutcome.end().to_wire(), seen="yes"), "seen must be true or false"),
    (dict(ReadOutcome.end().to_wire(), spec=SPEC), "element spec with status 'end'"),
    (dict(ReadOutcome.data(SPEC).to_wire(), spec={"tree": "*"}), "spec must have the fields"),
    (dict(ReadOutcome.end().to_wire(), extra=1), "must have the fields"),
])
def test_from_wire_rejects_malformed_messages_naming_the_field(payload, match):
    with pytest.raises(ValueError, match=match):
        ReadOutcome.from_wire(payload)


def test_from_wire_rejects_a_bad_process():
    with pytest.raises(ValueError, match="process must be an int >= 0"):
        ReadOutcome.from_wire(ReadOutcome.end().to_wire(), -1)

