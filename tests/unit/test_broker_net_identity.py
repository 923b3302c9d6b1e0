"""The broker's socket and its callers' identities, the cases the other broker tests leave open
(autogpu_jupyter.brokerd.net and autogpu_jupyter.brokerd.identity), all in this process: the
connection cap's every bound, the socket directory's every refusal and the walk to ``/``, the
socket's mode and backlog, the listener's turn, log line and resumption after a back-off, a
channel's end (its write watch removed, close's deadline), and when the subordinate uid file
is read and how the lookup cache is bounded.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import socket
import stat
import struct
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.brokerd import identity, net
from autogpu_jupyter.brokerd.identity import UNKNOWN_KEY, Accounts
from autogpu_jupyter.brokerd.net import Channel
from tests.unit.test_broker_channel import _fill
from tests.unit.test_broker_channel import run as run_channel
from tests.unit.test_broker_identity import FREE  # a uid no passwd entry names
from tests.unit.test_broker_net import FakeLimits, until

# ---- the connection cap ------------------------------------------------------------------


def test_with_no_cap_asked_for_the_default_applies_and_a_cap_of_one_is_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``connection_cap()`` (0: none asked for) is :data:`DEFAULT_MAX_CONNECTIONS`; 1 is a
    cap like any other. Caught: the parameter's default made 1 (a broker of one connection),
    ``requested > 0`` made ``> 1`` (a cap of 1 became 4096)."""
    monkeypatch.setattr(net, "resource", FakeLimits(8192, 8192))
    assert (net.connection_cap(), net.connection_cap(1)) == (4096, 1)


def test_the_soft_limit_is_raised_to_at_most_65536_whatever_the_hard_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unlimited hard limit raises the soft one to 65536, as does a hard one above it.
    Caught: an unlimited hard limit taken as a number (the soft limit left at 1024, the cap
    at 960), the ceiling made 65537."""
    unlimited = FakeLimits(1024, FakeLimits.RLIM_INFINITY)
    monkeypatch.setattr(net, "resource", unlimited)
    assert (net.connection_cap(0), unlimited.soft) == (4096, 65536)
    high = FakeLimits(1024, 100_000)
    monkeypatch.setattr(net, "resource", high)
    assert (net.connection_cap(100_000), high.soft) == (65536 - 64, 65536)


class OSErrorLimits(FakeLimits):
    """``setrlimit`` failing with an errno Python does not turn into ValueError (a sandbox's
    seccomp filter, say)."""

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))


def test_a_raise_that_fails_with_an_os_error_keeps_the_soft_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: OSError no longer suppressed, or suppressed with ``None`` beside ValueError
    (a TypeError): the broker stopped instead of capping at its soft limit."""
    limits = OSErrorLimits(256, 1024)
    monkeypatch.setattr(net, "resource", limits)
    assert (net.connection_cap(0), limits.soft) == (256 - 64, 256)


def test_the_cap_is_never_below_the_root_reserve_plus_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A descriptor limit of 70 leaves 6 after the broker's 64: the cap is still 17, one
    connection for anyone besides root's 16. Caught: the floor made 15 or 18."""
    monkeypatch.setattr(net, "resource", FakeLimits(70, 70))
    assert net.connection_cap(0) == net.ROOT_RESERVE + 1 == 17


# ---- the socket directory ----------------------------------------------------------------


def test_a_file_or_a_symlink_in_the_directorys_place_is_refused_in_one_whole_line(
    tmp_path: Path,
) -> None:
    """Caught: ``or`` made ``and`` (a plain file taken for a directory), the line's second
    half changed."""
    (tmp_path / "file").write_text("")
    (tmp_path / "link").symlink_to(tmp_path)
    for name in ("file", "link"):
        with pytest.raises(SystemExit) as err:
            net.check_socket_dir(str(tmp_path / name))
        assert str(err.value) == (
            f"autogpu broker: socket directory {tmp_path / name} is a symlink or not a "
            "directory: refused; use a directory of root's, e.g. /run/autogpu")


