"""Typed, validated messages between processes (private).

Agreement messages (:meth:`jreplicate.cluster.agreement.Agreement.exchange`) are JSON;
nothing that crosses processes is unpickled. This module holds the small schema
checkers those messages are read with, and the JSON description of a pytree structure
that input elements carry, so that a process which never saw an element (SINGLE mode,
or a padded process whose input ran out at once) can rebuild its structure.

A checker is a function ``check(value, where) -> value`` that raises ``ValueError``
naming ``where`` (the field's path in the message) when the value is malformed.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

Checker = Callable[[Any, str], Any]
LEAF = "*"
MAX_DEPTH = 100  # of a described structure; deeper ones are refused, not recursed into


# -- encoding ------------------------------------------------------------------------
class Encoded(dict):
    """A JSON object whose text is computed once (a cached message part: never modify
    it); :func:`dumps` splices the text in."""

    __slots__ = ("text",)

    def __init__(self, value: dict):
        super().__init__(value)
        self.text = json.dumps(value, allow_nan=False, separators=(",", ":"))


def dumps(message: Any) -> bytes:
    """``message`` as compact JSON (no NaN or infinity); top-level :class:`Encoded`
    fields are not encoded again."""
    def text(v):
        return v.text if isinstance(v, Encoded) else json.dumps(
            v, allow_nan=False, separators=(",", ":"))
    if isinstance(message, dict):
        return ("{" + ",".join(f"{json.dumps(str(k))}:{text(v)}" for k, v in message.items())
                + "}").encode()
    return text(message).encode()


# -- limits -------------------------------------------------------------------------
#: Every number a message carries is bounded, so that no process acts on an impossible
#: value another sent (a dimension of 2**60 once passed, and the process that padded
#: with it failed alone in ``np.zeros``). The limits are far above any real value.
MAX_INT64 = 2**63 - 1  #: counts, step ids and indices: what an int64 holds
MAX_DIM = 2**31 - 1  #: one dimension of an input leaf
MAX_RANK = 64  #: dimensions of an input leaf (NumPy's own limit)
MAX_BYTES = 2**40  #: the bytes of an input element's leaves together (1 TiB)
MAX_ITEMS = 2**20  #: the entries of a list (leaves, fields, children)


# -- checkers ------------------------------------------------------------------------
def _fail(where: str, want: str, value: Any) -> ValueError:
    return ValueError(f"{where} must be {want}, got {json.dumps(value)[:80]}")


def _schema(check: Checker, *description: Any) -> Checker:
    """Tags ``check`` with what it accepts (``("int", lo, hi)``, ``("record",
    fields)``...), so that a schema can be walked: the tests find every numeric field
    of every message this way."""
    check.schema = description  # type: ignore[attr-defined]
    return check


def string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, "a string", value)
    return value


def boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, "true or false", value)
    return value


_schema(string, "str")
_schema(boolean, "bool")


def integer(lo: int, hi: int) -> Checker:
    """An int in ``[lo, hi]`` (not a bool, not a float such as 3.0, NaN or infinity)."""
    want = f"an int >= {lo} and <= {hi}"

    def check(value, where):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _fail(where, want, value)
        return value
    return _schema(check, "int", lo, hi)


#: An int >= 0 that an int64 holds (a count, a step id, a process index).
natural = integer(0, MAX_INT64)


def optional(check: Checker) -> Checker:
    return _schema(lambda value, where: None if value is None else check(value, where),
                   "optional", check)


def one_of(*choices: str) -> Checker:
    def check(value, where):
        if value not in choices:
            raise _fail(where, f"one of {list(choices)}", value)
        return value
    return _schema(check, "one_of", choices)


def list_of(check: Checker, limit: int = MAX_ITEMS) -> Checker:
    def checked(value, where):
        if not isinstance(value, list):
            raise _fail(where, "a list", value)
        if len(value) > limit:
            raise ValueError(f"{where} must have at most {limit} entries, got {len(value)}")
        return [check(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return _schema(checked, "list", check)


def sequence(*checks: Checker, what: str) -> Checker:
    """A list of ``len(checks)`` entries, each checked by its checker (``what`` names
    the list in errors, e.g. ``"a [shape, dtype] pair"``)."""
    def check(value, where="the message"):
        if not (isinstance(value, list) and len(value) == len(checks)):
            raise _fail(where, what, value)
        return [c(v, f"{where}[{i}]") for i, (c, v) in enumerate(zip(checks, value))]
    return _schema(check, "sequence", checks)


def record(**fields: Checker) -> Callable[[Any], dict]:
    """A checker of a JSON object with exactly ``fields``, each checked by its checker;
    called with the message alone (``where`` is the message)."""
    def check(value, where="the message"):
        if not isinstance(value, dict):
            raise _fail(where, f"an object with fields {sorted(fields)}", value)
        if set(value) != set(fields):
            raise ValueError(f"{where} must have the fields {sorted(fields)}, got "
                             f"{sorted(value)[:20]}")
        return {k: c(value[k], f"{where}.{k}") for k, c in fields.items()}
    return _schema(check, "record", fields)


def then(check: Checker, refine: Callable[[Any, str], None]) -> Checker:
    """``check``, then ``refine(value, where)`` on what it returns (a check across
    fields); walked as ``check``."""
    def checked(value, where="the message"):
        out = check(value, where)
        refine(out, where)
        return out
    return _schema(checked, *check.schema)


def dtype_name(value: Any, where: str) -> str:
    """A NumPy dtype's canonical name (``"float32"``, ``"bfloat16"``); no objects."""
    if not (isinstance(value, str) and _is_dtype_name(value)):
        raise _fail(where, "a dtype name such as 'float32'", value)
    return value


