"""ParameterServerStrategy where its features meet, under faults.

A hypothesis state machine drives random interleavings of ``rep.run`` (kept and dropped
RemoteValues, a step that raises), ``join``, ``kill_worker`` at "compute" / "push",
``set_worker_delay``, ``state()`` / ``restore()`` and ``fetch`` for each mode
(asynchronous, bounded staleness, token-gated with backup workers) on the embedded
carrier with 1-3 shards and 2-4 workers, against a reference in NumPy: SGD or Adam fed
exactly the pushes each shard's ledger applied, in the order it applied them (token-gated:
the mean of each completed global step's accepted gradients). The gradients do not
depend on the parameters, so every run of a step pushes the same gradient and the
reference is exact up to float rounding. Then targeted attacks where features meet.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.ps.remote import ParameterServerError, StepCancelledError, WorkerLostError
from tests._ps_helpers import (
    assert_every_step_ends,
    bounded_test,  # noqa: F401 (autouse: every test bounded)
    sgd_job,
)

LR = 0.25
SIZES = {"a": 2, "b": 3, "c": 2}  # round robin: 3 shards hold one leaf each
BOUND_S = 30.0  # no join or fetch here may take longer


# -- the reference ---------------------------------------------------------------------

def _sgd(grads: list[dict]) -> dict:
    out = {k: np.zeros(n) for k, n in SIZES.items()}
    for g in grads:
        for k in out:
            out[k] = out[k] - LR * np.asarray(g[k], np.float64)
    return out


def _adam(grads: list[dict], b1=0.9, b2=0.999, eps=1e-8) -> dict:
    p = {k: np.zeros(n) for k, n in SIZES.items()}
    mu = {k: np.zeros(n) for k, n in SIZES.items()}
    nu = {k: np.zeros(n) for k, n in SIZES.items()}
    for t, g in enumerate(grads, 1):
        for k in p:
            x = np.asarray(g[k], np.float64)
            mu[k] = b1 * mu[k] + (1 - b1) * x
            nu[k] = b2 * nu[k] + (1 - b2) * x * x
            m_hat, v_hat = mu[k] / (1 - b1 ** t), nu[k] / (1 - b2 ** t)
            p[k] = p[k] - LR * m_hat / (np.sqrt(v_hat) + eps)
    return p


def _instrument(strategy, log: list) -> None:
    """Every shard's ledger logs ``(shard, push id, kind)`` as it records a push, in
    the order the shard decided them (under its lock)."""
    for i, sh in enumerate(strategy._ex()._carrier.shards):
        led = sh.ledger
        if getattr(led, "_review_wrapped", False):
            continue
        orig = led.record

        def record(push_id, kind, staleness=None, orig=orig, i=i):
            orig(push_id, kind, staleness)
            log.append((i, int(push_id), kind))

        led.record = record
        led._review_wrapped = True


def _step(tx):
    def step(ctx, batch, p, o):
        g = {k: batch[k] + 0.0 * p[k] for k in SIZES}  # the same whatever was pulled
        u, o = tx.update(g, o, p)
        return batch["tag"], optax.apply_updates(p, u)
    return step


def _bad_step(tx):
    def bad(ctx, batch, p, o):
        raise ValueError("review: this step raises")
    return bad


class _Sched:
    """A scheduled step as the machine knows it."""

    def __init__(self, rv, grads, tag, bad):
        self.rv, self.step_id, self.grads, self.tag, self.bad = rv, rv.step_id, grads, tag, bad


# -- the state machine -----------------------------------------------------------------

class PSMachine(RuleBasedStateMachine):
    mode = "async"

    @initialize(num_ps=st.integers(1, 3), workers=st.integers(2, 4),
                adam=st.booleans(), tau=st.integers(0, 2), k=st.integers(1, 3),
                backups=st.integers(0, 1), restarts=st.sampled_from([0, 1, -1]))
    def build(self, num_ps, workers, adam, tau, k, backups, restarts):
        self.num_ps, self.workers = num_ps, workers
        kw = {}
        if self.mode == "tau":
            kw["max_staleness"] = tau
            adam = False
        self.tau = tau if self.mode == "tau" else None
        self.k = min(k, workers)
        self.adam = adam and self.mode == "async"
        s = jr.ParameterServerStrategy(num_ps=num_ps, num_workers=workers,
                                       placement="round_robin", token_timeout=BOUND_S,
                                       max_worker_restarts=restarts, **kw)
        rep = jr.Replicator(s)
        with rep.scope():
            params = {k_: jnp.zeros(n) for k_, n in SIZES.items()}
            if self.mode == "token":
                inner = jr.sync_replicas(optax.sgd(LR), self.k, workers + backups)
            else:
                inner = optax.adam(LR) if self.adam else optax.sgd(LR)
            tx = jr.ps.pushable(inner)
            opt = tx.init(params)
        self.s, self.rep, self.params, self.opt = s, rep, params, opt
        self.step, self.bad = _step(tx), _bad_step(tx)
        self.log: list = []
        _instrument(s, self.log)
        self.rng = np.random.default_rng(num_ps * 100 + workers)
        self.kept: list[_Sched] = []
        self.sched: list[_Sched] = []  # every step scheduled since the last join
        self.done: list[_Sched] = []  # ended (checked), this timeline
        self.grads: dict[int, dict] = {}  # step id -> gradient, this timeline
        # Per shard, the ids applied this timeline in the order applied (token-gated
        # shard 0: (id, global step it counts for)).
        self.history: list[list] = [[] for _ in range(num_ps)]
        self.armed: set[int] = set()
        self.saved = None
        self.dead_all = False
        self.shut = False

    def teardown(self):
        if hasattr(self, "s"):
            self.s.shutdown()

    # -- rules ---------------------------------------------------------------------------
    # (not after raising steps until a join: whether that run would raise their error,
    # scheduling nothing, depends on the threads' timing, and the machine's state, which
    # the preconditions read, must not)
    @precondition(lambda self: not self.dead_all and not self.shut and
                  not any(sc.bad for sc in self.sched))
    @rule(n=st.integers(1, 8), keep=st.booleans(), bad=st.integers(0, 15))
    def run(self, n, keep, bad):
        for _ in range(n):
            g = {k_: (self.rng.integers(-4, 5, m) / 4).astype(np.float32)
                 for k_, m in SIZES.items()}
            tag = np.int32(self.rng.integers(1 << 20))
            batch = {**g, "tag": tag}
            is_bad = bad == 0
            try:
                rv = self.rep.run(self.bad if is_bad else self.step, batch, self.params,
                                  self.opt)
            except ValueError as e:
                # TensorFlow's semantics: once a step raised, the next run raises its
                # error, once, and schedules nothing (the steps behind it are
                # cancelled); whether that is this run depends on the threads' timing.
                assert "review: this step raises" in str(e), e
                assert any(sc.bad for sc in self.sched), "no step here raises"
                event("run raised a step's error")
                continue
            sc = _Sched(rv, g, tag, is_bad)
            self.grads[sc.step_id] = g
            self.sched.append(sc)
            if keep:
                self.kept.append(sc)

    @precondition(lambda self: not self.dead_all and not self.shut)
    @rule(w=st.integers(0, 3), when=st.sampled_from(["compute", "push"]))
    def kill(self, w, when):
        w %= self.workers
        if w not in self.armed and len(self.armed) >= self.workers - 1:
            return  # one worker always survives
        self.armed.add(w)
        jrt.kill_worker(self.s, w, when=when)

    @precondition(lambda self: not self.dead_all and not self.shut)
    @rule(w=st.integers(0, 3), seconds=st.sampled_from([0.0, 0.01, 0.05]))
    def delay(self, w, seconds):
        jrt.set_worker_delay(self.s, w % self.workers, seconds)

    @rule()
    def join(self):
        if not self.shut:
            self._join()
            return
        t0 = time.monotonic()  # after shutdown: join returns at once, raises nothing new
        try:
            self.rep.join()
        except Exception as e:  # noqa: BLE001 - the first error of the steps, once
            assert isinstance(e, (StepCancelledError, ValueError, WorkerLostError,
                                  ParameterServerError, RuntimeError)), e
        assert time.monotonic() - t0 < BOUND_S

    @precondition(lambda self: not self.dead_all and not self.shut)
    @rule()
    def save(self):
        self._join()
        state = self.s.state()
        self.saved = (state, [list(h) for h in self.history], dict(self.grads),
                      list(self.done))

    @precondition(lambda self: self.saved is not None and not self.shut)
    @rule()
    def restore(self):
        self._join()
        self._restore()

    @precondition(lambda self: not self.shut and not self.dead_all)
    @rule(i=st.integers(0, 2), dice=st.integers(0, 1))
    def lose_shard_then_restore(self, i, dice):
        """A shard is lost: the steps fail with ParameterServerError within the bound,
        and restoring the saved state (the fix the error names) trains on."""
        if dice:
            return
        if self.saved is None:
            self.save()
        else:
            self._join()
        jrt.kill_shard(self.s, i % self.num_ps)
        g = {k_: np.ones(m, np.float32) for k_, m in SIZES.items()}
        rv = self.rep.run(self.step, {**g, "tag": np.int32(7)}, self.params, self.opt)
        with pytest.raises(ParameterServerError, match="restore"):
            self.s._ex().coordinator.join(timeout=BOUND_S)
        with pytest.raises(ParameterServerError):
            rv.fetch(timeout=BOUND_S)
        event("lost a shard")
        self._restore()

    def _restore(self):
        state, history, grads, done = self.saved
        self.s.restore(state)
        self.log[:] = []
        _instrument(self.s, self.log)
        self.history = [list(h) for h in history]
        self.grads, self.done = dict(grads), list(done)
        self.armed.clear()  # new workers
        self.dead_all = False
        event("restored")
        self._check_params()

    @precondition(lambda self: self.kept)
    @rule(i=st.integers(0, 100))
    def fetch(self, i):
        sc = self.kept[i % len(self.kept)]
        self._check_fetch(sc)

    @precondition(lambda self: self.kept)
    @rule()
    def drop(self):
        self.kept.pop(0)

    @precondition(lambda self: not self.shut and self.sched)
    @rule(dice=st.integers(0, 5))
    def shutdown_pending(self, dice):
        """Shutdown with steps pending: every step ends within the bound, with its
        value or a named error; later runs are refused, naming the fix."""
        if dice:
            return
        t0 = time.monotonic()
        self.s.shutdown()
        self.shut = True
        for sc in self.sched:
            try:
                sc.rv.fetch(timeout=BOUND_S)
            except (StepCancelledError, ValueError, WorkerLostError,
                    ParameterServerError, RuntimeError):
                pass
        assert time.monotonic() - t0 < BOUND_S
        batch = {**self.grads.get(0, {k_: np.zeros(n, np.float32) for k_, n in SIZES.items()}),
                 "tag": np.int32(0)}
        for attempt in range(2):
            try:
                self.rep.run(self.step, batch, self.params, self.opt)
            except ValueError as e:
                # A step that raised before the shutdown: its error first, once (TF's
                # semantics; whether it raised before depends on the threads' timing).
                assert attempt == 0 and "review: this step raises" in str(e), e
                assert any(sc.bad for sc in self.sched), "no step here raises"
                continue
            except RuntimeError as e:
                assert "shut down" in str(e), e
                break
            raise AssertionError("a run after shutdown scheduled a step")
        self.sched = []

    # -- checks --------------------------------------------------------------------------
    def _join(self):
        t0 = time.monotonic()
        try:
            self.s._ex().coordinator.join(timeout=BOUND_S)
        except TimeoutError:
            raise AssertionError(f"join did not end within {BOUND_S} s") from None
        except ValueError as e:
            assert "review: this step raises" in str(e)
        except StepCancelledError:
            assert self.mode == "token", "only token waits are cancelled"
        except WorkerLostError:
            pass  # a step failed on max_attempts workers
        except ParameterServerError as e:
            assert "every worker died" in str(e), e
            self.dead_all = True
        assert time.monotonic() - t0 < BOUND_S
        # Every step scheduled ended, with its value or a named error.
        for sc in self.sched:
            assert sc.rv.done(), f"step {sc.step_id} still pending after join"
            self._check_fetch(sc)
        self._absorb_log()
        st_ = self.s.stats()
        event(f"rescheduled: {min(st_['rescheduled'], 3)}")
        event(f"alive: {sum(st_['alive'])}/{self.workers}")
        event(f"errors: {sorted({type(sc.rv._error).__name__ for sc in self.sched})}")
        if self.mode == "token":
            event(f"global step > 0: {self.s.global_step > 0}")
        self.done += self.sched
        self.sched = []
        self._check_ledgers()
        self._check_params()

    def _check_fetch(self, sc: _Sched):
        try:
            tag, _ = sc.rv.fetch(timeout=BOUND_S)
        except TimeoutError:
            assert not sc.rv.done()
            raise AssertionError(f"fetch of step {sc.step_id} did not end") from None
        except ValueError as e:
            assert sc.bad and "review: this step raises" in str(e)
            return
        except (StepCancelledError, WorkerLostError, ParameterServerError):
            return
        except RuntimeError as e:  # a step that ran into the shards shut down
            assert self.shut and "shut down" in str(e), e
            return
        assert not sc.bad
        assert int(tag) == int(sc.tag), (sc.step_id, int(tag), int(sc.tag))

    def _absorb_log(self):
        log, self.log[:] = list(self.log), []
        shard0 = self.s._ex()._carrier.shards[0]
        for i, push_id, kind in log:
            if kind != "applied":
                continue
            if self.mode == "token" and i == 0:
                d = shard0.ledger.decisions[push_id]
                self.history[0].append((push_id, d.step))
            else:
                self.history[i].append(push_id)

    def _check_ledgers(self):
        ex = self.s._ex()
        for i, led in enumerate(self.s.ledger()):
            assert led["pushes"] == led["applied"] + led["stale"] + led["backup"] + \
                led["duplicate"] + led["failed"], (i, led)
            if self.tau is not None and led["staleness"]:
                assert max(led["staleness"]) <= self.tau, led["staleness"]
        ids = [h if self.mode != "token" or i else [x for x, _ in h]
               for i, h in enumerate(self.history)]
        for i, h in enumerate(ids):
            assert len(h) == len(set(h)), f"shard {i} applied a push twice: {h}"
        if self.mode != "token":
            # Exactly once: every shard applied the same set, the steps that returned
            # a value; a failed step on none.
            ok = {sc.step_id for sc in self.done if sc.rv._error is None}
            for i, h in enumerate(ids):
                assert set(h) == ok, (i, sorted(set(h) ^ ok))
        else:
            gs = ex.shard_step(0)
            assert [ex.shard_step(i) for i in range(self.num_ps)] == [gs] * self.num_ps

    def _check_params(self):
        got = self.s.parameters()
        if self.mode == "token":
            gs = self.s.global_step
            per_step: dict[int, list] = {}
            for push_id, step in self.history[0]:
                per_step.setdefault(step, []).append(self.grads[push_id])
            assert all(s_ < gs or s_ == gs for s_ in per_step), (per_step.keys(), gs)
            means = [{k: np.mean([g[k] for g in per_step[s_]], 0) for k in SIZES}
                     for s_ in range(gs)]
            want = _sgd(means)
            for k in SIZES:
                np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5)
            return
        placement = self.s.placement
        for k in SIZES:
            i = placement.shard_of(f"['{k}']")
            seq = [self.grads[j] for j in self.history[i]]
            want = (_adam if self.adam else _sgd)(seq)[k]
            np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"leaf {k} on shard {i}")

    @invariant()
    def nothing_stuck(self):
        if hasattr(self, "s") and not self.shut:
            assert self.s._ex().coordinator.pending <= len(self.sched)


#: REVIEW_PS_EXAMPLES=200 REVIEW_PS_RANDOM=1 explores further (the suite's run is fixed).
_SETTINGS = settings(max_examples=int(os.environ.get("REVIEW_PS_EXAMPLES", 6)),
                     stateful_step_count=20, deadline=None,
                     suppress_health_check=list(HealthCheck),
                     derandomize=not os.environ.get("REVIEW_PS_RANDOM"))


class AsyncMachine(PSMachine):
    mode = "async"


class TauMachine(PSMachine):
    mode = "tau"


class TokenMachine(PSMachine):
    mode = "token"


TestAsyncMachine = AsyncMachine.TestCase
TestAsyncMachine.settings = settings(_SETTINGS, max_examples=2 * _SETTINGS.max_examples)
TestTauMachine = TauMachine.TestCase
TestTauMachine.settings = settings(_SETTINGS, max_examples=2 * _SETTINGS.max_examples)
TestTokenMachine = TokenMachine.TestCase
TestTokenMachine.settings = _SETTINGS


@pytest.mark.parametrize("machine", [AsyncMachine, TauMachine, TokenMachine])
def test_the_machine_takes_a_step_s_error_raised_by_the_next_run(machine):
    """Regression (the machine was flaky): a "run" rule of raising steps, the first of
    which raised before the second ``rep.run`` (TF's semantics: that run raises the
    step's error, once, and schedules nothing). The machine failed with the step's own
    ValueError instead of checking the job on; whether it happened depended on the
    threads' timing, so here each ``rep.run`` first waits for the steps scheduled."""

    @settings(max_examples=1, deadline=None, database=None)
    @given(st.none())
    def drive(_):
        m = machine()
        try:
            m.build(num_ps=2, workers=2, adam=False, tau=1, k=1, backups=0, restarts=0)
            run = m.rep.run

            def run_after_the_others(*args, **kw):
                t0 = time.monotonic()
                while not all(sc.rv.done() for sc in m.sched):
                    assert time.monotonic() - t0 < BOUND_S
                    time.sleep(0.01)
                return run(*args, **kw)

            m.rep.run = run_after_the_others
            m.run(n=3, keep=True, bad=0)  # (the second raised ValueError here)
            m.join()
            assert [sc.bad for sc in m.done] == [True, True]  # (the second: refused)
            m.run(n=2, keep=True, bad=1)
            m.join()
            assert [sc.bad for sc in m.done] == [True, True, False, False]
        finally:
            m.teardown()

    drive()


@pytest.mark.parametrize("machine", [AsyncMachine, TokenMachine])
def test_the_machine_takes_a_step_s_error_before_shut_down_from_the_next_run(machine):
    """Regression (flaky too): shutdown after a step raised; the next run raises that
    step's error first (once), then "shut down". The machine expected "shut down" at
    once, failing when the step had raised before the shutdown (timing)."""

    @settings(max_examples=1, deadline=None, database=None)
    @given(st.none())
    def drive(_):
        m = machine()
        try:
            m.build(num_ps=1, workers=2, adam=False, tau=1, k=1, backups=0, restarts=0)
            m.run(n=1, keep=True, bad=0)
            t0 = time.monotonic()
            while not m.sched[0].rv.done():
                assert time.monotonic() - t0 < BOUND_S
                time.sleep(0.01)
            m.shutdown_pending(dice=0)  # (raised the step's ValueError here)
            assert m.shut and not m.sched
        finally:
            m.teardown()

    drive()


# -- targeted attacks ---------------------------------------------------------------------

def _sgd_job(num_ps=1, workers=2, **kw):
    s, rep, params, opt, tx = sgd_job(SIZES, lr=LR, num_ps=num_ps, num_workers=workers,
                                      placement="round_robin", **kw)
    return s, rep, params, opt, _step(tx)


def _batch(tag=0, value=1.0):
    return {**{k: np.full(n, value, np.float32) for k, n in SIZES.items()},
            "tag": np.int32(tag)}


def test_a_step_running_at_shutdown_ends_with_the_public_step_cancelled_error():
    """A step that computes while the strategy shuts down meets its closed shards when
    it pushes: it ends with jr.ps.StepCancelledError (it was the private
    ShardClosedError, which no public name lets a caller catch)."""
    s, rep, params, opt, step = _sgd_job(num_ps=2, workers=1)
    rep.run(step, _batch(), params, opt).fetch(timeout=BOUND_S)  # compiled
    jrt.set_worker_delay(s, 0, 0.3)
    value = rep.run(step, _batch(1), params, opt)
    time.sleep(0.1)  # running: in its delay, before its push
    s.shutdown()
    with pytest.raises(StepCancelledError, match="shut down while step"):
        value.fetch(timeout=BOUND_S)


@pytest.mark.parametrize("token_gated", [False, True])
def test_a_step_whose_worker_dies_during_shutdown_ends_and_join_returns(token_gated):
    """Shutdown while worker 0 computes a step it will die in: the step used to go
    back into the stopped queue, pending for ever (fetch and join never returned)."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {k: jnp.zeros(n) for k, n in SIZES.items()}
        inner = jr.sync_replicas(optax.sgd(LR), 1, 2) if token_gated else optax.sgd(LR)
        tx = jr.ps.pushable(inner)
        opt = tx.init(params)
    step = _step(tx)
    rep.run(step, _batch(), params, opt).fetch(timeout=BOUND_S)  # both compiled
    rep.run(step, _batch(), params, opt)
    rep.join()
    for w in range(2):
        jrt.set_worker_delay(s, w, 0.3)
    jrt.kill_worker(s, 0, when="compute")
    values = [rep.run(step, _batch(i), params, opt) for i in range(2)]
    time.sleep(0.1)  # both running
    s.shutdown()
    t0 = time.monotonic()
    assert_every_step_ends(values, 5.0)
    done = threading.Event()

    def join():
        try:
            rep.join()
        except RuntimeError:  # (a step that ran into the closed shards)
            pass
        done.set()

    threading.Thread(target=join, daemon=True).start()
    assert done.wait(5.0), "join after shutdown did not return"
    assert time.monotonic() - t0 < 10.0


def test_an_nnx_model_changed_between_runs_is_read_as_of_each_run():
    """The executor cached an NNX argument's graph and state at its first run: a model
    switched to eval() (dropout off) or a variable set anew between two runs still ran
    as at the first run, silently (MirroredStrategy reads it as of each run)."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.scale = nnx.Variable(jnp.array(1.0))

    s = jr.ParameterServerStrategy(num_ps=1, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        model = Model(nnx.Rngs(0))
        opt = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.0)), wrt=nnx.Param)

    def step(ctx, model, opt):
        g = nnx.grad(lambda m: jnp.sum(m.lin(jnp.ones((2, 4)))))(model)
        opt.update(model, g)
        return model.drop(jnp.ones(8)) * model.scale[...]

    first = rep.run(step, None, model, opt).fetch(timeout=BOUND_S)
    assert set(np.unique(first)) <= {0.0, 2.0} and 0.0 in first  # dropout, scale 1
    model.scale.set_value(jnp.array(3.0))
    model.eval()
    second = rep.run(step, None, model, opt).fetch(timeout=BOUND_S)
    np.testing.assert_array_equal(second, np.full(8, 3.0, np.float32))
    third = rep.run(step, None, model, opt).fetch(timeout=BOUND_S)  # (unchanged)
    np.testing.assert_array_equal(third, np.full(8, 3.0, np.float32))
    model.scale.set_value(np.array(5.0, np.float32))  # a NumPy value, refilled in place
    assert float(rep.run(step, None, model, opt).fetch(timeout=BOUND_S)[0]) == 5.0
    model.scale.get_value()[...] = 7.0
    assert float(rep.run(step, None, model, opt).fetch(timeout=BOUND_S)[0]) == 7.0
    s.shutdown()


