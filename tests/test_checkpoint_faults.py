"""CheckpointManager under faults: a checkpoint that does not match init_fn's state, two
managers on one directory, a damaged checkpoint, bad paths; across processes, every
process raises the chief's error at once (real processes on 127.0.0.1, bounded)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import pytest

from jreplicate.checkpoint import CheckpointError, CheckpointManager, dirlock
from jreplicate.replicator import Replicator
from jreplicate.strategies.mirrored import MirroredStrategy
from tests.test_multi_worker_processes import ROOT, SCRIPTS, _launch


@pytest.fixture(scope="module")
def rep():
    return Replicator(MirroredStrategy())


def _state(dtype=jnp.float32, key="w"):
    return {key: jnp.ones((3, 4), dtype), "b": jnp.zeros(4), "opt": (jnp.zeros(2),)}


def _saved(path, rep, steps=(1,)):
    with CheckpointManager(path, rep) as m:
        _, state = m.restore_or_initialize(_state)
        for s in steps:
            m.save(s, {**state, "b": state["b"] + s})
    return path


# -- item 5: no silent cast, no numpy error for another structure ------------------------
def test_other_dtype_is_an_error_naming_path_and_both_dtypes(tmp_path, rep):
    _saved(tmp_path, rep)
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(CheckpointError, match=re.escape(
                f"checkpoint 1 in {tmp_path} does not match init_fn()'s state: ['w'] is "
                "float32[3, 4] in the checkpoint but init_fn() gives int32[3, 4], and "
                "restoring would cast it.\nThe checkpoint is left where it is. Restore it "
                "with an init_fn that builds the state it holds (make init_fn() build "
                "float32 at ['w'])")):
            m.restore_or_initialize(lambda: _state(jnp.int32))
        assert sorted(os.listdir(tmp_path)) == ["1", "jreplicate.lock"]  # left in place
        step, state = m.restore_or_initialize(_state)  # the matching state restores
        assert step == 1 and state["w"].dtype == jnp.float32


def test_renamed_key_is_an_error_naming_both_paths(tmp_path, rep):
    _saved(tmp_path, rep)
    with CheckpointManager(tmp_path, rep) as m, pytest.raises(CheckpointError) as e:
        m.restore_or_initialize(lambda: _state(key="weights"))
    msg = str(e.value)
    assert "does not match init_fn()'s state" in msg
    assert "only in init_fn()'s state (1): ['weights'] float32[3, 4]" in msg
    assert "only in the checkpoint (1): ['w'] float32[3, 4]" in msg
    assert "the same arrays in the same order, under other paths" in msg
    assert "truth value" not in msg


def test_extra_leaf_and_other_container_are_errors(tmp_path, rep):
    _saved(tmp_path, rep)
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(CheckpointError, match=re.escape(
                "init_fn()'s state has ['extra'] float32[1], which the checkpoint lacks")):
            m.restore_or_initialize(lambda: {**_state(), "extra": jnp.zeros(1)})
        with pytest.raises(CheckpointError, match=re.escape(
                "only in init_fn()'s state (1): ['opt']['m'] float32[2]")):
            m.restore_or_initialize(lambda: {**_state(), "opt": {"m": jnp.zeros(2)}})


# -- item 6: one directory, one manager ---------------------------------------------------
def test_second_manager_on_a_directory_fails_until_the_first_closes(tmp_path, rep):
    first = CheckpointManager(tmp_path, rep)
    with pytest.raises(CheckpointError, match=re.escape(
            f"the checkpoint directory {tmp_path} is in use by another CheckpointManager, "
            "not closed, of the chief's process")):
        CheckpointManager(tmp_path, rep)
    first.close()
    first.close()  # idempotent
    assert not (tmp_path / "jreplicate.lock").exists()
    second = CheckpointManager(tmp_path, rep)
    del second  # dropped without close(): the lock goes with it
    CheckpointManager(tmp_path, rep).close()


_HOLDER = """
import sys, time
from jreplicate.checkpoint import CheckpointManager
from jreplicate.strategies.mirrored import MirroredStrategy
m = CheckpointManager(sys.argv[1], MirroredStrategy())
print("HOLDING", flush=True)
time.sleep(120)
"""


def test_lock_of_another_job_then_recovery_after_it_crashed(tmp_path, rep):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tmp_path)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        line = ""
        deadline = time.monotonic() + 90
        while "HOLDING" not in line and time.monotonic() < deadline and p.poll() is None:
            line = p.stdout.readline()
        assert "HOLDING" in line, p.stderr.read() if p.poll() is not None else "no answer"
        with pytest.raises(CheckpointError) as e:
            CheckpointManager(tmp_path, rep)
        msg = str(e.value)
        assert f"is in use by another job: process {p.pid} on host {socket.gethostname()}" \
            in msg
        assert f"delete {tmp_path / 'jreplicate.lock'}" in msg
        os.killpg(p.pid, signal.SIGKILL)  # the other job crashes, leaving its lock file
        p.wait(timeout=10)
        assert (tmp_path / "jreplicate.lock").exists()
        with CheckpointManager(tmp_path, rep):  # a stale lock is taken over
            info = json.loads((tmp_path / "jreplicate.lock").read_text())
            assert info["pid"] == os.getpid()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=10)


def test_without_flock_a_dead_holders_lock_is_stale(tmp_path, rep, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(dirlock.fcntl, "flock", no_flock)
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=10)
    lock = tmp_path / "jreplicate.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(),
                                "started": 0, "command": "train.py"}))
    CheckpointManager(tmp_path, rep).close()  # the dead holder's lock: taken over
    lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(),
                                "started": 0, "command": "train.py"}))
    with pytest.raises(CheckpointError, match=f"in use by another job: process "
                                              f"{os.getppid()} on host"):
        CheckpointManager(tmp_path, rep)
    lock.write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": 0}))
    with pytest.raises(CheckpointError, match="process 1 on host elsewhere"):
        CheckpointManager(tmp_path, rep)  # another host's: cannot be checked, so held


# -- item 12: damaged checkpoints, bad paths ----------------------------------------------
def _damage(path, step):
    shutil.rmtree(path / str(step) / "default" / "d")  # committed, but the data is gone


def test_damaged_newest_checkpoint_falls_back_quietly(tmp_path, rep, caplog, capfd):
    _saved(tmp_path, rep, steps=(1, 2, 3))
    _damage(tmp_path, 3)
    with caplog.at_level(logging.WARNING, "jreplicate"), CheckpointManager(tmp_path, rep) as m:
        step, state = m.restore_or_initialize(_state)
        assert step == 2 and state["b"].tolist() == [2.0] * 4
        assert m.save(3, state)  # the damaged step can be written again
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and f"checkpoint {tmp_path / '3'} is damaged" in warned[0]
    assert len(warned[0]) < 600  # one line, not Orbax's TensorStore specs
    assert any(p.name.startswith("3.damaged-") for p in tmp_path.iterdir())
    time.sleep(0.5)  # TensorStore's late callbacks into the closed event loop
    out, err = capfd.readouterr()
    for noise in ("Traceback", "Event loop is closed", "tensorstore_spec", "never retrieved"):
        assert noise not in out + err, (out + err)[-3000:]


def test_every_checkpoint_damaged_is_an_error_that_moves_nothing(tmp_path, rep):
    _saved(tmp_path, rep, steps=(1, 2))
    _damage(tmp_path, 1)
    _damage(tmp_path, 2)
    with CheckpointManager(tmp_path, rep) as m:
        with pytest.raises(CheckpointError, match=re.escape(
                f"every checkpoint in {tmp_path} is damaged (2: ")) as e:
            m.restore_or_initialize(_state)  # never step 0 silently
        assert f"move the step directories out of {tmp_path} to start from init_fn() " \
               "at step 0" in str(e.value)
        assert sorted(os.listdir(tmp_path)) == ["1", "2", "jreplicate.lock"]
    for s in ("1", "2"):  # the user's decision: start again
        os.rename(tmp_path / s, tmp_path.parent / f"aside-{s}")
    with CheckpointManager(tmp_path, rep) as m:
        step, state = m.restore_or_initialize(_state)
    assert step == 0 and state["b"].tolist() == [0.0] * 4


def test_path_problems_name_the_path(tmp_path, rep, monkeypatch):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(CheckpointError, match=re.escape(
            f"cannot use {a_file} as the checkpoint directory: {a_file} is a file, not a "
            "directory")):
        CheckpointManager(a_file, rep)
    with pytest.raises(CheckpointError, match=re.escape(
            f"{a_file} is a file, where a directory is needed")):
        CheckpointManager(a_file / "ckpt", rep)

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(os, "makedirs", denied)  # root ignores file modes: simulate
    with pytest.raises(CheckpointError, match=re.escape(
            f"cannot use {tmp_path / 'new'} as the checkpoint directory: no permission to "
            f"write {tmp_path / 'new'}")):
        CheckpointManager(tmp_path / "new", rep)


# -- items 6, 11 and 12 across processes ---------------------------------------------------
def test_chief_only_faults_raise_the_same_error_on_every_process_at_once(tmp_path):
    (tmp_path / "not_a_dir").write_text("x")
    r = _launch(["--nproc", "2", "--devices-per-proc", "2",
                 str(SCRIPTS / "checkpoint_faults.py"), "--dir", str(tmp_path)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = {}
    for rank, name, kind, secs, msg in re.findall(
            r"\[p(\d)\] RESULT (\w+) (\w+) ([\d.]+) ?(.*)", r.stdout):
        results.setdefault(name, {})[int(rank)] = (kind, float(secs), msg)
    assert set(results) == {"in_the_way", "parent_is_a_file", "second_manager",
                            "after_close", "other_dtype", "damaged_newest", "empty_nodes",
                            "all_damaged", "init_differs"}, r.stdout[-3000:]
    for name, by_rank in results.items():
        assert set(by_rank) == {0, 1}, name
        (kind0, _, msg0), (kind1, _, msg1) = by_rank[0], by_rank[1]
        assert (kind0, msg0) == (kind1, msg1), (name, by_rank)  # the same everywhere
        assert max(t for _, t, _ in by_rank.values()) < 10, (name, by_rank)  # not 30 s
    assert results["in_the_way"][1][0] == "CheckpointError"
    assert f"{tmp_path / 'not_a_dir'} is a file" in results["in_the_way"][1][2]
    assert results["parent_is_a_file"][1][0] == "CheckpointError"
    assert results["second_manager"][1][0] == "CheckpointError"
    assert "is in use by another CheckpointManager" in results["second_manager"][1][2]
    assert results["after_close"][1][0] == "ok"
    assert results["other_dtype"][1][0] == "CheckpointError"
    assert "['w'] is float32[3, 4] in the checkpoint but init_fn() gives int32[3, 4]" \
        in results["other_dtype"][1][2]
    kind, _, msg = results["damaged_newest"][1]
    assert (kind, msg) == ("ok", "step=1 w=1.0")  # step 2's data was lost: step 1 restored
    assert results["empty_nodes"][1][::2] == ("ok", "step=1 w=1.0")
    kind, _, msg = results["all_damaged"][1]
    assert kind == "CheckpointError" and "every checkpoint in" in msg, msg
    kind, _, msg = results["init_differs"][1]
    assert kind == "CheckpointError" and "another state on process 1 than on process 0" in msg
    names = sorted(p.name for p in (tmp_path / "damaged").iterdir())
    assert names[0] == "1" and names[1].startswith("2.damaged-"), names
