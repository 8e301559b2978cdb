"""Parameter-server core: placement, the shard state machine, its ledger, TF's scenarios."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.client import ShardClient
from jreplicate.ps.fate.ledger import Ledger
from jreplicate.ps.placement import place_parameters
from jreplicate.ps.shard import PSShard, ShardClosedError, TokenTimeoutError
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)


# -- placement ------------------------------------------------------------------------
def test_round_robin_as_replica_device_setter():
    # TF's device_setter test: with 3 ps tasks, variables 2..5 land on 0, 1, 2, 0.
    params = {f"v{i}": np.zeros(2, np.float32) for i in range(2, 6)}
    p = place_parameters(params, 3)
    assert p.assignment == [0, 1, 2, 0]
    assert [p.shard_of(f"['v{i}']") for i in range(2, 6)] == [0, 1, 2, 0]
    # The seed's two-ps example: v1, v2, v3 on tasks 0, 1, 0.
    assert place_parameters([np.zeros(1)] * 3, 2).assignment == [0, 1, 0]
    assert "shard 2: ['v4']" in str(p)
    with pytest.raises(KeyError, match="no such leaf"):
        p.shard_of("['nope']")


def test_size_balanced_splits_large_leaves_and_roundtrips():
    params = {"big": np.arange(1000 * 64, dtype=np.float32).reshape(1000, 64),
              "mid": np.ones((100, 64), np.float32), "b": np.ones(64, np.float32),
              "s": np.ones((), np.float32)}
    p = place_parameters(params, 4, "size_balanced", min_slice_bytes=16 << 10)
    shards = p.shard_of("['big']")
    assert sorted(shards) == [0, 1, 2, 3]  # split into 4 slices, one per shard
    b = p.bytes_per_shard
    assert sum(b) == sum(x.nbytes for x in params.values())
    assert max(b) - min(b) <= params["mid"].nbytes + 64 * 4 + 4 + 64 * 4 * 2
    pieces = p.split(params)
    back = p.join(pieces)
    for k in params:
        np.testing.assert_array_equal(back[k], params[k])
    # Without splitting (large min slice) the big leaf stays whole on one shard.
    whole = place_parameters(params, 4, "size_balanced", min_slice_bytes=1 << 30)
    assert isinstance(whole.shard_of("['big']"), int)
    with pytest.raises(ValueError, match="num_shards"):
        place_parameters(params, 0)
    with pytest.raises(ValueError, match="placement="):
        place_parameters(params, 2, "random")


# -- the shard, asynchronous ----------------------------------------------------------
def test_async_shard_applies_records_staleness_and_duplicates():
    tx = optax.sgd(0.5)
    shard = PSShard(0, {"0": np.zeros(2, np.float32)}, tx, device=jax.devices()[7])
    step, p = shard.pull()
    assert step == 0 and isinstance(p["0"], np.ndarray)
    shard.push(0, worker=0, fetched_step=0, grads={"0": np.ones(2, np.float32)})
    shard.push(1, worker=1, fetched_step=0, grads={"0": np.ones(2, np.float32)})  # stale 1
    shard.push(1, worker=2, fetched_step=2, grads={"0": np.ones(2, np.float32)})  # dup
    step, p = shard.pull()
    assert step == 2
    np.testing.assert_allclose(p["0"], [-1.0, -1.0])
    s = shard.ledger.summary()
    assert s == {"pushes": 3, "applied": 2, "stale": 0, "backup": 0, "duplicate": 1,
                 "failed": 0, "staleness": {0: 1, 1: 1}}
    # The ledger survives a round trip through its fixed-shape arrays.
    again = Ledger.from_arrays(shard.ledger.to_arrays())
    assert again.summary() == s and again.seen(1) and not again.seen(2)
    shard.close("stopped")
    with pytest.raises(ShardClosedError, match="stopped"):
        shard.pull()


def test_concurrent_pushes_are_serialised():
    shard = PSShard(0, {"0": np.zeros((), np.float32)}, optax.sgd(1.0))
    def pusher(w):
        for i in range(50):
            shard.push(w * 1000 + i, w, 0, {"0": np.float32(-1.0)})
    threads = [threading.Thread(target=pusher, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert shard.pull() == (200, {"0": np.float32(200.0)})
    assert shard.ledger.counts["applied"] == 200


# -- token-gated: TF's sync_replicas_optimizer_test through two shards ----------------
def _tf_params():
    return {"v0": np.float32(0.0), "v1": np.float32(1.0),
            "v_sparse": np.array([[3.0], [4.0]], np.float32)}


def _tf_grads(w):
    return {"v0": np.float32(0.1 + w * 0.2), "v1": np.float32(0.9 + w * 0.2),
            "v_sparse": np.array([[0.0], [0.1 + w * 0.2]], np.float32)}


class _PSCluster:
    """TF's test cluster with its variables on two PS shards (v0, v_sparse on shard 0)."""

    def __init__(self, num_workers, k):
        tx = jr.sync_replicas(optax.sgd(2.0), replicas_to_aggregate=k,
                              total_num_replicas=num_workers, num_tokens=num_workers)
        self.placement = place_parameters(_tf_params(), 2)
        pieces = self.placement.split(_tf_params())
        self.shards = [PSShard(i, pieces[i], tx, device=jax.devices()[i]) for i in range(2)]
        self.client = ShardClient(self.shards, self.placement, token_gated=True)
        self.local_step = [0] * num_workers
        self.next_id = 0

    def run_train_op(self, *workers):
        for w in workers:
            self.client.push(self.next_id, w, [self.local_step[w]], _tf_grads(w))
            self.next_id += 1
        for w in workers:
            self.local_step[w] = self.shards[0].take_token(time.monotonic() + 5,
                                                           skip_stale=False)

    def value(self, name):
        return self.client.pull()[1][name]

    @property
    def global_step(self):
        return self.shards[0].step


