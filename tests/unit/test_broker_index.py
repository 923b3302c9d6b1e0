"""The lease book's indexes (issue 39: a grant and a pick cost what the devices asked for and the
person's own records hold, not the whole book): the one admission, given only the leases it
reads (:meth:`LeaseBook.counted_for`), decides every lease as it does over every live lease,
words included; the booking view and the live records follow every change (grants, re-picks,
set_pid, ends, orphans).

A ``Broker`` object with connections made by hand (no socket, no journal), as in
test_broker_rules.py; the state is built by a seeded random walk so that exclusive and shared
leases, MIG devices and their parents, several people and their quotas all meet.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from autogpu_jupyter.broker import Broker, BrokerRefusal, Conn
from autogpu_jupyter.brokerd import ops as ops_mod
from autogpu_jupyter.brokerd.book import Orphan
from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.errors import AutoGPUError
from tests.unit.test_broker_rules import broker, person, run

GPUS = ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
MIGS = {"MIG-0a": "GPU-0", "MIG-0b": "GPU-0", "MIG-2a": "GPU-2"}
DEVICES = GPUS + list(MIGS)


def hold(b: Broker, conn: Conn, devices: list[str], exclusive: bool, created_s: float) -> Any:
    rec = ops_mod.make_record(b, conn, "lease", {
        "device_uuids": devices, "device_requested_bytes": [1 << 30] * len(devices),
        "exclusive": exclusive, "pid": conn.pid, "kernel_id": None, "notebook_path": None,
        "command": None, "holder_kind": "process",
    })
    conn.record = replace(rec, created_s=created_s)
    return conn.record


def verdict_over_everything(b: Broker, conn: Conn, devices: list[str], exclusive: bool,
                            replaced: set[str]) -> str:
    """What the one admission says over EVERY live lease (the book before its indexes)."""
    leases, _ = b.book.live_split(replaced)
    try:
        admission.admit_lease(
            leases, applicant=b.book.applicant(conn), devices=devices, exclusive=exclusive,
            quota=b.book.quota(conn), reserved=b.config.reserved, parents=b.book.parents,
        )
    except AutoGPUError as err:
        return str(err)
    return "granted"


def verdict_of_the_book(b: Broker, conn: Conn, devices: list[str], exclusive: bool,
                        replaced: set[str]) -> str:
    rec = ops_mod.make_record(b, conn, "lease", {
        "device_uuids": devices, "device_requested_bytes": [None] * len(devices),
        "exclusive": exclusive, "pid": conn.pid, "kernel_id": None, "notebook_path": None,
        "command": None, "holder_kind": "process",
    })
    try:
        b.book.check_lease(conn, rec, replaced)
    except BrokerRefusal as err:
        return str(err)
    return "granted"


def random_book(seed: int) -> tuple[Broker, list[Conn], list[Conn]]:
    rng = random.Random(seed)
    b = broker(max_devices_per_user=3, max_leases_per_user=4,
               user_limits={"user1003": 0})
    b.book.parents = dict(MIGS)
    people = [person(b, uid) for uid in (1001, 1002, 1003)]
    holders: list[Conn] = []
    for i in range(40):
        who = rng.choice(people)
        conn = person(b, who.uid)
        devices = rng.sample(DEVICES, rng.choice((1, 1, 2)))
        try:
            hold(b, conn, devices, rng.random() < 0.15, created_s=float(rng.randrange(30)))
            holders.append(conn)
        except BrokerRefusal:
            pass
        if holders and rng.random() < 0.2:  # some end, some move to another pid
            gone = holders.pop(rng.randrange(len(holders)))
            gone.record = None
        if holders and rng.random() < 0.2:
            moved = rng.choice(holders)
            assert moved.record is not None
            moved.record = replace(moved.record, pid=moved.record.pid + 1)
        if holders and rng.random() < 0.1:  # a restart left one as an orphan
            left = holders.pop(rng.randrange(len(holders)))
            rec = left.record
            assert rec is not None
            left.record = None
            b.book.adopt(Orphan(left.uid, rec, [], key=left.key))
    return b, people, holders


def test_the_admission_over_the_leases_it_reads_decides_as_over_every_lease() -> None:
    """Every request of every person on every device and pair of devices (on GPUs and MIG
    devices of one another, shared and exclusive, with and without a re-pick's replaced lease),
    over 12 random books: the same grant or the same refusal, word for word. Caught: the MIG
    kin of the asked devices left out (a parent held exclusively was missed), the person's own
    leases on other devices left out (the device and lease quotas not reached), a re-pick's
    replaced lease still counted, the leases given in another order (other words)."""
    seen: set[str] = set()
    for seed in range(12):
        b, people, holders = random_book(seed)
        asks = [[d] for d in DEVICES] + [[a, c] for a in DEVICES for c in DEVICES if a < c]
        for who in people:
            own = [c.record.lease_id for c in holders if c.uid == who.uid and c.record]
            for replaced in ({*own[:1]}, set()):
                for devices in asks:
                    for exclusive in (False, True):
                        want = verdict_over_everything(b, who, devices, exclusive, replaced)
                        got = verdict_of_the_book(b, who, devices, exclusive, replaced)
                        assert got == want, (seed, who.uid, devices, exclusive, replaced)
                        seen.add(want.split(":")[0].split(" already")[-1][:30])
    # the walk met grants and each kind of refusal
    assert "granted" in seen and "no device free" in seen
    assert any("holds leases on" in s or "lease(s)" in s for s in seen), seen


def test_the_booking_view_and_the_live_records_follow_every_change() -> None:
    """After grants, ends, set_pid and orphans, ``begin`` shows each person what a view built
    from every live lease shows: their own leases in full, every other device's rows, in the
    live order. Caught: an ended lease or an orphan kept in a device's rows, a device's rows
    kept after one of its leases moved to another pid."""
    for seed in range(6):
        b, people, _ = random_book(seed)
        everything = b.book.live()
        assert everything == sorted(everything, key=lambda p: (p[1].created_s, p[1].lease_id))
        for who in people:
            got = run(b.run_op("begin", who, {"op": "begin"}))
            b.lock.release(who)
            own = [r.lease_id for k, r in everything if k == who.key and r.kind == "lease"]
            assert [r["lease_id"] for r in got["own"]] == own
            per_dev: dict[str, int] = {}
            for k, r in everything:
                if k != who.key:
                    for d in r.device_uuids:
                        per_dev[d] = per_dev.get(d, 0) + 1
            shown = {d["uuid"]: len(d["rows"]) + d["more"]["leases"] for d in got["devices"]}
            assert shown == per_dev
            pids = sorted(row[1] for d in got["devices"] for row in d["rows"])
            assert pids == sorted(r.pid for k, r in everything if k != who.key
                                  for _ in r.device_uuids)


def _bookings_one_device_at_a_time(devices: Any, leases: Any) -> dict[str, Any]:
    """What :func:`core.decision.bookings_for` gave before it read each lease once: every
    lease asked of every device (the reference it must still agree with)."""
    from autogpu_jupyter.core.policy import Booking

    out = {}
    for dev in devices:
        count, booked, excl, holders = 0, 0, [], []
        using = {p.pid for p in (dev.processes or ()) if p.used_memory_bytes is not None}
        for rec in leases:
            if not rec.live or rec.kind != "lease" or dev.uuid not in rec.device_uuids:
                continue
            count += 1
            if rec.exclusive:
                excl.append(admission.exclusive_phrase(rec))
            holders.append(rec.holder_text())
            req = rec.requested_on(dev.uuid)
            if req and rec.pid not in using:
                booked += req
        out[dev.uuid] = Booking(uuid=dev.uuid, lease_count=count, booked_bytes=booked,
                                exclusive=bool(excl), holders=tuple(holders),
                                exclusive_by=tuple(dict.fromkeys(excl)))
    return out


def test_the_bookings_read_each_lease_once_and_count_as_every_lease_asked_of_every_device(
) -> None:
    """Random leases (on one or two devices, a device named twice, exclusive, not live,
    tickets, fewer bookings than devices: a record from the wire is typed, not checked; a
    record given several times as the broker's folded leases are, pids NVML lists): the same
    bookings, holders in the same order. Caught: a repeated record counted once, a device
    named twice in one lease counted twice, a lease whose pid NVML lists still booked, a
    one-device lease with no booking read past its end."""
    from autogpu_jupyter.core.decision import bookings_for
    from autogpu_jupyter.core.devices import DeviceSnapshot, ProcessSnapshot
    from autogpu_jupyter.core.leasing.records import LeaseRecord

    rng = random.Random(7)
    listed = (ProcessSnapshot(pid=5, used_memory_bytes=1),)
    devices = [DeviceSnapshot(index=i, uuid=u, name="x", processes=listed if i else None)
               for i, u in enumerate(GPUS)]
    for _ in range(60):
        leases: list[LeaseRecord] = []
        for n in range(rng.randrange(12)):
            uuids = tuple(rng.choice(GPUS) for _ in range(rng.choice((1, 2))))
            rec = LeaseRecord(
                lease_id=f"L{n}", kind=rng.choice(("lease", "lease", "ticket")),
                device_uuids=uuids, device_requested_bytes=tuple(
                    rng.choice((None, 0, 1 << 30)) for _ in uuids)[:rng.choice((2, 2, 1, 0))],
                exclusive=rng.random() < 0.2, user=f"u{n}", uid=n, host="h",
                pid=rng.choice((5, 6)), created_s=0.0, live=rng.random() < 0.9)
            leases += [rec] * rng.choice((1, 1, 3))
        assert bookings_for(devices, leases) == _bookings_one_device_at_a_time(devices, leases)


def test_the_dump_of_the_namespaces_unix_sockets_names_each_open_one_and_no_closed_one(
) -> None:
    """A restart asks for the sockets of 10,000 orphans with one ``sock_diag`` dump (issue 39):
    it names both ends of a socket pair while they are open and neither once they are closed.
    Caught: the inode read from another field of the kernel's answer, a multi-part answer read
    only in its first part (200 pairs do not fit one)."""
    import os
    import socket

    from autogpu_jupyter.brokerd import peers

    pairs = [socket.socketpair() for _ in range(200)]
    inodes = {os.fstat(s.fileno()).st_ino for pair in pairs for s in pair}
    try:
        assert inodes <= peers.unix_inodes()
    finally:
        for a, c in pairs:
            a.close()
            c.close()
    assert not inodes & peers.unix_inodes()
