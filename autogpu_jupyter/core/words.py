"""The words every text front end says of a holder (issue 42, "words once").

``%gpu status``, ``autogpu list``, ``autogpu leases``, the panel, the lease store's refusals and
the server's ``/autogpu/holders`` (which sends these words to the JupyterLab sidebar) all word a
holder here; the dry-run ranking's words are :func:`autogpu_jupyter.core.tables.ranking_lines`.
This module sits at the bottom of core (it imports only the units), so that the lease records
word their holders with it too. One rule, stated once:

* where: the notebook, else ``kernel`` and the kernel id's first 8 characters, else ``pid N``;
* who: ``user: where`` (``where`` alone when the user is unknown);
* memory: ``10.0 GiB booked, 3.2 GiB used, exclusive`` (what is known, in that order).
"""

from __future__ import annotations

from autogpu_jupyter.core.units import format_bytes

__all__ = [
    "NOBODY",
    "holder_where",
    "holder_who",
    "holder_memory",
]

#: The one word every table, the panel, the CLI and the sidebar show for a device nobody holds.
NOBODY = "nobody"


def holder_where(notebook_path: str | None, kernel_id: str | None, pid: int | None) -> str:
    """``train.ipynb``, ``kernel 1a2b3c4d``, ``pid 4242``; ``""`` when none is known."""
    if notebook_path:
        return notebook_path
    if kernel_id:
        return f"kernel {kernel_id[:8]}"
    return f"pid {pid}" if pid is not None else ""


def holder_who(user: str | None, where: str) -> str:
    """``alice: train.ipynb``; ``where`` alone when the user is unknown."""
    return f"{user}: {where}" if user else where


def holder_memory(booked_bytes: int | None, used_bytes: int | None, exclusive: bool) -> str:
    """``10.0 GiB booked, 3.2 GiB used, exclusive`` (what is known; ``""`` when nothing)."""
    parts = []
    if booked_bytes:
        parts.append(f"{format_bytes(booked_bytes)} booked")
    if used_bytes is not None:
        parts.append(f"{format_bytes(used_bytes)} used")
    if exclusive:
        parts.append("exclusive")
    return ", ".join(parts)
