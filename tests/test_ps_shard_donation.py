"""The shard's jitted update gives each donated optimizer-state buffer to that state's
own new value: no copies in the compiled update (jax.jit hands donated buffers to the
first outputs of their shape and dtype; with the parameters first, the new parameters
took mu's buffers and XLA copied every leaf twice)."""

import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.ps.shard import PSShard


def _params():
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(64, 32)).astype(np.float32),
            "b": np.zeros(32, np.float32),
            "v": rng.normal(size=(32, 32)).astype(np.float32)}


def _copies(shard: PSShard) -> list[str]:
    """The compiled update's copies of arrays (scalar counters aside)."""
    text = shard.update.jitted.lower(shard._params, shard._opt_state,
                                     *shard.update.example(shard._params)).compile().as_text()
    return [line.strip() for line in text.splitlines()
            if " copy(" in line and "[] copy(" not in line]


@pytest.mark.parametrize("tx", [
    lambda: optax.adam(1e-3),
    lambda: optax.sgd(0.1, momentum=0.9),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    lambda: jr.sync.sync_replicas(optax.adam(1e-3), replicas_to_aggregate=2,
                                  total_num_replicas=3),
], ids=["adam", "momentum", "clip+adamw", "sync_replicas"])
def test_the_update_copies_no_leaf(tx):
    shard = PSShard(0, _params(), tx())
    assert not shard.may_raise
    assert _copies(shard) == []


def test_the_update_still_applies_exactly():
    """The reordered update's values: optax's own, step by step."""
    params, tx = _params(), optax.adam(1e-2)
    shard = PSShard(0, params, tx)
    ref_p, ref_o = dict(params), tx.init(params)
    rng = np.random.default_rng(1)
    for i in range(5):
        g = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
        shard.push(i, 0, i, g)
        u, ref_o = tx.update(g, ref_o, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    step, got = shard.pull()
    assert step == 5
    for k in params:
        np.testing.assert_allclose(got[k], np.asarray(ref_p[k]), rtol=1e-6, atol=1e-7)
