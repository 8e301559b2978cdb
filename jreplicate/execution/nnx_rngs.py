"""Per-replica random streams of Flax NNX arguments inside ``run``.

A one-device step over a global batch draws an independent dropout mask for every row.
Replicated, each replica runs the step on its rows with the same replicated module, so
an ``nnx.Rngs`` (or the ``nnx.RngStream`` an ``nnx.Dropout`` keeps) would give every
replica the same key and the same mask: other statistics than the one-device run's, and
silently. So inside the step each random stream of the NNX arguments draws from its
key folded with the replica's id, ``jax.random.fold_in(key, ctx.replica_id)``
(:func:`fold_streams`), and the original key is put back when the step returns
(:func:`restore`; also when a Flax transform inside the step, e.g. ``nnx.remat``,
hands back a new value of the folded key): the key leaving the step is the replicated
one, and the stream's count (``nnx.RngCount``) advances alike on every replica, so the
module's state stays replicated and the next call draws the next numbers, as one device
would.

* One replica (``num_replicas == 1``): nothing is folded, so a one-replica run draws
  exactly what the plain NNX program draws.
* The replica's id, not the device's: the logical devices of one replica draw alike.
* Under :class:`jreplicate.ParameterServerStrategy` each step already draws from its own
  streams (the key folded with the step's id); a sync group's replicas then fold in
  their id within the group, here.
* :func:`same_on_every_replica` marks streams that should draw the same numbers on every
  replica (a metadata entry on their ``nnx.RngKey``: it changes the program's cache key).
* Raw ``jax.random`` keys and keys in plain dicts (``state.to_pure_dict()``) are not
  streams: they stay as they are, the same on every replica (fold in
  ``ctx.replica_id`` where they should differ).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jreplicate._jax_compat import varying_axes

#: The metadata entry of an ``nnx.RngKey`` whose stream draws the same on every replica.
SAME = "jreplicate_same_on_every_replica"


def same_on_every_replica[T](node: T, *streams: str) -> T:
    """Marks Flax NNX random streams to draw the same numbers on every replica.

    Inside :meth:`jreplicate.Replicator.run` each random stream of the step's NNX
    arguments (an ``nnx.Rngs``, the stream an ``nnx.Dropout`` keeps) draws from its key
    folded with the replica's id, so that, as on one device over the global batch, each
    row gets its own dropout mask. Mark the streams whose draws must instead be
    identical on every replica: noise added to replicated state, a random crop shared
    by all replicas, a stream compared against a one-device program replica by replica.

    Args:
      node: an ``nnx.Rngs``, an ``nnx.RngStream``, or any Flax NNX module or pytree of
        them holding random streams. Marked in place; a stream forked from it later (as
        ``nnx.Dropout(rate, rngs=rngs)`` forks one) is not marked: mark the module that
        holds it.
      *streams: the names (tags) of the streams to mark, e.g. ``"dropout"``; none:
        every stream in ``node``.

    Returns:
      ``node`` itself, so that ``rngs = jr.same_on_every_replica(nnx.Rngs(noise=0))``
      marks inline.

    Raises:
      ValueError: ``node`` holds no random stream, or none of the given name.
      TypeError: a stream name is not a string.

    Example:
      >>> import jax, jax.numpy as jnp, jreplicate as jr
      >>> from flax import nnx
      >>> rep = jr.Replicator(jr.MirroredStrategy())
      >>> drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=0))
      >>> masks = rep.run(lambda ctx, d: d(jnp.ones(16)) != 0, None, drop)
      >>> len({tuple(m.tolist()) for m in masks})  # each replica its own mask
      8
      >>> _ = jr.same_on_every_replica(drop)
      >>> rep.run(lambda ctx, d: d(jnp.ones(16)) != 0, None, drop).shape  # replicated
      (16,)
    """
    for s in streams:
        if not isinstance(s, str):
            raise TypeError(
                f"jr.same_on_every_replica(node, *streams): stream names are strings (a "
                f"stream's tag, e.g. 'dropout'); got {s!r}.")
    keys = _rng_keys_outside(node)
    tags = sorted({str(_tag(k)) for k in keys})
    if not keys:
        raise ValueError(
            f"jr.same_on_every_replica(node): node (a {type(node).__name__}) holds no Flax "
            "NNX random stream (no nnx.RngKey). Pass an nnx.Rngs, an nnx.RngStream, or a "
            "module holding one (e.g. a model with nnx.Dropout(rate, rngs=rngs)).")
    missing = [s for s in streams if s not in tags]
    if missing:
        raise ValueError(
            f"jr.same_on_every_replica(node, {', '.join(map(repr, streams))}): node has no "
            f"random stream named {', '.join(map(repr, missing))}; its streams are "
            f"{', '.join(map(repr, tags))}. Name one of those, or none to mark them all.")
    for k in keys:
        if not streams or _tag(k) in streams:
            k.set_metadata(SAME, True)
    return node


def _tag(key_variable: Any) -> Any:
    return key_variable.get_metadata("tag", None)


def _rng_keys_outside(node: Any) -> list:
    """The ``nnx.RngKey`` Variables in ``node``, each once (empty when Flax is absent)."""
    try:
        from flax import nnx
    except ImportError:  # no Flax: no stream (the caller's error names the fix)
        return []
    return _rng_keys(node, nnx)


def _rng_keys(node: Any, nnx: Any) -> list:
    """The live ``nnx.RngKey`` Variables of NNX objects, pytrees of them and ``nnx.State``s,
    each once (``nnx.state`` dedupes shared ones and returns the objects themselves)."""
    keys = jax.tree.leaves(nnx.state(node, nnx.RngKey),
                           is_leaf=lambda x: isinstance(x, nnx.Variable))
    seen, out = set(), []
    for k in keys:
        if isinstance(k, nnx.RngKey) and id(k) not in seen:
            seen.add(id(k))
            out.append(k)
    return out


class Folded(NamedTuple):
    """A stream key replaced for the step's duration (see :func:`fold_streams`)."""

    variable: Any    # the nnx.RngKey (merged inside the step's trace)
    original: Any    # its replicated key
    folded: Any      # fold_in(original, replica id): what the step draws from


