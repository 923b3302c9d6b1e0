"""The broker and MIG (issue 39, breaks 3 and 4) and the waiting line's model requests, with real
Unix users against a real root broker on a simulated fleet: GPU 0 a plain A100, GPU 1 an A100 in
MIG mode with two MIG devices.

Physical GPUs decide: a reservation of GPU 1 covers its MIG devices (a non-member's ordinary
``autogpu run`` never lands on one, a raw lease on a slice is refused), and an exclusive lease
conflicts with every lease on the same physical GPU (the MIG device, its parent, its siblings),
both ways, in the broker's admission and in the picker's ranking alike. A waiting ticket keeps
its model (``--model A100``): it neither holds back another model's GPU nor is judged servable
by one. Each test was seen failing before its fix.
"""

from __future__ import annotations

import grp
import os
import shutil
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.brokerhelpers import Area, BrokerProc, RawConn, raw_call, wire
from tests.leasehelpers import AsUser, as_user, ensure_user, shared_area, uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

ALICE = "agtest-alice"
BOB = "agtest-bob"
GPU0, GPU1 = uuid_of(0), uuid_of(1)
MIG0 = "MIG-00000001-aaaa-5bbb-8ccc-000000000000"
MIG1 = "MIG-00000001-aaaa-5bbb-8ccc-000000000001"
A100 = "NVIDIA A100-SXM4-80GB"


def mig_fleet() -> dict[str, Any]:
    """GPU 0: a plain A100 at 90 % (a pick prefers an idle MIG device to it); GPU 1: an A100
    in MIG mode, two idle MIG devices."""
    return {
        "driver_version": "550.54.15",
        "devices": [
            {"uuid": GPU0, "name": A100, "pci_bus_id": "00000000:10:00.0",
             "memory_total": "80G", "memory_used": 0, "utilization_pct": 90, "processes": []},
            {"uuid": GPU1, "name": A100, "pci_bus_id": "00000000:11:00.0",
             "memory_total": "80G", "memory_used": 0, "utilization_pct": 0, "processes": [],
             "mig_devices": [
                 {"uuid": MIG0, "profile": "3g.40gb", "memory_total": "40G", "memory_used": 0},
                 {"uuid": MIG1, "profile": "3g.40gb", "memory_total": "40G", "memory_used": 0},
             ]},
        ],
    }


@pytest.fixture(scope="module")
def users() -> dict[str, tuple[int, int]]:
    return {"alice": ensure_user(ALICE), "bob": ensure_user(BOB)}


@pytest.fixture
def area(users: dict[str, tuple[int, int]]) -> Iterator[Area]:
    with shared_area("autogpu-mig") as root:
        a = Area(root)
        a.write_fleet(mig_fleet())
        yield a


def _kill_group(proc: Any) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _raw(path: str, *messages: dict[str, Any]) -> list[Any]:
    return raw_call(path, *(wire(m) for m in messages))


class _Held(dict):  # type: ignore[type-arg]
    """A reply whose connection stays open in the user's child (it pickles as the reply)."""

    conn: RawConn

    def __reduce__(self) -> Any:
        return (dict, (dict(self),))


def _hold(path: str, devices: list[str], exclusive: bool) -> _Held:
    conn = RawConn(path)
    held = _Held(conn.call({"op": "lease", "devices": devices, "exclusive": exclusive}))
    held.conn = conn
    return held


def _holding(users: dict[str, tuple[int, int]], area: Area, device: str,
             exclusive: bool) -> AsUser:
    """Alice holds a raw lease on ``device`` (until ``stop()``)."""
    uid, gid = users["alice"]
    child = AsUser(uid, gid, _hold, str(area.socket), [device], exclusive, hold=True)
    assert child.result()["ok"], child.result()
    return child


def _bob_leases(users: dict[str, tuple[int, int]], area: Area, device: str,
                exclusive: bool) -> dict[str, Any]:
    uid, gid = users["bob"]
    reply: dict[str, Any] = as_user(uid, gid, _raw, str(area.socket),
                                    {"op": "lease", "devices": [device],
                                     "exclusive": exclusive})[0]
    return reply


def _dropped(i: int, why: str) -> str:
    """The ranking's line for MIG device ``i`` of GPU 1, dropped for ``why``."""
    return (f"GPU 1 MIG {i} ({A100} MIG 3g.40gb): dropped: utilisation unknown: ranked by "
            f"memory and leases; {why}")


