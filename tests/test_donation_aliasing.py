"""Donation never destroys what another live object holds, at any depth (issue 28).

``run`` donates the arguments named in ``donate_argnums`` and the state of Flax NNX
arguments. Whatever another live object holds, directly or through a container on the
way from the argument to the leaf (``kept = params["layer"]``, ``opt_state[0]``, a
PerReplica inside a dict, a dict inside a Variable's value), must be copied rather than
destroyed, and nothing else copied: direct regression tests, then property tests over
random pytrees and NNX graphs with random aliases kept from outside, on the full path,
the steady-state path and device loops (``steps=``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jreplicate as jr
from jreplicate.execution import donation


@pytest.fixture(scope="module")
def rep():
    return jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))


def _array(rep, v: float) -> jax.Array:
    return jax.device_put(np.array([v, v + 0.5], np.float32), NamedSharding(rep.mesh, P()))


def _per_replica(rep, v: float) -> jr.PerReplica:
    n = rep.num_replicas
    values = np.array([[v + r, v + r + 0.5] for r in range(n)], np.float32)
    return jr.PerReplica(jax.device_put(values, NamedSharding(rep.mesh, P("replica"))),
                         rep.mesh)


def _plus_one(ctx, t):
    return jax.tree.map(lambda x: x + 1.0, t), jnp.float32(0)


def _values(tree: Any) -> list[np.ndarray]:
    """The tree's values now, as NumPy copies (no view keeps an array alive)."""
    return [np.asarray(x).copy() for x in jax.tree.leaves(tree)]


@contextlib.contextmanager
def _counting_copies():
    """The ids of the arrays run copied because another object holds them."""
    copied: list[int] = []
    real = donation.jnp.copy

    def spy(x):
        copied.append(id(x))
        return real(x)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(donation, "jnp", type("J", (), {"copy": staticmethod(spy)}))
        yield copied


# -- direct regression tests -----------------------------------------------------------

_NESTINGS = {
    "dict": (lambda a: {"w": a}, lambda c: c["w"]),
    "list": (lambda a: [a], lambda c: c[0]),
    "tuple": (lambda a: (a,), lambda c: c[0]),
}


@pytest.mark.parametrize("mode", ["single", "steady-state", "device-loop"])
@pytest.mark.parametrize("nesting", sorted(_NESTINGS))
def test_a_container_inside_a_donated_argument_held_elsewhere_keeps_its_arrays(
        rep, nesting, mode):
    wrap, get = _NESTINGS[nesting]
    steps = 2 if mode == "device-loop" else None
    params = {"layer": wrap(_array(rep, 1.0)), "other": _array(rep, 5.0)}
    if mode == "steady-state":  # the structure recorded before anything is held
        params, _ = rep.run(_plus_one, None, params, donate_argnums=(0,))
    kept = params["layer"]
    before = np.asarray(get(kept)).copy()
    for _ in range(2):
        params, _ = rep.run(_plus_one, None, params, steps=steps, donate_argnums=(0,))
    assert not get(kept).is_deleted()
    np.testing.assert_array_equal(np.asarray(get(kept)), before)
    np.testing.assert_array_equal(np.asarray(get(params["layer"])),
                                  before + 2 * (steps or 1))


@pytest.mark.parametrize("mode", ["single", "steady-state"])
def test_a_per_replica_inside_a_donated_container_held_elsewhere_keeps_its_array(rep, mode):
    params = {"pr": _per_replica(rep, 1.0), "w": _array(rep, 0.0)}
    if mode == "steady-state":
        params, _ = rep.run(_plus_one, None, params, donate_argnums=(0,))
    kept = params["pr"]
    before = np.asarray(kept.array).copy()
    for _ in range(2):
        params, _ = rep.run(_plus_one, None, params, donate_argnums=(0,))
    assert not kept.array.is_deleted()
    np.testing.assert_array_equal(np.asarray(kept.array), before)


def test_an_optax_state_held_by_part_keeps_its_arrays(rep):
    tx = optax.adam(0.1)
    with rep.scope():
        p = {"w": jnp.ones(3)}
    o = tx.init(p)

    def step(ctx, p, o):
        u, o = tx.update(jax.tree.map(jnp.ones_like, p), o, p)
        return optax.apply_updates(p, u), o

    p, o = rep.run(step, None, p, o, donate_argnums=(0, 1))
    adam, mu = o[0], o[0].mu  # a NamedTuple inside the state's tuple, a dict inside it
    before = _values(adam)
    for _ in range(2):
        p, o = rep.run(step, None, p, o, donate_argnums=(0, 1))
    for got, want in zip(_values(adam), before, strict=True):
        np.testing.assert_array_equal(got, want)
    assert mu is adam.mu and int(o[0].count) == 3


