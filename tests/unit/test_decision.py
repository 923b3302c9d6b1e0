"""The decision pipeline's own rules: lease bookings, the waiting line, how a choice is explained.

Devices are plain snapshots; tickets are real ones taken in a tmp registry (real files, flock).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import decision
from autogpu_jupyter.core.decision import (
    Context,
    bookings_for,
    decide,
    deciding_term,
    describe_load,
    gather,
    reserve_for_waiters,
    served_waiters,
    ticket_constraints,
)
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing.admission import ticket_text
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.policy import Booking, Candidate, Constraints, rank
from autogpu_jupyter.core.units import Size

GiB = 1024**3


def dev(
    i: int,
    *,
    free: int | None = 10 * GiB,
    total: int | None = 10 * GiB,
    util: float | None = 0.0,
    name: str = "Tesla T4",
    procs: tuple[ProcessSnapshot, ...] | None = (),
    **kw: Any,
) -> DeviceSnapshot:
    return DeviceSnapshot(
        index=i,
        uuid=f"GPU-{i}",
        name=name,
        memory_total_bytes=total,
        memory_free_bytes=free,
        memory_used_bytes=None if free is None or total is None else total - free,
        utilization_pct=util,
        processes=procs,
        **kw,
    )


def lease(
    uuids: tuple[str, ...],
    booked: tuple[int | None, ...],
    *,
    pid: int = 50,
    user: str = "ann",
    exclusive: bool = False,
    live: bool = True,
    kind: str = "lease",
    **kw: Any,
) -> LeaseRecord:
    return LeaseRecord(
        lease_id="0" * 16,
        kind=kind,
        device_uuids=uuids,
        device_requested_bytes=booked,
        exclusive=exclusive,
        user=user,
        uid=1,
        host="h",
        pid=pid,
        created_s=0.0,
        live=live,
        **kw,
    )


def test_no_leases_give_an_empty_booking_per_device() -> None:
    assert bookings_for([dev(0), dev(1)], []) == {
        "GPU-0": Booking("GPU-0", 0, 0, False, ()),
        "GPU-1": Booking("GPU-1", 0, 0, False, ()),
    }


def test_live_leases_book_their_request_on_each_of_their_devices() -> None:
    leases = [
        lease(("GPU-0", "GPU-1"), (2 * GiB, 3 * GiB), pid=50, notebook_path="a.ipynb"),
        lease(("GPU-0",), (1 * GiB,), pid=51, user="bo", exclusive=True),
        lease(("GPU-0",), (None,), pid=52, user="cy"),
        lease(("GPU-0",), (7 * GiB,), pid=53, user="dead", live=False, exclusive=True),
        lease(("GPU-0",), (7 * GiB,), pid=54, user="waiter", kind="ticket"),
    ]
    assert bookings_for([dev(0), dev(1), dev(2)], leases) == {
        "GPU-0": Booking(
            "GPU-0", 3, 3 * GiB, True, ("ann: a.ipynb", "bo: pid 51", "cy: pid 52"),
            exclusive_by=("held exclusively by another lease",),
        ),
        "GPU-1": Booking("GPU-1", 1, 3 * GiB, False, ("ann: a.ipynb",)),
        "GPU-2": Booking("GPU-2", 0, 0, False, ()),
    }


@pytest.mark.parametrize(
    ("procs", "booked"),
    [
        ((), 2 * GiB),  # holder not running on it yet: its request counts
        (None, 2 * GiB),  # processes unknown: keep the booking
        ((ProcessSnapshot(pid=50, used_memory_bytes=None),), 2 * GiB),  # use unknown
        ((ProcessSnapshot(pid=50, used_memory_bytes=5),), 0),  # real use counts instead
        ((ProcessSnapshot(pid=99, used_memory_bytes=5),), 2 * GiB),  # someone else
    ],
)
def test_a_booking_ends_once_nvml_shows_the_holder_using_memory(procs, booked) -> None:
    out = bookings_for([dev(0, procs=procs)], [lease(("GPU-0",), (2 * GiB,), pid=50)])
    assert out["GPU-0"].booked_bytes == booked
    assert out["GPU-0"].lease_count == 1


def test_exclusive_of_an_earlier_lease_is_kept_by_later_ones() -> None:
    leases = [lease(("GPU-0",), (None,), exclusive=True), lease(("GPU-0",), (None,), pid=2)]
    assert bookings_for([dev(0)], leases)["GPU-0"].exclusive is True


@pytest.mark.parametrize(
    ("cons", "allowed", "stored"),
    [
        (
            None,
            None,
            {
                "min_free_bytes": None,
                "min_free_fraction": None,
                "max_util_pct": None,
                "count": 1,
                "exclude": [],
                "exclusive": False,
                "allowed_uuids": None,
            },
        ),
        (
            Constraints(
                min_free=Size(bytes=5),
                max_util_pct=30.0,
                count=2,
                exclude=("GPU-9",),
                exclusive=True,
            ),
            ("GPU-1", "GPU-2"),
            {
                "min_free_bytes": 5,
                "min_free_fraction": None,
                "max_util_pct": 30.0,
                "count": 2,
                "exclude": ["GPU-9"],
                "exclusive": True,
                "allowed_uuids": ["GPU-1", "GPU-2"],
            },
        ),
        (
            Constraints(min_free=Size(fraction=0.25)),
            [],
            {
                "min_free_bytes": None,
                "min_free_fraction": 0.25,
                "max_util_pct": None,
                "count": 1,
                "exclude": [],
                "exclusive": False,
                "allowed_uuids": [],
            },
        ),
    ],
)
def test_ticket_constraints_store_the_request(cons, allowed, stored) -> None:
    assert ticket_constraints(cons, allowed) == stored


@pytest.mark.parametrize(
    ("stored", "cons"),
    [
        ({}, Constraints()),
        ({"min_free_bytes": 7, "min_free_fraction": 0.5}, Constraints(min_free=Size(bytes=7))),
        (
            {"min_free_bytes": None, "min_free_fraction": 0.5},
            Constraints(min_free=Size(fraction=0.5)),
        ),
        (
            {"max_util_pct": 20, "count": 3, "exclude": ["a"], "exclusive": True},
            Constraints(max_util_pct=20, count=3, exclude=("a",), exclusive=True),
        ),
    ],
)
def test_a_stored_ticket_request_reads_back_as_constraints(stored, cons) -> None:
    assert decision._ticket_request(stored) == cons


def test_a_ticket_keeps_the_whole_request_through_its_record() -> None:
    """Issue 39: a ticket stored its request in a shape of its own that dropped ``models`` and
    ``prefer`` (a waiter for an A100 was served as if any model would do). Every field of the
    request survives the record, as the readers of both stores parse it; a field added to
    :class:`Constraints` and not to the ticket fails here."""
    from autogpu_jupyter.core.leasing.records import encode, parse_record

    full = Constraints(min_free=Size(bytes=5), max_util_pct=30.0, count=2, exclude=("GPU-9",),
                       exclusive=True, models=("A100", "H100"), prefer=("H100",), devices=("1",))
    for f in dataclasses.fields(Constraints):
        assert getattr(full, f.name) != getattr(Constraints(), f.name), f.name
    rec = dataclasses.replace(ticket_rec(1, ticket_constraints(full, ["GPU-1"])), lease_id="a" * 32)
    back = parse_record(encode(rec), kind="ticket", path="", live=True)
    # Named devices (issue 41) travel as the UUIDs they named, the ticket's allowed devices:
    # the record keeps the shape older readers know; every other field as it was asked.
    assert decision._ticket_request(back.constraints or {}) == dataclasses.replace(
        full, devices=())
    assert (back.constraints or {})["allowed_uuids"] == ["GPU-1"]
    # Without a model or a preference the record has the shape older readers know.
    assert "models" not in ticket_constraints(Constraints(), None)


def test_a_waiter_for_one_model_reserves_nothing_of_another() -> None:
    """An exclusive waiter for an A100 is served the A100 only: the L4 stays free for others."""
    devices = [dev(0, name="NVIDIA A100-SXM4-80GB", util=90.0), dev(1, name="NVIDIA L4")]
    t = ticket_rec(1, ticket_constraints(Constraints(exclusive=True, models=("A100",)), None))
    out = reserve_for_waiters(devices, empty(devices), [t])
    assert (out["GPU-0"].exclusive, out["GPU-1"].lease_count) == (True, 0)
    held = bookings_for(devices, [lease(("GPU-0",), (None,), exclusive=True)])
    assert served_waiters(devices, held, [t]) == {}


def ticket_rec(
    seq: int, cons: dict[str, Any], *, user: str = "wa", lid: str | None = None
) -> LeaseRecord:
    return LeaseRecord(
        lease_id=lid or f"{seq:016x}",
        kind="ticket",
        device_uuids=(),
        device_requested_bytes=(),
        exclusive=False,
        user=user,
        uid=1,
        host="h",
        pid=1,
        created_s=0.0,
        seq=seq,
        constraints=cons,
    )


def empty(devices: list[DeviceSnapshot]) -> dict[str, Booking]:
    return bookings_for(devices, [])


def test_an_older_waiter_gets_the_best_device_reserved() -> None:
    devices = [dev(0, util=50.0), dev(1, util=0.0)]
    t = ticket_rec(1, ticket_constraints(Constraints(min_free=Size(bytes=3 * GiB)), None))
    out = reserve_for_waiters(devices, empty(devices), [t])
    assert out["GPU-1"] == Booking(
        "GPU-1", 1, 3 * GiB, False, ("wa: waiting (ticket 1)",), waiting=(ticket_text(t),)
    )
    assert out["GPU-0"] == Booking("GPU-0", 0, 0, False, ())


def test_waiters_are_served_in_turn_and_exclusive_is_booked() -> None:
    devices = [dev(0, util=10.0), dev(1, util=0.0)]
    t1 = ticket_rec(1, ticket_constraints(Constraints(exclusive=True), None), user="a")
    t2 = ticket_rec(2, ticket_constraints(Constraints(min_free=Size(fraction=0.5)), None), user="b")
    out = reserve_for_waiters(devices, empty(devices), [t1, t2])
    assert out["GPU-1"] == Booking(
        "GPU-1", 1, 0, True, ("a: waiting (ticket 1)",),
        exclusive_by=(f"reserved for {ticket_text(t1)}",), waiting=(ticket_text(t1),),
    )
    assert out["GPU-0"] == Booking(
        "GPU-0", 1, 5 * GiB, False, ("b: waiting (ticket 2)",), waiting=(ticket_text(t2),)
    )


def test_an_admins_reservation_is_worded_as_one_in_the_bookings() -> None:
    from autogpu_jupyter.core.leasing.admission import reservation

    leases = [reservation("GPU-0", ["ml"], "h"), lease(("GPU-0",), (None,), exclusive=True),
              lease(("GPU-0",), (None,), pid=2, exclusive=True)]
    assert bookings_for([dev(0)], leases)["GPU-0"].exclusive_by == (
        "reserved for group(s) ml by the admin", "held exclusively by another lease"
    )


def test_served_waiters_names_each_ticket_the_line_would_serve_now() -> None:
    """The same FIFO rule: the first waiter takes GPU 1 exclusively, the second the other one,
    the third (two GPUs) finds none left; bookings of live leases count."""
    devices = [dev(0, util=10.0), dev(1, util=0.0)]
    t1 = ticket_rec(1, ticket_constraints(Constraints(exclusive=True), None))
    t2 = ticket_rec(2, ticket_constraints(Constraints(), None))
    t3 = ticket_rec(3, ticket_constraints(Constraints(count=2), None))
    assert served_waiters(devices, empty(devices), [t1, t2, t3]) == {
        t1.lease_id: ("GPU-1",), t2.lease_id: ("GPU-0",)}
    full = {u: dataclasses.replace(b, exclusive=True, lease_count=1)
            for u, b in empty(devices).items()}
    assert served_waiters(devices, full, [t1, t2, t3]) == {}
    assert served_waiters(devices, empty(devices), []) == {}


def test_a_waiter_limited_to_allowed_devices_or_their_mig_parent() -> None:
    devices = [
        dev(0, util=0.0),
        dev(1, util=50.0),
        dev(2, util=90.0, is_mig=True, parent_uuid="GPU-P", mig_index=0),
    ]
    t = ticket_rec(1, ticket_constraints(Constraints(), ["GPU-1"]))
    out = reserve_for_waiters(devices, empty(devices), [t])
    assert [u for u, b in out.items() if b.lease_count] == ["GPU-1"]
    t = ticket_rec(1, ticket_constraints(Constraints(), ["GPU-P"]))
    out = reserve_for_waiters(devices, empty(devices), [t])
    assert [u for u, b in out.items() if b.lease_count] == ["GPU-2"]


def test_a_malformed_waiter_is_ignored_and_the_next_served() -> None:
    devices = [dev(0)]
    bad = ticket_rec(1, {"count": "many"})
    good = ticket_rec(2, {})
    out = reserve_for_waiters(devices, empty(devices), [bad, good])
    assert out["GPU-0"].holders == ("wa: waiting (ticket 2)",)
    bad_exclude = ticket_rec(3, {"exclude": 5})
    out = reserve_for_waiters(devices, empty(devices), [bad_exclude, ticket_rec(4, {})])
    assert out["GPU-0"].holders == ("wa: waiting (ticket 4)",)
    bad_fraction = ticket_rec(5, {"min_free_fraction": "half"})
    out = reserve_for_waiters(devices, empty(devices), [bad_fraction, ticket_rec(6, {})])
    assert out["GPU-0"].holders == ("wa: waiting (ticket 6)",)


def test_a_waiter_with_no_constraints_record_takes_one_device() -> None:
    devices = [dev(0)]
    t = dataclasses.replace(ticket_rec(1, {}), constraints=None)
    assert reserve_for_waiters(devices, empty(devices), [t])["GPU-0"].lease_count == 1


def test_a_device_without_a_booking_entry_is_not_reserved() -> None:
    devices = [dev(0)]
    out = reserve_for_waiters(devices, {}, [ticket_rec(1, {})])
    assert out == {}


def test_a_fraction_on_unknown_total_books_nothing_extra() -> None:
    devices = [dev(0, total=None)]
    t = ticket_rec(1, ticket_constraints(Constraints(min_free=Size(fraction=0.1)), None))
    out = reserve_for_waiters(devices, empty(devices), [t])
    assert out["GPU-0"].booked_bytes == 0


def test_the_input_bookings_are_not_changed() -> None:
    devices = [dev(0)]
    base = empty(devices)
    reserve_for_waiters(devices, base, [ticket_rec(1, {})])
    assert base["GPU-0"].lease_count == 0


def test_only_waiters_older_than_our_ticket_are_served_first(tmp_path: Path) -> None:
    registry = DirectoryStore(tmp_path / "registry", max_tickets_per_user=3)
    first = registry.take_ticket(constraints=ticket_constraints(None, None))
    mine = registry.take_ticket(constraints=ticket_constraints(None, None))
    later = registry.take_ticket(constraints=ticket_constraints(None, None))
    assert first is not None and mine is not None and later is not None
    try:
        _, tickets = registry.live_records()
        assert [t.lease_id for t in tickets] == [
            first.record.lease_id,
            mine.record.lease_id,
            later.record.lease_id,
        ]
        devices = [dev(0), dev(1), dev(2)]
        out = reserve_for_waiters(devices, empty(devices), tickets, ticket=mine)
        assert sum(b.lease_count for b in out.values()) == 1
        assert out["GPU-0"].holders == (
            f"{first.record.user}: waiting (ticket {first.record.seq})",
        )
        everyone = reserve_for_waiters(devices, empty(devices), tickets)
        assert sum(b.lease_count for b in everyone.values()) == 3
        ctx = gather(
            FleetSnapshot(tuple(devices), 0.0, "test"), environ={}, store=registry, ticket=mine
        )
        assert ctx.bookings == out
        older = reserve_for_waiters(devices, empty(devices), tickets, ticket=first)
        assert sum(b.lease_count for b in older.values()) == 0
    finally:
        for t in (first, mine, later):
            t.release()


def test_a_ticket_with_seq_zero_is_older_than_ours() -> None:
    devices = [dev(0)]
    zero = ticket_rec(0, {})
    nos = dataclasses.replace(ticket_rec(0, {}, lid="e" * 16), seq=None)

    class Mine:
        record = ticket_rec(1, {}, lid="f" * 16)

    out = reserve_for_waiters(devices, empty(devices), [zero, nos], ticket=Mine())  # type: ignore[arg-type]
    assert out["GPU-0"].lease_count == 2


# --- gather and decide -------------------------------------------------------------------------


def snap(*devices: DeviceSnapshot) -> FleetSnapshot:
    return FleetSnapshot(tuple(devices), 0.0, "test")


def test_gather_without_registry_has_no_bookings_and_reads_the_allocation() -> None:
    s = snap(dev(0), dev(1))
    ctx = gather(
        s,
        environ={"CUDA_VISIBLE_DEVICES": "1"},
        smoothed_util=lambda: {"GPU-0": 5.0},
        self_pids=[3, 4],
    )
    assert ctx.bookings == {}
    assert ctx.smoothed_util == {"GPU-0": 5.0}
    assert ctx.self_pids == (3, 4)
    assert ctx.snapshot is s
    d = decide(ctx, Constraints())
    assert [c.device.uuid for c in d.chosen] == ["GPU-1"]
    assert d.candidate("GPU-0").eligible is False
    assert d.runner_up is None


def test_gather_uses_this_process_environment_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    ctx = gather(snap(dev(0), dev(1)), smoothed_util={"GPU-1": 1.0})
    assert ctx.smoothed_util == {"GPU-1": 1.0}
    assert [c.device.uuid for c in decide(ctx, Constraints()).chosen] == ["GPU-0"]


def test_gather_reads_live_leases_from_the_registry(tmp_path: Path) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    t = registry.take_ticket(constraints=ticket_constraints(Constraints(exclusive=True), None))
    assert t is not None
    try:
        ctx = gather(snap(dev(0, util=20.0), dev(1)), environ={}, store=registry)
        assert ctx.bookings["GPU-1"].exclusive is True
        assert ctx.bookings["GPU-0"] == Booking("GPU-0")
        d = decide(ctx, Constraints())
        assert d.best is not None and d.best.device.uuid == "GPU-0"
        assert d.runner_up is None
        assert d.constraints == Constraints()
        assert d.context is ctx
    finally:
        t.release()


def test_decision_best_runner_up_and_candidate() -> None:
    ctx = Context(snap(dev(0, util=30.0), dev(1, util=0.0), dev(2, util=60.0)), None, {})  # type: ignore[arg-type]
    d = decide(ctx, Constraints())
    assert d.best is not None and d.best.device.uuid == "GPU-1"
    assert d.runner_up is not None and d.runner_up.device.uuid == "GPU-0"
    assert d.candidate("GPU-2") is d.ranked[2]
    assert d.candidate("GPU-9") is None
    two = decide(ctx, Constraints(count=2))
    assert [c.device.uuid for c in two.chosen] == ["GPU-1", "GPU-0"]
    assert two.runner_up is not None and two.runner_up.device.uuid == "GPU-2"
    none = decide(ctx, Constraints(count=4))
    assert none.best is None and none.chosen == ()
    assert none.runner_up is not None and none.runner_up.device.uuid == "GPU-1"


# --- explaining a choice ------------------------------------------------------------------------


def cand(
    util: float | None,
    free: int | None,
    total: int | None = 10 * GiB,
    *,
    name: str = "T4",
    key: tuple = (0.0, 0.0, 0.0, 0.0, ""),
) -> Candidate:
    d = dev(0, free=free, total=total, util=util, name=name)
    return Candidate(
        device=d,
        eligible=True,
        reasons=(),
        effective_free_bytes=free,
        smoothed_util_pct=util,
        key=key,
    )


@pytest.mark.parametrize(
    ("c", "long", "short"),
    [
        (cand(None, None), "load unknown", "?"),
        (cand(None, 5 * GiB, total=None), "load unknown", "?"),
        (cand(None, 5 * GiB, total=0), "load unknown", "?"),
        (cand(35.0, None), "load 35% (utilisation)", "35% util"),
        (cand(50.0, 5 * GiB), "load 50% (utilisation)", "50% util"),
        (cand(49.0, 5 * GiB), "load 50% (memory in use or booked)", "50% mem"),
        (cand(None, 7 * GiB), "load 30% (memory in use or booked)", "30% mem"),
        (cand(12.4, 10 * GiB), "load 12% (utilisation)", "12% util"),
    ],
)
def test_describe_load_names_the_larger_share(c: Candidate, long: str, short: str) -> None:
    assert describe_load(c) == long
    assert describe_load(c, short=True) == short


def test_describe_load_is_long_by_default() -> None:
    assert describe_load(cand(1.0, None)) == "load 1% (utilisation)"


def test_deciding_term_names_the_first_key_that_differs() -> None:
    a = cand(10.0, 8 * GiB, name="A100", key=(0.0, 1.0, 2.0, -8.0, "GPU-0"))
    assert deciding_term(a, None) == "the only device that fits"
    b = cand(90.0, 1 * GiB, name="T4", key=(1.0, 1.0, 2.0, -8.0, "GPU-1"))
    assert deciding_term(a, b) == "preferred model (A100 before T4)"
    b = cand(90.0, 1 * GiB, key=(0.0, 18.0, 2.0, -8.0, "GPU-1"))
    assert deciding_term(a, b) == "lower load (20% mem vs 90% util)"
    b = cand(10.0, 8 * GiB, key=(0.0, 1.0, 3.0, -8.0, "GPU-1"))
    assert deciding_term(a, b) == "fewer live leases (2 vs 3)"
    b = cand(10.0, 1 * GiB, key=(0.0, 1.0, 2.0, -1.0, "GPU-1"))
    assert deciding_term(a, b) == "more free memory (8.0 GiB vs 1.0 GiB)"
    b = cand(10.0, 8 * GiB, key=(0.0, 1.0, 2.0, -8.0, "GPU-1"))
    assert (
        deciding_term(a, b) == "equal load, leases and free memory: the lower UUID breaks the tie"
    )


def test_rank_and_deciding_term_agree_on_real_keys() -> None:
    ranked = rank([dev(0, util=40.0), dev(1, util=0.0)], Constraints())
    assert deciding_term(ranked[0], ranked[1]) == "lower load (0% util vs 40% util)"


# --- more of the waiting line ------------------------------------------------------------------


def test_a_malformed_waiter_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    devices = [dev(0)]
    caplog.set_level("DEBUG", logger="autogpu_jupyter.core.decision")
    reserve_for_waiters(devices, empty(devices), [ticket_rec(9, {"exclude": 5})])
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring ticket 0000000000000009: 'int' object is not iterable"
    ]


def test_a_waiter_with_the_same_seq_as_ours_is_not_served_first() -> None:
    devices = [dev(0)]

    class Mine:
        record = ticket_rec(4, {}, lid="f" * 16)

    same = ticket_rec(4, {}, lid="a" * 16)
    older = ticket_rec(3, {}, lid="b" * 16)
    out = reserve_for_waiters(devices, empty(devices), [older, same], ticket=Mine())  # type: ignore[arg-type]
    assert out["GPU-0"].holders == ("wa: waiting (ticket 3)",)


def test_a_waiter_for_two_devices_books_both_even_if_one_has_no_entry() -> None:
    devices = [dev(0, util=0.0), dev(1, util=50.0)]
    t = ticket_rec(1, ticket_constraints(Constraints(count=2, min_free=Size(bytes=GiB)), None))
    out = reserve_for_waiters(devices, {"GPU-1": Booking("GPU-1")}, [t])
    assert out == {
        "GPU-1": Booking(
            "GPU-1", 1, GiB, False, ("wa: waiting (ticket 1)",), waiting=(ticket_text(t),)
        )
    }


def test_a_waiter_is_given_the_device_the_smoothed_utilisation_favours() -> None:
    devices = [dev(0, util=0.0), dev(1, util=0.0)]
    t = ticket_rec(1, {})
    out = reserve_for_waiters(devices, empty(devices), [t], smoothed_util={"GPU-0": 90.0})
    assert out["GPU-1"].lease_count == 1
    assert out["GPU-0"].lease_count == 0


def test_gather_passes_the_smoothed_utilisation_to_the_waiting_line(tmp_path: Path) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    t = registry.take_ticket(constraints=ticket_constraints(None, None))
    assert t is not None
    try:
        ctx = gather(
            snap(dev(0), dev(1)), environ={}, store=registry, smoothed_util={"GPU-0": 90.0}
        )
        assert [u for u, b in ctx.bookings.items() if b.lease_count] == ["GPU-1"]
        with registry.locked() as txn:
            locked = gather(snap(dev(0), dev(1)), environ={}, store=registry, txn=txn)
        assert [u for u, b in locked.bookings.items() if b.lease_count] == ["GPU-0"]
    finally:
        t.release()


def test_a_locked_gather_reads_the_directory_its_transaction_locked(tmp_path: Path) -> None:
    """Under the lock the bookings are the transaction's, read through the directory it holds
    locked: renamed meanwhile, that directory still shows the waiter, where a fresh read of the
    registry's path finds nothing."""
    registry = DirectoryStore(tmp_path / "registry")
    t = registry.take_ticket(constraints=ticket_constraints(None, None))
    assert t is not None
    try:
        with registry.locked() as txn:
            (tmp_path / "registry").rename(tmp_path / "moved")
            try:
                locked = gather(snap(dev(0), dev(1)), environ={}, store=registry, txn=txn)
                unlocked = gather(snap(dev(0), dev(1)), environ={}, store=registry)
            finally:
                (tmp_path / "moved").rename(tmp_path / "registry")
        assert [u for u, b in locked.bookings.items() if b.lease_count] == ["GPU-0"]
        assert [b.lease_count for b in unlocked.bookings.values()] == [0, 0]
    finally:
        t.release()


