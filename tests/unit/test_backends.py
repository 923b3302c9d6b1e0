"""The simulated fleet's exact numbers, snapshot (de)serialisation, and backend choice.

The demo fleets are what a user without a GPU sees first (``AUTOGPU_SIMULATE=demo-4x``): their
devices, load curves and derived power/temperature are pinned here to the number. Fast, in-process,
in the mutation-test selection.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import backends
from autogpu_jupyter.core.backends import SIMULATE_ENV, get_backend
from autogpu_jupyter.core.backends.simulated import (
    BUILTIN_FLEETS,
    SimulatedBackend,
    builtin_fleet,
    resolve_fleet_source,
)
from autogpu_jupyter.core.devices import (
    COMPUTE_MODES,
    DeviceSnapshot,
    FleetSnapshot,
    ProcessSnapshot,
)
from autogpu_jupyter.errors import UsageErrorBase
from tests.leasehelpers import forget_backends

GiB = 1024**3
A100 = "NVIDIA A100-SXM4-80GB"
L4 = "NVIDIA L4"


def fleet_file(tmp_path: Path, fleet: dict, name: str = "fleet.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(fleet))
    return path


def one_device(tmp_path: Path, spec: dict, now: float = 0.0) -> list[DeviceSnapshot]:
    """The snapshots of a one-GPU fleet file, read at ``now``."""
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-x", **spec}]})
    return list(SimulatedBackend(str(path), clock=lambda: now).snapshot().devices)


# ---- the built-in demo fleets -----------------------------------------------------------------


def test_demo_4x_at_time_zero_every_number() -> None:
    snap = SimulatedBackend("demo-4x", clock=lambda: 0.0).snapshot()
    assert (snap.backend, snap.simulated, snap.timestamp_s, snap.errors) == (
        "simulated", True, 0.0, ()
    )
    assert snap.driver_version == "550.54.15 (simulated)"
    rows = [
        (d.index, d.uuid, d.name, d.pci_bus_id, d.memory_total_bytes, d.memory_used_bytes,
         d.memory_free_bytes, d.utilization_pct, d.temperature_c, d.power_w, d.power_limit_w,
         d.compute_mode, d.mig_enabled, d.available, d.processes)
        for d in snap.devices
    ]
    assert rows == [
        (0, "GPU-50000000-d3mo-4x00-a000-000000000000", A100, "00000000:07:00.0", 80 * GiB,
         10 * GiB, 70 * GiB, 20.0, 41, 124.0, 400.0, "DEFAULT", False, True,
         (ProcessSnapshot(41000, 10 * GiB, "alice", "python train.py"),)),
        (1, "GPU-50000001-d3mo-4x01-a100-000000000001", A100, "00000000:17:00.0", 80 * GiB,
         84174199128, 1725146792, 99.0, 77, 376.8, 400.0, "DEFAULT", False, True,
         (ProcessSnapshot(41001, 84174199128, "bob", "python train.py"),)),
        (2, "GPU-50000002-d3mo-4x02-a200-000000000002", L4, "00000000:27:00.0", 24 * GiB,
         479613993, 25290189783, 3.7, 34, 12.9, 72.0, "DEFAULT", False, True, ()),
        (3, "GPU-50000003-d3mo-4x03-a300-000000000003", L4, "00000000:37:00.0", 24 * GiB,
         5440721917, 20329081859, 21.9, 42, 23.4, 72.0, "DEFAULT", False, True,
         (ProcessSnapshot(41003, 5440721917, "dave", "python train.py"),)),
    ]
    assert all(d.timestamp_s == 0.0 and d.memory_utilization_pct is None for d in snap.devices)


def test_demo_4x_a_hundred_seconds_later() -> None:
    snap = SimulatedBackend("demo-4x", clock=lambda: 100.0).snapshot()
    assert [(d.utilization_pct, d.memory_used_bytes, d.temperature_c, d.power_w)
            for d in snap.devices] == [
        (29.6, 14878545882, 45, 154.7),
        (96.7, 83628344399, 76, 369.4),
        (9.1, 1167542989, 36, 16.0),
        (68.3, 12620538806, 63, 50.1),
    ]
    assert [d.processes[0].used_memory_bytes if d.processes else None for d in snap.devices] == [
        14878545882, 83628344399, None, 12620538806,
    ]


def test_demo_8x_devices_and_their_users() -> None:
    snap = SimulatedBackend("demo-8x", clock=lambda: 0.0).snapshot()
    assert [(d.uuid, d.pci_bus_id, d.name, d.memory_total_bytes, d.power_limit_w,
             d.utilization_pct, [(p.pid, p.user) for p in d.processes]) for d in snap.devices] == [
        ("GPU-50000000-d3mo-4x00-a000-000000000000", "00000000:07:00.0", A100, 80 * GiB, 400.0,
         20.0, [(41000, "alice")]),
        ("GPU-50000001-d3mo-4x01-a100-000000000001", "00000000:17:00.0", A100, 80 * GiB, 400.0,
         99.0, [(41001, "bob")]),
        ("GPU-50000002-d3mo-4x02-a200-000000000002", "00000000:27:00.0", A100, 80 * GiB, 400.0,
         3.7, []),
        ("GPU-50000003-d3mo-4x03-a300-000000000003", "00000000:37:00.0", A100, 80 * GiB, 400.0,
         21.9, [(41003, "dave")]),
        ("GPU-50000004-d3mo-4x04-a400-000000000004", "00000000:47:00.0", L4, 24 * GiB, 72.0,
         27.4, [(41004, "alice")]),
        ("GPU-50000005-d3mo-4x05-a500-000000000005", "00000000:57:00.0", L4, 24 * GiB, 72.0,
         98.3, [(41005, "bob")]),
        ("GPU-50000006-d3mo-4x06-a600-000000000006", "00000000:67:00.0", L4, 24 * GiB, 72.0,
         1.5, []),
        ("GPU-50000007-d3mo-4x07-a700-000000000007", "00000000:77:00.0", L4, 24 * GiB, 72.0,
         29.5, [(41007, "dave")]),
    ]


def test_demo_8x_description_of_the_busy_l4() -> None:
    assert builtin_fleet("demo-8x")["devices"][5] == {
        "name": L4,
        "uuid": "GPU-50000005-d3mo-4x05-a500-000000000005",
        "pci_bus_id": "00000000:57:00.0",
        "memory_total": 24 * GiB,
        "power_limit_w": 72.0,
        "load": {"period_s": 275.0, "phase": 8.5, "utilization_pct": [92, 99],
                 "memory_used_fraction": [0.96, 0.98]},
        "processes": [{"pid": 41005, "user": "bob", "command": "python train.py",
                       "memory_share": 1.0}],
    }
    assert sorted(BUILTIN_FLEETS) == ["demo-4x", "demo-8x", "demo-amd"]


DEMO_4X = [
    (A100, "GPU-50000000-d3mo-4x00-a000-000000000000", "00000000:07:00.0", 80 * GiB, 400.0, 90.0,
     0.0, [5, 35], [0.05, 0.2], (41000, "alice")),
    (A100, "GPU-50000001-d3mo-4x01-a100-000000000001", "00000000:17:00.0", 80 * GiB, 400.0, 127.0,
     1.7, [92, 99], [0.96, 0.98], (41001, "bob")),
    (L4, "GPU-50000002-d3mo-4x02-a200-000000000002", "00000000:27:00.0", 24 * GiB, 72.0, 164.0,
     3.4, [0, 10], [0.0, 0.05], None),
    (L4, "GPU-50000003-d3mo-4x03-a300-000000000003", "00000000:37:00.0", 24 * GiB, 72.0, 201.0,
     5.1, [20, 70], [0.2, 0.5], (41003, "dave")),
]
DEMO_8X = [
    (A100, "GPU-50000000-d3mo-4x00-a000-000000000000", "00000000:07:00.0", 80 * GiB, 400.0, 90.0,
     0.0, [5, 35], [0.05, 0.2], (41000, "alice")),
    (A100, "GPU-50000001-d3mo-4x01-a100-000000000001", "00000000:17:00.0", 80 * GiB, 400.0, 127.0,
     1.7, [92, 99], [0.96, 0.98], (41001, "bob")),
    (A100, "GPU-50000002-d3mo-4x02-a200-000000000002", "00000000:27:00.0", 80 * GiB, 400.0, 164.0,
     3.4, [0, 10], [0.0, 0.05], None),
    (A100, "GPU-50000003-d3mo-4x03-a300-000000000003", "00000000:37:00.0", 80 * GiB, 400.0, 201.0,
     5.1, [20, 70], [0.2, 0.5], (41003, "dave")),
    (L4, "GPU-50000004-d3mo-4x04-a400-000000000004", "00000000:47:00.0", 24 * GiB, 72.0, 238.0,
     6.8, [5, 35], [0.05, 0.2], (41004, "alice")),
    (L4, "GPU-50000005-d3mo-4x05-a500-000000000005", "00000000:57:00.0", 24 * GiB, 72.0, 275.0,
     8.5, [92, 99], [0.96, 0.98], (41005, "bob")),
    (L4, "GPU-50000006-d3mo-4x06-a600-000000000006", "00000000:67:00.0", 24 * GiB, 72.0, 312.0,
     10.2, [0, 10], [0.0, 0.05], None),
    (L4, "GPU-50000007-d3mo-4x07-a700-000000000007", "00000000:77:00.0", 24 * GiB, 72.0, 349.0,
     11.9, [20, 70], [0.2, 0.5], (41007, "dave")),
]


def described(rows: list[tuple]) -> dict:
    """A built-in fleet description from one row per device."""
    devices = []
    for name, uuid, bus, total, limit, period, phase, util, used, proc in rows:
        devices.append({
            "name": name, "uuid": uuid, "pci_bus_id": bus, "memory_total": total,
            "power_limit_w": limit,
            "load": {"period_s": period, "phase": phase, "utilization_pct": util,
                     "memory_used_fraction": used},
            "processes": [] if proc is None else [
                {"pid": proc[0], "user": proc[1], "command": "python train.py",
                 "memory_share": 1.0}
            ],
        })
    return {"driver_version": "550.54.15 (simulated)", "devices": devices}


def test_the_builtin_fleets_are_described_device_by_device() -> None:
    assert BUILTIN_FLEETS == {"demo-4x": (2, 2), "demo-8x": (4, 4), "demo-amd": (4, 4)}
    assert builtin_fleet("demo-4x") == described(DEMO_4X)
    assert builtin_fleet("demo-8x") == described(DEMO_8X)


def test_builtin_fleet_is_a_copy_the_caller_may_change() -> None:
    mine = builtin_fleet("demo-4x")
    mine["devices"][0]["name"] = "changed"
    mine["devices"][0]["load"]["utilization_pct"][0] = 50
    fresh = builtin_fleet("demo-4x")
    assert fresh["devices"][0]["name"] == A100
    assert fresh["devices"][0]["load"]["utilization_pct"] == [5, 35]
    assert SimulatedBackend("demo-4x", clock=lambda: 0.0).snapshot().devices[0].name == A100


def test_a_builtin_fleet_is_read_without_any_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo-4x").write_text("{not json")  # a file of that name does not matter
    backend = SimulatedBackend("demo-4x", clock=lambda: 0.0)
    assert (backend.source, backend.name, backend.simulated) == ("demo-4x", "simulated", True)
    assert len(backend.snapshot().devices) == 4


# ---- moving load ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "util", "used_gib", "power", "temp"),
    [
        (0.0, 50.0, 40, 220.0, 54),  # the wave starts half-way
        (30.0, 90.0, 60, 348.0, 72),  # a quarter period (default 120 s): the top
        (90.0, 10.0, 20, 92.0, 36),  # three quarters: the bottom
    ],
)
def test_load_follows_a_sine_wave_with_a_default_period_of_two_minutes(
    tmp_path: Path, now: float, util: float, used_gib: int, power: float, temp: int
) -> None:
    (dev,) = one_device(tmp_path, {
        "memory_total": "80GiB", "power_limit_w": 400,
        "load": {"utilization_pct": [10, 90], "memory_used_fraction": [0.25, 0.75]},
    }, now=now)
    assert (dev.utilization_pct, dev.memory_used_bytes, dev.memory_free_bytes) == (
        util, used_gib * GiB, (80 - used_gib) * GiB
    )
    assert (dev.power_w, dev.temperature_c) == (power, temp)


def test_load_period_and_phase(tmp_path: Path) -> None:
    spec = {"load": {"period_s": 40.0, "phase": math.pi / 2, "utilization_pct": [0, 100]}}
    assert [one_device(tmp_path, spec, now=t)[0].utilization_pct for t in (0.0, 10.0, 20.0)] == [
        100.0, 50.0, 0.0,
    ]


def test_load_without_a_range_stays_at_the_fixed_utilisation(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {"utilization_pct": 42, "memory_total": 1000,
                                   "memory_used": 300, "load": {"period_s": 10.0}}, now=3.0)
    # no memory_used_fraction: memory stays as given
    assert (dev.utilization_pct, dev.memory_used_bytes, dev.memory_free_bytes) == (42.0, 300, 700)
    (idle,) = one_device(tmp_path, {"load": {"period_s": 10.0}}, now=3.0)
    assert (idle.utilization_pct, idle.temperature_c, idle.power_w) == (0.0, 32, None)


def test_memory_fraction_needs_a_known_total(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {"load": {"utilization_pct": [10, 10],
                                            "memory_used_fraction": [0.5, 0.5]}})
    assert (dev.memory_total_bytes, dev.memory_used_bytes, dev.memory_free_bytes) == (
        None, None, None
    )


# ---- fleet file fields ------------------------------------------------------------------------


def test_a_device_with_only_a_uuid(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {}, now=12.5)
    assert dev == DeviceSnapshot(
        index=0, uuid="GPU-x", name="Simulated GPU", compute_mode="DEFAULT", mig_enabled=False,
        processes=(), timestamp_s=12.5,
    )


def test_used_memory_is_the_sum_of_the_processes(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {
        "memory_total": "10GiB", "memory_utilization_pct": 12.5, "compute_mode": "PROHIBITED",
        "processes": [
            {"pid": "7", "used_memory": "3GiB"},
            {"pid": 8, "used_memory": 1073741824.0, "user": "bob"},
            {"pid": 9},
        ],
    })
    assert (dev.memory_used_bytes, dev.memory_free_bytes, dev.memory_utilization_pct) == (
        4 * GiB, 6 * GiB, 12.5
    )
    assert dev.compute_mode == "PROHIBITED"
    assert dev.processes == (
        ProcessSnapshot(7, 3 * GiB), ProcessSnapshot(8, GiB, "bob"), ProcessSnapshot(9),
    )


def test_used_memory_over_the_total_leaves_zero_free(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {"memory_total": "1GiB", "memory_used": "3GiB"})
    assert (dev.memory_used_bytes, dev.memory_free_bytes) == (3 * GiB, 0)


def test_memory_share_splits_the_used_memory(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {
        "memory_total": 1000, "memory_used": 801,
        "processes": [{"pid": 1, "memory_share": 0.25}, {"pid": 2, "memory_share": "0.5",
                                                         "used_memory": 7}],
    })
    assert [p.used_memory_bytes for p in dev.processes] == [200, 7]
    # without a known used memory, a share means nothing
    (unknown,) = one_device(tmp_path, {"processes": [{"pid": 1, "memory_share": 0.5}]})
    assert unknown.processes == (ProcessSnapshot(1),)


def test_derived_power_and_temperature_round_as_shown(tmp_path: Path) -> None:
    (dev,) = one_device(tmp_path, {"utilization_pct": 33, "power_limit_w": 72})
    # 72 * (0.15 + 0.8 * 0.33) = 29.808 -> 29.8 W; 32 + 0.45 * 33 = 46.85 -> 47 degrees
    assert (dev.utilization_pct, dev.power_w, dev.power_limit_w, dev.temperature_c) == (
        33.0, 29.8, 72, 47
    )
    (given,) = one_device(tmp_path, {"utilization_pct": 33, "power_limit_w": 72, "power_w": 5,
                                     "temperature_c": 20})
    assert (given.power_w, given.temperature_c) == (5, 20)
    (no_limit,) = one_device(tmp_path, {"utilization_pct": 33})
    assert (no_limit.power_w, no_limit.power_limit_w, no_limit.temperature_c) == (None, None, 47)


def test_a_lost_device(tmp_path: Path) -> None:
    devices = one_device(tmp_path, {"lost": True, "pci_bus_id": "00000000:99:00.0",
                                    "memory_total": "80GiB", "utilization_pct": 50}, now=3.0)
    assert devices == [DeviceSnapshot(
        index=0, uuid="GPU-x", name="Simulated GPU", pci_bus_id="00000000:99:00.0",
        available=False, error="GPU is lost", processes=None, timestamp_s=3.0,
    )]
    (forbidden,) = one_device(tmp_path, {"lost": 1, "name": "L4", "error": "no permission"})
    assert (forbidden.name, forbidden.error, forbidden.available) == ("L4", "no permission", False)
    (fine,) = one_device(tmp_path, {"lost": False})
    assert fine.available is True


def test_mig_devices_follow_their_gpu(tmp_path: Path) -> None:
    devices = one_device(tmp_path, {
        "name": "NVIDIA H100", "pci_bus_id": "00000000:01:00.0", "memory_total": "80GiB",
        "utilization_pct": 70, "compute_mode": "EXCLUSIVE_PROCESS",
        "mig_devices": [
            {"uuid": "MIG-a", "profile": "3g.40gb", "memory_total": "40GiB",
             "memory_used": "50GiB"},
            {"uuid": "MIG-b"},
        ],
    }, now=9.0)
    parent, a, b = devices
    assert (parent.utilization_pct, parent.mig_enabled, parent.is_mig, parent.temperature_c) == (
        None, True, False, 64
    )
    assert a == DeviceSnapshot(
        index=0, uuid="MIG-a", name="NVIDIA H100 MIG 3g.40gb", pci_bus_id="00000000:01:00.0",
        memory_total_bytes=40 * GiB, memory_used_bytes=50 * GiB, memory_free_bytes=0,
        compute_mode="EXCLUSIVE_PROCESS", mig_enabled=True, is_mig=True, parent_uuid="GPU-x",
        mig_index=0, processes=(), timestamp_s=9.0,
    )
    assert b == DeviceSnapshot(
        index=0, uuid="MIG-b", name="NVIDIA H100 MIG", pci_bus_id="00000000:01:00.0",
        memory_used_bytes=0, compute_mode="EXCLUSIVE_PROCESS", mig_enabled=True, is_mig=True,
        parent_uuid="GPU-x", mig_index=1, processes=(), timestamp_s=9.0,
    )
    assert [d.label for d in devices] == ["GPU 0", "GPU 0 MIG 0", "GPU 0 MIG 1"]


def test_fleet_level_defaults(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {})
    snap = SimulatedBackend(str(path), clock=lambda: 7).snapshot()
    assert snap == FleetSnapshot(
        devices=(), timestamp_s=7.0, backend="simulated", simulated=True,
        driver_version="simulated",
    )
    assert isinstance(snap.timestamp_s, float)


def test_devices_are_numbered_in_file_order(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": [
        {"uuid": "GPU-b", "mig_devices": [{"uuid": "MIG-b0"}]}, {"uuid": "GPU-a"},
    ]})
    snap = SimulatedBackend(str(path)).snapshot()
    assert [(d.index, d.uuid, d.label) for d in snap.devices] == [
        (0, "GPU-b", "GPU 0"), (0, "MIG-b0", "GPU 0 MIG 0"), (1, "GPU-a", "GPU 1"),
    ]


SIZE_FORMS = ("expected a number with a unit, e.g. 10G, 10GiB, 512M, 0.5T, 16GB (decimal), or a "
              "share of the device like 25%")


@pytest.mark.parametrize(
    ("device", "field"),
    [
        ({"memory_total": "80 parsecs"}, "memory_total"),
        ({"memory_total": "80G", "memory_used": "80 parsecs"}, "memory_used"),
        ({"memory_total": "80G", "processes": [{"pid": 1, "used_memory": "80 parsecs"}]},
         "process used_memory"),
        ({"memory_total": "80G", "memory_used": "1G",
          "processes": [{"pid": 1, "used_memory": "80 parsecs"}]}, "process used_memory"),
        ({"mig_devices": [{"uuid": "MIG-0"}, {"uuid": "MIG-1", "memory_total": "80 parsecs"}]},
         "MIG 1 memory_total"),
        ({"mig_devices": [{"uuid": "MIG-0", "memory_used": "80 parsecs"}]}, "MIG 0 memory_used"),
    ],
)
def test_a_bad_size_in_a_fleet_file_names_the_file_device_and_field(
    tmp_path: Path, device: dict[str, Any], field: str
) -> None:
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-a"}, {"uuid": "GPU-x", **device}]})
    with pytest.raises(UsageErrorBase) as err:
        SimulatedBackend(str(path)).snapshot()
    assert str(err.value) == (
        f"fleet file {str(path)!r}, device 1 (GPU-x) {field}: invalid size '80 parsecs': unknown "
        f"unit 'parsecs'; {SIZE_FORMS}"
    )


def test_a_size_that_is_no_number_or_text_is_refused(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-x", "memory_total": True}]})
    with pytest.raises(UsageErrorBase, match=r"^fleet file .* device 0 \(GPU-x\) memory_total: "):
        SimulatedBackend(str(path)).snapshot()


def test_memory_in_use_without_a_total_has_no_free_memory(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-x", "memory_used": "2G"}]})
    dev = SimulatedBackend(str(path)).snapshot().devices[0]
    assert (dev.memory_total_bytes, dev.memory_used_bytes, dev.memory_free_bytes) == (
        None, 2 * GiB, None
    )


@pytest.mark.parametrize(("util", "want"), [(None, 0.0), (0, 0.0), (40, 40.0)])
def test_a_load_without_a_utilisation_range_holds_the_given_utilisation(
    tmp_path: Path, util: float | None, want: float
) -> None:
    device: dict[str, Any] = {"uuid": "GPU-x", "memory_total": "10G",
                              "load": {"memory_used_fraction": [0.5, 0.5]}}
    if util is not None:
        device["utilization_pct"] = util
    path = fleet_file(tmp_path, {"devices": [device]})
    for t in (0.0, 7.5, 30.0, 61.0):
        dev = SimulatedBackend(str(path), clock=lambda t=t: t).snapshot().devices[0]
        assert (dev.utilization_pct, dev.memory_used_bytes) == (want, 5 * GiB)


# ---- the fleet file over time -----------------------------------------------------------------


def test_a_deleted_file_keeps_the_last_fleet(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-x"}]})
    backend = SimulatedBackend(str(path))
    assert [d.uuid for d in backend.snapshot().devices] == ["GPU-x"]
    path.unlink()
    assert [d.uuid for d in backend.snapshot().devices] == ["GPU-x"]


def test_a_file_deleted_before_the_first_read_is_an_error(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": []})
    backend = SimulatedBackend(str(path))
    path.unlink()
    with pytest.raises(UsageErrorBase) as info:  # one message, never a bare FileNotFoundError
        backend.snapshot()
    assert str(info.value) == (
        f"fleet file {str(path)!r} cannot be read: No such file or directory; expected a JSON "
        "fleet file (UTF-8) this user can read")


def test_a_half_written_file_keeps_the_last_good_fleet(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-x"}]})
    backend = SimulatedBackend(str(path))
    backend.snapshot()
    path.write_text('{"devices": [{"uu')
    os.utime(path, ns=(1, 10**18))
    assert [d.uuid for d in backend.snapshot().devices] == ["GPU-x"]
    path.write_text('{"devices": [{"uuid": "GPU-y"}]}')
    os.utime(path, ns=(1, 2 * 10**18))
    assert [d.uuid for d in backend.snapshot().devices] == ["GPU-y"]


def test_an_unchanged_file_is_not_read_again(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, {"devices": [{"uuid": "GPU-x"}]})
    os.utime(path, ns=(1, 10**18))
    backend = SimulatedBackend(str(path))
    backend.snapshot()
    path.write_text('{"devices": [{"uuid": "GPU-y"}]}')
    os.utime(path, ns=(1, 10**18))  # same mtime: the backend keeps what it read
    assert [d.uuid for d in backend.snapshot().devices] == ["GPU-x"]


def test_invalid_json_message(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("{nope")
    with pytest.raises(UsageErrorBase) as info:
        SimulatedBackend(str(path)).snapshot()
    assert str(info.value) == f"fleet file {str(path)!r} is not valid JSON"
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_missing_absolute_path_says_what_is_expected(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.json")
    with pytest.raises(UsageErrorBase) as info:
        SimulatedBackend(missing)
    assert str(info.value) == (
        f"AUTOGPU_SIMULATE={missing!r}: not a fleet file and not a built-in fleet; expected an "
        "absolute path to a JSON fleet file or one of demo-4x, demo-8x, demo-amd"
    )
    with pytest.raises(UsageErrorBase, match="not a fleet file"):
        SimulatedBackend(str(tmp_path))  # a directory is not a fleet file


# ---- where a fleet is read from ---------------------------------------------------------------


def test_resolve_fleet_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "f.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "g.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "sub")
    base = str(tmp_path)
    assert resolve_fleet_source("", base) == ""
    assert resolve_fleet_source("demo-8x", base) == "demo-8x"
    (tmp_path / "demo-8x").write_text("{}")
    assert resolve_fleet_source("demo-8x", base) == "demo-8x"  # the built-in name wins
    assert resolve_fleet_source("/no/such/file.json", base) == "/no/such/file.json"
    assert resolve_fleet_source("f.json", base) == str(tmp_path / "f.json")
    assert resolve_fleet_source("./sub/../f.json", base) == str(tmp_path / "f.json")
    assert resolve_fleet_source("g.json", base) == "g.json"  # not under base_dir
    assert resolve_fleet_source("sub", base) == "sub"  # a folder is not a fleet file
    # the default base is the current directory
    assert resolve_fleet_source("g.json") == str(tmp_path / "sub" / "g.json")
    assert resolve_fleet_source("f.json") == "f.json"


# ---- choosing a backend -----------------------------------------------------------------------


@pytest.fixture
def fresh_backends(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(SIMULATE_ENV, raising=False)
    forget_backends()
    yield
    forget_backends()


def test_get_backend_shares_one_instance_per_fleet(
    fresh_backends: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    four = get_backend("demo-4x")
    assert isinstance(four, SimulatedBackend) and four.source == "demo-4x"
    assert get_backend("demo-4x") is four
    eight = get_backend("demo-8x")
    assert eight is not four and eight.source == "demo-8x"
    monkeypatch.setenv(SIMULATE_ENV, "demo-8x")
    assert get_backend() is eight
    assert SIMULATE_ENV == "AUTOGPU_SIMULATE"


def test_get_backend_without_simulation_is_nvml(fresh_backends: None) -> None:
    from autogpu_jupyter.core.backends.nvml import NvmlBackend

    nvml = get_backend()
    assert isinstance(nvml, NvmlBackend)
    assert get_backend("") is nvml  # empty means NVML, shared with the default
    assert isinstance(nvml, backends.Backend)


def test_a_fleet_named_nvml_is_not_the_nvml_backend(
    fresh_backends: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    get_backend()  # the NVML backend exists in this process
    with pytest.raises(UsageErrorBase, match=r"^AUTOGPU_SIMULATE='nvml': not a fleet file"):
        get_backend("nvml")


@pytest.mark.parametrize("name", ["nvml", "NVML", "XXXX", "none", "0"])
def test_the_nvml_backend_and_a_fleet_file_of_any_name_never_share_an_instance(
    fresh_backends: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A fleet file may have any name, in any order of asking. Kills the mutant that keys the
    NVML backend's cache entry by a name (``XXXX``) instead of the empty string, which no fleet
    name can be (it was listed as equivalent in tests/mutation_equivalent.txt)."""
    from autogpu_jupyter.core.backends.nvml import NvmlBackend

    monkeypatch.chdir(tmp_path)
    fleet_file(tmp_path, {"devices": [{"uuid": "GPU-named"}]}, name=name)
    nvml = get_backend("")
    fleet = get_backend(name)
    assert isinstance(nvml, NvmlBackend)
    assert isinstance(fleet, SimulatedBackend) and fleet.source == name
    assert [d.uuid for d in fleet.snapshot().devices] == ["GPU-named"]
    forget_backends()
    fleet = get_backend(name)  # the other order
    assert isinstance(get_backend(), NvmlBackend) and get_backend(name) is fleet


