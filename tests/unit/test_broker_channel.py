"""The broker's connection channel (autogpu_jupyter.brokerd.net.Channel) over a real socket
pair: lines in (bounded), bytes out at once or kept up to a cap, a client that does not read
dropped, a close that sends what was written first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from autogpu_jupyter.brokerd.net import Channel

Body = Callable[[Channel, socket.socket, list[str]], Awaitable[Any]]


def run(body: Body, cap: int = 1024) -> Any:
    """``body(channel, client_end, ended)`` on a fresh loop; ``ended`` collects on_end calls."""

    async def main() -> Any:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ended: list[str] = []
        chan = Channel(ours, cap, lambda: ended.append("end"))
        try:
            return await body(chan, theirs, ended)
        finally:
            chan.shut()
            ours.close()
            theirs.close()

    return asyncio.run(main())


def test_lines_come_one_at_a_time_and_the_end_gives_what_is_left() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> list[bytes]:
        peer.sendall(b'{"op": "a"}\n{"op": "b"}\npartial')
        got = [await chan.readline(100), await chan.readline(100)]
        peer.shutdown(socket.SHUT_WR)
        got += [await chan.readline(100), await chan.readline(100)]
        return got

    assert run(body) == [b'{"op": "a"}\n', b'{"op": "b"}\n', b"partial", b""]


def test_a_line_is_waited_for_across_reads() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bytes:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, peer.sendall, b"hel")
        loop.call_later(0.02, peer.sendall, b"lo\n")
        return await chan.readline(100)

    assert run(body) == b"hello\n"


@pytest.mark.parametrize(
    ("sent", "limit"),
    [(b"x" * 11, 10), (b"x" * 10 + b"\n", 10), (b"x" * 200 + b"\n", 10)],
)
def test_a_line_past_the_limit_is_refused(sent: bytes, limit: int) -> None:
    """No newline within ``limit`` bytes, or one past it: refused, not buffered on."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        peer.sendall(sent)
        with pytest.raises(ValueError, match=f"longer than {limit} bytes"):
            await chan.readline(limit)

    run(body)


def test_a_line_of_exactly_the_limit_is_read() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bytes:
        peer.sendall(b"x" * 9 + b"\n")
        return await chan.readline(10)

    assert run(body) == b"x" * 9 + b"\n"


def test_a_write_the_socket_takes_is_sent_at_once() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bytes:
        chan.write(b"reply\n")
        assert chan.pending == 0
        assert await chan.drain(1.0) is True
        return peer.recv(100)

    assert run(body) == b"reply\n"


def _fill(chan: Channel) -> int:
    """Write until the socket takes no more; how many bytes were written in all."""
    total = 0
    while chan.pending == 0 and not chan.closed:
        chan.write(b"y" * 4096)
        total += 4096
    return total


def test_what_the_socket_does_not_take_is_kept_and_sent_when_the_client_reads() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> tuple[int, int]:
        total = _fill(chan)
        chan.write(b"tail\n")
        assert chan.pending > 0
        loop = asyncio.get_running_loop()
        got = bytearray()

        def read() -> None:
            got.extend(peer.recv(1 << 20))

        loop.add_reader(peer.fileno(), read)
        try:
            assert await chan.drain(5.0) is True
            while len(got) < total + 5:
                await asyncio.sleep(0.01)
        finally:
            loop.remove_reader(peer.fileno())
        assert got.endswith(b"tail\n") and ended == []
        return len(got), chan.pending

    total, pending = run(body, cap=1 << 22)
    assert pending == 0 and total > 0


