"""No warning from jreplicate's own code (issue 28): Flax's DeprecationWarning for
``flax.nnx.State`` came from the parameter server's check of NNX state that a step
changes (``State.filter``); pyproject.toml's ``filterwarnings`` turns a
DeprecationWarning raised from a jreplicate module into an error in the suite."""

import tomllib
import warnings
from pathlib import Path

import pytest

from jreplicate.ps.nnx_state import NnxArg, check_nothing_lost

nnx = pytest.importorskip("flax.nnx")
ROOT = Path(__file__).resolve().parents[1]


def _as_errors():
    warnings.simplefilter("error", DeprecationWarning)
    warnings.simplefilter("error", FutureWarning)
    warnings.simplefilter("error", PendingDeprecationWarning)


def test_checking_nnx_state_a_step_changed_uses_no_deprecated_flax_api():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    with warnings.catch_warnings():
        _as_errors()
        check_nothing_lost([NnxArg(graphdef, state)], [model])  # nothing changed
        graphdef, state = nnx.split(nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
        built = nnx.merge(graphdef, nnx.clone(state))
        built.mean.set_value(built.mean.get_value() + 1)  # a step changed a statistic
        with pytest.raises(ValueError, match=r"changed the BatchStat at 'mean'"):
            check_nothing_lost([NnxArg(graphdef, state)], [built])


def test_the_suite_turns_deprecation_warnings_from_jreplicate_into_errors():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    filters = config["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert "error::DeprecationWarning:jreplicate" in filters
