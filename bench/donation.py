"""Peak memory of an Adam step with and without donation: jreplicate vs hand-written.

The peak is XLA's own account of the compiled per-device program
(``memory_analysis()``: arguments + outputs - aliased buffers + temporaries): it is
exact and free of timing noise. An MLP 784-1024-1024-10 with Adam on 8 simulated CPU devices;
jreplicate's ``run(..., donate_argnums=(0, 1))`` against ``jax.jit(shard_map(...),
donate_argnums=...)`` of the same step, and both without donation.

Run: ``python bench/donation.py [--json PATH]`` (a few seconds). On an accelerator the
devices are the machine's own (one GPU: one replica).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

SIZES = (784, 1024, 1024, 10)
GLOBAL_BATCH = 256
TX = optax.adam(1e-3)


step = _timing.classifier_step(TX, GLOBAL_BATCH)


def peak(compiled) -> int:
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    rep = jr.Replicator(jr.MirroredStrategy())
    n = rep.num_replicas
    rng = np.random.default_rng(0)
    with rep.scope():
        params = [{"w": jax.numpy.asarray(rng.normal(size=(a, b)).astype(np.float32) * 0.05),
                   "b": jax.numpy.zeros(b)} for a, b in zip(SIZES[:-1], SIZES[1:])]
        opt = TX.init(params)
    sharded = NamedSharding(rep.mesh, P("replica"))
    x = jax.device_put(rng.normal(size=(n, GLOBAL_BATCH // n, SIZES[0])).astype(np.float32),
                       sharded)
    y = jax.device_put(rng.integers(0, 10, (n, GLOBAL_BATCH // n)).astype(np.int32), sharded)
    batch = (jr.PerReplica(x, rep.mesh), jr.PerReplica(y, rep.mesh))

    def hand(donate):
        body = jax.shard_map(lambda p, o, x, y: step(None, (x[0], y[0]), p, o), mesh=rep.mesh,
                             in_specs=(P(), P(), P("replica"), P("replica")),
                             out_specs=(P(), P()))
        return peak(jax.jit(body, donate_argnums=(0, 1) if donate else ()).lower(
            params, opt, x, y).compile())

    ex = rep._executor
    rows = {
        "donated": (peak(ex.compiled(step, True, batch, (params, opt), donate_argnums=(0, 1))),
                    hand(True)),
        "kept": (peak(ex.compiled(step, True, batch, (params, opt))), hand(False)),
    }
    state = sum(a.nbytes for a in jax.tree.leaves((params, opt)))  # each device holds it
    print(f"Adam step, MLP {'-'.join(map(str, SIZES))}: state {state / 2**20:.2f} MiB/device")
    print(f"{'state':8s} {'jreplicate MiB':>15s} {'hand-written MiB':>17s} {'ratio':>6s}")
    for name, (ours, theirs) in rows.items():
        print(f"{name:8s} {ours / 2**20:15.2f} {theirs / 2**20:17.2f} "
              f"{ours / theirs:6.3f}")
    print(f"jreplicate kept / donated: {rows['kept'][0] / rows['donated'][0]:.3f}")
    _record.write(args.json, "donation",
                  "Peak memory of an Adam step with and without donation (XLA's analysis)",
                  ["state", "jreplicate MiB", "hand-written MiB", "jreplicate / hand-written"],
                  [[name, ours / 2**20, theirs / 2**20, ours / theirs]
                   for name, (ours, theirs) in rows.items()],
                  model="MLP " + "-".join(map(str, SIZES)), state_mib_per_device=state / 2**20,
                  kept_over_donated=rows["kept"][0] / rows["donated"][0], replicas=n,
                  platform=jax.devices()[0].platform)


if __name__ == "__main__":
    main()
