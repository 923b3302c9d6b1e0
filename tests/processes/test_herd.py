"""Herd safety with real processes: pickers released at the same instant never pile up.

Each picker is its own Python process (``tests/leasehelpers.py``) that blocks on a shared start
gate (an ``flock`` the test holds); opening the gate releases all of them at once, like kernels
started together by a JupyterHub. They read the fleet through the same backend a kernel uses.
"""

from __future__ import annotations

import collections
import os
import re
import select
import signal
from pathlib import Path

import pytest

from autogpu_jupyter.core.leasing import DirectoryStore
from tests.fakenvml import FakeNvml
from tests.leasehelpers import (
    FleetEnv,
    Gate,
    Picker,
    finish_all,
    fleet,
    lease_files,
    start_pickers,
    uuid_of,
)


@pytest.fixture
def fleet_source(fake_nvml: FakeNvml, tmp_path: Path) -> FleetEnv:
    """The pickers read the fleet through the real pynvml binding over the fake driver."""
    return FleetEnv(tmp_path, fake_nvml)


@pytest.fixture
def registry_dir(tmp_path: Path) -> Path:
    return tmp_path / "registry"


def _herd(n: int, args: list[str], fleet_source: FleetEnv, registry_dir: Path,
          tmp_path: Path) -> tuple[list[Picker], list[dict[str, object]]]:
    gate = Gate(tmp_path / "gate")
    pickers = start_pickers(
        n, ["--registry", str(registry_dir), "--gate", str(gate.path), "--hold", *args],
        fleet_source.env,
    )
    gate.open()
    results = [p.result() for p in pickers]
    gate.close()
    return pickers, results


@pytest.mark.slow
def test_32_simultaneous_pickers_on_4_gpus_get_8_each(
    fleet_source: FleetEnv, registry_dir: Path, tmp_path: Path
) -> None:
    fleet_source.write(fleet(4))
    pickers, results = _herd(32, [], fleet_source, registry_dir, tmp_path)
    try:
        assert [r["event"] for r in results] == ["picked"] * 32
        counts = collections.Counter(r["uuid"] for r in results)
        assert counts == {uuid_of(i): 8 for i in range(4)}
        assert all(r["lease_note"] is None for r in results)
        assert fleet_source.kind == "fake-nvml"
        assert len(DirectoryStore(registry_dir).list_leases()) == 32
    finally:
        finish_all(pickers)
    # Every picker released its lease on exit.
    assert DirectoryStore(registry_dir).list_leases() == []
    assert list(lease_files(registry_dir)) == []


def test_8_exclusive_pickers_on_8_gpus_get_8_distinct_gpus_and_a_9th_is_refused(
    fleet_source: FleetEnv, registry_dir: Path, tmp_path: Path
) -> None:
    fleet_source.write(fleet(8))
    pickers, results = _herd(9, ["--exclusive"], fleet_source, registry_dir, tmp_path)
    try:
        picked = [r for r in results if r["event"] == "picked"]
        refused = [r for r in results if r["event"] == "error"]
        assert sorted(r["uuid"] for r in picked) == [uuid_of(i) for i in range(8)]
        assert len(refused) == 1
        assert refused[0]["type"] == "NoDeviceFitsError"
        assert str(refused[0]["message"]).splitlines() == ["no device fits (exclusive):"] + [
            f"  GPU {i} (NVIDIA A100-SXM4-80GB): dropped: exclusive wanted but 1 lease(s) hold it"
            for i in range(8)
        ]
    finally:
        finish_all(pickers)


