"""The amdsmi backend through AMD's real ``amdsmi`` binding over the fake ``libamd_smi.so``.

Every value a user would see is asserted exactly: identity, memory, load, partitions, what is
unknown, per-device failures, and which backend a host gets.
"""

from __future__ import annotations

import ctypes

import pytest

from autogpu_jupyter.core.backends import choose_backend, get_backend
from autogpu_jupyter.core.backends.amdsmi import AmdSmiBackend, _runtime_uuid
from autogpu_jupyter.core.devices import DeviceSnapshot, ProcessSnapshot
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
