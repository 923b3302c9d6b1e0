"""The booking view by process (issue 39: a pick on a 64-GPU host with 10,000 leases read a view
of 1,024 named rows): a pick of this version asks ``begin`` for each device's leases grouped by
the process holding them (``"view": "pids"``), and decides on them exactly as on every live
lease's full record -- the same bookings, the same choice, the same words -- wherever a device's
other leases come from at most ``VIEW_ROWS_PER_DEVICE`` processes; past that the rest are folded
as before (counted, booked, never less). A client that does not ask gets the rows it reads.

A ``Broker`` object with connections made by hand (no socket, no journal), as in
test_broker_rules.py; the books are seeded random walks over 64 GPUs.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerRefusal, Conn
from autogpu_jupyter.brokerd import ops as ops_mod
from autogpu_jupyter.brokerd import views as views_mod
from autogpu_jupyter.core.decision import bookings_for, decide, gather
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing import wire
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import parse_size
from tests.unit.test_broker_rules import broker, person, run

GIB = 1 << 30
GPUS = [f"GPU-{i:02d}" for i in range(64)]
ASKS = [
    Constraints(),
    Constraints(min_free=parse_size("40G")),
    Constraints(min_free=parse_size("20G"), count=3),
    Constraints(exclusive=True),
    Constraints(max_util_pct=50.0, count=2),
]


def random_book(seed: int, processes: int) -> tuple[Broker, list[int], Conn]:
    """A book of 150-400 leases of six people from ``processes`` pids, most on six busy GPUs
    (some on two GPUs, a few exclusive, bookings of none, 0, 1 or 3 GiB); and the viewer."""
    rng = random.Random(seed)
    b = broker()
    pids = [4000 + i for i in range(processes)]
    busy = rng.sample(GPUS, 6)
    for _ in range(rng.randrange(150, 400)):
        conn = person(b, 2000 + rng.randrange(6), pid=rng.choice(pids))
        devices = rng.sample(busy if rng.random() < 0.8 else GPUS, rng.choice((1, 1, 1, 2)))
        conn.record = ops_mod.make_record(b, conn, "lease", {
            "device_uuids": devices,
            "device_requested_bytes": [rng.choice((None, 0, GIB, 3 * GIB)) for _ in devices],
            "exclusive": rng.random() < 0.03, "pid": conn.pid, "kernel_id": None,
            "notebook_path": f"nb-{rng.randrange(50)}.ipynb", "command": None,
            "holder_kind": "kernel",
        })
    return b, pids, person(b, 1001, pid=1)


def fleet(seed: int, pids: list[int]) -> FleetSnapshot:
    """64 GPUs, each listing a few of the holders' pids (some with a memory use NVML knows:
    their bookings stop counting there) and an unknown process list on some."""
    rng = random.Random(seed)
    devices = []
    for i, uuid in enumerate(GPUS):
        free = rng.randrange(0, 81) * GIB
        listed = tuple(ProcessSnapshot(pid=p, used_memory_bytes=rng.choice((None, GIB)))
                       for p in rng.sample(pids, rng.randrange(0, min(5, len(pids) + 1))))
        devices.append(DeviceSnapshot(
            index=i, uuid=uuid, name="NVIDIA A100-SXM4-80GB", memory_total_bytes=80 * GIB,
            memory_used_bytes=80 * GIB - free, memory_free_bytes=free,
            utilization_pct=float(rng.choice((0, 20, 70))),
            processes=None if rng.random() < 0.05 else listed))
    return FleetSnapshot(tuple(devices), 0.0, "test")


class Records:
    """The leases a decision reads, as a lease store gives them (no tickets)."""

    def __init__(self, leases: list[LeaseRecord]) -> None:
        self.leases = leases

    def live_records(self, txn: Any = None) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        return self.leases, []


def begin(b: Broker, viewer: Conn, **msg: Any) -> dict[str, Any]:
    got = run(b.run_op("begin", viewer, {"op": "begin", **msg}))
    b.lock.release(viewer)
    return got


def everything(b: Broker, viewer: Conn) -> list[LeaseRecord]:
    """Every live lease but the viewer's, in full (what the shared directory would give)."""
    return [r for k, r in b.book.live() if k != viewer.key and r.kind == "lease"]


def decision_words(snap: FleetSnapshot, leases: list[LeaseRecord], ask: Constraints) -> Any:
    """What a user is told of a decision: every device in rank, kept or not, with its reasons
    and the memory it counts free; and the devices chosen."""
    d = decide(gather(snap, environ={}, store=Records(leases)), ask)
    return ([(c.device.uuid, c.eligible, c.reasons, c.effective_free_bytes) for c in d.ranked],
            [c.device.uuid for c in d.chosen])


