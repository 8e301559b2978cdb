"""The Ray carrier's actors keep freed step buffers for reuse (jreplicate/ps/_malloc.py)."""

import ctypes
import platform

import numpy as np
import pytest

from jreplicate.ps import _malloc

glibc = platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not glibc, reason="mallopt is glibc's")
def test_thresholds_are_set_and_allocation_still_works(monkeypatch):
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)
    assert _malloc.keep_freed_blocks()
    # A model-sized block allocated and freed twice: the same values come back.
    for _ in range(2):
        a = np.arange(2 * 1024 * 1024, dtype=np.float32)
        assert float(a[-1]) == 2 * 1024 * 1024 - 1
        del a


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                  "GLIBC_TUNABLES"])
def test_the_environment_wins(monkeypatch, name):
    monkeypatch.setenv(name, "1")
    assert not _malloc.keep_freed_blocks()


def test_no_mallopt_changes_nothing(monkeypatch):
    class NoMallopt:
        def __init__(self, *_):
            pass

    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert not _malloc.keep_freed_blocks()
