"""A state that is one array (``mngr.save(step, w)``) is saved and restored, as the
format-1 manager did: Orbax's ``StandardSave`` takes no bare array, so the manager
stores it in a one-element tuple, which does not count when matched with ``init_fn()``'s
state (restored into ``w`` or ``(w,)`` alike, never into ``{"x": w}``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr

VALUES = {"jax_array": lambda: jnp.arange(3.0), "numpy_array": lambda: np.arange(
    4, dtype=np.int32), "scalar": lambda: jnp.float32(2.5)}


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("background", [True, False])
def test_one_array_as_the_state_round_trips(value, background, tmp_path):
    rep = jr.Replicator(jr.MirroredStrategy())
    x = VALUES[value]()
    with jr.CheckpointManager(tmp_path, rep, enable_async_checkpointing=background) as m:
        assert m.save(1, x)
        assert m.save(2, lambda: x)  # a function returning one array too
    with jr.CheckpointManager(tmp_path, rep) as m:
        at, got = m.restore_or_initialize(lambda: jnp.zeros_like(x))
        assert at == 2 and np.asarray(got).tobytes() == np.asarray(x).tobytes()
        _, (wrapped,) = m.restore_or_initialize(lambda: (jnp.zeros_like(x),))
        assert np.asarray(wrapped).tobytes() == np.asarray(x).tobytes()
        with pytest.raises(jr.checkpoint.CheckpointError, match="does not match"):
            m.restore_or_initialize(lambda: {"x": jnp.zeros_like(x)})
    assert jax.tree.structure(got) == jax.tree.structure(jnp.zeros_like(x))
