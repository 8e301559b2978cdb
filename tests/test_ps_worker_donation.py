"""The parameter-server worker donating its
placed parameters to the step (and its cached _unforward plans), the capturing wrapper
holding the step weakly, and the one program cache per executor. Every reference is
computed independently with numpy."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jreplicate as jr
from tests._ps_helpers import bounded_test  # noqa: F401 (autouse: every test bounded)
from tests.test_ps_ray import local_ray  # noqa: F401 (one Ray for the module)

T = {"a": np.array([1.0, -2.0], np.float32), "b": np.array([3.0, 0.5, -1.0], np.float32)}
LR = 0.5


def _ps(inner=None, **kw):
    """One worker (so its steps are sequential and exact), params {"a": 2, "b": 3} of
    zeros, a pushable ``inner`` (default sgd(LR)); the gradient of the step is ``w - T``."""
    s = jr.ParameterServerStrategy(**{"num_ps": 2, "num_workers": 1, **kw})
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
        tx = jr.ps.pushable(optax.sgd(LR) if inner is None else inner)
        opt = tx.init(w)

    def grads(w):
        return jax.grad(lambda w: sum(0.5 * jnp.sum((w[k] - T[k]) ** 2) for k in T))(w)

    return s, rep, w, opt, tx, grads


def _reference(n):
    """The parameters before each of ``n`` steps and after the last (numpy sgd)."""
    w = {k: np.zeros_like(v) for k, v in T.items()}
    seen = []
    for _ in range(n):
        seen.append({k: v.copy() for k, v in w.items()})
        w = {k: w[k] - LR * (w[k] - T[k]) for k in T}
    return seen, w


def _assert_tree(got, want):
    jax.tree.map(lambda g, r: np.testing.assert_allclose(np.asarray(g), r, rtol=1e-6,
                                                         atol=1e-6), got, want)


def _params_and_grads_step(tx, grads):
    """A step returning the params it pulled and its gradients (and the new opt state)."""
    def step(ctx, w, opt):
        g = grads(w)
        u, opt = tx.update(g, opt, w)
        return w, g, opt
    return step


def _assert_params_and_grads(s, values):
    """Each step of ``values`` (scheduled in order on one worker) returned the params
    numpy SGD had before it and their gradient; the shards hold the final params."""
    seen, final = _reference(len(values))
    for k, v in enumerate(values):
        got_w, got_g, _ = v.fetch()
        _assert_tree(got_w, seen[k])
        _assert_tree(got_g, {key: seen[k][key] - T[key] for key in T})
    _assert_tree(s.parameters(), final)


# Each returns (outputs, what they must be given the pulled params w0 and gradients g0).
RETURNS = {
    "params_unchanged": (lambda w, g, u, opt: (w, opt),
                         lambda w0, g0: (w0,)),
    "params_twice": (lambda w, g, u, opt: (w, w, opt),
                     lambda w0, g0: (w0, w0)),
    "leaf_inside_another": (lambda w, g, u, opt: ({"x": w["a"], "y": [w["b"]]}, w["a"] * 2),
                            lambda w0, g0: ({"x": w0["a"], "y": [w0["b"]]}, w0["a"] * 2)),
    "part_of_params": (lambda w, g, u, opt: w["b"],
                       lambda w0, g0: w0["b"]),
    "gradients_only": (lambda w, g, u, opt: g,
                       lambda w0, g0: g0),
    "params_and_gradients": (lambda w, g, u, opt: (g, w, opt, w["a"] + 1),
                             lambda w0, g0: (g0, w0, w0["a"] + 1)),
    "applied_update": (lambda w, g, u, opt: (optax.apply_updates(w, u), opt),
                       lambda w0, g0: (w0,)),
    "nothing": (lambda w, g, u, opt: None, lambda w0, g0: None),
}


def _strip_opt(name, out):
    """The outputs without the (empty) optimizer state."""
    if name in ("params_unchanged", "applied_update"):
        return (out[0],)
    if name == "params_twice":
        return out[:2]
    if name == "params_and_gradients":
        return (out[0], out[1], out[3])
    return out


@pytest.mark.parametrize("name", sorted(RETURNS))
def test_ps_donated_params_whatever_the_step_returns(name):
    s, rep, w, opt, tx, grads = _ps()
    ret, want = RETURNS[name]

    def step(ctx, w, opt):
        g = grads(w)
        u, opt = tx.update(g, opt, w)
        return ret(w, g, u, opt)

    n = 5
    values = [rep.run(step, None, w, opt) for _ in range(n)]
    rep.join()
    seen, final = _reference(n)
    for k, v in enumerate(values):
        w0 = seen[k]
        g0 = {key: w0[key] - T[key] for key in T}
        _assert_tree(_strip_opt(name, v.fetch()), want(w0, g0))
    _assert_tree(s.parameters(), final)
    s.shutdown()


def test_ps_donated_params_with_two_replicas_in_sync():
    s, rep, w, opt, tx, grads = _ps(num_replicas_in_sync=2)
    step = _params_and_grads_step(tx, grads)
    values = [rep.run(step, None, w, opt) for _ in range(4)]
    rep.join()
    _assert_params_and_grads(s, values)
    s.shutdown()


def test_ps_a_step_that_raises_after_its_first_run_leaves_the_next_step_whole():
    """The step donated the placed parameters, then raised (a runtime error after the
    donation); the worker's next step must pull, not touch the donated buffers."""
    s, rep, w, opt, tx, grads = _ps()

    def step(ctx, w, opt, fail):
        g = grads(w)
        u, opt = tx.update(g, opt, w)
        w = jax.lax.cond(fail, lambda: jax.tree.map(lambda x: x / 0.0, w), lambda: w)
        return w, opt

    def boom(x):
        if x:
            raise ValueError("broken step")
        return np.float32(0)

    def bad(ctx, w, opt):  # raises when run (after its arguments were donated)
        u, opt = tx.update(grads(w), opt, w)
        z = jax.pure_callback(boom, jax.ShapeDtypeStruct((), jnp.float32), w["a"][0] == 0.75)
        return jax.tree.map(lambda x: x + z, w), opt

    values = [rep.run(step, None, w, opt, np.bool_(False)) for _ in range(2)]
    values.append(rep.run(bad, None, w, opt))  # compiles, runs again and raises
    with pytest.raises(Exception, match="broken step"):
        rep.join()
    values += [rep.run(step, None, w, opt, np.bool_(False)) for _ in range(2)]
    rep.join()
    seen, final = _reference(4)
    for k, v in enumerate(values[:2] + values[3:]):
        _assert_tree(v.fetch()[0], seen[k])
    _assert_tree(s.parameters(), final)
    s.shutdown()


