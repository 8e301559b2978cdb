"""The examples in the public docstrings run and print what they say."""

import doctest
import importlib
import pkgutil

import pytest

import jreplicate
from tests._optional import installed

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(jreplicate.__path__, "jreplicate.")
    if m.name not in ("jreplicate.cluster.launch", "jreplicate.demo")  # entry points, no doctests
)


# Modules whose examples need a package jreplicate itself does not (Ray checks the names
# of Ray's actor options), skipped where it is missing (the GPU image).
NEEDS = {"jreplicate.strategies.parameter_server": "ray"}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    if name in NEEDS and not installed(NEEDS[name]):
        pytest.skip(f"its examples need {NEEDS[name]} (not installed)")
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in {name}"


def test_public_api_has_examples():
    attempted = sum(doctest.testmod(importlib.import_module(n)).attempted for n in MODULES)
    assert attempted >= 20, attempted
