"""The steady-state path of ``run``: a call shaped like an earlier one skips the checks
(private).

A training loop calls ``run`` with the same step function and arguments of the same
structure thousands of times. The first such call takes the full path
(:meth:`SPMDExecutor._prepare`: NNX detection, placement, validation, program lookup)
and, when every input is a concrete ``jax.Array`` already placed for the mesh, records
the program under ``(fn, pytree structure)`` in the executor's
:class:`~jreplicate.execution.cache.ProgramCache` (it goes with the program, or with
``fn`` once ``fn`` is freed). Later calls with that structure flatten
once (in C++; Flax NNX modules among the top-level arguments in one Python-level pass,
with their Variables as leaves, whose values are read and written back directly),
check the leaf types, and call the compiled program: ``jax.jit``'s own C++ dispatch then
checks shapes, dtypes and weak types.

What ``jax.jit`` alone would let through is sent back to the full path, so that the
result is always the full path's (a call that fails once it has started running raises
its error and is never run again there: only :class:`Retrace` and a call refused before
running, see ``_refused``, go to the full path):

* a new shape, dtype or weak type makes ``jax.jit`` trace again; the step's body
  raises :class:`Retrace` while the steady-state call is in progress (before anything
  runs), and the full path builds the program for the new signature;
* a NumPy array or Python number (its 64-bit values are checked on the full path), a
  tracer, a deleted (donated) array, an array placed elsewhere: the full path;
* an argument passed twice in a call that donates: the full path (which names it);
* a donated array (NNX state, ``donate_argnums``) that another live object holds,
  directly or through a container of its argument (a reference count above its
  holder's, :mod:`jreplicate.execution.donation`): the full path, which donates a copy;
* with several logical devices per replica, or with ``weight_update_sharding``, a leaf
  whose sharding differs from the recorded one (the program keeps model shardings it
  was built for; a sharded program takes its state as its plan stores it, so an old
  replicated copy passed again is resharded there): the full path;
* an NNX Variable now shared, holding something other than an array, or of another
  type or metadata than the recorded one (``nnx_args.variable_signature``): the full
  path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import jax

from jreplicate._jax_compat import array_type
from jreplicate.context import PerReplica
from jreplicate.execution import donation, nnx_args
from jreplicate.execution.base import NOT_RUN
from jreplicate.execution.cache import CallShape, ProgramCache

_tree_flatten = jax.tree_util.tree_flatten
_tree_unflatten = jax.tree_util.tree_unflatten
_ARRAY = array_type()  # the concrete jax.Array class (None: never take this path)


class Retrace(Exception):
    """Raised by a step's body traced during a steady-state call."""


_GUARD = threading.local()


def retrace_guarded() -> bool:
    """Whether a steady-state call is in progress on this thread (see :class:`Retrace`)."""
    return getattr(_GUARD, "on", False)


class SteadyCall:
    """A call shape's program and what its steady-state calls need to skip the checks
    (hangs off the function's :class:`jreplicate.execution.cache.FunctionEntry`)."""

    __slots__ = ("program", "jitted", "num_out", "out_def", "donate", "limit", "arg_limit",
                 "plans", "shardings", "placed", "order", "num_plain", "variables")

    def __init__(self, program: Any, out_def: Any, shardings: tuple | None,
                 order: list[int] | None, num_plain: int, variables: list | None,
                 placed: tuple, limit: tuple, arg_limit: tuple, plans: tuple):
        self.program = program  # the cache drops this call with it
        self.jitted, self.num_out, self.out_def = program.jitted, program.num_out, out_def
        self.donate = program.jitted_donate
        self.shardings = shardings  # compared before every call (several devices/replica)
        self.placed = placed  # the inputs' shardings (compared only when a call fails)
        self.limit = limit  # see donation.held_elsewhere
        self.arg_limit = arg_limit
        self.plans = plans  # the containers in donated plain arguments
        # NNX arguments: the flat leaves in the program's order (plain leaves, then the
        # Variables, whose values are read), and how many are plain.
        self.order, self.num_plain = order, num_plain
        self.variables = variables  # their nnx_args.variable_signature, for NNX calls


MISS = NOT_RUN


