"""Ordered input reads, training threads and the Ray address, where features meet.

Each test failed before its fix.
"""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jreplicate as jr

M = jr.InputReplicationMode


def _see(ctx, batch, n):
    return n + 1, batch[0]


def _pipelines(ctx):
    """Per replica 4 elements, except replica 1 (3: it ends in the last step) and
    replica 3, which raises at its element 3 (in that same step)."""
    r = ctx.input_pipeline_id
    for i in range(4 - (r == 1)):
        if r == 3 and i == 3:
            raise OSError("pipeline 3 failed")
        yield np.full((1,), i, np.float32)


@pytest.mark.parametrize("enforce_ordering", [False, True])
@pytest.mark.parametrize("steps", [None, 2])
def test_enforce_ordering_never_hides_a_pipelines_error_behind_another_ones_end(
        enforce_ordering, steps):
    """Item 5 with ordered reads: a pipeline of a lower index ending in the step where a
    later one raises was a quiet end of the input ("dropped a final partial batch")."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))
    it = rep.prepare_input(_pipelines, M.PER_REPLICA, enforce_ordering=enforce_ordering,
                           prefetch_on_device=False)
    n = rep.replicate(jnp.int32(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "dropped a partial batch": it is an error
        with pytest.raises(OSError, match="pipeline 3 failed"):
            for _ in range(4):
                n, _ = rep.run(_see, it, n, steps=steps)
    assert int(n) == 3


@pytest.mark.parametrize("enforce_ordering", [False, True])
def test_ordered_reads_still_drop_an_uneven_end_with_a_warning(enforce_ordering):
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:4]))

    def uneven(ctx):
        return iter([np.full((1,), i, np.float32)
                     for i in range(3 - (ctx.input_pipeline_id == 1))])

    it = rep.prepare_input(uneven, M.PER_REPLICA, enforce_ordering=enforce_ordering,
                           prefetch_on_device=False)
    n = rep.replicate(jnp.int32(0))
    for _ in range(2):
        n, _ = rep.run(_see, it, n)
    with pytest.warns(UserWarning, match=r"ran out after 3 of 4 replicas"):
        with pytest.raises(StopIteration):
            rep.run(_see, it, n)


def test_a_loop_whose_read_ends_at_exit_never_places_the_steps_read():
    """Ctrl-C at exit: a read that returns after the exit began raises InputClosedError,
    so that the reading thread (which the exit does not wait for) never goes on into
    JAX while it is torn down. A device loop took that error for an input error at step
    k and placed its k complete steps (a device transfer during teardown)."""
    from jreplicate.input import shutdown

    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:1]))

    def source(ctx):
        for i in range(6):
            if i == 2:
                shutdown.begin_exit()  # the exit begins while this element is read
            yield np.full((1,), i, np.float32)

    it = rep.prepare_input(source, prefetch_on_device=False)
    placed = []
    assemble = it._executor.assemble
    it._executor = type("Spy", (), {"assemble": lambda self, *a: placed.append(a)
                                    or assemble(*a)})()
    n, raised = rep.replicate(jnp.int32(0)), []

    def read():  # on a daemon thread, as the exit does not wait for one
        try:
            rep.run(_see, it, n, steps=4)
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    thread = threading.Thread(target=read, daemon=True)
    try:
        thread.start()
        thread.join(timeout=60)
    finally:
        shutdown._exiting.clear()
    assert len(raised) == 1 and isinstance(raised[0], shutdown.InputClosedError), raised
    assert placed == []


def test_a_training_thread_outliving_the_main_thread_keeps_reading_in_line():
    """The exit hook runs when the main thread ends, before the interpreter joins the
    other (non-daemon) threads: a training thread reading its input in line got
    InputClosedError ("the process is exiting") on its next read. Only daemon threads,
    which the exit does not wait for, must stop reading. (With prefetch, Python 3.12
    itself refuses to start a thread at that point.)"""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in __import__("os").environ.items()
           if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = str(root)
    r = subprocess.run([sys.executable, str(root / "tests" / "mp_scripts" /
                                            "train_in_thread.py"), "no-prefetch"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert "DONE 3" in r.stdout, r.stdout + r.stderr[-2000:]


class _FakeRay:
    """Records how ensure_ray initialises Ray (no Ray instance is started)."""

    def __init__(self):
        self.inits = []

    def is_initialized(self):
        return bool(self.inits)

    def init(self, **kwargs):
        self.inits.append(kwargs)


@pytest.mark.parametrize("address, private", [(None, True), ("local", True),
                                               ("auto", False), ("10.0.0.5:6379", False)])
def test_ray_address_local_gets_the_private_loopback_instance(monkeypatch, address,
                                                             private):
    """RAY_ADDRESS=local asks Ray for a new local instance: it was started by a plain
    ray.init(), which listens on the machine's network address (Ray's processes
    exchange pickles)."""
    from jreplicate.ps.ray import carrier as ray_carrier

    fake = _FakeRay()
    monkeypatch.setattr(ray_carrier, "_ray", lambda: fake)
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    assert ray_carrier.ensure_ray() is fake
    assert ray_carrier.ensure_ray() is fake  # a second strategy: the same instance
    assert len(fake.inits) == 1
    assert (fake.inits[0].get("_node_ip_address") == "127.0.0.1") is private
    assert fake.inits[0]["include_dashboard"] is False
