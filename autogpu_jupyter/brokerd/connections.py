"""The life of a broker connection: accepted (or refused at the caps), served message by
message, answered, ended.

Identity comes only from the kernel (``SO_PEERCRED``). A connection is admitted while its
person (:mod:`autogpu_jupyter.brokerd.identity`) holds fewer than its cap and the broker fewer
than its own (the last :data:`autogpu_jupyter.brokerd.net.ROOT_RESERVE` kept for root); else
it gets one line and is closed. Each message is one JSON line: throttled per person, checked
against the protocol (the first message's version), run through the op table
(:data:`autogpu_jupyter.brokerd.ops.OPS`), answered. However the connection ends, its lock,
its lease or ticket and its socket end with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import socket
import struct
import time
from collections import Counter
from typing import Any

from autogpu_jupyter._version import __version__
from autogpu_jupyter.brokerd import net, peers
from autogpu_jupyter.brokerd.book import BrokerRefusal
from autogpu_jupyter.brokerd.identity import Account, tenant_key
from autogpu_jupyter.brokerd.ops import OLDER, OPS, RecordReply, before, older_reply
from autogpu_jupyter.brokerd.views import encoded_line
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.leasing.wire import (
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL,
    WIRE_STORE_ERROR,
    WIRE_UNTRUSTED,
)

__all__ = ["Conn", "Connections", "OUT_BUFFER_BYTES", "peer_credentials"]

log = logging.getLogger("autogpu.broker")

#: What the broker keeps for a client that does not read, beyond one reply of at most
#: ``MAX_REPLY_BYTES`` (unsolicited notices): past it the connection is dropped. A reply not
#: read within ``send_timeout_s`` drops it too.
OUT_BUFFER_BYTES = 64 * 1024


class Conn:
    """One client connection and what it holds.

    Setting :attr:`record` puts the change in the lease book (which journals it, written
    before its reply)."""

    def __init__(
        self, broker: Any, uid: int, gid: int, pid: int, account: Account,
        writer: net.Channel | None = None,
    ) -> None:
        self.broker = broker
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.account = account
        self.writer: net.Channel = writer  # type: ignore[assignment]
        self._record: LeaseRecord | None = None
        self.holder_pids: list[tuple[int, int]] = []  # (pid, start time)
        #: The peer's socket inode and the connecting process as (pid, start time): read once,
        #: neither changes while the connection is open (see ``Restorer.holder_ids``).
        self.ids: tuple[int | None, list[tuple[int, int]]] | None = None
        self.granted: asyncio.Future[None] | None = None
        self.lock_handle: asyncio.TimerHandle | None = None
        self.greeted = False  # the first message's protocol was checked
        self.proto = PROTOCOL  # the protocol the client speaks (its first message's)
        self.granted_at = 0.0  # when it was last given the pick lock (monotonic)
        #: The pid its records show: the connecting process's pid in its own pid namespace
        #: (a tenant's container sees its own pids; ``pid`` stays the host's).
        self.shown_pid = pid

    @property
    def root(self) -> bool:
        """Root's exemptions: uid 0 on the main socket only (a tenant is never root)."""
        return self.uid == 0 and not self.account.tenant

    @property
    def record(self) -> LeaseRecord | None:
        return self._record

    @record.setter
    def record(self, rec: LeaseRecord | None) -> None:
        old, self._record = self._record, rec
        try:
            self.broker.book.record_changed(self, old, rec)
        except BrokerRefusal:  # not journaled: not granted (nor changed); the book undid it
            ended = old is not None and (rec is None or rec.lease_id != old.lease_id)
            self._record = None if ended else old
            raise

    @property
    def key(self) -> int:
        return self.account.key

    @property
    def user(self) -> str:
        return self.account.name

    @property
    def groups(self) -> set[str]:
        return set(self.account.groups)


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (``SO_PEERCRED``)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3I"))
    pid, uid, gid = struct.unpack("3I", data)  # unsigned: a uid may be >= 2**31
    return pid, uid, gid


