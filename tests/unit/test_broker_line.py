"""The broker's waiting line and its pick lock, in-process (issue 22): when a ticket lapses
and what that leaves behind (the count, the bar from the line, the event to its holder, the
log lines), when a dormant ticket starts to reserve, what a ticket is admitted with, whose
turn the pick lock is, when a holder is marked for letting it time out and how those marks
are pruned, and what a ``begin`` answers. A ``Broker`` object with connections made by hand
and a clock of its own (no socket, no journal, no sleeps).

Each test was seen failing with the bugs named in its docstring planted by hand.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import types
from dataclasses import replace
from typing import Any

import pytest

import autogpu_jupyter.broker as broker_mod
from autogpu_jupyter.broker import Broker, BrokerRefusal, Conn, Orphan
from autogpu_jupyter.brokerd import book as book_mod
from autogpu_jupyter.brokerd import connections as conn_mod
from autogpu_jupyter.brokerd import fleet as fleet_mod
from autogpu_jupyter.brokerd import picklock as picklock_mod
from tests.unit.test_broker_rules import (
    Written,
    broker,
    counted,
    exclusive_ticket,
    lease_record,
    one_free_device,
    person,
    run,
    ticket_record,
)


class Clock:
    """The broker module's clock (``time.monotonic``), moved by hand; its ``time.time`` is the
    real one. Only the broker's module sees it: the event loop keeps its own clock."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
        self.now = now
        clock = types.SimpleNamespace(monotonic=lambda: self.now, time=time.time)
        for mod in (broker_mod, book_mod, picklock_mod, fleet_mod, conn_mod):
            monkeypatch.setattr(mod, "time", clock)


class Fleet:
    """A backend whose snapshot is the one free device of ``one_free_device``."""

    def snapshot(self) -> Any:
        return one_free_device()


def check_line(b: Broker) -> None:
    """One round of the reaper's ticket check."""
    async def go() -> None:
        await b.restorer.lapse_round(asyncio.get_running_loop())

    run(go())


def messages(caplog: Any, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "autogpu.broker" and r.levelno == level]


# ---- tickets: lapsing and waking -------------------------------------------------------------


@pytest.mark.parametrize("seq", [2, None])
def test_a_ticket_that_lapses_is_counted_bars_only_its_person_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: Any, seq: int | None,
) -> None:
    """Two tickets servable past the grace lapse in one round: each is counted (two in
    all), each person (and not the holder of an older lease) is barred from the line for a
    minute, each holder gets one ``ticket_lapsed`` event and is closed, and the log says it
    once per ticket, by its number (0 for a ticket without one). Caught: the count set to 1
    instead of raised; the bar given to nobody (no key looked up, or the found key thrown
    away) or to the first other live record's person; the ticket's time kept (its holder's
    end barred it a second time, logged twice); the ticket number in the log lines made 1 for
    none, or 0 for every one; the person's name left out of the bar's line, or its words
    changed."""
    Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=0.0)
    b.fleet.backend = Fleet()
    alice, bob, carol = person(b, 1001), person(b, 1002), person(b, 1003)
    alice.record = replace(lease_record(b, alice, "GPU-other"), created_s=time.time() - 100)
    bob.writer = Written()  # type: ignore[assignment]
    carol.writer = Written()  # type: ignore[assignment]
    bob.record = replace(ticket_record(b, bob), seq=seq)
    carol.record = replace(ticket_record(b, carol), seq=None if seq is None else seq + 1)
    bobs, carols = bob.record.lease_id, carol.record.lease_id
    caplog.set_level(logging.INFO, logger="autogpu.broker")
    b.book.waiters = lambda snap, tickets, settled_only=False: {  # type: ignore[method-assign]
        t.lease_id: ("GPU-s1",) for t in tickets}
    check_line(b)
    assert counted(b, "tickets_lapsed") == 2
    assert (bob.record, carol.record) == (None, None)
    assert b.book.bars() == {1002: 1060.0, 1003: 1060.0}
    assert b.book.servable_times() == {}
    n_bob, n_carol = (0, 0) if seq is None else (seq, seq + 1)
    assert messages(caplog) == [
        f"user1002 left ticket {n_bob} that could be served: barred from the line for 60 s",
        f"ticket {n_bob} of user1002 lapsed: it could be served for 0 s but was not taken",
        f"user1003 left ticket {n_carol} that could be served: barred from the line for 60 s",
        f"ticket {n_carol} of user1003 lapsed: it could be served for 0 s but was not taken",
    ]
    for conn, lease_id, shown in ((bob, bobs, seq), (carol, carols,
                                                    None if seq is None else seq + 1)):
        assert [json.loads(x) for x in conn.writer.lines] == [{  # type: ignore[attr-defined]
            "event": "ticket_lapsed", "lease_id": lease_id,
            "message": f"your place in the waiting line (ticket {shown}) lapsed: a device was "
                       "free for it for 0 s but no lease was taken",
        }]
        assert conn.writer.closed


