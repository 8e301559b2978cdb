"""prepare_input(..., partial_batch="pad"): every example counts once, on every sweep."""

import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr

ROOT = Path(__file__).resolve().parents[1]


def _digits_eval_setup():
    load_digits = pytest.importorskip(
        "sklearn.datasets", reason="scikit-learn is not installed").load_digits
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int32)
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 10)).astype(np.float32)
    return x, y, w


def test_rfc_evaluation_loop_counts_every_digit_on_every_sweep():
    """SINGLE mode, reinitialize, sweep until the iterator ends (the design's loop)."""
    x, y, w = _digits_eval_setup()
    rep = jr.Replicator(jr.MirroredStrategy())
    eval_batch = 64  # 1797 = 28 * 64 + 5: the last step has 5 real examples of 64

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(eval_batch)
        return [(x[i:i + b], y[i:i + b]) for i in range(0, len(x), b)]

    traces = []

    def eval_step(ctx, batch, w):
        traces.append(1)
        xb, yb = batch
        m = ctx.batch_mask
        correct = (jnp.argmax(xb @ w, -1) == yb) * m
        losses = -jax.nn.log_softmax(xb @ w)[jnp.arange(yb.shape[0]), yb]
        mean_loss = jr.compute_average_loss(losses, eval_batch, sample_weight=m)
        return ctx.all_sum(m.sum()), ctx.all_sum(correct.sum()), ctx.all_sum(mean_loss)

    want_correct = int(np.sum(np.argmax(x @ w, -1) == y))
    logp = x @ w - np.log(np.sum(np.exp(x @ w), -1, keepdims=True))
    want_loss = -logp[np.arange(len(y)), y].sum()
    inputs = rep.prepare_input(input_fn, jr.InputReplicationMode.SINGLE,
                               partial_batch="pad")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped, nothing to warn about
        for _ in range(3):
            count = correct = loss_sum = 0.0
            steps = 0
            while True:
                try:
                    n, c, loss = rep.run(eval_step, inputs, w)
                except StopIteration:
                    break
                steps += 1
                count += float(n)
                correct += float(c)
                loss_sum += float(loss) * eval_batch
            assert (steps, count, correct) == (29, 1797, want_correct)
            np.testing.assert_allclose(loss_sum, want_loss, rtol=1e-4)
            inputs.reinitialize()
    assert len(traces) == 1  # the padded step has the full step's shapes


def test_pipelines_running_out_at_different_times_are_padded():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
    sizes = [3, 1, 2, 3]  # replica r's pipeline yields sizes[r] elements, the last short

    def input_fn(ctx):
        r = ctx.input_pipeline_id
        out = [np.full((4,), 10.0 * r + i, np.float32) for i in range(sizes[r])]
        out[-1] = out[-1][:2]
        return out

    inputs = rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA,
                               partial_batch="pad")
    masks, sums = [], []
    for batch in inputs:
        mask, s = rep.run(lambda ctx, b: (ctx.batch_mask, ctx.all_sum(
            jnp.sum(b * ctx.batch_mask))), batch)
        masks.append(np.asarray(mask.array))
        sums.append(float(s))
    assert len(masks) == 3
    np.testing.assert_array_equal(masks[0], [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1],
                                             [1, 1, 1, 1]])
    np.testing.assert_array_equal(masks[1], [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0],
                                             [1, 1, 1, 1]])
    np.testing.assert_array_equal(masks[2], [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0],
                                             [1, 1, 0, 0]])
    want = sum(sum(float(v) * (2 if i == sizes[r] - 1 else 4)
                   for i, v in enumerate(10.0 * r + np.arange(sizes[r])))
               for r in range(4))
    assert sum(sums) == want


def test_full_steps_have_an_all_ones_mask_and_loops_carry_it():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    data = [np.ones((3,), np.float32)] * 4 + [np.ones((1,), np.float32)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA,
                               partial_batch="pad")
    count, per_step = rep.run(lambda ctx, b, n: (n + ctx.all_sum(ctx.batch_mask.sum()),
                                                 ctx.all_sum(ctx.batch_mask.sum())),
                              inputs, jnp.float32(0), steps=10)
    assert per_step.tolist() == [6, 6, 6, 6, 2] and float(count) == 26


def test_batch_mask_needs_padding_and_the_option_is_checked():
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    inputs = rep.prepare_input(lambda ctx: iter([np.ones(2)] * 2),
                               jr.InputReplicationMode.PER_REPLICA)
    with pytest.raises(ValueError, match=r"batch_mask exists when.*partial_batch='pad'"):
        rep.run(lambda ctx, b: ctx.batch_mask, inputs)
    with pytest.raises(ValueError, match=r"partial_batch='trim'\) must be 'drop'.*or 'pad'"):
        rep.prepare_input(lambda ctx: iter([]), partial_batch="trim")
    padded = rep.prepare_input(lambda ctx: iter([{"x": np.ones((2, 3)), "n": np.ones(())}]),
                               partial_batch="pad")
    with pytest.raises(ValueError, match=r"every leaf of an element needs one.*\['n'\]: \[\]"):
        rep.run(lambda ctx, b: b, padded)


def test_padded_evaluation_across_two_processes(tmp_path):
    from tests.test_multi_worker_processes import _launch
    r = _launch(["--nproc", "2", "--devices-per-proc", "2",
                 str(ROOT / "tests" / "mp_scripts" / "pad_eval.py")], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    n = 40 + 63
    for sweep in range(2):
        assert f"SWEEP {sweep} count={n} total={n * (n - 1) // 2} want={n} " in r.stdout, \
            r.stdout[-3000:]
