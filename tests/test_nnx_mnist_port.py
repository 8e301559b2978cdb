"""examples/nnx_mnist_port: Flax's NNX MNIST tutorial on 8 replicas equals it on one device.

``original.py`` is the tutorial's program (on scikit-learn's digits); ``train.py`` its
port to jreplicate. Both run their ``main`` for 4 steps and an evaluation, the
original on one device, the port on 8 replicas (a per-replica batch of 4), and every
recorded metric (train and test loss and accuracy, correct predictions), every
parameter and every BatchNorm statistic must agree to float tolerance. How:

* without dropout (``main(dropout=False)``: the model is deterministic): the port draws
  its masks per replica, so its masks differ from the one-device masks by construction;
* with ``optax.sgd`` (momentum 0.9) instead of the tutorial's ``adamw``: Adam divides
  each gradient by its own magnitude, so the gradients that are zero in exact
  arithmetic (the convolutions' biases in front of BatchNorm: ~1e-8 of float noise, the
  others ~1e-2) become steps of +-learning_rate whose sign depends on the order of a
  sum; with SGD the two programs agree to ~1e-8.

The tempting port that keeps the tutorial's ``.mean()`` loss has 8x the gradient of the
port (gradients of replicated state are summed over the replicas), so 8x its update
under SGD, and ``run`` reports it (``jr.ReplicationHabitWarning`` at the ``.mean()``
line). (Adam's update hardly changes with the gradient's scale: with the tutorial's
``adamw`` that error is nearly hidden, until clipping, a schedule tuned elsewhere or
another optimizer meets it.)
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np
import optax
import pytest
from flax import nnx

import jreplicate as jr
from tests._optional import installed, needs_devices

pytestmark = [pytest.mark.skipif(not installed("sklearn"), reason="needs sklearn (the data)"),
              needs_devices(8)]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "nnx_mnist_port"
STEPS, EVAL_EVERY = 4, 3  # an evaluation after the 4th step (step 3) only


def _load(name: str):
    """examples/nnx_mnist_port/<name>.py as a module of its own name (train.py and
    original.py are common names: other examples may have them too)."""
    spec = importlib.util.spec_from_file_location(f"nnx_mnist_port_{name}",
                                                  EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(EXAMPLE))  # for their `from tutorial_stand_ins import ...`
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(EXAMPLE))
    return module


@pytest.fixture(scope="module")
def programs():
    original, train = _load("original"), _load("train")
    # One optimizer object for every run: nnx.jit and run compile once per optimizer.
    tx = optax.sgd(original.learning_rate, original.momentum)
    return original, train, tx


def _state(model) -> dict[str, np.ndarray]:
    return {".".join(map(str, path)): np.asarray(v[...])
            for path, v in nnx.to_flat_state(nnx.state(model))}


def test_the_port_on_8_replicas_equals_the_tutorial_on_one_device(programs, capsys):
    original, train, tx = programs
    want, want_model = original.main(STEPS, EVAL_EVERY, dropout=False, tx=tx, verbose=False)
    got, got_model = train.main(STEPS, EVAL_EVERY, dropout=False, tx=tx, verbose=True)

    assert sorted(got) == sorted(want) == sorted(
        [f"{split}_{m}" for split in ("train", "test") for m in ("loss", "accuracy")]
        + ["pred_correct"])
    for tag in want:
        assert [s for s, _ in got[tag]] == [s for s, _ in want[tag]] == [3], tag
        np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in want[tag]],
                                   rtol=1e-5, err_msg=tag)
    # The accuracies are counts over the same examples: equal, not close.
    assert got["test_accuracy"] == want["test_accuracy"]
    assert got["train_accuracy"] == want["train_accuracy"]

    want_state, got_state = _state(want_model), _state(got_model)
    assert sorted(got_state) == sorted(want_state)
    assert {"batch_norm1.mean", "batch_norm2.var", "conv1.kernel"} <= set(want_state)
    for name, value in want_state.items():
        np.testing.assert_allclose(got_state[name], value, rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    # The port's state stayed replicated (one value on every device), as run wrote it.
    kernel = got_model.linear2.kernel[...]
    assert len(kernel.sharding.device_set) == 8 and kernel.sharding.is_fully_replicated

    printed = capsys.readouterr().out
    assert "step    3  train_loss" in printed and "step    3  test_accuracy" in printed


def test_the_shape_check_leaves_the_tutorials_state_dropout_included(programs):
    """The tutorial calls the model once in training mode before training (its running
    statistics move); the port makes that call through jr.one_replica, with dropout."""
    original, train, tx = programs
    want = _state(original.main(0, dropout=True, tx=tx, verbose=False)[1])
    got = _state(train.main(0, dropout=True, tx=tx, verbose=False)[1])
    assert np.abs(want["batch_norm1.mean"]).max() > 0  # the check moved the statistics
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def _code_lines(name: str) -> list[str]:
    """The lines of examples/nnx_mnist_port/<name>.py after its module docstring."""
    text = (EXAMPLE / f"{name}.py").read_text()
    return text.splitlines()[ast.parse(text).body[0].end_lineno:]


def test_every_change_of_the_port_is_marked():
    """``diff original.py train.py`` is the port: each changed stretch of train.py carries
    a ``[jr]`` mark (a deletion: within three lines of it), so its header note and the
    marks list every change."""
    before, after = _code_lines("original"), _code_lines("train")
    unmarked = []
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        near = after[j1:j2] if j2 > j1 else after[max(j1 - 3, 0):j1 + 3]
        if tag != "equal" and not any("[jr]" in line for line in near):
            unmarked.append((before[i1:i2], after[j1:j2]))
    assert not unmarked, unmarked
    assert sum("[jr]" in line for line in after) >= 15


def tempting_loss_fn(model, batch, rngs=None):
    """The tutorial's loss kept as it is: each replica's own mean."""
    logits = model(batch["image"], rngs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits=logits, labels=batch["label"]).mean(), logits


def test_the_tempting_port_with_the_mean_loss_has_8_times_the_gradient_and_is_reported(
        programs):
    _, train, _ = programs

    def gradients(ctx, batch, model):
        port = nnx.grad(lambda m: train.loss_fn(m, batch)[0])(model)
        tempting = nnx.grad(lambda m: tempting_loss_fn(m, batch)[0])(model)
        return port, tempting

    rep = jr.Replicator(jr.MirroredStrategy())
    with rep.scope():
        model = train.CNN(rngs=nnx.Rngs(0))
    batch = next(train.make_batches(train.train_ds, train.batch_size))
    with pytest.warns(jr.ReplicationHabitWarning) as caught:
        port, tempting = rep.run(gradients, batch, nnx.view(model, deterministic=True,
                                                             use_running_average=False))
    # Reported once, at the line of the tempting loss's .mean(), naming the fix.
    mean_line = next(i for i, line in enumerate(inspect.getsourcelines(tempting_loss_fn)[0],
                                                tempting_loss_fn.__code__.co_firstlineno)
                     if ".mean()" in line)
    habits = [w for w in caught if w.category is jr.ReplicationHabitWarning]
    assert [(Path(w.filename).name, w.lineno) for w in habits] == [
        (Path(__file__).name, mean_line)], [str(w.message) for w in caught]
    assert "jr.compute_average_loss" in str(habits[0].message)
    port, tempting = nnx.to_flat_state(port), nnx.to_flat_state(tempting)
    checked = 0
    for (path, g), (_, t) in zip(port, tempting, strict=True):
        g, t = np.asarray(g[...]), np.asarray(t[...])
        if path[-1] == "bias" and str(path[0]).startswith("conv"):
            continue  # zero in exact arithmetic (BatchNorm follows): float noise only
        # The gradients of replicated state are summed over the 8 replicas, and each
        # replica's mean is 8x its share of the global mean.
        np.testing.assert_allclose(t, 8 * g, rtol=1e-4, atol=1e-6 * np.abs(g).max(),
                                   err_msg=str(path))
        checked += 1
    assert checked == 10
