"""The Ray carrier's actors keep freed step buffers for reuse (private).

A worker actor allocates a model-sized buffer or two per step (the parameters it
places, the gradients and outputs of the step) and frees them a step or two later.
With glibc's default, adaptive thresholds those blocks go back to the operating system
when freed (``munmap``, or the heap trimmed) and come back as new pages, which the
kernel faults in and zeroes on first touch: measured on the 4.4 MB MLP of
``bench/ray_baseline.py``, about 800 page faults and 2 ms of system CPU per update in
the threads that run the step. Fixed thresholds keep blocks under
:data:`MMAP_THRESHOLD` in the heap and keep up to :data:`TRIM_THRESHOLD` of free heap
for the next step (the same as ``MALLOC_MMAP_THRESHOLD_`` and
``MALLOC_TRIM_THRESHOLD_`` in the environment).

Only in the processes of the carrier's own actors; on a C library without ``mallopt``
(not glibc) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

#: Blocks up to this size come from the heap (glibc's largest adaptive threshold).
MMAP_THRESHOLD = 32 * 1024 * 1024
#: Free memory at the top of the heap kept before returning it to the system.
TRIM_THRESHOLD = 128 * 1024 * 1024
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_blocks() -> bool:
    """Sets this process's allocator thresholds (see the module docstring), unless the
    environment sets them (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, or
    ``GLIBC_TUNABLES``). Returns whether they were set."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                     "GLIBC_TUNABLES")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc: its own allocator, left alone
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
