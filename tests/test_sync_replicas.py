"""sync_replicas, host driver: TensorFlow's SyncReplicasOptimizer tests and references."""

import functools
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate.sync import (
    SyncReplicasState,
    TokenQueue,
    averaged_params,
    sync_replicas,
    take_token,
    tokens_available,
)


def _tf_params():
    return {"v0": jnp.array(0.0), "v1": jnp.array(1.0), "v_sparse": jnp.array([[3.0], [4.0]])}


def _tf_grads(worker_id):
    # The IndexedSlices gradient of TF's test (row 1 of v_sparse) written densely.
    return {
        "v0": jnp.array(0.1 + worker_id * 0.2),
        "v1": jnp.array(0.9 + worker_id * 0.2),
        "v_sparse": jnp.array([[0.0], [0.1 + worker_id * 0.2]]),
    }


class _Cluster:
    """The PS of TF's test: params, optimizer state, each worker's sync_rep_local_step."""

    def __init__(self, num_workers, replicas_to_aggregate):
        self.tx = sync_replicas(
            optax.sgd(2.0),
            replicas_to_aggregate=replicas_to_aggregate,
            total_num_replicas=num_workers,
            num_tokens=num_workers,  # make_session_run_hook(is_chief, num_tokens=num_workers)
        )
        self.params = _tf_params()
        self.state = self.tx.init(self.params)
        self.local_step = [int(self.state.global_step)] * num_workers  # local_step_init_op

    def run_train_op(self, w):
        """One worker's train_op: push its gradients, then dequeue a token."""
        self.run_concurrently(w)

    def run_concurrently(self, *workers):
        """Workers in threads: all push, and each dequeue waits for the update's tokens."""
        for w in workers:
            updates, self.state = self.tx.update(
                _tf_grads(w), self.state, self.params, local_step=self.local_step[w]
            )
            self.params = optax.apply_updates(self.params, updates)
        for w in workers:
            token, self.state = take_token(self.state)
            self.local_step[w] = int(token)

    def value(self, name):
        return np.asarray(self.params[name])


def test_tf_two_workers():
    c = _Cluster(num_workers=2, replicas_to_aggregate=2)
    np.testing.assert_allclose(c.value("v0"), 0.0)
    np.testing.assert_allclose(c.value("v1"), 1.0)
    assert c.local_step == [0, 0] and int(c.state.global_step) == 0

    c.run_train_op(0)
    assert int(c.state.global_step) == 0  # one gradient is not enough
    c.run_train_op(1)
    assert int(c.state.global_step) == 1
    np.testing.assert_allclose(c.value("v0"), 0 - (0.1 + 0.3) / 2 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - (0.9 + 1.1) / 2 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(
        c.value("v_sparse"), [[3.0], [4.0 - (0.1 + 0.3) / 2 * 2.0]], rtol=1e-6
    )
    # The initial tokens carry step 0: the next round is computed at a stale step.
    assert c.local_step == [0, 0]

    c.run_train_op(0)
    c.run_train_op(1)
    assert int(c.state.global_step) == 1
    assert c.local_step == [1, 1]
    np.testing.assert_allclose(c.value("v0"), 0 - (0.1 + 0.3) / 2 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - (0.9 + 1.1) / 2 * 2.0, rtol=1e-6)
    assert int(c.state.dropped_stale) == 2 and int(c.state.dropped_backup) == 0

    # The queue is now empty: the two workers must work together.
    assert int(tokens_available(c.state)) == 0
    saved = c.state
    with pytest.raises(RuntimeError, match="token queue is empty"):
        c.run_train_op(0)  # alone, worker 0 would wait on the dequeue forever
    c.state = saved  # states are values: forget that push
    c.run_concurrently(0, 1)
    assert int(c.state.global_step) == 2
    np.testing.assert_allclose(c.value("v0"), 0 - 2 * (0.1 + 0.3) / 2 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - 2 * (0.9 + 1.1) / 2 * 2.0, rtol=1e-6)


def test_tf_three_workers_one_backup():
    c = _Cluster(num_workers=3, replicas_to_aggregate=2)
    assert int(c.state.global_step) == 0 and c.local_step[1] == 0

    # Workers 0 and 2 finish first.
    c.run_train_op(0)
    c.run_train_op(2)
    assert int(c.state.global_step) == 1
    np.testing.assert_allclose(c.value("v0"), 0 - (0.1 + 0.5) / 2 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - (0.9 + 1.3) / 2 * 2.0, rtol=1e-6)

    # Worker 1 finishes later: its gradient is dropped (the backup of step 0).
    c.run_train_op(1)
    assert int(c.state.dropped_backup) == 1 and int(c.state.dropped_stale) == 0
    # All local steps are still 0, so the next round is dropped as stale.
    c.run_train_op(0)
    c.run_train_op(1)
    c.run_train_op(2)
    assert int(c.state.global_step) == 1
    assert c.local_step[1] == 1
    assert int(c.state.dropped_stale) == 3

    # Worker 0 alone cannot finish the step (it waits); with worker 1 it does.
    c.run_concurrently(0, 1)
    assert int(c.state.global_step) == 2
    np.testing.assert_allclose(c.value("v0"), -0.6 - (0.1 + 0.3) / 2 * 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), -1.2 - (0.9 + 1.1) / 2 * 2.0, rtol=1e-6)