def test_a_directory_others_can_write_is_refused_however_far_up_it_lies(tmp_path: Path) -> None:
    """The walk goes on to ``/``, not to the socket directory's parent only. Caught: the walk
    ended after the first directory above (a world-writable one two levels up passed)."""
    top = tmp_path / "top"
    (top / "mid" / "run").mkdir(parents=True)
    os.chmod(top, 0o777)
    os.chmod(top / "mid", 0o755)
    os.chmod(top / "mid" / "run", 0o755)
    with pytest.raises(SystemExit) as err:
        net.check_socket_dir(str(top / "mid" / "run"))
    assert str(err.value) == (
        f"autogpu broker: socket directory {top / 'mid' / 'run'} lies under {top}, which uid "
        f"{os.geteuid()} owns with mode 0777: refused (another user could replace the "
        "directory); use a path whose every directory is root's")


def test_a_broker_not_run_as_root_accepts_directories_above_that_root_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The directories above the socket's may be the broker's user's or root's. Caught: root's
    uid 0 made 1 (every path under ``/`` refused for a broker of another user)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    if os.geteuid() == 0:  # play a broker of uid 12345, under root's directories
        os.chown(run, 12345, 12345)
        monkeypatch.setattr(os, "geteuid", lambda: 12345)
    assert os.stat("/").st_uid == 0
    net.check_socket_dir(str(run))  # raises nothing


# ---- the socket --------------------------------------------------------------------------


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory under /tmp with a short path (a socket path has at most 107 bytes)."""
    where = tempfile.mkdtemp(prefix="agn-", dir="/tmp")
    try:
        yield where
    finally:
        shutil.rmtree(where)


def test_the_socket_is_made_mode_0666_in_this_process_whatever_the_umask(
    short_dir: str,
) -> None:
    """Caught: the umask at bind 0o112 instead of 0o111 (a socket 0665: others could not
    connect)."""
    old = os.umask(0o077)
    try:
        net.listen(os.path.join(short_dir, "b.sock")).close()
        left = os.umask(old)
    finally:
        os.umask(old)
    mode = os.lstat(os.path.join(short_dir, "b.sock")).st_mode
    assert (stat.S_ISSOCK(mode), oct(stat.S_IMODE(mode)), oct(left)) == (True, "0o666", "0o77")


def _listen_backlog(sock: socket.socket) -> int:
    """The backlog the kernel holds for listening Unix socket ``sock`` (sock_diag's
    UNIX_DIAG_RQLEN: for a listener, its queue and its backlog)."""
    ino = os.fstat(sock.fileno()).st_ino
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino,
                      0x10, 0xFFFFFFFF, 0xFFFFFFFF)  # UDIAG_SHOW_RQLEN, any cookie
    hdr = struct.pack("=IHHII", 16 + len(req), 20, 1, 1, 0)  # SOCK_DIAG_BY_FAMILY, REQUEST
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as diag:  # NETLINK_SOCK_DIAG
        diag.sendto(hdr + req, (0, 0))
        data = diag.recv(8192)
    off = 16 + 16  # nlmsghdr, unix_diag_msg
    while off + 4 <= len(data):
        alen, atype = struct.unpack_from("=HH", data, off)
        if atype == 4:  # UNIX_DIAG_RQLEN
            return int(struct.unpack_from("=II", data, off + 4)[1])
        off += (alen + 3) & ~3
    raise AssertionError(f"no UNIX_DIAG_RQLEN in {data.hex()}")


def test_the_socket_listens_with_a_backlog_of_1024(short_dir: str) -> None:
    """The broker listens with the default backlog: 1024 connections may wait to be
    accepted. Caught: the default made 1025."""
    sock = net.listen(os.path.join(short_dir, "b.sock"))
    try:
        assert _listen_backlog(sock) == 1024
    finally:
        sock.close()


def test_a_missing_directory_is_made_0755_even_where_a_default_acl_lets_all_write(
    short_dir: str,
) -> None:
    """Under a default ACL the umask does not apply, only ``makedirs``' mode: 0755 keeps the
    directory the broker makes its own, and the broker listens in it. Caught: the mode left
    out (0777 from the ACL: the broker refused the directory it had just made)."""
    # system.posix_acl_default, version 2: user::rwx, group::rwx, other::rwx
    acl = struct.pack("<I", 2) + b"".join(
        struct.pack("<HHI", tag, 7, 0xFFFFFFFF) for tag in (0x01, 0x04, 0x20))
    os.setxattr(short_dir, "system.posix_acl_default", acl)
    net.listen(os.path.join(short_dir, "run", "b.sock")).close()
    assert oct(stat.S_IMODE(os.stat(os.path.join(short_dir, "run")).st_mode)) == "0o755"


# ---- the listener ------------------------------------------------------------------------


class Scripted(socket.socket):
    """A socket whose ``accept`` gives, in turn, what ``outcomes`` holds (raising the
    exceptions), then nothing (``BlockingIOError``). Never connected, it is readable to the
    loop: the loop calls its listener at each turn."""

    outcomes: list[Any]

    def accept(self) -> Any:
        got = self.outcomes.pop(0) if self.outcomes else BlockingIOError()
        if isinstance(got, BaseException):
            raise got
        return got


def test_an_aborted_or_broken_connection_does_not_end_the_listeners_turn() -> None:
    """A connection gone before its accept (ECONNABORTED, EPROTO) is passed over: the ones
    behind it are accepted in the same turn of the loop (what each accept asks the loop to
    run next sees both), with no pause. Caught: ``continue`` made ``break`` (the turn ended
    at the first aborted connection)."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()

    async def main() -> tuple[list[Any], list[int], float, bool]:
        loop = asyncio.get_running_loop()
        accepted: list[Any] = []
        seen: list[int] = []

        def on_accept(conn: Any) -> None:
            accepted.append(conn)
            loop.call_soon(lambda: seen.append(len(accepted)))  # runs after this turn

        sock = Scripted(socket.AF_UNIX)
        sock.outcomes = [OSError(errno.ECONNABORTED, "aborted"), (a, None),
                         OSError(errno.EPROTO, "protocol"), (c, None), BlockingIOError()]
        listener = net.Listener(sock, on_accept)
        await until(lambda: len(seen) == 2, "both accepted")
        paused = listener.resumes_at is not None
        listener.close()
        return accepted, seen, listener.backoff_s, paused

    try:
        assert asyncio.run(main()) == ([a, c], [2, 2], 0.0, False)
    finally:
        for s in (a, b, c, d):
            s.close()


