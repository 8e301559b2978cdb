"""Skip markers for tests that need a package beyond what jreplicate itself needs, or
more devices than the machine has.

The GPU image the device check runs on (bench/README.md, "On an accelerator") has JAX,
Flax, Optax, Orbax, pytest and hypothesis only: a test that needs scikit-learn, tqdm,
matplotlib or Ray skips there, naming the package, instead of failing.
"""

from __future__ import annotations

import importlib.util

import pytest


def installed(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def needs(*modules: str) -> pytest.MarkDecorator:
    """Skips the test unless every one of ``modules`` is installed."""
    missing = [m for m in modules if not installed(m)]
    return pytest.mark.skipif(bool(missing),
                              reason=f"needs {', '.join(missing)} (not installed)")


def needs_devices(n: int) -> pytest.MarkDecorator:
    """Skips the test where JAX has fewer than ``n`` devices (one GPU in the device check;
    the 8 simulated CPU devices elsewhere)."""
    import jax

    have = jax.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} devices, {have} here")
