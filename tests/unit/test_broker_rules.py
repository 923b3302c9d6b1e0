"""The broker's rules about people, in-process: who sees which command line, who may release
or re-point a lease, how many connections a person holds, which group limit applies and whose
turn the pick lock is. A ``Broker`` object with connections made by hand (no socket, no
journal); the same rules over real sockets and real users are in tests/multiuser.

Each test was seen failing with the bug named in its docstring planted by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import subprocess
from typing import Any

import pytest

from autogpu_jupyter.broker import Broker, BrokerConfig, BrokerRefusal, Conn, Orphan
from autogpu_jupyter.brokerd.identity import Account


def broker(**config: Any) -> Broker:
    return Broker(BrokerConfig(socket_path="/nonexistent/b.sock", **config))


def person(b: Broker, uid: int, *, name: str = "", groups: frozenset[str] = frozenset(),
           pid: int | None = None) -> Conn:
    conn = Conn(b, uid, uid, pid or os.getpid(), Account(uid, name or f"user{uid}", groups))
    b.conns.add(conn)
    return conn


def lease_record(b: Broker, conn: Conn, device: str, command: str | None = None) -> Any:
    """The record the broker builds for ``conn``'s lease on ``device``."""
    return b._make_record(conn, "lease", {
        "device_uuids": [device], "device_requested_bytes": [None], "exclusive": False,
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": command,
        "holder_kind": "process",
    })


def lease(b: Broker, conn: Conn, device: str, command: str | None = None) -> None:
    """``conn`` holds a lease on ``device`` (as ``op_lease`` leaves it)."""
    conn.record = lease_record(b, conn, device, command)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_the_leases_answer_shows_a_command_line_only_to_its_owner_and_root() -> None:
    """Caught: the viewer taken from the record (every user saw every command line)."""
    b = broker(record_commands=True)
    alice, bob, root = person(b, 1001), person(b, 1002), person(b, 0, name="root")
    lease(b, alice, "GPU-r1", command="python train.py --token=s3cret")
    lease(b, bob, "GPU-r2", command="python eval.py")

    def commands(viewer: Conn) -> dict[str, str | None]:
        got = run(b.op_leases(viewer, {"op": "leases"}))
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
    b.orphans[rec.lease_id] = Orphan(1001, rec, [], key=1001)
    with pytest.raises(BrokerRefusal, match=f"^release: no lease '{rec.lease_id}' of yours is "
                                            "orphaned$"):
        run(b.op_release(bob, {"op": "release", "lease_id": rec.lease_id}))
    assert rec.lease_id in b.orphans
    assert run(b.op_release(alice, {"op": "release", "lease_id": rec.lease_id})) == {"ok": True}
    assert rec.lease_id not in b.orphans


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
            run(b.op_set_pid(caller, {"op": "set_pid", "pid": 1}))
        got = run(b.op_set_pid(caller, {"op": "set_pid", "pid": mine.pid}))
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
    b.per_key[1001] = 1
    assert b._conn_refusal(1001, acct) is None
    b.per_key[1001] = 2
    assert b._conn_refusal(1001, acct) == (
        "too many connections for alice (max_connections_per_user = 2)"
    )


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
    assert b.limit_for(conn) == expected


def test_the_pick_lock_goes_to_the_person_served_least_recently() -> None:
    """Two of alice's picks wait before bob's: when alice's first pick is done, bob goes next,
    then alice's second (a person with many connections cannot starve the others). Caught:
    the lock handed out in plain arrival order."""
    b = broker()
    alice0, alice1 = person(b, 1001), person(b, 1001)
    bob = person(b, 1002)

    async def go() -> list[Conn]:
        await b.op_begin(alice0, {"op": "begin"})  # alice is served now
        order: list[Conn] = []

        async def pick(conn: Conn) -> None:
            await b.op_begin(conn, {"op": "begin"})
            order.append(conn)
            b._drop_lock(conn)

        waiting = [asyncio.create_task(pick(c)) for c in (alice1, bob)]
        await asyncio.sleep(0)
        assert list(b.waiting) == [alice1, bob]
        b._drop_lock(alice0)
        await asyncio.gather(*waiting)
        return order

    assert run(go()) == [bob, alice1]


def test_a_pick_with_options_that_are_not_an_object_is_a_usage_error() -> None:
    """The client raises the refusal's kind: a usage error, not a broker failure. Caught: the
    kind dropped (the refusal became a plain RegistryError)."""
    b = broker()
    conn = person(b, 1001)
    with pytest.raises(BrokerRefusal, match=r"^options: expected an object$") as err:
        run(b.op_pick(conn, {"op": "pick", "options": [1]}))
    assert err.value.kind == "UsageErrorBase"


