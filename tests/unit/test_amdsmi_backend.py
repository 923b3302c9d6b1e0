"""The amdsmi backend through AMD's real ``amdsmi`` binding over the fake ``libamd_smi.so``.

Every value a user would see is asserted exactly: identity, memory, load, partitions, what is
unknown, per-device failures, and which backend a host gets.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core import procfs
from autogpu_jupyter.core.backends import amdsmi as mod
from autogpu_jupyter.core.backends import choose_backend, get_backend
from autogpu_jupyter.core.backends.amdsmi import AmdSmiBackend, _runtime_uuid
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.errors import NVMLUnavailableError, UsageErrorBase
from tests.fakeamdsmi import (
    FakeAmdSmi,
    amd_rocr_uuid,
    amd_uuid,
    fleet_amd_8x,
    fleet_amd_partitions,
    preload_fake_amdsmi,
    wrapper_symbols,
)

GiB = 1024**3
MI300X, MI210 = "AMD Instinct MI300X", "AMD Instinct MI210"


def test_every_symbol_the_wrapper_binds_is_exported_by_the_fake() -> None:
    lib = preload_fake_amdsmi()
    names = wrapper_symbols()
    assert len(names) >= 180  # amdsmi 7.0.2 binds 184
    missing = [n for n in names if not hasattr(lib, n)]
    assert missing == []
    # the ones the backend does not use answer AMDSMI_STATUS_NOT_SUPPORTED (2)
    assert ctypes.CDLL(None).amdsmi_get_gpu_vbios_info(None, None) == 2


def test_eight_gpus_read_exactly(fake_amdsmi: FakeAmdSmi) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    snap = AmdSmiBackend().snapshot()
    assert (snap.backend, snap.simulated, snap.driver_version, snap.errors) == (
        "amdsmi", False, "6.10.5", ())
    want = []
    for i in range(8):
        mi300 = i < 4
        used = [3, 150, 0, 90, 1, 40, 0, 20][i] * GiB
        util = [2, 96, 0, 60, 10, 85, 0, 30][i]
        limit = 750.0 if mi300 else 300.0
        total = (192 if mi300 else 64) * GiB
        want.append(DeviceSnapshot(
            index=i, uuid=amd_uuid(i), name=MI300X if mi300 else MI210,
            pci_bus_id=f"0000:{0x05 + 0x20 * i:02x}:00.0",
            memory_total_bytes=total, memory_used_bytes=used, memory_free_bytes=total - used,
            utilization_pct=float(util), memory_utilization_pct=float([1, 70, 0, 35, 3, 50, 0,
                                                                        12][i]),
            temperature_c=float(round(32 + 0.45 * util)),
            power_w=float(round(limit * (0.15 + 0.8 * util / 100))), power_limit_w=limit,
            compute_mode=None, mig_enabled=False,
            processes=(ProcessSnapshot(1_100_000 + i, used),) if used else (),
            vendor="amd", runtime_uuid=amd_rocr_uuid(i),
        ))
    got = [d.__class__(**{**{f: getattr(d, f) for f in d.__slots__}, "timestamp_s": 0.0})
           for d in snap.devices]
    assert got == want


def test_partitions_are_devices_with_their_own_memory_and_no_per_socket_values(
    fake_amdsmi: FakeAmdSmi,
) -> None:
    fake_amdsmi.write(fleet_amd_partitions())
    snap = AmdSmiBackend().snapshot()
    rows = [(d.index, d.name, d.uuid, d.runtime_uuid, d.memory_total_bytes,
             d.memory_used_bytes, d.utilization_pct, d.temperature_c, d.power_w,
             d.power_limit_w, [p.pid for p in d.processes or ()]) for d in snap.devices]
    assert rows == [
        (p, f"{MI300X} (CPX {p}, NPS4)", f"02ff74a1-0000-1000-80{p:02x}-7f3c2a1b0e9d",
         "GPU-7f3c2a1b0e9d8c76", 48 * GiB, (4 if p == 1 else 0) * GiB, None, None, None, None,
         [1_200_001] if p == 1 else [])
        for p in range(8)
    ] + [(8, MI300X, "ffff74a1-0000-1000-80ff-5b6c7d8e9fa0", "GPU-5b6c7d8e9fa01234",
          192 * GiB, 0, 0.0, 32.0, 112.0, 750.0, [])]
    # every partition is its own device: a pick may take several (no MIG-like one-per-process)
    assert not any(d.is_mig or d.parent_uuid for d in snap.devices)


def test_a_device_that_fails_is_listed_unavailable_and_the_others_are_read(
    fake_amdsmi: FakeAmdSmi,
) -> None:
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = fleet["devices"][:3]
    fleet["devices"][1]["error"] = "no_permission"
    fleet["devices"][2]["lost"] = True
    fake_amdsmi.write(fleet)
    snap = AmdSmiBackend().snapshot()
    assert [(d.index, d.uuid, d.available, d.error, d.processes) for d in snap.devices] == [
        (0, amd_uuid(0), True, None, ()),
        (1, "unknown-1", False, "no permission", None),
        (2, "unknown-2", False, "amdsmi error: AMDSMI_STATUS_IO", None),
    ]


def test_a_device_known_before_it_fails_keeps_its_name(fake_amdsmi: FakeAmdSmi) -> None:
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = fleet["devices"][:2]
    fake_amdsmi.write(fleet)
    backend = AmdSmiBackend()
    backend.snapshot()
    fake_amdsmi.set(1, lost=True)
    lost = backend.snapshot().devices[1]
    assert (lost.index, lost.uuid, lost.name, lost.pci_bus_id, lost.available) == (
        1, amd_uuid(1), MI300X, "0000:25:00.0", False)


def test_a_warm_backend_s_warm_up_reads_nothing(fake_amdsmi: FakeAmdSmi) -> None:
    """The picker's warm-up before the lock takes no second snapshot once amdsmi is up and
    every device is known (issue 26); a device that failed is read again by the next one."""
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = fleet["devices"][:2]
    fake_amdsmi.write(fleet)
    backend = AmdSmiBackend()
    backend.warm_up()
    before = fake_amdsmi.total_calls()
    backend.warm_up()
    assert fake_amdsmi.total_calls() == before
    fake_amdsmi.set(1, lost=True)
    backend.snapshot()  # device 1 fails: its identity is dropped
    fake_amdsmi.set(1, lost=False)
    before = fake_amdsmi.total_calls()
    backend.warm_up()
    assert fake_amdsmi.total_calls() > before


def test_unsupported_queries_read_as_unknown(fake_amdsmi: FakeAmdSmi) -> None:
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = [fleet["devices"][0]]
    fleet["devices"][0]["unsupported"] = ["activity", "temp_hotspot", "power", "power_cap",
                                          "processes", "enumeration"]
    fleet["devices"][0]["temperature_edge_c"] = 47
    fake_amdsmi.write(fleet)
    d = AmdSmiBackend().snapshot().devices[0]
    # the edge sensor stands in for the hotspot one; the ROCr UUID comes from the ASIC serial
    assert (d.utilization_pct, d.temperature_c, d.power_w, d.power_limit_w, d.processes,
            d.runtime_uuid, d.index) == (None, 47.0, None, None, None, amd_rocr_uuid(0), 0)


def test_load_changes_are_read_at_the_next_snapshot(fake_amdsmi: FakeAmdSmi) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    backend = AmdSmiBackend()
    assert backend.snapshot().devices[2].utilization_pct == 0.0
    fake_amdsmi.set(2, utilization_pct=77, memory_used=10 * GiB)
    d = backend.snapshot().devices[2]
    assert (d.utilization_pct, d.memory_used_bytes) == (77.0, 10 * GiB)


def test_no_loaded_driver_is_one_line(fake_amdsmi: FakeAmdSmi) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    backend = AmdSmiBackend()
    backend.snapshot()
    fake_amdsmi.set_driver(driver="none")
    with pytest.raises(NVMLUnavailableError) as err:
        backend.snapshot()
    assert str(err.value) == (
        "no AMD GPU driver on this host (amdsmi: the amdgpu driver is not loaded)")


def test_autogpu_backend_selects_amdsmi_and_a_bad_value_is_one_message(
    fake_amdsmi: FakeAmdSmi, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_amdsmi.write(fleet_amd_8x())
    backend = get_backend()
    assert backend.name == "amdsmi" and get_backend() is backend
    assert len(backend.snapshot().devices) == 8
    assert choose_backend(" AMDSMI ") == "amdsmi"
    assert choose_backend("nvml") == "nvml"
    with pytest.raises(UsageErrorBase) as err:
        choose_backend("rocm")
    assert str(err.value) == (
        "AUTOGPU_BACKEND='rocm': not a GPU backend; expected one of nvml, amdsmi or auto "
        "(NVML where NVIDIA's library is installed, else amdsmi)")


@pytest.mark.parametrize(
    ("hip_uuid", "serial", "want"),
    [
        ("GPU-4c2d1a9f8e3b6a70", "N/A", "GPU-4c2d1a9f8e3b6a70"),
        ("GPU-4C2D1A9F8E3B6A70", "", "GPU-4c2d1a9f8e3b6a70"),
        ("GPU-0000000000000000", "0x00000000000000AB", "GPU-00000000000000ab"),
        (None, "0x4C2D1A9F8E3B6A70", "GPU-4c2d1a9f8e3b6a70"),
        ("N/A", "N/A", None),
        ("GPU-XX", "zz", None),
        (None, "0xFFFFFFFFFFFFFFFF", None),
    ],
)
def test_rocr_uuid_from_the_binding(hip_uuid: object, serial: object, want: str | None) -> None:
    assert _runtime_uuid(hip_uuid, serial) == want


def test_a_process_list_longer_than_the_first_buffer_is_read_whole(
    fake_amdsmi: FakeAmdSmi,
) -> None:
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = [fleet["devices"][0]]
    fleet["devices"][0]["processes"] = [
        {"pid": 2_000_000 + p, "used_memory": (p + 1) * GiB // 8} for p in range(40)]
    fake_amdsmi.write(fleet)
    before = FakeAmdSmi.calls("amdsmi_get_gpu_process_list")
    procs = AmdSmiBackend().snapshot().devices[0].processes
    assert procs is not None
    assert [(p.pid, p.used_memory_bytes) for p in procs] == [
        (2_000_000 + p, (p + 1) * GiB // 8) for p in range(40)]
    # 32 entries offered first: the library answers "more", the second call reads all 40
    assert FakeAmdSmi.calls("amdsmi_get_gpu_process_list") - before == 2


@pytest.mark.parametrize(
    ("nvidia", "amd", "want"),
    [(True, True, "nvml"), (False, True, "amdsmi"), (False, False, "nvml")],
)
def test_auto_detection_prefers_nvidias_library_then_amds(
    monkeypatch: pytest.MonkeyPatch, nvidia: bool, amd: bool, want: str
) -> None:
    """``auto`` (or nothing): NVML where NVIDIA's library loads, else amdsmi where AMD's
    does, else NVML (whose error then says no driver is installed); found once per process."""
    import ctypes

    from autogpu_jupyter.core import backends
    from autogpu_jupyter.core.backends import amdsmi

    asked: list[object] = []

    def cdll(name: object, *args: object, **kwargs: object) -> object:
        asked.append(name)
        if not nvidia:
            raise OSError(f"{name}: cannot open shared object file")
        return object()

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(amdsmi, "library_present", lambda: amd)
    monkeypatch.setattr(backends, "_detected", [])
    assert choose_backend(" Auto ") == want
    assert choose_backend("") == want
    assert asked == ["libnvidia-ml.so.1"]  # asked for by name, and once


# ---- against a binding written in Python ----
# What the fake C library cannot show: "N/A" readings, booleans where numbers belong, a library
# that keeps asking for a bigger process buffer, an amdsmi shut down behind the backend's back;
# plus its import, initialisation and where it looks for libamd_smi.so. Found by the mutation run
# of issue 22; every value is asserted whole.
NOW = 1234.5
LOGGER = "autogpu_jupyter.core.backends.amdsmi"
SIMULATE = "; to try autogpu without a GPU, set AUTOGPU_SIMULATE=demo-amd (a simulated fleet)"
STATUS_NAMES = {2: "AMDSMI_STATUS_NOT_SUPPORTED", 10: "AMDSMI_STATUS_NO_PERM",
                12: "AMDSMI_STATUS_IO", 18: "AMDSMI_STATUS_INIT_ERROR",
                32: "AMDSMI_STATUS_NOT_INIT", 34: "AMDSMI_STATUS_DRIVER_NOT_LOADED"}


# ---- a Python amdsmi binding: the calls the backend makes, as AMD's binding answers them ----
class SmiError(Exception):
    """The binding's ``AmdSmiException``."""


