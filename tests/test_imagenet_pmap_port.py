"""Flax's pmap ImageNet example ported to jreplicate (examples/imagenet_pmap_port/).

``original.py`` is Flax's ``train.py`` on ``jax.pmap`` (digits for ImageNet); ``train.py``
is its port. The port on 8 replicas must equal the original program run with
``jax.pmap`` on ONE device (the same global batches, the same initialisation): a
one-device reference computed by Flax's own code. The port a user is tempted to write
(rename ``jax.pmap`` to ``rep.run``, keep the per-replica mean loss and
``lax.pmean(grads)``) must not: it updates 8 times as far.
"""

import contextlib
import difflib
import functools
import inspect
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import dynamic_scale as dynamic_scale_lib

import jreplicate as jr
from examples.imagenet_pmap_port import original, stand_ins, train
from examples.imagenet_pmap_port.config import get_config

pytest.importorskip("sklearn")


def _config(**overrides):
    config = get_config()
    # 1437 training digits // 256 = 5 steps per epoch: 6 steps run one evaluation.
    config.update(batch_size=256, image_size=8, num_train_steps=6, steps_per_eval=1,
                  log_every_steps=1, learning_rate=0.1, **overrides)
    return config


@contextlib.contextmanager
def _one_device_host(monkeypatch):
    """The original program sees a host with one device: its batches get a leading
    device axis of 1 and ``jax.pmap`` runs on ``jax.devices()[0]`` alone."""
    first = jax.local_devices()[0]
    with monkeypatch.context() as m:
        m.setattr(jax, "local_device_count", lambda *a, **k: 1)
        m.setattr(jax, "local_devices", lambda *a, **k: [first])
        yield


def _run(module, config, monkeypatch):
    """``module.train_and_evaluate``: the final state and what it wrote, by step."""
    writers = []

    def create_default_writer(**kwargs):
        writers.append(stand_ins.MetricWriter(**kwargs))
        return writers[-1]

    monkeypatch.setattr(module, "metric_writers",
                        types.SimpleNamespace(create_default_writer=create_default_writer))
    state = module.train_and_evaluate(config, workdir="")
    (writer,) = writers
    scalars = {}
    for step, values in writer.scalars:
        values.pop("steps_per_second", None)  # a timing
        scalars.setdefault(step, {}).update(values)
    return state, scalars


def _assert_trees_close(got, want, what, rtol=2e-5, atol=2e-6):
    leaves_got = jax.tree_util.tree_leaves_with_path(got)
    leaves_want = jax.tree_util.tree_leaves(want)
    assert len(leaves_got) == len(leaves_want), what
    for (path, a), b in zip(leaves_got, leaves_want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                                   err_msg=f"{what}{jax.tree_util.keystr(path)}")


def test_the_port_on_8_replicas_equals_the_pmap_original_on_one_device(monkeypatch):
    config = _config()
    port_state, port_scalars = _run(train, config, monkeypatch)
    with _one_device_host(monkeypatch):
        ref_state, ref_scalars = _run(original, config, monkeypatch)

    assert int(port_state.step) == int(ref_state.step) == 6
    _assert_trees_close(port_state.params, ref_state.params, "params")
    _assert_trees_close(port_state.batch_stats, ref_state.batch_stats, "batch_stats")
    _assert_trees_close(port_state.opt_state, ref_state.opt_state, "opt_state")
    # Every step's train loss, accuracy and learning rate; the evaluation after step 5.
    assert sorted(port_scalars) == sorted(ref_scalars) == [1, 2, 3, 4, 5, 6]
    assert set(ref_scalars[5]) == {"train_loss", "train_accuracy", "train_learning_rate",
                                   "eval_loss", "eval_accuracy"}
    for step, want in ref_scalars.items():
        assert port_scalars[step].keys() == want.keys(), step
        for name, value in want.items():
            np.testing.assert_allclose(port_scalars[step][name], value, rtol=2e-5,
                                       atol=1e-6, err_msg=f"step {step}: {name}")
    # The programs train: a reference that did nothing would match too.
    assert ref_scalars[6]["train_loss"] < 0.8 * ref_scalars[1]["train_loss"]
    # The port's state is replicated on the 8 devices, as one array per leaf.
    kernel = port_state.params["conv_init"]["kernel"]
    assert kernel.sharding.is_fully_replicated and len(kernel.sharding.device_set) == 8


def test_every_change_of_the_port_is_marked():
    """``diff original.py train.py`` is the port: each changed stretch of train.py
    carries a ``[jr]`` mark (a deletion, within three lines of it), so the note at the top of
    train.py and the marks list every change."""
    folder = pathlib.Path(train.__file__).parent
    before = (folder / "original.py").read_text().splitlines()
    after = (folder / "train.py").read_text().splitlines()
    unmarked = []
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        near = after[j1:j2] if j2 > j1 else after[max(j1 - 3, 0):j1 + 3]
        if tag != "equal" and not any("[jr]" in line for line in near):
            unmarked.append((before[i1:i2], after[j1:j2]))
    assert not unmarked, unmarked
    assert sum("[jr]" in line for line in after) > 20


# -- the step itself, on a small model: the tempting port, DynamicScale, donation --------
class _Small(nn.Module):
    """Conv, BatchNorm over the 'batch' axis (as the ResNet's), Dense."""

    dtype: jnp.dtype = jnp.float32  # read by original.initialized

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), use_bias=False)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5,
                         axis_name="batch")(x)
        return nn.Dense(stand_ins.NUM_CLASSES)(jnp.mean(nn.relu(x), axis=(1, 2)))


