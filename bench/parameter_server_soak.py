"""Soak: exactly-once under faults, N runs of "kill 1 of 4 workers at 40 % of training".

Each run trains a small linear model with ParameterServerStrategy (2 shards, 4 workers,
embedded carrier, 8 simulated CPU devices), kills a random worker when 40 % of the
scheduled steps are done (at a random point: after computing, or between its pushes to
shard 0 and shard 1), and checks per shard that ``pushes == applied + stale + backup +
duplicate`` and ``applied == scheduled steps``, that the parameters equal exactly-once
application, and that ``join`` returned within a bound (no hang). Exits 1 on any failure.

    python bench/parameter_server_soak.py [--runs 20] [--steps 50]

``tests/test_ps_sync_and_faults.py`` runs a shorter version (4 runs).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jreplicate as jr  # noqa: E402
import jreplicate.testing as jrt  # noqa: E402


def one_run(seed: int, steps: int, join_bound: float) -> tuple[bool, str]:
    rng = random.Random(seed)
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=4)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(4)
        tx = jr.ps.pushable(optax.sgd(0.01))
        opt = tx.init(w)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    for k in range(4):
        jrt.set_worker_delay(s, k, rng.uniform(0.002, 0.02))
    victim, when = rng.randrange(4), rng.choice(["compute", "push"])
    t0 = time.monotonic()
    for _ in range(steps):
        rep.run(step, None, w, opt)
    while s.stats()["completed"] < 0.4 * steps and time.monotonic() - t0 < join_bound:
        time.sleep(0.001)
    jrt.kill_worker(s, victim, when=when)
    try:
        s._executor.coordinator.join(timeout=join_bound)
    except TimeoutError as e:
        return False, f"HANG: {e}"
    took = time.monotonic() - t0
    st, ledgers = s.stats(), s.ledger()
    ok = st["completed"] == steps
    for led in ledgers:
        ok &= led["pushes"] == led["applied"] + led["stale"] + led["backup"] + led["duplicate"]
        ok &= led["applied"] == steps
    ok &= bool(np.allclose(s.parameters(), -0.01 * steps, rtol=1e-5))
    killed = not st["alive"][victim]
    s.shutdown()
    line = (f"kill worker {victim} at {when:7s}: died={killed!s:5s} rescheduled="
            f"{st['rescheduled']} shard0 {ledgers[0]['pushes']} pushes = "
            f"{ledgers[0]['applied']} applied + {ledgers[0]['duplicate']} dup; shard1 "
            f"{ledgers[1]['pushes']} = {ledgers[1]['applied']} + {ledgers[1]['duplicate']}; "
            f"{took:.2f} s")
    return ok, line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--join-bound", type=float, default=60.0)
    args = parser.parse_args()
    failures = 0
    for r in range(args.runs):
        ok, line = one_run(r, args.steps, args.join_bound)
        failures += not ok
        print(f"run {r:2d} {'ok  ' if ok else 'FAIL'} {line}", flush=True)
    print(f"{args.runs - failures}/{args.runs} runs kept the invariant, none hung"
          if not failures else f"{failures} of {args.runs} runs FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
