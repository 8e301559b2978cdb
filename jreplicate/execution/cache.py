"""Which compiled program serves a call of a step function: one cache per executor
(private).

The cache holds one :class:`FunctionEntry` per step function, keyed by the function
object's identity (never its own ``__eq__``: two equal but distinct callables may
compute different things; a bound method by its object and function, so ``obj.step``
fetched anew every call is one step function) and held weakly: a function
object nothing else refers to (a lambda or ``functools.partial`` built for one step, and
whatever it closes over, such as a batch) is freed with its entry, its programs and
their compiled executables. An entry holds the function's programs by
:class:`ProgramKey` (the full path, :meth:`SPMDExecutor._prepare`) and its steady-state
calls by call shape (:mod:`jreplicate.execution.fast`), each of which serves one of
those programs and goes with it. At most ``max_programs`` programs are kept, the least
recently used dropped first. Code compiled again and again for new function objects (a
new lambda, partial or callable object every step, equal to the last or not) gets a
warning naming the fix.
"""

from __future__ import annotations

import collections
import functools
import warnings
import weakref
from collections.abc import Callable
from types import FunctionType, MethodType
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


# -- identity ----------------------------------------------------------------------------
# A step function is identified by the object itself, never by its own ``__eq__`` and
# ``__hash__``: two equal but distinct callables (a frozen dataclass with a
# ``compare=False`` field, a class whose ``__eq__`` always holds) may compute different
# things, and an ``__eq__`` or ``__hash__`` that raises must not break ``run``. A bound
# method, a new object at every access (``obj.step``), is identified by its
# ``__self__`` and ``__func__``: the same object's method is the same step, an equal
# but distinct object's is not. The keys are the objects' addresses (see
# :func:`identity`), valid while the function lives: each is held by a token (a weak
# reference whose callback drops the key's entry when the function is freed, before
# its address can be reused), or, for the few callables that cannot be weakly
# referenced (a builtin, a class with ``__slots__``), held strongly, as ``jax.jit``
# does. Every lookup also checks that the token holds the very object (``holds``).

#: ``object.__hash__``: in CPython a rotation of the object's address, so distinct for
#: live objects, whatever the type's own ``__hash__``; unlike ``id``, which raises an
#: audit event (a Python audit hook, as filelock installs, makes each ``id`` call cost
#: microseconds on the steady-state path).
_address = object.__hash__
_referent = weakref.ref.__call__  # (a WeakMethod's own referent: the method's object)


def identity(fn: Callable) -> Any:
    """The key identifying ``fn`` while it lives: its address, or the addresses of
    ``fn.__self__`` and ``fn.__func__`` for a bound method."""
    if type(fn) is MethodType:
        return (_address(fn.__self__), _address(fn.__func__))
    return _address(fn)


class _Ref(weakref.ref):
    """A weak reference to a callable, carrying its :func:`identity`."""

    __slots__ = ("key",)

    def __init__(self, ob: Any, callback: Callable | None = None):
        super().__init__(ob, callback)
        self.key = _address(ob)

    def holds(self, fn: Callable) -> bool:
        return self() is fn

    # Compared and hashed by identity (a plain weak reference would use the referent's).
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


class _MethodRef(weakref.WeakMethod):
    """A weak reference to a bound method (its ``__self__`` and ``__func__``, each
    weakly), carrying its :func:`identity`; calling it gives a bound method again."""

    __slots__ = ("key",)

    def __init__(self, meth: Any, callback: Callable | None = None):
        super().__init__(meth, callback)
        self.key = (_address(meth.__self__), _address(meth.__func__))

    def holds(self, fn: Callable) -> bool:
        return type(fn) is MethodType and _referent(self) is fn.__self__ \
            and self._func_ref() is fn.__func__

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


class _Held:
    """A callable that cannot be weakly referenced, held strongly (so its address, its
    key, stays its own)."""

    __slots__ = ("fn", "key")

    def __init__(self, fn: Callable):
        self.fn = fn
        self.key = identity(fn)

    def __call__(self) -> Callable:
        return self.fn

    def holds(self, fn: Callable) -> bool:
        return self.fn is fn or type(fn) is MethodType and type(self.fn) is MethodType \
            and self.fn.__self__ is fn.__self__ and self.fn.__func__ is fn.__func__


