"""The broker taking its journal back after a restart, and the reaper of what it took back,
in-process: a journal it cannot use stops it in one line; the ticket counter goes on from the
journal; a journal of an earlier boot is dropped and said so; each reaper round checks the
orphans and the tickets on its own loop and hands a free pick lock on; the holders the reaper
finds by an orphan's socket are journaled; a forgotten orphan leaves nothing behind; and
``set_pid`` refuses in its own words. A ``Broker`` object built by hand over a temporary state
directory (the helpers of test_broker_rules), no socket of its own, no sleeps.

Each test was seen failing with the bugs named in its docstring planted by hand.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerRefusal, Orphan
from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd.journal import Entry
from autogpu_jupyter.core.leasing.records import encode
from tests.unit.test_broker_rules import (
    broker,
    lease,
    lease_record,
    live_ids,
    person,
    replayed,
    run,
    ticket_record,
)


def state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    return state


def me() -> list[tuple[int, int]]:
    """This process as a holder: (pid, start time)."""
    ids = jrnl.proc_ids(os.getpid())
    assert ids
    return ids


GONE = [(os.getpid(), -1)]  # a start time no process has: a holder that is gone


# -- set_pid ---------------------------------------------------------------------------------


def test_set_pid_on_a_connection_that_holds_no_lease_is_refused_in_those_words() -> None:
    """Caught: the refusal's words replaced by none, or changed (in case or by added text)."""
    b = broker()
    conn = person(b, 0, name="root")
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("set_pid", conn, {"op": "set_pid", "pid": os.getpid()}))
    assert (str(err.value), err.value.kind) == (
        "set_pid: this connection holds no lease", "RegistryError")
    assert conn.record is None


@pytest.mark.parametrize(("pid", "shown"), [
    ("4242", "'4242'"),
    (True, "'True'"),
    (4.0, "'4.0'"),
    (None, "'None'"),
    ("7" * 50, repr("7" * 40)),
])
def test_set_pid_refuses_a_pid_that_is_not_a_whole_number_naming_its_first_40_characters(
    pid: Any, shown: str,
) -> None:
    """A pid that is text, a bool, a float or missing is a usage error that quotes the first
    40 characters of what was sent; the lease keeps its holder. Caught: the int check joined
    to the bool check by ``and`` (text or no pid raised a TypeError, ``True`` and ``4.0`` were
    taken as the holder's pid); the value cut at 41 characters."""
    b = broker()
    conn = person(b, 0, name="root")  # root may name any process: only the value is checked
    lease(b, conn, "GPU-sp2")
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("set_pid", conn, {"op": "set_pid", "pid": pid}))
    assert (str(err.value), err.value.kind) == (f"set_pid: invalid pid {shown}", "UsageErrorBase")
    assert conn.record is not None and conn.record.pid == conn.pid  # unchanged


# -- forgetting an orphan --------------------------------------------------------------------


def test_a_forgotten_orphan_leaves_nothing_of_it_in_the_ticket_checks() -> None:
    """An orphaned ticket released by its person is gone from the orphans and from the ticket
    checks (when it became servable); another ticket's place there (its time, its dormancy)
    is kept. Caught: its servable time looked up under no id (the broker kept it for good).
    (An orphan is never dormant: a ticket taken back waits.)"""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker(ticket_grace_s=100.0)
    b.fleet.backend = SimulatedBackend("demo-4x")  # four free devices
    alice, bob = person(b, 1001), person(b, 1002)
    alice.record = ticket_record(b, alice)
    rec = alice.record
    assert rec is not None
    alice.record = None  # its connection ended with the old broker; the journal kept it
    b.book.adopt(Orphan(1001, rec, [], key=1001))
    b.fleet.snapshot()
    bob.record = ticket_record(b, bob)  # a device is free for it behind the orphan: dormant
    assert bob.record is not None

    async def check() -> None:  # one round of the reaper's ticket check: both are servable
        await b.restorer.lapse_round(asyncio.get_running_loop())

    run(check())
    times = b.book.servable_times()
    assert set(times) == {rec.lease_id, bob.record.lease_id}
    version = b.book.version
    released = run(b.run_op("release", alice, {"op": "release", "lease_id": rec.lease_id}))
    assert released == {"ok": True}
    assert (b.book.orphans, b.book.servable_times(), b.book.dormant_tickets()) == (
        {}, {bob.record.lease_id: times[bob.record.lease_id]}, {bob.record.lease_id})
    assert b.book.version == version + 1


