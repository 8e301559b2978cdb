"""Cross-process agreement, the class: a generated matrix of per-process kinds.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 2``; checked
by tests/test_cross_process_agreement.py, which imports the cell generators and the
NumPy oracle from here. Each process loops over every cell in one order, records its
outcome (``CELL <name> ok <result>`` or ``CELL <name> <ErrorType> <message>``), and then
runs a step with a collective (``SYNC ok``): after an agreed error the processes must
still be in step.

* argument cells ``arg-<kind0>-<kind1>``: ``rep.run(step, None, arg)`` where process p
  passes ``arg`` of kind ``kind<p>`` (:data:`ARG_KINDS`: NumPy in two dtypes, a
  ``jax.Array`` uncommitted and committed, Python and NumPy scalars, a tuple, a
  NamedTuple, custom pytree nodes with two aux data, another shape, dtype or value, and
  values refused on one process);
* input cells ``in-<kind0>-<kind1>-<change>``: PER_WORKER input with
  ``partial_batch="pad"`` where process p's elements are of kind ``kind<p>``
  (:data:`INPUT_KINDS`: NumPy, ``jax.Array``, a dict, a NamedTuple, custom pytree nodes
  with two aux data, another dtype or feature shape), two sweeps of uneven lengths
  (process 1's second sweep is empty), and ``change`` says whether process 0's elements
  change kind at ``reinitialize()``.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys
import time
from typing import Any, NamedTuple

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import numpy as np  # noqa: E402

ARG_KINDS = ("np", "np64", "jax", "jax_dev", "int32", "shape", "value", "py_float",
             "np_scalar", "py_int", "py_bool", "tuple", "named", "node", "node_b", "str",
             "big")
INPUT_KINDS = ("arr", "jax", "dict", "named", "node", "node_b", "dtype", "feat")
CHANGES = ("none", "p0")
COUNTS = ((3, 2), (2, 0))  # elements of (process 0, process 1) in sweeps 1 and 2
BATCH = 2  # examples per element


class Pair(NamedTuple):
    a: Any
    b: Any


class Rec(NamedTuple):
    x: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Node:
    x: Any
    tag: str = dataclasses.field(metadata=dict(static=True))


class Cell(NamedTuple):
    name: str
    kinds: tuple[str, str]
    change: str = "none"


def arg_cells() -> list[Cell]:
    return [Cell(f"arg-{a}-{b}", (a, b)) for a, b in itertools.product(ARG_KINDS, repeat=2)]


def input_cells() -> list[Cell]:
    return [Cell(f"in-{a}-{b}-{c}", (a, b), c)
            for a, b, c in itertools.product(INPUT_KINDS, INPUT_KINDS, CHANGES)]


# -- the NumPy oracle ------------------------------------------------------------------------
_X = np.arange(3, dtype=np.float32) + 1


def _canon(kind: str) -> tuple | None:
    """What ``kind``'s argument is, as every process should see it (None: refused)."""
    leaf = {"np": _X, "np64": _X, "jax": _X, "jax_dev": _X, "int32": _X.astype(np.int32),
            "shape": np.arange(4, dtype=np.float32) + 1, "value": _X * 2,
            "py_float": np.float32(2.0), "np_scalar": np.float32(2.0),
            "py_int": np.int32(2), "py_bool": np.bool_(True)}
    if kind in leaf:  # (a Python int or float is weakly typed, as on one process)
        return ("weak" if kind in ("py_float", "py_int") else "leaf", (leaf[kind],))
    return {"tuple": ("tuple", (_X, _X)), "named": ("Pair", (_X, _X)),
            "node": ("Node-a", (_X,)), "node_b": ("Node-b", (_X,))}.get(kind)


def _weighted(leaves) -> float:
    return float(sum(np.sum(np.asarray(x, np.float32).ravel()
                            * (1 + np.arange(np.size(x), dtype=np.float32)))
                     for x in leaves))


def expected_arg_outcome(cell: Cell) -> str | None:
    """The result both processes must print, or None where they must raise alike."""
    a, b = (_canon(k) for k in cell.kinds)
    if a is None or b is None or a[0] != b[0] or len(a[1]) != len(b[1]) or any(
            x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes()
            for x, y in zip(a[1], b[1])):
        return None
    return f"{4 * _weighted(a[1]):g}"


def _input_canon(kind: str) -> tuple:
    return {"arr": ("leaf", "float32", 2), "jax": ("leaf", "float32", 2),
            "dict": ("dict", "float32", 2),
            "named": ("Rec", "float32", 2), "node": ("Node-a", "float32", 2),
            "node_b": ("Node-b", "float32", 2), "dtype": ("leaf", "int32", 2),
            "feat": ("leaf", "float32", 3)}[kind]


def _value(process: int, element: int) -> int:
    return 1 + element + 10 * process


