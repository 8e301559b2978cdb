"""Markdown tables and figures from a ``bench/report.py`` report (no benchmark runs here).

Every figure is drawn from the records alone, so ``python -m bench.report --render
bench/results/<run>/report.json`` redraws them without measuring anything again.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any


def slug(text: str) -> str:
    """A folder-name form of a device kind (``"NVIDIA H100 80GB HBM3"`` ->
    ``"nvidia-h100-80gb-hbm3"``)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value == 0 or abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) >= 0.01 else f"{value:.2e}"
    return str(value)


def table(record: dict[str, Any]) -> str:
    """One record's rows as a markdown table."""
    cols = record["columns"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in record["rows"]]
    return "\n".join(lines)


def _rows(report: dict[str, Any], name: str) -> tuple[list[str], list[list]] | None:
    got = report["benchmarks"].get(name, {})
    if got.get("status") != "ok" or "record" not in got:
        return None
    return got["record"]["columns"], got["record"]["rows"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _title(report: dict[str, Any], what: str) -> str:
    m = report["machine"]
    return f"{what}\n{m['device_count']} x {m['device_kind']} ({m['platform']}), {m['date'][:10]}"


def _finish(fig: Any, ax: Any, report: dict[str, Any], path: str, title: str, *,
            xlabel: str | None, ylabel: str, legend: dict | None = None) -> bool:
    """Labels, titles (with the machine and date), saves and closes one figure."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(_title(report, title), fontsize=9)
    if legend is not None:
        ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return True


def plot_steps_per_run(report: dict[str, Any], path: str) -> bool:
    got = _rows(report, "steps_per_run")
    if got is None:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    models = dict.fromkeys(r[0] for r in got[1])
    for model in models:
        pts = [(r[1], r[2]) for r in got[1] if r[0] == model]
        ax.plot(*zip(*pts), marker="o", label=model)
    ax.set_xscale("log")
    return _finish(fig, ax, report, path, "Device loops: run(..., steps=K)",
                   xlabel="K (steps per run call)", ylabel="steps/s", legend={})


def plot_stragglers(report: dict[str, Any], path: str) -> bool:
    got = _rows(report, "stragglers")
    if got is None:
        return False
    cols, rows = got
    i, s = cols.index("time to target"), cols.index("time to target std")
    rows = [r for r in rows if r[i] is not None]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    names = [r[0] if r[0].startswith("async") else f"sync {r[0]}" for r in rows]
    ax.bar(names, [r[i] for r in rows], yerr=[r[s] or 0 for r in rows], capsize=3)
    meta = report["benchmarks"]["stragglers"]["record"]["meta"]
    ax.tick_params(axis="x", labelsize=8)
    return _finish(fig, ax, report, path, "Backup replicas against stragglers (lower is better)",
                   xlabel=None, ylabel=f"virtual time to {meta['target']:.0%} test accuracy")


def plot_ps_workers(report: dict[str, Any], path: str) -> bool:
    ps = report["benchmarks"].get("parameter_server", {})
    ray = _rows(report, "ray_baseline")
    if ps.get("status") != "ok" and ray is None:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    if ps.get("status") == "ok":
        pts = ps["record"]["meta"]["async_by_workers"]
        ax.plot(*zip(*pts), marker="o", label="embedded carrier, async")
    if ray is not None:
        cols, rows = ray
        w, h, system, rate = (cols.index(c) for c in ("workers", "hidden", "system",
                                                      "updates/s"))
        for key in dict.fromkeys((r[h], r[system]) for r in rows):
            pts = sorted((r[w], r[rate]) for r in rows if (r[h], r[system]) == key)
            ax.plot(*zip(*pts), marker="s", ls="--", label=f"{key[1]}, H={key[0]}")
    return _finish(fig, ax, report, path, "Parameter server: updates/s against workers",
                   xlabel="workers", ylabel="applied updates/s", legend={"fontsize": 7})


def plot_host_overhead(report: dict[str, Any], path: str) -> bool:
    got = _rows(report, "host_overhead")
    if got is None:
        return False
    _, rows = got
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r[3] for r in rows], width=0.4, label="reference")
    ax.bar([i + 0.2 for i in x], [r[2] for r in rows], width=0.4, label="jreplicate")
    ax.set_xticks(list(x), [f"{r[0]}\nvs {r[1]}\n({r[4]:.2f}x)" for r in rows], fontsize=7)
    return _finish(fig, ax, report, path, "Host overhead against hand-written JAX",
                   xlabel=None, ylabel="microseconds per step", legend={})


def plot_weight_update(report: dict[str, Any], path: str) -> bool:
    """State bytes per device (parameters + optimizer state, solid) and XLA's peak of a
    step (dashed) against the replica count, one colour per variant measured (pending
    variants, with no figures, are left out)."""
    got = _rows(report, "weight_update_sharding")
    if got is None:
        return False
    cols, rows = got
    v, n, p, o, peak = (cols.index(c) for c in ("variant", "replicas", "params MiB/device",
                                                "opt state MiB/device", "peak MiB"))
    rows = [r for r in rows if r[p] is not None]
    if not rows:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name in dict.fromkeys(r[v] for r in rows):
        mine = sorted((r for r in rows if r[v] == name), key=lambda r: r[n])
        hand = name.startswith("hand")  # hollow squares: the library's lines show inside
        (line,) = ax.plot([r[n] for r in mine], [r[p] + r[o] for r in mine],
                          marker="s" if hand else "o", markersize=10 if hand else 5,
                          markerfacecolor="none" if hand else None, lw=1 if hand else 1.5,
                          label=f"{name}: state")
        ax.plot([r[n] for r in mine], [r[peak] for r in mine], ls="--", marker=".",
                color=line.get_color(), label=f"{name}: peak of a step")
    replicas = sorted({r[n] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(replicas, [str(x) for x in replicas])
    ax.set_ylim(bottom=0)
    meta = report["benchmarks"]["weight_update_sharding"]["record"].get("meta", {})
    return _finish(fig, ax, report, path, "Weight-update sharding, "
                   + meta.get("model", "an MLP") + ", Adam", xlabel="replicas",
                   ylabel="MiB per device",
                   legend={"fontsize": 7, "loc": "upper left", "bbox_to_anchor": (1.01, 1)})


#: Each benchmark's figure: its file, how it is drawn, and its caption on the docs site.
FIGURES: dict[str, tuple[str, Callable[[dict, str], bool], str]] = {
    "steps_per_run": ("steps_per_run.png", plot_steps_per_run,
                      "Device loops: steps per second of `run(..., steps=K)` against K, "
                      "per model (higher is better)."),
    "stragglers": ("stragglers_time_to_target.png", plot_stragglers,
                   "Backup replicas: virtual time to the target test accuracy with N of the "
                   "replicas aggregated each step, and asynchronous training (lower is "
                   "better)."),
    "parameter_server": ("ps_workers.png", plot_ps_workers,
                         "Parameter server: applied updates per second against the number "
                         "of workers and, where Ray is installed, a Ray parameter server "
                         "written as Ray's tutorial teaches."),
    "host_overhead": ("host_overhead.png", plot_host_overhead,
                      "Host overhead of a dispatch-bound step: microseconds per step, "
                      "jreplicate against hand-written JAX (lower is better)."),
    "weight_update_sharding": ("weight_update_sharding.png", plot_weight_update,
                               "Weight-update sharding: parameters and Adam state held per "
                               "device (solid) and XLA's peak memory of a step (dashed) "
                               "against the number of replicas: replicated, "
                               "`weight_update_sharding=\"optimizer\"` (ZeRO-1) and "
                               "`\"parameters\"` (ZeRO-3), and hand-written `jax.jit` with "
                               "sharded state (GSPMD FSDP, ZeRO-1) (lower is better)."),
}
#: The accuracy curves examples/stragglers.py draws beside the stragglers benchmark.
STRAGGLERS_CURVES = ("stragglers.png", "Backup replicas: test accuracy against virtual time "
                     "with N of the replicas aggregated each step, and asynchronous training.")


def figure(path: str, caption: str) -> list[str]:
    """A MyST figure (the docs site renders it at the column's width, with its caption)."""
    alt = os.path.splitext(os.path.basename(path))[0]
    return [f"```{{figure}} {path}", ":width: 100%", f":alt: {alt}", "", caption, "```", ""]


def _draw(plot: Callable[[dict[str, Any], str], bool], report: dict[str, Any],
          path: str) -> bool:
    """Draws one figure; False (the table alone) where matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return plot(report, path)


def write_markdown(report: dict[str, Any], out: str) -> str:
    """Draws the figures into ``out`` and writes ``out/report.md``; returns its text."""
    m = report["machine"]
    lines = [f"# Benchmarks, {m['date'][:10]}", "",
             f"{m['device_count']} x {m['device_kind']} ({m['platform']}), "
             f"{m['cpu_cores']} CPU cores, load average {m['load_average'][0]:.1f} before and "
             f"{m.get('load_average_after', [float('nan')])[0]:.1f} after, "
             f"jax {m['jax']}, Python {m['python']}, {m['date']}"
             + (" (--quick: smoke-test sizes, noisy)" if report.get("quick") else "") + ".", ""]
    for name, result in report["benchmarks"].items():
        fig = FIGURES.get(name)
        if name == "ray_baseline" and "parameter_server" not in report["benchmarks"]:
            fig = FIGURES["parameter_server"]  # the same figure, drawn once
        drawn = fig is not None and _draw(fig[1], report, os.path.join(out, fig[0]))
        title = result.get("record", {}).get("title", name)
        lines += [f"## {title}", "", f"`{name}`, {result.get('seconds', 0):.0f} s"
                  + (f", arguments `{' '.join(result['args'])}`" if result.get("args") else "")
                  + ".", ""]
        if result["status"] != "ok":
            lines += [f"{result['status']}: {result.get('why', '')}", ""]
        elif "record" in result:
            meta = result["record"].get("meta", {})
            lines += [table(result["record"]), ""]
            if meta:
                lines += ["Measured with " + ", ".join(
                    f"{k} = {_cell(v)}" for k, v in meta.items()
                    if not isinstance(v, (list, dict))) + ".", ""]
        else:
            lines += ["```text", result.get("text", "").rstrip(), "```", ""]
        if name == "stragglers" and os.path.exists(os.path.join(out, STRAGGLERS_CURVES[0])):
            lines += figure(*STRAGGLERS_CURVES)
        if drawn:
            lines += figure(fig[0], fig[2])
    text = "\n".join(lines)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    return text
