"""What checkpoints saved in the background cost a training loop (one process).

An MLP 784-2048-2048-10 with Adam (70 MiB of parameters and optimizer state: each save
writes it all) trains with donation on 8 simulated CPU devices. Four loops of
``--block`` steps, interleaved over ``--rounds`` rounds so that background load hits
them alike, each block ending with ``wait_until_finished``:

* ``none``: no saves;
* ``async/100``, ``async/10``: ``CheckpointManager.save`` every 100 / 10 steps, in the
  background (the default);
* ``sync/100``: every 100 steps with ``enable_async_checkpointing=False``.

Reported: each loop's time per step and its ratio to ``none`` in the same round (median,
min and max over rounds); the time ``save()`` takes to return (device-to-host copies,
digests) against the time until the checkpoint is committed; the peak RSS increase during
a save (``VmHWM`` after writing ``5`` to ``/proc/self/clear_refs``) against the bytes
saved.

What a CPU cannot show: CPU "device" buffers are host memory and Orbax's host copy of
them is a zero-copy view, so ``save()`` returns almost at once and the RSS increase
understates the pinned host copies of a GPU or TPU; and the write competes with training
for the same cores, which overstates its cost on a machine whose accelerator computes
while the host writes.

Run: ``python bench/checkpoint_background.py [--quick] [--json PATH]``; ``--quick``: a
small model and short blocks, a smoke test. On a loaded 2-core CPU the 8-replica default
runs for over half an hour (each simulated device computes the step and holds the
state): ``--replicas 1 --global-batch 8 --rounds 3`` took about 10 minutes there.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

TX = optax.adam(1e-3)
LOOPS = {"none": (None, True), "async/100": (100, True), "async/10": (10, True),
         "sync/100": (100, False)}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (0 where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Loop:
    """Trains ``block`` steps per call, saving every ``every`` steps (None: never)."""

    def __init__(self, rep, step, batch, state, every, background, block):
        self.rep, self.step, self.batch = rep, step, batch
        self.state, self.every, self.block = state, every, block
        self.dir = tempfile.mkdtemp(prefix="ckpt_bench_")
        self.mngr = None if every is None else jr.CheckpointManager(
            self.dir, rep, max_to_keep=2, enable_async_checkpointing=background)
        self.n = 0

    def __call__(self):
        for _ in range(self.block):
            self.state = self.rep.run(self.step, self.batch, *self.state, donate_argnums=(0, 1))
            self.n += 1
            if self.mngr is not None and self.n % self.every == 0:
                self.mngr.save(self.n, self.state)
        if self.mngr is not None:
            self.mngr.wait_until_finished()
        return self.state

    def close(self):
        if self.mngr is not None:
            self.mngr.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--replicas", type=int, default=8,
                    help="devices of the MirroredStrategy (1: the step computes once)")
    _record.add_argument(ap)
    a = ap.parse_args(argv)
    sizes = (784, 256, 256, 10) if a.quick else (784, 2048, 2048, 10)
    rounds, block = (2, 20) if a.quick else (a.rounds, a.block)
    loops = ({"none": (None, True), "async/10": (10, True), "sync/10": (10, False)}
             if a.quick else LOOPS)
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:a.replicas]))
    n = rep.num_replicas
    rng = np.random.default_rng(0)

    def init():
        with rep.scope():
            params = [{"w": jax.numpy.asarray(rng.normal(size=(i, o)).astype(np.float32) * .05),
                       "b": jax.numpy.zeros(o)} for i, o in zip(sizes[:-1], sizes[1:])]
            return [params, TX.init(params)]
    sharded = NamedSharding(rep.mesh, P("replica"))
    gb = a.global_batch
    x = jax.device_put(rng.normal(size=(n, gb // n, sizes[0])).astype(np.float32), sharded)
    y = jax.device_put(rng.integers(0, 10, (n, gb // n)).astype(np.int32), sharded)
    batch = (jr.PerReplica(x, rep.mesh), jr.PerReplica(y, rep.mesh))
    step = _timing.classifier_step(TX, gb)
    state_bytes = sum(v.nbytes for v in jax.tree.leaves(init()))
    impls = {}
    made = {}
    for name, (every, background) in loops.items():
        made[name] = Loop(rep, step, batch, init(), every, background, block)
        impls[name] = (made[name], 1)
    times = _timing.interleaved(impls, rounds, warmup=1)

    # save() against the write, and the host memory a save takes, on a quiet loop
    probe = made[next(k for k in loops if k.startswith("async"))]
    returns, writes, rss = [], [], []
    for i in range(3):
        jax.block_until_ready(probe.state)
        reset = _reset_peak()
        before = _status("VmRSS")
        t0 = time.perf_counter()
        probe.mngr.save(10**6 + i, probe.state)
        t1 = time.perf_counter()
        probe.mngr.wait_until_finished()
        t2 = time.perf_counter()
        returns.append(t1 - t0)
        writes.append(t2 - t0)
        if reset:
            rss.append(_status("VmHWM") - before)
    for loop in made.values():
        loop.close()

    base = "none"
    rows = []
    print(f"MLP {'-'.join(map(str, sizes))} + Adam: {state_bytes / 2**20:.1f} MiB saved "
          f"per checkpoint; {n} replicas; blocks of {block} steps, {rounds} rounds")
    print(f"{'loop':10s} {'ms/step':>8s} {'ratio':>6s} {'min':>6s} {'max':>6s}")
    for name in loops:
        ratios = [t / b for t, b in zip(times[name], times[base])]
        ms = statistics.median(times[name]) / block * 1e3
        rows.append([name, ms, statistics.median(ratios), min(ratios), max(ratios)])
        print(f"{name:10s} {ms:8.2f} {rows[-1][2]:6.3f} {rows[-1][3]:6.3f} {rows[-1][4]:6.3f}")
    print(f"save() returned in {statistics.median(returns) * 1e3:.0f} ms (median of 3); "
          f"committed after {statistics.median(writes) * 1e3:.0f} ms")
    if rss:
        print(f"peak RSS increase during a save: {statistics.median(rss) / 2**20:.1f} MiB "
              f"(state saved: {state_bytes / 2**20:.1f} MiB)")
    _record.write(a.json, "checkpoint_background",
                  "Step time with checkpoints saved in the background, against no saves",
                  ["loop", "ms/step", "ratio to none", "min ratio", "max ratio"], rows,
                  model="MLP " + "-".join(map(str, sizes)) + " + adam",
                  state_mib=state_bytes / 2**20, replicas=n, block_steps=block,
                  rounds=rounds, global_batch=gb,
                  save_return_ms=statistics.median(returns) * 1e3,
                  save_commit_ms=statistics.median(writes) * 1e3,
                  peak_rss_increase_mib=statistics.median(rss) / 2**20 if rss else None,
                  load_average=os.getloadavg(), platform=jax.devices()[0].platform,
                  date=time.strftime("%Y-%m-%d %H:%M"))


if __name__ == "__main__":
    main()