def test_decide_ranks_by_the_smoothed_utilisation() -> None:
    ctx = gather(
        snap(dev(0, util=0.0), dev(1, util=10.0)), environ={}, smoothed_util={"GPU-0": 80.0}
    )
    d = decide(ctx, Constraints())
    assert d.best is not None and d.best.device.uuid == "GPU-1"
    assert d.best.smoothed_util_pct == 10.0


def test_decide_counts_leases_from_the_context() -> None:
    s = snap(dev(0), dev(1))
    ctx = Context(s, None, {"GPU-0": Booking("GPU-0", 1, 0, True, ("x: pid 1",))})  # type: ignore[arg-type]
    d = decide(ctx, Constraints())
    assert [c.device.uuid for c in d.chosen] == ["GPU-1"]
    assert d.candidate("GPU-0").reasons == ("held exclusively by another lease",)


def test_an_exclusive_process_gpu_used_by_ourselves_stays_eligible() -> None:
    busy = dev(0, compute_mode="EXCLUSIVE_PROCESS", procs=(ProcessSnapshot(pid=777),))
    ours = decide(gather(snap(busy), environ={}, self_pids=[777]), Constraints())
    assert ours.best is not None
    theirs = decide(gather(snap(busy), environ={}), Constraints())
    assert theirs.best is None


