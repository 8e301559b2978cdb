"""ParameterServerStrategy: ``rep.run`` refuses bad arguments on the driver, before it
schedules anything (TensorFlow's ``schedule`` refuses a RemoteValue argument too), in one
error naming every bad leaf, instead of the worker's error coming back from fetch/join
as if the step had failed."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)


@pytest.fixture(scope="module")
def job():
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
        tx = jr.ps.pushable(optax.sgd(0.5))
        opt = tx.init(w)

    def step(ctx, w, opt, *extra):
        g = jax.grad(lambda w: jnp.sum(w["a"] - 1.0) + jnp.sum(w["b"]))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    first = rep.run(step, None, w, opt)
    rep.join()
    def batch_step(ctx, batch, w, opt, *extra):
        return step(ctx, w, opt)

    yield s, rep, w, opt, (step, batch_step), first
    s.shutdown()


def _refused(job, exc, match, *, inputs=None, extra=()):
    """``rep.run`` raises ``exc`` matching ``match`` at once, and nothing is scheduled:
    no step id taken, the shards' parameters and ledgers unchanged; the next good step
    runs as the second step of the job."""
    s, rep, w, opt, step, _ = job
    before = (s.stats()["scheduled"], s._executor.next_id, s.ledger()[0]["applied"])
    params = jax.tree.map(np.asarray, s.parameters())
    with pytest.raises(exc, match=match) as info:
        if inputs is None:
            rep.run(step[0], None, w, opt, *extra)
        else:
            rep.run(step[1], inputs, w, opt, *extra)
    assert (s.stats()["scheduled"], s._executor.next_id,
            s.ledger()[0]["applied"]) == before
    jax.tree.map(np.testing.assert_array_equal, s.parameters(), params)
    return str(info.value)


def test_a_remote_value_argument_is_refused_at_run(job):
    msg = _refused(job, TypeError, r"argument \[2\] is a RemoteValue", extra=(job[5],))
    assert "value.fetch()" in msg


def test_a_remote_value_in_the_batch_is_refused_at_run(job):
    _refused(job, TypeError, r"the input batch \['x'\] is a RemoteValue",
             inputs={"x": job[5]})


def test_every_bad_leaf_is_named_in_one_error(job):
    msg = _refused(job, TypeError, "3 leaves are wrong",
                   extra=({"name": "adam", "rv": job[5], "ok": np.ones(2)}, object()))
    assert "argument [2]['name'] is a str" in msg
    assert "argument [2]['rv'] is a RemoteValue" in msg
    assert "argument [3] is a object" in msg
    assert "['ok']" not in msg


def test_iterators_inside_a_pytree_or_among_the_arguments_are_refused_at_run(job):
    """A tuple of per-worker iterators is run's inputs (tests/test_ps_several_inputs.py);
    iterators anywhere else are never read, so they are refused."""
    rep = job[1]
    its = [rep.prepare_input(lambda ctx: iter([np.ones((4, 2), np.float32)] * 3))
           for _ in range(2)]
    msg = _refused(job, TypeError, "2 leaves are wrong", inputs={"x": its[0], "y": its[1]})
    assert "the input batch ['x'] is an input iterator" in msg
    assert "the input batch ['y'] is an input iterator" in msg
    assert "rep.run(fn, iterator, *args)" in msg
    _refused(job, TypeError, r"argument \[2\] is an input iterator", extra=(its[0],))


def test_non_numeric_and_unfit_numpy_leaves_are_refused_at_run(job):
    _refused(job, TypeError, r"argument \[2\] is a NumPy array of dtype <U1",
             extra=(np.array(["a", "b"]),))
    _refused(job, ValueError, r"argument \[2\]\['big'\] holds .* does not fit int32",
             extra=({"big": np.array([2**40], np.int64)},))


def test_a_deleted_array_is_refused_at_run(job):
    x = jnp.ones(3)
    x.delete()
    _refused(job, ValueError, r"argument \[2\] is an array that was donated", extra=(x,))


def test_good_arguments_still_run_after_refusals(job):
    s, rep, w, opt, step, _ = job
    n = s.ledger()[0]["applied"]
    rv = rep.run(step[1], {"x": np.ones((4, 2), np.float32),
                        "p": jr.PerReplica(np.ones((2, 2), np.float32))}, w, opt,
                 np.int64(3), 2.0)
    rep.join()
    rv.fetch()
    assert s.ledger()[0]["applied"] == n + 1


# -- the fast path: every leaf plainly fine is not looked at by path --------------------
def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - compared as (type, message)
        return type(e), str(e)
    return None


def _leaves():
    import ml_dtypes

    from jreplicate.context import PerReplica
    from jreplicate.ps.remote import RemoteValue

    class Fake(RemoteValue):
        def __init__(self):
            pass

    dead = jnp.ones(2) + 0
    dead.delete()
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("replica",))
    return [jnp.zeros(3), dead, np.zeros(2, np.float32), np.int64(2 ** 40),
            np.array([2 ** 40]), np.array([1.5]), np.zeros(0, np.int64),
            np.array([1e300]), np.array(["x"]), np.zeros(2, ml_dtypes.bfloat16),
            np.zeros(2, ">f4"), np.array([None], object), 3, 2.5, True, 1j, "s", None,
            object(), Fake(), PerReplica(jnp.zeros(1), mesh, "replica")]


@pytest.mark.parametrize("x64", [False, True])
def test_the_fast_path_refuses_what_the_full_check_refuses(x64):
    """A property over mixes of leaves of every kind (live, deleted and 64-bit values,
    non-arrays, a RemoteValue, a PerReplica): ``check_run_arguments`` (which returns
    early when every leaf is plainly fine) raises exactly what the leaf-by-leaf check
    raises, with or without 64-bit types."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from jreplicate.ps import run_arguments as ra

    leaves = _leaves()
    leaf = st.sampled_from(range(len(leaves))).map(lambda i: leaves[i])
    tree = st.recursive(leaf, lambda t: st.lists(t, max_size=3) | st.dictionaries(
        st.sampled_from("abc"), t, max_size=2), max_leaves=5)

    @settings(deadline=None, max_examples=150)
    @given(batch=st.none() | tree, args=st.lists(tree, max_size=3))
    def agree(batch, args):
        args = tuple(args)
        fast = _outcome(lambda: ra.check_run_arguments(batch, args))
        with pytest.MonkeyPatch.context() as m:
            m.setattr(ra, "_plainly_fine", lambda x: False)
            full = _outcome(lambda: ra.check_run_arguments(batch, args))
        assert fast == full

    saved = jax.config.jax_enable_x64  # (only read by the check: no array is made)
    jax.config.update("jax_enable_x64", x64)
    try:
        agree()
    finally:
        jax.config.update("jax_enable_x64", saved)
