"""ROCm's grant variables, read by the ROCm runtime's own rules (``ROCR_VISIBLE_DEVICES``,
then ``HIP_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``, then ``GPU_DEVICE_ORDINAL``), and the
variables a pick writes for an AMD GPU.

The rules are stated in :mod:`autogpu_jupyter.core.visibility`'s docstring and in
docs/internals.md; :func:`~autogpu_jupyter.core.visibility.current_allocation` and
:func:`~autogpu_jupyter.core.visibility.visible_env` call these for a host whose GPUs are AMD's.
"""


from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from autogpu_jupyter.core.allocation import (
    CVD,
    GDO,
    HIP,
    ROCR,
    SLURM_VARS,
    Allocation,
    _host_indices,
    _label,
    _slurm_grant,
    _within_every_grant,
)
from autogpu_jupyter.core.devices import DeviceSnapshot

__all__ = [
    "parse_rocr_visible_devices",
    "parse_hip_visible_devices",
    "rocm_allocation",
    "rocm_env",
]

#
# The rules below are those of the runtimes' sources (docs/internals.md, "ROCm visibility"):
#
# ROCR_VISIBLE_DEVICES, read once by the ROCr runtime when it loads (hsa_init; HIP calls it at its
# own initialisation). Unset: every GPU the process can open (libhsakmt skips GPUs whose render
# node a device cgroup denies). "": none. Otherwise tokens split at ",", trimmed, upper-cased;
# only the first <number of GPUs> tokens count. A token starting with "G" is a UUID (5 to 20
# characters, "GPU-" + 16 hex digits of KFD's unique id, or a prefix of one) that must match
# exactly one GPU; any other token is read by strtol(base 0) and must be all digits of it (an
# empty token reads as 0, "0x1" as 1, "010" as 8). The first token that is invalid, out of range,
# ambiguous, unknown or repeats a GPU ends the list.
#
# HIP_VISIBLE_DEVICES, else CUDA_VISIBLE_DEVICES (HIP's, when HIP_VISIBLE_DEVICES is empty or
# unset), read by HIP once at its initialisation, index the GPUs ROCr left, in ROCr's order. A
# token containing "GPU-" names the first such GPU whose UUID contains it (lower-case hex, case
# sensitive); any other token must be a canonical decimal ("1", not "01", " 1" or "+1") in range.
# The first invalid token ends the list; a repeated GPU is skipped. GPU_DEVICE_ORDINAL is the
# same list for OpenCL (HIP ignores it); autogpu takes it as a bound too, as Slurm writes it.
#
# PyTorch's ROCm build selects devices through HIP (so the rules above), and its own count
# (torch.cuda._parse_visible_devices) prefers HIP_VISIBLE_DEVICES, raises when it lists more GPUs
# than ROCR_VISIBLE_DEVICES, and with ROCR alone counts ROCR's entries: autogpu writes the four
# variables consistently so that every reader agrees.

_STRTOL0 = re.compile(r"[+-]?(?:0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")


def _rocr_uuid_of(device: DeviceSnapshot) -> str | None:
    """ROCr's ``GPU-<16 HEX>`` of ``device`` as its filter compares it (upper case)."""
    u = device.runtime_uuid
    return u.upper() if u and u.upper().startswith("GPU-") else None


def _strtol0(token: str) -> int | None:
    """strtol(token, &end, 0) when it consumes the whole token (an empty token reads as 0)."""
    if token == "":
        return 0
    if _STRTOL0.fullmatch(token) is None:
        return None
    return int(token, 0) if not re.fullmatch(r"[+-]?0[0-7]+", token) else int(token, 8)


