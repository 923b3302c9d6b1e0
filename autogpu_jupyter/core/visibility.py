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
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.errors import UsageErrorBase

__all__ = [
    "CVD",
    "NVD",
    "ROCR",
    "HIP",
    "GDO",
    "ROCM_VARS",
    "rocm_allocation",
    "SLURM_VARS",
    "Allocation",
    "parse_cuda_visible_devices",
    "current_allocation",
    "check_visible_ids",
    "VISIBLE_IDS",
    "visible_env",
]

log = logging.getLogger(__name__)

CVD = "CUDA_VISIBLE_DEVICES"
NVD = "NVIDIA_VISIBLE_DEVICES"
#: Slurm's variables, most specific first: inside a step the step's list is the one that counts.
SLURM_VARS = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS")
ROCR = "ROCR_VISIBLE_DEVICES"
HIP = "HIP_VISIBLE_DEVICES"
GDO = "GPU_DEVICE_ORDINAL"
#: What a pick on an AMD host writes (and a release restores).
ROCM_VARS = (ROCR, HIP, CVD, GDO)

_UUID_PREFIXES = ("GPU-", "MIG-")
_LEADING_UINT = re.compile(r"\+?([0-9]+)")


@dataclass(frozen=True, slots=True)
class Allocation:
    """The GPUs this process was granted before autogpu did anything.

    Attributes
    ----------
    source
        The variable(s) the grant comes from (``"CUDA_VISIBLE_DEVICES"``, ``"SLURM_JOB_GPUS +
        CUDA_VISIBLE_DEVICES"``, ...); ``None`` when unrestricted.
    raw
        The raw value(s) parsed, joined with ``" + "`` like ``source``; ``None`` when unrestricted.
    uuids
        Granted device UUIDs in CUDA's order; ``None`` means every device, ``()`` none.
    notes
        Why entries were dropped or how a value was read, in words for people.
    labels
        People's names of ``uuids`` (``GPU 2``, ``GPU 0 MIG 1``), same order, for messages.
    parts
        Each variable that took part and its raw value, in the order they were applied.
    """

    source: str | None
    raw: str | None
    uuids: tuple[str, ...] | None
    notes: tuple[str, ...] = ()
    labels: tuple[str, ...] = ()
    parts: tuple[tuple[str, str], ...] = ()

    @property
    def empty(self) -> bool:
        """True when the grant is "no GPU at all" (``uuids == ()``)."""
        return self.uuids == ()

    @property
    def unrestricted(self) -> bool:
        """True when every device is granted (``uuids is None``)."""
        return self.uuids is None

    def allows(self, device: DeviceSnapshot) -> bool:
        """Whether ``device`` lies inside the grant.

        A MIG device is allowed when it or its parent GPU is granted; a parent GPU is not allowed
        merely because one of its MIG devices is (two MIG UUIDs never grant the whole card).
        """
        if self.uuids is None:
            return True
        if device.uuid in self.uuids:
            return True
        return device.is_mig and device.parent_uuid is not None and device.parent_uuid in self.uuids

    def describe(self) -> str:
        """One line for people: ``CUDA_VISIBLE_DEVICES='0,2' grants GPU 0, GPU 2``."""
        if self.uuids is None:
            return (
                "no GPU restriction (CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES and "
                "SLURM_*_GPUS set no limit): every GPU is granted"
            )
        parts = self.parts or ((self.source or "?", self.raw or ""),)
        what = " and ".join(f"{name}={value!r}" for name, value in parts)
        verb = "grant" if len(parts) > 1 else "grants"
        if not self.uuids:
            text = f"{what} {verb} no GPU to this process"
            return f"{text} ({'; '.join(self.notes)})" if self.notes else text
        names = self.labels if len(self.labels) == len(self.uuids) else self.uuids
        return f"{what} {verb} {', '.join(names)}"


# --------------------------------------------------------------------------- helpers


def _physical(devices: Sequence[DeviceSnapshot]) -> list[DeviceSnapshot]:
    """Whole GPUs (not MIG devices) in NVML index order: what indices refer to."""
    return sorted((d for d in devices if not d.is_mig), key=lambda d: d.index)


def _label(devices: Sequence[DeviceSnapshot], uuid: str) -> str:
    """The label of ``uuid``, one of ``devices`` (a grant only ever holds devices NVML shows)."""
    return next(d.label for d in devices if d.uuid == uuid)


def _labels(devices: Sequence[DeviceSnapshot], uuids: Sequence[str]) -> str:
    return ", ".join(_label(devices, u) for u in uuids)


