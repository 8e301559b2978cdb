"""MultiWorkerStrategy pieces that need no second process: cluster discovery, the
single-process strategy, chief checkpoints and the launcher (with JAX-free children).

Real multi-process runs are in tests/test_multi_worker_processes.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jreplicate.checkpoint import COMMIT_MARKER, CheckpointError, CheckpointManager
from jreplicate.cluster import launch, runtime, watchdog
from jreplicate.cluster import spec as cluster_spec
from jreplicate.cluster.discovery import from_tf_config, resolve_cluster
from jreplicate.cluster.spec import ClusterSpec, Timeouts
from jreplicate.input.context import InputReplicationMode
from jreplicate.replicator import Replicator
from jreplicate.strategies.mirrored import MirroredStrategy
from jreplicate.strategies.multi_worker import MultiWorkerStrategy
from tests._models import init_mlp

PLAIN = str(Path(__file__).parent / "mp_scripts" / "plain.py")
ENV_VARS = [cluster_spec.ENV_COORDINATOR, cluster_spec.ENV_NUM_PROCESSES,
            cluster_spec.ENV_PROCESS_ID, cluster_spec.ENV_LOCAL_DEVICE_IDS,
            cluster_spec.TF_CONFIG, *cluster_spec.ENV_TIMEOUTS.values(),
            watchdog.ENV_FAIL_FAST]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for k in ENV_VARS:
        monkeypatch.delenv(k, raising=False)


# -- cluster discovery ------------------------------------------------------------------
def test_tf_config_workers():
    cfg = {"cluster": {"worker": ["h0:1234", "h1:1234", "h2:1234"]},
           "task": {"type": "worker", "index": 2}}
    assert from_tf_config(json.dumps(cfg)) == ClusterSpec("h0:1234", 3, 2, None, "TF_CONFIG")


def test_tf_config_chief_is_process_zero():
    cfg = {"cluster": {"chief": ["c:1"], "worker": ["w0:2", "w1:3"]},
           "task": {"type": "worker", "index": 0}}
    spec = from_tf_config(cfg)
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("c:1", 3, 1)
    cfg["task"] = {"type": "chief", "index": 0}
    assert from_tf_config(cfg).process_id == 0


@pytest.mark.parametrize("text, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"cluster": {"worker": ["h:1"]}}), "'cluster' and 'task'"),
    (json.dumps({"cluster": {}, "task": {"type": "worker", "index": 0}}), "no 'worker'"),
    (json.dumps({"cluster": {"worker": ["h:1"], "ps": ["p:2"]},
                 "task": {"type": "ps", "index": 0}}), "ParameterServerStrategy"),
    (json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 1}}),
     r"task\['index'\] is 1; it must be an int in \[0, 1\)"),
    (json.dumps({"cluster": {"worker": ["nohostport"]}, "task": {"type": "worker"}}),
     r"cluster\['worker'\]\[0\] is 'nohostport'"),
    (json.dumps({"cluster": {"chief": ["a:1", "b:2"]}, "task": {"type": "chief"}}),
     "at most one chief"),
])
def test_tf_config_errors(text, match):
    with pytest.raises(ValueError, match=match):
        from_tf_config(text)


def test_resolve_order_arguments_env_tf_config(monkeypatch):
    assert resolve_cluster().source == "auto-detect"
    monkeypatch.setenv("TF_CONFIG", json.dumps(
        {"cluster": {"worker": ["t0:9", "t1:9"]}, "task": {"type": "worker", "index": 1}}))
    assert resolve_cluster() == ClusterSpec("t0:9", 2, 1, None, "TF_CONFIG")
    monkeypatch.setenv(cluster_spec.ENV_COORDINATOR, "127.0.0.1:5000")
    monkeypatch.setenv(cluster_spec.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(cluster_spec.ENV_PROCESS_ID, "3")
    assert resolve_cluster() == ClusterSpec("127.0.0.1:5000", 4, 3, None,
                                            "JREPLICATE_* environment")
    assert resolve_cluster("h:1", 2, 0, [0, 1]) == ClusterSpec("h:1", 2, 0, (0, 1), "arguments")
    assert resolve_cluster(num_processes=1).source == "single process"


@pytest.mark.parametrize("kwargs, match", [
    (dict(coordinator_address="h:1", num_processes=2), "but not process_id"),
    (dict(coordinator_address="h:1", num_processes=2, process_id=2),
     r"process_id=...\) is 2; it must be an int in \[0, 2\)"),
    (dict(coordinator_address="h", num_processes=2, process_id=0), "'host:port'"),
    (dict(coordinator_address="h:99999", num_processes=2, process_id=0), "port in 1..65535"),
    (dict(num_processes=0), r"num_processes=...\) is 0"),
    (dict(local_device_ids=[]), "non-empty list"),
])
def test_resolve_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        resolve_cluster(**kwargs)


def test_resolve_partial_environment(monkeypatch):
    monkeypatch.setenv(cluster_spec.ENV_COORDINATOR, "127.0.0.1:5000")
    with pytest.raises(ValueError, match="but not JREPLICATE_NUM_PROCESSES, JREPLICATE_PROCESS"):
        resolve_cluster()


def test_timeouts_from_arguments_environment_defaults(monkeypatch):
    assert Timeouts.resolve() == Timeouts(300, 100, 300, 600)
    monkeypatch.setenv("JREPLICATE_HEARTBEAT_TIMEOUT", "7")
    t = Timeouts.resolve(collective_timeout=9)
    assert (t.heartbeat_timeout, t.collective_timeout, t.shutdown_timeout) == (7, 9, 300)
    with pytest.raises(ValueError, match=r"collective_timeout=...\) is -1"):
        Timeouts.resolve(collective_timeout=-1)
    monkeypatch.setenv("JREPLICATE_HEARTBEAT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JREPLICATE_HEARTBEAT_TIMEOUT='soon' is not a number"):
        Timeouts.resolve()


def test_initialize_gets_what_is_left_of_the_initialization_timeout(monkeypatch):
    """Waiting for the coordinator uses up part of initialization_timeout, not a second one."""
    seen = {}
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setattr(runtime._jax_compat, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(runtime, "_reachable", lambda address, deadline: time.sleep(2) is None)
    runtime.connect(ClusterSpec("127.0.0.1:1", 2, 1), Timeouts(initialization_timeout=5))
    assert seen["initialization_timeout"] == 3


# -- the strategy in one process --------------------------------------------------------
def test_single_process_strategy():
    s = MultiWorkerStrategy()  # no cluster anywhere: one process
    assert s.cluster.source == "single process"
    assert (s.num_replicas, s.num_workers, s.worker_index, s.is_chief) == (8, 1, 0, True)
    assert s.devices_per_worker == 8
    assert s.local_replica_ids == tuple(range(8))
    assert repr(s) == "MultiWorkerStrategy(num_replicas=8, num_workers=1, worker_index=0)"
    assert MultiWorkerStrategy(num_processes=1, heartbeat_timeout=5).timeouts.heartbeat_timeout \
        == 5


# -- fail fast: opt-in, as TensorFlow's preemption handler ------------------------------
@pytest.fixture
def excepthook(monkeypatch):
    """Restores sys.excepthook after the test; returns the one before it."""
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    return sys.excepthook


def test_strategy_installs_no_excepthook_unless_asked(monkeypatch, excepthook):
    # As a worker of two processes (the hook was installed for num_processes > 1).
    monkeypatch.setattr(MultiWorkerStrategy, "num_processes", property(lambda self: 2))
    MultiWorkerStrategy()
    assert sys.excepthook is excepthook  # a library leaves process-wide state alone
    monkeypatch.setenv(watchdog.ENV_FAIL_FAST, "1")  # as the launcher's processes
    MultiWorkerStrategy(fail_fast=False)
    assert sys.excepthook is excepthook
    MultiWorkerStrategy()
    assert getattr(sys.excepthook, "_jreplicate", False)
    hook = sys.excepthook
    MultiWorkerStrategy(fail_fast=True)  # installed once
    assert sys.excepthook is hook


def test_fail_fast_true_installs_the_hook_in_one_process(excepthook):
    s = MultiWorkerStrategy(fail_fast=True)
    assert s.num_workers == 1 and getattr(sys.excepthook, "_jreplicate", False)


def test_fail_fast_argument_and_environment_are_checked(monkeypatch, excepthook):
    with pytest.raises(TypeError, match=r"MultiWorkerStrategy\(fail_fast=...\) is 1; it must "
                                        "be True, False or None"):
        MultiWorkerStrategy(fail_fast=1)
    monkeypatch.setenv(watchdog.ENV_FAIL_FAST, "maybe")
    with pytest.raises(ValueError, match="JREPLICATE_FAIL_FAST='maybe' is neither 1 nor 0"):
        MultiWorkerStrategy()
    for value, want in [("0", False), ("", False), ("1", True), ("true", True)]:
        monkeypatch.setenv(watchdog.ENV_FAIL_FAST, value)
        assert watchdog.fail_fast_requested(None) is want
    assert sys.excepthook is excepthook


def test_fail_fast_hook_prints_then_exits_explained(monkeypatch, capsys, excepthook):
    printed, exits = [], []
    monkeypatch.setattr(sys, "excepthook", lambda *a: printed.append(a[0]))
    monkeypatch.setattr(watchdog, "_exit_now", exits.append)
    watchdog.install_fail_fast(1, 2, Timeouts(heartbeat_timeout=4, collective_timeout=8))
    cases = [(RuntimeError("gloo: Connection closed by peer"), 1, True),
             (cluster_spec.ClusterError("did not arrive"), 1, True),
             (ValueError("bad batch"), 1, False), (KeyboardInterrupt(), 130, False)]
    for error, status, explained in cases:
        sys.excepthook(type(error), error, None)
        err = capsys.readouterr().err
        assert printed[-1] is type(error) and exits[-1] == status  # the traceback first
        assert ("jreplicate: process 1 of 2 stopped because a collective across processes "
                "failed" in err) is explained, err
        if explained:
            assert "heartbeat_timeout=4s" in err and "collective_timeout=8s" in err
    assert len(exits) == len(printed) == len(cases)


def test_joining_a_cluster_after_the_backend_started_is_an_error():
    jax.devices()  # the backend is up in this process
    with pytest.raises(RuntimeError, match="before anything starts the JAX backend"):
        MultiWorkerStrategy("127.0.0.1:1234", 2, 1)


@pytest.mark.parametrize("mode", list(InputReplicationMode))
def test_single_process_input_modes(mode):
    rep = Replicator(MultiWorkerStrategy(num_processes=1))

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(16)
        n = 2 * (8 if mode is not InputReplicationMode.PER_REPLICA else 1)
        return (np.full((b,), 100 * ctx.input_pipeline_id + i, np.float32) for i in range(n))

    it = rep.prepare_input(input_fn, replication_mode=mode)
    firsts = [[float(v[0]) for v in rep.run(lambda ctx, b: b, batch)] for batch in it]
    if mode is InputReplicationMode.PER_REPLICA:
        assert firsts == [[100.0 * r for r in range(8)], [100.0 * r + 1 for r in range(8)]]
    else:
        assert firsts == [list(range(8)), list(range(8, 16))]


# -- checkpoints ------------------------------------------------------------------------
def _init():
    params = init_mlp(jax.random.key(0))
    return {"params": params, "opt": optax.adam(1e-2).init(params), "step": jnp.int32(0)}


def _equal(a, b):
    return jax.tree.all(jax.tree.map(
        lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))


def test_restore_or_initialize_then_save_and_restore(tmp_path):
    rep = Replicator(MirroredStrategy())
    mngr = CheckpointManager(tmp_path, rep, max_to_keep=2)
    assert mngr.is_chief and mngr.latest_step() is None
    step, state = mngr.restore_or_initialize(_init)
    assert step == 0 and _equal(state, _init())
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8
               for x in jax.tree.leaves(state))
    new = jax.tree.map(lambda x: x + 1, state)
    for s in (1, 2, 3):
        assert mngr.save(s, new)
    mngr.close()
    assert mngr.complete_steps() == [2, 3]  # max_to_keep=2
    again = CheckpointManager(tmp_path, rep)
    step, restored = again.restore_or_initialize(_init)
    assert step == 3 and _equal(restored, new)
    assert type(restored["opt"][0]) is type(new["opt"][0])  # optax's named tuples survive
    with pytest.raises(CheckpointError, match="checkpoint 3 already exists"):
        again.save(3, restored)


def test_half_written_checkpoints_are_never_restored(tmp_path):
    rep = Replicator(MirroredStrategy())
    with CheckpointManager(tmp_path, rep) as mngr:
        _, state = mngr.restore_or_initialize(_init)
        mngr.save(5, state)
    (tmp_path / "9.orbax-checkpoint-tmp-1700000000").mkdir()  # interrupted save
    (tmp_path / "8").mkdir()  # a step directory without its commit marker
    (tmp_path / "8" / "_CHECKPOINT_METADATA").write_text("{}")
    with CheckpointManager(tmp_path, rep) as mngr:
        assert mngr.complete_steps() == [5] and mngr.latest_step() == 5
        step, _ = mngr.restore_or_initialize(_init)
        assert step == 5
        mngr.save(6, state)  # the chief sets the incomplete step aside before writing
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "8" not in names and any(n.startswith("8.incomplete-") for n in names)
    assert (tmp_path / "6" / COMMIT_MARKER).is_file()


def test_interrupted_save_debris_does_not_defeat_max_to_keep(tmp_path):
    rep = Replicator(MirroredStrategy())
    (tmp_path / "2.orbax-checkpoint-tmp-1700000000" / "default").mkdir(parents=True)
    with CheckpointManager(tmp_path, rep, max_to_keep=2) as mngr:
        _, state = mngr.restore_or_initialize(_init)
        for s in (2, 3, 4):  # the chief restarted before step 2 and saves it again
            mngr.save(s, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["3", "4"]


def test_checkpoint_of_other_shapes_is_an_error_not_restored(tmp_path):
    # Other processes would wait for init_fn()'s shapes in the broadcast: all must raise.
    rep = Replicator(MirroredStrategy())
    CheckpointManager(tmp_path, rep).save(1, {"w": jnp.arange(3.0)})
    with pytest.raises(CheckpointError, match=r"checkpoint 1 .* \['w'\] is float32\[3\] in the "
                                              r"checkpoint but init_fn\(\) gives float32\[4\]"):
        CheckpointManager(tmp_path, rep).restore_or_initialize(lambda: {"w": jnp.zeros(4)})
    step, state = CheckpointManager(tmp_path, rep).restore_or_initialize(
        lambda: {"w": jnp.zeros(3)})
    assert step == 1 and state["w"].tolist() == [0.0, 1.0, 2.0]


def test_prng_key_arrays_get_an_error_that_names_the_fix(tmp_path):
    rep = Replicator(MirroredStrategy())
    mngr = CheckpointManager(tmp_path, rep)
    with_key = {"w": jnp.zeros(2), "key": jax.random.key(0)}
    with pytest.raises(TypeError, match=r"\['key'\] is a PRNG key array .*key_data"):
        mngr.save(1, with_key)
    mngr.save(1, {"w": jnp.zeros(2), "key": jax.random.key_data(jax.random.key(0))})
    with pytest.raises(TypeError, match=r"init_fn\(\) returned: \['key'\] is a PRNG key"):
        mngr.restore_or_initialize(lambda: with_key)


def test_save_interval_and_errors(tmp_path):
    rep = Replicator(MirroredStrategy())
    mngr = CheckpointManager(tmp_path, rep, save_interval_steps=5)
    _, state = mngr.restore_or_initialize(_init)
    assert not mngr.save(3, state)
    assert mngr.save(3, state, force=True) and mngr.save(5, state)
    with pytest.raises(ValueError, match=r"save\(step=-1\): step must be an int >= 0"):
        mngr.save(-1, state)
    per_replica = rep.run(lambda ctx: ctx.replica_id)
    with pytest.raises(ValueError, match=r"\['ids'\] is a PerReplica value"):
        mngr.save(10, {"ids": per_replica})
    with pytest.raises(TypeError, match=r"\['name'\] is a str, not an array"):
        mngr.save(10, {"name": "x"})
    mngr.close()  # one manager per directory
    with pytest.raises(CheckpointError, match=r"checkpoint 5 .* does not match init_fn"):
        CheckpointManager(tmp_path, rep).restore_or_initialize(lambda: {"w": jnp.ones(3)})
    with pytest.raises(TypeError, match="must be a jreplicate Strategy or Replicator"):
        CheckpointManager(tmp_path, object())
    with pytest.raises(ValueError, match="max_to_keep=0"):
        CheckpointManager(tmp_path, rep, max_to_keep=0)
    with pytest.raises(ValueError, match="save_interval_steps=0"):
        CheckpointManager(tmp_path, rep, save_interval_steps=0)
    with pytest.raises(TypeError, match="parameter-less function"):
        mngr.restore_or_initialize(None)


# -- the launcher (JAX-free children) ---------------------------------------------------
def _launch(monkeypatch, capsys, *argv):
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep pytest's handlers
    t0 = time.monotonic()
    code = launch.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err, time.monotonic() - t0


def test_launch_prefixes_output_and_sets_environment(monkeypatch, capsys):
    code, out, err, _ = _launch(monkeypatch, capsys, "--nproc", "3", "--devices-per-proc", "2",
                                PLAIN, "ok", "--flag", "-m", "x")
    assert code == 0, err
    lines = sorted(ln for ln in out.splitlines() if "hello" in ln)
    assert [ln[:4] for ln in lines] == ["[p0]", "[p1]", "[p2]"]
    coords = {ln.split("coord=")[1].split()[0] for ln in lines}
    assert len(coords) == 1 and coords.pop().startswith("127.0.0.1:")
    assert "n=3" in lines[0] and "restart=0" in lines[0]
    assert "--xla_force_host_platform_device_count=2" in lines[0]
    assert "args=['--flag', '-m', 'x']" in lines[0]
    assert "[p2] note from rank=2" in err


def test_launch_propagates_first_failure(monkeypatch, capsys):
    code, out, err, elapsed = _launch(monkeypatch, capsys, "--nproc", "3", "--grace", "1",
                                      PLAIN, "exit3")
    assert code == 3
    assert ("jreplicate.cluster.launch: process 1 of 3 failed first: exit code 3; its last stderr "
            "line: ValueError: bad shard; stopped the other processes") in err
    assert elapsed < 30  # the others (sleeping 60 s) were stopped


def test_launch_reports_signals(monkeypatch, capsys):
    code, _, err, _ = _launch(monkeypatch, capsys, "--nproc", "2", "--grace", "1", PLAIN,
                              "kill")
    assert code == 128 + 9
    assert "process 1 of 2 failed first: killed by signal 9 (SIGKILL)" in err


def test_launch_restarts(monkeypatch, capsys):
    code, out, err, _ = _launch(monkeypatch, capsys, "--nproc", "2", "--max-restarts", "2",
                                PLAIN, "flaky")
    assert code == 0, err
    assert "restarting all 2 processes (restart 2 of 2)" in err
    assert "succeeded after 2 restart(s)" in err
    assert out.count("restart=2") == 2
    code, _, err, _ = _launch(monkeypatch, capsys, "--nproc", "2", "--max-restarts", "1",
                              PLAIN, "flaky")
    assert code == 7 and "giving up after 1 restart(s)" in err


def test_launch_timeout_and_module(monkeypatch, capsys):
    code, _, err, elapsed = _launch(monkeypatch, capsys, "--nproc", "2", "--timeout", "1",
                                    "--grace", "1", PLAIN, "sleep")
    assert code == 124 and "--timeout 1s expired with processes [0, 1] still running" in err
    assert elapsed < 20
    code, out, err, _ = _launch(monkeypatch, capsys, "--nproc", "1", "-m",
                                "tests.mp_scripts.plain", "ok", "a")
    assert code == 0, err
    assert "[p0] hello rank=0 n=1" in out and "args=['a']" in out


def test_launch_double_dash_ends_the_launcher_options(monkeypatch, capsys):
    code, out, err, _ = _launch(monkeypatch, capsys, "--nproc", "1", "--", PLAIN, "ok", "z")
    assert code == 0, err
    assert "[p0] hello rank=0 n=1" in out and "args=['z']" in out


@pytest.mark.parametrize("argv, match", [
    (["--nproc", "0", PLAIN], "--nproc 0"),
    (["--nproc", "2", "--devices-per-proc", "0", PLAIN], "--devices-per-proc 0"),
    (["--nproc", "2", "missing.py"], "does not exist"),
    (["--nproc", "2", "-m"], "-m needs a module name"),
])
def test_launch_argument_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(argv)
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_child_env():
    env = launch.child_env({"XLA_FLAGS": "--a=1 --xla_force_host_platform_device_count=8"},
                           coordinator="127.0.0.1:9", nproc=2, rank=1, devices_per_proc=4,
                           restart=3)
    assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=4"
    assert (env["JREPLICATE_PROCESS_ID"], env["JREPLICATE_NUM_PROCESSES"]) == ("1", "2")
    assert env["JREPLICATE_RESTART_COUNT"] == "3" and env["PJRT_NPROC"] == "10"
    assert env[watchdog.ENV_FAIL_FAST] == "1"  # the launcher's processes fail fast
    one = launch.child_env({}, coordinator="127.0.0.1:9", nproc=1, rank=0,
                           devices_per_proc=None, restart=0)
    assert watchdog.ENV_FAIL_FAST not in one  # one process has no peers to hold up
    kept = launch.child_env({watchdog.ENV_FAIL_FAST: "0"}, coordinator="127.0.0.1:9",
                            nproc=2, rank=0, devices_per_proc=None, restart=0)
    assert kept[watchdog.ENV_FAIL_FAST] == "0"  # the user's word is final
    assert launch.describe_status(-signal.SIGTERM) == "killed by signal 15 (SIGTERM)"
    assert "could not join the cluster" in launch.describe_status(watchdog.EXIT_INIT_TIMEOUT)
    assert os.path.exists(PLAIN) and sys.executable
