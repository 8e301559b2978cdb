"""Calling code written for the replica axis outside :meth:`jreplicate.Replicator.run`.

A model written for replicas names the replica axis: ``nnx.BatchNorm(...,
axis_name="batch")`` all-reduces its batch statistics over it, a step calls
``jax.lax.pmean(x, "batch")``. Outside ``run`` no axis is bound, and JAX raises
``NameError: unbound axis name: batch`` (e.g. when Flax's tutorial calls the model once
on a sample to check its output shape). :func:`one_replica` runs such code as ONE
replica: the axis is bound with size 1, so every collective over it is the identity and
the code computes what it computes on one device without an ``axis_name``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jreplicate._jax_compat import axis_bound
from jreplicate.context import active_axis_name
from jreplicate.layout import REPLICA_AXIS


def one_replica(fn: Callable[..., Any], *, axis_name: str = REPLICA_AXIS
                ) -> Callable[..., Any]:
    """``fn`` evaluated as one replica: mesh axis ``axis_name`` bound with size 1.

    Use it to call code that names the replica axis outside
    :meth:`jreplicate.Replicator.run`, e.g. a model with ``nnx.BatchNorm(...,
    axis_name="batch")`` in training mode, which otherwise raises ``NameError: unbound
    axis name: batch``. Inside, ``jax.lax.psum`` / ``pmean`` / ``pmax`` over the axis
    return their argument, ``jax.lax.axis_index`` is 0 and ``all_gather`` adds a
    leading axis of 1: the result is that of the same code on one device without an
    ``axis_name`` (for BatchNorm: statistics of the batch given).

    Flax NNX modules passed as arguments, or as ``fn`` itself (a module or one of its
    bound methods), are updated in place as by a call on one device: BatchNorm's running
    statistics move, random streams advance. To leave the model untouched (a shape
    check), call it on ``nnx.clone(model)``, or put it in evaluation mode
    (``model.eval()``: BatchNorm then uses its running statistics and names no axis).

    Nothing is compiled or placed: the call runs where its arguments live (``jax.vmap``
    over a leading axis of size 1 that is added and removed again). Inside a step
    ``run`` is tracing, the replica axis is bound already, over all replicas: call
    ``fn`` directly there.

    Args:
      fn: the function, NNX module or bound method to call; its outputs must be
        pytrees of arrays.
      axis_name: the axis to bind: the name the code uses (the strategy's
        ``axis_name``; default ``jr.REPLICA_AXIS``).

    Returns:
      A function taking ``fn``'s arguments and returning its outputs.

    Raises:
      TypeError: ``fn`` is not callable, or ``axis_name`` is not a non-empty str (at
        once).
      RuntimeError: when called where the axis is bound already (inside ``run``).
      ValueError: when ``fn`` updates an NNX module it closes over instead of taking
        it as an argument (the error names the fix).

    Example (a model written for ``jax.pmap``, called on a sample before training)::

        >>> import jax.numpy as jnp, jreplicate as jr
        >>> from flax import nnx
        >>> model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)),
        ...                        nnx.BatchNorm(4, axis_name="batch", rngs=nnx.Rngs(0)))
        >>> model(jnp.ones((2, 3)))
        Traceback (most recent call last):
        NameError: unbound axis name: batch
        >>> jr.one_replica(model, axis_name="batch")(jnp.ones((2, 3))).shape
        (2, 4)
        >>> jr.one_replica(lambda m, x: m(x).sum(), axis_name="batch")(model, jnp.ones((2, 3)))
        Array(0., dtype=float32)
    """
    if not callable(fn):
        raise TypeError(f"jr.one_replica(fn) must be callable (a function, an NNX module "
                        f"or a bound method), got {type(fn).__name__}.")
    if not isinstance(axis_name, str) or not axis_name:
        raise TypeError(
            f"jr.one_replica(axis_name={axis_name!r}) must be a non-empty str: the axis "
            "name the code uses, e.g. axis_name='batch' (the strategy's axis_name).")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if active_axis_name() is not None or axis_bound(axis_name):
            raise RuntimeError(
                f"jr.one_replica(fn, axis_name={axis_name!r}) was called where a replica "
                "axis is bound already (inside a step Replicator.run is tracing, or a "
                "shard_map). Binding it again with size 1 would give each replica its "
                "own statistics. Call fn directly inside the step.")
        return _call(fn, args, kwargs, axis_name)

    return wrapped


def _call(fn: Callable, args: tuple, kwargs: dict, axis_name: str) -> Any:
    nnx = sys.modules.get("flax.nnx")  # a program that never imported NNX has no modules
    is_node = nnx.graph.is_graph_node if nnx is not None else (lambda x: False)
    target, owner = fn, ()
    if inspect.ismethod(fn) and is_node(fn.__self__):
        target, owner = fn.__func__, (fn.__self__,)
    elif is_node(fn):
        target, owner = type(fn).__call__, (fn,)
    # Arrays and NNX modules enter the vmapped call; anything else (flags such as
    # train=True, strings, None) stays a Python value, as in a direct call.
    leaves, treedef = jax.tree.flatten((owner, args, kwargs), is_leaf=is_node)
    dynamic = [_is_dynamic(x, is_node) for x in leaves]
    operands = [x for x, d in zip(leaves, dynamic) if d]

    def body(operands: list) -> Any:
        it = iter(operands)
        full = [next(it) if d else x for x, d in zip(leaves, dynamic)]
        owner_, args_, kwargs_ = jax.tree.unflatten(treedef, full)
        return target(*owner_, *args_, **kwargs_)

    vmap = nnx.vmap if nnx is not None else jax.vmap
    mapped = vmap(body, in_axes=None, out_axes=0, axis_size=1, axis_name=axis_name)
    try:
        out = mapped(operands)
    except Exception as e:  # broad: only Flax's TraceContextError is translated
        if nnx is None or type(e).__name__ != "TraceContextError":
            raise
        raise ValueError(
            f"jr.one_replica: fn updates a Flax NNX module it closes over ({e}). Pass the "
            "module as an argument, so that its updates land: jr.one_replica(lambda m, x: "
            f"m(x), axis_name={axis_name!r})(model, x), or pass the module itself as fn."
        ) from e
    return jax.tree.map(lambda x: x[0], out)


def _is_dynamic(x: Any, is_node: Callable[[Any], bool]) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) or is_node(x)