def test_kill_worker_at_push_with_one_shard_kills_the_worker_after_its_push():
    """``kill_worker(when="push")`` with one shard did nothing (there is no second
    shard to die before): the worker never died and the fault was silently not
    injected. With one shard the worker now dies right after its push; the push is
    applied once and the rerun's is a duplicate."""
    s, rep, params, opt, step = _sgd_job(num_ps=1, workers=2, max_worker_restarts=0)
    jrt.set_worker_delay(s, 1, 0.1)
    jrt.kill_worker(s, 0, when="push")
    for i in range(6):
        rep.run(step, _batch(i), params, opt)
    rep.join()
    assert s.stats()["alive"] == [False, True]
    assert s.stats()["rescheduled"] == 1
    led = s.ledger()[0]
    assert (led["applied"], led["duplicate"], led["pushes"]) == (6, 1, 7)
    np.testing.assert_allclose(s.parameters()["a"], -LR * 6)
    s.shutdown()


def test_a_step_given_up_mid_push_is_applied_by_every_shard_or_named():
    s, rep, params, opt, step = _sgd_job(num_ps=2, workers=2, max_attempts=1)
    for w in range(2):  # whichever takes step 0 dies mid-push
        jrt.kill_worker(s, w, when="push")
    value = rep.run(step, _batch(0), params, opt)
    try:
        rep.join()
    except ParameterServerError:
        return  # named: the shards disagree, restore
    except WorkerLostError:
        pass
    assert value.done()
    applied = [led["applied"] for led in s.ledger()]
    got = s.parameters()
    s.shutdown()
    assert applied[0] == applied[1], (applied, got)


