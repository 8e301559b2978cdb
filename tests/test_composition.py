"""Every capability composes with every other: one property, every combination.

One small training run (linear regression by SGD, a running loss sum and an example
count carried as plain state) is driven through a combination of

* state as a plain pytree or a Flax NNX module (with an integer step counter),
* single steps or device loops (``steps=K``),
* donation of the plain state (``donate_argnums``) or none,
* 8 replicas of one device or 4 replicas of 2 logical devices (part of the state on
  logical device 1),
* the steady-state path of ``run`` or every call on the full path,
* full batches (``partial_batch="drop"``) or a final partial batch padded and masked,
* prefetch on, off, or chosen automatically,

and every combination must give the values of an independent NumPy reference and,
bit for bit where the arithmetic is the same program, of the plain path (single steps,
no donation, full path, no prefetch) of its (state form, layout, input) triple. A
pairwise covering set of combinations always runs (``@example``); hypothesis adds
random ones (``JREPLICATE_COMPOSITION_EXAMPLES`` raises the count for bug hunts).
"""

from __future__ import annotations

import itertools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jreplicate as jr
from jreplicate.execution import fast

GLOBAL_BATCH = 16
LR = 0.05
FULL_STEPS = 5
PAD_EXTRA = 6  # with padding, a sixth step holds 6 real examples of 16

_RNG = np.random.default_rng(7)
X = _RNG.normal(size=(FULL_STEPS * GLOBAL_BATCH + PAD_EXTRA, 4)).astype(np.float32)
Y = _RNG.normal(size=(len(X), 3)).astype(np.float32)
W0 = (_RNG.normal(size=(4, 3)) / 2).astype(np.float32)
B0 = np.zeros(3, np.float32)


# -- the reference: NumPy, one device ------------------------------------------------
def _reference(pad: bool) -> dict[str, np.ndarray]:
    n = len(X) if pad else FULL_STEPS * GLOBAL_BATCH
    w, b = W0.astype(np.float64), B0.astype(np.float64)
    loss_sum, seen, count = 0.0, 0.0, 0
    for s in range(0, n, GLOBAL_BATCH):
        x, y = X[s:min(s + GLOBAL_BATCH, n)], Y[s:min(s + GLOBAL_BATCH, n)]
        err = x @ w + b - y
        loss_sum += 0.5 * np.sum(err ** 2) / GLOBAL_BATCH
        w = w - LR * (x.T @ err) / GLOBAL_BATCH
        b = b - LR * err.sum(0) / GLOBAL_BATCH
        seen += len(x)
        count += 1
    return {"w": w, "b": b, "loss_sum": loss_sum, "seen": seen, "count": count}


# -- the steps (module level, so that the program cache sees the same functions) -------
def _loss_and_seen(ctx, batch, w, b, pad):
    x, y = batch
    per_example = 0.5 * jnp.sum((x @ w + b - y) ** 2, -1)
    mask = ctx.batch_mask if pad else None
    loss = jr.compute_average_loss(per_example, GLOBAL_BATCH, sample_weight=mask)
    seen = jnp.sum(mask) if pad else jnp.float32(x.shape[0])
    return loss, seen


def _plain_step(pad):
    def step(ctx, batch, params, acc):
        def f(p):
            return _loss_and_seen(ctx, batch, p["w"], p["b"], pad)

        (loss, seen), g = jax.value_and_grad(f, has_aux=True)(params)
        params = jax.tree.map(lambda p, g: p - LR * g, params, g)
        acc = {"loss_sum": acc["loss_sum"] + ctx.all_sum(loss),
               "seen": acc["seen"] + ctx.all_sum(seen)}
        return params, acc, ctx.all_sum(loss)
    return step


class Linear(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.asarray(W0))
        self.b = nnx.Param(jnp.asarray(B0))
        self.count = nnx.Variable(jnp.int32(0))


def _nnx_step(pad):
    def step(ctx, batch, model, acc):
        def f(m):
            return _loss_and_seen(ctx, batch, m.w[...], m.b[...], pad)

        (loss, seen), g = nnx.value_and_grad(f, has_aux=True)(model)
        model.w[...] = model.w[...] - LR * g["w"][...]
        model.b[...] = model.b[...] - LR * g["b"][...]
        model.count[...] = model.count[...] + 1
        acc = {"loss_sum": acc["loss_sum"] + ctx.all_sum(loss),
               "seen": acc["seen"] + ctx.all_sum(seen)}
        return acc, ctx.all_sum(loss)
    return step


STEPS = {(form, pad): (_nnx_step if form == "nnx" else _plain_step)(pad)
         for form in ("plain", "nnx") for pad in (False, True)}
REPLICATORS: dict[str, jr.Replicator] = {}


def _replicator(layout: str) -> jr.Replicator:
    if layout not in REPLICATORS:
        strategy = (jr.MirroredStrategy() if layout == "8x1"
                    else jr.MirroredStrategy(logical_devices_per_replica=2))
        REPLICATORS[layout] = jr.Replicator(strategy)
    return REPLICATORS[layout]


def _input_fn(pad):
    n = len(X) if pad else FULL_STEPS * GLOBAL_BATCH

    def input_fn(ctx):
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        return ((X[i:min(i + b, n)], Y[i:min(i + b, n)]) for i in range(0, n, b))
    return input_fn


