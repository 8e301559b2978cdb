"""The main job: train an MLP on scikit-learn's digits across 8 replicas.

Run it with ``python -m jreplicate.demo`` (or the ``jreplicate-demo`` script). On a
machine without accelerators it simulates 8 CPU devices. It compiles the step (shown as
its own phase), trains with a progress bar on stderr (plain lines every 10 % of the
steps when stderr is not a terminal, e.g. piped or under ``jreplicate.cluster.launch``) and
prints the held-out accuracy on stdout.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from typing import TextIO

DEFAULT_STEPS = 600
DEFAULT_GLOBAL_BATCH = 128
DEFAULT_LR = 3e-3
DEFAULT_DEVICES = 8
TARGET_ACCURACY = 0.95
# A loss that rises above this multiple of the first step's loss has diverged.
_DIVERGENCE_FACTOR = 10.0
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _simulate_devices(n: int | None) -> None:
    """Asks XLA for ``n`` CPU devices; must run before JAX initialises its backend.

    Args:
      n: the number of CPU devices, or None for the count already in ``XLA_FLAGS``
        (8 when there is none). An explicit ``n`` replaces a count in ``XLA_FLAGS``.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if n is None:
        if _DEVICE_FLAG in flags:
            return
        n = DEFAULT_DEVICES
    flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={n}".strip()


def load_digits_split(seed: int = 0):
    """scikit-learn's bundled 8x8 digits (1797 images), scaled and split 80/20."""
    import numpy as np
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as e:
        raise ImportError(
            "the demo's data set is scikit-learn's bundled digits, and scikit-learn is not "
            "installed: pip install scikit-learn (jreplicate itself does not need it)."
        ) from e

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y.astype(np.int32), test_size=0.2, random_state=seed,
                            stratify=y)


