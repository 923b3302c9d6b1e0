"""This process's choice: which device(s) it picked, its lease, and the environment it changed.

Shared by the Python API, the magics and the panel. A kernel started by the autogpu kernel
provisioner finds the provisioner's choice in ``AUTOGPU_PICKED`` (UUIDs) and ``AUTOGPU_LEASE_ID``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autogpu_jupyter.core.contract import LEASE_ENV, NOTE_ENV, PICKED_ENV
from autogpu_jupyter.core.cudastate import (
    cuda_state,
    hip_state,
    hip_too_late_message,
    too_late_message,
)
from autogpu_jupyter.errors import TooLateError

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot
    from autogpu_jupyter.core.picker import PickResult
    from autogpu_jupyter.core.policy import Constraints
    from autogpu_jupyter.core.registry import Lease

__all__ = [
    "Choice",
    "current",
    "apply",
    "release",
    "original_environ",
    "MANAGED_VARS",
    "PICKED_ENV",
    "LEASE_ENV",
]

# CUDA's, then ROCm's (an AMD pick writes ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES,
# CUDA_VISIBLE_DEVICES and GPU_DEVICE_ORDINAL; core.visibility.ROCM_VARS).
MANAGED_VARS = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
)


@dataclass
class Choice:
    """The device(s) this process uses, as far as autogpu knows."""

    uuids: tuple[str, ...]
    devices: tuple[DeviceSnapshot, ...] = ()
    lease: Lease | None = None
    lease_id: str | None = None
    source: str = "magic"  # "magic", "api", "provisioner"
    constraints_text: str = ""
    constraints: Constraints | None = None
    picked_at_s: float = field(default_factory=time.time)
    forced: bool = False
    note: str | None = None


_lock = threading.RLock()
_current: Choice | None = None
# The values of MANAGED_VARS before our first change: the allocation we narrow within.
_original: dict[str, str | None] | None = None


def _restore(env: MutableMapping[str, str], saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v


def original_environ(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment as it was before autogpu changed it in this process."""
    env = dict(os.environ if environ is None else environ)
    with _lock:
        if _original is not None:
            _restore(env, _original)
    return env


def current() -> Choice | None:
    """This process's choice, or the provisioner's (from the environment), or ``None``."""
    with _lock:
        if _current is not None:
            return _current
    picked = os.environ.get(PICKED_ENV, "").strip()
    if picked:
        return Choice(
            uuids=tuple(u for u in picked.split(",") if u),
            lease_id=os.environ.get(LEASE_ENV) or None,
            source="provisioner",
            note=os.environ.get(NOTE_ENV) or None,
        )
    return None


def check_not_too_late(force: bool) -> str | None:
    """Raise :class:`TooLateError` if CUDA (or, on AMD, HIP) is initialised here; with
    ``force``, return the warning instead (``None`` when it is not too late)."""
    state = cuda_state()
    if state.initialized:
        message = too_late_message(state)
    else:
        rocm = hip_state()
        if not rocm.initialized:
            return None
        message = hip_too_late_message(rocm)
    if not force:
        raise TooLateError(message)
    return "--force: " + message


def apply(
    result: PickResult,
    *,
    source: str = "magic",
    forced: bool = False,
    environ: MutableMapping[str, str] | None = None,
) -> Choice:
    """Make ``result`` this process's choice: set the variables, keep its lease, drop the old
    lease."""
    global _current, _original
    env = os.environ if environ is None else environ
    with _lock:
        if _original is None:
            _original = {k: env.get(k) for k in MANAGED_VARS}
        old = _current
        env.update(result.env)
        _current = Choice(
            uuids=tuple(d.uuid for d in result.chosen),
            devices=result.chosen,
            lease=result.lease,
            lease_id=None if result.lease is None else result.lease.record.lease_id,
            source=source,
            constraints_text=result.constraints.describe(),
            constraints=result.constraints,
            forced=forced,
            note=result.lease_note,
        )
        if old is not None and old.lease is not None and old.lease is not result.lease:
            old.lease.release()
        return _current


def release(environ: MutableMapping[str, str] | None = None) -> Choice | None:
    """Drop this process's choice and lease; restore the variables as they were before the pick."""
    global _current, _original
    env = os.environ if environ is None else environ
    with _lock:
        old = _current
        _current = None
        if old is not None and old.lease is not None:
            old.lease.release()
        if _original is not None:
            _restore(env, _original)
            _original = None
        return old