class _Layer(nnx.Module):
    def __init__(self, v: float):
        self.w = nnx.Param(jnp.full(2, v))
        self.tree = nnx.Param({"a": jnp.full(3, v), "b": (jnp.full(1, v),)})


class _Model(nnx.Module):
    def __init__(self):
        self.layer1 = _Layer(1.0)
        self.layer2 = _Layer(10.0)


def _nnx_step(ctx, m):
    _, state = nnx.split(m)
    nnx.update(m, jax.tree.map(lambda x: x + 1.0, state))
    return jnp.float32(0)


def test_nnx_a_kept_submodule_sees_the_new_state_and_kept_values_keep_the_old(rep):
    with rep.scope():
        m = _Model()
    rep.run(_nnx_step, None, m)
    layer = m.layer1                          # updated in place: sees the new values
    tree = m.layer1.tree.get_value()          # a Variable's value: replaced, keeps old
    inner = tree["b"]                         # a container inside it
    w = m.layer2.w.get_value()                # a Variable's array (nnx.split's path)
    old = [_values(tree), _values(inner), _values(w)]
    for _ in range(2):
        rep.run(_nnx_step, None, m)
    for held, want in zip((tree, inner, w), old, strict=True):
        for got, v in zip(_values(held), want, strict=True):
            np.testing.assert_array_equal(got, v)
    assert layer is m.layer1
    np.testing.assert_array_equal(np.asarray(layer.w.get_value()), np.full(2, 4.0))
    np.testing.assert_array_equal(np.asarray(m.layer1.tree.get_value()["b"][0]), [4.0])


def test_nnx_a_variable_holding_a_one_leaf_pytree_runs(rep):
    """nnx_args.split_fast took such a Variable's value for an array and the step
    failed with an unrelated error about changed attributes."""
    class M(nnx.Module):
        def __init__(self):
            self.v = nnx.Param({"a": jnp.zeros(3)})

    with rep.scope():
        m = M()
    kept = m.v.get_value()
    for _ in range(2):
        rep.run(_nnx_step, None, m)
    np.testing.assert_array_equal(np.asarray(m.v.get_value()["a"]), np.full(3, 2.0))
    np.testing.assert_array_equal(np.asarray(kept["a"]), np.zeros(3))


# -- the class: random pytrees, random aliases ------------------------------------------

class _Pair(NamedTuple):
    a: Any
    b: Any


@dataclasses.dataclass
class _Box:  # a custom pytree node (read through jax's one-level flatten)
    x: Any
    y: Any


jax.tree_util.register_dataclass(_Box, data_fields=["x", "y"], meta_fields=[])

_LEAF = st.sampled_from(["array", "array", "per_replica"])
_SPEC = st.recursive(_LEAF, lambda c: st.one_of(
    st.dictionaries(st.sampled_from("abc"), c, max_size=3).map(lambda d: ("dict", d)),
    st.lists(c, max_size=3).map(lambda xs: ("list", xs)),
    st.lists(c, max_size=3).map(lambda xs: ("tuple", xs)),
    st.tuples(c, c).map(lambda xs: ("pair", xs)),
    st.tuples(c, c).map(lambda xs: ("box", xs))), max_leaves=6)


def _build(rep, spec, counter: list) -> Any:
    if spec in ("array", "per_replica"):
        counter[0] += 1
        return (_array if spec == "array" else _per_replica)(rep, 10.0 * counter[0])
    kind, kids = spec
    if kind == "dict":
        return {k: _build(rep, v, counter) for k, v in sorted(kids.items())}
    built = [_build(rep, k, counter) for k in kids]
    return {"list": list, "tuple": tuple, "pair": lambda b: _Pair(*b),
            "box": lambda b: _Box(*b)}[kind](built)


def _nodes(tree: Any) -> list:
    """Every object of the tree: itself, its containers and leaves."""
    out = [tree]
    try:
        kids = jax.tree_util.flatten_one_level(tree)[0]
    except ValueError:
        return out
    for k in kids:
        out.extend(_nodes(k))
    return out


