"""The example's ``configs/default.py``, scaled to the digits: the same fields, a
one-block ResNet (``models._ResNet1``, Flax's own test model: BatchNorm and a residual
block) on 16x16x3 images, three epochs (about 92 % of the held-out digits)."""

from __future__ import annotations

from examples.imagenet_pmap_port.stand_ins import ConfigDict


def get_config() -> ConfigDict:
    """The default hyperparameters (Flax's field names and meanings)."""
    config = ConfigDict()
    config.model = "_ResNet1"  # as defined in the `models` module
    config.dataset = "digits"  # the `tfds.builder` name: stand_ins.DigitsBuilder
    config.image_size = 16  # Flax hard-codes 224 in train_and_evaluate

    config.learning_rate = 0.4  # Flax's 0.1 is for ImageNet; scaled by batch_size / 256
    config.warmup_epochs = 0.5
    config.momentum = 0.9
    config.batch_size = 64
    config.shuffle_buffer_size = 16 * 64
    config.prefetch = 10

    config.num_epochs = 3.0
    config.log_every_steps = 5

    config.cache = False
    config.half_precision = False

    # -1: computed from num_epochs over the whole training split; likewise steps_per_eval.
    config.num_train_steps = -1
    config.steps_per_eval = -1

    config.profile = False  # clu's profiler is not installed here
    return config