def test_an_accept_failure_not_about_resources_is_logged_without_the_cap_hint(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The line names the error in words (its errno's, else the error's own text) and adds
    the hint about the connection cap only for a lack of descriptors or memory. Caught: the
    hint added to every line, or "XXXX" in its place; an error without errno looked up by
    number (a TypeError) or named ``None``."""
    clock = [1000.0]
    monkeypatch.setattr(net, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    async def main() -> None:
        sock = Scripted(socket.AF_UNIX)
        sock.outcomes = [OSError(errno.EPERM, "denied"), OSError("no errno here")]
        listener = net.Listener(sock, lambda s: None)
        last = None
        for now in (1000.0, 1010.0):  # each failure after the last back-off ended
            clock[0] = now
            await until(lambda: listener.resumes_at not in (None, last), "a failed accept")
            last = listener.resumes_at
        listener.close()

    with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "accept failed (Operation not permitted); 1 failure(s) since the last note; "
        "pausing 0.05 s",
        "accept failed (no errno here); 1 failure(s) since the last note; pausing 0.10 s",
    ]


def test_the_first_accept_failure_is_logged_whatever_the_clock_reads(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A broker started within 10 s of the monotonic clock's zero (early in a boot, in a
    fresh time namespace) still notes its first failed accept at once. Caught: the time of
    the "last note" starting at 0 (the product's code before this test: the first failure
    went unlogged until the clock passed 10 s), at 1 or at +10."""
    monkeypatch.setattr(net, "time", types.SimpleNamespace(monotonic=lambda: 0.0))

    async def main() -> None:
        sock = Scripted(socket.AF_UNIX)
        sock.outcomes = [OSError(errno.EMFILE, os.strerror(errno.EMFILE))]
        listener = net.Listener(sock, lambda s: None)
        await until(lambda: listener.resumes_at is not None, "a failed accept")
        listener.close()

    with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == [
        "accept failed (Too many open files); 1 failure(s) since the last note; pausing "
        "0.05 s (out of descriptors: the connection cap is below the limit, see "
        "--max-connections)"]


def test_after_the_back_off_the_listener_accepts_again(short_dir: str) -> None:
    """Driven by the loop: a failed accept stops the watch on the listening socket; the
    back-off's timer, when it fires, watches it again, and the waiting connection is
    accepted. Caught: the timer given no callback (the listener never resumed), the watch
    resumed with no callback (the loop called ``None``)."""
    path = os.path.join(short_dir, "b.sock")

    class FailsOnce(socket.socket):
        failed = False

        def accept(self) -> Any:
            if not self.failed:
                self.failed = True
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return super().accept()

    async def main() -> tuple[int, bool, list[Any]]:
        loop = asyncio.get_running_loop()
        errors: list[Any] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        accepted: list[socket.socket] = []
        sock = FailsOnce(socket.AF_UNIX)
        sock.bind(path)
        sock.listen(8)
        listener = net.Listener(sock, accepted.append)
        client = socket.socket(socket.AF_UNIX)
        client.connect(path)
        # the loop sees the socket readable: the accept fails
        await until(lambda: listener.resumes_at is not None, "a failed accept")
        assert not accepted
        watched_while_paused = sock.fileno() in loop._selector.get_map()  # type: ignore[attr-defined]
        # the back-off's end, when the loop runs it: watched again, the connection accepted
        await until(lambda: accepted, "the waiting connection accepted")
        count = len(accepted)
        listener.close()
        for s in [client, *accepted]:
            s.close()
        return count, watched_while_paused, errors

    assert asyncio.run(main()) == (1, False, [])


# ---- a channel's end ---------------------------------------------------------------------


def test_a_fresh_channel_is_open_with_nothing_pending() -> None:
    """Caught: ``closed`` starting as ``None`` rather than ``False``."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> tuple[Any, int]:
        return chan.closed, chan.pending

    assert run_channel(body) == (False, 0)


def test_once_a_backlog_is_sent_the_socket_is_no_longer_watched_for_writing() -> None:
    """The write watch is set for a backlog and removed when it is sent (no busy loop of
    writable events on a channel with nothing to send). Caught: the writing flag set to
    ``None`` or ``False`` instead of ``True`` (the watch never removed), the watch removed
    for no descriptor (``remove_writer(None)``, the error suppressed)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        total = _fill(chan)
        fd = chan.sock.fileno()
        watched = fd in loop._selector.get_map()  # type: ignore[attr-defined]
        got = bytearray()
        loop.add_reader(peer.fileno(), lambda: got.extend(peer.recv(1 << 20)))
        try:
            assert await chan.drain(5.0) is True
            for _ in range(10_000):  # the last of it, from the kernel's buffer
                if len(got) >= total:
                    break
                await asyncio.sleep(0)
        finally:
            loop.remove_reader(peer.fileno())
        return watched, fd in loop._selector.get_map()  # type: ignore[attr-defined]

    assert run_channel(body, cap=1 << 22) == (True, False)


def test_a_channel_with_replies_pending_whose_socket_was_closed_first_still_shuts() -> None:
    """Its write watch cannot be removed by descriptor (the socket's is -1 now): shutting
    raises nothing. Caught: ValueError no longer suppressed, or ``None`` in its place (a
    TypeError)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> tuple[bool, list[str]]:
        _fill(chan)
        chan.sock.close()
        chan.shut()
        return chan.closed, ended

    assert run_channel(body, cap=1 << 22) == (True, [])


def test_a_channel_whose_descriptor_was_closed_behind_its_back_still_shuts() -> None:
    """Read and written (both watches set), its descriptor closed under the socket object:
    taking the write watch off fails in epoll with EBADF, and shutting raises nothing.
    Caught: OSError no longer suppressed, or ``None`` in its place (a TypeError)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bool:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, peer.sendall, b"a\n")
        await chan.readline(100)  # the socket is watched for input from now on
        _fill(chan)  # and for output
        os.close(chan.sock.fileno())
        try:
            chan.shut()
        finally:
            chan.sock.detach()  # the number is closed already
        return chan.closed

    assert run_channel(body, cap=1 << 22) is True