def test_a_pick_on_the_view_by_process_decides_as_on_every_full_record() -> None:
    """12 random books of up to 16 holder processes on 64 GPUs, five requests each: the view by
    process gives the same bookings (count, bytes, exclusivity and why) and the same ranking,
    reasons and choice as every live lease's record. Caught: a process's leases booked once
    (not summed), a lease booking 0 or nothing counted as booking, a pid NVML lists discounted
    for only one of its leases, a process folded away below the cap, a two-GPU lease counted
    on one device only, the exclusive lease of a process lost in its group."""
    for seed in range(12):
        b, pids, viewer = random_book(seed, processes=random.Random(seed).choice((3, 8, 16)))
        snap = fleet(seed, pids)
        full = everything(b, viewer)
        got = begin(b, viewer, view="pids")
        assert all("rows" not in d and len(d["pids"]) <= wire.VIEW_ROWS_PER_DEVICE
                   and d["more"]["leases"] == 0 for d in got["devices"])
        view = wire.view_records(got["devices"], "/s")

        def shown(leases: list[LeaseRecord]) -> Any:
            return {u: (bk.lease_count, bk.booked_bytes, bk.exclusive, bk.exclusive_by)
                    for u, bk in bookings_for(snap.devices, leases).items()}

        assert shown(view) == shown(full), seed
        assert any(bk[0] > 20 for bk in shown(full).values())  # devices with many leases
        for ask in ASKS:
            assert decision_words(snap, view, ask) == decision_words(snap, full, ask), (
                seed, ask)


def test_past_the_cap_of_processes_a_device_is_never_seen_emptier() -> None:
    """With 40 holder processes a busy device has more than VIEW_ROWS_PER_DEVICE: the rest are
    folded into ``more``, counted and booked whether or not NVML lists their pids -- the same
    count and exclusivity as every record, the booking the same or more, never less. Caught:
    the folded processes' leases or bookings dropped, the exclusive one folded away."""
    folded = 0
    for seed in range(6):
        b, pids, viewer = random_book(100 + seed, processes=40)
        snap = fleet(seed, pids)
        got = begin(b, viewer, view="pids")
        folded += sum(d["more"]["leases"] for d in got["devices"])
        view = bookings_for(snap.devices, wire.view_records(got["devices"], "/s"))
        full = bookings_for(snap.devices, everything(b, viewer))
        for uuid, bk in full.items():
            assert (view[uuid].lease_count, view[uuid].exclusive, view[uuid].exclusive_by) == (
                bk.lease_count, bk.exclusive, bk.exclusive_by)
            assert view[uuid].booked_bytes >= bk.booked_bytes
    assert folded > 0


def test_a_devices_processes_put_the_exclusive_then_the_largest_bookings_first() -> None:
    """``device_pids``: one row per process (its leases, what they book together, whether one
    is exclusive), the exclusive first, then the largest; past VIEW_ROWS_PER_DEVICE folded.
    Caught: the processes in the order they came (the largest folded away), the exclusive
    lease of a process not marked."""
    b = broker()
    recs = []
    for i in range(wire.VIEW_ROWS_PER_DEVICE + 2):
        conn = person(b, 2000 + i, pid=500 + i)
        for booked in ((i + 1) * GIB, GIB):  # two leases each
            recs.append(ops_mod.make_record(b, conn, "lease", {
                "device_uuids": ["GPU-v"], "device_requested_bytes": [booked],
                "exclusive": i == 0 and booked == GIB, "pid": conn.pid, "kernel_id": None,
                "notebook_path": None, "command": None, "holder_kind": "kernel",
            }))
    got = views_mod.device_pids("GPU-v", recs)
    n = wire.VIEW_ROWS_PER_DEVICE + 2
    assert got["pids"] == [
        [500, 2, 2 * GIB, True],
        *[[500 + i, 2, (i + 2) * GIB, False] for i in range(n - 1, 2, -1)],
    ]
    assert got["more"] == {"leases": 4, "exclusive": False, "booked": 3 * GIB + 4 * GIB}


