"""Weight-update sharding: state bytes per device, peak memory, step time, collectives.

An Adam step of an MLP of 4 layers ``W -> W`` (W = 1024: 4.2 M parameters, 16 MiB f32,
Adam's moments 32 MiB; ``--quick`` halves W), global batch 64, on N = 1 / 2 / 4 / 8 of
the 8 simulated CPU devices, five ways on the same initial state and batch:

* ``replicated``: ``Replicator(MirroredStrategy(devices=jax.devices()[:N])).run(step,
  batch, params, opt_state, donate_argnums=(0, 1))``: every device holds all the state;
* ``optimizer`` / ``parameters``: the same with ``MirroredStrategy(...,
  weight_update_sharding="optimizer" | "parameters")`` (ZeRO-1 / ZeRO-3);
* ``hand_fsdp``: ``jax.jit`` of a plain ``value_and_grad`` + ``optax.adam`` step with
  ``in_shardings``/``out_shardings`` placing the batch on ``P("data")`` and parameters
  and optimizer state on ``P("data")`` along one dimension (the plan's rule, below),
  state donated: GSPMD's own FSDP;
* ``hand_zero1``: the same with the parameters replicated (``P()``).

The shard rule, as the library's: a leaf is sharded along its largest dimension that
divides by N (ties: the first); a leaf with fewer than ``--min-shard-size`` elements, a
scalar or one with no such dimension stays replicated.

Columns per variant and N: state bytes per device (parameters and optimizer state, from
``addressable_shards``) and their ratio to ``replicated``; peak step memory from XLA's
``memory_analysis()`` (arguments + outputs + temporaries - aliased); step time (median,
least and greatest of interleaved rounds of donated steps, the order rotated every
round) and its paired ratio to ``hand_fsdp`` and to ``replicated``; the collectives of
the compiled program (``as_text()``: count and MiB of reduce-scatter, all-gather and
all-reduce, a collective's MiB being the whole buffer it reduces or gathers) and a ring
model of the bytes each device sends (all-reduce ``2(N-1)/N``, the others ``(N-1)/N``
of the buffer). Before timing, every variant's parameters after two steps are checked
against the same two steps of plain ``jax.jit`` on one device.

What CPU devices cannot show: the 8 simulated devices share one memory and run a
collective as a memory copy, so the traffic saved by a reduce-scatter against an
all-reduce does not show in step time; the bytes per device and the collectives do.

Run: ``python bench/weight_update_sharding.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
import _timing  # noqa: E402

import jreplicate as jr  # noqa: E402

LAYERS = 4
GLOBAL_BATCH = 64
LR = 1e-3
MIB = 2**20
VARIANTS = ("replicated", "optimizer", "parameters", "hand_fsdp", "hand_zero1")
LIBRARY_LEVELS = ("optimizer", "parameters")
COLUMNS = ["variant", "replicas", "params MiB/device", "opt state MiB/device",
           "state / replicated", "peak MiB", "step ms", "step ms min", "step ms max",
           "vs hand_fsdp", "vs replicated", "reduce-scatter", "reduce-scatter MiB",
           "all-gather", "all-gather MiB", "all-reduce", "all-reduce MiB",
           "ring MiB sent/device", "note"]


# -- model, data, the plan's shard rule --------------------------------------------------
def init_params(width: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``LAYERS`` dense layers ``width -> width`` with biases, He-initialised."""
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(width, width)) * np.sqrt(2.0 / width)).astype(np.float32),
             "b": np.zeros(width, np.float32)} for _ in range(LAYERS)]


def make_batch(width: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(GLOBAL_BATCH, width)).astype(np.float32)
    return x, rng.integers(0, width, size=GLOBAL_BATCH).astype(np.int32)


def per_example_loss(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(_timing.mlp(params, x), y)


def shard_dim(shape: tuple[int, ...], n: int, min_size: int) -> int | None:
    """The dimension a leaf of ``shape`` is sharded along over ``n`` replicas, or None
    (replicated): the largest dimension divisible by ``n`` (ties: the first); scalars,
    empty leaves and leaves under ``min_size`` elements stay replicated."""
    size = int(np.prod(shape)) if shape else 1
    if not shape or size == 0 or size < min_size:
        return None
    fits = [d for d in range(len(shape)) if shape[d] % n == 0]
    return max(fits, key=lambda d: (shape[d], -d)) if fits else None


def shard_spec(shape: tuple[int, ...], n: int, min_size: int, axis: str) -> P:
    d = shard_dim(shape, n, min_size)
    return P() if d is None else P(*([None] * d + [axis]))


# -- measuring ---------------------------------------------------------------------------
def bytes_per_device(tree: Any) -> int:
    """The most bytes of ``tree``'s leaves any one device holds (from their shards)."""
    per: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values(), default=0)


