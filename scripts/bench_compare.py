#!/usr/bin/env python3
"""The guard against silent slowdowns (issue 26): compare the figures of the last ``make bench``
(``benchmarks/results/latest.json``) with the run recorded in docs/benchmarks.md.

    .venv/bin/python scripts/bench_compare.py [--results FILE] [--baseline docs/benchmarks.md]
        [--tolerance 0.2] [--record]

Every figure is lower-is-better (a ratio to a peer in the same run, or milliseconds). A figure
that worsened by more than ``--tolerance`` (20 %) is named, and the exit status is 1; a figure
the recorded run does not have is listed as new, one the results lack as not measured (neither
fails). ``--record`` writes the results into docs/benchmarks.md as the new recorded run (after
the comparison; the exit status still tells whether something worsened).

The recorded run is the JSON object in the fenced block that follows the line
``<!-- bench-baseline -->`` in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- bench-baseline -->"
_BLOCK = re.compile(re.escape(MARKER) + r"\n```json\n(?P<body>.*?)\n```", re.DOTALL)


class BaselineError(Exception):
    """The recorded run cannot be read (no marker, not a JSON object of numbers)."""


@dataclass(frozen=True)
class Change:
    """One figure in both runs."""

    name: str
    before: float
    after: float

    @property
    def ratio(self) -> float:
        """after / before (inf when before is 0 and after is not)."""
        if self.before == 0:
            return 1.0 if self.after == 0 else math.inf
        return self.after / self.before

    def worse(self, tolerance: float) -> bool:
        return self.ratio > 1.0 + tolerance


@dataclass(frozen=True)
class Comparison:
    changes: tuple[Change, ...]
    new: tuple[str, ...]
    missing: tuple[str, ...]
    tolerance: float

    @property
    def worsened(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.worse(self.tolerance))


def _figures(data: object, where: str) -> dict[str, float]:
    if not isinstance(data, dict):
        raise BaselineError(
            f"{where}: expected a JSON object of figures, got {type(data).__name__}"
        )
    out: dict[str, float] = {}
    for key, value in data.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise BaselineError(f"{where}: {key!r} is {value!r}, not a finite number")
        out[str(key)] = float(value)
    return out


def read_baseline(text: str, where: str = "docs/benchmarks.md") -> dict[str, float]:
    """The recorded run in ``text`` (see the module docstring)."""
    m = _BLOCK.search(text)
    if m is None:
        raise BaselineError(f"{where}: no recorded run (a ```json block after {MARKER})")
    try:
        data = json.loads(m.group("body"))
    except ValueError as err:
        raise BaselineError(f"{where}: the recorded run is not JSON ({err})") from None
    return _figures(data, where)


def write_baseline(text: str, figures: Mapping[str, float]) -> str:
    """``text`` with its recorded run replaced by ``figures`` (appended where none is)."""
    block = f"{MARKER}\n```json\n{json.dumps(dict(sorted(figures.items())), indent=2)}\n```"
    if _BLOCK.search(text) is None:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    return _BLOCK.sub(lambda _m: block, text, count=1)


def compare(
    baseline: Mapping[str, float], results: Mapping[str, float], tolerance: float = 0.2
) -> Comparison:
    """Each figure of both runs, and those only one of them has."""
    both = sorted(set(baseline) & set(results))
    return Comparison(
        changes=tuple(Change(k, baseline[k], results[k]) for k in both),
        new=tuple(sorted(set(results) - set(baseline))),
        missing=tuple(sorted(set(baseline) - set(results))),
        tolerance=tolerance,
    )


def report(comparison: Comparison) -> str:
    """The comparison as a Markdown table and a verdict."""
    lines = ["| figure | recorded | now | now / recorded | |", "|---|---:|---:|---:|---|"]
    for c in comparison.changes:
        flag = f"**worse by more than {comparison.tolerance:.0%}**" if c.worse(
            comparison.tolerance) else ""
        lines.append(f"| {c.name} | {c.before:g} | {c.after:g} | {c.ratio:.2f} | {flag} |")
    for name in comparison.new:
        lines.append(f"| {name} | - | (new) | | |")
    for name in comparison.missing:
        lines.append(f"| {name} | recorded | (not measured) | | |")
    worse = comparison.worsened
    if worse:
        lines.append("")
        lines.append("worsened by more than "
                     f"{comparison.tolerance:.0%}: " + ", ".join(c.name for c in worse))
    else:
        lines.append("")
        lines.append(f"no figure worsened by more than {comparison.tolerance:.0%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "latest.json"))
    ap.add_argument("--baseline", default=str(ROOT / "docs" / "benchmarks.md"))
    ap.add_argument("--tolerance", type=float, default=0.2)
    ap.add_argument("--record", action="store_true",
                    help="write the results into the baseline file as the recorded run")
    a = ap.parse_args(argv)
    try:
        results = _figures(json.loads(Path(a.results).read_text()), a.results)
        doc = Path(a.baseline).read_text()
        baseline = read_baseline(doc, a.baseline)
    except (OSError, ValueError, BaselineError) as err:
        print(f"bench_compare: {err}", file=sys.stderr)
        return 2
    comparison = compare(baseline, results, a.tolerance)
    print(report(comparison))
    if a.record:
        Path(a.baseline).write_text(write_baseline(doc, {**baseline, **results}))
        print(f"recorded in {a.baseline}")
    return 1 if comparison.worsened else 0


if __name__ == "__main__":
    raise SystemExit(main())
