"""``autogpu broker``: the trusted lease broker for hosts with many users (issue 11).

A small daemon, run by root, on a Unix socket every user may connect to. It alone owns the
lease state of the host; clients (:mod:`autogpu_jupyter.core.leasing.brokerclient`) talk to it in
newline-delimited JSON, one object per line: requests of at most ``MAX_REQUEST_BYTES``, replies
of at most ``MAX_REPLY_BYTES`` (both defined there: the two sides agree). Every request and reply
carries ``"proto"``: the first message of a connection with another protocol is answered with
one line naming both versions, and the connection is closed.

Identity comes only from the kernel (``SO_PEERCRED``: uid, gid, pid of the connecting process);
``user``, ``uid`` or ``pid`` fields in a message are never read as identity. A uid is *accounted*
to a person (:mod:`autogpu_jupyter.brokerd.identity`): a subordinate uid (``/etc/subuid``) is
its owner, for the quota, the connection and message limits, the turn at the pick lock and the
name on its records; unknown uids share one small bucket.

**A lease is a connection.** The connection that asked for a lease holds it: when every copy of
that socket is closed (the holder exits, is SIGKILLed, or hands the descriptor to a child that
exits), the broker sees EOF and frees the lease. A ticket (a place in the waiting line) is held
the same way. One connection holds at most one lease or ticket.

Operations (``{"op": ..., "proto": 2}``)::

    begin      wait for the broker's pick lock (served fairly across users), get the compact
               booking view (per device, what others' leases book; the caller's own leases; the
               oldest tickets): the client decides with core.decision, as a local pick does
    end        give the lock back without a lease
    lease      hold a lease on these devices (checked: exclusivity, max_devices_per_user)
    pick       the broker ranks (its own snapshot, core.decision over its state) and leases
               what it chose, in one message (options in the one options schema)
    ticket     join the waiting line (FIFO; the broker numbers tickets)
    set_pid    the pid that uses the device (a kernel started by a provisioner); same uid only
    release    end this connection's lease or ticket (or, by ``lease_id``, an orphan of yours)
    leases     live leases (and tickets), one page at a time (``after``: where the last page
               ended); other users' command lines are never sent
    status     counts: leases, tickets, per-user rows, connections (no records)
    revoke     root only: end a lease or ticket; its holder's connection is told, then closed

**Bounded.** Nothing one user sends makes another user's reply or the broker's memory grow
without a limit: record fields are capped in encoded bytes
(``core.leasing.records.FIELD_CAPS``), replies are a bounded view or a page, a client that
does not read its reply within ``send_timeout_s`` is dropped (what is kept for it is capped,
not grown: :class:`autogpu_jupyter.brokerd.net.Channel`), connections are capped per person
and in all (below the descriptor limit, the last ones kept for root), and accept errors back
off with one log line (:mod:`autogpu_jupyter.brokerd.net`).

**Restarts.** With a state directory (root-only, ``--state-dir``) every change is appended to a
journal, written before the reply that announces it (:mod:`autogpu_jupyter.brokerd.journal`;
a journal of an earlier boot is dropped: no lease outlives the boot). A restarted broker takes
back each journaled lease or ticket whose socket is still held by some
process (found by the socket's inode; else by the recorded pids and their start times) as an
*orphan*: held until no process holds it any more, so no live lease is lost or doubled; nothing
is handed out on its devices in the meantime.

**Tickets lapse.** A ticket taken while a device is free for it (counting only leases held for
:data:`SETTLED_S`) reserves nothing (a waiter only waits when nothing fits) until nothing fits it
once. A ticket the broker could serve now but
that has not been turned into a lease for ``ticket_grace_s`` loses its place: its connection is
told and closed. A waiter polls every second, so only a client that holds a ticket without
picking loses it. A person who left a place that could be served (it lapsed, or was dropped
without a lease) may not join the line for :data:`LINE_BAR_S`.

The broker is a front end: it imports core, never another front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import pwd
import secrets
import signal
import socket
import stat
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from autogpu_jupyter._version import __version__
from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd import net
from autogpu_jupyter.brokerd.identity import Account, Accounts
from autogpu_jupyter.core import decision, options
from autogpu_jupyter.core.backends import get_backend
from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.brokerclient import (
    DEFAULT_SOCKET,
    HOLDER_KINDS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PAGE_BYTES,
    PAGE_RECORDS,
    PROTOCOL,
    VIEW_ROWS_PER_DEVICE,
    VIEW_TICKET_BYTES,
    VIEW_TICKETS,
)
from autogpu_jupyter.core.leasing.records import (
    MAX_ID_LIST,
    MAX_SEQ,
    Invalid,
    LeaseRecord,
    capped_text,
    cut_encoded,
    encode,
    parse_record,
    record_from_fields,
)
from autogpu_jupyter.core.leasing.store import StoreTransaction
from autogpu_jupyter.core.picker import explain_drops
from autogpu_jupyter.errors import AutoGPUError

__all__ = ["Broker", "BrokerConfig", "DEFAULT_SOCKET", "MAX_MESSAGE_BYTES", "main", "serve"]

log = logging.getLogger("autogpu.broker")

#: The longest message line accepted; a longer one closes that connection.
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES
#: What the broker keeps for a client that does not read, beyond one reply of at most
#: ``MAX_REPLY_BYTES`` (unsolicited notices): past it the connection is dropped. A reply not
#: read within ``send_timeout_s`` drops it too.
OUT_BUFFER_BYTES = 64 * 1024
#: How much of a holder's name and place (``alice``, ``analysis.ipynb``) the booking view
#: carries, in encoded bytes.
_VIEW_TEXT = 128
#: The pick lock of a person who let it time out within :data:`LOCK_MISUSE_MEMORY_S` is taken
#: back after this long when someone else waits: holding it idle then blocks nobody for long.
#: A pick that gets the lock and leases at once never meets it.
LOCK_SLICE_S = 0.01
LOCK_MISUSE_MEMORY_S = 60.0
#: Tickets a person may take per second on average, and at once.
TICKETS_PER_S = 2.0
TICKET_BURST = 8
#: How long a person who left a servable ticket (lapsed, or dropped) may not join the line.
LINE_BAR_S = 60.0
#: A lease younger than this does not make a new ticket wait (see ``Broker._servable_now``).
SETTLED_S = 2.0
_FLEET_RECHECK_S = 5.0


@dataclass
class BrokerConfig:
    """The admin's rules (``autogpu broker`` flags, or the AutoGPU config of root)."""

    socket_path: str = DEFAULT_SOCKET
    state_dir: str | None = None
    max_devices_per_user: int = 0
    #: Leases one user may hold at once (0: no limit); tickets (places in the waiting line).
    max_leases_per_user: int = 0
    max_tickets_per_user: int = admission.DEFAULT_MAX_TICKETS
    max_connections_per_user: int = 256
    #: Messages per second one non-root uid may send, all its connections together (a burst of
    #: as many is allowed); past it, that uid's messages wait -- nobody else's do.
    messages_per_s_per_user: float = 500.0
    #: Per-user limits by name (``{"alice": 4}``): they win over the groups' and the default.
    user_limits: dict[str, int] = field(default_factory=dict)
    #: Per-user limits for members of a group (``{"students": 1}``): a user in several groups
    #: gets the most generous one.
    group_limits: dict[str, int] = field(default_factory=dict)
    #: Devices only members of some groups may lease (``{"GPU-...": ["ml"]}``).
    reserved: dict[str, list[str]] = field(default_factory=dict)
    #: Connections the broker holds at once, all users together (0: as many as its descriptor
    #: limit allows, less a reserve); the last :data:`net.ROOT_RESERVE` are root's.
    max_connections: int = 0
    #: The one bucket of uids that are neither passwd users nor anyone's subordinate uids.
    unknown_max_connections: int = 16
    unknown_max_devices: int = 1
    #: A ticket the broker could serve but that is not turned into a lease within this many
    #: seconds loses its place (a waiter polls every second).
    ticket_grace_s: float = 5.0
    #: A client that does not read a reply within this many seconds is dropped.
    send_timeout_s: float = 10.0
    subuid_path: str = "/etc/subuid"

    def load_rules(self, path: str) -> None:
        """Read the admin's rules file (JSON; see docs/admin-broker.md). Raises ``SystemExit``
        naming the file and the bad entry."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict):
                raise TypeError("expected a JSON object")
            unknown = set(doc) - {
                "max_devices_per_user", "max_leases_per_user", "max_tickets_per_user", "users",
                "groups", "reserved", "unknown_uids",
            }
            if unknown:
                raise TypeError(f"unknown key {sorted(unknown)[0]!r}")
            if "max_devices_per_user" in doc:
                self.max_devices_per_user = _count(doc["max_devices_per_user"])
            if "max_leases_per_user" in doc:
                self.max_leases_per_user = _count(doc["max_leases_per_user"])
            if "max_tickets_per_user" in doc:
                self.max_tickets_per_user = _count(doc["max_tickets_per_user"])
            self.user_limits = {str(k): _count(v) for k, v in _obj(doc, "users").items()}
            self.group_limits = {str(k): _count(v) for k, v in _obj(doc, "groups").items()}
            self.reserved = {str(k): _groups(k, v) for k, v in _obj(doc, "reserved").items()}
            bucket = _obj(doc, "unknown_uids")
            extra = set(bucket) - {"max_devices", "max_connections"}
            if extra:
                raise TypeError(f"unknown_uids: unknown key {sorted(extra)[0]!r}")
            if "max_devices" in bucket:
                self.unknown_max_devices = _count(bucket["max_devices"])
            if "max_connections" in bucket:
                self.unknown_max_connections = _count(bucket["max_connections"])
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise SystemExit(
                f"autogpu broker: rules file {path}: {err}; expected e.g. "
                '{"max_devices_per_user": 2, "users": {"alice": 4}, "groups": {"students": 1}, '
                '"reserved": {"GPU-...": ["ml"]}}'
            ) from None

    def check_reserved(self, fleet: set[str] | None) -> None:
        """Every reserved id must be a device of this host (``fleet``; ``None``: unknown, not
        checked): a typo would silently reserve nothing. Raises ``SystemExit`` naming it."""
        if fleet is None:
            return
        for uuid in sorted(self.reserved):
            if uuid not in fleet:
                raise SystemExit(
                    f"autogpu broker: reserved device {uuid!r} is not a device of this host "
                    f"(its devices: {', '.join(sorted(fleet)) or 'none'}): fix the rules file"
                )

    lock_timeout_s: float = 2.0
    record_commands: bool = False


def _obj(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    v = doc.get(key, {})
    if not isinstance(v, dict):
        raise TypeError(f"{key}: expected an object, got {type(v).__name__}")
    return v


def _groups(uuid: str, v: Any) -> list[str]:
    if not isinstance(v, list) or not v or not all(isinstance(g, str) and g for g in v):
        raise TypeError(
            f"reserved {str(uuid)[:80]!r}: expected a list of group names, got {json.dumps(v)}"
        )
    return list(v)


class Conn:
    """One client connection and what it holds.

    Setting :attr:`record` journals the change (written before its reply)."""

    def __init__(
        self, broker: Broker, uid: int, gid: int, pid: int, account: Account,
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
        #: neither changes while the connection is open (see ``Broker._holder_ids``).
        self.ids: tuple[int | None, list[tuple[int, int]]] | None = None
        self.granted: asyncio.Future[None] | None = None
        self.lock_handle: asyncio.TimerHandle | None = None
        self.greeted = False  # the first message's protocol was checked
        self.granted_at = 0.0  # when it was last given the pick lock (monotonic)

    @property
    def record(self) -> LeaseRecord | None:
        return self._record

    @record.setter
    def record(self, rec: LeaseRecord | None) -> None:
        old, self._record = self._record, rec
        self.broker._record_changed(self, old, rec)

    @property
    def key(self) -> int:
        return self.account.key

    @property
    def user(self) -> str:
        return self.account.name

    @property
    def groups(self) -> set[str]:
        return set(self.account.groups)


@dataclass(eq=False)
class Orphan:
    """A lease or ticket taken back from the journal after a restart: held while some process
    holds its socket (or, where that cannot be known, while its recorded holders run)."""

    uid: int
    record: LeaseRecord
    holder_pids: list[tuple[int, int]]
    key: int = 0
    peer: int | None = None


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r} is not a whole number >= 0")
    return v


def peer_credentials(sock: Any) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (``SO_PEERCRED``)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3I"))
    pid, uid, gid = struct.unpack("3I", data)  # unsigned: a uid may be >= 2**31
    return pid, uid, gid


class BrokerRefusal(Exception):
    """A request the broker refuses; the message goes back to the client (one line)."""

    def __init__(self, message: str, kind: str = "RegistryError") -> None:
        super().__init__(message)
        self.kind = kind


class Broker:
    """The lease state of the host and the rules around it (one asyncio loop, no threads)."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.host = socket.gethostname()
        self.conns: set[Conn] = set()
        self.per_key: Counter[int] = Counter()  # open connections per account
        self.orphans: dict[str, Orphan] = {}
        self.seq = 0
        self.lock_holder: Conn | None = None
        self.waiting: deque[Conn] = deque()
        self.last_grant: dict[int, float] = {}
        #: When each person last let the pick lock time out (see :meth:`_arm_lock_timer`).
        self.lock_misuse: dict[int, float] = {}
        self.started = time.time()
        #: Set on SIGTERM once the last journal is written: connections closed by the shutdown
        #: must not erase it (their holders still run and are taken back by the next broker).
        self.stopping = False
        self.backend: Any = None
        self.buckets: dict[int, list[float]] = {}  # account -> [tokens, last refill]
        self.accounts = Accounts(config.subuid_path)
        self.conn_cap = net.connection_cap(config.max_connections)
        self.refused = 0  # connections refused since the last log line
        self._refused_logged = -math.inf  # the first refusal is logged, whatever the clock
        self.lapsed = 0  # tickets that lost their place, in all
        self.servable_since: dict[str, float] = {}  # ticket id -> when it could first be served
        #: Tickets that joined the line while a device was free for them: they reserve nothing
        #: (a waiter only waits when nothing fits) until the line is full for them once.
        self.dormant: set[str] = set()
        self.joined: dict[int, list[float]] = {}  # person -> [tokens, last refill]: tickets/s
        self.line_barred: dict[int, float] = {}  # person -> until when it may not join the line
        self.last_lease_at: dict[int, float] = {}  # person -> when it was last granted a lease
        self._snap: Any = None
        self._snap_at = -1e9
        self._fleet: set[str] | None = None
        self._fleet_checked = -_FLEET_RECHECK_S
        #: Bumped by every change of the live records (see :meth:`live`).
        self.version = 0
        self._live: tuple[int, list[tuple[int, LeaseRecord]]] = (-1, [])
        #: The rows of a device's leases, by the ids of those leases (a pick on another device
        #: does not change them): bounded, cleared when full.
        self._rows: dict[tuple[str, ...], dict[str, Any]] = {}
        self._last_encoded: tuple[LeaseRecord | None, bytes] = (None, b"")
        self.journal: jrnl.Journal | None = None
        if config.state_dir:
            _check_state_dir(config.state_dir)
            self.journal = jrnl.Journal(config.state_dir)
            self._load_journal()

    # -- state ------------------------------------------------------------------------------

    def live(self) -> list[tuple[int, LeaseRecord]]:
        """Every live lease and ticket as (account, record), oldest first (computed once per
        change of the state: a pick reads it several times)."""
        if self._live[0] != self.version:
            out = [(c.key, c.record) for c in self.conns if c.record is not None]
            out += [(o.key, o.record) for o in self.orphans.values()]
            out.sort(key=lambda p: (p[1].created_s, p[1].lease_id))
            self._live = (self.version, out)
        return list(self._live[1])

    def _shown(self, rec: LeaseRecord, viewer_uid: int) -> dict[str, Any]:
        """A record's payload for a client of ``viewer_uid``: other users' command lines are
        left out (root sees them)."""
        shown = rec if viewer_uid in (0, rec.uid) else replace(rec, command=None)
        return shown._payload()

    # -- the pick lock ----------------------------------------------------------------------

    def _grant_next(self) -> None:
        """Give the lock to the waiter of the person served least recently (FIFO per person:
        a user's subordinate uids are that user)."""
        while self.lock_holder is None and self.waiting:
            best = min(
                range(len(self.waiting)),
                key=lambda i: (self.last_grant.get(self.waiting[i].key, 0.0), i),
            )
            conn = self.waiting[best]
            del self.waiting[best]
            if conn.granted is None or conn.granted.done():
                continue
            self.lock_holder = conn
            now = time.monotonic()
            self.last_grant[conn.key] = now
            conn.granted_at = now
            self._arm_lock_timer(conn)
            conn.granted.set_result(None)

    def _arm_lock_timer(self, conn: Conn) -> None:
        """How long ``conn`` may keep the lock: ``lock_timeout_s``; only :data:`LOCK_SLICE_S`
        when its person let the lock time out lately and someone else is waiting."""
        if conn.lock_handle is not None:
            conn.lock_handle.cancel()
        hold = self.config.lock_timeout_s
        if self._suspect(conn.key) and any(w.key != conn.key for w in self.waiting):
            hold = LOCK_SLICE_S
        left = max(0.0, conn.granted_at + hold - time.monotonic())
        loop = asyncio.get_running_loop()
        conn.lock_handle = loop.call_later(left, self._expire_lock, conn)

    def _suspect(self, key: int) -> bool:
        since = self.lock_misuse.get(key)
        return since is not None and time.monotonic() - since < LOCK_MISUSE_MEMORY_S

    def _expire_lock(self, conn: Conn) -> None:
        if self.lock_holder is conn:
            log.warning(
                "uid %d (pid %d) held the pick lock too long: taken back", conn.uid, conn.pid
            )
            now = time.monotonic()
            if now - conn.granted_at >= self.config.lock_timeout_s - 0.001:
                # the whole time out, not a short slice: marked (again) for a minute
                self.lock_misuse[conn.key] = now
            if len(self.lock_misuse) > 4096:  # people who misused it long ago: forgotten
                self.lock_misuse = {k: t for k, t in self.lock_misuse.items()
                                    if now - t < LOCK_MISUSE_MEMORY_S}
            self._drop_lock(conn)

    def _drop_lock(self, conn: Conn) -> None:
        if conn.lock_handle is not None:
            conn.lock_handle.cancel()
            conn.lock_handle = None
        if conn.granted is not None and not conn.granted.done():
            conn.granted.cancel()
        conn.granted = None
        if self.lock_holder is conn:
            self.lock_holder = None
        if conn in self.waiting:  # (a raised and caught ValueError costs more on every pick)
            self.waiting.remove(conn)
        if self.lock_holder is None:
            self._grant_next()

    # -- operations -------------------------------------------------------------------------

    async def op_begin(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        if conn.record is not None:
            raise BrokerRefusal(admission.ONE_PER_CONNECTION)
        if self.lock_holder is not conn:
            loop = asyncio.get_running_loop()
            conn.granted = loop.create_future()
            self.waiting.append(conn)
            holder = self.lock_holder
            if holder is not None and holder.key != conn.key and self._suspect(holder.key):
                self._arm_lock_timer(holder)  # a short slice now that someone else waits
            self._grant_next()
            await conn.granted
        return {
            "ok": True,
            **self._view(conn),
            "max_devices_per_user": self.limit_for(conn)[0],
        }

    def _view(self, conn: Conn) -> dict[str, Any]:
        """The compact booking view of a pick: what it needs from every live record, in a size
        that does not grow with other users' records.

        * ``own``: the caller's own leases (its person's), in full: a re-pick hides them;
        * ``devices``: per device, up to :data:`VIEW_ROWS_PER_DEVICE` rows of other leases
          (exclusive ones first, then the largest bookings) as ``[exclusive, pid, bytes, user,
          where]``, and the rest folded into one ``more`` row (count, exclusive, bytes);
        * ``tickets``: the oldest waiters, at most :data:`VIEW_TICKETS` and
          :data:`VIEW_TICKET_BYTES` (a pick only yields to waiters ahead of it);
        * ``reserved``: the devices the admin reserved for groups the caller is not in (UUID ->
          those groups), which the client ranks out as the admission words them.
        """
        live = self.live()
        own = [self._shown(rec, conn.uid) for key, rec in live
               if key == conn.key and rec.kind == "lease"]
        per_dev: dict[str, list[LeaseRecord]] = {}
        for key, rec in live:
            if rec.kind == "lease" and key != conn.key:
                for uuid in rec.device_uuids:
                    per_dev.setdefault(uuid, []).append(rec)
        devices = [self._rows_of(uuid, recs) for uuid, recs in sorted(per_dev.items())]
        tickets: list[dict[str, Any]] = []
        size = 0
        waiting = [rec for _, rec in live if self.reserving(rec)]
        waiting.sort(key=admission.line_key)
        for rec in waiting:
            payload = self._shown(replace(rec, command=None), conn.uid)
            size += len(json.dumps(payload))
            if len(tickets) >= VIEW_TICKETS or size > VIEW_TICKET_BYTES:
                break
            tickets.append(payload)
        return {
            "own": own,
            "devices": devices,
            "tickets": tickets,
            "tickets_not_shown": len(waiting) - len(tickets),
            "reserved": {
                uuid: list(groups)
                for uuid, groups in admission.reserved_away(
                    self.config.reserved, self._applicant(conn)
                ).items()
            },
        }

    def _rows_of(self, uuid: str, recs: list[LeaseRecord]) -> dict[str, Any]:
        """:func:`_device_rows`, kept for the same leases of the same device."""
        # a record changes only by set_pid (its pid); a lease id names the rest
        key = (uuid, *(f"{r.lease_id}:{r.pid}" for r in recs))
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) >= 256:
                self._rows.clear()
            rows = self._rows[key] = _device_rows(uuid, recs)
        return rows

    async def op_end(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        self._drop_lock(conn)
        return {"ok": True}

    def _holder_fields(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        holder = msg.get("holder") or {}
        if not isinstance(holder, dict):
            raise BrokerRefusal("holder: expected an object", "UsageErrorBase")
        pid = conn.pid
        kind = holder.get("kind") or "process"
        if kind not in HOLDER_KINDS:
            raise BrokerRefusal(
                f"holder.kind {str(kind)[:40]!r} is not one of {', '.join(HOLDER_KINDS)}",
                "UsageErrorBase",
            )
        return {
            "pid": pid,
            "kernel_id": _capped(holder, "kernel_id"),
            "notebook_path": _capped(holder, "notebook_path"),
            "command": _capped(holder, "command") if self.config.record_commands else None,
            "holder_kind": kind,
        }

    def _make_record(self, conn: Conn, kind: str, payload: dict[str, Any]) -> LeaseRecord:
        """A record built by the broker: identity from the kernel, the rest validated by the
        readers' own schema (what a forged field would break is refused here)."""
        base = {
            "version": 1,
            "kind": kind,
            "lease_id": secrets.token_hex(16),
            "exclusive": False,
            "user": capped_text(conn.user, "user") or str(conn.uid),
            "uid": conn.uid,
            "host": capped_text(self.host, "host") or "?",
            "created_s": time.time(),
        }
        base.update(payload)
        try:
            return record_from_fields(
                base, kind=kind, path=f"broker:{base['lease_id']}", live=True
            )
        except (Invalid, TypeError, ValueError) as err:
            raise BrokerRefusal(f"{kind} refused: {err}", "UsageErrorBase") from None

    def _replaced(self, conn: Conn, msg: dict[str, Any]) -> set[str]:
        """The caller's OWN live leases this lease replaces (a re-pick: ``ignore_ids``,
        ``ignore_kernel``). They end when the new lease is granted, so a re-pick can never hold
        both (nor exceed the quota by "replacing" leases it keeps); other users' are never
        touched."""
        ignore = msg.get("ignore_ids") or []
        if not isinstance(ignore, list):
            ignore = []
        ids = {i for i in ignore[:MAX_ID_LIST] if isinstance(i, str)}
        kernel = msg.get("ignore_kernel") if isinstance(msg.get("ignore_kernel"), str) else None
        return {
            r.lease_id
            for u, r in self.live()
            if u == conn.key
            and r.kind == "lease"
            and (r.lease_id in ids or bool(kernel and r.kernel_id == kernel))
        }

    def _end_replaced(self, replaced: set[str]) -> None:
        if not replaced:
            return
        for other in list(self.conns):
            if other.record is not None and other.record.lease_id in replaced:
                other.record = None
                _notify(other, {"event": "replaced", "message": "lease replaced by a re-pick"})
        for lease_id in replaced:
            self._forget_orphan(lease_id)

    def _applicant(self, conn: Conn) -> admission.Applicant:
        """Who asks, for the admission: the quota and the lines count the *person*
        (``conn.key``: a subordinate uid is its owner), the root check is the uid itself."""
        return admission.Applicant(
            conn.uid, conn.user, frozenset(conn.groups), key=conn.key
        )

    def _quota(self, conn: Conn) -> admission.Quota:
        limit, why = self.limit_for(conn)
        return admission.Quota(
            max_devices=limit,
            max_leases=self.config.max_leases_per_user,
            max_tickets=self.config.max_tickets_per_user,
            source=why,
            enforcer=" (enforced by the broker)",
        )

    def _live_split(self, replaced: set[str]) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        """Live leases (less the ``replaced`` ones of a re-pick) and tickets, for admission,
        each marked with its person: the copies' ``uid`` is the account key of the uid that
        holds it (a subordinate uid's owner), as :attr:`admission.Applicant.key` counts."""
        live = [r if r.uid == key else replace(r, uid=key) for key, r in self.live()]
        leases = [r for r in live if r.kind == "lease" and r.lease_id not in replaced]
        return leases, [r for r in live if r.kind == "ticket"]

    def _check_lease(self, conn: Conn, rec: LeaseRecord, replaced: set[str]) -> None:
        """The one admission's verdict on ``rec`` (:func:`admission.admit_lease`)."""
        leases, _ = self._live_split(replaced)
        try:
            admission.admit_lease(
                leases,
                applicant=self._applicant(conn),
                devices=rec.device_uuids,
                exclusive=rec.exclusive,
                quota=self._quota(conn),
                reserved=self.config.reserved,
            )
        except AutoGPUError as err:
            raise BrokerRefusal(str(err), type(err).__name__) from None

    def limit_for(self, conn: Conn) -> tuple[int, str]:
        """The device limit of ``conn``'s user (0: none) and where it comes from."""
        cfg = self.config
        user = conn.user
        if conn.account.unknown:
            return cfg.unknown_max_devices, " for uids without a passwd entry"
        if user in cfg.user_limits:
            return cfg.user_limits[user], f" for {user}"
        mine = {g: cfg.group_limits[g] for g in conn.groups if g in cfg.group_limits}
        if mine:
            group = max(mine, key=lambda g: (mine[g] == 0, mine[g]))  # 0 = no limit: the most
            return mine[group], f" for group {group}"
        return cfg.max_devices_per_user, ""

    def reserved_away(self, conn: Conn) -> list[LeaseRecord]:
        """Devices reserved for groups ``conn``'s user is not in, as exclusive pseudo-leases
        (:func:`admission.reservation`): the one decision then ranks them out, worded by the
        admission ("reserved for group(s) ml by the admin"), with no rule of its own."""
        if not self.config.reserved:
            return []
        away = admission.reserved_away(self.config.reserved, self._applicant(conn))
        return [admission.reservation(u, groups, self.host) for u, groups in away.items()]

    async def op_lease(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        if conn.record is not None:
            raise BrokerRefusal(admission.ONE_PER_CONNECTION)
        devices = msg.get("devices")
        if not isinstance(devices, list) or not devices or len(devices) > MAX_ID_LIST:
            raise BrokerRefusal("devices: expected a list of device UUIDs", "UsageErrorBase")
        await self._check_known(devices)
        booked = msg.get("requested_bytes")
        if booked is None:
            booked = [None] * len(devices)
        rec = self._make_record(
            conn,
            "lease",
            {
                "device_uuids": devices,
                "device_requested_bytes": booked,
                "exclusive": msg.get("exclusive", False),
                **self._holder_fields(conn, msg),
            },
        )
        replaced = self._replaced(conn, msg)
        self._check_lease(conn, rec, replaced)
        self._end_replaced(replaced)
        conn.holder_pids = list(self._holder_ids(conn)[1])  # before the record: journaled
        conn.record = rec
        self._journal()
        self._drop_lock(conn)
        return _RecordReply(rec, self._encoded(rec))

    async def op_pick(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Pick AND lease in one message: the broker ranks with its own snapshot and the one
        decision pipeline (``core.decision``) over its own state, then leases what it chose on
        this connection (the same checks as ``lease``). For clients that cannot run the engine
        (a raw socket, another language). No ``wait`` here: a waiting pick runs in the client.
        """
        if conn.record is not None:
            raise BrokerRefusal(admission.ONE_PER_CONNECTION)
        values = msg.get("options") or {}
        if not isinstance(values, dict):
            raise BrokerRefusal("options: expected an object", "UsageErrorBase")
        try:
            opts = options.parse(values, style="key", accept=_PICK_KEYS)
        except AutoGPUError as err:
            raise BrokerRefusal(str(err), "UsageErrorBase") from None
        snap = await asyncio.get_running_loop().run_in_executor(None, self._snapshot)
        # From here to the lease nothing awaits: the decision and the lease see one state.
        context = decision.gather(snap, environ={}, store=_StateView(self, conn))
        made = decision.decide(context, opts.constraints)
        if not made.chosen:
            raise BrokerRefusal(
                f"no device fits ({opts.constraints.describe()}):\n{explain_drops(made.ranked)}",
                "NoDeviceFitsError",
            )
        mf = opts.constraints.min_free
        reply = await self.op_lease(conn, {
            "devices": [c.device.uuid for c in made.chosen],
            "requested_bytes": [
                None if mf is None else mf.resolve(c.device.memory_total_bytes)
                for c in made.chosen
            ],
            "exclusive": opts.constraints.exclusive,
            "holder": msg.get("holder"),
        })
        reply["labels"] = [c.device.label for c in made.chosen]
        return reply

    def _snapshot(self) -> Any:
        """The fleet now, from the broker's own backend (NVML, or ``AUTOGPU_SIMULATE``)."""
        if self.backend is None:
            self.backend = get_backend()
        snap = self.backend.snapshot()
        self._fleet = _fleet_ids(snap)
        self._fleet_checked = self._snap_at = time.monotonic()
        self._snap = snap
        return snap

    async def op_ticket(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Join the waiting line, if the one admission admits the ticket
        (:func:`admission.admit_ticket`: tickets per user, the device quota with what the user
        waits for, reserved devices); ``ignore_ids`` / ``ignore_kernel`` name the caller's own
        leases a re-pick replaces, which do not count."""
        if conn.record is not None:
            raise BrokerRefusal(admission.ONE_PER_CONNECTION)
        rec = self._make_record(
            conn,
            "ticket",
            {
                "device_uuids": [],
                "device_requested_bytes": [],
                "exclusive": msg.get("exclusive", False),
                "seq": min(self.seq + 1, MAX_SEQ),
                "constraints": msg.get("constraints"),
                **self._holder_fields(conn, msg),
            },
        )
        leases, tickets = self._live_split(self._replaced(conn, msg))
        try:
            admitted = admission.admit_ticket(
                leases,
                tickets,
                applicant=self._applicant(conn),
                constraints=rec.constraints or {},
                quota=self._quota(conn),
                reserved=self.config.reserved,
            )
        except AutoGPUError as err:
            raise BrokerRefusal(str(err), type(err).__name__) from None
        if admitted != rec.constraints:
            rec = replace(rec, constraints=admitted)
        conn.holder_pids = list(self._holder_ids(conn)[1])  # before the record: journaled
        conn.record = rec
        self.seq = rec.seq or self.seq
        self._journal()
        return _RecordReply(rec, self._encoded(rec))

    async def _check_known(self, devices: list[Any]) -> None:
        """Refuse ids that are not devices of this host (a lease on ``gpu-...`` in lower case,
        or on a made-up id, would count against nothing real). Where the broker cannot see
        the fleet (no GPU library), ids are only checked by the record schema."""
        unknown = [d for d in devices if self._fleet is None or d not in self._fleet]
        if not unknown:
            return
        now = time.monotonic()
        if now - self._fleet_checked >= _FLEET_RECHECK_S:
            self._fleet_checked = now
            loop = asyncio.get_running_loop()
            with contextlib.suppress(Exception):  # any backend failure: the fleet stays unknown
                await loop.run_in_executor(None, self._snapshot)
        if self._fleet is None:
            return
        for d in devices:
            if d not in self._fleet:
                raise BrokerRefusal(
                    f"{str(d)[:80]!r} is not a device of this host (its devices: "
                    f"{', '.join(sorted(self._fleet)[:16]) or 'none'})",
                    "UsageErrorBase",
                )

    async def op_set_pid(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        pid = msg.get("pid")
        if conn.record is None:
            raise BrokerRefusal("set_pid: this connection holds no lease")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise BrokerRefusal(f"set_pid: invalid pid {str(pid)[:40]!r}", "UsageErrorBase")
        if conn.uid != 0 and conn.uid not in jrnl.pid_uids(pid):
            raise BrokerRefusal(f"set_pid: pid {pid} is not a process of yours")
        conn.holder_pids = jrnl.proc_ids(pid) or conn.holder_pids
        conn.record = replace(conn.record, pid=pid)  # journaled with its new holders
        return {"ok": True, "record": conn.record._payload()}

    async def op_release(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        lease_id = msg.get("lease_id")
        if lease_id is None or (conn.record is not None and conn.record.lease_id == lease_id):
            conn.record = None
            return {"ok": True}
        orphan = self.orphans.get(lease_id) if isinstance(lease_id, str) else None
        if orphan is None or orphan.key != conn.key:
            raise BrokerRefusal(f"release: no lease {str(lease_id)[:64]!r} of yours is orphaned")
        self._forget_orphan(orphan.record.lease_id)
        return {"ok": True}

    async def op_leases(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """One page of live records, oldest first: at most :data:`PAGE_RECORDS` records and
        :data:`PAGE_BYTES`; ``next`` is where the next page starts (``None``: the last)."""
        kinds = {"lease", "ticket"} if msg.get("tickets") else {"lease"}
        if msg.get("kind") in ("lease", "ticket"):
            kinds = {str(msg["kind"])}
        after = msg.get("after")
        cursor: tuple[float, str] | None = None
        if after is not None:
            if (
                not isinstance(after, list) or len(after) != 2
                or not isinstance(after[0], (int, float)) or isinstance(after[0], bool)
                or not isinstance(after[1], str)
            ):
                raise BrokerRefusal("leases: after: expected [created_s, lease_id]",
                                    "UsageErrorBase")
            cursor = (float(after[0]), after[1])
        records = [rec for _, rec in self.live() if rec.kind in kinds]
        out: list[dict[str, Any]] = []
        size = 0
        nxt = None
        for rec in records:
            if cursor is not None and (rec.created_s, rec.lease_id) <= cursor:
                continue
            payload = self._shown(rec, conn.uid)
            size += len(json.dumps(payload))
            if out and (len(out) >= PAGE_RECORDS or size > PAGE_BYTES):
                last = out[-1]
                nxt = [last["created_s"], last["lease_id"]]
                break
            out.append(payload)
        return {"ok": True, "records": out, "next": nxt, "total": len(records)}

    async def op_status(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Counts only (the records come page by page from ``leases``): per person, at most
        :data:`_STATUS_USERS` rows, the largest first; the rest summed in one row."""
        per_user: dict[str, dict[str, int]] = {}
        leases = tickets = 0
        for key, rec in self.live():
            name = rec.user or str(key)
            row = per_user.setdefault(name, {"leases": 0, "devices": 0, "tickets": 0})
            if rec.kind == "lease":
                leases += 1
                row["leases"] += 1
                row["devices"] += len(rec.device_uuids)
            else:
                tickets += 1
                row["tickets"] += 1
        if len(per_user) > _STATUS_USERS:
            ranked = sorted(per_user.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
            rest = {"leases": 0, "devices": 0, "tickets": 0}
            for _name, row in ranked[_STATUS_USERS:]:
                for k in rest:
                    rest[k] += row[k]
            per_user = dict(ranked[:_STATUS_USERS])
            per_user[f"({len(ranked) - _STATUS_USERS} more users)"] = rest
        return {
            "ok": True,
            "leases_total": leases,
            "tickets_total": tickets,
            "per_user": per_user,
            "orphans": len(self.orphans),
            "connections": len(self.conns),
            "max_connections": self.conn_cap,
            "waiting_for_lock": len(self.waiting),
            "max_devices_per_user": self.config.max_devices_per_user,
            "tickets_lapsed": self.lapsed,
            "journal_bytes": None if self.journal is None else self.journal.size_bytes,
            "uptime_s": time.time() - self.started,
            "pid": os.getpid(),
            "version": __version__,
        }

    async def op_revoke(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        if conn.uid != 0:
            raise BrokerRefusal("revoke needs root")
        lease_id = msg.get("lease_id")
        for other in list(self.conns):
            if other.record is not None and other.record.lease_id == lease_id:
                rec = other.record
                other.record = None
                note = {
                    "event": "revoked",
                    "lease_id": rec.lease_id,
                    "kind": rec.kind,
                    "message": f"{rec.kind} {rec.lease_id} revoked by the admin",
                }
                _notify(other, note)
                with contextlib.suppress(OSError, RuntimeError, AttributeError):
                    other.writer.close()
                return {"ok": True, "revoked": rec.holder_text(), "kind": rec.kind}
        if isinstance(lease_id, str) and lease_id in self.orphans:
            rec = self.orphans[lease_id].record
            self._forget_orphan(lease_id)
            return {"ok": True, "revoked": rec.holder_text(), "kind": rec.kind}
        raise BrokerRefusal(
            f"revoke: no live lease or ticket {str(lease_id)[:64]!r}", "UsageErrorBase"
        )

    OPS: ClassVar[dict[str, Any]] = {
        "begin": op_begin,
        "end": op_end,
        "lease": op_lease,
        "pick": op_pick,
        "ticket": op_ticket,
        "set_pid": op_set_pid,
        "release": op_release,
        "leases": op_leases,
        "status": op_status,
        "revoke": op_revoke,
    }

    # -- connections ------------------------------------------------------------------------

    def accepted(self, sock: socket.socket) -> None:
        """A new connection (from :class:`net.Listener`): admitted, or refused with one line
        when the caps are reached (per person; in all, the last ones kept for root)."""
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        account = self.accounts.account(uid, gid)
        why = self._conn_refusal(uid, account)
        if why is not None:
            self._refuse(sock, uid, why)
            return
        conn = Conn(self, uid, gid, pid, account)
        self.conns.add(conn)
        self.per_key[conn.key] += 1
        task = asyncio.get_running_loop().create_task(self._run(conn))
        conn.writer = net.Channel(sock, OUT_BUFFER_BYTES + MAX_REPLY_BYTES, task.cancel)
        # The end of the task, however it ends (even cancelled before it ran), ends the
        # connection: its lock, its lease or ticket, its socket.
        task.add_done_callback(lambda _t: self._ended(conn))

    def _conn_refusal(self, uid: int, account: Account) -> str | None:
        total = len(self.conns)
        if uid == 0:
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

    def _refuse(self, sock: socket.socket, uid: int, why: str) -> None:
        line = json.dumps({"ok": False, "type": "RegistryError", "error": why,
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

    async def _run(self, conn: Conn) -> None:
        with contextlib.suppress(OSError, RuntimeError):  # a connection lost on the way
            await self._serve(conn)

    def _ended(self, conn: Conn) -> None:
        self.conns.discard(conn)
        self.per_key[conn.key] -= 1
        if self.per_key[conn.key] <= 0:
            del self.per_key[conn.key]
        self._drop_lock(conn)
        if conn.record is not None:
            conn.record = None
        conn.writer.shut()
        with contextlib.suppress(OSError):
            conn.writer.sock.close()

    async def _serve(self, conn: Conn) -> None:
        while True:
            try:
                line = await conn.writer.readline(MAX_REQUEST_BYTES)
            except ValueError:
                await self._send(
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
                await self._send(conn, _error("malformed message (not JSON): connection closed"))
                return
            await self._throttle(conn)
            op = msg.get("op") if isinstance(msg, dict) else None
            if not isinstance(op, str) or op not in self.OPS:
                await self._send(conn, _error(
                    f"unknown message (op {_short(op)}; expected one of "
                    f"{', '.join(self.OPS)}): connection closed"
                ))
                return
            if not conn.greeted:
                mismatch = _protocol_mismatch(msg.get("proto"))
                if mismatch:
                    await self._send(conn, {"ok": False, "type": "RegistryUntrustedError",
                                            "error": mismatch})
                    return
                conn.greeted = True
            try:
                if op == "ticket":
                    self._may_join(conn)
                    await self._fresh_snapshot()  # to judge whether the ticket waits at all
                reply = await self.OPS[op](self, conn, msg)
            except BrokerRefusal as err:
                reply = {"ok": False, "error": str(err), "type": err.kind}
            if not await self._send(conn, reply):
                return
            if op == "begin" and conn.ids is None:
                # The pick decides in its own process now: meanwhile, read what its lease's
                # journal line will need, off the path of the `lease` that follows.
                self._holder_ids(conn)

    async def _send(self, conn: Conn, msg: dict[str, Any]) -> bool:
        """Send one reply; ``False`` when the connection is gone or the client does not read it
        within ``send_timeout_s`` (then it is dropped: its buffer is freed, its lease ends)."""
        msg.setdefault("proto", PROTOCOL)
        if isinstance(msg, _RecordReply) and len(msg) == 3:  # as built (a pick adds labels)
            data = b'{"ok":true,"proto":%d,"record":%s}\n' % (PROTOCOL, msg.encoded)
        elif msg == _OK:
            data = _OK_LINE
        else:
            data = json.dumps(msg).encode() + b"\n"
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

    async def _fresh_snapshot(self) -> None:
        """A snapshot at most a second old for :meth:`_servable_now` (none without a fleet)."""
        if time.monotonic() - self._snap_at <= 1.0:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self._snapshot)
        except Exception as err:  # no GPU library: tickets reserve as they always did
            log.debug("no snapshot for a new ticket: %s", err)
            self._snap, self._snap_at = None, time.monotonic()

    def _may_join(self, conn: Conn) -> None:
        """A person joins the waiting line at most :data:`TICKETS_PER_S` times a second (a
        burst of :data:`TICKET_BURST`): a waiting pick takes one ticket; each costs the broker
        a decision."""
        if conn.uid == 0:
            return
        now = time.monotonic()
        barred = self.line_barred.get(conn.key, 0.0)
        if barred > now:
            raise BrokerRefusal(
                f"{conn.user} left a place in the waiting line that could be served, without "
                f"taking a lease: {conn.user} may wait in line again in {barred - now:.0f} s "
                "(a pick that does not wait works now)", "LeaseLimitError",
            )
        bucket = self.joined.setdefault(conn.key, [float(TICKET_BURST), now])
        bucket[0] = min(float(TICKET_BURST), bucket[0] + (now - bucket[1]) * TICKETS_PER_S)
        bucket[1] = now
        if bucket[0] < 1.0:
            raise BrokerRefusal(
                f"{conn.user} joined the waiting line {TICKET_BURST} times in the last "
                f"{TICKET_BURST / TICKETS_PER_S:.0f} s: wait a moment before taking another "
                "ticket", "LeaseLimitError",
            )
        bucket[0] -= 1.0
        if len(self.joined) > 4 * len(self.per_key) + 64:
            for k in [k for k in self.joined if k not in self.per_key]:
                del self.joined[k]

    async def _throttle(self, conn: Conn) -> None:
        """A token bucket per person: a flood from one user (and their subordinate uids)
        delays that user's own messages."""
        rate = self.config.messages_per_s_per_user
        if conn.uid == 0 or rate <= 0:
            return
        now = time.monotonic()
        bucket = self.buckets.setdefault(conn.key, [rate, now])
        bucket[0] = min(rate, bucket[0] + (now - bucket[1]) * rate) - 1.0
        bucket[1] = now
        if bucket[0] < 0:
            await asyncio.sleep(-bucket[0] / rate)
        if len(self.buckets) > 4 * len(self.per_key) + 64:  # people who left: bounded
            full = [k for k, b in self.buckets.items() if k not in self.per_key]
            for k in full:
                del self.buckets[k]

    # -- journal ----------------------------------------------------------------------------

    def _journal(self) -> None:
        """Kept for the operations' call sites: changes are journaled as they happen (setting a
        connection's record), written before the reply."""

    def _record_changed(
        self, conn: Conn, old: LeaseRecord | None, new: LeaseRecord | None
    ) -> None:
        """A connection's record was set: the live state's version moves on, a ticket's line
        state follows, and the journal gets the change (not while stopping: the next broker
        takes those leases back)."""
        self.version += 1
        ended = old is not None and (new is None or new.lease_id != old.lease_id)
        began = new is not None and (old is None or new.lease_id != old.lease_id)
        if ended:
            assert old is not None
            since = self.servable_since.pop(old.lease_id, None)
            self.dormant.discard(old.lease_id)
            if (old.kind == "ticket" and since is not None
                    and self.last_lease_at.get(conn.key, -1e9) < since):
                self._bar_from_line(conn.key, old)  # left a place it could have taken
        if began and new is not None and new.kind == "lease":
            self.last_lease_at[conn.key] = time.monotonic()
        if began and new is not None and new.kind == "ticket" and self._servable_now(new):
            self.dormant.add(new.lease_id)
        journal = self.journal
        if journal is None or self.stopping:
            return
        if ended:
            assert old is not None
            journal.remove(old.lease_id)
        if new is None:
            return
        if began:
            peer = self._holder_ids(conn)[0]
            pids = list(conn.holder_pids)
            journal.add(jrnl.Entry(new.lease_id, conn.uid, self._encoded(new).decode(), peer,
                                   pids), seq=new.seq)
        else:  # the same lease, changed (set_pid): the new record and its holders
            known = journal.entries.get(new.lease_id)
            peer = None if known is None else known.peer
            journal.add(jrnl.Entry(new.lease_id, conn.uid, self._encoded(new).decode(), peer,
                                   list(conn.holder_pids)))

    def _encoded(self, rec: LeaseRecord) -> bytes:
        """``encode(rec)``, kept for the last record (records are immutable): a grant's
        journal line and its reply carry the same bytes, encoded once."""
        last, data = self._last_encoded
        if last is not rec:
            data = encode(rec)
            self._last_encoded = (rec, data)
        return data

    def _holder_ids(self, conn: Conn) -> tuple[int | None, list[tuple[int, int]]]:
        """``conn``'s peer socket inode (``None`` without a journal: only the journal needs
        it) and its connecting process as ``[(pid, start time)]``, read from the kernel once
        per connection."""
        if conn.ids is None:
            peer = None
            if self.journal is not None and conn.writer is not None:
                peer = jrnl.peer_inode(conn.writer.sock)
            conn.ids = (peer, _proc_ids(conn.pid))
        return conn.ids

    def _forget_orphan(self, lease_id: str) -> None:
        if self.orphans.pop(lease_id, None) is not None:
            self.version += 1
            self.servable_since.pop(lease_id, None)
            self.dormant.discard(lease_id)
            if self.journal is not None and not self.stopping:
                self.journal.remove(lease_id)

    def _load_journal(self) -> None:
        assert self.journal is not None
        try:
            entries = self.journal.load()
        except OSError as err:
            raise SystemExit(
                f"autogpu broker: journal in {self.config.state_dir} unusable ({err})"
            ) from None
        self.seq = self.journal.seq
        held = jrnl.scan_socket_holders(e.peer for e in entries.values() if e.peer)
        kept = 0
        for e in entries.values():
            try:
                kind = json.loads(e.record)["kind"]
                rec = parse_record(e.record.encode(), kind=kind, path="", live=True)
            except (Invalid, KeyError, TypeError, ValueError) as err:
                log.warning("journal entry skipped: %s", err)
                self.journal.remove(e.lease_id)
                continue
            pids = held.get(e.peer, []) if e.peer else jrnl.holders_alive(e.pids, None, e.uid)
            if not pids:
                self.journal.remove(e.lease_id)
                continue
            rec = replace(rec, path=f"broker:{rec.lease_id}")
            self.seq = max(self.seq, rec.seq or 0)
            key = self.accounts.account(e.uid, _primary_gid(e.uid)).key
            self.orphans[rec.lease_id] = Orphan(e.uid, rec, pids, key, e.peer)
            self.version += 1
            self.journal.set_pids(rec.lease_id, pids)
            kept += 1
        if self.journal.dropped:
            log.warning("restart: the journal was of an earlier boot (%s): its %d lease(s)/"
                        "ticket(s) ended with that boot and are dropped",
                        self.journal.logged_boot, self.journal.dropped)
        log.info("restart: %d lease(s)/ticket(s) taken back from the journal", kept)

    async def reap_orphans(self) -> None:
        """Every second: free orphans nobody holds any more, and let servable tickets that
        were not turned into leases lapse."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            try:
                await self._reap(loop)
                await self._lapse_tickets(loop)
            except Exception:  # the reaper must outlive any one bad round
                log.exception("orphan and ticket check failed")
            if self.waiting and self.lock_holder is None:
                self._grant_next()

    async def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        lost: list[Orphan] = []
        for o in list(self.orphans.values()):
            alive = jrnl.holders_alive(o.holder_pids, o.peer, o.uid)
            if alive:
                o.holder_pids = alive
            else:
                lost.append(o)
        if not lost:
            return
        # Every known holder is gone; a child it forked may still hold the socket: one scan.
        peers = [o.peer for o in lost if o.peer]
        held = await loop.run_in_executor(None, jrnl.scan_socket_holders, peers) if peers else {}
        for o in lost:
            pids = held.get(o.peer, []) if o.peer else []
            if pids and o.record.lease_id in self.orphans:
                o.holder_pids = pids
                if self.journal is not None:
                    self.journal.set_pids(o.record.lease_id, pids)
            else:
                self._forget_orphan(o.record.lease_id)

    def reserving(self, rec: LeaseRecord) -> bool:
        """Whether ``rec`` is a ticket that reserves devices for its waiter (not dormant)."""
        return rec.kind == "ticket" and rec.lease_id not in self.dormant

    def _waiters(
        self, snap: Any, tickets: list[LeaseRecord], settled_only: bool = False
    ) -> dict[str, tuple[str, ...]]:
        """The tickets of ``tickets`` (in line order) the one decision would serve now;
        ``settled_only``: as if the leases younger than :data:`SETTLED_S` were not there."""
        born = time.time() - SETTLED_S if settled_only else float("inf")
        leases = [r for _, r in self.live() if r.kind == "lease" and r.created_s <= born]
        bookings = decision.bookings_for(snap.devices, leases)
        return decision.served_waiters(snap.devices, bookings, tickets)

    def _line(self) -> list[LeaseRecord]:
        tickets = [r for _, r in self.live() if r.kind == "ticket"]
        return admission.in_line(tickets)

    def _servable_now(self, ticket: LeaseRecord) -> bool:
        """Whether a device is free for a ticket, behind the reserving tickets (by the last
        snapshot, at most a second old; without one: no), counting only leases held for
        :data:`SETTLED_S` at least: a waiter waits for a job to end, not for another user's
        pick of a moment ago (a ticket taken while such a pick held its device would otherwise
        reserve every device the moment that pick let go)."""
        snap = self._snap
        if snap is None or time.monotonic() - self._snap_at > 1.0:
            return False
        line = [r for r in self._line() if self.reserving(r) and r.lease_id != ticket.lease_id]
        try:
            return ticket.lease_id in self._waiters(snap, [*line, ticket], settled_only=True)
        except Exception as err:  # a ticket the decision cannot read reserves as before
            log.debug("ticket %s not judged: %s", ticket.lease_id, err)
            return False

    async def _lapse_tickets(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every second, with a fresh snapshot: a dormant ticket for which nothing is free any
        more starts reserving (it waits now); a ticket (dormant or reserving) the broker could
        serve, for longer than ``ticket_grace_s``, but that was not turned into a lease loses
        its place (its connection is told, then closed)."""
        line = self._line()
        if not line:
            self.servable_since.clear()
            return
        try:
            snap = await loop.run_in_executor(None, self._snapshot)
        except Exception as err:  # no fleet to judge by: no ticket lapses
            log.debug("no snapshot for the ticket check: %s", err)
            return
        for rec in self._line():
            if rec.lease_id in self.dormant and not self._servable_now(rec):
                self.dormant.discard(rec.lease_id)  # leases that stay block it: it waits now
        reserving = [r for r in self._line() if self.reserving(r)]
        servable = set(self._waiters(snap, reserving))
        for rec in self._line():  # a dormant ticket could be served too, behind the others
            if rec.lease_id in self.dormant and rec.lease_id in self._waiters(
                snap, [*reserving, rec]
            ):
                servable.add(rec.lease_id)
        now = time.monotonic()
        for rec in self._line():
            if rec.lease_id not in servable:
                self.servable_since.pop(rec.lease_id, None)
                continue
            since = self.servable_since.setdefault(rec.lease_id, now)
            if now - since >= self.config.ticket_grace_s:
                self._lapse(rec)

    def _bar_from_line(self, key: int, rec: LeaseRecord) -> None:
        """A person whose ticket could be served but was not taken (it lapsed, or was dropped
        while servable) may not join the line for :data:`LINE_BAR_S`: otherwise a stream of
        tickets taken and left would keep a place ahead of everyone."""
        now = time.monotonic()
        self.line_barred[key] = now + LINE_BAR_S
        if len(self.line_barred) > 4096:
            self.line_barred = {k: t for k, t in self.line_barred.items() if t > now}
        log.info("%s left ticket %d that could be served: barred from the line for %.0f s",
                 rec.user, rec.seq or 0, LINE_BAR_S)

    def _lapse(self, rec: LeaseRecord) -> None:
        self.lapsed += 1
        self.servable_since.pop(rec.lease_id, None)
        key = next((k for k, r in self.live() if r.lease_id == rec.lease_id), None)
        if key is not None:
            self._bar_from_line(key, rec)
        log.info("ticket %d of %s lapsed: it could be served for %.0f s but was not taken",
                 rec.seq or 0, rec.user, self.config.ticket_grace_s)
        for conn in list(self.conns):
            if conn.record is not None and conn.record.lease_id == rec.lease_id:
                conn.record = None
                _notify(conn, {
                    "event": "ticket_lapsed", "lease_id": rec.lease_id,
                    "message": f"your place in the waiting line (ticket {rec.seq}) lapsed: a "
                    f"device was free for it for {self.config.ticket_grace_s:.0f} s but no "
                    "lease was taken",
                })
                with contextlib.suppress(OSError, RuntimeError, AttributeError):
                    conn.writer.close()
                return
        self._forget_orphan(rec.lease_id)


_PICK_KEYS = (
    "min_free", "max_util", "count", "exclude", "exclusive", "model", "prefer", "devices"
)


class _RecordReply(dict):  # type: ignore[type-arg]
    """``{"ok": true, "record": <payload>}`` for a record just granted: sent as the bytes
    its journal line carries (:meth:`Broker._encoded`), not encoded a second time."""

    def __init__(self, rec: LeaseRecord, encoded: bytes) -> None:
        super().__init__(ok=True, record=rec._payload())
        self.encoded = encoded


_OK = {"ok": True, "proto": PROTOCOL}
_OK_LINE = json.dumps(_OK).encode() + b"\n"


class _StateView:
    """The broker's live records as :func:`core.decision.gather` reads a store
    (:class:`~autogpu_jupyter.core.leasing.store.RecordView`), with the devices reserved away
    from the asking user as the admission's pseudo-leases; dormant tickets reserve nothing."""

    def __init__(self, broker: Broker, conn: Conn) -> None:
        self._broker = broker
        self._conn = conn

    def live_records(
        self, txn: StoreTransaction | None = None
    ) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        live = [r for _, r in self._broker.live()]
        leases = [r for r in live if r.kind == "lease"] + self._broker.reserved_away(self._conn)
        tickets = [r for r in live if r.kind == "ticket" and self._broker.reserving(r)]
        return leases, admission.in_line(tickets)


_STATUS_USERS = 256


def _device_rows(uuid: str, recs: list[LeaseRecord]) -> dict[str, Any]:
    """One device of the booking view: the first :data:`VIEW_ROWS_PER_DEVICE` leases
    (exclusive first, then the largest bookings) as rows, the rest folded into ``more``."""
    ranked = sorted(recs, key=lambda r: (not r.exclusive, -(r.requested_on(uuid) or 0)))
    rows = []
    for rec in ranked[:VIEW_ROWS_PER_DEVICE]:
        where = rec.holder_text().partition(": ")[2]
        rows.append([rec.exclusive, rec.pid, rec.requested_on(uuid),
                     cut_encoded(rec.user, _VIEW_TEXT), cut_encoded(where, _VIEW_TEXT)])
    rest = ranked[VIEW_ROWS_PER_DEVICE:]
    more = {
        "leases": len(rest),
        "exclusive": any(r.exclusive for r in rest),
        "booked": sum(r.requested_on(uuid) or 0 for r in rest),
    }
    return {"uuid": uuid, "rows": rows, "more": more}


def _fleet_ids(snap: Any) -> set[str]:
    """Every id a lease may name on this host: each device's UUID (MIG devices included)."""
    return {d.uuid for d in snap.devices}


def _capped(holder: Mapping[str, Any], key: str) -> str | None:
    """A holder's free-text field as the record keeps it: at most ``FIELD_CAPS[key]`` encoded
    bytes (a longer one is cut, not refused: it only labels the lease)."""
    v = holder.get(key)
    return capped_text(v if isinstance(v, str) else None, key)


def _short(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _protocol_mismatch(theirs: Any) -> str | None:
    """One line when a client speaks another protocol than :data:`PROTOCOL` (``None``: same)."""
    if theirs == PROTOCOL and not isinstance(theirs, bool):
        return None
    spoken = "no protocol version (an autogpu older than 0.2)" if theirs is None else (
        f"protocol {_short(theirs)}"
    )
    return (
        f"this autogpu speaks {spoken}, the lease broker speaks protocol {PROTOCOL} (autogpu "
        f"{__version__}): the broker and this environment come from different autogpu "
        "versions; upgrade autogpu here (or ask the admin to run the same version for both)"
    )


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except (KeyError, OverflowError):
        return uid


def _proc_ids(pid: int) -> list[tuple[int, int]]:
    return jrnl.proc_ids(pid)


def _notify(conn: Conn, event: dict[str, Any]) -> None:
    """An unsolicited line to a holder (``revoked``, ``replaced``, ``ticket_lapsed``): its
    client reads it with its next reply."""
    with contextlib.suppress(OSError, RuntimeError, AttributeError):
        conn.writer.write(json.dumps(event).encode() + b"\n")


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message, "type": "RegistryError"}


def _check_state_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SystemExit(f"autogpu broker: state directory {path} is not a directory of ours")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)


def _inherited_socket() -> socket.socket | None:
    """The listening socket systemd passed (socket activation: ``LISTEN_FDS``), if any."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    try:
        n = int(os.environ.get("LISTEN_FDS", "0"))
    except ValueError:
        return None
    if n < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)
    return socket.socket(fileno=3)


def _initial_fleet(broker: Broker) -> None:
    """The fleet at start: reserved ids are checked against it (a typo stops the broker)."""
    try:
        broker._snapshot()
    except Exception as err:  # no GPU library here: neither check can be made
        log.warning("the broker cannot see this host's devices (%s): reserved ids and leased "
                    "ids are not checked against the fleet", err)
        return
    broker.config.check_reserved(broker._fleet)


async def serve(config: BrokerConfig, ready: Any = None) -> None:
    """Run the broker until cancelled (SIGTERM/SIGINT stop it cleanly)."""
    broker = Broker(config)
    _initial_fleet(broker)
    sock = _inherited_socket() or net.listen(config.socket_path)
    listener = net.Listener(sock, broker.accepted)
    reaper = asyncio.create_task(broker.reap_orphans())
    if ready is not None:
        ready()
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: None if stop.done() else stop.set_result(None))
    try:
        await stop
    finally:
        reaper.cancel()
        broker.stopping = True
        listener.close()


def main(config: BrokerConfig) -> int:
    """``autogpu broker --foreground``: serve until SIGTERM."""
    logging.basicConfig(level=logging.INFO, format="autogpu-broker: %(message)s", stream=sys.stderr)
    if os.geteuid() != 0:
        log.warning(
            "not running as root: users' identities are still checked, but the "
            "journal and socket belong to uid %d",
            os.geteuid(),
        )

    def ready() -> None:
        print(f"autogpu broker: listening on {config.socket_path}", file=sys.stderr, flush=True)

    asyncio.run(serve(config, ready))
    return 0