def test_a_servable_ticket_lapses_only_when_the_whole_grace_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a grace of 5 s, a ticket the broker could serve keeps its place at the first
    check and 4.9 s later (its first servable moment kept under its own id), and loses it at
    5 s. Caught: the time it became servable kept under no id (the ticket never lapsed, or
    the broker kept a stray entry), and the elapsed time computed as a sum (it lapsed at
    once)."""
    clock = Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=5.0)
    b.fleet.backend = Fleet()
    alice = person(b, 1001)
    alice.writer = Written()  # type: ignore[assignment]
    alice.record = exclusive_ticket(b, alice, 1)  # no snapshot yet: it reserves
    lease_id = alice.record.lease_id
    assert b.book.reserving(alice.record)
    check_line(b)
    assert b.book.servable_times() == {lease_id: 1000.0} and alice.record is not None
    clock.now = 1004.9
    check_line(b)
    assert b.book.servable_times() == {lease_id: 1000.0} and alice.record is not None
    clock.now = 1005.0
    check_line(b)
    assert alice.record is None and counted(b, "tickets_lapsed") == 1
    assert b.book.servable_times() == {}


def test_a_dormant_ticket_starts_to_reserve_once_a_settled_lease_takes_its_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ticket taken while the one device was free is dormant (it reserves nothing) and,
    at a check, timed as servable; once an exclusive lease held for ten seconds takes the
    device, the next check makes it reserve (it waits now) and forgets when it last could be
    served. Caught: the dormant ticket never woken (either test of the wake-up inverted, or
    no id let go), and the time it could be served dropped under no id (kept for it, it
    would lapse at once the next time it could be served)."""
    clock = Clock(monkeypatch, 990.0)
    b = broker(ticket_grace_s=100.0)
    b.fleet.backend = Fleet()
    b.book.snap, b.book.snap_at = one_free_device(), clock.now
    alice, carol = person(b, 1001), person(b, 1003)
    alice.record = exclusive_ticket(b, alice, 1)
    lease_id = alice.record.lease_id
    assert not b.book.reserving(alice.record)
    check_line(b)
    assert b.book.servable_times() == {lease_id: 990.0} and not b.book.reserving(alice.record)
    clock.now = 1000.0
    carol.record = replace(lease_record(b, carol, "GPU-s1"), exclusive=True,
                           created_s=time.time() - 10)
    check_line(b)
    assert b.book.reserving(alice.record)
    assert b.book.servable_times() == {}
    assert alice.record.lease_id == lease_id


def test_a_dormant_ticket_whose_device_is_still_free_stays_dormant_and_is_timed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dormant ticket for which the device is still free stays dormant (it reserves
    nothing) and is timed as servable from this check on. Caught: the dormant test made
    ``or``, or the servable test inverted (a ticket that could be served began to reserve
    its device)."""
    clock = Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=100.0)
    b.fleet.backend = Fleet()
    b.book.snap, b.book.snap_at = one_free_device(), clock.now
    alice = person(b, 1001)
    alice.record = exclusive_ticket(b, alice, 1)
    lease_id = alice.record.lease_id
    assert not b.book.reserving(alice.record)
    check_line(b)
    assert not b.book.reserving(alice.record)
    assert b.book.servable_times() == {lease_id: 1000.0}


def test_a_dormant_ticket_whose_device_was_just_leased_stays_dormant_and_does_not_lapse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dormant ticket whose one device another user leased exclusively a second ago: the
    young lease does not wake it (it does not wait for a pick of a moment ago), and it is not
    servable either (that lease holds the device), so it does not lapse. Caught: a dormant
    ticket taken as servable without asking the decision (``and`` made ``or``: it lapsed
    while its device was held)."""
    clock = Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=0.0)
    b.fleet.backend = Fleet()
    b.book.snap, b.book.snap_at = one_free_device(), clock.now
    alice, carol = person(b, 1001), person(b, 1003)
    alice.writer = Written()  # type: ignore[assignment]
    alice.record = exclusive_ticket(b, alice, 1)
    rec = alice.record
    assert not b.book.reserving(rec)
    carol.record = replace(lease_record(b, carol, "GPU-s1"), exclusive=True,
                           created_s=time.time() - 1)
    check_line(b)
    assert alice.record is rec and counted(b, "tickets_lapsed") == 0
    assert (b.book.reserving(rec), b.book.servable_times()) == (False, {})
    assert alice.writer.lines == []  # type: ignore[attr-defined]


