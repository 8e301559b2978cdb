"""Detection of ``jax.pmap`` habits that silently change a replicated step's numbers.

Under :meth:`jreplicate.Replicator.run` the gradient of a replicated argument is
already **summed** over the replicas (JAX transposes the implicit "replicated to
per-replica" cast of the argument into a ``psum``). Code ported from ``jax.pmap``
keeps two habits that then give an N-times update on N replicas, silently:

* ``"mean_loss"``: a per-replica **mean** loss (``jnp.mean(per_example_loss)``, or a
  sum divided by this replica's example count) is differentiated with respect to
  replicated state: the summed gradient is N times the one-device gradient of the
  global-batch mean. The fix is :func:`jreplicate.compute_average_loss`.
* ``"batch_independent_term"``: a loss term that does not depend on the batch (an L2
  penalty on the parameters) is added on every replica, so its gradient is summed N
  times (N-times weight decay). The fix is
  :func:`jreplicate.scale_regularization_loss`.
* ``"invariant_all_reduce"``: ``lax.psum`` / ``lax.pmean`` / ``ctx.all_sum`` of a value
  that is already identical on every replica (for instance the gradients, which are
  already summed): ``psum`` multiplies it by N, ``pmean`` returns it unchanged (a wasted
  all-reduce that marks the pmap habit ``pmean(grads)``).

:func:`find` reads the step's jaxpr, once per compiled program, at the first call
(nothing runs on the steady-state path), and :func:`report` warns with
:class:`ReplicationHabitWarning` naming the step, the source line and the fix. What
each check catches, and what it cannot, is listed in ``docs/guides/getting_started.md``
("Warnings about pmap habits"). Everything here is a pure function of the trace, so
every process of a multi-process job finds the same habits.
"""

from __future__ import annotations

import gc
import itertools
import logging
import math
import os
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from jreplicate import _jax_compat

_log = logging.getLogger("jreplicate")

#: The habit that ``lax.psum`` / ``lax.pmean`` / ``ctx.all_sum`` reduce a value that is
#: identical on every replica.
INVARIANT_ALL_REDUCE = "invariant_all_reduce"
#: The habit of differentiating a per-replica mean loss with respect to replicated state.
MEAN_LOSS = "mean_loss"
#: The habit of adding a batch-independent loss term on every replica, unscaled.
BATCH_INDEPENDENT_TERM = "batch_independent_term"
#: Every name ``Replicator.run(..., allow=...)`` accepts.
HABITS = (INVARIANT_ALL_REDUCE, MEAN_LOSS, BATCH_INDEPENDENT_TERM)


class ReplicationHabitWarning(UserWarning):
    """A replicated step does something that is right under ``jax.pmap`` but changes the
    numbers under :meth:`jreplicate.Replicator.run` (an N-times gradient, an all-reduce
    of a value that is the same on every replica).

    Raised once per compiled step, at its first call, with the step's name, the source
    line and the fix. Silence what you do on purpose with ``rep.run(...,
    allow=("mean_loss",))`` (names: ``"mean_loss"``, ``"batch_independent_term"``,
    ``"invariant_all_reduce"``), or make it an error with
    ``warnings.simplefilter("error", jr.ReplicationHabitWarning)``.

    Example (a pmap port's per-replica mean loss: 2 replicas, a 2x update):
      >>> import warnings, jax, jax.numpy as jnp, jreplicate as jr
      >>> rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
      >>> with rep.scope():
      ...     w = jnp.ones(3)
      >>> def step(ctx, x, w):
      ...     return w - 0.1 * jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     _ = rep.run(step, jnp.ones((4, 3)), w)
      >>> [type(c.message).__name__ for c in caught]
      ['ReplicationHabitWarning']
      >>> "jr.compute_average_loss(per_example_loss, global_batch_size)" in str(
      ...     caught[0].message)
      True
    """


class Finding(NamedTuple):
    """One habit found in a step's jaxpr."""

    habit: str          # one of HABITS
    op: str             # "psum", "pmean", "mean" or "term"
    source: tuple       # the equation's JAX source info, then its enclosing calls'
    divisor: float | None = None  # "mean": the per-replica example count divided by


# -- the allow keyword --------------------------------------------------------------------
_checked_allow: dict = {}