def test_ps_two_steps_of_one_output_structure_but_different_forwarding():
    """_unforward's plans are keyed by the output structure: two steps whose outputs
    have one pytree structure but forward different inputs (or none)."""
    s, rep, w, opt, tx, grads = _ps()

    def step_fwd(ctx, w, opt, x, y):
        u, opt = tx.update(grads(w), opt, w)
        return x, y  # both forwarded (replicated inputs unchanged)

    def step_swap(ctx, w, opt, x, y):
        u, opt = tx.update(grads(w), opt, w)
        return y, x

    def step_own(ctx, w, opt, x, y):
        u, opt = tx.update(grads(w), opt, w)
        return x + 1, y

    x, y = np.arange(3.0, dtype=np.float32), np.arange(3.0, 6.0, dtype=np.float32)
    vals = []
    for _ in range(2):
        for f in (step_fwd, step_swap, step_own):
            vals.append((f, rep.run(f, None, w, opt, x, y)))
    rep.join()
    for f, v in vals:
        a, b = v.fetch()
        want = {step_fwd: (x, y), step_swap: (y, x), step_own: (x + 1, y)}[f]
        np.testing.assert_array_equal(np.asarray(a), want[0])
        np.testing.assert_array_equal(np.asarray(b), want[1])
    _assert_tree(s.parameters(), _reference(6)[1])
    s.shutdown()


