"""Compiled programs are keyed by the step function's identity, never its ``__eq__``.

Two equal but distinct callables (a frozen dataclass with a ``compare=False`` field, a
class whose ``__eq__`` always holds) may compute different things: each runs its own
code, under every strategy and in device loops; the same object (and ``obj.method``,
a new bound-method object at every access) is traced once; the recompilation warning
fires for new objects built every step, equal or not, and only for them.
"""

import dataclasses
import functools
import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jreplicate as jr
from tests._ps_helpers import bounded_test  # noqa: F401 - every PS test is bounded


@dataclasses.dataclass(frozen=True)
class Scale:
    """Equal for equal names, whatever ``k``: the issue's step."""

    name: str
    k: float = dataclasses.field(compare=False)

    def __call__(self, ctx, x):
        return x * self.k


def _mirrored():
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))


def test_equal_but_distinct_steps_run_their_own_code():
    rep = _mirrored()
    x = jnp.arange(4.0)
    a, b = Scale("s", 2.0), Scale("s", 3.0)
    assert a == b and hash(a) == hash(b)
    for _ in range(2):  # (the second round takes the steady-state path)
        np.testing.assert_array_equal(np.asarray(rep.run(a, None, x)), np.arange(4.0) * 2)
        np.testing.assert_array_equal(np.asarray(rep.run(b, None, x)), np.arange(4.0) * 3)


def test_equal_but_distinct_steps_in_device_loops():
    rep = _mirrored()
    x = jnp.arange(4.0)
    a, b = Scale("s", 2.0), Scale("s", 3.0)
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(rep.run(a, None, x, steps=3)),
                                      np.arange(4.0) * 8)
        np.testing.assert_array_equal(np.asarray(rep.run(b, None, x, steps=3)),
                                      np.arange(4.0) * 27)


def test_equal_but_distinct_steps_with_steps_per_run():
    tpu = jr.Replicator(jr.TPUStrategy(devices=jax.devices()[:2], steps_per_run=2))

    @dataclasses.dataclass(frozen=True)
    class Shift:
        name: str
        k: float = dataclasses.field(compare=False)

        def __call__(self, ctx, batch, w):
            return w + self.k * ctx.all_sum(jnp.sum(batch)), batch

    def input_fn(ctx):
        return (np.full((1,), 1.0, np.float32) for _ in range(4))

    a, b = Shift("s", 1.0), Shift("s", 10.0)
    it = tpu.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA)
    w = jnp.zeros(())
    w, _ = tpu.run(a, it, w)  # 2 steps of a: w + 2 * 2
    w, _ = tpu.run(b, it, w)  # 2 steps of b: w + 2 * 20
    assert float(w) == 44.0


def test_a_bound_method_fetched_every_call_takes_the_steady_state_path(counted):
    """``obj.step`` is a new object at every access, but one step function: after its
    first call, its calls skip the checks (and an equal object's method does not)."""
    _MODE.clear()
    rep = _mirrored()
    w = rep.replicate(jnp.arange(3.0))
    m, other = _Model(2.0, "m"), _Model(5.0, "other")
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(rep.run(m.step, None, w)), np.arange(3.0) * 2)
    assert counted == {"hit": 4, "miss": 1}
    np.testing.assert_array_equal(np.asarray(rep.run(other.step, None, w)), np.arange(3.0) * 5)
    assert counted == {"hit": 4, "miss": 2}


def _ps_setup():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)
    return s, rep, w, opt, tx


