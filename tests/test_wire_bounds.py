"""Every number a message between processes carries is bounded (issue 28, item 8: the
class "wire").

An input report with a dimension of 2**60 passed the schema, and the process that
padded with it failed alone in ``np.zeros``. The schemas are walked, not listed: every
message the processes agree on (``jreplicate._wire.MESSAGES``) and the parameter
server's packed meta data (``jreplicate.ps.ray.wire.META``); for every numeric field found,
too large, negative, non-integer, bool, NaN and infinite values are each refused,
naming the sender and the field. A value within the limits that one process still
cannot build (no memory for its padding) is an error on every process.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from jreplicate import _jax_compat, _wire
from jreplicate.cluster.agreement import Agreement
from jreplicate.cluster.spec import MessageError
from jreplicate.ps.ray import wire as ps_wire
from tests.test_security import _FakeKV

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = {**_wire.MESSAGES, "the parameter server's packed meta data": ps_wire.META}


# -- walking a schema --------------------------------------------------------------------
def example(check):
    """A valid message of ``check``'s schema, reaching every field (an int dict key in
    each structure description)."""
    kind, *rest = check.schema
    if kind == "int":
        return rest[0]
    if kind in ("str", "bool", "dtype", "one_of"):
        return {"str": "s", "bool": True, "dtype": "float32"}.get(kind) or rest[0][0]
    if kind == "optional":
        return example(rest[0])
    if kind == "list":
        return [example(rest[0])]
    if kind == "sequence":
        return [example(c) for c in rest[0]]
    if kind == "record":
        return {k: example(c) for k, c in rest[0].items()}
    if kind == "structure":
        return {"dict": [[0, "*"]]}
    raise AssertionError(f"a checker of unknown kind {kind!r}: tag it (_wire._schema)")


def numeric_fields(check, path=(), where="the message"):
    """``(path into example(check), where the checker names it, lo, hi, kind)`` of
    every number the schema holds (kind "key": a dict key, which may be a string)."""
    kind, *rest = check.schema
    if kind == "int":
        yield path, where, rest[0], rest[1], "int"
    elif kind == "optional":
        yield from numeric_fields(rest[0], path, where)
    elif kind == "list":
        yield from numeric_fields(rest[0], path + (0,), f"{where}[0]")
    elif kind == "sequence":
        for i, c in enumerate(rest[0]):
            yield from numeric_fields(c, path + (i,), f"{where}[{i}]")
    elif kind == "record":
        for k, c in rest[0].items():
            yield from numeric_fields(c, path + (k,), f"{where}.{k}")
    elif kind == "structure":
        yield path + ("dict", 0, 0), f"{where}.dict[0]", -2**63, 2**63 - 1, "key"


def all_checkers(check):
    yield check
    kind, *rest = check.schema
    inner = {"optional": lambda: [rest[0]], "list": lambda: [rest[0]],
             "sequence": lambda: list(rest[0]), "record": lambda: list(rest[0].values())}
    for c in inner.get(kind, list)():
        yield from all_checkers(c)


def _set(message, path, value):
    out = copy.deepcopy(message)
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


FIELDS = [(name, *field) for name, check in SCHEMAS.items()
          for field in numeric_fields(check)]


def _bad_values(lo, hi, kind):
    bad = {"too large": hi + 1, "far too large": 2**64 + 7, "float": float(max(lo, 1)),
           "fraction": lo + 0.5, "bool": True, "NaN": math.nan, "infinity": math.inf,
           "-infinity": -math.inf}
    if lo == 0:
        bad["negative"] = -1
    else:
        bad["too small"] = lo - 1
    if kind != "key":  # a dict key may be a string
        bad["string"] = str(max(lo, 1))
    return bad


def test_the_walk_finds_the_fields_of_the_issue():
    wheres = {(name, where) for name, _, where, *_ in FIELDS}
    assert ("this step's input", "the message.spec.leaves[0][0][0]") in wheres  # a dim
    assert ("this step's input", "the message.spec.tree.dict[0]") in wheres  # an int key
    assert ("a checkpoint decision", "the message.value") in wheres  # a step
    assert len(FIELDS) >= 6, FIELDS


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_checker_is_tagged_and_every_int_bounded(name):
    """A field added with an untagged checker (no known bounds) fails here."""
    for check in all_checkers(SCHEMAS[name]):
        assert hasattr(check, "schema"), check
        if check.schema[0] == "int":
            lo, hi = check.schema[1:]
            assert -2**63 <= lo <= hi <= 2**63 - 1, check.schema
    SCHEMAS[name](example(SCHEMAS[name]), "the message")  # the example is valid


def _refusal(monkeypatch, name, message) -> str:
    """The error a process gets for ``message`` sent by process 2 (or worker 3)."""
    raw = json.dumps(message).encode()  # NaN and infinity as JSON's NaN/Infinity
    check = SCHEMAS[name]
    if check is ps_wire.META:
        with pytest.raises(ValueError) as e:
            ps_wire.decode(raw, "worker 3")
        assert "worker 3 sent a malformed message" in str(e.value)
        return str(e.value)
    mine = example(check)
    kv = _FakeKV({"p/0/0": json.dumps(mine).encode(), "p/0/2": raw})
    monkeypatch.setattr(_jax_compat, "distributed_client", lambda: kv)
    with pytest.raises(MessageError) as e:
        Agreement("p", num_processes=3, process_id=1, timeout=1).exchange(mine, name, check)
    assert f"process 2 sent a malformed message while agreeing on {name}" in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name, path, where, lo, hi, kind", FIELDS,
                         ids=[f"{f[0]}:{f[2]}" for f in FIELDS])
def test_every_numeric_field_refuses_impossible_values(monkeypatch, name, path, where,
                                                        lo, hi, kind):
    message = example(SCHEMAS[name])
    for label, bad in _bad_values(lo, hi, kind).items():
        error = _refusal(monkeypatch, name, _set(message, path, bad))
        assert where in error, (label, error)


# -- the direct regressions --------------------------------------------------------------
def _report(leaves):
    return {"status": "ok", "detail": "", "error_type": "", "seen": True,
            "spec": {"structure": "PyTreeDef({'x': *})", "tree": {"dict": [["x", "*"]]},
                     "leaves": leaves}}


def test_an_input_report_with_a_dimension_of_2_to_the_60_is_refused(monkeypatch):
    """Issue 28 item 8: it passed the schema."""
    with pytest.raises(ValueError, match=r"the message.spec.leaves\[0\]\[0\]\[1\] must be an "
                       r"int >= 0 and <= 2147483647, got 1152921504606846976"):
        _wire.input_report(_report([[[4, 2**60], "float32"]]))
    error = _refusal(monkeypatch, "this step's input", _report([[[4, 2**60], "float32"]]))
    assert "leaves[0][0][1]" in error


def test_the_bytes_of_an_element_are_bounded():
    ok = _wire.input_report(_report([[[2**20, 2**10], "float32"]]))  # 4 GiB
    assert ok["spec"]["leaves"][0][0] == [2**20, 2**10]
    with pytest.raises(ValueError, match=r"leaves\[0\] is float32\[1024, 1073741824\], over "
                       r"1099511627776 bytes"):
        _wire.input_report(_report([[[2**10, 2**30], "float32"]]))
    with pytest.raises(ValueError, match=r"leaves hold 5497558138880 bytes together, over "):
        _wire.input_report(_report([[[2**30, 2**8], "float32"]] * 5))
    with pytest.raises(ValueError, match=r"at most 64 entries"):
        _wire.input_report(_report([[[1] * 65, "float32"]]))


def test_packed_meta_must_lie_within_its_bytes():
    meta, chunks = ps_wire.pack({"w": np.arange(6, dtype=np.float32)})
    assert ps_wire.unpack(ps_wire.decode(ps_wire.encode(meta)), chunks)["w"].tolist() == \
        list(range(6))
    leaves, size = json.loads(ps_wire.encode(meta))
    for bad, match in [([[["w", "<f4", [9], 0]], size], r"ends at byte 36, past the 32"),
                       ([[["w", "<f4", [6], 16]], size], r"ends at byte 40, past the 32"),
                       ([[["w", "ml_dtypes:nope", [6], 0]], size], r"must be a dtype"),
                       ([[["w", "|O", [6], 0]], size], r"must be a dtype"),
                       ([leaves, 2**41], r"the message\[1\] must be an int >= 0 and <= ")]:
        with pytest.raises(ValueError, match=match):
            ps_wire.decode(json.dumps(bad).encode(), "worker 0")


def test_a_checkpoint_step_beyond_int64_is_refused_up_front(tmp_path):
    import jreplicate as jr
    with jr.CheckpointManager(tmp_path, jr.MirroredStrategy()) as mngr:
        with pytest.raises(ValueError, match=r"step=9223372036854775808.*at most "):
            mngr.save(2**63, {"w": np.zeros(2, np.float32)}, force=True)
        assert mngr.save(2**63 - 1, {"w": np.zeros(2, np.float32)}, force=True)


def test_every_exchange_uses_a_walked_schema():
    """Every agreement in the package exchanges one of the messages walked above."""
    calls = []
    for p in (ROOT / "jreplicate").rglob("*.py"):
        calls += re.findall(r"\.exchange\((?:[^()]|\([^()]*\))*\)", p.read_text())
    walked = list(_wire.MESSAGES.values())
    known = tuple(f"_wire.{name}" for name, value in vars(_wire).items()
                  if any(value is s for s in walked)) + ("ReadOutcome.from_wire",)
    assert "_wire.CHIEF_RESULT" in known and "_wire.CHECKPOINT_OUTCOME" in known
    assert calls and all(any(k in c for k in known) for c in calls), calls
    assert "_wire.input_report(payload)" in (ROOT / "jreplicate" / "input" /
                                             "protocol.py").read_text()


# -- within the limits, but one process cannot build it ----------------------------------
def test_padding_one_process_has_no_memory_for_is_an_error_on_every_process():
    """Process 1 pads from process 0's spec (256 MiB, within the limits) under an
    address-space limit: before, it failed alone with MemoryError (the launcher's
    fail-fast stopped process 0; without it, 0 waited in the step's collective)."""
    from tests.test_multi_worker_processes import _launch
    r = _launch(["--nproc", "2", "--devices-per-proc", "2",
                 str(ROOT / "tests" / "mp_scripts" / "pad_beyond_memory.py")], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for p in (0, 1):
        assert re.search(rf"RAISED {p} ValueError: process 1 could not build its input "
                         r"elements of this step .*MemoryError", r.stdout), r.stdout[-3000:]