class LibError(SmiError):
    """The binding's ``AmdSmiLibraryException`` (``abs(err_code)``, as the binding does)."""

    def __init__(self, code: int) -> None:
        code = abs(code)
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"amdsmi status {self.code}"

    def get_error_code(self) -> int:
        return self.code

    def get_error_info(self, detailed: bool = True) -> str:
        short = STATUS_NAMES.get(self.code, f"AMDSMI_STATUS_{self.code}")
        return f"{short} - what went wrong" if detailed else short


class Fail:
    """A reading that answers this status (missing readings answer NOT_SUPPORTED)."""

    def __init__(self, code: int) -> None:
        self.code = code


class MemUsage(ctypes.Structure):
    _fields_ = [("gtt_mem", ctypes.c_uint64), ("cpu_mem", ctypes.c_uint64),
                ("vram_mem", ctypes.c_uint64)]


class ProcInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 32), ("pid", ctypes.c_uint32),
                ("memory_usage", MemUsage)]


class Dev:
    def __init__(self, fail: int | None = None, **values: Any) -> None:
        self.fail = fail
        self.values = values
        self.process_calls = 0


class Wrapper:
    """``amdsmi.amdsmi_wrapper``: the ctypes process list the backend calls directly."""

    amdsmi_proc_info_t = ProcInfo

    def amdsmi_get_gpu_process_list(self, handle: Dev, count_ref: Any, buffer: Any) -> int:
        handle.process_calls += 1
        if handle.fail is not None:
            return handle.fail
        rcs = handle.values.get("process_rcs")
        if rcs:
            return rcs.pop(0)
        procs = handle.values.get("procs", Fail(2))
        if isinstance(procs, Fail):
            return procs.code
        count = count_ref._obj
        room = count.value
        for i, (pid, vram) in enumerate(procs[:room]):
            buffer[i].pid = pid
            buffer[i].memory_usage.vram_mem = vram
        count.value = len(procs)
        return 0 if len(procs) <= room else 41