def _host_indices(physical: Sequence[DeviceSnapshot], who: str = "this host shows") -> str:
    n = len(physical)
    if n == 0:
        return f"{who} no GPU"
    idx = [d.index for d in physical]
    span = (
        f"{idx[0]}"
        if n == 1
        else (
            f"{idx[0]}-{idx[-1]}"
            if idx == list(range(idx[0], idx[0] + n))
            else ",".join(map(str, idx))
        )
    )
    return f"{who} {n}: {span}"


def _strtoul(entry: str) -> tuple[int | None, str]:
    """CUDA reads an index entry like ``strtoul``: the leading digits, the rest ignored.

    Returns ``(value, rest)``; ``value`` is None when the entry does not start with digits
    (a negative number counts as invalid: CUDA stops there).
    """
    m = _LEADING_UINT.match(entry)
    if m is None:
        return None, entry
    return int(m.group(1)), entry[m.end() :]


def _resolve_uuid(entry: str, devices: Sequence[DeviceSnapshot]) -> tuple[str | None, str | None]:
    """Full UUID for a full UUID or a unique prefix; otherwise ``(None, why)``."""
    exact = [d for d in devices if d.uuid == entry]
    if exact:
        return exact[0].uuid, None
    matches = [d for d in devices if d.uuid.startswith(entry)]
    if len(matches) == 1:
        return matches[0].uuid, None
    if not matches:
        return None, "no device has that UUID or UUID prefix"
    return None, (
        f"ambiguous UUID prefix: it matches {len(matches)} devices "
        f"({', '.join(d.label for d in matches)})"
    )


def _parse_index_entries(
    var: str, entries: Sequence[str], physical: Sequence[DeviceSnapshot], who: str
) -> tuple[tuple[str, ...], list[str]]:
    notes: list[str] = []
    numbers: list[tuple[int, str]] = []
    for entry in entries:
        value, rest = _strtoul(entry)
        if value is None:
            if entry.startswith(_UUID_PREFIXES):
                why = "a UUID after indices: CUDA does not allow mixing indices and UUIDs"
            elif entry.startswith("-"):
                why = "a negative index"
            elif entry == "":
                why = "an empty entry"
            else:
                why = "not a device index"
            notes.append(_stopped(var, entry, why))
            break
        if rest:
            notes.append(
                f"{var}: {entry!r} read as {value}: CUDA reads only the leading digits "
                "(there are no ranges)"
            )
        if any(value == v for v, _ in numbers):
            notes.append(f"{var}: device {value} is listed twice; CUDA then shows no GPU at all")
            return (), notes
        numbers.append((value, entry))
    by_index = {d.index: d for d in physical}
    out: list[str] = []
    for value, entry in numbers:
        dev = by_index.get(value)
        if dev is None:
            why = f"no GPU with index {value}; {_host_indices(physical, who)}"
            notes.append(_stopped(var, entry, why))
            break
        out.append(dev.uuid)
    return tuple(out), notes


def _parse_uuid_entries(
    var: str, entries: Sequence[str], devices: Sequence[DeviceSnapshot]
) -> tuple[tuple[str, ...], list[str]]:
    notes: list[str] = []
    kind = entries[0][:4]
    raw_seen: list[str] = []
    for entry in entries:
        if kind == "MIG-" and entry.startswith("MIG-GPU-"):
            notes.append(
                f"{var}: stopped at {entry!r}: the legacy MIG-GPU-<uuid>/<gi>/<ci> form is not "
                "supported; use the MIG UUID that `nvidia-smi -L` prints (MIG-…)"
            )
            break
        if not entry.startswith(kind):
            if entry.startswith(_UUID_PREFIXES):
                why = f"a {entry[:4]} UUID after {kind} UUIDs: CUDA does not allow mixing them"
            elif _strtoul(entry)[0] is not None:
                why = "an index after UUIDs: CUDA does not allow mixing indices and UUIDs"
            elif entry == "":
                why = "an empty entry"
            else:
                why = "not a device UUID"
            notes.append(_stopped(var, entry, why))
            break
        if entry in raw_seen:
            notes.append(f"{var}: {entry!r} is listed twice; CUDA then shows no GPU at all")
            return (), notes
        raw_seen.append(entry)
    out: list[str] = []
    for entry in raw_seen:
        uuid, problem = _resolve_uuid(entry, devices)
        if uuid is None:
            notes.append(_stopped(var, entry, problem))
            break
        if uuid in out:
            notes.append(
                f"{var}: {entry!r} names {_label(devices, uuid)} again; "
                "CUDA then shows no GPU at all"
            )
            return (), notes
        out.append(uuid)
    return tuple(out), notes