def test_ps_token_gated_with_donation():
    """One worker, sync_replicas aggregating 1: every step applied, in order, and the
    params it returns are those it pulled (token-gated mode pushes with push, not
    push_pull)."""
    s, rep, w, opt, tx, grads = _ps(jr.sync_replicas(
        optax.sgd(LR), replicas_to_aggregate=1, total_num_replicas=1))
    step = _params_and_grads_step(tx, grads)
    values = [rep.run(step, None, w, opt) for _ in range(5)]
    rep.join()
    _assert_params_and_grads(s, values)
    assert s.global_step == 5
    s.shutdown()


ray = None
try:
    import ray  # noqa: F811
except ImportError:
    pass


@pytest.mark.skipif(ray is None, reason="Ray is not installed")
def test_ray_pipelined_steps_with_donation_and_alternating_returns(request):
    """carrier="ray", one worker with two steps in flight: each step starts from what
    the previous push returned (reuse), donates its placed copy, and its outputs stay on
    the worker until fetched; steps of one output structure but different forwarding
    alternate (the worker's _unforward plans), as do steps returning the parameters
    unchanged, twice, in part, or their gradients."""
    request.getfixturevalue("local_ray")
    s, rep, w, opt, tx, grads = _ps(carrier="ray")
    assert s._executor._carrier.depth == 2

    def make(name):
        ret = RETURNS[name][0]

        def step(ctx, w, opt, x, y):
            g = grads(w)
            u, opt = tx.update(g, opt, w)
            return ret(w, g, u, opt), (x, y) if name == "params_twice" else (y, x)
        return step

    names = ["params_unchanged", "params_twice", "part_of_params", "gradients_only",
             "params_and_gradients", "leaf_inside_another"]
    steps = {n: make(n) for n in names}
    x, y = np.arange(3.0, dtype=np.float32), np.arange(3.0, 6.0, dtype=np.float32)
    order = names * 2
    values = [rep.run(steps[n], None, w, opt, x, y) for n in order]
    rep.join()
    seen, final = _reference(len(order))
    for k, (n, v) in enumerate(zip(order, values)):
        w0 = seen[k]
        g0 = {key: w0[key] - T[key] for key in T}
        out, (a, b) = v.fetch()
        _assert_tree(_strip_opt(n, out), RETURNS[n][1](w0, g0))
        want = (x, y) if n == "params_twice" else (y, x)
        np.testing.assert_array_equal(np.asarray(a), want[0])
        np.testing.assert_array_equal(np.asarray(b), want[1])
    _assert_tree(s.parameters(), final)
    s.shutdown()


def test_program_cache_evicts_while_steady_calls_are_recorded_and_answers_stay_right():
    """More step functions (one code, different constants) than the 64 programs the
    cache keeps, each called twice per round (the second call steady-state), functions
    dropped and collected between rounds, ids possibly reused: every answer is its own
    function's."""
    import functools

    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        x = jnp.arange(4.0)
    ex = rep._executor

    def make(c):
        return lambda ctx, v: v * c + ctx.num_replicas

    def scaled(ctx, v, *, c):
        return v * c - 1.0

    fns = {c: make(float(c)) for c in range(70)}
    parts = {c: functools.partial(scaled, c=float(c)) for c in range(70, 75)}
    with pytest.warns(UserWarning, match="compiled the step function"):
        for rnd in range(2):
            for c, f in list(fns.items()) + list(parts.items()):
                for _ in range(2):
                    got = np.asarray(rep.run(f, None, x))
                    want = np.arange(4.0) * c + (c in parts and -1.0 or 2)
                    np.testing.assert_array_equal(got, want, err_msg=f"{c} round {rnd}")
            assert len(ex._cache) <= 64
            dropped = [c for c in fns if c % 3 == rnd]
            for c in dropped:  # drop some; new ones take their place
                del fns[c]
            gc.collect()
            for c in dropped:
                fns[c + 1000] = make(float(c + 1000))
    gc.collect()
    assert all(e.fn() is not None for e in ex._cache.entries())
    assert len(ex._cache) <= 64


