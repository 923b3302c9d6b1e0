"""Compact tables for people: aligned plain text for terminals, escaped HTML for notebooks.

``%gpu status``, ``%gpu pick --dry-run``, ``autogpu list`` and ``autogpu pick --dry-run`` show
tables whose cells partly come from other users (notebook paths, user names, command lines,
reasons naming them). Two rules hold for every cell, whatever the caller passes:

- **HTML**: every cell, caption and note goes through :func:`html.escape`; nothing a caller
  passes is ever markup. Colours are JupyterLab theme variables with fallbacks, so a table reads
  in light and dark themes.
- **Terminal**: C0/C1 control characters and Unicode bidirectional controls are made visible
  (``\\x1b``, ``\\u202e``) by :func:`visible`, so a hostile name cannot move the cursor, recolour
  the terminal or reorder what follows it.

Layout: every column but one keeps its cells on one line (``GPU 0``, ``NVIDIA A100-SXM4-80GB``
never break); the one ``wrap`` column (holders, reasons) takes the rest of the width, and in text
its continuation lines start under the column, never back at column 0. Where the width is too
small for every column (an 80-column terminal), the columns with a ``drop`` rank are left out,
lowest rank first, until the table fits: text is left-aligned, numbers right-aligned. The dry
run's ranking (:func:`ranking_lines`) puts its wrap column, the verdict, under each row instead
where the other columns leave it less than its least width.
"""

from __future__ import annotations

import html
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core.text import cells, ljust, rjust, terminal_safe, wrap_words
from autogpu_jupyter.core.units import format_bytes
from autogpu_jupyter.core.words import NOBODY

if TYPE_CHECKING:
    from autogpu_jupyter.core.picker import PickResult
    from autogpu_jupyter.core.policy import Constraints

__all__ = [
    "Column",
    "visible",
    "to_text",
    "to_html",
    "status_table",
    "narrow",
    "asked_text",
    "ranking_lines",
]

# A unit ends where no word character follows (``\b`` would never end "%", which is no word
# character itself, so "12 %" could split).
_UNIT_GAP = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|KB|MB|GB|TB|%|s|W|°C)(?!\w)")
#: What stays on one line in a wrapping cell besides a number and its unit: a short aside in
#: parentheses ("(15.6 GiB used)") and "pid 4100".
_GROUPS = re.compile(r"\([^()]{1,30}\)|\bpid \d+")


def _glued(text: str) -> str:
    """``text`` with the spaces that must not break a line made no-break spaces."""
    text = _UNIT_GAP.sub("\\1\u00a0\\2", text)
    return _GROUPS.sub(lambda m: m.group().replace(" ", "\u00a0"), text)


def visible(text: object) -> str:
    """``text`` for one table cell of a terminal: :func:`core.text.terminal_safe` (C0/C1
    controls, DEL, bidi controls, lone surrogates spelled out), and line breaks too."""
    safe = terminal_safe(str(text))
    return safe.replace("\n", "\\x0a").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


@dataclass(frozen=True, slots=True)
class Column:
    """A table column: its title, alignment, whether its cells may wrap (one column), and when
    it is left out of a table too wide for its width (``drop``: 1 first, 0 never)."""

    title: str
    align: str = "left"
    wrap: bool = False
    drop: int = 0


_MIN_WRAP = 24
_GAP = 2


def _fits(widths: Sequence[int], wrap_at: int | None, width: int, indent: str) -> bool:
    fixed = sum(w for i, w in enumerate(widths) if i != wrap_at) + _GAP * (len(widths) - 1)
    return len(indent) + fixed + (_MIN_WRAP if wrap_at is not None else 0) <= width


