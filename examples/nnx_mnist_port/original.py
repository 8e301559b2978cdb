"""Flax's NNX MNIST tutorial, as one program on one device: the reference for train.py.

Source: google/flax, docs_nnx/mnist_tutorial.md (the version of 2026-04-23, commit
83e3c21b; flax 0.12), sections 2-7, in the tutorial's order and two-space indentation.
The code is the tutorial's, line for line, except:

* the data: ``load_dataset('mnist')`` (Hugging Face ``datasets``, a download) is
  scikit-learn's bundled digits resized to 28x28x1 (``tutorial_stand_ins.py``); as
  that train split holds 44 batches of 32, ``train_steps = 40`` and ``eval_every = 10``
  (the tutorial: 1200 and 200);
* ``SummaryWriter`` is tensorboardX's reduced to printed, recorded scalars
  (``tutorial_stand_ins.py``); the predictions figure (``plot_predictions``,
  ``writer.add_figure``) is replaced by the number of correct predictions on that test
  batch (``pred_correct``); ``nnx.display`` and section 8 (export to a SavedModel) are
  left out; the shape check prints its output (the notebook shows it);
* the imports are gathered at the top (``matplotlib`` and ``typing.Optional`` unused);
* the cells after the definitions (model, optimizer, metrics, views, training loop) are
  the body of ``main``, whose arguments shorten the run, switch dropout off
  (``dropout=False``: the model and its training view are made deterministic) and
  replace the optimizer (``tx``); it returns the recorded metrics and the model.

``tests/test_nnx_mnist_port.py`` compares train.py with this program without dropout
(train.py draws masks per replica, by construction not these) and with ``optax.sgd``:
Adam divides each gradient by its own magnitude, so gradients that are zero in exact
arithmetic (those of the convolutions' biases, which BatchNorm subtracts again) turn
their float noise into steps of +-learning_rate whose signs depend on the order of a
sum; any two programs that sum in different orders part there.

Run: ``python examples/nnx_mnist_port/original.py``. Its port to jreplicate, 8
replicas, is ``train.py`` beside it; ``diff original.py train.py`` shows every change.
"""
# ruff: noqa: E501 - the tutorial's own long lines, kept as they are

from functools import partial

import jax.numpy as jnp  # JAX NumPy
import numpy as np
import optax
from flax import nnx  # The Flax NNX API.
from tutorial_stand_ins import SummaryWriter, load_dataset

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
    self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
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
  loss = optax.softmax_cross_entropy_with_integer_labels(
    logits=logits, labels=batch['label']
  ).mean()
  return loss, logits

@nnx.jit
def train_step(model: CNN, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, rngs: nnx.Rngs, batch):
  """Train for a single step."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, batch, rngs)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.
  optimizer.update(model, grads)  # In-place updates.

@nnx.jit
def eval_step(model: CNN, metrics: nnx.MultiMetric, batch):
  loss, logits = loss_fn(model, batch)
  metrics.update(loss=loss, logits=logits, labels=batch['label'])  # In-place updates.

@nnx.jit
def pred_step(model: CNN, batch):
  logits = model(batch['image'], None)
  return logits.argmax(axis=1)


def main(train_steps=train_steps, eval_every=eval_every, dropout=True, tx=None, verbose=True):
  # Instantiate the model.
  model = CNN(rngs=nnx.Rngs(0))
  if not dropout:
    model = nnx.view(model, deterministic=True)

  y = model(jnp.ones((1, 28, 28, 1)), nnx.Rngs(0))
  if verbose:
    print(y)

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
    train_step(train_model, optimizer, metrics, rngs, batch)

    if step > 0 and (step % eval_every == 0 or step == train_steps - 1):  # Evaluation period passed.
      # Log the training metrics.
      for metric, value in metrics.compute().items():  # Compute the metrics.
        writer.add_scalar(f'train_{metric}', value, step) # Record the metrics.
      metrics.reset()  # Reset the metrics for the test set.

      # Compute the metrics on the test set after each training epoch.
      for test_batch in make_batches(test_ds, batch_size):
        eval_step(eval_model, metrics, test_batch)

      # Show predicted labels on a single test batch
      pred = pred_step(eval_model, test_batch)
      writer.add_scalar('pred_correct', (pred == test_batch['label']).sum(), step)

      # Log the test metrics.
      for metric, value in metrics.compute().items():
        writer.add_scalar(f'test_{metric}', value, step) # Record the metrics.

      metrics.reset()  # Reset the metrics for the next training epoch.

  return writer.scalars, model


if __name__ == '__main__':
  main()
