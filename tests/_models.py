"""Small models and data shared by the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def init_mlp(key, sizes=(16, 32, 10)):
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        k = jax.random.fold_in(key, i)
        params.append({"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)})
    return params


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def per_example_loss(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


class NnxMLP(nnx.Module):
    def __init__(self, sizes=(16, 32, 10), *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(sizes[0], sizes[1], rngs=rngs)
        self.l2 = nnx.Linear(sizes[1], sizes[2], rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def make_data(steps, global_batch, dim=16, classes=10, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, global_batch, dim)).astype(np.float32)
    y = rng.integers(0, classes, size=(steps, global_batch)).astype(np.int32)
    return x, y
