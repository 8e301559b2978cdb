"""Which compiled program serves a call of a step function: one cache per executor
(private).

The cache holds one :class:`FunctionEntry` per step function, held weakly: a function
object nothing else refers to (a lambda or ``functools.partial`` built for one step, and
whatever it closes over, such as a batch) is freed with its entry, its programs and
their compiled executables. An entry holds the function's programs by
:class:`ProgramKey` (the full path, :meth:`SPMDExecutor._prepare`) and its steady-state
calls by call shape (:mod:`jreplicate.execution.fast`), each of which serves one of
those programs and goes with it. At most ``max_programs`` programs are kept, the least
recently used dropped first. Code compiled again and again for new function objects (a
new lambda every step) gets a warning naming the fix.
"""

from __future__ import annotations

import collections
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

#: New function objects with one code object after which ``run`` warns.
RECOMPILE_WARNING_AFTER = 8

#: Steady-state calls one function may record before they are all dropped (a bound on
#: call shapes that map to the same programs; each is recorded again on its next call).
MAX_STEADY_PER_FUNCTION = 256


class ProgramKey(NamedTuple):
    """What selects a compiled program of one step function: the call's signature."""

    has_batch: bool
    treedef: Any            # of (batch, plain args, NNX state)
    graphdef: Any           # of the NNX arguments, or None
    node_pos: tuple[int, ...]  # positions of the NNX arguments
    kinds: tuple            # per flat leaf: a program.LeafKind
    steps: int | None
    donate_argnums: tuple[int, ...]
    avals: tuple            # per flat leaf: (shape, dtype, weak type)


class CallShape(NamedTuple):
    """What selects a steady-state call of one step function (see
    :mod:`jreplicate.execution.fast`, which looks it up with a plain tuple of these
    fields in this order: equal, and of equal hash)."""

    treedef: Any            # of (batch, args), NNX Variables as leaves
    has_batch: bool
    steps: int | None
    donate_argnums: tuple[int, ...]


class FunctionEntry:
    """What the cache holds for one step function."""

    __slots__ = ("token", "fn", "programs", "steady", "nnx")

    def __init__(self, token: Any, fn: Callable[[], Any]):
        #: Its key in the cache: a weak reference whose callback drops the entry.
        self.token = token
        #: Returns the step function, or None once it is freed.
        self.fn = fn
        #: Its compiled programs (:class:`jreplicate.execution.program.Program`).
        self.programs: dict[ProgramKey, Any] = {}
        #: Its steady-state calls (:class:`jreplicate.execution.fast.SteadyCall`), each
        #: serving one of ``programs``.
        self.steady: dict[CallShape, Any] = {}
        #: Whether a steady-state call was recorded with NNX Variables among the leaves
        #: (its calls flatten them in Python; plain pytrees flatten in C++).
        self.nnx = False


class _WeakCall:
    """Calls the function behind a weak reference (the program must not keep it)."""

    __slots__ = ("_ref",)

    def __init__(self, ref: weakref.ref):
        self._ref = ref

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self._ref()
        if fn is None:  # only a trace after the function was freed could get here
            raise RuntimeError("jreplicate: the step function was garbage-collected.")
        return fn(*args, **kwargs)


class _IdentityRef(weakref.ref):
    """A weak reference hashed and compared by its referent's identity: the key of a
    callable that is not hashable (a dataclass with ``__call__``, whose ``eq=True``
    removes ``__hash__``), which a plain weak reference cannot be."""

    __slots__ = ("_id",)

    def __init__(self, ob: Any, callback: Callable | None = None):
        super().__init__(ob, callback)
        self._id = id(ob)

    def __hash__(self) -> int:
        return hash(self._id)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, _IdentityRef):
            return NotImplemented
        ob = self()
        return ob is not None and ob is other()


def _hashable(fn: Callable) -> bool:
    try:
        hash(fn)
    except TypeError:
        return False
    return True