def expected_input_outcome(cell: Cell) -> str | None:
    """``"<sum>/<count> <sum>/<count>"`` of the two sweeps, or None for an error."""
    if _input_canon(cell.kinds[0]) != _input_canon(cell.kinds[1]) or cell.change != "none":
        return None
    features = _input_canon(cell.kinds[0])[2]
    out = []
    for counts in COUNTS:
        total = sum(_value(p, e) * BATCH * features
                    for p, n in enumerate(counts) for e in range(n))
        out.append(f"{total:g}/{sum(counts) * BATCH:g}")
    return " ".join(out)


# -- the job ---------------------------------------------------------------------------
def _arg(kind: str, me: int) -> Any:
    import jax.numpy as jnp
    x = _X.copy()
    return {"np": lambda: x, "np64": lambda: x.astype(np.float64),
            "jax": lambda: jnp.asarray(x),
            "jax_dev": lambda: jax.device_put(x, jax.local_devices()[me]),
            "int32": lambda: x.astype(np.int32),
            "shape": lambda: np.arange(4, dtype=np.float32) + 1, "value": lambda: x * 2,
            "py_float": lambda: 2.0, "np_scalar": lambda: np.float32(2.0),
            "py_int": lambda: 2, "py_bool": lambda: True, "tuple": lambda: (x, x),
            "named": lambda: Pair(x, x), "node": lambda: Node(x, "a"),
            "node_b": lambda: Node(x, "b"), "str": lambda: "abc",
            "big": lambda: np.int64(2 ** 40)}[kind]()


def _element(kind: str, process: int, element: int) -> Any:
    v = _value(process, element)
    x = np.full((BATCH, 2), v, np.float32)
    return {"arr": lambda: x, "jax": lambda: jax.numpy.asarray(x), "dict": lambda: {"x": x},
            "named": lambda: Rec(x),
            "node": lambda: Node(x, "a"), "node_b": lambda: Node(x, "b"),
            "dtype": lambda: x.astype(np.int32),
            "feat": lambda: np.full((BATCH, 3), v, np.float32)}[kind]()


_CHANGED = {"arr": "dtype", "jax": "node", "dict": "named", "named": "arr", "node": "node_b",
            "node_b": "node", "dtype": "arr", "feat": "arr"}


def _describe(e: Exception) -> str:
    return f"{type(e).__name__} {str(e).splitlines()[0][:600]}"


def main(parts: tuple[str, ...] = ("arguments", "inputs")) -> None:
    import jax.numpy as jnp

    import jreplicate as jr
    strategy = jr.MultiWorkerStrategy()
    rep = jr.Replicator(strategy)
    me = strategy.worker_index

    def arg_step(ctx, arg):
        return ctx.all_sum(sum(
            jnp.sum(x.astype(jnp.float32).ravel() * (1 + jnp.arange(x.size, dtype=jnp.float32)))
            for x in jax.tree.leaves(arg)))

    def input_step(ctx, batch):
        m = ctx.batch_mask
        total = sum((x.astype(jnp.float32) * m[:, None]).sum() for x in jax.tree.leaves(batch))
        return ctx.all_sum(total), ctx.all_sum(m.sum())

    def one(ctx):
        return ctx.all_sum(1.0)

    def sync():
        got = float(np.asarray(rep.run(one).addressable_data(0)))
        print(f"SYNC {'ok' if got == strategy.num_replicas else got}", flush=True)

    t0 = time.perf_counter()
    for cell in arg_cells() if "arguments" in parts else ():
        try:
            out = rep.run(arg_step, None, _arg(cell.kinds[me], me))
            detail = f"ok {float(np.asarray(out.addressable_data(0))):g}"
        except Exception as e:  # recorded: the test compares the processes' outcomes
            detail = _describe(e)
        print(f"CELL {cell.name} {detail}", flush=True)
        sync()

    t1 = time.perf_counter()
    for cell in input_cells() if "inputs" in parts else ():
        sweep = [0]

        def input_fn(ctx, cell=cell, sweep=sweep):
            p = ctx.input_pipeline_id
            kind = cell.kinds[p]
            if sweep[0] and cell.change == f"p{p}":
                kind = _CHANGED[kind]
            return (_element(kind, p, e) for e in range(COUNTS[sweep[0]][p]))

        it = rep.prepare_input(input_fn, partial_batch="pad")
        try:
            sums = []
            for s in range(len(COUNTS)):
                total = count = 0.0
                for batch in it:
                    t, c = rep.run(input_step, batch)
                    total += float(np.asarray(t.addressable_data(0)))
                    count += float(np.asarray(c.addressable_data(0)))
                sums.append(f"{total:g}/{count:g}")
                if s + 1 < len(COUNTS):
                    sweep[0] = s + 1
                    it.reinitialize()
            detail = "ok " + " ".join(sums)
        except Exception as e:  # recorded: the test compares the processes' outcomes
            detail = _describe(e)
        it.close()
        print(f"CELL {cell.name} {detail}", flush=True)
        sync()
    print(f"DONE arguments {t1 - t0:.1f}s inputs {time.perf_counter() - t1:.1f}s", flush=True)


if __name__ == "__main__":
    main()
