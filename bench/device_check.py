"""The device check: what one accelerator can tell us, in at most 8 minutes, no install.

    PYTHONPATH=. python3 -m bench.device_check [--out DIR] [--budget 450] [--tests-budget 170]

Made for the GPU machine the ``device`` tool lends (bench/README.md, "On an accelerator":
the exact call): its image has jax, flax, optax, orbax-checkpoint, pytest, pytest-xdist
and hypothesis, and nothing can be installed, so the project runs from the working tree
on ``PYTHONPATH``. Three parts, each in its own processes, each with a deadline:

1. the platform: which devices JAX finds (``no GPU found, running on CPU`` where there
   is none; everything below still runs, on CPU);
2. the GPU subset of the tests on the machine's own devices
   (``JREPLICATE_TEST_DEVICES=native``, see tests/conftest.py): every strategy one device
   can host, device loops, donation, NNX, checkpoints, the parameter server's embedded
   carrier with its shard and worker on the one device (:data:`TESTS`);
3. ``python -m bench.report --gpu``: step times and ratios to hand-written JAX, device
   loops K = 1 / 10 / 100, peak memory with and without donation, host overhead per
   call, the cost of ``sync_replicas``.

Everything lands in ``--out`` (default ``$OUT`` where the device tool sets it, else
``bench/results/<date>_<platform>-device-check``): ``device_check.json`` and
``device_check.md`` (the summary), ``tests.log``, ``tests.xml`` (JUnit),
``report.json``, ``report.md`` and ``logs/`` (the benchmarks'). Exit status 0 when
every selected test passed and no benchmark failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The tests written for any device count (tests/conftest.py's native mode offers the
# strategies the devices can host).
TESTS = ("tests/test_one_device_strategies.py", "tests/test_device_loops.py",
         "tests/test_conformance.py")

_PROBE = """
import json, jax, jaxlib
d = jax.devices()
print(json.dumps({"platform": d[0].platform, "device_kind": d[0].device_kind,
                  "device_count": len(d), "jax": jax.__version__,
                  "jaxlib": jaxlib.__version__}))
"""


def _run(cmd: Sequence[str], env: dict[str, str], timeout: float,
         log: str | None = None) -> tuple[int | None, str]:
    """Runs ``cmd`` in its own process group; ``(exit status or None if it ran past
    ``timeout`` and was killed, its output)``. The output also goes to ``log``."""
    with open(log or os.devnull, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        out: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append(text)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            out.append(text)
            rc = None
        f.write("".join(out))
    return rc, "".join(out)


def probe(env: dict[str, str], timeout: float = 120) -> dict[str, Any]:
    """The devices JAX finds here, from a fresh process."""
    rc, out = _run([sys.executable, "-c", _PROBE], env, timeout)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if rc != 0 or not lines:
        raise SystemExit(f"device check: JAX did not start (exit status {rc}):\n{out[-3000:]}")
    return json.loads(lines[-1])


def _junit_counts(path: str) -> dict[str, int]:
    """passed / failed / errors / skipped from pytest's JUnit XML (empty if absent)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root)
    got = {k: sum(int(s.get(k, 0)) for s in suites)
           for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": got["tests"] - got["failures"] - got["errors"] - got["skipped"],
            "failed": got["failures"], "errors": got["errors"], "skipped": got["skipped"]}