class FastPath:
    """The steady-state calls of one executor, recorded in and looked up from its
    :class:`~jreplicate.execution.cache.ProgramCache` by ``(fn, call shape)``."""

    def __init__(self, cache: ProgramCache, mesh: Any, axis: str, check_shardings: bool):
        self._find = cache.find
        self._cache = cache
        self._mesh, self._axis = mesh, axis
        self._check_shardings = check_shardings

    def call(self, fn: Callable, has_batch: bool, batch: Any, args: tuple,
             steps: int | None, donate_argnums: tuple[int, ...]) -> Any:
        """The step's result, or :data:`MISS` when the full path must run."""
        if _ARRAY is None:
            return MISS
        function = self._find(fn)
        if function is None:
            return MISS
        if function.nnx:  # NNX Variables as leaves (a Python-level flatten)
            leaves, treedef = _flatten(batch, args)
        else:
            leaves, treedef = _tree_flatten((batch, args))
        # A CallShape's fields, in order (a plain tuple: equal, of equal hash, faster).
        entry = function.steady.get((treedef, has_batch, steps, donate_argnums))
        if entry is None:
            return MISS
        variables = None
        if entry.order is not None:
            inputs = [leaves[i] for i in entry.order]
            variables = inputs[entry.num_plain:]
            if not all(map(nnx_args.is_variable, variables)) \
                    or len(set(map(id, variables))) != len(variables):
                return MISS  # a Variable now shared, or replaced by another value
            try:
                if nnx_args.variable_signature(variables) != entry.variables:
                    return MISS  # a Variable of another type or with other metadata
            except Exception:  # noqa: BLE001 - metadata that does not compare: full path
                return MISS
            inputs[entry.num_plain:] = [v.get_value() for v in variables]
        else:
            inputs = leaves
        for x in inputs:
            if type(x) is not _ARRAY:
                return MISS
        if entry.donate:
            x = None  # the loop's reference to the last input
            if len(set(map(id, inputs))) != len(inputs) \
                    or donation.held_elsewhere(inputs, entry.limit, args, entry.arg_limit,
                                               entry.plans):
                return MISS  # the full path copies what another object holds
        if entry.shardings is not None:
            for x, s in zip(inputs, entry.shardings):  # (`is`: the recorded object, as
                # jax.jit gives it back call after call; `!=` costs ~1 us a leaf)
                have = x.sharding
                if have is not s and have != s:
                    return MISS
        _GUARD.on = True
        try:
            flat = entry.jitted(*inputs)
        except Retrace:  # a new signature: the full path builds its program
            return MISS
        except Exception as e:  # broad: sorted below; what is not a refusal is re-raised
            if _refused(e, inputs, entry.placed):
                return MISS  # refused before running: the full path's clearer error
            if variables is not None:
                nnx_args.note_failed_step(e, variables)
            raise  # it ran (at least in part): never run the step twice
        finally:
            _GUARD.on = False
        if variables is not None:
            num_out = entry.num_out
            for v, x in zip(variables, flat[num_out:], strict=True):
                v.set_value(x)
            flat = flat[:num_out]
        return _tree_unflatten(entry.out_def, flat)

    def record(self, fn: Callable, has_batch: bool, batch: Any, args: tuple,
               steps: int | None, donate_argnums: tuple[int, ...], program: Any,
               arrays: list) -> None:
        """Remembers ``program`` for calls shaped like this one, which the full path just
        ran with the program inputs ``arrays``, if such calls can take the steady-state
        path: the call's own leaves (and NNX Variables' values) were the program's
        inputs, unchanged (nothing was placed or converted)."""
        if _ARRAY is None:
            return
        leaves, treedef = _flatten(batch, args)
        is_var = [nnx_args.is_variable(x) for x in leaves]
        num_plain = len(leaves) - sum(is_var)
        order = signature = None
        inputs = leaves
        if num_plain < len(leaves):
            order = [i for i, v in enumerate(is_var) if not v] + \
                [i for i, v in enumerate(is_var) if v]
            inputs = [leaves[i] for i in order]
            variables = inputs[num_plain:]
            inputs[num_plain:] = [x.get_value() for x in variables]
            signature = nnx_args.variable_signature(variables)
        if len(program.specs) - program.num_out != len(leaves) - num_plain:
            return  # NNX state not reached from a top-level module: the full path only
        if len(inputs) != len(arrays) or any(
                type(x) is not _ARRAY or x is not a for x, a in zip(inputs, arrays)):
            return
        per = program.outputs_per_replica()[:program.num_out]
        out_def = jax.tree.structure(jax.tree.unflatten(
            program.out_tree,
            [PerReplica(0, self._mesh, self._axis) if r else 0 for r in per]))
        placed = tuple(x.sharding for x in inputs)
        shardings = placed if self._check_shardings else None
        function = self._find(fn)
        if function is None:  # (its entry is gone: the full path only)
            return
        if order is not None:
            function.nnx = True
        self._cache.record(function, CallShape(treedef, has_batch, steps, donate_argnums),
                           SteadyCall(
            program, out_def, shardings, order, num_plain, signature, placed,
            _donation_limit(inputs, program.jitted_donate, args, num_plain, order is not None),
            donation.argument_limit(args, program.donate_args, 0),
            tuple((k, plan) for k, _ in program.donate_args
                  if (plan := donation.container_plan(args[k])) is not None)))


def _donation_limit(inputs: list, donated: tuple, args: tuple, num_plain: int,
                    nnx_call: bool) -> tuple:
    """The most references each donated input may have in :meth:`FastPath.call` for
    nothing else to hold it (:mod:`jreplicate.execution.donation`): its holder,
    ``inputs``, and ``leaves`` when that is another list (NNX calls; plain leaves)."""
    direct = {id(a) for a in args}
    out = []
    for i in donated:
        is_state = i >= num_plain
        kind = donation.holder(inputs[i], inputs[i], direct, is_state)
        out.append((i, kind + 1 + (nnx_call and not is_state) + 1))
    return tuple(out)


def _refused(e: Exception, inputs: list, placed: tuple) -> bool:
    """Whether a failed call was refused before anything ran: a deleted (donated) input
    (jax.jit says so; a call that ran has deleted its donated inputs too), one placed
    elsewhere than recorded (jax.jit's lowering fails), or a call inside another trace
    (a nested run, which traces rather than runs). Anything else failed while running,
    and must not run again on the full path."""
    if "deleted" in str(e) and any(x.is_deleted() for x in inputs):
        return True
    if any(x.sharding != s for x, s in zip(inputs, placed)):
        return True
    try:
        from jax._src import core
        return not core.trace_state_clean()
    except (ImportError, AttributeError):  # a JAX without it: assume refused, as before
        return True


def _flatten(batch: Any, args: tuple) -> tuple[list, Any]:
    """The leaves of ``(batch, args)``; NNX Variables as leaves when an argument is an
    NNX object (one Python-level flatten; plain pytrees flatten in C++)."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
        base = getattr(nnx, "Pytree", None) or getattr(nnx, "Object", None)
        if base is not None and any(isinstance(a, base) for a in args):
            return _tree_flatten((batch, args), is_leaf=nnx_args.is_variable)
    return _tree_flatten((batch, args))
