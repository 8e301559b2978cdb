"""Preemption: a SIGTERM on any process makes every process save the same step and exit
42; the launcher restarts the group apart from --max-restarts; the run resumes bit-exact.

* One process (a Python SIGTERM handler): the signal sent from inside a step.
* Two processes under the launcher (JAX's preemption service): SIGTERM to a seeded
  random process at a seeded random step, with per-step runs and device loops of 4
  steps (the sync ids are the manager's own call count, never the step: T6), compared
  bit for bit with uninterrupted runs of the same 2x4 topology.
* The launcher alone (JAX-free children): exit 42 does not use up --max-restarts, is
  bounded by --max-preemptions, needs every process; its own SIGTERM is forwarded.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jreplicate as jr
from jreplicate.checkpoint import EXIT_PREEMPTED, CheckpointManager, Preempted
from jreplicate.checkpoint import preemption as preemption_mod
from jreplicate.cluster import launch, watchdog
from jreplicate.cluster.launch import tied_to_parent
from tests._models import init_mlp, make_data, mlp, per_example_loss

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "mp_scripts" / "preempt.py")
TX = optax.adam(1e-2)
STEPS, BATCH = 8, 16


def _init():
    params = init_mlp(jax.random.key(1))
    return params, TX.init(params)


def _step(ctx, batch, params, opt, kill):
    xb, yb = batch
    # The notice arrives while the step runs (a callback on the devices' threads).
    jax.debug.callback(lambda k: os.kill(os.getpid(), signal.SIGTERM) if k else None,
                       kill)

    def loss_fn(p):
        return jr.compute_average_loss(per_example_loss(mlp(p, xb), yb), BATCH)

    g = jax.grad(loss_fn)(params)
    u, opt = TX.update(g, opt, params)
    return optax.apply_updates(params, u), opt


def _train(rep, mngr, state, start, kill_at=None):
    """Trains from ``start`` to STEPS, saving after every step; returns the state."""
    x, y = make_data(STEPS, BATCH, seed=5)

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(BATCH)
        return ((x[s, r * b:(r + 1) * b], y[s, r * b:(r + 1) * b])
                for s in range(start, STEPS) for r in range(ctx.num_replicas))

    inputs = rep.prepare_input(input_fn)
    params, opt = state
    for s in range(start, STEPS):
        params, opt = rep.run(_step, next(inputs), params, opt, np.bool_(s == kill_at))
        jax.block_until_ready(params)  # as reading the loss would: the step has run
        if mngr is not None:
            mngr.save(s + 1, (params, opt))
    return params, opt


def _bits(tree):
    return [np.asarray(v).tobytes() for v in jax.tree.leaves(tree)]


@pytest.fixture
def rep():
    return jr.Replicator(jr.MirroredStrategy())


@pytest.fixture(autouse=True)
def _sigterm_as_at_start():
    """Each test starts with SIGTERM's default action, whatever an earlier test in this
    process installed (``ray.init`` installs a handler that exits at once)."""
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGTERM, old)


def test_rays_exiting_handler_is_not_chained_but_given_back(tmp_path, rep):
    """Ray's driver handler calls ``sys.exit`` at once: chained to, it would end the job
    before the agreed save. The watch does not call it, and gives it back at close."""
    called = []

    def ray_handler(signum, frame):
        called.append(signum)
        raise SystemExit(signum)

    ray_handler.__module__ = "ray._private.worker"
    signal.signal(signal.SIGTERM, ray_handler)
    with CheckpointManager(tmp_path, rep, exit_on_preemption=False) as mngr:
        os.kill(os.getpid(), signal.SIGTERM)
        assert mngr.save(1, {"w": jnp.zeros(2)}) and mngr.reached_preemption(1)
    assert called == [] and signal.getsignal(signal.SIGTERM) is ray_handler


def test_sigterm_in_a_step_saves_that_step_exits_42_and_resumes_bit_exact(tmp_path, rep):
    with rep.scope():
        reference = _train(rep, None, _init(), 0)
    before = signal.getsignal(signal.SIGTERM)
    mngr = CheckpointManager(tmp_path, rep, save_interval_steps=100)
    assert mngr._preempt.mechanism == "signal"
    with rep.scope():
        _, state = mngr.restore_or_initialize(_init)
    with pytest.raises(Preempted) as info:
        _train(rep, mngr, state, 0, kill_at=3)
    e = info.value
    assert isinstance(e, SystemExit) and e.code == EXIT_PREEMPTED == 42
    # The signal arrives during step 4's computation: save(4) is where the job stops.
    assert e.step == 4
    assert mngr.reached_preemption(e.step)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == [str(e.step)]
    assert signal.getsignal(signal.SIGTERM) == before  # closed: the handler given back
    with CheckpointManager(tmp_path, rep, save_interval_steps=100) as again:
        with rep.scope():
            step, state = again.restore_or_initialize(_init)
        assert step == e.step
        resumed = _train(rep, again, state, step)
    assert _bits(resumed) == _bits(reference)


def test_exit_on_preemption_false_lets_the_program_decide(tmp_path, rep):
    mngr = CheckpointManager(tmp_path, rep, save_interval_steps=10, exit_on_preemption=False)
    made = []

    def state():
        made.append(1)
        return {"w": jnp.ones(3)}

    assert not mngr.save(1, state) and not made  # not written: never evaluated
    os.kill(os.getpid(), signal.SIGTERM)
    assert mngr.save(2, state) and made == [1]  # written whatever the interval says
    assert mngr.reached_preemption(2) and mngr.reached_preemption(3)
    assert mngr.complete_steps() == [2]
    assert mngr.save(10, state) and not mngr.save(11, state)  # on as before, if asked
    mngr.close()


def test_the_handler_chains_to_the_previous_one_and_is_given_back(tmp_path, rep):
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGTERM, previous)
    try:
        first = CheckpointManager(tmp_path / "a", rep, exit_on_preemption=False)
        second = CheckpointManager(tmp_path / "b", rep, exit_on_preemption=False)
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
        first.close()
        assert signal.getsignal(signal.SIGTERM) != previous  # the second still watches
        assert second.save(7, {"w": jnp.zeros(2)}, force=False)  # interval 1: written
        assert second.reached_preemption(7)
        second.close()
        assert signal.getsignal(signal.SIGTERM) == previous
        # A notice nobody acted on does not outlive the managers: a new one starts clean.
        with CheckpointManager(tmp_path / "c", rep, save_interval_steps=5) as third:
            assert not third.save(1, {"w": jnp.zeros(2)})
            assert not third.reached_preemption(1)
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_manager_dropped_without_close_gives_the_handler_back(tmp_path, rep):
    """A manager the program drops unclosed (collected) stops watching SIGTERM: its
    handler does not stay installed, chained, for the rest of the process."""
    import gc

    def previous(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, previous)
    try:
        dropped = CheckpointManager(tmp_path / "a", rep)
        dropped.save(1, {"w": jnp.zeros(2)})
        dropped.wait_until_finished()
        assert signal.getsignal(signal.SIGTERM) != previous
        del dropped
        gc.collect()
        assert signal.getsignal(signal.SIGTERM) == previous
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_manager_made_outside_the_main_thread_says_preemption_is_not_watched(
        tmp_path, rep, caplog):
    made = {}
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="jreplicate"):
        t = threading.Thread(target=lambda: made.update(m=CheckpointManager(tmp_path, rep)))
        t.start()
        t.join(60)
    assert "preemption (SIGTERM) is not watched on this process" in caplog.text
    assert made["m"]._preempt.mechanism == "none"
    assert signal.getsignal(signal.SIGTERM) == before
    made["m"].close()


def test_exit_on_preemption_is_checked(tmp_path, rep):
    with pytest.raises(TypeError, match=r"exit_on_preemption='yes'\) must be True or False"):
        CheckpointManager(tmp_path, rep, exit_on_preemption="yes")


def test_sync_ids_are_the_call_count_not_the_step(monkeypatch):
    """With JAX's service, the ids passed grow by one per check, process-wide, whatever
    the steps (device loops jump by K) or the number of managers."""
    seen = []
    from jax.experimental import multihost_utils
    monkeypatch.setattr(preemption_mod, "_service_running", lambda: True)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point",
                        lambda i: seen.append(i) or False)
    a, b = preemption_mod.PreemptionWatch(None), preemption_mod.PreemptionWatch(None)
    assert a.mechanism == b.mechanism == "jax"
    for w in (a, a, b, a, b):
        assert not w.check()
    assert seen == list(range(seen[0], seen[0] + 5))


# -- the launcher with JAX-free children ----------------------------------------------
def _launch(monkeypatch, capsys, *argv):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    code = launch.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_exit_42_does_not_use_up_max_restarts(monkeypatch, capsys):
    code, _, err = _launch(monkeypatch, capsys, "--nproc", "2", "--max-restarts", "0",
                           SCRIPT, "exit42-once")
    assert code == 0, err
    assert ("restarting all 2 processes (preemption 1 of 100; not counted against "
            "--max-restarts)") in err
    code, _, err = _launch(monkeypatch, capsys, "--nproc", "2", "--max-preemptions", "2",
                           SCRIPT, "exit42-always")
    assert code == EXIT_PREEMPTED, err
    assert err.count("preempted: every process exited 42") == 3
    assert "giving up after 2 preemption restart(s) (--max-preemptions 2)" in err


def test_exit_42_on_one_process_only_is_a_failure(monkeypatch, capsys):
    code, _, err = _launch(monkeypatch, capsys, "--nproc", "2", "--grace", "1",
                           "--max-preemptions", "5", SCRIPT, "one42")
    assert code == EXIT_PREEMPTED and "preemption 1 of" not in err, err
    assert ("processes [1] of 2 exited 42 (preempted) but processes [0] did not stop within "
            "--grace 1s (stopped them)") in err
    code, _, err = _launch(monkeypatch, capsys, "--nproc", "2", "--max-preemptions", "5",
                           SCRIPT, "mixed42")
    assert code == EXIT_PREEMPTED and "preemption 1 of" not in err, err
    assert ("processes [1] of 2 exited 42 (preempted) but processes [0] ended otherwise "
            "(exit code 0)") in err


def test_describe_status_names_preemption():
    assert launch.describe_status(42) == "exit code 42 (preempted, after saving a checkpoint)"
    assert watchdog.EXIT_PREEMPTED == jr.checkpoint.EXIT_PREEMPTED == 42


def _start(args: list[str], env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jreplicate.cluster.launch", *args]
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("JREPLICATE_", "JAX_", "XLA_")) and k != "TF_CONFIG"}
    base.update(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.Popen(tied_to_parent(cmd), cwd=ROOT, env=base, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(p: subprocess.Popen, timeout: float) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        pytest.fail(f"launcher still running after {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")


def test_sigterm_to_the_launcher_is_forwarded_and_it_exits_42():
    p = _start(["--nproc", "2", "--grace", "20", "--max-preemptions", "5", SCRIPT, "term42"])
    ready = 0
    deadline = time.monotonic() + 30
    while ready < 2 and time.monotonic() < deadline:
        line = p.stdout.readline()
        ready += "READY" in line
        if not line:
            break
    assert ready == 2, p.stderr.read() if p.poll() is not None else "not ready"
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = _finish(p, 30)
    assert p.returncode == EXIT_PREEMPTED, err
    assert time.monotonic() - t0 < 10  # not the --grace: it returns once all exited
    assert "received SIGTERM and forwarded it: every process exited 42; not restarting" in err
    assert "restarting" not in err.replace("not restarting", "") and "restart=1" not in out


# -- two processes under the launcher, JAX's preemption service ------------------------
TRAIN_STEPS = 24


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final parameters and optimizer state of uninterrupted 2x4 runs (K = 1 and 4)."""
    d = tmp_path_factory.mktemp("reference")
    p = _start(["--nproc", "2", "--devices-per-proc", "4", "--timeout", "150", SCRIPT,
                "reference", "--ckpt", str(d / "ckpt"), "--out", str(d),
                "--steps", str(TRAIN_STEPS)])
    out, err = _finish(p, 180)
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    return {k: np.load(d / f"final_k{k}.npz") for k in (1, 4)}


