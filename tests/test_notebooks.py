"""The notebooks in colab/ execute top to bottom (their cells assert results)."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is not installed")
NotebookClient = pytest.importorskip("nbclient", reason="nbclient is not installed").NotebookClient

COLAB = pathlib.Path(__file__).parent.parent / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
QUICKSTART = COLAB / "quickstart.ipynb"
MODEL_PARALLEL = COLAB / "model_parallel_and_device_loops.ipynb"
PARAMETER_SERVER = COLAB / "parameter_server.ipynb"
# Every notebook on 8 simulated CPU devices and on 1: each runs unchanged on any device
# count (its first cell reads JREPLICATE_NOTEBOOK_DEVICES).
CASES = [(path, 8) for path in NOTEBOOKS] + [(path, 1) for path in NOTEBOOKS]


def _outputs(nb) -> list[str]:
    return ["".join(o.get("text", "")) for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", [])]


@pytest.mark.parametrize("path, devices", CASES, ids=lambda v: getattr(v, "name", f"{v}dev"))
def test_notebook_runs(path, devices, monkeypatch):
    # XLA_FLAGS asks for 8 devices, as conftest does: the quickstart's first cell must
    # replace that count with JREPLICATE_NOTEBOOK_DEVICES.
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("JREPLICATE_NOTEBOOK_DEVICES", str(devices))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    assert os.environ["XLA_FLAGS"]
    if path == MODEL_PARALLEL:
        text = "\n".join(_outputs(nb))
        m = 2 if devices % 2 == 0 else 1
        assert f"{devices // m} replicas x {m} logical devices" in text, text
        for claim in ("tensor-parallel == 1 device", "two stages == 1 device",
                      "10 steps in one loop == 10 run calls, bit for bit", "K =  50"):
            assert claim in text, text
    if path == PARAMETER_SERVER and devices == 1:
        text = "\n".join(_outputs(nb))
        assert "1 worker: no other worker to reschedule its step on" in text, text
    elif path == PARAMETER_SERVER:
        text = "\n".join(_outputs(nb))
        for claim in ("staleness histogram (shard 0):", "updates of 5 gradients each",
                      "exactly once: every shard applied each of the 300 steps once"):
            assert claim in text, text
    if path == QUICKSTART:
        text = "\n".join(_outputs(nb))
        assert f"{devices} replicas on cpu" in text, text
        assert f"{devices} replicas == 1 device: losses and parameters match" in text, text


def test_quickstart_is_stored_executed_and_installs_from_the_repository():
    nb = nbformat.read(QUICKSTART, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code), "save the notebook with its outputs"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)
    text = "\n".join(c.source for c in nb.cells)
    assert "pip install jreplicate" not in text  # not released: install from a clone
    assert "pip install -e ." in text
    # The first cell sets the simulated device count; jax is imported only after it.
    assert "JREPLICATE_NOTEBOOK_DEVICES" in code[0].source
    assert "import jax" not in code[0].source and "import jax" in code[1].source
    assert "JAX_PLATFORMS" not in text  # no CPU-only assumption on GPU/TPU runtimes
    assert "replicas == 1 device" in "".join(_outputs(nb))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_opens_by_installing_from_the_repository(path):
    """The first code cell installs jreplicate when the runtime lacks it (from the clone
    the notebook sits in, or JREPLICATE_SOURCE) and sets the simulated device count, all
    before jax is imported; the notebook is stored with its outputs."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    first = code[0].source
    assert "importlib.util.find_spec('jreplicate') is None" in first
    assert "'pip', 'install'" in first and "JREPLICATE_SOURCE" in first
    assert "JREPLICATE_NOTEBOOK_DEVICES" in first
    assert "import jax" not in first
    assert all(c.outputs for c in code[1:]), "save the notebook with its outputs"
    assert not any(o.get("output_type") == "error" for c in code for o in c.outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_install_cell_keeps_the_runtimes_jax(path, monkeypatch):
    """Where jreplicate is missing, the first cell installs it with the runtime's own jax,
    jaxlib, CUDA plugins and libtpu as pip constraints (never replaced: a TPU runtime
    breaks when jaxlib and libtpu drift apart), and where pip cannot satisfy both (the
    runtime's JAX is too old) it stops with an error saying so. pip itself is not run."""
    import importlib.util
    import subprocess

    import jax
    import jaxlib

    first = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"][0]
    calls = []

    def pip(cmd, *args, **kwargs):
        constraints = cmd[cmd.index("-c") + 1]
        calls.append((cmd, pathlib.Path(constraints).read_text().split()))
        return subprocess.CompletedProcess(cmd, 1)  # as pip fails beside a too-old JAX

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "jreplicate" else find_spec(name, *a))
    monkeypatch.setattr(subprocess, "run", pip)
    monkeypatch.setenv("JREPLICATE_SOURCE", str(COLAB.parent))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    with pytest.raises(RuntimeError, match=r"jreplicate needs jax and jaxlib >= 0\.11\.2, < 0\.13"):
        exec(compile(first.source, str(path), "exec"), {})  # noqa: S102 - the cell itself
    (cmd, kept), = calls
    assert cmd[-1] == str(COLAB.parent) and "--upgrade" not in cmd and "-U" not in cmd
    assert f"jax=={jax.__version__}" in kept and f"jaxlib=={jaxlib.__version__}" in kept