def test_a_client_that_does_not_read_past_the_cap_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Dropped, and logged with what it left unread. Caught: the log line's text changed."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        _fill(chan)
        kept = chan.pending
        assert 0 < kept <= 8192 and not chan.closed
        chan.write(b"z" * (8192 - kept))  # exactly at the cap: kept
        assert chan.pending == 8192 and ended == []
        chan.write(b"z")  # one byte past the cap
        assert chan.closed and chan.pending == 0
        assert ended == ["end"]
        chan.write(b"more")  # a dropped channel sends nothing more
        assert chan.pending == 0

    with caplog.at_level(logging.WARNING, logger="autogpu.broker"):
        run(body, cap=8192)
    assert [r.getMessage() for r in caplog.records] == [
        "a client did not read 8193 bytes of replies: its connection is dropped"]


def test_a_reply_not_read_in_time_drops_the_connection() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        _fill(chan)
        with pytest.raises(TimeoutError, match=r"did not read within 0.05 s"):
            await chan.drain(0.05)
        assert chan.closed and ended == ["end"]

    run(body, cap=1 << 22)


def test_close_sends_what_was_written_first_then_ends() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        total = _fill(chan)
        chan.close(timeout_s=5.0)
        assert not chan.closed and ended == []  # still sending what was written
        chan.write(b"after close")  # refused: the channel is closing
        peer.setblocking(False)
        loop = asyncio.get_running_loop()
        got = 0
        while got < total:
            got += len(await loop.sock_recv(peer, 1 << 20))
        assert got == total  # everything written before the close, nothing after
        assert chan.closed and ended == ["end"]
        chan.close()  # once closed, nothing more happens
        chan.abort()
        assert ended == ["end"]

    run(body, cap=1 << 22)


def test_close_of_a_channel_that_does_not_drain_drops_it_after_the_timeout() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        _fill(chan)
        chan.close(timeout_s=0.05)
        assert ended == []
        for _ in range(100):
            if ended:
                break
            await asyncio.sleep(0.01)
        assert ended == ["end"] and chan.closed and chan.pending == 0

    run(body, cap=1 << 22)