def _token(fn: Callable, callback: Callable | None = None) -> Any:
    """A weak reference standing for ``fn`` in a key (``fn`` itself if it has none)."""
    try:
        if inspect.ismethod(fn):
            return weakref.WeakMethod(fn, callback)
        if not _hashable(fn):
            return _IdentityRef(fn, callback)
        return weakref.ref(fn, callback)
    except TypeError:  # not weakly referenceable (a builtin): held, as jax.jit does
        return fn


def _code(fn: Callable) -> Any:
    inner = fn
    for _ in range(32):  # (a bound on wrappers, should one wrap itself)
        if isinstance(inner, _WeakCall):  # (a wrapper's step, held weakly)
            inner = inner._ref()
        elif hasattr(inner, "__wrapped__"):  # a wrapper's step (ps/worker.py)
            inner = inner.__wrapped__
        elif hasattr(inner, "func"):  # functools.partial
            inner = inner.func
        else:
            break
    inner = getattr(inner, "__func__", inner)
    return getattr(inner, "__code__", None)


_ref = weakref.ref


class ProgramCache:
    """The programs and steady-state calls of one executor's step functions."""

    def __init__(self, max_programs: int):
        self._functions: dict[Any, FunctionEntry] = {}
        self._recent: collections.OrderedDict = collections.OrderedDict()  # (token, key)
        self._max = max_programs
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._objects_per_code: collections.Counter = collections.Counter()
        self._warned: set = set()

    def __len__(self) -> int:
        """The number of programs held."""
        return len(self._recent)

    def entries(self) -> list[FunctionEntry]:
        """The functions' entries (for inspection)."""
        return list(self._functions.values())

    def find(self, fn: Callable) -> FunctionEntry | None:
        """``fn``'s entry if it is the very function recorded (the steady-state path:
        an equal bound method, a new object at every access, is not), else None."""
        try:
            # The entry's own weak reference is returned here: no new object.
            entry = self._functions.get(_ref(fn))
        except TypeError:  # not weakly referenceable, or not hashable: its token
            try:
                entry = self._functions.get(_token(fn))
            except TypeError:  # neither hashable nor weakly referenceable: never cached
                return None
        if entry is None or entry.fn() is not fn:
            return None
        return entry

    def get(self, fn: Callable, key: ProgramKey) -> Any:
        """``fn``'s program for ``key``, or None."""
        token = _token(fn)
        entry = self._functions.get(token)
        program = None if entry is None else entry.programs.get(key)
        if program is not None:
            self._recent.move_to_end((token, key))
        return program

    def put(self, fn: Callable, key: ProgramKey, build: Callable[[Callable], Any]) -> Any:
        """Builds ``fn``'s program for ``key`` with ``build(callable)``, ``callable``
        standing for ``fn`` without keeping it alive, and stores it."""
        entry = self._functions.get(_token(fn))
        if entry is None:
            token = _token(fn, self._forget)
            entry = self._functions[token] = FunctionEntry(token, _handle(fn, token))
        token = entry.token
        program = build(fn if token is fn else _WeakCall(token))
        entry.programs[key] = program
        self._recent[(token, key)] = None
        if len(self._recent) > self._max:
            old_token, old_key = next(iter(self._recent))
            old = self._functions.get(old_token)
            if old is not None:  # (None: its function was freed just now)
                self._drop_program(old, old_key)
        self._note_new_object(fn)
        return program

    def record(self, entry: FunctionEntry, shape: CallShape, call: Any) -> None:
        """Records a steady-state call of ``entry``'s function; ``call.program`` is one
        of its programs."""
        if len(entry.steady) >= MAX_STEADY_PER_FUNCTION:
            entry.steady.clear()
        entry.steady[shape] = call

    def _drop_program(self, entry: FunctionEntry, key: ProgramKey) -> None:
        """Drops ``entry``'s program for ``key`` with the steady-state calls it serves,
        and the entry once it has no programs left."""
        program = entry.programs.pop(key, None)
        self._recent.pop((entry.token, key), None)
        for shape in [s for s, c in list(entry.steady.items()) if c.program is program]:
            entry.steady.pop(shape, None)
        if not entry.programs:
            self._functions.pop(entry.token, None)

    def _forget(self, token: Any) -> None:
        """``token``'s function was freed: its entry goes, with every program. (A
        callback of the garbage collector, which may run inside any other method: it
        iterates over copies and tolerates what is already gone.)"""
        if self._functions.pop(token, None) is not None:
            for t, key in [(t, key) for t, key in list(self._recent) if t is token]:
                self._recent.pop((t, key), None)

    def _note_new_object(self, fn: Callable) -> None:
        code = _code(fn)
        if code is None or inspect.ismethod(fn):  # a bound method is new at every access
            return
        try:
            if fn in self._seen:
                return
            self._seen.add(fn)
        except TypeError:
            return
        self._objects_per_code[code] += 1
        if self._objects_per_code[code] >= RECOMPILE_WARNING_AFTER and code not in self._warned:
            self._warned.add(code)
            warnings.warn(
                f"jreplicate: Replicator.run compiled the step function {code.co_name} "
                f"({code.co_filename}:{code.co_firstlineno}) for "
                f"{self._objects_per_code[code]} different function objects. run compiles "
                "once per function object: a lambda, nested def or functools.partial built "
                "inside the training loop compiles every step. Build the step function once, "
                "outside the loop, and pass per-step values as arguments.",
                stacklevel=5)


