"""The coordinator with several steps in flight per worker (``depth``, the Ray carrier's
pipelining), driven by fake workers: exactly once and attempts counted only for steps
that started. And the default placement (bytes balanced over the shards).

A fake worker runs its steps in the order started (as a Ray actor does), one at a time
when the coordinator waits for them; the first worker to start its third step dies in
it, so the step started behind it never runs there.
"""

import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.closure import Closure
from jreplicate.ps.coordinator import Coordinator
from jreplicate.ps.placement import place_parameters
from jreplicate.ps.remote import WorkerLostError
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)


class FakeWorkers:
    """``n`` workers, each step 2 ms; the first worker to start its ``die_at``-th step
    (1-based) dies running it (``victim``, ``fatal``)."""

    def __init__(self, n: int, die_at: int):
        self.die_at = die_at
        self.ran: dict[int, list[int]] = {}  # step id -> workers that ran it to the end
        self.started = [[] for _ in range(n)]  # per worker: step ids in start order
        self.dead = [False] * n
        self.victim = self.fatal = None
        self.lock = threading.Lock()
        self.runners = [self._runner(w) for w in range(n)]

    def _runner(self, w: int):
        def start(c, on_token_wait):
            with self.lock:
                self.started[w].append(c.step_id)
                if self.victim is None and len(self.started[w]) == self.die_at:
                    self.victim, self.fatal = w, c.step_id
            return lambda: self._run(w, c)
        return start

    def _run(self, w: int, c: Closure) -> int:
        if self.dead[w]:
            raise WorkerLostError(f"worker {w} is dead; step {c.step_id} did not run")
        time.sleep(0.002)
        if (w, c.step_id) == (self.victim, self.fatal):
            self.dead[w] = True
            raise WorkerLostError(f"worker {w} died running step {c.step_id}")
        with self.lock:
            self.ran.setdefault(c.step_id, []).append(w)
        return c.step_id


def _schedule(coordinator: Coordinator, n: int) -> list:
    return [coordinator.schedule(Closure(i, None, False, None, (), 0, None))
            for i in range(n)]


def _behind(fake: FakeWorkers) -> int:
    """The step the victim started after the one it died in."""
    return fake.started[fake.victim][fake.die_at]


@pytest.mark.parametrize("depth", [1, 2])
def test_every_step_runs_exactly_once_when_a_worker_dies_with_steps_in_flight(depth):
    fake = FakeWorkers(3, die_at=3)
    c = Coordinator(fake.runners, depth=depth, max_attempts=2)
    values = _schedule(c, 40)
    c.join(timeout=60)
    assert [v.fetch(timeout=1) for v in values] == list(range(40))
    assert sorted(fake.ran) == list(range(40))
    assert all(len(ws) == 1 for ws in fake.ran.values()), fake.ran  # exactly once
    v = fake.victim
    assert c.alive == [w != v for w in range(3)]
    assert values[fake.fatal].attempts == 2 and v not in fake.ran[fake.fatal]
    if depth == 2:  # the step started behind the lost one never ran on the victim
        behind = _behind(fake)
        assert values[behind].attempts == 1 and fake.ran[behind] != [v]
        assert c.rescheduled == 2
    else:
        assert len(fake.started[v]) == 3 and c.rescheduled == 1
    c.shutdown()


def test_a_step_that_never_started_does_not_use_up_max_attempts():
    """max_attempts=1: the step the worker died in fails; the one started behind it,
    which never ran, runs elsewhere (it would fail too if its start counted)."""
    fake = FakeWorkers(2, die_at=3)
    c = Coordinator(fake.runners, depth=2, max_attempts=1)
    values = _schedule(c, 30)
    with pytest.raises(WorkerLostError, match="failed on 1 workers"):
        c.join(timeout=60)
    behind = _behind(fake)
    failed = [v.step_id for v in values if v.done() and v._error is not None]
    assert failed == [fake.fatal]
    assert values[behind].fetch(timeout=1) == behind
    assert fake.ran[behind] == [1 - fake.victim]
    assert sorted(fake.ran) == [i for i in range(30) if i != fake.fatal]
    c.shutdown()


def test_bounded_staleness_keeps_one_step_per_worker():
    with pytest.raises(ValueError, match="depth"):
        Coordinator([lambda c, w: (lambda: None)], depth=2, max_staleness=1)


