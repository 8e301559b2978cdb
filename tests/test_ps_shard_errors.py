"""A parameter-server shard whose own optimizer update raises (issue 18, hardening).

The user's optax transformation raising inside a shard's jitted update (a check by a
callback, a gradient it cannot trace) is the step's error, as TF2's ClusterCoordinator
treats application errors: raised from ``fetch`` and ``join``, naming the shard, the
push's step and the original exception, never retried on other workers; the workers
stay alive; no shard applies any piece of the failed push (every ledger records it as
``failed``), and the parameters are those of the pushes applied (a numpy reference).
A genuinely lost shard (``jrt.kill_shard``) is still a ParameterServerError.
"""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
import jreplicate.testing as jrt
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import local_ray  # noqa: F401 (one Ray for the module)

LR, MOMENTUM, LIMIT, BAD = 0.1, 0.9, 50.0, 99.0


def _check_gradients():
    """An optax transformation that raises ValueError (in a host callback, at run time)
    when a gradient holds a value above LIMIT."""
    def check(grads):
        for g in grads:
            if np.any(np.asarray(g) > LIMIT):
                raise ValueError(f"gradient too large: {float(np.max(g))}")

    def update(grads, state, params=None, **extra):
        del params, extra
        jax.debug.callback(check, jax.tree.leaves(grads))
        return grads, state

    return optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)


def _checked_tx():
    return optax.chain(_check_gradients(), optax.sgd(LR, momentum=MOMENTUM))


def _job(tx, *, num_ps, num_workers=2, **kw):
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
        ptx = jr.ps.pushable(tx)
        opt = ptx.init(params)

    def step(ctx, x, params, opt):
        # x = (value of a's gradient, value of b's gradient)
        g = {"a": jnp.full((3,), x[0]), "b": jnp.full((2,), x[1])}
        u, opt = ptx.update(g, opt, params)
        return optax.apply_updates(params, u), opt

    return s, rep, params, opt, step


def _key_on(s, shard):
    """The name (as the step calls it) of a leaf held by ``shard``."""
    return next(k for k in "ab" if s.placement.shard_of(f"['{k}']") == shard)


def _momentum_sgd(n):
    """Parameters after ``n`` pushes of a unit gradient (numpy, float32)."""
    p, t = np.float32(0), np.float32(0)
    for _ in range(n):
        t = np.float32(MOMENTUM) * t + np.float32(1)
        p = p - np.float32(LR) * t
    return p


def _fetch_ok(values, bad):
    """How many of the steps other than ``bad`` returned their outputs: the others
    were cancelled (queued behind the error, or refused at push while running)."""
    ok = 0
    for i, v in enumerate(values):
        if i != bad:
            try:
                v.fetch()
                ok += 1
            except jr.ps.StepCancelledError:
                pass
    return ok


def _assert_failed_once(s, rep, values, bad, *, exact=True):
    """join raises step ``bad``'s error (the steps behind it cancelled); returns it and
    the number of other steps that completed (each shard applied exactly those when
    ``exact``: asynchronous training)."""
    with pytest.raises(Exception) as info:
        rep.join()
    err = info.value
    assert not isinstance(err, jr.ps.ParameterServerError), err
    text = str(err)
    for part in (f"step {bad}", "shard 0", "ValueError", "too large: 99.0"):
        assert part in text, (part, text)
    assert values[bad].attempts == 1  # not retried on another worker
    with pytest.raises(type(err), match="too large"):
        values[bad].fetch()
    ok = _fetch_ok(values, bad)
    assert ok >= 1  # (at least the first step ran before the error)
    st = s.stats()
    assert all(st["alive"]), st
    assert st["rescheduled"] == 0, st
    for led in s.ledger():
        assert led["failed"] == 1, led
        assert led["applied"] == ok or not exact, led
        assert led["pushes"] == led["applied"] + led["stale"] + led["backup"] + \
            led["duplicate"] + led["failed"], led
    return err, ok