def test_close_gives_ten_seconds_by_default_and_a_second_close_keeps_the_first_deadline() -> None:
    """Closing with replies pending drops the connection if they are not sent within 10 s;
    closing again (a revoke, then a lapse) neither shortens nor adds a deadline. Caught: the
    default made 11 s, ``or`` made ``and`` (a second deadline set beside the first)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        loop = asyncio.get_running_loop()
        _fill(chan)
        before = loop.time()
        chan.close()
        after = loop.time()
        first = chan.drops_at
        assert first is not None
        assert before + 10.0 <= first <= after + 10.0
        chan.close(timeout_s=0.05)
        assert chan.drops_at == first  # the first deadline kept, no second one
        assert (chan.closed, ended) == (False, [])

    run_channel(body, cap=1 << 22)


# ---- who a uid is: when the subordinate uid file is read ---------------------------------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]
    monkeypatch.setattr(identity, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_the_first_lookup_reads_the_subuid_file_whatever_the_clock_reads(
    tmp_path: Path, clock: list[float],
) -> None:
    """A monotonic clock under a second (a fresh boot or time namespace) does not pass for
    "checked a moment ago". Caught: the stamp of a file never looked at starting as ``""``
    (not ``None``: the file was not read until a second had passed)."""
    path = tmp_path / "subuid"
    path.write_text(f"daemon:{FREE}:10\n")
    clock[0] = 0.5
    assert Accounts(str(path)).account(FREE + 1).name == "daemon"


def test_a_subuid_file_that_appears_is_read_at_the_next_check_a_second_later(
    tmp_path: Path, clock: list[float],
) -> None:
    """A missing file is looked at again once a second like any other, at exactly a second
    after the last look. Caught: a missing file's stamp made ``None`` (looked at on every
    lookup), ``<`` made ``<=`` (the check a second later skipped)."""
    path = tmp_path / "subuid"
    accounts = Accounts(str(path))
    assert accounts.account(FREE).key == UNKNOWN_KEY
    path.write_text(f"daemon:{FREE}:10\n")
    clock[0] = 1000.5
    assert accounts.account(FREE).key == UNKNOWN_KEY
    clock[0] = 1001.0
    assert accounts.account(FREE).name == "daemon"


def test_the_lookup_cache_is_emptied_when_it_reaches_its_bound(
    tmp_path: Path, clock: list[float], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At its bound (here 3) the cache is emptied before the next entry goes in: it never
    holds more. Caught: ``>=`` made ``>`` (a fourth entry kept)."""
    monkeypatch.setattr(identity, "_CACHE_MAX", 3)
    accounts = Accounts(str(tmp_path / "none"))
    sizes = []
    for uid in range(FREE, FREE + 4):
        accounts.account(uid)
        sizes.append(accounts.cached)
    assert sizes == [1, 2, 3, 1]


def test_a_subuid_file_of_exactly_its_bound_is_read_whole_without_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Caught: ``>`` made ``>=`` (a file of exactly the bound said to be larger)."""
    text = f"daemon:{FREE}:10\nbin:{FREE + 10}:5\n"
    monkeypatch.setattr(identity, "_MAX_SUBUID_BYTES", len(text))
    path = tmp_path / "subuid"
    path.write_text(text)
    with caplog.at_level("WARNING", logger="autogpu.broker"):
        got = identity._read_ranges(str(path))
    assert (got, caplog.records) == (
        [(FREE, FREE + 9, "daemon"), (FREE + 10, FREE + 14, "bin")], [])