def check_allow(allow: Any) -> frozenset:
    """``Replicator.run``'s ``allow=`` as a frozenset of habit names; ``ValueError``
    naming the argument and the valid names otherwise (the same on every process)."""
    try:
        hit = _checked_allow.get(allow)
    except TypeError:  # unhashable (a list): checked below, not cached
        hit = None
    if hit is not None:
        return hit
    names = (allow,) if isinstance(allow, str) else allow
    try:
        got = tuple(names)
    except TypeError:
        got = None
    if got is None or not all(isinstance(n, str) and n in HABITS for n in got):
        raise ValueError(
            f"Replicator.run(..., allow={allow!r}): allow names the replication habits a "
            f"step does on purpose, a name or a tuple of names among {HABITS!r} (see "
            "jr.ReplicationHabitWarning), e.g. allow=('mean_loss',).")
    out = frozenset(got)
    if isinstance(allow, (str, tuple, frozenset)) and len(_checked_allow) < 256:
        _checked_allow[allow] = out
    return out


# -- the step's graph ---------------------------------------------------------------------
#: Call-like primitives whose body is read as part of the caller's graph.
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "remat2",
                     "checkpoint", "custom_jvp_call", "custom_vjp_call",
                     "custom_vjp_call_jaxpr", "named_call"})
#: All-reduce sums.
_PSUMS = frozenset({"psum_invariant", "psum"})
#: Equations a constant, or the scale of a cotangent, passes through unchanged.
_SAME_VALUE = frozenset({"pvary", "convert_element_type", "copy", "copy_p", "reshape",
                         "squeeze", "expand_dims", "broadcast_in_dim"})
#: Bounds on the short walks (a scalar chain is a handful of equations).
_SHORT_WALK = 64


class _Node(NamedTuple):
    prim: str
    params: dict
    ins: tuple      # operands: (scope, Var) keys, or JAX literals
    outs: tuple     # (scope, Var) keys
    transposed: bool  # made by transposing a differentiated function (the backward pass)
    source: tuple     # source infos: the equation's, then its enclosing calls'


def _aval(atom: Any) -> Any:
    return atom[1].aval if isinstance(atom, tuple) else atom.aval


def _shape(atom: Any) -> tuple:
    return tuple(getattr(_aval(atom), "shape", ()))


def _varies(atom: Any, axis: str) -> bool:
    return axis in _jax_compat.aval_varying_axes(_aval(atom))