@pytest.mark.parametrize("num_ps,max_staleness", [(1, None), (2, None), (2, 2)])
def test_a_shard_update_error_is_the_steps_error_and_nothing_is_applied(num_ps,
                                                                       max_staleness):
    """Step 3's gradient of a leaf on shard 0 makes shard 0's update raise: join and
    fetch raise it (not retried, workers alive); no shard applied any piece of it; the
    optimizer state (momentum) is intact: the parameters are momentum SGD over the 7
    other pushes; training goes on after join."""
    s, rep, params, opt, step = _job(_checked_tx(), num_ps=num_ps,
                                     max_staleness=max_staleness)
    bad_key = _key_on(s, 0)
    bad = 3
    values = _schedule(rep, step, params, opt, 8, bad, bad_key)
    _, ok = _assert_failed_once(s, rep, values, bad)
    got = s.parameters()
    np.testing.assert_allclose(got["a"], np.full(3, _momentum_sgd(ok)), rtol=1e-6)
    np.testing.assert_allclose(got["b"], np.full(2, _momentum_sgd(ok)), rtol=1e-6)
    for _ in range(2):  # the shards and workers still train
        rep.run(step, np.ones(2, np.float32), params, opt)
    rep.join()
    np.testing.assert_allclose(s.parameters()["a"], np.full(3, _momentum_sgd(ok + 2)),
                               rtol=1e-6)
    assert all(led["applied"] == ok + 2 and led["failed"] == 1 for led in s.ledger())
    s.shutdown()


def test_an_error_on_shard_1_leaves_shard_0_unchanged():
    """Asynchronous, two shards: the gradient only shard 1's check rejects. Shard 0 must
    not apply its piece either (never half-applied)."""
    s, rep, params, opt, step = _job(_checked_tx(), num_ps=2)
    key = _key_on(s, 1)
    bad = 2
    values = _schedule(rep, step, params, opt, 6, bad, key)
    with pytest.raises(Exception, match="shard 1") as info:
        rep.join()
    assert "step 2" in str(info.value) and "too large: 99.0" in str(info.value)
    assert values[bad].attempts == 1 and all(s.stats()["alive"])
    ok = _fetch_ok(values, bad)
    for led in s.ledger():
        assert led["failed"] == 1 and led["applied"] == ok, led
    got = s.parameters()
    for k, n in (("a", 3), ("b", 2)):
        np.testing.assert_allclose(got[k], np.full(n, _momentum_sgd(ok)), rtol=1e-6)
    s.shutdown()


@pytest.mark.parametrize("num_ps", [1, 2])
def test_token_gated_a_failed_push_counts_for_no_step(num_ps):
    """jr.sync_replicas (2 of 2 workers aggregated), one or two shards: the push whose
    check raises on shard 0 is decided ``failed``: shard 1 drops its staged piece, the
    token goes back; the other 8 pushes are applied or stale (a worker's first push,
    without a token, may be: TF's local_step_init) alike on every shard, every 2 applied
    making a global step of all."""
    inner = optax.sgd(LR)
    tx = optax.chain(_check_gradients(),
                     jr.sync_replicas(inner, replicas_to_aggregate=2, total_num_replicas=2))
    s, rep, params, opt, step = _job(tx, num_ps=num_ps)
    key = _key_on(s, 0)
    bad = 4
    values = _schedule(rep, step, params, opt, 9, bad, key)
    _, ok = _assert_failed_once(s, rep, values, bad, exact=False)
    led0, *others = s.ledger()
    assert all(led == led0 for led in others), (led0, others)
    assert led0["applied"] + led0["stale"] == ok, led0
    gs = led0["applied"] // 2
    assert gs >= 1 and s.global_step == gs
    assert all(s._executor.shard_step(i) == gs for i in range(num_ps))
    got = s.parameters()
    np.testing.assert_allclose(got["a"], np.full(3, -LR * gs), rtol=1e-6)
    np.testing.assert_allclose(got["b"], np.full(2, -LR * gs), rtol=1e-6)
    s.shutdown()


def _needs_float(grads, state, params=None, **extra):
    for g in jax.tree.leaves(grads):
        if not jnp.issubdtype(g.dtype, jnp.floating):
            raise TypeError(f"this optimizer takes float gradients, got {g.dtype}")
    return grads, state