def parse_rocr_visible_devices(
    value: str, devices: Sequence[DeviceSnapshot], var: str = ROCR
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Read ``ROCR_VISIBLE_DEVICES`` the way ROCr does, over ``devices`` in ROCr's order.

    Returns ``(uuids, notes)``: the devices ROCr would show, in order, and why entries ended
    the list. Never raises.
    """
    if value == "":
        return (), (f"{var} is set but empty: ROCr shows no GPU",)
    ordered = list(devices)
    tokens = [t.strip().upper() for t in value.split(",")]
    if value.endswith(","):
        tokens.pop()  # std::getline yields no token after a final separator
    out: list[str] = []
    notes: list[str] = []
    for token in tokens[: len(ordered)]:
        if token.startswith("G"):
            matches = (
                [i for i, d in enumerate(ordered)
                 if (_rocr_uuid_of(d) or "\0").startswith(token)]
                if 5 <= len(token) <= 20 else []
            )
            if len(matches) != 1:
                why = ("ambiguous: it matches several GPUs" if matches else
                       "no GPU has that ROCr UUID (GPU-<16 hex digits>) or prefix")
                notes.append(_stopped_rocm(var, token, why, "ROCr"))
                break
            index = matches[0]
        else:
            number = _strtol0(token)
            if number is None or not 0 <= number < len(ordered):
                why = ("not an index" if number is None else
                       f"no GPU with index {number}; {_host_indices(ordered)}")
                notes.append(_stopped_rocm(var, token, why, "ROCr"))
                break
            index = number
            if token == "":
                notes.append(f"{var}: an empty entry reads as GPU index 0, as ROCr reads it")
        uuid = ordered[index].uuid
        if uuid in out:
            notes.append(_stopped_rocm(var, token, "that GPU is already listed", "ROCr"))
            break
        out.append(uuid)
    return tuple(out), tuple(notes)


def parse_hip_visible_devices(
    value: str, devices: Sequence[DeviceSnapshot], var: str = HIP
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Read a HIP list (``HIP_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` /
    ``GPU_DEVICE_ORDINAL``) the way HIP does, over ``devices``: the GPUs ROCr left, in order."""
    ordered = list(devices)
    out: list[str] = []
    notes: list[str] = []
    for token in value.split(",") if value else []:
        index: int | None = None
        if "GPU-" in token:
            # HIP compares with the runtime's own spelling, case sensitive (lower-case hex)
            index = next((i for i, d in enumerate(ordered) if token in (d.runtime_uuid or "")),
                         None)
        elif token.isascii() and token.isdecimal() and str(int(token)) == token:
            index = int(token)
        if index is None or not 0 <= index < len(ordered):
            why = ("not a GPU index or UUID" if index is None else
                   f"no GPU with index {index}; {_host_indices(ordered, 'ROCr shows')}")
            notes.append(_stopped_rocm(var, token, why, "HIP"))
            break
        uuid = ordered[index].uuid
        if uuid not in out:  # HIP skips a repeated GPU
            out.append(uuid)
    return tuple(out), tuple(notes)


def _stopped_rocm(var: str, token: str, why: str, runtime: str) -> str:
    return f"{var}: stopped at {token!r} ({why}); later entries are ignored, as {runtime} does"


def _relative(devices: Sequence[DeviceSnapshot], uuids: Sequence[str]) -> list[DeviceSnapshot]:
    """``uuids``' devices in that order, renumbered from 0 (how a runtime shows a subset)."""
    by = {d.uuid: d for d in devices}
    return [replace(by[u], index=i) for i, u in enumerate(uuids)]


def _rocm_read(
    var: str,
    value: str,
    base: list[DeviceSnapshot],
    slurm: tuple[str, ...] | None,
    parse: Callable[..., tuple[tuple[str, ...], tuple[str, ...]]],
) -> tuple[tuple[str, ...], list[str]]:
    """``value`` read over ``base``; where Slurm granted fewer GPUs than ``base`` holds and the
    plain reading leaves the grant, read relative to the grant (Slurm's numbering under a device
    cgroup that amdsmi does not honour), as for CUDA_VISIBLE_DEVICES."""
    uuids, notes = parse(value, base, var)
    if slurm and len(slurm) < len(base) and not all(u in slurm for u in uuids):
        inside = [d for d in base if d.uuid in slurm]
        rel, rel_notes = parse(value, _relative(inside, [d.uuid for d in inside]), var)
        return rel, [*rel_notes, f"{var}={value!r} read relative to the Slurm job's GPUs, as "
                     "Slurm writes it under a device cgroup"]
    return uuids, list(notes)


def rocm_allocation(
    devices: Sequence[DeviceSnapshot], environ: Mapping[str, str] | None = None
) -> Allocation:
    """The allocation of a process on an AMD host, read by the ROCm runtimes' rules.

    ``ROCR_VISIBLE_DEVICES`` selects from every GPU (in ROCr's order, ``index``); the HIP list
    (``HIP_VISIBLE_DEVICES``, else ``CUDA_VISIBLE_DEVICES``) and ``GPU_DEVICE_ORDINAL`` index
    what ROCr left; Slurm's ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS`` bound the result as on
    NVIDIA. Where Slurm wrote the same list to ``ROCR_VISIBLE_DEVICES`` and to a HIP variable
    (its default without ``Flags=amd_gpu_env``; HIP would then read it relative to ROCr's
    list), the HIP variable is read as naming ROCr's GPUs: the grant Slurm meant, never wider.
    Never raises for a bad value.
    """
    env = os.environ if environ is None else environ
    ordered = sorted(devices, key=lambda d: d.index)
    notes: list[str] = []
    parts: list[tuple[str, str]] = []
    grants: list[tuple[str, tuple[str, ...]]] = []

    slurm_var = next((v for v in SLURM_VARS if env.get(v) is not None), None)
    slurm: tuple[str, ...] | None = None
    if slurm_var is not None:
        slurm, n = _slurm_grant(slurm_var, env[slurm_var], ordered)
        notes += n
        parts.append((slurm_var, env[slurm_var]))
        grants.append((slurm_var, slurm))

    rocr_value = env.get(ROCR)
    rocr_list = tuple(d.uuid for d in ordered)
    if rocr_value is not None:
        rocr_list, n = _rocm_read(ROCR, rocr_value, ordered, slurm, parse_rocr_visible_devices)
        notes += n
        parts.append((ROCR, rocr_value))
        grants.append((ROCR, rocr_list))
    after_rocr = _relative(ordered, rocr_list)

    hip_var = HIP if env.get(HIP) else (CVD if env.get(CVD) else None)
    for var in (v for v in (hip_var, GDO) if v is not None and env.get(v)):
        value = env[var]
        parts.append((var, value))
        if slurm_var is not None and rocr_value is not None and value == rocr_value:
            notes.append(f"{var}={value!r} repeats {ROCR}: read as the same GPUs (Slurm writes "
                         f"both unless gres.conf says Flags=amd_gpu_env)")
            grants.append((var, rocr_list))
            continue
        base = after_rocr if rocr_value is not None else ordered
        got, n = _rocm_read(var, value, base, None if rocr_value is not None else slurm,
                            parse_hip_visible_devices)
        notes += n
        grants.append((var, got))
    for var in (HIP, CVD, GDO):
        if env.get(var) == "":
            notes.append(f"{var} is set but empty: HIP reads that as unset")

    if not grants:
        return Allocation(source=None, raw=None, uuids=None, notes=tuple(notes))
    kept = _within_every_grant(grants, ordered, notes)
    return Allocation(
        source=" + ".join(name for name, _ in parts),
        raw=" + ".join(value for _, value in parts),
        uuids=tuple(kept),
        notes=tuple(notes),
        labels=tuple(_label(ordered, u) for u in kept),
        parts=tuple(parts),
    )


def rocm_env(chosen: Sequence[DeviceSnapshot], devices: Sequence[DeviceSnapshot]) -> dict[str, str]:
    """The environment that makes ROCm, HIP, PyTorch's ROCm build and OpenCL see exactly
    ``chosen``, in that order, as devices ``0..n-1``.

    ``ROCR_VISIBLE_DEVICES`` names them by ROCr UUID where each UUID names one GPU of the host
    (a UUID does not depend on enumeration order or device cgroups), else by ROCr index (the
    partitions of one GPU may share a UUID); the HIP variables then count from 0.
    """
    counts: dict[str, int] = {}
    for d in devices:
        u = _rocr_uuid_of(d)
        if u is not None:
            counts[u] = counts.get(u, 0) + 1
    unique = all((u := _rocr_uuid_of(d)) is not None and counts[u] == 1 for d in chosen)
    # "GPU-" and lower-case hex: ROCr upper-cases what it reads, HIP compares with this spelling
    ids = ["GPU-" + (d.runtime_uuid or "")[4:].lower() if unique else str(d.index)
           for d in chosen]
    ordinals = ",".join(str(i) for i in range(len(chosen)))
    return {ROCR: ",".join(ids), HIP: ordinals, CVD: ordinals, GDO: ordinals}
