"""Errors collect, then report: every bad leaf of a validated pytree in one message.

A user fixing a pytree should never fix one leaf only to meet the next: the run
arguments, collectives' values, step outputs and checkpointed state name every bad
leaf at once, one bullet each with its path and fix (``jax/_src/shard_map.py``'s
style); one bad leaf keeps the one-line form.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate import CheckpointManager, MirroredStrategy, Replicator
from jreplicate._tree import MAX_LISTED, LeafErrors, map_checked, report


def _check(path, x):
    if isinstance(x, str):
        raise TypeError(f"f(tree): {jax_path(path)} is a str, not an array")
    if isinstance(x, float) and x < 0:
        raise ValueError(f"f(tree): {jax_path(path)} is negative")
    return x


def jax_path(path):
    import jax
    return jax.tree_util.keystr(path)


leaf_values = st.one_of(st.floats(0, 10), st.floats(-10, -0.5), st.text(max_size=3))


@settings(deadline=None, max_examples=60)
@given(st.dictionaries(st.from_regex(r"[a-z]{1,4}", fullmatch=True), leaf_values,
                       max_size=20))
def test_every_bad_leaf_is_reported_once(tree):
    """Against a reference list of the bad leaves: none bad returns the mapped tree;
    one bad keeps the one-line message; several list each (up to MAX_LISTED) once,
    with the error type that every caller's ``except`` still catches."""
    bad = {k: v for k, v in tree.items()
           if isinstance(v, str) or (isinstance(v, float) and v < 0)}
    if not bad:
        assert map_checked(_check, tree, "f(tree)") == tree
        return
    with pytest.raises((TypeError, ValueError)) as info:
        map_checked(_check, tree, "f(tree)")
    msg = str(info.value)
    types = {TypeError if isinstance(v, str) else ValueError for v in bad.values()}
    if len(bad) == 1:
        assert "\n" not in msg and msg.startswith("f(tree): ")
        assert type(info.value) is types.pop()
        return
    assert msg.splitlines()[0] == f"f(tree): {len(bad)} leaves are wrong:"
    listed = [line for line in msg.splitlines() if line.startswith("  - ")]
    assert len(listed) == min(len(bad), MAX_LISTED)
    for k in sorted(bad)[:MAX_LISTED]:  # dicts flatten in sorted key order
        assert sum(f"['{k}']" in line for line in listed) == 1
    assert ("more" in msg.splitlines()[-1]) == (len(bad) > MAX_LISTED)
    assert type(info.value) is (types.pop() if len(types) == 1 else LeafErrors)


def test_mixed_kinds_are_caught_as_either():
    problems = [TypeError("g: ['a'] is a str"), ValueError("g: ['b'] is negative")]
    for kind in (TypeError, ValueError):
        with pytest.raises(kind, match=r"(?s)g: 2 leaves are wrong:.*\['a'\].*\['b'\]"):
            report(problems, "g")
    report([], "g")  # nothing to report


def test_checkpoint_save_names_every_bad_leaf(tmp_path):
    rep = Replicator(MirroredStrategy())
    ids = rep.run(lambda ctx: ctx.replica_id)
    with CheckpointManager(tmp_path, rep) as mngr:
        state = {"ids": ids, "name": "x", "w": jnp.ones(2), "count": np.int32(3)}
        with pytest.raises(LeafErrors) as info:
            mngr.save(0, state, force=True)
        lines = str(info.value).splitlines()
        assert lines[0] == "CheckpointManager.save(state): 2 leaves are wrong:"
        assert "['ids'] is a PerReplica value" in lines[1]
        assert "['name'] is a str, not an array" in lines[2]
        assert mngr.latest_step() is None  # nothing written
        with pytest.raises(ValueError, match=r"^CheckpointManager.save\(state\): \['ids'\]"):
            mngr.save(0, {"ids": ids, "w": jnp.ones(2)}, force=True)  # one: one line


def test_collective_names_every_non_array_leaf():
    rep = Replicator(MirroredStrategy())
    with pytest.raises(TypeError) as info:
        rep.run(lambda ctx: ctx.all_sum({"a": "x", "b": ctx.replica_id, "c": None or "y"}))
    lines = str(info.value).splitlines()
    assert lines[0] == "ReplicaContext.all_sum(value): 2 leaves are wrong:"
    assert "['a']" in lines[1] and "['c']" in lines[2] and "not an array" in lines[2]


# -- Replicator.run's arguments and batches ----------------------------------------------