def _tagged_input(ctx):
    """Worker w's pipeline: elements whose every gradient entry is 100 * w + n + 1."""
    n = 0
    while True:
        n += 1
        v = float(100 * ctx.input_pipeline_id + n)
        yield {**{k: np.full(m, v, np.float32) for k, m in SIZES.items()},
               "tag": np.int32(v)}


def test_a_rerun_after_a_kill_mid_push_completes_the_other_shards_with_its_own_gradient():
    """Asynchronous mode, 2 shards, PER_WORKER input, as documented (the PS guide's
    "Asynchronous pushes across shards"): a worker killed between its pushes to shard 0
    and shard 1 has its step rerun on the other worker, which reads its next element;
    shard 0 counts the rerun's push a duplicate and shard 1 applies it. Every shard
    applies exactly one gradient per step, shard 0 the first run's and shard 1 the
    rerun's (a push is not atomic across shards in asynchronous mode, as in TensorFlow;
    token-gated mode stages the pieces and is exact)."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, placement="round_robin",
                                   max_worker_restarts=0)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {k: jnp.zeros(n) for k, n in SIZES.items()}
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(params)
    step = _step(tx)
    it = rep.prepare_input(_tagged_input)
    jrt.set_worker_delay(s, 1, 0.2)  # each worker takes one of the two steps
    jrt.kill_worker(s, 0, when="push")
    rep.run(step, it, params, opt)
    rep.run(step, it, params, opt)
    rep.join()
    got, stats, ledgers = s.parameters(), s.stats(), s.ledger()
    on = {k: s.placement.shard_of(f"['{k}']") for k in SIZES}
    s.shutdown()
    assert stats["rescheduled"] == 1 and stats["alive"] == [False, True]
    assert [led["applied"] for led in ledgers] == [2, 2]
    assert [led["duplicate"] for led in ledgers] == [1, 0]
    # Worker 0's first element (1) reached shard 0 only; worker 1 ran its own step on
    # its first element (101) and the rerun on its second (102), which only shard 1 took.
    for k in SIZES:
        want = 1 + 101 if on[k] == 0 else 101 + 102
        np.testing.assert_array_equal(-np.asarray(got[k]), np.full(SIZES[k], want))


def test_nnx_dropout_reruns_after_kills_draw_the_first_runs_masks():
    """Workers killed while computing and mid-push: every step, rerun or not, draws the
    masks of the model's streams folded with its own id (computed here independently),
    and each shard applies every step once."""
    nnx = pytest.importorskip("flax.nnx")

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    s = jr.ParameterServerStrategy(num_ps=2, num_workers=3, max_worker_restarts=0)
    rep = jr.Replicator(s)
    with rep.scope():
        model = Dropped(nnx.Rngs(0, dropout=1))
        opt = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)

    def step(ctx, model, optimizer):
        g = nnx.grad(lambda m: jnp.mean(m(jnp.ones((8, 4))) ** 2))(model)
        optimizer.update(model, g)
        return model.drop(jnp.ones((8, 4))) != 0

    jrt.kill_worker(s, 0, when="compute")
    jrt.kill_worker(s, 1, when="push")
    values = [rep.run(step, None, model, opt) for _ in range(6)]
    rep.join()
    masks = [v.fetch(timeout=BOUND_S) for v in values]
    stats, ledgers = s.stats(), s.ledger()
    s.shutdown()
    assert stats["rescheduled"] >= 1 and stats["alive"].count(False) >= 1
    for v, mask in zip(values, masks):
        ref = nnx.clone(model)
        keys = nnx.state(ref, nnx.RngKey)
        nnx.update(ref, jax.tree.map(lambda k, i=v.step_id: jax.random.fold_in(k, i), keys))
        ref(jnp.ones((8, 4)))  # (the loss's draw)
        np.testing.assert_array_equal(mask, np.asarray(ref.drop(jnp.ones((8, 4))) != 0))
    for led in ledgers:
        assert led["applied"] == 6


def _token_reference(s, grads: dict[int, dict]) -> dict:
    """Token-gated: SGD by the mean of the gradients shard 0 accepted for each completed
    global step (its ledger's decisions)."""
    decisions = s._ex()._carrier.shards[0].ledger.decisions
    per_step: dict[int, list] = {}
    for push_id, d in decisions.items():
        if d.kind == "applied":
            per_step.setdefault(d.step, []).append(grads[push_id])
    gs = s.global_step
    assert all(k <= gs for k in per_step)
    return _sgd([{k: np.mean([g[k] for g in per_step[i]], 0) for k in SIZES}
                 for i in range(gs)])


def _boom_input(ctx):
    """Worker 2's elements have one more key: the step raises on worker 2 only, after
    taking its token."""
    n = 0
    while True:
        n += 1
        v = float(100 * ctx.input_pipeline_id + n)
        el = {**{k: np.full(m, v, np.float32) for k, m in SIZES.items()}, "tag": np.int32(v)}
        if ctx.input_pipeline_id == 2:
            el["boom"] = np.zeros(1, np.float32)
        yield el


def test_token_gated_a_step_raising_on_one_worker_only():
    """2 of 3 gradients per step; the step raises on worker 2 only (after it took a
    token). join raises that error within the bound, the steps behind it are cancelled
    (TF's coordinator), and the parameters are the reference's for shard 0's accepted
    pushes."""
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=3, placement="round_robin",
                                   token_timeout=BOUND_S)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {k: jnp.zeros(n) for k, n in SIZES.items()}
        tx = jr.ps.pushable(jr.sync_replicas(optax.sgd(LR), 2, 3))
        opt = tx.init(params)
    inner = _step(tx)

    def step(ctx, batch, p, o):
        if "boom" in batch:
            raise ValueError("review: worker 2's batch")
        return inner(ctx, batch, p, o)

    it = rep.prepare_input(_boom_input)
    values = [rep.run(step, it, params, opt) for _ in range(12)]
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="worker 2's batch"):
        rep.join()
    assert time.monotonic() - t0 < BOUND_S
    grads, failed = {}, 0
    for v in values:
        try:
            tag, _ = v.fetch(timeout=BOUND_S)
        except ValueError:
            failed += 1
            continue
        except StepCancelledError:
            continue
        g = float(np.ravel(tag)[0])
        grads[v.step_id] = {k: np.full(m, g, np.float32) for k, m in SIZES.items()}
    assert failed >= 1
    got, want = s.parameters(), _token_reference(s, grads)
    led = s.ledger()
    s.shutdown()
    for k in SIZES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)
    assert led[0]["pushes"] == led[0]["applied"] + led[0]["stale"] + led[0]["backup"] + \
        led[0]["duplicate"] + led[0]["failed"]


