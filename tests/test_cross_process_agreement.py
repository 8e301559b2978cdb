"""Cross-process agreement: whatever kind of value each process passes (NumPy, a
``jax.Array``, Python numbers, custom pytree nodes, NamedTuples, another structure,
shape or dtype, a change at ``reinitialize()``), every process either runs the call
alike or raises the same error, stays in step with the others, and exits on time.

Each test launches one 2-process job (``python -m jreplicate.cluster.launch``, 2 CPU
devices each) with bounded waits and checks exit codes and output; the scripts are in
tests/mp_scripts/agreement.py and tests/mp_scripts/agreement_matrix.py.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from jreplicate.execution import agreed
from tests.mp_scripts import agreement_matrix as matrix
from tests.test_multi_worker_processes import _base_env
from tests.test_multi_worker_processes import _launch as launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mp_scripts"


def _launch(script: str, args: list[str], timeout: float, collective: float = 8
            ) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``script`` on 2 processes (2 CPU devices each); returns the launcher's result
    and when it ended (``time.time()``). The group is killed if it outlives ``timeout``."""
    env = _base_env(JREPLICATE_HEARTBEAT_TIMEOUT="4", JREPLICATE_SHUTDOWN_TIMEOUT="3",
                    JREPLICATE_INITIALIZATION_TIMEOUT="60",
                    JREPLICATE_COLLECTIVE_TIMEOUT=str(collective))
    r = launch(["--nproc", "2", "--devices-per-proc", "2", str(SCRIPTS / script), *args],
               timeout=timeout, env=env)
    return r, time.time()


def _results(stdout: str) -> dict[str, dict[int, tuple[str, str]]]:
    out: dict[str, dict[int, tuple[str, str]]] = {}
    for rank, name, kind, msg in re.findall(r"\[p(\d)\] RESULT (\w+) (\w+) ?(.*)", stdout):
        out.setdefault(name, {})[int(rank)] = (kind, msg)
    return out


# -- the decision, on one process ----------------------------------------------------------
def _msg(leaves, refused=(), tree="(*,) #1"):
    return agreed.message(tree, leaves, list(refused))


def test_decide_is_one_answer_from_every_process_messages():
    a, f32 = np.arange(3, dtype=np.float32), np.float32(2)
    host = agreed.host_leaf(a, lambda: "x")[1]
    assert host == agreed.host_leaf(a.astype(np.float64), lambda: "x")[1]  # canonical
    other = agreed.host_leaf(a + 1, lambda: "x")[1]
    name = {0: "argument [0]", 1: "argument [1]"}.get
    assert agreed.decide([_msg([host]), _msg([host])], [], name, "run") == []
    same = [TypeError("run: argument [0] is a str")]
    assert agreed.decide([_msg(["refused"], same)] * 2, same, name, "run") == same
    (e,) = agreed.decide([_msg(["refused"], same), _msg([host])], same, name, "run")
    assert type(e) is TypeError and "refused on some processes only" in str(e)
    assert "process 0: argument [0] is a str | process 1: accepted" in str(e)
    (e,) = agreed.decide([_msg([host]), _msg([host, host], tree="((*, *),) #2")], [],
                         name, "run")
    assert "another structure on some processes" in str(e) and "(2 leaves)" in str(e)
    errors = agreed.decide([_msg([host, host]), _msg([other, agreed.host_leaf(
        f32, lambda: "x")[1]])], [], name, "run")
    assert [str(e).split(" (")[0] for e in errors] == [
        "run: argument [0] differs between the processes",
        "run: argument [1] differs between the processes"]
    assert "(float32[3] everywhere, other values on process(es) [1]" in str(errors[0])
    assert "(process 0: host value float32[3]; process 1: host value float32[])" \
        in str(errors[1])


# -- direct regressions ------------------------------------------------------------------
def test_exit_after_agreed_input_error_is_prompt():
    # Issue 28 item 3: both processes raised the same ValueError and reached the end of
    # the script; one then waited, tearing down its JAX client, in the collective of a
    # step its peer had dispatched but left without running (until collective_timeout:
    # 600 s by default; 60 s here). Both must exit at once.
    r, ended = _launch("agreement.py", ["--case", "exit_after_error"], timeout=150,
                       collective=60)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    got = _results(r.stdout)
    assert got["sweep0"] == {0: ("ok", "2"), 1: ("ok", "2")}, got
    assert got["sweep1"][0][0] == got["sweep1"][1][0] == "ValueError", got
    assert "changed structure since the first step" in got["sweep1"][0][1]
    assert got["sweep1"][1][1].startswith("reading the input on process 0 failed")
    ends = [float(t) for t in re.findall(r"\] END ([\d.]+)", r.stdout)]
    assert len(ends) == 2, r.stdout[-3000:]
    print(f"the launcher ended {ended - max(ends):.1f}s after the scripts' last line")
    assert ended - max(ends) < 30, r.stderr[-3000:]  # a hang lasts collective_timeout


