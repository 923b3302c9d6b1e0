"""The broker's rules about people, in-process: who sees which command line, who may release
or re-point a lease, how many connections a person holds, which group limit applies and whose
turn the pick lock is. A ``Broker`` object with connections made by hand (no socket, no
journal); the same rules over real sockets and real users are in tests/multiuser.

Each test was seen failing with the bug named in its docstring planted by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import re
import subprocess
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerConfig, BrokerRefusal, Conn, Orphan
from autogpu_jupyter.brokerd import connections as conn_mod
from autogpu_jupyter.brokerd import fleet as fleet_mod
from autogpu_jupyter.brokerd import ops as ops_mod
from autogpu_jupyter.brokerd import views as views_mod
from autogpu_jupyter.brokerd.identity import Account
from autogpu_jupyter.core.leasing.brokerclient import MAX_REPLY_BYTES


def broker(**config: Any) -> Broker:
    return Broker(BrokerConfig(socket_path="/nonexistent/b.sock", **config))


def person(b: Broker, uid: int, *, name: str = "", groups: frozenset[str] = frozenset(),
           pid: int | None = None) -> Conn:
    conn = Conn(b, uid, uid, pid or os.getpid(), Account(uid, name or f"user{uid}", groups))
    b.connections.conns.add(conn)
    return conn


def lease_record(b: Broker, conn: Conn, device: str, command: str | None = None) -> Any:
    """The record the broker builds for ``conn``'s lease on ``device``."""
    return ops_mod.make_record(b, conn, "lease", {
        "device_uuids": [device], "device_requested_bytes": [None], "exclusive": False,
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": command,
        "holder_kind": "process",
    })


def lease(b: Broker, conn: Conn, device: str, command: str | None = None) -> None:
    """``conn`` holds a lease on ``device`` (as ``op_lease`` leaves it)."""
    conn.record = lease_record(b, conn, device, command)


