"""pmap habits that silently change a replicated step's numbers are warned about at the
first call (issue 29 item 1): a per-replica mean loss, a batch-independent loss term
added on every replica, and an all-reduce of a value already identical on every
replica. Each warning names the step, the line and the fix; ``allow=`` silences what a
step does on purpose; the correct forms are silent (and the whole suite turns the
warning into an error: pyproject's filterwarnings)."""

import inspect
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jreplicate as jr

N = 8          # replicas (conftest: 8 simulated devices)
B = 2          # examples per replica
GLOBAL = N * B
LR = 0.1


def _data(seed=0, rows=GLOBAL):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(rows, 3)).astype(np.float32),
            rng.normal(size=(rows,)).astype(np.float32))


def _rep(n=N, **kw):
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n], **kw))


def _per_example(w, x, y):
    return (x @ w - y) ** 2


def _line(fn, text):
    """The line number of the first source line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(lines) if text in s)


def _caught(run):
    """``run()``'s result and the ReplicationHabitWarnings it raised."""
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        out = run()
    return out, [w for w in got if issubclass(w.category, jr.ReplicationHabitWarning)]


def _habits(ws):
    return sorted(re.search(r"allow=\('(\w+)',\)", str(w.message)).group(1) for w in ws)


# -- the pmap-port patterns ---------------------------------------------------------
def _mean_step(ctx, batch, w):
    x, y = batch
    g = jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)  # MEAN
    return w - LR * g


def _mean_pmean_step(ctx, batch, w):
    x, y = batch
    g = jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)  # MEAN
    g = jax.lax.pmean(g, ctx.axis_name)  # PMEAN
    return w - LR * g


def _psum_params_step(ctx, batch, w):
    return jax.lax.psum(w, ctx.axis_name), ctx.all_sum(batch[1].sum())  # PSUM


def _all_sum_replicated_step(ctx, batch, w):
    total = ctx.all_sum(jnp.sum(w))  # ALLSUM
    return w, total


def _l2_step(ctx, batch, w):
    x, y = batch

    def loss(w):
        data = jr.compute_average_loss(_per_example(w, x, y), GLOBAL)
        return data + 0.01 * jnp.sum(w ** 2)  # L2

    return w - LR * jax.grad(loss)(w)


@pytest.mark.parametrize("step, marks", [
    (_mean_step, {"mean_loss": "# MEAN"}),
    (_mean_pmean_step, {"mean_loss": "# MEAN", "invariant_all_reduce": "# PMEAN"}),
    (_psum_params_step, {"invariant_all_reduce": "# PSUM"}),
    (_all_sum_replicated_step, {"invariant_all_reduce": "# ALLSUM"}),
    (_l2_step, {"batch_independent_term": "# L2"}),
], ids=lambda v: getattr(v, "__name__", ""))
def test_each_pmap_habit_warns_once_naming_the_line_and_the_fix(step, marks):
    rep = _rep()
    with rep.scope():
        w = jnp.ones(3)
    batch = _data()
    _, first = _caught(lambda: rep.run(step, batch, w))
    _, again = _caught(lambda: rep.run(step, batch, w))
    assert again == []  # once per compiled program
    assert _habits(first) == sorted(marks)
    for w_ in first:
        msg = str(w_.message)
        habit = _habits([w_])[0]
        line = _line(step, marks[habit])
        assert w_.filename == __file__ and w_.lineno == line, (w_.filename, w_.lineno)
        assert f"{__file__}:{line}" in msg and repr(step.__qualname__) in msg
        fix = {"mean_loss": "jr.compute_average_loss(per_example_loss, global_batch_size)",
               "batch_independent_term": "jr.scale_regularization_loss(term)",
               "invariant_all_reduce": "already summed over the replicas"}[habit]
        assert fix in msg, msg
    if "mean_loss" in marks:
        assert f"{N}x the one-device update" in str(first[0].message)


def test_the_mean_loss_update_really_is_n_times_and_the_fixed_one_is_not():
    """The warning is about a real effect: the flagged program's update is N times the
    one-device update on the global batch; with compute_average_loss it is 1x."""
    rep = _rep()
    x, y = _data(1)
    w0 = np.array([0.5, -1.0, 2.0], np.float32)
    with rep.scope():
        w = jnp.asarray(w0)

    def fixed(ctx, batch, w):
        x, y = batch
        g = jax.grad(lambda w: jr.compute_average_loss(_per_example(w, x, y), GLOBAL))(w)
        return w - LR * g

    one = LR * jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(jnp.asarray(w0))
    for step, ratio in ((_mean_step, N), (_mean_pmean_step, N), (fixed, 1)):
        new, found = _caught(lambda step=step: rep.run(step, (x, y), w))
        np.testing.assert_allclose(w0 - np.asarray(new), ratio * np.asarray(one),
                                   rtol=1e-5, atol=1e-6)
        assert ("mean_loss" in _habits(found)) == (ratio != 1)


