"""A "Download" link, and an "Open in Colab" link where the repository is public, atop
each notebook page.

The notebook file travels with the site (Sphinx's download mechanism copies it into
``_downloads/`` and the link carries the ``download`` attribute), so the download works
wherever the site is served. Colab opens a notebook from a public GitHub repository
only, so its link needs the repository's URL: the conf sets ``notebook_repository_url``
from ``pyproject.toml``'s ``[project.urls] Repository``, the one place the URL is
written. Without it, no Colab link is emitted (none that would not resolve). The link
names the notebook's path in the repository: a page's source in ``docs/notebooks/`` is a
symbolic link to ``colab/``, which GitHub (and so Colab) does not follow.
"""

from __future__ import annotations

import pathlib
import re

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ConfigError

_GITHUB = re.compile(r"^https://github\.com/(?P<owner>[\w.-]+)/(?P<repo>[\w.-]+?)(?:\.git)?/?$")


def colab_url(repository_url: str | None, path: str, branch: str = "main") -> str | None:
    """The Colab URL that opens ``path`` (relative to the repository root), or None.

    Raises:
      ConfigError: ``repository_url`` is set but is not ``https://github.com/OWNER/REPO``.
    """
    if not repository_url:
        return None
    m = _GITHUB.match(repository_url)
    if m is None:
        raise ConfigError(
            f"notebook_repository_url={repository_url!r} (pyproject.toml [project.urls] "
            "Repository): Colab opens notebooks from GitHub only; give "
            "https://github.com/OWNER/REPO, or remove it to emit no Colab link.")
    return (f"https://colab.research.google.com/github/{m['owner']}/{m['repo']}/blob/"
            f"{branch}/{path}")


def links(docname: str, repo_path: str, colab: str | None) -> nodes.paragraph:
    """The paragraph of links put under a notebook page's title."""
    name = pathlib.PurePosixPath(repo_path).name
    para = nodes.paragraph(classes=["notebook-links"])
    if colab:
        para += nodes.reference("", "Open in Colab", refuri=colab, internal=False,
                                classes=["colab-link"])
        para += nodes.Text(" · ")
    download = addnodes.download_reference(
        "", "", refdoc=docname, reftarget=f"/{docname}.ipynb", refexplicit=True,
        refdomain="", reftype="download")
    download += nodes.Text("Download ")
    download += nodes.literal(name, name)
    para += download
    return para


def _add_links(app, doctree) -> None:
    """``doctree-read`` (before Sphinx collects the downloads): links atop a notebook."""
    source = pathlib.Path(doctree.get("source") or "")
    if source.suffix != ".ipynb":
        return
    docname = app.env.path2doc(str(source))
    root = pathlib.Path(app.config.notebook_repository_root or pathlib.Path(app.srcdir).parent)
    repo_path = source.resolve().relative_to(root.resolve()).as_posix()
    colab = colab_url(app.config.notebook_repository_url, repo_path,
                      app.config.notebook_branch)
    title = next(iter(doctree.findall(nodes.title)), None)
    if title is None:
        return
    title.parent.insert(title.parent.index(title) + 1, links(docname, repo_path, colab))


def setup(app):
    app.add_config_value("notebook_repository_url", None, "env", types=(str, type(None)))
    app.add_config_value("notebook_branch", "main", "env", types=(str,))
    app.add_config_value("notebook_repository_root", None, "env", types=(str, type(None)))
    app.connect("doctree-read", _add_links, priority=400)  # before the download collector
    return {"parallel_read_safe": True, "parallel_write_safe": True}