class _Graph:
    """One jaxpr with the bodies of its calls (``jax.jit``, ``jax.checkpoint``, custom
    derivatives) inlined: each equation a :class:`_Node`, with its producers and
    consumers. Bodies of loops and conditionals are read as graphs of their own."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.producer: dict = {}
        self.consumers: dict = defaultdict(list)
        self.consts: dict = {}
        self._scopes = itertools.count()

    def build(self, jaxpr: Any, transposed: bool, roots: list, operands: tuple = (),
              outer: tuple = ()) -> list:
        """Adds ``jaxpr``'s equations (its inputs bound to ``operands``); returns the
        atoms of its outputs. Bodies not inlined are appended to ``roots``. ``outer``:
        the source infos of the calls it is the body of, innermost first (a traceback
        recorded inside a ``jax.jit`` stops at its boundary: the call names the line)."""
        inner = getattr(jaxpr, "jaxpr", jaxpr)
        consts = getattr(jaxpr, "consts", ())
        scope = next(self._scopes)
        env: dict = dict(zip(inner.invars, operands))
        for v, c in zip(inner.constvars, consts):
            self.consts[(scope, v)] = c

        def atom(v: Any) -> Any:
            return v if _jax_compat.is_literal(v) else env.get(v, (scope, v))

        for eqn in inner.eqns:
            names = _jax_compat.transform_names(eqn.source_info)
            t = transposed or "transpose" in names
            ins = tuple(atom(v) for v in eqn.invars)
            name = eqn.primitive.name
            subs = _jax_compat.sub_jaxprs(eqn.params)
            if name in _INLINE and len(subs) == 1 and _fits(subs[0], eqn):
                body = self.build(subs[0], t, roots, ins, (eqn.source_info, *outer))
                for o, a in zip(eqn.outvars, body):
                    env[o] = a
                continue
            # (a forward pass recomputed inside a transposed jax.checkpoint is forward)
            node = _Node(name, eqn.params, ins, tuple((scope, o) for o in eqn.outvars),
                         t and "scope:rematted_computation" not in names,
                         (eqn.source_info, *outer))
            self.nodes.append(node)
            for o in node.outs:
                self.producer[o] = node
            for a in ins:
                if isinstance(a, tuple):
                    self.consumers[a].append(node)
            roots.extend((s, t, node.source) for s in subs)
        return [atom(v) for v in inner.outvars]

    # -- constants and scales ---------------------------------------------------------
    def const(self, a: Any, depth: int = 0) -> float | None:
        """The value of a scalar constant operand (through casts), else None."""
        if _jax_compat.is_literal(a):
            val = a.val
        elif a in self.consts:
            val = self.consts[a]
        else:
            p = self.made(a)
            if p is None or p.prim not in _SAME_VALUE or not p.ins or depth > 8:
                return None
            return self.const(p.ins[0], depth + 1)
        try:
            arr = np.asarray(val)
        except Exception:  # noqa: BLE001 - an opaque constant (a key, a token): no value
            return None
        if arr.ndim != 0 or arr.dtype.kind not in "biuf":
            return None
        return float(arr)

    def scale(self, node: _Node, through: Any) -> float | None:
        """The constant factor ``node`` multiplies ``through`` by (a ``div`` by a
        constant, or a ``mul`` by one), else None."""
        if node.prim == "div" and node.ins[0] == through:
            c = self.const(node.ins[1])
            return None if not c else 1.0 / c
        if node.prim == "mul":
            other = [a for a in node.ins if a != through]
            if len(other) == 1:
                return self.const(other[0])
        return None

    def factor(self, node: _Node) -> float | None:
        """The constant factor of a ``div`` by a constant or a ``mul`` by one."""
        if node.prim == "div":
            return self.scale(node, node.ins[0])
        if node.prim == "mul" and len(node.ins) == 2:
            a, b = (self.const(x) for x in node.ins)
            if a is not None and b is not None:  # (a constant cotangent: the seed)
                return a * b
            return a if b is None else b
        return None

    def through(self, node: _Node) -> Any:
        """The operand a ``div`` or ``mul`` by a constant scales."""
        if node.prim == "mul" and self.const(node.ins[1]) is None:
            return node.ins[1]
        return node.ins[0]

    def divided_by(self, a: Any, n: int) -> bool:
        """Whether ``a`` is a value divided by ``n`` (``x / num_replicas``, as
        :func:`jreplicate.scale_regularization_loss` computes)."""
        for _ in range(8):
            p = self.made(a)
            if p is None:
                return False
            if _near(self.factor(p), 1.0 / n):
                return True
            if p.prim not in _SAME_VALUE:
                return False
            a = p.ins[0]
        return False

    def then_divided_by(self, a: Any, n: int) -> bool:
        """Whether ``a`` is next divided by ``n`` (``lax.pmean``'s division, or the
        backward pass of ``x / num_replicas``), through casts and constant factors."""
        todo, seen = [a], set()
        while todo and len(seen) < _SHORT_WALK:
            x = todo.pop()
            for c in self.consumers.get(x, ()):
                if id(c) in seen:
                    continue
                seen.add(id(c))
                if c.prim == "div" and c.ins[0] == x and _near(self.const(c.ins[1]), n):
                    return True
                if c.prim in _SAME_VALUE or self.scale(c, x) is not None or c.prim == "neg":
                    todo.extend(c.outs)
        return False

    def made(self, a: Any) -> _Node | None:
        """The equation that made ``a`` (None for a literal or an input)."""
        return self.producer.get(a) if isinstance(a, tuple) else None

    def back(self, a: Any) -> _Node | None:
        """The transposed equation that made ``a``, else None."""
        p = self.made(a)
        return p if p is not None and p.transposed else None


def _fits(sub: Any, eqn: Any) -> bool:
    inner = getattr(sub, "jaxpr", sub)
    return len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars)


def _near(x: float | None, y: float) -> bool:
    return x is not None and math.isclose(x, y, rel_tol=1e-5)


def _axes(node: _Node) -> tuple:
    axes = node.params.get("axes", ())
    return axes if isinstance(axes, tuple) else (axes,)


# -- the checks -----------------------------------------------------------------------------
def find(closed_jaxpr: Any, axis: str, num_replicas: int) -> list[Finding]:
    """The habits in a traced step (``jax.jit(...).trace(...).jaxpr``) whose replica
    mesh axis is ``axis`` with ``num_replicas`` replicas, each found once, in program
    order. None with one replica (nothing is then summed)."""
    if num_replicas <= 1:
        return []
    # A large step is tens of thousands of small tuples: the collector's passes over
    # them (and over the jaxpr) would cost more than the reading itself.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _find(closed_jaxpr, axis, num_replicas)
    finally:
        if was_enabled:
            gc.enable()


def _find(closed_jaxpr: Any, axis: str, num_replicas: int) -> list[Finding]:
    found: list[Finding] = []
    todo, seen = [(closed_jaxpr, False, ())], set()
    while todo:
        jaxpr, transposed, outer = todo.pop(0)
        if id(jaxpr) in seen:
            continue
        seen.add(id(jaxpr))
        graph, roots = _Graph(), []
        graph.build(jaxpr, transposed, roots, outer=outer)
        found += _check(graph, axis, num_replicas)
        todo += roots
    unique, keys = [], set()
    for f in found:
        key = (f.habit, _location(f.source))
        if key not in keys:
            keys.add(key)
            unique.append(f)
    return unique


def _check(g: _Graph, axis: str, n: int) -> list[Finding]:
    found, grads = [], []
    for node in g.nodes:
        if node.prim not in _PSUMS or axis not in _axes(node) or not node.ins:
            continue
        if node.transposed:  # the sum over replicas of a replicated value's gradient
            if not g.then_divided_by(node.outs[0], n):  # (grads / num_replicas: a mean)
                grads.append(node)
            continue
        src = g.made(node.ins[0])
        # (a constant all-reduced counts the replicas, as ctx.all_sum(1.0): on purpose)
        if src is not None and src.prim == "pvary" and axis in _axes(src) \
                and g.const(src.ins[0]) is None and not g.divided_by(src.ins[0], n):
            op = "pmean" if g.then_divided_by(node.outs[0], n) else "psum"
            found.append(Finding(INVARIANT_ALL_REDUCE, op, node.source))
    return _mean_losses(g, grads, axis, n) + _terms(g, grads, axis) + found


def _mean_losses(g: _Graph, grads: list[_Node], axis: str, n: int) -> list[Finding]:
    """Per-replica means on the backward path of the summed gradients: a scalar
    cotangent that varies over the replicas, scaled by ``1 / S`` and broadcast to the
    ``S`` elements it was the mean of (the transpose of ``jnp.mean``), unless the loss
    was averaged over the replicas first (``lax.pmean(jnp.mean(...))``)."""
    found, seen = [], set()
    todo = [p.ins[0] for p in grads]
    while todo:
        node = g.back(todo.pop())
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.prim == "broadcast_in_dim" and _shape(node.ins[0]) == () \
                and _varies(node.outs[0], axis):
            size = math.prod(_shape(node.outs[0]))
            q = g.back(node.ins[0])
            while q is not None and q.prim == "convert_element_type":
                q = g.back(q.ins[0])
            # (a mean of one element is also its sum: right, and not told apart)
            if q is not None and size > 1 and _near(g.factor(q), 1.0 / size):
                if not _averaged(g, g.through(q), axis, n):
                    found.append(Finding(MEAN_LOSS, "mean", q.source, float(size)))
        todo.extend(a for a in node.ins if isinstance(a, tuple))
    return found


def _averaged(g: _Graph, ct: Any, axis: str, n: int) -> bool:
    """Whether the scalar cotangent ``ct`` comes through the transpose of a mean over
    the replicas (the differentiated loss was ``lax.pmean``-ed: a division by ``n``
    before an all-reduce)."""
    todo, steps, reduced = [ct], 0, False
    while todo and steps < _SHORT_WALK:
        node = g.back(todo.pop())
        steps += 1
        if node is None:
            continue
        if node.prim == "pvary" and axis in _axes(node):
            reduced = True
        elif reduced and _near(g.factor(node), 1.0 / n):
            return True
        todo.extend(a for a in node.ins if isinstance(a, tuple) and _shape(a) == ())
    return False


def _terms(g: _Graph, grads: list[_Node], axis: str) -> list[Finding]:
    """Summed gradients of a scalar whose cotangent is the loss's seed times constants
    only: a term added to every replica's loss that depends on no per-replica data."""
    found = []
    for p in grads:
        if _shape(p.ins[0]) != () or not _seed_only(g, p.ins[0], axis):
            continue
        found.append(Finding(BATCH_INDEPENDENT_TERM, "term", p.source))
    return found