def _pick(data: Any, nodes: list, obj=lambda n: n) -> list:
    """Up to three of ``nodes`` to keep from outside, containers as often as arrays
    (``obj``: a node's object)."""
    def is_leaf(n):
        return isinstance(obj(n), jax.Array)

    groups = [g for g in ([x for x in nodes if not is_leaf(x)],
                          [x for x in nodes if is_leaf(x)]) if g]
    picks = data.draw(st.lists(st.tuples(st.integers(0, len(groups) - 1),
                                         st.integers(0, 10 ** 6)), max_size=3), "aliases")
    return [groups[g][i % len(groups[g])] for g, i in picks]


def _arrays(tree: Any) -> set[int]:
    return {id(x) for x in jax.tree.leaves(tree)}


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=_SPEC, mode=st.sampled_from(["single", "steady-state", "device-loop"]),
       data=st.data())
def test_donation_keeps_every_alias_at_any_depth_and_copies_nothing_else(
        rep, spec, mode, data):
    tree = _build(rep, spec, [0])
    if not jax.tree.leaves(tree):
        return
    steps = 2 if mode == "device-loop" else None
    if mode == "steady-state":
        tree, _ = rep.run(_plus_one, None, tree, donate_argnums=(0,))
    kept = _pick(data, _nodes(tree))
    kept_values = [_values(k) for k in kept]
    held = set().union(*map(_arrays, kept)) if kept else set()
    expect = [v + (steps or 1) for v in _values(tree)]
    with _counting_copies() as copied:
        tree, _ = rep.run(_plus_one, None, tree, steps=steps, donate_argnums=(0,))
    for k, values in zip(kept, kept_values, strict=True):
        assert not any(x.is_deleted() for x in jax.tree.leaves(k))
        for got, want in zip(_values(k), values, strict=True):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(_values(tree), expect, strict=True):
        np.testing.assert_array_equal(got, want)
    assert set(copied) == held  # what another object holds is copied, nothing else
    assert len(copied) == len(held)


class _Node(nnx.Module):
    """An NNX graph node built from a spec: Variables holding an array or a pytree,
    raw arrays in an nnx.data dict, submodules, an nnx.List of submodules."""

    def __init__(self, spec: list, counter: list):
        v = lambda: float(counter.__setitem__(0, counter[0] + 1) or counter[0])  # noqa: E731
        for j, kind in enumerate(spec):
            if kind == "var":
                value = nnx.Param(jnp.full(2, v()))
            elif kind == "var-tree":
                value = nnx.Param({"a": jnp.full(2, v()), "t": (jnp.full(2, v()),)})
            elif kind == "raw":
                value = nnx.data({"r": jnp.full(2, v())})
            elif kind == "list":
                value = nnx.List([_Node(["var"], counter)])
            else:
                value = _Node(kind, counter)
            setattr(self, f"f{j}", value)


_NNX_SPEC = st.recursive(
    st.lists(st.sampled_from(["var", "var", "var-tree", "raw", "list"]), min_size=1,
             max_size=3),
    lambda c: st.lists(st.one_of(st.sampled_from(["var", "var-tree"]), c), min_size=1,
                       max_size=3), max_leaves=4)


def _nnx_nodes(node: Any, in_place: bool = True) -> list:
    """``(object, whether run updates it in place)`` for every object of an NNX graph:
    modules, nnx.List, Variables and nnx.data dicts are updated in place (whoever holds
    them sees the new state); the arrays and the containers inside a Variable's value
    are replaced (whoever holds them keeps the old values)."""
    out = [(node, in_place)]
    if isinstance(node, nnx.Variable):
        value = node.get_value()
        return out + ([(value, False)] if isinstance(value, jax.Array)
                      else [(x, False) for x in _nodes(value)])
    if isinstance(node, (nnx.Module, nnx.List)):
        kids = list(node) if isinstance(node, nnx.List) else \
            [x for k, x in vars(node).items() if k.startswith("f")]
    elif isinstance(node, dict):
        kids = list(node.values())
    else:
        return [(node, False)]  # a raw array
    for k in kids:
        out.extend(_nnx_nodes(k))
    return out


def _mixed_step(ctx, m, t):
    _nnx_step(ctx, m)
    return _plus_one(ctx, t)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=_NNX_SPEC, plain=_SPEC,
       mode=st.sampled_from(["single", "steady-state", "device-loop"]), data=st.data())