def _handle(fn: Callable, token: Any) -> Callable[[], Any]:
    """What :attr:`FunctionEntry.fn` holds: the plain weak reference to ``fn`` that
    :meth:`ProgramCache.find` gets back from ``weakref.ref(fn)`` (CPython shares it while
    it lives), the method's token, or ``fn`` itself if it can't be weakly referenced."""
    if token is fn:
        return lambda: fn
    if isinstance(token, (weakref.WeakMethod, _IdentityRef)):
        return token
    return _ref(fn)


_GONE = object()


class FunctionMap:
    """A dict from step functions to values that holds the functions weakly (an entry
    goes with its function) and works for every callable: by equality for hashable ones
    (as ``weakref.WeakKeyDictionary``), by identity for unhashable ones, and holding the
    few that cannot be weakly referenced (builtins) as ``jax.jit`` does.

    Args:
      on_drop: called with an entry's value when its function is freed (by the garbage
        collector: from any thread, inside any code).
    """

    def __init__(self, on_drop: Callable[[Any], None] | None = None) -> None:
        self._d: dict[Any, Any] = {}
        self._on_drop = on_drop

    def _drop(self, token: Any) -> None:
        value = self._d.pop(token, _GONE)
        if value is not _GONE and self._on_drop is not None:
            self._on_drop(value)

    def get(self, fn: Callable, default: Any = None) -> Any:
        return self._d.get(_token(fn), default)

    def __getitem__(self, fn: Callable) -> Any:
        return self._d[_token(fn)]

    def __setitem__(self, fn: Callable, value: Any) -> None:
        token = _token(fn)
        if token in self._d:
            self._d[token] = value
        else:
            self._d[_token(fn, self._drop)] = value

    def setdefault(self, fn: Callable, default: Any) -> Any:
        token = _token(fn)
        if token not in self._d:
            self[fn] = default
        return self._d[token]

    def __len__(self) -> int:
        return len(self._d)


def weak_callable(fn: Callable) -> Callable:
    """``fn`` behind a weak reference: a callable that calls ``fn`` while it lives,
    for wrappers kept in a :class:`FunctionMap` under ``fn`` (a wrapper that held ``fn``
    strongly would keep its own key alive). ``fn`` itself if it cannot be weakly
    referenced."""
    token = _token(fn)
    return fn if token is fn else _WeakCall(token)
