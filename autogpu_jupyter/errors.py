"""The one error family of autogpu.

Every error a user can cause or meet derives from :class:`AutoGPUError`. Each surface translates
it at its boundary: the magics into ``UsageError`` (one line, no traceback), the server into an
HTTP error with a JSON ``message``, the CLI into a message and an exit code (``exit_code``).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AutoGPUError",
    "UsageErrorBase",
    "NVMLUnavailableError",
    "NoDeviceGrantedError",
    "NoDeviceFitsError",
    "TooLateError",
    "LeaseStoreError",
    "LeaseLimitError",
    "LeaseStoreUntrustedError",
    "LeaseStoreUnreachableError",
    "DeviceBoundError",
]


class AutoGPUError(Exception):
    """Base of every autogpu error. ``exit_code`` is what the CLI exits with."""

    exit_code: int = 1


class UsageErrorBase(AutoGPUError, ValueError):
    """Bad input from the user: a size, a percentage, a device id, an option value."""

    exit_code = 2


class NVMLUnavailableError(AutoGPUError):
    """NVML cannot be used on this host (no library, driver not loaded, no permission)."""

    exit_code = 4


class NoDeviceGrantedError(AutoGPUError):
    """The allocation this process inherited (CUDA_VISIBLE_DEVICES, ...) grants no GPU."""

    exit_code = 3


class NoDeviceFitsError(AutoGPUError):
    """No device satisfies the constraints. ``candidates`` holds the ranking with reasons;
    ``waitable`` is false when no wait could help (the request's own restrictions rule out
    every device: named devices, --exclude, --model, the allocation)."""

    exit_code = 3

    def __init__(self, message: str, candidates: object = (), waitable: bool = True) -> None:
        super().__init__(message)
        self.candidates = candidates
        self.waitable = waitable


class TooLateError(AutoGPUError):
    """CUDA is already initialised in this process: CUDA_VISIBLE_DEVICES would do nothing."""

    exit_code = 5


class LeaseStoreError(AutoGPUError):
    """The lease registry cannot be used safely (permissions, ownership, no flock)."""


class LeaseLimitError(AutoGPUError):
    """The user already holds as many devices as the admin allows (``max_devices_per_user``)."""

    exit_code = 3


class LeaseStoreUntrustedError(LeaseStoreError):
    """A pick that promised exclusivity, a wait in line or a quota, while the lease registry
    cannot be used or trusted: it fails closed instead of going on without a lease."""

    exit_code = 3


class LeaseStoreUnreachableError(LeaseStoreUntrustedError):
    """The lease broker could not be reached, was lost mid-request or did not answer in time
    (it may be restarting): nothing was picked. A pick already waiting in line keeps its place
    and tries again until its wait ends; any other pick fails closed at once."""


class DeviceBoundError(AutoGPUError):
    """This process can use only the device(s) it was started on (a kernel the autogpu
    kernelspec started: its CUDA view was set before it started), and they do not meet the
    request. Waiting does not help; moving (a restart elsewhere) does."""

    exit_code = 3


def __getattr__(name: str) -> Any:
    # The names before the lease-store renames, deprecated for one release.
    from autogpu_jupyter._renamed import old_name  # noqa: PLC0415

    return old_name(__name__, name)
