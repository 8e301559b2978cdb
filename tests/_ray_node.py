"""``ray start`` for a second Ray node on this machine, on loopback only (used by
tests/test_ps_ray_cluster.py): ``python -m tests._ray_node start --address=... ...``.

Ray's processes listen on 127.0.0.1 alone when their node address is exactly
``127.0.0.1``; Ray keeps that address only under ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
(otherwise it swaps the loopback address for the machine's network address), and under
that flag ``ray start --address`` refuses to join a cluster (multi-node clusters are not
supported on Windows and macOS). This launcher lets the join proceed and keeps the
loopback addresses as given; the processes it starts read the flag from the
environment. On a real cluster none of this is needed: each node has its address.
"""

import sys

import ray._private.ray_constants as ray_constants
from ray._private import services
from ray.scripts.scripts import main

if __name__ == "__main__":
    ray_constants.ENABLE_RAY_CLUSTER = True  # let `ray start --address` join
    services.resolve_ip_for_localhost = lambda host: host  # keep 127.0.0.1
    sys.exit(main())
