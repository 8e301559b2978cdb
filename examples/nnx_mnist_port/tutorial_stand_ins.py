"""What the tutorial downloads or logs to, standing in so that both programs run offline.

* ``load_dataset``: Flax's tutorial loads MNIST with Hugging Face's
  ``datasets.load_dataset('mnist')`` (70 000 downloaded 28x28 images). This serves
  scikit-learn's 1 797 bundled 8x8 digits through the part of that interface the
  tutorial uses (``dataset['train']``, ``.shuffle(seed=...)``, ``len(ds)``, ``ds[i:j]``
  giving ``{'image': [...], 'label': [...]}`` with 28x28 uint8 images), so the
  tutorial's ``make_batches`` and model run unchanged: each digit is scaled from 0..16
  to 0..255, enlarged 3x to 24x24 and centred in a 28x28 frame (as MNIST centres a
  20x20 digit). 80 % train (1 437 images), 20 % test (360), stratified.
* ``SummaryWriter``: tensorboardX's writer, reduced to ``add_scalar``: it prints each
  value and keeps it in ``scalars`` (``{tag: [(step, value), ...]}``) for the tests.
"""

from __future__ import annotations

import numpy as np


class Split:
    """One split: images ``[n, 28, 28]`` uint8 and labels ``[n]`` int64."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, rows: slice) -> dict:
        return {"image": list(self.images[rows]), "label": list(self.labels[rows])}

    def shuffle(self, seed: int) -> Split:
        order = np.random.default_rng(seed).permutation(len(self))
        return Split(self.images[order], self.labels[order])


def load_dataset(name: str = "mnist") -> dict[str, Split]:
    """``{'train': Split, 'test': Split}`` of the digits (``name`` is ignored)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    small = np.round(digits.images * (255 / 16)).astype(np.uint8)       # [n, 8, 8]
    large = np.kron(small, np.ones((1, 3, 3), np.uint8))                # [n, 24, 24]
    images = np.pad(large, ((0, 0), (2, 2), (2, 2)))                    # [n, 28, 28]
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target, test_size=0.2, random_state=0, stratify=digits.target)
    return {"train": Split(x_train, y_train), "test": Split(x_test, y_test)}


class SummaryWriter:
    """tensorboardX's ``SummaryWriter.add_scalar``, printed and recorded."""

    def __init__(self, verbose: bool = True):
        self.verbose = verbose
        self.scalars: dict[str, list[tuple[int, float]]] = {}

    def add_scalar(self, tag: str, value, step: int) -> None:
        self.scalars.setdefault(tag, []).append((step, float(value)))
        if self.verbose:
            print(f"step {step:4d}  {tag:15s} {float(value):.4f}", flush=True)
