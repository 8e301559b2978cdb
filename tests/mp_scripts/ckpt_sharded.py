"""State sharded across processes, saved by every process (tests/test_checkpoint_every_process.py).

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 4`` with
``--dir D``. Each process builds the state with ``make_array_from_callback`` from
:func:`reference` (a 32 MiB float32 leaf and an int32 leaf sharded P('replica') over the
8 devices of both processes, a replicated leaf, a NumPy leaf), asserts the sharded ones
are not fully addressable, and saves steps 1 and 2 into ``D/shared``, measuring the peak
of its resident memory during each save (``VmHWM`` after ``/proc/self/clear_refs``; step
1's includes compiling the digest).
Both processes then restore step 2 onto their 2 x 4 devices, each reading its own
shards. Then each gives its own directory ``D/own<p>`` (the directory is not shared):
sharded state is refused on both processes alike, replicated state is written by the
chief, and restored through it.
Prints ``RESULT <json>`` per process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

BIG = (8192, 1024)  # float32: 32 MiB, 16 MiB per process


def reference(step: int, name: str, index: tuple = ()) -> np.ndarray:
    """The leaf ``name`` of step ``step``'s state, or its block ``index`` (slices),
    computed from the global positions alone (no process builds a whole sharded leaf)."""
    shape, dtype = {"big": (BIG, np.float32), "small": ((16, 3), np.int32),
                    "rep": ((4, 5), np.float32), "host": ((7,), np.int16)}[name]
    index = index or tuple(slice(None) for _ in shape)
    ranges = [np.arange(n)[s] for n, s in zip(shape, index, strict=True)]
    flat = np.zeros([len(r) for r in ranges], np.uint64)
    stride = 1
    for d in reversed(range(len(shape))):
        flat = flat + ranges[d].astype(np.uint64).reshape(
            [-1 if k == d else 1 for k in range(len(shape))]) * np.uint64(stride)
        stride *= shape[d]
    mixed = (flat * np.uint64(2654435761) + np.uint64(1000003 * step + len(name))) \
        % np.uint64(1 << 20)
    if np.dtype(dtype).kind == "f":
        return (mixed.astype(np.float64) / 4096.0 - 128.0).astype(dtype)
    return (mixed.astype(np.int64) - (1 << 19)).astype(dtype) if dtype == np.int32 else \
        (mixed % np.uint64(1 << 15)).astype(dtype)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    d = ap.parse_args().dir
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jreplicate.checkpoint import CheckpointError, CheckpointManager
    from jreplicate.replicator import Replicator
    from jreplicate.strategies.multi_worker import MultiWorkerStrategy

    strategy = MultiWorkerStrategy(collective_timeout=30)
    rep = Replicator(strategy)
    me = strategy.worker_index
    mesh = strategy.mesh
    rows, everywhere = NamedSharding(mesh, P("replica")), NamedSharding(mesh, P())

    def state(step):
        def placed(name, sharding):
            return jax.make_array_from_callback(
                reference(step, name).shape if name != "big" else BIG, sharding,
                lambda index: reference(step, name, index))
        return {"big": placed("big", rows), "small": placed("small", rows),
                "rep": placed("rep", everywhere), "host": reference(step, "host")}

    out: dict = {"process": me}
    s1 = state(1)
    out["fully_addressable"] = [s1["big"].is_fully_addressable,
                                s1["small"].is_fully_addressable]
    out["own_bytes"] = sum(s.data.nbytes for s in s1["big"].addressable_shards)
    with CheckpointManager(os.path.join(d, "shared"), rep) as m:
        out["every_process_writes"] = getattr(m, "every_process_writes", None)
        for step in (1, 2):  # step 1 also compiles the digest and warms Orbax up
            s = s1 if step == 1 else state(2)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak resident memory starts again from now
            rss = _status("VmRSS")
            start = time.monotonic()
            m.save(step, s, force=True)
            m.wait_until_finished()  # the write included, background or not
            out[f"save_seconds_{step}"] = time.monotonic() - start
            out[f"hwm_increase_{step}"] = _status("VmHWM") - rss
            del s
        del s1
    with CheckpointManager(os.path.join(d, "shared"), rep) as m:  # every process reads
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state(0))
        step, got = m.restore_or_initialize(lambda: abstract, shardings={
            "big": rows, "small": rows, "rep": None, "host": None})
        out["restored_step"] = step
        out["restored_equal"] = all(
            np.array_equal(np.asarray(s.data), reference(2, name, s.index))
            and s.data.dtype == reference(2, name).dtype
            for name in ("big", "small", "rep", "host") for s in got[name].addressable_shards)
        out["restored_specs"] = [str(got["big"].sharding.spec),
                                 str(got["rep"].sharding.spec)]
        del got
    with CheckpointManager(os.path.join(d, "fresh"), rep) as m:  # nothing saved: init_fn
        step, got = m.restore_or_initialize(lambda: state(3))
        out["fresh"] = [step, got["big"].sharding == rows, got["rep"].sharding == everywhere,
                        all(np.array_equal(np.asarray(s.data), reference(3, name, s.index))
                            for name in ("big", "small", "rep", "host")
                            for s in got[name].addressable_shards)]
        del got
    own = os.path.join(d, f"own{me}")  # each process its own directory: not shared
    with CheckpointManager(own, rep) as m:
        out["own_every_process_writes"] = getattr(m, "every_process_writes", None)
        try:
            m.save(1, state(1), force=True)
            out["own_sharded"] = "saved"
        except CheckpointError as e:
            out["own_sharded"] = str(e)
        replicated = {"rep": state(1)["rep"], "host": reference(1, "host")}
        out["own_replicated"] = m.save(1, replicated, force=True)
        m.wait_until_finished()
        out["own_steps"] = m.complete_steps()
    with CheckpointManager(own, rep) as m:  # the chief reads, every process receives
        step, got = m.restore_or_initialize(lambda: replicated)
        out["own_restored"] = [step] + [
            bool(np.array_equal(np.asarray(got[k].addressable_data(0)), reference(1, k)))
            for k in ("rep", "host")]
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