def test_token_gated_replicas_to_aggregate_above_the_workers_left_after_kills():
    """3 gradients per step, 3 workers, 2 killed: the last worker contributes several
    gradients to a step (as total_num_replicas < replicas_to_aggregate); every step ends,
    none hangs, and the parameters are the reference's."""
    s = jr.ParameterServerStrategy(num_ps=3, num_workers=3, placement="round_robin",
                                   token_timeout=BOUND_S, max_worker_restarts=0)
    rep = jr.Replicator(s)
    with rep.scope():
        params = {k: jnp.zeros(n) for k, n in SIZES.items()}
        tx = jr.ps.pushable(jr.sync_replicas(optax.sgd(LR), 3, 3))
        opt = tx.init(params)
    step = _step(tx)
    rep.run(step, _batch(0, 1.0), params, opt)
    rep.join()
    jrt.kill_worker(s, 1, when="compute")
    jrt.kill_worker(s, 2, when="push")
    values = [rep.run(step, _batch(i, float(i)), params, opt) for i in range(1, 13)]
    t0 = time.monotonic()
    try:
        rep.join()
    except StepCancelledError:
        pass  # (steps waiting for a step's last gradients nothing scheduled will push)
    assert time.monotonic() - t0 < BOUND_S
    assert all(v.done() for v in values)
    grads = {0: {k: np.full(m, 1.0, np.float32) for k, m in SIZES.items()}}
    grads.update({v.step_id: {k: np.full(m, float(i), np.float32) for k, m in SIZES.items()}
                  for i, v in enumerate(values, 1)})
    alive, gs = s.stats()["alive"], s.global_step
    got, want = s.parameters(), _token_reference(s, grads)
    steps = [s._ex().shard_step(i) for i in range(3)]
    s.shutdown()
    assert alive == [True, False, False], alive
    assert gs >= 3 and steps == [gs] * 3, (gs, steps)
    for k in SIZES:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_restart_shard_names_every_lost_update_after_a_step_that_raised(monkeypatch):
    from jreplicate.ps.fate import ledger

    monkeypatch.setattr(ledger, "WINDOW", 8)
    s, rep, params, opt, step = _sgd_job(num_ps=2, workers=2)
    bad = rep.run(_bad_step(None), _batch(), params, opt)  # id 0: never pushed
    with pytest.raises(ValueError):
        rep.join()
    assert bad.done()
    for i in range(1, 5):
        rep.run(step, _batch(i), params, opt)
    rep.join()
    saved = s.state()
    after = [rep.run(step, _batch(i), params, opt).step_id for i in range(20)]
    rep.join()
    lost_shard = s.placement.shard_of("['b']")
    jrt.kill_shard(s, lost_shard)
    report = s.restart_shard(lost_shard, saved)
    s.shutdown()
    assert report.lost == tuple(after), report.lost


