"""One InputIterator driven through random sequences of runs, against a model (issue 15,
item 10a).

A hypothesis state machine runs single steps and device loops of changing K, steps
that raise (when traced, or when an argument is rejected), reinitialize, over a source
that raises at chosen elements, with partial_batch drop or pad and prefetch on, off, the
default, or the default made to switch within a few steps. A small model says what every
call must see, from in-line reading of the source (K separate runs): nothing lost,
duplicated or reordered; a failed step consumes nothing; an input error fails its step
(a loop runs the complete steps before it, and the next call raises it).

``JR_STATEFUL_EXAMPLES=200`` (and ``JR_STATEFUL_STEPS=30``) runs more examples, and
longer ones, to hunt bugs.
"""

import collections
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import jreplicate as jr
from jreplicate.input import auto

REPLICAS = 2
_REP: list = []  # one Replicator for every example: its compiled programs are reused


def _rep():
    if not _REP:
        _REP.append(jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:REPLICAS])))
    return _REP[0]


# Element i holds i + 1 (padding holds 0); each step returns what every replica saw.
def _see(ctx, batch, n):
    return n + 1, batch[0]


def _see_masked(ctx, batch, n):
    return n + 1, batch[0] * ctx.batch_mask[0]


def _trace_fails(ctx, batch, n):
    raise RuntimeError("the step failed")


class _Source:
    """Elements ``i + 1`` for i < ``length``; reading an element in ``bad`` raises (once:
    the next read goes on with the next element)."""

    def __init__(self, length, bad, pipeline=0):
        self.i, self.length, self.bad, self.pipeline = 0, length, bad, pipeline

    def __iter__(self):
        return self

    def __next__(self):
        i, self.i = self.i, self.i + 1
        if i >= self.length:
            raise StopIteration
        if i in self.bad:
            raise OSError(f"bad element {self.pipeline}:{i}")
        return np.full((1,), i + 1, np.float32)


class _Model:
    """What in-line reading (K separate runs) gives: a stream of events, one per step:
    ``("ok", [value per replica])``, ``("error", (pipeline, element))`` or ``("end",)``.

    With one pipeline (PER_WORKER) a step reads its replicas' elements one after the
    other; with one per replica (PER_REPLICA, read concurrently) every pipeline's element
    of the step is read, and an error wins over another pipeline's end."""

    def __init__(self, lengths, bads, pad):
        self.lengths, self.bads, self.pad = lengths, bads, pad
        self.reinitialize()

    def reinitialize(self):
        self.pos, self.ended, self.front = 0, False, collections.deque()

    def _event(self):
        if self.ended:
            return ("end",)
        if len(self.lengths) == 1:
            return self._one_pipeline(self.lengths[0], self.bads[0])
        s, self.pos = self.pos, self.pos + 1
        errors = [r for r, bad in enumerate(self.bads) if s in bad and s < self.lengths[r]]
        if errors:
            return ("error", (errors[0], s))
        got = [s + 1 if s < n else 0 for n in self.lengths]
        return self._outcome(got, all(got) or self.pad)

    def _one_pipeline(self, length, bad):
        got = []
        for _ in range(REPLICAS):  # a step reads REPLICAS elements, in order
            i, self.pos = self.pos, self.pos + 1
            if i in bad and i < length:
                return ("error", (0, i))  # the step's elements read before it are gone
            if i >= length and not self.pad:
                return self._outcome(got, False)  # a partial final batch is dropped
            got.append(i + 1 if i < length else 0)
        return self._outcome(got, True)

    def _outcome(self, got, runs):
        if runs and any(got):
            return ("ok", got)
        self.ended = True
        return ("end",)

    def _at(self, idx):
        while len(self.front) <= idx:
            self.front.append(self._event())
        return self.front[idx]

    def take(self, k, fails=False):
        """What ``run(..., steps=k)`` gives: ``("ok", steps)``, ``("error", element)`` or
        ``("end",)``; a call that ``fails`` after taking its steps consumes nothing."""
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


