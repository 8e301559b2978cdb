"""How a ``rep.run`` call becomes a step under ParameterServerStrategy
(:class:`jreplicate.ps.step_builder.StepBuilder`), thread-free, against the
arguments as given: the registered params and optimizer state are found by identity
wherever they stand, every other argument is read as of the call (refilling the
caller's NumPy arrays afterwards changes nothing), a batch is copied, and each step
function keeps one key for as long as it lives."""

import gc
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr
from jreplicate.ps.step_builder import StepBuilder


def _builder():
    freed = []
    b = StepBuilder(on_function_freed=freed.append)
    params = {"w": jnp.zeros(3), "b": jnp.zeros(2)}
    opt = (jnp.zeros(3), jnp.zeros(2))
    b.register(params, opt)
    return b, params, opt, freed


def _step(ctx, *args):
    return args


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["params", "opt", "np", "jax", "num", "copy_params"]),
                min_size=1, max_size=6).filter(lambda xs: "params" in xs))
def test_params_and_opt_found_by_identity_and_the_rest_read_now(kinds):
    b, params, opt, _ = _builder()
    args, originals = [], []
    for i, k in enumerate(kinds):
        a = {"params": params, "opt": opt, "np": np.full(2, float(i), np.float32),
             "jax": jnp.full(2, float(i)), "num": float(i),
             # equal values, other objects: not the registered params
             "copy_params": {"w": jnp.zeros(3), "b": jnp.zeros(2)}}[k]
        args.append(a)
        originals.append(np.array(a, copy=True) if k == "np" else None)
    c = b.closure(7, _step, False, None, tuple(args), (), frozenset())
    assert c.step_id == 7
    assert c.param_index == kinds.index("params")
    want_opt = kinds.index("opt") if "opt" in kinds else None
    assert c.opt_index == want_opt
    for i, k in enumerate(kinds):
        if i in (c.param_index, c.opt_index):
            assert c.args[i] is None  # the worker substitutes the shards' values
        elif k == "np":
            args[i][:] = -1.0  # the caller refills its array after run returned
            np.testing.assert_array_equal(c.args[i], originals[i])
        elif k == "jax":
            assert c.args[i] is args[i]  # immutable: not copied


def test_a_batch_is_copied_and_per_replica_arrays_too():
    b, params, opt, _ = _builder()
    x = np.ones((4, 2), np.float32)
    p = np.ones((8, 2), np.float32)
    c = b.closure(0, _step, True, {"x": x, "p": jr.PerReplica(p)}, (params, opt), (),
                  frozenset())
    x[:] = 5.0
    p[:] = 5.0
    np.testing.assert_array_equal(c.batch["x"], 1.0)
    np.testing.assert_array_equal(c.batch["p"], 1.0)


def test_each_function_keeps_one_key_while_it_lives_and_its_key_is_freed_with_it():
    b, params, opt, freed = _builder()

    def make():
        def f(ctx, p, o):
            return p
        return f

    f, g = make(), make()
    keys = [b.closure(i, fn, False, None, (params, opt), (), frozenset()).fn_key
            for i, fn in enumerate([f, g, f, g, f])]
    assert keys[0] == keys[2] == keys[4] and keys[1] == keys[3] and keys[0] != keys[1]
    del f
    gc.collect()
    assert freed == [keys[0]]
    h = make()
    assert b.closure(9, h, False, None, (params, opt), (), frozenset()).fn_key not in keys


def test_no_params_among_the_arguments_is_refused_with_the_fix():
    b, params, opt, _ = _builder()
    with pytest.raises(ValueError, match="none of the step's arguments is the params"):
        b.closure(0, _step, False, None, ({"w": jnp.zeros(3), "b": jnp.zeros(2)}, opt),
                  (), frozenset())


def test_donate_argnums_warns_once():
    b, params, opt, _ = _builder()
    with pytest.warns(UserWarning, match=r"donate_argnums=\(0,\)\) has no effect"):
        b.closure(0, _step, False, None, (params, opt), (0,), frozenset())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b.closure(1, _step, False, None, (params, opt), (0,), frozenset())
