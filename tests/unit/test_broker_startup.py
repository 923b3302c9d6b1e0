"""The broker's start-up, its rules file and its handling of a connection, in-process: what
``autogpu broker --foreground`` prints and logs, how ``serve`` checks the fleet and stops, the
state directory made private, a socket systemd passes, the kernel's peer credentials, the one
line a refused connection gets, what the broker keeps for a client that does not read, when it
reads the fleet again (a new ticket, an id it does not know), and the words of a protocol
mismatch.

Each test was seen failing with the bug named in its docstring planted by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import locale
import logging
import os
import signal
import socket
import struct
import tempfile
import time
import types
from typing import Any

import pytest

import autogpu_jupyter.broker as broker_mod
from autogpu_jupyter import __version__
from autogpu_jupyter.broker import BrokerConfig, BrokerRefusal, Conn
from autogpu_jupyter.brokerd import book as book_mod
from autogpu_jupyter.brokerd import connections as conn_mod
from autogpu_jupyter.brokerd import fleet as fleet_mod
from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd import net
from autogpu_jupyter.brokerd import picklock as picklock_mod
from autogpu_jupyter.brokerd.identity import Account
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing.brokerclient import MAX_REPLY_BYTES, PROTOCOL
from autogpu_jupyter.errors import AutoGPUError
from tests.unit.test_broker_rules import broker, exchange, person, run


class Counted:
    """The simulated ``demo-4x`` host at one fixed moment, counting its snapshots."""

    def __init__(self) -> None:
        self.inner = SimulatedBackend("demo-4x", clock=lambda: 1_000_000.0)
        self.snapshots = 0

    def snapshot(self) -> Any:
        self.snapshots += 1
        return self.inner.snapshot()


class NoFleet:
    """A host without a GPU library."""

    def snapshot(self) -> Any:
        raise AutoGPUError("no GPU library here")


class Clock:
    """The broker's monotonic clock, stopped at ``now`` (wall time and asyncio untouched)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, now: float) -> None:
        self.now = now
        clock = types.SimpleNamespace(monotonic=lambda: self.now, time=time.time)
        for mod in (broker_mod, book_mod, picklock_mod, fleet_mod, conn_mod):
            monkeypatch.setattr(mod, "time", clock)


def short_socket_dir() -> str:
    return tempfile.mkdtemp(prefix="agb-", dir="/tmp")  # a socket path has at most 107 bytes


# ---- the rules file, the state directory, the socket systemd passes -------------------------


def test_a_rules_file_is_read_as_utf8_in_this_process_under_the_c_locale(tmp_path: Any) -> None:
    """A user's name may be non-ASCII: the file is read as UTF-8 even where the locale's
    encoding is ASCII (the broker started by an init system with ``LANG`` unset). Caught: the
    file opened in the locale's encoding (``encoding=None`` or no encoding given: the admin's
    file refused as undecodable)."""
    path = tmp_path / "rules.json"
    path.write_text(json.dumps({"users": {"zoë": 2}}, ensure_ascii=False), encoding="utf-8")
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        assert locale.getencoding() == "ANSI_X3.4-1968"  # the C locale: ASCII here
        config = BrokerConfig(socket_path="/nonexistent/b.sock")
        config.load_rules(str(path))
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)
    assert config.user_limits == {"zoë": 2}


def test_a_state_directory_open_to_others_is_made_private_exactly(tmp_path: Any) -> None:
    """An existing state directory that others may list is made 0700 (not 0701, not left
    0755). Caught: the chmod given no path, no mode, ``None`` for either (the broker stopped
    with a TypeError), or the mode written 449 (0701: others could still enter it)."""
    from autogpu_jupyter.brokerd.startup import check_state_dir

    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    check_state_dir(str(state))
    assert os.stat(state).st_mode & 0o7777 == 0o700


# ---- the fleet at start, serve and main ------------------------------------------------------


def test_a_broker_that_cannot_see_the_fleet_says_so_in_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """Caught: the warning's text reworded or dropped, its reason left out or ``None``."""
    from autogpu_jupyter.broker import _initial_fleet

    monkeypatch.setattr(fleet_mod, "get_backend", NoFleet)
    b = broker(reserved={"GPU-typo": ["ml"]})
    with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
        _initial_fleet(b)  # nothing to check the reserved ids against: no exit
    assert [r.getMessage() for r in caplog.records] == [
        "the broker cannot see this host's devices (no GPU library here): reserved ids and "
        "leased ids are not checked against the fleet"]