def test_equal_frozen_dataclass_steps_and_bound_methods():
    """Two equal frozen-dataclass steps (each with programs of its own: see
    tests/test_step_identity.py); the first dropped, the second still runs; bound
    methods of two objects keep apart."""
    import dataclasses

    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    with rep.scope():
        x = jnp.arange(4.0)

    @dataclasses.dataclass(frozen=True)
    class Scale:
        c: float

        def __call__(self, ctx, v):
            return v * self.c

    class Model:
        def __init__(self, c):
            self.c = c

        def step(self, ctx, v):
            return v + self.c

    a, b = Scale(2.0), Scale(2.0)
    np.testing.assert_array_equal(np.asarray(rep.run(a, None, x)), np.arange(4.0) * 2)
    del a
    gc.collect()
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(rep.run(b, None, x)), np.arange(4.0) * 2)
    np.testing.assert_array_equal(np.asarray(rep.run(Scale(3.0), None, x)),
                                  np.arange(4.0) * 3)
    m1, m2 = Model(1.0), Model(5.0)
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(rep.run(m1.step, None, x)),
                                      np.arange(4.0) + 1)
        np.testing.assert_array_equal(np.asarray(rep.run(m2.step, None, x)),
                                      np.arange(4.0) + 5)
    ref = __import__("weakref").ref(m1)
    del m1
    gc.collect()
    assert ref() is None


def test_ps_step_functions_of_every_kind_are_freed_and_right():
    """Under ParameterServerStrategy (embedded): a bound method, an unhashable
    dataclass, a functools.partial and a lambda per step, each dropped after its step:
    right values, and the functions freed (the worker's capturing wrappers hold them
    weakly)."""
    import dataclasses
    import functools
    import weakref

    s, rep, w, opt, tx, grads = _ps()

    @dataclasses.dataclass
    class Step:  # eq=True: unhashable
        c: float

        def __call__(self, ctx, w, opt):
            u, opt = tx.update(grads(w), opt, w)
            return w["a"] * self.c

    class Holder:
        def __init__(self, c):
            self.c = c

        def step(self, ctx, w, opt):
            u, opt = tx.update(grads(w), opt, w)
            return w["a"] * self.c

    def plain(ctx, w, opt, *, c):
        u, opt = tx.update(grads(w), opt, w)
        return w["a"] * c

    makers = [Step, lambda c: Holder(c).step, lambda c: functools.partial(plain, c=c),
              lambda c: (lambda ctx, w, opt: plain(ctx, w, opt, c=c))]
    refs, values, cs = [], [], []
    for k in range(8):
        f = makers[k % 4](float(k + 1))
        refs.append(weakref.ref(f.__self__ if hasattr(f, "__self__") else f))
        values.append(rep.run(f, None, w, opt))
        cs.append(float(k + 1))
        del f
    rep.join()
    seen, final = _reference(8)
    for k, v in enumerate(values):
        np.testing.assert_allclose(np.asarray(v.fetch()), seen[k]["a"] * cs[k], rtol=1e-6)
    _assert_tree(s.parameters(), final)
    del values, v
    gc.collect()
    assert [r() for r in refs[:-1]] == [None] * 7
    rep.run(Step(1.0), None, w, opt)  # the last step's closure goes with the next one
    rep.join()
    gc.collect()
    assert refs[-1]() is None
    s.shutdown()