def test_nnx_donation_keeps_every_alias_at_any_depth_and_copies_nothing_else(
        rep, spec, plain, mode, data):
    with rep.scope():
        m = _Node(spec, [0])
    tree = _build(rep, plain, [100])
    steps = 2 if mode == "device-loop" else None
    k = steps or 1

    if mode == "steady-state":
        tree, _ = rep.run(_mixed_step, None, m, tree, donate_argnums=(1,))
    kept = _pick(data, _nnx_nodes(m) + [(x, False) for x in _nodes(tree)], lambda n: n[0])
    kept_values = [[v + k if in_place else v for v in _values(x)] for x, in_place in kept]
    held = set().union(*(_arrays(x) for x, in_place in kept if not in_place))
    expect = [v + k for v in _values(nnx.state(m))], [v + k for v in _values(tree)]
    with _counting_copies() as copied:
        tree, _ = rep.run(_mixed_step, None, m, tree, steps=steps, donate_argnums=(1,))
    for (x, _), values in zip(kept, kept_values, strict=True):
        for got, want in zip(_values(x), values, strict=True):
            np.testing.assert_array_equal(got, want)
    for got, want in zip(_values(nnx.state(m)) + _values(tree), expect[0] + expect[1],
                         strict=True):
        np.testing.assert_array_equal(got, want)
    assert set(copied) == held and len(copied) == len(held)


def test_an_unheld_nested_argument_takes_the_steady_state_path_without_copies(
        rep, counted):
    params = {"a": {"b": [(_array(rep, 1.0), _Pair(_array(rep, 2.0), _per_replica(rep, 3.0)))],
                    "c": _Box(_array(rep, 4.0), {"d": _array(rep, 5.0)})}}
    with _counting_copies() as copied:
        for _ in range(4):
            params, _ = rep.run(_plus_one, None, params, donate_argnums=(0,))
        assert copied == [] and counted["hit"] == 3
        kept = params["a"]["c"].y  # a dict inside a custom node
        params, _ = rep.run(_plus_one, None, params, donate_argnums=(0,))
        assert len(copied) == 1 and counted["miss"] == 2  # (the first call, this one)
        params, _ = rep.run(_plus_one, None, params, donate_argnums=(0,))
        assert counted["hit"] == 4 and len(copied) == 1
    np.testing.assert_array_equal(np.asarray(kept["d"]), [9.0, 9.5])


def test_tpu_strategy_steps_per_run_keeps_a_held_container():
    """A device loop of the strategy's steps_per_run over an input iterator."""
    rep = jr.Replicator(jr.TPUStrategy(devices=jax.devices()[:2], steps_per_run=2))
    data = [np.full((2,), float(i), np.float32) for i in range(8)]
    it = rep.prepare_input(lambda ctx: iter(data), jr.InputReplicationMode.PER_REPLICA)

    def step(ctx, batch, p):
        return jax.tree.map(lambda x: x + 1.0, p), jnp.sum(batch)

    params = {"layer": {"w": _array(rep, 1.0)}, "opt": (_Pair(_array(rep, 2.0), ()),)}
    params, _ = rep.run(step, it, params, donate_argnums=(0,))
    kept, pair = params["layer"], params["opt"][0]
    before = _values((kept, pair))
    params, _ = rep.run(step, it, params, donate_argnums=(0,))
    for got, want in zip(_values((kept, pair)), before, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(params["layer"]["w"]), before[0] + 2.0)


def test_a_parameter_server_worker_still_donates_its_nested_parameters_without_a_copy():
    """The worker donates the parameters it placed for the step (several devices): a
    fresh pytree that nothing else holds, at any depth."""
    from jreplicate.ps.closure import Closure, HostBatch
    from jreplicate.ps.worker import PSWorker
    from tests.test_ps_forwarding import _Client

    params = {"layer": {"w": np.ones((2, 3), np.float32), "b": [np.zeros(3, np.float32)]},
              "o": (np.ones(2, np.float32),)}
    tx = jr.ps.pushable(optax.adam(1e-3))
    worker = PSWorker(0, jax.devices()[:2], _Client(params),
                      jax.tree.map(np.asarray, tx.init(params)))

    def step(ctx, batch, p, o):
        u, o = tx.update(jax.tree.map(lambda a: jnp.ones_like(a) * jnp.sum(batch), p), o, p)
        return optax.apply_updates(p, u), o

    x = np.ones((2, 8), np.float32)
    with _counting_copies() as copied:
        for i in range(3):
            _, decision = worker.run(Closure(i, step, True, HostBatch(
                [[x[:1]], [x[1:]]], jax.tree.structure(0)), (None, None), 0, 1, fn_key=7))
            assert decision.kind == "applied"
    assert copied == []
