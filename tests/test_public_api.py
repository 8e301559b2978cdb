"""Every public name is importable, and __init__ only re-exports."""

import importlib
import importlib.util

import jreplicate
import jreplicate.checkpoint
import jreplicate.cluster
import jreplicate.execution
import jreplicate.input
import jreplicate.strategies
import jreplicate.sync
import jreplicate.testing

sync_module = jreplicate.sync


def test_every_public_name_imports():
    for module in (jreplicate, jreplicate.execution, jreplicate.input, jreplicate.strategies,
                   sync_module, jreplicate.checkpoint, jreplicate.testing, jreplicate.cluster):
        assert module.__all__, module
        for name in module.__all__:
            obj = getattr(module, name)
            assert obj is not None, (module.__name__, name)
            exec(f"from {module.__name__} import {name}", {})


def test_init_defines_nothing_itself():
    for module in (jreplicate, jreplicate.execution, jreplicate.input, jreplicate.strategies,
                   jreplicate.sync, jreplicate.checkpoint, jreplicate.cluster):
        for name in module.__all__:
            obj = getattr(module, name)
            owner = getattr(obj, "__module__", None)
            if owner is not None:
                assert owner != module.__name__ or not callable(obj), (module.__name__, name)


def test_submodules_import():
    for name in ("replicator", "context", "losses", "demo", "input.sources",
                 "input.prefetch", "input.staging", "input.padding", "strategies.mirrored",
                 "layout", "execution.program",
                 "execution.nnx_args", "_jax_compat", "strategies.multi_worker",
                 "cluster.launch", "cluster.spec", "cluster.discovery", "cluster.runtime",
                 "cluster.agreement", "cluster.watchdog", "checkpoint", "checkpoint.manager",
                 "checkpoint.checks", "checkpoint.tree", "checkpoint.dirlock", "sync",
                 "strategies.parameter_server",
                 "ps.placement", "ps.shard", "ps.ledger", "ps.client", "ps.capture",
                 "ps.worker", "ps.coordinator", "ps.remote", "ps.ray_carrier",
                 "ps.executor", "ps.embedded", "ps.handle", "ps._ray_proxy", "testing"):
        importlib.import_module(f"jreplicate.{name}")


def test_sync_replicas_names_are_top_level():
    for name in sync_module.__all__:
        assert getattr(jreplicate, name) is getattr(sync_module, name)


def test_sync_replicas_is_a_function_not_a_module():
    # the function once shadowed a module of the same name (issue 16 item 2)
    assert importlib.util.find_spec("jreplicate.sync_replicas") is None
    assert callable(jreplicate.sync.sync_replicas)
    assert jreplicate.sync.sync_replicas is jreplicate.sync_replicas


def test_fault_injection_is_not_on_the_strategy():
    for name in jreplicate.testing.__all__:
        assert not hasattr(jreplicate.ParameterServerStrategy, name), name
