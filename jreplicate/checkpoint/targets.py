"""Where each restored leaf goes on this topology (private to jreplicate.checkpoint).

A checkpoint records no placement that another topology could use (Orbax's
``_sharding`` file names the devices that wrote it), so a restore always says where
each array goes. For each leaf of ``init_fn()``'s state, in order:

1. ``restore_or_initialize(init_fn, shardings=...)``: a pytree, or a prefix of one, of
   :class:`jax.sharding.Sharding`, or of :class:`jax.ShapeDtypeStruct` with a
   ``sharding`` (the way Orbax users write ``StandardRestore(abstract_state)``;
   ``None`` leaves a subtree to the next rules); ``rep.state_shardings(...)`` gives
   the shardings a step keeps its state in.
2. The sharding of the template leaf when it is a concrete array on the strategy's
   devices (state ``init_fn`` placed sharded over a ``"model"`` axis, or on a logical
   device). ``jax.eval_shape`` drops the shardings of values placed inside ``init_fn``
   on an Auto mesh, so sharded optimizer state needs rule 1.
3. Replicated on the strategy's mesh.

A :class:`~jax.sharding.NamedSharding` that does not divide a leaf's shape is refused
before anything is read, naming the leaf and the fix.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from jreplicate._tree import path_str
from jreplicate.checkpoint.tree import spec


def _given(x: Any) -> Sharding | None:
    if x is None or isinstance(x, Sharding):
        return x
    sharding = getattr(x, "sharding", None)
    if isinstance(x, jax.ShapeDtypeStruct) and isinstance(sharding, Sharding):
        return sharding
    raise TypeError(
        "restore_or_initialize(shardings=...): each leaf must be a jax.sharding.Sharding, "
        "a jax.ShapeDtypeStruct with a sharding, or None (the default placement), got "
        f"{type(x).__name__}" + (" without a sharding" * isinstance(x, jax.ShapeDtypeStruct))
        + ".")


def _is_given_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Sharding, jax.ShapeDtypeStruct))


def _from_template(leaf: Any, devices: set) -> Sharding | None:
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and not isinstance(leaf, jax.core.Tracer) \
            and sharding.mesh.devices.size and set(sharding.mesh.devices.flat) <= devices:
        return sharding
    return None


def resolve(template: Any, shardings: Any, mesh: Any) -> list[Sharding]:
    """The target sharding of each leaf of ``template`` (in its flatten order).

    Raises:
      TypeError: ``shardings`` holds something else than shardings.
      ValueError: ``shardings`` is not a prefix of ``template``'s structure, or a
        target does not divide its leaf (the message names the leaf and the fix).
    """
    pairs = jax.tree_util.tree_leaves_with_path(template)
    given: list[Sharding | None] = [None] * len(pairs)
    if shardings is not None:
        try:
            full = jax.tree.broadcast(shardings, template, is_leaf=_is_given_leaf)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "restore_or_initialize(shardings=...) must be a pytree of shardings with "
                "init_fn()'s structure, or a prefix of it (one sharding for a whole "
                f"subtree): {str(e).splitlines()[0][:300]}") from None
        given = [_given(x) for x in jax.tree.structure(template).flatten_up_to(full)]
    devices = set(mesh.devices.flat)
    replicated = NamedSharding(mesh, P())
    out = []
    for (path, leaf), target in zip(pairs, given, strict=True):
        target = target or _from_template(leaf, devices) or replicated
        check_divides(target, leaf, path)
        out.append(target)
    return out


def check_divides(target: Sharding, leaf: Any, path: tuple) -> None:
    """Raises ValueError when ``target`` cannot hold ``leaf`` (uneven shards)."""
    if not isinstance(target, NamedSharding):
        return
    shape = tuple(np.shape(leaf))
    entries = tuple(target.spec)
    for d, entry in enumerate(entries):
        if entry is None:
            continue
        if d >= len(shape):
            raise ValueError(
                f"restore_or_initialize: {path_str(path) or 'the root'} {spec(leaf)} cannot "
                f"be placed as {target.spec}: it has {len(shape)} dimensions. Pass "
                "shardings= for it (e.g. NamedSharding(mesh, P()) for replicated).")
        axes = entry if isinstance(entry, tuple) else (entry,)
        ways = math.prod(target.mesh.shape[a] for a in axes)
        if shape[d] % ways:
            raise ValueError(
                f"restore_or_initialize: {path_str(path) or 'the root'} {spec(leaf)} cannot "
                f"be placed as {target.spec} on {ways} devices along dimension {d} "
                f"({'x'.join(map(str, axes))}): {ways} does not divide {shape[d]}. Pass "
                "shardings= for it (e.g. NamedSharding(mesh, P()) for replicated), or "
                f"restore on a mesh whose {'x'.join(map(str, axes))} size divides {shape[d]}.")
