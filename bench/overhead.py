"""Per-step overhead of jreplicate vs a hand-written shard_map step vs Keras DataParallel.

One data-parallel train step of an MLP 784-1024-1024-10 (softmax cross-entropy, SGD with
momentum 0.9, global batch 256 = 32 per replica on 8 simulated CPU devices), implemented
five ways on the same parameters and the same synthetic batch:

* ``jreplicate``: ``Replicator(MirroredStrategy()).run(step, batch, params, opt)`` with a
  pre-assembled batch (a pytree of ``jr.PerReplica`` taken once from ``prepare_input``);
* ``jreplicate+input``: the same, but ``run(step, iterator, ...)`` reads and places a
  batch through ``prepare_input`` every step (input path included);
* ``hand-written``: ``jax.jit(jax.shard_map(step, ...))`` with the batch pre-sharded as
  ``NamedSharding(mesh, P("replica"))`` and replicated params; gradients are summed by
  the implicit psum of the unvarying params, the loss is scaled by the global batch;
* ``keras-jit``: Keras 3 ``DataParallel`` on the JAX backend, a ``keras.Sequential`` of
  the same shape, and the documented custom JAX train step (``jax.jit`` over
  ``model.stateless_call`` + ``optimizer.stateless_apply``): the compute-equivalent
  Keras path;
* ``keras-tob``: the same model compiled with ``model.compile`` and stepped with
  ``model.train_on_batch`` (the plain Keras user API; it returns a Python float, so it
  synchronises with the device every step).

The losses of the first steps are checked to agree before timing (jreplicate must match
the hand-written step to 1e-6). Then every implementation is warmed up and timed in
interleaved rounds (``--rounds`` rounds of ``--steps`` steps each, ``block_until_ready``
at the end of each block, the order rotated every round); the table shows the median step
time over rounds, its ratio to the hand-written step's median, and the median of the
per-round ratios ("paired", which cancels slow drifts of background load). A second table
repeats everything for a tiny MLP 16-32-32-10 (25x more steps per block), where compute
is negligible and the step time is mostly per-call host overhead (``--no-tiny`` skips it).

Run: ``python bench/overhead.py`` (about 1-1.5 minutes on a 2-core CPU) or ``--quick``.
Without Keras (or with ``--no-keras``) the Keras rows are left out; ``--sizes`` and
``--global-batch`` set the large MLP (the GPU mode of ``bench/report.py`` times a wider
one, whose step is compute-bound on an accelerator).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["KERAS_BACKEND"] = "jax"

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jreplicate as jr  # noqa: E402

try:
    import keras
except ImportError:  # the Keras rows are left out
    keras = None

sys.path.insert(0, os.path.dirname(__file__))
import _record  # noqa: E402
from _timing import time_block  # noqa: E402

SIZES = (784, 1024, 1024, 10)
TINY_SIZES = (16, 32, 32, 10)  # compute-free: the step time is framework overhead
GLOBAL_BATCH = 256
LR, MOMENTUM = 0.05, 0.9
CHECK_STEPS = 5


# -- model, data -----------------------------------------------------------------------
def init_params(sizes, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"w": (rng.normal(size=(a, b)) * np.sqrt(2.0 / a)).astype(np.float32),
             "b": np.zeros(b, np.float32)} for a, b in zip(sizes[:-1], sizes[1:])]


def make_batch(sizes, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(GLOBAL_BATCH, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], size=GLOBAL_BATCH).astype(np.int32)
    return x, y


def mlp(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def per_example_loss(logits, y):
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]


def tx() -> optax.GradientTransformation:
    return optax.sgd(LR, momentum=MOMENTUM)


# -- implementations -------------------------------------------------------------------
# Each builder returns (step, loss): step() runs one train step and returns something to
# block on; loss() is the loss of the last step as a float.
Impl = tuple[Callable[[], object], Callable[[], float]]


def build_jreplicate(params_np, x, y, n: int, from_iterator: bool) -> Impl:
    rep = jr.Replicator(jr.MirroredStrategy())
    b = GLOBAL_BATCH // n
    optimizer = tx()
    with rep.scope():
        params = jax.tree.map(jnp.asarray, params_np)
        opt = optimizer.init(params)

    def input_fn(ctx):
        i = ctx.input_pipeline_id
        xb, yb = x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]
        return lambda: (xb, yb)

    def step(ctx, batch, params, opt):
        xb, yb = batch

        def loss_fn(p):
            return jr.compute_average_loss(per_example_loss(mlp(p, xb), yb), GLOBAL_BATCH)

        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt = optimizer.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, ctx.all_sum(loss)

    iterator = rep.prepare_input(input_fn,
                                 replication_mode=jr.InputReplicationMode.PER_REPLICA)
    inputs = iterator if from_iterator else iterator.get_next()
    state = {"params": params, "opt": opt, "loss": None}

    def run():
        state["params"], state["opt"], state["loss"] = rep.run(
            step, inputs, state["params"], state["opt"])
        return state["loss"]

    return run, lambda: float(state["loss"])


def build_hand_written(params_np, x, y, n: int) -> Impl:
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(AxisType.Auto,))
    optimizer = tx()
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("replica"))
    params = jax.device_put(params_np, replicated)
    opt = jax.device_put(optimizer.init(params), replicated)
    xb, yb = jax.device_put(x, sharded), jax.device_put(y, sharded)

    def body(params, opt, xb, yb):
        def loss_fn(p):
            return per_example_loss(mlp(p, xb), yb).sum() / GLOBAL_BATCH

        # params are unvarying over "replica", so their gradient comes back psum-ed.
        loss, g = jax.value_and_grad(loss_fn)(params)
        updates, opt = optimizer.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, jax.lax.psum(loss, "replica")

    step = jax.jit(jax.shard_map(body, mesh=mesh,
                                 in_specs=(P(), P(), P("replica"), P("replica")),
                                 out_specs=(P(), P(), P())))
    state = {"params": params, "opt": opt, "loss": None}

    def run():
        state["params"], state["opt"], state["loss"] = step(
            state["params"], state["opt"], xb, yb)
        return state["loss"]

    return run, lambda: float(state["loss"])


def _keras_model(params_np) -> keras.Model:
    sizes = [params_np[0]["w"].shape[0]] + [layer["b"].shape[0] for layer in params_np]
    layers = [keras.Input((sizes[0],))]
    layers += [keras.layers.Dense(s, activation="relu") for s in sizes[1:-1]]
    layers += [keras.layers.Dense(sizes[-1])]
    model = keras.Sequential(layers)
    model.set_weights([a for layer in params_np for a in (layer["w"], layer["b"])])
    model.compile(optimizer=keras.optimizers.SGD(LR, momentum=MOMENTUM),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _keras_batch(distribution, x, y):
    def put(a):
        return jax.device_put(a, distribution.get_data_layout(a.shape).backend_layout)
    return put(x), put(y)


def build_keras_jit(params_np, x, y, distribution) -> Impl:
    model = _keras_model(params_np)
    model.optimizer.build(model.trainable_variables)
    loss_obj = model.loss
    xb, yb = _keras_batch(distribution, x, y)

    def body(tv, ntv, ov, xb, yb):
        def loss_fn(tv):
            logits, new_ntv = model.stateless_call(tv, ntv, xb, training=True)
            return loss_obj(yb, logits), new_ntv

        (loss, ntv), g = jax.value_and_grad(loss_fn, has_aux=True)(tv)
        tv, ov = model.optimizer.stateless_apply(ov, g, tv)
        return tv, ntv, ov, loss

    step = jax.jit(body)
    state = {"tv": [v.value for v in model.trainable_variables],
             "ntv": [v.value for v in model.non_trainable_variables],
             "ov": [v.value for v in model.optimizer.variables], "loss": None}

    def run():
        state["tv"], state["ntv"], state["ov"], state["loss"] = step(
            state["tv"], state["ntv"], state["ov"], xb, yb)
        return state["loss"]

    return run, lambda: float(state["loss"])


def build_keras_tob(params_np, x, y, distribution) -> Impl:
    model = _keras_model(params_np)
    xb, yb = _keras_batch(distribution, x, y)
    state = {"loss": None}

    def run():
        state["loss"] = model.train_on_batch(xb, yb)
        return None

    return run, lambda: float(state["loss"])


# -- driver ----------------------------------------------------------------------------
def check_losses(impls: dict[str, Impl], steps: int) -> None:
    traj = {}
    for name, (run, loss) in impls.items():
        traj[name] = []
        for _ in range(steps):
            run()
            traj[name].append(loss())
    ref = np.array(traj["hand-written"])
    print(f"loss trajectory over the first {steps} steps (same init, same batch):")
    for name, t in traj.items():
        err = np.max(np.abs(np.array(t) - ref) / np.abs(ref))
        print(f"  {name:17s} " + " ".join(f"{v:.6f}" for v in t) + f"   max rel diff {err:.1e}")
    # On CPU jreplicate's program is the hand-written one (bit-identical losses); on a GPU
    # each compilation autotunes its own matmul algorithms (TF32 by default), so the two
    # agree to TF32's precision only.
    exact = 1e-6 if jax.devices()[0].platform == "cpu" else 2e-3
    for name, t in traj.items():
        tol = exact if name.startswith("jreplicate") else max(exact, 1e-3)
        np.testing.assert_allclose(t, ref, rtol=tol, err_msg=name)
    print(f"  check passed (jreplicate rtol {exact:g}, keras rtol {max(exact, 1e-3):g} vs "
          "hand-written)\n")


def bench(sizes, rounds: int, steps: int, distribution) -> list[list]:
    """Builds the implementations for an MLP of ``sizes``, checks and times them."""
    n = jax.device_count()
    params_np = init_params(sizes)
    x, y = make_batch(sizes)
    impls: dict[str, Impl] = {
        "hand-written": build_hand_written(params_np, x, y, n),
        "jreplicate": build_jreplicate(params_np, x, y, n, from_iterator=False),
        "jreplicate+input": build_jreplicate(params_np, x, y, n, from_iterator=True),
    }
    if distribution is not None:
        impls["keras-jit"] = build_keras_jit(params_np, x, y, distribution)
        impls["keras-tob"] = build_keras_tob(params_np, x, y, distribution)
    print(f"== MLP {'-'.join(map(str, sizes))}, global batch {GLOBAL_BATCH} "
          f"({GLOBAL_BATCH // n} per replica), SGD momentum {MOMENTUM}")
    check_losses(impls, CHECK_STEPS)  # also compiles every step

    for run, _ in impls.values():  # warm-up
        time_block(run, 3)
    times: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # rotate to spread drift
        for name in order:
            times[name].append(time_block(impls[name][0], steps))

    med = {name: statistics.median(t) for name, t in times.items()}
    hw = med["hand-written"]
    # Paired ratio: each round times every implementation back to back, so the per-round
    # ratio cancels slow drifts of background load; its median is the robust estimate.
    paired = {name: statistics.median(a / b for a, b in zip(t, times["hand-written"]))
              for name, t in times.items()}
    print(f"step time over {rounds} rounds x {steps} steps (ms/step), ratios to hand-written")
    print(f"{'implementation':18s} {'median':>8s} {'min':>8s} {'max':>8s} "
          f"{'median/hw':>10s} {'paired/hw':>10s}")
    for name in names:
        t = times[name]
        print(f"{name:18s} {med[name] * 1e3:8.3f} {min(t) * 1e3:8.3f} {max(t) * 1e3:8.3f} "
              f"{med[name] / hw:10.3f} {paired[name]:10.3f}")
    print()
    for a, b in [("jreplicate", "hand-written"), ("keras-jit", "hand-written"),
                 ("keras-tob", "hand-written"), ("jreplicate", "keras-jit"),
                 ("jreplicate", "keras-tob")]:
        if a not in med or b not in med:
            continue
        print(f"{a:10s} / {b:12s}  {med[a] / med[b]:.3f}")
    print()
    model = "MLP " + "-".join(map(str, sizes))
    return [[model, name, med[name] * 1e3, min(times[name]) * 1e3, max(times[name]) * 1e3,
             med[name] / hw, paired[name]] for name in names]


def main() -> None:
    global GLOBAL_BATCH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--steps", type=int, default=4, help="steps per timed block (default 4)")
    ap.add_argument("--quick", action="store_true",
                    help="3 rounds x 2 steps, smoke test of the script")
    ap.add_argument("--no-tiny", action="store_true",
                    help="skip the overhead-bound (tiny MLP) table")
    ap.add_argument("--no-keras", action="store_true",
                    help="leave out the Keras rows (left out anyway without Keras)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="the large MLP's layer sizes (default %(default)s)")
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                    help="examples per step over all replicas (default %(default)s)")
    _record.add_argument(ap)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 3, 2
    GLOBAL_BATCH = args.global_batch
    sizes = tuple(int(v) for v in args.sizes.split(","))
    use_keras = keras is not None and not args.no_keras
    print(f"jax {jax.__version__}, keras {keras.__version__ if use_keras else '(not used)'}, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} CPU "
          "cores\n")
    distribution = None
    if use_keras:
        distribution = keras.distribution.DataParallel(
            devices=keras.distribution.list_devices())
        keras.distribution.set_distribution(distribution)
    t0 = time.perf_counter()
    rows = bench(sizes, args.rounds, args.steps, distribution)
    if not args.no_tiny:
        # Same comparison where compute is negligible: exposes per-call host overhead.
        rows += bench(TINY_SIZES, args.rounds, args.steps * 25, distribution)
    print(f"total {time.perf_counter() - t0:.0f} s")
    _record.write(args.json, "overhead",
                  "Step time: jreplicate against hand-written shard_map and Keras 3",
                  ["model", "implementation", "median ms", "min ms", "max ms",
                   "median / hand-written", "paired / hand-written"], rows,
                  rounds=args.rounds, steps=args.steps,
                  keras=keras.__version__ if use_keras else None, global_batch=GLOBAL_BATCH,
                  platform=jax.devices()[0].platform, device_kind=jax.devices()[0].device_kind)


if __name__ == "__main__":
    main()
