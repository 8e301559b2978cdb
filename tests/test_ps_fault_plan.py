"""Fault injection as a plan (:mod:`jreplicate.ps.faults`): the default plan injects
nothing, each fault point does what it says, and production classes hold only the
plan the carrier injected (no kill or delay flags of their own).

The plan itself is checked against a small reference model (hypothesis, no threads);
the embedded carrier end to end with a recorded ``sleep``; one Ray case.
"""

import pickle
import time
import types

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps import faults as faults_mod
from jreplicate.ps.client import ShardClient
from jreplicate.ps.faults import KILL_POINTS, FaultPlan, WorkerFaults
from jreplicate.ps.placement import place_parameters
from jreplicate.ps.remote import WorkerLostError
from jreplicate.ps.shard import PSShard
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)

LR = 0.5
#: The test and benchmark flags production classes held before the plan.
FLAGS = ("kill_at", "delay", "between_shards", "ordered", "_between_shards", "_delays")


@pytest.fixture
def slept(monkeypatch):
    """The seconds each of the plan's sleeps asked for (recorded, not slept)."""
    calls: list[float] = []
    monkeypatch.setattr(faults_mod, "time", types.SimpleNamespace(sleep=calls.append))
    return calls


# -- the plan against a reference model (pure, no threads) ----------------------------------

class PlanMachine(RuleBasedStateMachine):
    """Every change and every fault point of a FaultPlan against a dict of
    ``worker -> (delay, kill_at)``: the sleeps asked for, the kills raised (each once),
    the pushes ordered, and the plan after a pickle round trip (as shipped to Ray)."""

    workers = st.integers(0, 3)

    def __init__(self):
        super().__init__()
        self.plan = FaultPlan()
        self.model: dict[int, tuple[float, str | None]] = {}
        self.calls: list[float] = []
        faults_mod.time = types.SimpleNamespace(sleep=self.calls.append)

    def teardown(self):
        faults_mod.time = time

    def _get(self, w):
        return self.model.get(w, (0.0, None))

    @rule(w=workers, d=st.sampled_from([0.0, 0.01, 2.5]))
    def set_delay(self, w, d):
        self.plan.set_delay(w, d)
        self.model[w] = (d, self._get(w)[1])

    @rule(w=workers, when=st.sampled_from(KILL_POINTS))
    def kill(self, w, when):
        self.plan.kill(w, when)
        self.model[w] = (self._get(w)[0], when)

    @rule(w=workers)
    def disarm(self, w):
        self.plan.disarm(w)
        self.model[w] = (self._get(w)[0], None)

    @rule(w=workers, d=st.sampled_from([0.0, 0.3]),
          when=st.sampled_from([None, *KILL_POINTS]))
    def set(self, w, d, when):
        self.plan.set(w, WorkerFaults(d, when))
        self.model[w] = (d, when)

    @rule(w=workers, step=st.integers(0, 100))
    def after_compute(self, w, step):
        d, kill = self._get(w)
        before = len(self.calls)
        if kill == "compute":
            with pytest.raises(WorkerLostError, match=f"worker {w} died computing step {step}"):
                self.plan.after_compute(w, step)
            self.model[w] = (d, None)  # fires once
        else:
            self.plan.after_compute(w, step)
        assert self.calls[before:] == ([d] if d else [])

    @rule(w=workers)
    def push(self, w):
        d, kill = self._get(w)
        assert self.plan.ordered(w) == (kill == "push")
        if kill == "push":
            with pytest.raises(WorkerLostError, match=f"worker {w} died after pushing to"):
                self.plan.between_shards(w, 1)
            self.model[w] = (d, None)
        else:
            self.plan.between_shards(w, 1)

    @rule()
    def ship(self):
        self.plan = pickle.loads(pickle.dumps(self.plan))

    @invariant()
    def agrees(self):
        for w in range(4):
            d, kill = self._get(w)
            assert self.plan.get(w) == WorkerFaults(d, kill)

    @precondition(lambda self: not any(d or k for d, k in self.model.values()))
    @invariant()
    def nothing_armed_is_the_default(self):
        assert self.plan._workers == {}


TestPlanModel = PlanMachine.TestCase
TestPlanModel.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_the_default_plan_injects_nothing(slept):
    plan = FaultPlan()
    for w in range(64):
        plan.after_compute(w, w)
        plan.between_shards(w, 1)
        assert not plan.ordered(w)
        assert plan.get(w) == WorkerFaults()
    assert slept == []