def narrow(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    width: int,
    *,
    indent: str = "",
) -> tuple[list[Column], list[tuple[str, ...]]]:
    """The columns (and the rows' cells) that fit ``width`` characters: columns with a ``drop``
    rank are left out, rank 1 first, until the others fit (the wrap column counted at its
    least width). Columns without a rank always stay."""
    _check(columns, rows)
    keep = list(range(len(columns)))

    def widths_of(idx: list[int]) -> list[int]:
        return [
            max([cells(columns[i].title), *(cells(visible(r[i])) for r in rows)]) for i in idx
        ]

    for rank in sorted({c.drop for c in columns if c.drop > 0}):
        wrap_at = next((n for n, i in enumerate(keep) if columns[i].wrap), None)
        if _fits(widths_of(keep), wrap_at, width, indent):
            break
        keep = [i for i in keep if columns[i].drop != rank]
    return [columns[i] for i in keep], [tuple(r[i] for i in keep) for r in rows]


def _check(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> None:
    if sum(c.wrap for c in columns) > 1:
        raise ValueError("at most one column may wrap")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"row {row!r} has {len(row)} cells, {len(columns)} columns")


def to_text(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    width: int = 100,
    indent: str = "",
) -> list[str]:
    """The table as aligned lines of at most ``width`` terminal cells where the wrap column
    allows.

    Cells are made :func:`visible`; widths are counted in terminal cells (a CJK character takes
    two: :func:`core.text.cells`). The wrap column gets what the other columns leave (at least
    24 cells), broken between words only (never inside "20.0 GiB", "(15.6 GiB used)" or
    "pid 4100"); its continuation lines are indented to the column's start.
    """
    _check(columns, rows)
    texts = [[visible(c) for c in row] for row in rows]
    titles = [c.title for c in columns]
    widths = [max([cells(t), *(cells(r[i]) for r in texts)]) for i, t in enumerate(titles)]
    wrap_at = next((i for i, c in enumerate(columns) if c.wrap), None)
    if wrap_at is not None:
        fixed = sum(w for i, w in enumerate(widths) if i != wrap_at) + _GAP * (len(columns) - 1)
        widths[wrap_at] = max(_MIN_WRAP, min(widths[wrap_at], width - len(indent) - fixed))

    def line(values: Sequence[str]) -> list[str]:
        parts: list[list[str]] = []
        for i, v in enumerate(values):
            if i == wrap_at:
                # "20.0 GiB", "(15.6 GiB used)" stay together: a no-break space is no split
                # point, and becomes a plain space again after wrapping.
                wrapped = wrap_words(_glued(v), widths[i])
                parts.append([w.replace("\u00a0", " ") for w in wrapped])
            else:
                parts.append([v])
        height = max(len(p) for p in parts)
        out = []
        for k in range(height):
            shown = []
            for i, col in enumerate(columns):
                v = parts[i][k] if k < len(parts[i]) else ""
                shown.append(rjust(v, widths[i]) if col.align == "right" else ljust(v, widths[i]))
            out.append((indent + "  ".join(shown)).rstrip())
        return out

    lines = line(titles)
    for r in texts:
        lines.extend(line(r))
    return lines


_FG = "var(--jp-ui-font-color1, inherit)"
_FG2 = "var(--jp-ui-font-color2, #616161)"
_BORDER = "var(--jp-border-color2, #c8c8c8)"
_MINE_BG = "var(--jp-layout-color2, rgba(127, 127, 127, 0.16))"
_ACCENT = "var(--jp-brand-color1, #1976d2)"


