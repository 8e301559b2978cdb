"""The input layer where its features meet.

Each test targets one place where two or more input features compose (modes, padding,
prefetch, device loops, re-iteration, failing sources and steps, donation, logical
devices, ParameterServerStrategy's per-worker input), against a small NumPy reference
of which examples each step must see.

Bug hunts: ``JR_REVIEW_EXAMPLES`` / ``JR_REVIEW_STEPS`` (the state machine; 400 x 40
passed on 2026-11-26 in about a minute) and ``JR_REVIEW_PS_EXAMPLES`` (the
parameter-server sweeps).
"""

from __future__ import annotations

import collections
import faulthandler
import os
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import jreplicate as jr
from jreplicate.input import auto
from tests._ps_helpers import TEST_BOUND_S

M = jr.InputReplicationMode


@pytest.fixture
def bounded():
    """A test that could wait on workers ends the process, with every thread's
    traceback, after ``TEST_BOUND_S`` seconds (as the PS suites do)."""
    faulthandler.dump_traceback_later(TEST_BOUND_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# -- ParameterServerStrategy, PER_WORKER input, epochs --------------------------------
def _ps_job(num_workers: int, per_pipeline: int, gate: threading.Event | None = None,
            **strategy):
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=num_workers, **strategy)
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


@pytest.mark.usefixtures("bounded")
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


@pytest.mark.usefixtures("bounded")
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


# -- a stateful model of the input where its features meet ---------------------------
B = 2  # rows of a per-replica element
DIM = 3
LR = 0.125
_REPS: dict[str, jr.Replicator] = {}  # one per layout: compiled programs are reused


def _layout_rep(layout: str) -> jr.Replicator:
    if layout not in _REPS:
        _REPS[layout] = _rep(2) if layout == "2" else \
            jr.Replicator(jr.MirroredStrategy(logical_devices_per_replica=2))  # 4 x 2
    return _REPS[layout]


def _features(ids) -> np.ndarray:
    """The features of examples ``ids`` (float32 ``[len(ids), DIM]``)."""
    ids = np.asarray(ids, np.float64).reshape(-1, 1)
    return np.sin(0.37 * ids * np.arange(1, DIM + 1) + 0.5).astype(np.float32)


