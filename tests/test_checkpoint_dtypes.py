"""Every dtype JAX offers, through a checkpoint (issue 28, item 7: the class of
"checkpointable types").

The dtypes are enumerated, not listed: every scalar type of ``jax.numpy`` and of
``ml_dtypes`` (and JAX's own set where it exposes one), ``float0`` and NumPy's string
dtype, kept when JAX can hold an array of it; so a dtype a new JAX adds is covered
without a change here. For each, as a JAX array and as a NumPy leaf, a save either
restores every bit pattern of the dtype exactly (bytes compared: NaN payloads, -0.0,
the sub-byte types' every value) or is refused before anything is written, naming the
leaf and the fix, with the directory as it was. 64-bit types run again with
``jax_enable_x64`` on (in a subprocess: the flag is global). Restoring into another
dtype stays refused; a parameter server's ``state()`` keeps its dtypes too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jreplicate as jr
from jreplicate.checkpoint import CheckpointError, CheckpointManager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the class: every dtype JAX offers ------------------------------------------------
def _candidates() -> dict[str, np.dtype]:
    found: dict[str, np.dtype] = {}
    kinds = [getattr(jnp, n) for n in dir(jnp)] + [getattr(ml_dtypes, n) for n in dir(ml_dtypes)]
    try:  # JAX's own set, where this JAX keeps one
        from jax._src import dtypes as jax_dtypes
        kinds += list(getattr(jax_dtypes, "_jax_dtype_set", ()))
    except ImportError:
        pass
    kinds += [jax.dtypes.float0, np.dtypes.StringDType()]
    for kind in kinds:
        if not (isinstance(kind, np.dtype) or isinstance(kind, type) and hasattr(kind, "dtype")):
            continue
        try:
            dtype = np.dtype(kind)
        except TypeError:
            continue
        found.setdefault(str(dtype), dtype)
    return found


def _held(dtype: np.dtype) -> bool:
    """Whether JAX holds an array of ``dtype`` (as that dtype: not float64 with x64 off)."""
    try:
        x = jax.device_put(np.zeros((2,), dtype), jax.devices()[0])
    except Exception:  # noqa: BLE001 - JAX refuses the dtype: it does not offer it
        return False
    return x.dtype == dtype


def offered() -> dict[str, np.dtype]:
    return {name: d for name, d in sorted(_candidates().items()) if _held(d)}


DTYPES = offered()


def patterns(dtype: np.dtype) -> np.ndarray:
    """Every bit pattern of a type of at most 8 bits; for wider ones random bytes and
    the patterns a conversion would change (-0.0, infinities, NaNs with payloads,
    subnormals)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.array([False, True, True, False])
    if dtype.kind == "T" or dtype == jax.dtypes.float0:
        return np.zeros(4, dtype) if dtype != np.dtypes.StringDType() \
            else np.array(["a", "", "ß"], dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    if bits <= 8:
        return np.arange(2 ** bits, dtype=np.uint8).view(dtype)
    raw = np.random.default_rng(bits).integers(0, 256, 64 * dtype.itemsize, np.uint8)
    out = raw.view(dtype)
    part = np.dtype(f"float{bits // 2}") if dtype.kind == "c" else dtype
    if part.kind == "f" or jax.dtypes.issubdtype(part, np.floating):
        info = ml_dtypes.finfo(part)
        width = jax.dtypes.itemsize_bits(part)
        nexp, nmant = info.nexp, info.nmant
        top = ((1 << nexp) - 1) << nmant
        ints = [1 << (width - 1), 1, (1 << nmant) - 1, top, top | 1, top | (1 << (nmant - 1)),
                top | ((1 << nmant) - 1)]
        ints += [i | (1 << (width - 1)) for i in ints]
        special = np.array(ints, f"uint{width}").view(part)
        special = special.view(dtype) if dtype.kind == "c" else special
        out = np.concatenate([out, special])
    return out


def _bytes(x) -> bytes:
    x = np.asarray(x)
    if x.dtype.kind == "T":  # strings are references: compare the text
        return json.dumps(x.tolist()).encode()
    return np.ascontiguousarray(x).view(np.uint8).tobytes()


def roundtrip(directory: str, dtype: np.dtype, kind: str) -> dict:
    """Saves a state of ``dtype`` leaves (``kind``: "jax" or "numpy") and restores it.

    Returns ``{"outcome": "exact"}``, ``{"outcome": "refused", "error": ..., "type":
    ..., "left": [directory entries after the save]}``, or ``{"outcome": "wrong",
    ...}`` (saved but not restored exactly, or failed part-way).
    """
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:2]))
    host = patterns(dtype)
    grid = host[: (host.size // 2) * 2].reshape(2, -1)
    if kind == "jax":
        state = {"bits": jax.device_put(host, jax.devices()[0]),
                 "grid": jax.device_put(grid, jax.devices()[1])}
        try:  # computed by XLA, not put: JAX gives int1's host copy as bool
            zeros = jnp.zeros((3,), dtype)
        except Exception:  # noqa: BLE001 - JAX computes nothing of this dtype
            zeros = None
        if zeros is not None and zeros.dtype == dtype:  # (JAX 0.12 may give bool for
            state["zeros"] = zeros                     # int1 after a bool: its cache)
    else:
        state = {"bits": host, "grid": grid}
    shapes = {k: np.shape(v) for k, v in state.items()}
    want = {k: _bytes(v) for k, v in state.items()}
    before = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    with CheckpointManager(directory, rep) as mngr:
        listed = sorted(os.listdir(directory))
        try:
            mngr.save(1, state, force=True)
        except CheckpointError as e:  # the chief failed while writing: never wanted
            return {"outcome": "wrong", "error": f"failed part-way: {e}",
                    "left": sorted(os.listdir(directory))}
        except (TypeError, ValueError) as e:
            left = sorted(os.listdir(directory))
            return {"outcome": "refused", "error": str(e), "type": type(e).__name__,
                    "left": left, "listed": listed, "before": before}
    with CheckpointManager(directory, rep) as mngr:
        step, back = mngr.restore_or_initialize(
            lambda: {k: jax.ShapeDtypeStruct(shape, dtype) for k, shape in shapes.items()})
    got = {k: _bytes(v) for k, v in back.items()}
    dtypes = {k: str(v.dtype) for k, v in back.items()}
    if step != 1 or got != want or set(dtypes.values()) != {str(np.dtype(dtype))}:
        return {"outcome": "wrong", "error": f"step {step}, dtypes {dtypes}, equal bytes "
                f"{[got[k] == want[k] for k in want]}"}
    return {"outcome": "exact"}


def check(result: dict, dtype: np.dtype) -> None:
    """Saved and restored bit-exact, or refused up front naming the leaf and the fix."""
    assert result["outcome"] != "wrong", (str(dtype), result)
    if result["outcome"] == "refused":
        error = result["error"]
        assert "['bits']" in error and "['grid']" in error, error  # every leaf named
        assert any(w in error for w in ("Save", "Leave it out", "view", "as ")), error
        assert result["left"] == result["listed"], result  # nothing written
        assert not any(n[:1].isdigit() for n in result["left"]), result


@pytest.mark.parametrize("kind", ["jax", "numpy"])
@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_restores_exactly_or_is_refused_up_front(tmp_path, name, kind):
    dtype = DTYPES[name]
    result = roundtrip(str(tmp_path / "ckpt"), dtype, kind)
    check(result, dtype)
    # What JAX holds as a number (bool, ints, floats, complex, ml_dtypes' types) must
    # come back exactly: refusing it would be a loss, not a safety.
    numeric = jax.dtypes.issubdtype(dtype, np.number) or dtype == np.bool_
    if numeric:
        assert result["outcome"] == "exact", (name, kind, result)


def test_the_enumeration_finds_the_types_of_the_issue():
    """The class is found, not listed: the issue's and ml_dtypes' types are in it."""
    for name in ("bool", "int2", "uint2", "int4", "uint4", "int8", "uint32", "float16",
                 "bfloat16", "float32", "complex64", "float8_e4m3fn", "float8_e4m3",
                 "float8_e5m2", "float4_e2m1fn", "float6_e2m3fn"):
        assert name in DTYPES, name


@pytest.mark.parametrize("name", ["float64", "int64", "uint64", "complex128"])
def test_a_64_bit_numpy_leaf_with_x64_off_is_refused_up_front(tmp_path, name):
    assert not jax.config.jax_enable_x64
    result = roundtrip(str(tmp_path / "ckpt"), np.dtype(name), "numpy")
    check(result, np.dtype(name))
    assert result["outcome"] == "refused" and "jax_enable_x64" in result["error"]


def test_every_dtype_with_x64_on(tmp_path):
    """With ``jax_enable_x64`` (a global flag: another process), the 64-bit types are
    held by JAX and must restore exactly as well; the others as with x64 off."""
    script = textwrap.dedent(f"""
        import json, os, sys
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import jax
        jax.config.update("jax_enable_x64", True)
        sys.path.insert(0, {ROOT!r})
        from tests import test_checkpoint_dtypes as t
        out = {{}}
        for name, dtype in t.offered().items():
            if dtype.kind == "T" or dtype.itemsize < 8:  # where x64 matters
                continue
            for kind in ("jax", "numpy"):
                out[name + "/" + kind] = t.roundtrip(
                    os.path.join({str(tmp_path)!r}, name + kind), dtype, kind)
        print("RESULT" + json.dumps(out))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.split("RESULT", 1)[1])
    assert {"float64/jax", "int64/jax", "uint64/jax", "complex128/jax"} <= set(out), out
    for case, result in out.items():
        assert result["outcome"] == "exact", (case, result)


# -- restoring into another dtype stays refused ----------------------------------------
@pytest.mark.parametrize("saved, wanted", [
    ("uint4", "uint8"), ("uint8", "uint4"), ("float8_e4m3", "float8_e4m3fn"),
    ("int4", "uint4"), ("float6_e2m3fn", "int8"), ("bfloat16", "float16"),
    ("int1", "bool"),
])
def test_restoring_into_another_dtype_is_refused(tmp_path, saved, wanted):
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:2]))
    x = patterns(DTYPES[saved])
    with CheckpointManager(tmp_path, rep) as mngr:
        mngr.save(1, {"w": jax.device_put(x, jax.devices()[0])}, force=True)
    with CheckpointManager(tmp_path, rep) as mngr:
        with pytest.raises(CheckpointError, match=rf"\['w'\] is {saved}\[{x.size}\] in the "
                           rf"checkpoint but init_fn\(\) gives {wanted}\[{x.size}\]"):
            mngr.restore_or_initialize(lambda: {"w": jnp.zeros(x.shape, DTYPES[wanted])})
    assert sorted(os.listdir(tmp_path)) == ["1"]  # left where it is


def test_uint4_leaf_restores_bit_exact(tmp_path):
    """Issue 28 item 7: a uint4 leaf failed part-way through Orbax's write
    (``Unsupported data type: "uint4"``), naming no leaf, leaving a temporary
    directory."""
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:2]))
    q = jnp.arange(16, dtype=jnp.uint4).reshape(4, 4)
    state = {"params": {"q": q, "scale": jnp.ones(4)}, "mask": jnp.zeros(3, jnp.int4)}
    with CheckpointManager(tmp_path, rep) as mngr:
        assert mngr.save(5, state, force=True)
    assert sorted(os.listdir(tmp_path)) == ["5"]  # no temporary directory
    with CheckpointManager(tmp_path, rep) as mngr:
        step, back = mngr.restore_or_initialize(lambda: jax.tree.map(jnp.zeros_like, state))
    assert step == 5 and back["params"]["q"].dtype == jnp.uint4
    assert np.asarray(back["params"]["q"]).tolist() == np.asarray(q).tolist()
    assert _bytes(back["params"]["q"]) == _bytes(q)


def test_a_string_leaf_is_refused_up_front_naming_it(tmp_path):
    rep = jr.Replicator(jr.MirroredStrategy(devices=jax.devices()[:2]))
    with CheckpointManager(tmp_path, rep) as mngr:
        with pytest.raises(TypeError, match=r"\['names'\] is <U2, which is not a numeric"):
            mngr.save(1, {"w": jnp.ones(2), "names": np.array(["ab", "c"])}, force=True)
        with pytest.raises(TypeError, match=r"\['g'\] is float0.*Leave it out"):
            mngr.save(1, {"g": np.zeros(3, jax.dtypes.float0)}, force=True)
    assert os.listdir(tmp_path) == []


# -- a parameter server's state --------------------------------------------------------
def test_parameter_server_state_keeps_its_dtypes(tmp_path):
    """``ParameterServerStrategy.state()`` saved by the manager: parameters of a dtype
    TensorStore stores as it is (bfloat16) and of one stored as bits (float8_e4m3),
    with the ledger's integers, restore bit for bit."""
    def job():
        s = jr.ParameterServerStrategy(num_ps=2, num_workers=1)
        rep = jr.Replicator(s)
        with rep.scope():
            w = {"a": jnp.full(4, 0.3, jnp.bfloat16), "b": jnp.full(3, 1.5, jnp.float8_e4m3),
                 "c": jnp.full(2, -0.0, jnp.float32)}
            tx = jr.ps.pushable(optax.sgd(0.25))
            opt = tx.init(w)

        def step(ctx, w, opt):
            g = jax.tree.map(jnp.ones_like, w)
            u, opt = tx.update(g, opt, w)
            return optax.apply_updates(w, u), opt
        return s, rep, w, opt, step

    s, rep, w, opt, step = job()
    for _ in range(3):
        rep.run(step, None, w, opt)
    rep.join()
    saved = s.state()
    with CheckpointManager(tmp_path, rep) as mngr:
        mngr.save(3, saved)
    s.shutdown()
    s2, rep2, *_ = job()
    with CheckpointManager(tmp_path, rep2) as mngr:
        at, back = mngr.restore_or_initialize(s2.state)
    assert at == 3
    flat, back_flat = jax.tree.leaves(saved), jax.tree.leaves(back)
    assert [np.asarray(x).dtype for x in back_flat] == [np.asarray(x).dtype for x in flat]
    assert [_bytes(x) for x in back_flat] == [_bytes(x) for x in flat]
    s2.restore(back)
    assert [_bytes(x) for x in jax.tree.leaves(s2.state())] == [_bytes(x) for x in flat]
    s2.shutdown()