@pytest.mark.parametrize("k", [1, 3])
def test_one_replica_equals_multisteps(k):
    params = {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array(0.3)}
    rng = np.random.default_rng(k)
    grads = [
        {"w": jnp.asarray(rng.normal(size=3), jnp.float32), "b": jnp.float32(rng.normal())}
        for _ in range(4 * k + 1)
    ]
    ours = sync_replicas(optax.adam(0.1), replicas_to_aggregate=k)
    ref = optax.MultiSteps(optax.adam(0.1), every_k_schedule=k, use_grad_mean=True)
    p1, s1 = params, ours.init(params)
    p2, s2 = params, ref.init(params)
    ref_update = jax.jit(ref.update)
    for i, g in enumerate(grads):
        u1, s1 = ours.update(g, s1, p1)
        u2, s2 = ref_update(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        assert int(s1.global_step) == (i + 1) // k == int(s2.gradient_step)


def test_updates_zero_until_kth_fresh_push():
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=3, total_num_replicas=5)
    params = jnp.zeros(2)
    state = tx.init(params)
    pushes = [(0, 1.0), (0, 2.0), (0, 6.0), (0, 7.0), (0, 8.0), (0, 9.0), (1, 1.0)]
    outs = []
    for ls, g in pushes:  # (local_step, gradient)
        updates, state = tx.update(jnp.full(2, g), state, params, local_step=ls)
        outs.append((np.asarray(updates).tolist(), int(state.global_step)))
    assert outs[:2] == [([0.0, 0.0], 0)] * 2
    assert outs[2] == ([-3.0, -3.0], 1)  # the mean of 1, 2 and 6
    # Late for step 0: the first total - replicas_to_aggregate = 2 are the backups of
    # step 0, the third cannot be (5 replicas) and counts as stale.
    assert outs[3:] == [([0.0, 0.0], 1)] * 4
    assert int(state.dropped_backup) == 2 and int(state.dropped_stale) == 1
    assert int(state.num_accumulated) == 1


