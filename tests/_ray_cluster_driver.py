"""The driver of tests/test_ps_ray_cluster.py: a process with ONE JAX device that joins a
two-node Ray cluster (``ray.init(address=...)``) and trains there. It writes what it saw
as JSON to ``$JR_OUT``; the test asserts on it.

Environment: ``JR_RAY_ADDRESS`` (the head's GCS), ``JR_HEAD_PID`` / ``JR_NODE_PID`` (the
``ray start --block`` processes of the two nodes: their process trees are the nodes),
``JR_OUT``.
"""

import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import ray

import jreplicate as jr
import jreplicate.testing as jrt
from tests._sockets import is_loopback, listening_sockets, process_tree

LR = 0.05
out: dict = {"devices": len(jax.local_devices())}


def _wait(cond, seconds, what):
    end = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} after {seconds} s")
        time.sleep(0.05)


def _node_of(actor) -> str:
    """The node an actor runs on, from the GCS (the dashboard's state API is off)."""
    info = ray._private.state.actors(actor._actor_id.hex())
    return info["Address"]["NodeID"]


def part_a_one_device_driver_matches_a_reference():
    """One worker of two replicas (the driver has one device) on the second node, the
    shard on the head: least squares by SGD equals numpy's, step by step."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(12, 4, 3)).astype(np.float32)  # 12 elements of 4 examples
    ys = rng.normal(size=(12, 4)).astype(np.float32)
    s = jr.ParameterServerStrategy(
        num_ps=1, num_workers=1, num_replicas_in_sync=2, carrier="ray",
        ray_worker_options={"resources": {"worker_node": 1}},
        ray_shard_options={"resources": {"ps_node": 1}})
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)

    def step(ctx, batch, w, opt):
        x, y = batch

        def loss(w):  # per replica; the group's gradients are summed: the global mean
            return 0.5 * jnp.sum((x @ w - y) ** 2) / (x.shape[0] * ctx.num_replicas)

        u, opt = tx.update(jax.grad(loss)(w), opt, w)
        return optax.apply_updates(w, u), opt

    it = rep.prepare_input(lambda ctx: list(zip(xs, ys)),
                           jr.InputReplicationMode.SINGLE)
    for _ in range(6):
        rep.run(step, it, w, opt)
    rep.join()
    ex = s._executor._carrier
    out["a_nodes"] = {"shard": _node_of(ex.shards[0]), "worker": _node_of(ex.workers[0])}
    ref = np.zeros(3, np.float32)
    for k in range(6):
        x, y = xs[2 * k:2 * k + 2].reshape(-1, 3), ys[2 * k:2 * k + 2].reshape(-1)
        ref = ref - LR * x.T @ (x @ ref - y) / len(y)
    out["a_params"], out["a_ref"] = s.parameters().tolist(), ref.tolist()
    s.shutdown()


def part_b_spread_crash_and_a_lost_node():
    """Two shards and worker 0 on the head, workers 1 and 2 on the second node; worker
    1's process crashes (Ray restarts it there), then the second node is lost: its
    steps are rescheduled on worker 0, and every step is applied exactly once."""
    s = jr.ParameterServerStrategy(
        num_ps=2, num_workers=3, num_replicas_in_sync=2, carrier="ray",
        ray_worker_options=lambda w: {"resources": {"head_worker" if w == 0 else
                                                    "worker_node": 1}},
        ray_shard_options={"resources": {"ps_node": 1}})
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(params)

    def step(ctx, p, opt):  # linear: every applied step adds -LR * [1, 2]
        g = jax.grad(lambda p: jnp.sum(p["a"]) + 2 * jnp.sum(p["b"]))(p)
        u, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, u), opt

    ex = s._executor._carrier
    out["b_nodes"] = {"shards": [_node_of(a) for a in ex.shards],
                      "workers": [_node_of(a) for a in ex.workers]}
    trees = [int(os.environ["JR_HEAD_PID"]), int(os.environ["JR_NODE_PID"]), os.getpid()]
    sockets = [x for pid in trees for x in listening_sockets(pid)]
    out["sockets"] = len(sockets)
    out["not_loopback"] = [f"{addr}:{port} {cmd[:60]}" for _, cmd, addr, port in sockets
                           if not is_loopback(addr)]
    for k in range(3):
        jrt.set_worker_delay(s, k, 0.05)
    scheduled = 0

    def run(n):
        nonlocal scheduled
        scheduled += n
        return [rep.run(step, None, params, opt) for _ in range(n)]

    run(12)
    _wait(lambda: s.stats()["completed_by"][1] >= 2, 60, "worker 1 ran no step")
    jrt.kill_worker(s, 1, when="crash")
    run(12)  # worker 1 takes some: the crash is seen (by a step in flight, or these)
    s._executor.coordinator.join(timeout=90)
    _wait(lambda: s.stats()["replaced"] >= 1, 60, "worker 1 was not replaced")
    after_crash = s.stats()["completed_by"][1]
    run(12)
    _wait(lambda: s.stats()["completed_by"][1] > after_crash, 60,
          "the replaced worker 1 ran no step")
    out["worker1_node_after_restart"] = _node_of(ex.workers[1])
    node = process_tree(int(os.environ["JR_NODE_PID"]))
    done2 = s.stats()["completed_by"][2]
    run(18)  # the node is lost while its workers run some of these
    _wait(lambda: s.stats()["completed_by"][2] > done2, 60, "worker 2 ran no step")
    out["rescheduled_before_node_loss"] = s.stats()["rescheduled"]
    t0 = time.monotonic()
    for pid in node:  # the second node is lost: its raylet, agents and workers
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    s._executor.coordinator.join(timeout=120)
    out["join_after_node_loss_s"] = time.monotonic() - t0
    st = s.stats()
    out["stats"] = {k: st[k] for k in ("scheduled", "completed", "completed_by",
                                       "rescheduled", "replaced")}
    out["scheduled"] = scheduled
    out["ledger"] = s.ledger()
    out["params"] = {k: np.asarray(v).tolist() for k, v in s.parameters().items()}
    s.shutdown()


if __name__ == "__main__":
    t0 = time.monotonic()
    ray.init(address=os.environ["JR_RAY_ADDRESS"], log_to_driver=False)
    _wait(lambda: sum(n["Alive"] for n in ray.nodes()) >= 2, 60, "the second node")
    out["nodes"] = {n["NodeID"]: sorted(k for k in n["Resources"] if not k.startswith(
        "node:")) for n in ray.nodes() if n["Alive"]}
    part_a_one_device_driver_matches_a_reference()
    out["a_s"] = time.monotonic() - t0
    part_b_spread_crash_and_a_lost_node()
    out["total_s"] = time.monotonic() - t0
    with open(os.environ["JR_OUT"], "w") as f:
        json.dump(out, f, default=str)
    ray.shutdown()
