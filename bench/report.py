"""Runs every benchmark and records its figures: one JSON record, markdown tables, PNGs.

    python -m bench.report [--quick] [--only NAME ...] [--out DIR]
    python -m bench.report --gpu [--budget SECONDS] [--out DIR]

Each benchmark runs in its own process (each sets up its own devices), one after the
other, with a progress line per benchmark on stderr. The results go to
``bench/results/<date>_<device kind>/`` (or ``--out``):

* ``report.json``: the date, the machine (device kind and count, platform, CPU cores,
  load average, jax/jaxlib versions) and every benchmark's record (columns, rows and
  what they were measured under; see ``bench/_record.py``), its wall time and exit
  status; a benchmark that failed or was skipped says why;
* ``report.md``: the same as markdown tables, linking the figures;
* the figures: ``steps_per_run.png`` (steps/s against K for device loops),
  ``stragglers.png`` and ``stragglers_time_to_target.png`` (backup replicas: accuracy
  against virtual time, time to the target accuracy), ``ps_workers.png`` (parameter
  server updates/s against workers, and the Ray carrier beside a hand-written Ray
  parameter server when Ray is installed), ``host_overhead.png`` (jreplicate against
  hand-written JAX per step);
* ``logs/<name>.log``: each benchmark's own output.

So the day the suite runs on a GPU or a TPU, this one command records its figures.

``--gpu`` is the device check's mode (``bench/device_check.py``; bench/README.md, "On an
accelerator"): the benchmarks one accelerator answers, on the machine's own devices and
sized for it, within ``--budget`` seconds in all (a benchmark left without time is
recorded as skipped): absolute step times of a compute-bound and a dispatch-bound MLP
with their ratios to hand-written ``jax.jit(shard_map)`` (``overhead``, Keras left out),
host overhead per call (``host_overhead``), device loops K = 1 / 10 / 100
(``steps_per_run``), peak memory with and without donation from XLA's memory analysis
(``donation``) and the cost of ``sync_replicas`` (``sync_replicas`` on every device of
the default backend). Without a GPU it runs the same on CPU in the smoke-test sizes
(``--quick``: the GPU's sizes would not fit the budget), and says so. Its folder is
``bench/results/<date>_<platform>`` (``<date>_gpu`` on a GPU; on CPU
``<date>_cpu-device-check``, apart from the full CPU runs).
A full run took 12 minutes of benchmarks on a 2-core CPU machine (2026-11-25).
``--quick`` runs every benchmark in its smoke-test size: good for checking the pipeline,
too noisy for conclusions.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass(frozen=True)
class Bench:
    """One benchmark: its script, its arguments (full and quick), its time limit."""

    name: str
    script: str  # relative to the repository root
    full: tuple[str, ...] = ()
    quick: tuple[str, ...] = ("--quick",)
    timeout_s: float = 1800.0
    needs: tuple[str, ...] = ()  # modules it imports beyond the test extra
    json: bool = True  # writes a --json record; else its output is kept as text


BENCHES: tuple[Bench, ...] = (
    Bench("steps_per_run", "bench/steps_per_run.py"),
    Bench("host_overhead", "bench/host_overhead.py"),
    Bench("overhead", "bench/overhead.py", needs=("keras",)),
    Bench("tensor_parallel", "bench/tensor_parallel.py"),
    Bench("prefetch", "bench/prefetch.py"),
    Bench("sync_replicas", "bench/sync_replicas.py", quick=("--repeats", "5", "--steps", "5")),
    Bench("stragglers", "examples/stragglers.py", quick=("--seeds", "1")),
    Bench("parameter_server", "bench/parameter_server.py", quick=("--steps", "30", "--no-ray")),
    Bench("ray_baseline", "bench/ray_baseline.py",
          quick=("--updates", "40", "--rounds", "1", "--hidden", "256", "--num-ps", "1"),
          needs=("ray", "psutil")),
    Bench("ps_scale_sim", "bench/ps_scale_sim.py", quick=("--scale", "0.2")),
    Bench("ps_driver_cost", "bench/ps_driver_cost.py", quick=("--runs", "100", "--rounds", "3"),
          json=False),
    Bench("ps_input", "bench/ps_input.py", quick=("--steps", "60", "--rounds", "1"),
          json=False),
    Bench("donation", "bench/donation.py", quick=(), json=False),
    Bench("checkpoint_background", "bench/checkpoint_background.py"),
    Bench("memory_per_step_fn", "bench/memory_per_step_fn.py", quick=("--n", "20"),
          json=False),
    Bench("multi_worker", "bench/multi_worker.py", json=False),
)


# The device check's benchmarks (--gpu), in the order they run, each with a time limit
# that fits the budget; "full" is the size measured on an accelerator, "quick" a smoke run.
GPU_BENCHES: tuple[Bench, ...] = (
    Bench("overhead", "bench/overhead.py",
          full=("--no-keras", "--rounds", "8", "--steps", "10", "--sizes", "784,4096,4096,10",
                "--global-batch", "4096"),
          quick=("--no-keras", "--quick"), timeout_s=150),
    Bench("host_overhead", "bench/host_overhead.py", full=("--rounds", "5"), timeout_s=150),
    Bench("steps_per_run", "bench/steps_per_run.py",
          full=("--rounds", "5", "--models", "mlp-16-32-32-10"),
          quick=("--quick", "--models", "mlp-16-32-32-10"), timeout_s=90),
    Bench("donation", "bench/donation.py", quick=(), timeout_s=60),
    Bench("sync_replicas", "bench/sync_replicas.py",
          full=("--backend", "default", "--repeats", "10"),
          quick=("--backend", "default", "--repeats", "3", "--steps", "5"), timeout_s=90),
)


def machine() -> dict[str, Any]:
    """What the figures were measured on (on CPU: the 8 simulated devices the benchmarks
    set up for themselves)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "cpu_cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "host": platform.node(),
    }


