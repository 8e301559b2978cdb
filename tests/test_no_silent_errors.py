"""Issue 9's silent wrong answers and first-hour stumbles in the engine: each case is a
correct result or an error naming the fix."""

import re
import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr

# Toy steps here all-reduce replicated values (ctx.all_sum of a module's own state) as
# the computation they check, which Replicator.run warns about as a pmap habit
# (jr.ReplicationHabitWarning, an error in this suite): allowed in this module.
pytestmark = pytest.mark.filterwarnings("ignore::jreplicate.ReplicationHabitWarning")


@pytest.fixture
def rep():
    return jr.Replicator(jr.MirroredStrategy())


# -- 1. values that do not fit the 32-bit types --------------------------------------------
@pytest.mark.parametrize("value, dtype, shown", [
    (2**31 + 5, np.int64, "2147483653"), (2**40, np.int64, "1099511627776"),
    (-(2**31) - 1, np.int64, "-2147483649"), (2**33, np.uint64, "8589934592"),
    (1e300, np.float64, "1e+300")])
def test_values_that_would_wrap_are_errors(rep, value, dtype, shown):
    bad = np.array([1, value], dtype)
    inputs = rep.prepare_input(lambda ctx: iter([bad] * 2),
                               jr.InputReplicationMode.PER_REPLICA)
    with pytest.raises(ValueError, match=r"input element of replica \d at the root holds "
                                         rf"{re.escape(shown)}.*jax_enable_x64"):
        rep.run(lambda ctx, b: b, inputs)
    with pytest.raises(ValueError, match=rf"argument \[0\] holds {re.escape(shown)}.*not fit"):
        rep.run(lambda ctx, w: w, None, bad)


def test_values_that_fit_pass_unchanged(rep):
    ok = np.array([2**31 - 1, -(2**31), 7], np.int64)
    out = rep.run(lambda ctx, w: w, None, ok)
    np.testing.assert_array_equal(np.asarray(out), ok)
    f = np.array([np.inf, -np.inf, 3e38, 1e-300], np.float64)  # inf stays inf
    np.testing.assert_array_equal(np.asarray(rep.run(lambda ctx, w: w, None, f)),
                                  f.astype(np.float32))