# -- the same on Ray (a few bounded cases) -----------------------------------------------

@pytest.fixture(scope="module")
def review_ray():
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'jreplicate[ray]'")
    from tests.test_ps_ray import private_ray

    yield from private_ray()


def test_on_ray_kill_at_push_with_one_shard_and_nnx_read_as_of_each_run(review_ray):
    """On Ray (the worker actors import this checkout's client): a worker killed at
    "push" with one shard dies after its push (the rerun's push a duplicate, every step
    applied once), and an NNX variable set between two runs is read as of each run."""
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)
            self.scale = nnx.Variable(jnp.array(1.0))

    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier="ray")
    rep = jr.Replicator(s)
    with rep.scope():
        model = Model(nnx.Rngs(0))
        opt = nnx.Optimizer(model, jr.ps.pushable(optax.sgd(0.1)), wrt=nnx.Param)

    def step(ctx, model, opt):
        opt.update(model, nnx.grad(lambda m: jnp.sum(m.lin(jnp.ones((1, 2)))))(model))
        return model.scale[...]

    try:
        assert float(rep.run(step, None, model, opt).fetch(timeout=120)) == 1.0
        model.scale.set_value(jnp.array(3.0))
        assert float(rep.run(step, None, model, opt).fetch(timeout=120)) == 3.0
        rep.join()
        jrt.kill_worker(s, 0, when="push")
        for _ in range(4):
            rep.run(step, None, model, opt)
        rep.join()
        led, stats = s.ledger()[0], s.stats()
        assert stats["rescheduled"] >= 1 and stats["alive"][1], stats
        assert (led["applied"], led["duplicate"], led["pushes"]) == (6, 1, 7), led
    finally:
        s.shutdown()