def test_get_backend_reports_a_bad_fleet_and_caches_nothing(
    fresh_backends: None, tmp_path: Path
) -> None:
    missing = str(tmp_path / "missing.json")
    with pytest.raises(UsageErrorBase):
        get_backend(missing)
    fleet_file(tmp_path, {"devices": [{"uuid": "GPU-late"}]}, name="missing.json")
    assert [d.uuid for d in get_backend(missing).snapshot().devices] == ["GPU-late"]


# ---- snapshots as data ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uuid", "short"),
    [
        ("GPU-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d", "GPU-1a2b3c4d"),
        ("MIG-11111111-aaaa", "MIG-11111111"),
        ("GPU-abc", "GPU-abc"),
        ("GPU-", "GPU-"),
        ("nodash", "nodash"),
        # an amdsmi UUID has no GPU- word: its first group, never cut inside the second
        ("5aff74a3-0000-1000-8002-d3a0a3d00002", "5aff74a3"),
    ],
)
def test_short_uuid(uuid: str, short: str) -> None:
    assert DeviceSnapshot(index=0, uuid=uuid, name="x").short_uuid == short


def test_the_short_id_of_an_amd_device_starts_what_rocr_visible_devices_names() -> None:
    dev = DeviceSnapshot(index=2, uuid="5aff74a3-0000-1000-8002-d3a0a3d00002", name="x",
                         vendor="amd", runtime_uuid="GPU-4d0a3d0000000002")
    assert dev.short_uuid == "GPU-4d0a3d00"
    assert dev.runtime_uuid is not None and dev.runtime_uuid.startswith(dev.short_uuid)


