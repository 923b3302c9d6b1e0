"""The allocation a process inherited (:class:`Allocation`) and the readers of NVIDIA's and
Slurm's grant variables: ``CUDA_VISIBLE_DEVICES`` by CUDA's rules, ``NVIDIA_VISIBLE_DEVICES`` by
the container runtime's, ``SLURM_STEP_GPUS`` / ``SLURM_JOB_GPUS``.

The rules are stated in :mod:`autogpu_jupyter.core.visibility`'s docstring; that module reads
the whole environment with them (:func:`~autogpu_jupyter.core.visibility.current_allocation`),
and :mod:`autogpu_jupyter.core.rocmgrant` reads ROCm's variables with the helpers here.
"""


from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from autogpu_jupyter.core.devices import DeviceSnapshot

__all__ = [
    "CVD",
    "NVD",
    "ROCR",
    "HIP",
    "GDO",
    "ROCM_VARS",
    "SLURM_VARS",
    "Allocation",
    "parse_cuda_visible_devices",
]

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
