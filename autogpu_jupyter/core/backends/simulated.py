"""A simulated fleet: the same snapshots as NVML, from a JSON fleet file or a built-in fleet.

Used for demos on machines without an NVIDIA driver (``AUTOGPU_SIMULATE=demo-4x``) and clearly
labelled ``simulated`` on every surface. The fleet file is re-read whenever it changes, so a demo
or a test can move load while kernels run. The schema is documented in
docs/fleet-files.md.
"""

from __future__ import annotations

import copy
import json
import math
import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.units import parse_size
from autogpu_jupyter.errors import UsageErrorBase

__all__ = [
    "SimulatedBackend", "BUILTIN_FLEETS", "AMD_FLEETS", "builtin_fleet", "fleet_at",
    "resolve_fleet_source",
]

GiB = 1024**3


def _demo(n_a100: int, n_l4: int) -> dict[str, Any]:
    devices: list[dict[str, Any]] = []
    for i in range(n_a100 + n_l4):
        a100 = i < n_a100
        devices.append(
            {
                "name": "NVIDIA A100-SXM4-80GB" if a100 else "NVIDIA L4",
                "uuid": f"GPU-5{i:07d}-d3mo-4x{i:02d}-a{i}00-{i:012x}",
                "pci_bus_id": f"00000000:{0x07 + 0x10 * i:02X}:00.0",
                "memory_total": 80 * GiB if a100 else 24 * GiB,
                "power_limit_w": 400.0 if a100 else 72.0,
                "load": {
                    "period_s": 90.0 + 37.0 * i,
                    "phase": i * 1.7,
                    # GPU 1 (and 5) is the busy one: always overloaded by another user's job
                    # (over the panel's 90 % / 95 % thresholds), so notebooks/panel.ipynb,
                    # which sits on it on purpose, shows the overload warning at once.
                    "utilization_pct": [[5, 35], [92, 99], [0, 10], [20, 70]][i % 4],
                    "memory_used_fraction": [[0.05, 0.2], [0.96, 0.98], [0.0, 0.05], [0.2, 0.5]][
                        i % 4
                    ],
                },
                "processes": [
                    {
                        "pid": 41000 + i,
                        "user": user,
                        "command": "python train.py",
                        "memory_share": 1.0,
                    }
                    for user in {0: ["alice"], 1: ["bob"], 2: [], 3: ["dave"]}[i % 4]
                ],
            }
        )
    return {"driver_version": "550.54.15 (simulated)", "devices": devices}


def _demo_amd(n_mi300: int, n_mi210: int) -> dict[str, Any]:
    """An AMD fleet with the load pattern of :func:`_demo` (MI300X where it has A100s)."""
    fleet = _demo(n_mi300, n_mi210)
    for i, dev in enumerate(fleet["devices"]):
        mi300 = i < n_mi300
        dev["name"] = "AMD Instinct MI300X" if mi300 else "AMD Instinct MI210"
        dev["uuid"] = f"{0x5AFF74A1 + i:08x}-0000-1000-80{i:02x}-d3a0a3d00{i:03x}"
        dev["runtime_uuid"] = f"GPU-{0x4D0A3D0000000000 + i:016x}"
        dev["pci_bus_id"] = f"0000:{0x05 + 0x20 * i:02x}:00.0"
        dev["memory_total"] = 192 * GiB if mi300 else 64 * GiB
        dev["power_limit_w"] = 750.0 if mi300 else 300.0
    return {"vendor": "amd", "driver_version": "6.10.5 (simulated)", "devices": fleet["devices"]}


#: Built-in fleets, by name: how many A100s and L4s each has (``builtin_fleet`` describes one);
#: ``demo-amd`` has AMD Instinct MI300X and MI210 in their places (:data:`AMD_FLEETS`).
BUILTIN_FLEETS: dict[str, tuple[int, int]] = {
    "demo-4x": (2, 2),
    "demo-8x": (4, 4),
    "demo-amd": (4, 4),
}
#: The built-in fleets of AMD GPUs.
AMD_FLEETS = ("demo-amd",)


def builtin_fleet(name: str) -> dict[str, Any]:
    """The fleet description of a built-in fleet (built on each call: the caller may change it)."""
    if name in AMD_FLEETS:
        return _demo_amd(*BUILTIN_FLEETS[name])
    return _demo(*BUILTIN_FLEETS[name])


