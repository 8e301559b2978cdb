"""Smoke test of examples/stragglers.py (tiny settings)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tests._optional import needs

ROOT = Path(__file__).resolve().parents[1]


def _load_example():
    spec = importlib.util.spec_from_file_location("stragglers", ROOT / "examples" / "stragglers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs("sklearn", "matplotlib")
def test_stragglers_example_runs(tmp_path, capsys):
    stragglers = _load_example()
    out = tmp_path / "plot.png"
    argv = ["--seeds", "1", "--time-budget", "40", "--target", "0.5", "--out", str(out)]
    results = stragglers.main([*argv, "--configs", "8/0,5/3", "--async-lr", "0.125"])
    assert out.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "time to 50%" in printed and "5/3" in printed
    assert set(results) == {"8/0", "5/3", "async lr 0.125"}
    # Backups make steps shorter: more updates in the same virtual time.
    assert results["8/0"]["updates"] < results["5/3"]["updates"]
    for r in results.values():
        assert 0.0 <= r["final_accuracy"] <= 1.0
    assert results["5/3"]["final_accuracy"] > 0.5
    assert np.isfinite(results["5/3"]["time_to_target"])


def test_stragglers_example_rejects_bad_configs(capsys):
    stragglers = _load_example()
    with pytest.raises(SystemExit):
        stragglers.parse_args(["--configs", "6/1"])
    assert "N + b = 8" in capsys.readouterr().err
