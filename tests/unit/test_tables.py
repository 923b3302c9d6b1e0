"""The table renderers behind ``%gpu status``, ``--dry-run`` and ``autogpu list``/``pick``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import PickResult, pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.tables import Column, narrow, ranking_lines, to_html, to_text, visible
from tests.leasehelpers import fleet

COLUMNS = [Column("gpu"), Column("free", align="right"), Column("holders", wrap=True)]


def test_text_is_aligned_and_the_wrap_column_continues_under_itself() -> None:
    rows = [
        ("GPU 0", "77.5 GiB", "alice: notebooks/exp/long-name.ipynb (10.0 GiB)"),
        ("GPU 10", "1.0 GiB", "-"),
    ]
    assert to_text(COLUMNS, rows, width=50) == [
        "gpu         free  holders",
        "GPU 0   77.5 GiB  alice:",
        "                  notebooks/exp/long-name.ipynb",
        "                  (10.0 GiB)",  # "10.0 GiB" is never split
        "GPU 10   1.0 GiB  -",
    ]
    # wide enough: one line per row
    assert to_text(COLUMNS, rows, width=100)[1] == (
        "GPU 0   77.5 GiB  alice: notebooks/exp/long-name.ipynb (10.0 GiB)"
    )


def test_terminal_text_shows_control_and_bidi_characters() -> None:
    assert visible("bob\x1b[31mred\x9b\u202eevil\u2066") == "bob\\x1b[31mred\\x9b\\u202eevil\\u2066"
    assert visible("Zoë · ▶ GPU 1") == "Zoë · ▶ GPU 1"
    (line,) = to_text([Column("who")], [("mallory\x1b]0;pwned\x07",)], width=80)[1:]
    assert line == "mallory\\x1b]0;pwned\\x07"


def test_html_escapes_every_cell_and_caption() -> None:
    html = to_html(
        COLUMNS,
        [("<b>GPU</b>", "1 GiB", 'eve: <img src=x onerror="alert(1)">.ipynb')],
        caption="<script>alert(2)</script>",
        highlight={0},
        notes=["<i>note</i>"],
    )
    for raw in ("<b>GPU", "<img", "<script", "<i>"):
        assert raw not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;.ipynb" in html
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in html
    assert html.count('data-mine="1"') == 1


def test_the_status_table_marks_the_callers_rows_and_writes_each_unit() -> None:
    """``%gpu status`` / ``autogpu list``: the caller's devices marked and returned for
    highlighting, numbers with their unit, unknown readings as ``?`` (never 0), a device's
    state before its holders, numbers right-aligned and the narrow-screen drop order."""
    import pandas as pd

    from autogpu_jupyter.core.tables import status_table

    common = {"name": "A100", "mem used": "1.0 GiB", "mem total": "80.0 GiB",
              "mem free": "79.0 GiB"}
    frame = pd.DataFrame([
        {"": "", "gpu": 0, "uuid": "GPU-a", "util %": 37.0, "temp °C": 41.0, "power W": 80.4,
         "procs": 2, "holders": "bob: a.ipynb", "state": "ok", **common},
        {"": "▶", "gpu": 1, "uuid": "GPU-b", "util %": None, "temp °C": float("nan"),
         "power W": None, "procs": None, "holders": "ann: b.ipynb", "state": "lost", **common},
        {"": "", "gpu": 3, "uuid": "GPU-d", "util %": 0.0, "temp °C": 30.0, "power W": 60.0,
         "procs": 0, "holders": "", "state": "lost", **common},
    ])
    columns, rows, highlight = status_table(frame)
    assert highlight == {1}
    assert rows == [
        ("", "0", "A100", "GPU-a", "37%", "1.0 GiB / 80.0 GiB", "79.0 GiB", "41 °C", "80 W", "2",
         "bob: a.ipynb"),
        ("▶", "1", "A100", "GPU-b", "?", "1.0 GiB / 80.0 GiB", "79.0 GiB", "?", "?", "?",
         "lost; ann: b.ipynb"),
        ("", "3", "A100", "GPU-d", "0%", "1.0 GiB / 80.0 GiB", "79.0 GiB", "30 °C", "60 W", "0",
         "lost"),
    ]
    # a frame without the state and holders columns: every device ok, nobody holding it
    bare = frame.drop(columns=["state", "holders"]).head(1)
    assert status_table(bare)[1][0][-1] == "nobody"
    assert [(c.title, c.align, c.wrap, c.drop) for c in columns] == [
        ("", "left", False, 0), ("gpu", "left", False, 0), ("name", "left", False, 0),
        ("uuid", "left", False, 1), ("util", "right", False, 0),
        ("memory used / total", "right", False, 5), ("free", "right", False, 0),
        ("temp", "right", False, 3), ("power", "right", False, 2), ("procs", "right", False, 4),
        ("holders", "left", True, 0),
    ]


# ==== folded from test_core_misc_mutants.py (issue 42) ===========================================
# Survivors of the full mutation run (issue 22) in core/tables.py: the table narrowing. The rest
# of this round's core/ tests went to the files of their subjects (issue 42); these wait until the
# tables' own tests settle, to go into test_table_layout.py or test_tables.py.


GiB = 1024**3

# ---- core.cluster: ClusterCache._refresh ----------------------------------------------------


# ---- core.overload: _own_lease and best_alternative -----------------------------------------


# ---- core.decision.served_waiters -----------------------------------------------------------


# ---- core.sampler: _seed_num and Sampler.seed -----------------------------------------------


# ---- core.leasing.brokerclient: _Conn._left_behind ------------------------------------------


# ---- core.leasing.records._encoded_len ------------------------------------------------------


# ---- core.tables: _fits and narrow ----------------------------------------------------------

_NAME_ID = [Column("name"), Column("id", drop=1)]
_ROWS = [("abcd", "12345")]  # 4 + 2 + 5 = 11 characters


@pytest.mark.parametrize(
    ("width", "indent", "kept"),
    [(11, None, 2), (10, None, 1), (13, "  ", 2), (12, "  ", 1)],
)
def test_narrow_keeps_a_column_that_fits_exactly(
    width: int, indent: str | None, kept: int
) -> None:
    """No wrap column: nothing more than the cells and one gap between columns. Caught: the
    wrap column's 24 (or 1) counted without one, ``<`` for ``<=``, a gap too many, an indent
    by default, and no wrap column raising ``StopIteration``."""
    kw = {} if indent is None else {"indent": indent}
    cols, rows = narrow(_NAME_ID, _ROWS, width, **kw)
    assert (cols, rows) == (_NAME_ID[:kept], [_ROWS[0][:kept]])


def test_narrow_counts_the_wrap_column_at_24() -> None:
    cols = [Column("name"), Column("why", wrap=True), Column("id", drop=1)]
    rows = [("abcd", "w" * 40, "12345")]
    assert narrow(cols, rows, 4 + 24 + 5 + 4)[0] == cols
    assert narrow(cols, rows, 4 + 24 + 5 + 3)[0] == cols[:2]


# ---- core.tables.ranking_lines: the dry run's table in the terminal's width -------------------


@pytest.fixture
def ranked(tmp_path: Path) -> PickResult:
    """Three A100-SXM4-80GB (the longest name of a common GPU): one picked, one that fits, one
    dropped for two reasons."""
    data = fleet(3)
    data["devices"][1].update(memory_used=75 * 1024**3, utilization_pct=90)
    data["devices"][2].update(memory_used=50 * 1024**3, utilization_pct=40)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(data))
    return pick(PickOptions(Constraints.parse(min_free="10G", max_util="50")),
                backend=SimulatedBackend(str(path)), environ={}, dry_run=True)


@pytest.mark.parametrize("width", [80, 72, 64])
def test_a_ranking_fits_the_terminal_and_never_cuts_a_device(
    ranked: PickResult, width: int
) -> None:
    """In an 80-column terminal (and narrower) no line is wider than the terminal: the verdict
    goes under its device's row when the columns leave it too little room, and each device's
    label and name stay whole on its row. Caught (issue 42): the table 96 columns wide at 80
    (the verdict column kept at 24 beside the others)."""
    lines = ranking_lines(ranked, width)
    assert max(len(ln) for ln in lines) <= width
    for label in ("GPU 0", "GPU 1", "GPU 2"):
        (row,) = [ln for ln in lines if ln.startswith(("  1 ", "  2 ", "  - ")) and label in ln]
        assert "NVIDIA A100-SXM4-80GB" in row
    text = " ".join(ln.strip() for ln in lines)
    for words in ("would pick: 80.0 GiB free >= 10.0 GiB wanted",
                  "fits: 30.0 GiB free >= 10.0 GiB wanted",
                  "dropped: only 5.0 GiB free < 10.0 GiB wanted; utilisation 90% > max 50%",
                  "why GPU 0 over GPU 2: lower load (0% util vs 62% mem)"):
        assert words in text


def test_a_ranking_at_80_columns_puts_each_verdict_under_its_row(ranked: PickResult) -> None:
    """The columns need 70 of the 80, leaving the verdict less than its 24: each verdict on
    the line under its row, from the device column on; nothing broken."""
    assert ranking_lines(ranked, 80) == [
        "autogpu [SIMULATED] dry run (min free 10.0 GiB, max util 50%): nothing changed",
        "  rank  device  name                       free  util  load     leases",
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0",
        "        would pick: 80.0 GiB free >= 10.0 GiB wanted",
        "  2     GPU 2   NVIDIA A100-SXM4-80GB  30.0 GiB   40%  62% mem       0",
        "        fits: 30.0 GiB free >= 10.0 GiB wanted",
        "  -     GPU 1   NVIDIA A100-SXM4-80GB   5.0 GiB   90%  -             0",
        "        dropped: only 5.0 GiB free < 10.0 GiB wanted; utilisation 90% > max 50%",
        "  why GPU 0 over GPU 2: lower load (0% util vs 62% mem)",
    ]


def test_a_ranking_at_200_columns_cuts_nothing(ranked: PickResult) -> None:
    """A wide terminal: one line per device, every column there, each verdict whole beside it.
    """
    assert ranking_lines(ranked, 200) == [
        "autogpu [SIMULATED] dry run (min free 10.0 GiB, max util 50%): nothing changed",
        "  rank  device  name                       free  util  load     leases  verdict",
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0  would pick: "
        "80.0 GiB free >= 10.0 GiB wanted",
        "  2     GPU 2   NVIDIA A100-SXM4-80GB  30.0 GiB   40%  62% mem       0  fits: "
        "30.0 GiB free >= 10.0 GiB wanted",
        "  -     GPU 1   NVIDIA A100-SXM4-80GB   5.0 GiB   90%  -             0  dropped: only "
        "5.0 GiB free < 10.0 GiB wanted; utilisation 90% > max 50%",
        "  why GPU 0 over GPU 2: lower load (0% util vs 62% mem)",
    ]


def test_a_ranking_in_a_very_narrow_terminal_leaves_out_util_then_leases(
    ranked: PickResult,
) -> None:
    """Narrower than the table itself: the smoothed util goes first (the load column names
    the figure each device was ranked by), then the leases; the label and name stay."""
    def header(width: int) -> str:
        (line,) = [ln for ln in ranking_lines(ranked, width) if ln.startswith("  rank")]
        return line

    names = "  rank  device  name                       free"
    assert header(70) == f"{names}  util  load     leases"  # 70 wide: all of it
    assert header(69) == f"{names}  load     leases"
    assert header(63) == f"{names}  load"