def to_html(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    caption: str = "",
    highlight: Collection[int] = (),
    notes: Sequence[str] = (),
    css_class: str = "autogpu-table",
) -> str:
    """The table as compact HTML with inline styles; every text escaped.

    ``highlight`` holds row numbers to mark (this kernel's devices): a theme-aware background
    and an accent bar, readable in light and dark themes; the row carries ``data-mine="1"``.
    """
    _check(columns, rows)
    e = html.escape

    def cell_style(col: Column, head: bool) -> str:
        style = f"padding:1px 8px;text-align:{'right' if col.align == 'right' else 'left'};"
        if col.wrap:
            style += "white-space:normal;overflow-wrap:anywhere;min-width:14em;max-width:40em;"
        else:
            style += "white-space:nowrap;"
        if head:
            style += f"font-weight:600;color:{_FG2};border-bottom:1px solid {_BORDER};"
        return style

    head = "".join(f'<th style="{cell_style(c, True)}">{e(c.title)}</th>' for c in columns)
    body = []
    for n, row in enumerate(rows):
        mine = n in highlight
        attrs = (
            f' data-mine="1" style="background:{_MINE_BG};font-weight:600;'
            f'box-shadow:inset 3px 0 0 {_ACCENT}"'
            if mine
            else ""
        )
        tds = "".join(
            f'<td style="{cell_style(c, False)}">{e(str(v))}</td>'
            for c, v in zip(columns, row, strict=True)
        )
        body.append(f"<tr{attrs}>{tds}</tr>")
    cap = (
        f'<caption style="caption-side:top;text-align:left;padding:2px 8px;color:{_FG}">'
        f"{e(caption)}</caption>"
        if caption
        else ""
    )
    foot = "".join(
        f'<div style="padding:1px 8px;color:{_FG2};font-size:12px">{e(n)}</div>' for n in notes
    )
    return (
        f'<div class="{e(css_class)}"><table style="border-collapse:collapse;font-size:12px;'
        f'color:{_FG};margin:0">{cap}<thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>{foot}</div>"
    )


def status_table(frame: Any) -> tuple[list[Column], list[tuple[str, ...]], set[int]]:
    """The status table of every device (``api.status()``'s frame) as ``%gpu status`` and
    ``autogpu list`` show it: the columns, text rows, and the row numbers of the caller's
    devices (marked ``▶``). Text columns are left-aligned, numbers right-aligned; holders (other
    users' notebook paths) are the one column that wraps, and the columns a narrow terminal or
    notebook can do without carry a ``drop`` rank (the UUID first, memory in use last: free
    memory always stays)."""
    # pandas only for a status table: %load_ext imports this module for its text helpers.
    import pandas as pd  # noqa: PLC0415

    columns = [
        Column(""),
        Column("gpu"),
        Column("name"),
        Column("uuid", drop=1),
        Column("util", align="right"),
        Column("memory used / total", align="right", drop=5),
        Column("free", align="right"),
        Column("temp", align="right", drop=3),
        Column("power", align="right", drop=2),
        Column("procs", align="right", drop=4),
        Column("holders", wrap=True),
    ]

    def num(value: Any, unit: str) -> str:
        if value is None or pd.isna(value):  # unknown (NOT_SUPPORTED, lost): never 0
            return "?"
        return f"{float(value):.0f}{unit}"

    rows: list[tuple[str, ...]] = []
    highlight: set[int] = set()
    for n, r in enumerate(frame.to_dict("records")):
        if r[""] == "▶":
            highlight.add(n)
        state = r.get("state") or "ok"
        holders = r.get("holders") or ""
        if state != "ok":
            holders = f"{state}; {holders}" if holders else state
        rows.append(
            (
                r[""],
                str(r["gpu"]),
                str(r["name"]),
                str(r["uuid"]),
                num(r.get("util %"), "%"),
                f"{r['mem used']} / {r['mem total']}",
                str(r["mem free"]),
                num(r.get("temp °C"), " °C"),
                num(r.get("power W"), " W"),
                num(r.get("procs"), ""),
                holders or NOBODY,
            )
        )
    return columns, rows, highlight


def asked_text(constraints: Constraints) -> str:
    """What was asked, for people: ``min free 10.0 GiB``, or ``any device`` when nothing was."""
    text = constraints.describe()
    return "any device" if text == "no constraints" else text


