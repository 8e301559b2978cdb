"""Review 2026-11-26 (io2): replicated host arguments and the input across processes.

Run under ``python -m jreplicate.cluster.launch --nproc 2 --devices-per-proc 2``; prints
one ``RESULT <scenario> <outcome> <detail>`` line per scenario and ``DONE``.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from jreplicate.input.context import InputReplicationMode as Mode  # noqa: E402
from jreplicate.replicator import Replicator  # noqa: E402
from jreplicate.strategies.multi_worker import MultiWorkerStrategy  # noqa: E402


def main() -> None:
    strategy = MultiWorkerStrategy(os.environ["JREPLICATE_COORDINATOR"],
                                   int(os.environ["JREPLICATE_NUM_PROCESSES"]),
                                   int(os.environ["JREPLICATE_PROCESS_ID"]),
                                   heartbeat_timeout=5, collective_timeout=10)
    rep = Replicator(strategy)
    me = strategy.worker_index

    def result(name, fn):
        try:
            print(f"RESULT {name} ok {fn()}", flush=True)
        except Exception as e:  # report, and carry on with the next scenario
            print(f"RESULT {name} {type(e).__name__} {str(e).splitlines()[0]}", flush=True)

    def echo(ctx, x):
        return x

    def exact(x):  # placed as a replicated argument: the same values, bits and shape
        def run():
            got = np.asarray(rep.run(echo, None, x).addressable_data(0))
            want = np.asarray(x)
            want = want.astype(want.dtype.newbyteorder("="))
            return f"{got.shape == want.shape}/{got.dtype == want.dtype}/" \
                   f"{got.tobytes() == want.tobytes()}"
        return run

    result("big_endian", exact(np.array([1.5, -0.0, np.nan], ">f4")))
    result("big_endian_0d", exact(np.array(-2.5, ">f4")))
    result("scope_big_endian", lambda: np.asarray(
        rep.replicate({"w": np.array([1.5, 2.0], ">f4")})["w"].addressable_data(0)).tolist())

    def differ_dtype():  # the same bytes, dtypes whose dtype.str is '<V1' on both
        raw = np.array([1, 2], np.uint8)
        return rep.run(echo, None, raw.view(ml_dtypes.float8_e4m3fn if me == 0
                                            else ml_dtypes.int4)).dtype
    result("differ_dtype", differ_dtype)

    def many_leaves():  # 50 small NumPy arguments a step: one agreement round, not 50
        leaves = [np.full(4, i, np.float32) for i in range(50)]

        def step(ctx, xs):
            return sum(x.sum() for x in xs)
        from jreplicate.cluster.agreement import Agreement
        rep.run(step, None, leaves)
        gather, count = Agreement.all_gather, [0]

        def counted(*args, **kwargs):
            count[0] += 1
            return gather(*args, **kwargs)
        Agreement.all_gather = counted
        try:
            t = time.perf_counter()
            for _ in range(5):
                out = rep.run(step, None, leaves)
            out.block_until_ready()
        finally:
            Agreement.all_gather = gather
        return f"{count[0] // 5}/{(time.perf_counter() - t) / 5 * 1e3:.1f}ms"
    result("many_leaves", many_leaves)

    def uneven(ctx):  # process 1's replicas (2, 3) start with 3 examples, 0 and 1 with 4
        rows = [4, 4] if ctx.input_pipeline_id < 2 else [3, 4]
        return iter([np.full((n, 2), ctx.input_pipeline_id + 1, np.float32) for n in rows])

    def pad_uneven():
        it = rep.prepare_input(uneven, Mode.PER_REPLICA, partial_batch="pad")

        def step(ctx, batch):
            return ctx.all_sum(batch.sum()), ctx.all_sum(ctx.batch_mask.sum())
        got = [tuple(float(np.asarray(v.addressable_data(0))) for v in rep.run(step, b))
               for b in it]
        return got
    result("pad_uneven", pad_uneven)

    calls = [0]

    def single_fn(ctx):  # worker 0 reads for everyone; its 2nd step changes shape
        def one():
            calls[0] += 1
            return np.ones((3 if calls[0] == ctx.num_replicas + 1 else 2,), np.float32)
        return one

    it = rep.prepare_input(single_fn, Mode.SINGLE)
    result("single_callable_1", lambda: next(it).shape)
    result("single_callable_2", lambda: next(it).shape)
    result("single_callable_reinit", it.reinitialize)
    result("single_callable_after", lambda: next(it).shape)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