def test_equal_but_distinct_steps_under_a_parameter_server():
    """The embedded carrier: each step pushes its own gradient and returns its own
    value (the worker's compiled steps, and the driver's function keys that a Ray
    worker keeps functions under, are per object)."""
    s, rep, w, opt, tx = _ps_setup()

    @dataclasses.dataclass(frozen=True)
    class Push:
        name: str
        k: float = dataclasses.field(compare=False)

        def __call__(self, ctx, w, opt):
            u, opt = tx.update(jnp.full(3, -self.k), opt, w)  # sgd(1): w += k
            return w * self.k

    a, b = Push("p", 1.0), Push("p", 10.0)
    outs = [rep.run(f, None, w, opt) for f in (a, b, a, b)]
    rep.join()
    got = [float(np.asarray(o.fetch())[0]) for o in outs]
    assert got == [0.0, 10.0, 11.0, 120.0]  # w before each step, times its k
    np.testing.assert_array_equal(np.asarray(s.parameters()), np.full(3, 22.0))
    keys = s._executor._steps.fn_keys  # (a Ray worker actor keeps the functions it was sent by key)
    assert keys.get(a) is not None and keys.get(b) not in (None, keys.get(a))
    s.shutdown()


# -- the class: every kind of callable a step may be -------------------------------------
#
# Each kind makes steps computing "times k" (under a parameter server: pushing -k as the
# gradient of sgd(1), so w += k, and returning w * k), counting its traces under its own
# label. A "fresh" kind makes a new object at every make(k) (equal to the others where
# the kind's equality allows); the others name fixed functions (k in (2, 3)).

TRACES: dict = {}
_MODE: dict = {}  # "tx" under a parameter server


def _apply(label, k, ctx, *args):
    TRACES[label] = TRACES.get(label, 0) + 1  # the body runs only while traced
    if "tx" not in _MODE:
        (x,) = args
        return x * k
    w, opt = args
    u, opt = _MODE["tx"].update(jnp.full(w.shape, -k, w.dtype), opt, w)
    return w * k


def _f2(ctx, *args):
    return _apply("f2", 2.0, ctx, *args)


def _f3(ctx, *args):
    return _apply("f3", 3.0, ctx, *args)


class _Static:
    s2 = staticmethod(_f2)
    s3 = staticmethod(_f3)


class _Cls2:
    k = 2.0

    @classmethod
    def step(cls, ctx, *args):
        return _apply(cls.__name__, cls.k, ctx, *args)


class _Cls3(_Cls2):
    k = 3.0


def _scaled(ctx, *args, k, label):
    return _apply(label, k, ctx, *args)


class _Cfg:
    """Partial arguments that compare equal whatever their k."""

    def __init__(self, k, label):
        self.k, self.label = k, label

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


def _scaled_cfg(ctx, *args, cfg):
    return _apply(cfg.label, cfg.k, ctx, *args)


