"""Soak of process exits with dropped prefetching iterators (issue 9, item 14).

``python bench/exit_soak.py [N]`` runs tests/mp_scripts/drop_prefetch.py N times (default
30, two at a time, each bounded by 120 s) and prints how many exited cleanly (status 0)
and the distinct failures. Before the exit hook of jreplicate/input/prefetch.py, 5 of 12
runs aborted (status 134, "terminate called after throwing an instance of ...").
"""

from __future__ import annotations

import collections
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from tests.test_exit import run_exits  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    t0 = time.monotonic()
    results = run_exits(n)
    clean = sum(rc == 0 for rc, _ in results)
    print(f"{clean} of {n} exits clean in {time.monotonic() - t0:.0f}s")
    failures = collections.Counter((rc, err.strip().splitlines()[-1] if err.strip() else "")
                                   for rc, err in results if rc != 0)
    for (rc, line), count in failures.items():
        print(f"  {count} x status {rc}: {line}")
    return 0 if clean == n else 1


if __name__ == "__main__":
    sys.exit(main())
