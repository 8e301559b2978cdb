"""Every use of private or version-specific JAX behaviour, in one place (private).

Moving jreplicate to a new JAX release should be a change to this file alone:

* :func:`varying_axes` reads which mesh axes a traced value varies over
  (``jax.typeof(x).manual_axis_type.varying`` in jax 0.12);
* :func:`shard_map_per_leaf_out_specs` builds a ``shard_map`` whose out_specs are
  chosen per output leaf from that fact. On jax 0.12 one tracing pass does it, because
  ``shard_map`` reads ``out_specs`` only after calling the body; where a JAX release
  reads them earlier (detected once by :func:`single_pass_out_specs`), an
  ``eval_shape`` pass chooses them first and the step is traced twice per signature;
* :func:`alias_host_arrays` places read-only NumPy arrays without a copy, and
  :func:`producing_equation` reads which equation made a traced value (the PS worker's
  forwarding of the parameters a step returns unchanged);
* :func:`aval_varying_axes`, :func:`transform_names`, :func:`user_source` and their
  neighbours read a traced step's jaxpr (the detection of pmap habits in
  :mod:`jreplicate.execution.habits`);
* :func:`shard_map_equation`, :func:`replica_collective`, :func:`sum_over`,
  :func:`eval_equation` and :func:`atom_value` read a traced step's ``shard_map`` body
  and bind its equations one by one, inside or outside the manual region (the split
  program of ``weight_update_sharding``: :mod:`jreplicate.execution.split`);
* :func:`unbound_axis_in` reads the axis name out of JAX's error for a collective over
  an unbound mesh axis (a bare AssertionError in jax 0.12, for a replica-invariant
  value);
* :func:`backends_are_initialized`, :func:`cluster_env_present`,
  :func:`distributed_client` and :func:`set_gloo_hostname` reach into ``jax._src`` for
  the distributed runtime;
* :data:`MIN_JAX` is the oldest jax/jaxlib release supported (``pyproject.toml``
  declares the same range; ``.ci/run``'s compatibility job runs a subset of the tests on
  it): importing jreplicate with an older one raises an ImportError naming the fix
  (:func:`unsupported_jax`), and a release newer than the tested range warns.

What differs between the supported releases, and how each is handled:

* jaxlib 0.11, on CPU with more simulated devices than the machine's cores can serve
  (8 devices on 2 cores): an all-reduce can deadlock, and XLA aborts the process after
  40 s ("Termination timeout for all reduce"). The CPU client needs more threads:
  :func:`_cpu_collective_threads` sets ``PJRT_NPROC = 2 * devices + 2`` (the value
  ``jreplicate.cluster.launch`` gives its processes) when jreplicate is imported before
  JAX's backend starts, and warns with the fix when it started already. jaxlib 0.12
  needs nothing.
* jaxlib 0.11 and older, on CPU: an array that NumPy has read (``np.asarray``, which
  aliases the CPU buffer) is never donated afterwards; XLA copies it instead. Results
  are the same, only the memory is not reused (tests compare on the devices where they
  check buffer reuse). GPUs and TPUs copy to the host, so this is CPU-only.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

# Imported with the library, not at a step's first call: importing jax.extend.core
# registers JAX config options that are part of the trace context, so a late import
# changed the context and every eager op compiled before compiled again (the executables
# kept alive: tests/test_hardening_execution.py's dropped-step-functions check).
import jax.extend.core  # noqa: F401
import jaxlib
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

#: The oldest jax and jaxlib release jreplicate supports (tested in .ci/run).
MIN_JAX = (0, 11, 2)
#: The first release past the tested range (pyproject.toml's upper bound).
NEXT_UNTESTED_JAX = (0, 13)
#: The oldest orbax-checkpoint jreplicate's checkpoints work with: with 0.12.2 and older
#: (tried on jax 0.11.2) ``save`` returned but never committed its step, so a restore
#: found no checkpoint; 0.11.x does not import on jax 0.11.2.
MIN_ORBAX = (0, 12, 3)

# Tests set this to True to exercise the eval_shape fallback on any JAX.
FORCE_TWO_PASS_OUT_SPECS = False


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.12.0.1"`` -> ``(0, 12, 0, 1)``,
    ``"0.13.0.dev20260101"`` -> ``(0, 13, 0)``."""
    parts = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(part):  # "0rc1", "dev...": the release ends here
            break
    return tuple(parts)


