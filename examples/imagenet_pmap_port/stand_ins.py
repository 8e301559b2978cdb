"""Stand-ins for what Flax's ImageNet example needs and this machine lacks.

The example reads ImageNet through ``tensorflow_datasets`` (``tfds.builder``,
``input_pipeline.create_split``), its settings through ``ml_collections.ConfigDict``
and writes metrics through ``clu.metric_writers``. None of them is installed here
(nor is ImageNet), so this module offers objects of the same names and calls:
scikit-learn's digits (1797 8x8 grey images, 10 classes), upscaled to
``image_size`` x ``image_size`` x 3, stand in for ImageNet. ``original.py`` and
``train.py`` import them under the names the example uses, so their bodies stay
Flax's.

A stream is the same whatever its batch size: the examples (the training split
reshuffled every epoch, seeded) cut into batches, so one pipeline of ``batch_size=64``
and one of ``batch_size=8`` read eight times per step give the same global batches.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
from absl import logging

NUM_CLASSES = 10
_TRAIN_FRACTION = 0.8


class ConfigDict(dict):
    """``ml_collections.ConfigDict`` as the example uses it: keys read as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(f"the config has no field {name!r}") from e

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


ml_collections = types.SimpleNamespace(ConfigDict=ConfigDict)


# -- clu.metric_writers ----------------------------------------------------------------
class MetricWriter:
    """``clu.metric_writers.create_default_writer``'s logging writer; it also keeps
    every ``write_scalars`` call in :attr:`scalars` as ``(step, {name: float})``."""

    def __init__(self, logdir: str | None = None, just_logging: bool = False):
        del logdir, just_logging  # nothing is written to disk here
        self.scalars: list[tuple[int, dict[str, float]]] = []

    def write_scalars(self, step: int, scalars: dict[str, Any]) -> None:
        values = {k: float(v) for k, v in scalars.items()}
        self.scalars.append((int(step), values))
        logging.info("[%d] %s", step, ", ".join(f"{k}={v:.6g}" for k, v in values.items()))

    def flush(self) -> None:
        pass  # logging writes at once


metric_writers = types.SimpleNamespace(create_default_writer=MetricWriter)


# -- tensorflow_datasets and the example's input_pipeline --------------------------------
def _load(image_size: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = digits.images.astype(np.float32) / 16.0  # [n, 8, 8] in [0, 1]
    scale = -(-image_size // 8)
    x = np.repeat(np.repeat(x, scale, axis=1), scale, axis=2)[:, :image_size, :image_size]
    x = (x - x.mean()) / x.std()  # the example's MEAN_RGB / STDDEV_RGB normalisation
    x = np.repeat(x[..., None], 3, axis=-1)  # [n, image_size, image_size, 3]
    y = digits.target.astype(np.int32)
    n_train = int(len(x) * _TRAIN_FRACTION)
    return {"train": (x[:n_train], y[:n_train]), "validation": (x[n_train:], y[n_train:])}


class DigitsBuilder:
    """``tfds.builder(name)``'s stand-in: ``info.splits[split].num_examples``."""

    def __init__(self, name: str, image_size: int = 16):
        if name != "digits":
            raise ValueError(f"only the 'digits' data set ships here, not {name!r}")
        self.image_size = image_size
        self.data = _load(image_size)
        self.info = types.SimpleNamespace(splits={
            split: types.SimpleNamespace(num_examples=len(y))
            for split, (_, y) in self.data.items()})


tfds = types.SimpleNamespace(builder=DigitsBuilder)
tf = types.SimpleNamespace(float32=jnp.float32, float16=jnp.float16, bfloat16=jnp.bfloat16)


def create_split(dataset_builder: DigitsBuilder, batch_size: int, image_size: int,
                 dtype: Any = jnp.float32, train: bool = True, cache: bool = False,
                 shuffle_buffer_size: int | None = None, prefetch: int = 0,
                 seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """``input_pipeline.create_split``: an endless stream of ``{'image', 'label'}``
    numpy batches of ``batch_size``. The split is repeated, then batched (the example
    repeats and shuffles its training split before batching), so a stream is one
    sequence of examples cut into batches; the training split is reshuffled every
    epoch (a full shuffle, seeded; ``shuffle_buffer_size``, ``cache`` and ``prefetch``
    are accepted and unused)."""
    del cache, shuffle_buffer_size, prefetch
    if image_size != dataset_builder.image_size:
        raise ValueError(f"create_split(image_size={image_size}) differs from the "
                         f"builder's {dataset_builder.image_size}")
    x, y = dataset_builder.data["train" if train else "validation"]
    x = np.asarray(x, dtype=dtype)
    rng = np.random.default_rng(seed)
    order = np.zeros(0, np.int64)
    while True:
        while len(order) < batch_size:
            epoch = rng.permutation(len(y)) if train else np.arange(len(y))
            order = np.concatenate([order, epoch])
        idx, order = order[:batch_size], order[batch_size:]
        yield {"image": x[idx], "label": y[idx]}


input_pipeline = types.SimpleNamespace(create_split=create_split)