def simulated_broker(**config: Any) -> tuple[Broker, list[str]]:
    """A broker whose fleet is the simulated ``demo-4x`` host at one fixed moment (its free
    memory and load drift with the clock), and its device ids in order."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker(**config)
    b.fleet.backend = SimulatedBackend("demo-4x", clock=lambda: 1_000_000.0)
    b.fleet.snapshot()
    return b, sorted(d.uuid for d in b.book.snap.devices)


def counted(b: Broker, key: str) -> Any:
    """What ``autogpu broker status`` says of ``key`` (root's ``status``: counts only)."""
    root = Conn(b, 0, 0, os.getpid(), Account(0, "root", frozenset()))
    return asyncio.run(b.run_op("status", root, {"op": "status"}))[key]


def live_ids(b: Broker) -> set[str]:
    """The ids of the book's live leases and tickets (its connections' and its orphans')."""
    return {rec.lease_id for _, rec in b.book.live()}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def replayed(state: Any) -> tuple[dict[str, Any], int]:
    """The journal file in the state directory ``state`` as a broker restarted now reads it:
    a copy of the file (the live broker goes on appending to its own) replayed by a fresh
    journal. Its live entries by lease id, and the ticket counter."""
    import shutil
    import tempfile

    from autogpu_jupyter.brokerd import journal as jrnl

    with tempfile.TemporaryDirectory() as copy:
        shutil.copy2(os.path.join(str(state), jrnl.LOG_NAME), copy)
        j = jrnl.Journal(copy)
        try:
            return j.load(), j.seq
        finally:
            j.close()


def found_servable(b: Broker) -> None:
    """One round of the reaper's ticket check over one free device (``one_free_device``):
    the tickets a device is free for are found servable from now on."""
    import types

    b.fleet.backend = types.SimpleNamespace(snapshot=one_free_device)

    async def go() -> None:
        await b.restorer.lapse_round(asyncio.get_running_loop())

    run(go())


def test_the_leases_answer_shows_a_command_line_only_to_its_owner_and_root() -> None:
    """Caught: the viewer taken from the record (every user saw every command line)."""
    b = broker(record_commands=True)
    alice, bob, root = person(b, 1001), person(b, 1002), person(b, 0, name="root")
    lease(b, alice, "GPU-r1", command="python train.py --token=s3cret")
    lease(b, bob, "GPU-r2", command="python eval.py")

    def commands(viewer: Conn) -> dict[str, str | None]:
        got = run(b.run_op("leases", viewer, {"op": "leases"}))
        return {r["user"]: r["command"] for r in got["records"]}

    assert commands(alice) == {"user1001": "python train.py --token=s3cret", "user1002": None}
    assert commands(bob) == {"user1001": None, "user1002": "python eval.py"}
    assert commands(root) == {"user1001": "python train.py --token=s3cret",
                              "user1002": "python eval.py"}


def test_an_orphaned_lease_is_released_only_by_its_own_person() -> None:
    """After a restart a lease taken back from the journal may be released by id, by its
    person only. Caught: the ownership check dropped (anyone freed anyone's orphaned GPU)."""
    b = broker()
    alice, bob = person(b, 1001), person(b, 1002)
    lease(b, alice, "GPU-o1")
    rec = alice.record
    assert rec is not None
    alice.record = None  # its connection ended with the old broker; the journal kept it
    b.book.adopt(Orphan(1001, rec, [], key=1001))
    with pytest.raises(BrokerRefusal, match=f"^release: no lease '{rec.lease_id}' of yours is "
                                            "orphaned$"):
        run(b.run_op("release", bob, {"op": "release", "lease_id": rec.lease_id}))
    assert rec.lease_id in live_ids(b)
    released = run(b.run_op("release", alice, {"op": "release", "lease_id": rec.lease_id}))
    assert released == {"ok": True}
    assert rec.lease_id not in live_ids(b)


def test_a_release_by_id_ends_the_connections_own_lease_and_no_other() -> None:
    """A release naming the connection's own lease ends it; one naming any other id is
    refused (its first 64 characters quoted) and the connection keeps its lease. Caught: the
    id compared with ``!=`` (a release naming another id ended the caller's own lease); the
    orphans looked up by an id that is not text (a list id raised a TypeError); the id cut at
    65 characters."""
    b = broker()
    alice = person(b, 1001)
    lease(b, alice, "GPU-rl1")
    rec = alice.record
    assert rec is not None
    long_id = "x" * 70
    for other, shown in (("0" * 32, repr("0" * 32)), (["a", "b"], repr(str(["a", "b"]))),
                         (long_id, repr("x" * 64))):
        with pytest.raises(BrokerRefusal) as err:
            run(b.run_op("release", alice, {"op": "release", "lease_id": other}))
        assert str(err.value) == f"release: no lease {shown} of yours is orphaned"
        assert alice.record is rec
    released = run(b.run_op("release", alice, {"op": "release", "lease_id": rec.lease_id}))
    assert released == {"ok": True}
    assert alice.record is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start another user's process")
def test_set_pid_may_name_only_a_process_of_the_callers_own() -> None:
    """Caught: the check made on the caller's own process instead of the one it names (a user
    could make another user's process the holder of a lease)."""
    nobody = pwd.getpwnam("nobody")
    theirs = subprocess.Popen(["sleep", "30"], user=nobody.pw_uid, group=nobody.pw_gid)
    mine = subprocess.Popen(["sleep", "30"], user=nobody.pw_uid, group=nobody.pw_gid)
    try:
        b = broker()
        # the caller is a process of nobody's (as a kernel of that user would be)
        caller = person(b, nobody.pw_uid, pid=theirs.pid)
        lease(b, caller, "GPU-p1")
        with pytest.raises(BrokerRefusal, match=r"^set_pid: pid 1 is not a process of yours$"):
            run(b.run_op("set_pid", caller, {"op": "set_pid", "pid": 1}))
        got = run(b.run_op("set_pid", caller, {"op": "set_pid", "pid": mine.pid}))
        assert got["record"]["pid"] == mine.pid
    finally:
        for p in (theirs, mine):
            p.kill()
            p.wait()


def test_a_persons_connections_stop_at_the_limit_itself() -> None:
    """``max_connections_per_user = 2``: the second connection is the last one. Caught: one
    connection more than configured."""
    b = broker(max_connections_per_user=2)
    acct = Account(1001, "alice", frozenset())
    b.connections.per_key[1001] = 1
    assert b.connections.refusal(1001, acct) is None
    b.connections.per_key[1001] = 2
    assert b.connections.refusal(1001, acct) == (
        "too many connections for alice (max_connections_per_user = 2)"
    )


def test_the_last_connections_are_roots_and_unknown_uids_share_one_named_limit() -> None:
    """With room for 40 connections, the last 16 are root's: a user is refused at 24 in all,
    root only at 40, each in its own words; uids without a passwd entry share their own limit,
    and a subordinate uid's refusal says whose it is. Caught: root's check made for uid 1 or
    ``>`` (root refused early, or let past the cap), the reserve not kept (``>`` or ``+``), the
    unknown uids held to the per-user limit, or their name, setting or the ``via`` left out."""
    from autogpu_jupyter.brokerd import net
    from autogpu_jupyter.brokerd.identity import UNKNOWN_KEY

    b = broker(max_connections_per_user=5, unknown_max_connections=1)
    b.connections.conn_cap = 40
    alice = Account(1001, "alice", frozenset())
    root = Account(0, "root", frozenset())

    def refusal(total: int, uid: int, acct: Account) -> str | None:
        b.connections.conns = {object() for _ in range(total)}  # type: ignore[misc]
        return b.connections.refusal(uid, acct)

    assert net.ROOT_RESERVE == 16
    assert refusal(23, 1001, alice) is None
    assert refusal(24, 1001, alice) == (
        "the broker holds its most connections (40, the last 16 kept for root); try again "
        "shortly")
    assert refusal(24, 0, root) is None
    assert refusal(39, 0, root) is None
    assert refusal(40, 0, root) == "the broker holds its most connections (40); try again"
    assert refusal(24, 1, Account(1, "daemon", frozenset())) is not None
    unknown = Account(UNKNOWN_KEY, "uid 70000", frozenset())
    b.connections.per_key[UNKNOWN_KEY] = 1
    assert refusal(0, 70000, unknown) == (
        "too many connections for uids without a passwd entry "
        "(unknown_uids.max_connections = 1)")
    sub = Account(1001, "alice", frozenset(), via="subordinate uid 100003 of alice")
    b.connections.per_key[1001] = 5
    assert refusal(0, 100003, sub) == (
        "too many connections for alice (subordinate uid 100003 of alice) "
        "(max_connections_per_user = 5)")
    b.connections.per_key[1001] = 4
    assert refusal(0, 100003, sub) is None


class Paced:
    """The broker's clock, stopped at ``now``, and the delays its message throttle asks for
    (recorded, not slept)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import types


        self.now = 100.0
        self.delays: list[Any] = []

        async def sleep(delay: Any) -> None:
            self.delays.append(delay)

        from autogpu_jupyter.brokerd import connections as conn_mod

        monkeypatch.setattr(conn_mod, "time", types.SimpleNamespace(monotonic=lambda: self.now))
        monkeypatch.setattr(conn_mod, "asyncio", types.SimpleNamespace(sleep=sleep))

    def send(self, b: Broker, conn: Conn, count: int = 1) -> list[Any]:
        """The delays of ``count`` messages of ``conn`` at this moment."""
        self.delays = []
        for _ in range(count):
            coro = b.connections.throttle(conn)
            with pytest.raises(StopIteration):
                coro.send(None)
        return self.delays


def test_a_users_flood_delays_only_that_users_messages_past_a_burst_of_the_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At 4 messages a second, a user's first 4 messages at one moment pass at once, each
    further one waits a quarter of a second more; another user and root are not delayed, and
    a second later the bucket has 4 more. Caught: root throttled (``and``, ``!= 0``, uid 1),
    one bucket for everyone, the refill or the cost of a message miscounted, the test of an
    empty bucket off by one, the delay not the missing tokens over the rate."""
    b = broker(messages_per_s_per_user=4.0)
    clock = Paced(monkeypatch)
    alice, bob, root = person(b, 1001), person(b, 1002), person(b, 0, name="root")
    assert clock.send(b, root, 12) == []
    assert clock.send(b, alice, 4) == []
    assert clock.send(b, alice, 2) == [0.25, 0.5]
    assert clock.send(b, bob, 3) == []
    clock.now += 1.0  # alice's bucket: -2 + 4 tokens
    assert clock.send(b, alice, 3) == [0.25]
    clock.now += 0.125  # half a token more: alice's bucket is at -0.5, bob's full
    assert clock.send(b, bob) == []
    assert clock.send(b, alice) == [0.375]


@pytest.mark.parametrize(("rate", "expected"), [(0.0, []), (1.0, [1.0])])
def test_a_rate_of_zero_throttles_nobody_and_a_rate_of_one_delays_the_second_message(
    monkeypatch: pytest.MonkeyPatch, rate: float, expected: list[float],
) -> None:
    """Caught: a rate of 0 throttled (a division by zero on the first message) and a rate of
    1 taken for no limit."""
    b = broker(messages_per_s_per_user=rate)
    clock = Paced(monkeypatch)
    assert clock.send(b, person(b, 1001), 2) == expected


def test_the_throttles_buckets_of_people_gone_are_dropped_past_four_per_person_and_64(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two people connected: up to 4 * 2 + 64 = 72 buckets are kept; the 73rd drops those
    of everyone not connected, and keeps the two. Caught: the bound's ``>``, ``*``, 4 or 64
    changed, or the buckets of the people connected dropped instead."""
    b = broker(messages_per_s_per_user=4.0)
    clock = Paced(monkeypatch)
    alice, bob = person(b, 1001), person(b, 1002)
    b.connections.per_key.update({1001: 1, 1002: 1})
    clock.send(b, alice)
    clock.send(b, bob)
    for uid in range(2000, 2070):  # people whose connections ended
        clock.send(b, person(b, uid))
    assert len(b.connections.buckets) == 72
    clock.send(b, person(b, 3000))
    assert sorted(b.connections.buckets) == [1001, 1002]


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        ({"small": 1, "big": 3}, (3, " for group big")),
        ({"small": 1, "free": 0}, (0, " for group free")),  # 0 is no limit: the most of all
        ({"small": 1, "other": 9}, (1, " for group small")),  # only groups the user is in
    ],
)
def test_a_member_of_several_limited_groups_gets_the_most_generous_limit(
    limits: dict[str, int], expected: tuple[int, str]
) -> None:
    """Caught: the strictest group's limit taken (a member of a generous group, or of one
    without a limit, held to a students' quota)."""
    b = broker(group_limits=limits, max_devices_per_user=5)
    conn = person(b, 1001, groups=frozenset({"small", "big", "free"}))
    assert b.book.limit_for(conn) == expected


def test_the_pick_lock_goes_to_the_person_served_least_recently() -> None:
    """Two of alice's picks wait before bob's: when alice's first pick is done, bob goes next,
    then alice's second (a person with many connections cannot starve the others). Caught:
    the lock handed out in plain arrival order."""
    b = broker()
    alice0, alice1 = person(b, 1001), person(b, 1001)
    bob = person(b, 1002)

    async def go() -> list[Conn]:
        await b.run_op("begin", alice0, {"op": "begin"})  # alice is served now
        order: list[Conn] = []

        async def pick(conn: Conn) -> None:
            await b.run_op("begin", conn, {"op": "begin"})
            order.append(conn)
            b.lock.release(conn)

        waiting = [asyncio.create_task(pick(c)) for c in (alice1, bob)]
        await asyncio.sleep(0)
        assert list(b.lock.waiting) == [alice1, bob]
        b.lock.release(alice0)
        await asyncio.gather(*waiting)
        return order

    assert run(go()) == [bob, alice1]


def test_a_pick_with_options_that_are_not_an_object_is_a_usage_error() -> None:
    """The client raises the refusal's kind: a usage error, not a broker failure. Caught: the
    kind dropped (the refusal became a plain LeaseStoreError)."""
    b = broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal, match=r"^options: expected an object$") as err:
        run(b.run_op("pick", conn, {"op": "pick", "options": [1]}))
    assert err.value.kind == "UsageErrorBase"


def test_leaving_a_servable_ticket_bars_a_person_who_never_leased() -> None:
    """A ticket that could have been served, given up by someone who took no lease since it
    could: that person may not join the line for a while (even one who never leased at all).
    Caught: the default for "never leased" dropped (the comparison raised)."""
    b = broker()
    conn = person(b, 1001)
    conn.record = ops_mod.make_record(b, conn, "ticket", {
        "device_uuids": [], "device_requested_bytes": [], "exclusive": False, "seq": 1,
        "constraints": {"min_free_bytes": None, "min_free_fraction": None,
                        "max_util_pct": None, "count": 1, "exclude": [], "exclusive": False,
                        "allowed_uuids": None},
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "process",
    })
    assert conn.record is not None
    found_servable(b)  # it could be served from then on
    assert list(b.book.servable_times()) == [conn.record.lease_id]
    conn.record = None  # given up
    assert 1001 in b.book.bars()


def test_a_waiter_that_ends_leaves_the_line_and_the_lock_goes_on() -> None:
    """A connection that ends while it waits for the pick lock (its channel dropped) leaves
    the line as its task ends. Caught: the wrong connection taken out of the line (the ended
    one stayed in it, and the error skipped the rest of the connection's ending)."""
    b = broker()
    holder, waiter, third = person(b, 1001), person(b, 1002), person(b, 1003)

    async def go() -> None:
        await b.run_op("begin", holder, {"op": "begin"})
        assert b.lock.lock_holder is holder
        waiting = asyncio.create_task(b.run_op("begin", waiter, {"op": "begin"}))
        nxt = asyncio.create_task(b.run_op("begin", third, {"op": "begin"}))
        await asyncio.sleep(0)
        assert list(b.lock.waiting) == [waiter, third]
        waiting.cancel()  # its channel was dropped: its task is cancelled, then ended
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        b.lock.release(waiter)  # what the end of its task does
        assert list(b.lock.waiting) == [third]
        assert b.lock.lock_holder is holder
        b.lock.release(holder)  # the holder is done: the next one in line gets the lock
        await nxt
        assert b.lock.lock_holder is third and list(b.lock.waiting) == []
        b.lock.release(third)

    run(go())


def test_a_record_the_broker_builds_has_a_name_for_a_nameless_user_and_host() -> None:
    """The record names the user by uid where the account has no name, and the host as "?"
    where it has none (the schema refuses an empty name); its holder fields come from the
    connection, its flags from the message. Caught: either fallback changed."""
    b = broker()
    b.host = ""
    conn = Conn(b, 1005, 1005, os.getpid(), Account(1005, "", frozenset()))
    rec = lease_record(b, conn, "GPU-mk1")
    assert (rec.user, rec.uid, rec.host, rec.device_uuids) == ("1005", 1005, "?", ("GPU-mk1",))


def test_a_repick_replaces_only_the_callers_own_leases() -> None:
    """``ignore_ids`` / ``ignore_kernel`` of a lease name what a re-pick replaces: the caller's
    own leases only. Caught: the owner check dropped (a user ended another user's lease by
    naming its id or its kernel)."""
    from dataclasses import replace

    b = broker()
    alice, bob, bob_kernel = person(b, 1001), person(b, 1002), person(b, 1002)
    alice.record = replace(lease_record(b, alice, "GPU-p1"), kernel_id="k-1")
    bob_kernel.record = replace(lease_record(b, bob_kernel, "GPU-p2"), kernel_id="k-1")
    theirs, mine = alice.record.lease_id, bob_kernel.record.lease_id
    assert b.book.replaced(bob, {"ignore_ids": [theirs, mine]}) == {mine}
    assert b.book.replaced(bob, {"ignore_kernel": "k-1"}) == {mine}
    b.book.end_replaced(
        b.book.replaced(bob, {"ignore_ids": [theirs, mine], "ignore_kernel": "k-1"}))
    assert alice.record is not None and alice.record.lease_id == theirs  # hers, untouched
    assert bob_kernel.record is None


def test_the_leases_pages_neither_repeat_nor_skip_a_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: the page's cursor compared inclusively (the last record of a page came again
    at the start of the next: every list and status showed it twice)."""

    monkeypatch.setattr(ops_mod, "PAGE_RECORDS", 2)
    b = broker()
    for i in range(5):
        lease(b, person(b, 1001 + i), f"GPU-q{i}")
    seen: list[str] = []
    after = None
    for _ in range(5):
        page = run(b.run_op("leases", person(b, 0, name="root"), {"op": "leases", "after": after}))
        seen += [r["lease_id"] for r in page["records"]]
        after = page["next"]
        if after is None:
            break
    assert sorted(seen) == sorted(r.lease_id for _, r in b.book.live())
    assert len(seen) == 5


def test_a_grant_is_answered_with_the_bytes_its_journal_line_carries(tmp_path: Any) -> None:
    """A lease's reply is not encoded again: the record's bytes are the journal's, put in the
    reply as they are; a plain ``ok`` is a line kept ready. The client reads the same answer
    either way. Caught: a reply without its protocol, or a record other than the one granted
    (the last one encoded, a stale one)."""
    import json
    import socket

    from autogpu_jupyter.brokerd import net
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = broker(state_dir=str(state))
    b.fleet.ids = {"GPU-a0", "GPU-a1"}  # the host's devices, whatever this test process sees

    async def main() -> list[dict[str, Any]]:
        ours, theirs = socket.socketpair()
        conn = person(b, 0, name="root")
        conn.writer = net.Channel(ours, 1 << 20, lambda: None)
        other = person(b, 1001)
        lease(b, other, "GPU-a0")  # encoded last, before ours
        msg = {"op": "lease", "devices": ["GPU-a1"], "holder": {"kind": "kernel"}}
        replies = [await b.run_op("lease", conn, msg),
                   await b.run_op("release", conn, {"op": "release"})]
        for reply in replies:
            assert await b.connections.send(conn, reply)
        theirs.settimeout(5)
        got = theirs.recv(1 << 16).decode().splitlines()
        conn.writer.shut()
        ours.close()
        theirs.close()
        raw.extend(got)
        return [json.loads(line) for line in got]

    raw: list[str] = []
    granted, released = run(main())
    journal = (state / "journal.log").read_text().splitlines()
    add = [json.loads(x) for x in journal if '"add"' in x][-1]
    assert granted == {"ok": True, "proto": PROTOCOL, "record": json.loads(add["record"])}
    assert raw[0] == f'{{"ok":true,"proto":{PROTOCOL},"record":{add["record"]}}}'  # as is
    assert granted["record"]["device_uuids"] == ["GPU-a1"]
    assert granted["record"]["holder_kind"] == "kernel"
    assert released == {"ok": True, "proto": PROTOCOL}


def test_a_reply_past_its_cap_is_an_error_that_says_so_and_is_logged(caplog: Any) -> None:
    """Replies are bounded by construction; one that is not (a bug) is never sent: the client
    gets one error line naming both sizes, and the log says which uid it was for."""
    import json
    import logging
    import socket

    from autogpu_jupyter.brokerd import net
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    cap = MAX_REPLY_BYTES
    b = broker()

    async def main(size: int) -> bytes:
        ours, theirs = socket.socketpair()
        conn = person(b, 1007)
        conn.writer = net.Channel(ours, 1 << 22, lambda: None)
        reply = {"ok": True, "x": ""}
        reply["x"] = "y" * (size - len(json.dumps(reply | {"proto": PROTOCOL})) - 1)
        theirs.setblocking(False)
        loop = asyncio.get_running_loop()

        async def read() -> bytes:
            got = b""
            while not got.endswith(b"\n"):
                got += await loop.sock_recv(theirs, 1 << 22)
            return got

        reading = asyncio.ensure_future(read())
        assert await b.connections.send(conn, reply)
        got = await asyncio.wait_for(reading, 10)
        conn.writer.shut()
        ours.close()
        theirs.close()
        return got

    assert len(run(main(cap))) == cap  # exactly the cap: sent as it is
    caplog.set_level(logging.ERROR, logger="autogpu.broker")
    line = run(main(cap + 1))
    assert json.loads(line) == {
        "ok": False, "type": "RegistryError", "proto": PROTOCOL,
        "error": f"reply too long ({cap + 1} bytes, cap {cap}): a bug of the broker, please "
                 "report it"}
    assert [r.getMessage() for r in caplog.records] == [
        f"reply of {cap + 1} bytes to uid 1007 not sent (cap {cap})"]


def test_a_client_that_does_not_read_its_reply_in_time_is_dropped_and_logged(
    caplog: Any,
) -> None:
    import logging
    import socket

    from autogpu_jupyter.brokerd import net

    b = broker(send_timeout_s=0.05)

    async def main() -> bool:
        ours, theirs = socket.socketpair()
        conn = person(b, 1008, pid=4242)
        conn.writer = net.Channel(ours, 1 << 24, lambda: None)
        while conn.writer.pending == 0:  # the socket takes no more
            conn.writer.write(b"z" * 65536)
        sent = await b.connections.send(conn, {"ok": True})
        closed = conn.writer.closed
        ours.close()
        theirs.close()
        return sent or not closed

    caplog.set_level(logging.WARNING, logger="autogpu.broker")
    assert run(main()) is False
    assert [r.getMessage() for r in caplog.records] == [
        "uid 1008 (pid 4242) did not read its reply within 0 s: dropped"]


def test_the_one_message_pick_answers_its_labels_beside_the_record() -> None:
    """``{"op": "pick"}`` answers the record it leased and the chosen devices' labels (a
    grant's reply is otherwise sent as built, from its journal's bytes). Caught: the labels
    dropped on the way out."""
    import json
    import socket

    from autogpu_jupyter.brokerd import net
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    b = broker()
    b.fleet.backend = SimulatedBackend("demo-4x")

    async def main() -> dict[str, Any]:
        ours, theirs = socket.socketpair()
        conn = person(b, 1009)
        conn.writer = net.Channel(ours, 1 << 20, lambda: None)
        reply = await b.run_op("pick", conn, {"op": "pick", "options": {"min_free": "1G"}})
        assert await b.connections.send(conn, reply)
        theirs.settimeout(5)
        line = theirs.recv(1 << 16)
        conn.writer.shut()
        ours.close()
        theirs.close()
        return json.loads(line)  # type: ignore[no-any-return]

    got = run(main())
    assert got["ok"] is True and got["proto"] == PROTOCOL
    labels = {d.uuid: d.label for d in b.book.snap.devices}
    assert got["labels"] == [labels[u] for u in got["record"]["device_uuids"]]
    assert len(got["labels"]) == 1 and got["record"]["user"] == "user1009"


# ---- survivors of the mutation sample (issue 22): each test names the change it catches ----


def ticket_record(b: Broker, conn: Conn) -> Any:
    """The record the broker builds for ``conn``'s ticket (one device, any)."""
    return ops_mod.make_record(b, conn, "ticket", {
        "device_uuids": [], "device_requested_bytes": [], "exclusive": False, "seq": 1,
        "constraints": {"min_free_bytes": None, "min_free_fraction": None,
                        "max_util_pct": None, "count": 1, "exclude": [], "exclusive": False,
                        "allowed_uuids": None},
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "process",
    })


class Written:
    """A connection's writer that keeps what the broker writes to it."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.lines.append(data)

    def close(self) -> None:
        self.closed = True


def test_a_lock_taken_back_after_a_short_slice_does_not_mark_its_person_again() -> None:
    """Only a lock held for the whole ``lock_timeout_s`` marks its person as one who lets it
    time out; one taken back after a short slice (someone else waited) does not. Caught: the
    margin of 1 ms made 1.001 s (with a 1 s timeout every lock taken back marked its person)."""
    import time

    from autogpu_jupyter.broker import LOCK_SLICE_S

    b = broker(lock_timeout_s=1.0)
    alice, bob = person(b, 1001), person(b, 1002)
    b.lock.lock_holder = alice
    alice.granted_at = time.monotonic() - LOCK_SLICE_S  # it held a slice, then lost it
    b.lock.expire(alice)
    assert b.lock.lock_holder is None and b.lock.lock_misuse == {}
    b.lock.lock_holder = bob
    bob.granted_at = time.monotonic() - 1.0  # it held the whole timeout
    b.lock.expire(bob)
    assert b.lock.lock_holder is None and list(b.lock.lock_misuse) == [1002]


def test_a_holder_that_let_the_lock_time_out_gets_a_slice_once_someone_else_waits() -> None:
    """A person who let the pick lock time out lately keeps it only :data:`LOCK_SLICE_S` once
    another person asks for it: the holder's timer is set again when the other one begins.
    Caught: the holder's misuse looked up under no key (the other waited the whole timeout)."""
    import time

    from autogpu_jupyter.broker import LOCK_SLICE_S

    b = broker(lock_timeout_s=30.0)
    alice, bob = person(b, 1001), person(b, 1002)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        await b.run_op("begin", alice, {"op": "begin"})
        assert alice.lock_handle is not None
        assert alice.lock_handle.when() - loop.time() > 20  # alone: the whole timeout
        b.lock.lock_misuse[1001] = time.monotonic()  # she let it time out a moment ago
        waiting = asyncio.create_task(b.run_op("begin", bob, {"op": "begin"}))
        await asyncio.sleep(0)
        assert alice.lock_handle is not None
        assert alice.lock_handle.when() <= loop.time() + LOCK_SLICE_S
        await asyncio.wait_for(waiting, 5)
        assert b.lock.lock_holder is bob
        b.lock.release(bob)

    run(go())


