"""Memory held by step functions that are built, run once and dropped.

A training script that builds a new step function per phase (or per experiment in a
notebook) closes over constants (a mask, a table). Once the function is dropped,
nothing should keep its programs or its constants alive. This measures the resident
memory (RSS, after ``gc.collect()`` and ``malloc_trim(0)``) that N such functions, each
closing over an array of ``--mib`` MiB, still hold after they are dropped:

* ``jax.jit``: N fresh ``jax.jit`` functions, each called once;
* ``run``: N fresh step functions, each run once by ``Replicator.run``.

Both in one process (8 simulated CPU devices), side by side, and their ratio (target:
run / jax.jit <= 1.5). Run: ``python bench/memory_per_step_fn.py [--n 100 --mib 8]``.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import warnings  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jreplicate as jr  # noqa: E402

_LIBC = ctypes.CDLL("libc.so.6")


def rss_mib() -> float:
    """Resident memory after a full collection and returning freed heap to the OS."""
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


_KIND = {"const": "numpy"}


def _constant(i: int, mib: float) -> np.ndarray:
    c = np.full(int(mib * 2**20) // 4, float(i), np.float32)
    return jnp.asarray(c) if _KIND["const"] == "jax" else c


def _jit_fn(c: np.ndarray):
    return jax.jit(lambda x: x + jnp.sum(c))


def _step_fn(c: np.ndarray):
    def step(ctx, w):
        return w + jnp.sum(c)
    return step


def held_by_jit(n: int, mib: float) -> float:
    x = jnp.ones(4)
    before = rss_mib()
    for i in range(n):
        f = _jit_fn(_constant(i, mib))
        jax.block_until_ready(f(x))
        del f
    return rss_mib() - before


def held_by_run(rep: jr.Replicator, n: int, mib: float) -> float:
    w = rep.replicate(jnp.ones(4))
    before = rss_mib()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # run warns about recompiling a new function
        for i in range(n):
            step = _step_fn(_constant(i, mib))
            jax.block_until_ready(rep.run(step, None, w))
            del step
    return rss_mib() - before


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_in_use_mib() -> float:
    """glibc's heap in use (``mallinfo2``: allocated blocks and mmapped chunks), after a
    full collection: RSS less the freed memory the allocator keeps (fragmentation)."""
    gc.collect()
    _LIBC.malloc_trim(0)
    _LIBC.mallinfo2.restype = _MallInfo2
    info = _LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20


def heap_held(n: int, mib: float) -> tuple[float, float]:
    """Median over 3 interleaved rounds of the heap in use that ``n`` dropped functions
    leave behind: ``(jax.jit, run)``."""
    rep = jr.Replicator(jr.MirroredStrategy())
    jits, runs = [], []
    for _ in range(3):
        a = heap_in_use_mib()
        held_by_jit(n, mib)
        b = heap_in_use_mib()
        held_by_run(rep, n, mib)
        runs.append(heap_in_use_mib() - b)
        jits.append(b - a)
    return float(np.median(jits)), float(np.median(runs))


def live_programs() -> tuple[int, int]:
    """``(compiled executables alive, jax.Arrays alive)`` after a full collection."""
    from jax._src import xla_bridge
    gc.collect()
    return len(xla_bridge.get_backend().live_executables()), len(jax.live_arrays())


def measure(n: int, mib: float, const: str = "numpy",
            rounds: int = 3) -> tuple[float, float, tuple[int, int]]:
    """Medians over ``rounds`` interleaved rounds of ``(MiB held by jax.jit functions,
    MiB held by run's step functions)``, and what is alive after the last round
    (:func:`live_programs`, compared with before: it must not grow)."""
    _KIND["const"] = const
    rep = jr.Replicator(jr.MirroredStrategy())
    held_by_jit(3, mib)  # warm up both: what any first call allocates once
    held_by_run(rep, 3, mib)
    before = live_programs()
    jits, runs = [], []
    for _ in range(rounds):  # interleaved: the allocator's slack moves between phases
        jits.append(held_by_jit(n, mib))
        runs.append(held_by_run(rep, n, mib))
    after = live_programs()
    grown = (after[0] - before[0], after[1] - before[1])
    return float(np.median(jits)), float(np.median(runs)), grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="step functions")
    parser.add_argument("--mib", type=float, default=8.0, help="MiB each closes over")
    parser.add_argument("--const", choices=("numpy", "jax"), default="numpy",
                        help="the closed-over array: a NumPy array or a jax.Array")
    args = parser.parse_args()
    jit, run, grown = measure(args.n, args.mib, args.const)
    print(f"{args.n} functions closing over {args.mib:g} MiB each ({args.const}), held "
          "after they are dropped (RSS, MiB; median of 3 interleaved rounds):")
    print(f"  jax.jit  {jit:8.1f}   ({jit / args.n:.3f} per function)")
    print(f"  run      {run:8.1f}   ({run / args.n:.3f} per function)")
    print(f"  run / jax.jit = {run / max(jit, 1.0):.2f}   (target <= 1.5; jax.jit's figure "
          "is floored at 1 MiB: both are allocator noise once nothing is kept)")
    print(f"  executables / arrays left alive by the rounds: {grown[0]} / {grown[1]}")
    hjit, hrun = heap_held(args.n, args.mib)
    print(f"  heap in use (mallinfo2, without the allocator's kept free memory): jax.jit "
          f"{hjit:.2f}, run {hrun:.2f} MiB ({1024 * hrun / args.n:.1f} KiB per function)")


if __name__ == "__main__":
    main()