def test_run_names_every_bad_argument_leaf_at_once():
    """Replicator.run used to raise at its first bad leaf. A str, a 64-bit value that
    does not fit, an array donated to an earlier step and a PerReplica of the wrong
    length, across two arguments, are one message of one bullet each (in leaf order,
    with its path and fix); a TypeError among ValueErrors: caught as either."""
    import jax

    from jreplicate import PerReplica

    rep = Replicator(MirroredStrategy())
    gone = rep.replicate(jnp.ones(2))
    rep.run(lambda ctx, w: w + 1, None, gone, donate_argnums=0)  # deletes `gone`
    params = {"name": "x", "big": np.array([2**40]), "ok": jnp.ones(2)}
    extra = [gone, PerReplica(jnp.ones((3, 2)), rep.mesh)]
    for kind in (TypeError, ValueError):
        with pytest.raises(kind) as info:
            rep.run(lambda ctx, p, e: p["ok"], None, params, extra)
    assert type(info.value) is LeafErrors
    lines = str(info.value).splitlines()
    assert lines[0] == "Replicator.run: 4 leaves are wrong:"
    bullets = [line for line in lines if line.startswith("  - ")]
    assert len(bullets) == 4
    assert bullets[0].startswith("  - argument [0]['big'] holds 1099511627776 (int64)")
    assert bullets[1].startswith("  - argument [0]['name'] is a str, not an array.")
    assert bullets[2].startswith("  - argument [1][0] is an array that was donated")
    assert bullets[3].startswith("  - argument [1][1] is a PerReplica whose array has shape "
                                 "(3, 2)")
    assert all("Replicator.run:" not in b for b in bullets)  # said once, in the head
    # One bad leaf keeps its one-line message.
    with pytest.raises(TypeError, match=r"^Replicator.run: argument \[0\]\['name'\] is a "
                       r"str, not an array\. [^\n]*$"):
        rep.run(lambda ctx, p: p["ok"], None, {"name": "x", "ok": jnp.ones(2)})
    jax.effects_barrier()


def test_run_names_every_bad_batch_leaf_at_once():
    rep = Replicator(MirroredStrategy())
    n = rep.num_replicas
    batch = {"a": "text", "b": np.ones((n + 1, 2)), "c": np.ones((n, 2)), "d": 3}
    with pytest.raises(LeafErrors) as info:
        rep.run(lambda ctx, b: b["c"], batch)
    lines = str(info.value).splitlines()
    assert lines[0] == "Replicator.run(fn, inputs): 3 leaves are wrong:"
    assert lines[1].startswith("  - inputs ['a'] is a str; inputs are a pytree of arrays")
    assert lines[2].startswith(f"  - inputs ['b'] has shape ({n + 1}, 2); a plain array")
    assert lines[3].startswith("  - inputs ['d'] has a scalar;")
    with pytest.raises(ValueError, match=r"^Replicator.run\(fn, inputs\): inputs \['b'\] "
                       r"has shape [^\n]*$"):
        rep.run(lambda ctx, b: b["c"], {"b": np.ones((n + 1, 2)), "c": np.ones((n, 2))})


def test_run_names_every_donated_leaf_also_passed_elsewhere():
    rep = Replicator(MirroredStrategy())
    a, b = rep.replicate(jnp.ones(2)), rep.replicate(jnp.zeros(2))
    with pytest.raises(ValueError) as info:
        rep.run(lambda ctx, p, q: (p, q), None, {"a": a, "b": b}, [a, b], donate_argnums=0)
    lines = str(info.value).splitlines()
    assert lines[0] == "Replicator.run: 2 leaves are wrong:"
    assert lines[1].startswith("  - argument [0]['a'] is donated (donate_argnums), but the "
                               "same array is also passed as argument [1][0].")
    assert lines[2].startswith("  - argument [0]['b'] is donated (donate_argnums), but the "
                               "same array is also passed as argument [1][1].")


@pytest.mark.parametrize("steps", [None, 2])
def test_run_names_every_nnx_variable_left_different_on_each_replica(steps):
    """A step that leaves several Variables of an NNX argument different on each
    replica: one message naming each by its attribute path (was the first only, by its
    index in the flat state)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            self.a, self.b = nnx.Param(jnp.ones(2)), nnx.Param(jnp.ones(2))
            self.stat = nnx.BatchStat(jnp.ones(2))

    def step(ctx, x, net):
        net.a[...] = net.a[...] * ctx.replica_id
        net.stat[...] = net.stat[...] + ctx.replica_id
        return x

    rep = Replicator(MirroredStrategy())
    with rep.scope():
        net = Net()
    with pytest.raises(ValueError) as info:
        rep.run(step, None, jnp.ones(2), net, steps=steps)
    lines = str(info.value).splitlines()
    assert lines[0] == "Replicator.run: 2 leaves are wrong:"
    assert lines[1].startswith("  - the step function left NNX state argument [1].a "
                               "different on each replica")
    assert lines[2].startswith("  - the step function left NNX state argument [1].stat ")

    def one(ctx, net):
        net.b[...] = net.b[...] * ctx.replica_id

    with pytest.raises(ValueError, match=r"^the step function left NNX state argument "
                       r"\[0\].b different on each replica, so it can't"):
        rep.run(one, None, net)
