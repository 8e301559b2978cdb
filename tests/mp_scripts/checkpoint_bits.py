"""A checkpoint restored across processes comes back bit for bit (-0.0, NaN payloads,
bfloat16, int4, bool, complex; uint4 and float8_e4m3, stored as their bits), on every
process, and init_fn()'s NaN initialises.

Run under ``python -m jreplicate.cluster.launch --nproc 2`` with ``--dir D``; prints
``RESULT <name> <same bits on this process>`` per leaf and scenario, then ``DONE``.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from jreplicate.checkpoint import CheckpointManager  # noqa: E402
from jreplicate.replicator import Replicator  # noqa: E402
from jreplicate.strategies.multi_worker import MultiWorkerStrategy  # noqa: E402


def state() -> dict:
    return {"f32": np.array([-0.0, np.inf, 1e-45], np.float32),
            "nan": np.array([0x7FC00001, 0xFFC00000], np.uint32).view(np.float32),
            "bf16": np.array([-0.0, 3.0, np.nan], ml_dtypes.bfloat16),
            "i4": np.array([-8, 7], ml_dtypes.int4),
            "u32": np.array([2**32 - 1], np.uint32), "bool": np.array([True, False]),
            "c64": np.array([-0.0 - 0.0j, 1j], np.complex64),
            "scalar": np.array(-0.0, np.float32),
            # Stored as their bits (TensorStore lacks them), the dtype recorded.
            "u4": np.arange(16, dtype=np.uint8).view(ml_dtypes.uint4),
            "f8": np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3)}


def report(scenario: str, got: dict, want: dict) -> None:
    for k, v in want.items():
        g = np.asarray(got[k])
        same = g.dtype == v.dtype and g.shape == v.shape and g.tobytes() == v.tobytes()
        print(f"RESULT {scenario}.{k} {same}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    d = ap.parse_args().dir
    rep = Replicator(MultiWorkerStrategy(collective_timeout=30))
    want = state()
    zeros = {k: np.zeros_like(v) for k, v in want.items()}
    with CheckpointManager(d, rep) as m:
        step, got = m.restore_or_initialize(state)  # nothing saved: init_fn's values
        report("initialised", got, want)
        m.save(1, got)
    with CheckpointManager(d, rep) as m:
        step, got = m.restore_or_initialize(lambda: zeros)
        assert step == 1, step
        report("restored", got, want)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