# ---- break 3: a reserved GPU's MIG devices ----------------------------------------------------


def test_a_reservation_covers_the_gpu_and_every_mig_device_of_it(
    area: Area, users: dict[str, tuple[int, int]]
) -> None:
    """GPU 1 is reserved for alice's group. Bob's ordinary run lands on GPU 0 (busy), never on
    a MIG device of GPU 1 (it did: the idle MIG device ranked first); his dry run and his run
    on GPU 1 alone name the reservation for each MIG device; his raw leases on the slices and
    a ticket naming one are refused in the admission's words; alice, a member, takes a slice."""
    a_group = grp.getgrgid(users["alice"][1]).gr_name
    rules = area.root / "rules.json"
    rules.write_text(f'{{"reserved": {{"{GPU1}": ["{a_group}"]}}}}')
    proc = BrokerProc(area.root, "--rules", str(rules), "--ticket-grace", "120",
                      env={"AUTOGPU_SIMULATE": str(area.fleet)})
    try:
        ran = area.cli(BOB, "run", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip() == GPU0
        reserved = f"reserved for group(s) {a_group} by the admin"
        only_1 = area.cli(BOB, "run", "--exclude", "0", "--", "true")
        assert only_1.returncode == 3, only_1.stderr
        for i in (0, 1):
            assert _dropped(i, reserved) in only_1.stderr, only_1.stderr
        dry = area.cli(BOB, "pick", "--dry-run", "--exclude", "0")  # proposed MIG device 0
        assert dry.returncode == 3, dry.stdout
        assert _dropped(1, reserved) in dry.stderr, dry.stderr
        for mig in (MIG0, MIG1):
            for exclusive in (False, True):
                reply = _bob_leases(users, area, mig, exclusive)
                assert (reply["ok"], reply["error"]) == (
                    False, f"no device free: {mig} is {reserved}"), reply
        uid, gid = users["bob"]
        ticket = {"op": "ticket", "constraints": {
            "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
            "exclude": [], "exclusive": False, "allowed_uuids": [MIG1]}}
        reply = as_user(uid, gid, _raw, str(area.socket), ticket)[0]
        assert reply["error"] == f"no device free: {MIG1} is {reserved}", reply
        assert proc.status()["leases"] == []
        uid, gid = users["alice"]
        mine = as_user(uid, gid, _raw, str(area.socket), {"op": "lease", "devices": [MIG0]})
        assert mine[0]["ok"], mine
    finally:
        proc.stop()


# ---- break 4: exclusivity across a MIG device, its siblings and its parent --------------------


@pytest.fixture
def broker(area: Area) -> Iterator[BrokerProc]:
    proc = BrokerProc(area.root, "--max-devices-per-user", "0", "--ticket-grace", "120",
                      env={"AUTOGPU_SIMULATE": str(area.fleet)})
    try:
        yield proc
    finally:
        proc.stop()


def test_an_exclusive_mig_lease_keeps_its_parent_and_siblings_off(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """Alice holds MIG device 0 of GPU 1 exclusively: bob's raw leases on GPU 1 and on MIG
    device 1, exclusive or not, are refused naming why (all three were granted); his run on
    GPU 1 alone finds nothing, the ranking saying the same as the refusal."""
    held = _holding(users, area, MIG0, exclusive=True)
    try:
        who = f"{ALICE}: pid {held.pid}"
        for exclusive in (False, True):
            reply = _bob_leases(users, area, GPU1, exclusive)
            assert reply.get("error") == (
                f"no device free: {GPU1}: its MIG device {MIG0} is held exclusively by {who}"
            ), reply
            reply = _bob_leases(users, area, MIG1, exclusive)
            assert reply.get("error") == (
                f"no device free: {MIG1}: its sibling MIG device {MIG0} is held exclusively "
                f"by {who}"
            ), reply
        run = area.cli(BOB, "run", "--exclude", "0", "--", "true")
        assert run.returncode == 3, run.stderr
        assert _dropped(
            1, "its sibling MIG device GPU 1 MIG 0 is held exclusively by another lease"
        ) in run.stderr, run.stderr
        assert [r["device_uuids"] for r in broker.status()["leases"]] == [[MIG0]]
    finally:
        held.stop()


def test_an_exclusive_parent_lease_keeps_its_mig_devices_off(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """Alice holds GPU 1 itself exclusively: no MIG device of it goes to bob, by raw lease or
    by a pick (a slice of it was leased as if the parent were another device)."""
    held = _holding(users, area, GPU1, exclusive=True)
    try:
        who = f"{ALICE}: pid {held.pid}"
        for mig in (MIG0, MIG1):
            reply = _bob_leases(users, area, mig, exclusive=False)
            assert reply.get("error") == (
                f"no device free: {mig}: its parent {GPU1} is held exclusively by {who}"
            ), reply
        ran = area.cli(BOB, "run", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
        assert (ran.returncode, ran.stdout.strip()) == (0, GPU0), ran.stderr
    finally:
        held.stop()


def test_exclusive_wanted_is_refused_where_the_physical_gpu_is_in_use(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """Alice holds MIG device 0 (not exclusively): bob's exclusive leases on GPU 1 and on the
    sibling are refused (both were granted), his shared lease on the sibling is granted, and
    his exclusive run on GPU 1 finds nothing, worded as the refusal."""
    held = _holding(users, area, MIG0, exclusive=False)
    try:
        who = f"{ALICE}: pid {held.pid}"
        reply = _bob_leases(users, area, GPU1, exclusive=True)
        assert reply.get("error") == (
            f"no device free: exclusive wanted but {GPU1}: its MIG device {MIG0} is held by "
            f"{who}"
        ), reply
        reply = _bob_leases(users, area, MIG1, exclusive=True)
        assert reply.get("error") == (
            f"no device free: exclusive wanted but {MIG1}: its sibling MIG device {MIG0} is "
            f"held by {who}"
        ), reply
        assert _bob_leases(users, area, MIG1, exclusive=False)["ok"]
        run = area.cli(BOB, "run", "--exclusive", "--exclude", "0", "--", "true")
        assert run.returncode == 3, run.stderr
        assert _dropped(
            1, "exclusive wanted but its sibling MIG device GPU 1 MIG 0 is held by 1 lease(s)"
        ) in run.stderr, run.stderr
    finally:
        held.stop()


# ---- a waiting ticket keeps its model ---------------------------------------------------------


def test_a_waiter_for_a100_neither_holds_back_nor_takes_another_model(
    area: Area, users: dict[str, tuple[int, int]]
) -> None:
    """GPU 0 is the only A100 (alice holds it exclusively), GPU 1 an idle L4. Alice waits for an
    A100 of her own: bob's ordinary run gets the L4, her ticket stays in line past the broker's
    grace, and she gets GPU 0 when it frees. Her ticket was read back as "any model": the
    broker judged it servable by the idle L4 and let it lapse after the grace (3 s here)."""
    area.write_fleet({"driver_version": "550.54.15", "devices": [
        {"uuid": GPU0, "name": A100, "memory_total": "80G", "memory_used": 0,
         "utilization_pct": 0, "processes": []},
        {"uuid": GPU1, "name": "NVIDIA L4", "memory_total": "24G", "memory_used": 0,
         "utilization_pct": 0, "processes": []},
    ]})
    proc = BrokerProc(area.root, "--max-devices-per-user", "0", "--ticket-grace", "3",
                      env={"AUTOGPU_SIMULATE": str(area.fleet)})
    holder = area.run_held(ALICE, "run", "--exclusive", "--model", "A100", "--", "sleep", "60")
    waiter = None
    try:
        proc.wait_for(lambda s: len(s["leases"]) == 1)
        waiter = area.run_held(ALICE, "run", "--exclusive", "--model", "A100", "--wait", "60",
                               "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
        proc.wait_for(lambda s: len(s["tickets"]) == 1)
        ran = area.cli(BOB, "run", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES")
        assert (ran.returncode, ran.stdout.strip()) == (0, GPU1), ran.stderr
        time.sleep(5)  # past the grace: a ticket judged servable lapses in it
        st = proc.status()
        assert (st["tickets_lapsed"], len(st["tickets"])) == (0, 1), st
        _kill_group(holder)
        out, err = waiter.communicate(timeout=30)
        assert (waiter.returncode, out.strip()) == (0, GPU0), err
    finally:
        for p in (holder, waiter):
            if p is not None and p.poll() is None:
                _kill_group(p)
        proc.stop()