def peak_bytes(compiled: Any) -> int:
    """XLA's peak per device: arguments + outputs + temporaries - aliased (donated)."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16}
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"%(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<op>[a-z][\w\-]*)\("
                          r"(?P<args>[^)]*)\)")
KINDS = ("reduce-scatter", "all-gather", "all-reduce")


def _nbytes(text: str) -> int:
    """Bytes of the array shapes written in ``text`` (``f32[64,512]{1,0}``, tuples)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        if dtype in _DTYPE_BYTES:
            total += _DTYPE_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return total


def collectives(hlo: str) -> dict[str, tuple[int, int]]:
    """``{kind: (count, bytes)}`` of the reduce-scatters, all-gathers and all-reduces of
    an HLO module's text (``compiled.as_text()``). A collective's bytes are the whole
    buffer it reduces or gathers: the larger of its operands and its result (an async
    ``-start``, whose result holds its operands too, counts once, by its result less its
    operands). Operand shapes are looked up by name where the text does not print them."""
    shapes: dict[str, str] = {}
    found = {k: (0, 0) for k in KINDS}
    for line in hlo.splitlines():
        m = _INSTRUCTION.search(line)
        if m is None:
            continue
        shapes[m.group("name")] = m.group("shape")
        op = m.group("op")
        base = op.removesuffix("-start")
        if base not in KINDS or op.endswith("-done"):
            continue
        args = m.group("args")
        operands = _nbytes(args) or sum(_nbytes(shapes.get(name, ""))
                                        for name in re.findall(r"%([\w.\-]+)", args))
        out = _nbytes(m.group("shape"))
        size = max(operands, out - operands) if op.endswith("-start") else max(operands, out)
        count, total = found[base]
        found[base] = (count + 1, total + size)
    return found


def ring_bytes(found: dict[str, tuple[int, int]], n: int) -> float:
    """Bytes each device sends for these collectives on a ring of ``n``."""
    if n <= 1:
        return 0.0
    part = (n - 1) / n
    return (2 * part * found["all-reduce"][1] + part * found["reduce-scatter"][1]
            + part * found["all-gather"][1])


# -- the variants --------------------------------------------------------------------------
@dataclasses.dataclass
class Variant:
    """One way of running the step: ``step()`` runs one donated step on the state it
    holds; ``state()`` that state; ``compiled`` the program, for XLA's analyses."""

    name: str
    step: Callable[[], Any]
    state: Callable[[], tuple[Any, Any]]
    compiled: Any