def test_a_holder_that_is_not_an_object_is_a_usage_error() -> None:
    """Caught: the refusal's kind dropped (the client raised a broker failure, not the usage
    error it is)."""
    b = broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal, match=r"^holder: expected an object$") as err:
        ops_mod.holder_fields(b, conn, {"holder": ["kernel"]})
    assert err.value.kind == "UsageErrorBase"


def test_a_lease_replaced_by_a_repick_tells_its_connection_so() -> None:
    """The connection of a lease a re-pick replaced gets one ``replaced`` event line (its
    client reads it with its next reply). Caught: the event's key misspelled."""
    b = broker()
    alice, alice_old = person(b, 1001), person(b, 1001)
    alice_old.writer = Written()  # type: ignore[assignment]
    lease(b, alice_old, "GPU-rp1")
    assert alice_old.record is not None
    b.book.end_replaced(b.book.replaced(alice, {"ignore_ids": [alice_old.record.lease_id]}))
    assert alice_old.record is None
    assert alice_old.writer.lines == [  # type: ignore[attr-defined]
        b'{"event": "replaced", "message": "lease replaced by a re-pick"}\n']


@pytest.mark.parametrize("pid", [0, -5])
def test_set_pid_refuses_a_pid_that_is_not_positive(pid: int) -> None:
    """Caught: ``or pid <= 0`` made ``and`` (0 and negative pids were taken as holders)."""
    b = broker()
    conn = person(b, 0, name="root")  # root may name any process: only the value is checked
    lease(b, conn, "GPU-sp1")
    with pytest.raises(BrokerRefusal, match=rf"^set_pid: invalid pid '{pid}'$") as err:
        run(b.run_op("set_pid", conn, {"op": "set_pid", "pid": pid}))
    assert err.value.kind == "UsageErrorBase"
    assert conn.record is not None and conn.record.pid == conn.pid  # unchanged


def test_revoke_by_a_user_other_than_root_is_refused_in_those_words() -> None:
    """Caught: the refusal's text changed."""
    b = broker()
    alice, bob = person(b, 1001), person(b, 1002)
    lease(b, bob, "GPU-rv1")
    assert bob.record is not None
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("revoke", alice, {"op": "revoke", "lease_id": bob.record.lease_id}))
    assert (str(err.value), err.value.kind) == ("revoke needs root", "RegistryError")
    assert bob.record is not None  # still bob's


class Closing(Written):
    """A writer whose close fails the way a connection lost on the way fails."""

    def __init__(self, err: type[Exception]) -> None:
        super().__init__()
        self.err = err

    def close(self) -> None:
        raise self.err("the connection is gone")


@pytest.mark.parametrize("make", [Written, lambda: None, lambda: Closing(OSError),
                                  lambda: Closing(RuntimeError)],
                         ids=["open", "none", "oserror", "runtimeerror"])
def test_root_revokes_a_live_lease_tells_its_holder_and_says_whose_it_was(make: Any) -> None:
    """Root's revoke ends the lease, sends its holder one ``revoked`` event line, closes its
    connection (a connection already lost on the way does not fail the revoke) and answers
    whose lease it was and its kind. Caught: the event's or the answer's keys misspelled;
    each error the close may raise no longer suppressed."""
    b = broker()
    root, alice = person(b, 0, name="root"), person(b, 1001)
    alice.writer = writer = make()
    lease(b, alice, "GPU-rv2")
    rec = alice.record
    assert rec is not None
    got = run(b.run_op("revoke", root, {"op": "revoke", "lease_id": rec.lease_id}))
    assert got == {"ok": True, "revoked": f"user1001: pid {alice.pid}", "kind": "lease"}
    assert alice.record is None
    if isinstance(writer, Written):
        assert [json.loads(line) for line in writer.lines] == [{
            "event": "revoked", "lease_id": rec.lease_id, "kind": "lease",
            "message": f"lease {rec.lease_id} revoked by the admin"}]
    if type(writer) is Written:
        assert writer.closed


def test_root_revokes_an_orphaned_lease_by_id_and_an_unknown_id_is_named_in_the_refusal(
) -> None:
    """An orphan (a lease taken back from the journal) is revoked by id: gone from the
    orphans, the answer says whose it was. An id of nothing live is refused with its first 64
    characters. Caught: the orphan's record or id dropped; the answer's keys misspelled or
    its ``ok`` false; the id cut at 65 characters."""
    b = broker()
    root, alice = person(b, 0, name="root"), person(b, 1001)
    lease(b, alice, "GPU-rv3")
    rec = alice.record
    assert rec is not None
    alice.record = None
    b.book.adopt(Orphan(1001, rec, [], key=1001))
    got = run(b.run_op("revoke", root, {"op": "revoke", "lease_id": rec.lease_id}))
    assert got == {"ok": True, "revoked": f"user1001: pid {alice.pid}", "kind": "lease"}
    assert counted(b, "orphans") == 0
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("revoke", root, {"op": "revoke", "lease_id": "y" * 70}))
    assert str(err.value) == f"revoke: no live lease or ticket {'y' * 64!r}"
    assert err.value.kind == "UsageErrorBase"


def test_every_accepted_connection_counts_against_its_persons_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three connections of one person with ``max_connections_per_user = 2``: two are served,
    the third refused with one line; when they end, the count is back to none. Caught: the
    count set to 1 instead of increased (a person's connections never reached the limit)."""
    import json
    import socket


    b = broker(max_connections_per_user=2)
    monkeypatch.setattr(conn_mod, "peer_credentials", lambda sock: (os.getpid(), 1001, 1001))
    monkeypatch.setattr(b.accounts, "account",
                        lambda uid: Account(1001, "alice", frozenset()))

    async def go() -> tuple[list[int], dict[str, Any]]:
        pairs = [socket.socketpair() for _ in range(3)]
        counts = []
        for ours, _ in pairs:
            b.accepted(ours)
            counts.append(b.connections.per_key[1001])
        third = pairs[2][1]
        third.settimeout(5)
        refusal = json.loads(await asyncio.get_running_loop().run_in_executor(
            None, third.recv, 65536))
        for _, theirs in pairs:
            theirs.close()
        for _ in range(200):
            if not b.connections.conns:
                break
            await asyncio.sleep(0.01)
        return counts, refusal

    counts, refusal = run(go())
    assert counts == [1, 2, 2]
    assert refusal["error"] == "too many connections for alice (max_connections_per_user = 2)"
    assert (b.connections.conns, dict(b.connections.per_key)) == (set(), {})


def test_a_ticket_given_up_before_it_could_be_served_bars_nobody() -> None:
    """A ticket that never could be served (no check found it servable) ends without a
    bar from the line. Caught: ``and`` made ``or`` (the comparison with no time raised, and
    the ticket's connection could not end)."""
    b = broker()
    conn = person(b, 1001)
    conn.record = ticket_record(b, conn)
    conn.record = None
    assert b.book.bars() == {} and b.book.servable_times() == {}


def test_a_ticket_the_decision_cannot_judge_is_logged_by_its_id(caplog: Any) -> None:
    """A ticket the decision fails on reserves as before (it is not dormant), with a debug
    line naming it. Caught: the ticket's id left out of the line."""
    import logging
    import time

    b = broker()
    b.book.snap, b.book.snap_at = object(), time.monotonic()  # a fresh snapshot

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("a constraint it cannot read")

    b.book.waiters = fails  # type: ignore[method-assign]
    conn = person(b, 1001)
    caplog.set_level(logging.DEBUG, logger="autogpu.broker")
    conn.record = ticket_record(b, conn)
    assert conn.record is not None
    assert b.book.reserving(conn.record)
    assert [r.getMessage() for r in caplog.records if "not judged" in r.getMessage()] == [
        f"ticket {conn.record.lease_id} not judged: a constraint it cannot read"]


def test_the_state_a_pick_decides_on_has_the_devices_reserved_away_from_its_user() -> None:
    """The store view of a pick's decision counts a device reserved for a group the caller
    is not in as an exclusive pseudo-lease; a member sees it free. Caught: the reservation
    asked for no connection (the view raised)."""
    from autogpu_jupyter.broker import _StateView
    from autogpu_jupyter.core.leasing import admission

    b = broker(reserved={"GPU-res1": ["ml"]})
    outsider = person(b, 1001)
    member = person(b, 1002, groups=frozenset({"ml"}))
    lease(b, member, "GPU-res0")
    leases, tickets = _StateView(b.book, outsider).live_records()
    assert [(r.device_uuids, r.exclusive, admission.is_reservation(r)) for r in leases] == [
        (("GPU-res0",), False, False), (("GPU-res1",), True, True)]
    assert tickets == []
    leases, _ = _StateView(b.book, member).live_records()
    assert [r.device_uuids for r in leases] == [("GPU-res0",)]


def test_a_state_directory_that_is_a_symlink_is_refused_in_one_line(tmp_path: Any) -> None:
    """Caught: the refusal's text dropped (the broker stopped without saying why)."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SystemExit) as err:
        broker(state_dir=str(tmp_path / "link"))
    assert str(err.value) == (
        f"autogpu broker: state directory {tmp_path / 'link'}: {tmp_path / 'link'} is a "
        "symlink: refused (root would write the journal wherever it points); name the real "
        f"path, --state-dir {real}")


def test_serve_listens_answers_and_stops_on_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` (what ``autogpu broker`` runs): it listens, answers a client, and SIGTERM ends
    it cleanly (its handler, not the default that kills the process). Caught: the listener
    given no socket, no future to wait on, a signal handler installed without its callback."""
    import json
    import signal
    import tempfile

    import autogpu_jupyter.broker as broker_mod
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL
    from autogpu_jupyter.errors import AutoGPUError

    class NoFleet:
        def snapshot(self) -> Any:
            raise AutoGPUError("no GPU library here")

    monkeypatch.setattr(fleet_mod, "get_backend", NoFleet)
    where = tempfile.mkdtemp(prefix="agb-", dir="/tmp")  # a socket path has at most 107 bytes
    path = os.path.join(where, "b.sock")
    replies: list[dict[str, Any]] = []

    async def client() -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        writer.write(json.dumps({"op": "status", "proto": PROTOCOL}).encode() + b"\n")
        replies.append(json.loads(await reader.readline()))
        writer.close()
        # never the default handler: that would end the test process
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        os.kill(os.getpid(), signal.SIGTERM)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        tasks = []
        config = BrokerConfig(socket_path=path)
        await asyncio.wait_for(
            broker_mod.serve(config, lambda: tasks.append(loop.create_task(client()))), 10)
        await tasks[0]

    try:
        run(main())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(where)
    assert [(r["ok"], r["leases_total"], r["proto"]) for r in replies] == [(True, 0, PROTOCOL)]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # given back


# ---- survivors of seed 52's sample (issue 22) ----


@pytest.mark.parametrize(("value", "shown"), [(-1, "-1"), (True, "True"), ("2", "'2'")])
def test_a_rules_file_with_a_limit_that_is_not_a_count_names_it(
    tmp_path: Any, value: Any, shown: str
) -> None:
    """Caught: the bad value's text dropped from the message (the admin read ``None``)."""
    import json

    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"max_devices_per_user": value}))
    with pytest.raises(SystemExit) as err:
        BrokerConfig(socket_path="/nonexistent/b.sock").load_rules(str(path))
    assert str(err.value) == (
        f"autogpu broker: rules file {path}: {shown} is not a whole number >= 0; expected e.g. "
        '{"max_devices_per_user": 2, "users": {"alice": 4}, "groups": {"students": 1}, '
        '"reserved": {"GPU-...": ["ml"]}}')


def test_a_holder_of_an_unknown_kind_is_a_usage_error_naming_the_kinds() -> None:
    """Caught: the refusal's kind misspelled (the client raised a broker failure, not the
    usage error it is)."""
    b = broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal) as err:
        ops_mod.holder_fields(b, conn, {"holder": {"kind": "daemon"}})
    assert (str(err.value), err.value.kind) == (
        "holder.kind 'daemon' is not one of process, kernel, cli, provisioner, api",
        "UsageErrorBase")


def test_a_second_lease_on_one_connection_is_refused_in_those_words() -> None:
    """Caught: the refusal's text dropped (the client showed ``None``)."""
    b = broker()
    conn = person(b, 1001)
    lease(b, conn, "GPU-ol1")
    held = conn.record
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", conn, {"op": "lease", "devices": ["GPU-ol2"]}))
    assert (str(err.value), err.value.kind) == (
        "this connection already holds a lease or ticket", "RegistryError")
    assert conn.record is held


def test_a_ticket_past_the_tickets_per_user_is_refused_with_the_admissions_words() -> None:
    """The admission's refusal reaches the client as it is, with its kind. Caught: its text
    replaced by ``None``."""
    b = broker(max_tickets_per_user=0)
    conn = person(b, 1001)
    msg = {"op": "ticket", "constraints": {
        "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
        "exclude": [], "exclusive": False, "allowed_uuids": None}}
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("ticket", conn, msg))
    assert (str(err.value), err.value.kind) == (
        "user1001 already waits in line with 0 ticket(s); another would exceed "
        "max_tickets_per_user = 0 set by the admin (enforced by the broker). Wait for one of "
        "them to be served, or cancel it (interrupt the waiting pick).",
        "LeaseLimitError")
    assert conn.record is None


def test_a_refused_connection_gets_one_line_with_the_protocol_and_is_logged(
    caplog: Any,
) -> None:
    """Caught: the refusal line's ``proto`` key misspelled (a client of this version would
    take the broker for one of another protocol)."""
    import json
    import logging
    import socket

    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    b = broker()
    ours, theirs = socket.socketpair()
    caplog.set_level(logging.WARNING, logger="autogpu.broker")
    try:
        b.connections.refuse(ours, 1001, "too many connections for alice")
        theirs.settimeout(5)
        line = theirs.recv(65536)
    finally:
        theirs.close()
    assert line.endswith(b"\n") and json.loads(line) == {
        "ok": False, "type": "RegistryError", "error": "too many connections for alice",
        "proto": PROTOCOL}
    assert ours.fileno() == -1  # closed
    assert [r.getMessage() for r in caplog.records] == [
        "1 connection(s) refused (the last from uid 1001: too many connections for alice)"]


