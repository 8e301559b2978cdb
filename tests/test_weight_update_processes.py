"""Weight-update sharding across 2 processes x 4 CPU devices on 127.0.0.1.

``tests/mp_scripts/weight_update.py`` trains with MultiWorkerStrategy at both levels (adam
on a plain pytree, single steps and a device loop; ``nnx.Optimizer`` with adamw), each
process computing the one-device reference itself and comparing the shards it holds; the
optimizer state must be sharded across the processes. Every wait is bounded (the
launcher's timeout, short runtime timeouts); exit codes and stderr are checked.
"""

from __future__ import annotations

from tests.test_multi_worker_processes import SCRIPTS, _launch


def test_both_levels_across_two_processes_equal_one_device():
    r = _launch(["--nproc", "2", "--devices-per-proc", "4",
                 str(SCRIPTS / "weight_update.py")], timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for level in ("optimizer", "parameters"):
        for check in ("adam params", "adam state", "adam layout", "nnx params",
                      "nnx optimizer", "nnx layout"):
            for p in (0, 1):
                assert f"[p{p}] OK {level} {check}" in r.stdout, (level, check, p, r.stdout)
    assert r.stdout.count("DONE") == 2
    assert "Traceback" not in r.stderr and "Error" not in r.stderr, r.stderr[-5000:]
