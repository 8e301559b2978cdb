"""Checkpoints saved in the background (one process): ``save`` returns before the
commit, training (and donation) goes on meanwhile, a failed write surfaces once, at the
next call, on every process alike, and is never restored; a state machine against a
dict of committed steps checks restore and ``max_to_keep`` through saves, waits,
failures, damage and restarts. Two processes: tests/test_checkpoint_background_processes
cases below, through tests/mp_scripts/ckpt_faults_async.py."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import jreplicate as jr
import jreplicate.testing as jrt
from jreplicate.checkpoint import CheckpointError, CheckpointManager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def rep():
    return jr.Replicator(jr.MirroredStrategy())


def _state(seed: int, n: int = 64) -> dict:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((n, n)).astype(np.float32),
            "b": rng.integers(-2**31, 2**31 - 1, 16, dtype=np.int32)}


def _template(n: int = 64):
    return lambda: {"w": jnp.zeros((n, n), jnp.float32), "b": jnp.zeros(16, jnp.int32)}


def _restored(path, rep, n: int = 64):
    with CheckpointManager(path, rep) as m:
        step, state = m.restore_or_initialize(_template(n))
    return step, jax.tree.map(np.asarray, state)


def _bits_equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8))
               for k in a)


def test_save_returns_before_the_commit(tmp_path, rep):
    release = threading.Event()
    with CheckpointManager(tmp_path, rep) as m:
        jrt.delay_checkpoint_write(m, release)
        t0 = time.monotonic()
        assert m.save(1, _state(1)) is True
        assert time.monotonic() - t0 < 20  # the write is held: save did not wait for it
        assert m.complete_steps() == [] and m.latest_step() is None  # not committed yet
        assert not any(n == "1" for n in os.listdir(tmp_path))
        release.set()
        m.wait_until_finished()
        assert m.complete_steps() == [1] and m.latest_step() == 1
    step, state = _restored(tmp_path, rep)
    assert step == 1 and _bits_equal(state, _state(1))


def test_donating_the_state_while_it_is_written_keeps_the_saved_values(tmp_path, rep):
    # Trap T4: save, then donate at once. The checkpoint is the state before donation.
    n = 1024  # 4 MiB of float32
    state = jax.device_put({"w": jnp.asarray(_state(7, n)["w"]), "b": jnp.arange(16)})
    before = jax.tree.map(lambda x: np.array(x, copy=True), state)
    step_fn = jax.jit(lambda s: {"w": s["w"] * 2 + 1, "b": s["b"] + 1}, donate_argnums=0)
    release = threading.Event()
    with CheckpointManager(tmp_path, rep) as m:
        jrt.delay_checkpoint_write(m, release)
        m.save(1, state)
        for _ in range(3):  # training goes on and donates the saved buffers
            state = step_fn(state)
        jax.block_until_ready(state)
        release.set()
        m.wait_until_finished()
    with CheckpointManager(tmp_path, rep) as m:
        step, got = m.restore_or_initialize(
            lambda: {"w": jnp.zeros((n, n)), "b": jnp.zeros(16, jnp.int32)})
    assert step == 1 and _bits_equal(jax.tree.map(np.asarray, got), before)
    assert not np.array_equal(np.asarray(state["w"]), before["w"])  # it did train on


@pytest.mark.parametrize("where", ["save", "wait_until_finished", "close",
                                   "restore_or_initialize"])
def test_a_failed_write_surfaces_once_at_the_next_call(tmp_path, rep, where):
    m = CheckpointManager(tmp_path, rep, max_to_keep=2)
    m.save(1, _state(1))
    m.wait_until_finished()
    jrt.fail_checkpoint_write(m)
    assert m.save(2, _state(2)) is True  # the failure is in the background
    calls = {"save": lambda: m.save(3, _state(3)), "wait_until_finished": m.wait_until_finished,
             "close": m.close,
             "restore_or_initialize": lambda: m.restore_or_initialize(_template())}
    with pytest.raises(CheckpointError, match=re.escape(
            f"checkpoint 2 was not written: process 0 failed (cannot write to {tmp_path}: "
            "the disk is full (No space left on device (injected by jreplicate.testing."
            f"fail_checkpoint_write): {tmp_path}). Nothing older was deleted for it. Free "
            "space on that disk (or raise the quota), or give a directory on another "
            "disk.); it is incomplete and will not be restored; checkpoint 1 is the "
            "latest.")):
        calls[where]()
    assert m.complete_steps() == [1]
    assert sorted(os.listdir(tmp_path)) == ["1", "jreplicate.lock"][:2 if where != "close" else 1]
    # once: the next calls do not raise it again
    m.wait_until_finished()
    m.close()
    m.close()
    step, state = _restored(tmp_path, rep)
    assert step == 1 and _bits_equal(state, _state(1))


def test_a_failed_write_raises_at_save_when_saves_block(tmp_path, rep):
    with CheckpointManager(tmp_path, rep, enable_async_checkpointing=False) as m:
        jrt.fail_checkpoint_write(m)
        with pytest.raises(CheckpointError, match="checkpoint 5 was not written: process 0 "
                           "failed .*there is no complete checkpoint yet"):
            m.save(5, _state(5))
        assert m.complete_steps() == []
        assert m.save(6, _state(6)) and m.complete_steps() == [6]  # committed on return


def test_max_to_keep_counts_committed_steps(tmp_path, rep):
    with CheckpointManager(tmp_path, rep, max_to_keep=2) as m:
        for s in range(1, 6):
            m.save(s, _state(s))
        jrt.fail_checkpoint_write(m)
        m.save(6, _state(6))
        with pytest.raises(CheckpointError, match="checkpoint 6 was not written"):
            m.wait_until_finished()
        assert m.complete_steps() == [4, 5]  # a failed write deletes nothing
    assert sorted(os.listdir(tmp_path)) == ["4", "5"]


def test_a_manager_dropped_while_writing_finishes_before_a_new_one_opens(tmp_path, rep):
    import gc
    m = CheckpointManager(tmp_path, rep)
    jrt.delay_checkpoint_write(m, 1.0)
    m.save(1, _state(1))
    del m  # no close(): its lock goes with it, its write goes on
    gc.collect()
    step, state = _restored(tmp_path, rep)  # waited for the write, did not delete it
    assert step == 1 and _bits_equal(state, _state(1))


def test_arguments_are_checked(tmp_path, rep):
    with pytest.raises(TypeError, match=re.escape(
            "CheckpointManager(enable_async_checkpointing=1) must be True or False.")):
        CheckpointManager(tmp_path, rep, enable_async_checkpointing=1)
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(ValueError, match=re.escape(
                "fail_checkpoint_write(process=1): process must be an int in [0, 1)")):
            jrt.fail_checkpoint_write(m, process=1)
        with pytest.raises(ValueError, match="seconds >= 0 or a threading.Event"):
            jrt.delay_checkpoint_write(m, -1.0)
        with pytest.raises(TypeError, match="mngr must be a CheckpointManager"):
            jrt.fail_checkpoint_write(rep)


def test_an_error_never_reported_is_logged_at_exit(tmp_path):
    script = textwrap.dedent(f"""
        import jax.numpy as jnp, jreplicate as jr, jreplicate.testing as jrt
        m = jr.CheckpointManager({str(tmp_path)!r}, jr.MirroredStrategy())
        jrt.fail_checkpoint_write(m)
        m.save(1, {{"w": jnp.ones(2)}})
        """)  # the program ends without wait_until_finished() or close()
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    # (Python starts no thread at exit, so the write fails there in any case.)
    assert re.search(r"jreplicate: checkpoint 1 was not written \(.*\); the error was never "
                     r"reported: call CheckpointManager.wait_until_finished\(\) or close\(\)",
                     out.stderr), out.stderr[-2000:]
    assert "1" not in os.listdir(tmp_path)


# -- a state machine against a dict of committed steps ------------------------------------
MAX_TO_KEEP = 2


def _flip_a_data_byte(step_dir: str) -> None:
    """Flips the middle byte of each data file of a step (OCDBT keeps data files in
    ``d/`` directories; which one a read uses depends on the layout)."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs
             if os.path.basename(d) == "d"]
    assert files, f"no data files under {step_dir}"
    for path in files:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x5A]))