class Connections:
    """The broker's open connections, their caps, and the serving of each."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.config = broker.config
        self.conns: set[Conn] = set()
        self.per_key: Counter[int] = Counter()  # open connections per account
        self.buckets: dict[int, list[float]] = {}  # account -> [tokens, last refill]
        self.paced = 0  # messages that waited for their person's rate (status: messages_paced)
        self.conn_cap = net.connection_cap(self.config.max_connections)
        self.refused = 0  # connections refused since the last log line
        self._refused_logged = -math.inf  # the first refusal is logged, whatever the clock

    def accepted(self, sock: socket.socket, tenant: Any = None) -> None:
        """A new connection (from :class:`net.Listener`): admitted, or refused with one line
        when the caps are reached (per person; in all, the last ones kept for root). On a
        tenant's socket (``tenant``: a :class:`~autogpu_jupyter.brokerd.tenants.Tenant`) the
        caller *is* that tenant, whatever its uid (issue 40)."""
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        if tenant is not None:
            account = tenant.account(tenant_key(tenant.name))
        else:
            account = self.broker.accounts.account(uid)
        why = self.refusal(uid, account)
        if why is not None:
            self.refuse(sock, uid, why)
            return
        conn = Conn(self.broker, uid, gid, pid, account)
        if tenant is not None:
            conn.shown_pid = peers.ns_pid(pid) or pid
        self.conns.add(conn)
        self.per_key[conn.key] += 1
        task = asyncio.get_running_loop().create_task(self.run(conn))
        conn.writer = net.Channel(sock, OUT_BUFFER_BYTES + MAX_REPLY_BYTES, task.cancel)
        # The end of the task, however it ends (even cancelled before it ran), ends the
        # connection: its lock, its lease or ticket, its socket.
        task.add_done_callback(lambda _t: self.ended(conn))

    def refusal(self, uid: int, account: Account) -> str | None:
        total = len(self.conns)
        if uid == 0 and not account.tenant:
            if total >= self.conn_cap:
                return f"the broker holds its most connections ({self.conn_cap}); try again"
            return None
        if total >= self.conn_cap - net.ROOT_RESERVE:
            return (
                f"the broker holds its most connections ({self.conn_cap}, the last "
                f"{net.ROOT_RESERVE} kept for root); try again shortly"
            )
        unknown = account.unknown
        limit = (
            self.config.unknown_max_connections if unknown
            else self.config.max_connections_per_user
        )
        if self.per_key[account.key] >= limit:
            name = "uids without a passwd entry" if unknown else account.name
            via = f" ({account.via})" if account.via else ""
            setting = "unknown_uids.max_connections" if unknown else "max_connections_per_user"
            return f"too many connections for {name}{via} ({setting} = {limit})"
        return None

    def refuse(self, sock: socket.socket, uid: int, why: str) -> None:
        line = json.dumps({"ok": False, "type": WIRE_STORE_ERROR, "error": why,
                           "proto": PROTOCOL}).encode() + b"\n"
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(line)
        sock.close()
        self.refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= net.LOG_EVERY_S:
            self._refused_logged = now
            log.warning("%d connection(s) refused (the last from uid %d: %s)",
                        self.refused, uid, why)
            self.refused = 0

    async def run(self, conn: Conn) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # a connection lost on the way
            await self.serve(conn)

    def ended(self, conn: Conn) -> None:
        self.conns.discard(conn)
        self.per_key[conn.key] -= 1
        if self.per_key[conn.key] <= 0:
            del self.per_key[conn.key]
        self.broker.lock.release(conn)
        if conn.record is not None:
            conn.record = None
        conn.writer.shut()
        with contextlib.suppress(OSError):
            conn.writer.sock.close()

    async def serve(self, conn: Conn) -> None:
        broker = self.broker
        while True:
            try:
                line = await conn.writer.readline(MAX_REQUEST_BYTES)
            except ValueError:
                await self.send(
                    conn,
                    _error(f"message longer than {MAX_REQUEST_BYTES} bytes: connection closed"),
                )
                return
            except (ConnectionError, OSError):
                return
            if not line:
                return
            if not line.endswith(b"\n"):
                return  # EOF in the middle of a message
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                await self.send(conn, _error("malformed message (not JSON): connection closed"))
                return
            await self.throttle(conn)
            op = msg.get("op") if isinstance(msg, dict) else None
            if not isinstance(op, str) or op not in OPS:
                await self.send(conn, _error(
                    f"unknown message (op {_short(op)}; expected one of "
                    f"{', '.join(OPS)}): connection closed"
                ))
                return
            if not conn.greeted:
                mismatch = _protocol_mismatch(msg.get("proto"))
                if mismatch:
                    await self.send(conn, {"ok": False, "type": WIRE_UNTRUSTED,
                                            "error": mismatch})
                    return
                conn.greeted = True
                conn.proto = PROTOCOL if msg.get("proto") == PROTOCOL else OLDER
            try:
                await before(broker, conn, op)
                reply = await OPS[op](broker, conn, msg)
            except BrokerRefusal as err:
                reply = {"ok": False, "error": str(err), "type": err.kind}
            if conn.proto == OLDER:
                reply = await older_reply(broker, conn, op, reply)
            if not await self.send(conn, reply):
                return
            if op == "begin" and conn.ids is None:
                # The pick decides in its own process now: meanwhile, read what its lease's
                # journal line will need, off the path of the `lease` that follows.
                broker.restorer.holder_ids(conn)

    async def send(self, conn: Conn, msg: dict[str, Any]) -> bool:
        """Send one reply; ``False`` when the connection is gone or the client does not read it
        within ``send_timeout_s`` (then it is dropped: its buffer is freed, its lease ends)."""
        msg.setdefault("proto", PROTOCOL)
        if isinstance(msg, RecordReply) and len(msg) == 3:  # as built (a pick adds labels)
            data = b'{"ok":true,"proto":%d,"record":%s}\n' % (PROTOCOL, msg.encoded)
        elif msg == _OK:
            data = _OK_LINE
        else:  # a pick's booking view: each device's JSON as kept, not encoded per pick
            data = encoded_line(msg) or json.dumps(msg).encode() + b"\n"
        if len(data) > MAX_REPLY_BYTES:  # replies are bounded by construction: a bug
            log.error("reply of %d bytes to uid %d not sent (cap %d)", len(data), conn.uid,
                      MAX_REPLY_BYTES)
            data = json.dumps(_error(
                f"reply too long ({len(data)} bytes, cap {MAX_REPLY_BYTES}): a bug of the "
                "broker, please report it"
            ) | {"proto": PROTOCOL}).encode() + b"\n"
        conn.writer.write(data)
        try:
            return await conn.writer.drain(self.config.send_timeout_s)
        except TimeoutError:  # the connection was dropped
            log.warning("uid %d (pid %d) did not read its reply within %.0f s: dropped",
                        conn.uid, conn.pid, self.config.send_timeout_s)
            return False

    async def throttle(self, conn: Conn) -> None:
        """A token bucket per person: a flood from one user (and their subordinate uids)
        delays that user's own messages."""
        rate = self.config.messages_per_s_per_user
        if conn.root or rate <= 0:
            return
        now = time.monotonic()
        bucket = self.buckets.setdefault(conn.key, [rate, now])
        bucket[0] = min(rate, bucket[0] + (now - bucket[1]) * rate) - 1.0
        bucket[1] = now
        if bucket[0] < 0:
            self.paced += 1
            await asyncio.sleep(-bucket[0] / rate)
        if len(self.buckets) > 4 * len(self.per_key) + 64:  # people who left: bounded
            full = [k for k, b in self.buckets.items() if k not in self.per_key]
            for k in full:
                del self.buckets[k]