def test_ps_distinct_step_functions_do_not_warn_and_a_lambda_per_step_names_itself():
    import warnings

    s, rep, w, opt, tx, grads = _ps()

    def body(w, opt, c):
        u, opt = tx.update(grads(w), opt, w)
        return w["a"] * c

    steps = (lambda ctx, w, opt: body(w, opt, 1.0), lambda ctx, w, opt: body(w, opt, 2.0),
             lambda ctx, w, opt: body(w, opt, 3.0), lambda ctx, w, opt: body(w, opt, 4.0),
             lambda ctx, w, opt: body(w, opt, 5.0), lambda ctx, w, opt: body(w, opt, 6.0),
             lambda ctx, w, opt: body(w, opt, 7.0), lambda ctx, w, opt: body(w, opt, 8.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eight functions, each built once: no warning
        values = [rep.run(f, None, w, opt) for f in steps]
        rep.join()
    seen, _ = _reference(8)
    for k, v in enumerate(values):
        np.testing.assert_allclose(np.asarray(v.fetch()), seen[k]["a"] * (k + 1), rtol=1e-6)
    with pytest.warns(UserWarning, match="step function <lambda> .*test_ps_worker_donation"):
        for k in range(8):  # a new lambda per step: warned, naming the user's function
            rep.run(lambda ctx, w, opt, k=k: body(w, opt, k), None, w, opt)
        rep.join()
    s.shutdown()


def test_wire_meta_round_trips_every_ml_dtypes_type():
    """The Ray carrier's push_pull meta data as JSON: every dtype NumPy or ml_dtypes has
    (float8_e5m2 is of kind 'f', spelled '<f1' by NumPy, which NumPy cannot read)."""
    import ml_dtypes

    from jreplicate.ps.ray import wire

    names = [n for n in dir(ml_dtypes) if n.startswith(("float", "int", "uint", "bfloat"))]
    types = [getattr(ml_dtypes, n) for n in names if isinstance(getattr(ml_dtypes, n), type)]
    for t in [np.float32, np.dtype(">f4"), np.int64, np.bool_, *types]:
        tree = {"a": np.arange(6).astype(t).reshape(2, 3), "b": np.ones((), np.float32)}
        meta, chunks = wire.pack(tree, chunks=2)
        out = wire.unpack(wire.decode(wire.encode(meta)), wire.to_bytes(chunks))
        for k, v in tree.items():
            assert out[k].dtype == v.dtype, (t, out[k].dtype)
            np.testing.assert_array_equal(out[k].reshape(-1).view(np.uint8),
                                          v.reshape(-1).view(np.uint8))


@pytest.mark.parametrize("when", ["compute", "push"])
def test_ps_killed_worker_with_donated_params(when):
    """Two workers, two shards, a worker killed after its step ran (its placed params
    donated) or between its pushes: its step runs again elsewhere, applied once on each
    shard; every step's returned parameter is its shard's after some number of
    updates."""
    import jreplicate.testing as jrt

    s = jr.ParameterServerStrategy(num_ps=2, num_workers=2)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
        tx = jr.ps.pushable(optax.sgd(0.25))
        opt = tx.init(w)

    def step(ctx, w, opt):  # a constant gradient: the result does not depend on order
        g = jax.tree.map(jnp.ones_like, w)
        u, opt = tx.update(g, opt, w)
        return w, opt, w["b"]

    for k in range(2):
        jrt.set_worker_delay(s, k, 0.002)
    jrt.kill_worker(s, 1, when=when)
    values = [rep.run(step, None, w, opt) for _ in range(12)]
    rep.join()
    assert s.stats()["completed"] == 12
    assert [led["applied"] for led in s.ledger()] == [12, 12]
    _assert_tree(s.parameters(), {"a": np.full(2, -3.0), "b": np.full(3, -3.0)})
    for v in values:  # (asynchronous: the two shards may be at different steps)
        got, _, b = v.fetch()
        for x in jax.tree.leaves(got):
            n = -float(np.asarray(x)[0]) / 0.25
            assert n == int(n) and 0 <= n <= 12  # (a rerun may see its own first push)
            np.testing.assert_array_equal(np.asarray(x), np.full(x.shape, -0.25 * n))
        np.testing.assert_array_equal(np.asarray(b), np.asarray(got["b"]))
    s.shutdown()


def test_ps_two_replicas_a_per_replica_output_beside_forwarded_inputs():
    """num_replicas_in_sync=2: outputs mixing a per-replica value (a PerReplica node),
    replicated inputs forwarded unchanged and the donated params; plans cached and used
    again by a second step of the same output structure."""
    s, rep, w, opt, tx, grads = _ps(num_replicas_in_sync=2)
    inputs = rep.prepare_input(lambda ctx: [np.full((2, 3), float(i), np.float32)
                                            for i in range(8)])

    def step(ctx, batch, w, opt, x):
        u, opt = tx.update(grads(w), opt, w)
        return {"pr": batch.sum(), "x": x, "w": w, "both": (x, batch.sum() * 2)}

    def step2(ctx, batch, w, opt, x):
        u, opt = tx.update(grads(w), opt, w)
        return {"pr": batch.sum() + 1, "x": x, "w": w, "both": (x, batch.sum())}

    x = np.arange(3.0, dtype=np.float32)
    it = iter(inputs)
    values = [rep.run(f, next(it), w, opt, x) for f in (step, step2, step, step2)]
    rep.join()
    seen, final = _reference(4)
    for k, v in enumerate(values):
        out = v.fetch()
        sums = np.array([6.0 * (2 * k), 6.0 * (2 * k + 1)])  # one element per replica
        pr, both = (sums, 2 * sums) if k % 2 == 0 else (sums + 1, sums)
        np.testing.assert_array_equal(np.asarray(out["pr"]).reshape(-1), pr)
        np.testing.assert_array_equal(np.asarray(out["both"][1]).reshape(-1), both)
        np.testing.assert_array_equal(np.asarray(out["x"]), x)
        np.testing.assert_array_equal(np.asarray(out["both"][0]), x)
        _assert_tree(out["w"], seen[k])
    _assert_tree(s.parameters(), final)
    s.shutdown()


def test_ray_worker_actors_let_dropped_step_functions_go(request):
    request.getfixturevalue("local_ray")
    s, rep, w, opt, tx, grads = _ps(carrier="ray")

    def body(ctx, w, opt, *, c):
        u, opt = tx.update(grads(w), opt, w)
        return w["a"] * c

    import functools
    import warnings

    values = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a new function per step: warned in the actor)
        for k in range(6):
            values.append(rep.run(functools.partial(body, c=float(k)), None, w, opt))
            rep.join()
            gc.collect()
    seen, _ = _reference(6)
    for k, v in enumerate(values):
        np.testing.assert_allclose(np.asarray(v.fetch()), seen[k]["a"] * k, rtol=1e-6)
    actor = s._executor._carrier.workers[0]
    held = ray.get(actor.__ray_call__.remote(lambda self: len(self.fns)), timeout=60)
    assert held <= 2, held
    s.shutdown()


def test_ps_donated_params_of_odd_leaves_warn_nothing():
    """Parameters with a scalar, an empty and a bfloat16 leaf, and two leaves of one
    shape and dtype: donated without jax.jit's 'not usable' warning, right values."""
    import warnings

    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"s": jnp.zeros(()), "e": jnp.zeros((0, 3)), "h": jnp.zeros(4, jnp.bfloat16),
             "a": jnp.zeros(4), "b": jnp.zeros(4)}
        tx = jr.ps.pushable(optax.sgd(1.0))
        opt = tx.init(w)

    def step(ctx, w, opt):
        g = {"s": jnp.ones(()), "e": jnp.ones((0, 3)), "h": jnp.ones(4, jnp.bfloat16),
             "a": jnp.full(4, 2.0), "b": jnp.full(4, 3.0)}
        u, opt = tx.update(g, opt, w)
        return w["a"] + w["b"], w["s"]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = [rep.run(step, None, w, opt) for _ in range(3)]
        rep.join()
    for k, v in enumerate(values):
        ab, sc = v.fetch()
        np.testing.assert_array_equal(np.asarray(ab), np.full(4, -5.0 * k))
        assert float(sc) == -k
    p = s.parameters()
    assert float(p["s"]) == -3.0 and p["e"].shape == (0, 3)
    np.testing.assert_array_equal(np.asarray(p["h"], np.float32), np.full(4, -3.0))
    np.testing.assert_array_equal(p["a"], np.full(4, -6.0))
    np.testing.assert_array_equal(p["b"], np.full(4, -9.0))
    s.shutdown()


