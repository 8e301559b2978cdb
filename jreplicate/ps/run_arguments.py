"""``Replicator.run``'s arguments under ``ParameterServerStrategy``, checked on the driver.

A step runs later, on a worker, where the SPMD executor checks its arguments again. A
leaf that executor would refuse is refused here, at ``run``, before anything is
scheduled (no step id taken, no :class:`~jreplicate.ps.RemoteValue` made), as
TensorFlow's ``ClusterCoordinator.schedule`` refuses a ``RemoteValue`` argument: every
bad leaf is named in one error (:func:`jreplicate._tree.report`), with its pytree path
and the fix, so that it does not come back later from ``fetch`` or ``join`` as if the
step had failed. The check reads only the caller's arguments, so it runs alike on every
driver.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import jax
import numpy as np

from jreplicate._jax_compat import array_type
from jreplicate._tree import (
    check_fits,
    deleted_array_error,
    is_array_like,
    jax_can_hold,
    native,
    path_str,
    report,
)
from jreplicate.context import PerReplica
from jreplicate.input.iterator import InputIterator
from jreplicate.ps.remote import RemoteValue

_WHAT = "Replicator.run"


def check_run_arguments(batch: Any, args: tuple, skip: Collection[int] = ()) -> None:
    """Raises one error naming every leaf of ``batch`` and ``args`` a step cannot take.

    Args:
      batch: the step's input as given to the executor: a pytree of arrays and
        :class:`~jreplicate.PerReplica` values (or None; the host and per-worker batches
        of an input iterator are not looked at).
      args: the step's other arguments.
      skip: positions in ``args`` not to look at (Flax NNX modules, read on their own).

    Raises:
      TypeError: a leaf is not an array (a ``RemoteValue``, an input iterator, a string,
        any other object), or a NumPy array of a type JAX cannot hold.
      ValueError: an array was donated to an earlier step, or a 64-bit NumPy value does
        not fit JAX's 32-bit type.
    """
    trees = ([] if batch is None else [batch]) + \
        [a for i, a in enumerate(args) if i not in skip]
    # Every leaf plainly fine (the usual case): no pytree paths, which only the errors
    # need (they took half of the driver's CPU per run: 70-90 of 175 us, adam on a
    # 3-layer MLP). Anything else is looked at leaf by leaf, below.
    if all(_plainly_fine(x) for t in trees for x in jax.tree.leaves(t, is_leaf=_MARKED)):
        return
    problems: list[Exception] = []
    if batch is not None:
        _check_tree(batch, "the input batch", problems)
    for i, a in enumerate(args):
        if i not in skip:
            _check_tree(a, f"argument [{i}]", problems)
    report(problems, _WHAT)


def _MARKED(x: Any) -> bool:  # noqa: N802 (a predicate passed as is_leaf)
    return isinstance(x, (PerReplica, RemoteValue, InputIterator))


_ARRAY = array_type() or jax.Array  # concrete arrays (not tracers)
_PLAIN_DTYPES: dict[tuple[np.dtype, bool], bool] = {}


def _plainly_fine(x: Any) -> bool:
    """True if :func:`_check_leaf` passes ``x`` without reading its values: a live
    concrete JAX array, a Python number, or a NumPy value of a type JAX holds that
    :func:`check_fits` does not scan (not 64-bit, or 64-bit types enabled)."""
    if isinstance(x, PerReplica):
        x = x.array
    if type(x) is _ARRAY:
        return not x.is_deleted()
    if isinstance(x, (np.ndarray, np.generic)):
        key = (x.dtype, bool(jax.config.jax_enable_x64))
        plain = _PLAIN_DTYPES.get(key)
        if plain is None:
            wide = native(x.dtype) in (np.int64, np.uint64, np.float64, np.complex128)
            plain = _PLAIN_DTYPES[key] = jax_can_hold(x.dtype) and (key[1] or not wide)
        return plain
    return type(x) in (bool, int, float, complex)


def _check_tree(tree: Any, head: str, problems: list[Exception]) -> None:
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_MARKED)[0]
    for path, x in pairs:
        where = f"{head}{path_str(path)}" if head.startswith("argument") else \
            f"{head} {path_str(path)}".rstrip()
        if isinstance(x, PerReplica):
            x = x.array
        try:
            _check_leaf(x, where)
        except (TypeError, ValueError) as e:
            problems.append(e)


def _check_leaf(x: Any, where: str) -> None:
    if isinstance(x, RemoteValue):
        raise TypeError(
            f"{_WHAT}: {where} is a RemoteValue (the result of a scheduled step), not an "
            "array: a step's arguments are read when run is called, and this value may "
            "not exist yet. Pass value.fetch() (which waits for that step), or leave the "
            "value on the parameter servers (the params passed to tx.init inside "
            "rep.scope() are the shards' current values in every step).")
    if isinstance(x, InputIterator):
        raise TypeError(
            f"{_WHAT}: {where} is an input iterator ({type(x).__name__}), not an array. "
            "Pass one iterator as run's inputs: rep.run(fn, iterator, *args) calls "
            "fn(ctx, batch, *args) with its next batch (a tuple of per-worker iterators, "
            "rep.run(fn, (it1, it2), *args), gives the tuple of their batches); an "
            "iterator inside another pytree or among the arguments is not read.")
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
        raise deleted_array_error(where)
    if not is_array_like(x):
        raise TypeError(
            f"{_WHAT}: {where} is a {type(x).__name__}, not an array. Arguments must be "
            "pytrees of arrays; close over other values in fn (e.g. "
            "functools.partial(step, name=...)), built once outside the training loop: "
            "a new function object each step compiles each step.")
    if isinstance(x, (np.ndarray, np.generic)):
        if not jax_can_hold(x.dtype):
            raise TypeError(
                f"{_WHAT}: {where} is a NumPy array of dtype {x.dtype}, which JAX cannot "
                "hold. Convert it to a numeric type (e.g. encode strings as integer ids), "
                "or close over it in fn.")
        check_fits(np.asarray(x), _named(where))


def _named(where: str) -> Callable[[], str]:
    return lambda: f"{_WHAT}: {where}"
