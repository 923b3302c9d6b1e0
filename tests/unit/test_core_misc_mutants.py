"""Survivors of the full mutation run (issue 22) in core/tables.py: the table narrowing. The rest
of this round's core/ tests went to the files of their subjects (issue 42); these wait until the
tables' own tests settle, to go into test_table_layout.py or test_tables.py."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.tables import Column, narrow

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
