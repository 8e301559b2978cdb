"""The PS worker's held outputs: the Ray worker copying old held outputs out of the
object store, the shut-down fetch, and run(..., donate_argnums=...)'s warning."""

import gc
import inspect
import threading
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.ray.actors import HELD_IN_STORE
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

LR = 0.5


def _sgd_job(carrier="embedded", **kw):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, carrier=carrier, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {"w": jnp.zeros(3)}
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(params)
    return s, rep, params, tx, opt


def test_donation_warning_points_at_the_callers_run_line():
    s, rep, params, tx, opt = _sgd_job()

    def step(ctx, p, o):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        return optax.apply_updates(p, u), o

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # the rep.run line just below
        rep.run(step, None, params, opt, donate_argnums=(0, 1))
    rep.join()
    s.shutdown()
    (w,) = [w for w in caught if "donate_argnums" in str(w.message)]
    assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno)



def test_two_threads_fetching_one_held_remote_value_both_get_its_outputs():
    """On Ray a finished RemoteValue holds a HeldOutputs until fetched: a second thread
    whose fetch saw it just before the first stored the outputs must not fail (it raised
    AttributeError: 'dict' object has no attribute 'resolve')."""
    from jreplicate.ps.remote import RemoteValue

    first_done = threading.Event()

    class Held:  # HeldOutputs' part fetch uses: resolve is a Ray round trip
        def __getattribute__(self, name):
            if name == "resolve" and threading.current_thread().name == "second":
                first_done.wait(10)  # the second's check passes as the first finishes
            return object.__getattribute__(self, name)

        def resolve(self, timeout=None):
            return {"x": np.arange(3)}

    rv = RemoteValue(0)
    rv._set(Held())
    got = {}
    second = threading.Thread(target=lambda: got.setdefault("second", rv.fetch()),
                              name="second")
    second.start()
    got["first"] = rv.fetch()
    first_done.set()
    second.join(10)
    assert set(got) == {"first", "second"}
    for out in got.values():
        np.testing.assert_array_equal(out["x"], np.arange(3))


# -- Ray: outputs held on a worker, copied out of the object store after HELD_IN_STORE --

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
from tests.test_ps_ray import local_ray  # noqa: E402, F401 (the module's Ray instance)


def _held(s):
    return [ray.get(a.held_steps.remote(), timeout=60) for a in s._executor._carrier.workers]


@pytest.mark.usefixtures("local_ray")
def test_old_held_outputs_fetch_exactly_as_recent_ones_on_a_sync_group_of_two():
    """A sync group of 2 devices on one Ray worker, outputs of many dtypes, scalars,
    None, (), nested dicts and a PerReplica: the outputs of step 0, copied out of the
    object store 50 steps ago, fetch with the same structure, shapes, dtypes and values
    as the latest step's, equal to a NumPy reference; dropping the RemoteValues lets the
    worker go of them (copied ones included)."""
    s, rep, params, tx, opt = _sgd_job("ray", num_replicas_in_sync=2)

    def step(ctx, p, o):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        w = p["w"]
        return {"p": optax.apply_updates(p, u), "bf": w.astype(jnp.bfloat16),
                "neg": w < -1.0, "i": w.astype(jnp.int32), "s": jnp.sum(w), "none": None,
                "e": (), "nest": {"a": {"b": w[0]}}, "rid": ctx.replica_id * 10.0 + w[0]}

    n = 52
    assert n > 10 * HELD_IN_STORE
    values = [rep.run(step, None, params, opt) for _ in range(n)]
    rep.join()

    def reference(k):  # step k pulled w = -LR * k (one worker, one push a step); the
        w = np.full(3, -LR * k, np.float32)  # updates a worker applies are zeros
        return {"p": {"w": w}, "bf": w.astype(ml_dtypes.bfloat16),
                "neg": w < -1.0, "i": w.astype(np.int32), "s": np.float32(w.sum()),
                "none": None, "e": (), "nest": {"a": {"b": w[0]}},
                "rid": np.array([0.0, 10.0], np.float32) + w[0]}

    for k in (0, 1, n - HELD_IN_STORE - 1, n - 1):  # copied long ago, ..., still in store
        got, want = values[k].fetch(), reference(k)
        assert jax.tree.structure(got) == jax.tree.structure(want), k
        want_leaves = dict(jax.tree_util.tree_flatten_with_path(want)[0])
        for path, g in jax.tree_util.tree_flatten_with_path(got)[0]:
            x, r = np.asarray(g), np.asarray(want_leaves[path])
            where = f"step {k} {jax.tree_util.keystr(path)}"
            assert (x.shape, x.dtype) == (r.shape, r.dtype), where
            np.testing.assert_array_equal(x, r, err_msg=where)
    assert _held(s) == [list(range(n))]
    del values, got
    gc.collect()
    rep.run(step, None, params, opt).fetch()  # carries the let-go of all 52 (kept: none)
    rep.join()
    assert len(_held(s)[0]) <= 1
    np.testing.assert_array_equal(s.parameters()["w"], np.float32(-LR) * (n + 1))
    s.shutdown()


@pytest.mark.usefixtures("local_ray")
def test_a_step_returning_a_prng_key_kept_past_the_store_window_keeps_training():
    """A step returning a typed PRNG key (``key, sub = jax.random.split(key)``) whose
    RemoteValues the caller keeps: copying the key out of the object store, HELD_IN_STORE
    steps later, must not fail the later step (the worker was lost and join raised
    ParameterServerError: every worker died). The key fetches as a key, from the old
    steps (copied out of the store) as from the latest."""
    s, rep, params, tx, opt = _sgd_job("ray")

    def step(ctx, p, o, key):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        key, _ = jax.random.split(key)
        return optax.apply_updates(p, u), o, jnp.sum(p["w"]), key

    n = HELD_IN_STORE + 3
    key = jax.random.key(0)
    values = [rep.run(step, None, params, opt, key) for _ in range(n)]
    rep.join()
    assert s.ledger()[0]["applied"] == n
    np.testing.assert_array_equal(s.parameters()["w"], np.float32(-LR) * n)
    want = np.asarray(jax.random.key_data(jax.random.split(key)[0]))
    for v in (values[0], values[-1]):
        got = v.fetch()[3]
        assert jax.dtypes.issubdtype(got.dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)), want)
    s.shutdown()


@pytest.mark.usefixtures("local_ray")
def test_fetch_after_restore_on_ray_says_the_workers_were_restarted_by_restore():
    """strategy.restore replaces the Ray worker actors, so a step's outputs not fetched
    before are gone (the embedded carrier keeps them): the error says restore did it
    (it said the strategy was shut down) and how to keep them."""
    s, rep, params, tx, opt = _sgd_job("ray")

    def step(ctx, p, o):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        return optax.apply_updates(p, u), o, jnp.sum(p["w"])

    kept, lost = rep.run(step, None, params, opt), rep.run(step, None, params, opt)
    np.testing.assert_array_equal(kept.fetch()[2], 0.0)
    rep.join()
    s.restore(s.state())
    np.testing.assert_array_equal(kept.fetch()[2], 0.0)  # fetched before: kept
    with pytest.raises(jr.ps.WorkerLostError, match=r"strategy\.restore.*fetch"):
        lost.fetch()
    s.shutdown()
