"""The broker's socket (autogpu_jupyter.brokerd.net): made with its mode at bind in a directory
only its user can write, accepted with a back-off and one log line when descriptors run out,
and the connection cap below the descriptor limit. Real sockets, real directories, a real
``RLIMIT_NOFILE`` (in a forked child).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.brokerd import net


async def until(cond: Any, what: str) -> None:
    """Let the loop run (it calls a listener when its socket is readable, a back-off's end when
    due) until ``cond()`` holds; a bound, not a measure: at most 5 s."""
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"the loop never got there: {what}")

ROOT = os.geteuid() == 0


def _in_child(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a forked child (process-wide limits and umask stay there)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.write(w, json.dumps(fn(*args)).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


def test_the_socket_gets_mode_0666_from_bind_whatever_the_umask(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)

    def make(umask: int) -> list[int]:
        os.umask(umask)
        sock = net.listen(str(run / "b.sock"))
        mode = stat.S_IMODE(os.lstat(run / "b.sock").st_mode)
        sock.close()
        return [mode, os.umask(0)]

    for umask in (0o022, 0o077, 0o000):
        mode, left = _in_child(make, umask)
        assert (oct(mode), left) == ("0o666", umask)  # the umask is given back


def test_a_missing_directory_is_made_0755_and_a_stale_socket_replaced(tmp_path: Path) -> None:
    path = tmp_path / "new" / "b.sock"

    def make() -> list[int]:
        os.umask(0o077)
        first = net.listen(str(path))
        first.close()  # a broker gone, its socket file left
        second = net.listen(str(path))
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
        second.close()
        return [stat.S_IMODE(os.stat(path.parent).st_mode)]

    assert _in_child(make) == [0o755]


def test_a_file_in_the_sockets_place_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    (run / "b.sock").write_text("mine")
    with pytest.raises(SystemExit) as err:
        net.listen(str(run / "b.sock"))
    assert str(err.value) == (
        f"autogpu broker: {run / 'b.sock'} exists and is not a socket; remove it")
    assert (run / "b.sock").read_text() == "mine"


@pytest.mark.parametrize("mode", [0o775, 0o757, 0o777])
def test_a_directory_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, mode)
    with pytest.raises(SystemExit) as err:
        net.listen(str(run / "b.sock"))
    me = os.geteuid()
    assert str(err.value) == (
        f"autogpu broker: socket directory {run} is owned by uid {me} with mode {mode:04o}: "
        "refused (another user could swap the socket); use a directory owned by uid "
        f"{me} that only it can write (mode 0755), e.g. /run/autogpu")
    assert not (run / "b.sock").exists()


def test_a_symlinked_directory_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(SystemExit) as err:
        net.check_socket_dir(str(tmp_path / "link"))
    assert str(err.value).startswith(
        f"autogpu broker: socket directory {tmp_path / 'link'} is a symlink or not a directory")


@pytest.mark.skipif(not ROOT, reason="needs root to give a directory to another uid")
def test_a_directory_another_user_owns_or_one_above_it_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    os.chown(run, 12345, 12345)
    with pytest.raises(SystemExit) as err:
        net.check_socket_dir(str(run))
    assert "is owned by uid 12345 with mode 0755: refused" in str(err.value)
    os.chown(run, 0, 0)
    above = tmp_path / "above"
    above.mkdir(mode=0o755)
    (above / "run").mkdir(mode=0o755)
    os.chown(above, 12345, 12345)  # its owner could rename run/ and put its own in place
    with pytest.raises(SystemExit) as err2:
        net.check_socket_dir(str(above / "run"))
    assert str(err2.value) == (
        f"autogpu broker: socket directory {above / 'run'} lies under {above}, which uid "
        "12345 owns with mode 0755: refused (another user could replace the directory); use "
        "a path whose every directory is root's")
    os.chown(above, 0, 0)
    os.chmod(above, 0o1777)  # sticky and world-writable (as /tmp): a user cannot rename run/
    net.check_socket_dir(str(above / "run"))
    os.chmod(above, 0o777)
    with pytest.raises(SystemExit):
        net.check_socket_dir(str(above / "run"))


def test_the_connection_cap_stays_below_the_descriptor_limit() -> None:
    def caps(soft: int, hard: int, requested: int) -> list[int]:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        cap = net.connection_cap(requested)
        return [cap, resource.getrlimit(resource.RLIMIT_NOFILE)[0]]

    # the soft limit is raised to the hard one first; 64 are kept for the broker's own files
    assert _in_child(caps, 256, 1024, 0) == [1024 - 64, 1024]
    assert _in_child(caps, 1024, 1024, 100) == [100, 1024]
    assert _in_child(caps, 1024, 1024, 5000) == [1024 - 64, 1024]
    assert _in_child(caps, 8192, 8192, 0) == [net.DEFAULT_MAX_CONNECTIONS, 8192]
    assert _in_child(caps, 70, 70, 0) == [net.ROOT_RESERVE + 1, 70]  # never below the reserve


def test_out_of_descriptors_the_listener_backs_off_and_logs_once(tmp_path: Path) -> None:
    """A process at its descriptor limit: accept fails with EMFILE. The listener stops
    accepting for a back-off (doubling to 1 s) and says so in one line, not once per try; when
    descriptors are back, the waiting connections are accepted."""

    def run(path: str) -> dict[str, Any]:
        records: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        logging.getLogger("autogpu.broker").addHandler(Keep())
        accepted: list[socket.socket] = []

        async def main() -> dict[str, Any]:
            listener = net.Listener(net.listen(path), accepted.append)
            clients = [socket.socket(socket.AF_UNIX) for _ in range(5)]
            used = len(os.listdir("/proc/self/fd"))
            resource.setrlimit(resource.RLIMIT_NOFILE, (used + 8, used + 100))
            spare = []
            while True:  # every descriptor number left: taken
                try:
                    spare.append(os.open("/dev/null", os.O_RDONLY))
                except OSError:
                    break
            for c in clients:
                c.setblocking(False)
                try:
                    c.connect(path)
                except BlockingIOError:
                    pass
            await asyncio.sleep(0.5)  # every accept fails: EMFILE
            during = (len(accepted), listener.backoff_s, len(records))
            for fd in spare[:3]:  # three descriptors back
                os.close(fd)
            await asyncio.sleep(1.5)
            listener.close()
            return {"during": during, "after": len(accepted), "log": records}

        return asyncio.run(main())

    got = _in_child(run, str(tmp_path / "b.sock"))
    accepted, backoff, logged = got["during"]
    assert accepted == 0 and 0.05 <= backoff <= net.MAX_BACKOFF_S, got
    assert logged == 1, got["log"]
    assert got["log"][0].startswith("accept failed (Too many open files); 1 failure(s) since "
                                    "the last note; pausing 0.05 s (out of descriptors")
    assert got["after"] == 3, got  # as many as the freed descriptors allow


def test_a_listener_closed_twice_stays_closed(tmp_path: Path) -> None:
    """Closing is idempotent: the second close (its socket already closed, so no descriptor to
    stop watching) raises nothing."""

    async def main() -> bool:
        listener = net.Listener(net.listen(str(tmp_path / "c.sock")), lambda s: s.close())
        listener.close()
        listener.close()
        return listener.sock.fileno() == -1

    assert asyncio.run(main()) is True


# ---- the same rules in this process (the forked children above are not seen by mutmut) ----


class FakeLimits:
    """``resource`` for RLIMIT_NOFILE: ``setrlimit`` refuses a soft limit above the hard one
    with ValueError, as the real one does (and every raise where ``refuse`` is set)."""

    RLIMIT_NOFILE = resource.RLIMIT_NOFILE
    RLIM_INFINITY = resource.RLIM_INFINITY

    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == self.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == self.RLIMIT_NOFILE
        soft, hard = limits
        if self.refuse or (hard != self.RLIM_INFINITY and soft > hard):
            raise ValueError("current limit exceeds maximum limit")
        self.soft, self.hard = soft, hard


def test_the_cap_raises_the_soft_limit_to_the_hard_one_or_follows_a_refused_raise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: the hard limit ignored (65536 asked for, refused, the cap left at the soft
    limit), the raise called without its limits, ValueError no longer suppressed (a refused
    raise stopped the broker)."""
    limits = FakeLimits(256, 1024)
    monkeypatch.setattr(net, "resource", limits)
    assert (net.connection_cap(0), limits.soft) == (1024 - net.FD_RESERVE, 1024)
    refused = FakeLimits(256, 1024, refuse=True)
    monkeypatch.setattr(net, "resource", refused)
    assert (net.connection_cap(0), refused.soft) == (256 - net.FD_RESERVE, 256)


