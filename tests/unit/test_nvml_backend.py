"""The NVML backend in this process: the real pynvml binding over the fake ``libnvidia-ml.so.1``.

Scenario tests in gpustat's style: each writes a fleet, reads it back and asserts the exact values a
user would see. Everything here runs in the test process (fast, in the mutation-test selection);
checks that need another library or no library at all are in
``tests/processes/test_nvml_backend.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.nvml import NvmlBackend
from autogpu_jupyter.core.devices import DeviceSnapshot, ProcessSnapshot
from autogpu_jupyter.errors import NVMLUnavailableError
from tests.fakenvml import (
    FakeNvml,
    GiB,
    MiB,
    fleet_4x,
    fleet_8x,
    fleet_edge_cases,
    fleet_mig,
    preload_fake_nvml,
)

ME = pwd.getpwuid(os.getuid()).pw_name

A100 = "NVIDIA A100-SXM4-80GB"
L4 = "NVIDIA L4"
UUID0 = "GPU-a1000000-a100-4000-8000-0000f00d0000"
UUID1 = "GPU-a1000001-a100-4001-8001-0000f00d0001"


NVML_LOGGER = "autogpu_jupyter.core.backends.nvml"


def strip_time(dev: DeviceSnapshot) -> DeviceSnapshot:
    return dataclasses.replace(dev, timestamp_s=0.0)


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == NVML_LOGGER]

@pytest.fixture
def sleeper() -> Any:
    """A real process with a known command line, to stand in the fake driver's process list."""
    proc = subprocess.Popen(["sleep", "60"])
    # Hand it over once it has exec'd: before that, /proc shows our own command line.
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while cmdline.read_bytes() != b"sleep\x0060\x00" and time.monotonic() < deadline:
        time.sleep(0.005)
    yield proc
    proc.kill()
    proc.wait()


# ---- a healthy fleet ------------------------------------------------------------------------


def test_8x_fleet_every_field(fake_nvml: FakeNvml, sleeper: subprocess.Popen[bytes]) -> None:
    fleet = fleet_8x()
    fleet["devices"][0]["processes"] = [
        {"pid": sleeper.pid, "used_memory": 1536 * MiB},
        {"pid": 4_000_001, "used_memory": None},  # no such process; memory "not available"
    ]
    fake_nvml.write(fleet)

    snap = NvmlBackend().snapshot()

    assert snap.backend == "nvml"
    assert snap.simulated is False
    assert snap.driver_version == "550.54.15"
    assert snap.errors == ()
    assert [d.name for d in snap.devices] == [A100] * 4 + [L4] * 4
    assert [d.index for d in snap.devices] == list(range(8))
    assert [d.pci_bus_id for d in snap.devices] == [
        "00000000:07:00.0", "00000000:17:00.0", "00000000:27:00.0", "00000000:37:00.0",
        "00000000:47:00.0", "00000000:57:00.0", "00000000:67:00.0", "00000000:77:00.0",
    ]
    assert strip_time(snap.devices[0]) == DeviceSnapshot(
        index=0,
        uuid=UUID0,
        name=A100,
        pci_bus_id="00000000:07:00.0",
        memory_total_bytes=80 * GiB,
        # v2 memory: the driver's 512 MiB reservation is neither used nor free
        memory_used_bytes=2 * GiB,
        memory_free_bytes=80 * GiB - 512 * MiB - 2 * GiB,
        utilization_pct=3.0,
        memory_utilization_pct=1.0,
        temperature_c=33.0,
        power_w=69.6,
        power_limit_w=400.0,
        compute_mode="DEFAULT",
        mig_enabled=False,
        processes=(
            ProcessSnapshot(pid=sleeper.pid, used_memory_bytes=1536 * MiB, user=ME,
                            command="sleep 60"),
            ProcessSnapshot(pid=4_000_001, used_memory_bytes=None, user=None, command=None),
        ),
        available=True,
        error=None,
    )
    l4 = snap.devices[5]
    assert (l4.uuid, l4.memory_total_bytes, l4.memory_used_bytes, l4.memory_free_bytes) == (
        "GPU-a1000005-l4ff-4005-8005-0000f00d0005", 23034 * MiB, 12 * GiB,
        23034 * MiB - 428 * MiB - 12 * GiB,
    )
    assert (l4.utilization_pct, l4.power_w, l4.power_limit_w, l4.mig_enabled) == (
        80.0, 56.9, 72.0, False,
    )
    assert [d.processes for d in snap.devices[2:4]] == [
        (), (ProcessSnapshot(pid=1_000_003, used_memory_bytes=70 * GiB),),
    ]


def test_same_fleet_reads_the_same_as_the_simulated_backend(
    fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    fleet = fleet_8x()
    for dev in fleet["devices"]:
        dev.pop("reserved_memory")  # the simulated backend has no driver reservation
    fake_nvml.write(fleet)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet))

    ours = [strip_time(d) for d in NvmlBackend().snapshot().devices]
    simulated = [strip_time(d) for d in SimulatedBackend(str(path)).snapshot().devices]
    assert ours == simulated


