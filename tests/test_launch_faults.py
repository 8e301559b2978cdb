"""The launcher under faults, with real processes on 127.0.0.1 (every wait bounded).

* One worker's uncaught exception stops the whole group promptly under the default
  timeouts (it used to wait up to ``shutdown_timeout``, 300 s, in JAX's shutdown barrier),
  and the launcher names that process and its exception, not a peer that aborted after.
* Killing the launcher with SIGKILL takes the programs' own children with it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jreplicate.cluster.launch import tied_to_parent

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mp_scripts"
STOP_BOUND = 15  # seconds from the exception to the launcher's exit


def _env() -> dict[str, str]:
    """No JREPLICATE_* timeouts: the production defaults (300 s shutdown) apply."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JREPLICATE_", "JAX_", "XLA_")) and k != "TF_CONFIG"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _start_launcher(args: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jreplicate.cluster.launch", *args]
    return subprocess.Popen(tied_to_parent(cmd), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # its processes die with it (tied to it)
        out, err = p.communicate(timeout=30)
        pytest.fail(f"launcher still running after {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")


def test_one_workers_exception_stops_the_group_and_is_named():
    p = _start_launcher(["--timeout", "150", "--nproc", "2", "--devices-per-proc", "2",
                         str(SCRIPTS / "train.py"), "--steps", "60", "--fail-at", "5",
                         "--fail-how", "raise"])
    out, err = _finish(p, timeout=180)
    t_end = time.time()
    m = re.search(r"\[p1\] FAILING raise at step 5 t=([\d.]+)", out)
    assert m, out[-3000:] + err[-3000:]
    took = t_end - float(m.group(1))
    print(f"group stopped {took:.2f}s after process 1's exception (bound {STOP_BOUND}s)")
    assert p.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == ("jreplicate.cluster.launch: process 1 of 2 failed first: exit code 1; it "
                    "raised "
                    "ValueError: bad batch at step 5; stopped the other processes"), err[-3000:]
    assert took < STOP_BOUND, err[-3000:]
    assert "DONE" not in out


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody has reaped yet (it is dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_sigkilled_launcher_takes_grandchildren_with_it():
    p = _start_launcher(["--nproc", "2", str(SCRIPTS / "plain.py"), "grandchild"])
    grandchildren = {}
    try:
        deadline = time.monotonic() + 60
        while len(grandchildren) < 2 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            if m := re.search(r"GRANDCHILD (\d+) of rank=(\d)", line):
                grandchildren[int(m.group(2))] = int(m.group(1))
        assert len(grandchildren) == 2, p.stderr.read() if p.poll() is not None else ""
        assert not any(_gone(pid) for pid in grandchildren.values())
        p.kill()  # SIGKILL: the launcher can do nothing about it
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(map(_gone, grandchildren.values())):
            time.sleep(0.05)
        alive = [pid for pid in grandchildren.values() if not _gone(pid)]
        assert not alive, f"grandchildren {alive} outlived the SIGKILLed launcher"
    finally:
        for pid in grandchildren.values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)