def test_multi_batch_replica_with_tokens():
    """total_num_replicas < replicas_to_aggregate: one replica pushes 3 batches a step."""
    tx = sync_replicas(optax.sgd(1.0), replicas_to_aggregate=3, total_num_replicas=1)
    params = jnp.array(0.0)
    state = tx.init(params)
    assert int(tokens_available(state)) == 3
    local, applied = 0, []
    for i in range(10):
        updates, state = tx.update(jnp.array(float(i)), state, params, local_step=local)
        params = optax.apply_updates(params, updates)
        applied.append(int(state.global_step))
        local, state = take_token(state)
        local = int(local)
    # Step 0 takes pushes 0-2; push 3 still carries an initial token (stale); 4-6 and
    # 7-9 make steps 1 and 2.
    assert applied == [0, 0, 1, 1, 1, 1, 2, 2, 2, 3]
    assert int(state.dropped_stale) == 1
    np.testing.assert_allclose(params, -(1.0 + 5.0 + 8.0), rtol=1e-6)


def test_tokens_through_chain_and_jit():
    tx = optax.chain(optax.clip(1.0), sync_replicas(optax.sgd(1.0), 2, num_tokens=2))
    state = tx.init(jnp.zeros(3))
    assert int(tokens_available(state)) == 2
    take = jax.jit(take_token)
    t0, state = take(state)
    t1, state = take(state)
    t2, state = take(state)  # empty: -1 under jit, queue unchanged
    assert [int(t0), int(t1), int(t2)] == [0, 0, -1]
    assert isinstance(state[1], SyncReplicasState)
    with pytest.raises(RuntimeError, match="token queue is empty"):
        take_token(state)


def test_tokens_before_init_raise():
    for not_initialised in (None, optax.EmptyState(), optax.sgd(1.0).init(jnp.zeros(2))):
        with pytest.raises(ValueError, match=r"Call state = tx.init\(params\) first"):
            take_token(not_initialised)
        with pytest.raises(ValueError, match="tx.init"):
            tokens_available(not_initialised)


def test_token_queue_representation():
    q = TokenQueue(jnp.int32(0), jnp.int32(1), jnp.int32(3))
    tx = sync_replicas(optax.sgd(1.0), 1)
    state = tx.init(jnp.zeros(1))._replace(tokens=q, global_step=jnp.int32(2))
    # queue: [0] + [1, 1, 1] + [2, 2, 2]
    assert int(tokens_available(state)) == 7
    got = []
    for _ in range(7):
        t, state = take_token(state)
        got.append(int(t))
    assert got == [0, 1, 1, 1, 2, 2, 2]


@functools.cache
def _tx(k, total, lr=1.0, num_tokens=None):
    return sync_replicas(optax.sgd(lr), k, total_num_replicas=total, num_tokens=num_tokens)


@settings(deadline=None, max_examples=40)
@given(
    k=st.integers(1, 3),
    total=st.integers(1, 4),
    offsets=st.lists(st.sampled_from([0, 0, 0, 1, 2, -1]), min_size=1, max_size=24),
)
def test_host_driver_matches_accumulator_model(k, total, offsets):
    """Random pushes vs a plain-Python model of TF's ConditionalAccumulator + SGD."""
    lr = 0.5
    tx = _tx(k, total, lr)
    params = jnp.zeros(2)
    state = tx.init(params)
    step = tx.update
    # model
    m_param, m_acc, m_cnt, m_gs = np.zeros(2), np.zeros(2), 0, 0
    m_late, m_stale, m_backup, quota = 0, 0, 0, max(total - k, 0)
    for i, off in enumerate(offsets):
        g = np.array([i + 1.0, -0.5 * i], np.float32)
        ls = m_gs - off
        updates, state = step(jnp.asarray(g), state, params, local_step=ls)
        params = optax.apply_updates(params, updates)
        if ls == m_gs:
            m_acc, m_cnt = m_acc + g, m_cnt + 1
            if m_cnt == k:
                m_param = m_param - lr * m_acc / k
                m_acc, m_cnt, m_gs, m_late = np.zeros(2), 0, m_gs + 1, 0
        elif ls == m_gs - 1 and m_late < quota:
            m_late, m_backup = m_late + 1, m_backup + 1
        else:
            m_late += ls == m_gs - 1
            m_stale += 1
        np.testing.assert_allclose(params, m_param, rtol=1e-5, atol=1e-5)
        assert int(state.global_step) == m_gs and int(state.num_accumulated) == m_cnt
        assert (int(state.dropped_stale), int(state.dropped_backup)) == (m_stale, m_backup)


