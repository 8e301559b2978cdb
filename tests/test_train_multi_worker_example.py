"""examples/train_multi_worker.py (the README's launcher example) runs under the launcher.

Two processes x 2 simulated CPU devices on 127.0.0.1, with a failure on purpose at step
13 and one group restart: the group resumes from the checkpoint of step 10 and finishes.
Every wait is bounded: short JREPLICATE_*_TIMEOUT values, the launcher's --timeout, a
subprocess timeout, and the whole process group killed if that expires.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._optional import needs

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_multi_worker.py"
TIMEOUTS = {"JREPLICATE_HEARTBEAT_TIMEOUT": "4", "JREPLICATE_COLLECTIVE_TIMEOUT": "8",
            "JREPLICATE_SHUTDOWN_TIMEOUT": "3", "JREPLICATE_INITIALIZATION_TIMEOUT": "60"}


@needs("sklearn")
def test_train_multi_worker_example_under_the_launcher_resumes_after_a_failure(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JREPLICATE_", "JAX_", "XLA_")) and k != "TF_CONFIG"}
    env.update(TIMEOUTS, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "jreplicate.cluster.launch", "--nproc", "2", "--devices-per-proc",
           "2", "--max-restarts", "1", "--timeout", "170", str(EXAMPLE), "--steps", "30",
           "--save-every", "5", "--log-every", "10", "--fail-at", "13",
           "--ckpt", str(tmp_path / "ckpt")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=200)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the launcher did not finish in 200 s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, (out[-3000:], err[-3000:])
    # Checkpoints are written in the background: step 10's write may still be in flight
    # when process 1 crashes at step 13 (under load); it is then lost, and the group
    # resumes from step 5, the latest committed one. Every process resumes from one step.
    resumed = re.findall(r"\[p(\d)\] process \d/2 \(attempt 1\): 2 of 4 replicas; resuming "
                         r"from checkpoint at step (\d+)", out)
    assert sorted(p for p, _ in resumed) == ["0", "1"], out
    assert len({s for _, s in resumed}) == 1 and resumed[0][1] in ("5", "10"), out
    for p in (0, 1):
        assert f"[p{p}] process {p}/2 (attempt 0): 2 of 4 replicas; starting at step 0" in out
    assert "[p1] process 1: failing on purpose at step 13" in out
    assert "[p0] step 30/30  loss" in out and "[p0] done: step 30, held-out accuracy" in out
    assert "process 1 of 2 failed first: exit code 3" in err, err[-3000:]
    assert "succeeded after 1 restart" in err, err[-3000:]
    kept = set(os.listdir(tmp_path / "ckpt"))
    assert {"25", "30"} <= kept and not {"5", "10", "15", "20"} & kept  # max_to_keep=2
