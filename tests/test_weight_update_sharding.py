"""weight_update_sharding=: state sharded over the replicas (ZeRO-1 / ZeRO-3).

References are one-device optax computed here on the concatenated global batch, never
by jreplicate.
"""

import inspect

import jax
import pytest

import jreplicate as jr

STRATEGIES = {
    "MirroredStrategy": lambda **kw: jr.MirroredStrategy(**kw),
    "TPUStrategy": lambda **kw: jr.TPUStrategy(devices=jax.devices(), **kw),
    "MultiWorkerStrategy": lambda **kw: jr.MultiWorkerStrategy(**kw),
}


# -- the option ---------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("level", [None, "optimizer", "parameters"])
def test_option_is_stored_on_the_layout(name, level):
    s = STRATEGIES[name](weight_update_sharding=level, min_weight_shard_size=0)
    assert s.weight_update_sharding == level
    assert s.layout.weight_update_sharding == level
    assert s.layout.min_weight_shard_size == 0
    assert (f"weight_update_sharding={level!r}" in repr(s)) == (level is not None)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("value, error, words", [
    ("zero3", ValueError, "is not a choice"),
    ("", ValueError, "is not a choice"),
    (True, TypeError, "must be None"),
    (1, TypeError, "must be None"),
])
def test_bad_level_names_argument_and_choices(name, value, error, words):
    with pytest.raises(error, match=words) as e:
        STRATEGIES[name](weight_update_sharding=value)
    msg = str(e.value)
    assert f"{name}(weight_update_sharding=" in msg
    assert "'optimizer'" in msg and "'parameters'" in msg


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError),
                                          (True, TypeError), ("8", TypeError)])
def test_bad_min_size(name, value, error):
    with pytest.raises(error, match=rf"{name}\(min_weight_shard_size="):
        STRATEGIES[name](weight_update_sharding="optimizer", min_weight_shard_size=value)


@pytest.mark.parametrize("cls", [jr.MirroredStrategy, jr.TPUStrategy, jr.MultiWorkerStrategy])
def test_options_are_keyword_only(cls):
    params = inspect.signature(cls).parameters
    for name, default in (("weight_update_sharding", None), ("min_weight_shard_size", 1024)):
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default


def test_parameter_server_refuses_the_option():
    with pytest.raises(TypeError, match="weight_update_sharding"):
        jr.ParameterServerStrategy(num_ps=1, num_workers=1, weight_update_sharding="optimizer")
