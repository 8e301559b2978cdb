"""The public API: tiered namespaces, every name importable and documented with an
example that runs, and ``__init__`` files that only re-export."""

import importlib
import importlib.util
import inspect
import pkgutil
import types

import pytest

import jreplicate
import jreplicate.testing

#: The namespaces a user imports names from (``jr.<ns>.<Name>``), the top level first.
NAMESPACES = [jreplicate] + [importlib.import_module(f"jreplicate.{n}") for n in (
    "checkpoint", "cluster", "execution", "input", "ps", "strategies", "sync", "testing")]

#: What a researcher types daily stays at the top level (issue 16 item 5).
TOP_LEVEL = {
    "Replicator", "ReplicaContext", "PerReplica", "InputContext", "InputIterator",
    "InputReplicationMode", "MirroredStrategy", "MultiWorkerStrategy", "TPUStrategy",
    "ParameterServerStrategy", "compute_average_loss", "scale_regularization_loss",
    "sync_replicas", "same_on_every_replica",
    "CheckpointManager", "MODEL_AXIS", "REPLICA_AXIS", "one_replica",
    "ReplicationHabitWarning",
}


def _public(module):
    for name in module.__all__:
        obj = getattr(module, name)
        if not isinstance(obj, types.ModuleType):
            yield name, obj


def test_the_top_level_is_the_daily_tier():
    names = {n for n, _ in _public(jreplicate)}
    assert names == TOP_LEVEL
    namespaces = {n for n in jreplicate.__all__ if n not in names}
    assert namespaces == {"checkpoint", "cluster", "execution", "input", "ps", "strategies",
                          "sync"}
    for moved, where in (("pushable", "ps"), ("RemoteValue", "ps"), ("WorkerLostError", "ps"),
                         ("ClusterSpec", "cluster"), ("Timeouts", "cluster"),
                         ("take_token", "sync"), ("Layout", "strategies"),
                         ("Strategy", "strategies"), ("CheckpointError", "checkpoint")):
        assert not hasattr(jreplicate, moved), moved  # one home, no twin
        assert moved in getattr(jreplicate, where).__all__, (moved, where)


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_every_public_name_imports(module):
    assert module.__all__, module
    assert sorted(module.__all__) == sorted(set(module.__all__)), module
    for name in module.__all__:
        assert getattr(module, name) is not None, (module.__name__, name)
        exec(f"from {module.__name__} import {name}", {})


@pytest.mark.parametrize("module", NAMESPACES, ids=lambda m: m.__name__)
def test_every_public_name_has_an_example(module):
    """Each public class and function documents itself with an example; the examples
    run in tests/test_doctests.py (the modules defining them are all collected)."""
    missing = []
    for name, obj in _public(module):
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants (axis names, the commit marker)
        doc = inspect.getdoc(obj) or ""
        if ">>>" not in doc:
            missing.append(name)
        owner = importlib.import_module(obj.__module__)
        assert owner.__name__.startswith("jreplicate"), (name, owner)
    assert not missing, f"{module.__name__}: no example in the docstring of {missing}"


def test_init_defines_nothing_itself():
    for module in NAMESPACES[:-1]:  # jreplicate.testing is a module, not a package
        for name, obj in _public(module):
            owner = getattr(obj, "__module__", None)
            if owner is not None:
                assert owner != module.__name__ or not callable(obj), (module.__name__, name)


def test_every_package_says_where_things_live():
    for m in pkgutil.walk_packages(jreplicate.__path__, "jreplicate."):
        if m.ispkg:
            doc = importlib.import_module(m.name).__doc__ or ""
            assert len(doc.split()) >= 40, f"{m.name}: its __init__ docstring is too short"


def test_submodules_import():
    for m in pkgutil.walk_packages(jreplicate.__path__, "jreplicate."):
        importlib.import_module(m.name)


def test_sync_replicas_is_a_function_not_a_module():
    # the function once shadowed a module of the same name (issue 16 item 2)
    assert importlib.util.find_spec("jreplicate.sync_replicas") is None
    assert callable(jreplicate.sync.sync_replicas)
    assert jreplicate.sync.sync_replicas is jreplicate.sync_replicas


def test_fault_injection_is_not_on_the_strategy():
    for name in jreplicate.testing.__all__:
        assert not hasattr(jreplicate.ParameterServerStrategy, name), name


def test_names_say_what_they_hold():
    # issue 16 item 5: a parameter server's num_workers is the workers asked for (it was
    # 1, the driver process); Layout.first_devices says it holds one device per replica.
    ps = jreplicate.ParameterServerStrategy(num_workers=3)
    assert (ps.num_workers, ps.num_processes, ps.num_replicas) == (3, 1, 3)
    m = jreplicate.MirroredStrategy(logical_devices_per_replica=2)
    assert (m.num_workers, m.num_processes, m.process_index) == (1, 1, 0)
    assert m.layout.first_devices == tuple(r[0] for r in m.layout.replica_devices)
    assert len(m.layout.first_devices) == m.num_replicas == 4
    assert not hasattr(m.layout, "devices") and not hasattr(ps, "num_ps_workers")