def test_a_lease_of_a_moment_ago_keeps_a_waiting_ticket_from_lapsing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lapse check counts every lease, the young ones too (only a new ticket's dormancy
    looks past them): a ticket waiting for the one device, which another user leased
    exclusively a second ago, is not servable and does not lapse. Caught: the young leases
    left out by default, or always (the ticket lapsed while its device was held)."""
    Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=0.0)
    b.fleet.backend = Fleet()
    alice, carol = person(b, 1001), person(b, 1003)
    alice.writer = Written()  # type: ignore[assignment]
    alice.record = exclusive_ticket(b, alice, 1)  # no snapshot yet: it reserves
    carol.record = replace(lease_record(b, carol, "GPU-s1"), exclusive=True,
                           created_s=time.time() - 1)
    rec = alice.record
    check_line(b)
    assert alice.record is rec and counted(b, "tickets_lapsed") == 0
    assert b.book.servable_times() == {}
    assert alice.writer.lines == []  # type: ignore[attr-defined]


def test_a_ticket_check_without_a_snapshot_is_logged_and_lapses_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """A backend that fails: no ticket is judged (one found servable before keeps its time
    and its place), and one debug line says why. Caught: the line's words changed, its
    format or its error left out."""
    clock = Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=100.0)
    b.fleet.backend = Fleet()

    class NoFleet:
        def snapshot(self) -> Any:
            raise RuntimeError("NVML is not loaded")

    alice = person(b, 1001)
    alice.record = ticket_record(b, alice)
    rec = alice.record
    check_line(b)  # the one device is free: servable from now on
    b.fleet.backend = NoFleet()
    clock.now = 1101.0  # past the grace: judged, it would lapse
    caplog.set_level(logging.DEBUG, logger="autogpu.broker")
    check_line(b)
    assert messages(caplog, logging.DEBUG) == [
        "no snapshot for the ticket check: NVML is not loaded"]
    assert alice.record is rec and b.book.servable_times() == {rec.lease_id: 1000.0}


def test_an_orphaned_ticket_that_lapses_is_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ticket taken back from the journal after a restart (no connection holds it) that
    lapses leaves the broker's state, and its person is barred. Caught: the orphan looked up
    under no id (the lapsed ticket stayed in the line for good)."""
    Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=0.0)
    b.fleet.backend = Fleet()
    conn = person(b, 1003)
    rec = ticket_record(b, conn)
    b.connections.conns.discard(conn)
    b.book.adopt(Orphan(1003, rec, [], key=1003))
    check_line(b)
    assert b.book.live() == [] and counted(b, "tickets_lapsed") == 1
    assert counted(b, "orphans") == 0
    assert b.book.bars() == {1003: 1060.0}


class Failing(Written):
    """A writer whose writes and close fail as a connection lost on the way fails."""

    def __init__(self, err: type[Exception]) -> None:
        super().__init__()
        self.err = err

    def write(self, data: bytes) -> None:
        raise self.err("the connection is gone")

    def close(self) -> None:
        raise self.err("the connection is gone")


@pytest.mark.parametrize("make", [lambda: Failing(OSError), lambda: Failing(RuntimeError),
                                  lambda: None],
                         ids=["oserror", "runtimeerror", "no-writer"])
def test_a_ticket_whose_connection_is_lost_on_the_way_lapses_all_the_same(
    monkeypatch: pytest.MonkeyPatch, make: Any,
) -> None:
    """Telling the holder fails (its writes and close raise OSError or RuntimeError, or it
    has no writer yet): the ticket lapses all the same and the check goes on to the next one.
    Caught: any of the three errors no longer ignored when the event is written or the
    connection closed."""
    Clock(monkeypatch, 1000.0)
    b = broker(ticket_grace_s=0.0)
    b.fleet.backend = Fleet()
    bob, carol = person(b, 1002), person(b, 1003)
    bob.writer = make()
    carol.writer = Written()  # type: ignore[assignment]
    bob.record = replace(ticket_record(b, bob), seq=1)
    carol.record = replace(ticket_record(b, carol), seq=2)
    b.book.waiters = lambda snap, tickets, settled_only=False: {  # type: ignore[method-assign]
        t.lease_id: ("GPU-s1",) for t in tickets}
    check_line(b)
    assert (bob.record, carol.record, counted(b, "tickets_lapsed")) == (None, None, 2)
    assert carol.writer.closed


