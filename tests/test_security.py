"""Nothing is exposed: a local job listens on loopback only, and no message read from
another process is unpickled (issue 15, item 1).

* A launched 2-process job (coordination service, gloo collectives, input agreements)
  has every listening TCP socket of its process tree on loopback (read from /proc).
* Where the coordinator listens: loopback for a loopback coordinator, where the user
  says otherwise; gloo's collectives get a loopback host name for local jobs.
* Agreement messages are JSON checked against a schema: a malformed one (not JSON, a
  wrong type, a missing or extra field) is an error naming the process that sent it;
  the structure description input elements carry round-trips through JSON.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jreplicate import _jax_compat, _wire
from jreplicate.cluster import launch, runtime
from jreplicate.cluster import spec as cluster_spec
from jreplicate.cluster.agreement import Agreement
from jreplicate.cluster.spec import ClusterSpec, MessageError, Timeouts
from jreplicate.context import MaskedBatch
from tests._sockets import is_loopback, listening_sockets

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mp_scripts"
Pair = collections.namedtuple("Pair", "x y")


# -- a launched job listens on loopback only -------------------------------------------
def _wait_for(path: Path, text: str, count: int, timeout: float, p: subprocess.Popen) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and p.poll() is None:
        out = path.read_text()
        if out.count(text) >= count:
            return out
        time.sleep(0.2)
    return path.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_launched_job_listens_on_loopback_only(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JREPLICATE_", "JAX_", "XLA_")) and k != "TF_CONFIG"}
    env.update(PYTHONPATH=str(ROOT), JREPLICATE_INITIALIZATION_TIMEOUT="60",
               JREPLICATE_HEARTBEAT_TIMEOUT="10", JREPLICATE_SHUTDOWN_TIMEOUT="10")
    go, log = tmp_path / "go", tmp_path / "out.txt"
    cmd = [sys.executable, "-m", "jreplicate.cluster.launch", "--timeout", "150", "--nproc", "2",
           "--devices-per-proc", "2", str(SCRIPTS / "listen.py"), str(go)]
    with open(log, "w") as out:
        p = subprocess.Popen(launch.tied_to_parent(cmd), cwd=ROOT, env=env, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text = _wait_for(log, "READY", 2, 150, p)
        assert text.count("READY") == 2, text[-3000:]
        sockets = listening_sockets(p.pid)
        go.touch()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    # Every value is right: padding built from another process's description (process 1
    # had no element), namedtuples rebuilt on process 1 (SINGLE mode).
    assert text.count("PAD count=20 sum=190 SINGLE total=72") == 2, text[-3000:]
    print("\n".join(f"{pid} {addr}:{port} {cmd[:60]}" for pid, cmd, addr, port in sockets))
    assert len({port for *_, port in sockets}) >= 2, sockets  # coordinator + gloo
    exposed = [s for s in sockets if not is_loopback(s[2])]
    assert not exposed, f"listening beyond loopback: {exposed}"


# -- where the coordinator and gloo listen ---------------------------------------------
@pytest.fixture
def no_bind_env(monkeypatch):
    for k in (cluster_spec.ENV_BIND_ADDRESS, "JAX_COORDINATOR_BIND_ADDRESS"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("coordinator, given, want", [
    ("127.0.0.1:1234", None, "127.0.0.1:1234"),
    ("127.0.0.2:99", None, "127.0.0.2:99"),
    ("localhost:1234", None, "localhost:1234"),
    ("[::1]:1234", None, "[::1]:1234"),
    ("10.0.0.1:1234", None, None),  # JAX's default: every interface
    ("node0:1234", None, None),
    ("10.0.0.1:1234", "10.0.0.1:1234", "10.0.0.1:1234"),
    ("127.0.0.1:1234", "[::]:1234", "[::]:1234"),  # the user's word is final
])
def test_bind_address(no_bind_env, coordinator, given, want):
    assert runtime.resolve_bind_address(coordinator, given) == want


def test_bind_address_environment(no_bind_env, monkeypatch):
    monkeypatch.setenv(cluster_spec.ENV_BIND_ADDRESS, "10.0.0.1:7")
    assert runtime.resolve_bind_address("10.0.0.1:7") == "10.0.0.1:7"
    monkeypatch.setenv(cluster_spec.ENV_BIND_ADDRESS, "nowhere")
    with pytest.raises(ValueError, match=cluster_spec.ENV_BIND_ADDRESS):
        runtime.resolve_bind_address("127.0.0.1:7")
    monkeypatch.delenv(cluster_spec.ENV_BIND_ADDRESS)
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "10.0.0.1:7")  # JAX reads it
    assert runtime.resolve_bind_address("127.0.0.1:7") is None
    with pytest.raises(ValueError, match=r"coordinator_bind_address=\.\.\.\) is 'x'"):
        runtime.resolve_bind_address("127.0.0.1:7", "x")


@pytest.mark.parametrize("coordinator, bind, gloo", [
    ("127.0.0.1:1", "127.0.0.1:1", "127.0.0.1"),
    ("[::1]:1", "[::1]:1", "::1"),
    ("10.0.0.1:1", None, None),
])
def test_connect_passes_bind_address_and_gloo_host(no_bind_env, monkeypatch, coordinator,
                                                   bind, gloo):
    seen, hosts = {}, []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: seen.update(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    monkeypatch.setattr(_jax_compat, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(_jax_compat, "set_gloo_hostname", hosts.append)
    spec = runtime.connect(ClusterSpec(coordinator, 2, 0), Timeouts(initialization_timeout=5))
    assert seen["coordinator_bind_address"] == bind == spec.coordinator_bind_address
    assert hosts == [gloo]


def test_gloo_collectives_get_the_host_name(monkeypatch):
    """The CPU backend, when it starts, creates gloo collectives on the given host."""
    from jax._src import distributed, xla_bridge
    made = []
    reg = xla_bridge._backend_factories["cpu"]
    monkeypatch.setitem(xla_bridge._backend_factories, "cpu", reg)
    monkeypatch.setattr(reg, "factory", lambda collectives=None: ("client", collectives))
    monkeypatch.setattr(xla_bridge._jax, "make_gloo_tcp_collectives",
                        lambda **kw: made.append(kw) or "gloo")
    monkeypatch.setattr(distributed.global_state, "client", "the-distributed-client")
    _jax_compat.set_gloo_hostname("127.0.0.1")
    assert xla_bridge._backend_factories["cpu"].factory() == ("client", "gloo")
    assert made == [{"distributed_client": "the-distributed-client", "hostname": "127.0.0.1"}]
    _jax_compat.set_gloo_hostname(None)  # JAX's own factory back
    assert xla_bridge._backend_factories["cpu"].factory() == ("client", None)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.1", "myhost"])
def test_launcher_refuses_a_host_beyond_loopback(host, capsys):
    with pytest.raises(SystemExit) as e:
        launch.main(["--nproc", "2", "--host", host, str(SCRIPTS / "plain.py"), "ok"])
    assert e.value.code == 2
    assert f"--host {host}: " in capsys.readouterr().err


def test_launcher_coordinator_on_ipv6_loopback():
    host, _, port = launch.coordinator_address("::1").rpartition(":")
    assert host == "[::1]" and 0 < int(port) < 65536


# -- agreement messages are checked JSON, never pickles ----------------------------------
class _FakeKV:
    """The coordination service's key-value store, with other processes' values."""

    def __init__(self, values: dict[str, bytes]):
        self.values = dict(values)

    def key_value_set_bytes(self, key, value):
        self.values[key] = value

    def blocking_key_value_get_bytes(self, key, timeout_ms):
        return self.values[key]

    def key_value_delete(self, key):
        self.values.pop(key, None)


REPORT = {"status": "ok", "detail": "", "error_type": "", "seen": True,
          "spec": {"structure": "PyTreeDef({'x': *})", "tree": {"dict": [["x", "*"]]},
                   "leaves": [[[4, 3], "float32"]]}}


def _with(**changes):
    out = json.loads(json.dumps(REPORT))
    for k, v in changes.items():
        out[k] = v
    return json.dumps(out).encode()


@pytest.mark.parametrize("raw, match", [
    (b"\x80\x04\x95 a pickle", "sent a malformed message"),
    (b"{not json", "sent a malformed message"),
    (b"[1, 2]", "must be an object with fields"),
    (_with(status=3), r"message.status must be one of"),
    (_with(seen="yes"), r"message.seen must be true or false"),
    (_with(spec={"structure": "s", "tree": "*", "leaves": [[[-1], "float32"]]}),
     r"leaves\[0\]\[0\]\[0\] must be an int >= 0"),
    (_with(spec={"structure": "s", "tree": "*", "leaves": [[[4], "object"]]}),
     "must be a dtype name"),
    (_with(spec={"structure": "s", "tree": {"eval": "x"}, "leaves": []}),
     "must be a structure description"),
    (_with(status="end"), "has an element spec with status 'end'"),
    (json.dumps({k: v for k, v in REPORT.items() if k != "seen"}).encode(),
     r"must have the fields \['detail', 'error_type', 'seen', 'spec', 'status'\]"),
    (json.dumps({**REPORT, "extra": 1}).encode(), "must have the fields"),
    (b"[" * 100_000, "sent a malformed message"),  # too deep for the parser
])
def test_malformed_message_names_its_sender(monkeypatch, raw, match):
    kv = _FakeKV({"p/0/0": json.dumps(REPORT).encode(), "p/0/2": raw})
    monkeypatch.setattr(_jax_compat, "distributed_client", lambda: kv)
    agreement = Agreement("p", num_processes=3, process_id=1, timeout=1)
    with pytest.raises(MessageError, match=match) as e:
        agreement.exchange(REPORT, "this step's input", _wire.input_report)
    assert "process 2 sent a malformed message while agreeing on this step's input" \
        in str(e.value)


def test_well_formed_messages_come_back_in_process_order(monkeypatch):
    other = {**REPORT, "status": "end", "spec": None, "seen": False}
    kv = _FakeKV({"p/0/0": json.dumps(other).encode()})
    monkeypatch.setattr(_jax_compat, "distributed_client", lambda: kv)
    got = Agreement("p", 2, 1, timeout=1).exchange(REPORT, "x", _wire.input_report)
    assert got == [other, REPORT]
    assert json.loads(kv.values["p/0/1"]) == REPORT  # published as JSON


def test_checked_messages_are_cached_by_their_bytes_only(monkeypatch):
    """A repeated message is not checked again; a different one always is."""
    kv = _FakeKV({"p/0/0": json.dumps(REPORT).encode(), "p/1/0": b'{"status": 1}'})
    monkeypatch.setattr(_jax_compat, "distributed_client", lambda: kv)
    agreement = Agreement("p", 2, 1, timeout=1)
    spec = REPORT["spec"]
    mine = {**REPORT, "spec": _wire.Encoded(spec)}  # spliced in as computed once
    assert json.loads(_wire.dumps(mine)) == REPORT
    assert agreement.exchange(mine, "x", _wire.input_report) == [REPORT, REPORT]
    with pytest.raises(MessageError, match="process 0 sent a malformed message"):
        agreement.exchange(mine, "x", _wire.input_report)


def test_checkpoint_chief_result_schema():
    assert _wire.CHIEF_RESULT({"value": 3, "error": None}) == {"value": 3, "error": None}
    for bad in ({"value": "3", "error": None}, {"value": True, "error": None},
                {"value": None, "error": 5}, {"value": None}):
        with pytest.raises(ValueError):
            _wire.CHIEF_RESULT(bad)


def test_no_pickle_in_the_package():
    """Nothing in jreplicate unpickles (Ray's own transport aside)."""
    found = [str(p.relative_to(ROOT)) for p in (ROOT / "jreplicate").rglob("*.py")
             if "pickle.load" in p.read_text() or "allow_pickle=True" in p.read_text()]
    assert not found, found


# -- the structure description of input elements ---------------------------------------
_leaf = st.just(0)


def _trees(leaf):
    return st.recursive(
        st.one_of(leaf, st.none()),
        lambda kids: st.one_of(
            st.lists(kids, max_size=3),
            st.lists(kids, max_size=3).map(tuple),
            st.dictionaries(st.one_of(st.text(max_size=3), st.integers(-3, 3)), kids,
                            max_size=3).filter(lambda d: len({type(k) for k in d}) <= 1),
            st.tuples(kids, kids).map(lambda t: Pair(*t)),
            st.tuples(kids, kids).map(lambda t: MaskedBatch(*t)),
            st.dictionaries(st.text(max_size=3), kids, max_size=3).map(
                collections.OrderedDict)),
        max_leaves=12)


@settings(max_examples=60, deadline=None)
@given(_trees(_leaf))
def test_structure_description_round_trips_through_json(tree):
    treedef = jax.tree.structure(tree)
    desc = json.loads(json.dumps(_wire.describe(treedef)))
    checked = _wire.structure(desc, "tree")
    assert _wire.rebuildable(checked)
    assert _wire.rebuild(checked) == treedef
    assert _wire.describe(_wire.rebuild(checked)) == checked


def test_custom_nodes_are_opaque_and_need_the_local_structure():
    treedef = jax.tree.structure({"c": jax.tree_util.Partial(np.add, np.ones(2))})
    desc = json.loads(json.dumps(_wire.describe(treedef)))
    assert not _wire.rebuildable(desc)
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        _wire.rebuild(desc)
    assert _wire.rebuild(desc, [None, treedef]) is treedef  # the local one that matches
    Local = collections.namedtuple("Local", "a")  # not reachable by name: opaque
    assert "opaque" in _wire.describe(jax.tree.structure(Local(0)))
    assert _wire.describe(jax.tree.structure(Pair(0, 0)))["namedtuple"] == f"{__name__}:Pair"