def test_a_client_that_does_not_ask_gets_the_rows_and_a_bad_view_is_one_line() -> None:
    """Older clients send ``begin`` without ``view`` and read each device's named rows: that is
    still what they get (asking ``rows`` gives the same). A view this broker does not know is
    refused with one line naming it and the views there are. Caught: every client given the
    view by process (an older one would count no lease: it reads only ``rows``)."""
    b, _, viewer = random_book(3, processes=8)
    old = begin(b, viewer)
    assert all("pids" not in d and d["rows"] for d in old["devices"])
    assert begin(b, viewer, view="rows")["devices"] == old["devices"]
    with pytest.raises(BrokerRefusal) as err:
        begin(b, viewer, view="everything")
    assert (str(err.value), err.value.kind) == (
        "view 'everything' is not one of rows, pids", "UsageErrorBase")


def test_the_view_by_process_is_smaller_than_the_rows_at_host_scale() -> None:
    """3,000 leases of 30 processes on 64 GPUs: the view by process carries fewer rows than
    the named rows do, and the records a pick makes of it are fewer too (what a pick decodes;
    issue 39). Caught: a device's processes sent once per lease."""
    b = broker()
    for i in range(3000):
        conn = person(b, 2000 + i % 10, pid=7000 + i % 30)
        conn.record = ops_mod.make_record(b, conn, "lease", {
            "device_uuids": [GPUS[i % 64]], "device_requested_bytes": [GIB], "exclusive": False,
            "pid": conn.pid, "kernel_id": f"{i:032x}", "notebook_path": f"nb-{i}.ipynb",
            "command": None, "holder_kind": "kernel",
        })
    viewer = person(b, 1001, pid=1)
    by_pid = begin(b, viewer, view="pids")["devices"]
    rows = begin(b, viewer)["devices"]
    assert sum(len(d["pids"]) for d in by_pid) < sum(len(d["rows"]) for d in rows)
    made = {id(r) for r in wire.view_records(by_pid, "/s")}
    assert len(made) < len({id(r) for r in wire.view_records(rows, "/s")})
    assert len(wire.view_records(by_pid, "/s")) == 3000


def _view_by_init(devices: list[dict[str, Any]], path: str) -> list[LeaseRecord]:
    """What the view's records are, each made by ``LeaseRecord``'s own ``__init__`` (the
    reading of the view before issue 39 set its records slot by slot): one per row, one per
    process, one per device's folded leases, and one alike record for every further lease."""
    out: list[LeaseRecord] = []

    def made(uuid: str, exclusive: bool, pid: int, booked: int | None, user: str,
             where: str | None) -> LeaseRecord:
        lease_id = f"view{len(out):028x}"
        return LeaseRecord(
            lease_id=lease_id, kind="lease", device_uuids=(uuid,),
            device_requested_bytes=(booked,), exclusive=exclusive, user=user, uid=-1, host="",
            pid=pid, created_s=0.0, notebook_path=where, path=f"{path}#{lease_id}")

    for dev in devices:
        for exclusive, pid, booked, user, where in dev.get("rows") or ():
            out.append(made(dev["uuid"], exclusive, pid, booked, user, where or None))
        more = dev.get("more") or {}
        groups = [*(dev.get("pids") or ()),
                  [0, more.get("leases", 0), more.get("booked") or 0, bool(more.get("exclusive"))]]
        alike = 0
        for pid, leases, booked, exclusive in groups:
            if leases > 0:
                alike += leases - 1
                out.append(made(dev["uuid"], exclusive, pid, booked or 0, "others", None))
        if alike:
            rest = made(dev["uuid"], False, 0, None, "others", None)
            out += [rest] * alike
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_views_records_are_those_the_records_own_init_makes(seed: int) -> None:
    """The records a pick makes of a booking view (set slot by slot, without the dataclass's
    ``__init__``: a third of a pick's time at host scale) equal, field for field and hash for
    hash, those ``LeaseRecord(...)`` makes, over random books read both ways (by process and
    as named rows), with the same runs of one record."""
    b, _, viewer = random_book(100 + seed, (3, 12, 30)[seed % 3])
    for view in wire.VIEW_SHAPES:
        devices = begin(b, viewer, view=view)["devices"]
        got = wire.view_records(devices, "/run/b.sock")
        want = _view_by_init(devices, "/run/b.sock")
        assert got == want and [hash(r) for r in got] == [hash(r) for r in want]
        assert [type(r) for r in got] == [LeaseRecord] * len(want)
        assert [id(r) == id(got[i - 1]) for i, r in enumerate(got) if i] == [
            id(r) == id(want[i - 1]) for i, r in enumerate(want) if i]
        assert [r.to_dict() for r in got] == [r.to_dict() for r in want]
    assert len(got) > 100


