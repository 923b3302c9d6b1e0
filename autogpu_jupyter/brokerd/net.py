"""The broker's socket: where it listens, how it accepts, what it lets a connection cost.

**Listening.** The socket is created with its final mode by ``bind`` itself (under a umask of
``0o111``: mode 0666, every user may connect; identity comes from ``SO_PEERCRED``), never
``chmod``-ed by path afterwards: a path can be swapped for a symlink between two calls, and
root's ``chmod`` would follow it. Its directory must be a real directory owned by the broker's
user (root) and writable by nobody else, and so must be every directory above it unless it is
sticky (``/tmp``, ``/var/tmp``): a user who can rename or write there could put their own file
under the broker's name. Anything else is refused with one line naming the directory.

**Accepting.** Connections are accepted by :class:`Listener` (not ``asyncio.start_server``):
when the process is out of descriptors (``EMFILE``/``ENFILE``) or memory, it stops accepting for a
back-off that doubles up to :data:`MAX_BACKOFF_S` and logs one line per
:data:`LOG_EVERY_S` with a count, instead of one traceback per attempt. A global cap on open
connections (below the process's descriptor limit) keeps descriptors for the broker's own work,
and the last :data:`ROOT_RESERVE` connections are root's only: a host full of one user's sockets
still lets the admin run ``autogpu broker status`` and ``revoke``.

**Talking.** Each connection is a :class:`Channel` over its non-blocking socket, read with
``recv`` and written with ``send``, not an asyncio transport and stream: a message that came
with the connection (a pick sends ``begin`` right after ``connect``) is read at once, and a
reply the socket takes whole is sent at once, without extra turns of the event loop (a fresh
connection's first answer in half the time, measured in docs/benchmarks.md). Once a connection
first waits for a message, its socket stays watched by the loop until it ends (one
registration per connection, not one per message). What a client sends ahead is read at most
one message-size cap ahead (then reading pauses and the rest stays in the kernel's socket
buffer); what it does not read is kept up to a cap, past which (or past the sender's timeout)
the connection is dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import os
import resource
import socket
import stat
import time
from collections.abc import Callable

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "FD_RESERVE",
    "LOG_EVERY_S",
    "MAX_BACKOFF_S",
    "ROOT_RESERVE",
    "Channel",
    "Listener",
    "check_socket_dir",
    "connection_cap",
    "listen",
]

log = logging.getLogger("autogpu.broker")

#: Descriptors kept for the broker's own work (journal, /proc scans, the GPU library, logs).
FD_RESERVE = 64
#: Connections only root may use once the others are taken.
ROOT_RESERVE = 16
#: The cap on connections when the admin sets none: each costs the broker some memory, and no
#: host has this many kernels and picks at once.
DEFAULT_MAX_CONNECTIONS = 4096
#: The longest pause in accepting after running out of descriptors or memory.
MAX_BACKOFF_S = 1.0
#: At most one log line per this many seconds about refused or failed accepts.
LOG_EVERY_S = 10.0
_RESOURCE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def connection_cap(requested: int = 0) -> int:
    """The most connections the broker holds at once: ``requested`` (0:
    :data:`DEFAULT_MAX_CONNECTIONS`), never more than the descriptor limit less
    :data:`FD_RESERVE`.

    The soft ``RLIMIT_NOFILE`` is raised to the hard one first (systemd's default soft limit is
    1024; its hard one 524288)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    want = min(want, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    limit = (soft if soft != resource.RLIM_INFINITY else 65536) - FD_RESERVE
    cap = max(ROOT_RESERVE + 1, limit)
    return min(requested, cap) if requested > 0 else min(DEFAULT_MAX_CONNECTIONS, cap)


def check_socket_dir(parent: str) -> None:
    """Refuse (``SystemExit``, one line) a socket directory others could tamper with."""
    me = os.geteuid()
    st = os.lstat(parent)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SystemExit(
            f"autogpu broker: socket directory {parent} is a symlink or not a directory: "
            "refused; use a directory of root's, e.g. /run/autogpu"
        )
    if st.st_uid != me or stat.S_IMODE(st.st_mode) & 0o022:
        raise SystemExit(
            f"autogpu broker: socket directory {parent} is owned by uid {st.st_uid} with mode "
            f"{stat.S_IMODE(st.st_mode):04o}: refused (another user could swap the socket); "
            f"use a directory owned by uid {me} that only it can write (mode 0755), "
            "e.g. /run/autogpu"
        )
    path = os.path.dirname(os.path.abspath(parent))
    while True:
        st = os.stat(path)
        writable = stat.S_IMODE(st.st_mode) & 0o022
        sticky = st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, me) or (writable and not sticky):
            raise SystemExit(
                f"autogpu broker: socket directory {parent} lies under {path}, which uid "
                f"{st.st_uid} owns with mode {stat.S_IMODE(st.st_mode):04o}: refused (another "
                "user could replace the directory); use a path whose every directory is root's"
            )
        if path == "/":
            return
        path = os.path.dirname(path)


