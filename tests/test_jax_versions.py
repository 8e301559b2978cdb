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
