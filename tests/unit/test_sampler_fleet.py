"""The sampler in this process, over a real simulated backend reading a fleet file."""

from __future__ import annotations

import json
import math
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.sampler import METRICS, Sampler, get_sampler, own_pids, stop_sampler
from autogpu_jupyter.errors import UsageErrorBase
from tests.leasehelpers import forget_backends

GiB = 1024**3
A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def _fleet(util_a: float, *, lost_b: bool = False, broken: bool = False) -> dict[str, Any]:
    b: dict[str, Any] = {
        "uuid": B,
        "name": "Fake L4",
        "memory_total": 24 * GiB,
        "utilization_pct": 10,
        "memory_used": 2 * GiB,
        "processes": [],
    }
    if lost_b:
        b = {"uuid": B, "name": "Fake L4", "lost": True, "error": "GPU is lost"}
    a: dict[str, Any] = {
        "uuid": A,
        "name": "Fake A100",
        "memory_total": 80 * GiB,
        "utilization_pct": util_a,
        "memory_used": 30 * GiB,
        "temperature_c": 55,
        "power_w": 250.0,
        "processes": [
            {"pid": os.getpid(), "used_memory": 8 * GiB},
            {"pid": 1, "user": "root", "used_memory": 22 * GiB},
        ],
    }
    if broken:
        a["memory_total"] = "lots"
    return {"devices": [a, b]}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fleet_file(tmp_path: Path) -> Any:
    path = tmp_path / "fleet.json"

    def write(data: dict[str, Any]) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    write(_fleet(50))
    write.path = path  # type: ignore[attr-defined]
    return write


@pytest.fixture
def clocked(fleet_file: Any) -> tuple[Sampler, Clock]:
    clock = Clock()
    backend = SimulatedBackend(str(fleet_file.path), clock=clock)
    return Sampler(backend, interval_s=1.0, history_s=10.0, clock=clock), clock


def test_history_frame_holds_exact_values(clocked: tuple[Sampler, Clock]) -> None:
    s, clock = clocked
    s.sample_now()
    clock.now += 1
    s.sample_now()
    df = s.history_frame()
    assert list(df.columns) == ["timestamp_s", "time", "uuid", "label", *METRICS]
    assert len(df) == 4
    row = df.iloc[2]
    assert (row["uuid"], row["label"]) == (A, "GPU 0")
    assert row["timestamp_s"] == 1_000_001.0
    assert row["utilization_pct"] == 50.0
    assert row["memory_used_bytes"] == 30 * GiB
    assert row["memory_free_bytes"] == 50 * GiB
    assert row["temperature_c"] == 55.0
    assert row["power_w"] == 250.0
    assert row["own_memory_bytes"] == 8 * GiB  # this process's entry, not root's
    assert df.iloc[3]["own_memory_bytes"] == 0.0
    assert str(df["time"].iloc[0]) == "1970-01-12 13:46:40+00:00"
    assert len(s.history_frame(since_s=0.5)) == 2


def test_history_series_matches_the_frame(clocked: tuple[Sampler, Clock], fleet_file: Any) -> None:
    s, clock = clocked
    for util in (20, 40):
        fleet_file(_fleet(util))
        s.sample_now()
        clock.now += 1
    fleet_file({"devices": [_fleet(90)["devices"][0]]})  # GPU B leaves the list
    s.sample_now()
    series = s.history_series()
    assert list(series) == [A, B]
    a, b = series[A], series[B]
    assert a.timestamps_s.tolist() == [1_000_000.0, 1_000_001.0, 1_000_002.0]
    assert a.column("utilization_pct").tolist() == [20.0, 40.0, 90.0]
    assert a.column("own_memory_bytes").tolist() == [8 * GiB] * 3
    assert b.timestamps_s.tolist() == [1_000_000.0, 1_000_001.0]
    assert b.column("memory_used_bytes").tolist() == [2 * GiB] * 2
    assert a.values.shape == (3, len(METRICS))
    last = s.history_series(since_s=1)
    assert last[A].column("utilization_pct").tolist() == [40.0, 90.0]
    assert len(last[B]) == 1
    frame = sampler_mod.series_from_frame(s.history_frame())
    assert list(frame) == [A, B]
    assert frame[A].values.tolist() == a.values.tolist()
    assert frame[B].timestamps_s.tolist() == b.timestamps_s.tolist()
    assert s.smoothed_util(10) == {A: 50.0}


