"""Keeping the tests' Jupyter installs inside their temporary directories."""

from __future__ import annotations

from pathlib import Path

import jupyter_client.kernelspec
import jupyter_core.paths
import pytest


def keep_kernelspecs_in(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point Jupyter's system kernelspec directory (where an install with neither ``--user`` nor
    ``--prefix`` goes, ``/usr/local/share/jupyter`` for root) into ``tmp``: a bug, or a mutant
    under ``make mutate``, that drops the destination then writes there, not into the host's
    Jupyter, where it would outlive the test and change what later runs list."""
    system = tmp / "system-jupyter"
    monkeypatch.setattr(jupyter_core.paths, "SYSTEM_JUPYTER_PATH", [str(system)])
    monkeypatch.setattr(jupyter_client.kernelspec, "SYSTEM_JUPYTER_PATH", [str(system)])
    return system