@pytest.mark.parametrize("start", [100.0, 3.0], ids=["running", "just-booted"])
def test_refused_connections_are_logged_at_most_every_ten_seconds_with_their_count(
    monkeypatch: pytest.MonkeyPatch, caplog: Any, start: float,
) -> None:
    """The first refusal is logged, also on a host booted less than 10 s ago (the monotonic
    clock counts from boot); the next ones within 10 s are counted into the next line, logged
    10 s after the last. Caught: the count set instead of increased or not started again from 0,
    the time since the last line miscounted or compared with ``>``; the last line's time
    starting at 0 (a broker started in a host's first 10 s kept its first refusals quiet)."""
    import logging
    import socket

    b = broker()
    clock = Paced(monkeypatch)
    clock.now = start
    caplog.set_level(logging.WARNING, logger="autogpu.broker")

    def refuse(uid: int) -> None:
        ours, theirs = socket.socketpair()
        b.connections.refuse(ours, uid, "too many connections")
        theirs.close()

    refuse(1001)
    clock.now += 5.0
    refuse(1002)
    refuse(1003)
    clock.now += 5.0
    refuse(1004)
    refuse(1005)
    clock.now += 10.0
    refuse(1006)
    assert [r.getMessage() for r in caplog.records] == [
        "1 connection(s) refused (the last from uid 1001: too many connections)",
        "3 connection(s) refused (the last from uid 1004: too many connections)",
        "2 connection(s) refused (the last from uid 1006: too many connections)"]


def test_a_client_of_another_protocol_gets_an_untrusted_error_and_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first message of a connection names the client's protocol; another one is answered
    with one line of kind ``LeaseStoreUntrustedError`` (the client says the versions differ),
    then the connection ends. Caught: the line's ``type`` key misspelled."""
    import json
    import socket

    import autogpu_jupyter.broker as broker_mod
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    b = broker()
    monkeypatch.setattr(conn_mod, "peer_credentials", lambda sock: (os.getpid(), 1001, 1001))
    monkeypatch.setattr(b.accounts, "account",
                        lambda uid: Account(1001, "alice", frozenset()))

    async def go() -> list[bytes]:
        ours, theirs = socket.socketpair()
        b.accepted(ours)
        theirs.sendall(json.dumps({"op": "status", "proto": PROTOCOL + 1}).encode() + b"\n")
        theirs.settimeout(5)
        loop = asyncio.get_running_loop()
        got = []
        while chunk := await loop.run_in_executor(None, theirs.recv, 65536):
            got.append(chunk)  # up to the end: the broker closed the connection
        theirs.close()
        return got

    got = b"".join(run(go()))
    assert json.loads(got) == {
        "ok": False, "type": "RegistryUntrustedError", "proto": PROTOCOL,
        "error": broker_mod._protocol_mismatch(PROTOCOL + 1)}
    assert got.count(b"\n") == 1


def exchange(b: Broker, monkeypatch: pytest.MonkeyPatch, *sent: bytes) -> list[Any]:
    """The replies of a broker to one connection of alice's that sends ``sent`` then ends."""
    import json
    import socket


    monkeypatch.setattr(conn_mod, "peer_credentials", lambda sock: (os.getpid(), 1001, 1001))
    monkeypatch.setattr(b.accounts, "account",
                        lambda uid: Account(1001, "alice", frozenset()))

    async def go() -> bytes:
        ours, theirs = socket.socketpair()
        b.accepted(ours)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, theirs.sendall, b"".join(sent))
        theirs.shutdown(socket.SHUT_WR)
        theirs.settimeout(5)
        got = []
        while chunk := await loop.run_in_executor(None, theirs.recv, 65536):
            got.append(chunk)  # up to the end: the broker closed the connection
        theirs.close()
        return b"".join(got)

    return [json.loads(line) for line in run(go()).splitlines()]


def test_a_client_of_the_older_protocol_is_served_in_the_shapes_it_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client of the protocol before this one (autogpu before 0.2: no ``proto`` in its
    messages) picks through a broker of this one: its ``begin`` lists the leases of others
    as records (``leases``, with the tickets beside them), its lease is granted on a free
    device and refused on an exclusive one, its ``status`` carries the records. Caught: the
    older protocol refused in one line (the broker and users' environments had to be
    upgraded on the same day), or answered with the booking view only (an older client saw
    every device free and took bob's exclusive GPU)."""
    import json

    b, ids = simulated_broker()
    bob = person(b, 1002)
    bob.record = ops_mod.make_record(b, bob, "lease", {
        "device_uuids": [ids[0]], "device_requested_bytes": [None], "exclusive": True,
        "pid": bob.pid, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "process"})

    def older(msg: dict[str, Any]) -> bytes:
        return json.dumps(msg).encode() + b"\n"

    begin, taken, status = exchange(
        b, monkeypatch, older({"op": "begin"}),
        older({"op": "lease", "devices": [ids[0]], "exclusive": True}),
        older({"op": "status"}),
    )
    assert begin["ok"] is True and begin["tickets"] == []
    assert [(r["device_uuids"], r["exclusive"], r["user"]) for r in begin["leases"]] == [
        ([ids[0]], True, "user1002")]
    assert taken["ok"] is False and "exclusive" in taken["error"], taken
    assert [r["user"] for r in status["leases"]] == ["user1002"] and status["tickets"] == []
    (mine,) = exchange(b, monkeypatch, older({"op": "lease", "devices": [ids[1]]}))
    assert mine["ok"] is True and mine["record"]["device_uuids"] == [ids[1]]


@pytest.mark.parametrize(
    ("sent", "error"),
    [
        (b"x" * (64 * 1024 + 1) + b"\n",
         "message longer than 65536 bytes: connection closed"),
        (b"{not json\n", "malformed message (not JSON): connection closed"),
        (b'{"op": "frobnicate"}\n',
         'unknown message (op "frobnicate"; expected one of begin, end, lease, pick, ticket, '
         "set_pid, release, leases, status, revoke, reload): connection closed"),
        (b'[1]\n',
         "unknown message (op null; expected one of begin, end, lease, pick, ticket, "
         "set_pid, release, leases, status, revoke, reload): connection closed"),
    ],
)
def test_a_message_the_broker_cannot_take_is_answered_in_one_line_naming_why_then_closed(
    monkeypatch: pytest.MonkeyPatch, sent: bytes, error: str,
) -> None:
    """Caught: the line too long, not JSON or of an unknown op answered without its words (or
    not at all), a message that is not an object or an unknown op taken on to the ops."""
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    b = broker()
    assert exchange(b, monkeypatch, sent, b'{"op": "leases"}\n') == [
        {"ok": False, "type": "RegistryError", "error": error, "proto": PROTOCOL}]


def test_the_protocol_is_checked_on_the_first_message_and_the_line_bar_on_tickets_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection names its protocol once; a person barred from the waiting line still
    lists the leases, and a ticket is refused with the bar's words as a ``LeaseLimitError``.
    Caught: the protocol asked of every message, the bar checked on every op but tickets (or
    on none), and the refusal's ``ok`` key misspelled."""
    import json

    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    b = broker()
    other = broker()  # alice's ticket there lapsed: barred for a minute
    b.book.bar_from_line(1001, ticket_record(other, person(other, 1001)))
    replies = exchange(
        b, monkeypatch,
        json.dumps({"op": "leases", "proto": PROTOCOL}).encode() + b"\n",
        b'{"op": "leases"}\n',
        b'{"op": "ticket"}\n',
    )
    assert [r["ok"] for r in replies[:2]] == [True, True]
    assert replies[2] == {
        "ok": False, "type": "LeaseLimitError", "proto": PROTOCOL,
        "error": "alice left a place in the waiting line that could be served, without taking "
                 "a lease: alice may wait in line again in 60 s (a pick that does not wait "
                 "works now)"}


def test_the_reaper_logs_a_failed_round_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """A round of the orphan and ticket check that fails is logged with its traceback, and
    the next round comes. Caught: the log line's text replaced by ``None``."""
    import logging

    b = broker()
    rounds: list[int] = []

    class Stop(Exception):
        pass

    async def sleep(delay: float) -> None:
        assert delay == 1.0
        if len(rounds) == 2:
            raise Stop

    async def reap(loop: Any) -> None:
        rounds.append(len(rounds))
        raise RuntimeError("a bad round")

    monkeypatch.setattr(asyncio, "sleep", sleep)
    monkeypatch.setattr(b.restorer, "reap", reap)
    caplog.set_level(logging.ERROR, logger="autogpu.broker")
    with pytest.raises(Stop):
        run(b.restorer.reap_orphans())
    assert rounds == [0, 1]
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("orphan and ticket check failed", True)] * 2


def test_an_orphan_whose_recorded_holder_runs_is_kept() -> None:
    """After a restart, a lease whose socket's inode is not known lives while its recorded
    holders run (checked by start time and uid). Caught: the holders checked without their
    socket's inode argument (the check raised, and no orphan was ever reaped)."""
    from autogpu_jupyter.brokerd import journal as jrnl

    b = broker()
    alice = person(b, os.getuid())
    lease(b, alice, "GPU-or1")
    rec = alice.record
    assert rec is not None
    alice.record = None
    me = jrnl.proc_ids(os.getpid())
    assert me
    b.book.adopt(Orphan(os.getuid(), rec, list(me), key=os.getuid()))

    async def go() -> None:
        await b.restorer.reap(asyncio.get_running_loop())

    run(go())
    assert rec.lease_id in b.book.orphans and b.book.orphans[rec.lease_id].holder_pids == list(me)


def test_an_orphan_whose_holders_are_gone_but_whose_socket_is_held_is_kept() -> None:
    """Every recorded holder of an orphan is gone, but a process still holds its socket (as a
    child the socket was handed to would; here this process): that one becomes its holder,
    found by one scan of /proc. Caught: the scan's answer looked up by the wrong key (the
    lookup raised)."""
    import socket

    from autogpu_jupyter.brokerd import journal as jrnl

    b = broker()
    alice = person(b, os.getuid())
    lease(b, alice, "GPU-or2")
    rec = alice.record
    assert rec is not None
    alice.record = None
    ours, theirs = socket.socketpair()
    try:
        inode = os.fstat(theirs.fileno()).st_ino  # held by this process only
        gone = [(os.getpid(), -1)]  # a start time no process has: that holder is gone
        b.book.adopt(Orphan(os.getuid(), rec, gone, key=os.getuid(), peer=inode))

        async def go() -> None:
            await b.restorer.reap(asyncio.get_running_loop())

        run(go())
    finally:
        ours.close()
        theirs.close()
    assert rec.lease_id in live_ids(b)
    assert b.book.orphans[rec.lease_id].holder_pids == jrnl.proc_ids(os.getpid())


def test_a_servable_ticket_behind_one_that_is_not_lapses_after_the_grace() -> None:
    """The lapse check goes through the whole line: a ticket that is not servable (the first)
    does not stop the check of those behind it. Caught: ``continue`` made ``break`` (a ticket
    behind an unservable one kept its place however long a device was free for it)."""
    from dataclasses import replace

    b = broker(ticket_grace_s=0.0)
    alice, bob = person(b, 1001), person(b, 1002)
    alice.record = ticket_record(b, alice)
    bob.writer = Written()  # type: ignore[assignment]
    bob.record = replace(ticket_record(b, bob), seq=2)
    assert [r.seq for r in b.book.line()] == [1, 2]
    theirs, mine = alice.record.lease_id, bob.record.lease_id

    def waiters(snap: Any, tickets: list[Any], settled_only: bool = False) -> dict[str, Any]:
        return {mine: ("GPU-lp1",)} if any(t.lease_id == mine for t in tickets) else {}

    b.fleet.snapshot = lambda: "a snapshot"  # type: ignore[method-assign]
    b.book.waiters = waiters  # type: ignore[method-assign]

    async def go() -> None:
        await b.restorer.lapse_round(asyncio.get_running_loop())

    run(go())
    assert alice.record is not None and alice.record.lease_id == theirs  # not servable: kept
    assert bob.record is None and counted(b, "tickets_lapsed") == 1
    assert bob.writer.closed  # type: ignore[attr-defined]
    assert [json_event(x) for x in bob.writer.lines] == [  # type: ignore[attr-defined]
        ("ticket_lapsed", mine)]


