"""Notebook widgets (ipywidgets only here): :class:`Panel`, the live GPU panel.

``Panel`` is imported lazily so that importing this package needs no ipywidgets (the overload
magics' cell hook) and :mod:`autogpu_jupyter.widgets.chart` load without ipywidgets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autogpu_jupyter.widgets.panel import Panel

__all__ = ["Panel"]


def __getattr__(name: str) -> Any:
    if name == "Panel":
        from autogpu_jupyter.widgets.panel import Panel

        return Panel
    raise AttributeError(f"module 'autogpu_jupyter.widgets' has no attribute {name!r}")