def _token(fn: Callable, callback: Callable | None = None) -> Any:
    """What holds ``fn`` under its :func:`identity`: a weak reference whose
    ``callback`` (called with the token) runs when ``fn`` is freed, or a :class:`_Held`
    for a callable that cannot be weakly referenced. Calling it gives ``fn`` (None
    once freed); ``token.holds(f)`` tells whether ``f`` is ``fn``; ``token.key`` is
    ``identity(fn)``."""
    try:
        if type(fn) is MethodType:
            return _MethodRef(fn, callback)
        return _Ref(fn, callback)
    except TypeError:  # not weakly referenceable (a builtin, __slots__): held
        return _Held(fn)


def _as_callable(token: Any) -> Callable:
    """A callable standing for the token's function without keeping it alive."""
    return token.fn if isinstance(token, _Held) else _WeakCall(token)


def _code(fn: Callable) -> Any:
    """The code object ``fn`` runs (the recompilation warning counts objects per code):
    through wrappers, partials and bound methods; a callable object's ``__call__``."""
    inner = fn
    for _ in range(32):  # (a bound on wrappers, should one wrap itself)
        if isinstance(inner, _WeakCall):  # (a wrapper's step, held weakly)
            inner = inner._ref()
        elif isinstance(inner, functools.partial):
            inner = inner.func
        elif hasattr(inner, "__wrapped__"):  # a wrapper's step (ps/worker.py)
            inner = inner.__wrapped__
        else:
            break
    inner = getattr(inner, "__func__", inner)
    if not isinstance(inner, FunctionType):  # a callable object: its class's __call__
        try:
            call = type(inner).__call__
        except AttributeError:  # (not callable: no code)
            return None
        inner = getattr(call, "__func__", call)
    return getattr(inner, "__code__", None)


class ProgramCache:
    """The programs and steady-state calls of one executor's step functions."""

    def __init__(self, max_programs: int):
        self._functions: dict[Any, FunctionEntry] = {}  # by identity(fn)
        self._recent: collections.OrderedDict = collections.OrderedDict()  # (identity, key)
        self._max = max_programs
        self._seen = FunctionMap(weak_only=True)  # the functions counted below
        self._objects_per_code: collections.Counter = collections.Counter()
        self._warned: set = set()

    def __len__(self) -> int:
        """The number of programs held."""
        return len(self._recent)

    def entries(self) -> list[FunctionEntry]:
        """The functions' entries (for inspection)."""
        return list(self._functions.values())

    def find(self, fn: Callable) -> FunctionEntry | None:
        """``fn``'s entry (the steady-state path: a bound method of the recorded
        method's object finds it too), or None."""
        if type(fn) is MethodType:
            entry = self._functions.get((_address(fn.__self__), _address(fn.__func__)))
            return entry if entry is not None and entry.token.holds(fn) else None
        entry = self._functions.get(_address(fn))
        return entry if entry is not None and entry.fn() is fn else None

    def get(self, fn: Callable, key: ProgramKey) -> Any:
        """``fn``'s program for ``key``, or None."""
        fid = identity(fn)
        entry = self._functions.get(fid)
        if entry is None or not entry.token.holds(fn):
            return None
        program = entry.programs.get(key)
        if program is not None:
            self._recent.move_to_end((fid, key))
        return program

    def put(self, fn: Callable, key: ProgramKey, build: Callable[[Callable], Any]) -> Any:
        """Builds ``fn``'s program for ``key`` with ``build(callable)``, ``callable``
        standing for ``fn`` without keeping it alive, and stores it."""
        fid = identity(fn)
        entry = self._functions.get(fid)
        created = entry is None or not entry.token.holds(fn)
        if created:
            token = _token(fn, self._forget)
            entry = self._functions[fid] = FunctionEntry(token, token)
        program = build(_as_callable(entry.token))
        entry.programs[key] = program
        self._recent[(fid, key)] = None
        if len(self._recent) > self._max:
            old_fid, old_key = next(iter(self._recent))
            old = self._functions.get(old_fid)
            if old is not None:
                self._drop_program(old, old_key)
            else:  # (its function was freed just now)
                self._recent.pop((old_fid, old_key), None)
        self._note_new_object(fn, created)
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
        fid = entry.token.key
        program = entry.programs.pop(key, None)
        self._recent.pop((fid, key), None)
        for shape in [s for s, c in list(entry.steady.items()) if c.program is program]:
            entry.steady.pop(shape, None)
        if not entry.programs and self._functions.get(fid) is entry:
            self._functions.pop(fid, None)

    def _forget(self, token: Any) -> None:
        """``token``'s function was freed: its entry goes, with every program. (A
        callback of the garbage collector, which may run inside any other method: it
        iterates over copies and tolerates what is already gone.)"""
        fid = token.key
        entry = self._functions.get(fid)
        if entry is not None and entry.token is token:
            self._functions.pop(fid, None)
            for f, key in [(f, key) for f, key in list(self._recent) if f == fid]:
                self._recent.pop((f, key), None)

    def _note_new_object(self, fn: Callable, created: bool) -> None:
        """Counts ``fn`` (once per function object; a bound method once per object)
        under its code, and warns once the same code was compiled for
        :data:`RECOMPILE_WARNING_AFTER` of them. (A callable that cannot be weakly
        referenced is counted when its entry is ``created``: the entry holds it.)"""
        code = _code(fn)
        if code is None or self._seen.get(fn) is not None:
            return
        self._seen[fn] = True
        if not created and self._seen.get(fn) is None:
            return
        self._objects_per_code[code] += 1
        if self._objects_per_code[code] >= RECOMPILE_WARNING_AFTER and code not in self._warned:
            self._warned.add(code)
            warnings.warn(
                f"jreplicate: Replicator.run compiled the step function {code.co_name} "
                f"({code.co_filename}:{code.co_firstlineno}) for "
                f"{self._objects_per_code[code]} different function objects. run compiles "
                "once per function object (a bound method: once per object), even for "
                "objects that compare equal: a lambda, nested def, functools.partial or "
                "callable object built inside the training loop compiles every step. "
                "Build the step function once, outside the loop, and pass per-step values "
                "as arguments.",
                stacklevel=5)