# -- taking the journal back -----------------------------------------------------------------


def test_a_journal_the_broker_cannot_use_stops_it_with_one_line_naming_the_directory_and_why(
    tmp_path: Path,
) -> None:
    """A journal log that is a symlink is not followed: the broker stops, its exit message
    naming the state directory and the error (and the file the link points at is left as it
    was). Caught: the message replaced by none (the broker exited 0, saying nothing)."""
    state = state_dir(tmp_path)
    target = tmp_path / "elsewhere"
    target.write_text("not a journal\n")
    (state / jrnl.LOG_NAME).symlink_to(target)
    with pytest.raises(SystemExit) as err:
        broker(state_dir=str(state))
    assert err.value.code == (
        f"autogpu broker: journal in {state} unusable ([Errno {errno.ELOOP}] "
        f"{os.strerror(errno.ELOOP)}: '{state / jrnl.LOG_NAME}')")
    assert target.read_text() == "not a journal\n"


@pytest.mark.parametrize(("counter", "ticket_seq", "expected"), [
    (0, None, 0),  # a lease only: no number
    (3, 7, 7),  # a ticket numbered past the journal's counter
    (5, 2, 5),  # the journal's counter past every ticket kept
])
def test_a_restarted_broker_goes_on_from_the_journals_counter_or_the_highest_ticket_it_keeps(
    tmp_path: Path, counter: int, ticket_seq: int | None, expected: int,
) -> None:
    """The ticket counter after a restart is the higher of the journal's counter and the
    number of each record taken back; a lease (no number) counts as 0. Caught: the counter set
    to none, or a record without a number counted as 1 (a ticket number skipped)."""
    state = state_dir(tmp_path)
    first = broker(state_dir=str(state))
    assert first.restorer.journal is not None
    owner = person(first, os.getuid())
    rec = lease_record(first, owner, "GPU-rs1")
    if ticket_seq is not None:
        rec = replace(ticket_record(first, owner), seq=ticket_seq)
    first.restorer.journal.add(Entry(rec.lease_id, os.getuid(), encode(rec).decode(), None, me()))
    first.restorer.journal.seq = counter
    first.restorer.journal.compact()  # the log's head: {"seq": counter}
    second = broker(state_dir=str(state))
    assert live_ids(second) == {rec.lease_id}
    assert second.book.seq == expected


def test_a_journal_of_an_earlier_boot_is_dropped_and_said_so_with_its_boot_and_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """A broker started on another boot than the journal's takes nothing back and logs one
    warning naming the journal's boot and how many records it dropped. Caught: the boot logged
    as none; either half of the warning's text changed (by added text or in case)."""
    state = state_dir(tmp_path)
    boot = tmp_path / "boot_id"
    boot.write_text("boot-one\n")
    monkeypatch.setattr(jrnl, "BOOT_ID_PATH", str(boot))
    first = broker(state_dir=str(state))
    assert first.restorer.journal is not None
    owner = person(first, os.getuid())
    for n in range(2):
        rec = lease_record(first, owner, f"GPU-eb{n}")
        first.restorer.journal.add(
            Entry(rec.lease_id, os.getuid(), encode(rec).decode(), None, me()))
    boot.write_text("boot-two\n")
    caplog.set_level(logging.INFO, logger="autogpu.broker")
    second = broker(state_dir=str(state))
    assert second.book.orphans == {}
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "restart: the journal was of an earlier boot (boot-one): its 2 lease(s)/"
                    "ticket(s) ended with that boot and are dropped"),
        ("INFO", "restart: 0 lease(s)/ticket(s) taken back from the journal"),
    ]


