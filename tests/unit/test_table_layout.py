"""Exact layout of the tables behind ``%gpu status``, ``--dry-run`` and ``autogpu list``:
where the wrap column breaks, how units stay with their numbers, and the exact HTML."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.tables import Column, to_html, to_text, visible

GPU_AND_HOLDERS = [Column("gpu"), Column("holders", wrap=True)]


def test_a_column_is_left_aligned_and_kept_on_one_line_unless_told() -> None:
    col = Column("gpu")
    assert (col.title, col.align, col.wrap) == ("gpu", "left", False)


def test_line_breaks_in_a_cell_are_spelled_out() -> None:
    assert visible("a\nb\u2028c\u2029d") == "a\\x0ab\\u2028c\\u2029d"
    assert visible(12) == "12"


@pytest.mark.parametrize(
    ("columns", "rows", "message"),
    [
        (
            [Column("a", wrap=True), Column("b", wrap=True)],
            [],
            "at most one column may wrap",
        ),
        (
            [Column("a"), Column("b")],
            [("x", "y"), ("only one",)],
            "row ('only one',) has 1 cells, 2 columns",
        ),
        ([Column("a")], [("x", "y")], "row ('x', 'y') has 2 cells, 1 columns"),
    ],
)
def test_a_malformed_table_is_refused_in_text_and_html(
    columns: list[Column], rows: list[tuple[str, ...]], message: str
) -> None:
    with pytest.raises(ValueError) as err:
        to_text(columns, rows)
    assert str(err.value) == message
    with pytest.raises(ValueError) as err:
        to_html(columns, rows)
    assert str(err.value) == message


def test_the_wrap_column_takes_exactly_the_width_the_others_leave() -> None:
    # "GPU 0" and the two-space gap take 7 of 40 columns: the holders get 33.
    fits = "x" * 16 + " " + "y" * 16  # 33 characters
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", fits)], width=40) == [
        "gpu    holders",
        "GPU 0  " + fits,
    ]
    too_long = "x" * 16 + " " + "y" * 17  # 34 characters
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", too_long)], width=40) == [
        "gpu    holders",
        "GPU 0  " + "x" * 16,
        "       " + "y" * 17,
    ]
    # the indent counts against the width, and starts every line
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", fits)], width=42, indent="  ") == [
        "  gpu    holders",
        "  GPU 0  " + fits,
    ]
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", too_long)], width=41, indent="  ") == [
        "  gpu    holders",
        "  GPU 0  " + "x" * 16,
        "         " + "y" * 17,
    ]


def test_three_columns_leave_two_gaps_for_the_wrap_column() -> None:
    columns = [Column("gpu"), Column("free", align="right"), Column("holders", wrap=True)]
    # 5 + 7 + two gaps of 2 = 16 of 49: the holders get 33
    fits = "x" * 16 + " " + "y" * 16
    too_long = "x" * 16 + " " + "y" * 17
    assert to_text(columns, [("GPU 0", "1.0 GiB", fits)], width=49)[1] == (
        "GPU 0  1.0 GiB  " + fits
    )
    assert to_text(columns, [("GPU 0", "1.0 GiB", too_long)], width=49)[1:] == [
        "GPU 0  1.0 GiB  " + "x" * 16,
        "                " + "y" * 17,
    ]


def test_the_default_width_is_100_columns() -> None:
    fits = "x" * 46 + " " + "y" * 46  # 93 = 100 - 7
    too_long = "x" * 46 + " " + "y" * 47
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", fits)])[1] == "GPU 0  " + fits
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", too_long)])[1:] == [
        "GPU 0  " + "x" * 46,
        "       " + "y" * 47,
    ]


def test_the_wrap_column_keeps_at_least_24_characters_in_a_narrow_terminal() -> None:
    twenty_four = "a" * 11 + " " + "b" * 12
    twenty_five = "a" * 12 + " " + "b" * 12
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", twenty_four)], width=10)[1:] == [
        "GPU 0  " + twenty_four
    ]
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", twenty_five)], width=10)[1:] == [
        "GPU 0  " + "a" * 12,
        "       " + "b" * 12,
    ]


def test_hyphenated_names_are_not_broken_at_their_hyphens() -> None:
    text = "see carol-on-a-long-name-x"
    assert to_text(GPU_AND_HOLDERS, [("GPU 0", text)], width=10)[1:] == [
        "GPU 0  see",
        "       carol-on-a-long-name-x",
    ]


@pytest.mark.parametrize(
    "unit", ["B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "%", "s", "W", "°C"]
)
def test_a_number_and_its_unit_are_never_split(unit: str) -> None:
    # "x"*21 + " 5" is 23 characters: without the glue "5" would end the line, its unit the next
    lines = to_text(GPU_AND_HOLDERS, [("GPU 0", "x" * 21 + " 5 " + unit)], width=10)
    assert lines[1:] == ["GPU 0  " + "x" * 21, "       5 " + unit]


def test_only_a_whole_unit_is_glued() -> None:
    # "5 Bytes" is no unit: the number may end a line and the word start the next
    lines = to_text(GPU_AND_HOLDERS, [("GPU 0", "x" * 21 + " 5 Bytes")], width=10)
    assert lines[1:] == ["GPU 0  " + "x" * 21 + " 5", "       Bytes"]


def test_an_empty_wrap_cell_and_short_cells_pad_without_trailing_spaces() -> None:
    columns = [Column("gpu"), Column("holders", wrap=True), Column("free", align="right")]
    rows = [("GPU 0", "", "1 GiB"), ("GPU 1", "alice bob", "")]
    assert to_text(columns, rows, width=10) == [
        "gpu    holders                    free",
        "GPU 0                            1 GiB",
        "GPU 1  alice bob",
    ]
    # the shorter cells of a wrapped row are blank on its continuation lines
    rows = [("GPU 0", "a" * 12 + " " + "b" * 12, "1 GiB")]
    assert to_text(columns, rows, width=10)[1:] == [
        "GPU 0  " + "a" * 12 + " " * 14 + "1 GiB",
        "       " + "b" * 12,
    ]
    assert to_text([Column("gpu"), Column("holders", wrap=True)], [("GPU 0", "")]) == [
        "gpu    holders",
        "GPU 0",
    ]


def test_right_aligned_titles_and_cells_end_at_the_column_edge() -> None:
    columns = [Column("n", align="right"), Column("name")]
    assert to_text(columns, [("10", "a"), ("7", "bb")]) == [" n  name", "10  a", " 7  bb"]


_FG = "var(--jp-ui-font-color1, inherit)"
_FG2 = "var(--jp-ui-font-color2, #616161)"
_BORDER = "var(--jp-border-color2, #c8c8c8)"
_HEAD = f"font-weight:600;color:{_FG2};border-bottom:1px solid {_BORDER};"
_LEFT = "padding:1px 8px;text-align:left;white-space:nowrap;"
_RIGHT = "padding:1px 8px;text-align:right;white-space:nowrap;"
_WRAP = (
    "padding:1px 8px;text-align:left;white-space:normal;overflow-wrap:anywhere;"
    "min-width:14em;max-width:40em;"
)
_TABLE = f'<table style="border-collapse:collapse;font-size:12px;color:{_FG};margin:0">'


def test_html_is_exactly_this_markup_with_theme_colours() -> None:
    columns = [Column("gpu"), Column("free", align="right"), Column("holders", wrap=True)]
    html = to_html(
        columns,
        [("GPU 0", "1 GiB", "a & b"), ("GPU 1", 2, "-")],
        caption="Cap",
        highlight={1},
        notes=["n1", "<n2>"],
    )
    mine = (
        ' data-mine="1" style="background:var(--jp-layout-color2, rgba(127, 127, 127, 0.16));'
        'font-weight:600;box-shadow:inset 3px 0 0 var(--jp-brand-color1, #1976d2)"'
    )
    note = f'<div style="padding:1px 8px;color:{_FG2};font-size:12px">'
    assert html == (
        '<div class="autogpu-table">'
        + _TABLE
        + '<caption style="caption-side:top;text-align:left;padding:2px 8px;'
        + f'color:{_FG}">Cap</caption>'
        + "<thead><tr>"
        + f'<th style="{_LEFT}{_HEAD}">gpu</th>'
        + f'<th style="{_RIGHT}{_HEAD}">free</th>'
        + f'<th style="{_WRAP}{_HEAD}">holders</th>'
        + "</tr></thead><tbody>"
        + f'<tr><td style="{_LEFT}">GPU 0</td><td style="{_RIGHT}">1 GiB</td>'
        + f'<td style="{_WRAP}">a &amp; b</td></tr>'
        + f'<tr{mine}><td style="{_LEFT}">GPU 1</td><td style="{_RIGHT}">2</td>'
        + f'<td style="{_WRAP}">-</td></tr>'
        + "</tbody></table>"
        + f"{note}n1</div>{note}&lt;n2&gt;</div>"
        + "</div>"
    )


def test_html_without_caption_notes_or_highlight() -> None:
    html = to_html([Column("x")], [("1",)], css_class='my"class')
    assert html == (
        '<div class="my&quot;class">'
        + _TABLE
        + f'<thead><tr><th style="{_LEFT}{_HEAD}">x</th></tr></thead>'
        + f'<tbody><tr><td style="{_LEFT}">1</td></tr></tbody></table></div>'
    )


def test_a_narrow_width_leaves_out_the_columns_it_can_do_without_lowest_rank_first() -> None:
    from autogpu_jupyter.core.tables import narrow

    columns = [Column("gpu"), Column("uuid", drop=1), Column("temp", align="right", drop=2),
               Column("holders", wrap=True)]
    rows = [("GPU 0", "GPU-5a1b2c3d", "51 °C", "alice: train.ipynb")]
    # wide enough for everything (the wrap column at its least width, 24)
    assert narrow(columns, rows, 60) == (columns, [tuple(rows[0])])
    # one column too many: the UUID goes first, then the temperature
    assert [c.title for c in narrow(columns, rows, 50)[0]] == ["gpu", "temp", "holders"]
    cols, cells = narrow(columns, rows, 20)
    assert [c.title for c in cols] == ["gpu", "holders"]
    assert cells == [("GPU 0", "alice: train.ipynb")]
    # columns without a rank always stay, however narrow
    assert [c.title for c in narrow([Column("gpu")], [("GPU 0",)], 1)[0]] == ["gpu"]


# ---- word boundaries and display cells (issue 41) ----------------------------------------------


def test_a_holder_wraps_between_holders_never_inside_its_memory_in_parentheses() -> None:
    """Caught (issue 41): at 80 columns "(15.6 GiB used)" broke after "GiB"."""
    lines = to_text(GPU_AND_HOLDERS, [("GPU 0", "alice: pid 41000 (15.6 GiB used), bob: pid "
                                                "41001 (184.4 GiB used)")], width=40)
    assert lines == [
        "gpu    holders",
        "GPU 0  alice: pid 41000 (15.6 GiB used),",
        "       bob: pid 41001 (184.4 GiB used)",
    ]
    # where "(184.4 GiB" would still fit on the line: the whole aside goes to the next one
    lines = to_text(GPU_AND_HOLDERS, [("GPU 1", "bob: pid 41001 (184.4 GiB used)")], width=34)
    assert lines[1:] == ["GPU 1  bob: pid 41001", "       (184.4 GiB used)"]
    lines = to_text(GPU_AND_HOLDERS, [("GPU 0", "alice: pid 41000 (15.6 GiB used)")], width=31)
    assert lines[1:] == ["GPU 0  alice: pid 41000", "       (15.6 GiB used)"]


def test_widths_count_display_cells_so_a_cjk_name_does_not_shift_the_next_column() -> None:
    """Caught (issue 41): a CJK notebook name (each character two cells wide) shifted the next
    column by as many cells as it has characters."""
    lines = to_text([Column("notebook"), Column("gpu")],
                    [("データ解析.ipynb", "GPU 0"), ("a.ipynb", "GPU 1")])
    assert lines == [
        "notebook          gpu",
        "データ解析.ipynb  GPU 0",
        "a.ipynb           GPU 1",
    ]
    # the column after it starts at the same terminal cell on every line
    from autogpu_jupyter.core.text import cells

    starts = {cells(line[: line.index("GPU")]) for line in lines[1:]}
    assert starts == {18}


def test_a_wrapped_cjk_cell_keeps_to_its_width_in_cells() -> None:
    from autogpu_jupyter.core.text import cells

    lines = to_text(GPU_AND_HOLDERS, [("GPU 0", "アリス: 研究室の長いノートブックの名前.ipynb")],
                    width=31)
    assert all(cells(line) <= 31 for line in lines), lines
    assert lines[1] == "GPU 0  アリス:"


@pytest.mark.parametrize(
    ("text", "width"),
    [("abc", 3), ("データ", 6), ("e\u0301", 1), ("ＡＢ", 4), ("", 0), ("a\u200bb", 2)],
)
def test_display_cells(text: str, width: int) -> None:
    from autogpu_jupyter.core.text import cells

    assert cells(text) == width
