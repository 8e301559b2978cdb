"""Donation that never destroys an array another live object holds (private).

``run`` donates the state of Flax NNX arguments (always) and the arguments named in
``donate_argnums``. A leaf is donated only when nothing holds it but its one place
among the arguments (its Variable, its container: a dict, list, optax state or
:class:`~jreplicate.PerReplica`, or, for an array passed directly as an argument, the
caller's variable) and ``run``'s own lists. Otherwise (``nnx.clone(model)``, a teacher
or an EMA sharing the arrays, ``best = params["w"]``) a copy is donated in its place:
one device copy of that leaf, usually once, since afterwards the argument holds the
step's new arrays, which nothing else shares.

The count is ``sys.getrefcount``'s: exact for leaves in containers and Variables. For an
array passed directly as an argument the call's own references depend on how ``run`` is
called (through ``functools.partial`` or ``*args`` adds some), so such a call may copy
where it need not, never the other way round.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

#: How a donated leaf is held outside ``run``: by an NNX Variable, by a container (a
#: pytree node or a PerReplica), or directly as an argument (``run``'s ``*args`` tuple
#: and the caller's variable).
VARIABLE, CONTAINER, ARGUMENT = 1, 1, 2


class DonatedArgument(NamedTuple):
    """A plain argument named in ``donate_argnums``."""

    position: int            # among run's arguments
    leaves: tuple[int, ...]  # its flat leaf indices among the program's inputs


def _held(arrays: list, limit: tuple, args: tuple, arg_limit: tuple) -> list[int]:
    getrefcount = sys.getrefcount
    out = [i for i, n in limit if getrefcount(arrays[i]) > n]
    for k, n, leaves in arg_limit:
        if getrefcount(args[k]) > n:
            out.extend(leaves)
    return out


def held_elsewhere(arrays: list, limit: tuple, args: tuple = (),
                   arg_limit: tuple = ()) -> bool:
    """Whether a donated leaf of ``arrays`` has more references than ``limit`` allows
    (``((leaf index, most references), ...)``, counting its holder outside ``run``, the
    lists of ``run`` that hold it where this is called, and ``getrefcount``'s argument),
    or a donated argument that is a container (``args[k]``) more than ``arg_limit``
    allows (``((k, most references, its leaf indices), ...)``: ``best = params``)."""
    getrefcount = sys.getrefcount  # (the steady-state path: one loop, early exit)
    for i, n in limit:
        if getrefcount(arrays[i]) > n:
            return True
    for k, n, _ in arg_limit:
        if getrefcount(args[k]) > n:
            return True
    return False


def copy_held_elsewhere(arrays: list, limit: tuple, args: tuple = (),
                        arg_limit: tuple = ()) -> None:
    """Replaces each donated leaf another live object holds by a copy (in place; see
    :func:`held_elsewhere`)."""
    for i in sorted(set(_held(arrays, limit, args, arg_limit))):
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
