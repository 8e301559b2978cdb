"""ParameterServerStrategy(carrier="ray")'s actor options and worker layout, checked on
the driver when the strategy is created (issue 18 item 8). No Ray process is started:
creating the strategy starts nothing."""

import warnings

import jax
import pytest

import jreplicate as jr
from jreplicate.ps.ray.options import (
    is_gpu_worker,
    resolve,
    shard_actor_options,
    worker_actor_options,
)
from tests._optional import needs


def test_a_one_device_driver_lays_out_ray_workers_of_several_replicas():
    """The workers' devices are the actors', not this process's: one driver device and
    num_replicas_in_sync=2 make two workers of two replicas (was: 'needs 2 devices per
    worker but 1 are available')."""
    one = jax.local_devices()[:1]
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2, num_replicas_in_sync=2,
                                   devices=one, carrier="ray")
    assert (s.num_workers, s.num_replicas, s.num_replicas_in_sync) == (2, 4, 2)
    assert s.worker_devices == ((), ()) and s.shard_devices == ()
    assert s.mesh.devices.size == 1  # where the driver places what it restores
    with pytest.raises(ValueError, match="needs 2 devices per worker"):
        jr.ParameterServerStrategy(num_replicas_in_sync=2, devices=one)  # embedded


def test_options_reach_each_actor_merged_with_the_defaults():
    s = jr.ParameterServerStrategy(
        num_ps=2, num_workers=3, carrier="ray", num_replicas_in_sync=2,
        ray_worker_options=lambda w: {"resources": {f"node{w % 2}": 1}, "num_cpus": 1},
        ray_shard_options={"resources": {"ps_node": 0.5}, "memory": 1 << 20})
    workers, shards = s._ray_options
    assert [o["resources"] for o in workers] == [{"node0": 1}, {"node1": 1}, {"node0": 1}]
    merged = worker_actor_options(workers[1], 2)
    assert merged["num_cpus"] == 1 and merged["max_task_retries"] == 0
    assert merged["max_restarts"] == -1  # restarted every time, as preempted workers
    assert merged["runtime_env"]["env_vars"] == {
        "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    assert shard_actor_options(shards[0]) == {
        "num_cpus": 0, "resources": {"ps_node": 0.5}, "memory": 1 << 20,
        "max_restarts": 0, "max_task_retries": 0}


def test_a_users_runtime_env_is_kept_and_completed():
    opts = resolve("ray_worker_options", {"runtime_env": {
        "env_vars": {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false", "A": "1"},
        "pip": ["einops"]}, "max_restarts": 0}, 1, 4)[0]
    merged = worker_actor_options(opts, 4)
    assert merged["runtime_env"]["pip"] == ["einops"] and merged["max_restarts"] == 0
    assert merged["runtime_env"]["env_vars"] == {
        "A": "1", "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_cpu_enable_fast_math=false "
                     "--xla_force_host_platform_device_count=4"}
    assert opts["runtime_env"]["env_vars"]["XLA_FLAGS"] == \
        "--xla_cpu_enable_fast_math=false"  # the user's dict is not changed
    gpu = worker_actor_options(resolve("ray_worker_options", {"num_gpus": 2}, 1, 2)[0], 2)
    assert is_gpu_worker(gpu) and gpu["num_gpus"] == 2
    # Not the driver's JAX_PLATFORMS=cpu (a CPU-only head): every platform, GPUs first.
    assert gpu["runtime_env"] == {"env_vars": {"JAX_PLATFORMS": ""}}


@pytest.mark.parametrize("kw, error, match", [
    pytest.param({"ray_worker_options": {"num_gpu": 1}}, ValueError,
                 r"ray_worker_options=...\): \['num_gpu'\] are not options of a Ray actor",
                 marks=needs("ray")),  # Ray's own list of option names
    ({"ray_worker_options": {"max_task_retries": 2}}, ValueError,
     "reschedules a lost step itself"),
    ({"ray_shard_options": {"max_restarts": 1}}, ValueError, "restart_shard"),
    ({"ray_shard_options": {"name": "ps"}}, ValueError, "one name cannot serve"),
    ({"ray_worker_options": {"num_gpus": 1}, "num_replicas_in_sync": 2}, ValueError,
     "use num_gpus=2"),
    ({"ray_worker_options": {"num_cpus": -1}}, ValueError, "a number >= 0"),
    ({"ray_worker_options": {"resources": {"gpu_node": "1"}}}, ValueError,
     "map resource names to amounts"),
    ({"ray_worker_options": {"max_restarts": 1.5}}, ValueError, "-1 for no limit"),
    ({"ray_worker_options": ["num_cpus", 1]}, TypeError, "must be a dict"),
    pytest.param({"ray_worker_options": lambda w: {"num_cpus": 1} if w == 0 else {"nme": 1}},
                 ValueError, r"for actor 1: \['nme'\]", marks=needs("ray")),
    ({"ray_worker_options": {"runtime_env": "env.yaml"}}, TypeError, "must be a dict"),
    ({"ray_worker_options": {"num_cpus": float("inf")}}, ValueError, "finite"),
    ({"ray_worker_options": {"runtime_env": {"env_vars": {"A": 1}}}}, TypeError,
     "map names to strings"),
    pytest.param({"ray_worker_options": {"resources": {"CPU": 1}}}, ValueError,
                 "Ray refuses these actor options: .*num_cpus", marks=needs("ray")),
])
def test_bad_options_are_errors_naming_the_argument_and_the_fix(kw, error, match):
    kw = {"num_workers": 2, "carrier": "ray", **kw}
    with pytest.raises(error, match=match):
        jr.ParameterServerStrategy(**kw)


def test_options_need_the_ray_carrier():
    with pytest.raises(ValueError, match="pass carrier='ray'"):
        jr.ParameterServerStrategy(ray_worker_options={"num_cpus": 1})


def test_a_driver_with_gpus_is_told_its_workers_run_on_cpu():
    from jreplicate.ps.ray.options import warn_if_gpus_unused
    with pytest.warns(UserWarning, match=r"run on CPU .* ray_worker_options=\{'num_gpus': 2\}"):
        warn_if_gpus_unused(({}, {}), "gpu", 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_gpus_unused(({"num_gpus": 0},), "gpu", 2)  # meant
        warn_if_gpus_unused(({},), "cpu", 2)