@settings(deadline=None, max_examples=25)
@given(
    k=st.integers(1, 3),
    workers=st.integers(1, 4),
    order=st.lists(st.integers(0, 3), min_size=1, max_size=30),
)
def test_token_flow_matches_fifo_model(k, workers, order):
    """Workers push then dequeue; tokens equal those of a FIFO fed as TF's chief feeds it."""
    tx = _tx(k, workers)
    params = jnp.zeros(1)
    state = tx.init(params)
    fifo = deque([0] * k)
    local = [0] * workers
    blocked = [False] * workers
    gs = 0
    for w in order:
        w %= workers
        if not blocked[w]:
            _, state = tx.update(jnp.ones(1), state, params, local_step=local[w])
            if int(state.global_step) != gs:
                gs = int(state.global_step)
                fifo.extend([gs] * max(workers, k))
        if fifo:
            token, state = take_token(state)
            assert int(token) == fifo.popleft()
            local[w], blocked[w] = int(token), False
        else:
            blocked[w] = True  # TF's dequeue blocks; retry on the worker's next turn
            with pytest.raises(RuntimeError, match="empty"):
                take_token(state)
        assert int(tokens_available(state)) == len(fifo)


def test_variable_averages_masked_and_only_on_apply():
    params = {"a": jnp.array([1.0, 2.0]), "b": jnp.array(5.0)}
    tx = sync_replicas(
        optax.sgd(0.1), 2, variable_averages=0.9, variables_to_average={"a": True, "b": False}
    )
    state = tx.init(params)
    assert state.ema["b"] is None
    np.testing.assert_allclose(state.ema["a"], [1.0, 2.0])
    ema_ref = np.array([1.0, 2.0])
    for i in range(6):
        g = {"a": jnp.array([1.0, -1.0]) * (i + 1), "b": jnp.array(1.0)}
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
        if i % 2 == 1:  # an aggregated update was applied
            ema_ref = ema_ref - (1 - 0.9) * (ema_ref - np.asarray(params["a"]))
        np.testing.assert_allclose(state.ema["a"], ema_ref, rtol=1e-6)
    avg = averaged_params(state, params)
    np.testing.assert_allclose(avg["a"], ema_ref, rtol=1e-6)
    np.testing.assert_allclose(avg["b"], params["b"])
    with pytest.raises(ValueError, match="variable_averages=0.999"):
        averaged_params(sync_replicas(optax.sgd(1.0), 1).init(params), params)


def test_variables_to_average_callable():
    params = {"kernel": jnp.ones(2), "bias": jnp.ones(1)}
    tx = sync_replicas(
        optax.sgd(1.0),
        1,
        variable_averages=0.5,
        variables_to_average=lambda p: {k: k == "kernel" for k in p},
    )
    state = tx.init(params)
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    np.testing.assert_allclose(state.ema["kernel"], [0.5, 0.5])
    assert state.ema["bias"] is None


def test_extra_args_forwarded_to_inner():
    inner = optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0)
    tx = sync_replicas(optax.chain(optax.sgd(1.0), inner), 1)
    params = jnp.zeros(1)
    state = tx.init(params)
    ref = optax.chain(optax.sgd(1.0), inner)
    ref_state = ref.init(params)
    for loss in (1.0, 2.0, 3.0, 4.0):
        updates, state = tx.update(jnp.ones(1), state, params, value=jnp.asarray(loss))
        ref_updates, ref_state = ref.update(jnp.ones(1), ref_state, params, value=loss)
        np.testing.assert_allclose(updates, ref_updates)
    assert float(updates[0]) > -1.0  # the plateau did reduce the step