class FakeSm:
    AmdSmiException = SmiError
    AmdSmiLibraryException = LibError
    AmdSmiInitFlags = SimpleNamespace(INIT_AMD_GPUS="INIT_AMD_GPUS")
    AmdSmiMemoryType = SimpleNamespace(VRAM="VRAM")
    AmdSmiTemperatureMetric = SimpleNamespace(CURRENT="CURRENT")
    AmdSmiTemperatureType = SimpleNamespace(HOTSPOT="HOTSPOT", EDGE="EDGE")

    def __init__(self, *devices: Dev) -> None:
        self.devices = list(devices)
        self.amdsmi_wrapper = Wrapper()
        self.calls: list[str] = []
        self.init_calls: list[Any] = []
        self.init_error: Exception | None = None
        self.handle_errors: list[int] = []

    def _get(self, handle: Dev, key: str) -> Any:
        self.calls.append(key)
        if handle.fail is not None:
            raise LibError(handle.fail)
        value = handle.values.get(key, Fail(2))
        if isinstance(value, Fail):
            raise LibError(value.code)
        return value

    def amdsmi_init(self, flags: Any) -> None:
        self.init_calls.append(flags)
        if self.init_error is not None:
            raise self.init_error

    def amdsmi_get_processor_handles(self) -> list[Dev]:
        if self.handle_errors:
            raise LibError(self.handle_errors.pop(0))
        return list(self.devices)

    def amdsmi_get_gpu_driver_info(self, h: Dev) -> Any:
        return self._get(h, "driver")

    def amdsmi_get_gpu_device_uuid(self, h: Dev) -> Any:
        return self._get(h, "uuid")

    def amdsmi_get_gpu_asic_info(self, h: Dev) -> Any:
        return self._get(h, "asic")

    def amdsmi_get_gpu_device_bdf(self, h: Dev) -> Any:
        return self._get(h, "bdf")

    def amdsmi_get_gpu_enumeration_info(self, h: Dev) -> Any:
        return self._get(h, "enum")

    def amdsmi_get_gpu_compute_partition(self, h: Dev) -> Any:
        return self._get(h, "compute")

    def amdsmi_get_gpu_memory_partition(self, h: Dev) -> Any:
        return self._get(h, "memory_partition")

    def amdsmi_get_gpu_kfd_info(self, h: Dev) -> Any:
        return self._get(h, "kfd")

    def amdsmi_get_gpu_memory_total(self, h: Dev, kind: Any) -> Any:
        assert kind == "VRAM"
        return self._get(h, "total")

    def amdsmi_get_gpu_memory_usage(self, h: Dev, kind: Any) -> Any:
        assert kind == "VRAM"
        return self._get(h, "used")

    def amdsmi_get_gpu_activity(self, h: Dev) -> Any:
        return self._get(h, "activity")

    def amdsmi_get_temp_metric(self, h: Dev, sensor: str, metric: str) -> Any:
        assert metric == "CURRENT"
        value = self._get(h, "temp").get(sensor, Fail(2))
        if isinstance(value, Fail):
            raise LibError(value.code)
        return value

    def amdsmi_get_power_info(self, h: Dev) -> Any:
        return self._get(h, "power")

    def amdsmi_get_power_cap_info(self, h: Dev) -> Any:
        return self._get(h, "cap")