def test_without_a_soft_limit_the_cap_counts_65536_descriptors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: 65537 counted for an unlimited soft limit."""
    unlimited = FakeLimits(resource.RLIM_INFINITY, resource.RLIM_INFINITY)
    monkeypatch.setattr(net, "resource", unlimited)
    assert net.connection_cap(100_000) == 65536 - net.FD_RESERVE
    assert unlimited.soft == resource.RLIM_INFINITY  # nothing to raise


def test_the_listener_accepts_at_most_128_connections_per_turn() -> None:
    """A bounded batch: 130 waiting connections take two turns of the loop, 128 then 2 (what
    each accept asks the loop to run next runs once the turn is over: it counts the accepted
    connections then). Caught: a batch of 129."""
    where = tempfile.mkdtemp(prefix="agn-", dir="/tmp")  # a socket path has at most 107 bytes
    path = os.path.join(where, "b.sock")
    accepted: list[socket.socket] = []
    clients = []

    async def main() -> list[int]:
        loop = asyncio.get_running_loop()
        seen: list[int] = []

        def on_accept(conn: socket.socket) -> None:
            accepted.append(conn)
            loop.call_soon(lambda: seen.append(len(accepted)))  # runs after this turn

        for _ in range(130):
            c = socket.socket(socket.AF_UNIX)
            clients.append(c)
        listener = net.Listener(net.listen(path, backlog=256), on_accept)
        for c in clients:
            c.connect(path)
        await until(lambda: len(seen) == 130, "130 accepted")
        listener.close()
        return sorted(set(seen))

    try:
        assert asyncio.run(main()) == [128, 130]
    finally:
        for s in accepted + clients:
            s.close()
        os.unlink(path)
        os.rmdir(where)


def test_a_failing_accept_pauses_and_is_logged_once_per_ten_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """EMFILE from accept: the listener stops watching its socket for a back-off that doubles,
    and says so in one line with a count, at most once per :data:`LOG_EVERY_S` (one at
    exactly that long after the last). Caught: the error not passed on (no line, a crash),
    no errno for its words, the pause called without its delay, ``>=`` made ``>``."""
    import errno
    import types

    clock = [1000.0]
    monkeypatch.setattr(net, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    class OutOfDescriptors(socket.socket):
        def accept(self) -> Any:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        listener = net.Listener(OutOfDescriptors(socket.AF_UNIX), lambda s: None)
        delays: list[float] = []
        last = None
        for now in (1000.0, 1009.99, 1010.0):  # each failure after the last back-off ended
            clock[0] = now
            before = loop.time()
            await until(lambda: listener.resumes_at not in (None, last), "a failed accept")
            after = loop.time()
            last = listener.resumes_at
            assert last is not None  # resumed after the back-off:
            assert before + listener.backoff_s <= last <= after + listener.backoff_s
            delays.append(listener.backoff_s)
        listener.close()
        return delays

    with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
        delays = asyncio.run(main())
    assert delays == [0.05, 0.1, 0.2]
    suffix = (" (out of descriptors: the connection cap is below the limit, see "
              "--max-connections)")
    assert [r.getMessage() for r in caplog.records] == [
        f"accept failed (Too many open files); 1 failure(s) since the last note; pausing "
        f"0.05 s{suffix}",
        f"accept failed (Too many open files); 2 failure(s) since the last note; pausing "
        f"0.20 s{suffix}",
    ]


def test_a_connection_whose_handling_fails_is_closed_logged_and_the_next_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One bad connection never stops the accepting: its socket is closed, the failure logged
    with its traceback. Caught: the log line's text replaced by ``None``."""
    where = tempfile.mkdtemp(prefix="agn-", dir="/tmp")  # a socket path has at most 107 bytes
    path = os.path.join(where, "b.sock")
    handed: list[socket.socket] = []

    def on_accept(conn: socket.socket) -> None:
        handed.append(conn)
        if len(handed) == 1:
            raise RuntimeError("a bad connection")

    async def main() -> None:
        listener = net.Listener(net.listen(path), on_accept)
        clients = [socket.socket(socket.AF_UNIX) for _ in range(2)]
        for c in clients:
            c.connect(path)
        await until(lambda: len(handed) == 2, "both handed on")
        listener.close()
        for c in clients:
            c.close()

    try:
        with caplog.at_level(logging.ERROR, logger="autogpu.broker"):
            asyncio.run(main())
    finally:
        os.unlink(path)
        os.rmdir(where)
    assert len(handed) == 2
    assert handed[0].fileno() == -1 and handed[1].fileno() != -1  # the bad one closed
    handed[1].close()
    assert [(r.getMessage(), r.exc_info is not None) for r in caplog.records] == [
        ("connection handling failed", True)]