def run_tests(out: str, env: dict[str, str], budget: float, on_gpu: bool) -> dict[str, Any]:
    """The GPU subset of the tests on the machine's own devices, within ``budget`` s."""
    env = dict(env, JREPLICATE_TEST_DEVICES="native")
    workers = max(1, min(4, (os.cpu_count() or 2) // 2))
    if on_gpu:  # several test processes share the GPU: no process may take it all
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_MEM_FRACTION=".2")
    else:  # one CPU device, as one GPU: nothing simulated
        env.pop("XLA_FLAGS", None)
        env["JAX_PLATFORMS"] = "cpu"
    xml = os.path.join(out, "tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *TESTS]
    if workers > 1:
        cmd[3:3] = ["-n", str(workers), "--dist", "loadfile"]
    t0 = time.monotonic()
    rc, text = _run(cmd, env, budget, os.path.join(out, "tests.log"))
    summary = [ln for ln in text.splitlines() if " passed" in ln or " failed" in ln]
    shown = " ".join("--junitxml=tests.xml" if a.startswith("--junitxml=") else a
                     for a in cmd[1:])  # tests.xml: in the results folder
    result = {"command": f"JREPLICATE_TEST_DEVICES=native python {shown}",
              "seconds": round(time.monotonic() - t0, 1),
              "exit_status": rc, "summary": summary[-1] if summary else None,
              **_junit_counts(xml)}
    if rc is None:
        result["why"] = f"ran past its {budget:.0f} s and was stopped"
    return result


def run_bench(out: str, env: dict[str, str], budget: float) -> dict[str, Any]:
    """``python -m bench.report --gpu`` into ``out`` within ``budget`` seconds (its
    report.md beside device_check.md: both are pages of the documentation site once the
    folder is in bench/results/, which docs/benchmarks links to)."""
    bench_out = out
    cmd = [sys.executable, "-m", "bench.report", "--gpu", "--budget", str(int(budget - 15)),
           "--out", bench_out]
    t0 = time.monotonic()
    rc, _ = _run(cmd, env, budget, os.path.join(out, "bench.log"))
    result: dict[str, Any] = {"seconds": round(time.monotonic() - t0, 1), "exit_status": rc}
    try:
        with open(os.path.join(bench_out, "report.json")) as f:
            report = json.load(f)
        result["benchmarks"] = {n: {"status": r["status"], "seconds": r.get("seconds"),
                                    **({"why": r["why"]} if "why" in r else {})}
                                for n, r in report["benchmarks"].items()}
    except (OSError, ValueError, KeyError) as e:
        result["why"] = f"no report: {e}"
    return result


def _markdown(summary: dict[str, Any]) -> str:
    d, t, b = summary["device"], summary["tests"], summary["bench"]
    lines = [f"# Device check, {summary['date']}", "",
             f"{d['device_count']} x {d['device_kind']} ({d['platform']}), jax {d['jax']}, "
             f"jaxlib {d['jaxlib']}, {summary['cpu_cores']} CPU cores"
             + ("" if d["platform"] != "cpu" else "; no GPU found, ran on CPU") + ".", "",
             f"Total {summary['seconds']:.0f} s.", "",
             f"## Tests ({t['seconds']:.0f} s)", "",
             f"`{t['command']}`: {t.get('summary') or t.get('why') or 'no summary'}", "",
             f"## Benchmarks ({b['seconds']:.0f} s)", "",
             "The tables: `report.md` in this folder.", ""]
    for name, r in b.get("benchmarks", {}).items():
        lines.append(f"- `{name}`: {r['status']}" + (f" ({r['why']})" if "why" in r else ""))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="results folder (default $OUT, else bench/results/<date>_...)")
    ap.add_argument("--budget", type=float, default=450.0,
                    help="seconds for everything (default %(default)s: 7.5 minutes)")
    ap.add_argument("--tests-budget", type=float, default=170.0,
                    help="seconds for the tests (default %(default)s)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    device = probe(env)
    on_gpu = device["platform"] == "gpu"
    found = (f"{device['device_count']} x {device['device_kind']} ({device['platform']}), "
             f"jax {device['jax']}, jaxlib {device['jaxlib']}")
    print("device check: " + (found if device["platform"] != "cpu"
                              else f"no GPU found, running on CPU ({found})"), flush=True)
    date = datetime.datetime.now(datetime.UTC)
    out = args.out or os.path.join(
        HERE, "results", f"{date:%Y-%m-%d}_{device['platform']}-device-check")
    os.makedirs(out, exist_ok=True)
    left = args.budget - (time.monotonic() - start)
    print(f"device check: tests ({min(args.tests_budget, left - 60):.0f} s at most) ...",
          flush=True)
    tests = run_tests(out, env, min(args.tests_budget, left - 60), on_gpu)
    print(f"device check: tests: {tests.get('summary') or tests.get('why')}", flush=True)
    left = args.budget - (time.monotonic() - start)
    print(f"device check: benchmarks ({left:.0f} s at most) ...", flush=True)
    bench = run_bench(out, env, left)
    summary = {"date": date.isoformat(timespec="seconds"), "device": device,
               "cpu_cores": os.cpu_count(), "tests": tests, "bench": bench,
               "seconds": round(time.monotonic() - start, 1)}
    with open(os.path.join(out, "device_check.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = _markdown(summary)
    with open(os.path.join(out, "device_check.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    failed = [n for n, r in bench.get("benchmarks", {}).items() if r["status"] == "failed"]
    ok = tests["exit_status"] == 0 and bench["exit_status"] == 0 and not failed
    print(f"device check: {'ok' if ok else 'NOT ok'}; results in {out}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