def full(**over: Any) -> dict[str, Any]:
    """Every reading of one MI300X in SPX mode (``over`` replaces some; ``Fail(2)``: none)."""
    values: dict[str, Any] = {
        "driver": {"driver_version": "6.10.5"},
        "uuid": "uuid-0",
        "asic": {"market_name": MI300X, "asic_serial": "0x00000000000000AB"},
        "bdf": "0000:05:00.0",
        "enum": {"hip_id": 3, "hip_uuid": "GPU-4C2D1A9F8E3B6A70"},
        "compute": "SPX",
        "total": 192 * GiB,
        "used": 10 * GiB,
        "activity": {"gfx_activity": 40, "umc_activity": 12},
        "temp": {"HOTSPOT": 55, "EDGE": 44},
        "power": {"current_socket_power": 400, "average_socket_power": 390},
        "cap": {"power_cap": 750_000_000},
        "procs": [(0, 0), (1, GiB), (4242, 2 * GiB)],
    }
    values.update(over)
    return values


def proc(pid: int, used: int) -> ProcessSnapshot:
    return ProcessSnapshot(pid, used, user=f"user{pid}", command=f"command {pid}")


FULL = DeviceSnapshot(
    index=3, uuid="uuid-0", name=MI300X, pci_bus_id="0000:05:00.0",
    memory_total_bytes=192 * GiB, memory_used_bytes=10 * GiB, memory_free_bytes=182 * GiB,
    utilization_pct=40.0, memory_utilization_pct=12.0, temperature_c=55.0, power_w=400.0,
    power_limit_w=750.0, compute_mode=None, mig_enabled=False,
    processes=(proc(1, GiB), proc(4242, 2 * GiB)), vendor="amd",
    runtime_uuid="GPU-4c2d1a9f8e3b6a70", timestamp_s=NOW,
)