@pytest.mark.parametrize("num_ps", [1, 2])
def test_an_update_that_cannot_trace_the_pushed_gradient_fails_the_step_only(num_ps):
    """A tx whose update raises while tracing a gradient of a dtype the shards have not
    compiled for (int32 pushed for float32 parameters; with two shards, only shard 1's
    leaf): the step's error, naming the shard and the original TypeError; no shard
    applied it, the (donated) momentum is intact, and they train on."""
    tx = optax.chain(optax.GradientTransformationExtraArgs(
        lambda p: optax.EmptyState(), _needs_float), optax.sgd(LR, momentum=MOMENTUM))
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
        ptx = jr.ps.pushable(tx)
        opt = ptx.init(params)
    bad_key = _key_on(s, num_ps - 1)

    def steps(bad):
        def step(ctx, params, opt):
            g = {k: jnp.ones_like(p, jnp.int32 if bad and k == bad_key else p.dtype)
                 for k, p in params.items()}
            u, opt = ptx.update(g, opt, params)
            return optax.apply_updates(params, u), opt
        return step

    good, bad = steps(False), steps(True)
    values = [rep.run(f, None, params, opt) for f in (good, bad, good)]
    with pytest.raises(jr.ps.ShardUpdateError, match="TypeError") as info:
        rep.join()
    assert f"shard {num_ps - 1}" in str(info.value) and "step 1" in str(info.value)
    assert "float gradients, got int32" in str(info.value)
    assert values[1].attempts == 1 and all(s.stats()["alive"])
    ok = _fetch_ok(values, 1)  # (step 2 may have been cancelled behind step 1)
    for led in s.ledger():
        assert (led["applied"], led["failed"]) == (ok, 1), led
    for k, n in (("a", 3), ("b", 2)):
        np.testing.assert_allclose(s.parameters()[k], np.full(n, _momentum_sgd(ok)),
                                   rtol=1e-6)
    s.shutdown()


def test_token_gated_shard_1_raising_for_a_push_shard_0_accepted_is_lost():
    """Below the client (which tries a push on every shard first): a token-gated shard
    1 whose update raises while feeding a push shard 0 accepted would disagree with
    shard 0: it closes itself as lost (ShardClosedError: a ParameterServerError for
    the job), its state as before."""
    from jreplicate.ps.fate.decision import Decision
    from jreplicate.ps.shard import PSShard, ShardClosedError
    tx = optax.with_extra_args_support(optax.chain(_check_gradients(), jr.sync_replicas(
        optax.sgd(LR), replicas_to_aggregate=1, total_num_replicas=1)))
    sh = PSShard(1, {"0": np.zeros(2, np.float32)}, tx, num_shards=2)
    assert sh.may_raise
    sh.stage(0, 0, {"0": np.ones(2, np.float32)})
    sh.commit(0, Decision("applied", 0, 0, completes=True))
    assert sh.step == 1
    sh.stage(1, 0, {"0": np.full(2, BAD, np.float32)})
    with pytest.raises(ShardClosedError, match="shard 0 had accepted.*ValueError"):
        sh.commit(1, Decision("applied", 1, 0, completes=True))
    assert sh.closed and sh._step == 1
    np.testing.assert_allclose(np.asarray(sh._params["0"]), np.full(2, -LR), rtol=1e-6)


def test_a_killed_shard_is_still_a_parameter_server_error():
    s, rep, params, opt, step = _job(_checked_tx(), num_ps=2)
    rep.run(step, np.ones(2, np.float32), params, opt)
    rep.join()
    jrt.kill_shard(s, 1)
    v = rep.run(step, np.ones(2, np.float32), params, opt)
    with pytest.raises(jr.ps.ParameterServerError, match="shard"):
        rep.join()
    with pytest.raises(jr.ps.ParameterServerError):
        v.fetch()
    s.shutdown()


def _schedule(rep, step, params, opt, n, bad, key):
    """``n`` steps, each pushing ones except step ``bad``: BAD for leaf ``key``."""
    xs = [((BAD, 1.0) if key == "a" else (1.0, BAD)) if i == bad else (1.0, 1.0)
          for i in range(n)]
    return [rep.run(step, np.array(x, np.float32), params, opt) for x in xs]


# -- Ray: the same error from a shard actor -------------------------------------------

