"""A JAX-free program for launcher tests: prints its environment, then behaves as told.

``python plain.py ok|exit3|kill|flaky|sleep|grandchild [args...]``
"""

import os
import signal
import subprocess
import sys
import time

rank = int(os.environ["JREPLICATE_PROCESS_ID"])
restart = int(os.environ["JREPLICATE_RESTART_COUNT"])
what = sys.argv[1]
print(f"hello rank={rank} n={os.environ['JREPLICATE_NUM_PROCESSES']} "
      f"coord={os.environ['JREPLICATE_COORDINATOR']} restart={restart} "
      f"xla={os.environ.get('XLA_FLAGS', '')!r} args={sys.argv[2:]}", flush=True)
print(f"note from rank={rank}", file=sys.stderr, flush=True)
if what == "exit3" and rank == 1:
    time.sleep(0.3)
    print("ValueError: bad shard", file=sys.stderr, flush=True)
    sys.exit(3)
if what == "kill" and rank == 1:
    time.sleep(0.3)
    os.kill(os.getpid(), signal.SIGKILL)
if what == "flaky" and rank == 0 and restart < 2:
    sys.exit(7)
if what == "grandchild":  # a child of its own, which must die with the launcher
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(f"GRANDCHILD {child.pid} of rank={rank}", flush=True)
if what in ("exit3", "kill", "sleep", "grandchild"):
    time.sleep(60)  # stopped by the launcher long before this