def test_ring_buffer_is_bounded(clocked: tuple[Sampler, Clock]) -> None:
    s, clock = clocked
    assert s.capacity == 11
    for _ in range(100):
        s.sample_now()
        clock.now += 1
    assert len(s) == 11
    assert s.sample_count == 100
    assert s.history_frame()["timestamp_s"].min() == 1_000_089.0


def test_smoothed_util_is_mean_over_window(clocked: tuple[Sampler, Clock], fleet_file: Any) -> None:
    s, clock = clocked
    for util in (20, 40, 90):
        fleet_file(_fleet(util))
        s.sample_now()
        clock.now += 1
    assert s.smoothed_util(10) == {A: 50.0, B: 10.0}
    assert s.smoothed_util(1) == {A: 65.0, B: 10.0}


def test_lost_gpu_recorded_and_others_keep_updating(
    clocked: tuple[Sampler, Clock], fleet_file: Any
) -> None:
    s, clock = clocked
    s.sample_now()
    clock.now += 1
    fleet_file(_fleet(70, lost_b=True))
    s.sample_now()
    last = s.history_frame(since_s=0)
    by = {r["uuid"]: r for _, r in last.iterrows()}
    assert by[A]["utilization_pct"] == 70.0
    assert by[B]["available"] == 0.0
    assert math.isnan(by[B]["utilization_pct"])
    assert s.smoothed_util(0) == {A: 70.0, B: None}
    snap = s.latest()
    assert snap is not None and snap.by_uuid(B).error == "GPU is lost"  # type: ignore[union-attr]


def test_failed_read_is_recorded_then_recovers(tmp_path: Path, fleet_file: Any) -> None:
    fleet_file(_fleet(50, broken=True))
    clock = Clock()
    s = Sampler(SimulatedBackend(str(fleet_file.path), clock=clock), clock=clock)
    assert s.sample_now() is None
    assert len(s.errors) == 1
    assert s.errors[0].message.startswith(
        f"fleet file {str(fleet_file.path)!r}, device 0 ({A}) memory_total: invalid size 'lots': "
        "not understood"
    )
    assert s.latest() is None
    fleet_file(_fleet(60))
    assert s.sample_now() is not None
    assert len(s) == 1 and len(s.errors) == 1


def test_listeners_called_after_each_sample(clocked: tuple[Sampler, Clock]) -> None:
    s, _ = clocked
    seen: list[int] = []

    def cb(sampler: Sampler, snapshot: Any) -> None:
        seen.append(len(snapshot.devices))

    def broken(sampler: Sampler, snapshot: Any) -> None:
        raise RuntimeError("listener bug")

    s.subscribe(broken)
    s.subscribe(cb)
    s.subscribe(cb)
    s.sample_now()
    s.unsubscribe(cb)
    s.sample_now()
    assert seen == [2]
    assert s.listener_count == 1


def test_bad_interval_is_one_clear_message(clocked: tuple[Sampler, Clock]) -> None:
    s, _ = clocked
    with pytest.raises(UsageErrorBase) as err:
        s.set_interval(0.01)
    assert str(err.value) == (
        "invalid sampler interval 0.01: expected a number of seconds >= 0.1, e.g. 1 or 0.5"
    )
    s.set_interval(0.5)
    assert (s.interval_s, s.capacity) == (0.5, 21)


def test_own_pids_finds_descendants() -> None:
    import subprocess

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert own_pids([child.pid, 1, os.getpid()]) == frozenset({child.pid, os.getpid()})
    finally:
        child.kill()
        child.wait()


def _threads() -> int:
    return sum(t.name == "autogpu-sampler" for t in threading.enumerate())


def test_one_thread_across_start_stop_restart(
    fleet_file: Any, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet_file.path))
    forget_backends()
    stop_sampler()
    try:
        s1 = get_sampler(interval_s=0.1)
        assert get_sampler() is s1
        assert _threads() == 1
        stop_sampler()
        assert _threads() == 0 and not s1.running
        s2 = get_sampler()
        assert s2 is not s1 and _threads() == 1
        s2.pause()
        assert s2.paused
        s2.resume()
    finally:
        stop_sampler()
        forget_backends()
    assert _threads() == 0
    assert sampler_mod.current_sampler() is None