def fold_streams(nodes: tuple, ctx: Any) -> list[Folded]:
    """Gives every unmarked random stream of ``nodes`` this replica's key, in place.

    Args:
      nodes: the NNX arguments, as merged inside the step's trace.
      ctx: the step's :class:`jreplicate.ReplicaContext` (the replica's id and count).

    Returns:
      What :func:`restore` needs to put the original keys back (empty: none folded).
    """
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not nodes or ctx.num_replicas == 1:
        return []
    keys = [k for k in _rng_keys(nodes, nnx) if not k.get_metadata(SAME, False)]
    if not keys:
        return []
    replica = ctx.replica_id
    folded = []
    for k in keys:
        original = k.get_value()
        new = _fold(original, replica)
        if new is None:
            continue  # not a typed key (nnx.RngStream makes every key one): left as is
        k.set_value(new)
        folded.append(Folded(k, original, k.get_value()))
    return folded


def _fold(key: Any, replica: Any) -> Any:
    """``fold_in(key, replica)`` for a typed key array of any shape (a split stream's
    keys each folded), or None for a value that is not a typed key."""
    dtype = getattr(key, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    if key.ndim == 0:
        return jax.random.fold_in(key, replica)
    flat = jax.vmap(jax.random.fold_in, (0, None))(key.reshape(-1), replica)
    return flat.reshape(key.shape)


def restore(folded: list[Folded], out: Any, ctx: Any) -> Any:
    """Puts the original keys back after the step and returns ``out`` with them.

    A stream's key is set back when the step left it folded: the folded key itself, or
    any key that differs across replicas (what a Flax transform inside the step, e.g.
    ``nnx.jit`` or ``nnx.remat``, hands back for it: a new value of the folded key;
    a key differing across replicas could not be written back to the replicated module
    anyway). A replicated key the step set (``nnx.reseed`` with a seed) is the step's.
    Wherever the step returned such a key (``return nnx.state(model)`` after
    ``nnx.merge``) the original is returned instead.
    """
    if not folded:
        return out
    back = {}
    for f in folded:
        back[id(f.folded)] = f
        final = f.variable.get_value()
        if final is f.folded or ctx.axis_name in varying_axes(final):
            f.variable.set_value(f.original)
            back[id(final)] = f._replace(folded=final)

    def put_back(x: Any) -> Any:
        f = back.get(id(x))
        return f.original if f is not None and x is f.folded else x

    if not any(id(x) in back for x in jax.tree.leaves(out)):
        return out
    return jax.tree.map(put_back, out)
