# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

# Flax's ImageNet example (original.py beside this file: Flax's train.py on `jax.pmap`,
# on the digits) ported to jreplicate. `diff original.py train.py` shows every change;
# each changed line is marked `# [jr]`:
#   - jax.pmap(train_step, in_axes=(None, 0), out_axes=(None, 0), axis_name='batch')
#       -> rep = jr.Replicator(jr.MirroredStrategy(axis_name='batch')); rep.run(...).
#     The axis keeps its name, so the model (BatchNorm(axis_name='batch')) and
#     compute_metrics' lax.pmean(metrics, 'batch') stay as they are.
#   - train_step(state, batch) -> train_step(ctx, batch, state): run's calling order.
#   - the loss: the per-replica mean -> jr.compute_average_loss(per_example, global
#     batch), and the L2 penalty -> jr.scale_regularization_loss(penalty): under run
#     the gradients of the replicated state are SUMMED over the replicas already.
#   - `grads = lax.pmean(grads, 'batch')` deleted (and DynamicScale's axis_name): kept,
#     it would leave the summed gradients as they are, 8 times the update on 8 replicas.
#   - `lax.pmean(new_model_state['batch_stats'], 'batch')` deleted: BatchNorm with
#     axis_name='batch' gives every replica the global batch's statistics already.
#   - prepare_tf_data (the leading device axis) and jax_utils.prefetch_to_device
#       -> rep.prepare_input(input_fn, prefetch_on_device=True): each replica's pipeline
#     yields its own batch of config.batch_size / replicas.
#   - the state is created in rep.scope() (placed replicated once; no
#     jax_utils.replicate) and donated to each step.
#   - common_utils.get_metrics (it indexes a device axis that is gone: run returns
#     0-d replicated metrics) -> common_utils.stack_forest(jax.device_get(...)).
# Run: python -m examples.imagenet_pmap_port.train   (8 simulated CPU devices on CPU)
# tests/test_imagenet_pmap_port.py checks that it equals original.py run with jax.pmap
# on one device. Kept in Flax's style, so ruff's import rules are silenced here:
# ruff: noqa: I001

"""ImageNet example.

This script trains a ResNet-50 on the ImageNet dataset.
The data is loaded using tensorflow_datasets.
"""

import functools
import time
from typing import Any

from absl import logging
# [jr] no flax.jax_utils: no replicate, unreplicate or prefetch_to_device
from flax.training import common_utils
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state
import jax
from jax import lax
import jax.numpy as jnp
from jax import random
import optax

import jreplicate as jr  # [jr]
from examples.imagenet_pmap_port import models
from examples.imagenet_pmap_port.stand_ins import (  # [digits] [not installed]
    input_pipeline, metric_writers, ml_collections, tf, tfds)


NUM_CLASSES = 10  # [digits]


def create_model(*, model_cls, half_precision, **kwargs):
  platform = jax.local_devices()[0].platform
  if half_precision:
    if platform == 'tpu':
      model_dtype = jnp.bfloat16
    else:
      model_dtype = jnp.float16
  else:
    model_dtype = jnp.float32
  return model_cls(num_classes=NUM_CLASSES, dtype=model_dtype, **kwargs)


def initialized(key, image_size, model):
  input_shape = (1, image_size, image_size, 3)

  @jax.jit
  def init(*args):
    return model.init(*args)

  variables = init({'params': key}, jnp.ones(input_shape, model.dtype))
  return variables['params'], variables['batch_stats']


def cross_entropy_loss(logits, labels):
  one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
  xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
  return jnp.mean(xentropy)


def cross_entropy_loss_share(ctx, logits, labels):  # [jr]
  """[jr] This replica's share of the global-batch mean cross entropy."""
  one_hot_labels = common_utils.onehot(labels, num_classes=NUM_CLASSES)
  xentropy = optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels)
  return jr.compute_average_loss(
      xentropy, global_batch_size=labels.shape[0] * ctx.num_replicas_in_sync
  )


def compute_metrics(logits, labels):
  loss = cross_entropy_loss(logits, labels)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
  metrics = {
      'loss': loss,
      'accuracy': accuracy,
  }
  metrics = lax.pmean(metrics, axis_name='batch')
  return metrics


def create_learning_rate_fn(
    config: ml_collections.ConfigDict,
    base_learning_rate: float,
    steps_per_epoch: int,
):
  """Create learning rate schedule."""
  warmup_fn = optax.linear_schedule(
      init_value=0.0,
      end_value=base_learning_rate,
      transition_steps=config.warmup_epochs * steps_per_epoch,
  )
  cosine_epochs = max(config.num_epochs - config.warmup_epochs, 1)
  cosine_fn = optax.cosine_decay_schedule(
      init_value=base_learning_rate, decay_steps=cosine_epochs * steps_per_epoch
  )
  schedule_fn = optax.join_schedules(
      schedules=[warmup_fn, cosine_fn],
      boundaries=[config.warmup_epochs * steps_per_epoch],
  )
  return schedule_fn