def json_event(line: bytes) -> tuple[str, str]:
    import json

    doc = json.loads(line)
    return doc["event"], doc["lease_id"]


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),  # LISTEN_FDS unset: nothing inherited
        ({"LISTEN_FDS": "0"}, None),
        ({"LISTEN_FDS": "x"}, None),
    ],
)
def test_no_inherited_socket_without_a_descriptor_count(
    monkeypatch: pytest.MonkeyPatch, environ: dict[str, str], expected: Any,
) -> None:
    """systemd's variables naming this process but no descriptor: none is taken (and
    descriptor 3 left alone). Caught: an unset LISTEN_FDS read without its default "0" (the
    broker stopped with a TypeError)."""
    from autogpu_jupyter.broker import _inherited_socket

    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.delenv("LISTEN_FDS", raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    assert _inherited_socket() is expected
    assert os.environ["LISTEN_PID"] == str(os.getpid())  # not taken: left as it was


# ---- survivors of seed 53's sample (issue 22) ----


@pytest.mark.parametrize("until", [0.0, 1000.0])  # long past; ending this very moment
def test_past_4096_bars_the_ended_ones_are_dropped_and_the_new_one_kept(
    monkeypatch: pytest.MonkeyPatch, until: float,
) -> None:
    """The bars are pruned once there are more than 4096 of them: every bar that has ended by
    now goes (one ending now bars no more), the new one stays. Caught: the bound moved to
    4097 (the 4097th bar kept the ended ones), and a bar ending now kept by the pruning."""
    import autogpu_jupyter.broker as broker_mod

    b = broker()
    conn = person(b, 1001)
    rec = ticket_record(b, conn)
    now = [until - broker_mod.LINE_BAR_S]  # 4096 people barred then: their bars end at until
    monkeypatch.setattr(broker_mod.time, "monotonic", lambda: now[0])
    for i in range(4096):
        b.book.bar_from_line(10_000 + i, rec)
    assert len(b.book.bars()) == 4096
    now[0] = 1000.0
    b.book.bar_from_line(1001, rec)
    assert b.book.bars() == {1001: 1000.0 + broker_mod.LINE_BAR_S}


def test_a_users_own_limit_is_the_one_applied_before_any_groups() -> None:
    """Caught: the user's name lost before the lookup (a person with a limit of their own got
    the general one)."""
    b = broker(user_limits={"alice": 2}, group_limits={"lab": 7}, max_devices_per_user=5)
    assert b.book.limit_for(person(b, 1001, name="alice", groups=frozenset({"lab"}))) == (
        2, " for alice")


def test_a_leases_page_takes_records_up_to_exactly_its_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A page holds records while their JSON sums to at most PAGE_BYTES: two records of exactly
    that many bytes fit. Caught: the byte count started at 1 (a page one byte short)."""
    import json


    b = broker()
    for i in range(3):
        lease(b, person(b, 1001 + i), f"GPU-p{i}")
    root = person(b, 0, name="root")
    shown = [views_mod.shown(r, 0) for _, r in b.book.live() if r.kind == "lease"]
    monkeypatch.setattr(ops_mod, "PAGE_BYTES", len(json.dumps(shown[0])) +
                        len(json.dumps(shown[1])))
    page = run(b.run_op("leases", root, {"op": "leases"}))
    assert page["records"] == shown[:2]
    assert page["next"] == [shown[1]["created_s"], shown[1]["lease_id"]]


def test_a_pick_books_the_bytes_its_min_free_asks_on_each_device() -> None:
    """The lease a pick takes records the bytes asked (``min_free``) per device, as a lease
    asked for by hand does. Caught: the key misspelt (the pick's lease booked nothing)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker()
    b.fleet.backend = SimulatedBackend("demo-4x")
    conn = person(b, 1009)
    run(b.run_op("pick", conn, {"op": "pick", "options": {"min_free": "1G"}}))
    assert conn.record is not None
    assert list(conn.record.device_requested_bytes) == [1 << 30]


@pytest.mark.parametrize(("given", "said"), [
    ({"count": "x"}, "invalid count 'x': expected a whole number >= 1, e.g. 2"),
    ({"exclude": 5}, 'invalid exclude 5: expected ids like "0,2" or a list'),
    ({"wait": 5}, "unknown parameter 'wait'; accepted: count, devices, exclude, exclusive, "
                  "max_util, min_free, model, prefer"),
])
def test_a_pick_with_a_bad_option_is_a_usage_error_naming_it_as_a_key(
    given: dict[str, Any], said: str,
) -> None:
    """The options of ``{"op": "pick"}`` are JSON keys: a bad one is named ``count``, not
    ``--count``; ``wait`` is not one of them (a waiting pick runs in the client). Caught: the
    style or the accepted keys not passed (or misspelt: an ``exclude`` that is not a list
    raised a TypeError); the refusal's text or kind changed."""
    b, _ = simulated_broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("pick", conn, {"op": "pick", "options": given}))
    assert (str(err.value), err.value.kind) == (said, "UsageErrorBase")
    assert conn.record is None


def test_a_pick_that_nothing_fits_is_refused_with_why_each_device_was_dropped() -> None:
    """Caught: the refusal's text, its explanation or its kind dropped or changed."""
    b, _ = simulated_broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("pick", conn, {"op": "pick", "options": {"min_free": "100G"}}))
    head, *lines = str(err.value).split("\n")
    assert head == "no device fits (min free 100.0 GiB):"
    assert [re.sub(r"only [0-9.]+ GiB", "only N GiB", line) for line in lines] == [
        f"  GPU {i} (NVIDIA {model}): dropped: only N GiB free < 100.0 GiB wanted"
        for i, model in enumerate(["A100-SXM4-80GB"] * 2 + ["L4"] * 2)]
    assert err.value.kind == "NoDeviceFitsError" and conn.record is None


