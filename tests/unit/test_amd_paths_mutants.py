"""core's AMD paths, in whole outputs: the simulated AMD fleet, AMD's device metrics exporter
series folded into one device and its snapshot, what the ROCr check hands
``hsa_system_get_info``, the too-late message naming a framework, and the linker's load counter
built afresh (also where the C library lacks ``dl_iterate_phdr`` or the system is not Linux)."""

from __future__ import annotations

import ctypes
import os
import sys
import types
from typing import Any

import pytest

from autogpu_jupyter.core import cudastate
from autogpu_jupyter.core.backends.simulated import GiB, _demo, builtin_fleet
from autogpu_jupyter.core.cluster import (
    ClusterDevice,
    Sample,
    _Acc,
    _amd_snapshot,
    _fold_amd,
)
from autogpu_jupyter.core.cudastate import CudaState, _ask_rocr, hip_too_late_message
from autogpu_jupyter.core.devices import DeviceSnapshot

MiB = 1024**2
NOW = 1_800_000_000.0
INST = "10.0.0.9:5000"
UUID0 = "5aff74a1-0000-1000-8000-c0ffee000000"
ROCR = "/opt/rocm/lib/libhsa-runtime64.so.1"

# ------------------------------------------------------------------ the simulated AMD fleet

#: What ``demo-amd`` changes in ``demo-8x``'s devices, GPU by GPU.
AMD_DEVICES = [
    (name, f"5aff74a{1 + i}-0000-1000-800{i}-d3a0a3d0000{i}", f"GPU-4d0a3d000000000{i}",
     f"0000:{pci}:00.0", mem, watts)
    for i, (name, pci, mem, watts) in enumerate(
        [("AMD Instinct MI300X", pci, 192 * GiB, 750.0) for pci in ("05", "25", "45", "65")]
        + [("AMD Instinct MI210", pci, 64 * GiB, 300.0) for pci in ("85", "a5", "c5", "e5")]
    )
]


def test_the_simulated_amd_fleet_is_demo_8x_with_mi300x_and_mi210_in_its_places() -> None:
    devices = _demo(4, 4)["devices"]
    for dev, (name, uuid, runtime_uuid, pci, mem, watts) in zip(devices, AMD_DEVICES):
        dev.update(name=name, uuid=uuid, runtime_uuid=runtime_uuid, pci_bus_id=pci,
                   memory_total=mem, power_limit_w=watts)
    assert builtin_fleet("demo-amd") == {
        "vendor": "amd", "driver_version": "6.10.5 (simulated)", "devices": devices}
    assert AMD_DEVICES[0][1] == "5aff74a1-0000-1000-8000-d3a0a3d00000"
    assert AMD_DEVICES[7][1:4] == ("5aff74a8-0000-1000-8007-d3a0a3d00007",
                                   "GPU-4d0a3d0000000007", "0000:e5:00.0")


# ------------------------------------------------ AMD's exporter: folding and the snapshot


def sample(value: float, **labels: str) -> Sample:
    return Sample({"__name__": "gpu_gfx_activity", "instance": INST, **labels}, value, NOW)


@pytest.mark.parametrize(
    ("labels", "key", "expected"),
    [
        ({"hostname": "mi300-a", "gpu_id": "2", "gpu_uuid": UUID0,
          "card_series": "AMD Instinct MI300X", "card_model": "102-D65209-0C"},
         UUID0, _Acc("mi300-a", INST, UUID0, "2", "AMD Instinct MI300X", "amd")),
        ({"hostname": "mi300-a", "gpu_id": "1", "card_model": "102-D65209-0C"},
         "mi300-a/gpu-1", _Acc("mi300-a", INST, "mi300-a/gpu-1", "1", "102-D65209-0C", "amd")),
        # no optional label at all: the host from the instance, no index, no model
        ({}, "10.0.0.9/gpu-", _Acc("10.0.0.9", INST, "10.0.0.9/gpu-", "", "", "amd")),
    ],
)
def test_an_amd_exporter_sample_is_folded_into_its_device(
    labels: dict[str, str], key: str, expected: _Acc
) -> None:
    acc: dict[str, _Acc] = {}
    _fold_amd(sample(45.0, **labels), acc)
    _fold_amd(Sample({**sample(0, **labels).labels, "__name__": "gpu_used_vram"}, 2048.0, NOW),
              acc)
    expected.values.update(gpu_gfx_activity=45.0, gpu_used_vram=2048.0)
    assert acc == {key: expected}


def amd_device(index: int | None, **fields: Any) -> ClusterDevice:
    return ClusterDevice(DeviceSnapshot(
        index=-1 if index is None else index, uuid=UUID0, name="AMD Instinct MI300X",
        vendor="amd", timestamp_s=NOW, **fields), "amd")


NONE = {"memory_total_bytes": None, "memory_used_bytes": None, "memory_free_bytes": None,
        "utilization_pct": None, "temperature_c": None, "power_w": None}


