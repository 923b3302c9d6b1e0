"""Frozen snapshots of devices and their processes.

Units live in field names (``memory_free_bytes``, ``utilization_pct``, ``timestamp_s``); ``None``
means unknown (NOT_SUPPORTED, not readable), and zero means zero. Devices are identified by UUID
(MIG devices by their MIG UUID); ``index`` is the NVML index (on AMD: ROCr's enumeration index),
for people only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd


__all__ = [
    "ProcessSnapshot",
    "DeviceSnapshot",
    "FleetSnapshot",
    "COMPUTE_MODES",
    "mig_parents",
    "physical_gpu",
]

#: NVML compute modes by their NVML number.
COMPUTE_MODES = {0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS"}


@dataclass(frozen=True, slots=True)
class ProcessSnapshot:
    """A compute process on a device, as NVML reports it.

    ``user`` and ``command`` come from ``/proc`` and are ``None`` where it does not tell (another
    PID namespace, the process already gone). Surfaces hide other users' ``command`` by default.
    """

    pid: int
    used_memory_bytes: int | None = None
    user: str | None = None
    command: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    """One device at one moment. A MIG device is its own snapshot with ``is_mig=True``."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_pct: float | None = None
    memory_utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    compute_mode: str | None = None
    mig_enabled: bool | None = None
    is_mig: bool = False
    parent_uuid: str | None = None
    mig_index: int | None = None
    processes: tuple[ProcessSnapshot, ...] | None = ()
    available: bool = True
    error: str | None = None
    #: ``"nvidia"`` or ``"amd"``: whose runtime and visibility variables select this device.
    vendor: str = "nvidia"
    #: The id the vendor's runtime selects the device by where it differs from ``uuid``: on AMD,
    #: ROCr's ``GPU-<16 hex>`` (KFD's unique id; the partitions of one GPU may share it).
    runtime_uuid: str | None = None
    timestamp_s: float = 0.0

    @property
    def label(self) -> str:
        """What people call this device: ``GPU 3`` or ``GPU 0 MIG 1``."""
        if self.is_mig:
            return f"GPU {self.index} MIG {self.mig_index}"
        return f"GPU {self.index}"

    @property
    def short_uuid(self) -> str:
        """``GPU-1a2b3c4d`` style short form for display (the full UUID stays the identity).

        Always a prefix of the id the runtime is given: on AMD, of ROCr's ``GPU-<16 hex>``
        (what ``ROCR_VISIBLE_DEVICES`` names), not of the amdsmi UUID; a UUID without a
        ``GPU-``/``MIG-`` word is cut after its first group, never inside one.
        """
        ident = self.runtime_uuid or self.uuid
        prefix, _, rest = ident.partition("-")
        if not rest:
            return ident
        return f"{prefix}-{rest[:8]}" if prefix.isalpha() else prefix

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "processes"}
        d["processes"] = None if self.processes is None else [p.to_dict() for p in self.processes]
        d["label"] = self.label
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceSnapshot:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        procs = d.get("processes")
        kw["processes"] = None if procs is None else tuple(ProcessSnapshot(**p) for p in procs)
        return cls(**kw)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """Every device this host shows, read at ``timestamp_s`` through ``backend``."""

    devices: tuple[DeviceSnapshot, ...]
    timestamp_s: float
    backend: str
    simulated: bool = False
    driver_version: str | None = None
    errors: tuple[str, ...] = field(default=())

    def by_uuid(self, uuid: str) -> DeviceSnapshot | None:
        for d in self.devices:
            if d.uuid == uuid:
                return d
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "timestamp_s": self.timestamp_s,
            "backend": self.backend,
            "simulated": self.simulated,
            "driver_version": self.driver_version,
            "errors": list(self.errors),
            "devices": [d.to_dict() for d in self.devices],
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FleetSnapshot:
        return cls(
            devices=tuple(DeviceSnapshot.from_dict(x) for x in d["devices"]),
            timestamp_s=float(d["timestamp_s"]),
            backend=str(d["backend"]),
            simulated=bool(d.get("simulated")),
            driver_version=d.get("driver_version"),
            errors=tuple(d.get("errors", ())),
        )

    def to_dataframe(self) -> pd.DataFrame:
        """One row per device, indexed by UUID; process lists summarised as counts."""
        import pandas as pd  # noqa: PLC0415 (pandas: only for a frame)

        rows = []
        for dev in self.devices:
            row = dev.to_dict()
            procs = row.pop("processes")
            row["process_count"] = None if procs is None else len(procs)
            rows.append(row)
        columns = [f.name for f in fields(DeviceSnapshot) if f.name != "processes"]
        columns += ["label", "process_count"]
        df = pd.DataFrame(rows, columns=columns)
        df.attrs["simulated"] = self.simulated
        df.attrs["backend"] = self.backend
        return df.set_index("uuid", drop=False)


def mig_parents(devices: Iterable[DeviceSnapshot]) -> dict[str, str]:
    """The fleet's MIG layout: each MIG device's UUID -> its parent GPU's UUID.

    A MIG UUID (``MIG-<uuid>``, as drivers since R470 print it) does not say which GPU it is a
    slice of; only a snapshot does. Lease rules that follow physical GPUs (a reservation, an
    exclusive lease: :mod:`autogpu_jupyter.core.leasing.admission`) read this map.
    """
    return {d.uuid: d.parent_uuid for d in devices if d.is_mig and d.parent_uuid}


def physical_gpu(uuid: str, parents: Mapping[str, str]) -> str:
    """The physical GPU ``uuid`` is on: its parent for a MIG device, itself otherwise."""
    return parents.get(uuid, uuid)