def test_a_closed_listener_stops_watching_its_socket(tmp_path: Path) -> None:
    """Caught: the watch left behind (``remove_reader`` given no descriptor; the loop kept a
    closed descriptor, later reused by another socket, in its selector)."""

    async def main() -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        listener = net.Listener(net.listen(str(tmp_path / "w.sock")), lambda s: s.close())
        fd = listener.sock.fileno()
        watched = fd in loop._selector.get_map()  # type: ignore[attr-defined]
        listener.close()
        return watched, fd in loop._selector.get_map()  # type: ignore[attr-defined]

    assert asyncio.run(main()) == (True, False)


def test_a_missing_directory_is_made_0755_in_this_process_whatever_the_umask(
    tmp_path: Path,
) -> None:
    """The same as in a child above, in this process (so a run that maps tests to the code
    they reach sees it). Caught: the umask while making the directory changed from 0o022
    (0o023: a directory 0754 that others could not enter to connect)."""
    path = tmp_path / "fresh" / "b.sock"
    old = os.umask(0o077)
    try:
        net.listen(str(path)).close()
    finally:
        os.umask(old)
    assert oct(stat.S_IMODE(os.stat(path.parent).st_mode)) == "0o755"


def test_a_directory_made_by_another_broker_at_the_same_moment_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two brokers (or systemd and a broker) start at once: the socket directory missing
    when one looks is made by the other before it makes it itself. It listens there all the
    same. Caught: the directory made without ``exist_ok`` (the broker stopped with
    FileExistsError)."""
    path = tmp_path / "raced" / "b.sock"
    real_isdir = os.path.isdir

    def isdir(p: Any) -> bool:
        if os.fspath(p) == str(path.parent) and not real_isdir(p):
            os.mkdir(p, 0o755)  # the other one, between this one's look and its makedirs
            return False
        return real_isdir(p)

    monkeypatch.setattr(os.path, "isdir", isdir)  # the os.path net looks with
    sock = net.listen(str(path))
    try:
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
    finally:
        sock.close()
    assert oct(stat.S_IMODE(os.stat(path.parent).st_mode)) == "0o755"


def test_an_accept_that_succeeds_ends_the_back_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failed accept (back-off 0.05 s) one that succeeds resets the back-off: the
    next failure pauses 0.05 s again, not more. Caught: the reset made 1.0 (the next failure
    paused 2 s although the last accept had worked)."""
    import errno
    import types

    monkeypatch.setattr(net, "time", types.SimpleNamespace(monotonic=lambda: 1000.0))
    a, b = socket.socketpair()
    outcomes: list[Any] = [OSError(errno.EMFILE, "EMFILE"), (a, None),
                           BlockingIOError(), OSError(errno.EMFILE, "EMFILE")]

    class Flaky(socket.socket):  # readable to the loop (a socket never connected)
        def accept(self) -> Any:
            got = outcomes.pop(0) if outcomes else BlockingIOError()
            if isinstance(got, BaseException):
                raise got
            return got

    async def main() -> tuple[list[float], list[Any]]:
        accepted: list[Any] = []
        backoffs: list[float] = []

        def on_accept(conn: Any) -> None:
            accepted.append(conn)
            backoffs.append(listener.backoff_s)  # as the accept that worked left it

        listener = net.Listener(Flaky(socket.AF_UNIX), on_accept)
        await until(lambda: listener.resumes_at is not None, "the first failure")
        backoffs.insert(0, listener.backoff_s)
        await until(lambda: accepted and listener.resumes_at is not None, "the next failure")
        backoffs.append(listener.backoff_s)
        listener.close()
        return backoffs, accepted

    try:
        backoffs, accepted = asyncio.run(main())
    finally:
        a.close()
        b.close()
    assert backoffs == [0.05, 0.0, 0.05]
    assert accepted == [a]
