"""Writes ``checkpoint_format1.tar.gz``'s directory with jreplicate before issue 31.

Run from a checkout of that jreplicate: ``PYTHONPATH=<it> python
tests/data/make_checkpoint_format1.py OUT`` (steps 1 and 2 of :func:`state`, written by
the chief with a CRC-32 per array; ``uint4`` stored as its bits), then remove
``OUT/jreplicate.lock`` and ``tar -czf checkpoint_format1.tar.gz format1``.
"""

import os
import shutil
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402


def state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((8, 4)).astype(np.float32),
            "b": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
            "q": (np.arange(6) % 16).astype(ml_dtypes.uint4),
            "opt": ({"mu": rng.integers(-9, 9, (8,)).astype(np.int32)},)}


if __name__ == "__main__":
    import jreplicate as jr
    out = sys.argv[1]
    shutil.rmtree(out, ignore_errors=True)
    with jr.CheckpointManager(out, jr.Replicator(jr.MirroredStrategy())) as m:
        for step in (1, 2):
            m.save(step, state(step), force=True)
