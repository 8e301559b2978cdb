"""The pure steps of ``sync_replicas`` (jreplicate/sync/aggregate.py), without shard_map:
the host driver (pushes one by one) and the SPMD driver (all pushes at once) count the same
arrivals identically, and both agree with a plain-Python model of TensorFlow's rules."""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.sync import aggregate, sync_replicas

TIMES = [-math.inf, -1.0, -0.0, 0.0, 0.5, 1.0, math.inf, math.nan]


def _state(k, gs, num_acc, late, stale=0, backup=0):
    state = sync_replicas(optax.sgd(1.0), k).init(jnp.zeros(2))
    return state._replace(
        global_step=jnp.int32(gs), num_accumulated=jnp.int32(num_acc),
        late_this_step=jnp.int32(late), dropped_stale=jnp.int32(stale),
        dropped_backup=jnp.int32(backup))


def _counters(state):
    return tuple(int(getattr(state, f)) for f in aggregate.Counters._fields)


def _arrival_order(times):
    """Replica ids in arrival order: numbers first (-0.0 == 0.0), then NaN; ties by id."""
    return sorted(range(len(times)), key=lambda i: (math.isnan(times[i]),
                                                     0.0 if math.isnan(times[i]) else times[i], i))


def _reference(k, quota, gs, num_acc, late, local_steps, times):
    """TensorFlow's rules, one push at a time: (counters, ids of accepted pushes)."""
    stale = backup = 0
    accepted = []
    for i in _arrival_order(times):
        ls = local_steps[i]
        if ls == gs:
            accepted.append(i)
            num_acc += 1
            if num_acc == k:
                gs, num_acc, late = gs + 1, 0, 0
        elif ls == gs - 1:
            if late < quota:
                backup += 1
            else:
                stale += 1
            late += 1
        else:
            stale += 1
    return (num_acc, gs, late, stale, backup), sorted(accepted)


@settings(deadline=None, max_examples=40)
@given(
    k=st.integers(1, 5),
    extra=st.integers(0, 3),
    gs=st.integers(3, 5),
    data=st.data(),
)
def test_host_and_spmd_paths_count_the_same_arrivals_identically(k, extra, gs, data):
    n = data.draw(st.integers(1, 6), label="replicas")
    num_acc = data.draw(st.integers(0, k - 1), label="num_accumulated")
    late = data.draw(st.integers(0, 3), label="late_this_step")
    local_steps = data.draw(st.lists(st.integers(gs - 3, gs), min_size=n, max_size=n))
    times = data.draw(st.lists(st.sampled_from(TIMES), min_size=n, max_size=n))
    quota = extra  # total_num_replicas - replicas_to_aggregate
    start = _state(k, gs, num_acc, late, stale=7, backup=11)
    want, accepted = _reference(k, quota, gs, num_acc, late, local_steps, times)
    want = (want[0], want[1], want[2], 7 + want[3], 11 + want[4])

    contrib, push = aggregate.spmd_counts(
        jnp.array(local_steps, jnp.int32), jnp.array(times, jnp.float32),
        start.global_step, k - start.num_accumulated)
    _, spmd = aggregate.accumulate(start, push, k, quota)
    assert tuple(int(x) for x in spmd) == want
    assert np.flatnonzero(np.asarray(contrib)).tolist() == accepted

    host = start
    for i in _arrival_order(times):
        push = aggregate.host_counts(jnp.int32(local_steps[i]), host.global_step)
        _, counters = aggregate.accumulate(host, push, k, quota)
        host = host._replace(**counters._asdict())
    assert _counters(host) == want


def test_accumulate_a_completing_push_hands_its_losers_to_the_next_step():
    # 3 needed, 5 fresh: 2 lose. Quota 2: the push for the step before takes the one
    # place left (2 - 1 late), the older push is stale, both losers are backups.
    state = _state(k=3, gs=4, num_acc=0, late=1)
    push = aggregate.Push(None, jnp.int32(3), jnp.int32(1), jnp.int32(1), jnp.int32(2))
    apply, counters = aggregate.accumulate(state, push, k=3, quota=2)
    assert bool(apply)
    assert tuple(int(x) for x in counters) == (0, 5, 2, 1, 3)
    _, counters = aggregate.accumulate(state, push, k=3, quota=0)
    assert tuple(int(x) for x in counters) == (0, 5, 2, 4, 0)


def test_accumulate_an_incomplete_push_keeps_counting_late_ones():
    state = _state(k=3, gs=4, num_acc=1, late=2)
    push = aggregate.Push(None, jnp.int32(1), jnp.int32(2), jnp.int32(0), jnp.int32(0))
    apply, counters = aggregate.accumulate(state, push, k=3, quota=3)
    assert not bool(apply)
    assert tuple(int(x) for x in counters) == (2, 4, 4, 1, 1)


@pytest.mark.parametrize("local_step, want", [(4, (1, 0, 0)), (3, (0, 1, 0)), (2, (0, 0, 1)),
                                              (5, (0, 0, 1))])
def test_host_counts_one_push(local_step, want):
    push = aggregate.host_counts(jnp.int32(local_step), jnp.int32(4))
    assert push.gsum is None and int(push.losers) == 0
    assert (int(push.n_new), int(push.prev_late), int(push.other_stale)) == want
