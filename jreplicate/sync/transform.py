"""The ``sync_replicas`` optax transformation (TensorFlow's ``SyncReplicasOptimizer``).

:func:`sync_replicas` checks its options once into a frozen
:class:`~jreplicate.sync.aggregate.Config`; its ``init`` and ``update`` are closures of
a few lines over it, delegating to :func:`_init` and :func:`_update` here, which hands
each call to a driver in ``aggregate.py`` (the way ``optax.MultiSteps`` is written).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jreplicate.context import replica_axis_or_none
from jreplicate.layout import REPLICA_AXIS
from jreplicate.sync import aggregate, checks
from jreplicate.sync.aggregate import Config
from jreplicate.sync.state import SyncReplicasState, TokenQueue

_I32 = checks.I32


def sync_replicas(
    inner: optax.GradientTransformation,
    replicas_to_aggregate: int,
    total_num_replicas: int | None = None,
    variable_averages: float | None = None,
    *,
    variables_to_average: Any | Callable[[optax.Params], Any] | None = None,
    num_tokens: int | None = None,
    axis_name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Synchronous replica training with backup replicas: TF's ``SyncReplicasOptimizer``.

    Gradients are collected in accumulators until ``replicas_to_aggregate`` fresh ones
    of the current step arrived; their average then goes through ``inner`` in one shot
    and ``global_step`` increments once. A gradient computed at ``local_step !=
    global_step`` is stale and dropped. With ``total_num_replicas >
    replicas_to_aggregate`` the surplus replicas are backups: the slowest gradients of
    each step are dropped. With ``total_num_replicas < replicas_to_aggregate`` replicas
    contribute several batches per update. Unlike TensorFlow, drops are counted:
    ``state.dropped_stale`` and ``state.dropped_backup``.

    ``update(grads, state, params, *, local_step=None, arrival_time=None)`` has two
    drivers, chosen by whether the replica mesh axis (``axis_name``) is bound in the
    current trace:

    * **SPMD driver** (inside ``jreplicate.Replicator.run``, whatever the strategy's
      ``axis_name``, or a ``jax.shard_map`` over ``axis_name``): every replica calls
      ``update`` together with ITS OWN gradient (see :func:`.replica_value_and_grad`;
      plain ``jax.grad`` of replicated params is already summed over replicas and is
      rejected). ``arrival_time`` (a
      per-replica scalar, default equal for all, ties broken by replica id; or a vector
      of every replica's time, identical on all replicas, which saves an all-reduce)
      orders the replicas: the fastest ``replicas_to_aggregate - state.num_accumulated`` fresh
      gradients are aggregated (one ``psum``) and the rest count as dropped backups, so
      stragglers are simulated deterministically in one compiled step. Every replica
      leaves ``update`` with the same state and the same updates; the step itself is
      the token barrier, so replicas are always fresh unless ``local_step`` says
      otherwise. With ``replicas_to_aggregate == total`` this is plain synchronous
      data-parallel training. The arrival order is a total order whatever the times
      (compared as float32): ``-inf`` first, then finite times (``-0.0`` equals
      ``0.0``), ``+inf`` after every finite time, NaN after ``+inf`` (the last to
      arrive, still averaged in if needed), and equal times (NaN among them) by
      replica id; so exactly ``min(replicas_to_aggregate - state.num_accumulated,
      fresh)`` gradients are averaged in, never more. Times known when ``update`` is
      traced (a constant, a NumPy array) must not be NaN: ``ValueError``.
    * **Host driver** (outside a replica context): each call is ONE replica's push of a
      gradient computed at ``local_step`` (default: the current ``global_step``). The
      updates are zero until the ``replicas_to_aggregate``-th fresh push of the step,
      which returns ``inner``'s update of the average; ``state.global_step`` has then
      incremented. Replicas take their next ``local_step`` with :func:`.take_token`. With
      one replica and no ``local_step`` this equals ``optax.MultiSteps(inner,
      replicas_to_aggregate, use_grad_mean=True)``.

    Args:
      inner: the transformation applied to each averaged gradient, e.g. ``optax.sgd``.
      replicas_to_aggregate: gradients averaged into each update (>= 1).
      total_num_replicas: replicas pushing gradients (>= 1); default
        ``replicas_to_aggregate`` (host driver) or the replica axis size (SPMD driver,
        which requires the two to be equal when given).
      variable_averages: decay of exponential moving averages of the params, updated
        after each aggregated update (TF's ``ExponentialMovingAverage``); read them with
        :func:`.averaged_params` or ``state.ema``.
      variables_to_average: which params to average: a pytree of bools like params, or
        a function of params returning one; default all.
      num_tokens: initial tokens of the queue, all carrying the starting
        ``global_step``; default ``replicas_to_aggregate``. Must be ``>=
        replicas_to_aggregate - total_num_replicas``.
      axis_name: the replica mesh axis of the SPMD driver. Default ``None``: the axis of
        the step ``Replicator.run`` is tracing (its strategy's ``axis_name``), else
        ``jr.REPLICA_AXIS`` when a hand-written ``jax.shard_map`` binds it; name it
        only for a ``jax.shard_map`` of your own over another axis.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a
      :class:`.SyncReplicasState`. Extra keyword arguments other than ``local_step`` and
      ``arrival_time`` are passed on to ``inner``.

    Raises:
      ValueError: for invalid arguments, at construction, ``init`` or ``update``
        (empty or mismatched gradients, too few tokens, a NaN arrival time known at
        trace time, ...).
      TypeError: for arguments of the wrong type (``inner`` not an optax
        transformation, a count that is not an int, a ``local_step`` that is not an
        integer).

    Example (host driver, TensorFlow's two-worker test):
      >>> import jax.numpy as jnp, optax
      >>> from jreplicate.sync import sync_replicas, take_token
      >>> tx = sync_replicas(optax.sgd(2.0), replicas_to_aggregate=2)
      >>> params = {"v0": jnp.array(0.0), "v1": jnp.array(1.0)}
      >>> state = tx.init(params)
      >>> for w in (0, 1):  # both workers push at local_step 0
      ...     g = {"v0": jnp.array(0.1 + 0.2 * w), "v1": jnp.array(0.9 + 0.2 * w)}
      ...     updates, state = tx.update(g, state, params, local_step=0)
      ...     params = optax.apply_updates(params, updates)
      >>> int(state.global_step), round(float(params["v0"]), 6)
      (1, -0.4)

    Example (SPMD driver, 4 replicas, the slowest one is a dropped backup):
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> from jreplicate.sync import replica_grad
      >>> mesh = jax.make_mesh((4,), ("replica",), devices=jax.devices()[:4])
      >>> tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=3)
      >>> def step(w, state, x, t):
      ...     g = replica_grad(lambda w: jnp.sum(w * x))(w)
      ...     updates, state = tx.update(g, state, w, arrival_time=t[0])
      ...     return optax.apply_updates(w, updates), state
      >>> shard = lambda a: jax.device_put(jnp.array(a), jax.NamedSharding(mesh, P("replica")))
      >>> x, t = shard([1.0, 2.0, 3.0, 100.0]), shard([0.3, 0.1, 0.2, 9.0])
      >>> run = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P("replica"),
      ...               P("replica")), out_specs=(P(), P())))
      >>> w, state = run(jnp.array(0.0), tx.init(jnp.array(0.0)), x, t)
      >>> float(w), int(state.dropped_backup)
      (-2.0, 1)
    """
    cfg = _config(inner, replicas_to_aggregate, total_num_replicas, variable_averages,
                  variables_to_average, num_tokens, axis_name)
    host_update = jax.jit(functools.partial(aggregate.host_update, cfg))

    def init_fn(params: optax.Params) -> SyncReplicasState:
        return _init(cfg, params)

    def update_fn(
        updates: optax.Updates,
        state: SyncReplicasState,
        params: optax.Params | None = None,
        *,
        local_step: Any = None,
        arrival_time: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SyncReplicasState]:
        return _update(cfg, host_update, updates, state, params, local_step, arrival_time,
                       extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _config(
    inner: Any,
    replicas_to_aggregate: Any,
    total_num_replicas: Any,
    variable_averages: Any,
    variables_to_average: Any,
    num_tokens: Any,
    axis_name: str | None,
) -> Config:
    """The arguments of :func:`sync_replicas`, checked; raises naming the bad one."""
    if axis_name is not None and (not isinstance(axis_name, str) or not axis_name):
        raise TypeError(
            f"sync_replicas(axis_name={axis_name!r}) must be a non-empty str naming a mesh "
            "axis, or None (the default) for the replica axis of the step Replicator.run "
            "is running."
        )
    k = checks.check_count(
        "replicas_to_aggregate", replicas_to_aggregate, "gradients averaged per update"
    )
    total = None
    if total_num_replicas is not None:
        total = checks.check_count(
            "total_num_replicas",
            total_num_replicas,
            "replicas pushing gradients; None means replicas_to_aggregate",
        )
    n_tokens = checks.check_num_tokens(num_tokens, k, k if total is None else total)
    decay = None
    if variable_averages is not None:
        if isinstance(variable_averages, bool) or not isinstance(variable_averages, numbers.Real):
            raise TypeError(
                "variable_averages must be a moving-average decay (a float in [0, 1], "
                f"e.g. 0.999) or None, got {variable_averages!r}."
            )
        if not 0.0 <= float(variable_averages) <= 1.0:
            raise ValueError(
                f"variable_averages must be a decay in [0, 1], got {variable_averages}."
            )
        decay = float(variable_averages)
    elif variables_to_average is not None:
        raise ValueError(
            "variables_to_average is only used with variable_averages; pass "
            "variable_averages=<decay>, e.g. 0.999."
        )
    if not (hasattr(inner, "init") and hasattr(inner, "update")):
        raise TypeError(
            "inner must be an optax.GradientTransformation (e.g. optax.sgd(0.1)), got "
            f"{type(inner).__name__}."
        )
    return Config(optax.with_extra_args_support(inner), k, total, n_tokens, decay,
                  variables_to_average, axis_name)


def _init(cfg: Config, params: optax.Params) -> SyncReplicasState:
    """The state before any push: empty accumulators, ``num_tokens`` tokens of step 0."""
    if not jax.tree.leaves(params):
        raise ValueError(
            "sync_replicas: Must supply at least one variable, but params "
            f"{params!r} has no arrays. Pass the pytree of trainable arrays."
        )
    ema = None
    if cfg.decay is not None:
        mask = checks.resolve_mask(cfg.variables_to_average, params)
        ema = jax.tree.map(lambda p, m: jnp.array(p) if m else None, params, mask)
    return SyncReplicasState(
        accumulators=jax.tree.map(jnp.zeros_like, params),
        num_accumulated=checks.zero(),
        global_step=checks.zero(),
        tokens=TokenQueue(
            head_step=checks.zero(),
            head_count=jnp.full((), cfg.n_tokens, _I32),
            per_step=jnp.full((), max(cfg.host_total, cfg.k), _I32),
        ),
        inner_state=cfg.inner.init(params),
        ema=ema,
        late_this_step=checks.zero(),
        dropped_stale=checks.zero(),
        dropped_backup=checks.zero(),
    )


def _update(
    cfg: Config,
    host_update: Callable[..., Any],
    updates: optax.Updates,
    state: SyncReplicasState,
    params: optax.Params | None,
    local_step: Any,
    arrival_time: Any,
    extra_args: dict,
) -> tuple[optax.Updates, SyncReplicasState]:
    """Checks the arguments and picks the driver: SPMD if ``cfg.axis_name`` is bound."""
    if not isinstance(state, SyncReplicasState):
        raise ValueError(
            "sync_replicas: update() needs the state returned by tx.init(params), got "
            f"{type(state).__name__}."
        )
    checks.check_grads(updates, state, params)
    if cfg.decay is not None and params is None:
        raise ValueError(
            "sync_replicas(variable_averages=...) needs the params: call "
            "tx.update(grads, state, params)."
        )
    axis_name = replica_axis_or_none(cfg.axis_name)
    if axis_name is not None:
        n = int(jax.lax.axis_size(axis_name))
        if cfg.total is not None and cfg.total != n:
            raise ValueError(
                f"total_num_replicas={cfg.total} but the {axis_name!r} mesh axis has {n} "
                f"replicas; pass total_num_replicas={n} or None."
            )
        return aggregate.spmd_update(dataclasses.replace(cfg, axis_name=axis_name), updates,
                                     state, params, local_step, arrival_time, n, extra_args)
    if arrival_time is not None:
        raise ValueError(
            "arrival_time is only used inside a replica context (Replicator.run, or a "
            f"shard_map over axis {cfg.axis_name or REPLICA_AXIS!r}); the host driver takes "
            "pushes in call order."
        )
    if local_step is not None:
        local_step = checks.as_scalar(local_step, "local_step", _I32, "int")
    args = (updates, state, params, local_step, extra_args)
    if checks.compilable(args):  # eager call: run one cached compiled program
        return host_update(*args)
    return aggregate.host_update(cfg, *args)