_schema(dtype_name, "dtype")


@functools.lru_cache(maxsize=64)
def _is_dtype_name(value: str) -> bool:
    try:
        dt = np.dtype(value)
    except TypeError:
        return False
    return str(dt) == value and not dt.hasobject and dt.itemsize > 0


# -- pytree structures ---------------------------------------------------------------
def _key(k: Any) -> bool:
    """A dict key a description carries: a string, or an int that an int64 holds."""
    return isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)
                                  and -MAX_INT64 - 1 <= k <= MAX_INT64)


def _named_type(name: str, fields: Sequence[str]) -> type | None:
    """The namedtuple class ``module:qualname`` with ``fields``, among loaded modules
    (nothing is imported or called)."""
    module, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, "__dict__", {}).get(part) if obj is not None else None
    if isinstance(obj, type) and issubclass(obj, tuple) \
            and tuple(getattr(obj, "_fields", ())) == tuple(fields):
        return obj
    return None


@functools.lru_cache(maxsize=256)
def describe(treedef: Any) -> Any:
    """The JSON description of ``treedef``: ``"*"`` a leaf, ``null`` None, ``{"tuple":
    [...]}``, ``{"list": [...]}``, ``{"dict": [[key, ...], ...]}``, ``{"odict": ...}``,
    ``{"namedtuple": "module:qualname", "fields": [...], "children": [...]}``,
    ``{"masked": [batch, mask]}``; any other node is ``{"opaque": "<its repr>"}``,
    which compares but cannot be rebuilt elsewhere."""
    from jreplicate.context import MaskedBatch
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return LEAF
    kind, aux = treedef.node_data()
    children = [describe(c) for c in treedef.children()]
    if kind is type(None):
        return None
    if kind is tuple or kind is list:
        return {kind.__name__: children}
    if kind in (dict, OrderedDict) and all(_key(k) for k in aux):
        return {"dict" if kind is dict else "odict": [[k, c] for k, c in zip(aux, children)]}
    if kind is MaskedBatch:
        return {"masked": children}
    fields = getattr(kind, "_fields", None)
    if isinstance(kind, type) and issubclass(kind, tuple) and fields is not None:
        name = f"{kind.__module__}:{kind.__qualname__}"
        if _named_type(name, fields) is kind:
            return {"namedtuple": name, "fields": list(fields), "children": children}
    return {"opaque": str(treedef)}


def _pair(value: Any, where: str) -> list:
    if not (isinstance(value, list) and len(value) == 2 and _key(value[0])):
        raise _fail(where, f"a [key, structure] pair with a string key or an int key in "
                    f"[{-MAX_INT64 - 1}, {MAX_INT64}]", value)
    return value


def _any(value: Any, where: str) -> Any:
    return value  # checked by the caller