class CheckpointMachine(RuleBasedStateMachine):
    """The model: ``committed`` (step -> state) as on disk, ``damaged`` (steps whose
    files were changed after their commit), ``pending`` (the step being written and
    whether its write fails)."""

    def __init__(self):
        super().__init__()
        import tempfile
        self.dir = tempfile.mkdtemp(prefix="ckpt_machine_")
        self.rep = _REP
        self.mngr = CheckpointManager(self.dir, self.rep, max_to_keep=MAX_TO_KEEP)
        self.committed: dict[int, dict] = {}
        self.damaged: set[int] = set()
        self.pending: tuple[int, bool] | None = None  # (step, its write fails)
        self.armed = False  # a failure injected, for the next write that starts
        self.next_step = 1

    def _settled(self, call):
        """Runs ``call``, which settles the pending write first: it raises that write's
        failure, or the model commits the step (and applies ``max_to_keep``)."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[1]:
            with pytest.raises(CheckpointError, match=f"checkpoint {pending[0]} was not written"):
                call()
            return False
        if pending is not None:
            self.committed[pending[0]] = _state(pending[0], 8)
            for s in sorted(self.committed)[:-MAX_TO_KEEP]:
                del self.committed[s]
                self.damaged.discard(s)
        call()
        return True

    @rule(fail=st.sampled_from([False, False, True]), hold=st.booleans())
    def save(self, fail, hold):
        step, self.next_step = self.next_step, self.next_step + 1
        if fail:  # armed for the next write that starts
            jrt.fail_checkpoint_write(self.mngr)
            self.armed = True
        if hold:
            jrt.delay_checkpoint_write(self.mngr, 0.05)
        if self._settled(lambda: self.mngr.save(step, _state(step, 8))):
            self.pending, self.armed = (step, self.armed), False

    @rule()
    def wait(self):
        self._settled(self.mngr.wait_until_finished)

    @precondition(lambda self: self.pending is None and set(self.committed) - self.damaged)
    @rule(data=st.data())
    def corrupt(self, data):
        step = data.draw(st.sampled_from(sorted(set(self.committed) - self.damaged)))
        _flip_a_data_byte(os.path.join(self.dir, str(step)))
        self.damaged.add(step)

    @rule()
    def reopen(self):
        self._settled(self.mngr.close)
        self.mngr = CheckpointManager(self.dir, self.rep, max_to_keep=MAX_TO_KEEP)
        self.armed = False  # the faults were the closed manager's

    @rule()
    def restore(self):
        restored = {}

        def call():
            restored["value"] = self.mngr.restore_or_initialize(_template(8))

        good = sorted(set(self.committed) - self.damaged)
        if self.pending is not None and not self.pending[1]:
            good = sorted(set(good) | {self.pending[0]})[-MAX_TO_KEEP:]
        if not good and self.damaged and not (self.pending and self.pending[1]):
            self.pending = None
            with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
                call()
            return
        if not self._settled(call):
            return  # the pending write's failure was raised instead
        good = sorted(set(self.committed) - self.damaged)
        step, state = restored["value"]
        if not good:
            assert step == 0
            return
        assert step == good[-1]
        assert _bits_equal(jax.tree.map(np.asarray, state), self.committed[step])
        for s in [s for s in self.damaged if s > step]:  # moved aside, never deleted
            del self.committed[s]
            self.damaged.discard(s)

    @invariant()
    def listed_steps_are_the_committed_ones(self):
        if self.pending is None:
            assert self.mngr.complete_steps() == sorted(self.committed)
            assert len(self.committed) <= MAX_TO_KEEP

    def teardown(self):
        self._settled(self.mngr.close)


_REP = None


def test_checkpoint_state_machine(rep):
    global _REP
    _REP = rep
    CheckpointMachine.TestCase.settings = settings(
        max_examples=30, stateful_step_count=15, deadline=None,
        suppress_health_check=list(HealthCheck))
    CheckpointMachine.TestCase().runTest()


# -- two processes, each writing its own shards ------------------------------------------
def _launch_async(tmp_path, *args, timeout=120):
    from tests.test_multi_worker_processes import SCRIPTS, _launch
    t0 = time.monotonic()
    r = _launch(["--nproc", "2", "--devices-per-proc", "4",
                 str(SCRIPTS / "ckpt_faults_async.py"), "--dir", str(tmp_path), *args],
                timeout=timeout)
    return r, time.monotonic() - t0


def test_a_write_failing_on_one_process_is_the_same_error_on_every_process(tmp_path):
    r, _ = _launch_async(tmp_path, "--mode", "fail")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    results = dict(re.findall(r"\[p\d\] RESULT fail (\d) ([\d.]+ .*)", r.stdout))
    assert set(results) == {"0", "1"}, out[-4000:]
    errors = {p: v.split(" ", 1)[1] for p, v in results.items()}
    assert errors["0"] == errors["1"], errors  # the same error on both
    assert errors["0"].startswith("checkpoint 2 was not written: process 1 failed (cannot "
                                  f"write to {tmp_path}: the disk is full"), errors
    assert errors["0"].endswith("it is incomplete and will not be restored; checkpoint 1 "
                                "is the latest."), errors
    # promptly: process 0 was not left in Orbax's barrier until the timeout (20 s)
    assert all(float(v.split(" ", 1)[0]) < 10 for v in results.values()), results
    assert "ClusterError" not in out and "Timed out" not in out, out[-4000:]
    assert re.findall(r"LISTED \d \[1, 3\]", r.stdout) and len(
        re.findall(r"LISTED \d \[1, 3\]", r.stdout)) == 2, out[-4000:]
    assert sorted(os.listdir(tmp_path)) == ["1", "3"]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_process_killed_mid_write_leaves_a_step_never_restored(tmp_path, seed):
    import random
    rng = random.Random(seed)
    victim, delay = seed % 2, rng.uniform(0.05, 2.5)  # the write takes 2 s more
    r, _ = _launch_async(tmp_path, "--mode", "kill", "--victim", str(victim),
                         "--delay", f"{delay:.2f}")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and f"process {victim} of 2 failed first: killed by signal 9" \
        in r.stderr, out[-4000:]
    r, wall = _launch_async(tmp_path, "--mode", "restore")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    restored = re.findall(r"RESTORED (\d) (\d+) (\w+)", r.stdout)
    assert len(restored) == 2 and {s for _, s, _ in restored} <= {"1", "2"}, out[-4000:]
    assert len({s for _, s, _ in restored}) == 1  # the same step on both
    assert all(same == "True" for _, _, same in restored), out[-4000:]  # bit-equal
    after = ast.literal_eval(re.search(r"AFTER 0 (\[.*\])", r.stdout).group(1))
    step = int(restored[0][1])
    assert not any(".orbax-checkpoint-tmp" in n for n in after), after  # debris gone
    assert str(step + 1) in after, after
    assert wall < 60, wall
