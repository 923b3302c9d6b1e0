"""The broker under a hostile client, as a real ``autogpu broker`` process on this host.

What one connection or one uid can make the broker hold or answer is bounded, and every bad input
gets one line: the protocol version both ways, unknown ``op`` shapes, device ids that are not
this host's, fields capped in encoded bytes, a booking view and pages instead of every record,
clients that do not read, the connection caps (a reserve kept for root), subordinate uids
counted as their owner, tickets that lapse, the journal written before the reply.

Where a second uid is needed the test runs as root and forks a child that ``setuid``s to an uid
of its own (no user needs to exist for that); such tests skip when not run as root (CI runs as
root). The tests with real Unix users, ``uidmap`` and ``unshare`` are in
tests/multiuser/test_broker_attacks.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.leasing.brokerclient import (
    MAX_REPLY_BYTES,
    PROTOCOL,
    BrokerStore,
)
from autogpu_jupyter.errors import (
    LeaseLimitError,
    LeaseStoreError,
    LeaseStoreUntrustedError,
)
from tests.brokerhelpers import BrokerProc, RawConn, broker_area, wire
from tests.leasehelpers import AsUser, as_user, uuid_of

REPO = Path(__file__).resolve().parents[2]
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid to other uids")
def _passwd(name: str) -> tuple[int, int]:
    import pwd

    pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


#: Users of every Debian system (the forked children setuid to them; nothing is created)
OTHER = _passwd("nobody")
THIRD = _passwd("daemon")
#: uids with no passwd entry and in nobody's subordinate range
UNKNOWN = (301234, 301234)
UNKNOWN_TOO = (301235, 301235)


@pytest.fixture
def area() -> Iterator[Path]:
    with broker_area() as root:
        yield root


def _broker(area: Path, *args: str) -> BrokerProc:
    return BrokerProc(area, *args, env={"AUTOGPU_SIMULATE": str(area / "fleet.json")})


@pytest.fixture
def broker(area: Path) -> Iterator[BrokerProc]:
    proc = _broker(area)
    try:
        yield proc
    finally:
        proc.stop()


# ---- one line for every bad input -----------------------------------------------------------


def test_an_op_of_any_json_shape_gets_one_line_and_no_traceback(broker: BrokerProc) -> None:
    for op in ([], {}, 7, None, True, "become_root"):
        with RawConn(broker.socket) as c:
            reply = c.call({"op": op})
            assert reply["ok"] is False, reply
            assert reply["error"].startswith(f"unknown message (op {json.dumps(op)}; expected "
                                             "one of begin, end, lease"), reply
            assert c.read() is None  # closed
    assert "Traceback" not in broker.log.read_text()
    assert broker.proc is not None and broker.proc.poll() is None


def test_the_older_protocol_is_served_and_any_other_refused_with_both_versions(
    broker: BrokerProc,
) -> None:
    """A client of the protocol before this one (no version in its messages) picks and
    leases; a client of any other gets one line naming its version and both of the broker's,
    and the connection ends."""
    with RawConn(broker.socket) as c:
        c.send(json.dumps({"op": "begin"}).encode() + b"\n")  # an autogpu before versions
        reply = c.read()
        assert reply is not None and reply["ok"] is True, reply
        assert reply["leases"] == [] and reply["tickets"] == []
        c.send(json.dumps({"op": "lease", "devices": [uuid_of(0)]}).encode() + b"\n")
        reply = c.read()
        assert reply is not None and reply["ok"] is True, reply
        assert broker.status()["leases_total"] == 1
    with RawConn(broker.socket) as c:
        c.send(json.dumps({"op": "status", "proto": PROTOCOL + 1}).encode() + b"\n")
        reply = c.read()
        assert reply is not None and reply["ok"] is False
        assert reply["error"].startswith(
            f"this autogpu speaks protocol {PROTOCOL + 1}, the lease broker speaks protocol "
            f"{PROTOCOL} and {PROTOCOL - 1}"), reply
        assert c.read() is None


class _FakeBroker:
    """A socket that answers each line with ``reply`` (bytes): an old or a broken broker."""

    def __init__(self, path: Path, reply: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(path))
        self.sock.listen()
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                with __import__("contextlib").suppress(OSError):
                    c.recv(65536)
                    c.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


def test_the_client_refuses_an_old_broker_and_words_long_replies_and_timeouts(
    tmp_path: Path, broker: BrokerProc
) -> None:
    old = _FakeBroker(tmp_path / "old.sock", b'{"ok": true, "leases": [], "tickets": []}\n')
    try:
        with pytest.raises(LeaseStoreUntrustedError) as err:
            with BrokerStore(str(tmp_path / "old.sock")).locked() as txn:
                txn.ready()  # the lock's answer is read when the pick needs it
        assert str(err.value) == (
            f"the lease broker at {tmp_path / 'old.sock'} speaks an older protocol (no "
            f"version), this autogpu speaks protocol {PROTOCOL}: the broker and this "
            "environment come from different autogpu versions; nothing was picked; ask the "
            "admin to run the same autogpu version for both"
        )
    finally:
        old.close()
    huge = _FakeBroker(tmp_path / "huge.sock", b"[" + b" " * (MAX_REPLY_BYTES + 10))
    try:
        with pytest.raises(LeaseStoreError) as err2:
            BrokerStore(str(tmp_path / "huge.sock")).status()
        assert not isinstance(err2.value, LeaseStoreUntrustedError)
        assert f"sent a reply to 'status' longer than {MAX_REPLY_BYTES} bytes" in str(err2.value)
        assert "it is not down" in str(err2.value)
    finally:
        huge.close()
    # The pick lock held by another connection: a late lock is a busy broker, not a dead one.
    with RawConn(broker.socket) as holder:
        assert holder.call({"op": "begin"})["ok"] is True
        reg = BrokerStore(str(broker.socket), lock_timeout_s=0.5)
        with pytest.raises(LeaseStoreUntrustedError) as err3:
            with reg.locked() as txn:
                txn.live_leases()
        assert str(err3.value).startswith(
            f"the lease broker at {broker.socket} did not give its pick lock within 0.5 s"
        )
        assert "ask the admin to start it" not in str(err3.value)


def test_leases_name_devices_of_this_host_and_a_kind_of_holder(broker: BrokerProc) -> None:
    lower = uuid_of(0).lower()  # "gpu-...": not the device NVML names
    for devices, expected in (
        ([lower], f"{lower!r} is not a device of this host (its devices: {uuid_of(0)}, "),
        (["GPU-made-up"], "'GPU-made-up' is not a device of this host"),
    ):
        with RawConn(broker.socket) as c:
            reply = c.call({"op": "lease", "devices": devices})
            assert reply["type"] == "UsageErrorBase" and expected in reply["error"], reply
    with RawConn(broker.socket) as c:
        reply = c.call({"op": "lease", "devices": [uuid_of(0)], "holder": {"kind": "reserved"}})
        assert reply["error"] == (
            "holder.kind 'reserved' is not one of process, kernel, cli, provisioner, api"
        )
    assert broker.status()["leases"] == []


def test_free_text_fields_are_capped_in_encoded_bytes(broker: BrokerProc) -> None:
    with RawConn(broker.socket) as c:
        reply = c.call({"op": "lease", "devices": [uuid_of(0)], "holder": {
            "kind": "kernel", "notebook_path": "\U0001f600" * 4096, "kernel_id": "k" * 4096,
        }})
        rec = reply["record"]
        assert len(json.dumps(rec["notebook_path"])) - 2 <= 1024
        assert rec["notebook_path"] == "\U0001f600" * 85  # 12 escaped bytes each
        assert rec["kernel_id"] == "k" * 64
        line = wire({"op": "leases"})
        c.send(line)
        page = c.read()
        assert page is not None and len(json.dumps(page)) < 4096


def test_a_bad_rules_file_names_the_entry_reserved_ids_must_be_devices_of_the_host(
    area: Path,
) -> None:
    rules = area / "rules.json"
    cases = (
        ({"reserved": {uuid_of(0): "ml"}},
         f"reserved {uuid_of(0)!r}: expected a list of group names, got \"ml\""),
        ({"reserved": {"GPU-typo": ["ml"]}},
         "reserved device 'GPU-typo' is not a device of this host (its devices: "
         f"{uuid_of(0)}, {uuid_of(1)}, {uuid_of(2)}, {uuid_of(3)}): fix the rules file"),
        ({"unknown_uids": {"max_gpus": 1}}, "unknown_uids: unknown key 'max_gpus'"),
    )
    for doc, expected in cases:
        rules.write_text(json.dumps(doc))
        res = subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--rules", str(rules),
             "--socket", str(area / "run" / "x.sock"), "--state-dir", ""],
            capture_output=True, text=True, timeout=60, cwd=str(REPO),
            env={**os.environ, "AUTOGPU_SIMULATE": str(area / "fleet.json")},
        )
        assert res.returncode != 0
        lines = [ln for ln in res.stderr.splitlines() if not ln.startswith("autogpu-broker: ")]
        assert len(lines) == 1 and expected in lines[0], res.stderr


def test_the_socket_gets_its_mode_at_bind_in_a_directory_only_root_writes(area: Path) -> None:
    proc = _broker(area)
    try:
        assert oct((area / "run" / "broker.sock").stat().st_mode & 0o777) == "0o666"
    finally:
        proc.stop()
    for mode in (0o777, 0o775):
        os.chmod(area / "run", mode)
        res = subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--socket",
             str(area / "run" / "b.sock"), "--state-dir", ""],
            capture_output=True, text=True, timeout=60, cwd=str(REPO),
            env={**os.environ, "AUTOGPU_SIMULATE": str(area / "fleet.json")},
        )
        assert res.returncode != 0
        assert res.stderr.strip().splitlines()[-1] == (
            f"autogpu broker: socket directory {area / 'run'} is owned by uid {os.geteuid()} "
            f"with mode {mode:04o}: refused (another user could swap the socket); use a "
            f"directory owned by uid {os.geteuid()} that only it can write (mode 0755), e.g. "
            "/run/autogpu"
        )
        assert not (area / "run" / "b.sock").exists()


# ---- replies that do not grow with other users' records ---------------------------------------


def _hold_fat_leases(path: str, n: int, device: str) -> int:
    """``n`` leases on ``device`` with every free-text field at its cap, held open."""
    for i in range(n):
        c = RawConn(path)
        reply = c.call({"op": "lease", "devices": [device], "requested_bytes": [1024**3],
                        "holder": {"kind": "kernel", "kernel_id": f"{i:064d}",
                                   "notebook_path": "\u00e9" * 4096}})
        assert reply["ok"], reply
        _HELD.append(c)
    return n


_HELD: list[Any] = []


@ROOT_ONLY
def test_a_pick_reads_a_bounded_view_not_every_fat_record(broker: BrokerProc) -> None:
    fat = AsUser(*OTHER, _hold_fat_leases, str(broker.socket), 100, uuid_of(0), hold=True)
    try:
        assert fat.result() == 100
        with RawConn(broker.socket) as c:
            c.send(wire({"op": "begin"}))
            raw = c.read_raw()
        assert len(raw) < 16 * 1024, len(raw)  # 100 records of ~1.2 KiB each before
        view = json.loads(raw)
        dev = {d["uuid"]: d for d in view["devices"]}[uuid_of(0)]
        assert len(dev["rows"]) == 16 and dev["more"] == {
            "leases": 84, "exclusive": False, "booked": 84 * 1024**3}
        # The decision still sees 100 leases on GPU 0: a pick spreads to GPU 1.
        reg = BrokerStore(str(broker.socket))
        from autogpu_jupyter.core import picker
        from autogpu_jupyter.core.backends.simulated import SimulatedBackend
        from autogpu_jupyter.core.options import PickOptions
        from autogpu_jupyter.core.policy import Constraints

        backend = SimulatedBackend(str(broker.root / "fleet.json"))
        result = picker.pick(
            PickOptions(Constraints.parse()), store=reg, backend=backend, environ={}
        )
        try:
            assert result.chosen[0].uuid == uuid_of(1)
        finally:
            assert result.lease is not None
            result.lease.release()
        # status carries counts; the records come in pages (all 100 of them, on one connection).
        with RawConn(broker.socket) as c:
            c.send(wire({"op": "status"}))
            st = c.read_raw()
        assert len(st) < 4096 and json.loads(st)["leases_total"] == 100
        assert len(reg.list_leases()) == 100
    finally:
        fat.stop()


def _pipeline_unread(path: str, n_conns: int, n_requests: int) -> int:
    """``n_conns`` connections that each send ``n_requests`` paged ``leases`` requests and
    never read a byte of the answers."""
    for _ in range(n_conns):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.setblocking(False)
        data = wire({"op": "leases"}) * n_requests
        try:
            s.send(data)
        except BlockingIOError:
            pass
        _HELD.append(s)
    return n_conns


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@ROOT_ONLY
def test_clients_that_do_not_read_are_dropped_and_the_broker_stays_small(area: Path) -> None:
    proc = _broker(area, "--send-timeout", "1")
    fat = AsUser(*OTHER, _hold_fat_leases, str(proc.socket), 100, uuid_of(0), hold=True)
    silent = None
    try:
        assert fat.result() == 100
        assert proc.proc is not None
        before = _rss_kib(proc.proc.pid)
        silent = AsUser(*THIRD, _pipeline_unread, str(proc.socket), 50, 400, hold=True)
        assert silent.result() == 50
        # Every one of them is dropped once it has not read for a second ...
        proc.wait_for(lambda s: s["connections"] <= 101 + 1, timeout=30)
        grown_mib = (_rss_kib(proc.proc.pid) - before) / 1024
        assert grown_mib < 48, grown_mib  # was +580 MiB for 50 of them
        assert "did not read its reply within 1 s: dropped" in proc.log.read_text()
        # ... and the others are served as before.
        assert proc.status()["leases_total"] == 100
    finally:
        if silent is not None:
            silent.stop()
        fat.stop()
        proc.stop()


def _open_many(path: str, n: int) -> dict[str, int]:
    """Open ``n`` connections, send ``status`` on each; how many were served and refused."""
    out = {"served": 0, "refused": 0}
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        try:
            s.connect(path)
            # A refused connection is answered and closed at once: the request may then meet
            # a broken pipe while the refusal waits in the socket, to be read all the same.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                s.sendall(wire({"op": "status"}))
            line = s.makefile("rb").readline()
        except OSError:
            line = b""
        if b'"ok": true' in line:
            out["served"] += 1
        else:
            out["refused"] += 1
            out.setdefault("why", json.loads(line)["error"] if line else "closed")  # type: ignore[arg-type]
        _HELD.append(s)
    return out


@ROOT_ONLY
def test_the_connection_cap_keeps_the_last_connections_for_root(area: Path) -> None:
    proc = _broker(area, "--max-connections", "40", "--max-connections-per-user", "1000")
    flood = AsUser(*OTHER, _open_many, str(proc.socket), 60, hold=True)
    try:
        got = flood.result()
        assert got["served"] == 24 and got["refused"] == 36, got
        assert got["why"] == ("the broker holds its most connections (40, the last 16 kept for "
                              "root); try again shortly")
        st = proc.status()  # root still gets in
        assert st["connections"] == 24 + 1
        refusals = [ln for ln in proc.log.read_text().splitlines() if "refused" in ln]
        assert len(refusals) == 1, refusals  # one line, not one per connection
    finally:
        flood.stop()
        proc.stop()


@ROOT_ONLY
def test_running_out_of_descriptors_is_refused_politely_not_logged_per_accept(
    area: Path,
) -> None:
    """An fd limit of 200: the cap (200 less 64 kept for the broker's own work) is reached,
    never the limit itself; 300 connections cost a few log lines."""
    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))

    proc = BrokerProc(area, "--max-connections-per-user", "1000",
                      env={"AUTOGPU_SIMULATE": str(area / "fleet.json")}, preexec=low_limit)
    flood = AsUser(*OTHER, _open_many, str(proc.socket), 300, hold=True)
    try:
        got = flood.result()
        assert got["served"] == 200 - 64 - 16 and got["refused"] == 300 - got["served"], got
        assert proc.status()["max_connections"] == 136
        log = proc.log.read_text()
        assert "Traceback" not in log and len(log.splitlines()) < 10, log[-3000:]
    finally:
        flood.stop()
        proc.stop()


# ---- one person, many uids ---------------------------------------------------------------------


def _lease_one(path: str, device: str) -> dict[str, Any]:
    c = RawConn(path)
    reply = c.call({"op": "lease", "devices": [device]})
    _HELD.append(c)
    return reply


@ROOT_ONLY
def test_subordinate_uids_count_as_their_owner_and_unknown_uids_share_one_bucket(
    area: Path,
) -> None:
    import pwd

    owner = pwd.getpwuid(2).pw_name  # "bin": a passwd user that owns the range below
    (area / "subuid").write_text(f"{owner}:400000:65536\n")
    rules = area / "rules.json"
    rules.write_text(json.dumps({"unknown_uids": {"max_devices": 1, "max_connections": 3}}))
    proc = _broker(area, "--max-devices-per-user", "1", "--max-connections-per-user", "4",
                   "--subuid-file", str(area / "subuid"), "--rules", str(rules))
    kids: list[AsUser] = []
    try:
        kids.append(AsUser(400001, 400001, _lease_one, str(proc.socket), uuid_of(0), hold=True))
        first = kids[-1].result()
        assert first["ok"] and first["record"]["user"] == owner, first
        assert first["record"]["uid"] == 400001
        second = as_user(400002, 400002, _lease_one, str(proc.socket), uuid_of(1))
        assert second["type"] == "LeaseLimitError", second
        assert second["error"].startswith(f"{owner} already holds leases on 1 device(s)")
        # Connections: 4 for the owner's person, whichever of its uids opens them.
        many = as_user(400003, 400003, _open_many, str(proc.socket), 5)
        assert many["served"] == 3 and many["why"] == (
            f"too many connections for {owner} (subordinate uid 400003 of {owner}) "
            "(max_connections_per_user = 4)"), many
        # Two uids nobody owns share the small bucket.
        kids.append(AsUser(*UNKNOWN, _lease_one, str(proc.socket), uuid_of(2), hold=True))
        assert kids[-1].result()["ok"]
        third = as_user(*UNKNOWN_TOO, _lease_one, str(proc.socket), uuid_of(3))
        assert third["type"] == "LeaseLimitError"
        assert "max_devices_per_user = 1 set by the admin for uids without a passwd entry" in (
            third["error"])
        st = proc.status()
        assert st["per_user"][owner] == {"leases": 1, "devices": 1, "tickets": 0}
        assert st["per_user"]["unknown uids"] == {"leases": 1, "devices": 1, "tickets": 0}
    finally:
        for k in kids:
            k.stop()
        proc.stop()


# ---- restarts ------------------------------------------------------------------------------------


def test_a_restart_keeps_a_lease_whose_socket_a_child_holds(area: Path) -> None:
    """``autogpu run``'s wrapper SIGKILLed, then the broker: the command still holds the
    lease's socket, so the restarted broker keeps the lease (the connecting pid is gone)."""
    proc = _broker(area)
    env = {**os.environ, "AUTOGPU_SIMULATE": str(area / "fleet.json"),
           "AUTOGPU_BROKER_SOCKET": str(proc.socket), "PYTHONPATH": str(REPO)}
    run = subprocess.Popen(
        [sys.executable, "-m", "autogpu_jupyter.cli", "run", "--exclusive", "--exclude",
         "1,2,3", "--", "sleep", "60"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        st = proc.wait_for(lambda s: len(s["leases"]) == 1)
        lease_id = st["leases"][0]["lease_id"]
        os.kill(run.pid, signal.SIGKILL)  # the wrapper; `sleep` keeps the socket
        run.wait(10)
        proc.restart()
        st = proc.status()
        assert [r["lease_id"] for r in st["leases"]] == [lease_id] and st["orphans"] == 1
        other = subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", "run", "--exclusive", "--exclude",
             "1,2,3", "--", "true"], env=env, capture_output=True, text=True, timeout=60,
        )
        assert other.returncode == 3, other.stderr
    finally:
        os.killpg(run.pid, signal.SIGKILL)
    proc.wait_for(lambda s: s["leases"] == [], timeout=10)  # `sleep` gone: the orphan ends
    proc.stop()


def test_each_grant_is_journaled_before_its_reply_and_costs_one_line(broker: BrokerProc) -> None:
    log_path = broker.state / "journal.log"
    held = []
    for i in range(100):
        c = RawConn(broker.socket)
        rec = c.call({"op": "lease", "devices": [uuid_of(i % 4)], "holder": {
            "kind": "kernel", "notebook_path": "n" * 1024, "kernel_id": f"{i:064d}"}})["record"]
        # durable before the reply: the line is in the file the moment the client reads it
        assert rec["lease_id"] in log_path.read_text()
        held.append(c)
    live = log_path.stat().st_size
    start = live
    for _ in range(200):
        with RawConn(broker.socket) as c:
            c.call({"op": "lease", "devices": [uuid_of(0)]})
    grown = log_path.stat().st_size
    # 400 changes appended (not 400 rewrites of 100 records: ~60 MB), compacted when long.
    assert grown - start < 400 * 1024 and grown < 4 * live + 256 * 1024, (start, grown)
    for c in held:
        c.close()


# ---- tickets -------------------------------------------------------------------------------------


TICKET = {"op": "ticket", "exclusive": True, "constraints": {
    "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None, "count": 1,
    "exclude": [], "exclusive": True, "allowed_uuids": [uuid_of(0)]}}


def test_a_ticket_that_could_be_served_but_is_not_taken_loses_its_place(area: Path) -> None:
    proc = _broker(area, "--ticket-grace", "1")
    try:
        blocked_by = RawConn(proc.socket)
        blocked_by.call({"op": "lease", "devices": [uuid_of(0)], "exclusive": True})
        waiter = RawConn(proc.socket)
        ticket = waiter.call(TICKET)["record"]
        time.sleep(2.5)  # GPU 0 is taken: the ticket cannot be served, it keeps its place
        assert [t["lease_id"] for t in proc.status()["tickets"]] == [ticket["lease_id"]]
        blocked_by.close()  # now it could be served: 1 s later it lapses
        event = waiter.read(timeout=15)
        assert event is not None and event["event"] == "ticket_lapsed", event
        assert "lapsed: a device was free for it for 1 s but no lease was taken" in (
            event["message"])
        assert waiter.read() is None
        st = proc.status()
        assert st["tickets"] == [] and st["tickets_lapsed"] == 1
    finally:
        proc.stop()


def _wait_leave_and_rejoin(path: str) -> list[Any]:
    """As a user: a ticket that waits (GPU 0 is taken); once it could be served (the broker
    checks every second), leave it without a lease; then try to wait in line again."""
    waiter = RawConn(path)
    out = [waiter.call(TICKET)["ok"]]
    while True:
        with RawConn(path) as c:
            if c.call({"op": "status"})["leases_total"] == 0:
                break
        time.sleep(0.1)
    time.sleep(2.5)
    waiter.close()  # leaves a place it could have taken
    time.sleep(0.5)
    with RawConn(path) as again:
        out.append(again.call(TICKET))
    return out


def _hold_exclusive(path: str, device: str) -> bool:
    c = RawConn(path)
    _HELD.append(c)
    return bool(c.call({"op": "lease", "devices": [device], "exclusive": True})["ok"])


@ROOT_ONLY
def test_a_user_who_leaves_a_servable_place_waits_a_minute_to_queue_again(area: Path) -> None:
    proc = _broker(area, "--ticket-grace", "60")
    try:
        blocker = AsUser(*THIRD, _hold_exclusive, str(proc.socket), uuid_of(0), hold=True)
        assert blocker.result() is True
        user = AsUser(*OTHER, _wait_leave_and_rejoin, str(proc.socket))
        proc.wait_for(lambda s: s["tickets_total"] == 1)  # the ticket waits: GPU 0 is taken
        blocker.stop()
        joined, again = user.result()
        user.stop()
        assert joined is True
        assert again["ok"] is False and again["type"] == "LeaseLimitError", again
        assert again["error"].startswith(
            "nobody left a place in the waiting line that could be served, without taking a "
            "lease: nobody may wait in line again in ")
        assert again["error"].endswith(" s (a pick that does not wait works now)")
        assert "barred from the line for 60 s" in proc.log.read_text()
    finally:
        proc.stop()


def test_root_lists_and_revokes_tickets(broker: BrokerProc) -> None:
    hold = RawConn(broker.socket)
    hold.call({"op": "lease", "devices": [uuid_of(0)], "exclusive": True})
    waiter = RawConn(broker.socket)
    ticket = waiter.call(TICKET)["record"]
    cli = [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--socket",
           str(broker.socket)]
    listed = subprocess.run([*cli, "tickets"], capture_output=True, text=True, cwd=str(REPO))
    assert listed.returncode == 0, listed.stderr
    assert f"ticket 1  {ticket['lease_id']}  1 GPU(s) exclusive, since " in listed.stdout
    revoked = subprocess.run([*cli, "revoke", ticket["lease_id"]], capture_output=True,
                             text=True, cwd=str(REPO))
    assert revoked.stdout.startswith(f"revoked ticket {ticket['lease_id']} (root: pid ")
    event = waiter.read()
    assert event is not None and event["event"] == "revoked" and event["kind"] == "ticket"
    assert broker.status()["tickets"] == []
    hold.close()


def test_the_client_leases_lists_and_releases_over_the_new_protocol(area: Path) -> None:
    proc = _broker(area, "--max-devices-per-user", "1")
    try:
        reg = BrokerStore(str(proc.socket))
        with reg.locked() as txn:
            lease = txn.create(devices=[uuid_of(0)])
        try:
            assert [r.lease_id for r in reg.list_leases()] == [lease.record.lease_id]
            with reg.locked() as txn, pytest.raises(LeaseLimitError) as err:
                txn.create(devices=[uuid_of(1)])
            assert "max_devices_per_user = 1 set by the admin" in str(err.value)
        finally:
            lease.release()
        assert reg.list_leases() == []
    finally:
        proc.stop()