def want(**fields: Any) -> DeviceSnapshot:
    return DeviceSnapshot(**{**{f: getattr(FULL, f) for f in FULL.__slots__}, **fields})


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install a FakeSm as ``amdsmi`` in a fresh process state; a fixed clock and /proc."""
    monkeypatch.setattr(mod, "_state", mod._State())
    monkeypatch.setattr(mod, "time", SimpleNamespace(time=lambda: NOW))
    monkeypatch.setattr(procfs, "user_of", lambda pid: f"user{pid}")
    monkeypatch.setattr(procfs, "command_of", lambda pid: f"command {pid}")

    def install(*devices: Dev) -> FakeSm:
        sm = FakeSm(*devices)
        monkeypatch.setitem(sys.modules, "amdsmi", sm)
        return sm

    return install


def read_one(host: Any, **values: Any) -> DeviceSnapshot:
    host(Dev(**values))
    snap = AmdSmiBackend().snapshot()
    assert len(snap.devices) == 1
    return snap.devices[0]


# ---- devices ----
@pytest.mark.parametrize(
    ("over", "fields"),
    [
        ({}, {}),
        ({"asic": Fail(2)}, {"name": "AMD GPU", "runtime_uuid": "GPU-4c2d1a9f8e3b6a70"}),
        ({"asic": {"market_name": "N/A"}}, {"name": "AMD GPU"}),
        ({"asic": {"market_name": ""}}, {"name": "AMD GPU"}),
        ({"bdf": Fail(2)}, {"pci_bus_id": None}),
        ({"enum": {"hip_id": True, "hip_uuid": "N/A"}},
         {"index": 0, "runtime_uuid": "GPU-00000000000000ab"}),
        ({"enum": {"hip_id": 0}}, {"index": 0, "runtime_uuid": "GPU-00000000000000ab"}),
        ({"enum": Fail(2)}, {"index": 0, "runtime_uuid": "GPU-00000000000000ab"}),
        ({"compute": Fail(2)}, {}),
        ({"compute": "N/A"}, {}),
        ({"total": Fail(2)}, {"memory_total_bytes": None, "memory_free_bytes": None}),
        ({"used": Fail(3)}, {"memory_used_bytes": None, "memory_free_bytes": None}),
        ({"used": 192 * GiB}, {"memory_used_bytes": 192 * GiB, "memory_free_bytes": 0}),
        ({"used": 200 * GiB}, {"memory_used_bytes": 200 * GiB, "memory_free_bytes": 0}),
        ({"activity": Fail(2)}, {"utilization_pct": None, "memory_utilization_pct": None}),
        ({"activity": {"gfx_activity": "N/A", "umc_activity": True}},
         {"utilization_pct": None, "memory_utilization_pct": None}),
        ({"temp": {"HOTSPOT": Fail(2), "EDGE": 47}}, {"temperature_c": 47.0}),
        ({"temp": {"HOTSPOT": "N/A", "EDGE": 47.5}}, {"temperature_c": 47.5}),
        ({"temp": {}}, {"temperature_c": None}),
        ({"power": {"current_socket_power": "N/A", "average_socket_power": 390}},
         {"power_w": 390.0}),
        ({"power": Fail(2)}, {"power_w": None}),
        ({"cap": {"power_cap": 0}}, {"power_limit_w": None}),
        ({"cap": Fail(2)}, {"power_limit_w": None}),
        ({"procs": Fail(2)}, {"processes": None}),
        ({"procs": []}, {"processes": ()}),
    ],
)
def test_one_device_read_whole(host: Any, over: dict[str, Any], fields: dict[str, Any]) -> None:
    assert read_one(host, **full(**over)) == want(**fields)


@pytest.mark.parametrize(
    ("memory_mode", "kfd", "name"),
    [
        ("NPS4", {"current_partition_id": 3}, f"{MI300X} (CPX 3, NPS4)"),
        (Fail(2), Fail(2), f"{MI300X} (CPX 0)"),
        ("N/A", {"current_partition_id": "N/A"}, f"{MI300X} (CPX 0)"),
        ("NPS1", {"current_partition_id": True}, f"{MI300X} (CPX 0, NPS1)"),
    ],
)
def test_a_partition_is_named_with_its_modes_and_has_no_socket_values(
    host: Any, memory_mode: Any, kfd: Any, name: str
) -> None:
    values = full(compute="CPX", memory_partition=memory_mode, kfd=kfd)
    assert read_one(host, **values) == want(
        name=name, utilization_pct=None, memory_utilization_pct=None, temperature_c=None,
        power_w=None, power_limit_w=None)


@pytest.mark.parametrize(
    ("over", "partition"),
    [
        ({"compute": "CPX", "memory_partition": "NPS4", "kfd": {"current_partition_id": 5}},
         ("CPX", "NPS4", 5)),
        ({"compute": "DPX", "memory_partition": Fail(2), "kfd": Fail(2)}, ("DPX", "", 0)),
        ({"compute": "SPX"}, None),
    ],
)
def test_identity_read_whole(host: Any, over: dict[str, Any], partition: Any) -> None:
    sm = host()
    ident = AmdSmiBackend._read_identity(sm, 7, Dev(**full(**over)))
    name = MI300X if partition is None else f"{MI300X} ({partition[0]} {partition[2]}"
    if partition is not None:
        name += f", {partition[1]})" if partition[1] else ")"
    assert {k: getattr(ident, k) for k in ident.__slots__} == {
        "uuid": "uuid-0", "name": name, "bus_id": "0000:05:00.0", "index": 3,
        "runtime_uuid": "GPU-4c2d1a9f8e3b6a70", "partition": partition}


def test_processes_skip_empty_slots_and_carry_user_and_command(host: Any) -> None:
    procs = [(0, 5), (1, GiB), (0, 7), (7, 2 * GiB)]
    assert read_one(host, **full(procs=procs)).processes == (proc(1, GiB), proc(7, 2 * GiB))


def test_a_process_list_that_keeps_growing_is_given_up_after_four_tries(host: Any) -> None:
    dev = Dev(**full(process_rcs=[41, 15, 41, 41], procs=[(9, GiB)]))
    host(dev)
    assert AmdSmiBackend().snapshot().devices[0].processes is None
    assert dev.process_calls == 4


def test_a_process_list_read_on_the_fourth_try(host: Any) -> None:
    dev = Dev(**full(process_rcs=[41, 15, 41], procs=[(9, GiB)]))
    host(dev)
    assert AmdSmiBackend().snapshot().devices[0].processes == (proc(9, GiB),)
    assert dev.process_calls == 4


def test_identity_is_read_once(host: Any) -> None:
    sm = host(Dev(**full()), Dev(**full(uuid="uuid-1", enum={"hip_id": 4})))
    backend = AmdSmiBackend()
    backend.snapshot()
    second = backend.snapshot()
    assert [d.uuid for d in second.devices] == ["uuid-0", "uuid-1"]
    assert [d.index for d in second.devices] == [3, 4]
    assert sm.calls.count("uuid") == 2
    assert sm.calls.count("asic") == 2
    assert sm.calls.count("driver") == 1  # the driver's version is read once too


def unavailable(position: int, error: str) -> DeviceSnapshot:
    return DeviceSnapshot(index=position, uuid=f"unknown-{position}", name="unknown",
                          pci_bus_id=None, processes=None, available=False, error=error,
                          vendor="amd", timestamp_s=NOW)


@pytest.mark.parametrize(
    ("code", "error"),
    [(10, "no permission"), (12, "amdsmi error: AMDSMI_STATUS_IO"),
     (2, "amdsmi error: AMDSMI_STATUS_NOT_SUPPORTED")],
)
def test_a_failing_device_is_listed_unavailable_and_logged(
    host: Any, caplog: pytest.LogCaptureFixture, code: int, error: str
) -> None:
    host(Dev(**full()), Dev(fail=code))
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    snap = AmdSmiBackend().snapshot()
    assert snap.devices == (FULL, unavailable(1, error))
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        f"AMD GPU 1 unavailable: amdsmi status {code}"]


def test_a_known_device_that_fails_keeps_its_identity(host: Any) -> None:
    dev = Dev(**full(enum={"hip_id": 5, "hip_uuid": "N/A"}))
    host(Dev(**full(uuid="uuid-x")), dev)
    backend = AmdSmiBackend()
    backend.snapshot()
    dev.values["procs"] = Fail(10)  # the process list refused: the rc becomes the exception
    assert backend.snapshot().devices[1] == DeviceSnapshot(
        index=5, uuid="uuid-0", name=MI300X, pci_bus_id="0000:05:00.0", processes=None,
        available=False, error="no permission", vendor="amd", timestamp_s=NOW)
    dev.values["procs"] = [(3, GiB)]
    assert backend.snapshot().devices[1] == want(index=5, processes=(proc(3, GiB),),
                                                 runtime_uuid="GPU-00000000000000ab")


# ---- fleets ----
@pytest.mark.parametrize(
    ("driver", "version"),
    [({"driver_version": "6.10.5"}, "6.10.5"), ({"driver_version": 6}, "6"),
     ({"driver_version": "N/A"}, None), ({}, None), (Fail(2), None)],
)
def test_fleet_snapshot_whole(host: Any, driver: Any, version: str | None) -> None:
    host(Dev(**full(driver=driver)))
    assert AmdSmiBackend().snapshot() == FleetSnapshot(
        devices=(FULL,), timestamp_s=NOW, backend="amdsmi", driver_version=version)


def test_no_devices_is_an_empty_fleet(host: Any) -> None:
    host()
    assert AmdSmiBackend().snapshot() == FleetSnapshot(
        devices=(), timestamp_s=NOW, backend="amdsmi", driver_version=None)


def test_amdsmi_shut_down_behind_our_back_is_initialised_again(
    host: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sm = host(Dev(**full()))
    backend = AmdSmiBackend()
    backend.snapshot()
    sm.handle_errors = [32]
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    assert backend.snapshot().devices == (FULL,)
    assert sm.init_calls == ["INIT_AMD_GPUS", "INIT_AMD_GPUS"]
    assert sm.calls.count("uuid") == 2  # identities were read again
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == LOGGER] == [
        ("WARNING", "amdsmi was shut down behind our back; initialising it again")]


@pytest.mark.parametrize(
    ("errors", "message"),
    [
        ([32, 32], "amdsmi stopped working in this process "
                   "(AMDSMI_STATUS_NOT_INIT - what went wrong)"),
        ([12], "amdsmi cannot list the GPUs (AMDSMI_STATUS_IO - what went wrong)"),
        ([34], "no AMD GPU driver on this host (amdsmi: the amdgpu driver is not loaded)"),
    ],
)
def test_a_fleet_that_cannot_be_listed_is_one_message(
    host: Any, errors: list[int], message: str
) -> None:
    sm = host(Dev(**full()))
    sm.handle_errors = list(errors)  # a copy: the parameter list is shared by every run
    with pytest.raises(NVMLUnavailableError) as err:
        AmdSmiBackend().snapshot()
    assert str(err.value) == message


def test_warm_up_swallows_a_missing_library(host: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    backend = AmdSmiBackend()
    assert backend.warm_up() is None
    with pytest.raises(NVMLUnavailableError, match=r"^cannot import amdsmi "):
        backend.snapshot()


# ---- initialisation ----
# What the module's state holds (the imported binding, the import's remembered failure) shows
# through the snapshots: how often the library is initialised, a failure said again in the same
# words without importing again.
def test_state_starts_empty() -> None:
    """A reasoned private seam: a fresh state (a new process) holds no binding, no failure and
    an unlocked lock of the threading kind; nothing public reads a state before its first use."""
    state = mod._State()
    assert (state.module, state.import_error) == (None, None)
    assert state.lock.acquire(blocking=False)
    state.lock.release()
    assert isinstance(state.lock, type(threading.Lock()))


def test_init_imports_and_initialises_once(host: Any) -> None:
    """The library is initialised at the first snapshot only, whatever backend asks next; a
    library shut down behind our back is initialised again (below)."""
    sm = host(Dev(**full()))
    assert AmdSmiBackend().snapshot().devices == (FULL,)
    assert AmdSmiBackend().snapshot().devices == (FULL,)
    assert sm.init_calls == ["INIT_AMD_GPUS"]


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (LibError(34), "no AMD GPU driver on this host (amdsmi: the amdgpu driver is not loaded)"
                       + SIMULATE),
        (LibError(10), "amdsmi cannot be used on this host (no permission to open the AMD GPU "
                       "devices: join the 'render' and 'video' groups)"),
        (LibError(18), "amdsmi cannot be used on this host "
                       "(amdsmi_init: AMDSMI_STATUS_INIT_ERROR - what went wrong)"),
        (SmiError("bad things"), "amdsmi cannot be used on this host (bad things)"),
    ],
)
def test_init_failures_are_one_message(host: Any, error: Exception, message: str) -> None:
    sm = host(Dev(**full()))
    sm.init_error = error
    with pytest.raises(NVMLUnavailableError) as err:
        AmdSmiBackend().snapshot()
    assert str(err.value) == message
    assert err.value.__cause__ is error
    sm.init_error = None  # fixed (the driver loaded): the next snapshot initialises and reads
    assert AmdSmiBackend().snapshot().devices == (FULL,)
    assert sm.init_calls == ["INIT_AMD_GPUS", "INIT_AMD_GPUS"]


def test_code_of_an_error() -> None:
    """A reasoned private seam: an error of the binding without a status code (a ValueError)
    is no case the fake binding's calls raise; the code reader is asked directly."""
    assert mod._code(FakeSm(), LibError(12)) == 12
    assert mod._code(FakeSm(), ValueError(12)) is None