# -- one run of a combination ---------------------------------------------------------
def _train(c: dict) -> dict[str, np.ndarray]:
    rep = _replicator(c["layout"])
    on_one = rep.logical_device_for_variables(1) if c["layout"] == "4x2" else None
    with rep.scope():
        acc = {"loss_sum": jnp.float32(0), "seen": jnp.float32(0)}
        with on_one or _nothing():
            state = Linear() if c["form"] == "nnx" else {"w": jnp.asarray(W0)}
        if c["form"] == "plain":
            state = {**state, "b": jnp.asarray(B0)}
    inputs = rep.prepare_input(_input_fn(c["pad"]), partial_batch="pad" if c["pad"] else "drop",
                               prefetch_on_device=c["prefetch"])
    step = STEPS[(c["form"], c["pad"])]
    donate = (0, 1) if c["form"] == "plain" and c["donate"] else (1,) if c["donate"] else ()
    steps = None if c["k"] == 1 else c["k"]
    losses = []
    with mock.patch.object(fast, "_ARRAY", fast._ARRAY if c["fast"] else None):
        while True:
            try:
                out = rep.run(step, inputs, state, acc, steps=steps, donate_argnums=donate)
            except StopIteration:
                break
            if c["form"] == "plain":
                state, acc, loss = out
            else:
                acc, loss = out
            losses.extend(np.atleast_1d(np.asarray(loss)).tolist())
    got = {"loss_sum": np.asarray(acc["loss_sum"]), "seen": np.asarray(acc["seen"]),
           "losses": np.asarray(losses, np.float32)}
    if c["form"] == "nnx":
        got.update(w=np.asarray(state.w[...]), b=np.asarray(state.b[...]),
                   count=int(state.count[...]))
        w_sharding = state.w[...].sharding
    else:
        got.update(w=np.asarray(state["w"]), b=np.asarray(state["b"]), count=len(losses))
        w_sharding = state["w"].sharding
    if c["layout"] == "4x2":  # the variable placed on logical device 1 stays there
        want = {d for d in rep.mesh.devices[:, 1].flat}
        assert w_sharding.device_set == want, (c, w_sharding)
    return got


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


FACTORS = {
    "form": ("plain", "nnx"),
    "k": (1, 3),
    "donate": (False, True),
    "layout": ("8x1", "4x2"),
    "fast": (True, False),
    "pad": (False, True),
    "prefetch": (False, True, None),
}


def _pairwise_cover(factors: dict) -> list[dict]:
    """A small set of combinations in which every value pair of every two factors
    occurs (greedy covering array; deterministic)."""
    names = list(factors)
    todo = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
            for va in factors[a] for vb in factors[b]}
    rows = []
    everything = [dict(zip(names, vals)) for vals in itertools.product(*factors.values())]
    while todo:
        best = max(everything, key=lambda r: sum(
            (a, r[a], b, r[b]) in todo for a, b in itertools.combinations(names, 2)))
        todo -= {(a, best[a], b, best[b]) for a, b in itertools.combinations(names, 2)}
        rows.append(best)
    return rows


COVER = _pairwise_cover(FACTORS)
_PLAIN: dict[tuple, dict] = {}


def _plain_path(form: str, layout: str, pad: bool) -> dict:
    key = (form, layout, pad)
    if key not in _PLAIN:
        _PLAIN[key] = _train(dict(form=form, k=1, donate=False, layout=layout, fast=False,
                                  pad=pad, prefetch=False))
    return _PLAIN[key]


def _check(c: dict) -> None:
    got = _train(c)
    ref = _reference(c["pad"])
    np.testing.assert_allclose(got["w"], ref["w"], rtol=2e-5, atol=2e-6, err_msg=str(c))
    np.testing.assert_allclose(got["b"], ref["b"], rtol=2e-5, atol=2e-6, err_msg=str(c))
    np.testing.assert_allclose(got["loss_sum"], ref["loss_sum"], rtol=2e-5, err_msg=str(c))
    assert float(got["seen"]) == ref["seen"], c  # every example counted once
    assert got["count"] == ref["count"] == len(got["losses"]), c
    plain = _plain_path(c["form"], c["layout"], c["pad"])
    for k in ("w", "b", "loss_sum", "losses"):
        np.testing.assert_allclose(got[k], plain[k], rtol=1e-6, atol=1e-7,
                                   err_msg=f"{k} differs from the plain path: {c}")


def _with_cover(test):
    for row in reversed(COVER):
        test = example(c=row)(test)
    return test


def test_the_cover_has_every_pair():
    assert 6 <= len(COVER) <= 14
    for a, b in itertools.combinations(FACTORS, 2):
        seen = {(r[a], r[b]) for r in COVER}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)


@pytest.mark.filterwarnings("ignore::UserWarning")
@settings(max_examples=int(os.environ.get("JREPLICATE_COMPOSITION_EXAMPLES", len(COVER) + 12)),
          deadline=None, database=None)
@given(c=st.fixed_dictionaries({k: st.sampled_from(v) for k, v in FACTORS.items()}))
@_with_cover
def test_every_combination_equals_the_reference_and_the_plain_path(c):
    _check(c)
