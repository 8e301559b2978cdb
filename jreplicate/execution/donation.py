"""Donation that never destroys an array another live object holds (private).

``run`` donates the state of Flax NNX arguments (always) and the arguments named in
``donate_argnums``. A leaf is donated only when no live object outside ``run`` can reach
it except through the argument itself. Three things are counted
(``sys.getrefcount``):

* **the leaf**: held by nothing but its one place among the arguments (its Variable, its
  container: a dict, list, tuple, NamedTuple, custom pytree node or
  :class:`~jreplicate.PerReplica`, or, for an array passed directly as an argument, the
  caller's variable) and ``run``'s own lists (``best = params["w"]``, ``old = w``, a
  teacher or EMA sharing the arrays);
* **every container on the path from the argument down to the leaf**: each held by
  nothing but its parent (``kept = params["layer"]``, ``opt_state[0]``, a PerReplica
  inside a dict); one held from outside counts for every leaf below it. For NNX
  arguments these are the containers inside a Variable's value (a Variable holding a
  dict): modules, ``nnx.List``/``nnx.data`` containers and Variables are updated in
  place by ``run``, so whoever holds them sees the new state, and are not counted;
* **the argument itself** when it is a container (``best = params``).

Whatever is held from outside is replaced by a copy, and the copy donated: one device
copy of those leaves, usually once, since afterwards the argument holds the step's new
arrays, which nothing else shares. The steady-state path checks the same things with
limits computed when its call shape is recorded (:func:`container_plan`: one
``getrefcount`` per container of a donated plain argument), and sends a call where
anything is held to the full path, which copies.

The counts are exact for leaves and containers inside arguments. For an argument passed
directly the call's own references depend on how ``run`` is called (through
``functools.partial`` or ``*args`` adds some), so such a call may copy where it need
not, never the other way round. A custom pytree node is assumed to hold each of its
children once (as dataclasses, ``flax.struct`` and equinox modules do); one that holds
a child twice makes that child count as held, which copies where it need not.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jreplicate.context import PerReplica

#: How a donated leaf is held outside ``run``: by an NNX Variable, by a container (a
#: pytree node or a PerReplica), or directly as an argument (``run``'s ``*args`` tuple
#: and the caller's variable).
VARIABLE, CONTAINER, ARGUMENT = 1, 1, 2

_flatten_one_level = jax.tree_util.flatten_one_level
_flatten_one_level_with_keys = jax.tree_util.flatten_one_level_with_keys
# Containers whose children are read by subscript (jax flattens them as themselves):
# every other pytree node is read through jax's own one-level flatten.
_SUBSCRIPTED = (dict, list, tuple, collections.OrderedDict, collections.defaultdict)
# A container's references in a check: its parent, the check's local, getrefcount's
# argument (and the list of a generic node's children, see _children).
_CONTAINER_LIMIT = CONTAINER + 2


class DonatedArgument(NamedTuple):
    """A plain argument named in ``donate_argnums``."""

    position: int            # among run's arguments
    leaves: tuple[int, ...]  # its flat leaf indices among the program's inputs


class Containers(NamedTuple):
    """The containers to count (:func:`container_plan`) below ``holder[key]`` (an
    argument is not held here, so as not to add to its own count), and the flat index
    of its first leaf among the program's inputs."""

    holder: Any
    key: Any
    plan: tuple
    start: int


def _held(arrays: list, limit: tuple, args: tuple, arg_limit: tuple) -> list[int]:
    getrefcount = sys.getrefcount
    out = [i for i, n in limit if getrefcount(arrays[i]) > n]
    for k, n, leaves in arg_limit:
        if getrefcount(args[k]) > n:
            out.extend(leaves)
    return out


def held_elsewhere(arrays: list, limit: tuple, args: tuple = (),
                   arg_limit: tuple = (), plans: tuple = ()) -> bool:
    """Whether a donated leaf of ``arrays`` has more references than ``limit`` allows
    (``((leaf index, most references), ...)``, counting its holder outside ``run``, the
    lists of ``run`` that hold it where this is called, and ``getrefcount``'s argument),
    a donated argument that is a container (``args[k]``) more than ``arg_limit``
    allows (``((k, most references, its leaf indices), ...)``: ``best = params``), or a
    container inside donated argument ``args[k]`` more than its plan allows (``((k,
    plan), ...)``, :func:`container_plan`: ``kept = params["layer"]``)."""
    getrefcount = sys.getrefcount  # (the steady-state path: one loop, early exit)
    for i, n in limit:
        if getrefcount(arrays[i]) > n:
            return True
    for k, n, _ in arg_limit:
        if getrefcount(args[k]) > n:
            return True
    for k, plan in plans:
        if _over(args[k], plan):
            return True
    return False