def test_worker_faults_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"kill_at='network'.*one of \('compute', 'push'\)"):
        WorkerFaults(kill_at="network")
    with pytest.raises(ValueError, match=r"delay=-1.0.*seconds >= 0"):
        WorkerFaults(delay=-1.0)
    with pytest.raises(ValueError, match=r"delay=nan"):
        FaultPlan().set_delay(0, float("nan"))


# -- the client's fault points (shards in this process) --------------------------------------

class _Spy(FaultPlan):
    """A plan recording the points consulted."""

    def __init__(self):
        super().__init__()
        self.points: list[tuple] = []

    def ordered(self, worker):
        self.points.append(("ordered", worker))
        return super().ordered(worker)

    def between_shards(self, worker, i):
        self.points.append(("between_shards", worker, i))
        return super().between_shards(worker, i)


def _shards(num=2, gated=False):
    tx = jr.sync_replicas(optax.sgd(1.0), replicas_to_aggregate=1, total_num_replicas=1) \
        if gated else optax.sgd(1.0)
    params = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)}
    pl = place_parameters(params, num)
    return [PSShard(i, pl.split(params)[i], tx, num_shards=num) for i in range(num)], pl


def test_a_kill_at_push_reaches_shard_0_only_and_fires_once():
    """Asynchronous, two shards: worker 0 armed to die pushing pushes to shard 0 and
    dies; worker 1 (nothing armed) pushes to both at once; worker 0's next push (its
    kill fired) reaches both."""
    shards, pl = _shards()
    plan = _Spy()
    plan.kill(0, "push")
    client = ShardClient(shards, pl, token_gated=False, faults=plan)
    grads = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
    with pytest.raises(WorkerLostError, match="worker 0 died after pushing to shard 0"):
        client.push(0, 0, [0, 0], grads)
    assert [sh.step for sh in shards] == [1, 0]
    assert plan.get(0) == WorkerFaults()
    plan.points.clear()
    client.push(1, 1, [1, 0], grads)
    assert plan.points == [("ordered", 1)]  # all at once: no moment between shards
    client.push(2, 0, [2, 1], grads)
    assert [sh.step for sh in shards] == [3, 2]


def test_a_client_without_a_plan_pushes_all_at_once():
    shards, pl = _shards()
    client = ShardClient(shards, pl, token_gated=False)
    assert client.faults.get(0) == WorkerFaults()
    client.push(0, 0, [0, 0], {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)})
    assert [sh.step for sh in shards] == [1, 1]


# -- the embedded carrier, end to end ------------------------------------------------------

def _job(num_ps=2, num_workers=2, **kw):
    """sum(w * x) with x = [1, 2, 3, 4] every step: each applied step moves w by -LR * x."""
    s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=num_workers, **kw)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(4)
        tx = jr.ps.pushable(optax.sgd(LR))
        opt = tx.init(w)
    x = jnp.arange(1.0, 5.0)

    def step(ctx, w, opt):
        g = jax.grad(lambda w: jnp.sum(w * x))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt

    return s, rep, w, opt, step


def _exact(s, steps):
    np.testing.assert_allclose(jax.tree.leaves(s.parameters())[0],
                               -LR * steps * np.arange(1.0, 5.0), rtol=1e-6)
    for led in s.ledger():
        assert led["applied"] == steps, led


def test_embedded_default_injects_nothing_and_holds_only_the_plan(slept):
    s, rep, w, opt, step = _job()
    for _ in range(6):
        rep.run(step, None, w, opt)
    rep.join()
    carrier = s._executor._carrier
    assert slept == [] and s.stats()["rescheduled"] == 0 and all(s.stats()["alive"])
    _exact(s, 6)
    for wk in carrier.workers:
        assert wk.faults is carrier.faults and wk.client.faults is carrier.faults
        for obj in (wk, wk.client):
            assert not set(vars(obj)) & set(FLAGS), type(obj)
    assert carrier.faults.get(0) == carrier.faults.get(1) == WorkerFaults()
    s.shutdown()