def test_dead_leases_tickets_and_other_devices_leases_are_skipped_not_the_rest() -> None:
    leases = [
        lease(("GPU-0",), (7 * GiB,), pid=53, user="dead", live=False, exclusive=True),
        lease(("GPU-0",), (7 * GiB,), pid=54, user="waiter", kind="ticket"),
        lease(("GPU-1",), (1 * GiB,), pid=55, user="other"),
        lease(("GPU-0",), (2 * GiB,), pid=56, user="ann"),
    ]
    assert bookings_for([dev(0)], leases) == {
        "GPU-0": Booking("GPU-0", 1, 2 * GiB, False, ("ann: pid 56",)),
    }


def test_the_waiting_line_goes_by_seq_not_by_list_position() -> None:
    devices = [dev(0)]

    class Mine:
        record = ticket_rec(4, {}, lid="f" * 16)

    later = ticket_rec(5, {}, lid="a" * 16)
    older = ticket_rec(3, {}, lid="b" * 16)
    out = reserve_for_waiters(devices, empty(devices), [Mine.record, later, older], ticket=Mine())  # type: ignore[arg-type]
    assert out["GPU-0"].holders == ("wa: waiting (ticket 3)",)


# ---- the waiting line's smoothed load (found by the mutation run of issue 22) ----
def test_served_waiters_rank_on_the_smoothed_utilisation() -> None:
    """Caught: the smoothed utilisation not passed on (``None``)."""
    devices = [dev(0, util=0.0), dev(1, util=0.0)]
    t = ticket_rec(1, {})
    assert served_waiters(devices, empty(devices), [t]) == {t.lease_id: ("GPU-0",)}
    assert served_waiters(devices, empty(devices), [t], smoothed_util={"GPU-0": 90.0}) == {
        t.lease_id: ("GPU-1",)}


# ---- the waiting line's own ticket (found by the mutation run of issue 22) ----
def test_our_own_ticket_without_a_seq_is_not_served_before_us() -> None:
    devices = [dev(0)]
    mine_rec = dataclasses.replace(ticket_rec(0, {}, lid="f" * 16), seq=None)

    class Mine:
        record = mine_rec

    out = reserve_for_waiters(devices, empty(devices), [mine_rec], ticket=Mine())  # type: ignore[arg-type]
    assert out == empty(devices)