# ---- import ----
def test_no_binding_installed_is_said_and_remembered(
    host: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AMD's binding a snapshot says how to install it; the failed import is
    remembered: a binding installed later in the same process is not imported (a new process
    would)."""
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    message = ("cannot import amdsmi (import of amdsmi halted; None in sys.modules); "
               "install AMD's binding: pip install 'autogpu-jupyter[amd]'")
    for _ in range(2):
        with pytest.raises(NVMLUnavailableError) as err:
            AmdSmiBackend().snapshot()
        assert str(err.value) == message
    sm = host()  # the binding appears, in this process only
    with pytest.raises(NVMLUnavailableError, match=r"^cannot import amdsmi "):
        AmdSmiBackend().snapshot()
    assert sm.init_calls == []


@pytest.mark.parametrize(
    ("raise_", "message"),
    [
        ("KeyError('libamd_smi.so')",
         "no AMD GPU driver on this host (libamd_smi.so not found)" + SIMULATE),
        ("OSError('libamd_smi.so: undefined symbol: amdsmi_x')",
         "the amdsmi binding cannot use this host's libamd_smi.so (OSError: libamd_smi.so: "
         "undefined symbol: amdsmi_x); install the amdsmi release that matches the installed "
         "ROCm"),
        ("AttributeError('amdsmi_y')",
         "the amdsmi binding cannot use this host's libamd_smi.so (AttributeError: amdsmi_y); "
         "install the amdsmi release that matches the installed ROCm"),
    ],
)
def test_a_binding_that_cannot_load_the_library_is_silenced_and_one_message(
    host: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
    raise_: str, message: str,
) -> None:
    (tmp_path / "amdsmi.py").write_text(
        f"print('Unable to find libamd_smi.so')\nprint('second line')\nraise {raise_}\n",
        encoding="utf-8")
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    for _ in range(2):  # the second time from memory: not imported (nor printed) again
        with pytest.raises(NVMLUnavailableError) as err:
            AmdSmiBackend().snapshot()
        assert str(err.value) == message
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER] == [
        "amdsmi import printed: Unable to find libamd_smi.so\nsecond line"]


# ---- the library's places ----
@pytest.mark.parametrize(
    ("environ", "candidates"),
    [
        ({}, ["libamd_smi.so", "/opt/rocm/lib/libamd_smi.so"]),
        ({"ROCM_HOME": "/h"}, ["/h/lib/libamd_smi.so", "libamd_smi.so",
                               "/opt/rocm/lib/libamd_smi.so"]),
        ({"ROCM_PATH": "/p"}, ["/p/lib/libamd_smi.so", "libamd_smi.so", "/p/lib/libamd_smi.so"]),
        ({"ROCM_HOME": "/h", "ROCM_PATH": "/p"},
         ["/h/lib/libamd_smi.so", "libamd_smi.so", "/p/lib/libamd_smi.so"]),
        ({"ROCM_HOME": "", "ROCM_PATH": "/p"}, ["libamd_smi.so", "/p/lib/libamd_smi.so"]),
    ],
)
def test_library_candidates(environ: dict[str, str], candidates: list[str]) -> None:
    assert mod.library_candidates(environ) == candidates


def test_library_candidates_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROCM_HOME", "/env-home")
    monkeypatch.delenv("ROCM_PATH", raising=False)
    assert mod.library_candidates() == ["/env-home/lib/libamd_smi.so", "libamd_smi.so",
                                        "/opt/rocm/lib/libamd_smi.so"]
    assert mod.library_candidates({}) == ["libamd_smi.so", "/opt/rocm/lib/libamd_smi.so"]


@pytest.mark.parametrize(
    ("loadable", "present"),
    [(set(), False), ({"/p/lib/libamd_smi.so"}, True), ({"/h/lib/libamd_smi.so"}, True)],
)
def test_library_present_tries_every_candidate(
    monkeypatch: pytest.MonkeyPatch, loadable: set[str], present: bool
) -> None:
    monkeypatch.setenv("ROCM_HOME", "/h")
    monkeypatch.setenv("ROCM_PATH", "/p")
    asked: list[object] = []

    def cdll(name: object, *args: object, **kwargs: object) -> object:
        asked.append(name)
        if name not in loadable:
            raise OSError(f"{name}: cannot open shared object file")
        return object()

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    assert mod.library_present() is present
    every = ["/h/lib/libamd_smi.so", "libamd_smi.so", "/p/lib/libamd_smi.so"]
    assert asked == (every[:1] if "/h/lib/libamd_smi.so" in loadable else every)


# ---- ROCr's UUID ----
@pytest.mark.parametrize(
    ("hip_uuid", "serial", "result"),
    [
        ("GPU-", "0x10", "GPU-0000000000000010"),
        ("GPU-a", "N/A", "GPU-000000000000000a"),
        (None, None, None),
        (None, 17, None),
        (None, "0x1", "GPU-0000000000000001"),
        (None, "0x0", None),
        (None, "0xFFFFFFFFFFFFFFFE", "GPU-fffffffffffffffe"),
    ],
)
def test_rocr_uuid_edges(hip_uuid: Any, serial: Any, result: str | None) -> None:
    assert _runtime_uuid(hip_uuid, serial) == result
