"""Checkpoints of state sharded across processes, written by every process.

Two processes x 4 devices (``tests/mp_scripts/ckpt_sharded.py``, one launch) build a
32 MiB leaf sharded over both processes' devices, never whole on any host, and save it:
every process writes its own shards (the peak resident memory grows by less than a
copy of the whole leaf during the save). Then this process (one, 8 devices) restores it
onto 8 and 4 devices, bit for bit equal to the reference; a step with a process's
files deleted is moved aside when the older one restores. Where each process has its
own directory (not shared), sharded state is refused alike on both processes, naming
the directory and the fix, and replicated state is still written by the chief.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate.checkpoint import CheckpointError, CheckpointManager
from tests.mp_scripts.ckpt_sharded import BIG, reference
from tests.test_multi_worker_processes import SCRIPTS, _launch

MIB = 1 << 20


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    d = tmp_path_factory.mktemp("every_process")
    r = _launch(["--nproc", "2", "--devices-per-proc", "4", str(SCRIPTS / "ckpt_sharded.py"),
                 "--dir", str(d)], timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in r.stdout.splitlines()
               if "RESULT " in line]
    assert sorted(x["process"] for x in results) == [0, 1], r.stdout[-3000:]
    return d, sorted(results, key=lambda x: x["process"]), r


def _abstract():
    return {"big": jax.ShapeDtypeStruct(BIG, np.float32),
            "small": jax.ShapeDtypeStruct((16, 3), np.int32),
            "rep": jax.ShapeDtypeStruct((4, 5), np.float32),
            "host": jax.ShapeDtypeStruct((7,), np.int16)}


def _bits(x) -> bytes:
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8).tobytes()


def _check(state, step: int) -> None:
    for name, leaf in state.items():
        want = reference(step, name)
        assert leaf.dtype == want.dtype and leaf.shape == want.shape, name
        assert _bits(leaf) == _bits(want), name


def test_every_process_writes_its_own_shards_and_never_holds_the_whole(launched):
    _, results, _ = launched
    for x in results:
        assert x["every_process_writes"] is True
        assert x["fully_addressable"] == [False, False]
        assert x["own_bytes"] == 16 * MIB
        # A host copy of the whole leaf would add 32 MiB; the process's own shards,
        # 16 MiB, may be copied while they are written.
        assert x["hwm_increase_2"] < x["own_bytes"] + 8 * MIB, x
    for x in results:  # initialised (nothing saved): sharded state stays as init_fn placed it
        assert x["fresh"] == [0, True, True, True], x
    for x in results:  # both processes read their own shards back
        assert x["restored_step"] == 2 and x["restored_equal"] is True, x
        assert x["restored_specs"] == ["P('replica',)", "P()"], x
    step_dir = launched[0] / "shared" / "2" / "default"
    assert sorted(p.name for p in step_dir.glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]


@pytest.mark.parametrize("devices", [8, 4])
def test_restored_on_one_process_bit_for_bit(launched, tmp_path, devices):
    d, _, _ = launched
    path = tmp_path / "ckpt"
    shutil.copytree(d / "shared", path)
    strategy = jr.MirroredStrategy(devices=jax.devices()[:devices])
    rows = NamedSharding(strategy.mesh, P("replica"))
    with CheckpointManager(path, strategy) as m:
        step, state = m.restore_or_initialize(_abstract, shardings={
            "big": rows, "small": rows, "rep": None, "host": None})
    assert step == 2
    _check(state, 2)
    assert state["big"].sharding == rows
    assert state["big"].addressable_shards[0].data.shape == (BIG[0] // devices, BIG[1])
    assert state["rep"].sharding.is_fully_replicated


def test_a_process_directory_deleted_moves_the_step_aside(launched, tmp_path):
    d, _, _ = launched
    path = tmp_path / "ckpt"
    shutil.copytree(d / "shared", path)
    shutil.rmtree(path / "2" / "default" / "ocdbt.process_1")
    with CheckpointManager(path, jr.MirroredStrategy()) as m:
        step, state = m.restore_or_initialize(_abstract)
    assert step == 1
    _check(state, 1)
    names = sorted(os.listdir(path))
    assert names[0] == "1" and names[1].startswith("2.damaged-"), names


def test_a_directory_not_shared_refuses_sharded_state_alike_everywhere(launched):
    d, results, _ = launched
    # The same error on both processes (each was given its own path, named in it).
    messages = {re.sub(r"own\d", "own<p>", x["own_sharded"]) for x in results}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert not results[0]["own_every_process_writes"]
    assert re.search(r"process 1 cannot see .*own<p>/jreplicate.lock written by process 0",
                     message), message
    assert "['big'], P('replica',)) is written by every process into one directory; " \
           "give a directory every process can write (NFS, GCS), or save replicated " \
           "state" in message, message
    assert all(x["own_replicated"] is True for x in results)
    assert results[0]["own_steps"] == [1] and results[1]["own_steps"] == []
    assert all(x["own_restored"] == [1, True, True] for x in results), results
    with CheckpointManager(d / "own0", jr.MirroredStrategy()) as m:
        step, state = m.restore_or_initialize(
            lambda: {k: v for k, v in _abstract().items() if k in ("rep", "host")})
    assert step == 1
    _check(state, 1)


def test_the_restore_refuses_a_damaged_only_step_naming_it(launched, tmp_path):
    d, _, _ = launched
    path = tmp_path / "ckpt"
    shutil.copytree(d / "shared", path)
    shutil.rmtree(path / "1")
    shutil.rmtree(path / "2" / "default" / "ocdbt.process_0")
    with CheckpointManager(path, jr.MirroredStrategy(devices=jax.devices()[:4])) as m, \
            pytest.raises(CheckpointError, match="every checkpoint in .* is damaged"):
        m.restore_or_initialize(_abstract)
    assert sorted(os.listdir(path)) == ["2"]