def test_embedded_delay_is_slept_once_per_step_of_that_worker_only(slept):
    s, rep, w, opt, step = _job()
    jrt.set_worker_delay(s, 1, 0.125)
    for _ in range(8):
        rep.run(step, None, w, opt)
    rep.join()
    done = s.stats()["completed_by"]
    assert slept == [0.125] * done[1] and done[1] > 0
    jrt.set_worker_delay(s, 1, 0.0)
    for _ in range(4):
        rep.run(step, None, w, opt)
    rep.join()
    assert len(slept) == done[1]  # no more sleeps once the delay is 0
    _exact(s, 12)
    s.shutdown()


@pytest.mark.parametrize("when", KILL_POINTS)
def test_embedded_kill_fires_once_and_the_replacement_keeps_the_delay(slept, when):
    """Worker 0 (delayed) armed to die: it dies in its next step, at that point; the
    replacement runs steps (no kill armed) and is delayed as it was; every step is
    applied once (one shard: a push is on every shard or none)."""
    s, rep, w, opt, step = _job(num_ps=1, max_worker_restarts=None)
    jrt.set_worker_delay(s, 0, 0.25)
    jrt.kill_worker(s, 0, when=when)
    coord = s._executor.coordinator
    n = 0
    end = time.monotonic() + 60
    while s.stats()["replaced"] < 1 or s.stats()["completed_by"][0] < 2:
        assert time.monotonic() < end, "the kill never fired or the replacement idled"
        if coord.pending < 2:
            rep.run(step, None, w, opt)
            n += 1
        time.sleep(0.002)
    rep.join()
    st_ = s.stats()
    assert st_["replaced"] == 1 and st_["rescheduled"] == 1 and all(st_["alive"])
    assert s._executor._carrier.faults.get(0) == WorkerFaults(delay=0.25)
    # The dead step slept (compute) or pushed after sleeping (push) before it died.
    assert slept == [0.25] * (st_["completed_by"][0] + 1)
    _exact(s, n)
    s.shutdown()


def test_kill_worker_names_the_allowed_points():
    s, *_ = _job()
    with pytest.raises(ValueError, match=r"when='crash'.*\('compute', 'push'\)"):
        jrt.kill_worker(s, 0, when="crash")
    with pytest.raises(ValueError, match=r"worker=5 is not in \[0, 2\)"):
        jrt.set_worker_delay(s, 5, 0.1)
    s.shutdown()


# -- one Ray case --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_ray():
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
    from tests.test_ps_ray import private_ray
    yield from private_ray()


def test_on_ray_each_actor_holds_its_part_of_the_plan_and_a_kill_fires(local_ray):
    """The actors start with nothing armed; a delay and a kill reach the one actor they
    name (set_faults), and the kill at compute loses that worker with every step
    applied once; the other worker keeps its delay."""
    import ray
    s, rep, w, opt, step = _job(num_ps=1, carrier="ray")
    carrier = s._executor._carrier

    def actor_faults():
        return ray.get([a.__ray_call__.remote(
            lambda self: (self.worker.faults.get(self.worker.index),
                          sorted(set(vars(self.worker)) & set(FLAGS))))
            for a in carrier.workers], timeout=60)

    assert actor_faults() == [(WorkerFaults(), [])] * 2
    jrt.set_worker_delay(s, 1, 0.01)
    jrt.kill_worker(s, 0, when="compute")
    assert actor_faults() == [(WorkerFaults(kill_at="compute"), []),
                              (WorkerFaults(delay=0.01), [])]
    values = [rep.run(step, None, w, opt) for _ in range(6)]
    rep.join()
    assert s.stats()["alive"] == [False, True] and s.stats()["rescheduled"] >= 1
    assert actor_faults()[1] == (WorkerFaults(delay=0.01), [])
    assert all(v.fetch() is not None for v in values[-2:])
    _exact(s, 6)
    s.shutdown()


@pytest.mark.parametrize("seconds", [-1.0, float("nan")])
def test_a_negative_delay_is_refused_at_the_call_not_by_losing_the_worker(seconds):
    """Before the plan, a negative delay was accepted and each step of that worker raised
    in ``time.sleep`` after computing: the worker was lost (and replaced, again and
    again)."""
    s, rep, w, opt, step = _job(num_ps=1)
    with pytest.raises(ValueError, match=r"set_worker_delay\(seconds=(-1.0|nan)\).*>= 0"):
        jrt.set_worker_delay(s, 0, seconds)
    for _ in range(4):
        rep.run(step, None, w, opt)
    rep.join()
    assert s.stats()["rescheduled"] == 0 and s.stats()["replaced"] == 0
    _exact(s, 4)
    s.shutdown()