# -- the correct forms are silent -------------------------------------------------
def _silent(step, rep=None, *args):
    rep = rep or _rep()
    with rep.scope():
        w = jnp.ones(3)
    out, found = _caught(lambda: rep.run(step, _data(), w, *args))
    assert found == [], [str(f.message) for f in found]
    return out


def test_the_correct_forms_are_silent():
    def cal(ctx, batch, w):
        x, y = batch
        loss, g = jax.value_and_grad(
            lambda w: jr.compute_average_loss(_per_example(w, x, y), GLOBAL))(w)
        metric = ctx.all_sum(jnp.sum(x @ w > 0))  # a per-replica value, summed
        return w - LR * g, ctx.all_sum(loss), jax.lax.psum(y.sum(), ctx.axis_name), metric

    def regularized(ctx, batch, w):
        x, y = batch

        def loss(w):
            return jr.compute_average_loss(_per_example(w, x, y), GLOBAL) + \
                jr.scale_regularization_loss([0.01 * jnp.sum(w ** 2), jnp.sum(w) / 7])

        term = jr.scale_regularization_loss(0.01 * jnp.sum(w ** 2))
        by_hand = 0.01 * jnp.sum(w ** 2) / ctx.num_replicas_in_sync
        return (w - LR * jax.grad(loss)(w), ctx.all_sum(term), ctx.all_sum(by_hand),
                jax.lax.pmax(jnp.sum(w), ctx.axis_name))  # pmax/pmin: identities

    def by_hand(ctx, batch, w):  # a hand-written global mean, a sum loss
        x, y = batch
        g1 = jax.grad(lambda w: jnp.sum(_per_example(w, x, y)) / GLOBAL)(w)
        g2 = jax.grad(lambda w: jnp.sum(_per_example(w, x, y)))(w)
        return w - LR * (g1 + g2)

    def averaged(ctx, batch, w):  # the loss averaged over replicas, or grads / N
        x, y = batch
        g1 = jax.grad(lambda w: jax.lax.pmean(jnp.mean(_per_example(w, x, y)),
                                              ctx.axis_name))(w)
        g2 = jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(w) / ctx.num_replicas
        return w - LR * (g1 + g2)

    def own_grads(ctx, batch, w):  # each replica's own gradient (sync_replicas' way)
        x, y = batch
        g = jr.sync.replica_grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)
        return w - LR * jax.lax.pmean(g, ctx.axis_name)

    for step in (cal, regularized, by_hand, averaged, own_grads):
        _silent(step)


def test_the_silent_averaged_forms_do_update_like_one_device():
    x, y = _data(2)
    w0 = np.array([0.5, -1.0, 2.0], np.float32)
    one = jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(jnp.asarray(w0))
    rep = _rep()
    with rep.scope():
        w = jnp.asarray(w0)

    def averaged(ctx, batch, w):
        x, y = batch
        return jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(w) / ctx.num_replicas

    g, found = _caught(lambda: rep.run(averaged, (x, y), w))
    assert found == []
    np.testing.assert_allclose(g, one, rtol=1e-5, atol=1e-6)


def test_one_replica_is_not_warned_about():
    rep = _rep(1)
    with rep.scope():
        w = jnp.ones(3)
    _, found = _caught(lambda: rep.run(_mean_pmean_step, _data(rows=4), w))
    assert found == []  # nothing is summed: the same update as one device


# -- allow= ---------------------------------------------------------------------------
def test_allow_silences_exactly_what_it_names():
    for allow, left in (("mean_loss", ["invariant_all_reduce"]),
                        (("invariant_all_reduce",), ["mean_loss"]),
                        (["mean_loss", "invariant_all_reduce"], []),
                        ((), ["invariant_all_reduce", "mean_loss"])):
        rep = _rep()
        with rep.scope():
            w = jnp.ones(3)
        _, found = _caught(lambda: rep.run(_mean_pmean_step, _data(), w, allow=allow))  # noqa: B023
        assert _habits(found) == left, allow


@pytest.mark.parametrize("bad", ["mean", ("mean_loss", "psum"), 3, [None]])
def test_allow_names_are_checked(bad):
    rep = _rep()
    with rep.scope():
        w = jnp.ones(3)
    with pytest.raises(ValueError, match=r"allow=.*'mean_loss'.*'batch_independent_term'"):
        rep.run(_mean_step, _data(), w, allow=bad)
    rep.run(lambda ctx, w: w, None, w)  # nothing was compiled: a later call still runs


