"""The leaves a checkpoint holds, read to the host (private to jreplicate.checkpoint).

:func:`to_host` turns the state given to ``save`` (or built by ``init_fn``) into NumPy
arrays and refuses, naming the path and the fix, every leaf that could not come back as
it was: a :class:`jreplicate.PerReplica`, a PRNG key array, an array sharded across
processes, a donated (deleted) array; and, when saving, a dtype that is not JAX's bool
or numeric (``float0``, strings, objects: see :mod:`jreplicate.checkpoint.dtypes`), a
zero-size array (Orbax cannot write one) or a 64-bit NumPy leaf while
``jax_enable_x64`` is off (no ``init_fn`` could restore it: ``jax.eval_shape`` gives
32 bits). Python numbers become what JAX makes of
them (``0.5`` a float32, ``3`` an int32), refused when they do not fit.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jreplicate._tree import check_fits, map_checked, path_str, read_now
from jreplicate.checkpoint.dtypes import storage_dtype, unsavable
from jreplicate.context import PerReplica


def check_not_key(x: Any, path: Any, what: str) -> None:
    """Raises TypeError when ``x`` is a typed PRNG key array."""
    if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):
        nnx = ("['key']" in path_str(path)) * (
            " For a Flax NNX module, save nnx.state(model, nnx.Not(nnx.RngKey)): it keeps "
            "the streams' counts, so restored into a model built with the same seeds "
            "(nnx.update) the random streams go on where they were.")
        raise TypeError(
            f"{what}: {path_str(path) or 'the root'} is a PRNG key array ({x.dtype}); "
            "checkpoints hold plain arrays. Keep jax.random.key_data(key) in the state "
            "and rebuild the key with jax.random.wrap_key_data(...) after restoring." + nnx
        )


def zeros_like(tree: Any, what: str) -> Any:
    """NumPy zeros of each leaf's shape and dtype (keys refused)."""
    def leaf(path, x):
        check_not_key(x, path, what)
        return np.zeros(np.shape(x), x.dtype)
    return map_checked(leaf, tree, what)


