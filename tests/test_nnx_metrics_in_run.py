"""``nnx.MultiMetric`` in a replicated step counts what one device counts.

The two forms docs/porting/flax_nnx.md teaches, against ``nnx.MultiMetric`` (Accuracy
and Average('loss')) updated on one device with the global batch:

* inside the step, fed the global batch's values: ``loss=ctx.all_sum(share)`` (a
  ``jr.compute_average_loss`` share summed is the global mean),
  ``logits=ctx.all_gather(logits).reshape(-1, C)``, likewise the labels;
* outside ``run``, from the step's per-replica outputs: ``rep.reduce("sum", share)``
  and ``PerReplica.array`` reshaped to the global batch.

Over replica counts (with 2 logical devices per replica too), per-replica batch sizes and
numbers of steps (hypothesis), and in a device loop (``steps=3``). The habits it exists
against: per-replica values fed to the metric inside the step (its state then differs per
replica: ``run`` refuses it), and the mean of the shares (``rep.reduce("mean", ...)``),
the loss divided by the number of replicas.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr
from tests._optional import needs_devices

CLASSES = 10


@functools.cache
def _replicator(layout: str) -> jr.Replicator:
    """``"n"``: n replicas of one device; ``"4x2"``: 4 replicas of 2 logical devices."""
    if layout == "4x2":
        return jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:int(layout)]))


def _metrics() -> nnx.MultiMetric:
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(),
                           loss=nnx.metrics.Average("loss"))


def _share(ctx: jr.ReplicaContext, batch) -> jax.Array:
    """This replica's share of the global mean of the batch's per-example losses."""
    return jr.compute_average_loss(batch["loss"], batch["loss"].shape[0] * ctx.num_replicas)


def update_inside(ctx, batch, metrics):
    metrics.update(loss=ctx.all_sum(_share(ctx, batch)),
                   logits=ctx.all_gather(batch["logits"]).reshape(-1, CLASSES),
                   labels=ctx.all_gather(batch["labels"]).reshape(-1))


def values(ctx, batch):
    return _share(ctx, batch), batch["logits"]


def update_per_replica(ctx, batch, metrics):  # the habit: this replica's values
    metrics.update(loss=_share(ctx, batch), logits=batch["logits"], labels=batch["labels"])


def _batches(rng, steps: int, global_batch: int) -> list[dict]:
    return [{"logits": rng.normal(size=(global_batch, CLASSES)).astype(np.float32),
             "labels": rng.integers(0, CLASSES, global_batch).astype(np.int32),
             "loss": rng.exponential(size=global_batch).astype(np.float32)}
            for _ in range(steps)]


def _one_device(batches: list[dict]) -> dict:
    metrics = _metrics()
    for b in batches:
        metrics.update(loss=b["loss"].mean(), logits=b["logits"], labels=b["labels"])
    return metrics.compute()


def _assert_equal(got: dict, want: dict) -> None:
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-6)
    assert float(got["accuracy"]) == float(want["accuracy"])  # a ratio of equal counts


@needs_devices(8)
@settings(deadline=None, max_examples=10)
@given(layout=st.sampled_from(["1", "2", "8", "4x2"]), per_replica=st.sampled_from([1, 3]),
       steps=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_both_forms_count_what_one_device_counts(layout, per_replica, steps, seed):
    rep = _replicator(layout)
    n = rep.num_replicas
    batches = _batches(np.random.default_rng(seed), steps, n * per_replica)
    want = _one_device(batches)

    with rep.scope():
        inside = _metrics()
    outside, mean_habit = _metrics(), _metrics()
    for b in batches:
        rep.run(update_inside, b, inside)
        share, logits = rep.run(values, b)
        outside.update(loss=rep.reduce("sum", share),
                       logits=np.asarray(logits.array).reshape(-1, CLASSES), labels=b["labels"])
        mean_habit.update(loss=rep.reduce("mean", share), logits=b["logits"], labels=b["labels"])
    _assert_equal(inside.compute(), want)
    _assert_equal(outside.compute(), want)
    # The shares are already divided by the global batch: their mean is 1/n of the loss.
    np.testing.assert_allclose(float(mean_habit.compute()["loss"]), float(want["loss"]) / n,
                               rtol=1e-6)


@needs_devices(8)
def test_per_replica_values_fed_inside_are_refused_not_written_back():
    rep = _replicator("8")
    (batch,) = _batches(np.random.default_rng(0), 1, 16)
    with rep.scope():
        metrics = _metrics()
    with pytest.raises(ValueError, match="different on each replica"):
        rep.run(update_per_replica, batch, metrics)
    assert float(metrics.loss.count[...]) == 0  # nothing half-written


@needs_devices(8)
def test_in_a_device_loop_equals_one_device():
    rep = _replicator("8")
    batches = _batches(np.random.default_rng(1), 6, 16)
    per_replica = [{k: v[r * 2:(r + 1) * 2] for k, v in b.items()}
                   for b in batches for r in range(8)]  # step by step, replica by replica
    inputs = rep.prepare_input(lambda ctx: iter(per_replica))
    with rep.scope():
        metrics = _metrics()
    rep.run(update_inside, inputs, metrics, steps=3)
    rep.run(update_inside, inputs, metrics, steps=3)
    _assert_equal(metrics.compute(), _one_device(batches))