def _missing(needs: Sequence[str]) -> list[str]:
    import importlib.util
    return [m for m in needs if importlib.util.find_spec(m) is None]


def run_one(bench: Bench, out: str, quick: bool,
            deadline: float | None = None) -> dict[str, Any]:
    """Runs one benchmark in its own process; its record, or why there is none.
    ``deadline`` (``time.monotonic()``) cuts its time limit short."""
    missing = _missing(bench.needs)
    if missing:
        return {"status": "skipped",
                "why": f"needs {', '.join(missing)}: pip install -e '.[bench]'"}
    timeout = bench.timeout_s
    if deadline is not None:
        timeout = min(timeout, deadline - time.monotonic())
        if timeout < 10:
            return {"status": "skipped", "why": "no time left in the budget"}
    args = list(bench.quick if quick else bench.full)
    path = os.path.join(out, f"{bench.name}.json")
    if bench.json:
        args += ["--json", path]
    if bench.name == "stragglers":
        args += ["--out", os.path.join(out, "stragglers.png")]
    log = os.path.join(out, "logs", f"{bench.name}.log")
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, os.path.join(ROOT, bench.script), *args],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    took = time.perf_counter() - t0
    shown = [os.path.relpath(a, ROOT) if os.path.isabs(a) else a for a in args]
    result: dict[str, Any] = {"seconds": round(took, 1), "args": shown}
    if rc != 0:
        result.update(status="failed", why=f"exit status {rc}" if rc is not None
                      else f"no result in {timeout:.0f} s", log=_tail(log))
    elif bench.json:
        with open(path) as f:
            result.update(status="ok", record=json.load(f))
        os.remove(path)
    else:
        result.update(status="ok", text=_tail(log, 60))
    return result


def _tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def run_all(benches: Sequence[Bench], out: str, quick: bool,
            budget_s: float | None = None) -> dict[str, Any]:
    """Runs ``benches`` in order, reporting progress on stderr; the whole report.
    With ``budget_s``, all of them together get at most that many seconds."""
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    report: dict[str, Any] = {"machine": machine(), "quick": quick, "benchmarks": {}}
    if budget_s is not None:
        report["budget_s"] = budget_s
    for i, bench in enumerate(benches, 1):
        print(f"[{i}/{len(benches)}] {bench.name} ...", end=" ", file=sys.stderr, flush=True)
        result = run_one(bench, out, quick, deadline)
        report["benchmarks"][bench.name] = result
        print(f"{result['status']} ({result.get('seconds', 0):.0f} s)"
              + (f": {result['why']}" if "why" in result else ""), file=sys.stderr)
    report["machine"]["load_average_after"] = list(os.getloadavg())
    return report


def default_out(gpu: bool = False) -> str:
    from bench import figures
    m = machine()
    if gpu:
        tag = m["platform"] if m["platform"] != "cpu" else "cpu-device-check"
        return os.path.join(HERE, "results", f"{m['date'][:10]}_{tag}")
    return os.path.join(HERE, "results", f"{m['date'][:10]}_{figures.slug(m['device_kind'])}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke-test sizes (minutes)")
    ap.add_argument("--gpu", action="store_true",
                    help="the device check's benchmarks, sized for one accelerator (on CPU "
                    "where there is none)")
    ap.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                    help="the most seconds all benchmarks together may take (--gpu: 270)")
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[b.name for b in BENCHES],
                    help="run only these benchmarks")
    ap.add_argument("--out", default=None, help="folder (default bench/results/<date>_<kind>)")
    ap.add_argument("--render", metavar="REPORT_JSON", default=None,
                    help="do not run anything: rebuild report.md and the figures from a "
                    "report.json written earlier")
    args = ap.parse_args(argv)
    from bench import figures
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        out = args.out or os.path.dirname(os.path.abspath(args.render))
    else:
        out = args.out or default_out(args.gpu)
        listed = GPU_BENCHES if args.gpu else BENCHES
        benches = [b for b in listed if not args.only or b.name in args.only]
        budget = args.budget if args.budget is not None or not args.gpu else 270.0
        quick = args.quick
        if args.gpu:
            platform_ = machine()["platform"]
            quick = quick or platform_ == "cpu"  # the sizes for a GPU would not fit the budget
            print("GPU mode: " + ("no GPU found, running on CPU (smoke-test sizes)"
                                  if platform_ == "cpu" else f"running on {platform_}"),
                  file=sys.stderr)
        report = run_all(benches, out, quick, budget)
        report["gpu_mode"] = args.gpu
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f, indent=1)
    figures.write_markdown(report, out)
    failed = [n for n, r in report["benchmarks"].items() if r["status"] == "failed"]
    print(f"report: {os.path.join(out, 'report.md')}"
          + (f"; failed: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    if __package__ in (None, ""):  # python bench/report.py
        sys.path.insert(0, ROOT)
    sys.exit(main())