def test_serve_stops_before_listening_on_a_reserved_id_the_host_does_not_have(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fleet read at start is what the reserved ids are checked against: a typo stops the
    broker before it listens. Caught: the broker not given to the start's fleet check, or the
    check given no fleet (the typo silently reserved nothing)."""
    backend = Counted()
    monkeypatch.setattr(fleet_mod, "get_backend", lambda: backend)
    where = short_socket_dir()
    config = BrokerConfig(socket_path=os.path.join(where, "b.sock"),
                          reserved={"GPU-typo": ["ml"]})
    fleet = ", ".join(sorted(d.uuid for d in backend.inner.snapshot().devices))

    def ready() -> None:  # were it to listen, stop it at once
        asyncio.get_running_loop().call_soon(os.kill, os.getpid(), signal.SIGTERM)

    try:
        with pytest.raises(SystemExit) as err:
            run(broker_mod.serve(config, ready))
        assert os.listdir(where) == []
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.socket_path)
        os.rmdir(where)
    assert str(err.value) == (
        f"autogpu broker: reserved device 'GPU-typo' is not a device of this host (its "
        f"devices: {fleet}): fix the rules file")


def test_sigterm_twice_stops_serve_once_and_keeps_the_journal_of_what_is_still_held(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """A lease held when the broker is stopped stays in its journal (its holder still runs;
    the next broker takes it back), though its connection ends with the shutdown; a second
    SIGTERM before the first is handled is no error. Caught: ``stopping`` set to False or
    ``None`` at the stop (the shutdown erased the journal), and the handler that sets the
    stop without asking whether it is set already (the second signal raised
    InvalidStateError in the loop)."""
    monkeypatch.setattr(fleet_mod, "get_backend", NoFleet)
    where = short_socket_dir()
    path = os.path.join(where, "b.sock")
    state = tmp_path / "state"
    replies: list[dict[str, Any]] = []
    errors: list[Any] = []
    held: list[Any] = []

    async def client() -> None:
        reader, writer = await asyncio.open_unix_connection(path)
        held.append(writer)  # kept open past the stop
        writer.write(json.dumps({"op": "lease", "devices": ["GPU-a"], "proto": PROTOCOL})
                     .encode() + b"\n")
        replies.append(json.loads(await reader.readline()))
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: errors.append(context["message"]))
        tasks = []
        config = BrokerConfig(socket_path=path, state_dir=str(state))
        await asyncio.wait_for(
            broker_mod.serve(config, lambda: tasks.append(loop.create_task(client()))), 10)
        await tasks[0]
        held[0].close()

    try:
        run(main())
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.rmdir(where)
    assert [r["ok"] for r in replies] == [True]
    lease_id = replies[0]["record"]["lease_id"]
    assert list(jrnl.Journal(str(state)).load()) == [lease_id]
    assert errors == []


def test_main_logs_to_stderr_with_its_prefix_from_the_info_level(
    monkeypatch: pytest.MonkeyPatch, capsys: Any,
) -> None:
    """``autogpu broker --foreground`` run where logging is not set up yet (as on a host):
    its warnings and its info lines (a restart's count) reach stderr, each with the
    ``autogpu-broker:`` prefix, then the line saying where it listens. Caught: the level
    dropped or ``None`` (the info lines lost), the format dropped, ``None`` or reworded."""
    async def serve(config: BrokerConfig, ready: Any) -> None:
        broker_mod.log.info("restart: 0 lease(s)/ticket(s) taken back from the journal")
        ready()

    monkeypatch.setattr(broker_mod, "serve", serve)
    monkeypatch.setattr(broker_mod.os, "geteuid", lambda: 1234)
    monkeypatch.setattr(logging.root, "handlers", [])  # what basicConfig adds goes with it
    monkeypatch.setattr(logging.root, "level", logging.WARNING)
    capsys.readouterr()
    assert broker_mod.main(BrokerConfig(socket_path="/nonexistent/m.sock")) == 0
    assert capsys.readouterr().err == (
        "autogpu-broker: not running as root: users' identities are still checked, but the "
        "journal and socket belong to uid 1234\n"
        "autogpu-broker: restart: 0 lease(s)/ticket(s) taken back from the journal\n"
        "autogpu broker: listening on /nonexistent/m.sock\n")


def test_main_as_root_warns_of_nothing_and_serves_its_own_rules(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """Caught: the root check made for uid 1 (root warned that it is not root), and ``serve``
    given ``None`` instead of the admin's rules."""
    seen: list[Any] = []

    async def serve(config: BrokerConfig, ready: Any) -> None:
        seen.append(config)

    monkeypatch.setattr(broker_mod, "serve", serve)
    monkeypatch.setattr(broker_mod.os, "geteuid", lambda: 0)
    config = BrokerConfig(socket_path="/nonexistent/m.sock")
    with caplog.at_level(logging.INFO, logger="autogpu.broker"):
        assert broker_mod.main(config) == 0
    assert [r.getMessage() for r in caplog.records] == []
    assert seen == [config] and seen[0] is config


def test_main_flushes_its_listening_line_through_a_block_buffered_stderr(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whoever waits for the broker reads the listening line as it is printed, even where
    stderr is block-buffered (a wrapped or redirected stream). Caught: the print's flush
    dropped, ``False`` or ``None`` (the line stayed in the buffer)."""
    async def serve(config: BrokerConfig, ready: Any) -> None:
        ready()

    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="utf-8", line_buffering=False)
    monkeypatch.setattr(broker_mod, "serve", serve)
    monkeypatch.setattr(broker_mod.os, "geteuid", lambda: 0)
    monkeypatch.setattr(broker_mod.sys, "stderr", stream)
    assert broker_mod.main(BrokerConfig(socket_path="/nonexistent/m.sock")) == 0
    assert raw.getvalue() == b"autogpu broker: listening on /nonexistent/m.sock\n"


# ---- connections -----------------------------------------------------------------------------


def test_the_peer_credentials_of_a_uid_past_two_to_the_31_stay_positive() -> None:
    """``SO_PEERCRED`` holds three unsigned ints: a uid of 2**31 or more (a subordinate uid
    range can reach there) is read as itself. Caught: the ints read as signed (that uid
    became negative)."""
    from autogpu_jupyter.broker import peer_credentials

    class Peer:
        def getsockopt(self, level: int, name: int, size: int) -> bytes:
            assert (level, name, size) == (socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            return struct.pack("3I", 4321, 2**32 - 2, 2**31)

    assert peer_credentials(Peer()) == (4321, 4294967294, 2147483648)


def test_a_connection_made_with_its_channel_keeps_it() -> None:
    """Caught: the channel given to ``Conn`` dropped (its writer ``None``)."""
    b = broker()
    channel: Any = object()
    conn = Conn(b, 1001, 1001, os.getpid(), Account(1001, "alice", frozenset()), channel)
    assert conn.writer is channel


def test_root_is_accepted_in_the_connections_kept_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every connection but the last 16 in use, root's connection is still served.
    Caught: the caps asked about no uid (root held to a user's cap and refused)."""
    b = broker()
    b.connections.conn_cap = 20
    b.connections.conns = {person(b, 1000 + i) for i in range(20 - net.ROOT_RESERVE)}
    monkeypatch.setattr(conn_mod, "peer_credentials", lambda sock: (os.getpid(), 0, 0))

    async def go() -> list[int]:
        ours, theirs = socket.socketpair()
        b.accepted(ours)
        uids = sorted(c.uid for c in b.connections.conns)
        theirs.close()
        return uids

    assert run(go()) == [0, 1000, 1001, 1002, 1003]


def test_a_client_that_does_not_read_is_kept_up_to_one_reply_and_the_notices_buffer() -> None:
    """The broker keeps at most ``OUT_BUFFER_BYTES + MAX_REPLY_BYTES`` bytes for a client
    that does not read: to that byte the connection stays, one byte more drops it. Caught:
    the cap ``None`` (every write past the socket's buffer raised TypeError) or the two
    amounts subtracted (the connection dropped at once)."""
    b = broker()
    cap = broker_mod.OUT_BUFFER_BYTES + MAX_REPLY_BYTES

    async def go() -> list[bool]:
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)  # whatever the host's default
        with contextlib.ExitStack() as stack:
            stack.callback(theirs.close)
            original = conn_mod.peer_credentials
            conn_mod.peer_credentials = lambda sock: (os.getpid(), 1001, 1001)
            stack.callback(setattr, conn_mod, "peer_credentials", original)
            b.accepted(ours)
            (conn,) = b.connections.conns
            conn.writer.write(b"x" * MAX_REPLY_BYTES)  # more than the socket's buffer takes
            kept = conn.writer.pending
            assert 0 < kept < cap
            conn.writer.write(b"y" * (cap - kept))
            at_cap = conn.writer.closed
            conn.writer.write(b"z")
            return [at_cap, conn.writer.closed]

    assert run(go()) == [False, True]


def test_a_refused_client_that_does_not_read_never_blocks_the_broker(caplog: Any) -> None:
    """The refusal line is sent without waiting: to a client whose socket buffer is full it
    is dropped, the socket closed and the refusal logged. Caught: the socket left blocking
    (the broker waited for that client), and the failed send not kept quiet (the refusal
    raised instead of being counted)."""

    class Guarded(socket.socket):
        def send(self, data: Any, *flags: Any) -> int:
            if self.getblocking():
                raise AssertionError("a blocking send: the broker would wait for this client")
            return super().send(data, *flags)

    b = broker()
    ours, theirs = socket.socketpair()
    guarded = Guarded(fileno=ours.detach())
    try:
        guarded.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                socket.socket.send(guarded, b"x" * 65536)  # the client reads none of it
        guarded.setblocking(True)
        with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
            b.connections.refuse(guarded, 1001, "too many connections for alice")
        assert guarded.fileno() == -1
    finally:
        guarded.close()
        theirs.close()
    assert [r.getMessage() for r in caplog.records] == [
        "1 connection(s) refused (the last from uid 1001: too many connections for alice)"]


def test_a_connection_lost_under_its_loop_with_an_oserror_ends_quietly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: only RuntimeError kept quiet (a connection lost on the way killed its task
    with an error)."""
    b = broker()
    conn = person(b, 1001)

    async def failing(_conn: Conn) -> None:
        raise ConnectionResetError("Connection reset by peer")

    monkeypatch.setattr(b.connections, "serve", failing)
    assert run(b.connections.run(conn)) is None


def test_a_begin_reads_its_holders_ids_ahead_and_no_other_message_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After answering a ``begin``, the broker reads what the lease's journal line will need
    (off the path of the ``lease`` that follows); a ``status`` reads nothing. Caught: the
    read made after every message but a begin, after every message, or never (the op
    misspelled, or asked only of a connection that read them already)."""
    b = broker()
    read: list[int] = []
    holder_ids = b.restorer.holder_ids

    def spy(conn: Conn) -> Any:
        read.append(conn.uid)
        return holder_ids(conn)

    monkeypatch.setattr(b.restorer, "holder_ids", spy)
    status = json.dumps({"op": "status", "proto": PROTOCOL}).encode() + b"\n"
    begin = json.dumps({"op": "begin", "proto": PROTOCOL}).encode() + b"\n"
    assert [r["ok"] for r in exchange(b, monkeypatch, status)] == [True]
    assert read == []
    assert [r["ok"] for r in exchange(b, monkeypatch, begin)] == [True]
    assert read == [1001]


# ---- when the fleet is read again ------------------------------------------------------------


def test_the_broker_makes_its_backend_once_and_reads_the_fleet_from_it() -> None:
    """Caught: the backend starting as ``""`` (taken for one already made), or the one made
    dropped (``None``): either way the fleet could never be read."""
    made: list[Counted] = []

    def get_backend() -> Counted:
        made.append(Counted())
        return made[-1]

    b = broker()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fleet_mod, "get_backend", get_backend)
        first = b.fleet.snapshot()
        b.fleet.snapshot()
    assert len(made) == 1 and b.fleet.backend is made[0] and made[0].snapshots == 2
    assert b.fleet.ids == {d.uuid for d in first.devices} and len(b.fleet.ids) == 4


def test_a_first_ticket_reads_the_fleet_and_later_ones_within_a_second_do_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new broker has no snapshot: the first ticket reads one, whatever the clock; one a
    second old is used again, one older is not. Caught: the new broker's snapshot time set in
    the future (the first tickets judged without a fleet), the age added instead of
    subtracted, ``<`` or a 2 s age, and the read run without a loop, a function or an
    executor (the snapshot never made)."""
    clock = Clock(monkeypatch, 3.0)  # a host booted 3 s ago
    b = broker()
    b.fleet.backend = Counted()
    run(b.fleet.fresh_snapshot())
    assert (b.fleet.backend.snapshots, b.book.snap is not None, b.book.snap_at) == (1, True, 3.0)
    clock.now = 4.0  # exactly a second later: still fresh
    run(b.fleet.fresh_snapshot())
    assert b.fleet.backend.snapshots == 1
    clock.now = 5.5
    run(b.fleet.fresh_snapshot())
    assert (b.fleet.backend.snapshots, b.book.snap_at) == (2, 5.5)
    clock.now = 6.6
    run(b.fleet.fresh_snapshot())
    assert b.fleet.backend.snapshots == 3


def test_a_ticket_without_a_fleet_logs_why_and_does_not_ask_again_within_a_second(
    monkeypatch: pytest.MonkeyPatch, caplog: Any,
) -> None:
    """Caught: the debug line's text reworded or ``None``, its reason left out or ``None``,
    and ``<`` for ``<=`` (asked again, and logged again, at exactly a second)."""
    clock = Clock(monkeypatch, 100.0)
    b = broker()
    b.fleet.backend = NoFleet()
    with caplog.at_level(logging.DEBUG, logger="autogpu.broker"):
        run(b.fleet.fresh_snapshot())
        clock.now = 101.0
        run(b.fleet.fresh_snapshot())
    assert [r.getMessage() for r in caplog.records] == [
        "no snapshot for a new ticket: no GPU library here"]
    assert (b.book.snap, b.book.snap_at) == (None, 100.0)


def test_an_unknown_id_reads_the_fleet_again_at_most_every_five_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new broker reads the fleet for the first unknown id even on a host booted 3 s ago;
    then not within 5 s, and again at exactly 5 s. Caught: the last read's time starting at
    +5 s (the first check skipped on a just-booted host: the made-up id leased), the time
    since added instead of subtracted (read on every unknown id), and ``>`` for ``>=``."""
    clock = Clock(monkeypatch, 3.0)
    b = broker()
    backend = b.fleet.backend = Counted()
    with pytest.raises(BrokerRefusal):
        run(b.fleet.check_known(["gpu-made-up"]))
    assert backend.snapshots == 1
    clock.now = 7.9
    with pytest.raises(BrokerRefusal):
        run(b.fleet.check_known(["gpu-made-up"]))
    assert backend.snapshots == 1
    clock.now = 8.0
    with pytest.raises(BrokerRefusal):
        run(b.fleet.check_known(["gpu-made-up"]))
    assert backend.snapshots == 2


@pytest.mark.parametrize("size", [20, 0])
def test_an_unknown_id_is_refused_naming_its_first_80_characters_and_16_devices(
    size: int,
) -> None:
    """The refusal shows the id cut to 80 characters and at most 16 of the host's devices
    (``none`` for a host without any). Caught: 81 characters or 17 devices shown, and
    ``none`` reworded."""
    b = broker()
    b.fleet.ids = {f"GPU-{i:02d}" for i in range(size)}
    b.fleet.checked_at = time.monotonic()  # just read: not read again
    asked = "g" * 100
    with pytest.raises(BrokerRefusal) as err:
        run(b.fleet.check_known([asked]))
    shown = ", ".join(f"GPU-{i:02d}" for i in range(min(size, 16))) or "none"
    assert str(err.value) == (
        f"{'g' * 80!r} is not a device of this host (its devices: {shown})")


# ---- the protocol --------------------------------------------------------------------------


@pytest.mark.parametrize(("theirs", "spoken"), [
    (PROTOCOL + 1, f"protocol {PROTOCOL + 1}"),
    (PROTOCOL - 2, f"protocol {PROTOCOL - 2}"),
    (True, "protocol true"),
    ("x" * 50, f'protocol "{"x" * 36}...'),
])
def test_a_protocol_mismatch_names_both_sides_versions_and_what_to_do(
    theirs: Any, spoken: str,
) -> None:
    """The broker speaks its protocol and the one before it (messages without a version, or
    with that one); anything else gets one line naming the client's version and both of the
    broker's. Caught: the older protocol refused (a broker upgraded before its users'
    environments refused every one of them), ``True`` taken for 1, the client's version
    shown as ``null``, the advice reworded."""
    from autogpu_jupyter.broker import _protocol_mismatch

    assert _protocol_mismatch(theirs) == (
        f"this autogpu speaks {spoken}, the lease broker speaks protocol {PROTOCOL} and "
        f"{PROTOCOL - 1} (autogpu {__version__}): the broker and this environment come from "
        "different autogpu versions; upgrade autogpu here (or ask the admin to run the same "
        "version for both)")
    assert _protocol_mismatch(PROTOCOL) is None
    assert _protocol_mismatch(PROTOCOL - 1) is None
    assert _protocol_mismatch(None) is None  # the older protocol's messages carry no version