def copy_held_elsewhere(arrays: list, limit: tuple, args: tuple = (),
                        arg_limit: tuple = (), containers: tuple | list = (),
                        may_alias: Any = None) -> None:
    """Replaces each donated leaf another live object holds, directly or through a
    container (``containers``: :class:`Containers`), by a copy (in place; see
    :func:`held_elsewhere`). ``may_alias(i)``: whether leaf ``i`` may share the
    caller's buffers (a leaf below a held container that does not, e.g. one placed
    from NumPy, is not copied)."""
    held = set(_held(arrays, limit, args, arg_limit))
    below: list[int] = []
    for c in containers:
        _held_ranges(c.holder[c.key], c.plan, c.start, below)
    held.update(i for i in below if may_alias is None or may_alias(i))
    for i in sorted(held):
        arrays[i] = jnp.copy(arrays[i])


def argument_limit(args: tuple, groups: tuple, own: int, leaves: list | None = None
                   ) -> tuple:
    """The ``arg_limit`` of :func:`held_elsewhere` for the donated arguments that are
    containers: the call's references (:data:`ARGUMENT`), ``own`` more of ``run``'s (one
    more where the argument is itself one of ``leaves``: a PerReplica), and
    ``getrefcount``'s argument. ``groups``: the donated arguments
    (:class:`DonatedArgument`)."""
    def extra(k, idx):
        return leaves is not None and len(idx) == 1 and leaves[idx[0]] is args[k]

    return tuple((k, ARGUMENT + own + extra(k, idx) + 1, idx) for k, idx in groups
                 if idx and not isinstance(args[k], jax.Array))


def holder(x: Any, donated_value: Any, direct: set[int], is_state: bool) -> int:
    """References to a donated leaf outside ``run`` (see :data:`VARIABLE`): ``x`` is the
    flat leaf as passed (``donated_value`` itself, or a PerReplica holding it), ``direct``
    the ids of ``run``'s arguments."""
    if is_state:
        return VARIABLE
    return ARGUMENT if x is donated_value and id(x) in direct else CONTAINER


# -- containers ----------------------------------------------------------------------

_PLANS: dict = {}
_MAX_PLANS = 256


def container_plan(root: Any, per_replica_held: int = 0) -> tuple | None:
    """What to count below ``root`` (a donated argument, or an NNX Variable whose value
    is a pytree): ``(generic, entries)``, each entry ``(key, most references, its own
    plan or None, first leaf, end leaf)`` (leaves counted from the parent's first) for a
    child container with leaves below it; None when there is none. ``generic``: the
    children are read through ``jax.tree_util.flatten_one_level`` (``key`` their
    position) rather than by subscript (dicts, lists, tuples, NamedTuples: ``key`` the
    dict key or position). ``per_replica_held``: references ``run`` itself holds to a PerReplica
    there (the full path's flat list of leaves holds it). Leaves themselves are not in
    the plan (their limits are counted apart). Depends only on ``root``'s pytree
    structure: cached by it."""
    key = (jax.tree.structure(root), per_replica_held)
    plan = _PLANS.get(key, False)
    if plan is False:
        plan = _plan(root, per_replica_held)[0]
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _plan(node: Any, per_replica_held: int) -> tuple[tuple | None, int, bool]:
    """``(plan of node, number of leaves below it, whether it is a leaf)``."""
    try:
        pairs, _ = _flatten_one_level_with_keys(node)
    except ValueError:  # a leaf
        return None, 1, True
    generic = not (type(node) in _SUBSCRIPTED
                   or (isinstance(node, tuple) and hasattr(type(node), "_fields")))
    entries, count = [], 0
    for j, (path_key, child) in enumerate(pairs):
        sub, n, is_leaf = _plan(child, per_replica_held)
        if n and not is_leaf:
            key = j if generic or not isinstance(path_key, jax.tree_util.DictKey) \
                else path_key.key
            limit = _CONTAINER_LIMIT + generic + \
                (per_replica_held if isinstance(child, PerReplica) else 0)
            entries.append((key, limit, sub, count, count + n))
        count += n
    return ((generic, tuple(entries)) if entries else None), count, False


def _children(node: Any) -> list:
    # A new list: the node's own list (jax returns a list node itself) or a tuple its
    # flatten built are both let go, so each child gets exactly one reference here.
    return list(_flatten_one_level(node)[0])


def _over(node: Any, plan: tuple) -> bool:
    """Whether a container of ``plan`` below ``node`` has more references than allowed."""
    generic, entries = plan
    if generic:
        node = _children(node)
    getrefcount = sys.getrefcount
    for key, limit, sub, _, _ in entries:
        child = node[key]
        if getrefcount(child) > limit or (sub is not None and _over(child, sub)):
            return True
    return False


def _held_ranges(node: Any, plan: tuple, start: int, out: list[int]) -> None:
    """Appends to ``out`` the flat indices (from ``start``) of the leaves below every
    container of ``plan`` below ``node`` that has more references than allowed."""
    generic, entries = plan
    if generic:
        node = _children(node)
    getrefcount = sys.getrefcount
    for key, limit, sub, lo, hi in entries:
        child = node[key]
        if getrefcount(child) > limit:
            out.extend(range(start + lo, start + hi))
        elif sub is not None:
            _held_ranges(child, sub, start + lo, out)