def hand_variant(name: str, devices: list, params_np, batch_np, tx,
                 min_size: int) -> Variant:
    """``jax.jit`` with in/out shardings: ``hand_fsdp`` shards parameters and optimizer
    state, ``hand_zero1`` the optimizer state only (GSPMD partitions the step)."""
    n = len(devices)
    mesh = Mesh(np.array(devices), ("data",))

    def sharded(tree):
        return jax.tree.map(lambda a: NamedSharding(mesh, shard_spec(a.shape, n, min_size,
                                                                     "data")), tree)

    params = jax.tree.map(jnp.asarray, params_np)
    opt = jax.eval_shape(tx.init, params)
    p_s = sharded(params) if name == "hand_fsdp" else jax.tree.map(
        lambda _: NamedSharding(mesh, P()), params)
    o_s = sharded(opt)
    b_s = NamedSharding(mesh, P("data"))

    def step(batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jnp.mean(per_example_loss(p, x, y)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    jitted = jax.jit(step, in_shardings=((b_s, b_s), p_s, o_s), out_shardings=(p_s, o_s),
                     donate_argnums=(1, 2))
    cell = [jax.device_put(params, p_s), jax.jit(tx.init, out_shardings=o_s)(params)]
    batch = jax.device_put(batch_np, (b_s, b_s))
    compiled = jitted.lower(batch, *cell).compile()

    def one():
        cell[:] = compiled(batch, *cell)
        return cell[0]
    return Variant(name, one, lambda: tuple(cell), compiled)


def strategy_kwargs(level: str | None, min_size: int) -> dict[str, Any]:
    if level is None:
        return {}
    return {"weight_update_sharding": level, "min_weight_shard_size": min_size}


def library_variant(name: str, devices: list, params_np, batch_np, tx,
                    min_size: int) -> Variant:
    """``Replicator(MirroredStrategy(devices, weight_update_sharding=...)).run`` with the
    parameters and optimizer state donated."""
    level = None if name == "replicated" else name
    rep = jr.Replicator(jr.MirroredStrategy(devices=devices,
                                            **strategy_kwargs(level, min_size)))
    n = rep.num_replicas

    def step(ctx, batch, p, o):
        x, y = batch
        g = jax.grad(lambda p: jr.compute_average_loss(per_example_loss(p, x, y),
                                                       GLOBAL_BATCH))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    with rep.scope():
        params = jax.tree.map(jnp.asarray, params_np)
        opt = tx.init(params)
    per = rep.strategy.layout.per_replica
    batch = tuple(jr.PerReplica(jax.device_put(a.reshape(n, -1, *a.shape[1:]), per), rep.mesh)
                  for a in batch_np)
    compiled = compile_library(rep, step, batch, params, opt)
    cell = [params, opt]

    def one():
        cell[:] = rep.run(step, batch, *cell, donate_argnums=(0, 1))
        return cell[0]
    return Variant(name, one, lambda: tuple(cell), compiled)


def compile_library(rep: jr.Replicator, step, batch, params, opt) -> Any:
    """The compiled program ``rep.run`` calls for these arguments, state donated."""
    return rep.compiled(step, batch, params, opt, donate_argnums=(0, 1))


def library_supports_levels() -> str | None:
    """None where ``MirroredStrategy`` takes ``weight_update_sharding``, else why not."""
    try:
        jr.MirroredStrategy(devices=jax.devices()[:1], weight_update_sharding="optimizer")
    except TypeError as e:
        return f"pending: MirroredStrategy takes no weight_update_sharding here ({e})"
    return None


def reference(params_np, batch_np, tx, steps: int):
    """``steps`` steps of plain ``jax.jit`` on one device: what every variant must give
    (its parameters and optimizer state)."""
    @jax.jit
    def step(p, o):
        g = jax.grad(lambda p: jnp.mean(per_example_loss(p, *batch_np)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    p = jax.tree.map(jnp.asarray, params_np)
    o = tx.init(p)
    for _ in range(steps):
        p, o = step(p, o)
    return p, o


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def errors(state, ref, params_np) -> tuple[float, float]:
    """Relative errors of ``state`` against the reference: of the parameters' change
    since the start (L2), and of Adam's first moment (L2; proportional to the gradients,
    so a gradient scaled by N, which Adam's update hides, shows there)."""
    (p, o), (rp, ro) = state, ref
    p0 = _flat(params_np)
    dp = np.linalg.norm(_flat(p) - _flat(rp)) / np.linalg.norm(_flat(rp) - p0)
    mu = lambda opt: _flat(opt[0].mu)  # noqa: E731 - adam's (ScaleByAdamState, EmptyState)
    dmu = np.linalg.norm(mu(o) - mu(ro)) / np.linalg.norm(mu(ro))
    return float(dp), float(dmu)


# -- one replica count, the table -----------------------------------------------------------
def measure(n: int, names: list[str], params_np, batch_np, tx, args,
            ref, pending: dict[str, str]) -> list[list[Any]]:
    """Every variant of ``names`` on the first ``n`` devices: checked, then timed side by
    side; their rows of :data:`COLUMNS`."""
    devices = jax.devices()[:n]
    variants: dict[str, Variant] = {}
    for name in names:
        if name in pending:
            continue
        build = hand_variant if name.startswith("hand_") else library_variant
        v = build(name, devices, params_np, batch_np, tx, args.min_shard_size)
        for _ in range(args.check_steps):
            v.step()
        dp, dmu = errors(v.state(), ref, params_np)
        if dp > args.tolerance or dmu > args.tolerance:
            raise SystemExit(
                f"{name} on {n} devices: after {args.check_steps} steps the parameters' "
                f"change differs from one-device jax.jit by {dp:.1e} and Adam's first "
                f"moment by {dmu:.1e} (relative; > --tolerance {args.tolerance:g})")
        print(f"  {name:11s} N={n}: checked, relative error: parameters {dp:.1e}, "
              f"first moment {dmu:.1e}", flush=True)
        variants[name] = v
    times = _timing.interleaved({k: (v.step, args.steps) for k, v in variants.items()},
                                args.rounds, warmup=1)
    base = variants.get("replicated")
    base_bytes = None if base is None else bytes_per_device(base.state())
    rows = []
    for name in names:
        if name not in variants:
            rows.append([name, n] + [None] * (len(COLUMNS) - 3) + [pending[name]])
            continue
        v = variants[name]
        p, o = v.state()
        found = collectives(v.compiled.as_text())
        ms = [t * 1e3 for t in times[name]]
        rows.append([
            name, n, bytes_per_device(p) / MIB, bytes_per_device(o) / MIB,
            None if base_bytes is None else bytes_per_device((p, o)) / base_bytes,
            peak_bytes(v.compiled) / MIB, statistics.median(ms), min(ms), max(ms),
            _ratio(times, name, "hand_fsdp"), _ratio(times, name, "replicated"),
            found["reduce-scatter"][0], found["reduce-scatter"][1] / MIB,
            found["all-gather"][0], found["all-gather"][1] / MIB,
            found["all-reduce"][0], found["all-reduce"][1] / MIB,
            ring_bytes(found, n) / MIB, _unsharded(name, n, o, base)])
    return rows


def _unsharded(name: str, n: int, opt_state, base: Variant | None) -> str:
    """A note where a library level left the optimizer state replicated on several
    devices (an option accepted but not applied must not pass for a measurement)."""
    if name not in LIBRARY_LEVELS or n == 1 or base is None:
        return ""
    if bytes_per_device(opt_state) < bytes_per_device(base.state()[1]):
        return ""
    return "not sharded: the optimizer state came back replicated"


def _ratio(times: dict[str, list[float]], name: str, other: str) -> float | None:
    """The paired ratio of ``name``'s step time to ``other``'s; None if not timed."""
    return _timing.paired_ratio(times, name, other) if other in times else None


def print_table(rows: list[list[Any]]) -> None:
    head = ("variant", "N", "params", "opt", "/repl", "peak", "ms", "min", "max", "/fsdp",
            "/repl", "RS", "RS MiB", "AG", "AG MiB", "AR", "AR MiB", "ring")
    print(" ".join(f"{h:>8s}" if i else f"{h:11s}" for i, h in enumerate(head)))
    for row in rows:
        if row[2] is None:
            print(f"{row[0]:11s} {row[1]:>8d}  {row[-1]}")
            continue
        cells = [f"{row[0]:11s}", f"{row[1]:>8d}"]
        for v in row[2:-1]:
            cells.append("       -" if v is None else f"{v:8.3f}" if isinstance(v, float)
                         else f"{v:>8d}")
        print(" ".join(cells) + (f"  {row[-1]}" if row[-1] else ""))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="half the width, 3 rounds of 2 steps (a smoke test)")
    ap.add_argument("--width", type=int, default=None, help="layer width (default 1024, "
                    "--quick 512)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (10)")
    ap.add_argument("--steps", type=int, default=None, help="steps per round (5)")
    ap.add_argument("--check-steps", type=int, default=2)
    ap.add_argument("--tolerance", type=float, default=1e-3,
                    help="largest relative error (of the parameters' change, of the first "
                    "moment) after the check steps")
    ap.add_argument("--min-shard-size", type=int, default=1024,
                    help="leaves with fewer elements stay replicated (the library's "
                    "min_weight_shard_size)")
    _record.add_argument(ap)
    args = ap.parse_args(argv)
    width = args.width or (512 if args.quick else 1024)
    args.rounds = args.rounds or (3 if args.quick else 10)
    args.steps = args.steps or (2 if args.quick else 5)
    if max(args.replicas) > len(jax.devices()):
        ap.error(f"--replicas {max(args.replicas)}: only {len(jax.devices())} devices")
    tx = optax.adam(LR)
    params_np, batch_np = init_params(width), make_batch(width)
    why = library_supports_levels()
    pending = {v: why for v in LIBRARY_LEVELS if why is not None and v in args.variants}
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    n_params = sum(a.size for a in jax.tree.leaves(params_np))
    print(f"Adam, MLP {LAYERS} x {width}x{width} + biases ({n_params / 1e6:.2f} M parameters, "
          f"{4 * n_params / MIB:.1f} MiB f32), global batch {GLOBAL_BATCH}, "
          f"{args.rounds} rounds x {args.steps} steps, {jax.devices()[0].platform}, "
          f"load {load_before[0]:.1f}", flush=True)
    ref = reference(params_np, batch_np, tx, args.check_steps)
    rows = []
    for n in args.replicas:
        rows += measure(n, args.variants, params_np, batch_np, tx, args, ref, pending)
    print_table(rows)
    for name, reason in pending.items():
        print(f"{name}: {reason}")
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after. CPU "
          "devices share one memory and run collectives as copies: the saving shows in "
          "bytes per device and in the collectives, not in step time.")
    _record.write(
        args.json, "weight_update_sharding",
        "Weight-update sharding: state per device, peak memory, step time, collectives",
        COLUMNS, rows, model=f"MLP {LAYERS} x {width}x{width} + biases", width=width,
        parameters=n_params, global_batch=GLOBAL_BATCH, optimizer="adam",
        rounds=args.rounds, steps_per_round=args.steps, min_shard_size=args.min_shard_size,
        pending=pending, date=started, load_average_before=list(load_before),
        load_average_after=list(load_after), platform=jax.devices()[0].platform,
        device_kind=jax.devices()[0].device_kind, cpu_cores=os.cpu_count(),
        host=platform.node(), jax=jax.__version__)


if __name__ == "__main__":
    main()