def train_step(ctx, batch, state, learning_rate_fn):  # [jr]
  """Perform a single training step."""

  def loss_fn(params):
    """loss function used for training."""
    logits, new_model_state = state.apply_fn(
        {'params': params, 'batch_stats': state.batch_stats},
        batch['image'],
        mutable=['batch_stats'],
    )
    loss = cross_entropy_loss_share(ctx, logits, batch['label'])  # [jr]
    weight_penalty_params = jax.tree_util.tree_leaves(params)
    weight_decay = 0.0001
    weight_l2 = sum(
        jnp.sum(x**2) for x in weight_penalty_params if x.ndim > 1
    )
    weight_penalty = weight_decay * 0.5 * weight_l2
    loss = loss + jr.scale_regularization_loss(weight_penalty, axis_name='batch')  # [jr]
    return loss, (new_model_state, logits)

  step = state.step
  dynamic_scale = state.dynamic_scale
  lr = learning_rate_fn(step)

  if dynamic_scale:
    grad_fn = dynamic_scale.value_and_grad(loss_fn, has_aux=True)  # [jr]
    dynamic_scale, is_fin, aux, grads = grad_fn(state.params)
    # [jr] no axis_name: the gradients are summed over the replicas already.
  else:
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    aux, grads = grad_fn(state.params)
    # [jr] no `lax.pmean(grads)`: the gradients are summed over the replicas already.
  new_model_state, logits = aux[1]
  metrics = compute_metrics(logits, batch['label'])
  metrics['learning_rate'] = lr

  new_state = state.apply_gradients(
      grads=grads,
      batch_stats=new_model_state['batch_stats'],  # [jr] the same on every replica
  )
  if dynamic_scale:
    # if is_fin == False the gradients contain Inf/NaNs and optimizer state and
    # params should be restored (= skip this step).
    new_state = new_state.replace(
        opt_state=jax.tree_util.tree_map(
            functools.partial(jnp.where, is_fin),  # pyrefly: ignore[unbound-name]
            new_state.opt_state,
            state.opt_state,
        ),
        params=jax.tree_util.tree_map(
            functools.partial(jnp.where, is_fin), new_state.params, state.params
        ),
        dynamic_scale=dynamic_scale,
    )
    metrics['scale'] = dynamic_scale.scale

  return new_state, metrics


def eval_step(ctx, batch, state):  # [jr]
  variables = {'params': state.params, 'batch_stats': state.batch_stats}
  logits = state.apply_fn(variables, batch['image'], train=False, mutable=False)
  return compute_metrics(logits, batch['label'])


# [jr] prepare_tf_data (reshaping to a leading device axis) removed.


def create_input_iter(
    rep,  # [jr]
    dataset_builder,
    batch_size,
    image_size,
    dtype,
    train,
    cache,
    shuffle_buffer_size,
    prefetch,
):
  def input_fn(ctx):  # [jr] one pipeline per process, batched per replica
    return input_pipeline.create_split(
        dataset_builder,
        ctx.get_per_replica_batch_size(batch_size),  # [jr]
        image_size=image_size,
        dtype=dtype,
        train=train,
        cache=cache,
        shuffle_buffer_size=shuffle_buffer_size,
        prefetch=prefetch,
    )

  return rep.prepare_input(  # [jr]
      input_fn, prefetch_on_device=True, prefetch_buffer_size=2
  )


class TrainState(train_state.TrainState):
  batch_stats: Any
  dynamic_scale: dynamic_scale_lib.DynamicScale


# [not installed]: restore_checkpoint / save_checkpoint (flax.training.checkpoints
# with Orbax) removed.


