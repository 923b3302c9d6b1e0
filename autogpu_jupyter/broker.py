"""``autogpu broker``: the trusted lease broker for hosts with many users (issue 11).

A small daemon, run by root, on a Unix socket every user may connect to. It alone owns the
lease state of the host; clients (:mod:`autogpu_jupyter.core.leasing.brokerclient`) talk to it in
newline-delimited JSON, one object per line, at most :data:`MAX_MESSAGE_BYTES` per line.

Identity comes only from the kernel (``SO_PEERCRED``: uid, gid, pid of the connecting process);
``user``, ``uid`` or ``pid`` fields in a message are never read as identity.

**A lease is a connection.** The connection that asked for a lease holds it: when every copy of
that socket is closed (the holder exits, is SIGKILLed, or hands the descriptor to a child that
exits), the broker sees EOF and frees the lease. A ticket (a place in the waiting line) is held
the same way. One connection holds at most one lease or ticket.

Operations (``{"op": ...}``)::

    begin      wait for the broker's pick lock (served fairly across users), get every live
               lease and ticket: the client decides with core.decision, as a local pick does
    end        give the lock back without a lease
    lease      hold a lease on these devices (checked: exclusivity, max_devices_per_user)
    pick       the broker ranks (its own snapshot, core.decision over its state) and leases
               what it chose, in one message (options in the one options schema)
    ticket     join the waiting line (FIFO; the broker numbers tickets)
    set_pid    the pid that uses the device (a kernel started by a provisioner); same uid only
    release    end this connection's lease or ticket (or, by ``lease_id``, an orphan of yours)
    leases     live leases (and tickets): other users' command lines are never sent
    status     leases, waiters, per-user counts
    revoke     root only: end a lease; its holder's connection is told, then closed

Restarts: with a state directory (root-only, ``--state-dir``) every change is journaled. A
restarted broker takes back each journaled lease or ticket whose holder process still runs (same
pid, same start time, same uid) as an *orphan*: held until that process exits, so no live lease
is lost or doubled; nothing is handed out on its devices in the meantime.

The broker is a front end: it imports core, never another front end.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import logging
import os
import pwd
import secrets
import signal
import socket
import stat
import struct
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from autogpu_jupyter.core import decision, options, procfs
from autogpu_jupyter.core.backends import get_backend
from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.brokerclient import DEFAULT_SOCKET
from autogpu_jupyter.core.leasing.records import (
    MAX_DEVICES,
    MAX_SEQ,
    Invalid,
    LeaseRecord,
    encode,
    field_text,
    parse_record,
)
from autogpu_jupyter.core.leasing.store import StoreTransaction
from autogpu_jupyter.core.picker import explain_drops
from autogpu_jupyter.errors import AutoGPUError

__all__ = ["Broker", "BrokerConfig", "DEFAULT_SOCKET", "MAX_MESSAGE_BYTES", "main", "serve"]

log = logging.getLogger("autogpu.broker")

#: The longest message line accepted; a longer one closes that connection.
MAX_MESSAGE_BYTES = 64 * 1024


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

    def load_rules(self, path: str) -> None:
        """Read the admin's rules file (JSON; see docs/admin-broker.md). Raises ``SystemExit``
        naming the file and the bad entry."""
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            if not isinstance(doc, dict):
                raise TypeError("expected a JSON object")
            unknown = set(doc) - {"max_devices_per_user", "users", "groups", "reserved"}
            if unknown:
                raise TypeError(f"unknown key {sorted(unknown)[0]!r}")
            if "max_devices_per_user" in doc:
                self.max_devices_per_user = _count(doc["max_devices_per_user"])
            self.user_limits = {str(k): _count(v) for k, v in doc.get("users", {}).items()}
            self.group_limits = {str(k): _count(v) for k, v in doc.get("groups", {}).items()}
            self.reserved = {
                str(k): [str(g) for g in v] for k, v in doc.get("reserved", {}).items()
            }
        except (OSError, ValueError, TypeError, AttributeError) as err:
            raise SystemExit(
                f"autogpu broker: rules file {path}: {err}; expected e.g. "
                '{"max_devices_per_user": 2, "users": {"alice": 4}, "groups": {"students": 1}, '
                '"reserved": {"GPU-...": ["ml"]}}'
            ) from None
    lock_timeout_s: float = 2.0
    record_commands: bool = False


@dataclass(eq=False)
class Conn:
    """One client connection and what it holds."""

    uid: int
    gid: int
    pid: int
    writer: asyncio.StreamWriter
    record: LeaseRecord | None = None
    holder_pids: list[tuple[int, int]] = field(default_factory=list)  # (pid, start time)
    granted: asyncio.Future[None] | None = None
    lock_handle: asyncio.TimerHandle | None = None

    @property
    def user(self) -> str:
        return _user_name(self.uid)

    @property
    def groups(self) -> set[str]:
        return _groups_of(self.uid, self.gid)


@dataclass(eq=False)
class Orphan:
    """A lease or ticket taken back from the journal after a restart: held while its process
    runs."""

    uid: int
    record: LeaseRecord
    holder_pids: list[tuple[int, int]]


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r} is not a whole number >= 0")
    return v


def _groups_of(uid: int, gid: int) -> set[str]:
    """Names of the groups of ``uid`` (its primary ``gid`` and supplementary groups)."""
    gids = {gid}
    with contextlib.suppress(KeyError, OSError):
        gids.update(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    names = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            names.add(str(g))
    return names


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


#: When ``pid`` started (clock ticks after boot): with the pid, one process (core.procfs).
_start_time = procfs.start_time


def _pid_uids(pid: int) -> set[int]:
    """The uids of ``pid`` (none when it is gone or hidden)."""
    return procfs.uids(pid) or set()


def _alive(pids: Sequence[tuple[int, int]], uid: int) -> bool:
    """Whether any of ``pids`` still runs: the same process (start time) of ``uid``."""
    for pid, start in pids:
        if _start_time(pid) == start and (uid == 0 or uid in _pid_uids(pid)):
            return True
    return False


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, from the kernel (``SO_PEERCRED``)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
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
        self.orphans: dict[str, Orphan] = {}
        self.seq = 0
        self.lock_holder: Conn | None = None
        self.waiting: deque[Conn] = deque()
        self.last_grant: dict[int, float] = {}
        self.started = time.time()
        self._journal_dirty = False
        #: Set on SIGTERM once the last journal is written: connections closed by the shutdown
        #: must not erase it (their holders still run and are taken back by the next broker).
        self.stopping = False
        self.backend: Any = None
        self.buckets: dict[int, list[float]] = {}  # uid -> [tokens, last refill (monotonic)]
        if config.state_dir:
            self._load_journal()

    # -- state ------------------------------------------------------------------------------

    def live(self) -> list[tuple[int, LeaseRecord]]:
        """Every live lease and ticket as (uid, record), oldest first."""
        out = [(c.uid, c.record) for c in self.conns if c.record is not None]
        out += [(o.uid, o.record) for o in self.orphans.values()]
        return sorted(out, key=lambda p: (p[1].created_s, p[1].lease_id))

    def _records(self, kind: str, viewer_uid: int) -> list[dict[str, Any]]:
        """Live records of ``kind`` as their payloads (the record format's fields), for a
        client of ``viewer_uid``: other users' command lines are left out (root sees them)."""
        out = []
        for uid, rec in self.live():
            if rec.kind != kind:
                continue
            shown = rec if viewer_uid in (0, uid) else replace(rec, command=None)
            out.append(shown._payload())
        return out

    # -- the pick lock ----------------------------------------------------------------------

    def _grant_next(self) -> None:
        """Give the lock to the waiter of the user served least recently (FIFO per user)."""
        while self.lock_holder is None and self.waiting:
            best = min(
                range(len(self.waiting)),
                key=lambda i: (self.last_grant.get(self.waiting[i].uid, 0.0), i),
            )
            conn = self.waiting[best]
            del self.waiting[best]
            if conn.granted is None or conn.granted.done():
                continue
            self.lock_holder = conn
            self.last_grant[conn.uid] = time.monotonic()
            loop = asyncio.get_running_loop()
            conn.lock_handle = loop.call_later(self.config.lock_timeout_s, self._expire_lock, conn)
            conn.granted.set_result(None)

    def _expire_lock(self, conn: Conn) -> None:
        if self.lock_holder is conn:
            log.warning(
                "uid %d (pid %d) held the pick lock too long: taken back", conn.uid, conn.pid
            )
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
        with contextlib.suppress(ValueError):
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
            self._grant_next()
            await conn.granted
        return {
            "ok": True,
            "leases": self._records("lease", conn.uid)
            + [r._payload() for r in self.reserved_away(conn)],
            "tickets": self._records("ticket", conn.uid),
            "max_devices_per_user": self.limit_for(conn)[0],
        }

    async def op_end(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        self._drop_lock(conn)
        return {"ok": True}

    def _holder_fields(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        holder = msg.get("holder") or {}
        if not isinstance(holder, dict):
            raise BrokerRefusal("holder: expected an object", "UsageErrorBase")
        pid = conn.pid
        return {
            "pid": pid,
            "kernel_id": field_text(_opt_str(holder.get("kernel_id"))),
            "notebook_path": field_text(_opt_str(holder.get("notebook_path"))),
            "command": field_text(_opt_str(holder.get("command")))
            if self.config.record_commands
            else None,
            "holder_kind": field_text(_opt_str(holder.get("kind")) or "process", 32) or "process",
        }

    def _make_record(self, conn: Conn, kind: str, payload: dict[str, Any]) -> LeaseRecord:
        """A record built by the broker: identity from the kernel, the rest validated by the
        readers' own schema (what a forged field would break is refused here)."""
        base = {
            "version": 1,
            "kind": kind,
            "lease_id": secrets.token_hex(16),
            "exclusive": False,
            "user": field_text(conn.user) or str(conn.uid),
            "uid": conn.uid,
            "host": field_text(self.host) or "?",
            "created_s": time.time(),
        }
        base.update(payload)
        try:
            data = json.dumps(base, separators=(",", ":")).encode()
            return parse_record(data, kind=kind, path=f"broker:{base['lease_id']}", live=True)
        except (Invalid, TypeError, ValueError) as err:
            raise BrokerRefusal(f"{kind} refused: {err}", "UsageErrorBase") from None

    def _replaced(self, conn: Conn, msg: dict[str, Any]) -> set[str]:
        """The caller's OWN live leases this lease replaces (a re-pick: ``ignore_ids``,
        ``ignore_kernel``). They end when the new lease is granted, so a re-pick can never hold
        both (nor exceed the quota by "replacing" leases it keeps); other users' are never
        touched."""
        ignore = msg.get("ignore_ids") or []
        ids = {i for i in ignore if isinstance(i, str)} if isinstance(ignore, list) else set()
        kernel = msg.get("ignore_kernel") if isinstance(msg.get("ignore_kernel"), str) else None
        return {
            r.lease_id
            for u, r in self.live()
            if u == conn.uid
            and r.kind == "lease"
            and (r.lease_id in ids or bool(kernel and r.kernel_id == kernel))
        }

    def _end_replaced(self, replaced: set[str]) -> None:
        for other in list(self.conns):
            if other.record is not None and other.record.lease_id in replaced:
                other.record = None
                _notify(other, {"event": "replaced", "message": "lease replaced by a re-pick"})
        for lease_id in replaced:
            self.orphans.pop(lease_id, None)

    def _applicant(self, conn: Conn) -> admission.Applicant:
        return admission.Applicant(conn.uid, conn.user, frozenset(conn.groups))

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
        """Live leases (less the ``replaced`` ones of a re-pick) and tickets, for admission."""
        live = self.live()
        leases = [r for _, r in live if r.kind == "lease" and r.lease_id not in replaced]
        return leases, [r for _, r in live if r.kind == "ticket"]

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
        if not isinstance(devices, list) or not devices or len(devices) > MAX_DEVICES:
            raise BrokerRefusal("devices: expected a list of device UUIDs", "UsageErrorBase")
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
        conn.record = rec
        conn.holder_pids = _proc_ids(conn.pid)
        self._journal()
        self._drop_lock(conn)
        return {"ok": True, "record": rec._payload()}

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
        return self.backend.snapshot()

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
        self.seq = rec.seq or self.seq
        conn.record = rec
        conn.holder_pids = _proc_ids(conn.pid)
        self._journal()
        return {"ok": True, "record": rec._payload()}

    async def op_set_pid(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        pid = msg.get("pid")
        if conn.record is None:
            raise BrokerRefusal("set_pid: this connection holds no lease")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise BrokerRefusal(f"set_pid: invalid pid {pid!r}", "UsageErrorBase")
        if conn.uid != 0 and conn.uid not in _pid_uids(pid):
            raise BrokerRefusal(f"set_pid: pid {pid} is not a process of yours")
        conn.record = replace(conn.record, pid=pid)
        conn.holder_pids = _proc_ids(pid) or conn.holder_pids
        self._journal()
        return {"ok": True, "record": conn.record._payload()}

    async def op_release(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        lease_id = msg.get("lease_id")
        if lease_id is None or (conn.record is not None and conn.record.lease_id == lease_id):
            conn.record = None
            self._journal()
            return {"ok": True}
        orphan = self.orphans.get(lease_id) if isinstance(lease_id, str) else None
        if orphan is None or orphan.uid != conn.uid:
            raise BrokerRefusal(f"release: no lease {str(lease_id)[:64]!r} of yours is orphaned")
        del self.orphans[orphan.record.lease_id]
        self._journal()
        return {"ok": True}

    async def op_leases(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        out = self._records("lease", conn.uid)
        if msg.get("tickets"):
            out += self._records("ticket", conn.uid)
        return {"ok": True, "records": out}

    async def op_status(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        per_user: dict[str, dict[str, int]] = {}
        for uid, rec in self.live():
            row = per_user.setdefault(
                rec.user or str(uid), {"leases": 0, "devices": 0, "tickets": 0}
            )
            if rec.kind == "lease":
                row["leases"] += 1
                row["devices"] += len(rec.device_uuids)
            else:
                row["tickets"] += 1
        return {
            "ok": True,
            "leases": self._records("lease", conn.uid),
            "tickets": self._records("ticket", conn.uid),
            "per_user": per_user,
            "orphans": len(self.orphans),
            "connections": len(self.conns),
            "waiting_for_lock": len(self.waiting),
            "max_devices_per_user": self.config.max_devices_per_user,
            "uptime_s": time.time() - self.started,
            "pid": os.getpid(),
        }

    async def op_revoke(self, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        if conn.uid != 0:
            raise BrokerRefusal("revoke needs root")
        lease_id = msg.get("lease_id")
        for other in list(self.conns):
            if other.record is not None and other.record.lease_id == lease_id:
                rec, other.record = other.record, None
                self._journal()
                note = {
                    "event": "revoked",
                    "lease_id": rec.lease_id,
                    "message": f"lease {rec.lease_id} revoked by the admin",
                }
                with contextlib.suppress(OSError, RuntimeError):
                    other.writer.write(json.dumps(note).encode() + b"\n")
                    other.writer.close()
                return {"ok": True, "revoked": rec.holder_text()}
        if isinstance(lease_id, str) and lease_id in self.orphans:
            rec = self.orphans.pop(lease_id).record
            self._journal()
            return {"ok": True, "revoked": rec.holder_text()}
        raise BrokerRefusal(f"revoke: no live lease {str(lease_id)[:64]!r}", "UsageErrorBase")

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

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            writer.close()
            return
        conn = Conn(uid=uid, gid=gid, pid=pid, writer=writer)
        mine = sum(1 for c in self.conns if c.uid == uid)
        if uid != 0 and mine >= self.config.max_connections_per_user:
            await _send(
                writer,
                {
                    "ok": False,
                    "type": "RegistryError",
                    "error": f"too many connections for uid {uid} "
                    f"(max_connections_per_user = {self.config.max_connections_per_user})",
                },
            )
            writer.close()
            return
        self.conns.add(conn)
        try:
            await self._serve(conn, reader)
        finally:
            self.conns.discard(conn)
            self._drop_lock(conn)
            if conn.record is not None:
                conn.record = None
                self._journal()
            with contextlib.suppress(OSError, RuntimeError):
                writer.close()

    async def _serve(self, conn: Conn, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except (ValueError, asyncio.LimitOverrunError):
                await _send(
                    conn.writer,
                    _error(f"message longer than {MAX_MESSAGE_BYTES} bytes: connection closed"),
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
                await _send(conn.writer, _error("malformed message (not JSON): connection closed"))
                return
            await self._throttle(conn.uid)
            if not isinstance(msg, dict) or msg.get("op") not in self.OPS:
                await _send(conn.writer, _error("unknown message: connection closed"))
                return
            try:
                reply = await self.OPS[msg["op"]](self, conn, msg)
            except BrokerRefusal as err:
                reply = {"ok": False, "error": str(err), "type": err.kind}
            if not await _send(conn.writer, reply):
                return

    async def _throttle(self, uid: int) -> None:
        """A token bucket per uid: a flood from one user delays that user's own messages."""
        rate = self.config.messages_per_s_per_user
        if uid == 0 or rate <= 0:
            return
        now = time.monotonic()
        bucket = self.buckets.setdefault(uid, [rate, now])
        bucket[0] = min(rate, bucket[0] + (now - bucket[1]) * rate) - 1.0
        bucket[1] = now
        if bucket[0] < 0:
            await asyncio.sleep(-bucket[0] / rate)

    # -- journal ----------------------------------------------------------------------------

    def _journal(self) -> None:
        if not self.config.state_dir or self.stopping:
            return
        if self._journal_dirty:
            return
        self._journal_dirty = True
        asyncio.get_running_loop().call_soon(self._write_journal)

    def _write_journal(self) -> None:
        self._journal_dirty = False
        assert self.config.state_dir
        entries = [
            {"uid": c.uid, "record": encode(c.record).decode(), "pids": c.holder_pids}
            for c in self.conns
            if c.record is not None
        ] + [
            {"uid": o.uid, "record": encode(o.record).decode(), "pids": o.holder_pids}
            for o in self.orphans.values()
        ]
        data = json.dumps({"seq": self.seq, "entries": entries}).encode()
        path = os.path.join(self.config.state_dir, "journal.json")
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _load_journal(self) -> None:
        assert self.config.state_dir
        _check_state_dir(self.config.state_dir)
        path = os.path.join(self.config.state_dir, "journal.json")
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as err:
            log.warning("journal %s unreadable (%s): starting empty", path, err)
            return
        self.seq = int(doc.get("seq", 0))
        for entry in doc.get("entries", []):
            try:
                kind = json.loads(entry["record"])["kind"]
                rec = parse_record(entry["record"].encode(), kind=kind, path="", live=True)
                pids = [(int(p), int(s)) for p, s in entry["pids"]]
                uid = int(entry["uid"])
            except (Invalid, KeyError, TypeError, ValueError) as err:
                log.warning("journal entry skipped: %s", err)
                continue
            rec = replace(rec, path=f"broker:{rec.lease_id}")
            if _alive(pids, uid):
                self.orphans[rec.lease_id] = Orphan(uid, rec, pids)
        log.info("restart: %d lease(s)/ticket(s) taken back from the journal", len(self.orphans))

    async def reap_orphans(self) -> None:
        """Free orphaned leases whose process has exited (polled every second)."""
        while True:
            await asyncio.sleep(1.0)
            gone = [k for k, o in self.orphans.items() if not _alive(o.holder_pids, o.uid)]
            for k in gone:
                del self.orphans[k]
            if gone:
                self._journal()
            if self.waiting and self.lock_holder is None:
                self._grant_next()


_PICK_KEYS = ("min_free", "max_util", "count", "exclude", "exclusive", "model", "prefer")


class _StateView:
    """The broker's live records as :func:`core.decision.gather` reads a store
    (:class:`~autogpu_jupyter.core.leasing.store.RecordView`), with the devices reserved away
    from the asking user as the admission's pseudo-leases."""

    def __init__(self, broker: Broker, conn: Conn) -> None:
        self._broker = broker
        self._conn = conn

    def live_records(
        self, txn: StoreTransaction | None = None
    ) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        leases, tickets = self._broker._live_split(set())
        return leases + self._broker.reserved_away(self._conn), admission.in_line(tickets)


def _proc_ids(pid: int) -> list[tuple[int, int]]:
    start = _start_time(pid)
    return [] if start is None else [(pid, start)]


def _notify(conn: Conn, event: dict[str, Any]) -> None:
    """An unsolicited line to a holder (``revoked``, ``replaced``): its client reads it with
    its next reply."""
    with contextlib.suppress(OSError, RuntimeError):
        conn.writer.write(json.dumps(event).encode() + b"\n")


def _opt_str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message, "type": "RegistryError"}


async def _send(writer: asyncio.StreamWriter, msg: dict[str, Any]) -> bool:
    try:
        writer.write(json.dumps(msg).encode() + b"\n")
        await writer.drain()
    except (ConnectionError, OSError, RuntimeError):
        return False
    return True


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


def _listen(path: str) -> socket.socket:
    parent = os.path.dirname(path) or "."
    os.makedirs(parent, mode=0o755, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise SystemExit(f"autogpu broker: {path} exists and is not a socket; remove it")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    os.chmod(path, 0o666)  # noqa: S103 (world-connectable: identity comes from SO_PEERCRED)
    sock.listen(1024)
    return sock


async def serve(config: BrokerConfig, ready: Any = None) -> None:
    """Run the broker until cancelled (SIGTERM/SIGINT stop it cleanly)."""
    broker = Broker(config)
    sock = _inherited_socket() or _listen(config.socket_path)
    server = await asyncio.start_unix_server(broker.handle, sock=sock, limit=MAX_MESSAGE_BYTES)
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
        if broker.config.state_dir:
            broker._write_journal()
        broker.stopping = True
        server.close()


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