GLOBAL_BATCH = 64
LEARNING_RATE = optax.constant_schedule(0.1)
STEPS = 3


@functools.cache
def _batches():
    data = stand_ins.create_split(stand_ins.DigitsBuilder("digits", 8), GLOBAL_BATCH, 8)
    return tuple(next(data) for _ in range(STEPS))


@functools.cache
def _host_state():
    """original.create_train_state's state, on the host (built once: initialisers with
    random draws compile slowly on CPU)."""
    return jax.device_get(original.create_train_state(
        jax.random.key(0), get_config(), _Small(), 8, LEARNING_RATE))


def _state(dynamic_scale):
    return _host_state().replace(
        dynamic_scale=dynamic_scale_lib.DynamicScale() if dynamic_scale else None)


@functools.cache
def _pmap_one_device(dynamic_scale):
    """Flax's train_step under jax.pmap on one device, as original.py calls it: the
    state and the metrics after each step."""
    step = jax.pmap(functools.partial(original.train_step, learning_rate_fn=LEARNING_RATE),
                    in_axes=(None, 0), out_axes=(None, 0), axis_name="batch",
                    devices=jax.local_devices()[:1])
    state, history = _state(dynamic_scale), []
    for batch in _batches():
        state, metrics = step(state, jax.tree_util.tree_map(lambda x: x[None], batch))
        history.append((state, jax.tree_util.tree_map(lambda x: np.asarray(x)[0], metrics)))
    return history


def _replicator():
    return jr.Replicator(jr.MirroredStrategy(axis_name="batch"))


@pytest.mark.parametrize("dynamic_scale", [False, True], ids=["plain", "dynamic_scale"])
def test_the_ported_step_with_a_donated_train_state_equals_one_device(dynamic_scale):
    """train.py's train_step through ``rep.run`` with the flax TrainState donated, with
    and without Flax's DynamicScale (whose ``axis_name`` the port drops), against Flax's
    train_step under ``jax.pmap`` on one device, step by step."""
    rep = _replicator()
    state = rep.replicate(_state(dynamic_scale))
    step = functools.partial(train.train_step, learning_rate_fn=LEARNING_RATE)
    for batch, (ref_state, ref_metrics) in zip(_batches(), _pmap_one_device(dynamic_scale)):
        donated, state = state, None  # one reference, as in a training loop
        state, metrics = rep.run(step, batch, donated, donate_argnums=0)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(donated.params))
        _assert_trees_close(state.params, ref_state.params, "params")
        _assert_trees_close(state.batch_stats, ref_state.batch_stats, "batch_stats")
        _assert_trees_close(state.opt_state, ref_state.opt_state, "opt_state")
        metrics = jax.device_get(metrics)
        assert sorted(metrics) == sorted(ref_metrics)
        for name in ref_metrics:
            np.testing.assert_allclose(metrics[name], ref_metrics[name], rtol=2e-5, atol=1e-6,
                                       err_msg=name)
    assert int(state.step) == STEPS
    if dynamic_scale:
        assert float(state.dynamic_scale.scale) == float(ref_state.dynamic_scale.scale)
        assert int(state.dynamic_scale.fin_steps) == int(ref_state.dynamic_scale.fin_steps)
        assert int(ref_state.dynamic_scale.fin_steps) == STEPS


def _line_of(module, text):
    source = inspect.getsource(module).splitlines()
    (line,) = [i + 1 for i, s in enumerate(source) if text in s]
    return line


def test_the_tempting_port_keeping_pmean_grads_updates_8_times_as_far_and_is_reported():
    """Flax's train_step as it is under ``rep.run`` (a per-replica mean loss, its L2
    penalty on every replica, ``lax.pmean(grads)``): the metrics are right, the update
    is 8.000 times the one-device update, and run names each of the lines."""
    start = _state(False)
    ref_state, ref_metrics = _pmap_one_device(False)[0]
    rep = _replicator()

    def tempting(ctx, batch, state):  # ctx unused: the pmap step as it was
        return original.train_step(state, batch, learning_rate_fn=LEARNING_RATE)

    with pytest.warns(jr.ReplicationHabitWarning) as caught:
        wrong, metrics = rep.run(tempting, _batches()[0], rep.replicate(start))
    reported = sorted((pathlib.Path(w.filename).name, w.lineno) for w in caught
                      if w.category is jr.ReplicationHabitWarning)
    assert reported == [("original.py", _line_of(original, text)) for text in (
        "return jnp.mean(xentropy)",  # the per-replica mean loss
        "loss = loss + weight_penalty",  # the L2 penalty on every replica
        "grads = lax.pmean(grads, axis_name='batch')",
        "batch_stats=lax.pmean(new_model_state['batch_stats'], 'batch')",
    )], [str(w.message) for w in caught]

    right_update = jax.tree_util.tree_map(np.subtract, ref_state.params, start.params)
    wrong_update = jax.tree_util.tree_map(np.subtract, wrong.params, start.params)
    _assert_trees_close(wrong_update, jax.tree_util.tree_map(lambda u: 8 * u, right_update),
                        "8 x the one-device update", rtol=1e-4, atol=1e-7)
    assert np.abs(right_update["Dense_0"]["kernel"]).max() > 1e-3  # a real update
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
    _assert_trees_close(wrong.batch_stats, ref_state.batch_stats, "batch_stats")