def _stopped(var: str, entry: str, why: str | None) -> str:
    return f"{var}: stopped at {entry!r} ({why}); later entries are ignored, as CUDA does"


def _is_index_list(value: str) -> bool:
    """Whether CUDA reads ``value`` as indices: its first entry starts with digits."""
    return _LEADING_UINT.match(value.strip()) is not None


def parse_cuda_visible_devices(
    value: str, devices: Sequence[DeviceSnapshot]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Read a ``CUDA_VISIBLE_DEVICES`` value the way CUDA does.

    Parameters
    ----------
    value
        The variable's value (it is set: an unset variable means every device and is handled by
        :func:`current_allocation`).
    devices
        Every device NVML shows (MIG devices included); indices are NVML (PCI bus order) indices.

    Returns
    -------
    tuple
        ``(uuids, notes)``: the granted full UUIDs in CUDA's order (``()`` for none) and why
        entries were dropped. Never raises for a bad value: a bad value grants less, with a note.
    """
    return _parse_cvd(value, devices, "this host shows")


def _parse_cvd(
    value: str, devices: Sequence[DeviceSnapshot], who: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    var = CVD
    text = value.strip()
    if text == "":
        return (), (f"{var} is set but empty: CUDA shows no GPU",)
    if text == "NoDevFiles":
        return (), (
            f"{var}='NoDevFiles' (Slurm's value for a job without GPUs): CUDA shows no GPU",
        )
    if text == "-1":
        return (), (f"{var}='-1' hides every GPU from CUDA",)
    entries = [e.strip() for e in text.split(",")]
    if entries[0].startswith(_UUID_PREFIXES):
        uuids, notes = _parse_uuid_entries(var, entries, devices)
    else:
        uuids, notes = _parse_index_entries(var, entries, _physical(devices), who)
    return uuids, tuple(notes)


def _parse_nvidia_visible_devices(
    value: str, devices: Sequence[DeviceSnapshot]
) -> tuple[tuple[str, ...] | None, list[str]]:
    var = NVD
    text = value.strip()
    low = text.lower()
    if low == "all":
        return None, []
    if low in ("", "none", "void"):
        return (), [f"{var}={value!r}: the container runtime gives this container no GPU"]
    if text.startswith("/"):
        return None, [
            f"{var}={value!r} points at a device list the container runtime already applied: "
            "every GPU NVML shows is granted"
        ]
    entries = [e.strip() for e in text.split(",") if e.strip()]
    physical = _physical(devices)
    if all(e.startswith(_UUID_PREFIXES) for e in entries):
        out: list[str] = []
        notes: list[str] = []
        for entry in entries:
            uuid, why = _resolve_uuid(entry, devices)
            if uuid is None:
                notes.append(f"{var}: {entry!r} dropped ({why})")
            elif uuid not in out:
                out.append(uuid)
        return tuple(out), notes
    if all(e.isascii() and e.isdigit() for e in entries):
        numbers = list(dict.fromkeys(int(e) for e in entries))
        if len(numbers) == len(physical):
            return None, [
                f"{var}={value!r} lists host indices and NVML shows exactly {len(physical)} "
                "GPU(s): the container runtime already applied it"
            ]
        by_index = {d.index: d for d in physical}
        out = [by_index[n].uuid for n in numbers if n in by_index]
        notes = [f"{var}={value!r} read as NVML indices (NVML shows more GPUs than it lists)"]
        missing = [str(n) for n in numbers if n not in by_index]
        if missing:
            notes.append(f"{var}: index {', '.join(missing)} dropped ({_host_indices(physical)})")
        return tuple(out), notes
    return None, [
        f"{var}={value!r} (MIG or mixed entries) was applied by the container runtime: "
        "every GPU NVML shows is granted"
    ]


def _parse_slurm_ids(value: str) -> list[int] | None:
    ids: list[int] = []
    for entry in value.split(","):
        e = entry.strip()
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", e)
        if m is None:
            return None
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            return None
        ids.extend(range(lo, hi + 1))
    return list(dict.fromkeys(ids))


def _slurm_grant(
    var: str, value: str, devices: Sequence[DeviceSnapshot]
) -> tuple[tuple[str, ...], list[str]]:
    """The Slurm grant as ordered UUIDs, and notes."""
    text = value.strip()
    if text in ("", "NoDevFiles"):
        return (), [f"{var}={value!r}: the Slurm job has no GPU"]
    ids = _parse_slurm_ids(text)
    physical = _physical(devices)
    if ids is None:
        return (
            (),
            [
                f"{var}={value!r} is not a list of GPU ids (expected e.g. '0,2' or '0-3'): "
                "no GPU granted rather than guessing"
            ],
        )
    by_index = {d.index: d for d in physical}
    if len(ids) < len(physical) and all(i in by_index for i in ids):
        return tuple(by_index[i].uuid for i in ids), []
    if len(ids) == len(physical):
        every = tuple(d.uuid for d in physical)
        if set(ids) == set(by_index):  # the job has the whole host
            return every, []
        note = (
            f"{var}={value!r}: NVML shows exactly the job's {len(ids)} GPU(s) "
            "(device cgroup), so all of them are granted"
        )
        return every, [note]
    return (
        (),
        [
            f"{var}={value!r} names GPUs that do not match what NVML shows "
            f"({_host_indices(physical)}): cannot tell which GPUs are the job's, so none is granted"
        ],
    )


def _inside(uuid: str, grant: Sequence[str], devices: Sequence[DeviceSnapshot]) -> bool:
    if uuid in grant:
        return True
    return any(d.uuid == uuid and d.is_mig and d.parent_uuid in grant for d in devices)


def _cvd_grant(
    cvd: str,
    env: Mapping[str, str],
    devices: Sequence[DeviceSnapshot],
    slurm_var: str | None,
    slurm: tuple[str, ...] | None,
) -> tuple[tuple[str, ...], list[str]]:
    """What ``CUDA_VISIBLE_DEVICES`` grants (with a Slurm grant beside it), and notes."""
    uuids, cvd_notes = parse_cuda_visible_devices(cvd, devices)
    notes = list(cvd_notes)
    if slurm_var is not None and slurm and len(slurm) < len(_physical(devices)) and (
        _is_index_list(cvd)
    ):
        # NVML shows more GPUs than the job's: Slurm wrote global ids (no device cgroup) or ids
        # relative to the job's GPUs (device cgroup that CUDA honours but NVML does not). Take
        # the global reading when it stays inside the grant, else the relative one.
        by_id = [d for d in _physical(devices) if d.uuid in slurm]
        by_id.sort(key=lambda d: slurm.index(d.uuid))
        relative = [replace(d, index=i) for i, d in enumerate(by_id)]
        rel_uuids, rel_notes = _parse_cvd(cvd, relative, "the job has")
        if uuids and all(u in slurm for u in uuids):
            if rel_uuids and not rel_notes and rel_uuids != uuids:
                notes.append(
                    f"{CVD}={cvd!r} read as global ids inside {slurm_var}={env[slurm_var]!r} "
                    f"({_labels(devices, uuids)}); read relative to the job it would be "
                    f"{_labels(devices, rel_uuids)}"
                )
        else:
            uuids = rel_uuids
            notes = [
                *rel_notes,
                f"{CVD}={cvd!r} read relative to the job's GPUs ({slurm_var}="
                f"{env[slurm_var]!r}), as Slurm writes it under a device cgroup"
                + (f": {_labels(devices, uuids)}" if uuids else ""),
            ]
    models = sorted({d.name for d in _physical(devices)})
    if (
        uuids
        and _is_index_list(cvd)
        and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID"
        and len(models) > 1
    ):
        notes.append(
            f"{CVD}={cvd!r} uses indices and CUDA_DEVICE_ORDER is not PCI_BUS_ID, so CUDA "
            f"numbers GPUs fastest first; this host mixes models ({', '.join(models)}), so "
            "CUDA's index may name another GPU than NVML's: read here in PCI bus order "
            "(nvidia-smi's). UUIDs avoid the ambiguity"
        )
    return uuids, notes


def _within_every_grant(
    grants: list[tuple[str, tuple[str, ...]]], devices: Sequence[DeviceSnapshot], notes: list[str]
) -> list[str]:
    """The most specific grant's devices, in its order, that every other grant also allows."""
    primary_var, result = grants[-1]
    kept: list[str] = []
    for uuid in result:
        outside = [v for v, g in grants[:-1] if not _inside(uuid, g, devices)]
        if outside:
            notes.append(
                f"{_label(devices, uuid)} (from {primary_var}) is outside the allocation of "
                f"{' and '.join(outside)}: dropped"
            )
        else:
            kept.append(uuid)
    mig = [u for u in kept if any(d.uuid == u and d.is_mig for d in devices)]
    if len(mig) > 1:
        notes.append(
            f"{len(mig)} MIG devices granted; CUDA uses one MIG device per process, so a pick "
            "uses one of them"
        )
    return kept


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


# --------------------------------------------------------------------------- ROCm (AMD)
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
