"""The compiled programs of one executor, keyed by step function and signature (private).

The cache holds step functions weakly: a function object the program no longer refers
to (a lambda or ``functools.partial`` built for one step, and whatever it closes over,
such as a batch) is freed with its programs. Code compiled again and again for new
function objects (a new lambda every step) gets a warning naming the fix.
"""

from __future__ import annotations

import collections
import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

#: New function objects with one code object after which ``run`` warns.
RECOMPILE_WARNING_AFTER = 8


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


def _token(fn: Callable, callback: Callable | None = None) -> Any:
    """A weak reference standing for ``fn`` in a key (``fn`` itself if it has none)."""
    try:
        if inspect.ismethod(fn):
            return weakref.WeakMethod(fn, callback)
        return weakref.ref(fn, callback)
    except TypeError:  # not weakly referenceable (a builtin): held, as jax.jit does
        return fn


def _code(fn: Callable) -> Any:
    inner = fn
    while hasattr(inner, "func"):  # functools.partial
        inner = inner.func
    inner = getattr(inner, "__func__", inner)
    return getattr(inner, "__code__", None)


class ProgramCache:
    """Least-recently-used programs, at most ``max_entries``."""

    def __init__(self, max_entries: int):
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._max = max_entries
        self._seen: weakref.WeakSet = weakref.WeakSet()
        self._objects_per_code: collections.Counter = collections.Counter()
        self._warned: set = set()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, fn: Callable, rest: tuple) -> Any:
        key = (_token(fn), rest)
        program = self._entries.get(key)
        if program is not None:
            self._entries.move_to_end(key)
        return program

    def put(self, fn: Callable, rest: tuple, build: Callable[[Callable], Any]) -> Any:
        """Builds the program with ``build(callable)``, ``callable`` standing for ``fn``
        without keeping it alive, and stores it."""
        token = _token(fn, self._forget)
        program = build(fn if token is fn else _WeakCall(token))
        self._entries[(token, rest)] = program
        if len(self._entries) > self._max:
            self._entries.popitem(last=False)
        self._note_new_object(fn)
        return program

    def _forget(self, token: Any) -> None:
        for key in [k for k in self._entries if k[0] is token]:
            del self._entries[key]

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
