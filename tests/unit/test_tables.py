"""The table renderers behind ``%gpu status``, ``--dry-run`` and ``autogpu list``/``pick``."""

from __future__ import annotations

from autogpu_jupyter.core.tables import Column, to_html, to_text, visible

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
