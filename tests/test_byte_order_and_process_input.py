"""Input and checkpoints where they meet: byte order, and placement across processes.

* Big-endian NumPy data (FITS, network-order files): a checkpoint saved from it could
  never be restored (its checksum was of the big-endian bytes: "every checkpoint is
  damaged"); as a replicated argument, state or input element JAX refused it without
  naming the leaf, and a big-endian int64 escaped the 64-bit range check.
* Across processes (tests/mp_scripts/io2.py): replicated arguments whose dtypes share a
  ``dtype.str`` (ml_dtypes' ``'<V1'``) had equal digests and each process placed its own
  dtype; one gather per host argument (about 2 ms each: 100 ms a step for 50 leaves)
  is one gather per call; a padded first step whose processes' largest elements
  differed (uneven shards) raised "elements differ across processes" where one process
  runs it; SINGLE mode with a callable ``input_fn``: ``reinitialize()`` after an error
  left worker 0 ended while the others waited for it in the agreement.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest

import jreplicate as jr
from jreplicate import _wire
from jreplicate.checkpoint import CheckpointManager
from jreplicate.input import padding
from jreplicate.input.protocol import Action, ReadOutcome, decide

BIG = np.array([1.5, -0.0, np.nan, 3e38], ">f4")


def _rep():
    return jr.Replicator(jr.MirroredStrategy(jax.devices()[:2]))


def _same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    want = want.astype(want.dtype.newbyteorder("="))
    return got.shape == want.shape and got.dtype == want.dtype and \
        got.tobytes() == want.tobytes()


def test_big_endian_checkpoint_restores(tmp_path):
    rep = _rep()
    m = CheckpointManager(str(tmp_path), rep)
    assert m.save(1, {"w": BIG, "s": np.array(7, ">i4")}, force=True)
    m.close()
    m = CheckpointManager(str(tmp_path), rep)
    step, state = m.restore_or_initialize(
        lambda: {"w": np.zeros(4, ">f4"), "s": np.array(0, ">i4")})
    m.close()
    assert step == 1
    assert _same_bits(state["w"], BIG) and _same_bits(state["s"], np.array(7, ">i4"))


def test_big_endian_initial_state(tmp_path):
    m = CheckpointManager(str(tmp_path), _rep())
    step, state = m.restore_or_initialize(lambda: {"w": BIG})
    m.close()
    assert step == 0 and _same_bits(state["w"], BIG)


def test_big_endian_argument_state_and_input():
    rep = _rep()
    got = rep.run(lambda ctx, x: x, None, BIG)
    assert _same_bits(got.addressable_data(0), BIG)
    assert _same_bits(rep.replicate({"w": BIG})["w"].addressable_data(0), BIG)
    it = rep.prepare_input(lambda ctx: iter([BIG.copy() for _ in range(4)]))
    assert _same_bits(next(it).array.addressable_data(0)[0], BIG)


def test_big_endian_int64_range_checked():
    rep = _rep()
    big = np.array([2**40, 1], ">i8")
    with pytest.raises(ValueError, match=r"argument \[0\] holds 1099511627776 \(int64\)"):
        rep.run(lambda ctx, x: x, None, big)
    it = rep.prepare_input(lambda ctx: iter([big.copy() for _ in range(4)]))
    with pytest.raises(ValueError, match=r"replica 0 at the root holds 1099511627776"):
        next(it)


def _spec(rows):
    td = padding.masked_treedef(jax.tree.structure(np.zeros(1)))
    return _wire.element_spec(td, [np.zeros((rows, 2), np.float32),
                                   np.zeros(rows, np.float32)])


def _outcomes(specs, seen=False):
    return [ReadOutcome.from_wire(ReadOutcome.data(s, seen=seen).to_wire(), p)
            for p, s in enumerate(specs)]


def test_first_padded_step_takes_the_widest_spec():
    d = decide(_outcomes([_spec(3), _spec(4)]), pad=True, single=False, num_replicas=4)
    assert d.action is Action.DATA and d.spec["leaves"][0][0] == [4, 2]
    # Later steps (a spec known) and drop mode still require one spec.
    for outcomes, pad in ((_outcomes([_spec(3), _spec(4)], seen=True), True),
                          (_outcomes([_spec(3), _spec(4)]), False)):
        assert decide(outcomes, pad=pad, single=False, num_replicas=4).action \
            is Action.RAISE


@pytest.fixture(scope="module")
def io2_results():
    from tests.test_multi_worker_processes import SCRIPTS, _launch
    r = _launch(["--nproc", "2", "--devices-per-proc", "2", str(SCRIPTS / "io2.py")])
    assert r.stdout.count("DONE") == 2, r.stdout[-3000:] + r.stderr[-3000:]
    results: dict = {}
    for line in r.stdout.splitlines():
        m = re.match(r"\[p(\d)\] RESULT (\S+) (\S+) ?(.*)", line)
        if m:
            results.setdefault(m.group(2), {})[int(m.group(1))] = (m.group(3), m.group(4))
    return results


def test_mp_big_endian_placed(io2_results):
    for name in ("big_endian", "big_endian_0d"):
        assert io2_results[name] == {0: ("ok", "True/True/True"),
                                     1: ("ok", "True/True/True")}, name
    assert io2_results["scope_big_endian"][0] == ("ok", "[1.5, 2.0]")


def test_mp_digest_names_the_dtype(io2_results):
    got = io2_results["differ_dtype"]
    assert got[0][0] == got[1][0] == "ValueError", got
    assert got[0][1] == got[1][1]  # one message, agreed (jreplicate.execution.agreed)
    assert ("argument [0] differs between the processes (process 0: host value "
            "float8_e4m3fn[2]; process 1: host value int4[2])") in got[0][1]


def test_mp_many_host_leaves_one_gather(io2_results):
    # 50 NumPy arguments: one gather each took ~100 ms a step (2 CPU cores); one
    # agreement round for them all takes a few ms. (The time is printed, not checked.)
    for p in (0, 1):
        status, got = io2_results["many_leaves"][p]
        assert status == "ok" and got.split("/")[0] == "1", got


def test_mp_pad_uneven_first_step(io2_results):
    # As on one process: step 1 pads replicas 2, 3 from 3 to 4 examples (sum 66, 14
    # real), step 2 is full (sum 80, 16 real).
    want = ("ok", "[(66.0, 14.0), (80.0, 16.0)]")
    assert io2_results["pad_uneven"] == {0: want, 1: want}


def test_mp_single_callable_reinitialize(io2_results):
    assert io2_results["single_callable_2"][0][0] == "ValueError"
    assert io2_results["single_callable_2"][1][0] == "ValueError"
    assert io2_results["single_callable_after"] == {0: ("ok", "(2,)"), 1: ("ok", "(2,)")}


def test_one_process_pad_uneven_matches():
    rep = jr.Replicator(jr.MirroredStrategy(jax.devices()[:4]))

    def uneven(ctx):
        rows = [4, 4] if ctx.input_pipeline_id < 2 else [3, 4]
        return iter([np.full((n, 2), ctx.input_pipeline_id + 1, np.float32) for n in rows])
    it = rep.prepare_input(uneven, jr.InputReplicationMode.PER_REPLICA, partial_batch="pad")

    def step(ctx, batch):
        return ctx.all_sum(batch.sum()), ctx.all_sum(ctx.batch_mask.sum())
    assert [tuple(float(v) for v in rep.run(step, b)) for b in it] == \
        [(66.0, 14.0), (80.0, 16.0)]


assert Path(__file__).with_name("mp_scripts").joinpath("io2.py").exists()


def test_a_host_argument_that_cannot_be_placed_is_named_and_a_refused_one_not_placed():
    """One process: a value check_fits refused is not placed (JAX's own OverflowError for
    a Python int beyond int32 came first, unnamed), and a value JAX cannot hold (a
    string array) is named by its argument."""
    rep = jr.Replicator(jr.MirroredStrategy())
    with pytest.raises(ValueError, match=r"argument \[0\] holds 1099511627776"):
        rep.run(lambda ctx, s: s, None, 2**40)
    with pytest.raises(TypeError, match=r"Replicator.run: argument \[0\]: .*<U1"):
        rep.run(lambda ctx, s: s, None, np.array(["a", "b"]))