def test_default_placement_gives_every_shard_a_share_of_an_mlps_bytes():
    """Round-robin (TF's order) put only the biases of an MLP's ``{"b", "w"}`` layers on
    shard 0 (0.6 % of the bytes, yet a call per step); the default balances bytes."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        params = [{"w": jnp.zeros((a, b)), "b": jnp.zeros(b)}
                  for a, b in ((64, 256), (256, 256), (256, 10))]
        jr.ps.pushable(optax.adam(1e-3)).init(params)
    sizes = s.placement.bytes_per_shard
    assert s.placement.policy == "size_balanced" and min(sizes) >= 0.2 * sum(sizes), sizes
    rr = place_parameters(params, 2)
    assert min(rr.bytes_per_shard) < 0.01 * sum(rr.bytes_per_shard)  # the old default
    s.shutdown()


def test_outputs_that_are_inputs_unchanged_come_back_as_the_inputs():
    """A worker's step returns the optimizer state unchanged (a pushable update leaves
    it), a per-replica batch and the parameters: the state is not copied out of the
    compiled step but put back from the inputs, the batch stays per replica (two
    replicas), the parameters are those the step started from."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1, num_replicas_in_sync=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"k": jnp.arange(3.0)}
        tx = jr.ps.pushable(optax.adam(0.1))
        opt = tx.init(w)

    def step(ctx, x, w, opt):
        u, opt = tx.update(jax.tree.map(lambda v: v * jnp.sum(x), w), opt, w)
        return opt, x, optax.apply_updates(w, u), jnp.sum(w["k"])

    xs = np.arange(4.0, dtype=np.float32).reshape(4, 1)
    values = [rep.run(step, xs, w, opt) for _ in range(2)]
    rep.join()
    first, second = (v.fetch() for v in values)
    for a, b in zip(jax.tree.leaves(first[0]), jax.tree.leaves(tx.init(w))):
        np.testing.assert_array_equal(a, b)  # the worker's copy of the initial state
    np.testing.assert_array_equal(first[1], xs)  # per replica: not forwarded
    np.testing.assert_allclose(first[2]["k"], np.arange(3.0))
    assert float(second[3]) != float(first[3])  # the second step pulled the update
    worker = s._executor._carrier.workers[0]  # the state came back as the worker's own
    assert all(a is b for a, b in zip(jax.tree.leaves(values[0]._value[0]),
                                      jax.tree.leaves(worker._opt)))
    s.shutdown()


def test_pulled_parameters_are_donated_to_the_step_without_warnings():
    """The worker's placed copy of the pulled parameters is donated to the step: the
    parameters it returns (unchanged, or through the pushable update's zero updates)
    come back with the values the step started from, and a step that returns none of
    them, with gradients of another dtype (no output their buffers fit), runs without
    jax.jit's "donated buffers were not usable" warning."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"k": jnp.arange(3.0), "m": jnp.ones((2, 2))}
        tx = jr.ps.pushable(optax.sgd(0.1))
        opt = tx.init(w)

    def returns_them(ctx, x, w, opt):
        g = jax.tree.map(lambda v: v * jnp.sum(x), w)
        u, opt = tx.update(g, opt, w)
        return w, optax.apply_updates(w, u), opt

    def returns_a_loss(ctx, x, w, opt):
        g = jax.tree.map(lambda v: (v * jnp.sum(x)).astype(jnp.bfloat16), w)
        tx.update(g, opt, w)
        return jnp.sum(w["k"]) * jnp.sum(x)

    xs = np.ones((8, 1), np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        values = [rep.run(returns_them, xs, w, opt) for _ in range(3)]
        losses = [rep.run(returns_a_loss, xs, w, opt) for _ in range(3)]
        rep.join()
        got = [v.fetch() for v in values]
        loss = [float(v.fetch()) for v in losses]
    assert not [str(c.message) for c in caught if "donated" in str(c.message)]
    expected = {"k": np.arange(3.0), "m": np.ones((2, 2))}
    for step, (same, updated, _) in enumerate(got):
        for key in expected:  # sgd: each step subtracts 0.1 * 8 * (the values)
            np.testing.assert_allclose(same[key], expected[key] * 0.2 ** step, rtol=1e-6)
            np.testing.assert_array_equal(updated[key], same[key])
    np.testing.assert_allclose(loss, [8 * 3 * 0.2 ** k for k in range(3, 6)], rtol=1e-2)
    s.shutdown()