# ---- the bar from the line -------------------------------------------------------------------


def test_exactly_4096_bars_are_all_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bars are pruned only past 4096: with 4095 ended ones (4095 people barred two
    minutes ago) and the new one, all 4096 stay. Caught: the pruning started at 4096
    itself."""
    clock = Clock(monkeypatch, 880.0)
    b = broker()
    conn = person(b, 1001)
    rec = ticket_record(b, conn)
    for i in range(4095):
        b.book.bar_from_line(10_000 + i, rec)
    clock.now = 1000.0
    b.book.bar_from_line(1001, rec)
    ended = {10_000 + i: 940.0 for i in range(4095)}
    assert b.book.bars() == {**ended, 1001: 1060.0}


# ---- a ticket's admission --------------------------------------------------------------------


def test_a_ticket_on_a_connection_that_holds_one_is_refused_in_those_words() -> None:
    """Caught: the refusal's text dropped (``None``)."""
    from autogpu_jupyter.core.leasing import admission

    b = broker()
    conn = person(b, 1001)
    conn.record = ticket_record(b, conn)
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("ticket", conn, {"op": "ticket"}))
    assert str(err.value) == admission.ONE_PER_CONNECTION


def test_a_ticket_is_shared_unless_asked_and_never_served_from_devices_reserved_away() -> None:
    """A ticket of a user outside the group a device is reserved for is admitted with that
    device added to what it excludes (the line never serves it from there), and is not
    exclusive unless the message says so; a member's ticket keeps its request as sent.
    Caught: the reservations not handed to the admission (``None`` or left out), the
    admitted request kept only when it did not change, replaced by nothing, by a record of
    nothing or not at all; and a ticket exclusive by default."""
    b = broker(reserved={"GPU-rsv": ["ml"]})
    alice = person(b, 1001)
    member = person(b, 1002, groups=frozenset({"ml"}))
    asked = dict(ticket_record(b, alice).constraints)
    reply = run(b.run_op("ticket", alice, {"op": "ticket", "constraints": asked}))
    assert reply["record"]["constraints"] == {**asked, "exclude": ["GPU-rsv"]}
    assert reply["record"]["exclusive"] is False
    assert alice.record is not None
    assert alice.record.constraints == {**asked, "exclude": ["GPU-rsv"]}
    assert alice.record.exclusive is False
    theirs = run(b.run_op("ticket", member, {"op": "ticket", "constraints": asked}))
    assert theirs["record"]["constraints"] == asked
    assert member.record is not None and member.record.constraints == asked


# ---- the pick lock ---------------------------------------------------------------------------