# -- the reaper ------------------------------------------------------------------------------


class Stop(Exception):
    pass


def one_round(b: Broker, monkeypatch: pytest.MonkeyPatch,
              before: Callable[[], None] = lambda: None) -> None:
    """Run ``b.restorer.reap_orphans()`` for exactly one round (its sleep made instant), ``before``
    called first on its loop."""
    sleeps: list[float] = []

    async def sleep(delay: float) -> None:
        if sleeps:
            raise Stop
        sleeps.append(delay)

    async def go() -> None:
        before()
        await b.restorer.reap_orphans()

    monkeypatch.setattr(asyncio, "sleep", sleep)
    with pytest.raises(Stop):
        run(go())
    assert sleeps == [1.0]


def test_each_reaper_round_checks_the_orphans_then_the_tickets_on_its_own_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """Caught: the round's loop taken as none, or none passed to the orphan check or to the
    ticket check (the scan of /proc and the snapshot run on that loop's executor: the round
    failed, or judged no ticket)."""
    b = broker()
    seen: list[tuple[str, bool]] = []

    async def reap(loop: Any) -> None:
        seen.append(("orphans", loop is asyncio.get_running_loop()))

    async def lapse(loop: Any) -> None:
        seen.append(("tickets", loop is asyncio.get_running_loop()))

    b.restorer.reap = reap  # type: ignore[method-assign]
    b.restorer.lapse_round = lapse  # type: ignore[method-assign]
    caplog.set_level(logging.ERROR, logger="autogpu.broker")
    one_round(b, monkeypatch)
    assert seen == [("orphans", True), ("tickets", True)]
    assert caplog.records == []


def test_a_reaper_round_gives_a_free_pick_lock_to_the_one_who_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A waiter left in line while nobody holds the pick lock (its holder went away between
    rounds) is given the lock by the next reaper round. Caught: the lock handed on only while
    someone holds it (the waiter waited for good)."""
    b = broker()
    waiter = person(b, 1001)

    def wait() -> None:
        waiter.granted = asyncio.get_running_loop().create_future()
        b.lock.waiting.append(waiter)

    one_round(b, monkeypatch, wait)
    assert b.lock.lock_holder is waiter and list(b.lock.waiting) == []
    assert waiter.granted is not None and waiter.granted.done()


def test_the_holders_the_reaper_finds_by_an_orphans_socket_are_journaled(tmp_path: Path) -> None:
    """Every recorded holder of an orphan is gone but this process still holds its socket: the
    reaper keeps the orphan with this process as its holder and writes that to the journal (a
    broker restarted next finds it there). Caught: the holders journaled under no id, as none,
    or without the id or the holders (the round raised)."""
    state = state_dir(tmp_path)
    b = broker(state_dir=str(state))
    assert b.restorer.journal is not None
    alice = person(b, os.getuid())
    rec = lease_record(b, alice, "GPU-rj1")
    ours, theirs = socket.socketpair()
    try:
        inode = os.fstat(theirs.fileno()).st_ino  # held by this process only
        b.restorer.journal.add(Entry(rec.lease_id, os.getuid(), encode(rec).decode(), inode, GONE))
        b.book.adopt(Orphan(os.getuid(), rec, list(GONE), key=os.getuid(), peer=inode))

        async def go() -> None:
            await b.restorer.reap(asyncio.get_running_loop())

        run(go())
    finally:
        ours.close()
        theirs.close()
    assert b.book.orphans[rec.lease_id].holder_pids == me()
    assert {i: (e.peer, e.pids) for i, e in replayed(state)[0].items()} == {
        rec.lease_id: (inode, me())}
    last = (state / jrnl.LOG_NAME).read_bytes().splitlines()[-1]
    assert json.loads(last) == {"holders": rec.lease_id, "pids": [list(p) for p in me()]}



# -- orphan liveness costs nothing per descriptor (issue 39, break 6) ---------------------------


def _orphan_of(b: Broker, device: str, holders: list[tuple[int, int]],
               peer: int | None = None) -> str:
    alice = person(b, os.getuid())
    rec = lease_record(b, alice, device)
    b.book.adopt(Orphan(os.getuid(), rec, list(holders), key=os.getuid(), peer=peer))
    return rec.lease_id


def test_reaper_rounds_read_no_descriptor_of_a_live_holder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Orphans whose holders live, one by its socket and one by its pid: three reaper rounds
    keep both and list no process's descriptors (``/proc/PID/fd``): a holder with 20,000 open
    files costs a round what a holder with three does. Caught: each round walked
    ``/proc/PID/fd`` of every holder on the event loop (issue 39: 120 holders x 20,000
    descriptors froze the broker for seconds)."""
    b = broker()
    ours, theirs = socket.socketpair()
    by_socket = _orphan_of(b, "GPU-fd1", me(), os.fstat(theirs.fileno()).st_ino)
    by_pid = _orphan_of(b, "GPU-fd2", me())
    read: list[str] = []
    real_listdir, real_readlink = os.listdir, os.readlink

    def listdir(path: Any = ".") -> list[str]:
        read.append(str(path))
        return real_listdir(path)

    def readlink(path: Any, *args: Any, **kw: Any) -> str:
        read.append(str(path))
        return real_readlink(path, *args, **kw)

    async def rounds() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(3):
            await b.restorer.reap(loop)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(os, "readlink", readlink)
    try:
        run(rounds())
    finally:
        ours.close()
        theirs.close()
    assert live_ids(b) == {by_socket, by_pid}
    assert [p for p in read if "/fd" in p] == []