FAST_AUTO = {"WARMUP": 0, "WINDOW": 1, "SHARE": 0.0}


class InputMachine(RuleBasedStateMachine):
    @initialize(per_replica=st.booleans(),
                lengths=st.lists(st.integers(3, 13), min_size=REPLICAS, max_size=REPLICAS),
                bads=st.lists(st.sets(st.integers(0, 12), max_size=3), min_size=REPLICAS,
                              max_size=REPLICAS),
                pad=st.booleans(), prefetch=st.sampled_from([False, True, None, "switching"]),
                buffer=st.integers(1, 2))
    def setup(self, per_replica, lengths, bads, pad, prefetch, buffer):
        self.saved = {name: getattr(auto, name) for name in FAST_AUTO}
        if prefetch == "switching":  # the default, with a prefetch trial every few steps
            for name, value in FAST_AUTO.items():
                setattr(auto, name, value)
            prefetch = None
        if not per_replica:  # one pipeline for both replicas
            lengths, bads = lengths[:1], bads[:1]
        bads = [frozenset(bad) for bad in bads]
        self.model = _Model(lengths, bads, pad)
        self.rep = _rep()
        mode = jr.InputReplicationMode.PER_REPLICA if per_replica else \
            jr.InputReplicationMode.PER_WORKER

        def input_fn(ctx):
            r = ctx.input_pipeline_id
            return _Source(lengths[r], bads[r], r)

        self.it = self.rep.prepare_input(
            input_fn, mode, prefetch_on_device=prefetch, prefetch_buffer_size=buffer,
            partial_batch="pad" if pad else "drop")
        self.step = _see_masked if pad else _see
        self.n, self.count = self.rep.replicate(jnp.int32(0)), 0

    def teardown(self):
        if hasattr(self, "it"):
            self.it.close()
            for name, value in self.saved.items():
                setattr(auto, name, value)

    def _call(self, fn, k, n):
        """What the call gave, as the model says it: ("ok", steps), ("error", element),
        ("end",) or ("failed",)."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the dropped partial batch's warning
                n, seen = self.rep.run(fn, self.it, n, steps=k)
        except StopIteration:
            return ("end",)
        except OSError as e:
            pipeline, element = str(e).rsplit(" ", 1)[1].split(":")
            return ("error", (int(pipeline), int(element)))
        except (RuntimeError, ValueError) as e:
            if "the step failed" in str(e) or "donated to an earlier step" in str(e):
                return ("failed",)
            raise
        values = np.asarray(seen.array).astype(int).reshape(REPLICAS, -1)
        self.n = n
        return ("ok", values.T.tolist())

    @rule(k=st.sampled_from([None, 1, 2, 3]))
    def run(self, k):
        got = self._call(self.step, k, self.n)
        want = self.model.take(k)
        assert got == want, f"run(steps={k}) gave {got}, the model {want}"
        if want[0] == "ok":
            self.count += len(want[1])
        assert int(self.n) == self.count

    @rule(k=st.sampled_from([None, 1, 2, 3]), how=st.sampled_from(["trace", "call"]))
    def failing_run(self, k, how):
        if how == "trace":
            got = self._call(_trace_fails, k, self.n)
        else:
            gone = self.rep.replicate(jnp.int32(0))
            gone.delete()
            got = self._call(self.step, k, gone)
        want = self.model.take(k, fails=True)
        if want[0] == "ok":
            want = ("failed",)
        assert got == want, f"a failing run(steps={k}) gave {got}, the model {want}"

    @precondition(lambda self: hasattr(self, "it"))
    @rule()
    def reinitialize(self):
        assert self.it.reinitialize() == []
        self.model.reinitialize()


InputMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("JR_STATEFUL_EXAMPLES", "25")),
    stateful_step_count=int(os.environ.get("JR_STATEFUL_STEPS", "12")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TestInputMachine = InputMachine.TestCase