class FunctionMap:
    """A dict from step functions to values, keyed by each function's identity (never
    its own ``__eq__``/``__hash__``; a bound method by its object and function), that
    holds the functions weakly: an entry goes with its function. A callable that
    cannot be weakly referenced (a builtin) is held strongly, as ``jax.jit`` does, or,
    with ``weak_only``, not stored.

    Args:
      on_drop: called with an entry's value when its function is freed (by the garbage
        collector: from any thread, inside any code).
      weak_only: store nothing for a callable that cannot be weakly referenced.
    """

    def __init__(self, on_drop: Callable[[Any], None] | None = None, *,
                 weak_only: bool = False) -> None:
        self._d: dict[Any, tuple[Any, Any]] = {}  # identity -> (token, value)
        self._on_drop = on_drop
        self._weak_only = weak_only

    def _drop(self, token: Any) -> None:
        got = self._d.get(token.key)
        if got is not None and got[0] is token:
            self._d.pop(token.key, None)
            if self._on_drop is not None:
                self._on_drop(got[1])

    def get(self, fn: Callable, default: Any = None) -> Any:
        got = self._d.get(identity(fn))
        return default if got is None or not got[0].holds(fn) else got[1]

    def __getitem__(self, fn: Callable) -> Any:
        got = self._d.get(identity(fn))
        if got is None or not got[0].holds(fn):
            raise KeyError(fn)
        return got[1]

    def __setitem__(self, fn: Callable, value: Any) -> None:
        fid = identity(fn)
        got = self._d.get(fid)
        if got is not None and got[0].holds(fn):
            self._d[fid] = (got[0], value)
            return
        token = _token(fn, self._drop)
        if self._weak_only and isinstance(token, _Held):
            return
        self._d[fid] = (token, value)

    def setdefault(self, fn: Callable, default: Any) -> Any:
        got = self._d.get(identity(fn))
        if got is not None and got[0].holds(fn):
            return got[1]
        self[fn] = default
        return default

    def __len__(self) -> int:
        return len(self._d)


def weak_callable(fn: Callable) -> Callable:
    """``fn`` behind a weak reference: a callable that calls ``fn`` while it lives,
    for wrappers kept in a :class:`FunctionMap` under ``fn`` (a wrapper that held ``fn``
    strongly would keep its own key alive). ``fn`` itself if it cannot be weakly
    referenced."""
    return _as_callable(_token(fn))