def test_tf_two_workers_through_the_ps():
    c = _PSCluster(2, 2)
    assert c.placement.assignment == [0, 1, 0]
    c.run_train_op(0)
    assert c.global_step == 0
    c.run_train_op(1)
    assert c.global_step == 1 and c.shards[1].step == 1
    np.testing.assert_allclose(c.value("v0"), -0.4, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v_sparse"), [[3.0], [3.6]], rtol=1e-6)
    assert c.local_step == [0, 0]  # initial tokens carry step 0
    c.run_train_op(0)
    c.run_train_op(1)
    assert c.global_step == 1 and c.local_step == [1, 1]
    for s in c.shards:
        assert s.ledger.counts == {"applied": 2, "stale": 2, "backup": 0, "duplicate": 0,
                                    "failed": 0}
    # The queue is empty: worker 0 alone waits, with a deadline, never forever.
    c.client.push(c.next_id, 0, [1], _tf_grads(0))
    t0 = time.monotonic()
    with pytest.raises(TokenTimeoutError, match="no token for global step 1"):
        c.shards[0].take_token(time.monotonic() + 0.3, skip_stale=False)
    assert time.monotonic() - t0 < 2
    c.client.push(c.next_id + 1, 1, [1], _tf_grads(1))
    assert c.global_step == 2 == c.shards[1].step
    np.testing.assert_allclose(c.value("v0"), -0.8, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - 4.0, rtol=1e-6)


def test_tf_three_workers_one_backup_through_the_ps():
    c = _PSCluster(3, 2)
    c.run_train_op(0)
    c.run_train_op(2)
    assert c.global_step == 1
    np.testing.assert_allclose(c.value("v0"), -0.6, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), 1 - 2.2, rtol=1e-6)
    c.run_train_op(1)  # the backup of step 0
    c.run_train_op(0)
    c.run_train_op(1)
    c.run_train_op(2)
    assert c.global_step == 1 and c.local_step[1] == 1
    for s in c.shards:
        assert s.ledger.counts == {"applied": 2, "stale": 3, "backup": 1, "duplicate": 0,
                                    "failed": 0}
    c.run_train_op(0, 1)
    assert c.global_step == 2 == c.shards[1].step
    np.testing.assert_allclose(c.value("v0"), -0.6 - 0.4, rtol=1e-6)
    np.testing.assert_allclose(c.value("v1"), -1.2 - 2.0, rtol=1e-6)
    np.testing.assert_allclose(c.value("v_sparse"), [[3.0], [4.0 - 0.6 - 0.4]], rtol=1e-6)


def test_followers_apply_shard_0s_set_in_its_order():
    """Pushes reach shard 1 out of order (the completing push of step 0 last, a push of
    step 1 first): shard 1 still applies exactly shard 0's steps."""
    tx = jr.sync_replicas(optax.sgd(1.0), replicas_to_aggregate=2, total_num_replicas=3)
    params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    pl = place_parameters(params, 2)
    shards = [PSShard(i, pl.split(params)[i], tx) for i in range(2)]
    g = {k: {"0": np.full(2, k, np.float32)} for k in range(1, 5)}
    g1 = {k: {"1": np.full(2, 10 * k, np.float32)} for k in range(1, 5)}
    d1 = shards[0].push(1, 0, 0, g[1])
    d2 = shards[0].push(2, 1, 0, g[2])
    d3 = shards[0].push(3, 2, 1, g[3])
    d4 = shards[0].push(4, 0, 1, g[4])
    assert [d.kind for d in (d1, d2, d3, d4)] == ["applied"] * 4
    assert (d2.completes, d4.completes) == (True, True)
    for pid, gg, d in ((3, g1[3], d3), (2, g1[2], d2), (4, g1[4], d4)):
        shards[1].push(pid, 0, 0, gg, d)
    assert shards[1].step == 0  # step 0 still misses push 1
    shards[1].push(1, 0, 0, g1[1], d1)
    assert shards[1].step == 2
    np.testing.assert_allclose(shards[0].pull()[1]["0"], -(1.5 + 3.5))
    np.testing.assert_allclose(shards[1].pull()[1]["1"], -(15 + 35))
    np.testing.assert_allclose(jnp.zeros(1), 0)
