"""The kernel contract: what the autogpu kernel provisioner hands a kernel, and what it exposes
to the Jupyter server, in one typed place.

A kernel started by the "Python 3 (autogpu)" kernelspec finds its pick in environment variables
(:class:`KernelContract` reads them); the server reads the provisioner's state through the
:class:`ProvisionerState` protocol, never by importing the provisioner. Every ``AUTOGPU_*`` name
of that contract is defined here and nowhere else.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from autogpu_jupyter.core.policy import Constraints

__all__ = [
    "GRANT_ENV",
    "GRANT_ROCM_ENV",
    "ROCM_GRANT_VARS",
    "LEASE_ENV",
    "LEASE_FD_ENV",
    "MOVE_FILE_ENV",
    "NOTE_ENV",
    "ON_NO_DEVICE",
    "OPTIONS_ENV",
    "PICKED_ENV",
    "PROVISIONED_ENV",
    "PROVISIONER_NAME",
    "SERVER_ROOT_ENV",
    "SERVER_CULL_ENV",
    "SERVER_CULL_WARNING_ENV",
    "SESSION_NAME_ENV",
    "KernelContract",
    "notebook_path",
    "ProvisionerState",
]

#: The entry-point name kernelspecs use in ``metadata.kernel_provisioner.provisioner_name``.
PROVISIONER_NAME = "autogpu-provisioner"
#: What a kernelspec may ask for when nothing fits: start CPU-only, or refuse to start.
ON_NO_DEVICE = ("cpu", "fail")

#: The UUIDs the provisioner picked for the kernel (comma separated; "" = CPU-only).
PICKED_ENV = "AUTOGPU_PICKED"
#: The id of the kernel's lease.
LEASE_ENV = "AUTOGPU_LEASE_ID"
#: The number of the inherited lease descriptor (the kernel may close it).
LEASE_FD_ENV = "AUTOGPU_LEASE_FD"
#: ``"1"`` in a kernel started by the autogpu provisioner.
PROVISIONED_ENV = "AUTOGPU_PROVISIONED"
#: The provisioner's pick options, as JSON (the kernelspec's options).
OPTIONS_ENV = "AUTOGPU_PICK_OPTIONS"
#: The ``CUDA_VISIBLE_DEVICES`` the server had (the grant picked within); absent when unset.
GRANT_ENV = "AUTOGPU_GRANT_CVD"
#: The ROCm visibility variables the server had (the grant on an AMD host), as a JSON object
#: of those that were set (``{}``: none). Absent: a provisioner that did not record them.
GRANT_ROCM_ENV = "AUTOGPU_GRANT_ROCM"
#: The variables :data:`GRANT_ROCM_ENV` records: what bounds HIP's and ROCr's devices.
ROCM_GRANT_VARS = ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")
#: Where ``%gpu move`` writes its request for the next restart.
MOVE_FILE_ENV = "AUTOGPU_MOVE_FILE"
#: A message for the notebook user about the pick ("started CPU-only because ...").
NOTE_ENV = "AUTOGPU_PICK_NOTE"
#: The Jupyter server's root directory, set by the server extension for the kernels (and
#: terminals) it starts: notebook paths are written relative to it, as JupyterLab shows them.
SERVER_ROOT_ENV = "AUTOGPU_SERVER_ROOT"
#: Set by the server extension for the kernels it starts when it culls idle GPU kernels
#: (``c.AutoGPUServer.cull_idle_gpu_kernels_s``): the idle limit in seconds, and how long before
#: it the sidebar and the status bar warn (``cull_warning_s``; 0: no warning).
SERVER_CULL_ENV = "AUTOGPU_SERVER_CULL_IDLE_S"
SERVER_CULL_WARNING_ENV = "AUTOGPU_SERVER_CULL_WARNING_S"
#: jupyter_server's own variable: the notebook a kernel was started for (an absolute path).
SESSION_NAME_ENV = "JPY_SESSION_NAME"


def notebook_path(environ: Mapping[str, str] | None = None) -> str | None:
    """The notebook of the kernel whose environment is ``environ``, written one way everywhere
    (leases, ``%gpu``, the panel, ``autogpu list``, the sidebar): relative to the Jupyter
    server's root when the kernel lies under it (``notebooks/train.ipynb``, as JupyterLab's file
    browser and the sidebar show it), else as jupyter_server gave it. ``None`` outside a
    notebook's kernel."""
    env = os.environ if environ is None else environ
    path = (env.get(SESSION_NAME_ENV) or "").strip()
    if not path:
        return None
    root = (env.get(SERVER_ROOT_ENV) or "").strip()
    if root and os.path.isabs(path):
        rel = os.path.relpath(os.path.normpath(path), os.path.normpath(root))
        if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
            return rel
    return path


@dataclass(frozen=True, slots=True)
class KernelContract:
    """What a provisioned kernel was told, read from its environment."""

    provisioned: bool
    picked: tuple[str, ...]
    lease_id: str | None
    note: str | None
    options: Mapping[str, Any]
    grant_cvd: str | None
    move_file: str | None
    #: The inherited lease descriptor's number (``None``: none, or not a number).
    lease_fd: int | None = None
    #: The server's ROCm visibility variables (``None``: not recorded, or not a JSON object of
    #: strings: the kernel's own then bound a move, which fails closed).
    grant_rocm: Mapping[str, str] | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> KernelContract:
        env = os.environ if environ is None else environ
        try:
            options = json.loads(env.get(OPTIONS_ENV) or "{}")
        except json.JSONDecodeError:
            options = {}
        return cls(
            provisioned=env.get(PROVISIONED_ENV) == "1",
            picked=tuple(u.strip() for u in env.get(PICKED_ENV, "").split(",") if u.strip()),
            lease_id=env.get(LEASE_ENV) or None,
            note=(env.get(NOTE_ENV) or "").strip() or None,
            options=options if isinstance(options, dict) else {},
            grant_cvd=env.get(GRANT_ENV),
            move_file=(env.get(MOVE_FILE_ENV) or "").strip() or None,
            lease_fd=_fd(env.get(LEASE_FD_ENV, "")),
            grant_rocm=_rocm_grant(env.get(GRANT_ROCM_ENV)),
        )


def _rocm_grant(raw: str | None) -> Mapping[str, str] | None:
    """:data:`GRANT_ROCM_ENV` as the provisioner wrote it; ``None`` if absent or malformed."""
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or not all(
        k in ROCM_GRANT_VARS and isinstance(v, str) for k, v in doc.items()
    ):
        return None
    return dict(doc)


def _fd(value: str) -> int | None:
    """A descriptor number as the provisioner wrote it (ASCII digits only), else ``None``."""
    value = value.strip()
    return int(value) if value.isascii() and value.isdecimal() else None


@runtime_checkable
class ProvisionerState(Protocol):
    """What the autogpu provisioner exposes to the server (typed, instead of ``getattr``)."""

    autogpu_picked: tuple[str, ...]
    autogpu_constraints: Constraints | None
    autogpu_note: str | None
    autogpu_lease_id: str | None
    autogpu_move_file: str | None
