"""A benchmark's results as JSON, for ``bench/report.py`` (and anyone who wants them).

Every benchmark prints its table for a reader; with ``--json PATH`` it also writes the
same numbers as one record::

    {"bench": "steps_per_run", "title": "...", "columns": ["model", "K", ...],
     "rows": [["logreg-digits", 1, 2481.0, 1.0], ...], "meta": {...}}

``columns`` names the entries of each row; numbers stay numbers (no formatting), so the
report can plot them; ``meta`` holds what the rows were measured under (rounds, sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Sequence
from typing import Any


def add_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--json PATH`` to a benchmark's command line."""
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results as JSON to PATH (bench/report.py)")


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: NumPy scalars as Python numbers, NaN/inf as None."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def write(path: str | None, bench: str, title: str, columns: Sequence[str],
          rows: Sequence[Sequence[Any]], **meta: Any) -> None:
    """Writes one record to ``path`` (nothing when ``path`` is None).

    Raises:
        ValueError: a row whose length differs from ``columns``.
    """
    if path is None:
        return
    for i, row in enumerate(rows):
        if len(row) != len(columns):
            raise ValueError(f"{bench}: row {i} has {len(row)} entries for "
                             f"{len(columns)} columns {list(columns)}")
    record = {"bench": bench, "title": title, "columns": list(columns),
              "rows": _plain([list(r) for r in rows]), "meta": _plain(meta)}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
    os.replace(tmp, path)