def test_a_pick_leases_with_its_exclusive_wish_share_of_memory_and_holder() -> None:
    """The lease a pick takes is exclusive when asked, books a share (``25%``) of the chosen
    device's own memory, and records the holder the message names; with no ``min_free`` it
    books nothing. Caught: the exclusive or holder key misspelt or the holder read under
    another key (a shared lease of a plain process); the share resolved without the device's
    memory; no ``min_free`` resolved anyway (an AttributeError)."""
    b, _ = simulated_broker()
    one, two = person(b, 1001), person(b, 1002)
    holder = {"kind": "kernel", "kernel_id": "k-1", "notebook_path": "a.ipynb"}
    run(b.run_op("pick", one, {"op": "pick", "options": {"exclusive": True, "min_free": "25%"},
                        "holder": holder}))
    rec = one.record
    assert rec is not None
    total = {d.uuid: d.memory_total_bytes for d in b.book.snap.devices}[rec.device_uuids[0]]
    assert (rec.exclusive, list(rec.device_requested_bytes)) == (True, [total // 4])
    assert (rec.holder_kind, rec.kernel_id, rec.notebook_path) == ("kernel", "k-1", "a.ipynb")
    run(b.run_op("pick", two, {"op": "pick"}))
    assert two.record is not None
    assert list(two.record.device_requested_bytes) == [None]
    assert two.record.device_uuids != rec.device_uuids  # the exclusive one is not shared


@pytest.mark.parametrize("away", ["held", "reserved"])
def test_a_pick_passes_over_the_device_held_exclusively_or_reserved_away_from_its_person(
    away: str,
) -> None:
    """The pick's favourite (GPU 2 of ``demo-4x``) is passed over when someone holds it
    exclusively or it is reserved for a group its person is not in. Caught: the decision
    given no view of the broker's state, or a view of nobody's (the pick chose the held
    device and its lease was refused; the reservation asked of no person raised)."""
    b, ids = simulated_broker(reserved={})
    favourite = ids[2]
    alice, bob = person(b, 1001), person(b, 1002)
    run(b.run_op("pick", bob, {"op": "pick"}))
    assert bob.record is not None and list(bob.record.device_uuids) == [favourite]
    bob.record = None
    if away == "held":
        run(b.run_op("lease", bob, {"op": "lease", "devices": [favourite], "exclusive": True}))
    else:
        b.config.reserved = {favourite: ["ml"]}
    run(b.run_op("pick", alice, {"op": "pick"}))
    assert alice.record is not None and favourite not in alice.record.device_uuids


def test_a_pick_is_not_bounded_by_the_brokers_own_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker's own environment (``CUDA_VISIBLE_DEVICES`` of the service) says nothing
    about which devices a caller may get. Caught: the decision read ``os.environ``."""
    b, ids = simulated_broker()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    conn = person(b, 1001)
    run(b.run_op("pick", conn, {"op": "pick"}))
    assert conn.record is not None and list(conn.record.device_uuids) == [ids[2]]


def test_a_pick_or_a_begin_on_a_connection_that_holds_a_lease_is_refused_in_those_words(
) -> None:
    """Caught: the refusal's text dropped (``None``) in ``pick`` or ``begin``."""
    from autogpu_jupyter.core.leasing import admission

    b, ids = simulated_broker()
    conn = person(b, 1001)
    run(b.run_op("lease", conn, {"op": "lease", "devices": [ids[0]]}))
    for op in ("pick", "begin"):
        with pytest.raises(BrokerRefusal) as err:
            run(b.run_op(op, conn, {}))
        assert str(err.value) == admission.ONE_PER_CONNECTION


def test_a_set_pid_keeps_the_journals_peer_of_the_lease(tmp_path: Any) -> None:
    """A lease changed in place (a new holder pid) is journaled again with the peer inode the
    journal already had for it (as the journal file reads after a restart). Caught: the known
    peer dropped (after a restart the orphan could no longer be found by its socket)."""
    import dataclasses

    from autogpu_jupyter.brokerd.journal import Entry

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = broker(state_dir=str(state))
    assert b.restorer.journal is not None
    conn = person(b, 1001)
    lease(b, conn, "GPU-j0")
    rec = conn.record
    assert rec is not None
    known = replayed(state)[0][rec.lease_id]
    b.restorer.journal.add(Entry(rec.lease_id, known.uid, known.record, 4242, []))
    conn.record = dataclasses.replace(rec, pid=os.getpid() + 1)
    after = replayed(state)[0][rec.lease_id]
    assert (after.peer, json.loads(after.record)["pid"]) == (4242, os.getpid() + 1)


def test_a_new_state_directory_is_made_private_not_opened_then_closed(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The state directory is created 0700 (no moment where others may list or enter it):
    no chmod is needed afterwards. Caught: the mode dropped from its creation (the directory
    was 0755 until the chmod that followed)."""
    from autogpu_jupyter.brokerd.startup import check_state_dir

    chmods: list[Any] = []
    monkeypatch.setattr(os, "chmod", lambda *a, **k: chmods.append(a))
    old = os.umask(0o022)
    try:
        check_state_dir(str(tmp_path / "state"))
    finally:
        os.umask(old)
    assert chmods == []
    assert os.stat(tmp_path / "state").st_mode & 0o777 == 0o700


def test_main_says_whose_files_they_are_when_not_root_and_when_it_listens(
    monkeypatch: pytest.MonkeyPatch, caplog: Any, capsys: Any,
) -> None:
    """``autogpu broker --foreground`` not run as root warns once with its own uid, and says
    where it listens when ready. Caught: the uid replaced by ``None`` (the warning could not
    be formatted: the operator saw a logging traceback instead)."""
    import logging

    import autogpu_jupyter.broker as broker_mod

    async def serve(config: BrokerConfig, ready: Any) -> None:
        ready()

    monkeypatch.setattr(broker_mod, "serve", serve)
    monkeypatch.setattr(broker_mod.os, "geteuid", lambda: 1234)
    with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
        assert broker_mod.main(BrokerConfig(socket_path="/nonexistent/m.sock")) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "not running as root: users' identities are still checked, but the journal and "
        "socket belong to uid 1234"]
    assert capsys.readouterr().err.endswith(
        "autogpu broker: listening on /nonexistent/m.sock\n")


# ---- survivors of seed 54's sample (issue 22) ----


def test_the_booking_view_shows_the_exclusive_then_the_largest_bookings_and_folds_the_rest(
) -> None:
    """A pick's view of a device with more leases than :data:`VIEW_ROWS_PER_DEVICE`: the
    exclusive lease first, then the largest bookings; the smallest are folded into ``more``.
    Caught: the leases left in the order they were made (the biggest bookings folded away,
    the exclusive one last)."""
    from dataclasses import replace

    from autogpu_jupyter.core.leasing.brokerclient import VIEW_ROWS_PER_DEVICE

    gib = 1 << 30
    b = broker()
    n = VIEW_ROWS_PER_DEVICE + 2
    for i in range(n):  # the smallest booking oldest, the exclusive lease youngest
        conn = person(b, 2000 + i)
        conn.record = replace(ops_mod.make_record(b, conn, "lease", {
            "device_uuids": ["GPU-v"], "device_requested_bytes": [(i + 1) * gib],
            "exclusive": i == n - 1, "pid": 100 + i, "kernel_id": None,
            "notebook_path": f"n{i}.ipynb", "command": None, "holder_kind": "kernel",
        }), created_s=1000.0 + i)
    viewer = person(b, 1001)
    got = run(b.run_op("begin", viewer, {"op": "begin"}))
    b.lock.release(viewer)
    [device] = got["devices"]
    assert device["uuid"] == "GPU-v"
    assert [(row[0], row[1], row[2] // gib) for row in device["rows"]] == [
        (True, 100 + n - 1, n),
        *[(False, 100 + i, i + 1) for i in range(n - 2, 1, -1)],
    ]
    assert device["rows"][0][3:] == [f"user{2000 + n - 1}", f"n{n - 1}.ipynb"]
    assert device["more"] == {"leases": 2, "exclusive": False, "booked": 3 * gib}


@pytest.mark.parametrize("names", ["autogpu-broker.socket", None], ids=["named", "unnamed"])
def test_a_socket_systemd_passes_is_taken_once_and_its_variables_cleared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, names: str | None,
) -> None:
    """Socket activation: with ``LISTEN_PID`` naming this process and ``LISTEN_FDS=1`` the
    broker listens on descriptor 3 (what systemd bound), and clears the variables (its
    children inherit neither); systemd before v227 sets no ``LISTEN_FDNAMES``, and the socket
    is taken all the same. Caught: the ``LISTEN_PID`` variable misspelled (the passed socket
    ignored: the broker bound one of its own); the variables popped without a default (the
    missing ``LISTEN_FDNAMES`` raised KeyError and the broker stopped)."""
    import socket

    from autogpu_jupyter.broker import _inherited_socket

    path = str(tmp_path / "passed.sock")
    passed = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    passed.bind(path)
    passed.listen(1)
    try:
        saved = os.dup(3)
    except OSError:
        saved = None  # descriptor 3 not open in this process
    got: socket.socket | None = None
    try:
        os.dup2(passed.fileno(), 3)
        monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
        monkeypatch.setenv("LISTEN_FDS", "1")
        if names is None:
            monkeypatch.delenv("LISTEN_FDNAMES", raising=False)
        else:
            monkeypatch.setenv("LISTEN_FDNAMES", names)
        got = _inherited_socket()
        assert got is not None and got.fileno() == 3
        assert got.getsockname() == path
        assert [v for v in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES") if v in os.environ] == []
    finally:
        if got is not None:
            got.detach()  # descriptor 3 is put back below, not closed by the socket object
        if saved is None:
            os.close(3)
        else:
            os.dup2(saved, 3)
            os.close(saved)
        passed.close()


def test_a_rules_file_with_a_section_that_is_not_an_object_names_it(tmp_path: Any) -> None:
    """Caught: the message of the bad section dropped (the admin read ``None``)."""
    import json

    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"users": ["alice"]}))
    with pytest.raises(SystemExit) as err:
        BrokerConfig(socket_path="/nonexistent/b.sock").load_rules(str(path))
    assert str(err.value).startswith(
        f"autogpu broker: rules file {path}: users: expected an object, got list; expected e.g. ")


# ---- survivors of the broker's full run (issue 22): the admin's rules file ----

_RULES_EXAMPLE = (
    '; expected e.g. {"max_devices_per_user": 2, "users": {"alice": 4}, "groups": '
    '{"students": 1}, "reserved": {"GPU-...": ["ml"]}}')


def load_rules(tmp_path: Any, doc: Any) -> BrokerConfig:
    import json

    path = tmp_path / "rules.json"
    path.write_text(json.dumps(doc))
    config = BrokerConfig(socket_path="/nonexistent/b.sock")
    config.load_rules(str(path))
    return config


def test_every_section_of_a_rules_file_becomes_the_brokers_rule(tmp_path: Any) -> None:
    """Caught: a section's name misspelled in the known keys or where it is read (a valid
    file refused, or a section silently ignored: groups without their limit, reserved GPUs
    open to all, the unknown uids' bucket at its default), a limit's value or name dropped,
    and the reserved groups' check turned around (a valid list refused)."""
    config = load_rules(tmp_path, {
        "max_devices_per_user": 2, "max_leases_per_user": 3, "max_tickets_per_user": 4,
        "users": {"alice": 5}, "groups": {"students": 1, "staff": 0},
        "reserved": {"GPU-a": ["ml"], "GPU-b": ["ml", "vision"]},
        "unknown_uids": {"max_devices": 0, "max_connections": 7},
    })
    assert (config.max_devices_per_user, config.max_leases_per_user,
            config.max_tickets_per_user) == (2, 3, 4)
    assert config.user_limits == {"alice": 5}
    assert config.group_limits == {"students": 1, "staff": 0}
    assert config.reserved == {"GPU-a": ["ml"], "GPU-b": ["ml", "vision"]}
    assert (config.unknown_max_devices, config.unknown_max_connections) == (0, 7)
    # each bucket key alone is read too (not only when both are there)
    assert load_rules(tmp_path, {"unknown_uids": {"max_devices": 3}}).unknown_max_devices == 3
    only = load_rules(tmp_path, {"unknown_uids": {"max_connections": 9}})
    assert (only.unknown_max_devices, only.unknown_max_connections) == (1, 9)


@pytest.mark.parametrize(("doc", "why"), [
    (["alice"], "expected a JSON object"),
    ({"max_devices_per_user": 1, "max_gpus": 2}, "unknown key 'max_gpus'"),
    ({"unknown_uids": {"max_gpus": 1}}, "unknown_uids: unknown key 'max_gpus'"),
    ({"reserved": {"GPU-a": "ml"}},
     "reserved 'GPU-a': expected a list of group names, got \"ml\""),
    ({"reserved": {"GPU-a": []}}, "reserved 'GPU-a': expected a list of group names, got []"),
    ({"reserved": {"GPU-a": ["ml", ""]}},
     "reserved 'GPU-a': expected a list of group names, got [\"ml\", \"\"]"),
    ({"reserved": {"GPU-a": [7]}}, "reserved 'GPU-a': expected a list of group names, got [7]"),
    ({"reserved": {"G" * 100: None}},
     f"reserved {'G' * 80!r}: expected a list of group names, got null"),
])
def test_a_bad_rules_file_is_one_message_naming_the_bad_entry(
    tmp_path: Any, doc: Any, why: str
) -> None:
    """Caught: a message dropped or reworded (the admin read ``None``), the unknown key's
    check dropped (a typo silently ignored), the reserved groups' check loosened (a string,
    an empty list, an empty or non-text group name taken: a GPU reserved to nobody or to the
    letters of a name), and the reserved id not cut to 80 characters."""
    with pytest.raises(SystemExit) as err:
        load_rules(tmp_path, doc)
    assert str(err.value) == f"autogpu broker: rules file {tmp_path / 'rules.json'}: {why}" + (
        _RULES_EXAMPLE)


def test_a_rules_file_is_read_as_utf8_whatever_the_locale(tmp_path: Any) -> None:
    """A group's or user's name may be non-ASCII. Caught: the file opened in the locale's
    encoding (under LC_ALL=C the broker refused the admin's file)."""
    import json
    import sys

    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"users": {"zoë": 2}}, ensure_ascii=False), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LC_") and k != "LANG"}
    env.update(LC_ALL="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    code = ("import sys; from autogpu_jupyter.broker import BrokerConfig; c = BrokerConfig(); "
            "c.load_rules(sys.argv[1]); print(ascii(c.user_limits))")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, env=env, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert (res.returncode, res.stdout, res.stderr) == (0, "{'zo\\xeb': 2}\n", "")


@pytest.mark.parametrize(("fleet", "missing", "shown"), [
    ({"GPU-a", "GPU-c", "GPU-b"}, "GPU-typo", "GPU-a, GPU-b, GPU-c"), (set(), "GPU-a", "none"),
])
def test_a_reserved_id_that_is_not_a_device_of_the_host_is_refused_naming_the_devices(
    fleet: set[str], missing: str, shown: str
) -> None:
    """Caught: the check turned around (a valid reservation refused, a typo passed), the
    message dropped, and the host's devices listed wrongly or as 'none' when it has some."""
    config = BrokerConfig(socket_path="/nonexistent/b.sock",
                          reserved={"GPU-z": ["ml"], "GPU-typo": ["ml"], "GPU-a": ["ml"]})
    with pytest.raises(SystemExit) as err:
        config.check_reserved(fleet)
    assert str(err.value) == (
        f"autogpu broker: reserved device {missing!r} is not a device of this host (its "
        f"devices: {shown}): fix the rules file")
    BrokerConfig(reserved={"GPU-b": ["ml"]}).check_reserved({"GPU-a", "GPU-b"})  # all there
    config.check_reserved(None)  # the fleet unknown: nothing to check against


def test_a_lease_on_a_device_this_host_does_not_have_is_a_usage_error_naming_it() -> None:
    """Caught: the refusal's kind dropped (the client raised a broker failure, not the usage
    error a mistyped id is)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker()
    b.fleet.backend = SimulatedBackend("demo-4x")
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", conn, {"op": "lease", "devices": ["gpu-made-up"]}))
    fleet = ", ".join(sorted(d.uuid for d in b.book.snap.devices))
    assert str(err.value) == f"'gpu-made-up' is not a device of this host (its devices: {fleet})"
    assert err.value.kind == "UsageErrorBase"
    assert conn.record is None


def test_a_waiter_gone_just_as_the_lock_frees_is_passed_over_for_the_next_one() -> None:
    """A waiter whose task was cancelled (its client went away) while its connection's ending
    has not run yet, when the holder ends: the lock goes to the next waiter, and the holder's
    end is answered. Caught: the cancelled waiter given the lock (its future set twice: the
    holder's end raised, and the lock stayed with a connection that is gone)."""
    b = broker()
    holder, gone, third = person(b, 1001), person(b, 1002), person(b, 1003)

    async def go() -> None:
        await b.run_op("begin", holder, {"op": "begin"})
        waiting = asyncio.create_task(b.run_op("begin", gone, {"op": "begin"}))
        nxt = asyncio.create_task(b.run_op("begin", third, {"op": "begin"}))
        await asyncio.sleep(0)
        assert list(b.lock.waiting) == [gone, third]
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert await b.run_op("end", holder, {"op": "end"}) == {"ok": True}  # before gone's ending
        await asyncio.wait_for(nxt, 5)
        assert b.lock.lock_holder is third and list(b.lock.waiting) == []
        b.lock.release(gone)
        b.lock.release(third)

    run(go())


def test_a_lease_of_a_subordinate_uid_counts_against_its_owners_device_limit() -> None:
    """A lease held through a subordinate uid of alice's counts as hers: with one device per
    user, alice's own second lease is refused. Caught: the copy marked with no person (the
    subordinate uid's lease counted for nobody, and alice held two devices)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker(max_devices_per_user=1)
    b.fleet.backend = SimulatedBackend("demo-4x")
    b.fleet.snapshot()
    first, second = sorted(d.uuid for d in b.book.snap.devices)[:2]
    sub = Conn(b, 200000, 200000, os.getpid(),
               Account(1001, "alice", frozenset(), via="subordinate uid 200000 of alice"))
    b.connections.conns.add(sub)
    alice = person(b, 1001, name="alice")
    run(b.run_op("lease", sub, {"op": "lease", "devices": [first]}))
    assert sub.record is not None and sub.record.uid == 200000
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", alice, {"op": "lease", "devices": [second]}))
    assert str(err.value).startswith(
        f"alice already holds leases on 1 device(s) ({first}); taking 1 more would exceed "
        "max_devices_per_user = 1 set by the admin")
    assert err.value.kind == "LeaseLimitError" and alice.record is None


def test_the_status_counts_every_device_of_a_persons_leases() -> None:
    """Caught: a person's devices set to the last lease's count, not summed (two leases, of
    two devices and one, showed only the last one's)."""
    b = broker()
    one, two, other = person(b, 1001), person(b, 1001), person(b, 1002)
    one.record = ops_mod.make_record(b, one, "lease", {
        "device_uuids": ["GPU-s0", "GPU-s1"], "device_requested_bytes": [None, None],
        "exclusive": False, "pid": one.pid, "kernel_id": None, "notebook_path": None,
        "command": None, "holder_kind": "process",
    })
    lease(b, two, "GPU-s2")
    lease(b, other, "GPU-s3")
    got = run(b.run_op("status", one, {"op": "status"}))
    assert got["per_user"] == {
        "user1001": {"leases": 2, "devices": 3, "tickets": 0},
        "user1002": {"leases": 1, "devices": 1, "tickets": 0},
    }
    assert (got["leases_total"], got["tickets_total"]) == (3, 0)


def test_the_state_a_pick_decides_on_has_the_tickets_that_reserve_in_line_order() -> None:
    """The pick's state lists live tickets that reserve devices (dormant ones do not: one
    taken while a device is free for it). Caught: the reserving check asked of no ticket (any
    live ticket broke the pick)."""
    from autogpu_jupyter.brokerd.views import StateView
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker()
    picker, waiter, sleeper = person(b, 1001), person(b, 1002), person(b, 1003)
    waiter.record = ticket_record(b, waiter)  # no snapshot yet: it reserves
    b.fleet.backend = SimulatedBackend("demo-4x")
    b.fleet.snapshot()
    sleeper.record = ticket_record(b, sleeper)  # three devices free behind the waiter
    assert b.book.dormant_tickets() == {sleeper.record.lease_id}
    leases, tickets = StateView(b.book, picker).live_records()
    assert leases == [] and [t.lease_id for t in tickets] == [waiter.record.lease_id]


def test_a_lease_is_shared_unless_asked_and_an_exclusive_one_needs_a_device_nobody_holds() -> None:
    """A lease that does not say ``exclusive`` is shared: a second person leases the same
    device; an exclusive lease on a device someone holds is refused naming the holders.
    Caught: a lease exclusive by default (the second person was refused); the exclusive wish
    not handed to the admission (the exclusive lease was granted beside the others)."""
    b, (dev, _, _, _) = simulated_broker()
    alice, bob, carol = person(b, 1001), person(b, 1002), person(b, 1003)
    run(b.run_op("lease", alice, {"op": "lease", "devices": [dev]}))
    run(b.run_op("lease", bob, {"op": "lease", "devices": [dev]}))
    assert alice.record is not None and alice.record.exclusive is False
    assert bob.record is not None and bob.record.exclusive is False
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", carol, {"op": "lease", "devices": [dev], "exclusive": True}))
    assert str(err.value) == (f"no device free: exclusive wanted but {dev} is held by "
                              f"user1001: pid {alice.pid}, user1002: pid {bob.pid}")
    assert err.value.kind == "NoDeviceFitsError" and carol.record is None


def test_a_persons_leases_stop_at_the_admins_max_leases_per_user() -> None:
    """Caught: the broker's quota built without ``max_leases_per_user`` (no lease limit)."""
    b, (first, second, _, _) = simulated_broker(max_leases_per_user=1)
    one, two = person(b, 1001), person(b, 1001)
    run(b.run_op("lease", one, {"op": "lease", "devices": [first]}))
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", two, {"op": "lease", "devices": [second]}))
    assert str(err.value).startswith(
        "user1001 already holds 1 lease(s); another would exceed max_leases_per_user = 1 set "
        "by the admin (enforced by the broker).")
    assert err.value.kind == "LeaseLimitError" and two.record is None


def test_a_subordinate_uid_asking_counts_the_leases_of_its_owner() -> None:
    """A second connection of alice's subordinate uid is refused a device past alice's limit
    of one, which the first one holds. Caught: the applicant built without its person (the
    subordinate uid counted only leases whose uid is its own, none after the marking)."""
    b, (first, second, _, _) = simulated_broker(max_devices_per_user=1)

    def sub() -> Conn:
        conn = Conn(b, 200000, 200000, os.getpid(),
                    Account(1001, "alice", frozenset(), via="subordinate uid 200000 of alice"))
        b.connections.conns.add(conn)
        return conn

    one, two = sub(), sub()
    run(b.run_op("lease", one, {"op": "lease", "devices": [first]}))
    with pytest.raises(BrokerRefusal, match=r"^alice already holds leases on 1 device\(s\)"):
        run(b.run_op("lease", two, {"op": "lease", "devices": [second]}))
    assert two.record is None


@pytest.mark.parametrize("devices", [[], "GPU-0", None, {"GPU-0": 1}])
def test_a_lease_whose_devices_are_not_a_non_empty_list_is_a_usage_error(devices: Any) -> None:
    """Caught: ``and`` for ``or`` between the checks (an empty list or a string went on to
    the record)."""
    b, _ = simulated_broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal, match=r"^devices: expected a list of device UUIDs$") as e:
        run(b.run_op("lease", conn, {"op": "lease", "devices": devices}))
    assert e.value.kind == "UsageErrorBase" and conn.record is None


def test_a_lease_may_name_as_many_devices_as_the_id_list_holds_and_not_one_more() -> None:
    """Caught: the bound taken as ``>=`` (a lease of exactly ``MAX_ID_LIST`` was refused)."""
    from autogpu_jupyter.core.leasing.records import MAX_ID_LIST

    b = broker()
    ids = [f"GPU-{i:04d}" for i in range(MAX_ID_LIST + 1)]
    b.fleet.ids = set(ids)
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal, match=r"^devices: expected a list of device UUIDs$"):
        run(b.run_op("lease", conn, {"op": "lease", "devices": ids}))
    run(b.run_op("lease", conn, {"op": "lease", "devices": ids[:MAX_ID_LIST]}))
    assert conn.record is not None and list(conn.record.device_uuids) == ids[:MAX_ID_LIST]


def test_a_holder_that_never_let_the_lock_time_out_keeps_the_whole_timeout_while_others_wait(
) -> None:
    """The short slice is only for a person who let the lock time out lately: a lock handed on
    to a person who never did, while a third person still waits, runs the whole
    ``lock_timeout_s``. Caught: ``and`` made ``or`` (every lock given while someone else waited
    was cut to a slice)."""
    b = broker(lock_timeout_s=30.0)
    alice, bob, carol = person(b, 1001), person(b, 1002), person(b, 1003)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        await b.run_op("begin", alice, {"op": "begin"})
        bobs = asyncio.create_task(b.run_op("begin", bob, {"op": "begin"}))
        carols = asyncio.create_task(b.run_op("begin", carol, {"op": "begin"}))
        await asyncio.sleep(0)
        assert alice.lock_handle is not None
        assert alice.lock_handle.when() - loop.time() > 20
        await b.run_op("end", alice, {"op": "end"})
        await asyncio.wait_for(bobs, 5)
        assert b.lock.lock_holder is bob and list(b.lock.waiting) == [carol]
        assert bob.lock_handle is not None
        assert bob.lock_handle.when() - loop.time() > 20
        b.lock.release(bob)
        await asyncio.wait_for(carols, 5)
        b.lock.release(carol)

    run(go())


def test_a_device_reserved_for_a_group_is_leased_by_its_members_and_root_only() -> None:
    """A lease on a device the admin reserved for group ``ml``: refused to a user outside it in
    the admission's words, granted to a member and to root. Caught: the lease checked without
    the reservations (anyone took a reserved device); the applicant's uid dropped (root, whose
    exemption follows the uid, was refused)."""
    b = broker(reserved={"GPU-rz1": ["ml"]})
    b.fleet.ids = {"GPU-rz1"}
    outsider = person(b, 1001, name="olga")
    member = person(b, 1002, name="mia", groups=frozenset({"ml"}))
    root = person(b, 0, name="root")
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", outsider, {"op": "lease", "devices": ["GPU-rz1"]}))
    assert (str(err.value), err.value.kind) == (
        "no device free: GPU-rz1 is reserved for group(s) ml by the admin", "NoDeviceFitsError")
    assert outsider.record is None
    run(b.run_op("lease", member, {"op": "lease", "devices": ["GPU-rz1"]}))
    assert member.record is not None
    member.record = None
    run(b.run_op("lease", root, {"op": "lease", "devices": ["GPU-rz1"]}))
    assert root.record is not None and root.record.device_uuids == ("GPU-rz1",)


@pytest.mark.parametrize("record_commands", [False, True])
def test_a_holders_command_line_is_recorded_only_when_the_admin_says_so(
    record_commands: bool,
) -> None:
    """``record_commands`` off (the default): a lease keeps no command line, whatever the client
    sends. Caught: the setting ignored (every user's command line, tokens and all, was kept
    and shown)."""
    b = broker(record_commands=record_commands)
    b.fleet.ids = {"GPU-cm1"}
    conn = person(b, 1001)
    msg = {"op": "lease", "devices": ["GPU-cm1"],
           "holder": {"kind": "process", "command": "python train.py --token=s3cret"}}
    run(b.run_op("lease", conn, msg))
    assert conn.record is not None
    assert conn.record.command == ("python train.py --token=s3cret" if record_commands else None)


def test_a_connection_that_ends_ends_its_lease_and_gives_its_person_one_place_back(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two connections of one person (``max_connections_per_user = 2``), the first holding a
    lease: when it ends, its lease leaves the live state and the journal (a restarted broker
    must not take it back), and its person may open one connection more, not two. Caught:
    the count lowered by 2 or dropped while 1 was left (a person went past the limit); the
    record left set, or set to something other than none (the lease stayed in the journal)."""
    import socket


    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = broker(state_dir=str(state), max_connections_per_user=2)
    assert b.restorer.journal is not None
    acct = Account(1001, "alice", frozenset())
    monkeypatch.setattr(conn_mod, "peer_credentials", lambda sock: (os.getpid(), 1001, 1001))
    monkeypatch.setattr(b.accounts, "account", lambda uid: acct)

    async def go() -> None:
        pairs = [socket.socketpair() for _ in range(2)]
        for ours, _ in pairs:
            b.accepted(ours)
        first = next(c for c in b.connections.conns if c.writer.sock is pairs[0][0])
        lease(b, first, "GPU-e1")
        assert first.record is not None
        lease_id = first.record.lease_id
        assert list(replayed(state)[0]) == [lease_id]
        pairs[0][1].close()
        for _ in range(200):
            if len(b.connections.conns) == 1:
                break
            await asyncio.sleep(0.01)
        assert dict(b.connections.per_key) == {1001: 1}
        assert b.connections.refusal(1001, acct) is None  # one more
        assert (first.record, b.book.live(), replayed(state)[0]) == (None, [], {})
        b.connections.per_key[1001] += 1
        assert b.connections.refusal(1001, acct) is not None  # not two
        b.connections.per_key[1001] -= 1
        pairs[1][1].close()
        for _ in range(200):
            if not b.connections.conns:
                break
            await asyncio.sleep(0.01)

    run(go())
    assert dict(b.connections.per_key) == {}


def test_a_restarted_broker_takes_back_what_is_still_held_and_drops_the_rest(
    tmp_path: Any, caplog: Any,
) -> None:
    """A broker restarted over a journal of four entries: one that is no record (skipped,
    logged, dropped), one whose holder is gone (dropped), one whose recorded holder runs and
    one whose socket this process still holds though its recorded holder is gone (both taken
    back as orphans of their person, live, with the holders found, journaled). Then the
    socket is closed: the next reaper round frees that one and keeps the other. Caught: an
    entry skipped or dropped by ``break`` (the entries behind it were lost), the skipped or
    dropped entry left in the journal, the skip's log line changed or without its reason, the
    socket's holders not looked up (or looked up for entries without a socket), the orphan's
    uid, holders or socket dropped, the record taken back as not live, the holders found not
    journaled, the count logged wrong or its line changed."""
    import logging
    import socket

    from autogpu_jupyter.brokerd import journal as jrnl
    from autogpu_jupyter.brokerd.journal import Entry
    from autogpu_jupyter.core.leasing.records import encode

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    first = broker(state_dir=str(state))
    assert first.restorer.journal is not None
    uid = os.getuid()
    me, gone = jrnl.proc_ids(os.getpid()), [(os.getpid(), -1)]
    assert me
    owner = person(first, uid)
    dead, by_pid, by_socket = (lease_record(first, owner, f"GPU-k{n}") for n in range(3))
    ours, theirs = socket.socketpair()
    try:
        inode = os.fstat(theirs.fileno()).st_ino  # held by this process only
        j = first.restorer.journal
        j.add(Entry("f" * 32, uid, '{"kind": "lease"}', None, me))
        j.add(Entry(dead.lease_id, uid, encode(dead).decode(), None, gone))
        j.add(Entry(by_pid.lease_id, uid, encode(by_pid).decode(), None, me))
        j.add(Entry(by_socket.lease_id, uid, encode(by_socket).decode(), inode, gone))
        caplog.set_level(logging.INFO, logger="autogpu.broker")
        second = broker(state_dir=str(state))
        assert second.restorer.journal is not None
        assert [r.getMessage() for r in caplog.records] == [
            "journal entry skipped: missing keys ['created_s', 'device_requested_bytes', "
            "'device_uuids', 'exclusive', 'holder_kind', 'host', 'lease_id', 'pid', 'uid', "
            "'user', 'version']",
            "restart: 2 lease(s)/ticket(s) taken back from the journal",
        ]
        key = second.accounts.account(uid).key
        # The holders of a socket whose recorded ones are gone are found off the loop, by the
        # reaper's first round (one scan of /proc), not while the journal is read.
        got = {i: (o.uid, o.key, o.peer, o.holder_pids, o.record)
               for i, o in second.book.orphans.items()}
        assert got == {
            by_pid.lease_id: (uid, key, None, me, by_pid),
            by_socket.lease_id: (uid, key, inode, [], by_socket),
        }
        assert {i: e.pids for i, e in replayed(state)[0].items()} == {
            by_pid.lease_id: me, by_socket.lease_id: []}

        async def settle() -> None:
            await second.restorer.settle(asyncio.get_running_loop())

        run(settle())
        assert {i: o.holder_pids for i, o in second.book.orphans.items()} == {
            by_pid.lease_id: me, by_socket.lease_id: me}
        assert all(o.record.live and o.record.path == f"broker:{i}"
                   for i, o in second.book.orphans.items())
        assert {i: e.pids for i, e in replayed(state)[0].items()} == {
            by_pid.lease_id: me, by_socket.lease_id: me}
    finally:
        ours.close()
        theirs.close()

    async def reap() -> None:
        await second.restorer.reap(asyncio.get_running_loop())

    run(reap())
    assert live_ids(second) == {by_pid.lease_id}
    assert list(replayed(state)[0]) == [by_pid.lease_id]


@pytest.mark.parametrize("leased", ["after", "at"])
def test_leaving_a_servable_ticket_after_taking_a_lease_since_bars_nobody(
    monkeypatch: pytest.MonkeyPatch, leased: str,
) -> None:
    """A person whose ticket could be served took a lease since (on another connection, at
    the moment it could or after): leaving the ticket then is no place left, no bar. Caught:
    the lease's time looked up under no person, compared with ``<=``, or never kept (for a
    record of no kind, of a misspelled kind, or kept as none)."""
    import time
    import types

    from autogpu_jupyter.brokerd import book as book_mod

    now = [1000.0]  # the book's clock, moved by hand
    monkeypatch.setattr(book_mod, "time", types.SimpleNamespace(
        monotonic=lambda: now[0], time=time.time))
    b = broker(ticket_grace_s=100.0)
    waiter, picker = person(b, 1001), person(b, 1001)
    waiter.record = ticket_record(b, waiter)
    assert waiter.record is not None
    found_servable(b)  # it could be served from 1000 on
    assert b.book.servable_times() == {waiter.record.lease_id: 1000.0}
    if leased == "after":
        now[0] = 1001.0
    lease(b, picker, "GPU-lb1")  # the person took a lease
    waiter.record = None  # then left the ticket
    assert b.book.bars() == {} and b.book.servable_times() == {}


def test_a_ticket_taken_while_a_device_is_free_reserves_nothing_and_is_forgotten_when_it_ends(
) -> None:
    """A ticket that joins the line while a device is free for it is dormant: another user's
    pick does not see it reserve anything; when it ends, the broker keeps nothing of it.
    Caught: the dormant ticket's id not kept (it reserved a device at once), or not let go
    when it ended (the broker held every such id for good)."""
    from autogpu_jupyter.brokerd.views import StateView
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    b = broker()
    b.fleet.backend = SimulatedBackend("demo-4x")
    b.fleet.snapshot()
    waiter, picker = person(b, 1001), person(b, 1002)
    waiter.record = ticket_record(b, waiter)
    assert StateView(b.book, picker).live_records() == ([], [])
    assert b.book.dormant_tickets() == {waiter.record.lease_id}
    waiter.record = None
    assert (b.book.dormant_tickets(), b.book.servable_times()) == (set(), {})


def test_a_grant_journals_its_socket_its_holder_and_its_ticket_number_and_set_pid_its_new_holder(
    tmp_path: Any,
) -> None:
    """What a restarted broker needs to take a lease or ticket back is in the journal: the
    client's end of the socket, the connecting process (pid and start time) as its holder, a
    ticket's number (the next broker goes on from it); after ``set_pid``, the process named.
    Caught: the socket or the holders left out of the entry, read for no process, the ticket
    number not journaled; after ``set_pid`` the holders dropped, kept as before, or read for
    no process."""
    import socket
    import subprocess

    from autogpu_jupyter.brokerd import journal as jrnl
    from autogpu_jupyter.brokerd import net

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = broker(state_dir=str(state))
    assert b.restorer.journal is not None
    b.fleet.ids = {"GPU-jn1"}
    me = jrnl.proc_ids(os.getpid())
    assert me
    holder, waiter = person(b, os.getuid()), person(b, os.getuid())

    async def go(child: int, pairs: list[tuple[socket.socket, socket.socket]]) -> None:
        for conn, (ours, _) in zip((holder, waiter), pairs):
            conn.writer = net.Channel(ours, 1 << 20, lambda: None)
        await b.run_op("lease", holder, {"op": "lease", "devices": ["GPU-jn1"]})
        await b.run_op("ticket", waiter, {"op": "ticket", "constraints": {
            "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
            "exclude": [], "exclusive": False, "allowed_uuids": None}})
        assert holder.record is not None and waiter.record is not None
        entries, seq = replayed(state)
        for conn, (_, theirs) in zip((holder, waiter), pairs):
            e = entries[conn.record.lease_id]  # type: ignore[union-attr]
            assert (e.peer, e.pids) == (os.fstat(theirs.fileno()).st_ino, me)
        assert waiter.record.seq == 1
        assert seq == 1
        await b.run_op("set_pid", holder, {"op": "set_pid", "pid": child})
        assert replayed(state)[0][holder.record.lease_id].pids == jrnl.proc_ids(child)
        for conn in (holder, waiter):
            conn.writer.shut()

    child = subprocess.Popen(["sleep", "30"])
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        run(go(child.pid, pairs))
    finally:
        child.kill()
        child.wait()
        for ours, theirs in pairs:
            ours.close()
            theirs.close()


def test_a_subordinate_uids_lease_counts_its_owners_leases_against_the_limit() -> None:
    """alice holds her one device; a lease asked through a subordinate uid of hers is hers
    too, and refused. Caught: the applicant asked with no person of its own (the subordinate
    uid counted only its own leases, and alice held two devices)."""
    b = broker(max_devices_per_user=1)
    b.fleet.ids = {"GPU-sub0", "GPU-sub1"}
    alice = person(b, 1001, name="alice")
    sub = Conn(b, 200000, 200000, os.getpid(),
               Account(1001, "alice", frozenset(), via="subordinate uid 200000 of alice"))
    b.connections.conns.add(sub)
    run(b.run_op("lease", alice, {"op": "lease", "devices": ["GPU-sub0"]}))
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", sub, {"op": "lease", "devices": ["GPU-sub1"]}))
    assert str(err.value).startswith(
        "alice already holds leases on 1 device(s) (GPU-sub0); taking 1 more would exceed "
        "max_devices_per_user = 1 set by the admin (enforced by the broker)")
    assert err.value.kind == "LeaseLimitError" and sub.record is None


def test_a_lease_on_a_device_reserved_for_a_group_goes_only_to_its_members() -> None:
    """Caught: the reservations left out of the lease's admission (anyone leased a device the
    admin reserved for the ml group)."""
    b = broker(reserved={"GPU-rs0": ["ml"]})
    b.fleet.ids = {"GPU-rs0"}
    outsider = person(b, 1001)
    member = person(b, 1002, groups=frozenset({"ml"}))
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", outsider, {"op": "lease", "devices": ["GPU-rs0"]}))
    assert "reserved for group(s) ml by the admin" in str(err.value)
    assert outsider.record is None
    run(b.run_op("lease", member, {"op": "lease", "devices": ["GPU-rs0"]}))
    assert member.record is not None and member.record.device_uuids == ("GPU-rs0",)


def test_a_users_own_device_limit_is_named_in_the_refusal() -> None:
    """Caught: the limit's source left out of the quota (the refusal did not say the limit
    was alice's own, and she looked for it among the general settings)."""
    b = broker(user_limits={"alice": 1}, max_devices_per_user=5)
    b.fleet.ids = {"GPU-ul0", "GPU-ul1"}
    alice, again = person(b, 1001, name="alice"), person(b, 1001, name="alice")
    run(b.run_op("lease", alice, {"op": "lease", "devices": ["GPU-ul0"]}))
    with pytest.raises(BrokerRefusal) as err:
        run(b.run_op("lease", again, {"op": "lease", "devices": ["GPU-ul1"]}))
    assert ("would exceed max_devices_per_user = 1 set by the admin for alice (enforced by "
            "the broker)") in str(err.value)