def listen(path: str, backlog: int = 1024) -> socket.socket:
    """A listening Unix socket at ``path``, mode 0666 from ``bind`` (see the module docstring).

    Raises
    ------
    SystemExit
        One line: the directory is unsafe, or ``path`` exists and is not a socket.
    """
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        old = os.umask(0o022)
        try:
            os.makedirs(parent, mode=0o755, exist_ok=True)
        finally:
            os.umask(old)
    check_socket_dir(parent)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise SystemExit(f"autogpu broker: {path} exists and is not a socket; remove it")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # The mode comes from bind itself: world-connectable (identity comes from SO_PEERCRED).
    old = os.umask(0o111)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(backlog)
    return sock


class Listener:
    """Accepts connections on ``sock`` and hands each to ``on_accept`` (see the module
    docstring: back-off on resource errors, one rate-limited log line)."""

    def __init__(self, sock: socket.socket, on_accept: Callable[[socket.socket], None]) -> None:
        self.sock = sock
        self.on_accept = on_accept
        self.loop = asyncio.get_running_loop()
        self.backoff_s = 0.0
        self.failed = 0  # accepts failed since the last log line
        self._last_log = -math.inf  # the first failure is noted, whatever the clock
        self._paused: asyncio.TimerHandle | None = None
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._on_readable)

    @property
    def resumes_at(self) -> float | None:
        """The loop time at which a listener paused by a failed accept watches its socket
        again (``None``: it watches it now)."""
        return None if self._paused is None else self._paused.when()

    def _on_readable(self) -> None:
        for _ in range(128):  # a bounded batch: others get the loop between batches
            try:
                conn, _addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                self._pause(err)
                return
            self.backoff_s = 0.0
            try:
                self.on_accept(conn)
            except Exception:  # one bad connection never stops the accepting
                log.exception("connection handling failed")
                conn.close()

    def _pause(self, err: OSError) -> None:
        self.failed += 1
        self.backoff_s = min(MAX_BACKOFF_S, max(0.05, self.backoff_s * 2))
        now = time.monotonic()
        if now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            why = os.strerror(err.errno) if err.errno else str(err)
            log.warning(
                "accept failed (%s); %d failure(s) since the last note; pausing %.2f s%s",
                why, self.failed, self.backoff_s,
                " (out of descriptors: the connection cap is below the limit, see "
                "--max-connections)" if err.errno in _RESOURCE_ERRNOS else "",
            )
            self.failed = 0
        self.loop.remove_reader(self.sock.fileno())
        self._paused = self.loop.call_later(self.backoff_s, self._resume)

    def _resume(self) -> None:
        self._paused = None
        self.loop.add_reader(self.sock.fileno(), self._on_readable)

    def close(self) -> None:
        if self._paused is not None:
            self._paused.cancel()
        with contextlib.suppress(ValueError, OSError):
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()