def test_as_an_error_every_call_raises_until_fixed():
    rep = _rep()
    with rep.scope():
        w = jnp.ones(3)
    for _ in range(2):  # (the suite's own filter: an error)
        with pytest.raises(jr.ReplicationHabitWarning, match="mean_loss"):
            rep.run(_mean_step, _data(), w)
    rep.run(_mean_step, _data(), w, allow="mean_loss")


# -- where features meet --------------------------------------------------------------
def _input(rep, steps):
    x, y = _data(3, rows=GLOBAL * steps)

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GLOBAL)
        for k in range(steps):
            rows = slice(k * GLOBAL + ctx.input_pipeline_id * b,
                         k * GLOBAL + (ctx.input_pipeline_id + 1) * b)
            yield x[rows], y[rows]

    return rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA)


def test_a_device_loop_warns_once_for_its_programs():
    rep = _rep()
    with rep.scope():
        w = jnp.ones(3)

    def loop_step(ctx, batch, w):
        x, y = batch
        loss, g = jax.value_and_grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)  # MEAN
        return w - LR * g, loss

    it = _input(rep, 7)
    _, found = _caught(lambda: [rep.run(loop_step, it, w, steps=3) for _ in range(3)])
    # three loops: 3, 3 and a tail of 1 step (another program): one warning
    assert _habits(found) == ["mean_loss"]
    assert found[0].lineno == _line(loop_step, "# MEAN")

    def fixed(ctx, batch, w):
        x, y = batch
        return w - LR * jax.grad(
            lambda w: jr.compute_average_loss(_per_example(w, x, y), GLOBAL))(w), w[0]

    it = _input(rep, 3)
    _, found = _caught(lambda: rep.run(fixed, it, w, steps=3))
    assert found == []


def test_nnx_modules_and_nnx_value_and_grad():
    from flax import nnx
    rep = _rep()
    with rep.scope():
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)

    def mean_step(ctx, batch, model, opt):
        x, y = batch

        def loss_fn(m):
            return jnp.mean((m(x)[:, 0] - y) ** 2)  # MEAN

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return ctx.all_sum(loss)

    _, found = _caught(lambda: rep.run(mean_step, _data(), model, opt))
    assert _habits(found) == ["mean_loss"]
    assert found[0].lineno == _line(mean_step, "# MEAN")  # the user's line, not Flax's

    def fixed(ctx, batch, model, opt):
        x, y = batch
        grads = nnx.grad(lambda m: jr.compute_average_loss((m(x)[:, 0] - y) ** 2,
                                                           GLOBAL))(model)
        opt.update(model, grads)

    _, found = _caught(lambda: rep.run(fixed, _data(), model, opt))
    assert found == []


def test_logical_devices_count_the_replicas_not_the_devices():
    rep = jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))  # 4 x 2
    with rep.scope():
        w = jnp.ones(3)
    _, found = _caught(lambda: rep.run(_mean_step, _data(), w))
    assert _habits(found) == ["mean_loss"]
    assert "4x the one-device update" in str(found[0].message)

    def fixed(ctx, batch, w):
        x, y = batch
        return w - LR * jax.grad(
            lambda w: jr.compute_average_loss(_per_example(w, x, y), GLOBAL))(w)

    _, found = _caught(lambda: rep.run(fixed, _data(), w))
    assert found == []


def test_a_parameter_server_sync_group_is_checked_on_its_worker():
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.ones(3)
        tx = jr.ps.pushable(optax.sgd(LR))
        o = tx.init(w)

    def ps_step(ctx, batch, w, o):
        x, y = batch
        g = jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)  # MEAN
        u, o = tx.update(g, o, w)
        return optax.apply_updates(w, u), o

    x, y = _data(rows=4)

    def input_fn(ctx):  # each worker's replicas read their own examples
        b = ctx.get_per_replica_batch_size(4)
        while True:
            yield x[:b], y[:b]

    it = rep.prepare_input(input_fn)
    _, found = _caught(lambda: (rep.run(ps_step, it, w, o).fetch(), rep.join()))
    assert _habits(found) == ["mean_loss"]
    assert found[0].lineno == _line(ps_step, "# MEAN") and "ps_step'" in str(found[0].message)
    assert "2x the one-device update" in str(found[0].message)
    rep.run(ps_step, it, w, o).fetch()  # (warned once)


# -- the class test -------------------------------------------------------------------
@settings(max_examples=30, deadline=None, derandomize=True)
@given(loss=st.sampled_from(["mean", "cal", "sum"]),
       post=st.sampled_from([None, "pmean", "psum"]),
       term=st.sampled_from([None, "l2", "scaled_l2"]),
       extra=st.sampled_from([None, "per_replica", "invariant"]))
