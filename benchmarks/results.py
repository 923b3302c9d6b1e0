"""Where the benchmarks leave their ratios for the regression guard (issue 26).

Each benchmark that knows ``--results PATH`` merges its figures into that JSON object (one key
per figure, every one lower-is-better: a ratio to a peer, or milliseconds), so that one
``make bench`` run leaves them all in ``benchmarks/results/latest.json``.
``scripts/bench_compare.py`` compares them with the last run recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["record"]


def record(path: str | os.PathLike[str] | None, figures: Mapping[str, float]) -> None:
    """Merge ``figures`` into the JSON object at ``path`` (created when missing); nothing when
    ``path`` is ``None``."""
    if path is None:
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        current = json.loads(target.read_text())
    except (OSError, ValueError):
        current = {}
    if not isinstance(current, dict):
        current = {}
    current.update({k: round(float(v), 3) for k, v in figures.items()})
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(current, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, target)