@pytest.mark.usefixtures("local_ray")
def test_on_ray_a_shard_actors_update_error_is_the_steps_error():
    """Ray, two shard actors, asynchronous: shard 0's update raises for step 3: the
    step's error names shard 0, step 3 and the ValueError; not retried, the worker
    actors alive, both ledgers record it failed, the parameters are those of the other
    pushes that completed (the steps running on the actors finish; the queued ones are
    cancelled); then a gradient only shard 1 rejects, likewise; a killed shard actor is
    then a ParameterServerError as before."""
    s, rep, params, opt, step = _job(_checked_tx(), num_ps=2, carrier="ray")
    key = _key_on(s, 0)
    bad = 3
    values = _schedule(rep, step, params, opt, 6, bad, key)
    _, ok = _assert_failed_once(s, rep, values, bad)
    got = s.parameters()
    for k, n in (("a", 3), ("b", 2)):
        np.testing.assert_allclose(got[k], np.full(n, _momentum_sgd(ok)), rtol=1e-6)
    # A gradient only shard 1 rejects (tried there before shard 0 applies it).
    key1 = _key_on(s, 1)
    x = (BAD, 1.0) if key1 == "a" else (1.0, BAD)
    v = rep.run(step, np.array(x, np.float32), params, opt)
    after = rep.run(step, np.ones(2, np.float32), params, opt)
    with pytest.raises(jr.ps.ShardUpdateError, match="shard 1") as info:
        rep.join()
    assert info.value.error_type == "ValueError" and info.value.step_id == v.step_id
    ok += _fetch_ok([v, after], 0)
    assert all(led["failed"] == 2 and led["applied"] == ok for led in s.ledger())
    for k, n in (("a", 3), ("b", 2)):
        np.testing.assert_allclose(s.parameters()[k], np.full(n, _momentum_sgd(ok)),
                                   rtol=1e-6)
    jrt.kill_shard(s, 1)
    for _ in range(4):
        rep.run(step, np.ones(2, np.float32), params, opt)
    with pytest.raises(jr.ps.ParameterServerError, match="shard"):
        rep.join()
    s.shutdown()


def test_a_ledger_saved_before_failed_was_counted_loads_with_none_failed():
    from jreplicate.ps.fate.ledger import Ledger
    led = Ledger()
    led.record(0, "applied", 0)
    led.record(1, "failed")
    arrays = led.to_arrays()
    assert arrays["counts"].tolist() == [1, 0, 0, 0, 1]
    old = dict(arrays, counts=arrays["counts"][:4])  # as saved before
    again = Ledger.from_arrays(old)
    assert again.counts == {"applied": 1, "stale": 0, "backup": 0, "duplicate": 0,
                            "failed": 0}
    assert again.seen(0) and again.seen(1) and not again.seen(2)
    assert Ledger.from_arrays(arrays).summary() == led.summary()


def test_a_tx_that_cannot_run_on_a_shards_pieces_fails_when_built_naming_the_shard():
    """optax.masked with a mask of the parameters' tree: the shards hold flat dicts of
    pieces, so it cannot run there; the strategy says so when the optimizer is
    registered (before any shard is made, so on Ray too), naming the shard and its
    leaves; a mask given as a function of the leaves works."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
    rep = jr.Replicator(s)
    with pytest.raises(ValueError, match=r"shard 0, which holds the leaves") as info:
        with rep.scope():
            params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
            jr.ps.pushable(optax.masked(optax.sgd(1.0), {"a": True, "b": False})).init(
                params)
    assert "optax.masked" in str(info.value) and "pytree structure" in str(info.value)
    s.shutdown()
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"a": jnp.zeros(3), "b": jnp.zeros((2, 2))}
        tx = jr.ps.pushable(optax.masked(optax.sgd(1.0), lambda p: jax.tree.map(
            lambda x: x.ndim == 1, p)))
        opt = tx.init(params)

    def step(ctx, params, opt):
        u, opt = tx.update(jax.tree.map(jnp.ones_like, params), opt, params)
        return optax.apply_updates(params, u), opt

    rep.run(step, None, params, opt)
    rep.join()
    got = s.parameters()
    np.testing.assert_array_equal(got["a"], np.full(3, -1.0, np.float32))
    np.testing.assert_array_equal(got["b"], np.full((2, 2), 1.0, np.float32))  # unmasked: g
    s.shutdown()