def _shown(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def unsupported_jax(jax_version: str, jaxlib_version: str) -> str | None:
    """Why jreplicate refuses this jax/jaxlib pair (None: it is supported).

    Older than :data:`MIN_JAX` is refused: jreplicate is tested on it and newer only,
    and jaxlib 0.11.1 and older (0.10.x, 0.11.0 and 0.11.1 were tried) crash the whole
    process (a segmentation fault in ``Execute``) when an array that was donated is
    passed to a compiled step again: where jreplicate raises an error naming the
    argument (NNX state is donated by default), the Python process or notebook kernel
    would die. The message names the versions found and the fix.
    """
    old = [(name, v) for name, v in (("jax", jax_version), ("jaxlib", jaxlib_version))
           if release(v) < MIN_JAX]
    if not old:
        return None
    found = ", ".join(f"{name} {v}" for name, v in old)
    return (f"jreplicate needs jax and jaxlib >= {_shown(MIN_JAX)}, < "
            f"{_shown(NEXT_UNTESTED_JAX)}; this environment has {found} (older jaxlib "
            "releases crash the process when a donated array is used again). Upgrade JAX "
            f"(pip install -U 'jax>={_shown(MIN_JAX)},<{_shown(NEXT_UNTESTED_JAX)}', with "
            "the extra of your accelerator, e.g. 'jax[cuda13]' or 'jax[tpu]'), or on a "
            "hosted runtime (Colab) choose one whose JAX is at least that.")


def unsupported_orbax() -> str | None:
    """Why jreplicate's checkpoints refuse the installed orbax-checkpoint (None: fine)."""
    from importlib import metadata
    try:
        version = metadata.version("orbax-checkpoint")
    except metadata.PackageNotFoundError:
        return ("jreplicate's checkpoints need orbax-checkpoint, which is not installed: "
                f"pip install 'orbax-checkpoint>={_shown(MIN_ORBAX)}'.")
    if release(version) < MIN_ORBAX:
        return (f"jreplicate's checkpoints need orbax-checkpoint >= {_shown(MIN_ORBAX)}, "
                f"this environment has {version}, whose saves jreplicate cannot commit (a "
                "restore would find no checkpoint): pip install -U "
                f"'orbax-checkpoint>={_shown(MIN_ORBAX)}'.")
    return None


def _check_versions() -> None:
    why = unsupported_jax(jax.__version__, jaxlib.__version__)
    if why is not None:
        raise ImportError(why)
    if release(jax.__version__)[:2] >= NEXT_UNTESTED_JAX:
        warnings.warn(
            f"jreplicate was tested with jax >= {_shown(MIN_JAX)}, < "
            f"{_shown(NEXT_UNTESTED_JAX)}; this is jax {jax.__version__}, which may have "
            "changed what jreplicate relies on (its version-specific code is in "
            "jreplicate/_jax_compat.py).", stacklevel=3)


def simulated_cpu_devices() -> int:
    """The CPU device count asked for before JAX starts (``XLA_FLAGS``'s
    ``--xla_force_host_platform_device_count`` or ``jax_num_cpu_devices``; 1 if none)."""
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)",
                       os.environ.get("XLA_FLAGS", ""))
    n = int(found[-1]) if found else 1
    configured = getattr(jax.config, "jax_num_cpu_devices", -1)
    return max(n, configured if isinstance(configured, int) else -1)


def _cpu_collective_threads() -> None:
    """Gives jaxlib 0.11's CPU client the threads its all-reduce needs (see the module's
    docstring); nothing on jaxlib 0.12, with one device, or if ``PJRT_NPROC`` is set."""
    n = simulated_cpu_devices()
    if release(jaxlib.__version__) >= (0, 12) or n <= 1 or "PJRT_NPROC" in os.environ:
        return
    threads = 2 * n + 2
    if not backends_are_initialized():
        os.environ["PJRT_NPROC"] = str(threads)
        return
    warnings.warn(
        f"jaxlib {jaxlib.__version__} can deadlock in CPU all-reduce with {n} simulated "
        f"devices on {os.cpu_count()} cores (XLA aborts after 40 s), and JAX started before "
        f"jreplicate could give it more threads: set PJRT_NPROC={threads} in the "
        "environment before JAX starts (or import jreplicate before using JAX).",
        stacklevel=3)