# -- 2. a plain global batch is split, never replicated ------------------------------------
def test_plain_global_batch_is_split_over_replicas(rep):
    n = rep.num_replicas
    x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    y = (np.arange(64) % 10).astype(np.int32)

    def step(ctx, batch):
        xb, yb = batch
        loss = jr.compute_average_loss(jnp.sum(xb, -1) * 0 + 1.0, 64)
        return ctx.all_sum(loss), xb, yb

    total, xb, yb = rep.run(step, (x, y))
    assert float(total) == pytest.approx(1.0)  # was 8x too large when replicated
    assert xb.shape == (64 // n, 3)
    for r in range(n):
        np.testing.assert_array_equal(np.asarray(xb[r]), x[r * 8:(r + 1) * 8])
        np.testing.assert_array_equal(np.asarray(yb[r]), y[r * 8:(r + 1) * 8])
    np.testing.assert_array_equal(np.asarray(rep.run(step, (jnp.asarray(x), y))[1][3]),
                                  x[24:32])


def test_global_batch_errors_name_the_fix(rep):
    with pytest.raises(ValueError, match=r"inputs \[0\] has shape \(60, 3\).*divisible by 8"):
        rep.run(lambda ctx, b: b, (np.ones((60, 3)), np.ones(64)))
    with pytest.raises(ValueError, match=r"inputs \['lr'\] has a scalar.*arguments after "
                                         r"inputs"):
        rep.run(lambda ctx, b: b, {"x": np.ones((64, 3)), "lr": 0.1})


# -- 3. a changed input structure names the path -------------------------------------------
@pytest.mark.parametrize("second, message", [
    ({"x": np.ones(2)}, r"missing \['y'\]"),
    ({"x": np.ones(2), "z": np.ones(2)}, r"missing \['y'\]; new \['z'\]"),
    ((np.ones(2), np.ones(2)), r"missing \['x'\], \['y'\]; new \[0\], \[1\]"),
])
def test_changed_element_structure_is_an_error_naming_the_path(rep, second, message):
    first = {"x": np.ones(2), "y": np.ones(2)}
    inputs = rep.prepare_input(lambda ctx: iter([first, second]),
                               jr.InputReplicationMode.PER_REPLICA)
    rep.run(lambda ctx, b: b, inputs)
    with pytest.raises(ValueError, match=r"changed structure since the first step: " + message):
        rep.run(lambda ctx, b: b, inputs)


# -- 4. a failed step leaves its batch for a retry -----------------------------------------
@pytest.mark.parametrize("steps", [None, 2])
def test_failed_step_keeps_its_batch_for_the_retry(rep, steps):
    data = [np.full((2,), i, np.float32) for i in range(6)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA)
    calls = []

    def flaky(ctx, batch, seen):
        if not calls:
            calls.append(1)
            raise RuntimeError("transient")
        return seen + ctx.all_sum(batch[..., 0]) / ctx.num_replicas, ctx.all_sum(batch)

    seen = jnp.zeros(() if steps is None else ())
    with pytest.raises(RuntimeError, match="transient"):
        rep.run(flaky, inputs, seen, steps=steps)
    seen, first = rep.run(flaky, inputs, seen, steps=steps)
    # The retry got batch 0 (not batch 1 or 2): nothing was consumed by the failure.
    assert float(np.asarray(first).reshape(-1)[0]) == 0.0


# -- 7. plain Python attributes of NNX modules ---------------------------------------------
def test_mutating_a_python_attribute_of_an_nnx_module_is_an_error(rep):
    from flax import nnx

    class Counted(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.calls = 0
            self.steps = nnx.Variable(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.steps[...] += 1  # a Variable: updated and written back every step
            return self.lin(x)

    with rep.scope():
        m = Counted()
    for _ in range(3):
        rep.run(lambda ctx, m: ctx.all_sum(m(jnp.ones((1, 2))).sum()), None, m)
    assert int(m.steps[...]) == 3

    def bad(ctx, m):
        m.calls += 1
        return ctx.all_sum(m(jnp.ones((1, 2))).sum())

    with pytest.raises(ValueError, match=r"plain Python attribute.*argument \[0\]\.calls "
                                         r"\(0 -> 1\).*nnx.Variable"):
        rep.run(bad, None, m)
    assert m.calls == 0


# -- 18. closures, collectives outside run, nested run, warnings on every sweep -----------
def test_step_closing_over_an_nnx_model_gets_the_fix(rep):
    from flax import nnx
    with rep.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def step(ctx):
        loss, g = nnx.value_and_grad(lambda m: m(jnp.ones((1, 2))).sum())(model)
        opt.update(model, g)
        return ctx.all_sum(loss)

    with pytest.raises(ValueError, match=r"closes over.*rep.run\(step, inputs, model, "
                                         r"optimizer\)"):
        rep.run(step)


def test_context_outside_run_and_nested_run_get_their_own_errors(rep):
    kept = []
    rep.run(lambda ctx: kept.append(ctx) or ctx.all_sum(1.0))
    with pytest.raises(RuntimeError, match=r"all_sum was called outside the step"):
        kept[0].all_sum(jnp.ones(2))
    with pytest.raises(RuntimeError, match=r"replica_id was read outside the step"):
        _ = kept[0].replica_id
    with pytest.raises(RuntimeError, match=r"run was called inside a step.*call the inner "
                                           r"function directly"):
        rep.run(lambda ctx: rep.run(lambda c: c.all_sum(1.0)))


def test_dropped_partial_batch_warns_on_every_sweep(rep):
    data = [np.ones((4,), np.float32)] * 2 + [np.ones((1,), np.float32)]
    inputs = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA)
    seen = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's usual filter: once per message+place
        for _ in range(3):
            for _ in inputs:
                pass
            seen.append(len([w for w in caught if "partial batch" in str(w.message)]))
            inputs.reinitialize()
    assert seen == [1, 2, 3]