def test_warned_iff_the_update_differs_from_one_device_or_an_invariant_is_reduced(
        loss, post, term, extra):
    """Random small step programs against a one-device reference on the global batch:
    a habit is warned about exactly when the update differs from the one-device update
    (or the program all-reduces a value already identical on every replica)."""
    x, y = _data(4)
    w0 = np.array([0.3, -0.7, 1.1], np.float32)

    def loss_fn(w, x, y):
        per = _per_example(w, x, y)
        value = {"mean": jnp.mean, "sum": jnp.sum,
                 "cal": lambda p: jr.compute_average_loss(p, GLOBAL)}[loss](per)
        if term == "l2":
            value = value + 0.05 * jnp.sum(w ** 2)
        elif term == "scaled_l2":
            value = value + jr.scale_regularization_loss(0.05 * jnp.sum(w ** 2))
        return value

    def step(ctx, batch, w):
        x, y = batch
        g = jax.grad(loss_fn)(w, x, y)
        if post == "pmean":
            g = jax.lax.pmean(g, ctx.axis_name)
        elif post == "psum":
            g = jax.lax.psum(g, ctx.axis_name)
        side = {None: lambda: jnp.zeros(()),
                "per_replica": lambda: ctx.all_sum(jnp.sum(x)),
                "invariant": lambda: jax.lax.psum(jnp.sum(w), ctx.axis_name)}[extra]()
        return g, side

    rep = _rep()
    with rep.scope():
        w = jnp.asarray(w0)
    (g, _), found = _caught(lambda: rep.run(step, (x, y), w))
    one = jax.grad(loss_fn)(jnp.asarray(w0), jnp.asarray(x), jnp.asarray(y))
    same = np.allclose(g, one, rtol=1e-4, atol=1e-6)
    reduces_invariant = post is not None or extra == "invariant"
    assert bool(found) == (not same or reduces_invariant), (
        loss, post, term, extra, np.asarray(g) / np.asarray(one), _habits(found))
    expected = {"mean_loss"} if loss == "mean" else set()
    expected |= {"batch_independent_term"} if term == "l2" else set()
    expected |= {"invariant_all_reduce"} if reduces_invariant else set()
    assert set(_habits(found)) == expected


def test_the_check_reads_every_kind_of_step_without_failing(caplog):
    """Loops, conditionals, custom derivatives, checkpointing, jitted helpers and
    constants: the check reads them all (a reading failure would log and skip it)."""
    @jax.custom_vjp
    def clip(v):
        return v

    clip.defvjp(lambda v: (v, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))
    captured = np.float32(3.0)

    def step(ctx, batch, w):
        x, y = batch

        def loss(w):
            def body(c, row):
                return c + jnp.sum(_per_example(clip(w), row[None, :3], row[3:])), None
            total, _ = jax.lax.scan(body, 0.0 * jnp.sum(x), jnp.concatenate([x, y[:, None]], 1))
            total = jax.lax.cond(total > 0, lambda t: t, lambda t: -t, total)
            return jr.compute_average_loss(total[None], GLOBAL)

        g = jax.grad(jax.checkpoint(loss))(w)
        n = jax.lax.while_loop(lambda k: k < 3, lambda k: k + 1, 0)
        helper = jax.jit(lambda v: ctx.all_gather(v))
        return (w - LR * g, ctx.all_sum(jnp.sum(x) * captured), helper(y), n,
                ctx.all_max(captured))

    def constant(ctx, w):  # constants all-reduced (literal operands) count replicas
        return ctx.all_sum(captured) + ctx.all_sum(1.0) + w, ctx.all_sum(jnp.sum(w))

    with caplog.at_level("WARNING", logger="jreplicate"):
        _silent(step)
        rep = _rep()
        _, found = _caught(lambda: rep.run(constant, None, jnp.ones(3)))
    assert not [r for r in caplog.records if "could not read" in r.getMessage()]
    assert _habits(found) == ["invariant_all_reduce"]  # (the last one only)
    assert found[0].lineno == _line(constant, "jnp.sum(w)")


def test_a_chosen_replica_axis_name_is_the_axis_checked():
    """pmap's own axis name (MirroredStrategy(axis_name="batch")): the port keeps
    `lax.pmean(grads, "batch")` and is warned about on that axis."""
    rep = jr.Replicator(jr.MirroredStrategy(axis_name="batch"))
    with rep.scope():
        w = jnp.ones(3)

    def step(ctx, batch, w):
        x, y = batch
        g = jax.grad(lambda w: jnp.mean(_per_example(w, x, y)))(w)
        return w - LR * jax.lax.pmean(g, "batch")

    _, found = _caught(lambda: rep.run(step, _data(), w))
    assert _habits(found) == ["invariant_all_reduce", "mean_loss"]
