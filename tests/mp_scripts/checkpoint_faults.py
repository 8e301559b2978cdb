"""Checkpoint faults across processes: every process must raise the same error, promptly.

Run under ``python -m jreplicate.cluster.launch --nproc 2`` with ``--dir D`` (``D/not_a_dir`` is a
file). The chief alone touches the directory, so each fault is seen by the chief only;
the script prints ``RESULT <scenario> <outcome> <seconds> <message>`` per scenario, where
the outcome is ``ok`` or the exception type, and ``DONE``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import numpy as np  # noqa: E402

from jreplicate.checkpoint import CheckpointManager  # noqa: E402
from jreplicate.replicator import Replicator  # noqa: E402
from jreplicate.strategies.multi_worker import MultiWorkerStrategy  # noqa: E402

COLLECTIVE_TIMEOUT = 30  # a fault not shared would surface after this, as a ClusterError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    d = ap.parse_args().dir
    strategy = MultiWorkerStrategy(collective_timeout=COLLECTIVE_TIMEOUT)
    rep = Replicator(strategy)
    me = strategy.worker_index

    def f32():
        return {"w": np.ones((3, 4), np.float32), "b": np.zeros(4, np.float32)}

    def in_the_way():
        CheckpointManager(os.path.join(d, "not_a_dir"), rep)

    def parent_is_a_file():
        CheckpointManager(os.path.join(d, "not_a_dir", "ckpt"), rep)

    held = []

    def second_manager():
        held.append(CheckpointManager(os.path.join(d, "shared"), rep))
        CheckpointManager(os.path.join(d, "shared"), rep)

    def after_close():
        held.pop().close()
        CheckpointManager(os.path.join(d, "shared"), rep).close()

    def other_dtype():
        with CheckpointManager(os.path.join(d, "dtype"), rep) as m:
            _, state = m.restore_or_initialize(f32)
            m.save(1, state)
            m.restore_or_initialize(lambda: {"w": np.ones((3, 4), np.int32),
                                             "b": np.zeros(4, np.float32)})

    def damaged_newest():
        path = os.path.join(d, "damaged")
        with CheckpointManager(path, rep) as m:
            _, state = m.restore_or_initialize(f32)
            m.save(1, state)
            m.save(2, {"w": state["w"] * 2, "b": state["b"]})
            m.wait_until_finished()  # committed (it is written in the background)
            if me == 0:  # the data of step 2 is lost after its commit
                shutil.rmtree(os.path.join(path, "2", "default", "d"))
            step, restored = m.restore_or_initialize(f32)
            return f"step={step} w={float(np.asarray(restored['w']).max())}"

    def empty_nodes():  # an added None and a one-element wrapper: restored, not damage
        with CheckpointManager(os.path.join(d, "damaged"), rep) as m:
            step, restored = m.restore_or_initialize(lambda: ({**f32(), "n": None},))
            return f"step={step} w={float(np.asarray(restored[0]['w']).max())}"

    def all_damaged():  # every step damaged: an error everywhere, not step 0
        if me == 0:
            shutil.rmtree(os.path.join(d, "damaged", "1", "default", "d"))
        with CheckpointManager(os.path.join(d, "damaged"), rep) as m:
            m.restore_or_initialize(f32)

    def init_differs():  # process 1 builds another state: an error everywhere, no hang
        with CheckpointManager(os.path.join(d, "init_differs"), rep) as m:
            m.restore_or_initialize(lambda: {**f32(), **({"x": np.zeros(1)} if me else {})})

    scenarios = [("in_the_way", in_the_way), ("parent_is_a_file", parent_is_a_file),
                 ("second_manager", second_manager), ("after_close", after_close),
                 ("other_dtype", other_dtype), ("damaged_newest", damaged_newest),
                 ("empty_nodes", empty_nodes), ("all_damaged", all_damaged),
                 ("init_differs", init_differs)]
    for name, fn in scenarios:
        t0 = time.monotonic()
        try:
            out = fn()
            print(f"RESULT {name} ok {time.monotonic() - t0:.2f} {out}", flush=True)
        except Exception as e:  # report, and carry on with the next scenario
            print(f"RESULT {name} {type(e).__name__} {time.monotonic() - t0:.2f} "
                  f"{str(e).splitlines()[0]}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