def _reports(path: Path) -> list[list[str]]:
    return [ln.split() for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.parametrize("seed,k,service", [(1, 1, False), (2, 4, True)])
def test_sigterm_to_one_of_two_processes_saves_restarts_and_resumes_bit_exact(
        tmp_path, reference, seed, k, service):
    """``service``: JAX's preemption service; else (switched off) the manager's SIGTERM
    handler, the processes' notices all-gathered at every save."""
    rng = random.Random(seed)
    target, at = rng.randrange(2), rng.randrange(2, 12)
    report = tmp_path / "report.txt"
    report.touch()
    p = _start(["--nproc", "2", "--devices-per-proc", "4", "--max-restarts", "0",
                "--grace", "20", "--timeout", "150", SCRIPT, "train",
                "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path),
                "--report", str(report), "--steps", str(TRAIN_STEPS),
                "--save-every", "3", "--steps-per-run", str(k), "--sleep", "0.1",
                "--slow-writes", "0.5"] + ([] if service else ["--no-preemption-service"]))
    sent = None
    deadline = time.monotonic() + 120
    while sent is None and time.monotonic() < deadline and p.poll() is None:
        for row in _reports(report):
            if row[0] == str(target) and row[3] == "0" and int(row[2]) >= at:
                os.kill(int(row[1]), signal.SIGTERM)
                sent = int(row[2])
                break
        time.sleep(0.01)
    out, err = _finish(p, 150)
    assert sent is not None, f"never reached step {at}:\n{out[-3000:]}\n{err[-3000:]}"
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    rows = _reports(report)
    stopped = {r[1]: int(r[2]) for r in rows if r[0] == "P"}
    assert set(stopped) == {"0", "1"} and len(set(stopped.values())) == 1, rows
    step = stopped["0"]
    assert step >= sent and step % k == 0 and step < TRAIN_STEPS, (sent, step)
    assert all(r[3] == "0" for r in rows if r[0] == "P")
    # The restarted attempt resumed from the step the first one stopped at.
    watched = "jax" if service else "signal"
    assert f"START k={k} at step 0 (restart 0; preemption watched by {watched})" in out
    assert f"START k={k} at step {step} (restart 1; preemption watched by {watched})" in out
    assert f"preempted: every process saved checkpoint {step} and exited 42" in err
    assert "preemption 1 of 100; not counted against --max-restarts" in err
    final = np.load(tmp_path / f"final_k{k}.npz")
    ref = reference[k]
    assert len(final.files) == len(ref.files)
    for name in ref.files:
        assert final[name].tobytes() == ref[name].tobytes(), name


# -- JAX's sync protocol, simulated: where the processes stop ---------------------------
class _SyncProtocol:
    """tsl's PreemptionSyncManagerImpl for simulated processes: each process's last id
    passed is recorded; the notice sets the sync point to the largest recorded id plus
    one (every process reports its counter, then all agree on the max); a process gets
    True exactly when it passes that id."""

    def __init__(self, n: int):
        self.last = [0] * n
        self.point: int | None = None
        self.current = 0  # the simulated process calling

    def reached(self, sync_id: int) -> bool:
        self.last[self.current] = sync_id
        return self.point == sync_id

    def notice(self) -> None:
        self.point = max(self.last) + 1


def _simulate(managers, n, choose, ids_per_manager, monkeypatch):
    """Runs ``n`` simulated processes through the same program: managers one after the
    other, ``managers[m] = (calls, interval)``. ``choose(actions)`` picks the next action
    (a process's next save call, or the notice). A writing save is collective: every
    process must reach it. Returns where each process stopped (None: finished), or
    raises AssertionError when the processes can no longer move (a hang)."""
    from jax.experimental import multihost_utils
    sync = _SyncProtocol(n)
    monkeypatch.setattr(preemption_mod, "_service_running", lambda: True)
    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", sync.reached)
    program = [(m, c) for m, (calls, _) in enumerate(managers) for c in range(calls)]
    shared = [itertools.count() for _ in range(n)]
    watches = [[preemption_mod.PreemptionWatch(
        None, ids=itertools.count() if ids_per_manager else shared[p]) for _ in managers]
        for p in range(n)]
    pos, waiting, stopped, done = [0] * n, [None] * n, [None] * n, [False] * n
    noticed = False
    while not all(done):
        live = [p for p in range(n) if not done[p] and waiting[p] is None]
        keys = {waiting[p] for p in range(n)}
        if len(keys) == 1 and None not in keys:  # everyone at the same collective save
            for p in range(n):
                i, preempted = waiting[p]
                waiting[p], pos[p] = None, i + 1
                stopped[p] = i if preempted else None
                done[p] = preempted or pos[p] == len(program)
            continue
        actions = [("run", p) for p in live] + ([] if noticed else [("notice", None)])
        assert [a for a in actions if a[0] == "run"], (
            f"hang: processes wait at {waiting}, stopped at {stopped}")
        kind, p = choose(actions)
        if kind == "notice":
            sync.notice()
            noticed = True
            continue
        m, c = program[pos[p]]
        sync.current = p
        preempted = watches[p][m].check(c)
        if preempted or (c + 1) % managers[m][1] == 0:
            waiting[p] = (pos[p], preempted)
        else:
            pos[p] += 1
        if pos[p] == len(program):
            done[p] = True
    return stopped


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 3),
       managers=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=1,
                         max_size=3),
       data=st.data())
