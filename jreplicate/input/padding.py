"""Exact final batches: ``prepare_input(..., partial_batch="pad")`` (private helpers).

A step in which some elements are shorter along their leading (batch) axis (every leaf
by the same number of rows; at a pipeline's end or in its middle), or some pipelines
have run out while others have not, is padded to the first step's shapes with zeros,
and a mask of the real examples travels with the batch: the step reads it as
``ctx.batch_mask`` (float32, ``[per-replica batch]``, 1 for real examples, 0 for
padding). Shapes never change, so nothing recompiles.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jreplicate._tree import path_str, report
from jreplicate.context import MaskedBatch

#: Stands for the element of a replica whose pipeline has run out.
ENDED = object()

MODES = ("drop", "pad")


def check_mode(value: Any) -> str:
    if value not in MODES:
        raise ValueError(
            f"prepare_input(partial_batch={value!r}) must be 'drop' (a final partial batch "
            "is dropped with a warning) or 'pad' (padded with zeros; the step reads "
            "ctx.batch_mask to count only real examples)."
        )
    return value


def masked_treedef(treedef: Any) -> Any:
    """The structure of ``MaskedBatch(element, mask)`` for elements of ``treedef``."""
    element = jax.tree.unflatten(treedef, [0] * treedef.num_leaves)
    return jax.tree.structure(MaskedBatch(element, 0))


def batch_size(spec: list, paths: list) -> int:
    """The per-replica batch size: the common leading axis of every leaf."""
    sizes = {shape[0] if shape else None for shape, _ in spec}
    if len(sizes) != 1 or None in sizes:
        listing = ", ".join(f"{path_str(p) or 'the root'}: {list(shape)}"
                            for (shape, _), p in zip(spec, paths))
        raise ValueError(
            "prepare_input(partial_batch='pad') pads along the leading (batch) axis, so "
            f"every leaf of an element needs one, of one length; got {listing}. Give every "
            "leaf the batch as its first axis, or use partial_batch='drop'."
        )
    return sizes.pop()


def pad_element(leaves: list, paths: list, spec: list, b: int, replica_id: int
                ) -> list:
    """``leaves`` padded with zero rows to ``spec``, plus the mask as a last leaf."""
    n = leaves[0].shape[0] if leaves and leaves[0].ndim else b
    first = (path_str(paths[0]) or "the root") if paths else "the root"
    out, problems = [], []
    for x, (shape, dtype), path in zip(leaves, spec, paths):
        if x.shape == shape and x.dtype == dtype and n == b:
            out.append(x)
            continue
        if (x.dtype == dtype and x.ndim == len(shape) and x.ndim and x.shape[0] == n
                and x.shape[0] < shape[0] and x.shape[1:] == shape[1:]):
            out.append(np.concatenate([x, np.zeros((shape[0] - n,) + shape[1:], dtype)]))
            continue
        problems.append(ValueError(
            f"input element of replica {replica_id} at {path_str(path) or 'the root'} has "
            f"shape {x.shape} and dtype {x.dtype}, but the first step's elements had "
            f"{shape} and {dtype} (and this element's batch is {n}, as at {first}). With "
            "partial_batch='pad' an element may only be shorter along its leading axis, "
            "by the same number of rows in every leaf."
        ))
    report(problems, f"input element of replica {replica_id}")
    out.append((np.arange(b) < n).astype(np.float32))
    return out


def padding_element(spec: list, b: int) -> list:
    """The element of a replica whose pipeline has run out: zeros, mask all 0."""
    return [np.zeros(shape, dtype) for shape, dtype in spec] + [np.zeros(b, np.float32)]