class _Progress:
    """Training progress on a stream: a tqdm bar on a terminal (where tqdm is installed),
    else plain lines.

    The bar starts after the first (compiling) step, so its rate and ETA measure
    training steps only. Off a terminal (a pipe, a log file, the launcher's prefixed
    output) a bar would be one endless line of carriage returns, so one line is printed
    every 10 % of the steps instead: step, loss, steps per second.
    """

    def __init__(self, stream: TextIO | None, steps: int, desc: str):
        self.stream = stream
        self.steps = steps
        self.start = time.perf_counter()
        self.last_report = self.start
        self.every = max(1, math.ceil(steps / 10))
        self.bar = None
        if stream is not None and _isatty(stream) and steps > 1:
            try:
                from tqdm import tqdm
            except ImportError:  # no bar without tqdm: the plain lines instead
                return
            self.bar = tqdm(total=steps, initial=1, desc=desc, file=stream,
                            mininterval=0.5, dynamic_ncols=True)

    def due(self, step: int) -> bool:
        """Whether step ``step`` (1-based) should be shown (and its loss fetched)."""
        if self.stream is None:
            return step % self.every == 0 or step == self.steps
        if self.bar is not None:
            return step == self.steps or time.perf_counter() - self.last_report >= 0.5
        return step % self.every == 0 or step == self.steps

    def update(self, step: int, loss: float | None) -> None:
        """Records that ``step`` steps are done; shows ``loss`` if given."""
        if self.bar is not None:
            if loss is not None:
                self.last_report = time.perf_counter()
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.update(step - self.bar.n)
        elif self.stream is not None and loss is not None:
            elapsed = time.perf_counter() - self.start
            rate = (step - 1) / elapsed if elapsed > 0 else float("nan")
            self.stream.write(f"step {step:>{len(str(self.steps))}}/{self.steps}  "
                              f"loss {loss:.4f}  {rate:.1f} steps/s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def train(*, steps: int = DEFAULT_STEPS, global_batch: int = DEFAULT_GLOBAL_BATCH,
          lr: float = DEFAULT_LR, hidden: int = 256, seed: int = 0,
          progress: bool | TextIO = True) -> dict:
    """Trains the MLP with MirroredStrategy on all local devices.

    Args:
      steps: training steps (at least 1).
      global_batch: examples per step over all replicas; divisible by the replicas.
      lr: Adam's learning rate.
      hidden: width of the hidden layer.
      seed: seed of the initial parameters, the data split and the batches.
      progress: True to report progress on ``sys.stderr``, False for none, or a
        stream to report on. On a terminal it is a progress bar; otherwise one line
        every 10 % of the steps. The first step, which compiles, is reported first
        as its own phase.

    Returns:
      A dict: ``accuracy`` (held out), ``final_loss``, ``first_loss``, ``max_loss`` and
      ``max_loss_step`` (1-based), ``diverged`` (the loss became non-finite or rose above
      10x its first value; training stops early on a non-finite loss),
      ``steps_run``, ``compile_seconds`` (first step), ``train_seconds`` (all steps),
      ``num_replicas`` and ``test_examples``.

    Raises:
      ValueError: ``steps`` or ``global_batch`` is not positive, or ``global_batch``
        is not divisible by the number of replicas.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be at least 1, got {global_batch}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jreplicate as jr

    stream = sys.stderr if progress is True else (progress or None)
    x_train, x_test, y_train, y_test = load_digits_split(seed)
    rep = jr.Replicator(jr.MirroredStrategy())
    if global_batch % rep.num_replicas:
        raise ValueError(
            f"global_batch={global_batch} is not divisible by the {rep.num_replicas} "
            f"replicas; use a multiple of {rep.num_replicas}, e.g. "
            f"{max(1, round(global_batch / rep.num_replicas)) * rep.num_replicas}.")

    def input_fn(ctx: jr.InputContext):
        b = ctx.get_per_replica_batch_size(global_batch)
        rng = np.random.default_rng(seed + ctx.input_pipeline_id)
        while True:  # an endless shuffled stream, one per-replica batch per element
            idx = rng.choice(len(x_train), size=b, replace=b > len(x_train))
            yield x_train[idx], y_train[idx]

    with rep.scope():
        k1, k2 = jax.random.split(jax.random.key(seed))
        params = {
            "w1": jax.random.normal(k1, (64, hidden)) * (2 / 64) ** 0.5,
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, 10)) * (1 / hidden) ** 0.5,
            "b2": jnp.zeros(10),
        }
        tx = optax.adam(lr)
        opt_state = tx.init(params)

    def logits_fn(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]

    def train_step(ctx: jr.ReplicaContext, batch, params, opt_state):
        x, y = batch

        def loss_fn(p):
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits_fn(p, x), y)
            return jr.compute_average_loss(per_example, global_batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)  # grads: summed over replicas
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ctx.all_sum(loss)

    inputs = rep.prepare_input(input_fn, replication_mode=jr.InputReplicationMode.PER_REPLICA,
                               prefetch_on_device=True)
    start = time.perf_counter()
    if stream is not None:
        stream.write("compiling the step (and running it once)... ")
        stream.flush()
    params, opt_state, loss = rep.run(train_step, inputs, params, opt_state)
    losses = [loss]
    first_loss = float(loss)  # waits for the compiled step to finish
    compile_seconds = time.perf_counter() - start
    if stream is not None:
        stream.write(f"done in {compile_seconds:.1f} s\n")
        stream.flush()

    report = _Progress(stream, steps, f"training on {rep.num_replicas} replicas")
    report.update(1, first_loss if report.bar is not None or report.due(1) else None)
    steps_run = 1
    try:
        for step in range(2, steps + 1):
            params, opt_state, loss = rep.run(train_step, inputs, params, opt_state)
            losses.append(loss)
            steps_run = step
            if report.due(step):
                value = float(loss)  # waits for this step: the count shown is exact
                report.update(step, value)
                if not math.isfinite(value):
                    break  # diverged: the remaining steps cannot recover
            else:
                report.update(step, None)
    finally:
        report.close()
        rep.finalize()
    train_time = time.perf_counter() - start
    history = np.asarray(jax.device_get(losses), dtype=np.float64)
    finite = np.isfinite(history)
    peak = int(np.argmax(np.where(finite, history, np.inf)))
    predictions = np.asarray(jax.jit(logits_fn)(params, x_test)).argmax(-1)
    return {"accuracy": float((predictions == y_test).mean()),
            "final_loss": float(history[-1]), "first_loss": float(history[0]),
            "max_loss": float(history[peak]), "max_loss_step": peak + 1,
            "diverged": bool(not finite.all()
                             or history.max() > _DIVERGENCE_FACTOR * history[0]),
            "steps_run": steps_run, "compile_seconds": compile_seconds,
            "train_seconds": train_time, "num_replicas": rep.num_replicas,
            "test_examples": int(len(y_test))}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jreplicate.demo", description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Exit status: 0 when the held-out accuracy reaches "
               f"{TARGET_ACCURACY}, 1 when it does not (with the reason on stderr), "
               "2 for bad arguments.")
    parser.add_argument("--devices", type=_positive_int, default=None,
                        help="CPU devices to simulate when there is no accelerator "
                             f"(default: the count in XLA_FLAGS, else {DEFAULT_DEVICES}); "
                             "ignored on GPU/TPU, where every local device is used")
    parser.add_argument("--steps", type=_positive_int, default=DEFAULT_STEPS,
                        help="training steps")
    parser.add_argument("--global-batch", type=_positive_int, default=DEFAULT_GLOBAL_BATCH,
                        help="examples per step over all replicas (a multiple of the "
                             "number of devices)")
    parser.add_argument("--lr", type=_positive_float, default=DEFAULT_LR,
                        help="Adam learning rate")
    parser.add_argument("--seed", type=_non_negative_int, default=0,
                        help="seed of the initial parameters, data split and batches")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    _simulate_devices(args.devices)
    import jax

    platform = jax.devices()[0].platform
    n = jax.device_count()
    if args.devices is not None and platform == "cpu" and n != args.devices:
        print(f"note: --devices {args.devices} ignored: JAX was already initialised with "
              f"{n} CPU devices in this process", file=sys.stderr)
    if args.global_batch % n:
        parser.error(f"--global-batch {args.global_batch} is not divisible by the {n} "
                     f"devices; use a multiple of {n}")
    print(f"jreplicate demo: {n} {platform} devices, global batch {args.global_batch}, "
          f"{args.steps} steps, lr {args.lr:g}", flush=True)
    try:
        m = train(steps=args.steps, global_batch=args.global_batch, lr=args.lr, seed=args.seed)
    except ImportError as e:  # the data set's scikit-learn is missing: say so, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"held-out accuracy: {m['accuracy']:.4f} on {m['test_examples']} digits "
          f"(final loss {m['final_loss']:.4f}; compile {m['compile_seconds']:.1f}s, "
          f"{m['steps_run']} steps in {m['train_seconds']:.1f}s on {m['num_replicas']} "
          f"replicas)", flush=True)
    if m["diverged"]:
        stopped = (f"; stopped at step {m['steps_run']} of {args.steps}"
                   if m["steps_run"] < args.steps else "")
        print(f"error: training diverged with --lr {args.lr:g}: the loss rose from "
              f"{m['first_loss']:.4g} (step 1) to {m['max_loss']:.4g} "
              f"(step {m['max_loss_step']}){stopped}. The learning rate is too large; "
              f"try a smaller one, e.g. --lr {min(DEFAULT_LR, args.lr / 10):g}"
              f"{' (the default)' if args.lr / 10 >= DEFAULT_LR else ''}.",
              file=sys.stderr)
        return 1
    if m["accuracy"] < TARGET_ACCURACY:
        hints = []
        if args.steps < DEFAULT_STEPS:
            hints.append(f"more steps (--steps {DEFAULT_STEPS})")
        if args.lr < DEFAULT_LR:
            hints.append(f"a larger learning rate (--lr {DEFAULT_LR:g})")
        elif args.lr > DEFAULT_LR:
            hints.append(f"a smaller learning rate (--lr {DEFAULT_LR:g})")
        hint = f"; try {' or '.join(hints)}" if hints else ""
        print(f"error: held-out accuracy {m['accuracy']:.4f} is below the target "
              f"{TARGET_ACCURACY} after {args.steps} steps with --lr {args.lr:g}{hint}.",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
