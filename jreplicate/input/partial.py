"""Partial batches: which elements are one, and where one may be dropped (private).

An element is compared with the first step's element spec (the shape and dtype of each
leaf). Its *batched* leaves are those whose leading axis had the batch length in the
first step. An element is a **partial batch** when its batched leaves are all shorter
along that axis, by the same number of rows, and its other leaves are unchanged; any
other difference is an error naming the leaves (e.g. ``x`` shorter while ``y`` keeps
the full length: the leaves no longer hold the same examples).

Under ``partial_batch="drop"`` only a pipeline's *final* element may be a partial
batch: a shorter element that its pipeline follows with more elements is an error
(:func:`mid_stream`), as dropping it would end the input there and lose the rest
unread (e.g. an ``input_fn`` over several files, each ending in a partial batch).
Whether a pipeline ends after an element is known from the step's later elements of
the same pipeline or, for its last one, by reading one element ahead
(:meth:`jreplicate.input.sources.Pipeline.at_end`), only at a shorter element.

Example:
  >>> import numpy as np
  >>> spec = [((4, 3), np.dtype("float32")), ((4,), np.dtype("int32"))]
  >>> leaves = [np.zeros((3, 3), np.float32), np.zeros(3, np.int32)]
  >>> rows_of(leaves, ["['x']", "['y']"], spec, "input element of replica 0")
  (Short(rows=3, batch=4, path="['x']"), [])
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

#: The fix a mid-stream partial batch's error gives.
FIX = ("Yield full batches up to a pipeline's last element (e.g. batch the whole "
       "stream, not each file or shard separately), or use partial_batch='pad', which "
       "pads every shorter element to the full batch and masks the padding "
       "(ctx.batch_mask), so nothing is dropped.")


class Short(NamedTuple):
    """A partial batch: ``rows`` of the first step's ``batch`` rows; ``path`` is its
    first shorter leaf."""

    rows: int
    batch: int
    path: str


def rows_of(leaves: list[np.ndarray], paths: list[str], spec: list[tuple], where: str
            ) -> tuple[Short | None, list[Exception]]:
    """Compares one element's leaves with the first step's ``spec``.

    Args:
      leaves: the element's flat leaves.
      paths: their rendered paths (``"['x']"``; ``"the root"`` for a bare array).
      spec: ``(shape, dtype)`` of each leaf in the first step.
      where: what the messages start with (``"input element of replica 3"``).

    Returns:
      ``(None, [])`` for an element of the first step's shapes, ``(Short, [])`` for a
      partial batch, ``(None, errors)`` (one ValueError per wrong leaf, or one for
      leaves that disagree on the batch length) for anything else.
    """
    problems: list[Exception] = []
    shorter = []  # (index, rows) of leaves only shorter along the leading axis
    for j, (x, (shape, dtype), path) in enumerate(zip(leaves, spec, paths)):
        if x.shape == shape and x.dtype == dtype:
            continue
        if (x.dtype == dtype and x.ndim == len(shape) and x.ndim and x.shape[1:] == shape[1:]
                and x.shape[0] < shape[0]):
            shorter.append((j, x.shape[0]))
            continue
        problems.append(ValueError(
            f"{where} at {path} has shape {x.shape} and dtype {x.dtype}, but the first "
            f"step's elements had {shape} and {dtype}. Elements must keep one shape and "
            "dtype (only a pipeline's final element may be a smaller batch, and it is "
            "dropped)."))
    if problems or not shorter:
        return None, problems  # a leaf changed otherwise: the shorter ones are moot
    batches = {spec[j][0][0] for j, _ in shorter}
    rows = {n for _, n in shorter}
    batched = [j for j, (shape, _) in enumerate(spec) if shape and shape[0] in batches]
    if len(batches) == 1 and len(rows) == 1 and all(leaves[j].shape[0] in rows
                                                     for j in batched):
        j = shorter[0][0]
        return Short(rows.pop(), batches.pop(), paths[j]), []
    listing = ", ".join(f"{paths[j]} {leaves[j].shape[0]} (first step {spec[j][0][0]})"
                        for j in batched)
    return None, [ValueError(
        f"{where} is no partial batch: its leaves disagree on the number of examples "
        f"(rows along the leading axis: {listing}). A partial batch has every batched "
        "leaf shorter by the same number of rows; make every leaf of an element hold "
        "the same examples in input_fn.")]


def mid_stream(where: str, short: Short, step: int) -> ValueError:
    """The error for a partial batch that its pipeline follows with more elements.

    Args:
      where: the element (``"input element of replica 3 (input pipeline 3)"``).
      short: its rows.
      step: the step of the sweep it was read for (1 for the first).
    """
    return ValueError(
        f"{where}, read for step {step} of this sweep of the input, is a partial batch "
        f"({short.path} has {short.rows} rows, the first step's elements {short.batch}), "
        "but its pipeline has more elements after it. With partial_batch='drop' only a "
        "pipeline's final element may be partial (it is dropped); dropping this one "
        f"would end the input here and lose the rest unread. {FIX}")


def detail(rid: int, short: Short) -> str:
    """What a dropped final partial batch was, for its warning."""
    return f"replica {rid} got {short.rows} examples at {short.path}, the others {short.batch}"
