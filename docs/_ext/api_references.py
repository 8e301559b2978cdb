"""Cross-references to jreplicate's own names that Sphinx alone cannot resolve.

jreplicate defines a name in one module and documents it where users import it
(``jreplicate.layout.Layout`` is documented as ``jreplicate.strategies.Layout``;
``jreplicate.sync.sync_replicas`` as ``jreplicate.sync_replicas``), while signatures and
docstrings name the defining module or a namespace that re-exports it. This extension:

* resolves a reference to a jreplicate object to the entry that documents the same
  object under another name (checked by identity, never by the last name alone);
* shows a type variable (``T = TypeVar("T")``, or ``def f[T]``'s type parameter) as its
  name: it has no entry;
* shows a reference to an existing but undocumented jreplicate module (the docstrings
  say which module a mechanism lives in) as its name: the site documents the
  namespaces, not every module. A module that does not exist still fails the build;
* gives each API entry the anchor that ``sphinx.ext.viewcode``'s "[docs]" link uses:
  viewcode names one documenting module per source file (the first it meets), so an
  object documented in another namespace than its neighbours (``CheckpointError`` in
  ``jreplicate.checkpoint``, ``CheckpointManager`` at the top level, both defined in
  ``checkpoint/manager.py``) was linked to ``#jreplicate.CheckpointError``, which no
  page has.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import TypeVar

from offline_inventories import lookup
from sphinx import addnodes

PACKAGE = "jreplicate"


_DOCUMENTED: dict[tuple[int, int], dict[int, str]] = {}


def _documented(env) -> dict[int, str]:
    """``id(object) -> documented name`` of every documented jreplicate class or function."""
    objects = env.get_domain("py").objects
    key = (id(env), len(objects))
    if key in _DOCUMENTED:
        return _DOCUMENTED[key]
    found = _DOCUMENTED[key] = {}
    for name, entry in objects.items():
        if entry.objtype in ("module", "data") or not name.startswith(PACKAGE + "."):
            continue
        obj = lookup(name)
        if inspect.isclass(obj) or inspect.isroutine(obj):
            found.setdefault(id(obj), name)
    return found


def _is_module(name: str) -> bool:
    """Whether ``name`` is an importable module (found without running it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _candidates(node) -> list[str]:
    target = node["reftarget"].lstrip("~.")
    module = node.get("py:module")
    names = [target]
    if module and not target.startswith(PACKAGE + "."):
        names.insert(0, f"{module}.{target}")
    return [n for n in names if n.startswith(PACKAGE + ".")]


def _type_parameters(node) -> set[str]:
    """The names of the type parameters (``def f[T](x: T) -> T``) of the signature that
    ``node`` is part of, and of its class."""
    sig = node.parent
    while sig is not None and not isinstance(sig, addnodes.desc_signature):
        sig = sig.parent
    if sig is None or not sig.get("module") or not sig.get("fullname"):
        return set()
    names, path = set(), f"{sig['module']}.{sig['fullname']}"
    while path.count(".") >= 1 and path != sig["module"]:
        names |= {p.__name__ for p in getattr(lookup(path), "__type_params__", ())}
        path = path.rsplit(".", 1)[0]
    return names


def _resolve(app, env, node, contnode):
    """``missing-reference``: a jreplicate name documented elsewhere, a type variable or
    type parameter, a module."""
    if node.get("refdomain") != "py":
        return None
    if "." not in node["reftarget"] and node["reftarget"] in _type_parameters(node):
        return contnode
    for name in _candidates(node):
        if node["reftype"] == "mod":
            if _is_module(name):
                return contnode  # an undocumented module: its name, unlinked
            continue
        obj = lookup(name)
        if obj is None:
            continue
        if isinstance(obj, TypeVar):
            return contnode
        documented = _documented(env).get(id(obj))
        if documented and documented != name:
            domain = env.get_domain("py")
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                       documented, node, contnode)
    return None


def _viewcode_anchors(app, doctree, docname) -> None:
    """``doctree-resolved``: the anchor viewcode's back-link uses, on every API entry."""
    modules = getattr(app.env, "_viewcode_modules", {})
    for sig in doctree.findall(addnodes.desc_signature):
        module, fullname = sig.get("module"), sig.get("fullname")
        if not module or not fullname:
            continue
        owner = lookup(f"{module}.{fullname.split('.')[0]}")
        entry = modules.get(getattr(owner, "__module__", None))
        if not isinstance(entry, tuple) or len(entry) != 4 or entry[3] in (None, module):
            continue
        anchor = f"{entry[3]}.{fullname}"
        if anchor not in sig["ids"]:
            sig["ids"].append(anchor)


def setup(app):
    app.setup_extension("offline_inventories")
    app.connect("missing-reference", _resolve, priority=600)  # after intersphinx
    app.connect("doctree-resolved", _viewcode_anchors)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