def create_train_state(
    rng, config: ml_collections.ConfigDict, model, image_size, learning_rate_fn
):
  """Create initial training state."""
  dynamic_scale = None
  platform = jax.local_devices()[0].platform
  if config.half_precision and platform == 'gpu':
    dynamic_scale = dynamic_scale_lib.DynamicScale()

  params, batch_stats = initialized(rng, image_size, model)
  tx = optax.sgd(
      learning_rate=learning_rate_fn,
      momentum=config.momentum,
      nesterov=True,
  )
  state = TrainState.create(
      apply_fn=model.apply,
      params=params,
      tx=tx,
      batch_stats=batch_stats,
      dynamic_scale=dynamic_scale,
  )
  return state


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str
) -> TrainState:
  """Execute model training and evaluation loop.

  Args:
    config: Hyperparameter configuration for training and evaluation.
    workdir: Directory where the tensorboard summaries are written to.

  Returns:
    Final TrainState.
  """

  writer = metric_writers.create_default_writer(
      logdir=workdir, just_logging=jax.process_index() != 0
  )

  rng = random.key(0)
  rep = jr.Replicator(jr.MirroredStrategy(axis_name='batch'))  # [jr]

  image_size = config.image_size  # [digits]

  if config.batch_size % jax.device_count() > 0:
    raise ValueError('Batch size must be divisible by the number of devices')
  # [jr] no local_batch_size: each input_fn divides the global batch

  platform = jax.local_devices()[0].platform

  if config.half_precision:
    if platform == 'tpu':
      input_dtype = tf.bfloat16
    else:
      input_dtype = tf.float16
  else:
    input_dtype = tf.float32

  dataset_builder = tfds.builder(config.dataset, image_size)  # [digits]
  train_iter = create_input_iter(
      rep,  # [jr]
      dataset_builder,
      config.batch_size,  # [jr] the global batch: input_fn divides it
      image_size,
      input_dtype,
      train=True,
      cache=config.cache,
      shuffle_buffer_size=config.shuffle_buffer_size,
      prefetch=config.prefetch,
  )
  eval_iter = create_input_iter(
      rep,  # [jr]
      dataset_builder,
      config.batch_size,  # [jr]
      image_size,
      input_dtype,
      train=False,
      cache=config.cache,
      shuffle_buffer_size=None,
      prefetch=config.prefetch,
  )

  steps_per_epoch = (
      dataset_builder.info.splits['train'].num_examples // config.batch_size
  )

  if config.num_train_steps <= 0:
    num_steps = int(steps_per_epoch * config.num_epochs)
  else:
    num_steps = config.num_train_steps

  if config.steps_per_eval == -1:
    num_validation_examples = dataset_builder.info.splits[
        'validation'
    ].num_examples
    steps_per_eval = num_validation_examples // config.batch_size
  else:
    steps_per_eval = config.steps_per_eval

  # [not installed]: `steps_per_checkpoint = steps_per_epoch * 10` removed.

  base_learning_rate = config.learning_rate * config.batch_size / 256.0

  model_cls = getattr(models, config.model)
  model = create_model(
      model_cls=model_cls, half_precision=config.half_precision
  )

  learning_rate_fn = create_learning_rate_fn(
      config, base_learning_rate, steps_per_epoch
  )

  with rep.scope():  # [jr] created replicated
    state = create_train_state(rng, config, model, image_size, learning_rate_fn)
  # [not installed]: `state = restore_checkpoint(state, workdir)` removed.
  # step_offset > 0 if restarting from checkpoint
  step_offset = int(state.step)

  p_train_step = functools.partial(train_step, learning_rate_fn=learning_rate_fn)  # [jr]

  train_metrics = []
  hooks = []  # [not installed]: clu's periodic_actions.Profile hook removed.
  train_metrics_last_t = time.time()
  logging.info('Initial compilation, this might take some minutes...')
  for step in range(step_offset, num_steps):  # [jr]
    state, metrics = rep.run(p_train_step, train_iter, state, donate_argnums=0)  # [jr]
    for h in hooks:
      h(step)
    if step == step_offset:
      logging.info('Initial compilation completed.')

    if config.get('log_every_steps'):
      train_metrics.append(metrics)
      if (step + 1) % config.log_every_steps == 0:
        train_metrics = common_utils.stack_forest(jax.device_get(train_metrics))  # [jr]
        summary = {
            f'train_{k}': v
            for k, v in jax.tree_util.tree_map(
                lambda x: x.mean(), train_metrics
            ).items()
        }
        summary['steps_per_second'] = config.log_every_steps / (
            time.time() - train_metrics_last_t
        )
        writer.write_scalars(step + 1, summary)
        train_metrics = []
        train_metrics_last_t = time.time()

    if (step + 1) % steps_per_epoch == 0:
      epoch = step // steps_per_epoch
      eval_metrics = []

      for _ in range(steps_per_eval):
        metrics = rep.run(eval_step, eval_iter, state)  # [jr]
        eval_metrics.append(metrics)
      eval_metrics = common_utils.stack_forest(jax.device_get(eval_metrics))  # [jr]
      summary = jax.tree_util.tree_map(lambda x: x.mean(), eval_metrics)
      logging.info(
          'eval epoch: %d, loss: %.4f, accuracy: %.2f',
          epoch,
          summary['loss'],
          summary['accuracy'] * 100,
      )
      writer.write_scalars(
          step + 1, {f'eval_{key}': val for key, val in summary.items()}
      )
      writer.flush()
    # [not installed]: save_checkpoint(state, workdir) every steps_per_checkpoint
    # steps removed.

  # Wait until computations are done before exiting
  jax.random.normal(jax.random.key(0), ()).block_until_ready()
  train_iter.close()  # [jr] stops the prefetching threads
  eval_iter.close()  # [jr]

  return state


def main():  # [not installed]: Flax's main.py (absl flags) in a few lines
  from examples.imagenet_pmap_port.config import get_config
  jax.config.update('jax_num_cpu_devices', 8)  # 8 simulated devices on a CPU host
  logging.set_verbosity(logging.INFO)
  train_and_evaluate(get_config(), workdir='')


if __name__ == '__main__':
  main()
