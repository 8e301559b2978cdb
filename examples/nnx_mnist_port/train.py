"""Flax's NNX MNIST tutorial (original.py) ported to jreplicate: 8 replicas, one program.

The program of ``original.py`` (Flax's docs_nnx/mnist_tutorial.md on scikit-learn's
digits), data-parallel over the devices with ``jr.MirroredStrategy``: each step's batch
of 32 is split into 8 per-replica batches of 4, and the result equals the one-device
program to float tolerance (``tests/test_nnx_mnist_port.py``; with dropout on, the masks
are drawn per replica, so the numbers differ as two dropout seeds do). On N devices there
are N replicas (32 must be divisible by N). The lines changed
from ``original.py`` (``diff original.py train.py`` shows each; every changed line is
marked ``# [jr]``):

1. ``rep = jr.Replicator(jr.MirroredStrategy())``, and the model, optimizer and
   metrics created in ``rep.scope()`` (placed replicated on every device);
2. ``nnx.BatchNorm(..., axis_name=jr.REPLICA_AXIS)``: the batch statistics are those
   of the global batch (over every replica), as on one device; without it each replica
   normalises with its own 4 examples and run refuses the per-replica running stats;
3. ``loss_fn``: ``jr.compute_average_loss(per_example, batch_size)`` instead of
   ``.mean()``: the gradients of replicated state are summed over the replicas, so each
   replica's loss is its share of the global batch's mean. (``.mean()`` gives 8x the
   gradient, and ``run`` warns at its line, ``jr.ReplicationHabitWarning``, as
   ``tests/test_nnx_mnist_port.py`` shows; the tutorial's ``adamw``
   nearly hides it, as Adam's step hardly depends on the gradient's scale, but the
   loss the metrics report is 8x; with SGD the update is 8x);
4. ``@nnx.jit`` removed from the steps, which take ``ctx`` and the batch first, and
   run as ``rep.run(step, batch, *state)``: run compiles them (``jax.jit`` over
   ``shard_map``) and updates the NNX arguments in place, as ``nnx.jit`` does;
5. the metrics are fed the global batch's values, identical on every replica:
   ``loss=ctx.all_sum(loss)`` (the global mean, as ``loss`` is a share of it) and the
   logits and labels of every replica (``ctx.all_gather``), so ``metrics.compute()``
   gives the one-device numbers;
6. ``pred_step``'s predictions come back per replica (``jr.PerReplica``): ``.array``
   is ``[8, 4]``, reshaped to the batch's 32;
7. the shape check calls the model through ``jr.one_replica``: outside ``run`` no
   replica axis exists, and BatchNorm with an ``axis_name`` would raise ``NameError:
   unbound axis name``; ``one_replica`` binds it with size 1, so the call computes, and
   moves the running statistics, exactly as the tutorial's call on one device;
8. run as a script, it asks JAX for 8 CPU devices (``jax_num_cpu_devices``), the
   replicas where there is no GPU or TPU.

``nnx.Rngs`` and ``nnx.Optimizer`` are passed to ``run`` like the model; their state is
updated in place. Run: ``python examples/nnx_mnist_port/train.py``.
"""
# ruff: noqa: E501 - the tutorial's own long lines, kept as they are

from functools import partial

import jax  # [jr] for its config: 8 CPU devices where there is no GPU/TPU
import jax.numpy as jnp  # JAX NumPy
import numpy as np
import optax
from flax import nnx  # The Flax NNX API.
from tutorial_stand_ins import SummaryWriter, load_dataset

import jreplicate as jr  # [jr]

train_steps = 40
eval_every = 10
batch_size = 32

dataset = load_dataset('mnist')
train_ds = dataset['train'].shuffle(seed=0)
test_ds = dataset['test']

def make_batches(ds, batch_size):
  """Yield batches of normalized (image, label) numpy arrays."""
  for i in range(0, len(ds), batch_size):
    batch = ds[i : i + batch_size]
    if len(batch['label']) < batch_size:  # drop incomplete final batch
      break
    images = np.stack([
      np.array(img, dtype=np.float32)[..., None] / 255.0
      for img in batch['image']
    ])
    yield {'image': images, 'label': np.array(batch['label'])}