class Channel:
    """One client connection: lines in, bytes out, on the non-blocking socket ``sock``.

    ``cap`` bounds what the broker keeps for a client that does not read (past it the
    connection is dropped); ``on_end`` is called once when the channel is closed or dropped
    from outside the connection's own task (it stops that task: the task's end releases the
    connection's lock, lease and socket, see ``Broker.accepted``).
    """

    def __init__(self, sock: socket.socket, cap: int, on_end: Callable[[], object]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.cap = cap
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self._on_end = on_end
        self._in = bytearray()
        self._in_cap = 0  # past this many unread bytes, reading pauses (the last limit asked)
        self._reading = False  # the loop watches the socket for input
        self._eof = False
        self._error: OSError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._out = bytearray()
        self._writing = False
        self._closing: asyncio.TimerHandle | None = None
        self._flushed: asyncio.Future[None] | None = None

    # -- reading ---------------------------------------------------------------------------

    async def readline(self, limit: int) -> bytes:
        """The next line, with its newline; at the end of the stream, what is left (``b""``
        or a line without its newline).

        Input is read as it comes, once a first wait began (the socket stays watched: no
        registration per message), and never more than ``limit`` bytes ahead: past that,
        reading pauses and the rest waits in the kernel's socket buffer.

        Raises
        ------
        ValueError
            No newline within ``limit`` bytes (the message is too long).
        OSError
            The connection failed.
        """
        self._in_cap = limit
        while True:
            end = self._in.find(b"\n")
            if end >= 0:
                if end + 1 > limit:
                    raise ValueError(f"a line longer than {limit} bytes")
                line = bytes(self._in[: end + 1])
                del self._in[: end + 1]
                return line
            if len(self._in) > limit:
                raise ValueError(f"a line longer than {limit} bytes")
            if self._error is not None:
                raise self._error
            if self._eof:
                line = bytes(self._in)
                self._in.clear()
                return line
            if not self._reading and self._take():
                continue  # it was there already (a message that came with the connection)
            self._start_reading()
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _take(self) -> bool:
        """One ``recv`` into the input; ``False`` when nothing was there."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as err:
            self._error = err
            self._stop_reading()
            return True
        if data:
            self._in += data
            if len(self._in) > self._in_cap:
                self._stop_reading()  # the rest stays in the kernel until this is read
        else:
            self._eof = True
            self._stop_reading()
        return True

    def _on_readable(self) -> None:
        if self._take():
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _start_reading(self) -> None:
        if not self._reading and not self.closed:
            self.loop.add_reader(self.sock.fileno(), self._on_readable)
            self._reading = True

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_reader(self.sock.fileno())

    # -- writing ---------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Bytes written but not yet taken by the socket."""
        return len(self._out)

    @property
    def drops_at(self) -> float | None:
        """The loop time at which a channel closed with replies still unsent is dropped
        (``None``: not closing, or closed)."""
        return None if self._closing is None else self._closing.when()

    @property
    def buffered(self) -> int:
        """Bytes read from the socket but not yet taken by :meth:`readline` (what a client
        that sends without reading replies makes the broker hold)."""
        return len(self._in)

    def write(self, data: bytes) -> None:
        """Send ``data`` now if the socket takes it, else keep the rest for when it is
        writable; past ``cap`` kept bytes the connection is dropped. A closed channel drops
        it."""
        if self.closed or self._closing is not None:
            return
        if not self._out:
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.abort()
                return
            if sent == len(data):
                return
            data = data[sent:]
        if len(self._out) + len(data) > self.cap:
            log.warning("a client did not read %d bytes of replies: its connection is dropped",
                        len(self._out) + len(data))
            self.abort()
            return
        self._out += data
        if not self._writing:
            self.loop.add_writer(self.sock.fileno(), self._on_writable)
            self._writing = True

    def _on_writable(self) -> None:
        try:
            sent = self.sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.abort()
            return
        del self._out[:sent]
        if not self._out:
            self._stop_writing()
            if self._flushed is not None and not self._flushed.done():
                self._flushed.set_result(None)
            if self._closing is not None:
                self._end()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until everything written was taken by the socket; ``False`` when the channel
        was closed meanwhile.

        Raises
        ------
        TimeoutError
            The client did not read within ``timeout_s``: the connection was dropped.
        """
        if self._out and not self.closed:
            if self._flushed is None or self._flushed.done():
                self._flushed = self.loop.create_future()
            try:
                await asyncio.wait_for(asyncio.shield(self._flushed), timeout_s)
            except asyncio.TimeoutError:
                self.abort()
                raise TimeoutError(f"the client did not read within {timeout_s:g} s") from None
        return not self.closed

    # -- ending ----------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """End the connection once what was written is sent (within ``timeout_s``, else it
        is dropped)."""
        if self.closed or self._closing is not None:
            return
        if not self._out:
            self._end()
            return
        self._closing = self.loop.call_later(timeout_s, self.abort)

    def abort(self) -> None:
        """Drop the connection now, with whatever was not sent."""
        self._out.clear()
        self._end()

    def _end(self) -> None:
        if self.closed:
            return
        self.shut()
        self._on_end()

    def shut(self) -> None:
        """Mark the channel closed and stop writing (the socket itself is closed by whoever
        ends the connection's task, once no read is pending on it)."""
        self.closed = True
        self._stop_writing()
        self._stop_reading()
        if self._closing is not None:
            self._closing.cancel()
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            with contextlib.suppress(ValueError, OSError):
                self.loop.remove_writer(self.sock.fileno())