def resolve_fleet_source(source: str, base_dir: str | None = None) -> str:
    """``source`` as every process should read it: a built-in fleet name or an absolute path.

    A relative fleet file path that exists under ``base_dir`` (default: the current directory)
    becomes absolute, so that a server resolving it once at start hands its kernels (which run
    in their notebooks' folders) the same file. Anything else is returned unchanged (the backend
    reports it when it is used).
    """
    if not source or source in BUILTIN_FLEETS or os.path.isabs(source):
        return source
    candidate = os.path.join(base_dir or os.getcwd(), source)
    return os.path.abspath(candidate) if os.path.isfile(candidate) else source


def _bytes(value: Any, what: str) -> int | None:
    """A byte count of the fleet file (a number, or a size such as "80G"); ``what`` names it."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    try:
        return parse_size(value).resolve(None)
    except UsageErrorBase as err:
        raise UsageErrorBase(f"{what}: {err}") from None


def _load_at(
    load: dict[str, Any], util: Any, total: int | None, used: int | None, now: float
) -> tuple[float, int | None]:
    """A moving ``load``'s utilisation and memory in use at ``now`` (a sine of its period)."""
    period = float(load.get("period_s", 120.0))
    wave = 0.5 + 0.5 * math.sin(2 * math.pi * now / period + float(load.get("phase", 0.0)))
    lo, hi = load.get("utilization_pct", [util or 0, util or 0])
    util = round(lo + (hi - lo) * wave, 1)
    if total is not None and "memory_used_fraction" in load:
        flo, fhi = load["memory_used_fraction"]
        used = int(total * (flo + (fhi - flo) * wave))
    return util, used


def fleet_at(fleet: dict[str, Any], now: float) -> dict[str, Any]:
    """``fleet`` with every moving load stopped where it is at ``now`` (Unix seconds): a fleet
    whose every snapshot is the one the moving fleet shows at that instant. What the README's
    samples run on (``scripts/readme_samples.py``): the demo's fleet, reproducibly."""
    out = copy.deepcopy(fleet)
    for spec in out.get("devices", []):
        load = spec.pop("load", None)
        if not load or spec.get("lost"):
            continue
        total = _bytes(spec.get("memory_total"), "memory_total")
        used = _bytes(spec.get("memory_used"), "memory_used")
        spec["utilization_pct"], frozen = _load_at(
            load, spec.get("utilization_pct"), total, used, now)
        if frozen is not None:
            spec["memory_used"] = frozen
    return out


