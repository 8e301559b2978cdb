"""How one step function serves every strategy: :func:`pushable` optax transformations.

Under an SPMD strategy (Mirrored, MultiWorker, TPU) the step computes gradients and
applies them itself: ``updates, opt_state = tx.update(grads, opt_state, params)``. Under
:class:`jreplicate.ParameterServerStrategy` the same call must become a push of
``grads`` to the parameter servers, which own the parameters and the optimizer state.
An optax transformation is a pair of closures that cannot be intercepted from outside,
so the step's transformation is wrapped once, where it is created:

    tx = jr.ps.pushable(optax.adam(1e-3))

* Everywhere except a parameter-server worker, ``pushable(tx)`` **is** ``tx``: its
  ``init`` and ``update`` call ``tx``'s (bit for bit the same results).
* ``tx.init(params)`` inside ``rep.scope()`` of a ParameterServerStrategy also hands
  ``(tx, params)`` to the strategy: the parameters are placed on the PS shards, each
  shard initialises ``tx``'s state over its pieces, and the two arguments of later
  ``run`` calls that are these ``params`` and this state are recognised by identity.
* While a PS worker traces the step, ``update(grads, ...)`` records ``grads`` (summed
  over the worker's sync group, as under Mirrored) and returns zero updates (``-0.0``,
  so that ``optax.apply_updates`` returns the parameters bit for bit) and the state
  unchanged; the worker pushes the recorded gradients once per step, and the
  shards apply them with ``tx``.

Flax NNX: ``nnx.Optimizer(model, jr.ps.pushable(tx), wrt=...)`` created in the scope
registers ``nnx.state(model, wrt)``; ``run(step, inputs, model, optimizer)`` recognises
the model by the identity of those arrays, and each worker step runs on a fresh copy of
both (built from their graph and state) with the pulled parameters written into the
model; ``optimizer.update(model, grads)`` calls ``tx.update``, which records the push.

Limits: one ``pushable`` transformation per step (a GAN's two optimizers are not
supported under the PS yet); the step's state outputs under the PS are the worker's
snapshot, and NNX arguments on the coordinator are not updated (read the trained
parameters with ``strategy.parameters()``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax

_TRACE = threading.local()  # .sink: list of captured gradients while a PS worker traces
#: The parameter-server executor whose scope is active (it registers pushable inits).
REGISTRY: contextvars.ContextVar[Any] = contextvars.ContextVar("jreplicate_ps_registry",
                                                               default=None)


class PushableTransformation(optax.GradientTransformationExtraArgs):
    """An optax transformation that a parameter-server worker turns into a push.

    Build it with :func:`pushable`; ``inner`` is the wrapped transformation.
    """

    def __new__(cls, init, update, inner):
        self = super().__new__(cls, init, update)
        object.__setattr__(self, "_inner", inner)
        return self

    def __reduce__(self):
        return (PushableTransformation, (self.init, self.update, self._inner))

    @property
    def inner(self) -> optax.GradientTransformationExtraArgs:
        return self._inner


def pushable(tx: optax.GradientTransformation) -> PushableTransformation:
    """Wraps ``tx`` so that the same step runs under every strategy (see module doc).

    Args:
      tx: any optax transformation, including :func:`jreplicate.sync_replicas`.

    Returns:
      A transformation equal to ``tx`` except on a parameter-server worker.

    Example:
      >>> import jax.numpy as jnp, optax, jreplicate as jr
      >>> tx = jr.ps.pushable(optax.sgd(0.5))
      >>> u, _ = tx.update(jnp.ones(2), tx.init(jnp.zeros(2)))
      >>> u.tolist()
      [-0.5, -0.5]
    """
    if isinstance(tx, PushableTransformation):
        return tx
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(
            "pushable(tx): tx must be an optax.GradientTransformation (e.g. "
            f"optax.adam(1e-3)), got {type(tx).__name__}.")
    inner = optax.with_extra_args_support(tx)

    def init(params):
        state = inner.init(params)
        registry = active_registry()
        if registry is not None:
            registry.register(inner, params, state)
        return state

    def update(grads, state, params=None, **extra):
        sink = active_sink()
        if sink is not None:
            sink.append(grads)
            return sink.zero_updates(grads), state
        return inner.update(grads, state, params, **extra)

    return PushableTransformation(init, update, inner)


# Module-level accessors: the closures above reach the thread-local and the context
# variable through them, so that cloudpickle (Ray) pickles them by reference.
def active_registry() -> Any:
    """The parameter-server executor whose scope is active on this thread, or None."""
    return REGISTRY.get()


class Sink(list):
    """The gradients a PS worker's step pushed (one entry per pushable update), and the
    zero updates those returned, by ``id`` (see :func:`zero_updates`)."""

    def __init__(self):
        super().__init__()
        self.zeros: dict[int, Any] = {}

    def zero_updates(self, grads: Any) -> Any:
        """The updates a pushable update returns on a PS worker: ``-0.0`` everywhere (both
        parts of a complex value), so that ``params + updates`` is ``params`` bit for bit
        (``+0.0`` would turn a ``-0.0`` parameter into ``+0.0``). Recorded, so that the
        worker can tell an output that is a parameter plus them from a new value
        (``worker._forward``)."""
        updates = jax.tree.map(_negative_zeros, grads)
        self.zeros.update((id(u), u) for u in jax.tree.leaves(updates))
        return updates


def _negative_zeros(g: Any) -> Any:
    """``-0.0`` shaped like ``g``: both parts of a complex value (``-0.0 + 0.0j`` would
    turn a ``-0.0`` imaginary part into ``+0.0``); ``0`` for integers."""
    return jnp.full_like(g, complex(-0.0, -0.0) if jnp.iscomplexobj(g) else -0.0)


def active_sink() -> Sink | None:
    """The :class:`Sink` capturing gradients on this thread (a PS worker tracing), or
    None."""
    return getattr(_TRACE, "sink", None)


@contextlib.contextmanager
def capturing() -> Iterator[Sink]:
    """While active (on this thread), pushable updates record their gradients in the
    yielded :class:`Sink` instead of computing updates."""
    prev = getattr(_TRACE, "sink", None)
    _TRACE.sink = sink = Sink()
    try:
        yield sink
    finally:
        _TRACE.sink = prev
