"""Input pipelines: what ``input_fn`` may return, and how it is read."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from jreplicate.input import shutdown
from jreplicate.input.context import InputContext


class Pipeline:
    """One input pipeline: the result of one ``input_fn(ctx)`` call.

    ``input_fn`` may return:

    * an object with ``as_numpy_iterator()`` (a ``tf.data.Dataset``; TensorFlow is never
      imported here);
    * an iterable of pytrees of arrays: a list, a generator, a Grain ``MapDataset``,
      ``IterDataset`` or ``DataLoader``;
    * a parameter-less callable returning a pytree of arrays, called once per element
      (then :meth:`reinitialize` has no effect).

    Re-initialising re-iterates a re-iterable source and calls ``input_fn`` again for a
    one-shot iterator such as a generator.
    """

    def __init__(self, input_fn: Callable[[InputContext], Any], ctx: InputContext):
        self._fn = input_fn
        self.ctx = ctx
        self._open(input_fn(ctx))

    def _open(self, source: Any) -> None:
        self._source = source
        self.kind = _classify(source, self.ctx)
        self._it = None
        self._ahead: tuple | None = None  # the element at_end() read ahead, if any
        if self.kind == "dataset":
            self._it = iter(source.as_numpy_iterator())
        elif self.kind == "iterable":
            self._it = iter(source)

    def next(self) -> Any:
        """The next element; raises StopIteration at the end of the source, and
        InputClosedError for a read that ends after the process began to exit."""
        if self._ahead is not None:  # read ahead by at_end()
            (item,), self._ahead = self._ahead, None
            if isinstance(item, _Raised):
                raise item.error
            return item
        shutdown.start_read()  # user code, not JAX: see shutdown.threads_reading
        try:
            item = self._source() if self.kind == "callable" else next(self._it)
        finally:
            shutdown.end_read()
        shutdown.check_read_kept()
        return item

    def at_end(self) -> bool:
        """Whether the source has no element left (a callable never ends).

        Reads the next element ahead, which the next :meth:`next` returns. A read that
        raises is not the end: the next :meth:`next` raises its error (so that the
        pipelines of one step each give one element or error a step, and stay in step),
        except :class:`~jreplicate.input.shutdown.InputClosedError`, raised here. Only
        used at a shorter element (see :mod:`jreplicate.input.partial`): the reads of
        full elements never look ahead.
        """
        if self.kind == "callable" or self._ahead is not None:
            return False
        try:
            self._ahead = (self.next(),)
        except StopIteration:
            return True
        except shutdown.InputClosedError:
            raise
        except Exception as e:  # broad: a source's error is raised at its read
            self._ahead = (_Raised(e),)
        return False

    def reinitialize(self) -> None:
        """Restarts the pipeline from its first element (no-op for callables)."""
        if self.kind == "callable":
            return
        # A one-shot iterator is its own iterator; testing that with iter(source) would
        # open (and throw away) a fresh pass over a re-iterable source, e.g. start a
        # Grain DataLoader's workers.
        if self.kind == "iterable" and self._it is self._source:
            self._open(self._fn(self.ctx))  # a one-shot iterator: ask input_fn again
        else:
            self._open(self._source)


class _Raised:
    """A read ahead that raised ``error`` (raised again by the next read)."""

    def __init__(self, error: Exception):
        self.error = error


def _classify(source: Any, ctx: InputContext) -> str:
    where = f"input_fn({ctx!r}) returned"
    if hasattr(source, "as_numpy_iterator"):
        return "dataset"
    if isinstance(source, (str, bytes, Mapping, np.ndarray, jax.Array)):
        raise TypeError(
            f"{where} a {type(source).__name__}, which looks like a single element rather "
            "than a source of elements. Return an iterable of per-replica batches (e.g. a "
            "generator), a dataset, or a parameter-less callable that returns one batch."
        )
    if isinstance(source, Iterable):
        return "iterable"
    if callable(source):
        return "callable"
    raise TypeError(
        f"{where} a {type(source).__name__}, which is neither iterable nor callable. Return "
        "an iterable of per-replica batches (generator, list, Grain dataset/loader, "
        "tf.data.Dataset) or a parameter-less callable that returns one batch."
    )