class _Examples:
    """Pipeline ``p``'s examples ``p * 1000 + j`` for j < ``n``, split into ``files``
    consecutive files, each in elements of ``B`` rows (a file's last one shorter where
    ``B`` does not divide its length: with several files, a shorter element mid-stream),
    each a dict ``{"id": int32 [rows], "x": float32 [rows, DIM]}``. Reading element
    ``i`` in ``bad`` raises OSError (the next read goes on with element ``i + 1``);
    re-iterable, so ``reinitialize()`` restarts it, with the same bad elements."""

    def __init__(self, p: int, n: int, bad: frozenset, files: int = 1):
        self.p, self.n, self.bad, self.files = p, n, bad, files

    def elements(self) -> list[list[int]]:
        ids = [self.p * 1000 + j for j in range(self.n)]
        cuts = [self.n * f // self.files for f in range(self.files + 1)]
        return [ids[i:min(i + B, end)] for start, end in zip(cuts, cuts[1:])
                for i in range(start, end, B)]

    def __iter__(self):
        for i, ids in enumerate(self.elements()):
            if i in self.bad:
                yield _Raise(OSError(f"bad element {self.p}:{i}"))
            else:
                yield {"id": np.asarray(ids, np.int32), "x": _features(ids)}


class _Raise:
    def __init__(self, error):
        self.error = error


class _Reading:
    """An iterator over ``_Examples`` that raises where it holds a ``_Raise`` (and
    reads on afterwards), and keeps raising StopIteration at its end."""

    def __init__(self, source: _Examples):
        self.it = iter(source)

    def __iter__(self):
        return self

    def __next__(self):
        got = next(self.it)
        if isinstance(got, _Raise):
            raise got.error
        return got


class _ReIterable:
    def __init__(self, source: _Examples):
        self.source = source

    def __iter__(self):
        return _Reading(self.source)


class _ExampleModel:
    """What in-line reading (K separate runs) gives, step by step: ``("ok", ids)`` with
    ``ids[r]`` the ``B`` example ids replica r sees (-1 for padding), ``("error",
    (pipeline, element))``, ``("error", "shape")``, ``("error", "mid")`` (under "drop",
    a partial batch that its pipeline follows with more elements) or ``("end",)``."""

    def __init__(self, sources: list[_Examples], replicas: int, pad: bool):
        self.elements = [s.elements() for s in sources]
        self.bad = [s.bad for s in sources]
        self.replicas, self.pad = replicas, pad
        # The rows of the first step's (first real) element: every later element must
        # have as many, or fewer (a partial batch). Kept across sweeps, as the shapes.
        self.rows: int | None = None
        self.reinitialize()

    def reinitialize(self):
        self.pos, self.ended = 0, False
        self.front: collections.deque = collections.deque()

    def _event(self):
        if self.ended:
            return ("end",)
        if len(self.elements) == 1:  # one pipeline: a step reads `replicas` elements
            (els,), (bad,) = self.elements, self.bad
            got = []
            for _ in range(self.replicas):
                i, self.pos = self.pos, self.pos + 1
                if i < len(els) and i in bad:
                    return ("error", (0, i))  # the step's elements read before are gone
                if i >= len(els) and not self.pad:
                    if not got:
                        return self._end()
                    break  # what the step read is checked, then dropped
                got.append(els[i] if i < len(els) else None)
            ended = self.pos > len(els)  # (the read ahead never consumes: pos stays)
            followed = [k < len(got) - 1 or not ended and self.pos < len(els)
                        for k in range(len(got))]
            return self._outcome(got, followed, ended)
        s, self.pos = self.pos, self.pos + 1
        errors = [r for r, (els, bad) in enumerate(zip(self.elements, self.bad))
                  if s < len(els) and s in bad]
        if errors:
            return ("error", (errors[0], s))
        return self._outcome([els[s] if s < len(els) else None for els in self.elements],
                             [s + 1 < len(els) for els in self.elements], False)

    def _end(self):
        self.ended = True
        return ("end",)

    def _outcome(self, got, followed, ended):
        """The step of elements ``got`` (None: the pipeline ran out), ``followed[k]``:
        whether element k's pipeline has an element after it; ``ended``: a pipeline
        ran out after the step's elements."""
        if all(g is None for g in got):
            return self._end()
        real = [g for g in got if g is not None]
        if self.rows is None:  # padded: the largest element's; else replica 0's
            self.rows = max(map(len, real)) if self.pad else len(real[0])
        if any(len(g) > self.rows for g in real):
            return ("error", "shape")  # more rows than the first step: an error
        if not self.pad:
            if any(g is not None and len(g) < self.rows and f
                   for g, f in zip(got, followed)):
                return ("error", "mid")  # a partial batch more elements follow
            if ended or None in got or any(len(g) < self.rows for g in real):
                return self._end()  # a final partial step, dropped
        return ("ok", [(g or []) + [-1] * (self.rows - len(g or [])) for g in got])

    def _at(self, idx):
        while len(self.front) <= idx:
            self.front.append(self._event())
        return self.front[idx]

    def take(self, k, fails=False):
        """What ``run(..., steps=k)`` gives: ``("ok", steps)``, ``("error", element)``
        or ``("end",)``; a call that ``fails`` after taking its steps consumes nothing."""
        steps = []
        while len(steps) < (k or 1):
            event = self._at(len(steps))
            if event[0] == "ok":
                steps.append(event[1])
                continue
            if event[0] == "error" and not steps:
                self.front.popleft()  # raised by this call, so consumed
                return event
            break  # the end stays; an error after a step is raised by the next call
        if not steps:
            return ("end",)
        if not fails:
            for _ in steps:
                self.front.popleft()
        return ("ok", steps)


def _train(ctx, batch, state, mask):
    """One SGD step on the masked global mean of ``|x - w|^2``; the ids it saw."""
    def loss_fn(w):
        per_example = jnp.sum((batch["x"] - w) ** 2, axis=-1)
        return jr.compute_average_loss(per_example, ctx.all_sum(jnp.sum(mask)),
                                       sample_weight=mask)

    loss, g = jax.value_and_grad(loss_fn)(state["w"])
    state = {"w": state["w"] - LR * g, "seen": state["seen"] + ctx.all_sum(jnp.sum(mask)),
             "steps": state["steps"] + 1}
    return state, ctx.all_sum(loss), jnp.where(mask > 0, batch["id"], -1)


def _train_padded(ctx, batch, state):
    return _train(ctx, batch, state, ctx.batch_mask)


def _train_full(ctx, batch, state):
    return _train(ctx, batch, state, jnp.ones(batch["id"].shape, jnp.float32))


def _trace_fails(ctx, batch, state):
    raise RuntimeError("the step failed")


class _Reference:
    """The same training in NumPy (float64), one step per global batch of ids."""

    def __init__(self):
        self.w, self.seen, self.steps = np.zeros(DIM), 0, 0

    def step(self, ids_per_replica) -> float:
        ids = [i for ids in ids_per_replica for i in ids if i >= 0]
        x = _features(ids).astype(np.float64)
        loss = np.mean(np.sum((x - self.w) ** 2, -1))
        self.w = self.w - LR * np.mean(2 * (self.w - x), axis=0)
        self.seen, self.steps = self.seen + len(ids), self.steps + 1
        return float(loss)


FAST_AUTO = {"WARMUP": 0, "WINDOW": 1, "SHARE": 0.0}


class ComposedInputMachine(RuleBasedStateMachine):
    """One training run (SGD on a masked global-mean loss, state donated or not) driven
    through random single steps, device loops of changing K, steps that raise after
    taking their batch, and re-initialisations, over examples that do not fill the last
    element (of each of 1 to 3 files: partial batches mid-stream), with sources that
    raise at chosen elements, on 2 replicas or 4 replicas of 2 logical devices. Every
    step must see the ids the model says (each example once per sweep, padding masked),
    and the state must equal the NumPy reference."""

    @initialize(layout=st.sampled_from(["2", "4x2"]),
                per_replica=st.booleans(),
                sizes=st.lists(st.integers(B, 7 * B + 1), min_size=4, max_size=4),
                bads=st.lists(st.sets(st.integers(0, 7), max_size=2), min_size=4,
                              max_size=4),
                files=st.integers(1, 3), pad=st.booleans(), donate=st.booleans(),
                prefetch=st.sampled_from([False, True, None, "switching"]),
                single=st.booleans(), ordered=st.booleans(), buffer=st.integers(1, 3))
    def setup(self, layout, per_replica, sizes, bads, files, pad, donate, prefetch,
              single, ordered, buffer):
        self.saved = {name: getattr(auto, name) for name in FAST_AUTO}
        if prefetch == "switching":  # the default, with a prefetch trial every few steps
            for name, value in FAST_AUTO.items():
                setattr(auto, name, value)
            prefetch = None
        self.rep = rep = _layout_rep(layout)
        r = rep.num_replicas
        n = r if per_replica else 1
        sources = [_Examples(p, sizes[p], frozenset(bads[p]), files) for p in range(n)]
        self.model = _ExampleModel(sources, r, pad)
        mode = M.PER_REPLICA if per_replica else (M.SINGLE if single else M.PER_WORKER)
        self.it = rep.prepare_input(
            lambda ctx: _ReIterable(sources[ctx.input_pipeline_id]), mode,
            prefetch_on_device=prefetch, partial_batch="pad" if pad else "drop",
            enforce_ordering=ordered, prefetch_buffer_size=buffer)
        self.step = _train_padded if pad else _train_full
        self.donate = (0,) if donate else ()
        self.ref = _Reference()
        self.state = rep.replicate({"w": jnp.zeros(DIM), "seen": jnp.float32(0),
                                    "steps": jnp.int32(0)})

    def teardown(self):
        if hasattr(self, "it"):
            self.it.close()
            for name, value in self.saved.items():
                setattr(auto, name, value)

    def _call(self, fn, k, state):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the dropped partial batch's warning
                out = self.rep.run(fn, self.it, state, steps=k, donate_argnums=self.donate)
        except StopIteration:
            return ("end",), None
        except OSError as e:
            pipeline, element = str(e).rsplit(" ", 1)[1].split(":")
            return ("error", (int(pipeline), int(element))), None
        except (RuntimeError, ValueError) as e:
            if "the first step's elements had" in str(e):
                return ("error", "shape"), None
            if "is a partial batch" in str(e) and "more elements after it" in str(e):
                return ("error", "mid"), None
            if "the step failed" in str(e) or "donated to an earlier step" in str(e) \
                    or "deleted" in str(e):
                return ("failed",), None
            raise
        state, losses, ids = out
        ids = np.asarray(ids.array)  # [replicas, rows] or [replicas, k, rows]
        ids = ids[:, None] if k is None else ids
        steps = [ids[:, s].tolist() for s in range(ids.shape[1])]
        return ("ok", steps), (state, np.asarray(losses).reshape(-1))

    @rule(k=st.sampled_from([None, 1, 2, 3]))
    def run(self, k):
        got, out = self._call(self.step, k, self.state)
        want = self.model.take(k)
        assert got == want, f"run(steps={k}) gave {got}, the model {want}"
        if want[0] != "ok":
            return
        self.state, losses = out
        ref_losses = [self.ref.step(ids) for ids in want[1]]
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(self.state["w"]), self.ref.w,
                                   rtol=2e-5, atol=2e-6)
        assert float(self.state["seen"]) == self.ref.seen  # no padded row counted
        assert int(self.state["steps"]) == self.ref.steps

    @rule(k=st.sampled_from([None, 1, 2, 3]), how=st.sampled_from(["trace", "deleted"]))
    def failing_run(self, k, how):
        if how == "trace":
            got, _ = self._call(_trace_fails, k, self.state)
        else:  # a state whose arrays were deleted: rejected when the program is called
            gone = self.rep.replicate({"w": jnp.zeros(DIM), "seen": jnp.float32(0),
                                       "steps": jnp.int32(0)})
            jax.tree.map(lambda a: a.delete(), gone)
            got, _ = self._call(self.step, k, gone)
        want = self.model.take(k, fails=True)
        if want[0] == "ok":
            want = ("failed",)
        assert got == want, f"a failing run(steps={k}, {how}) gave {got}, the model {want}"

    @precondition(lambda self: hasattr(self, "it"))
    @rule()
    def reinitialize(self):
        assert self.it.reinitialize() == []
        self.model.reinitialize()


ComposedInputMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("JR_REVIEW_EXAMPLES", "40")),
    stateful_step_count=int(os.environ.get("JR_REVIEW_STEPS", "15")), deadline=None,
    database=None, phases=[Phase.explicit, Phase.generate, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestComposedInputMachine = ComposedInputMachine.TestCase


# -- ParameterServerStrategy PER_WORKER: random epochs --------------------------------
@pytest.mark.usefixtures("bounded")
@pytest.mark.filterwarnings("ignore::UserWarning")  # a dropped final partial step
@settings(max_examples=int(os.environ.get("JR_REVIEW_PS_EXAMPLES", "10")), deadline=None,
          database=None, phases=[Phase.explicit, Phase.generate, Phase.shrink],
          suppress_health_check=[HealthCheck.too_slow])
@example(workers=2, g=1, sizes=[3, 3, 0],
         epochs=[("held", 10, False), ("until_stop", 0, False)])
@example(workers=3, g=2, sizes=[5, 2, 3],
         epochs=[("held", 9, False), ("until_stop", 0, True), ("held", 2, True)])
@given(workers=st.integers(1, 3), g=st.integers(1, 2),
       sizes=st.lists(st.integers(0, 5), min_size=3, max_size=3),
       epochs=st.lists(st.tuples(st.sampled_from(["until_stop", "fixed", "held"]),
                                 st.integers(0, 8), st.booleans()),
                       min_size=1, max_size=3))
def test_ps_per_worker_sweeps_against_a_model(workers, g, sizes, epochs):
    """Each worker w reads pipeline w (``sizes[w]`` elements, ``g`` a step: a final
    partial step is dropped) through epochs that run to StopIteration or schedule a
    fixed number of steps, joined or not before ``reinitialize()`` ("held": the workers
    read nothing until the driver has called ``reinitialize()``, so the fixed number of
    steps are still queued then). Every epoch run to
    its end sees each element of the sweep exactly once (whatever earlier sweeps left
    queued), no sweep reads an element twice, and the parameters are the sum of what
    the steps that ran read."""
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=workers, num_replicas_in_sync=g)
    rep = jr.Replicator(s)
    with rep.scope():
        w = jnp.zeros(3)
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)
    opened = collections.Counter()  # pipeline -> sweeps opened (the element's sweep)
    gate = threading.Event()
    gate.set()

    class Sweep:
        def __init__(self, p):
            self.p = p

        def __iter__(self):
            opened[self.p] += 1
            for i in range(sizes[self.p]):
                assert gate.wait(30), "the test never opened the gate"
                yield np.array([self.p, i, opened[self.p]], np.float32)

    def step(ctx, x, w, opt):
        u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * x))(w), opt, w)
        return optax.apply_updates(w, u), opt, x

    full = sorted((p, i) for p in range(workers) for i in range(sizes[p] // g * g))
    applied = []
    try:
        it = rep.prepare_input(lambda ctx: Sweep(ctx.input_pipeline_id))
        for how, n, join in epochs:
            values = []
            if how == "held":
                gate.clear()
            for _ in range(400 if how == "until_stop" else n):
                try:
                    values.append(rep.run(step, it, w, opt))
                except StopIteration:
                    break
                if len(values) > 8:
                    time.sleep(0.005)  # the driver learns the end from the workers
            else:
                assert how != "until_stop", "the epoch never ended"
            if how == "held":
                it.reinitialize()
                gate.set()
            if join:
                rep.join()
            read = []
            for v in values:
                try:
                    read += [tuple(int(a) for a in x)
                             for x in np.asarray(v.fetch()[2]).reshape(-1, 3)]
                except StopIteration:
                    pass  # scheduled after the end of its sweep: not run
            applied += read
            if how == "until_stop":
                assert sorted(x[:2] for x in read) == full
            if how != "held":
                it.reinitialize()
        rep.join()
        # (pipeline, element, sweep of that pipeline): none read twice, ever.
        assert len(set(applied)) == len(applied), f"read twice: {sorted(applied)}"
        assert s.ledger()[0]["applied"] * g == len(applied)
        np.testing.assert_allclose(s.parameters(), -np.sum(applied, axis=0)
                                   if applied else np.zeros(3), rtol=1e-6, atol=1e-6)
    finally:
        gate.set()
        s.shutdown()


def test_a_padded_first_step_whose_replica_0_element_is_short_pads_it():
    """Found 2026-11-26: the first step's element spec was replica 0's element; where
    replica 0's shard held fewer examples than a per-replica batch (uneven PER_REPLICA
    shards) with partial_batch="pad", every full element of the other replicas was
    rejected ("the first step's elements had (1,)") instead of replica 0's being
    padded. (With "drop" a first step of two lengths stays an error.)"""
    rep = _rep(2)

    def shards(ctx):
        ids = np.arange(1 if ctx.input_pipeline_id == 0 else 5, dtype=np.float32) + 1
        return [ids[i:i + 2] for i in range(0, len(ids), 2)]

    it = rep.prepare_input(shards, M.PER_REPLICA, prefetch_on_device=False,
                           partial_batch="pad")
    seen = []
    for _ in range(4):
        try:
            x, m = rep.run(lambda ctx, x: (x, ctx.batch_mask), it)
        except StopIteration:
            break
        seen.append((np.asarray(x.array).tolist(), np.asarray(m.array).tolist()))
    assert seen == [([[1, 0], [1, 2]], [[1, 0], [1, 1]]),
                    ([[0, 0], [3, 4]], [[0, 0], [1, 1]]),
                    ([[0, 0], [5, 0]], [[0, 0], [1, 0]])]
    dropping = rep.prepare_input(shards, M.PER_REPLICA, prefetch_on_device=False)
    with pytest.raises(ValueError, match="replica 1 at the root has shape"):
        rep.run(lambda ctx, x: x, dropping)


_GOOD = {"a": np.zeros(2, np.float32), "n": np.zeros(2, np.int64)}
_BAD = {
    "a key renamed": ({"b": np.zeros(2, np.float32), "n": np.zeros(2, np.int64)},
                      ValueError, r"missing \['a'\]; new \['b'\]"),
    "float32 -> float64": ({"a": np.zeros(2), "n": np.zeros(2, np.int64)},
                           ValueError, r"\['a'\] has shape \(2,\) and dtype float64"),
    "an int64 beyond int32": ({"a": np.zeros(2, np.float32),
                               "n": np.array([0, 2 ** 40], np.int64)},
                              ValueError, r"\['n'\] holds 1099511627776"),
    "a longer leaf": ({"a": np.zeros(3, np.float32), "n": np.zeros(2, np.int64)},
                      ValueError, r"\['a'\] has shape \(3,\)"),
    "a leaf added": ({"a": np.zeros(2, np.float32), "n": np.zeros(2, np.int64),
                          "c": np.zeros(1)}, ValueError, r"new \['c'\]"),
}


@pytest.mark.parametrize("what", sorted(_BAD))
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("steps", [None, 3])
def test_a_bad_element_mid_stream_fails_its_step_only(what, prefetch, steps):
    """Element 5 of 12 (2 replicas, PER_WORKER: step 2) is wrong: steps 0 and 1 run
    (a loop of 3 runs them and the next call raises), the error names the leaf, and
    the steps after it read on, in order: nothing skipped, nothing cast."""
    bad, error, match = _BAD[what]
    elements = [dict(_GOOD, a=np.full(2, i, np.float32)) for i in range(12)]
    elements[5] = bad
    rep = _rep(2)
    it = rep.prepare_input(lambda ctx: iter(elements), prefetch_on_device=prefetch)
    got = []
    for _ in range(1 if steps else 2):  # a loop of 3 stops before the error
        out = rep.run(lambda ctx, x: x["a"][0], it, steps=steps)
        got += np.asarray(out.array).reshape(2, -1).T.ravel().tolist()
    assert got == [0, 1, 2, 3]  # steps 0 and 1
    with pytest.raises(error, match=match):
        rep.run(lambda ctx, x: x["a"][0], it, steps=steps)
    rest = []
    while True:
        try:
            out = rep.run(lambda ctx, x: x["a"][0], it, steps=steps)
        except StopIteration:
            break
        rest += np.asarray(out.array).reshape(2, -1).T.ravel().tolist()
    assert rest == [6, 7, 8, 9, 10, 11]  # element 4 went with its failed step


@pytest.mark.usefixtures("bounded")
def test_ps_ray_steps_of_an_ended_sweep_do_not_end_the_next_sweep(tmp_path):
    """As the embedded test above, on the Ray carrier: the sweep of an end found in a
    worker actor crosses Ray with it."""
    pytest.importorskip("ray")
    from tests.test_ps_ray import private_ray

    gate = tmp_path / "open"
    ray_dir = private_ray()
    next(ray_dir)
    s = jr.ParameterServerStrategy(num_ps=1, num_workers=2, carrier="ray")
    try:
        rep = jr.Replicator(s)
        with rep.scope():
            w = jnp.zeros(2)
            tx = jr.ps.pushable(optax.sgd(1.0))
            opt = tx.init(w)

        def input_fn(ctx, gate=str(gate)):
            import os
            import time
            for i in range(3):
                deadline = time.monotonic() + 60
                while not os.path.exists(gate) and time.monotonic() < deadline:
                    time.sleep(0.01)
                yield np.array([ctx.input_pipeline_id, i], np.float32)

        def step(ctx, x, w, opt):
            u, opt = tx.update(jax.grad(lambda w: jnp.sum(w * x))(w), opt, w)
            return optax.apply_updates(w, u), opt, x

        it = rep.prepare_input(input_fn)
        want = [(p, i) for p in range(2) for i in range(3)]
        first = [rep.run(step, it, w, opt) for _ in range(10)]
        it.reinitialize()
        gate.touch()
        assert _ps_seen(first) == want
        assert _ps_epoch(rep, it, step, w, opt) == want
        rep.join()
        assert s.ledger()[0]["applied"] == 2 * len(want)
    finally:
        gate.touch()
        s.shutdown()
        next(ray_dir, None)


class _Counting:
    """Pipeline ``p``'s elements ``10 * p + i`` for i < 4; pipeline 1 raises at its
    element 1 (and reads on)."""

    def __init__(self, p):
        self.p, self.i = p, 0

    def __iter__(self):
        return self

    def __next__(self):
        i, self.i = self.i, self.i + 1
        if i >= 4:
            raise StopIteration
        if self.p == 1 and i == 1:
            raise OSError("bad 1:1")
        return np.full((1,), 10 * self.p + i, np.float32)


@pytest.mark.parametrize("enforce_ordering", [False, True])
def test_an_error_in_one_pipeline_keeps_the_per_replica_pipelines_in_step(enforce_ordering):
    """Found 2026-11-26: with enforce_ordering=True, an error in pipeline 1 stopped the
    step's reads there, so pipelines 2 and 3 fell one element behind 0 and 1 for the
    rest of the sweep (steps mixed element s with element s - 1) and their last
    elements were dropped at the end; the concurrent reads (the default) read every
    pipeline of the failing step."""
    rep = _rep(4)
    it = rep.prepare_input(lambda ctx: _Counting(ctx.input_pipeline_id), M.PER_REPLICA,
                           enforce_ordering=enforce_ordering, prefetch_on_device=False)
    out = []
    for _ in range(6):
        try:
            out.append(np.asarray(rep.run(lambda ctx, x: x[0], it).array).tolist())
        except StopIteration:
            break
        except OSError as e:
            out.append(str(e))
    assert out == [[0, 10, 20, 30], "bad 1:1", [2, 12, 22, 32], [3, 13, 23, 33]]


@pytest.mark.usefixtures("bounded")
def test_ps_per_worker_a_failed_step_keeps_its_element():
    s, rep, w, opt, step, input_fn = _ps_job(1, 4)
    try:
        it = rep.prepare_input(input_fn)

        def fails(ctx, x, w, opt):
            raise RuntimeError("the step failed")

        values = [rep.run(step, it, w, opt)]
        failed = rep.run(fails, it, w, opt)
        with pytest.raises(RuntimeError, match="the step failed"):
            failed.fetch()
        with pytest.raises(RuntimeError, match="the step failed"):
            rep.join()
        values += [rep.run(step, it, w, opt) for _ in range(3)]
        rep.join()
        assert _ps_seen(values) == [(0, i) for i in range(4)]
    finally:
        s.shutdown()


def _fails(ctx, x, w, opt):
    raise RuntimeError("the step failed")


def test_ps_per_worker_a_failed_step_keeps_its_elements_in_a_sync_group_and_sweep():
    """A sync group of 2 replicas: the failed step's two elements go to the next step;
    reinitialize() drops what a failed step of the old sweep held."""
    s, rep, w, opt, step, input_fn = _ps_job(1, 6, num_replicas_in_sync=2)

    def seen(v):
        return [tuple(int(a) for a in row) for row in np.asarray(v.fetch()[2]).reshape(-1, 2)]

    try:
        it = rep.prepare_input(input_fn)
        a = rep.run(step, it, w, opt)
        rep.run(_fails, it, w, opt)
        with pytest.raises(RuntimeError):
            rep.join()
        b = rep.run(step, it, w, opt)
        rep.join()
        assert seen(a) == [(0, 0), (0, 1)] and seen(b) == [(0, 2), (0, 3)]
        rep.run(_fails, it, w, opt)  # holds (0, 4), (0, 5) of this sweep
        with pytest.raises(RuntimeError):
            rep.join()
        it.reinitialize()
        c = rep.run(step, it, w, opt)
        rep.join()
        assert seen(c) == [(0, 0), (0, 1)]  # the new sweep, not the old one's held ones
        assert s.ledger()[0]["applied"] == 3
    finally:
        s.shutdown()


@pytest.mark.usefixtures("bounded")
def test_ps_ray_a_failed_step_keeps_its_element_and_a_replacement_reads_it():
    """On Ray: the failed step's element goes to the worker actor's next step; a worker
    whose process dies while it holds one is replaced where its last successful step
    left its pipeline (the position the actor reports excludes the held element)."""
    pytest.importorskip("ray")
    import jreplicate.testing as jrt
    from tests.test_ps_ray import private_ray

    ray_dir = private_ray()
    next(ray_dir)
    s, rep, w, opt, step, input_fn = _ps_job(1, 8, carrier="ray")
    try:
        it = rep.prepare_input(input_fn)
        values = [rep.run(step, it, w, opt)]
        rep.run(_fails, it, w, opt)
        with pytest.raises(RuntimeError, match="the step failed"):
            rep.join()
        values.append(rep.run(step, it, w, opt))  # takes the failed step's element 1
        rep.join()
        seen = _ps_seen(values)  # (fetched: the actor holding them is killed below)
        rep.run(_fails, it, w, opt)  # holds element 2
        with pytest.raises(RuntimeError, match="the step failed"):
            rep.join()
        jrt.kill_worker(s, 0, when="crash")  # Ray restarts the actor in a new process
        values = [rep.run(step, it, w, opt) for _ in range(2)]
        rep.join()
        assert seen + _ps_seen(values) == [(0, 0), (0, 1), (0, 2), (0, 3)]
        assert s.stats()["replaced"] >= 1
    finally:
        s.shutdown()
        next(ray_dir, None)


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("at_the_end", [False, True])
def test_a_failed_reinitialize_never_reads_on_from_a_mix_of_sweeps(prefetch, at_the_end):
    """Found 2026-11-26: when input_fn raised while reinitialize() reopened pipeline 1,
    pipeline 0 had restarted and pipeline 1 had not: a caller that caught the error
    (a retry wrapper) trained on steps that paired pipeline 0's new sweep with
    pipeline 1's old one, and lost pipeline 0's last elements at the end. Reads now
    raise until reinitialize() succeeds."""
    rep = _rep(2)
    calls = collections.Counter()

    def input_fn(ctx):
        p = ctx.input_pipeline_id
        calls[p] += 1
        if p == 1 and calls[p] == 2:
            raise OSError("pipeline 1 cannot reopen")
        return (np.full((1,), 10 * p + i, np.float32) for i in range(5))

    def see(ctx, x):
        return x[0]

    it = rep.prepare_input(input_fn, M.PER_REPLICA, prefetch_on_device=prefetch)
    assert np.asarray(rep.run(see, it).array).tolist() == [0, 10]
    if at_the_end:  # an exhausted sweep: the reads raise, they do not just end
        for _ in range(4):
            rep.run(see, it)
        with pytest.raises(StopIteration):
            rep.run(see, it)
    with pytest.raises(OSError, match="cannot reopen"):
        it.reinitialize()
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"reinitialize\(\) failed.*cannot reopen"):
            rep.run(see, it)
    it.reinitialize()  # now it opens
    out = []
    while True:
        try:
            out.append(np.asarray(rep.run(see, it).array).tolist())
        except StopIteration:
            break
    assert out == [[i, 10 + i] for i in range(5)]