def test_a_repick_that_names_its_orphaned_lease_ends_it() -> None:
    """A lease taken back from the journal after a restart and named by a re-pick is ended
    with the new lease granted. Caught: the orphan not forgotten (the person held the old
    lease and the new one)."""
    b = broker()
    b.fleet.ids = {"GPU-or0", "GPU-or1"}
    alice = person(b, 1001)
    lease(b, alice, "GPU-or0")
    rec = alice.record
    assert rec is not None
    alice.record = None
    b.book.adopt(Orphan(1001, rec, [], key=1001))
    again = person(b, 1001)
    run(b.run_op("lease", again,
                 {"op": "lease", "devices": ["GPU-or1"], "ignore_ids": [rec.lease_id]}))
    assert rec.lease_id not in live_ids(b)
    assert [r.device_uuids for _, r in b.book.live()] == [("GPU-or1",)]


def test_a_repicks_ids_that_are_not_a_list_replace_nothing() -> None:
    """Caught: ids of the wrong type made None (the lease failed with a TypeError)."""
    b = broker()
    alice = person(b, 1001)
    lease(b, alice, "GPU-nl0")
    assert b.book.replaced(person(b, 1001), {"ignore_ids": "GPU-nl0"}) == set()


def test_an_unknown_uids_device_limit_says_it_is_for_uids_without_a_passwd_entry() -> None:
    """Caught: the limit's source text changed."""
    from autogpu_jupyter.brokerd.identity import UNKNOWN_KEY

    b = broker(unknown_max_devices=1)
    conn = Conn(b, 77777, 77777, os.getpid(),
                Account(UNKNOWN_KEY, "unknown uids", frozenset(), "uid 77777 (no passwd entry)"))
    assert b.book.limit_for(conn) == (1, " for uids without a passwd entry")