def _seed_only(g: _Graph, ct: Any, axis: str) -> bool:
    todo, steps = [ct], 0
    while todo:
        a = todo.pop()
        steps += 1
        if steps > _SHORT_WALK or _shape(a) != ():
            return False
        node = g.back(a)
        if node is None:  # a leaf: the seed (a constant) or a forward value
            if _varies(a, axis) and g.const(a) is None:
                return False  # per-replica data: the term depends on the batch
            continue
        if node.prim == "pvary":  # the loss went through an all-reduce: not this case
            return False
        todo.extend(a for a in node.ins if not _jax_compat.is_literal(a))
    return True


# -- the warning ----------------------------------------------------------------------------
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARIES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def _not_users(filename: str) -> bool:
    """Frames passed over when naming the line: jreplicate's and installed libraries'
    (Flax's Linear where a parameter meets the batch, optax's losses)."""
    return filename.startswith(_PACKAGE + os.sep) or any(s in filename for s in _LIBRARIES)


def _location(source: tuple) -> tuple | None:
    """``(file, line, column, function)`` of the user's line behind an equation: its
    own traceback's, else its enclosing calls' (innermost first)."""
    for info in source:
        where = _jax_compat.user_source(info, _not_users)
        if where is not None and not _not_users(where[0]):
            return where
    for info in source:  # only library frames: the innermost outside JAX
        where = _jax_compat.user_source(info, _not_users)
        if where is not None:
            return where
    return None


