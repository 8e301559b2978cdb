"""Break opportunities after the dots, commas and brackets of code in HTML tables.

A table cell holding ``tf.distribute.experimental.CentralStorageStrategy`` is one word
to a browser: it either widens the table past the content column (the porting guide's
name tables lost their last column at 1400 px) or, with ``docs/_static/tables.css``,
breaks it at an arbitrary letter. This post-transform inserts ``<wbr>`` after each
``.``, ``,``, ``(`` and ``=`` of inline code inside table cells, so long names wrap
where a reader splits them; the stylesheet's ``overflow-wrap: anywhere`` stays the
fallback for a name that is still too long. Only the HTML output changes: the text, the
search index and copy-paste are the same (``<wbr>`` has no character).
"""

from __future__ import annotations

import re

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

_AFTER = re.compile(r"(?<=[.,(=])(?=[^\s.,)=])")


class CodeBreaksInTables(SphinxPostTransform):
    """Splits the text of inline code in table entries, with ``<wbr>`` between parts."""

    default_priority = 900
    formats = ("html",)

    def run(self, **kwargs) -> None:
        for entry in self.document.findall(nodes.entry):
            for literal in list(entry.findall(nodes.literal)):
                for text in list(literal.findall(nodes.Text)):
                    parts = _AFTER.split(str(text))
                    if len(parts) < 2:
                        continue
                    new: list[nodes.Node] = []
                    for i, part in enumerate(parts):
                        if i:
                            new.append(nodes.raw("", "<wbr>", format="html"))
                        new.append(nodes.Text(part))
                    text.parent.replace(text, new)


def setup(app):
    app.add_post_transform(CodeBreaksInTables)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
