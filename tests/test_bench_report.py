"""bench/report.py: one command runs the benchmarks and records their figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import _record, figures, report
from tests._optional import needs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _result(bench: str, columns, rows, **meta):
    return {"status": "ok", "seconds": 1.0, "args": ["--quick"],
            "record": {"bench": bench, "title": bench, "columns": columns, "rows": rows,
                       "meta": meta}}


def _machine():
    return {"date": "2026-11-25T10:00:00+00:00", "platform": "gpu",
            "device_kind": "NVIDIA H100 80GB HBM3", "device_count": 8, "cpu_cores": 16,
            "load_average": [0.5, 0.4, 0.3], "load_average_after": [1.0, 0.9, 0.8],
            "python": "3.12.1", "jax": "0.12.0", "jaxlib": "0.12.0", "host": "h"}


@needs("matplotlib")
def test_every_figure_is_drawn_from_records_alone(tmp_path):
    rep = {"machine": _machine(), "quick": False, "benchmarks": {
        "steps_per_run": _result("steps_per_run", ["model", "K", "steps/s", "speed-up"],
                                 [["m", 1, 100.0, 1.0], ["m", 10, 400.0, 4.0]]),
        "stragglers": _result("stragglers", ["configuration", "updates", "time to target",
                                             "time to target std", "reached"],
                              [["8/0", 10, 200.0, 5.0, 3], ["async lr 1", 90, None, None, 0]],
                              target=0.96),
        "parameter_server": _result("parameter_server", ["configuration", "updates/s"],
                                    [["async, 1 worker(s)", 50.0]],
                                    async_by_workers=[[1, 50.0], [2, 80.0]]),
        "ray_baseline": _result("ray_baseline", ["hidden", "workers", "system", "updates/s",
                                                 "CPU ms/update", "vs hand-written"],
                                [[256, 1, "hand-written", 80.0, 18.0, 1.0],
                                 [256, 1, "carrier num_ps=1", 82.0, 17.0, 1.02]]),
        "host_overhead": _result("host_overhead", ["jreplicate", "reference", "jreplicate us",
                                                   "reference us", "paired ratio", "target"],
                                 [["run", "hand", 101.0, 100.0, 1.01, 1.03]]),
        "overhead": {"status": "skipped", "why": "needs keras"},
        "donation": {"status": "ok", "seconds": 2.0, "text": "donated: 1.00x\n"},
    }}
    text = figures.write_markdown(rep, str(tmp_path))
    for png in ("steps_per_run.png", "stragglers_time_to_target.png", "ps_workers.png",
                "host_overhead.png"):
        assert (tmp_path / png).stat().st_size > 1000, png
        # A MyST figure: the docs site shows it at the column's width, with a caption.
        caption = next(c for f, _, c in figures.FIGURES.values() if f == png)
        assert f"```{{figure}} {png}\n:width: 100%\n:alt: {png[:-4]}\n\n{caption}\n```" in text
    assert "| m | 10 | 400 | 4 |" in text  # numbers as a table
    assert "8 x NVIDIA H100 80GB HBM3 (gpu)" in text  # the device kind
    assert "skipped: needs keras" in text and "donated: 1.00x" in text
    assert (tmp_path / "report.md").read_text() == text


def test_one_command_runs_a_benchmark_and_records_machine_and_figures(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.report", "--quick", "--only", "ps_scale_sim",
         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "[1/1] ps_scale_sim ... ok" in proc.stderr  # progress on stderr
    got = json.loads((out / "report.json").read_text())
    assert got["machine"]["device_kind"] and got["machine"]["date"][10] == "T"
    assert got["machine"]["device_count"] == 8 and got["machine"]["platform"] == "cpu"
    rec = got["benchmarks"]["ps_scale_sim"]["record"]
    assert rec["columns"][:3] == ["mode", "workers", "shards"]
    # 4 modes (asynchronous, bounded delay, token-gated, stale-synchronous) x 3 worker
    # counts x 3 shard counts
    assert len(rec["rows"]) == 36 and all(len(r) == len(rec["columns"]) for r in rec["rows"])
    assert "ssp" in {r[0] for r in rec["rows"]}
    assert "## Parameter server at 10-1,000" in (out / "report.md").read_text()
    # --render redraws from the JSON without running anything
    again = subprocess.run([sys.executable, "-m", "bench.report", "--render",
                            str(out / "report.json")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0, again.stderr


def test_a_record_row_of_the_wrong_length_is_refused(tmp_path):
    with pytest.raises(ValueError, match="row 1 has 1 entries for 2 columns"):
        _record.write(str(tmp_path / "x.json"), "b", "t", ["a", "b"], [[1, 2], [3]])


def test_every_benchmark_script_is_listed():
    listed = {os.path.basename(b.script) for b in report.BENCHES}
    not_benchmarks = {"_timing.py", "_record.py", "report.py", "figures.py", "__init__.py",
                      "exit_soak.py", "parameter_server_soak.py",  # soak tests, not figures
                      "device_check.py"}  # runs the tests and report --gpu
    scripts = {f for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")}
    assert scripts - not_benchmarks <= listed


def test_gpu_mode_on_cpu_says_so_and_records_the_donation_peaks(tmp_path):
    """bench.report --gpu (the device check's benchmarks) where no GPU is: it says so, runs
    the smoke sizes within its budget and records XLA's peak memory with and without
    donation."""
    out = tmp_path / "gpu"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.report", "--gpu", "--only", "donation", "--out",
         str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "GPU mode: no GPU found, running on CPU" in proc.stderr
    got = json.loads((out / "report.json").read_text())
    assert got["gpu_mode"] is True and got["quick"] is True and got["budget_s"] == 270.0
    rec = got["benchmarks"]["donation"]["record"]
    assert [r[0] for r in rec["rows"]] == ["donated", "kept"]
    donated, kept = (r[1] for r in rec["rows"])
    assert kept > donated > 0 and rec["meta"]["platform"] == "cpu"
    assert [b.name for b in report.GPU_BENCHES] == [
        "overhead", "host_overhead", "steps_per_run", "donation", "sync_replicas"]


def test_a_benchmark_left_without_time_is_skipped_not_run(tmp_path):
    os.makedirs(tmp_path / "logs")
    got = report.run_one(report.GPU_BENCHES[0], str(tmp_path), True,
                         deadline=time.monotonic() + 5)
    assert got == {"status": "skipped", "why": "no time left in the budget"}
