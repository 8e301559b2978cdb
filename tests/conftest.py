"""Test configuration: 8 simulated CPU devices, set before JAX initialises.

With ``JREPLICATE_TEST_DEVICES=native`` the tests run on the machine's own devices
instead (one GPU in bench/device_check.py; one CPU device where there is none): JAX picks
its platform, nothing is simulated, matrix products run in full float32 (GPUs otherwise
use TF32, too coarse for the one-device references), and the ``strategy`` fixture offers
only the strategies those devices can host. Only the files bench/device_check.py selects
are written for any device count.
"""

import os

NATIVE = os.environ.get("JREPLICATE_TEST_DEVICES") == "native"
if not NATIVE:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in _flags:
        os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

if NATIVE:
    jax.config.update("jax_default_matmul_precision", "highest")
else:
    jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402

import jreplicate as jr  # noqa: E402

# Every in-process strategy configuration the conformance suite runs over. Strategies
# that need several processes (MultiWorkerStrategy) run the same checks in
# tests/test_multi_worker*.py through real processes.
STRATEGY_FACTORIES = {
    "mirrored-8": lambda: jr.MirroredStrategy(),
    "mirrored-4": lambda: jr.MirroredStrategy(devices=jax.local_devices()[:4]),
    "mirrored-2-odd": lambda: jr.MirroredStrategy(devices=[jax.local_devices()[i] for i in (5, 2)]),
    "mirrored-1": lambda: jr.MirroredStrategy(devices=[0]),
    # 4 replicas x 2 logical devices: the step is manual over "replica" only.
    "mirrored-4x2": lambda: jr.MirroredStrategy(logical_devices_per_replica=2),
    "tpu-8": lambda: jr.TPUStrategy(devices=jax.devices()),  # laid out as on a TPU
    # Parameter servers (tests/test_conformance.py marks the SPMD-only checks): one
    # worker (sequential, so equal to one device), and 3 sync groups of 2 devices.
    "ps-1": lambda: jr.ParameterServerStrategy(num_ps=2, num_workers=1),
    "ps-3x2": lambda: jr.ParameterServerStrategy(num_ps=2, num_replicas_in_sync=2),
}

if NATIVE:  # what one device (or a few) can host: each uses every device, or the first
    STRATEGY_FACTORIES = {
        "mirrored-all": lambda: jr.MirroredStrategy(),
        "mirrored-1": lambda: jr.MirroredStrategy(devices=[0]),
        "tpu-all": lambda: jr.TPUStrategy(devices=jax.devices()),  # laid out as on a TPU
        "ps-1": lambda: jr.ParameterServerStrategy(num_ps=1, num_workers=1,
                                                   devices=jax.devices()[:1]),
    }


@pytest.fixture(params=sorted(STRATEGY_FACTORIES))
def strategy(request):
    return STRATEGY_FACTORIES[request.param]()


@pytest.fixture
def counted(monkeypatch):
    """Counts the calls of run's steady-state path (jreplicate/execution/fast.py) that
    ran ("hit") and those sent to the full path ("miss")."""
    from jreplicate.execution import fast

    got = {"hit": 0, "miss": 0}
    call = fast.FastPath.call

    def counting(self, *a, **k):
        out = call(self, *a, **k)
        got["miss" if out is fast.MISS else "hit"] += 1
        return out

    monkeypatch.setattr(fast.FastPath, "call", counting)
    return got
