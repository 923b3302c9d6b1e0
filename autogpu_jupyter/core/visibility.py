"""What this process may use: the GPU allocation it inherited, read by CUDA's own rules.

A scheduler or a parent process may already have granted this process a set of GPUs. That grant is
an upper bound (design decision 3): autogpu only narrows within it, never widens it. Four
environment variables carry a grant:

``CUDA_VISIBLE_DEVICES`` (read by CUDA once, at ``cuInit``)
    Unset means every device. ``""``, ``-1`` and Slurm's ``NoDevFiles`` mean none. The value is a
    comma list of indices, full UUIDs (``GPU-…``, ``MIG-…``) or unique UUID prefixes (``GPU-5a1``).
    Parsing follows CUDA (and PyTorch's model of it, ``torch.cuda._parse_visible_devices``):

    * it stops at the first invalid entry (``0,2,-1,1`` is GPUs 0 and 2), and an index past the
      last GPU, an unknown or ambiguous UUID prefix, or a switch between indices and UUIDs (or
      between ``GPU-`` and ``MIG-`` UUIDs) is invalid;
    * an index entry is read like ``strtoul``: leading digits only, so ``0-2`` is ``0`` (there are
      no ranges) and ``1gpu`` is ``1``; whitespace around entries is ignored;
    * a repeated device makes the whole list empty (CUDA then shows no GPU at all).

    Indices are read in PCI bus order, NVML's and nvidia-smi's, which is what CUDA uses when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (autogpu always sets it). CUDA's default order is fastest
    first: on a host that mixes models an index can then name a different GPU, and the allocation
    carries a note saying so. UUIDs have no such ambiguity. The legacy MIG form
    ``MIG-GPU-<uuid>/<gi>/<ci>`` is not resolved: it ends the list, with a note.

``NVIDIA_VISIBLE_DEVICES`` (read by the NVIDIA container runtime when the container is created)
    ``all`` is unrestricted; ``none``, ``void`` and ``""`` mean no device. Inside the container
    NVML already shows only the injected GPUs, numbered from 0. A UUID list narrows by UUID (a
    no-op inside the container, a real narrowing where the variable leaked onto a host). A list
    of host indices is taken as already applied when NVML shows exactly that many GPUs, and as
    NVML indices otherwise. A path (the device plugin's volume-mounts strategy) or the
    ``<gpu>:<mig>`` form is taken as already applied by the runtime.

``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` (set by Slurm; the step's list wins)
    Global GPU ids of the job, a comma list (ranges such as ``0-2`` are accepted too). With
    ``ConstrainDevices=yes`` the job's device cgroup hides the other GPUs, NVML shows only the
    job's GPUs numbered from 0, and Slurm writes ``CUDA_VISIBLE_DEVICES`` relative to them.
    Without it NVML shows every GPU and Slurm writes global ids. So:

    * NVML shows more GPUs than the job has and every Slurm id is an NVML index: the grant is
      those GPUs. ``CUDA_VISIBLE_DEVICES`` is then read as global ids when every GPU it names lies
      in the grant, and otherwise relative to the grant (its ``i``-th GPU in id order), which is
      how Slurm numbers GPUs under a device cgroup that NVML does not honour. Either way the
      result stays inside the grant.
    * NVML shows exactly as many GPUs as the job has: NVML already shows only the job's GPUs;
      the grant is all of them and ``CUDA_VISIBLE_DEVICES`` is read against them as usual.
    * Anything else (ids NVML does not list, an unreadable value): no GPU is granted, with a
      note, rather than guessing.

When several variables are set the result is their intersection, in the order of the most
specific one (``CUDA_VISIBLE_DEVICES``, then Slurm, then ``NVIDIA_VISIBLE_DEVICES``). An empty
result means "no GPU granted to this process"; :attr:`Allocation.notes` say why.

On an AMD host (devices whose ``vendor`` is ``"amd"``) the ROCm runtimes' variables carry the
grant instead; their rules are below (:func:`rocm_allocation`) and in docs/internals.md.

Everything here is pure given the device list: no NVML, amdsmi, CUDA or HIP call is made.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence

from autogpu_jupyter.core.allocation import (  # noqa: F401 (imported from here before the cut)
    _LEADING_UINT,
    _UUID_PREFIXES,
    CVD,
    GDO,
    HIP,
    NVD,
    ROCM_VARS,
    ROCR,
    SLURM_VARS,
    Allocation,
    _cvd_grant,
    _host_indices,
    _inside,
    _is_index_list,
    _label,
    _labels,
    _parse_cvd,
    _parse_index_entries,
    _parse_nvidia_visible_devices,
    _parse_slurm_ids,
    _parse_uuid_entries,
    _physical,
    _resolve_uuid,
    _slurm_grant,
    _stopped,
    _strtoul,
    _within_every_grant,
    parse_cuda_visible_devices,
)
from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.rocmgrant import (  # noqa: F401 (imported from here before the cut)
    _relative,
    _rocm_read,
    _rocr_uuid_of,
    _stopped_rocm,
    _strtol0,
    parse_hip_visible_devices,
    parse_rocr_visible_devices,
    rocm_allocation,
    rocm_env,
)
from autogpu_jupyter.errors import UsageErrorBase

__all__ = [
    "CVD",
    "NVD",
    "ROCR",
    "HIP",
    "GDO",
    "ROCM_VARS",
    "rocm_allocation",
    "rocm_env",
    "parse_rocr_visible_devices",
    "parse_hip_visible_devices",
    "SLURM_VARS",
    "Allocation",
    "parse_cuda_visible_devices",
    "current_allocation",
    "check_visible_ids",
    "VISIBLE_IDS",
    "visible_env",
]

log = logging.getLogger(__name__)


# ------------------------------------------------- the whole environment, read and written


def current_allocation(
    devices: Sequence[DeviceSnapshot], environ: Mapping[str, str] | None = None
) -> Allocation:
    """The allocation this process inherited, read from its environment.

    Parameters
    ----------
    devices
        Every device NVML shows (MIG devices included), e.g. ``get_backend().snapshot().devices``.
    environ
        Defaults to ``os.environ``.

    Returns
    -------
    Allocation
        ``uuids is None`` when nothing restricts this process; ``()`` when nothing is granted
        (with notes saying why). Never raises for a bad value.
    """
    env = os.environ if environ is None else environ
    devices = list(devices)
    if any(d.vendor == "amd" for d in devices):
        return rocm_allocation(devices, env)
    notes: list[str] = []
    parts: list[tuple[str, str]] = []
    grants: list[tuple[str, tuple[str, ...]]] = []  # (var, ordered uuids), least specific first

    nvd = env.get(NVD)
    if nvd is not None:
        g, n = _parse_nvidia_visible_devices(nvd, devices)
        notes += n
        if g is not None:
            parts.append((NVD, nvd))
            grants.append((NVD, g))

    slurm_var = next((v for v in SLURM_VARS if env.get(v) is not None), None)
    slurm: tuple[str, ...] | None = None
    if slurm_var is not None:
        svalue = env[slurm_var]
        slurm, n = _slurm_grant(slurm_var, svalue, devices)
        notes += n
        parts.append((slurm_var, svalue))
        grants.append((slurm_var, slurm))

    cvd = env.get(CVD)
    if cvd is not None:
        parts.append((CVD, cvd))
        uuids, cvd_notes = _cvd_grant(cvd, env, devices, slurm_var, slurm)
        notes += cvd_notes
        grants.append((CVD, uuids))

    if not grants:
        return Allocation(source=None, raw=None, uuids=None, notes=tuple(notes))
    kept = _within_every_grant(grants, devices, notes)
    return Allocation(
        source=" + ".join(name for name, _ in parts),
        raw=" + ".join(value for _, value in parts),
        uuids=tuple(kept),
        notes=tuple(notes),
        labels=tuple(_label(devices, u) for u in kept),
        parts=tuple(parts),
    )


#: How ``CUDA_VISIBLE_DEVICES`` may name the devices of a pick (``c.AutoGPU.visible_ids``).
VISIBLE_IDS = ("uuid", "index")


def check_visible_ids(value: object) -> str:
    """``c.AutoGPU.visible_ids`` / ``AUTOGPU_VISIBLE_IDS`` as ``"uuid"`` or ``"index"``.

    Raises
    ------
    UsageErrorBase
        Any other value, named with the accepted ones.
    """
    ids = value.strip().lower() if isinstance(value, str) else None
    if ids not in VISIBLE_IDS:
        raise UsageErrorBase(
            f"invalid visible_ids {value!r} (c.AutoGPU.visible_ids or AUTOGPU_VISIBLE_IDS): "
            "expected 'uuid' (the default) or 'index'"
        )
    return ids


def _index_env(uuids: Sequence[str], devices: Sequence[DeviceSnapshot]) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` as NVML indices under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.

    NVML numbers the GPUs it lists in PCI bus order, as CUDA does under PCI_BUS_ID, so index
    ``n`` is the same GPU to both where CUDA sees the GPUs NVML lists. The variable replaces
    any inherited one, so the index counts every GPU this process can open (inside a container
    or a scheduler's cgroup: only those, for NVML as for CUDA), not the positions of an
    inherited list. A GPU NVML lists but cannot read (below one chosen) may be one CUDA cannot
    open either: its count would differ, so that pick is refused (use ``uuid``). A MIG device
    has no index in CUDA_VISIBLE_DEVICES (CUDA selects one by UUID only): refused too.
    """
    by_uuid = {d.uuid: d for d in devices}
    chosen = [by_uuid.get(u) for u in uuids]
    missing = [u for u, d in zip(uuids, chosen, strict=True) if d is None]
    if missing:
        raise UsageErrorBase(f"visible_ids = 'index': no device {missing[0]!r} on this host")
    mig = next((d for d in chosen if d is not None and d.is_mig), None)
    if mig is not None:
        raise UsageErrorBase(
            f"visible_ids = 'index' cannot select {mig.label}: CUDA selects a MIG device by its "
            "UUID only; set c.AutoGPU.visible_ids = 'uuid' (the default) for MIG devices"
        )
    physical = _physical(devices)
    for d in chosen:
        assert d is not None
        unreadable = next((p for p in physical if p.index < d.index and not p.available), None)
        if unreadable is not None:
            raise UsageErrorBase(
                f"visible_ids = 'index' cannot name {d.label}: {unreadable.label} before it is "
                "unreadable, so CUDA may number the GPUs otherwise; set c.AutoGPU.visible_ids "
                "= 'uuid' (the default)"
            )
    return {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        CVD: ",".join(str(d.index) for d in chosen if d is not None),
    }