def test_an_orphan_ends_as_soon_as_its_holder_does_without_waiting_for_a_round() -> None:
    """The holder of an orphan (a real process) is watched by the event loop itself: when it
    is killed, the orphan ends, its journal line with it, with no reaper round run. A holder
    taken with the start time of another process (its pid reused) holds nothing. Caught: the
    orphans checked only by the once-a-second reaper (or not at all without one)."""
    import subprocess
    import sys

    b = broker()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = jrnl.start_time(child.pid)
        assert start is not None
        held = _orphan_of(b, "GPU-pf1", [(child.pid, start)])
        reused = _orphan_of(b, "GPU-pf2", [(child.pid, start + 1)])

        async def go() -> None:
            loop = asyncio.get_running_loop()
            await b.restorer.settle(loop)
            assert live_ids(b) == {held}  # the reused pid: its orphan ended at once
            child.kill()
            for _ in range(1000):  # ends by the loop's own reader, no round in between
                if held not in live_ids(b):
                    return
                await asyncio.sleep(0.01)

        run(go())
        assert not {reused, held} & live_ids(b)
    finally:
        child.kill()
        child.wait(10)


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_a_lease_the_journal_cannot_record_is_refused_and_not_held(tmp_path: Path) -> None:
    """Mutation run of 2026-12-07 found the book's undoing of a change the journal refused
    unpinned (lease book, ``record_changed``): on a full disk a new lease is a refusal (the
    client's reply), and the book does not hold it."""
    from tests.unit.test_broker_journal import file_size_limit

    state = state_dir(tmp_path)
    b = broker(state_dir=str(state))
    alice = person(b, os.getuid())
    lease(b, alice, "GPU-j1")
    size = (state / "journal.log").stat().st_size
    new = lease_record(b, alice, "GPU-j2")
    with file_size_limit(size), pytest.raises(BrokerRefusal):
        alice.record = new
    assert new.lease_id not in live_ids(b)


