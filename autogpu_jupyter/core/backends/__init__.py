"""Where device snapshots come from: NVML on a real host, a simulated fleet elsewhere.

:func:`get_backend` chooses: ``AUTOGPU_SIMULATE`` set (to a fleet file or a built-in fleet name
such as ``demo-4x``) selects the simulated backend; otherwise NVML.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import FleetSnapshot

__all__ = ["Backend", "get_backend", "SIMULATE_ENV"]

SIMULATE_ENV = "AUTOGPU_SIMULATE"


@runtime_checkable
class Backend(Protocol):
    """A source of snapshots. Implementations are thread-safe."""

    name: str
    simulated: bool

    def snapshot(self) -> FleetSnapshot:
        """Read every device now. Raises ``NVMLUnavailableError`` when there is no driver."""
        ...


_lock = threading.Lock()
_cache: dict[str, Backend] = {}


def get_backend(simulate: str | None = None) -> Backend:
    """The backend this process uses (one instance per configuration, shared).

    Parameters
    ----------
    simulate
        A fleet file path or built-in fleet name; defaults to ``$AUTOGPU_SIMULATE``.
        Empty means NVML.
    """
    if simulate is None:
        simulate = os.environ.get(SIMULATE_ENV)
    key = simulate or ""  # "" is NVML: no fleet name can take its place
    with _lock:
        backend = _cache.get(key)
        if backend is None:
            if simulate:
                # The backend in use only (a vendor's module may load its library).
                from autogpu_jupyter.core.backends.simulated import (  # noqa: PLC0415
                    SimulatedBackend,
                )

                backend = SimulatedBackend(simulate)
            else:
                from autogpu_jupyter.core.backends.nvml import NvmlBackend  # noqa: PLC0415

                backend = NvmlBackend()
            _cache[key] = backend
        return backend