def structure(value: Any, where: str, depth: int = 0) -> Any:
    """Checks a structure description (see :func:`describe`); its only numbers are
    int dict keys (in an int64's range)."""
    if value is None or value == LEAF:
        return value
    if depth >= MAX_DEPTH:
        raise ValueError(f"{where} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict) and set(value) == {"namedtuple", "fields", "children"}:
        fields = list_of(string)(value["fields"], f"{where}.fields")
        children = [structure(c, f"{where}.children[{i}]", depth + 1) for i, c in
                    enumerate(list_of(_any)(value["children"], f"{where}.children"))]
        if len(fields) != len(children):
            raise ValueError(f"{where} has {len(fields)} fields but {len(children)} children")
        return {"namedtuple": string(value["namedtuple"], f"{where}.namedtuple"),
                "fields": fields, "children": children}
    if not isinstance(value, dict) or len(value) != 1:
        raise _fail(where, "a structure description", value)
    (kind, body), = value.items()
    here = f"{where}.{kind}"
    if kind == "opaque":
        return {kind: string(body, here)}
    if kind in ("dict", "odict"):
        pairs = list_of(_pair)(body, here)
        return {kind: [[k, structure(c, f"{here}[{k!r}]", depth + 1)] for k, c in pairs]}
    if kind in ("tuple", "list", "masked"):
        out = [structure(c, f"{here}[{i}]", depth + 1)
               for i, c in enumerate(list_of(_any)(body, here))]
        if kind == "masked" and len(out) != 2:
            raise _fail(here, "[batch, mask]", body)
        return {kind: out}
    raise _fail(where, "a structure description", value)


_schema(structure, "structure")


def _example(desc: Any) -> Any:
    """A value of structure ``desc`` with ``0`` leaves (see :func:`rebuild`)."""
    from jreplicate.context import MaskedBatch
    if desc == LEAF:
        return 0
    if desc is None:
        return None
    if "namedtuple" in desc:
        cls = _named_type(desc["namedtuple"], desc["fields"])
        if cls is None:
            raise ValueError(f"the namedtuple {desc['namedtuple']} is not defined in this "
                             "process")
        return cls(*(_example(c) for c in desc["children"]))
    (kind, body), = desc.items()
    if kind == "tuple":
        return tuple(_example(c) for c in body)
    if kind == "list":
        return [_example(c) for c in body]
    if kind in ("dict", "odict"):
        return (dict if kind == "dict" else OrderedDict)((k, _example(c)) for k, c in body)
    if kind == "masked":
        return MaskedBatch(*(_example(c) for c in body))
    raise ValueError(f"a {desc['opaque']} node cannot be rebuilt from its description")


def _children(desc: Any) -> list | None:
    """The child descriptions of ``desc`` (None for an opaque node)."""
    if not isinstance(desc, dict):
        return []
    if "namedtuple" in desc:
        return desc["children"]
    (kind, body), = desc.items()
    if kind == "opaque":
        return None
    return [c for _, c in body] if kind in ("dict", "odict") else body


def rebuildable(desc: Any) -> bool:
    """Whether :func:`rebuild` can rebuild ``desc`` without a local treedef (it has no
    opaque node)."""
    kids = _children(desc)
    return kids is not None and all(rebuildable(c) for c in kids)


def rebuild(desc: Any, local: Sequence[Any] = ()) -> Any:
    """The treedef described by ``desc``: one of ``local`` (this process's treedefs)
    that it describes, else rebuilt from the description.

    Raises:
      ValueError: ``desc`` has an opaque node (a custom pytree node) and none of
        ``local`` matches, or names a namedtuple this process does not define.
    """
    for treedef in local:
        if treedef is not None and describe(treedef) == desc:
            return treedef
    return jax.tree.structure(_example(desc))


# -- the messages --------------------------------------------------------------------
def _fits(spec: list, where: str) -> None:
    """A leaf's bytes (elements times item size) within :data:`MAX_BYTES`."""
    shape, dtype = spec
    if int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize > MAX_BYTES:
        raise ValueError(f"{where} is {dtype}{shape}, over {MAX_BYTES} bytes (the limit "
                         "of an input element)")


#: An array's shape: at most :data:`MAX_RANK` dimensions of at most :data:`MAX_DIM`.
shape = list_of(integer(0, MAX_DIM), limit=MAX_RANK)
_leaf_spec = then(sequence(shape, dtype_name, what="a [shape, dtype] pair"), _fits)


def _element_fits(spec: dict, where: str) -> None:
    total = sum(int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize
                for shape, dtype in spec["leaves"])
    if total > MAX_BYTES:
        raise ValueError(f"{where}.leaves hold {total} bytes together, over {MAX_BYTES} "
                         "(the limit of an input element)")


#: An input element's structure (repr and description) and its leaves' shapes, dtypes.
ELEMENT_SPEC = then(record(structure=string, tree=structure, leaves=list_of(_leaf_spec)),
                    _element_fits)


def element_spec(treedef: Any, leaves: Sequence[np.ndarray]) -> dict:
    """The :data:`ELEMENT_SPEC` message of an element of ``treedef`` with ``leaves``
    (shared between calls: do not modify it)."""
    return _element_spec(treedef, tuple((x.shape, x.dtype) for x in leaves))


@functools.lru_cache(maxsize=64)
def _element_spec(treedef: Any, leaves: tuple) -> Encoded:
    return Encoded({"structure": str(treedef), "tree": describe(treedef),
                    "leaves": [[list(shape), str(dtype)] for shape, dtype in leaves]})


def leaf_specs(spec: dict) -> list[tuple[tuple[int, ...], str]]:
    """``[(shape, dtype), ...]`` of a checked element spec."""
    return [(tuple(shape), dtype) for shape, dtype in spec["leaves"]]


def spec_str(spec: dict) -> str:
    """An element spec for error messages: ``float32[4, 3], int32[4] in PyTreeDef(...)``."""
    shapes = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in spec["leaves"])
    return shapes if spec["tree"] == LEAF else f"{shapes} in {spec['structure']}"


