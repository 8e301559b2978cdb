"""What the benchmarks share: interleaved timing (ratios measured side by side) and the
MLP they time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def time_block(run: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``run`` over ``calls`` calls, waiting for the device at the end."""
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = run()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def interleaved(impls: dict[str, tuple[Callable[[], object], int]], rounds: int,
                warmup: int = 2) -> dict[str, list[float]]:
    """Times every ``(run, calls)`` of ``impls`` once per round, the order rotated every
    round so that slow drifts of background load hit all alike. Returns the seconds per
    call of each round, by name."""
    for run, _ in impls.values():
        time_block(run, warmup)
    names = list(impls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, calls = impls[name]
            times[name].append(time_block(run, calls))
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a``'s time over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b]))


def mlp(params, x):
    """An MLP over ``[{"w": ..., "b": ...}, ...]`` layers, ReLU between them."""
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def classifier_step(tx, global_batch: int):
    """A step of ``mlp`` with softmax cross-entropy and the optax transform ``tx``, for
    :meth:`jreplicate.Replicator.run` (``step(ctx, (x, y), params, opt_state)``)."""
    import optax

    import jreplicate as jr

    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(
            optax.softmax_cross_entropy_with_integer_labels(mlp(p, x), y), global_batch))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o
    return step