def spans_processes(x: Any) -> bool:
    """Whether ``x`` is a jax.Array whose shards no single process holds all of."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable \
        and not x.is_fully_replicated


def sharded_across_processes(tree: Any) -> list[tuple[str, Any]]:
    """``(path, sharding)`` of each leaf of ``tree`` sharded across processes."""
    return [(path_str(p) or "the root", x.sharding)
            for p, x in jax.tree_util.tree_leaves_with_path(
                tree, is_leaf=lambda x: isinstance(x, PerReplica)) if spans_processes(x)]


def to_saved(tree: Any, what: str) -> Any:
    """The leaves every process gives Orbax when every process writes: a jax.Array as
    it is (checked without reading it: not donated, a dtype and size that can be saved),
    others as NumPy copies (``to_host``'s rules). An array of a dtype TensorStore stores
    as its bits (see :mod:`jreplicate.checkpoint.dtypes`) is read to the host, which
    needs it replicated or held by one process."""
    def leaf(path, x):
        where = path_str(path) or "the root"
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
            check_not_key(x, path, what)
            if x.is_deleted():
                raise ValueError(
                    f"{what}: {where} was donated (its buffer was deleted) to a step run "
                    "with donate_argnums: save the state the step returned instead (the "
                    "donated argument's buffers now belong to the step's outputs).")
            _check_savable(jax.ShapeDtypeStruct(x.shape, x.dtype), where, what)
            if storage_dtype(x.dtype) == np.dtype(x.dtype):
                return x
            if spans_processes(x):
                raise ValueError(
                    f"{what}: {where} is a {np.dtype(x.dtype).name} array sharded across "
                    f"processes ({x.sharding}); TensorStore stores {np.dtype(x.dtype).name} "
                    "as its bits, which jreplicate reads through one host. Save it "
                    "replicated, or cast it to a dtype TensorStore stores (e.g. uint8).")
        host = _read(x, path, what)
        _check_savable(host, where, what)
        return host
    return map_checked(leaf, tree, what, is_leaf=lambda x: isinstance(x, PerReplica))


def to_host(tree: Any, what: str, *, saving: bool = False) -> Any:
    """NumPy copies of a pytree's leaves, read from this process's devices; raises for
    every leaf that cannot be checkpointed at once (more of them when ``saving``)."""
    def leaf(path, x):
        where = path_str(path) or "the root"
        host = _read(x, path, what)
        if saving:
            _check_savable(host, where, what)
        return host
    return map_checked(leaf, tree, what, is_leaf=lambda x: isinstance(x, PerReplica))


def _read(x: Any, path: tuple, what: str) -> np.ndarray:
    where = path_str(path) or "the root"
    if isinstance(x, PerReplica):
        raise ValueError(
            f"{what}: {where} is a PerReplica value (different on each replica); "
            "checkpoints hold replicated state. Reduce it first (Replicator.reduce or "
            "ctx.all_sum in the step), or leave it out."
        )
    check_not_key(x, path, what)
    if isinstance(x, jax.Array):
        if x.is_deleted():
            raise ValueError(
                f"{what}: {where} was donated (its buffer was deleted) to a step run with "
                "donate_argnums: save the state the step returned instead (the donated "
                "argument's buffers now belong to the step's outputs).")
        if x.is_fully_addressable or x.is_fully_replicated:
            return _as_its_dtype(np.asarray(
                x if x.is_fully_addressable else x.addressable_data(0)), x.dtype, where, what)
        raise ValueError(
            f"{what}: {where} is sharded across processes ({x.sharding}); checkpoints "
            "hold replicated state. Replicate it (e.g. return it aggregated from the "
            "step) before saving."
        )
    if isinstance(x, np.ndarray):
        # A copy (the caller may write to its array later), in native byte order: a
        # big-endian array was saved with the checksum of its bytes as given, and
        # every restore then refused the checkpoint as damaged.
        return read_now(x)
    if isinstance(x, (bool, int, float, complex)):  # a Python number: as JAX holds it
        value = np.asarray(x)
        check_fits(value, lambda: f"{what}: {where}")
        return value.astype(jax.dtypes.canonicalize_dtype(value.dtype))
    if isinstance(x, np.generic):
        return np.asarray(x)
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # ShapeDtypeStruct
        return np.zeros(x.shape, x.dtype)
    raise TypeError(
        f"{what}: {where} is a {type(x).__name__}, not an array. Checkpointed state must "
        "be a pytree of arrays (for a Flax NNX module, checkpoint nnx.state(module))."
    )


def _as_its_dtype(host: np.ndarray, dtype: Any, where: str, what: str) -> np.ndarray:
    """A device array's host copy in the array's own dtype: JAX gives the copy of an
    int1 or uint1 array that XLA computed as bool (the same byte), which would be saved
    as bool and then not restore into init_fn()'s int1."""
    dtype = np.dtype(dtype)
    if host.dtype == dtype:
        return host
    if host.dtype.itemsize == dtype.itemsize and host.dtype.fields is None \
            and not host.dtype.hasobject:
        return host.view(dtype)
    raise TypeError(
        f"{what}: {where} is a {dtype.name} array whose host copy JAX gives as "
        f"{host.dtype.name}, which a checkpoint cannot hold as {dtype.name}. Save it cast "
        f"to a dtype JAX copies exactly (e.g. x.astype(jnp.int8)).")


def _check_savable(x: Any, where: str, what: str) -> None:
    problem = unsavable(x.dtype)
    if problem:
        raise TypeError(f"{what}: {where} is {problem}.")
    if int(np.prod(x.shape)) == 0:
        raise ValueError(
            f"{what}: {where} has zero size ({np.dtype(x.dtype).name}"
            f"[{', '.join(map(str, x.shape))}]); Orbax cannot write an array without "
            "elements. Leave it out of the saved state (it holds no data) and rebuild it "
            "after restoring.")
    held = jax.dtypes.canonicalize_dtype(x.dtype)
    if held != np.dtype(x.dtype):
        raise ValueError(
            f"{what}: {where} is {np.dtype(x.dtype).name}, which JAX holds as "
            f"{np.dtype(held).name} while jax_enable_x64 is off: no init_fn() could "
            "restore it. Save it as "
            f"{np.dtype(held).name} (np.asarray(x, np.{np.dtype(held).name})), or enable "
            "64-bit types before any JAX work: jax.config.update('jax_enable_x64', True).")
