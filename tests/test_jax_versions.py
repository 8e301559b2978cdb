"""The supported JAX range (pyproject.toml, jreplicate/_jax_compat.py's MIN_JAX): an older
jax/jaxlib is refused at import with the fix, a newer one warns; an orbax-checkpoint
whose saves jreplicate cannot commit is refused by CheckpointManager."""

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

import jreplicate as jr
from jreplicate import _jax_compat as compat

ROOT = Path(__file__).resolve().parents[1]


def test_release_reads_the_numeric_release():
    assert compat.release("0.12.0.1") == (0, 12, 0, 1)
    assert compat.release("0.11.2") == (0, 11, 2)
    assert compat.release("0.13.0.dev20260101") == (0, 13, 0)
    assert compat.release("0.11.2rc1") == (0, 11, 2)


@pytest.mark.parametrize("jax_v, jaxlib_v", [("0.11.1", "0.11.1"), ("0.10.2", "0.10.2"),
                                             ("0.11.2", "0.11.0"), ("0.9.2", "0.12.0")])
def test_an_older_jax_or_jaxlib_is_refused_naming_the_versions_and_the_fix(jax_v, jaxlib_v):
    why = compat.unsupported_jax(jax_v, jaxlib_v)
    assert why is not None and "jreplicate needs jax and jaxlib >= 0.11.2, < 0.13" in why
    old = [f"{n} {v}" for n, v in (("jax", jax_v), ("jaxlib", jaxlib_v))
           if compat.release(v) < (0, 11, 2)]
    assert all(o in why for o in old), why
    assert "pip install -U 'jax>=0.11.2,<0.13'" in why and "crash" in why


@pytest.mark.parametrize("v", ["0.11.2", "0.12.0", "0.12.0.1", "0.12.9"])
def test_the_supported_range_is_accepted(v):
    assert compat.unsupported_jax(v, v) is None


def test_the_declared_range_is_the_one_enforced():
    """pyproject.toml, .ci/compat-constraints.txt and MIN_JAX/MIN_ORBAX say the same."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    bounds = dict(re.fullmatch(r"([\w-]+)>=([\d.]+).*", d).groups() for d in deps)
    shown = ".".join(map(str, compat.MIN_JAX))
    assert bounds["jax"] == bounds["jaxlib"] == shown
    assert bounds["orbax-checkpoint"] == ".".join(map(str, compat.MIN_ORBAX))
    assert "jax>=0.11.2,<0.13" in deps
    pins = dict(line.split("==") for line in (ROOT / ".ci" / "compat-constraints.txt")
                .read_text().splitlines() if line and not line.startswith("#"))
    assert set(pins) == {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint"}
    assert all(pins[k] == bounds[k] for k in pins), (pins, bounds)


def test_importing_with_an_older_jax_is_an_import_error_naming_the_fix():
    """A fresh process whose JAX claims 0.11.1: importing jreplicate raises at once."""
    code = ("import jax, jaxlib; jax.__version__ = jaxlib.__version__ = '0.11.1'\n"
            "try:\n    import jreplicate\nexcept ImportError as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={"PYTHONPATH": str(ROOT),
                                                     "JAX_PLATFORMS": "cpu"})
    assert "REFUSED jreplicate needs jax and jaxlib >= 0.11.2" in out.stdout, out.stderr


def test_a_newer_jax_than_tested_warns(monkeypatch):
    monkeypatch.setattr(compat.jax, "__version__", "0.13.0")
    with pytest.warns(UserWarning, match=r"tested with jax >= 0\.11\.2, < 0\.13; this is jax "
                      r"0\.13\.0"):
        compat._check_versions()


def test_an_orbax_whose_saves_never_commit_is_refused(monkeypatch, tmp_path):
    real = metadata.version
    monkeypatch.setattr(metadata, "version",
                        lambda name: "0.12.2" if name == "orbax-checkpoint" else real(name))
    rep = jr.Replicator(jr.MirroredStrategy())
    with pytest.raises(ImportError, match=r"orbax-checkpoint >= 0\.12\.3, this environment "
                       r"has 0\.12\.2.*pip install -U 'orbax-checkpoint>=0\.12\.3'"):
        jr.CheckpointManager(tmp_path, rep)
    assert not any(tmp_path.iterdir())  # nothing written


def test_jaxlib_0_11_cpu_client_gets_threads_for_its_all_reduce(monkeypatch):
    """jaxlib 0.11 aborts in CPU all-reduce with 8 simulated devices on 2 cores (host
    overhead bench: 'Termination timeout for all reduce' after 40 s) unless PJRT_NPROC
    gives its client threads: set at import, before the backend starts."""
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(compat.jaxlib, "__version__", "0.11.2")
    monkeypatch.setattr(compat, "backends_are_initialized", lambda: False)
    compat._cpu_collective_threads()
    assert compat.os.environ["PJRT_NPROC"] == "18"


def test_a_started_backend_gets_the_fix_named(monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(compat.jaxlib, "__version__", "0.11.2")
    monkeypatch.setattr(compat, "backends_are_initialized", lambda: True)
    with pytest.warns(UserWarning, match="set PJRT_NPROC=18 in the environment before JAX"):
        compat._cpu_collective_threads()
    assert "PJRT_NPROC" not in compat.os.environ


def test_the_simulated_device_count_is_read_from_the_flags_and_the_config(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--a=1 --xla_force_host_platform_device_count=16")
    assert compat.simulated_cpu_devices() == 16
    monkeypatch.setenv("XLA_FLAGS", "")
    assert compat.simulated_cpu_devices() == 8  # conftest's jax_num_cpu_devices


@pytest.mark.parametrize("jaxlib_v, devices, env, want", [
    ("0.12.0", 8, {}, None),  # jaxlib 0.12 needs nothing
    ("0.11.2", 1, {}, None),  # one CPU device
    ("0.11.2", 4, {"PJRT_NPROC": "3"}, "3"),  # the user's own setting is kept
])
def test_no_threads_are_asked_for_where_none_are_needed(monkeypatch, jaxlib_v, devices, env,
                                                        want):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(compat, "simulated_cpu_devices", lambda: devices)
    monkeypatch.setattr(compat.jaxlib, "__version__", jaxlib_v)
    monkeypatch.setattr(compat, "backends_are_initialized", lambda: False)
    compat._cpu_collective_threads()
    assert compat.os.environ.get("PJRT_NPROC") == want