def test_an_orphan_held_by_a_socket_ends_when_its_holder_ends_after_the_socket() -> None:
    """Mutation run of 2026-12-07 found the end of an orphan with a socket unpinned at its
    holder's exit (the restorer's ``_exited`` asked about no orphan): the socket closed, then
    its last holder killed, the orphan ends with no reaper round."""
    import subprocess
    import sys

    b = broker()
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = jrnl.start_time(child.pid)
        assert start is not None
        held = _orphan_of(b, "GPU-ps1", [(child.pid, start)], os.fstat(theirs.fileno()).st_ino)

        async def go() -> None:
            loop = asyncio.get_running_loop()
            await b.restorer.settle(loop)
            assert live_ids(b) == {held}
            ours.close()
            theirs.close()
            child.kill()
            for _ in range(1000):
                if held not in live_ids(b):
                    return
                await asyncio.sleep(0.01)

        run(go())
        assert held not in live_ids(b)
    finally:
        ours.close()
        theirs.close()
        child.kill()
        child.wait(10)


def test_reaper_rounds_ask_the_orphans_sockets_in_turn_from_the_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mutation run of 2026-12-07 found the turn of the reaper's socket checks unpinned at its
    start: with one check per round, the first round asks the first orphan taken back, the next
    round the next one (two orphans whose sockets are closed, their holder alive)."""
    from autogpu_jupyter.brokerd import restore

    monkeypatch.setattr(restore, "POLLS_PER_ROUND", 1)
    b = broker()
    pairs = [socket.socketpair() for _ in range(2)]
    first, second = (_orphan_of(b, f"GPU-rr{i}", me(), os.fstat(p[1].fileno()).st_ino)
                     for i, p in enumerate(pairs))
    for p in pairs:
        p[0].close()
        p[1].close()
    seen = []

    async def rounds() -> None:
        loop = asyncio.get_running_loop()
        for _ in range(2):
            await b.restorer.reap(loop)
            seen.append(live_ids(b))

    run(rounds())
    assert seen == [{second}, set()]  # the first ended in the first round
    assert first not in seen[0]


_IN_OWN_NETNS = """
import os, socket, sys, time
ours, theirs = socket.socketpair()
print(os.fstat(theirs.fileno()).st_ino, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root for a network namespace")
def test_a_journaled_socket_in_another_network_namespace_keeps_its_lease_after_a_restart(
    tmp_path: Path,
) -> None:
    """A lease's socket lives in another network namespace (a container's) and its recorded
    holders are gone (the socket was handed on): the restarted broker finds the socket among
    the host's namespaces and keeps the lease; the reaper finds the process that holds it; the
    lease ends with that process. Mutation run of 2026-12-07 (seed 71) found the search of
    the host's namespaces at a restart, and the reaper's question about a socket it found
    there, unpinned: the lease was dropped at the restart or at the first reaper round."""
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    assert unshare is not None, "unshare (util-linux) is needed"
    child = subprocess.Popen([unshare, "--net", sys.executable, "-c", _IN_OWN_NETNS],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        inode = int(child.stdout.readline())
        assert os.stat(f"/proc/{child.pid}/ns/net").st_ino != os.stat(
            "/proc/self/ns/net").st_ino
        state = state_dir(tmp_path)
        first = broker(state_dir=str(state))
        assert first.restorer.journal is not None
        rec = lease_record(first, person(first, os.getuid()), "GPU-ns1")
        first.restorer.journal.add(
            Entry(rec.lease_id, os.getuid(), encode(rec).decode(), inode, GONE))
        second = broker(state_dir=str(state))
        assert live_ids(second) == {rec.lease_id}

        async def go() -> None:
            loop = asyncio.get_running_loop()
            await second.restorer.reap(loop)
            assert live_ids(second) == {rec.lease_id}
            assert [p for p, _ in second.book.orphans[rec.lease_id].holder_pids] == [child.pid]
            child.kill()
            for _ in range(1000):
                if rec.lease_id not in live_ids(second):
                    return
                await asyncio.sleep(0.01)

        run(go())
        assert rec.lease_id not in live_ids(second)
    finally:
        child.kill()
        child.wait(10)