def test_labels() -> None:
    assert DeviceSnapshot(index=3, uuid="u", name="x").label == "GPU 3"
    assert DeviceSnapshot(index=0, uuid="u", name="x", is_mig=True, mig_index=1).label == (
        "GPU 0 MIG 1"
    )
    assert COMPUTE_MODES == {
        0: "DEFAULT", 1: "EXCLUSIVE_THREAD", 2: "PROHIBITED", 3: "EXCLUSIVE_PROCESS",
    }


DEV = DeviceSnapshot(
    index=1, uuid="GPU-1", name="L4", pci_bus_id="00000000:17:00.0", memory_total_bytes=100,
    memory_used_bytes=40, memory_free_bytes=60, utilization_pct=5.0, compute_mode="DEFAULT",
    mig_enabled=False, processes=(ProcessSnapshot(12, 40, "bob", "python x.py"),),
    timestamp_s=3.5,
)
LOST = DeviceSnapshot(index=2, uuid="GPU-2", name="A100", processes=None, available=False,
                      error="GPU is lost")


def test_device_to_dict_exact() -> None:
    assert DEV.to_dict() == {
        "index": 1, "uuid": "GPU-1", "name": "L4", "pci_bus_id": "00000000:17:00.0",
        "memory_total_bytes": 100, "memory_used_bytes": 40, "memory_free_bytes": 60,
        "utilization_pct": 5.0, "memory_utilization_pct": None, "temperature_c": None,
        "power_w": None, "power_limit_w": None, "compute_mode": "DEFAULT", "mig_enabled": False,
        "is_mig": False, "parent_uuid": None, "mig_index": None,
        "processes": [{"pid": 12, "used_memory_bytes": 40, "user": "bob",
                       "command": "python x.py"}],
        "available": True, "error": None, "vendor": "nvidia", "runtime_uuid": None,
        "timestamp_s": 3.5, "label": "GPU 1",
    }
    assert list(DEV.to_dict())[-3:] == ["timestamp_s", "processes", "label"]
    assert LOST.to_dict()["processes"] is None