class _Model:
    """Its instances compare equal; ``step`` is the step (a bound method)."""

    def __init__(self, k, label):
        self.k, self.label = k, label

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0

    def step(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


@dataclasses.dataclass
class _EqData:  # eq=True: not hashable
    k: float
    label: str = dataclasses.field(compare=False)

    def __call__(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


@dataclasses.dataclass(frozen=True)
class _Frozen:  # hashable, equal whatever k
    name: str
    k: float = dataclasses.field(compare=False)
    label: str = dataclasses.field(compare=False, default="")

    def __call__(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


class _AlwaysEqual(_Model):
    def __call__(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


class _EqRaises(_Model):
    def __eq__(self, other):
        raise RuntimeError("__eq__ called")

    __hash__ = _Model.__hash__

    def __call__(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


class _HashRaises(_Model):
    def __hash__(self):
        raise RuntimeError("__hash__ called")

    def __call__(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


class _Slotted:
    """Not weakly referenceable, and equal to every other."""

    __slots__ = ("k", "label")

    def __init__(self, k, label):
        self.k, self.label = k, label

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0

    def __call__(self, ctx, *args):
        return _apply(self.label, self.k, ctx, *args)


def _nnx_module(k, label):
    from flax import nnx

    class Step(nnx.Module):
        def __init__(self):
            self.k, self.label = k, label

        def __call__(self, ctx, *args):
            return _apply(self.label, self.k, ctx, *args)

    return Step()


_NEXT = [0]


def _label():
    _NEXT[0] += 1
    return f"o{_NEXT[0]}"


def _fresh(build):
    """``make(k)``: a new object (``getter`` returns it) and its trace label."""
    def make(k):
        label = _label()
        obj = build(k, label)
        return (lambda: obj), label
    return make


def _lambda(k, label):
    return lambda ctx, *args: _apply(label, k, ctx, *args)


def _nested(k, label):
    def step(ctx, *args):
        return _apply(label, k, ctx, *args)
    return step


def _make_method(k):
    label = _label()
    obj = _Model(k, label)
    return (lambda: obj.step), label  # a new bound-method object at every access


# name -> (fresh, make): make(k) -> (getter, label or None for the fixed functions)
KINDS = {
    "function": (False, lambda k: ((lambda: {2.0: _f2, 3.0: _f3}[k]), None)),
    "staticmethod": (False, lambda k: ((lambda: getattr(_Static(), f"s{int(k)}")), None)),
    "classmethod": (False, lambda k: ((lambda: {2.0: _Cls2, 3.0: _Cls3}[k].step), None)),
    "lambda": (True, _fresh(_lambda)),
    "nested def": (True, _fresh(_nested)),
    "partial, different args": (True, _fresh(
        lambda k, label: functools.partial(_scaled, k=k, label=label))),
    "partial, equal args": (True, _fresh(
        lambda k, label: functools.partial(_scaled_cfg, cfg=_Cfg(k, label)))),
    "bound method": (True, _make_method),
    "eq dataclass": (True, _fresh(_EqData)),
    "frozen dataclass": (True, _fresh(lambda k, label: _Frozen("s", k, label))),
    "always-equal object": (True, _fresh(_AlwaysEqual)),
    "__eq__ raises": (True, _fresh(_EqRaises)),
    "__hash__ raises": (True, _fresh(_HashRaises)),
    "not weakly referenceable": (True, _fresh(_Slotted)),
    "nnx module": (True, _fresh(_nnx_module)),
}

FIXED_LABELS = {"function": {2.0: "f2", 3.0: "f3"}, "staticmethod": {2.0: "f2", 3.0: "f3"},
                "classmethod": {2.0: "_Cls2", 3.0: "_Cls3"}}


class _Harness:
    """Runs steps on one Replicator and checks each result against a NumPy reference
    (under a parameter server: the sequence replayed, w += k per step)."""

    def __init__(self, ps: bool):
        TRACES.clear()
        _MODE.clear()
        self.ps = ps
        if ps:
            self.s, self.rep, self.w, self.opt, _MODE["tx"] = _ps_setup()
            self.pending, self.ref_w = [], np.zeros(3, np.float32)
        else:
            self.rep = _mirrored()
            self.x = jnp.arange(3.0)

    def run(self, fn, k):
        if not self.ps:
            got = np.asarray(self.rep.run(fn, None, self.x))
            np.testing.assert_array_equal(got, np.arange(3.0) * k)
            return
        self.pending.append((self.rep.run(fn, None, self.w, self.opt), self.ref_w * k))
        self.ref_w = self.ref_w + np.float32(k)

    def check(self):
        if self.ps:
            self.rep.join()
            for out, want in self.pending:
                np.testing.assert_array_equal(np.asarray(out.fetch()), want)
            np.testing.assert_array_equal(np.asarray(self.s.parameters()), self.ref_w)
            self.pending = []

    def close(self):
        _MODE.clear()
        if self.ps:
            self.s.shutdown()


@pytest.fixture(params=["mirrored", "ps-embedded"])
def harness(request):
    h = _Harness(request.param == "ps-embedded")
    yield h
    h.close()


def _labels(kind, k, label):
    return FIXED_LABELS[kind][k] if label is None else label


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_object_runs_its_own_code_and_is_traced_once(harness, kind):
    """Two steps of one kind (equal where the kind allows), alternated: each computes
    its own result, and is traced once however often it runs (``obj.method`` and a
    classmethod are fetched anew for every call)."""
    _, make = KINDS[kind]
    (get_a, la), (get_b, lb) = make(2.0), make(3.0)
    la, lb = _labels(kind, 2.0, la), _labels(kind, 3.0, lb)
    for _ in range(3):
        harness.run(get_a(), 2.0)
        harness.run(get_b(), 3.0)
    harness.check()
    assert TRACES == {la: 1, lb: 1}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_recompile_warning_fires_exactly_for_new_objects(harness, kind, monkeypatch):
    """A new object every step (equal to the last where the kind allows) compiles every
    step: the warning comes with the RECOMPILE_WARNING_AFTER-th (here 3), once; one
    object run again and again (``obj.method`` fetched anew each time) never warns."""
    from jreplicate.execution import cache

    monkeypatch.setattr(cache, "RECOMPILE_WARNING_AFTER", 3)
    fresh, make = KINDS[kind]

    def warned():
        harness.check()  # (a parameter server's worker compiles, and warns, on its thread)
        return [w for w in seen if "compiled the step function" in str(w.message)]

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        get, label = make(2.0)
        for _ in range(5):
            harness.run(get(), 2.0)
        harness.check()
        assert TRACES == {_labels(kind, 2.0, label): 1}
        if fresh:
            harness.run(make(2.0)[0](), 2.0)  # the second object
            assert warned() == [] and len(TRACES) == 2
            harness.run(make(2.0)[0](), 2.0)  # the third: the warning
            harness.run(make(2.0)[0](), 2.0)  # the fourth: no second warning
            assert len(warned()) == 1 and len(TRACES) == 4
            assert "different function objects" in str(warned()[0].message)
        harness.check()
    assert [str(w.message) for w in seen] == (
        [str(w.message) for w in warned()] if fresh else [])


def test_a_freed_step_takes_its_programs_with_it(harness):
    """Identity keys hold nothing: every kind of step, dropped, is freed (and its
    programs with it)."""
    refs = []
    for kind, (fresh, make) in KINDS.items():
        if not fresh or kind == "not weakly referenceable":
            continue
        get, _ = make(2.0)
        fn = get()
        harness.run(fn, 2.0)
        refs.append((kind, weakref.ref(getattr(fn, "__self__", fn))))
        del fn, get
    harness.check()
    gc.collect()
    assert [kind for kind, r in refs if r() is not None] == []
    if not harness.ps:
        assert len(harness.rep._executor._cache) == 0


_POOL_REP: list = []


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["new", "run", "run", "run"]), st.integers(0, 3),
                          st.sampled_from(sorted(KINDS)), st.sampled_from([2.0, 3.0, 5.0])),
                min_size=1, max_size=12))
def test_steps_of_every_kind_mixed_dropped_and_rebuilt(actions):
    """Steps of all kinds in four slots, rebuilt (the old one dropped and collected, so
    that its id may come back for the new one) and run in any order on one Replicator
    for every example: each run computes its own step's result, and no step is traced
    twice."""
    if not _POOL_REP:
        _POOL_REP.append(_mirrored())
    rep, x = _POOL_REP[0], jnp.arange(3.0)
    TRACES.clear()
    _MODE.clear()
    # Four slots filled first, then rebuilt and run in the drawn order.
    actions = [("new", i, kind, k) for i, (_, _, kind, k) in enumerate(actions[:4])] + \
        [("run", i, None, None) for i in range(4)] + actions
    slots: dict = {}
    with warnings.catch_warnings():  # (new lambdas every example: tested above)
        warnings.filterwarnings("ignore", "jreplicate: Replicator.run compiled")
        _run_actions(rep, x, actions, slots)
    assert all(n == 1 for n in TRACES.values()), TRACES


def _run_actions(rep, x, actions, slots):
    for op, slot, kind, k in actions:
        if op == "new":
            fresh, make = KINDS[kind]
            k = k if fresh else min(k, 3.0)
            slots.pop(slot, None)
            gc.collect()
            slots[slot] = (make(k)[0], k)
        elif slot in slots:
            get, k = slots[slot]
            np.testing.assert_array_equal(np.asarray(rep.run(get(), None, x)),
                                          np.arange(3.0) * k)