class CNN(nnx.Module):
  """A simple CNN model."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(32, axis_name=jr.REPLICA_AXIS, rngs=rngs)  # [jr] global batch statistics
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, axis_name=jr.REPLICA_AXIS, rngs=rngs)  # [jr] global batch statistics
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.025)
    self.linear2 = nnx.Linear(256, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    x = self.linear2(x)
    return x

learning_rate = 0.005
momentum = 0.9

def loss_fn(model: CNN, batch, rngs: nnx.Rngs | None = None):
  logits = model(batch['image'], rngs)
  loss = jr.compute_average_loss(optax.softmax_cross_entropy_with_integer_labels(  # [jr]
    logits=logits, labels=batch['label']
  ), batch_size)  # [jr] this replica's share of the global batch's mean loss
  return loss, logits

def update_metrics(ctx: jr.ReplicaContext, metrics: nnx.MultiMetric, loss, logits, labels):  # [jr]
  """Feeds the metrics the global batch's values, identical on every replica."""
  metrics.update(loss=ctx.all_sum(loss),  # the global batch's mean loss
                 logits=ctx.all_gather(logits).reshape(-1, logits.shape[-1]),
                 labels=ctx.all_gather(labels).reshape(-1))

def train_step(ctx: jr.ReplicaContext, batch, model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs):  # [jr] no @nnx.jit
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  update_metrics(ctx, metrics, loss, logits, batch['label'])  # In-place updates. [jr]
  optimizer.update(model, grads)  # In-place updates.

def eval_step(ctx: jr.ReplicaContext, batch, model: CNN, metrics: nnx.MultiMetric):  # [jr] no @nnx.jit
  loss, logits = loss_fn(model, batch)
  update_metrics(ctx, metrics, loss, logits, batch['label'])  # In-place updates. [jr]

def pred_step(ctx: jr.ReplicaContext, batch, model: CNN):  # [jr] no @nnx.jit
  logits = model(batch['image'], None)
  return logits.argmax(axis=1)


def main(train_steps=train_steps, eval_every=eval_every, dropout=True, tx=None, verbose=True):
  rep = jr.Replicator(jr.MirroredStrategy())  # [jr]
  with rep.scope():  # [jr] placed replicated on every device
    # Instantiate the model.
    model = CNN(rngs=nnx.Rngs(0))
    if not dropout:
      model = nnx.view(model, deterministic=True)

  # [jr] BatchNorm's axis bound with size 1: as on one device, running statistics included.
  y = jr.one_replica(model)(jnp.ones((1, 28, 28, 1)), nnx.Rngs(0))
  if verbose:
    print(y)

  with rep.scope():  # [jr]
    optimizer = nnx.Optimizer(
      model, tx or optax.adamw(learning_rate, momentum), wrt=nnx.Param
    )
    metrics = nnx.MultiMetric(
      accuracy=nnx.metrics.Accuracy(),
      loss=nnx.metrics.Average('loss'),
    )

  train_model = nnx.view(model, deterministic=not dropout, use_running_average=False)
  eval_model = nnx.view(model, deterministic=True, use_running_average=True)

  writer = SummaryWriter(verbose)

  rngs = nnx.Rngs(0)

  for step, batch in enumerate(make_batches(train_ds, batch_size)):
    if step >= train_steps:
      break
    # Run the optimization for one step and make a stateful update to the following:
    # - The train state's model parameters
    # - The optimizer state
    # - The training loss and accuracy batch metrics
    rep.run(train_step, batch, train_model, optimizer, metrics, rngs)  # [jr]

    if step > 0 and (step % eval_every == 0 or step == train_steps - 1):  # Evaluation period passed.
      # Log the training metrics.
      for metric, value in metrics.compute().items():  # Compute the metrics.
        writer.add_scalar(f'train_{metric}', value, step) # Record the metrics.
      metrics.reset()  # Reset the metrics for the test set.

      # Compute the metrics on the test set after each training epoch.
      for test_batch in make_batches(test_ds, batch_size):
        rep.run(eval_step, test_batch, eval_model, metrics)  # [jr]

      # Show predicted labels on a single test batch
      pred = rep.run(pred_step, test_batch, eval_model).array.reshape(-1)  # [jr]
      writer.add_scalar('pred_correct', (pred == test_batch['label']).sum(), step)

      # Log the test metrics.
      for metric, value in metrics.compute().items():
        writer.add_scalar(f'test_{metric}', value, step) # Record the metrics.

      metrics.reset()  # Reset the metrics for the next training epoch.

  return writer.scalars, model


if __name__ == '__main__':
  jax.config.update('jax_num_cpu_devices', 8)  # [jr] before JAX starts; CPU only
  main()