def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which ``x`` varies (empty outside ``shard_map``)."""
    aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))  # the attribute's name before jax 0.8


@functools.cache
def single_pass_out_specs() -> bool:
    """Whether ``shard_map`` reads ``out_specs`` only after tracing its body, so that the
    body itself can fill them in (probed once, on one device, without compiling)."""
    mesh = Mesh(jax.devices()[:1], ("_probe",))
    specs: list = []

    def body(x):
        specs[:] = [P()]
        return [x]

    try:
        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=specs),
                       jax.ShapeDtypeStruct((), "float32"))
    except Exception:  # noqa: BLE001 - any failure means: choose the specs beforehand
        return False
    return True


def shard_map_per_leaf_out_specs(
    body: Callable[..., Sequence[jax.Array]], *, mesh: Mesh, in_specs: tuple,
    axis: str, manual_axes: frozenset, specs: list,
) -> Callable[..., list]:
    """A function of the flat inputs running ``body`` in ``shard_map``, manual over
    ``manual_axes``, whose out spec per leaf is ``P(axis)`` (the leaf gets a leading
    axis stacking the replicas) if the leaf varies over ``axis``, else ``P()``.

    ``body`` returns a flat list of per-replica values. ``specs`` (a list owned by the
    caller) receives the chosen specs when the returned function is traced, so the
    caller can tell which outputs are per-replica.
    """
    stacked = P(axis)

    def choose(flat: Sequence[jax.Array]) -> list:
        return [stacked if axis in varying_axes(x) else P() for x in flat]

    def stack(flat: Sequence[jax.Array], chosen: list) -> list:
        return [x[None] if s == stacked else x for x, s in zip(flat, chosen)]

    def smap(out_specs, fn):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=manual_axes)

    if single_pass_out_specs() and not FORCE_TWO_PASS_OUT_SPECS:
        def one_pass(*blocks):
            flat = body(*blocks)
            specs[:] = choose(flat)
            return stack(flat, specs)

        return lambda *arrays: smap(specs, one_pass)(*arrays)

    def two_pass(*arrays):
        probe: list = []

        def probing(*blocks):
            flat = body(*blocks)
            probe[:] = choose(flat)
            return [x[None] for x in flat]  # stacking is valid for every leaf

        # One spec is a valid out_specs prefix for any number of outputs.
        jax.eval_shape(lambda *a: smap(stacked, probing)(*a), *arrays)
        specs[:] = probe
        return smap(list(specs), lambda *blocks: stack(body(*blocks), specs))(*arrays)

    return two_pass


def compiler_options(platform: str, partial_manual: bool) -> dict | None:
    """XLA options for a step's program.

    jaxlib 0.12's CPU compiler aborts the process ("Invalid binary instruction opcode
    copy", in AllReducePromotion) on an all-reduce of a 16-bit type inside a
    ``shard_map`` that is manual over some mesh axes only (a replica spanning several
    logical devices). Skipping that pass leaves every dtype's collectives correct on CPU
    (tests/test_model_parallel.py checks bfloat16, float16 and int8).
    """
    if platform == "cpu" and partial_manual:
        return {"xla_disable_hlo_passes": "all-reduce-promotion"}
    return None


def axis_bound(name: str) -> bool:
    """Whether mesh axis ``name`` is bound in the current trace (inside ``shard_map``)."""
    try:
        from jax._src import core
        return name in core.get_axis_env().axis_sizes  # ~0.5 us
    except (ImportError, AttributeError):  # a JAX without it: the public, slower way
        try:
            jax.lax.axis_size(name)
        except NameError:
            return False
        return True


def unbound_axis_in(e: BaseException) -> str | None:
    """The mesh axis name JAX refused as unbound in error ``e``, or None for any other
    error. jax 0.12 says ``NameError: unbound axis name: X`` for a collective over a
    value that varies over the replicas, and raises a bare ``AssertionError`` in
    ``jax._src.core.pvary`` for one over a replica-invariant value; that frame's
    ``axes`` names the axes, of which the unbound one is reported."""
    if isinstance(e, NameError):
        found = re.search(r"unbound axis name: (\S+)", str(e))
        return found.group(1) if found else None
    if not isinstance(e, AssertionError) or str(e):
        return None
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == "pvary" and "jax" in frame.f_code.co_filename:
            axes = frame.f_locals.get("axes")
            for name in axes if isinstance(axes, tuple) else ():
                if isinstance(name, str) and not axis_bound(name):
                    return name
        tb = tb.tb_next
    return None


def array_type() -> type | None:
    """The class of concrete ``jax.Array`` values (None if this JAX hides it)."""
    try:
        from jax._src.array import ArrayImpl
    except ImportError:
        return None
    return ArrayImpl


def jit_wrapper_type() -> type | None:
    """The class of what ``jax.jit(f)`` returns (``PjitFunction``; None if this JAX has
    no class of its own for it)."""
    t = type(jax.jit(lambda: None))
    return None if t is type(lambda: None) else t


def alias_host_arrays(leaves: Sequence[Any], sharding: Any, device: Any) -> list:
    """``leaves`` (NumPy arrays) as ``jax.Array`` values on ``device`` (``sharding``
    is a one-device sharding of it), each aliasing its NumPy array where the runtime
    allows (CPU, 64-byte aligned: no copy) if that array is read-only, else copied. A
    writable array is always copied: its owner could change it under the jax.Array;
    so is one of a dtype JAX converts (64-bit ones without ``jax_enable_x64``).

    jax 0.12's ``pxla.batched_device_put`` takes about 5 µs a leaf, against 30 µs for
    ``jax.device_put(..., may_alias=True)`` (its Python layers); that is the fallback.
    """
    try:
        from jax._src.core import ShapedArray
        from jax._src.interpreters.pxla import batched_device_put
    except ImportError:
        batched_device_put = None
    out = []
    for x in leaves:
        if not (isinstance(x, np.ndarray) and not x.flags.writeable) or \
                jax.dtypes.canonicalize_dtype(x.dtype) != x.dtype:
            # A copy first: on CPU, jax 0.12's device_put aliases an aligned NumPy array
            # even with may_alias=False. (A 64-bit array without jax_enable_x64 is
            # converted, as jax converts it.)
            out.append(jax.device_put(np.array(x), sharding))
        elif batched_device_put is None:
            out.append(jax.device_put(x, sharding, may_alias=True))
        else:
            out.append(batched_device_put(ShapedArray(x.shape, x.dtype), sharding, [x],
                                          [device]))
    return out


def producing_equation(x: Any) -> tuple[str, list] | None:
    """While tracing: ``(primitive name, input tracers)`` of the equation that made the
    tracer ``x`` (jax 0.12's jaxpr tracers record it as ``parent``), or None where JAX
    records none (a caller must then treat ``x`` as an opaque value)."""
    eqn = getattr(x, "parent", None)
    name = getattr(getattr(eqn, "primitive", None), "name", None)
    ins = getattr(eqn, "in_tracers", None)
    if not isinstance(name, str) or not isinstance(ins, list):
        return None
    return name, ins


# -- reading a traced step's jaxpr (jreplicate.execution.habits) ------------------
def aval_varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes over which a jaxpr variable's abstract value varies."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()))
    return frozenset(getattr(aval, "vma", ()))


def is_literal(atom: Any) -> bool:
    """Whether a jaxpr equation's operand is a literal constant (not a variable)."""
    return isinstance(atom, _literal_type())


@functools.cache
def _literal_type() -> type:
    from jax.extend.core import Literal
    return Literal


def sub_jaxprs(params: dict) -> list:
    """The jaxprs (open or closed) among an equation's parameters, in order."""
    from jax.extend.core import jaxprs_in_params
    return list(jaxprs_in_params(params))


def transform_names(source_info: Any) -> tuple[str, ...]:
    """The transformations (``"jvp"``, ``"transpose"``, ...) and scopes an equation was
    traced under, outermost first, from its name stack (``()`` where JAX records none).
    A scope is given as ``"scope:<name>"``."""
    stack = getattr(getattr(source_info, "name_stack", None), "stack", ())
    out = []
    for elem in stack:
        name = getattr(elem, "name", None)
        if isinstance(name, str):
            out.append(name if type(elem).__name__ == "Transform" else f"scope:{name}")
    return tuple(out)


def user_source(source_info: Any, skip: Callable[[str], bool]) -> tuple | None:
    """``(file, line, column, function)`` of the innermost frame of the user's code that
    made an equation: JAX's own frames and those ``skip(file)`` accepts are passed
    over. None where JAX kept no traceback."""
    try:
        from jax._src import source_info_util
        frames = list(source_info_util.user_frames(source_info.traceback))
    except (ImportError, AttributeError, TypeError) as e:
        logging.getLogger("jreplicate").debug("user_source: no frames (%s)", e)
        return None
    chosen = next((f for f in frames if not skip(f.file_name)), frames[0] if frames else None)
    if chosen is None:
        return None
    return chosen.file_name, chosen.start_line, chosen.start_column, chosen.function_name


# -- splitting a traced step at the weight update (execution.weight_update, split) -----
#: Primitives that sum over mesh axes (lax.psum binds ``psum_invariant`` for a varying
#: value in jax 0.12, ``psum`` for other cases; older JAX named the first ``psum2``).
_SUM_PRIMITIVES = frozenset({"psum", "psum_invariant", "psum2"})


def shard_map_equation(closed_jaxpr: Any) -> int | None:
    """The index of the only ``shard_map`` equation of a traced program's (closed) jaxpr,
    or None when it has none or several. jax 0.12 params: ``jaxpr`` (a ``core.Jaxpr``,
    the body), ``in_specs``, ``out_specs``, ``mesh``, ``check_vma``,
    ``newly_manual_axes``."""
    found = [i for i, e in enumerate(closed_jaxpr.jaxpr.eqns)
             if e.primitive.name == "shard_map"]
    return found[0] if len(found) == 1 else None


def _axes_named(params: dict) -> frozenset:
    """The mesh axes an equation's params name (``axes`` or ``axis_name``)."""
    out: set = set()
    for key in ("axes", "axis_name"):
        v = params.get(key)
        for name in v if isinstance(v, (tuple, list, frozenset, set)) else (v,):
            if isinstance(name, str):
                out.add(name)
    return frozenset(out)


def _params_jaxprs(params: dict) -> list:
    """The open jaxprs among an equation's params (closed ones opened), in order."""
    out = []
    for val in params.values():
        for v in val if isinstance(val, (tuple, list)) else (val,):
            inner = getattr(v, "jaxpr", None) if type(v).__name__ == "ClosedJaxpr" else v
            if type(inner).__name__ == "Jaxpr":
                out.append(inner)
    return out


def replica_collective(eqn: Any, axis: str) -> bool:
    """Whether a jaxpr equation (or one inside its sub-jaxprs) is a collective or an
    ``axis_index`` over mesh axis ``axis``: matched by its params naming the axis, not
    by primitive name."""
    if axis in _axes_named(eqn.params):
        return True
    return any(replica_collective(e, axis) for j in _params_jaxprs(eqn.params)
               for e in j.eqns)


def sum_over(eqn: Any, axis: str) -> bool:
    """Whether ``eqn`` sums over exactly the mesh axis ``axis`` (``lax.psum(x, axis)``,
    what JAX inserts to aggregate a gradient), with no replica groups."""
    return (eqn.primitive.name in _SUM_PRIMITIVES and _axes_named(eqn.params) == {axis}
            and eqn.params.get("axis_index_groups") is None)


def is_sharding_constraint(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``with_sharding_constraint`` (an identity on values)."""
    return eqn.primitive.name == "sharding_constraint"


def has_effects(eqn: Any) -> bool:
    """Whether ``eqn`` has side effects (printing, callbacks, ordered IO)."""
    return bool(eqn.effects)


def atom_value(atom: Any, env: dict, *, manual: bool = True) -> Any:
    """An equation operand's value: a literal's constant, else ``env[atom]``.

    ``manual=False``: a literal of a ``shard_map`` body returned outside it. jax 0.12's
    literal (a ``TypedNdArray``) carries an abstract value typed on the manual mesh,
    which a primitive bound on global arrays refuses ("Mesh for all inputs should be
    equal"); it is rebuilt with the same dtype and weak type, untyped by any mesh."""
    if not is_literal(atom):
        return env[atom]
    val = atom.val
    if manual or not hasattr(val, "_aval"):
        return val
    try:
        from jax._src.core import ShapedArray
        from jax._src.literals import TypedNdArray
    except ImportError:
        return val
    aval = ShapedArray(val.shape, val.dtype, weak_type=val.aval.weak_type)
    return TypedNdArray(np.asarray(val), aval=aval)


def eval_equation(eqn: Any, invals: Sequence[Any]) -> list:
    """Binds one jaxpr equation to ``invals`` as ``jax.core.eval_jaxpr`` does (jax 0.12:
    ``get_bind_params`` returns the params dict; bound under ``eqn.ctx.manager``, also
    for an equation of a ``shard_map`` body bound outside it on global arrays, which
    jax 0.12 accepts: binding it outside its context fails on the literals and
    sub-jaxprs typed on the manual mesh); returns the list of its outputs."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # older JAX: (subfuns, params)
        subfuns, params = params
        invals = [*subfuns, *invals]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


#: Call primitives whose body is inlined before planning (a ``jax.jit`` nested in the
#: step, and the plain call JAX binds for a closed jaxpr), by primitive name: the
#: param holding the called jaxpr. Control flow (cond, scan, while), custom_jvp/vjp and
#: shard_map are no calls: they stay whole. jax 0.12 names its jit primitive ``jit``
#: and its ``closed_call`` ``eval_jaxpr``; older JAX ``pjit``, ``closed_call``, ``core_call``.
_INLINED_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
                  "core_call": "call_jaxpr", "eval_jaxpr": "call_jaxpr"}


def _called_jaxpr(eqn: Any) -> Any:
    """The open jaxpr ``eqn`` calls when it is an inlinable call (:data:`_INLINED_CALLS`)
    of a jaxpr with no constants attached; else None."""
    key = _INLINED_CALLS.get(eqn.primitive.name)
    called = eqn.params.get(key) if key else None
    if called is None or getattr(called, "consts", ()):
        return None  # (a called jaxpr's constants would need hoisting: kept whole)
    inner = called.jaxpr if type(called).__name__ == "ClosedJaxpr" else called
    if type(inner).__name__ != "Jaxpr" or len(inner.invars) != len(eqn.invars) \
            or len(inner.outvars) != len(eqn.outvars) or getattr(inner, "is_high", False):
        return None
    return inner


def nested_calls(jaxpr: Any) -> list:
    """The equations of ``jaxpr`` (not inside control flow) calling a nested jaxpr that
    :func:`inline_calls` leaves whole, e.g. a ``jax.jit`` with constants attached."""
    return [e for e in jaxpr.eqns if e.primitive.name in _INLINED_CALLS
            and _called_jaxpr(e) is None]


def inline_calls(jaxpr: Any) -> Any:
    """``jaxpr`` (an open ``core.Jaxpr``) with each nested call (a ``jax.jit`` in the
    step; :data:`_INLINED_CALLS`) replaced by the called jaxpr's equations, recursively:
    the callee's inputs are the call's operands, its outputs stand for the call's
    results, and each inlined equation gets fresh output variables (a jit called twice
    defines its variables twice). Equations inside control flow are untouched. The
    same values in the same order: only the nesting goes. Returns ``jaxpr`` itself
    when it calls nothing inlinable."""
    if not any(_called_jaxpr(e) is not None for e in jaxpr.eqns):
        return jaxpr
    from jax.extend.core import Var
    eqns: list = []
    top: dict = {}  # a top-level call's result -> the atom standing for it

    def emit(eqn: Any, rename: dict, fresh: bool) -> None:
        invars = [rename.get(a, a) if is_var(a) else a for a in eqn.invars]
        inner = _called_jaxpr(eqn)
        if inner is not None:
            scope = dict(zip(inner.invars, invars))
            for e in inner.eqns:
                emit(e, scope, True)
            for o, v in zip(eqn.outvars, inner.outvars):
                if is_var(o):
                    rename[o] = scope.get(v, v) if is_var(v) else v
            return
        outvars = list(eqn.outvars)
        if fresh:
            for k, o in enumerate(outvars):
                if is_var(o):
                    outvars[k] = rename[o] = Var(o.aval)
        eqns.append(eqn.replace(invars=invars, outvars=outvars))

    for e in jaxpr.eqns:
        emit(e, top, False)
    outvars = [top.get(v, v) if is_var(v) else v for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def inline_calls_in_body(closed_jaxpr: Any, index: int) -> Any:
    """``closed_jaxpr`` (a traced program) with its equation ``index`` (a
    ``shard_map``) calling its body with the nested calls inlined
    (:func:`inline_calls`); itself when there are none."""
    outer = closed_jaxpr.jaxpr
    eqn = outer.eqns[index]
    body = eqn.params["jaxpr"]
    new = inline_calls(body)
    if new is body:
        return closed_jaxpr
    eqns = list(outer.eqns)
    eqns[index] = eqn.replace(params={**eqn.params, "jaxpr": new})
    new_outer = outer.replace(eqns=eqns)
    if outer is closed_jaxpr:  # jax 0.12: one Jaxpr carrying its consts
        return new_outer
    return closed_jaxpr.replace(jaxpr=new_outer)


def is_var(atom: Any) -> bool:
    """Whether a jaxpr operand is a variable (not a literal, not a dropped output)."""
    return not is_literal(atom) and type(atom).__name__ == "Var"


# -- the distributed runtime -------------------------------------------------------
def backends_are_initialized() -> bool:
    """Whether the JAX backend has started (after which jax.distributed can't start)."""
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def cluster_env_present() -> bool:
    """Whether JAX's auto-detection would find a cluster (SLURM, Open MPI, Cloud TPU...)."""
    try:
        from jax._src import clusters
        kinds = clusters.ClusterEnv._cluster_types
    except (ImportError, AttributeError):  # unknown JAX internals: let JAX decide
        return True
    return any(not k.opt_in_only_method and k.is_env_present() for k in kinds)


def distributed_client() -> Any:
    """The coordination-service client of ``jax.distributed`` (key-value store)."""
    from jax._src import distributed
    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("the JAX distributed runtime is not running.")
    return client


def set_gloo_hostname(hostname: str | None) -> None:
    """Makes gloo (CPU collectives across processes) listen on ``hostname``.

    JAX creates gloo's TCP device without a host name, so gloo listens on the address
    that this machine's host name resolves to (a LAN address on most machines). This
    wraps the registered CPU backend factory so that the backend, when it starts, gets
    gloo collectives created with ``hostname`` (``None``: JAX's own behaviour). Call it
    before the backend starts. Where this JAX lacks the pieces, gloo keeps its default
    and a warning says so.
    """
    from jax._src import xla_bridge
    reg = getattr(xla_bridge, "_backend_factories", {}).get("cpu")
    make = getattr(getattr(xla_bridge, "_jax", None), "make_gloo_tcp_collectives", None)
    if reg is None or make is None:
        if hostname is not None:
            logging.getLogger("jreplicate").warning(
                "jreplicate: cannot make gloo listen on %s with this JAX; it listens on "
                "the address of the host name.", hostname)
        return
    original = getattr(reg.factory, "_jreplicate_original", reg.factory)
    if hostname is None:
        xla_bridge._backend_factories["cpu"] = dataclasses.replace(reg, factory=original)
        return
    if "collectives" not in inspect.signature(original).parameters:
        logging.getLogger("jreplicate").warning(
            "jreplicate: cannot make gloo listen on %s with this JAX.", hostname)
        return

    def factory():
        from jax._src import distributed
        client = distributed.global_state.client
        if client is None or jax.config.jax_cpu_collectives_implementation != "gloo":
            return original()
        return original(collectives=make(distributed_client=client, hostname=hostname))

    factory._jreplicate_original = original
    xla_bridge._backend_factories["cpu"] = dataclasses.replace(reg, factory=factory)


def weakly_typed(x: jax.Array) -> jax.Array:
    """``x`` (a global ``jax.Array``) with a weak type, as ``jax.device_put`` gives a
    Python scalar on one process: ``jax.make_array_from_callback`` always makes a strong
    one. Rebuilds the array around the same device buffers (no copy); where the private
    constructor is unavailable, a jitted conversion does it (one dispatch)."""
    try:
        from jax._src import array as _array
        return _array.ArrayImpl(x.aval.update(weak_type=True), x.sharding, x._arrays,
                                committed=x.committed, _skip_checks=True)
    except (ImportError, AttributeError, TypeError) as e:
        logging.getLogger("jreplicate").debug("weakly_typed: private path failed (%s)", e)
        from jax._src.lax import lax as _lax
        return jax.jit(lambda v: _lax._convert_element_type(v, weak_type=True),
                       out_shardings=x.sharding)(x)


# At import (jreplicate/__init__.py imports this module first): refuse an unsupported JAX,
# and give jaxlib 0.11's CPU client its threads while the backend has not started.
_check_versions()
_cpu_collective_threads()
