"""Step time of 2 processes x 4 devices over 1 process x 8 devices (MultiWorkerStrategy).

The model and step are those of ``bench/overhead.py``: an MLP 784-1024-1024-10,
softmax cross-entropy, SGD with momentum 0.9, global batch 256 (32 per replica). Both
configurations run the same program through ``Replicator(MultiWorkerStrategy()).run``,
started by ``python -m jreplicate.cluster.launch``:

* ``1x8``: ``--nproc 1 --devices-per-proc 8`` (no cross-process traffic);
* ``2x4``: ``--nproc 2 --devices-per-proc 4`` (gradients all-reduced across processes by
  gloo over loopback TCP).

Each run is timed three ways: ``step`` with a batch assembled once (the compiled step
alone); ``step+input`` with ``run(step, iterator, ...)`` reading a PER_WORKER batch every
step on the main thread (which adds the per-step cross-process agreement on the input,
a synchronisation point between the processes' hosts); ``step+prefetch``, the same with
``prepare_input(..., prefetch_on_device=True)``, which moves reading and agreement to a
background thread so they overlap the running step. Within a run
the median over ``--rounds`` rounds of ``--steps`` steps is taken (``block_until_ready``
at the end of each round); runs of the two configurations are interleaved ``--repeats``
times and the table reports the median over runs, and the ratio 2x4 / 1x8.

Each run also records its chief's first losses (before its timed rounds); the table is
printed only if those of the two configurations agree (max relative difference 1e-5).

Run: ``python bench/multi_worker.py`` (about 2-3 minutes on a 2-core CPU) or ``--quick``.
On a machine with few cores the two processes share those cores, so the ratio measures
the cost of the distributed runtime plus oversubscription, not of a network.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SIZES = (784, 1024, 1024, 10)
GLOBAL_BATCH = 256
LR, MOMENTUM = 0.05, 0.9
CHECK_STEPS = 3
TIMINGS = ("step", "step+input", "step+prefetch")


def worker(args: argparse.Namespace) -> None:
    """One process of a configuration; the chief prints a ``RESULT {json}`` line."""
    sys.path.insert(0, ROOT)
    from jreplicate.strategies.multi_worker import MultiWorkerStrategy

    strategy = MultiWorkerStrategy()  # from jreplicate.cluster.launch's environment

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from jreplicate.losses import compute_average_loss
    from jreplicate.replicator import Replicator

    rep = Replicator(strategy)
    tx = optax.sgd(LR, momentum=MOMENTUM)

    def init():
        params = []
        for i, (a, b) in enumerate(zip(SIZES[:-1], SIZES[1:])):
            k = jax.random.fold_in(jax.random.key(0), i)
            params.append({"w": jax.random.normal(k, (a, b)) / np.sqrt(a),
                           "b": jnp.zeros(b)})
        return params, tx.init(params)

    def step(ctx, batch, params, opt):
        x, y = batch

        def loss_fn(p):
            h = x
            for layer in p[:-1]:
                h = jax.nn.relu(h @ layer["w"] + layer["b"])
            logits = h @ p[-1]["w"] + p[-1]["b"]
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return compute_average_loss(per_example, GLOBAL_BATCH)

        loss, g = jax.value_and_grad(loss_fn)(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, ctx.all_sum(loss)

    rng = np.random.default_rng(0)
    data_x = rng.normal(size=(GLOBAL_BATCH, SIZES[0])).astype(np.float32)
    data_y = rng.integers(0, SIZES[-1], size=(GLOBAL_BATCH,)).astype(np.int32)

    def input_fn(ctx):  # replica r always gets rows [r*b, (r+1)*b) of the same batch
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        per = ctx.num_replicas // ctx.num_input_pipelines
        first = ctx.input_pipeline_id * per

        def gen():
            while True:
                for r in range(first, first + per):
                    yield data_x[r * b:(r + 1) * b], data_y[r * b:(r + 1) * b]
        return gen()

    with rep.scope():
        params, opt = init()
    inputs = rep.prepare_input(input_fn)
    batch = next(inputs)
    losses = []
    for _ in range(CHECK_STEPS):
        params, opt, loss = rep.run(step, batch, params, opt)
        losses.append(float(loss))

    def timed(source) -> float:
        nonlocal params, opt
        for _ in range(2):  # warm-up
            params, opt, loss = rep.run(step, source, params, opt)
        loss.block_until_ready()
        rounds = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.steps):
                params, opt, loss = rep.run(step, source, params, opt)
            loss.block_until_ready()
            rounds.append((time.perf_counter() - t0) / args.steps)
        return statistics.median(rounds)

    result = {"step": timed(batch), "step+input": timed(inputs)}
    inputs.close()
    result["step+prefetch"] = timed(rep.prepare_input(input_fn, prefetch_on_device=True))
    result.update(losses=losses, replicas=strategy.num_replicas, workers=strategy.num_workers)
    if strategy.is_chief:
        print("RESULT " + json.dumps(result), flush=True)


def run_config(nproc: int, devices: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "jreplicate.cluster.launch", "--nproc", str(nproc),
           "--devices-per-proc", str(devices), "--timeout", "600", __file__, "--worker",
           "--rounds", str(args.rounds), "--steps", str(args.steps)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JREPLICATE_")}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=660)
    lines = [ln for ln in r.stdout.splitlines() if "RESULT " in ln]
    if r.returncode != 0 or not lines:
        sys.exit(f"{nproc}x{devices} failed (exit {r.returncode}):\n{r.stdout[-2000:]}\n"
                 f"{r.stderr[-4000:]}")
    return json.loads(lines[-1].split("RESULT ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each configuration")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per run")
    ap.add_argument("--steps", type=int, default=10, help="steps per round")
    ap.add_argument("--quick", action="store_true", help="1 repeat, 3 rounds of 5 steps")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.rounds, args.steps = 1, 3, 5
    if args.worker:
        worker(args)
        return
    configs = {"1x8": (1, 8), "2x4": (2, 4)}
    runs: dict[str, list[dict]] = {k: [] for k in configs}
    for i in range(args.repeats):
        for name, (nproc, devices) in configs.items():
            res = run_config(nproc, devices, args)
            runs[name].append(res)
            print(f"repeat {i + 1}/{args.repeats} {name}: " + ", ".join(
                f"{k} {res[k] * 1e3:.2f} ms" for k in TIMINGS), flush=True)
    l8, l24 = runs["1x8"][0]["losses"], runs["2x4"][0]["losses"]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(l8, l24))
    print(f"\nfirst {CHECK_STEPS} losses 1x8 {[round(x, 6) for x in l8]} vs 2x4 "
          f"{[round(x, 6) for x in l24]} (max rel diff {rel:.1e})")
    if rel > 1e-5:
        sys.exit("the two configurations disagree; not timing a wrong computation")
    print(f"\nMLP {'-'.join(map(str, SIZES))}, global batch {GLOBAL_BATCH}, median of "
          f"{args.repeats} run(s) x {args.rounds} rounds x {args.steps} steps, "
          f"{os.cpu_count()} CPU cores\n")
    print(f"{'timing':<14} {'1x8 (ms)':>10} {'2x4 (ms)':>10} {'2x4 / 1x8':>10}")
    for key in TIMINGS:
        a = statistics.median(r[key] for r in runs["1x8"]) * 1e3
        b = statistics.median(r[key] for r in runs["2x4"]) * 1e3
        print(f"{key:<14} {a:>10.2f} {b:>10.2f} {b / a:>10.2f}")


if __name__ == "__main__":
    main()