def test_leaving_a_servable_ticket_bars_a_person_who_never_leased() -> None:
    """A ticket that could have been served, given up by someone who took no lease since it
    could: that person may not join the line for a while (even one who never leased at all).
    Caught: the default for "never leased" dropped (the comparison raised)."""
    b = broker()
    conn = person(b, 1001)
    conn.record = b._make_record(conn, "ticket", {
        "device_uuids": [], "device_requested_bytes": [], "exclusive": False, "seq": 1,
        "constraints": {"min_free_bytes": None, "min_free_fraction": None,
                        "max_util_pct": None, "count": 1, "exclude": [], "exclusive": False,
                        "allowed_uuids": None},
        "pid": conn.pid, "kernel_id": None, "notebook_path": None, "command": None,
        "holder_kind": "process",
    })
    assert conn.record is not None
    b.servable_since[conn.record.lease_id] = 1.0  # it could be served from then on
    conn.record = None  # given up
    assert 1001 in b.line_barred


def test_a_waiter_that_ends_leaves_the_line_and_the_lock_goes_on() -> None:
    """A connection that ends while it waits for the pick lock (its channel dropped) leaves
    the line as its task ends. Caught: the wrong connection taken out of the line (the ended
    one stayed in it, and the error skipped the rest of the connection's ending)."""
    b = broker()
    holder, waiter, third = person(b, 1001), person(b, 1002), person(b, 1003)

    async def go() -> None:
        await b.op_begin(holder, {"op": "begin"})
        assert b.lock_holder is holder
        waiting = asyncio.create_task(b.op_begin(waiter, {"op": "begin"}))
        nxt = asyncio.create_task(b.op_begin(third, {"op": "begin"}))
        await asyncio.sleep(0)
        assert list(b.waiting) == [waiter, third]
        waiting.cancel()  # its channel was dropped: its task is cancelled, then ended
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        b._drop_lock(waiter)  # what the end of its task does
        assert list(b.waiting) == [third]
        assert b.lock_holder is holder
        b._drop_lock(holder)  # the holder is done: the next one in line gets the lock
        await nxt
        assert b.lock_holder is third and list(b.waiting) == []
        b._drop_lock(third)

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
    assert b._replaced(bob, {"ignore_ids": [theirs, mine]}) == {mine}
    assert b._replaced(bob, {"ignore_kernel": "k-1"}) == {mine}
    b._end_replaced(b._replaced(bob, {"ignore_ids": [theirs, mine], "ignore_kernel": "k-1"}))
    assert alice.record is not None and alice.record.lease_id == theirs  # hers, untouched
    assert bob_kernel.record is None


def test_the_leases_pages_neither_repeat_nor_skip_a_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: the page's cursor compared inclusively (the last record of a page came again
    at the start of the next: every list and status showed it twice)."""
    import autogpu_jupyter.broker as broker_mod

    monkeypatch.setattr(broker_mod, "PAGE_RECORDS", 2)
    b = broker()
    for i in range(5):
        lease(b, person(b, 1001 + i), f"GPU-q{i}")
    seen: list[str] = []
    after = None
    for _ in range(5):
        page = run(b.op_leases(person(b, 0, name="root"), {"op": "leases", "after": after}))
        seen += [r["lease_id"] for r in page["records"]]
        after = page["next"]
        if after is None:
            break
    assert sorted(seen) == sorted(r.lease_id for _, r in b.live())
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
    b._fleet = {"GPU-a0", "GPU-a1"}  # the host's devices, whatever this test process sees

    async def main() -> list[dict[str, Any]]:
        ours, theirs = socket.socketpair()
        conn = person(b, 0, name="root")
        conn.writer = net.Channel(ours, 1 << 20, lambda: None)
        other = person(b, 1001)
        lease(b, other, "GPU-a0")  # encoded last, before ours
        msg = {"op": "lease", "devices": ["GPU-a1"], "holder": {"kind": "kernel"}}
        replies = [await b.op_lease(conn, msg), await b.op_release(conn, {"op": "release"})]
        for reply in replies:
            assert await b._send(conn, reply)
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

    from autogpu_jupyter import broker as broker_module
    from autogpu_jupyter.brokerd import net
    from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL

    cap = broker_module.MAX_REPLY_BYTES
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
        assert await b._send(conn, reply)
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
        sent = await b._send(conn, {"ok": True})
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
    b.backend = SimulatedBackend("demo-4x")

    async def main() -> dict[str, Any]:
        ours, theirs = socket.socketpair()
        conn = person(b, 1009)
        conn.writer = net.Channel(ours, 1 << 20, lambda: None)
        reply = await b.op_pick(conn, {"op": "pick", "options": {"min_free": "1G"}})
        assert await b._send(conn, reply)
        theirs.settimeout(5)
        line = theirs.recv(1 << 16)
        conn.writer.shut()
        ours.close()
        theirs.close()
        return json.loads(line)  # type: ignore[no-any-return]

    got = run(main())
    assert got["ok"] is True and got["proto"] == PROTOCOL
    labels = {d.uuid: d.label for d in b._snap.devices}
    assert got["labels"] == [labels[u] for u in got["record"]["device_uuids"]]
    assert len(got["labels"]) == 1 and got["record"]["user"] == "user1009"