def test_load_moves_while_the_backend_lives(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    assert backend.snapshot().devices[1].utilization_pct == 97.0

    fake_nvml.set(1, utilization_pct=4, memory_used=5 * GiB, compute_mode="EXCLUSIVE_PROCESS")
    dev = backend.snapshot().devices[1]
    assert (dev.utilization_pct, dev.memory_used_bytes, dev.compute_mode) == (
        4.0, 5 * GiB, "EXCLUSIVE_PROCESS",
    )


def test_a_half_written_scenario_keeps_the_last_good_one(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    assert len(backend.snapshot().devices) == 4
    # A writer that did not use temp + rename, caught mid-write: no "end" line yet.
    fake_nvml.scenario_path.write_text("driver 550.54.15\ngpu\nuuid GPU-half\n")
    assert [d.uuid for d in backend.snapshot().devices][:2] == [UUID0, UUID1]


def test_compute_modes(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    modes = ["DEFAULT", "EXCLUSIVE_THREAD", "PROHIBITED", "EXCLUSIVE_PROCESS"]
    for dev, mode in zip(fleet["devices"], modes):
        dev["compute_mode"] = mode
    fake_nvml.write(fleet)
    assert [d.compute_mode for d in NvmlBackend().snapshot().devices] == modes


# ---- what goes wrong on real hosts ------------------------------------------------------------


def test_lost_and_forbidden_gpus_are_listed_unavailable(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_edge_cases())
    snap = NvmlBackend().snapshot()

    assert [(d.index, d.available, d.error) for d in snap.devices] == [
        (0, True, None),
        (1, False, "GPU is lost"),
        (2, False, "no permission"),
        (3, True, None),
        (4, True, None),
    ]
    # A fresh process cannot learn the identity of a GPU whose handle fails.
    assert strip_time(snap.devices[1]) == DeviceSnapshot(
        index=1, uuid="unknown-1", name="unknown", processes=None, available=False,
        error="GPU is lost",
    )
    assert snap.devices[2].uuid == "unknown-2"
    assert snap.devices[4].compute_mode == "PROHIBITED"


def test_a_gpu_lost_while_running_keeps_its_identity_and_comes_back(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    backend.snapshot()

    fake_nvml.set(1, lost=True)
    lost = backend.snapshot().devices[1]
    assert (lost.uuid, lost.name, lost.pci_bus_id, lost.available, lost.error) == (
        UUID1, A100, "00000000:17:00.0", False, "GPU is lost",
    )
    assert lost.memory_total_bytes is None
    assert backend.snapshot().devices[0].available is True

    fake_nvml.set(1, lost=False)
    back = backend.snapshot().devices[1]
    assert (back.uuid, back.available, back.utilization_pct) == (UUID1, True, 97.0)


def test_utilisation_not_supported_is_none(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_edge_cases())
    dev = NvmlBackend().snapshot().devices[3]
    assert (dev.utilization_pct, dev.memory_utilization_pct) == (None, None)
    assert (dev.memory_used_bytes, dev.temperature_c, dev.available) == (70 * GiB, 57.0, True)


def test_each_field_not_supported_is_none(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fleet["devices"][0]["unsupported"] = [
        "temp", "power", "power_limit", "compute_mode", "memory", "processes", "pci",
    ]
    fake_nvml.write(fleet)
    dev = NvmlBackend().snapshot().devices[0]
    assert strip_time(dev) == DeviceSnapshot(
        index=0, uuid=UUID0, name=A100, pci_bus_id=None, utilization_pct=3.0,
        memory_utilization_pct=1.0, mig_enabled=False, processes=None,
    )


def test_mig_devices(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_mig())
    devices = [strip_time(d) for d in NvmlBackend().snapshot().devices]

    parent_uuid = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
    job = ProcessSnapshot(pid=2_000_001, used_memory_bytes=10 * GiB)
    assert [(d.label, d.uuid) for d in devices] == [
        ("GPU 0", parent_uuid),
        ("GPU 0 MIG 0", "MIG-11111111-aaaa-5bbb-8ccc-000000000001"),
        ("GPU 0 MIG 1", "MIG-22222222-aaaa-5bbb-8ccc-000000000002"),
        ("GPU 1", "GPU-0b0b0b0b-1111-2222-3333-444444444444"),
    ]
    parent = devices[0]
    assert (parent.mig_enabled, parent.is_mig, parent.utilization_pct, parent.temperature_c) == (
        True, False, None, 41.0,
    )
    assert parent.processes == (job,)  # NVML lists a MIG device's processes on its GPU too
    assert devices[1] == DeviceSnapshot(
        index=0,
        uuid="MIG-11111111-aaaa-5bbb-8ccc-000000000001",
        name=f"{A100} MIG 3g.40gb",
        pci_bus_id="00000000:07:00.0",
        memory_total_bytes=40 * GiB - 512 * MiB,
        memory_used_bytes=10 * GiB,
        memory_free_bytes=30 * GiB - 512 * MiB,
        compute_mode="DEFAULT",
        mig_enabled=True,
        is_mig=True,
        parent_uuid=parent_uuid,
        mig_index=0,
        processes=(job,),
    )
    assert (devices[2].memory_free_bytes, devices[2].processes) == (9856 * MiB, ())
    assert (devices[3].mig_enabled, devices[3].utilization_pct) == (False, 0.0)


def test_a_gpu_that_cannot_do_mig_reads_mig_disabled(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_8x())
    fake_nvml.reset_calls()
    devices = NvmlBackend().snapshot().devices
    assert [d.mig_enabled for d in devices] == [False] * 8  # L4: MIG mode NOT_SUPPORTED
    assert fake_nvml.calls("nvmlDeviceGetMaxMigDeviceCount") == 0  # no MIG slots looked for


def test_memory_v2_version_mismatch_falls_back_to_v1(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger=NVML_LOGGER)
    fleet = fleet_4x()
    fleet["memory_v2_error"] = "version_mismatch"
    fake_nvml.write(fleet)
    backend = NvmlBackend()
    dev = backend.snapshot().devices[0]
    # v1 counts the 512 MiB the driver reserves as used
    assert (dev.memory_used_bytes, dev.memory_free_bytes) == (
        2 * GiB + 512 * MiB, 80 * GiB - 2 * GiB - 512 * MiB,
    )
    assert logged(caplog) == [("DEBUG", "nvmlDeviceGetMemoryInfo_v2 unavailable: using v1")]
    fake_nvml.reset_calls()
    backend.snapshot()  # v2 is not tried again
    assert fake_nvml.calls("nvmlDeviceGetMemoryInfo_v2") == 0
    assert fake_nvml.calls("nvmlDeviceGetMemoryInfo") == 4


def test_gpu_count_change_drops_cached_identities(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_8x())
    backend = NvmlBackend()
    assert len(backend.snapshot().devices) == 8
    fake_nvml.write(fleet_4x())  # indices 2 and 3 are now other GPUs
    assert [d.uuid[:12] for d in backend.snapshot().devices] == [
        "GPU-a1000000", "GPU-a1000001", "GPU-a1000004", "GPU-a1000005",
    ]


# ---- NVML's lifetime in the process -----------------------------------------------------------


def test_handles_and_identity_are_read_once_and_nvml_never_shut_down(
    fake_nvml: FakeNvml,
) -> None:
    fake_nvml.write(fleet_8x())
    backend = NvmlBackend()
    fake_nvml.reset_calls()
    for _ in range(3):
        backend.snapshot()
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 8
    assert fake_nvml.calls("nvmlDeviceGetUUID") == 8
    assert fake_nvml.calls("nvmlDeviceGetPciInfo_v3") == 8
    assert fake_nvml.calls("nvmlDeviceGetCount_v2") == 3
    assert fake_nvml.calls("nvmlDeviceGetMemoryInfo_v2") == 24
    assert fake_nvml.calls("nvmlShutdown") == 0


def test_survives_someone_elses_extra_shutdown(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    import pynvml

    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    backend.snapshot()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        while True:  # drop every init of this process, ours included
            pynvml.nvmlShutdown()
    caplog.set_level("WARNING", logger=NVML_LOGGER)
    fake_nvml.reset_calls()
    assert [d.uuid for d in backend.snapshot().devices][:2] == [UUID0, UUID1]
    assert logged(caplog) == [
        ("WARNING", "NVML was shut down behind our back; initialising it again"),
    ]
    # the handles of the dead session are dropped: every GPU is looked up again
    assert fake_nvml.calls("nvmlInitWithFlags") == 1
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 4


def test_get_backend_serves_nvml_without_simulation(fake_nvml: FakeNvml) -> None:
    from autogpu_jupyter.core.backends import get_backend

    fake_nvml.write(fleet_4x())
    backend = get_backend()
    assert isinstance(backend, NvmlBackend)
    assert (backend.name, backend.simulated) == ("nvml", False)
    assert len(backend.snapshot().devices) == 4


def test_driver_not_loaded_in_this_process_raises_clear_error(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    backend.snapshot()
    fake_nvml.set_driver(driver="none")  # the driver is unloaded under a running kernel
    with pytest.raises(NVMLUnavailableError, match=r"^no NVIDIA driver on this host \(NVML: Dri"):
        backend.snapshot()


# ---- more of what goes wrong, read in this process --------------------------------------------


def test_other_nvml_errors_name_the_error(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger=NVML_LOGGER)
    fleet = fleet_4x()
    fleet["devices"][1]["error"] = "unknown"
    fake_nvml.write(fleet)
    devices = NvmlBackend().snapshot().devices
    assert logged(caplog) == [("DEBUG", "GPU 1 unavailable: Unknown Error")]
    assert [(d.uuid, d.available, d.error) for d in devices] == [
        (UUID0, True, None),
        ("unknown-1", False, "NVML error: Unknown Error"),
        ("GPU-a1000004-l4ff-4004-8004-0000f00d0004", True, None),
        ("GPU-a1000005-l4ff-4005-8005-0000f00d0005", True, None),
    ]


def test_a_lost_mig_device_is_listed_under_its_gpu(fake_nvml: FakeNvml) -> None:
    fleet = fleet_mig()
    fleet["devices"][0]["mig_devices"][1]["error"] = "lost"
    fake_nvml.write(fleet)
    devices = [strip_time(d) for d in NvmlBackend().snapshot().devices]
    parent_uuid = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
    assert [(d.label, d.available) for d in devices] == [
        ("GPU 0", True), ("GPU 0 MIG 0", True), ("GPU 0 MIG 1", False), ("GPU 1", True),
    ]
    assert devices[2] == DeviceSnapshot(
        index=0, uuid=f"{parent_uuid}/mig-1", name=f"{A100} MIG", pci_bus_id="00000000:07:00.0",
        mig_enabled=True, is_mig=True, parent_uuid=parent_uuid, mig_index=1, processes=None,
        available=False, error="GPU is lost",
    )


def test_a_mig_device_without_name_memory_or_processes(fake_nvml: FakeNvml) -> None:
    fleet = fleet_mig()
    fleet["devices"][0]["mig_devices"][1]["unsupported"] = ["name", "memory", "processes"]
    fake_nvml.write(fleet)
    mig = strip_time(NvmlBackend().snapshot().devices[2])
    assert mig == DeviceSnapshot(
        index=0, uuid="MIG-22222222-aaaa-5bbb-8ccc-000000000002", name=f"{A100} MIG",
        pci_bus_id="00000000:07:00.0", compute_mode="DEFAULT", mig_enabled=True, is_mig=True,
        parent_uuid="GPU-0a0a0a0a-1111-2222-3333-444444444444", mig_index=1, processes=None,
    )


def test_every_device_is_stamped_when_it_is_read(fake_nvml: FakeNvml) -> None:
    fleet = fleet_mig()
    fleet["devices"][0]["mig_devices"][1]["error"] = "lost"
    fleet["devices"][1]["lost"] = True
    fake_nvml.write(fleet)
    snap = NvmlBackend().snapshot()
    after = time.time()
    assert [d.available for d in snap.devices] == [True, True, False, False]
    assert all(snap.timestamp_s <= d.timestamp_s <= after for d in snap.devices)


def test_a_gpu_with_no_mig_slots_reads_none(fake_nvml: FakeNvml) -> None:
    fleet = fleet_mig()
    fleet["devices"][0]["max_mig_devices"] = 0
    fake_nvml.write(fleet)
    fake_nvml.reset_calls()
    devices = NvmlBackend().snapshot().devices
    assert [(d.label, d.mig_enabled) for d in devices] == [("GPU 0", True), ("GPU 1", False)]
    assert fake_nvml.calls("nvmlDeviceGetMigDeviceHandleByIndex") == 0


def test_mig_slots_beyond_the_count_are_not_read(fake_nvml: FakeNvml) -> None:
    fleet = fleet_mig()
    fleet["devices"][0]["max_mig_devices"] = 1
    fake_nvml.write(fleet)
    assert [d.label for d in NvmlBackend().snapshot().devices] == ["GPU 0", "GPU 0 MIG 0", "GPU 1"]


def test_empty_mig_slots_between_devices_are_skipped(fake_nvml: FakeNvml) -> None:
    # After an instance in the middle was destroyed, slots 0 and 2 answer NOT_FOUND.
    fleet = fleet_mig()
    fleet["devices"][0]["mig_devices"][0]["slot"] = 1
    fleet["devices"][0]["mig_devices"][1]["slot"] = 3
    fake_nvml.write(fleet)
    devices = NvmlBackend().snapshot().devices
    assert [(d.label, d.uuid) for d in devices] == [
        ("GPU 0", "GPU-0a0a0a0a-1111-2222-3333-444444444444"),
        ("GPU 0 MIG 1", "MIG-11111111-aaaa-5bbb-8ccc-000000000001"),
        ("GPU 0 MIG 3", "MIG-22222222-aaaa-5bbb-8ccc-000000000002"),
        ("GPU 1", "GPU-0b0b0b0b-1111-2222-3333-444444444444"),
    ]


def test_nvml_starts_from_a_fresh_process_state_and_warns_of_a_shadowing_binding(
    fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh process: no module yet, no binding note yet. The first use initialises NVML,
    checks the binding once (here a deprecated ``pynvml`` distribution sits beside it) and
    reports it with every snapshot."""
    import pynvml

    from autogpu_jupyter.core.backends import nvml

    site = tmp_path / "site"
    (site / "pynvml-11.5.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(pynvml, "__file__", str(site / "pynvml.py"))
    monkeypatch.setattr(nvml, "_state", nvml._State())  # reasoned: a fresh process
    fake_nvml.write(fleet_4x())
    note = "the deprecated 'pynvml' distribution 11.5.0 is installed" + FIX
    with pytest.warns(UserWarning) as caught:
        first = NvmlBackend().snapshot()
    assert [str(w.message) for w in caught] == [note]
    assert (len(first.devices), first.errors) == (4, (note,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert NvmlBackend().snapshot().errors == (note,)


def test_a_gpu_without_a_name_reads_unknown(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fleet["devices"][0]["unsupported"] = ["name"]
    fake_nvml.write(fleet)
    dev = NvmlBackend().snapshot().devices[0]
    assert (dev.uuid, dev.name, dev.pci_bus_id, dev.available) == (
        UUID0, "unknown", "00000000:07:00.0", True
    )


def test_processes_without_a_pid_are_skipped(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fleet["devices"][0]["processes"] = [
        {"pid": 0, "used_memory": GiB}, {"pid": 4_000_002, "used_memory": 0},
        {"pid": 1, "used_memory": 2 * GiB},  # a container's first process: a real one
    ]
    fake_nvml.write(fleet)
    processes = NvmlBackend().snapshot().devices[0].processes
    assert processes is not None
    assert [p.pid for p in processes] == [4_000_002, 1]
    assert processes[0] == ProcessSnapshot(pid=4_000_002, used_memory_bytes=0)
    assert processes[1].used_memory_bytes == 2 * GiB


def test_more_processes_than_one_read_holds(fake_nvml: FakeNvml) -> None:
    """Past 32 processes the first read answers INSUFFICIENT_SIZE with the count: one more read,
    with room to spare, lists them all."""
    gpu = fleet_4x()["devices"][0]
    gpu["processes"] = [{"pid": 3_000_000 + i, "used_memory": i * MiB} for i in range(40)]
    fake_nvml.write({"devices": [gpu]})
    fake_nvml.reset_calls()
    processes = NvmlBackend().snapshot().devices[0].processes
    assert processes == tuple(
        ProcessSnapshot(pid=3_000_000 + i, used_memory_bytes=i * MiB) for i in range(40)
    )
    assert fake_nvml.calls("nvmlDeviceGetComputeRunningProcesses_v3") == 2


def test_a_process_list_that_outgrows_every_read_is_unknown(fake_nvml: FakeNvml) -> None:
    """A list that keeps growing past each sized read is given up after four reads: the GPU's
    processes read as unknown, the rest of it as usual."""
    gpu = fleet_4x()["devices"][0]
    gpu["processes_outgrow"] = True
    fake_nvml.write({"devices": [gpu]})
    fake_nvml.reset_calls()
    dev = NvmlBackend().snapshot().devices[0]
    assert (dev.processes, dev.available, dev.memory_used_bytes) == (None, True, 2 * GiB)
    assert fake_nvml.calls("nvmlDeviceGetComputeRunningProcesses_v3") == 4


def test_a_compute_mode_without_a_name_reads_as_its_number(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fleet["devices"][0]["compute_mode"] = 7  # a mode of a newer driver
    fake_nvml.write(fleet)
    assert [d.compute_mode for d in NvmlBackend().snapshot().devices] == ["7"] + ["DEFAULT"] * 3


def test_the_enforced_power_limit_and_its_fallback(fake_nvml: FakeNvml) -> None:
    """The enforced limit (lower where another limit applies) is the limit; a board without it
    reads its management limit."""
    fleet = fleet_4x()
    fleet["devices"][0]["enforced_power_limit_w"] = 350.0
    fleet["devices"][1]["unsupported"] = ["enforced_power_limit"]
    fake_nvml.write(fleet)
    limits = [d.power_limit_w for d in NvmlBackend().snapshot().devices]
    assert limits == [350.0, 400.0, 72.0, 72.0]


def test_a_pending_mig_mode_change_is_not_the_current_mode(fake_nvml: FakeNvml) -> None:
    """After ``nvidia-smi -mig 1|0`` the new mode is only pending until the GPU is reset."""
    fleet = fleet_mig()
    fleet["devices"][0]["mig_pending"] = False  # MIG on, to be turned off at the next reset
    fleet["devices"][1]["mig_pending"] = True  # MIG off, to be turned on
    fake_nvml.write(fleet)
    devices = NvmlBackend().snapshot().devices
    assert [(d.label, d.mig_enabled) for d in devices] == [
        ("GPU 0", True), ("GPU 0 MIG 0", True), ("GPU 0 MIG 1", True), ("GPU 1", False),
    ]


def test_a_current_driver_is_read_with_its_newest_calls(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger=NVML_LOGGER)
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    fake_nvml.reset_calls()
    temperatures = [[d.temperature_c for d in backend.snapshot().devices] for _ in range(2)]
    assert temperatures == [[33.0, 76.0, 37.0, 68.0]] * 2
    newest = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetMemoryInfo_v2",
              "nvmlDeviceGetComputeRunningProcesses_v3")
    older = ("nvmlDeviceGetTemperature", "nvmlDeviceGetMemoryInfo",
             "nvmlDeviceGetComputeRunningProcesses_v2", "nvmlDeviceGetComputeRunningProcesses")
    assert [fake_nvml.calls(name) for name in newest + older] == [8, 8, 8, 0, 0, 0, 0]
    assert logged(caplog) == []


def test_a_binding_without_the_versioned_temperature_call(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvidia-ml-py 12.535 (our oldest) has no ``nvmlDeviceGetTemperatureV``."""
    import pynvml

    monkeypatch.delattr(pynvml, "nvmlDeviceGetTemperatureV")
    fleet = fleet_4x()
    fleet["devices"][2]["unsupported"] = ["temp"]
    fake_nvml.write(fleet)
    fake_nvml.reset_calls()
    assert [d.temperature_c for d in NvmlBackend().snapshot().devices] == [33.0, 76.0, None, 68.0]
    assert fake_nvml.calls("nvmlDeviceGetTemperature") == 4


@pytest.fixture
def older_driver(fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make this process a fresh one on a host with an older driver: NVML not yet initialised,
    and pynvml bound to the ``old`` or ``ancient`` build of the fake library (a copy of its own,
    loaded beside the default one). Everything is put back afterwards."""
    import pynvml

    from autogpu_jupyter.core.backends import nvml

    def bind(variant: str) -> Any:
        lib = FakeNvml.load_variant(variant)
        monkeypatch.setattr(pynvml, "nvmlLib", lib)
        monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer_cache", {})
        monkeypatch.setattr(nvml, "_state", nvml._State())  # reasoned: a fresh process
        lib.fakenvml_reset_calls()  # loaded once per process: counts of earlier tests
        return lib

    return bind


@pytest.mark.parametrize(
    ("variant", "call"),
    [("old", "nvmlDeviceGetComputeRunningProcesses_v2"),
     ("ancient", "nvmlDeviceGetComputeRunningProcesses")],
)
def test_an_older_driver_is_read_with_the_calls_it_has(
    fake_nvml: FakeNvml, older_driver: Any, caplog: pytest.LogCaptureFixture, variant: str,
    call: str,
) -> None:
    caplog.set_level("DEBUG", logger=NVML_LOGGER)
    fleet = fleet_4x()
    fleet["devices"][1]["processes"] = [
        {"pid": 31_337, "used_memory": 30 * GiB},
        {"pid": 31_338, "used_memory": 10 * GiB},
        {"pid": 31_339, "used_memory": None},
    ]
    fake_nvml.write(fleet)
    lib = older_driver(variant)
    backend = NvmlBackend()
    for _ in range(2):
        dev = backend.snapshot().devices[1]
        # no nvmlDeviceGetMemoryInfo_v2 on these drivers: v1 counts the 512 MiB reserved as used
        assert (dev.memory_used_bytes, dev.memory_free_bytes, dev.temperature_c) == (
            40 * GiB + 512 * MiB, 40 * GiB - 512 * MiB, 76.0,
        )
        # each entry read with the layout of its call: no garbage PIDs
        assert dev.processes == (
            ProcessSnapshot(pid=31_337, used_memory_bytes=30 * GiB),
            ProcessSnapshot(pid=31_338, used_memory_bytes=10 * GiB),
            ProcessSnapshot(pid=31_339, used_memory_bytes=None),
        )
    assert logged(caplog) == [  # each found out once
        ("DEBUG", "nvmlDeviceGetMemoryInfo_v2 unavailable: using v1"),
        ("DEBUG", "nvmlDeviceGetTemperatureV unavailable: using the older call"),
        ("INFO", f"old NVIDIA driver: reading processes with {call}"),
    ]
    assert [lib.fakenvml_calls(name.encode()) for name in (
        call, "nvmlDeviceGetTemperature", "nvmlDeviceGetMemoryInfo",
    )] == [8, 8, 8]


def test_nvml_shut_down_again_while_it_is_initialised_again(
    fake_nvml: FakeNvml, caplog: pytest.LogCaptureFixture
) -> None:
    """Someone shuts NVML down again before the second read: one clear error, no endless retry.
    (The fake answers UNINITIALIZED for the second GPU, as if shut down just before it.)"""
    fleet = fleet_4x()
    fleet["devices"][1]["error"] = "uninitialized"
    fake_nvml.write(fleet)
    caplog.set_level("WARNING", logger=NVML_LOGGER)
    with pytest.raises(NVMLUnavailableError) as info:
        NvmlBackend().snapshot()
    assert str(info.value) == "NVML stopped working in this process (Uninitialized)"
    assert logged(caplog) == [
        ("WARNING", "NVML was shut down behind our back; initialising it again"),
    ]


def test_without_the_binding_the_error_names_the_package_to_install(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh process where nvidia-ml-py is not installed."""
    from autogpu_jupyter.core.backends import nvml

    monkeypatch.delitem(sys.modules, "pynvml")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "-packages" not in p])
    monkeypatch.setattr(nvml, "_state", nvml._State())  # reasoned: a fresh process
    with pytest.raises(NVMLUnavailableError) as info:
        NvmlBackend().snapshot()
    assert str(info.value) == (
        "cannot import pynvml (No module named 'pynvml'); install nvidia-ml-py: "
        "pip install nvidia-ml-py"
    )
    assert isinstance(info.value.__cause__, ImportError)


def test_the_driver_version_is_read_once(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    assert backend.snapshot().driver_version == "550.54.15"
    fake_nvml.set_driver(driver_version="999.1")
    assert backend.snapshot().driver_version == "550.54.15"
    assert NvmlBackend().snapshot().driver_version == "999.1"


def test_warm_up_opens_the_handles_and_never_raises(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    fake_nvml.reset_calls()
    backend.warm_up()
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 4
    backend.snapshot()
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 4
    fake_nvml.set_driver(driver="none")
    assert backend.warm_up() is None  # the next locked snapshot reports it
    with pytest.raises(NVMLUnavailableError):
        backend.snapshot()
    fake_nvml.set_driver(driver="550")  # the driver is back: every GPU is read afresh
    fake_nvml.reset_calls()
    assert len(backend.snapshot().devices) == 4
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 4


def test_a_warm_backend_s_warm_up_reads_nothing(fake_nvml: FakeNvml) -> None:
    """A pick's warm-up before the lock must not take a second snapshot once NVML is up: the
    snapshot under the lock is the pick's only one (issue 26)."""
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    backend.warm_up()  # cold: initialises NVML and opens every handle
    total = preload_fake_nvml().fakenvml_total_calls
    before = total()
    backend.warm_up()
    assert total() == before
    backend.snapshot()
    after_snapshot = total()
    assert after_snapshot > before
    backend.warm_up()
    assert total() == after_snapshot
    fake_nvml.set(1, lost=True)  # a GPU that failed is opened again before the lock
    backend.snapshot()
    fake_nvml.set(1, lost=False)
    fake_nvml.reset_calls()
    backend.warm_up()
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 1



def test_a_failing_gpu_is_looked_up_again_next_time(fake_nvml: FakeNvml) -> None:
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    backend.snapshot()
    fake_nvml.set(1, error="no_permission")
    assert backend.snapshot().devices[1].error == "no permission"
    fake_nvml.set(1, error=None)
    fake_nvml.reset_calls()
    assert backend.snapshot().devices[1].available is True
    assert fake_nvml.calls("nvmlDeviceGetHandleByIndex_v2") == 1
    assert fake_nvml.calls("nvmlDeviceGetUUID") == 1


def test_memory_call_replaced_by_another_library(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """gpustat replaces ``pynvml.nvmlDeviceGetMemoryInfo`` by a function without ``version``."""
    import pynvml

    caplog.set_level("DEBUG", logger=NVML_LOGGER)
    original = pynvml.nvmlDeviceGetMemoryInfo
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: original(handle))
    fake_nvml.write(fleet_4x())
    backend = NvmlBackend()
    for _ in range(2):
        dev = backend.snapshot().devices[0]
        # the v1 form counts the driver's 512 MiB as used
        assert (dev.memory_total_bytes, dev.memory_used_bytes, dev.memory_free_bytes) == (
            80 * GiB, 2 * GiB + 512 * MiB, 80 * GiB - 2 * GiB - 512 * MiB,
        )
    assert logged(caplog) == [
        ("DEBUG", "pynvml.nvmlDeviceGetMemoryInfo was replaced: using its v1 form"),
    ]


def test_memory_not_supported_by_the_v2_call(fake_nvml: FakeNvml) -> None:
    fleet = fleet_4x()
    fleet["devices"][0]["unsupported"] = ["memory"]
    fake_nvml.write(fleet)
    backend = NvmlBackend()
    devices = backend.snapshot().devices
    assert (devices[0].memory_total_bytes, devices[0].memory_free_bytes) == (None, None)
    assert devices[1].memory_used_bytes == 40 * GiB  # v2 still used for the others
    fake_nvml.reset_calls()
    backend.snapshot()
    assert fake_nvml.calls("nvmlDeviceGetMemoryInfo_v2") == 4
    assert fake_nvml.calls("nvmlDeviceGetMemoryInfo") == 0


# ---- NVML that will not start --------------------------------------------------------------------


@pytest.fixture
def fresh_init(fake_nvml: FakeNvml) -> Any:
    """NVML not yet initialised in this process; initialised again (with no error) afterwards.

    A reasoned private seam: NVML is initialised once per process; a test of its start needs a
    fresh process's state (``_reset_init``), which no public call gives."""
    from autogpu_jupyter.core.backends import nvml

    nvml._reset_init()
    yield fake_nvml
    fake_nvml.write({"devices": []})
    nvml._reset_init()
    NvmlBackend().snapshot()


@pytest.mark.parametrize(
    ("init_error", "message", "cause"),
    [
        (12, "no NVIDIA driver on this host (libnvidia-ml.so.1 not found); to try autogpu without "
         "a GPU, set AUTOGPU_SIMULATE=demo-4x (a simulated fleet)", "NVMLError_LibraryNotFound"),
        ("driver_not_loaded", "no NVIDIA driver on this host (NVML: Driver Not Loaded; the NVIDIA "
         "kernel module is not loaded); to try autogpu without a GPU, set "
         "AUTOGPU_SIMULATE=demo-4x (a simulated fleet)", "NVMLError_DriverNotLoaded"),
        ("no_permission", "NVML cannot be used on this host (no permission to open the NVIDIA "
         "devices)", "NVMLError_NoPermission"),
        (18, "NVML cannot be used on this host (the NVML library and the loaded driver have "
         "different versions; reload the driver or reboot)", "NVMLError_LibRmVersionMismatch"),
        ("unknown", "NVML cannot be used on this host (nvmlInit: Unknown Error)",
         "NVMLError_Unknown"),
    ],
)
def test_nvml_init_failures_are_one_clear_error(
    fresh_init: FakeNvml, init_error: object, message: str, cause: str
) -> None:
    fresh_init.write({"init_error": init_error, "devices": fleet_4x()["devices"]})
    backend = NvmlBackend()
    with pytest.raises(NVMLUnavailableError) as info:
        backend.snapshot()
    assert str(info.value) == message
    assert type(info.value.__cause__).__name__ == cause
    backend.warm_up()  # swallowed: the picker's locked snapshot reports it
    fresh_init.set_driver(init_error=None)  # fixed: the next snapshot initialises NVML
    assert len(backend.snapshot().devices) == 4


# ---- /proc and the binding ----------------------------------------------------------------------


def test_process_owner_and_command_line(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    from autogpu_jupyter.core.procfs import command_of as _proc_command
    from autogpu_jupyter.core.procfs import user_of as _proc_user

    assert (_proc_user(sleeper.pid), _proc_command(sleeper.pid)) == (ME, "sleep 60")
    assert (_proc_user(4_000_003), _proc_command(4_000_003)) == (None, None)
    # a zombie has no command line
    zombie = subprocess.Popen(["true"])
    stat = Path(f"/proc/{zombie.pid}/stat")
    deadline = time.monotonic() + 10
    while ") Z " not in stat.read_text() and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        assert _proc_command(zombie.pid) is None
    finally:
        zombie.wait()


def test_a_command_line_that_is_not_utf8() -> None:
    from autogpu_jupyter.core.procfs import command_of as _proc_command

    argv = [b"sh", b"-c", b"sleep 60; :", b"caf\xe9 X"]
    proc = subprocess.Popen(argv)
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    deadline = time.monotonic() + 10
    while cmdline.read_bytes() != b"\0".join(argv) + b"\0" and time.monotonic() < deadline:
        time.sleep(0.005)
    try:
        assert _proc_command(proc.pid) == "sh -c sleep 60; : caf\ufffd X"
    finally:
        proc.kill()
        proc.wait()


def test_a_user_name_is_looked_up_once_per_process(
    sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The passwd database can be slow (LDAP, sssd): each uid is looked up once."""
    from autogpu_jupyter.core import procfs

    monkeypatch.setattr(procfs, "_user_names", {})  # a fresh process: no name known yet
    looked_up: list[int] = []
    getpwuid = pwd.getpwuid

    def counting_getpwuid(uid: int) -> pwd.struct_passwd:
        looked_up.append(uid)
        return getpwuid(uid)

    monkeypatch.setattr(pwd, "getpwuid", counting_getpwuid)
    assert [procfs.user_of(sleeper.pid) for _ in range(3)] == [ME] * 3
    assert looked_up == [os.getuid()]


def test_a_uid_missing_from_the_passwd_database_reads_as_its_number(
    sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As in a container whose /etc/passwd lacks the host's users."""
    from autogpu_jupyter.core import procfs

    def getpwuid(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(procfs, "_user_names", {})
    monkeypatch.setattr(pwd, "getpwuid", getpwuid)
    assert procfs.user_of(sleeper.pid) == str(os.getuid())


def _no_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return True
    return False


@pytest.mark.skipif(os.getuid() != 0, reason="starting a process as another uid needs root")
def test_a_uid_without_a_passwd_entry_reads_as_its_number() -> None:
    from autogpu_jupyter.core.procfs import user_of as _proc_user

    uid = next(u for u in range(54_321, 64_000) if _no_passwd_entry(u))
    proc = subprocess.Popen(["sleep", "60"], user=uid)
    try:
        assert _proc_user(proc.pid) == str(uid)
        assert _proc_user(proc.pid) == str(uid)
    finally:
        proc.kill()
        proc.wait()


def fake_module(path: Path) -> Any:
    class Module:
        __file__ = str(path)

    return Module()


FIX = (" instead of only nvidia-ml-py, which autogpu needs; fix: pip uninstall pynvml && "
       "pip install --force-reinstall nvidia-ml-py")


def test_binding_problem_finds_a_shadowing_package_and_its_distribution(tmp_path: Path) -> None:
    from autogpu_jupyter.core.backends.nvml import binding_problem

    site = tmp_path / "site"
    (site / "pynvml").mkdir(parents=True)
    (site / "pynvml" / "__init__.py").write_text("")
    assert binding_problem(fake_module(site / "pynvml" / "__init__.py")) == (
        f"'import pynvml' loads the package {site / 'pynvml'}" + FIX
    )
    (site / "pynvml-11.5.0.dist-info").mkdir()
    assert binding_problem(fake_module(site / "pynvml" / "__init__.py")) == (
        f"'import pynvml' loads the package {site / 'pynvml'}; the deprecated 'pynvml' "
        "distribution 11.5.0 is installed" + FIX
    )


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        ([], None),
        (["nvidia_ml_py-12.560.30.dist-info", "pynvml_utils-1.0.dist-info", "pynvml-1.0.txt",
          "pynvml.py"], None),
        (["pynvml-11.5.0.dist-info"], "the deprecated 'pynvml' distribution 11.5.0 is installed"),
        (["PyNVML-8.0.4.egg-info"], "the deprecated 'pynvml' distribution 8.0.4 is installed"),
        (["pynvml-1.2.dist.dist-info"], "the deprecated 'pynvml' distribution 1.2 is installed"),
    ],
)
def test_binding_problem_beside_a_plain_module(
    tmp_path: Path, names: list[str], expected: str | None
) -> None:
    from autogpu_jupyter.core.backends.nvml import binding_problem

    for name in names:
        (tmp_path / name).mkdir()
    found = binding_problem(fake_module(tmp_path / "pynvml.py"))
    assert found == (None if expected is None else expected + FIX)


def test_binding_problem_of_a_module_without_a_file(tmp_path: Path) -> None:
    from autogpu_jupyter.core.backends.nvml import binding_problem

    assert binding_problem(fake_module(tmp_path / "gone" / "pynvml.py")) is None

    class NoFile:
        __file__ = None

    assert binding_problem(NoFile()) is None  # type: ignore[arg-type]
    assert binding_problem(object()) is None  # type: ignore[arg-type]


def test_a_fresh_import_of_the_backend_starts_nvml_itself(fake_nvml: FakeNvml) -> None:
    """A second copy of the module (as a fresh process has) initialises NVML on first use."""
    import importlib.util

    from autogpu_jupyter.core.backends import nvml

    spec = importlib.util.spec_from_file_location("fresh_nvml", nvml.__file__)
    assert spec is not None and spec.loader is not None
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    fake_nvml.write(fleet_4x())
    fake_nvml.reset_calls()
    snap = fresh.NvmlBackend().snapshot()
    assert [d.uuid for d in snap.devices][:2] == [UUID0, UUID1]
    assert snap.errors == ()
    assert fake_nvml.calls("nvmlInitWithFlags") == 1
