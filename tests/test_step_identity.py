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
    s.shutdown()