def test_a_leases_journal_line_names_the_peer_socket_of_its_connection(tmp_path: Any) -> None:
    """The journal keeps the inode of the client's end of the socket (after a restart an
    orphan is held while some process holds that socket). Caught: the peer read only without
    a journal (every journaled lease had no peer, and was ended by a restart)."""
    import json
    import socket

    from autogpu_jupyter.brokerd import net

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = broker(state_dir=str(state))
    b.fleet.ids = {"GPU-pi0"}

    async def main() -> None:
        conn = person(b, 1001)
        conn.writer = net.Channel(ours, 1 << 20, lambda: None)
        await b.run_op("lease", conn, {"op": "lease", "devices": ["GPU-pi0"]})
        conn.writer.shut()

    ours, theirs = socket.socketpair()
    try:
        run(main())
        peer = os.fstat(theirs.fileno()).st_ino
    finally:
        ours.close()
        theirs.close()
    journal = (state / "journal.log").read_text().splitlines()
    [add] = [json.loads(x) for x in journal if '"add"' in x]
    assert add["peer"] == peer


def test_a_connection_whose_loop_fails_under_it_ends_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncio raises RuntimeError on a socket whose loop is closing: the connection ends
    like one lost on the way. Caught: only OSError kept quiet (the task died with an error)."""
    b = broker()
    conn = person(b, 1001)

    async def failing(_conn: Conn) -> None:
        raise RuntimeError("Event loop is closed")

    monkeypatch.setattr(b.connections, "serve", failing)
    assert run(b.connections.run(conn)) is None


def test_the_status_ranks_the_busiest_people_first_and_sums_the_rest_in_one_row(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """Past ``_STATUS_USERS`` people the status keeps the busiest (leases, devices and tickets
    summed; a tie by name) and folds the others into one "(N more users)" row; every other
    count of the answer under its own key. Caught: the ranking reversed or by name, the
    tie compared by counts, the folded row not summed (or not starting at zero), tickets
    miscounted, the answer's keys misspelled, the journal's size left out, the uptime summed."""
    import time

    from autogpu_jupyter import __version__

    monkeypatch.setattr(ops_mod, "_STATUS_USERS", 2)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    b = broker(state_dir=str(state))
    assert b.restorer.journal is not None
    p1, p2, p3, p4 = (person(b, uid) for uid in (1001, 1002, 1003, 1004))
    p5 = [person(b, 1005) for _ in range(3)]
    p1.record = ticket_record(b, p1)
    lease(b, p2, "GPU-st2")
    lease(b, p3, "GPU-st3")
    p4.record = ticket_record(b, p4)
    p5[0].record = ops_mod.make_record(b, p5[0], "lease", {
        "device_uuids": ["GPU-st50", "GPU-st51"], "device_requested_bytes": [None, None],
        "exclusive": False, "pid": p5[0].pid, "kernel_id": None, "notebook_path": None,
        "command": None, "holder_kind": "process",
    })
    p5[1].record = ticket_record(b, p5[1])
    p5[2].record = ticket_record(b, p5[2])
    b.lock.waiting.append(p1)
    b.book.lapsed = 3
    before = time.time()
    got = run(b.run_op("status", p1, {"op": "status"}))
    after = time.time()
    assert before - b.started <= got.pop("uptime_s") <= after - b.started
    assert got == {
        "ok": True,
        "leases_total": 3,
        "tickets_total": 4,
        "per_user": {
            "user1005": {"leases": 1, "devices": 2, "tickets": 2},
            "user1002": {"leases": 1, "devices": 1, "tickets": 0},
            "(3 more users)": {"leases": 1, "devices": 1, "tickets": 2},
        },
        "orphans": 0,
        "connections": 7,
        "max_connections": b.connections.conn_cap,
        "waiting_for_lock": 1,
        "max_devices_per_user": b.config.max_devices_per_user,
        "tickets_lapsed": 3,
        "messages_paced": 0,
        "journal_bytes": b.restorer.journal.size_bytes,
        "pid": os.getpid(),
        "version": __version__,
    }
    assert got["journal_bytes"] > 0


def test_the_status_folds_no_one_at_exactly_its_most_people() -> None:
    """Caught: the fold made at ``_STATUS_USERS`` people already (an empty "(0 more users)"
    row)."""

    b = broker()
    for i in range(ops_mod._STATUS_USERS):
        lease(b, person(b, 1001 + i), f"GPU-f{i}")
    got = run(b.run_op("status", person(b, 0, name="root"), {"op": "status"}))
    assert len(got["per_user"]) == ops_mod._STATUS_USERS
    assert not any(name.endswith("more users)") for name in got["per_user"])


def test_the_status_names_a_record_without_a_user_by_its_account() -> None:
    """A journal may hold a record with an empty user name: its row is named by the account's
    number. Caught: the account number lost (the row was named "None")."""
    from dataclasses import replace

    b = broker()
    alice = person(b, 1001)
    rec = replace(lease_record(b, alice, "GPU-nu0"), user="")
    b.book.adopt(Orphan(1001, rec, [], key=1001))
    got = run(b.run_op("status", alice, {"op": "status"}))
    assert got["per_user"] == {"1001": {"leases": 1, "devices": 1, "tickets": 0}}


# ---- survivors of the broker's full run (issue 22) ----


class Clock:
    """``time.monotonic`` of the broker module, moved by hand."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
        import autogpu_jupyter.broker as broker_mod

        self.now = now
        monkeypatch.setattr(broker_mod.time, "monotonic", lambda: self.now)


def refusal(b: Broker, conn: Conn) -> tuple[str, str] | None:
    """What ``conn`` joining the waiting line now is refused with (``None``: it may join)."""
    try:
        b.book.may_join(conn)
    except BrokerRefusal as err:
        return str(err), err.kind
    return None


def test_a_person_joins_the_line_a_burst_of_times_then_at_the_ticket_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight tickets at once, then two a second, per person; another person has a burst of
    their own and root is not counted. Caught: the bucket shared by everyone, not refilled,
    refilled too slowly or too fast, a join costing nothing or two, the refusal's words,
    kind or seconds changed, and root limited."""
    clock = Clock(monkeypatch, 1000.0)
    b = broker()
    alice, bob, root = person(b, 1001), person(b, 1002), person(b, 0, name="root")
    assert [refusal(b, alice) for _ in range(8)] == [None] * 8
    too_many = ("user1001 joined the waiting line 8 times in the last 4 s: wait a moment "
                "before taking another ticket", "LeaseLimitError")
    assert refusal(b, alice) == too_many
    assert refusal(b, bob) is None  # a burst of bob's own
    assert [refusal(b, root) for _ in range(20)] == [None] * 20
    clock.now += 0.5  # one ticket more at two a second
    assert refusal(b, alice) is None
    assert refusal(b, alice) == too_many
    clock.now += 100.0  # a full burst again, no more
    assert [refusal(b, alice) for _ in range(9)] == [None] * 8 + [too_many]


def test_a_barred_person_may_join_the_line_again_when_the_bar_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A person barred from the line (a servable ticket left) is refused until the bar ends,
    told how long is left; one never barred joins even on a clock just past boot. Caught: the
    refusal's words, seconds or kind changed, the bar kept on its last moment, and a person
    never barred taken as barred until 1 s after boot."""
    clock = Clock(monkeypatch, 0.5)
    b = broker()
    alice = person(b, 1001)
    assert refusal(b, alice) is None
    clock.now = 1000.0
    b.book.bar_from_line(alice.key, ticket_record(b, alice))
    clock.now = 1030.0
    assert refusal(b, alice) == (
        "user1001 left a place in the waiting line that could be served, without taking a "
        "lease: user1001 may wait in line again in 30 s (a pick that does not wait works "
        "now)", "LeaseLimitError")
    clock.now = 1060.0
    assert refusal(b, alice) is None


def test_the_line_rates_of_people_who_left_are_dropped_past_their_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker keeps a rate per person who joined the line: past four per connected
    person and 64 more, those of people no longer connected are dropped (a stream of uids
    cannot make it hold more). Caught: the bound moved by one either way, the 64 or the 4
    changed, and the connected people's rates dropped instead."""
    Clock(monkeypatch, 1000.0)
    b = broker()
    alice, bob, carol = person(b, 1001), person(b, 1002), person(b, 1003)
    b.connections.per_key.update({1001: 1, 1002: 1})  # carol's connection is not counted: she left
    b.book.joined = {10_000 + i: [8.0, 1000.0] for i in range(70)}
    assert refusal(b, alice) is None and refusal(b, bob) is None
    assert len(b.book.joined) == 72  # 4 * 2 + 64: not past the bound
    assert refusal(b, carol) is None
    assert sorted(b.book.joined) == [1001, 1002]


def one_free_device() -> Any:
    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot

    dev = DeviceSnapshot(index=0, uuid="GPU-s1", name="Fake", memory_total_bytes=80 << 30,
                         memory_used_bytes=0, memory_free_bytes=80 << 30, utilization_pct=0.0)
    return FleetSnapshot(devices=(dev,), timestamp_s=1.0, backend="test")


def exclusive_ticket(b: Broker, conn: Conn, seq: int) -> Any:
    from dataclasses import replace

    rec = ticket_record(b, conn)
    return replace(rec, seq=seq, constraints={**rec.constraints, "exclusive": True})


@pytest.mark.parametrize(
    ("lease_age_s", "snap_age_s", "earlier", "reserves"),
    [
        (None, 0.0, None, False),  # a free device: the ticket is served, it reserves nothing
        (None, 1.0, None, False),  # a snapshot a second old still judges
        (None, 1.5, None, True),  # an older one does not: the ticket reserves
        (2.0, 0.0, None, True),  # a lease held for SETTLED_S takes the device: it waits
        (1.0, 0.0, None, False),  # a pick of a moment ago does not make it wait
        (None, 0.0, "reserving", True),  # an earlier waiter that reserves is served first
        (None, 0.0, "dormant", False),  # an earlier ticket that reserves nothing is not
    ],
)
def test_a_new_ticket_reserves_only_where_a_settled_lease_or_an_earlier_waiter_holds_it(
    monkeypatch: pytest.MonkeyPatch, lease_age_s: float | None, snap_age_s: float,
    earlier: str | None, reserves: bool,
) -> None:
    """A ticket taken while the one device is free for it is dormant (it reserves nothing);
    it reserves where a lease held for two seconds at least, or an earlier reserving ticket,
    takes the device, or where the last snapshot is more than a second old. Caught: the
    snapshot's age limit moved or ignored, the judgement inverted or given no snapshot or
    line, young leases counted, settled ones ignored (or only those strictly older), every
    other ticket put ahead of it or none."""
    from dataclasses import replace

    import autogpu_jupyter.broker as broker_mod

    clock = Clock(monkeypatch, 1000.0)
    monkeypatch.setattr(broker_mod.time, "time", lambda: 1e9)
    b = broker()
    b.book.snap, b.book.snap_at = one_free_device(), clock.now
    if lease_age_s is not None:
        carol = person(b, 1003)
        carol.record = replace(lease_record(b, carol, "GPU-s1"), exclusive=True,
                               created_s=1e9 - lease_age_s)
    if earlier is not None:
        bob = person(b, 1002)
        b.book.snap_at = clock.now - (5.0 if earlier == "reserving" else 0.0)
        bob.record = exclusive_ticket(b, bob, 1)
        assert b.book.reserving(bob.record) is (earlier == "reserving")
    b.book.snap_at = clock.now - snap_age_s
    alice = person(b, 1001)
    alice.record = exclusive_ticket(b, alice, 2)
    assert b.book.reserving(alice.record) is reserves
