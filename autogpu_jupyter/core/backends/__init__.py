"""Where device snapshots come from: NVML or amdsmi on a real host, a simulated fleet elsewhere.

:func:`get_backend` chooses: ``AUTOGPU_SIMULATE`` set (to a fleet file or a built-in fleet name
such as ``demo-4x`` or ``demo-amd``) selects the simulated backend. Otherwise
``AUTOGPU_BACKEND`` names the vendor library (``nvml`` or ``amdsmi``); unset or ``auto``, NVML
is used when ``libnvidia-ml.so.1`` can be loaded, else amdsmi when ``libamd_smi.so`` can, else
NVML (whose error then says that no driver is installed). One vendor per host: a host with both
libraries uses NVIDIA's unless ``AUTOGPU_BACKEND=amdsmi`` says otherwise.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from autogpu_jupyter.errors import UsageErrorBase

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import FleetSnapshot

__all__ = ["Backend", "get_backend", "choose_backend", "SIMULATE_ENV", "BACKEND_ENV", "BACKENDS"]

SIMULATE_ENV = "AUTOGPU_SIMULATE"
BACKEND_ENV = "AUTOGPU_BACKEND"
#: The vendor libraries autogpu can read, by the name ``AUTOGPU_BACKEND`` takes.
BACKENDS = ("nvml", "amdsmi")


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
# What automatic detection found, once per process: a library dlopen finds stays found, and one
# it cannot find is not looked for again at every pick (LD_LIBRARY_PATH is read at start only).
_detected: list[str] = []


def _nvml_present() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


def _detect() -> str:
    if not _detected:
        from autogpu_jupyter.core.backends.amdsmi import library_present

        found = "nvml" if _nvml_present() else ("amdsmi" if library_present() else "nvml")
        _detected.append(found)
    return _detected[0]


def choose_backend(value: str | None = None) -> str:
    """The vendor backend this process uses: ``"nvml"`` or ``"amdsmi"``.

    Parameters
    ----------
    value
        ``nvml``, ``amdsmi``, ``auto`` or empty (detect); defaults to ``$AUTOGPU_BACKEND``.

    Raises
    ------
    UsageErrorBase
        ``value`` names no backend (the message lists the accepted names).
    """
    if value is None:
        value = os.environ.get(BACKEND_ENV, "")
    choice = value.strip().lower()
    if choice in BACKENDS:
        return choice
    if choice not in ("", "auto"):
        raise UsageErrorBase(
            f"{BACKEND_ENV}={value!r}: not a GPU backend; expected one of "
            f"{', '.join(BACKENDS)} or auto (NVML where NVIDIA's library is installed, else amdsmi)"
        )
    return _detect()


def get_backend(simulate: str | None = None) -> Backend:
    """The backend this process uses (one instance per configuration, shared).

    Parameters
    ----------
    simulate
        A fleet file path or built-in fleet name; defaults to ``$AUTOGPU_SIMULATE``.
        Empty means a vendor library (see :func:`choose_backend`).
    """
    if simulate is None:
        simulate = os.environ.get(SIMULATE_ENV)
    with _lock:
        if simulate:
            backend = _cache.get(simulate)
            if backend is None:
                from autogpu_jupyter.core.backends.simulated import SimulatedBackend

                backend = SimulatedBackend(simulate)
                _cache[simulate] = backend
            return backend
        vendor = choose_backend()
        # "" and "amdsmi:" are no fleet name: a file name cannot take their place.
        key = "" if vendor == "nvml" else "amdsmi:"
        backend = _cache.get(key)
        if backend is None:
            if vendor == "amdsmi":
                from autogpu_jupyter.core.backends.amdsmi import AmdSmiBackend

                backend = AmdSmiBackend()
            else:
                from autogpu_jupyter.core.backends.nvml import NvmlBackend

                backend = NvmlBackend()
            _cache[key] = backend
        return backend
