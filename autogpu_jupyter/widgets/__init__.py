"""Notebook widgets (ipywidgets only here): :class:`Panel`, the live GPU panel.

``Panel`` is imported lazily so that importing this package, and
:mod:`autogpu_jupyter.widgets.chart`, need no ipywidgets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autogpu_jupyter.widgets.panel import Panel

__all__ = ["Panel"]


def __getattr__(name: str) -> Any:
    if name == "Panel":
        from autogpu_jupyter.widgets.panel import Panel  # noqa: PLC0415 (ipywidgets: lazily)

        return Panel
    raise AttributeError(f"module 'autogpu_jupyter.widgets' has no attribute {name!r}")