def visible_env(
    uuids: Sequence[str], devices: Sequence[DeviceSnapshot] = (), ids: str = "uuid"
) -> dict[str, str]:
    """The environment that makes CUDA (or, on AMD, ROCm) see exactly ``uuids``, in that order.

    Parameters
    ----------
    uuids
        Full device UUIDs (``GPU-…`` or ``MIG-…``), as :class:`DeviceSnapshot.uuid` holds them.
    devices
        Every device of the snapshot the UUIDs come from. Where they are AMD devices, the ROCm
        variables are written (:func:`rocm_env`).
    ids
        ``"uuid"``, or ``"index"``: NVIDIA GPUs named by NVML index (``c.AutoGPU.visible_ids``;
        see :func:`_index_env` for what an index means and when it is refused). AMD devices are
        written as always (ROCr UUIDs and HIP ordinals).

    Returns
    -------
    dict
        ``{"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "GPU-…,GPU-…"}``; on AMD
        ``ROCR_VISIBLE_DEVICES`` plus ``HIP_VISIBLE_DEVICES``, ``CUDA_VISIBLE_DEVICES`` and
        ``GPU_DEVICE_ORDINAL`` set to ``0,…,n-1``.

    Raises
    ------
    UsageErrorBase
        An entry is not a full UUID (an index would be ambiguous under FASTEST_FIRST); with
        ``ids="index"``: a MIG device, or an unreadable GPU before a chosen one; a bad ``ids``.
    """
    ids = check_visible_ids(ids)
    by_uuid = {d.uuid: d for d in devices}
    if uuids and all(isinstance(u, str) and u in by_uuid and by_uuid[u].vendor == "amd"
                     for u in uuids):
        return rocm_env([by_uuid[u] for u in uuids], devices)
    if ids == "index" and uuids:
        return _index_env(uuids, devices)
    bad = [
        u
        for u in uuids
        if not (
            isinstance(u, str)
            and u.startswith(_UUID_PREFIXES)
            and "," not in u
            and u == u.strip()
            and len(u) > 4
        )
    ]
    if bad:
        raise UsageErrorBase(
            f"not a full device UUID: {', '.join(map(repr, bad))}; expected UUIDs such as "
            "'GPU-5a1c...' or 'MIG-...' as nvidia-smi -L prints them"
        )
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", CVD: ",".join(uuids)}