def test_fleet_round_trips_through_json() -> None:
    snap = FleetSnapshot(devices=(DEV, LOST), timestamp_s=9.0, backend="nvml",
                         driver_version="550", errors=("note",))
    text = snap.to_json(sort_keys=True)
    data = json.loads(text)
    assert list(data) == sorted(data)  # keyword arguments reach json.dumps
    assert snap.to_dict() == {
        "timestamp_s": 9.0, "backend": "nvml", "simulated": False, "driver_version": "550",
        "errors": ["note"], "devices": [DEV.to_dict(), LOST.to_dict()],
    }
    assert FleetSnapshot.from_dict(data) == snap
    assert FleetSnapshot.from_dict(json.loads(snap.to_json())) == snap


def test_fleet_from_a_minimal_dict() -> None:
    snap = FleetSnapshot.from_dict({
        "devices": [{"index": 0, "uuid": "GPU-0", "name": "x", "label": "ignored",
                     "unknown_field": 1}],
        "timestamp_s": "4", "backend": 7,
    })
    assert snap == FleetSnapshot(
        # a device without a process list: processes unknown
        devices=(DeviceSnapshot(index=0, uuid="GPU-0", name="x", processes=None),),
        timestamp_s=4.0, backend="7", simulated=False, driver_version=None, errors=(),
    )
    assert FleetSnapshot.from_dict({"devices": [], "timestamp_s": 0, "backend": "b",
                                    "simulated": 1}).simulated is True


