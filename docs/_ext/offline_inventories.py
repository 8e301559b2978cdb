"""Links to Python's, JAX's, optax's, Flax's and NumPy's documentation with no network.

Intersphinx links a name such as ``jax.Array`` to another project's documentation
through that project's ``objects.inv``, which it downloads at build time. The build
cannot download (CI reaches package registries only) and no installed package ships
these files, so the names this site references are listed here, each with the page of
its project's public documentation that holds it. At ``config-inited`` this extension
writes one standard (version 2) inventory per project into the doctree folder and points
``intersphinx_mapping`` at it, so intersphinx resolves them as usual. A table rather
than committed ``.inv`` files: the entries are reviewable text, nothing can go stale
against a binary copy, and adding a name is one line.

A class whose runtime path is private (``jax.sharding.Mesh`` is
``jax._src.mesh.Mesh``, as autodoc writes it in signatures) gets a second entry under
that path, displayed under its public name. A name the docs reference and that is
missing here fails the nitpicky build (``tests/test_docs_build.py``): add it here with
its page.
"""

from __future__ import annotations

import importlib
import pathlib
import zlib
from typing import NamedTuple


class Project(NamedTuple):
    """One project's inventory: ``entries`` maps ``(name, role)`` to a page ("$": name)."""

    title: str
    version: str
    url: str
    entries: dict[tuple[str, str], str]


def _same_page(page: str, role: str, *names: str) -> dict[tuple[str, str], str]:
    return {(name, role): f"{page}#$" for name in names}


def _own_pages(prefix: str, role: str, *names: str) -> dict[tuple[str, str], str]:
    return {(name, role): f"{prefix}{name}.html#$" for name in names}


PROJECTS: dict[str, Project] = {
    "python": Project("Python", "3", "https://docs.python.org/3/", {
        **_same_page("library/functions.html", "py:class", "bool", "float", "int", "object"),
        **_same_page("library/stdtypes.html", "py:class",
                     "bytes", "dict", "list", "set", "str", "tuple"),
        **_same_page("library/exceptions.html", "py:exception",
                     "BaseException", "Exception", "KeyError", "RuntimeError",
                     "StopIteration", "TimeoutError", "TypeError", "ValueError"),
        ("None", "py:data"): "library/constants.html#$",
        ("typing.Any", "py:data"): "library/typing.html#$",
        ("typing.NamedTuple", "py:class"): "library/typing.html#$",
        **_same_page("library/collections.abc.html", "py:class", "collections.abc.Callable",
                     "collections.abc.Iterable", "collections.abc.Iterator",
                     "collections.abc.Mapping", "collections.abc.Sequence"),
        ("contextlib.AbstractContextManager", "py:class"): "library/contextlib.html#$",
        ("abc.ABC", "py:class"): "library/abc.html#$",
        ("enum.Enum", "py:class"): "library/enum.html#$",
        ("os.PathLike", "py:class"): "library/os.html#$",
        ("threading.Event", "py:class"): "library/threading.html#$",
    }),
    "jax": Project("JAX", "latest", "https://docs.jax.dev/en/latest/", {
        **_own_pages("_autosummary/", "py:class", "jax.Array", "jax.Device"),
        **_own_pages("_autosummary/", "py:function", "jax.grad", "jax.value_and_grad",
                     "jax.jit", "jax.pmap", "jax.shard_map", "jax.lax.psum",
                     "jax.lax.pmean", "jax.lax.all_gather", "jax.lax.axis_index",
                     "jax.random.fold_in"),
        **_same_page("jax.sharding.html", "py:class", "jax.sharding.Mesh",
                     "jax.sharding.NamedSharding", "jax.sharding.PartitionSpec"),
    }),
    "optax": Project("Optax", "latest", "https://optax.readthedocs.io/en/latest/", {
        **_same_page("api/transformations.html", "py:class", "optax.GradientTransformation",
                     "optax.GradientTransformationExtraArgs", "optax.OptState",
                     "optax.Params", "optax.Updates"),
    }),
    "flax": Project("Flax", "latest", "https://flax.readthedocs.io/en/latest/", {
        ("flax.nnx.Module", "py:class"): "api_reference/flax.nnx/module.html#$",
        ("flax.nnx.Rngs", "py:class"): "api_reference/flax.nnx/rnglib.html#$",
        ("flax.nnx.BatchNorm", "py:class"): "api_reference/flax.nnx/nn/normalization.html#$",
        ("flax.nnx.Dropout", "py:class"): "api_reference/flax.nnx/nn/stochastic.html#$",
        ("flax.nnx.Optimizer", "py:class"):
            "api_reference/flax.nnx/training/optimizer.html#flax.nnx.optimizer.Optimizer",
        ("flax.nnx.MultiMetric", "py:class"):
            "api_reference/flax.nnx/training/metrics.html#flax.nnx.metrics.MultiMetric",
        ("flax.nnx.metrics.Average", "py:class"): "api_reference/flax.nnx/training/metrics.html#$",
    }),
    "numpy": Project("NumPy", "stable", "https://numpy.org/doc/stable/", {
        ("numpy.ndarray", "py:class"): "reference/generated/numpy.ndarray.html#$",
    }),
}


def lookup(name: str) -> object | None:
    """The object a dotted name denotes (importing its module), or None."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


def runtime_path(name: str) -> str | None:
    """The path autodoc writes for the class ``name`` (its ``__module__``), if it differs."""
    obj = lookup(name)
    if not isinstance(obj, type):
        return None
    path = f"{obj.__module__}.{obj.__qualname__}"
    return path if path != name else None


def inventory_lines(project: Project) -> list[str]:
    """The entries of ``project`` as inventory lines, private runtime paths included."""
    lines = []
    for (name, role), page in sorted(project.entries.items()):
        lines.append(f"{name} {role} 1 {page} -")
        alias = runtime_path(name) if role == "py:class" else None
        if alias:  # shown under the public name, linked to the public entry
            lines.append(f"{alias} {role} 1 {page.replace('$', name)} {name}")
    return lines


def write_inventory(path: pathlib.Path, project: Project) -> None:
    """Writes ``project`` as a version 2 ``objects.inv`` at ``path``."""
    header = (f"# Sphinx inventory version 2\n# Project: {project.title}\n"
              f"# Version: {project.version}\n"
              "# The remainder of this file is compressed using zlib.\n")
    body = "".join(line + "\n" for line in inventory_lines(project))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(header.encode() + zlib.compress(body.encode()))


def _install(app, config) -> None:
    folder = pathlib.Path(app.doctreedir) / "offline_inventories"
    mapping = {}
    for key, project in PROJECTS.items():
        write_inventory(folder / f"{key}.inv", project)
        mapping[key] = (project.url, str(folder / f"{key}.inv"))
    config.intersphinx_mapping = {**mapping, **(config.intersphinx_mapping or {})}


def setup(app):
    app.setup_extension("sphinx.ext.intersphinx")
    app.connect("config-inited", _install, priority=400)  # before intersphinx reads it
    return {"parallel_read_safe": True, "parallel_write_safe": True}
