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


_WU_COLUMNS = ["variant", "replicas", "params MiB/device", "opt state MiB/device",
               "state / replicated", "peak MiB", "step ms", "note"]


def _wu_row(name, n, params, opt, peak):
    return [name, n, params, opt, (params + opt) / 12.0, peak, 10.0, ""]


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
        "weight_update_sharding": _result(
            "weight_update_sharding", _WU_COLUMNS,
            [_wu_row("replicated", 1, 4.0, 8.0, 20.0), _wu_row("replicated", 8, 4.0, 8.0, 20.0),
             _wu_row("hand_fsdp", 1, 4.0, 8.0, 14.7), _wu_row("hand_fsdp", 8, 0.5, 1.0, 9.6),
             ["optimizer", 8] + [None] * (len(_WU_COLUMNS) - 3) + ["pending: no option"]],
            model="MLP 4 x 512x512 + biases"),
        "overhead": {"status": "skipped", "why": "needs keras"},
        "donation": {"status": "ok", "seconds": 2.0, "text": "donated: 1.00x\n"},
    }}
    text = figures.write_markdown(rep, str(tmp_path))
    for png in ("steps_per_run.png", "stragglers_time_to_target.png", "ps_workers.png",
                "host_overhead.png", "weight_update_sharding.png"):
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


def _weight_update_bench():
    from bench import weight_update_sharding
    return weight_update_sharding


def test_weight_update_bench_counts_collectives_by_their_whole_buffer():
    """The HLO reader: a collective's bytes are the buffer it reduces or gathers, whether
    the text prints operand shapes (GPU) or only names (CPU), and an async ``-start``
    counts once, by its result less its operands."""
    wu = _weight_update_bench()
    hlo = "\n".join([
        "  %p.1 = f32[128,1024]{1,0} parameter(0)",
        "  %g = f32[1024,1024]{1,0} fusion(%p.1), kind=kLoop",
        "  %ags = (f32[128,1024]{1,0}, f32[1024,1024]{1,0}) all-gather-start("
        "f32[128,1024]{1,0} %p.1), channel_id=1",
        "  %agd = f32[1024,1024]{1,0} all-gather-done(%ags)",
        "  %rs = f32[128,1024]{1,0} reduce-scatter(%g), channel_id=2, dimensions={0}",
        "  %ar = (f32[1024]{0}, bf16[8,8]{1,0}) all-reduce(%b, %c), to_apply=%add",
        "  %ars = f32[256]{0} all-reduce-start(f32[256]{0} %d), to_apply=%add",
        "  %ard = f32[256]{0} all-reduce-done(%ars)",
    ])
    got = wu.collectives(hlo)
    assert got == {"reduce-scatter": (1, 4 << 20), "all-gather": (1, 4 << 20),
                   "all-reduce": (2, 4096 + 128 + 1024)}
    # a ring of 4 sends 3/4 of each gathered or scattered buffer, twice that of a reduced one
    assert wu.ring_bytes(got, 4) == 0.75 * (8 << 20) + 1.5 * (4096 + 128 + 1024)
    assert wu.ring_bytes(got, 1) == 0.0


@pytest.mark.parametrize("shape, n, dim", [
    ((1024, 1024), 8, 0), ((64, 4096), 8, 1), ((6, 512), 4, 1), ((512,), 8, None),
    ((1000, 3), 8, 0), ((1001, 3), 8, None), ((), 8, None), ((0, 4096), 8, None)])
def test_weight_update_bench_shards_by_the_librarys_rule(shape, n, dim):
    """The hand-written variants shard along the dimension the library would (largest
    divisible, ties first; small, scalar, empty and indivisible leaves replicated)."""
    assert _weight_update_bench().shard_dim(shape, n, 1024) == dim
    layout = pytest.importorskip("jreplicate.layout")
    if hasattr(layout, "weight_shard_dim"):  # the library's own rule, once it has one
        assert layout.weight_shard_dim(shape, None, n, 1024) == dim


def test_weight_update_bench_measures_the_layout_it_claims(tmp_path):
    """The benchmark end to end at a tiny size: every variant was checked against one-device
    jax.jit (it exits non-zero otherwise), and the bytes per device it records are the
    layout's exact arithmetic: 4 layers of 64x64 weights (sharded over N) and 64-element
    biases (replicated, under min_shard_size); Adam's moments like the parameters and its
    int32 count. The library's levels, where the option exists, hold what the hand-written
    GSPMD variants hold."""
    path = tmp_path / "wu.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "bench/weight_update_sharding.py", "--width", "64", "--replicas",
         "4", "--rounds", "1", "--steps", "1", "--json", str(path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rec = json.loads(path.read_text())
    col = {c: i for i, c in enumerate(rec["columns"])}
    rows = {(r[0], r[1]): r for r in rec["rows"]}
    assert set(rows) == {(v, n) for v in ("replicated", "optimizer", "parameters",
                                          "hand_fsdp", "hand_zero1") for n in (4,)}
    mib = 2**20

    def state(name, n):
        r = rows[name, n]
        return round(r[col["params MiB/device"]] * mib), round(r[col["opt state MiB/device"]] * mib)

    full, quarter = 4 * (64 * 64 + 64) * 4, 4 * (64 * 64 // 4 + 64) * 4
    assert state("replicated", 4) == (full, 2 * full + 4)
    assert state("hand_fsdp", 4) == (quarter, 2 * quarter + 4)
    assert state("hand_zero1", 4) == (full, 2 * quarter + 4)
    assert rows["hand_fsdp", 4][col["state / replicated"]] == pytest.approx(
        (3 * quarter + 4) / (3 * full + 4))
    assert rows["hand_fsdp", 4][col["all-gather"]] >= 4  # the weights, gathered each step
    assert rows["replicated", 4][col["all-reduce MiB"]] * mib == pytest.approx(full)
    for level, like in (("optimizer", "hand_zero1"), ("parameters", "hand_fsdp")):
        note = rows[level, 4][col["note"]]
        if note.startswith("pending"):  # the option is not in this jreplicate yet
            assert rows[level, 4][col["params MiB/device"]] is None
            assert level in rec["meta"]["pending"]
        else:  # sharded as asked, its gradients reduce-scattered (not all-reduced)
            assert note == "" and state(level, 4) == state(like, 4), level
            assert rows[level, 4][col["reduce-scatter"]] == 4, level
    for key in ("date", "load_average_before", "load_average_after", "host", "cpu_cores"):
        assert key in rec["meta"]