def test_device_loops_donation_and_eviction_in_a_tiny_cache():
    """Two step functions, steps=K in (1, 3), donated or not, over a cache of 3
    programs (every few calls evicts one whose steady-state calls are recorded): each
    call equals K numpy steps."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.local_devices()[:2]))
    rep._executor._cache._max = 3
    xs = np.random.default_rng(0).normal(size=(400, 2, 3)).astype(np.float32)

    def input_fn(ctx):
        r = ctx.input_pipeline_id
        return (xs[s, r] for s in range(len(xs)))

    inputs = rep.prepare_input(input_fn, jr.InputReplicationMode.PER_REPLICA)

    def f1(ctx, x, w):
        return w * 0.5 + ctx.all_sum(x) / 2, ctx.all_sum(x.sum())

    def f2(ctx, x, w):
        return w - ctx.all_sum(x) * 0.25, ctx.all_sum(x.max())

    with rep.scope():
        w = jnp.zeros(3)
    ref, s = np.zeros(3, np.float32), 0
    plan = [(f, k, d) for f in (f1, f2) for k in (1, 3) for d in ((), (0,))]
    for f, k, donate in plan + plan[::-1] + plan[:3] * 2:
        w, aux = rep.run(f, inputs, w, steps=k if k > 1 else None, donate_argnums=donate)
        want_aux = []
        for _ in range(k):
            x = xs[s].sum(0)
            ref = ref * 0.5 + x / 2 if f is f1 else ref - x * 0.25
            want_aux.append(xs[s].sum() if f is f1 else xs[s].max(1).sum())
            s += 1
        np.testing.assert_allclose(np.asarray(w), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(aux).reshape(-1), want_aux, rtol=1e-5,
                                   atol=1e-5)
    assert len(rep._executor._cache) <= 3


def test_ps_optimizer_state_that_is_the_params_themselves():
    """A transformation whose state is the params it was given (the same arrays): the
    worker's state copy is not the donated params copy; both come back right."""
    base = optax.sgd(LR)
    tx_raw = optax.GradientTransformation(
        lambda p: (p, base.init(p)),
        lambda g, st, p=None: (base.update(g, st[1], p)[0], st))
    s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
    rep = jr.Replicator(s)
    with rep.scope():
        w = {"a": jnp.zeros(2), "b": jnp.zeros(3)}
        tx = jr.ps.pushable(tx_raw)
        opt = tx.init(w)
    assert jax.tree.leaves(opt)[0] is jax.tree.leaves(w)[0]

    def step(ctx, w, opt):
        g = jax.grad(lambda w: sum(0.5 * jnp.sum((w[k] - T[k]) ** 2) for k in T))(w)
        u, opt = tx.update(g, opt, w)
        return w, opt

    values = [rep.run(step, None, w, opt) for _ in range(4)]
    rep.join()
    seen, final = _reference(4)
    for k, v in enumerate(values):
        got_w, got_opt = v.fetch()
        _assert_tree(got_w, seen[k])
        _assert_tree(got_opt[0], {"a": np.zeros(2), "b": np.zeros(3)})  # the initial
    _assert_tree(s.parameters(), final)
    s.shutdown()
