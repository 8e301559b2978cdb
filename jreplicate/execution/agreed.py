"""A call's host-side arguments across processes: agreed first, then placed alike (private).

Across processes (:class:`jreplicate.MultiWorkerStrategy`) every process passes its own
copy of each replicated argument of ``run`` (and of the state ``Replicator.replicate``
places). A
leaf that is not yet an array of the job's mesh is *host-side*: a NumPy array or
scalar, a Python number, or a ``jax.Array`` of this process's own devices (committed to
one or not). Whatever the kind, a host-side leaf takes one path on every process:

1. each process describes every leaf of the call (:func:`host_leaf`: dtype, shape and a
   digest of the bytes for a host-side leaf; the kind for the others) and the call's
   structure, and lists what it refused (a leaf that is not an array, a value that does
   not fit its dtype);
2. the descriptions go through one agreement round of the coordination service's
   key-value store (:class:`~jreplicate.cluster.agreement.Agreement`; nothing is
   unpickled), never a collective of the devices: a process whose call differs cannot
   leave another waiting in a collective it never joins;
3. every process takes the same decision from the same messages (:func:`decide`): place
   each host-side leaf from its own copy (``jax.make_array_from_callback``: no
   collective), or raise one error, the same on every process, naming the argument that
   differs, the processes and the fix.

(Before, a NumPy leaf went through a gather of digests and a ``jax.Array`` through
``jax.device_put``'s own comparison of copies: two different collectives, and gloo
aborted the job when the kinds differed between processes.)

A call whose leaves are all arrays of the mesh already (the state a training loop passes
back) takes no round: it must be so on every process.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jreplicate import _wire
from jreplicate._jax_compat import weakly_typed
from jreplicate._tree import LeafErrors, read_now, report

#: At most this many characters of a structure are sent (its digest is sent too).
_TREE_CHARS = 400
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_KINDS: dict[str, type[Exception]] = {"ValueError": ValueError, "TypeError": TypeError,
                                      "LeafErrors": LeafErrors}
_FIX = ("A replicated argument must be the same value, of the same kind, on every process: "
        "compute it identically everywhere (the same seed), pass it as a per-replica batch, "
        "or broadcast it from one process (jax.experimental.multihost_utils."
        "broadcast_one_to_all).")


def is_host_side(x: Any, mesh_addressable: bool) -> bool:
    """Whether leaf ``x`` is host-side for a mesh that is (``mesh_addressable``) or is
    not fully addressable by this process: anything array-like but a ``jax.Array`` of
    the mesh's kind (on one process every array is placed by ``jax.device_put``)."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, jax.Array):
        return not mesh_addressable and x.is_fully_addressable
    return True


def host_leaf(x: Any, where: Callable[[], str]) -> tuple[np.ndarray, str]:
    """A host-side leaf as the NumPy array every process places (native byte order,
    C order, JAX's canonical dtype: a ``jax.Array`` copied to the host) and its
    description ``"host <dtype>[<shape>] <digest of the bytes>"``.

    Raises:
      TypeError, ValueError: NumPy or JAX cannot hold the value (named by ``where()``).
    """
    try:
        a = np.asarray(read_now(x))
        a = np.asarray(a, dtype=jax.dtypes.canonicalize_dtype(a.dtype), order="C")
    except (TypeError, ValueError, OverflowError) as e:
        raise (type(e) if isinstance(e, TypeError) else ValueError)(f"{where()}: {e}") from None
    # (the dtype's name: ml_dtypes' float8_e4m3fn, int4 and uint4 all have str '<V1')
    h = hashlib.blake2b(f"{a.dtype.name}{a.shape}".encode(), digest_size=16)
    h.update(a.reshape(-1).view(np.uint8))
    weak = " weak" if is_weak(x) else ""
    return a, f"host {a.dtype.name}{weak}{list(a.shape)} {h.hexdigest()}"


def is_weak(x: Any) -> bool:
    """Whether JAX gives leaf ``x`` a weak type (a Python int, float or complex: ``x *
    0.1`` keeps a bfloat16 ``x`` bfloat16), as one process's ``jax.device_put`` does."""
    return type(x) in (int, float, complex)


def placed_leaf(x: Any, kind: str) -> str:
    """The description of a leaf that is already an array of the mesh (``kind``:
    ``"mesh"`` or ``"per-replica"``)."""
    text = f"{kind} {np.dtype(x.dtype).name}{list(np.shape(x))}"
    if isinstance(x, jax.core.Tracer):
        return text + " traced"  # (under an outer jax.jit: no sharding to read)
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    return text + (f" {spec}" if spec is not None else "")


_trees: dict[Any, str] = {}