_OK = {"ok": True, "proto": PROTOCOL}
_OK_LINE = json.dumps(_OK).encode() + b"\n"


def notify(conn: Any, event: dict[str, Any], close: bool = False) -> None:
    """An unsolicited line to a holder (``revoked``, ``replaced``, ``ticket_lapsed``): its
    client reads it with its next reply; ``close``: then the connection is closed."""
    with contextlib.suppress(OSError, RuntimeError, AttributeError):
        conn.writer.write(json.dumps(event).encode() + b"\n")
    if close:
        with contextlib.suppress(OSError, RuntimeError, AttributeError):
            conn.writer.close()


def _short(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message, "type": WIRE_STORE_ERROR}


def _protocol_mismatch(theirs: Any) -> str | None:
    """One line when a client speaks neither :data:`PROTOCOL` nor the one before it
    (:data:`OLDER`: its messages carry no version); ``None`` when the broker speaks its
    protocol."""
    if theirs is None or (theirs in (PROTOCOL, OLDER) and not isinstance(theirs, bool)):
        return None
    return (
        f"this autogpu speaks protocol {_short(theirs)}, the lease broker speaks protocol "
        f"{PROTOCOL} and {OLDER} (autogpu {__version__}): the broker and this environment "
        "come from different autogpu versions; upgrade autogpu here (or ask the admin to run "
        "the same version for both)"
    )