@pytest.mark.parametrize(
    ("index", "values", "fields"),
    [
        (3, {"gpu_used_vram": 150_000, "gpu_total_vram": 196_592, "gpu_gfx_activity": 45,
             "gpu_junction_temperature": 61.0, "gpu_edge_temperature": 50.0,
             "gpu_package_power": 512.0, "gpu_power_usage": 100.0},
         {"memory_total_bytes": 196_592 * MiB, "memory_used_bytes": 150_000 * MiB,
          "memory_free_bytes": 46_592 * MiB, "utilization_pct": 45.0, "temperature_c": 61.0,
          "power_w": 512.0}),
        # the older exporters' names; more used than the total never makes the free negative
        (0, {"gpu_used_vram": 2.5, "gpu_total_vram": 2, "gpu_gfx_activity": 0,
             "gpu_edge_temperature": 50.0, "gpu_power_usage": 100.0},
         {"memory_total_bytes": 2 * MiB, "memory_used_bytes": int(2.5 * MiB),
          "memory_free_bytes": 0, "utilization_pct": 0.0, "temperature_c": 50.0,
          "power_w": 100.0}),
        (None, {}, NONE),
        (1, {"gpu_used_vram": 7}, {**NONE, "memory_used_bytes": 7 * MiB}),
        (1, {"gpu_total_vram": 7}, {**NONE, "memory_total_bytes": 7 * MiB}),
    ],
)
def test_an_amd_exporter_device_s_snapshot(
    index: int | None, values: dict[str, float], fields: dict[str, Any]
) -> None:
    dev = _Acc("mi300-a", INST, UUID0, "3", "AMD Instinct MI300X", "amd", dict(values))
    assert _amd_snapshot(dev, index, NOW) == amd_device(index, **fields)


# ------------------------------------------------------------------ asking ROCr (HSA)

NOT_INITIALIZED = 0x100B
INVALID_ARGUMENT = 0x1001


class FakeRocr:
    """Stands for ``ctypes.CDLL`` and the ROCr it opens: ``hsa_system_get_info`` answers ``rc``
    to the one valid call, ``(0, byref(c_uint16))`` (anything else is an invalid argument), and
    every opening and call is recorded."""

    def __init__(self, rc: int) -> None:
        self.rc = rc
        self.opened: list[tuple[str, int | None]] = []
        self.calls: list[tuple[Any, ...]] = []
        self.restype: Any = None

    def cdll(self, path: str, mode: int | None = None) -> Any:
        self.opened.append((path, mode))
        return types.SimpleNamespace(hsa_system_get_info=self)

    def __call__(self, *args: Any) -> int:
        self.calls.append(tuple(
            (type(a._obj).__name__, a._obj.value) if hasattr(a, "_obj") else a for a in args))
        if [type(a) for a in args] != [int, type(ctypes.byref(ctypes.c_int()))] or args[0]:
            return INVALID_ARGUMENT
        if self.rc == 0:
            args[1]._obj.value = 1
        return self.rc


@pytest.mark.parametrize(
    ("rc", "expected"),
    [
        (NOT_INITIALIZED, (False, f"ROCr is mapped ({ROCR}) but hsa_system_get_info returned "
                                  "HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B): hsa_init has not "
                                  "run yet")),
        (0, (True, f"hsa_system_get_info returned 0x0 from {ROCR}: ROCr (HIP) has started")),
        (0x1008, (True, f"hsa_system_get_info returned 0x1008 from {ROCR}: ROCr (HIP) has "
                        "started")),
    ],
)
def test_rocr_is_reopened_without_loading_and_asked_for_its_major_version(
    monkeypatch: pytest.MonkeyPatch, rc: int, expected: tuple[bool, str]
) -> None:
    fake = FakeRocr(rc)
    monkeypatch.setattr(ctypes, "CDLL", fake.cdll)
    assert _ask_rocr(ROCR) == expected
    assert fake.opened == [(ROCR, os.RTLD_NOLOAD | os.RTLD_LAZY)]
    assert fake.calls == [(0, ("c_ushort", 0))]
    assert fake.restype is ctypes.c_int


# ------------------------------------------------------------ the HIP too-late message


def test_the_hip_message_names_the_framework_that_probably_started_it() -> None:
    state = CudaState(True, "hsa_system_get_info returned 0x0 from /x: ROCr (HIP) has started",
                      "torch")
    assert hip_too_late_message(state, "kernel 'k'") == (
        "HIP (ROCm) is already initialised in kernel 'k', probably by torch (hsa_system_get_info "
        "returned 0x0 from /x: ROCr (HIP) has started). ROCR_VISIBLE_DEVICES and "
        "HIP_VISIBLE_DEVICES are read once, when ROCm initialises, so changing them now has no "
        "effect; nothing was changed. Restart the kernel and run `%gpu pick` first, before "
        "importing torch or anything that uses the GPU, or start the notebook with the \"Python "
        "3 (autogpu)\" kernel, which picks before the kernel starts.")


# ------------------------------------------------------------ the linker's load counter


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="dl_iterate_phdr (Linux)")
def test_a_new_load_counter_reads_the_linker_s_counts() -> None:
    count = cudastate._LoadCount()
    # checked before it is called: a counter without its callback would crash the process
    assert isinstance(count._callback, cudastate._PHDR_CALLBACK)
    assert count._iterate.restype is ctypes.c_int  # type: ignore[union-attr]
    assert count._iterate.argtypes == [  # type: ignore[union-attr]
        cudastate._PHDR_CALLBACK, ctypes.c_void_p]
    adds_subs = count()
    assert adds_subs is not None and adds_subs == cudastate._load_count()
    assert all(type(n) is int for n in adds_subs) and adds_subs[0] > 0


def no_libc(name: str | None) -> Any:
    raise OSError("no C library")


@pytest.mark.parametrize("libc", [
    pytest.param(lambda name: types.SimpleNamespace(), id="no-dl_iterate_phdr"),
    pytest.param(no_libc, id="no-libc"),
    pytest.param(None, id="not-linux"),
])
def test_without_dl_iterate_phdr_the_counter_says_it_cannot_tell(
    monkeypatch: pytest.MonkeyPatch, libc: Any
) -> None:
    if libc is None:
        monkeypatch.setattr(sys, "platform", "darwin")
    else:
        monkeypatch.setattr(sys, "platform", "linux")
        monkeypatch.setattr(ctypes, "CDLL", libc)
    count = cudastate._LoadCount()
    assert count._iterate is None
    assert count() is None
