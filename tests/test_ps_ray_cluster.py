"""ParameterServerStrategy on a Ray cluster of two nodes on this machine (issue 18 item
8): a head started with ``ray start --head`` (resources ``ps_node``, ``head_worker``)
and a second node joined with ``ray start --address`` (resource ``worker_node``), every
process on loopback only. A driver process with ONE JAX device joins with
``ray.init(address=...)`` (tests/_ray_cluster_driver.py) and checks:

* a worker of two replicas (devices of its actor, not the driver's) trains as numpy's
  SGD does, step by step;
* shards and workers are placed by the resources their options ask for;
* a worker whose process crashed is restarted by Ray and runs steps again;
* the second node lost (its processes killed): its steps are rescheduled on the head's
  worker, and every scheduled step is applied exactly once on every shard.

Skipped where Ray is not installed. Every wait is bounded; the nodes' process trees are
killed at the end whatever happens (never ``ray stop``, which stops every Ray instance
of the machine).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests._sockets import process_tree

pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc, kills process trees")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAY = os.path.join(os.path.dirname(sys.executable), "ray")
LR = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0",
               # Ray keeps 127.0.0.1 as this node's address (see tests/_ray_node.py).
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               # A lost node is declared dead after ~2 s, not Ray's default ~30 s.
               RAY_health_check_period_ms="500", RAY_health_check_failure_threshold="4",
               PYTHONPATH=ROOT, **extra)
    for k in ("RAY_ADDRESS", "XLA_FLAGS"):
        env.pop(k, None)
    return env


def _kill_tree(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    for pid in reversed(process_tree(proc.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _wait_port(port: int, proc: subprocess.Popen, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"the head's GCS did not listen on 127.0.0.1:{port} in {seconds} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray_cluster")
    # Ray's session (its sockets: AF_UNIX paths of at most 107 bytes) in a short path.
    ray_tmp = tempfile.mkdtemp(prefix="jr-ray-")
    port = _free_port()
    head = node = None
    logs = []
    try:
        logs.append(open(tmp / "head.log", "w"))
        head = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1",
             f"--port={port}", "--include-dashboard=false", "--num-cpus=1",
             "--resources=" + json.dumps({"ps_node": 2, "head_worker": 1}),
             f"--temp-dir={ray_tmp}", "--disable-usage-stats"],
            env=_env(), stdout=logs[-1], stderr=subprocess.STDOUT, start_new_session=True)
        _wait_port(port, head, 60)
        logs.append(open(tmp / "node.log", "w"))
        node = subprocess.Popen(
            [sys.executable, "-m", "tests._ray_node", "start", "--block",
             f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
             "--resources=" + json.dumps({"worker_node": 4}), "--disable-usage-stats"],
            cwd=ROOT, env=_env(), stdout=logs[-1], stderr=subprocess.STDOUT,
            start_new_session=True)
        yield {"address": f"127.0.0.1:{port}", "head": head, "node": node, "tmp": tmp}
    finally:
        _kill_tree(node)
        _kill_tree(head)
        for f in logs:
            f.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_training_on_a_two_node_ray_cluster(cluster):
    tmp = cluster["tmp"]
    t0 = time.monotonic()
    driver = subprocess.run(
        [sys.executable, "-m", "tests._ray_cluster_driver"], cwd=ROOT,
        env=_env(JR_RAY_ADDRESS=cluster["address"], JR_HEAD_PID=str(cluster["head"].pid),
                 JR_NODE_PID=str(cluster["node"].pid), JR_OUT=str(tmp / "out.json"),
                 JAX_PLATFORMS="cpu"),
        capture_output=True, text=True, timeout=150)
    took = time.monotonic() - t0
    assert driver.returncode == 0, driver.stderr[-4000:]
    with open(tmp / "out.json") as f:
        out = json.load(f)
    shown = {k: v for k, v in out.items() if k not in ("ledger", "params", "nodes")}
    print(f"\ndriver {took:.1f} s: {json.dumps(shown)}")
    nodes = out["nodes"]
    head_id = next(n for n, res in nodes.items() if "ps_node" in res)
    worker_id = next(n for n, res in nodes.items() if "worker_node" in res)
    assert out["devices"] == 1  # the driver's own: the workers' devices are theirs

    # The head's shard and the second node's worker of two replicas: numpy's SGD.
    assert out["a_nodes"] == {"shard": head_id, "worker": worker_id}
    np.testing.assert_allclose(out["a_params"], out["a_ref"], rtol=1e-5, atol=1e-6)

    # Placed by resources; every Ray process of both nodes and the driver on loopback.
    assert out["b_nodes"] == {"shards": [head_id, head_id],
                              "workers": [head_id, worker_id, worker_id]}
    assert out["sockets"] >= 6 and out["not_loopback"] == []

    # A crashed worker restarted on its node; the lost node's steps rescheduled.
    st, n = out["stats"], out["scheduled"]
    assert out["worker1_node_after_restart"] == worker_id
    assert st["replaced"] == 1 and st["completed"] == st["scheduled"] == n == 54
    assert st["rescheduled"] > out["rescheduled_before_node_loss"]  # the node's steps
    for led in out["ledger"]:  # each step applied exactly once on every shard
        assert led["applied"] == n and led["stale"] == led["backup"] == 0, led
        assert led["pushes"] == led["applied"] + led["duplicate"], led
    np.testing.assert_allclose(out["params"]["a"], np.full(3, -LR * n), rtol=1e-5)
    np.testing.assert_allclose(out["params"]["b"], np.full(2, -LR * 2 * n), rtol=1e-5)