def test_by_uuid() -> None:
    snap = FleetSnapshot(devices=(DEV, LOST), timestamp_s=0.0, backend="b")
    assert snap.by_uuid("GPU-2") is LOST
    assert snap.by_uuid("GPU-1") is DEV
    assert snap.by_uuid("GPU-3") is None


def test_an_empty_fleet_has_every_column() -> None:
    snap = FleetSnapshot(devices=(), timestamp_s=0.0, backend="simulated", simulated=True)
    df = snap.to_dataframe()
    assert len(df) == 0
    assert list(df.columns)[:3] == ["index", "uuid", "name"]
    assert list(df.columns)[-2:] == ["label", "process_count"]
    assert len(df.columns) == 24


def test_dataframe_rows_columns_and_attributes() -> None:
    snap = FleetSnapshot(devices=(DEV, LOST), timestamp_s=0.0, backend="nvml", simulated=False)
    df = snap.to_dataframe()
    assert list(df.columns) == [
        "index", "uuid", "name", "pci_bus_id", "memory_total_bytes", "memory_used_bytes",
        "memory_free_bytes", "utilization_pct", "memory_utilization_pct", "temperature_c",
        "power_w", "power_limit_w", "compute_mode", "mig_enabled", "is_mig", "parent_uuid",
        "mig_index", "available", "error", "vendor", "runtime_uuid", "timestamp_s", "label",
        "process_count",
    ]
    assert list(df.index) == ["GPU-1", "GPU-2"]
    assert list(df["uuid"]) == ["GPU-1", "GPU-2"]
    assert df.loc["GPU-1", "process_count"] == 1
    assert math.isnan(df.loc["GPU-2", "process_count"])  # no process list: unknown
    assert list(df["label"]) == ["GPU 1", "GPU 2"]
    assert df.attrs == {"simulated": False, "backend": "nvml"}


# ---- each vendor's backend cached under its own key (found by the mutation run of issue 22) ----
@pytest.mark.parametrize(("vendor", "key"), [("nvml", ""), ("amdsmi", "amdsmi:")])
def test_each_vendor_backend_is_kept_under_its_own_key(
    monkeypatch: pytest.MonkeyPatch, vendor: str, key: str
) -> None:
    nvml, amd = object(), object()
    cache: dict[Any, Any] = {"": nvml, "amdsmi:": amd}
    monkeypatch.setattr(backends, "_cache", cache)
    monkeypatch.setenv(backends.BACKEND_ENV, vendor)
    assert backends.get_backend("") is cache[key]
    assert cache == {"": nvml, "amdsmi:": amd}