def test_a_view_record_is_frozen_as_any_record() -> None:
    rec = wire.view_records([{"uuid": "GPU-a", "pids": [[7, 2, GIB, False]]}], "/s")[0]
    with pytest.raises(AttributeError):
        rec.pid = 8  # type: ignore[misc]
    assert (rec.pid, rec.requested_on("GPU-a"), rec.holder_text()) == (7, GIB, "others: pid 7")


@pytest.mark.parametrize("seed", range(3))
def test_the_begin_line_carries_each_devices_kept_json_and_says_what_the_book_holds_now(
    seed: int,
) -> None:
    """The ``begin`` reply goes out with each device's JSON as the row cache keeps it (not
    encoded again per pick): the same JSON as the reply encoded whole, in both views, and
    after a lease on a device the line says so (no stale bytes)."""
    b, pids, viewer = random_book(200 + seed, 12)
    for view in wire.VIEW_SHAPES:
        reply = {"ok": True, **begin(b, viewer, view=view), "proto": wire.PROTOCOL}
        line = views_mod.encoded_line(reply)
        assert line is not None and line.endswith(b"}\n") and line.count(b"\n") == 1
        assert json.loads(line) == json.loads(json.dumps(reply))
    before = json.loads(views_mod.encoded_line({"ok": True, **begin(b, viewer, view="pids")}))
    conn = person(b, 2001, pid=pids[0])
    conn.record = ops_mod.make_record(b, conn, "lease", {
        "device_uuids": [GPUS[63]], "device_requested_bytes": [7 * GIB], "exclusive": True,
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "kernel"})
    reply = {"ok": True, **begin(b, viewer, view="pids")}
    after = json.loads(views_mod.encoded_line(reply) or b"")
    assert after == json.loads(json.dumps(reply)) != before
    assert [pids[0], 1, 7 * GIB, True] in next(
        d for d in after["devices"] if d["uuid"] == GPUS[63])["pids"]
    assert views_mod.encoded_line({"ok": True}) is None
    assert views_mod.encoded_line({"ok": True, "devices": [{"uuid": "GPU-x"}]}) is None



def test_after_a_burst_of_leases_and_a_turn_of_the_loop_a_pick_builds_no_devices_rows() -> None:
    """The broker keeps the booking view warm (issue 39: the first pick after 10,000 grants
    built all 64 devices' rows on its own path): once the loop has turned after a burst of
    leases, a pick's ``begin`` builds no device's rows, and its line is the very line of a
    broker that kept nothing. Caught: rows built only when a pick asks (what ``built`` counts),
    a rebuild that keeps stale rows (the line differs), a shape asked for not kept warm."""

    def lease(bk: Broker, uid: int, pid: int, devices: list[str], exclusive: bool) -> None:
        conn = person(bk, uid, pid=pid)
        conn.record = ops_mod.make_record(bk, conn, "lease", {
            "device_uuids": devices, "device_requested_bytes": [GIB for _ in devices],
            "exclusive": exclusive, "pid": pid, "kernel_id": None,
            "notebook_path": "nb.ipynb", "command": None, "holder_kind": "kernel"})

    async def line(bk: Broker, viewer: Conn, view: str) -> bytes | None:
        got = await bk.run_op("begin", viewer, {"op": "begin", "view": view})
        bk.lock.release(viewer)
        return views_mod.encoded_line(got)

    async def go() -> None:
        b, fresh = broker(), broker()
        for bk in (b, fresh):  # the same burst, made while the loop runs
            rng = random.Random(7)
            for _ in range(300):
                lease(bk, 2000 + rng.randrange(6), 4000 + rng.randrange(40),
                      rng.sample(GPUS, rng.choice((1, 1, 2))), False)
        viewer, other = person(b, 1001, pid=1), person(fresh, 1001, pid=1)
        await b.views.settled()
        built = []
        for n, view in enumerate(("pids", "rows", "pids", "rows")):
            before = b.ops_cache.built
            got = await line(b, viewer, view)
            built.append(b.ops_cache.built - before)
            fresh.ops_cache = views_mod.RowCache()  # keeps nothing
            assert got == await line(fresh, other, view)
            for bk in (b, fresh):  # one more lease: its device goes stale
                lease(bk, 2001, 4001, [GPUS[5 + n]], True)
            await b.views.settled()
        # the rows by lease were built once, by the first pick that asked for them
        assert built == [0, len(b.book.index.leased_devices()), 0, 0]

    run(go())