def tree_text(treedef: Any, shown: Any = None) -> str:
    """``treedef`` as sent: the text of ``shown`` (a part of it the user passed; all of
    it by default) without memory addresses (an aux object's default repr), capped, and
    a digest of the whole."""
    key = (treedef, shown)
    try:
        hit = _trees.get(key)
    except TypeError:  # an unhashable aux: computed each time, never cached (below)
        hit = None
    if hit is not None:
        return hit
    whole = _ADDRESS.sub("", str(treedef))
    text = whole if shown is None else _ADDRESS.sub("", str(shown))
    digest = hashlib.blake2b(whole.encode(), digest_size=8).hexdigest()
    out = (text if len(text) <= _TREE_CHARS else text[:_TREE_CHARS] + "...") + f" #{digest}"
    try:
        hash(key)
    except TypeError:  # an unhashable aux: not cached
        return out
    if len(_trees) >= 256:
        _trees.clear()
    _trees[key] = out
    return out


def message(tree: str, leaves: Sequence[str], refused: Sequence[Exception]) -> dict:
    """One process's message: its call's structure, one description per leaf, and what
    it refused (``[error type, message]`` each)."""
    return {"tree": tree, "leaves": list(leaves),
            "refused": [[type(e).__name__, str(e)] for e in refused]}


def agree(agreement: Any, tree: str, descs: Sequence[str], refused: list[Exception],
          name: Callable[[int], str], what: str) -> None:
    """One agreement round on a call's structure (``tree``, see :func:`tree_text`), its
    leaves (``descs``, one per leaf) and this process's refusals; raises what
    :func:`decide` finds, on every process.

    Raises:
      ValueError, TypeError: see :func:`decide`.
      jreplicate.cluster.ClusterError: a process did not take part within the timeout.
    """
    messages = agreement.exchange(message(tree, descs, refused),
                                  f"the arguments of {what}", _wire.RUN_ARGUMENTS)
    report(decide(messages, refused, name, what), what)


def decide(messages: Sequence[dict], own: list[Exception], name: Callable[[int], str],
           what: str) -> list[Exception]:
    """The errors every process raises for the agreed ``messages`` (none: place).

    Pure, and the same on every process: ``own`` (this process's refusals) are raised as
    they are where every process refused the same; otherwise one error says which
    process refused what, or which leaves (named by ``name(i)``) differ between the
    processes and how.
    """
    first = messages[0]
    if any(m["refused"] for m in messages):
        if all(m["refused"] == first["refused"] for m in messages):
            return own  # the same refusal everywhere: as on one process
        return [_refused_on_some(messages, what)]
    if any(m["tree"] != first["tree"] or len(m["leaves"]) != len(first["leaves"])
           for m in messages):
        listing = "; ".join(f"process {p}: {m['tree']} ({len(m['leaves'])} leaves)"
                            for p, m in enumerate(messages))
        return [ValueError(
            f"{what}: the arguments have another structure on some processes ({listing}). "
            "Every process must pass arguments of one structure (same containers, same "
            "keys, the same static data in custom pytree nodes). " + _FIX)]
    return [_differs(name(i), [m["leaves"][i] for m in messages], what)
            for i in range(len(first["leaves"]))
            if any(m["leaves"][i] != first["leaves"][i] for m in messages)]


def _refused_on_some(messages: Sequence[dict], what: str) -> Exception:
    kinds = {_KINDS.get(t, ValueError) for m in messages for t, _ in m["refused"]}
    kind = kinds.pop() if len(kinds) == 1 else LeafErrors
    parts = []
    for p, m in enumerate(messages):
        if m["refused"]:
            texts = "; ".join(text.removeprefix(f"{what}: ") for _, text in m["refused"])
            parts.append(f"process {p}: {texts}")
        else:
            parts.append(f"process {p}: accepted")
    return kind(f"{what}: the arguments were refused on some processes only, so every "
                f"process stops ({' | '.join(parts)}).")


def _differs(where: str, descs: list[str], what: str) -> ValueError:
    """Leaf ``where`` described as ``descs[p]`` by process ``p``."""
    kinds = [d.split(" ", 1)[0] for d in descs]
    shapes = [d.split(" ")[1] if " " in d else d for d in descs]
    if len(set(kinds)) > 1 or len(set(shapes)) > 1:
        listing = "; ".join(f"process {p}: {_kind_name(k)} {s}"
                            for p, (k, s) in enumerate(zip(kinds, shapes, strict=True)))
        how = f"({listing})"
    else:
        others = [p for p, d in enumerate(descs) if d != descs[0]]
        how = f"({shapes[0]} everywhere, other values on process(es) {others} than on process 0)"
    return ValueError(f"{what}: {where} differs between the processes {how}. {_FIX}")


def _kind_name(kind: str) -> str:
    return {"host": "host value", "mesh": "array of the mesh",
            "per-replica": "PerReplica", "refused": "refused"}.get(kind, kind)


def place(arrays: Sequence[np.ndarray], sharding: Any, weak: Sequence[bool]) -> list:
    """Each agreed host array placed on ``sharding`` from this process's copy, with no
    collective; weakly typed where ``weak`` says so (see :func:`is_weak`)."""
    out = []
    for a, w in zip(arrays, weak, strict=True):
        x = jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
        out.append(weakly_typed(x) if w else x)
    return out