def test_numpy_on_one_process_jax_array_on_another():
    # Issue 28 item 4: gloo "collective mismatch", SIGABRT.
    r, _ = _launch("agreement.py", ["--case", "numpy_vs_jax"], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert "collective mismatch" not in r.stderr
    got = _results(r.stdout)
    want = ("ok", str((4 * 2.0 * (np.arange(3) + 1)).tolist()))
    for name in ("uncommitted", "committed", "committed_both", "after"):
        assert got[name] == {0: want, 1: want}, (name, got[name])
    assert got["differ"][0] == got["differ"][1], got["differ"]  # one agreed message
    assert got["differ"][0][0] == "ValueError"
    assert ("argument [0] differs between the processes (float32[3] everywhere, other "
            "values on process(es) [1] than on process 0)") in got["differ"][0][1]
    assert got["replicate"] == {0: ("ok", "[1.0, 2.0, 3.0]"), 1: ("ok", "[1.0, 2.0, 3.0]")}
    assert got["replicate_differ"][0] == got["replicate_differ"][1], got["replicate_differ"]
    assert got["replicate_differ"][0][0] == "ValueError"
    assert "state ['w'] differs between the processes" in got["replicate_differ"][0][1]
    # A Python number keeps its weak type across processes (it was placed float32, so
    # a bfloat16 step computed in float32 under MultiWorker and bfloat16 under Mirrored).
    for name in ("weak_float", "weak_int"):
        assert got[name] == {0: ("ok", "bfloat16"), 1: ("ok", "bfloat16")}, got[name]


# -- the class: a generated matrix of per-process kinds ------------------------------------
@pytest.fixture(scope="module")
def matrix_run():
    t0 = time.time()
    r, _ = _launch("agreement_matrix.py", [], timeout=240)
    print(f"matrix job: {time.time() - t0:.1f}s")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    cells: dict[str, dict[int, tuple[str, str]]] = {}
    for rank, cell, status, detail in re.findall(r"\[p(\d)\] CELL (\S+) (\S+) ?(.*)",
                                                 r.stdout):
        cells.setdefault(cell, {})[int(rank)] = (status, detail)
    return cells, r


def test_matrix_covers_every_cell(matrix_run):
    cells, r = matrix_run
    want = {c.name for c in matrix.arg_cells()} | {c.name for c in matrix.input_cells()}
    assert set(cells) == want, sorted(want - set(cells))[:10]
    for name, by_rank in cells.items():
        assert set(by_rank) == {0, 1}, name
    # Every cell ended in step: the sync step after it ran, on both processes.
    assert r.stdout.count("SYNC ok") == 2 * len(want)


def test_matrix_arguments_run_alike_or_fail_alike(matrix_run):
    cells, _ = matrix_run
    for cell in matrix.arg_cells():
        got = cells[cell.name]
        assert got[0] == got[1], (cell.name, got)  # agreed: one outcome, one message
        status, detail = got[0]
        expected = matrix.expected_arg_outcome(cell)
        if expected is None:  # the processes' values differ, or one is refused
            assert status in ("ValueError", "TypeError", "LeafErrors"), (cell.name, got)
            assert "argument [0]" in detail or "arguments" in detail, (cell.name, detail)
        else:
            assert status == "ok", (cell.name, got)
            assert detail == expected, (cell.name, detail, expected)


def test_matrix_inputs_run_alike_or_fail_alike(matrix_run):
    cells, _ = matrix_run
    for cell in matrix.input_cells():
        (s0, d0), (s1, d1) = cells[cell.name][0], cells[cell.name][1]
        assert s0 == s1, (cell.name, cells[cell.name])
        if s0 == "ok":
            assert d0 == d1 == matrix.expected_input_outcome(cell), (cell.name, d0, d1)
        else:
            # The process whose read failed raises its own error; the others say so.
            assert d0 == d1 or d0 in d1 or d1 in d0, (cell.name, d0, d1)
            assert matrix.expected_input_outcome(cell) is None, (cell.name, d0)