def _wrapped(text: str, width: int, first: str, rest: str, glue: Collection[str]) -> list[str]:
    """``text`` in lines of at most ``width`` cells: the first starting with ``first``, the
    others with ``rest``; broken between words only, never inside a number and its unit, an
    aside in parentheses or one of the names in ``glue`` (a device's label: ``GPU 0 MIG 1``)."""
    text = _glued(visible(text))
    for name in sorted(glue, key=len, reverse=True):
        text = text.replace(name, name.replace(" ", "\u00a0"))
    room = max(width - max(len(first), len(rest)), _MIN_WRAP)
    parts = [w.replace("\u00a0", " ") for w in wrap_words(text, room)]
    return [(first if k == 0 else rest) + w for k, w in enumerate(parts)]


def ranking_lines(result: PickResult, width: int = 120, indent: str = "  ") -> list[str]:
    """The ranking table of a dry run (``%gpu pick --dry-run``, ``autogpu pick --dry-run``):
    every device, its rank or why it was dropped, the load figure it was ranked by, and what
    decided between the best and the runner-up.

    Aligned columns, the whole table within ``width`` terminal cells: where the columns leave
    the verdict its least width (24), the verdict is the last column and wraps under itself;
    where they do not (an 80-column terminal, a long device name), each verdict goes on the
    lines under its device's row instead. A device's label and name are never cut or broken;
    the verdicts and the closing line break between words only. Control characters in any
    cell are made visible.
    """
    # The decision pipeline comes with the first pick.
    from autogpu_jupyter.core.decision import deciding_term, describe_load  # noqa: PLC0415

    sim = " [SIMULATED]" if result.snapshot.simulated else ""
    chosen = {d.uuid for d in result.chosen}
    labels = {c.device.label for c in result.candidates}
    columns = [
        Column("rank"),
        Column("device"),
        Column("name"),
        Column("free", align="right"),
        Column("util", align="right", drop=1),
        Column("load"),
        Column("leases", align="right", drop=2),
        Column("verdict", wrap=True),
    ]
    rows = []
    n = 0
    for c in result.candidates:
        if c.eligible:
            n += 1
            verdict = "would pick" if c.device.uuid in chosen else "fits"
        else:
            verdict = "dropped"
        rows.append(
            (
                str(n) if c.eligible else "-",
                c.device.label,
                c.device.name,
                format_bytes(c.effective_free_bytes),
                "?" if c.smoothed_util_pct is None else f"{c.smoothed_util_pct:.0f}%",
                describe_load(c, short=True) if c.eligible else "-",
                str(c.lease_count),
                f"{verdict}: {'; '.join(c.reasons) or 'ok'}",
            )
        )
    title = f"autogpu{sim} dry run ({asked_text(result.constraints)}): nothing changed"
    out = _wrapped(title, width, "", indent, labels)
    widths = [
        max([cells(col.title), *(cells(visible(r[i])) for r in rows)])
        for i, col in enumerate(columns)
    ]
    if _fits(widths, len(columns) - 1, width, indent):
        out.extend(to_text(columns, rows, width=width, indent=indent))
    else:
        # The verdicts under their rows, from the device column on; in a terminal narrower
        # still, the columns it can do without (util: the load names the figure ranked by;
        # then leases) are left out until the rest fits.
        kept, cut = narrow(columns[:-1], [r[:-1] for r in rows], width, indent=indent)
        table = to_text(kept, cut, width=width, indent=indent)
        under = indent + " " * (widths[0] + _GAP)
        out.append(table[0])
        for line, row in zip(table[1:], rows, strict=True):
            out.append(line)
            out.extend(_wrapped(row[-1], width, under, under, labels))
    if not result.chosen:
        fail = "no device fits: a real pick would fail now (--wait DURATION waits in line)"
        out.extend(_wrapped(fail, width, indent, indent + "  ", labels))
    else:
        best = result.candidate(result.chosen[0].uuid)
        if best is not None:
            ru = result.runner_up
            vs = f" over {ru.device.label}" if ru is not None else ""
            why = f"why {best.device.label}{vs}: {deciding_term(best, ru)}"
            out.extend(_wrapped(why, width, indent, indent + "  ", labels))
    return out
