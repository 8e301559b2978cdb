"""Background checkpoint writes across processes: a failed write, a process killed mid-write.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 4`` with
``--dir D --mode M``. The state is one float32 array sharded over the 8 replicas (each
process holds half of it, so each writes its own shards) and one replicated int32
array; the values of step ``s`` are :func:`reference` ``(s)``. Modes:

* ``fail``: step 1 is written; process 1's write of step 2 fails
  (``jreplicate.testing.fail_checkpoint_write``); every process prints
  ``RESULT fail <pid> <seconds> <error>`` for the error ``wait_until_finished`` raised,
  then step 3 is written and ``LISTED <pid> <steps>`` printed.
* ``kill``: step 1 is written; step 2's write is slowed (2 s) and process ``--victim``
  kills itself (SIGKILL) ``--delay`` seconds after ``save`` returned, during the write
  or after its commit: the group fails.
* ``restore``: prints ``RESTORED <pid> <step> <bit-equal to reference(step)>`` and the
  directory's entries after a save (``AFTER <pid> <names>``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jreplicate.testing as jrt  # noqa: E402
from jreplicate.checkpoint import CheckpointError, CheckpointManager  # noqa: E402
from jreplicate.strategies.multi_worker import MultiWorkerStrategy  # noqa: E402

N = 1 << 18  # float32: 1 MiB, 128 KiB per replica


def reference(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(N).astype(np.float32),
            "n": rng.integers(-2**31, 2**31 - 1, 16, dtype=np.int32)}


def placed(strategy: MultiWorkerStrategy, host: dict) -> dict:
    sharded = NamedSharding(strategy.mesh, P(strategy.axis_name))
    replicated = NamedSharding(strategy.mesh, P())
    return {"w": jax.make_array_from_callback((N,), sharded, lambda i: host["w"][i]),
            "n": jax.make_array_from_callback((16,), replicated, lambda i: host["n"][i])}


def template(strategy: MultiWorkerStrategy):
    sharded = NamedSharding(strategy.mesh, P(strategy.axis_name))
    return (lambda: {"w": jnp.zeros(N, jnp.float32), "n": jnp.zeros(16, jnp.int32)},
            {"w": sharded, "n": None})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mode", choices=("fail", "kill", "restore"), required=True)
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--delay", type=float, default=0.5)
    a = ap.parse_args()
    strategy = MultiWorkerStrategy(collective_timeout=20)
    me = strategy.process_index
    m = CheckpointManager(a.dir, strategy, max_to_keep=3)
    assert m.every_process_writes
    if a.mode == "restore":
        init, shardings = template(strategy)
        step, state = m.restore_or_initialize(init, shardings=shardings)
        assert not state["w"].is_fully_addressable  # restored sharded across processes
        got = {k: np.asarray(jax.experimental.multihost_utils.process_allgather(v, tiled=True))
               for k, v in state.items()}
        ref = reference(step)
        same = all(np.array_equal(got[k].view(np.uint8), ref[k].view(np.uint8)) for k in ref)
        print(f"RESTORED {me} {step} {same}", flush=True)
        m.save(step + 1, placed(strategy, reference(step + 1)))
        m.close()
        print(f"AFTER {me} {sorted(os.listdir(a.dir))}", flush=True)
        return
    m.save(1, placed(strategy, reference(1)))
    m.wait_until_finished()
    if a.mode == "fail":
        jrt.fail_checkpoint_write(m, process=1)
        m.save(2, placed(strategy, reference(2)))
        t0 = time.monotonic()
        try:
            m.wait_until_finished()
            print(f"RESULT fail {me} {time.monotonic() - t0:.2f} none", flush=True)
        except CheckpointError as e:
            print(f"RESULT fail {me} {time.monotonic() - t0:.2f} {e}", flush=True)
        m.save(3, placed(strategy, reference(3)))
        m.close()
        print(f"LISTED {me} {m.complete_steps()}", flush=True)
        return
    jrt.delay_checkpoint_write(m, 2.0)  # every process: the write of step 2 is slow
    m.save(2, placed(strategy, reference(2)))
    if me == a.victim:
        threading.Timer(a.delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    print(f"SAVED {me}", flush=True)
    m.wait_until_finished()
    m.close()
    print(f"SURVIVED {me}", flush=True)  # the kill came after the commit, or comes now
    if me == a.victim:
        time.sleep(60)


if __name__ == "__main__":
    main()