def test_9th_exclusive_picker_with_wait_gets_the_gpu_that_frees_up(
    fleet_source: FleetEnv, registry_dir: Path, tmp_path: Path
) -> None:
    fleet_source.write(fleet(8))
    holders, results = _herd(8, ["--exclusive"], fleet_source, registry_dir, tmp_path)
    try:
        assert sorted(r["uuid"] for r in results) == [uuid_of(i) for i in range(8)]
        waiter = Picker(
            ["--registry", str(registry_dir), "--exclusive", "--wait", "60", "--poll", "0.1",
             "--hold"],
            fleet_source.env,
        )
        waiter.expect("ready")
        assert re.fullmatch(
            r"waiting for a device \(exclusive\), \d+(\.\d)?s of 1m; "
            r"best now GPU 0: exclusive wanted but 1 lease\(s\) hold it",
            waiter.expect("waiting")["message"],
        )
        freed = results[5]["uuid"]
        holders[5].finish()
        got = waiter.result()
        assert got["event"] == "picked"
        assert got["uuid"] == freed
        waiter.finish()
    finally:
        finish_all(holders)


def test_sigkilled_picker_frees_its_gpu_with_no_cleanup(
    fleet_source: FleetEnv, registry_dir: Path
) -> None:
    fleet_source.write(fleet(1))
    args = ["--registry", str(registry_dir), "--exclusive", "--hold"]
    victim = Picker(args, fleet_source.env)
    victim.expect("ready")
    got = victim.result()
    assert got["event"] == "picked" and got["uuid"] == uuid_of(0)

    second = Picker(args, fleet_source.env)
    second.expect("ready")
    refused = second.result()
    assert refused["event"] == "error" and refused["type"] == "NoDeviceFitsError"
    assert "exclusive wanted but 1 lease(s) hold it" in refused["message"]
    second.finish()

    os.kill(victim.proc.pid, signal.SIGKILL)
    assert victim.finish() == -signal.SIGKILL
    # No cleanup ran: the file is still there, but nobody holds its flock any more.
    assert [p.name for p in lease_files(registry_dir)] == [f"{got['lease_id']}.lease"]
    registry = DirectoryStore(registry_dir)
    scan = registry.scan()
    assert [r.lease_id for r in scan.dead] == [got["lease_id"]]
    assert scan.live == []
    assert registry.list_leases() == []

    third = Picker(args, fleet_source.env)
    third.expect("ready")
    again = third.result()
    try:
        assert again["event"] == "picked" and again["uuid"] == uuid_of(0)
        assert again["lease_note"] is None
        # The owner's next pick removed its own dead lease file under the registry lock.
        assert [p.name for p in lease_files(registry_dir)] == [f"{again['lease_id']}.lease"]
    finally:
        third.finish()


def test_fifo_three_waiters_get_the_freed_gpu_in_arrival_order(
    fleet_source: FleetEnv, registry_dir: Path
) -> None:
    """The first waiter polls slowest and the last fastest: without the FIFO rule the last
    would win every time; with it, each freed GPU goes to the oldest waiter."""
    fleet_source.write(fleet(1))
    base = ["--registry", str(registry_dir), "--exclusive", "--hold"]
    holder = Picker(base, fleet_source.env)
    holder.expect("ready")
    assert holder.result()["event"] == "picked"
    waiters = []
    for i, poll in enumerate(["1.0", "0.3", "0.05"]):
        # Three waiters of one user: the line holds them when the admin allows it.
        w = Picker([*base, "--wait", "120", "--poll", poll, "--kernel-id", f"k{i}",
                    "--max-tickets", "3"], fleet_source.env)
        w.expect("ready")
        w.expect("waiting")  # its ticket exists before the next one starts
        waiters.append(w)
    tickets = DirectoryStore(registry_dir).list_leases(include_tickets=True)
    assert [(t.kind, t.kernel_id, t.seq) for t in tickets if t.kind == "ticket"] == [
        ("ticket", "k0", 1), ("ticket", "k1", 2), ("ticket", "k2", 3)
    ]
    order = []
    current = holder
    try:
        for _ in range(3):
            current.finish()
            # Whoever picks next reports first; the others keep waiting.
            streams = {w.proc.stdout: w for w in waiters if w not in order}
            ready, _, _ = select.select(list(streams), [], [], 60)
            assert len(ready) >= 1
            nxt = streams[ready[0]]
            event = nxt.result()
            assert event["event"] == "picked"
            order.append(nxt)
            current = nxt
        assert [waiters.index(w) for w in order] == [0, 1, 2]
    finally:
        finish_all([holder, *waiters])