def _spec_with_data(report: dict, where: str) -> None:
    if report["spec"] is not None and report["status"] != "ok":
        raise ValueError(f"{where} has an element spec with status {report['status']!r}")


#: One process's outcome of reading a step's input (see ``InputIterator``):
#: ``status``, ``detail`` (the partial batch or the error), ``error_type`` (the error's
#: class name), ``seen`` (whether the process knows the element structure) and
#: ``spec`` (the element spec, with status "ok" only).
input_report = then(record(status=one_of("ok", "end", "partial", "error"), detail=string,
                           error_type=string, seen=boolean, spec=optional(ELEMENT_SPEC)),
                    _spec_with_data)

#: The chief's ``(value, error)`` of a checkpoint decision (a step or None, a message).
CHIEF_RESULT = record(value=optional(natural), error=optional(string))

#: The chief's list of complete checkpoint steps, newest first (or its error).
CHECKPOINT_STEPS = record(value=optional(list_of(natural)), error=optional(string))

#: One process's outcome of a checkpoint action every process takes (seeing the
#: directory, reading a step): ``ok``, or what went wrong and how.
CHECKPOINT_OUTCOME = record(kind=one_of("ok", "mismatch", "damaged", "error"),
                            detail=string)

#: One process's outcome of the last background checkpoint write (error None: it
#: committed), and the chief's latest complete step once it ended.
CHECKPOINT_WRITE = record(error=optional(string), latest=optional(natural))

#: The chief's record of the directory's lock (or its error), compared by every process
#: with the lock file it reads.
CHIEF_TEXT = record(value=optional(string), error=optional(string))

#: Whether a process got a preemption notice (SIGTERM) not yet acted on, exchanged at
#: every ``CheckpointManager.save`` when JAX's preemption service does not run.
PREEMPTION_NOTICE = record(noticed=boolean)

#: Whether a process could build the input elements of a step it had to build from
#: the agreed spec (None: it could, or had none to build).
BUILD_RESULT = record(error=optional(string))

#: One process's view of a call's replicated arguments (``jreplicate/execution/agreed.py``):
#: its structure, one description per host-side leaf, and what it refused (``[error
#: type, message]`` each).
RUN_ARGUMENTS = record(
    tree=string, leaves=list_of(string),
    refused=list_of(sequence(string, string, what="an [error type, message] pair")))

#: Every message processes exchange through the coordination service, by what it
#: agrees on (walked by the tests: every number in each is bounded).
MESSAGES = {"this step's input": input_report, "a checkpoint decision": CHIEF_RESULT,
            "the checkpoints to restore": CHECKPOINT_STEPS,
            "a checkpoint outcome": CHECKPOINT_OUTCOME,
            "the outcome of a checkpoint write": CHECKPOINT_WRITE,
            "the checkpoint directory's lock": CHIEF_TEXT,
            "whether a process was preempted": PREEMPTION_NOTICE,
            "building this step's padded input": BUILD_RESULT,
            "the arguments of a call": RUN_ARGUMENTS}
