"""Pytree helpers shared by the modules (private)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def path_str(path: tuple) -> str:
    """Renders a key path as ``['a'][0].b`` (empty for the root)."""
    return jax.tree_util.keystr(path)


def is_array_like(x: Any) -> bool:
    """True for JAX arrays/tracers, numpy arrays/scalars and Python numbers."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex))


def flatten_arrays(tree: Any, message: Callable[[tuple, Any], str]) -> tuple[list, Any]:
    """``tree_flatten_with_path`` that raises ``TypeError(message(path, leaf))`` for the
    first leaf that is not array-like."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    for path, leaf in pairs:
        if not is_array_like(leaf):
            raise TypeError(message(path, leaf))
    return pairs, treedef


def check_array_leaves(tree: Any, what: str) -> None:
    """Raises TypeError naming the first leaf of ``tree`` that is not array-like."""
    flatten_arrays(tree, lambda path, leaf: (
        f"{what}: the leaf at {what_path(path)} is a {type(leaf).__name__}, not an "
        "array. Collectives and replicated computation work on pytrees of arrays "
        "(jax.Array, numpy arrays or Python numbers); remove the leaf or close over "
        "it as a constant in your step function instead."))


def what_path(path: tuple) -> str:
    s = path_str(path)
    return f"path {s}" if s else "the root"