def test_a_person_never_served_goes_before_one_served_just_after_boot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Half a second after boot (the monotonic clock is small), alice holds the lock; her
    second pick and bob's wait: bob, never served, goes first. Caught: "never served" counted
    as served at 1 s (alice, served at 0.5 s, went first)."""
    Clock(monkeypatch, 0.5)
    b = broker()
    alice0, alice1, bob = person(b, 1001), person(b, 1001), person(b, 1002)

    async def go() -> list[Conn]:
        await b.run_op("begin", alice0, {"op": "begin"})
        assert b.lock.last_grant == {1001: 0.5}
        order: list[Conn] = []

        async def pick(conn: Conn) -> None:
            await b.run_op("begin", conn, {"op": "begin"})
            order.append(conn)
            b.lock.release(conn)

        waiting = [asyncio.create_task(pick(c)) for c in (alice1, bob)]
        await asyncio.sleep(0)
        assert list(b.lock.waiting) == [alice1, bob]
        b.lock.release(alice0)
        await asyncio.wait_for(asyncio.gather(*waiting), 5)
        return order

    assert run(go()) == [bob, alice1]


@pytest.mark.parametrize(("ago", "sliced"), [(60.0, False), (59.5, True)])
def test_a_lock_misuse_is_remembered_for_exactly_a_minute(
    monkeypatch: pytest.MonkeyPatch, ago: float, sliced: bool,
) -> None:
    """A holder who let the lock time out 59.5 s ago is cut to a slice when someone else
    begins; one who did so exactly a minute ago keeps the whole timeout. Caught: the memory
    kept on its last moment (``<=``)."""
    from autogpu_jupyter.broker import LOCK_SLICE_S

    Clock(monkeypatch, 1000.0)
    b = broker(lock_timeout_s=30.0)
    alice, bob = person(b, 1001), person(b, 1002)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        await b.run_op("begin", alice, {"op": "begin"})
        b.lock.lock_misuse[1001] = 1000.0 - ago
        waiting = asyncio.create_task(b.run_op("begin", bob, {"op": "begin"}))
        await asyncio.sleep(0)
        assert alice.lock_handle is not None
        left = alice.lock_handle.when() - loop.time()
        assert (left <= LOCK_SLICE_S) is sliced and (left > 20) is not sliced
        if not sliced:
            b.lock.release(alice)
        await asyncio.wait_for(waiting, 5)
        assert b.lock.lock_holder is bob
        b.lock.release(bob)

    run(go())


def test_a_lock_held_the_whole_timeout_is_taken_back_logged_and_marked_with_its_time(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """A holder whose lock times out after exactly ``lock_timeout_s`` less the 1 ms margin
    loses it, one warning names its uid and pid, and its person is marked with that moment.
    Caught: the warning's words changed; the margin's edge excluded (``>``: a lock held the
    whole timeout, less the timer's rounding, did not mark its person); the mark kept as
    ``None`` (the person was never cut to a slice)."""
    clock = Clock(monkeypatch, 2.0 - 0.001)
    b = broker(lock_timeout_s=2.0)
    bob = person(b, 1002, pid=4242)
    b.lock.lock_holder = bob
    bob.granted_at = 0.0
    caplog.set_level(logging.INFO, logger="autogpu.broker")
    b.lock.expire(bob)
    assert b.lock.lock_holder is None
    assert b.lock.lock_misuse == {1002: clock.now}
    assert b.lock.suspect(1002)
    assert messages(caplog, logging.WARNING) == [
        "uid 1002 (pid 4242) held the pick lock too long: taken back"]


@pytest.mark.parametrize("case", ["4096", "4097"])
def test_the_lock_misuse_marks_are_pruned_past_4096_of_the_minute_just_ended(
    monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    """With 4095 old marks and the new one (4096) nothing is pruned; with one more (4097),
    every mark a minute old or more goes, those younger and the new one stay. Caught: the
    pruning started at 4096 or at 4098, the marks replaced by nothing, their age computed as
    a sum (every mark went, the new one too), and a mark exactly a minute old kept."""
    Clock(monkeypatch, 1000.0)
    b = broker(lock_timeout_s=2.0)
    bob = person(b, 1002)
    old = {10_000 + i: 940.0 for i in range(4095)}  # exactly a minute ago
    b.lock.lock_misuse = dict(old) if case == "4096" else {**old, 20_000: 940.5}
    b.lock.lock_holder = bob
    bob.granted_at = 990.0
    b.lock.expire(bob)
    if case == "4096":
        assert b.lock.lock_misuse == {**old, 1002: 1000.0}
    else:
        assert b.lock.lock_misuse == {20_000: 940.5, 1002: 1000.0}


def test_a_begin_answers_the_view_and_the_persons_device_limit() -> None:
    """A ``begin`` on an empty broker answers the whole (empty) booking view and the
    caller's device limit under its name. Caught: the key misspelled or upper-cased, and
    the limit's source given instead of the limit."""
    b = broker(max_devices_per_user=3)
    alice = person(b, 1001)

    async def go() -> dict[str, Any]:
        got = await b.run_op("begin", alice, {"op": "begin"})
        b.lock.release(alice)
        return got

    assert run(go()) == {
        "ok": True, "own": [], "devices": [], "tickets": [], "tickets_not_shown": 0,
        "reserved": {}, "max_devices_per_user": 3,
    }


# ---- a connection's end ----------------------------------------------------------------------


def test_a_connection_whose_socket_fails_to_close_still_ends() -> None:
    """The end of a connection whose socket's close raises OSError: it leaves the broker,
    its ticket ends and its person's count goes. Caught: the OSError no longer ignored (the
    end raised)."""
    b = broker()
    conn = person(b, 1001)
    b.connections.per_key[1001] = 1

    class Sock:
        def close(self) -> None:
            raise OSError("bad file descriptor")

    class Channel:
        sock = Sock()
        shut_down = False

        def shut(self) -> None:
            self.shut_down = True

    conn.writer = Channel()  # type: ignore[assignment]
    conn.record = ticket_record(b, conn)
    b.connections.ended(conn)
    assert (b.connections.conns, dict(b.connections.per_key), conn.record, b.book.live()) == (
        set(), {}, None, [])
    assert conn.writer.shut_down  # type: ignore[attr-defined]