def log_failure(fn: Callable, error: Exception) -> None:
    """Logs that reading a step's jaxpr failed (an equation this module does not know
    how to read): the step runs unchecked, as it would have before this check."""
    _log.warning("jreplicate: the check for pmap habits could not read step %s's "
                 "program (%s: %s); the step runs unchecked.", step_name(fn),
                 type(error).__name__, str(error))  # (not the error: its frames hold the step)


def step_name(fn: Callable) -> str:
    """How a warning names the step function."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def report(found: Iterable[Finding], step: str, allow: frozenset, num_replicas: int,
           reported: set) -> None:
    """Warns once for each finding not allowed and not ``reported`` already (a set the
    caller keeps: the same line in another compiled program of the step, such as a
    device loop's shorter tail, is not warned about twice)."""
    for f in found:
        if f.habit in allow:
            continue
        where = _location(f.source)
        key = (step, f.habit, where)
        if key in reported:
            continue
        message = _message(f, step, where, num_replicas)
        if where is None:
            warnings.warn(message, ReplicationHabitWarning, stacklevel=2)
        else:
            warnings.warn_explicit(message, ReplicationHabitWarning, where[0], where[1])
        # (only once warned: where the warning is made an error, every call raises)
        if len(reported) < 4096:
            reported.add(key)


def _message(f: Finding, step: str, where: tuple | None, n: int) -> str:
    at = f"{where[0]}:{where[1]}" if where else "an unknown line"
    head = f"Replicator.run: step {step!r} at {at}: "
    silence = (f" If this is intended, pass allow=({f.habit!r},) to Replicator.run "
               "(see jr.ReplicationHabitWarning).")
    if f.habit == MEAN_LOSS:
        return (head + f"the loss differentiated with respect to replicated state is "
                f"divided by this replica's {f.divisor:g} examples (a per-replica mean, as "
                f"in jax.pmap code). Gradients of replicated arguments are summed over the "
                f"{n} replicas, so this update is {n}x the one-device update on the global "
                "batch. Use jr.compute_average_loss(per_example_loss, global_batch_size) "
                "(the sum over this replica's examples divided by the GLOBAL batch size), "
                "and drop any lax.pmean(grads, ...)." + silence)
    if f.habit == BATCH_INDEPENDENT_TERM:
        return (head + "a loss term that does not depend on the batch (e.g. an L2 penalty "
                f"on the parameters) is added on each of the {n} replicas, and gradients "
                f"of replicated arguments are summed over them: its gradient counts {n}x "
                "(e.g. {n}x weight decay). Wrap it in jr.scale_regularization_loss(term)."
                .replace("{n}", str(n)) + silence)
    if f.op == "pmean":
        return (head + "lax.pmean of a value that is already identical on every replica "
                "returns it unchanged (a wasted all-reduce). If it is the gradient: "
                "gradients of replicated arguments are already summed over the replicas "
                "inside run, so drop the pmean and scale the loss with "
                "jr.compute_average_loss(per_example_loss, global_batch_size)." + silence)
    return (head + f"an all-reduce sum (lax.psum / ctx.all_sum) of a value that is already "
            f"identical on every replica multiplies it by {n}. If it is the gradient: "
            "gradients of replicated arguments are already summed over the replicas "
            "inside run, so drop the psum. To report a value every replica has, use it as "
            "it is." + silence)
