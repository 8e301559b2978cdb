"""Review 2026-11-26: the input layer where its features meet.

Each test targets one place where two or more input features compose (modes, padding,
prefetch, device loops, re-iteration, failing sources and steps, donation, logical
devices, ParameterServerStrategy's per-worker input), against a small NumPy reference
of which examples each step must see.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr

M = jr.InputReplicationMode


# -- ParameterServerStrategy, PER_WORKER input, epochs --------------------------------
def _ps_job(num_workers: int, per_pipeline: int, gate: threading.Event | None = None):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=num_workers)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(2)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def input_fn(ctx):
        for i in range(per_pipeline):
            if gate is not None:
                assert gate.wait(30), "the test never opened the gate"
            yield np.array([ctx.input_pipeline_id, i], np.float32)

    def step(ctx, x, w, opt):
        g = jax.grad(lambda w: jnp.sum(w * x))(w)
        u, opt = tx.update(g, opt, w)
        return optax.apply_updates(w, u), opt, x

    return s, rep, w, opt, step, input_fn


def _ps_seen(values) -> list[tuple[int, int]]:
    """The elements the steps of ``values`` read (sorted); steps not run are left out."""
    seen = []
    for v in values:
        try:
            seen.append(tuple(int(a) for a in np.asarray(v.fetch()[2]).reshape(-1)))
        except StopIteration:
            pass  # scheduled after the end: not run
    return sorted(seen)


def _ps_epoch(rep, it, step, w, opt) -> list[tuple[int, int]]:
    """One epoch as a user writes it: run until StopIteration (no join between
    epochs); the elements the steps of this epoch read."""
    values = []
    for _ in range(400):
        try:
            values.append(rep.run(step, it, w, opt))
        except StopIteration:
            break
        if len(values) > 8:
            time.sleep(0.005)  # the driver learns the end from the workers
    else:
        pytest.fail("the epoch never ended")
    return _ps_seen(values)


def test_ps_per_worker_epochs_each_see_every_element_once():
    s, rep, w, opt, step, input_fn = _ps_job(2, 3)
    try:
        it = rep.prepare_input(input_fn)
        want = [(p, i) for p in range(2) for i in range(3)]
        for epoch in range(3):
            assert _ps_epoch(rep, it, step, w, opt) == want, f"epoch {epoch}"
            it.reinitialize()
        rep.join()
        assert s.ledger()[0]["applied"] == 3 * len(want)
    finally:
        s.shutdown()


def test_ps_per_worker_steps_of_an_ended_sweep_do_not_end_the_next_sweep():
    """Found 2026-11-26. An epoch scheduled with more steps than elements, then
    ``reinitialize()`` while those steps were still queued: the old sweep's surplus
    steps found their workers' old pipelines ended *after* the restart and marked every
    worker's new sweep as ended, so the whole next epoch raised StopIteration at once
    (silently skipped, nothing applied)."""
    gate = threading.Event()
    s, rep, w, opt, step, input_fn = _ps_job(2, 3, gate)
    try:
        it = rep.prepare_input(input_fn)
        want = [(p, i) for p in range(2) for i in range(3)]
        first = [rep.run(step, it, w, opt) for _ in range(10)]  # 4 more than elements
        it.reinitialize()  # every step of the first epoch still queued (or reading)
        gate.set()
        assert _ps_seen(first) == want  # each step read the sweep it was scheduled in
        assert _ps_epoch(rep, it, step, w, opt) == want  # and the next sweep is whole
        rep.join()
        assert s.ledger()[0]["applied"] == 2 * len(want)
    finally:
        gate.set()
        s.shutdown()


# -- adversarial leaves ----------------------------------------------------------------
def _rep(n: int = 2, **kw) -> jr.Replicator:
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:n], **kw))


def _first_step(elements, **kw):
    rep = _rep()
    it = rep.prepare_input(lambda ctx: iter(elements), prefetch_on_device=False, **kw)
    return rep, it


def test_complex128_values_beyond_complex64_are_an_error_not_inf():
    """Found 2026-11-26: a complex128 leaf of 1e300 arrived as inf (complex64) with no
    error, where an int64 or float64 that does not fit is an error."""
    _, it = _first_step([{"z": np.array([1e300 + 1j])}] * 2)
    with pytest.raises(ValueError, match=r"\['z'\].*complex64"):
        it.get_next()
    _, it = _first_step([{"z": np.array([1.0 - 1e300j])}] * 2)
    with pytest.raises(ValueError, match=r"\['z'\].*complex64"):
        it.get_next()
    _, it = _first_step([np.array([1.5 + 2j])] * 2)  # fits: arrives as complex64
    np.testing.assert_array_equal(np.asarray(it.get_next().array), [[1.5 + 2j]] * 2)


@pytest.mark.parametrize("leaf, kind", [
    (np.str_("a"), "<U1"), (np.array(["ab", "cd"]), "<U2"),
    (np.array([1, "a"], dtype=object), "object"),
    (np.array(["2020-01-01"], dtype="datetime64[D]"), "datetime64"),
    (2 ** 70, "object"),  # a Python int no integer dtype holds
])
def test_a_leaf_jax_cannot_hold_is_named_with_its_path(leaf, kind):
    """Found 2026-11-26: strings, objects, datetimes (and Python ints beyond int64)
    passed the element check and failed in the transfer with JAX's "Dtype <U1 is not a
    valid JAX array type", naming neither the replica nor the leaf."""
    _, it = _first_step([{"x": np.zeros(2, np.float32), "bad": leaf}] * 2)
    with pytest.raises(TypeError, match=r"replica 0 at \['bad'\].*" + kind):
        it.get_next()