def test_close_with_nothing_pending_ends_at_once_and_a_lost_client_is_dropped() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        chan.close()
        assert chan.closed and ended == ["end"]

    run(body)

    async def lost(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        peer.close()
        chan.write(b"to nobody\n")
        assert chan.closed and ended == ["end"]

    run(lost)


def test_input_sent_ahead_is_read_at_most_a_limit_ahead_and_the_rest_stays_in_the_kernel() -> None:
    """A client that floods lines while the channel watches its socket: the channel keeps at
    most one ``limit`` (plus one read) of them, pauses, leaves the rest in the socket buffer,
    and reads on as the lines are taken. Caught: reading never paused (a flood held in the
    broker's memory), or never resumed after a pause (the connection stuck)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        peer.setblocking(False)
        loop = asyncio.get_running_loop()
        line = b"x" * 99 + b"\n"
        sent = [0]

        def flood() -> None:
            with contextlib.suppress(BlockingIOError):
                while sent[0] < 1 << 22:
                    sent[0] += peer.send(line * 64)

        loop.call_later(0.01, flood)
        assert await chan.readline(100) == line  # waited: the socket is watched now
        for _ in range(20):  # the loop runs the reader as often as it likes
            await asyncio.sleep(0)
        assert chan.buffered <= 100 + 65536
        got = 1
        while got * 100 < sent[0]:
            assert await asyncio.wait_for(chan.readline(100), 5) == line
            got += 1
            assert chan.buffered <= 100 + 65536
        assert got * 100 == sent[0]

    run(body)


def test_a_line_that_is_there_is_read_without_a_turn_of_the_loop() -> None:
    """A message that came with the connection (``begin`` right after ``connect``) is read at
    once. Caught: a first wait for the loop anyway (a turn of the loop per connection)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bytes:
        peer.sendall(b"begin\n")
        coro = chan.readline(100)
        with pytest.raises(StopIteration) as done:
            coro.send(None)
        return done.value.value  # type: ignore[no-any-return]

    assert run(body) == b"begin\n"


def test_empty_lines_and_a_last_line_of_exactly_the_limit_without_newline() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> list[bytes]:
        peer.sendall(b"\n\n" + b"x" * 10)
        peer.shutdown(socket.SHUT_WR)
        return [await chan.readline(10), await chan.readline(10), await chan.readline(10)]

    assert run(body) == [b"\n", b"\n", b"x" * 10]  # the end: what is left, not "too long"


def test_input_that_comes_while_nobody_reads_is_kept_without_an_error() -> None:
    """The socket stays watched between messages: what arrives while the connection's task
    handles a message is read into the channel, and the loop's callback raises nothing."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> list[Any]:
        loop = asyncio.get_running_loop()
        errors: list[Any] = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        loop.call_later(0.01, peer.sendall, b"one\n")
        assert await chan.readline(100) == b"one\n"
        peer.sendall(b"two\n")
        for _ in range(3):
            await asyncio.sleep(0.01)  # nobody waits: the reader runs
        assert chan.buffered == len(b"two\n")  # read, kept for the next readline
        assert await chan.readline(100) == b"two\n"
        return errors

    assert run(body) == []


def test_a_channel_whose_socket_was_closed_first_still_shuts() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bool:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, peer.sendall, b"a\n")
        await chan.readline(100)  # watched
        chan.sock.close()
        chan.shut()
        return chan.closed

    assert run(body) is True


def test_the_end_and_a_failure_wake_a_waiting_read() -> None:
    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> bytes:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, peer.sendall, b"half")
        loop.call_later(0.02, peer.shutdown, socket.SHUT_WR)
        return await chan.readline(100)

    assert run(body) == b"half"

    async def reset(chan: Channel, peer: socket.socket, ended: list[str]) -> None:
        # a peer that closes with our reply unread: the kernel resets the connection
        loop = asyncio.get_running_loop()
        chan.write(b"unread reply\n")
        loop.call_later(0.01, peer.close)
        with pytest.raises(ConnectionResetError):
            await chan.readline(100)
        with pytest.raises(ConnectionResetError):  # and says so again, not b""
            await chan.readline(100)

    run(reset)


def test_a_shut_channel_stops_watching_its_socket() -> None:
    """Once a read waited, the socket stays watched (one registration per connection); the
    end of the channel removes it, before its socket is closed. Caught: the watch left behind
    (the loop polling a closed, then reused, descriptor)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> tuple[bool, bool]:
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, peer.sendall, b"a\n")
        await chan.readline(100)
        loop.call_later(0.01, peer.sendall, b"b\n")
        await chan.readline(100)
        fd = chan.sock.fileno()
        watched = fd in loop._selector.get_map()  # type: ignore[attr-defined]
        chan.shut()
        return watched, fd in loop._selector.get_map()  # type: ignore[attr-defined]

    assert run(body) == (True, False)


def test_a_backlog_sent_once_does_not_stop_a_later_backlog_from_being_sent() -> None:
    """Replies the socket does not take are kept and sent when it is writable, again after a
    first backlog went out. Caught: the writing flag left set once the first backlog was sent
    (the second was never watched for: the client waited for its reply until the timeout)."""

    async def body(chan: Channel, peer: socket.socket, ended: list[str]) -> list[int]:
        loop = asyncio.get_running_loop()
        got = bytearray()

        def read() -> None:
            got.extend(peer.recv(1 << 20))

        sizes = []
        for _ in range(2):
            total = _fill(chan) + 5
            chan.write(b"tail\n")
            assert chan.pending > 0
            got.clear()
            loop.add_reader(peer.fileno(), read)
            try:
                assert await chan.drain(5.0) is True
                while len(got) < total:
                    await asyncio.sleep(0.01)
            finally:
                loop.remove_reader(peer.fileno())
            assert got.endswith(b"tail\n") and chan.pending == 0
            sizes.append(len(got) - total)
        assert ended == [] and not chan.closed
        return sizes

    assert run(body, cap=1 << 22) == [0, 0]