# ---------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(replicas_to_aggregate=0), ValueError, "replicas_to_aggregate must be >= 1"),
        (dict(replicas_to_aggregate=2.0), TypeError, "replicas_to_aggregate must be an int"),
        (dict(replicas_to_aggregate=True), TypeError, "replicas_to_aggregate must be an int"),
        (
            dict(replicas_to_aggregate=2, total_num_replicas=0),
            ValueError,
            "total_num_replicas must be >= 1",
        ),
        (
            dict(replicas_to_aggregate=3, total_num_replicas=1, num_tokens=1),
            ValueError,
            r"Too few tokens to finish the first step: 1 \(given\) vs 2 \(needed\)",
        ),
        (dict(replicas_to_aggregate=2, num_tokens=-1), ValueError, "num_tokens must be >= 0"),
        (dict(replicas_to_aggregate=2, variable_averages=1.5), ValueError, r"decay in \[0, 1\]"),
        (
            dict(replicas_to_aggregate=2, variables_to_average={"a": True}),
            ValueError,
            "only used with variable_averages",
        ),
    ],
)
def test_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        sync_replicas(optax.sgd(1.0), **kwargs)


def test_num_tokens_enough_for_multi_batch():
    tx = sync_replicas(optax.sgd(1.0), 3, total_num_replicas=1, num_tokens=2)
    assert int(tokens_available(tx.init(jnp.zeros(1)))) == 2
    tx = sync_replicas(optax.sgd(1.0), 2, total_num_replicas=4, num_tokens=0)
    assert int(tokens_available(tx.init(jnp.zeros(1)))) == 0


def test_inner_must_be_a_transformation():
    with pytest.raises(TypeError, match=r"optax.GradientTransformation \(e.g. optax.sgd"):
        sync_replicas(0.1, 2)


def test_update_errors():
    tx = sync_replicas(optax.sgd(1.0), 2)
    params = {"a": jnp.zeros(2), "b": jnp.zeros(())}
    state = tx.init(params)
    with pytest.raises(ValueError, match="Must supply at least one variable"):
        tx.init({})
    with pytest.raises(ValueError, match="Must supply at least one gradient"):
        tx.update({}, state, params)
    with pytest.raises(ValueError, match="same keys and nesting"):
        tx.update({"a": jnp.zeros(2)}, state)
    with pytest.raises(ValueError, match=r"gradient at \['a'\] has shape \(3,\)"):
        tx.update({"a": jnp.zeros(3), "b": jnp.zeros(())}, state, params)
    with pytest.raises(ValueError, match="params has structure"):
        tx.update(params, state, [params["a"], params["b"]])
    with pytest.raises(ValueError, match="state returned by tx.init"):
        tx.update(params, optax.EmptyState(), params)
    with pytest.raises(ValueError, match="arrival_time is only used inside a replica context"):
        tx.update(params, state, params, arrival_time=1.0)
    with pytest.raises(ValueError, match="local_step must be a scalar"):
        tx.update(params, state, params, local_step=jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match="local_step must be an integer"):
        tx.update(params, state, params, local_step=0.5)
    ema_tx = sync_replicas(optax.sgd(1.0), 2, variable_averages=0.9)
    with pytest.raises(ValueError, match=r"call tx.update\(grads, state, params\)"):
        ema_tx.update(params, ema_tx.init(params))


def test_state_leaves_do_not_alias_and_can_be_donated():
    tx = sync_replicas(optax.adam(0.1), 2, variable_averages=0.9)
    params = {"a": jnp.ones(3), "b": jnp.zeros(())}
    state = tx.init(params)

    def distinct(tree):
        ptrs = [x.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)]
        return len(set(ptrs)) == len(ptrs)

    assert distinct((params, state))
    updates, state = tx.update(params, state, params)  # eager host call
    assert distinct(state)
    step = jax.jit(tx.update, donate_argnums=(1,))
    for _ in range(3):
        updates, state = step(params, state, params)
    assert int(state.global_step) == 2
