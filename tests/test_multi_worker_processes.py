"""MultiWorkerStrategy with real processes on 127.0.0.1.

Every wait is bounded: processes run with short heartbeat / collective / shutdown /
initialisation timeouts, every subprocess call has a timeout, and every process group is
killed at the end of its test. The scripts live in tests/mp_scripts/.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jreplicate.cluster.launch import child_env, free_port, tied_to_parent
from jreplicate.strategies.multi_worker import MultiWorkerStrategy
from tests.mp_scripts import train as train_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mp_scripts"
# Short timeouts for tests (production defaults are 300 / 100 / 300 / 600 s).
HEARTBEAT, COLLECTIVE, SHUTDOWN, INIT = 4, 8, 3, 60
TIMEOUT_ENV = {
    "JREPLICATE_HEARTBEAT_TIMEOUT": str(HEARTBEAT),
    "JREPLICATE_COLLECTIVE_TIMEOUT": str(COLLECTIVE),
    "JREPLICATE_SHUTDOWN_TIMEOUT": str(SHUTDOWN),
    "JREPLICATE_INITIALIZATION_TIMEOUT": str(INIT),
}
# A killed or stuck worker must bring the whole group down within this many seconds
# (measured: see bench/multi_worker.py's docstring and test_killed_worker...).
KILL_BOUND = HEARTBEAT + SHUTDOWN + 10
STUCK_BOUND = COLLECTIVE + HEARTBEAT + SHUTDOWN + 10


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JREPLICATE_", "JAX_", "XLA_")) and k != "TF_CONFIG"}
    env.update(TIMEOUT_ENV)
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _launch(args: list[str], timeout: float = 150, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
    """Runs ``python -m jreplicate.cluster.launch args`` (with ``env``, by default
    :func:`_base_env`'s), killing its whole group on timeout."""
    cmd = [sys.executable, "-m", "jreplicate.cluster.launch", "--timeout", str(timeout - 10), *args]
    p = subprocess.Popen(tied_to_parent(cmd), cwd=ROOT, env=env or _base_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()  # the launcher stops its processes on SIGTERM...
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()  # ...and they die with it (tied_to_parent) if it is killed
            out, err = p.communicate()
        pytest.fail(f"launcher did not finish in {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class _Group:
    """Processes started directly (no launcher), so that nothing but the JAX runtime
    and jreplicate stops them; their output goes to files."""

    def __init__(self, tmp: Path, script: str, args: list[str], devices: list[int],
                 nproc: int | None = None, coordinator: str | None = None,
                 ranks: list[int] | None = None, env: dict[str, str] | None = None,
                 tf_config: bool = False):
        coordinator = coordinator or f"127.0.0.1:{free_port()}"
        nproc = nproc or len(devices)
        ranks = list(range(len(devices))) if ranks is None else ranks
        self.procs, self.logs = [], []
        for rank, k in zip(ranks, devices, strict=True):
            e = child_env(_base_env(**(env or {})), coordinator=coordinator, nproc=nproc,
                          rank=rank, devices_per_proc=k, restart=0)
            if tf_config:  # the cluster from TF_CONFIG instead of JREPLICATE_*
                for key in ("JREPLICATE_COORDINATOR", "JREPLICATE_NUM_PROCESSES",
                            "JREPLICATE_PROCESS_ID"):
                    del e[key]
                e["TF_CONFIG"] = json.dumps({
                    "cluster": {"worker": [coordinator] + [f"127.0.0.1:{free_port()}"
                                                           for _ in range(nproc - 1)]},
                    "task": {"type": "worker", "index": rank}})
            out = open(tmp / f"p{rank}-{free_port()}.out", "w+")
            err = open(tmp / f"p{rank}-{free_port()}.err", "w+")
            self.logs.append((out, err))
            self.procs.append(subprocess.Popen(
                tied_to_parent([sys.executable, "-u", str(SCRIPTS / script), *args]),
                cwd=ROOT, env=e, stdout=out, stderr=err, start_new_session=True))

    def wait(self, timeout: float) -> list[float]:
        """Waits for every process; returns their exit times (time.time())."""
        deadline = time.monotonic() + timeout
        ended = [None] * len(self.procs)
        while None in ended and time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
        if None in ended:
            self.kill()
            pytest.fail(f"processes {[i for i, e in enumerate(ended) if e is None]} did not "
                        f"exit within {timeout}s:\n" + self.output())
        return ended

    def returncodes(self) -> list[int]:
        return [p.returncode for p in self.procs]

    def text(self, rank: int) -> tuple[str, str]:
        out, err = self.logs[rank]
        out.flush(), err.flush()
        return (Path(out.name).read_text(), Path(err.name).read_text())

    def output(self) -> str:
        return "\n".join(f"--- p{r} stdout:\n{o[-2000:]}\n--- p{r} stderr:\n{e[-3000:]}"
                         for r in range(len(self.procs)) for o, e in [self.text(r)])

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=10)
        for out, err in self.logs:
            out.close(), err.close()


@pytest.fixture
def group(tmp_path):
    groups = []

    def start(*args, **kwargs):
        g = _Group(tmp_path, *args, **kwargs)
        groups.append(g)
        return g

    yield start
    for g in groups:
        g.kill()


def _load(path: Path) -> tuple[list[np.ndarray], np.ndarray]:
    with np.load(path) as z:
        n = len([k for k in z.files if k.startswith("arr_")])
        return [z[f"arr_{i}"] for i in range(n)], z["losses"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2 processes x 4 devices, 20 steps, every input mode, checkpointing PER_WORKER.

    The checkpoint directory starts with debris of an interrupted save (an Orbax
    temporary directory and a step directory without its commit marker): it must
    never be restored.
    """
    out = tmp_path_factory.mktemp("uninterrupted")
    ckpt = out / "ckpt"
    (ckpt / "19.orbax-checkpoint-tmp-1234").mkdir(parents=True)
    (ckpt / "18").mkdir()
    (ckpt / "18" / "junk").write_text("half written")
    r = _launch(["--nproc", "2", "--devices-per-proc", "4", str(SCRIPTS / "train.py"),
                 "--out", str(out), "--modes", "per_worker,per_replica,single,loop",
                 "--ckpt", str(ckpt), "--save-every", "5"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return out, r


def test_two_processes_match_one_process_of_eight_devices(uninterrupted):
    out, r = uninterrupted
    # Both processes started from scratch: the debris was not taken for a checkpoint.
    assert r.stdout.count("START per_worker at step 0 (restart 0)") == 2
    assert "[p0] LOCAL per_worker replicas=[0, 1, 2, 3] n_local=4" in r.stdout
    assert "[p1] LOCAL per_worker replicas=[4, 5, 6, 7] n_local=4" in r.stdout
    assert sorted(p.name for p in (out / "ckpt").iterdir() if p.name.isdigit()) == ["15", "20"]
    # The same training code, 1 process x 8 devices (this pytest process).
    assert jax.device_count() == 8
    args = train_script.parse_args(["--modes", "per_worker,per_replica,single,loop"])
    ref = train_script.train(MultiWorkerStrategy(num_processes=1), args)
    # Device loops across processes (3 steps a call, a 2-step tail) train alike too.
    for mode in ("per_worker", "per_replica", "single", "loop"):
        leaves, losses = _load(out / f"{mode}.npz")
        ref_leaves, ref_losses = ref[mode]
        assert len(losses) == 20
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-7)
        for a, b in zip(leaves, ref_leaves, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=mode)


def test_restart_resumes_from_checkpoint_bit_for_bit(uninterrupted, tmp_path):
    ref_out, _ = uninterrupted
    ckpt = tmp_path / "ckpt"
    # The chief is SIGKILLed before step 12 (after checkpoint 10) in the first attempt.
    r = _launch(["--nproc", "2", "--devices-per-proc", "4", "--max-restarts", "2",
                 "--grace", "2", str(SCRIPTS / "train.py"), "--out", str(tmp_path),
                 "--ckpt", str(ckpt), "--save-every", "5", "--fail-at", "12",
                 "--fail-process", "0", "--fail-how", "kill"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert re.search(r"process 0 of 2 failed first: killed by signal 9 \(SIGKILL\)", r.stderr)
    assert "restarting all 2 processes (restart 1 of 2)" in r.stderr
    assert "succeeded after 1 restart(s)" in r.stderr
    # Checkpoint 10 is written in the background: under load its write may still be in
    # flight when the chief is killed, and is then lost; both resume from 5 instead.
    starts = dict(re.findall(r"\[p(\d)\] START per_worker at step (\d+) \(restart 1\)",
                             r.stdout))
    assert set(starts) == {"0", "1"} and len(set(starts.values())) == 1, r.stdout[-3000:]
    start = int(starts["0"])
    assert start in (5, 10), r.stdout[-3000:]
    leaves, losses = _load(tmp_path / "per_worker.npz")
    ref_leaves, ref_losses = _load(ref_out / "per_worker.npz")
    np.testing.assert_array_equal(losses, ref_losses[start:])
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit


def test_killed_worker_stops_the_others_within_bound(group, tmp_path):
    g = group("train.py", ["--steps", "60", "--fail-at", "5", "--fail-how", "kill"], [2, 2])
    ended = g.wait(timeout=90)
    out1, _ = g.text(1)
    out0, err0 = g.text(0)
    assert g.returncodes()[1] == -signal.SIGKILL, g.output()
    assert g.returncodes()[0] != 0, g.output()
    t_fail = float(re.search(r"FAILING kill at step 5 t=([\d.]+)", out1).group(1))
    detect = ended[0] - t_fail
    print(f"survivor exited {detect:.2f}s after the kill (bound {KILL_BOUND}s)")
    assert detect < KILL_BOUND, g.output()
    assert "DONE" not in out0
    assert re.search(r"Connection closed by peer|heartbeat|unhealthy|did not arrive", err0), err0
    assert "jreplicate: process 0 of 2 stopped because a collective across processes failed" \
        in err0 or "Terminating process because the JAX distributed service detected" in err0


def test_stuck_worker_is_detected_by_collective_timeout(group, tmp_path):
    g = group("train.py", ["--steps", "60", "--fail-at", "5", "--fail-how", "hang"], [2, 2])
    ended = g.wait(timeout=120)
    out1, _ = g.text(1)
    out0, err0 = g.text(0)
    t_fail = float(re.search(r"FAILING hang at step 5 t=([\d.]+)", out1).group(1))
    assert all(rc != 0 for rc in g.returncodes()), g.output()
    detect = max(ended) - t_fail
    print(f"both processes exited {detect:.2f}s after the hang began (bound {STUCK_BOUND}s)")
    assert COLLECTIVE - 1 < ended[0] - t_fail, "detected before the collective timeout?"
    assert detect < STUCK_BOUND, g.output()
    assert f"Timed out waiting {COLLECTIVE * 1000}ms" in err0, err0
    assert "stopped because a collective across processes failed" in err0


def test_validation_is_identical_on_every_process(tmp_path):
    r = _launch(["--nproc", "2", "--devices-per-proc", "2", str(SCRIPTS / "errors.py")],
                env=_base_env(ERRORS_RESULTS=str(tmp_path)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert r.stdout.count("CLUSTER arguments") == 2
    results = {}  # from the files: a C++ log line in stdout cannot cut them
    for rank in (0, 1):
        text = (tmp_path / f"p{rank}.txt").read_text()
        for name, kind, msg in re.findall(r"^RESULT (\w+) (\w+) ?(.*)$", text, re.M):
            results.setdefault(name, {})[rank] = (kind, msg)
    assert set(results) == {"batch_differs", "input_error", "shorter", "indivisible",
                            "single_shape", "save_per_replica", "arg_bits", "arg_differs",
                            "short_mid_stream", "short_final"}
    for name, by_rank in results.items():
        assert set(by_rank) == {0, 1}, name
        assert by_rank[0][0] == by_rank[1][0], (name, by_rank)  # same outcome everywhere
    assert results["batch_differs"][0] == results["batch_differs"][1]
    assert results["batch_differs"][0][0] == "ValueError"
    assert "process 0: float32[4, 2]; process 1: float32[5, 2]" in results["batch_differs"][0][1]
    assert results["input_error"][0] == (
        "ValueError", "reading the input on process 1 failed, so every process stops: "
        "ValueError: corrupt record in shard 1")
    assert results["input_error"][1] == ("ValueError", "corrupt record in shard 1")
    assert results["shorter"][0] == results["shorter"][1] == ("ok", "2")
    # A shorter element that more elements follow, on one process: the same error on
    # every process; a final one (process 1's) ends the input everywhere, dropped.
    assert results["short_mid_stream"][1][0] == "ValueError"
    assert results["short_mid_stream"][1][1].startswith(
        "input element of replica 3 (input pipeline 1), read for step 2 of this sweep")
    assert results["short_mid_stream"][0] == (
        "ValueError", "reading the input on process 1 failed, so every process stops: "
        "ValueError: " + results["short_mid_stream"][1][1])
    assert results["short_final"][0] == results["short_final"][1] == ("ok", "2")
    assert results["indivisible"][0][0] == "ValueError"
    assert "not divisible by the 4 replicas" in results["indivisible"][0][1]
    assert results["single_shape"][0][0] == "ValueError"
    assert "on process 0 failed" in results["single_shape"][1][1]
    # A replicated NumPy argument holding NaN and -0.0 (jax.device_put compares copies
    # with ==: NaN failed as "not the same on each process"), and a 0-d one, placed as is.
    assert results["arg_bits"][0] == results["arg_bits"][1] == ("ok", "True/True/()")
    # Copies that do differ: the same ValueError on every process, naming the argument.
    assert results["arg_differs"][0][0] == results["arg_differs"][1][0] == "ValueError"
    assert "argument [0] differs between the processes" in results["arg_differs"][0][1]
    assert results["save_per_replica"][0] == results["save_per_replica"][1]
    assert "PerReplica" in results["save_per_replica"][0][1]


def test_mismatched_device_counts_fail_on_every_process(group):
    # The cluster comes from TF_CONFIG here (worker 0's address is the coordinator).
    g = group("train.py", ["--steps", "2"], [4, 2], tf_config=True)
    g.wait(timeout=60)
    assert g.returncodes() == [1, 1], g.output()
    for rank in (0, 1):
        err = g.text(rank)[1]
        assert ("MultiWorkerStrategy needs the same number of devices on every process, got "
                "process 0: 4, process 1: 2") in err, err
        assert "--devices-per-proc" in err
        assert "ValueError" in err


def test_unreachable_coordinator_fails_within_init_timeout(group):
    init = 3
    env = {"JREPLICATE_INITIALIZATION_TIMEOUT": str(init)}
    port = free_port()
    t0 = time.time()
    # Process 1 of 2, nobody listening at the coordinator's address.
    worker = group("train.py", [], [2], nproc=2, ranks=[1], env=env,
                   coordinator=f"127.0.0.1:{port}")
    # Process 0 of 2 (the coordinator), whose peer never comes.
    chief = group("train.py", [], [2], nproc=2, ranks=[0], env=env)
    (t_worker,), (t_chief,) = worker.wait(timeout=60), chief.wait(timeout=60)
    assert worker.returncodes() == [1], worker.output()
    err = worker.text(0)[1]
    assert "ClusterError" in err
    assert (f"process 1 of 2 could not reach the coordinator at 127.0.0.1:{port} within "
            f"initialization_timeout={init}s") in err, err
    assert chief.returncodes() == [75], chief.output()
    err = chief.text(0)[1]
    assert "the coordinator (process 0 of 2) could not join the cluster" in err, err
    assert "Not all processes connected" in err
    # Start-up (importing JAX) takes a few seconds on a loaded machine.
    assert max(t_worker, t_chief) - t0 < init + 20