class SimulatedBackend:
    """Snapshots from a fleet description; moving load where the fleet defines ``load``."""

    simulated = True

    def __init__(self, source: str, clock: Any = time.time) -> None:
        self.source = source
        self.name = "simulated"
        self._clock = clock
        self._lock = threading.Lock()
        self._mtime: float | None = None
        self._fleet: dict[str, Any] | None = None
        if source in BUILTIN_FLEETS:
            self._fleet = builtin_fleet(source)
        elif not Path(source).is_file():
            # A relative path is read from this process's directory, which differs between a
            # server and its kernels (a kernel runs in its notebook's folder): say where we looked.
            where = "" if os.path.isabs(source) else f" (looked in {os.getcwd()})"
            raise UsageErrorBase(
                f"AUTOGPU_SIMULATE={source!r}: not a fleet file{where} and not a built-in "
                "fleet; expected an absolute path to a JSON fleet file or one of "
                f"{', '.join(sorted(BUILTIN_FLEETS))}"
            )

    def _load(self) -> dict[str, Any]:
        if self.source in BUILTIN_FLEETS:
            assert self._fleet is not None
            return self._fleet
        with self._lock:
            try:
                mtime = os.stat(self.source).st_mtime_ns
                if self._fleet is not None and mtime == self._mtime:
                    return self._fleet
                with open(self.source, encoding="utf-8") as fh:
                    text = fh.read()
            except (OSError, UnicodeDecodeError) as err:
                # Being replaced (gone for a moment, or cut mid-character): the last good one.
                # Anything else (no permission) is said, not hidden behind an old fleet.
                if self._fleet is not None and isinstance(
                    err, (FileNotFoundError, UnicodeDecodeError)
                ):
                    return self._fleet
                why = err.strerror if isinstance(err, OSError) else f"not UTF-8 ({err.reason})"
                raise UsageErrorBase(
                    f"fleet file {self.source!r} cannot be read: {why}; expected a JSON fleet "
                    "file (UTF-8) this user can read"
                ) from None
            try:
                fleet = json.loads(text)
            except json.JSONDecodeError:
                if self._fleet is not None:  # a writer is mid-write: keep the last good one
                    return self._fleet
                raise UsageErrorBase(f"fleet file {self.source!r} is not valid JSON") from None
            self._fleet, self._mtime = fleet, mtime
            return self._fleet

    def snapshot(self) -> FleetSnapshot:
        fleet = self._load()
        now = float(self._clock())
        devices: list[DeviceSnapshot] = []
        vendor = str(fleet.get("vendor", "nvidia"))
        for index, spec in enumerate(fleet.get("devices", [])):
            devices.extend(
                replace(d, vendor=vendor, runtime_uuid=spec.get("runtime_uuid"),
                        compute_mode=spec.get("compute_mode"))
                if vendor != "nvidia" else d
                for d in self._device(index, spec, now)
            )
        return FleetSnapshot(
            devices=tuple(devices),
            timestamp_s=now,
            backend="simulated",
            simulated=True,
            driver_version=fleet.get("driver_version", "simulated"),
        )

    def _device(self, index: int, spec: dict[str, Any], now: float) -> list[DeviceSnapshot]:
        uuid = str(spec["uuid"])
        name = str(spec.get("name", "Simulated GPU"))
        if spec.get("lost"):
            return [
                DeviceSnapshot(
                    index=index,
                    uuid=uuid,
                    name=name,
                    pci_bus_id=spec.get("pci_bus_id"),
                    available=False,
                    error=str(spec.get("error", "GPU is lost")),
                    processes=None,
                    timestamp_s=now,
                )
            ]
        where = f"fleet file {self.source!r}, device {index} ({uuid})"
        total = _bytes(spec.get("memory_total"), f"{where} memory_total")
        used = _bytes(spec.get("memory_used"), f"{where} memory_used")
        util = spec.get("utilization_pct")
        load = spec.get("load")
        if load:
            util, used = _load_at(load, util, total, used, now)
        if used is None and total is not None:
            used = sum(
                _bytes(p.get("used_memory"), f"{where} process used_memory") or 0
                for p in spec.get("processes", [])
            )
        free = None if total is None or used is None else max(total - used, 0)
        procs = []
        for p in spec.get("processes", []):
            pm = _bytes(p.get("used_memory"), f"{where} process used_memory")
            if pm is None and "memory_share" in p and used is not None:
                pm = int(used * float(p["memory_share"]))
            procs.append(
                ProcessSnapshot(
                    pid=int(p["pid"]),
                    used_memory_bytes=pm,
                    user=p.get("user"),
                    command=p.get("command"),
                )
            )
        power_limit = spec.get("power_limit_w")
        power = spec.get("power_w")
        if power is None and power_limit is not None and util is not None:
            power = round(float(power_limit) * (0.15 + 0.8 * float(util) / 100.0), 1)
        temp = spec.get("temperature_c")
        if temp is None and util is not None:
            temp = round(32 + 0.45 * float(util))
        mig = spec.get("mig_devices") or []
        parent = DeviceSnapshot(
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=spec.get("pci_bus_id"),
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            utilization_pct=None if util is None or mig else float(util),
            memory_utilization_pct=spec.get("memory_utilization_pct"),
            temperature_c=temp,
            power_w=power,
            power_limit_w=power_limit,
            compute_mode=spec.get("compute_mode", "DEFAULT"),
            mig_enabled=bool(mig),
            processes=tuple(procs),
            timestamp_s=now,
        )
        out = [parent]
        for mi, m in enumerate(mig):
            mt = _bytes(m.get("memory_total"), f"{where} MIG {mi} memory_total")
            mu = _bytes(m.get("memory_used"), f"{where} MIG {mi} memory_used") or 0
            out.append(
                DeviceSnapshot(
                    index=index,
                    uuid=str(m["uuid"]),
                    name=f"{name} MIG {m.get('profile', '')}".strip(),
                    pci_bus_id=spec.get("pci_bus_id"),
                    memory_total_bytes=mt,
                    memory_used_bytes=mu,
                    memory_free_bytes=None if mt is None else max(mt - mu, 0),
                    compute_mode=parent.compute_mode,
                    mig_enabled=True,
                    is_mig=True,
                    parent_uuid=uuid,
                    mig_index=mi,
                    timestamp_s=now,
                )
            )
        return out