def test_every_process_stops_at_the_same_save_whatever_the_schedule(
        n, managers, data, monkeypatch):
    """Processes drift apart between collective saves (asynchronous dispatch), managers
    follow one another, the notice comes at any moment: every process stops at the same
    save call of the same manager, or none does (the notice came after the last)."""
    notice_after = data.draw(st.integers(0, n * sum(c for c, _ in managers)))
    moves = itertools.count()

    def choose(actions):
        runs = [a for a in actions if a[0] == "run"]
        if next(moves) >= notice_after and len(runs) < len(actions) or not runs:
            return ("notice", None)
        return data.draw(st.sampled_from(runs))

    stopped = _simulate(managers, n, choose, ids_per_manager=False,
                        monkeypatch=monkeypatch)
    assert len(set(stopped)) == 1, stopped


def test_sync_ids_counted_per_manager_would_split_the_processes(monkeypatch):
    """The schedule hypothesis finds for ids counted per manager (the seam's ``call``):
    process 1 is in the second manager when the notice comes, process 0 still in the
    first; counted per manager, process 0 stops in the first and process 1 waits in the
    second (a hang); counted per process, both stop at the same call."""
    def script():
        steps = iter([("run", 0), ("run", 0), ("run", 1), ("run", 1), ("run", 1),
                      ("run", 1), ("notice", None)])
        return lambda actions: next(steps, None) or actions[0]

    managers = [(3, 100), (3, 100)]
    with pytest.raises(AssertionError, match="hang"):
        _simulate(managers, 2, script(), ids_per_manager=True, monkeypatch=monkeypatch)
    assert _simulate(managers, 2, script(), ids_per_manager=False,
                     monkeypatch=monkeypatch) == [4, 4]