def test_on_ray_shutdown_while_a_worker_dies_ends_every_step(review_ray):
    s, rep, params, opt, step = _sgd_job(num_ps=1, workers=2, carrier="ray")
    try:
        for v in [rep.run(step, _batch(i), params, opt) for i in range(2)]:
            v.fetch(timeout=120)
        for w in range(2):
            jrt.set_worker_delay(s, w, 0.5)
        jrt.kill_worker(s, 0, when="compute")
        values = [rep.run(step, _batch(i), params, opt) for i in range(4)]
        time.sleep(0.2)
    finally:
        s.shutdown()
    assert_every_step_ends(values, 20.0)


def test_restore_after_a_lost_shard_restores_as_the_error_says():
    """A lost shard's ParameterServerError says "Restore the last checkpoint
    (strategy.restore(...))", but restore() joined first and re-raised that same error,
    every time: the job could not be restored (only restart_shard worked)."""
    s, rep, params, opt, step = _sgd_job(num_ps=2, workers=2)
    for i in range(3):
        rep.run(step, _batch(i), params, opt)
    rep.join()
    saved = s.state()
    jrt.kill_shard(s, 1)
    lost = rep.run(step, _batch(9), params, opt)
    with pytest.raises(ParameterServerError, match=r"strategy\.restore"):
        rep.join()
    s.restore(saved)
    with pytest.raises(ParameterServerError):
        lost.fetch(timeout=BOUND_S)  # (the failed step keeps its error)
    for k in SIZES:
        np.testing.assert_allclose(s.parameters()[k], -LR * 3)
    for i in range(2):
        rep.run(step, _batch(i), params, opt)
    rep.join()
    assert [led["applied"] for led in s.ledger()] == [5, 5]
    for k in SIZES:
        np.testing.assert_allclose(s.parameters()[k], -LR * 5)
    s.shutdown()


def test_on_ray_restore_after_a_lost_shard_actor(review_ray):
    s, rep, params, opt, step = _sgd_job(num_ps=2, workers=2, carrier="ray")
    try:
        for i in range(3):
            rep.run(step, _batch(i), params, opt)
        rep.join()
        saved = s.state()
        jrt.kill_shard(s, 1)
        rep.run(step, _batch(9), params, opt)
        with pytest.raises(ParameterServerError, match=r"strategy\.restore"):
            s._ex().coordinator.join(timeout=60)
        s.restore(saved)
        for i in range(2):
            rep.run(step, _batch(i), params, opt)
        rep.join()
        assert [led["applied"] for led in s.ledger()] == [5, 5]
        for k in SIZES:
            np.testing.assert_allclose(s.parameters()[k], -LR * 5)
    finally:
        s.shutdown()
