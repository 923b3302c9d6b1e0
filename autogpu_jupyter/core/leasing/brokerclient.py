"""The client of the trusted lease broker (``autogpu broker``, issue 11): a lease store.

:class:`BrokerRegistry` is the second implementation of the lease store port
(:class:`~autogpu_jupyter.core.leasing.store.LeaseStore`, beside the shared directory), so every
surface -- magics, API, CLI, provisioner, server -- goes through the broker unchanged when
:func:`autogpu_jupyter.core.leasing.factory.store_for` selects it. Admission (exclusivity,
quotas, reserved groups, tickets) happens in the broker, by the same rules as the directory's
(:mod:`~autogpu_jupyter.core.leasing.admission`); its refusals come back as the same errors.

A lease is a connection: :meth:`BrokerLease.fileno` is the connected socket, handed to the
process that uses the GPU (``pass_fds``) exactly like a lease file's descriptor. When every copy
of it is closed the broker frees the lease.

A broker that is configured but cannot be reached fails the pick closed (one line naming the
admin's fix), unless the admin set ``c.AutoGPU.broker_fallback = "registry"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import select
import socket
import stat
import struct
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core.leasing.admission import in_line, reservation
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.leasing.store import (
    HeldLease,
    LeaseStore,
    Requester,
    ScanResult,
    StoreTransaction,
)
from autogpu_jupyter.errors import (
    AutoGPUError,
    LeaseLimitError,
    NoDeviceFitsError,
    RegistryError,
    RegistryUnreachableError,
    RegistryUntrustedError,
    UsageErrorBase,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot

__all__ = [
    "DEFAULT_SOCKET",
    "HOLDER_KINDS",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "PROTOCOL",
    "BrokerLease",
    "BrokerRegistry",
    "BrokerTransaction",
    "broker_fix",
]

DEFAULT_SOCKET = "/run/autogpu/broker.sock"

# -- the protocol, as both sides speak it (the broker imports these: the caps agree) ----------

#: The version of the protocol, in every request and reply (``"proto"``): a broker and a
#: client of different versions refuse each other with one line naming both.
PROTOCOL = 2
#: The longest request line the broker reads (a longer one closes that connection).
MAX_REQUEST_BYTES = 64 * 1024
#: The longest reply line the broker sends and a client reads. Replies are bounded by
#: construction (a compact booking view, pages of records, counts), never by other users'
#: records: a reply past this is a bug, reported as such.
MAX_REPLY_BYTES = 1024 * 1024
#: One page of ``leases``: at most this many records, and this many bytes of them.
PAGE_RECORDS = 256
PAGE_BYTES = 256 * 1024
#: What a client reads of ``leases`` in all (pages of the broker): a list of every lease on
#: the host is for people, and no host has this many.
MAX_LIST_RECORDS = 16384
#: The booking view of ``begin``: rows per device (the rest folded into one), waiting tickets.
VIEW_ROWS_PER_DEVICE = 16
VIEW_TICKETS = 64
VIEW_TICKET_BYTES = 256 * 1024
#: Who may hold a lease (``holder.kind``), as the picker's requester says.
HOLDER_KINDS = ("process", "kernel", "cli", "provisioner", "api")

_MAX_LINE = MAX_REPLY_BYTES
#: ``struct ucred`` (pid, uid, gid) of ``SO_PEERCRED``, unsigned: a uid may be >= 2**31.
_UCRED = struct.Struct("3I")
_ERRORS: dict[str, type[AutoGPUError]] = {
    "LeaseLimitError": LeaseLimitError,
    "NoDeviceFitsError": NoDeviceFitsError,
    "UsageErrorBase": UsageErrorBase,
    # a lease the broker cannot record (its disk full): the pick fails closed, even a plain one
    "RegistryUntrustedError": RegistryUntrustedError,
}


def broker_fix(path: str) -> str:
    """What the admin does when the broker at ``path`` cannot be reached."""
    return (
        "ask the admin to start it (systemctl enable --now autogpu-broker.socket, or "
        f"`autogpu broker --socket {path}`), or to set c.AutoGPU.broker_fallback = 'registry'"
    )


class _Conn:
    """One connection to the broker: request/reply lines (events such as ``revoked`` skipped)."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.sock = _connect(path, timeout_s)
        self._buf = b""
        self._greeted = False  # the broker's protocol was checked on this connection

    def call(
        self, msg: Mapping[str, Any], timeout_s: float = 30.0, waiting_for: str = ""
    ) -> dict[str, Any]:
        """Send ``msg``; the broker's reply. A refusal raises its :class:`AutoGPUError`.

        ``waiting_for`` words a timeout (``"its pick lock"``): a broker that answers late is
        busy, not down, and is not reported as down.
        """
        op = str(msg.get("op"))
        with self._talking(op, timeout_s, waiting_for):
            self._send_line(msg)
            reply = self._next_reply(op)
        return self._checked(reply)

    def send(self, msg: Mapping[str, Any], timeout_s: float = 30.0) -> None:
        """Send ``msg`` without waiting for its reply (:meth:`receive` reads it)."""
        with self._talking(str(msg.get("op")), timeout_s, ""):
            self._send_line(msg)

    def receive(self, op: str, timeout_s: float = 30.0, waiting_for: str = "") -> dict[str, Any]:
        """The reply to ``op``, sent before with :meth:`send` (see :meth:`call`)."""
        with self._talking(op, timeout_s, waiting_for):
            reply = self._next_reply(op)
        return self._checked(reply)

    @contextlib.contextmanager
    def _talking(self, op: str, timeout_s: float, waiting_for: str) -> Iterator[None]:
        """Bound the socket's waits by ``timeout_s``; a timeout or a lost broker said in
        words (fail closed); the socket left blocking again."""
        try:
            self.sock.settimeout(timeout_s)
            yield
        except TimeoutError:
            what = waiting_for or f"an answer to {op!r}"
            raise RegistryUnreachableError(
                f"the lease broker at {self.path} did not give {what} within {timeout_s:g} s "
                "(it is busy, or other picks hold it): nothing was picked; try again"
            ) from None
        except OSError as err:
            raise RegistryUnreachableError(
                f"lost the lease broker at {self.path} ({_why(err)}); {broker_fix(self.path)}"
            ) from None
        except ValueError as err:  # a reply that is not JSON: not a broker we can trust
            raise RegistryUntrustedError(
                f"lost the lease broker at {self.path} ({_why(err)}); {broker_fix(self.path)}"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                self.sock.settimeout(None)

    def _send_line(self, msg: Mapping[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps({**msg, "proto": PROTOCOL}).encode() + b"\n")
        except (BrokenPipeError, ConnectionResetError):
            # A broker that refuses a connection (its caps) answers and closes at once: a
            # request sent after that finds the pipe broken, but the refusal waits unread.
            # Its words, not "Broken pipe", are what the user needs.
            refusal = self._left_behind()
            if refusal is not None:
                self._checked(refusal)
            raise

    def _left_behind(self) -> dict[str, Any] | None:
        """The refusal a closed broker left in the socket, if a whole one is there."""
        try:
            while b"\n" not in self._buf and len(self._buf) <= _MAX_LINE:
                chunk = self.sock.recv(65536)
                if not chunk:
                    break
                self._buf += chunk
            line = self._buf.partition(b"\n")[0] if b"\n" in self._buf else b""
            data = json.loads(line) if line else None
        except (OSError, ValueError):
            return None
        if isinstance(data, dict) and data.get("ok") is False:
            return data
        return None

    def _next_reply(self, op: str) -> dict[str, Any]:
        while True:
            reply = self._read_line(op)
            if "event" not in reply:  # events such as ``revoked`` are not replies
                return reply

    def _checked(self, reply: dict[str, Any]) -> dict[str, Any]:
        if reply.get("proto") != PROTOCOL and not self._greeted:
            self.close()
            raise RegistryUntrustedError(_version_mismatch(self.path, reply))
        self._greeted = True
        if not reply.get("ok"):
            cls = _ERRORS.get(str(reply.get("type")), RegistryError)
            raise cls(f"lease broker: {reply.get('error', 'refused')}")
        return reply

    def _read_line(self, op: str) -> dict[str, Any]:
        while b"\n" not in self._buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                raise RegistryError(
                    f"the lease broker at {self.path} sent a reply to {op!r} longer than "
                    f"{_MAX_LINE} bytes: refused (the broker and this autogpu disagree on the "
                    "protocol's caps, or the broker has a bug; it is not down)"
                )
        line, _, self._buf = self._buf.partition(b"\n")
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("reply is not an object")
        return data

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _version_mismatch(path: str, reply: Mapping[str, Any]) -> str:
    theirs = reply.get("proto")
    if reply.get("ok") is False and reply.get("type") == "RegistryUntrustedError":
        return f"lease broker at {path}: {reply.get('error')}"  # it refused us: its words
    spoken = "an older protocol (no version)" if theirs is None else f"protocol {theirs!r:.20}"
    return (
        f"the lease broker at {path} speaks {spoken}, this autogpu speaks protocol {PROTOCOL}: "
        "the broker and this environment come from different autogpu versions; nothing was "
        "picked; ask the admin to run the same autogpu version for both"
    )


def _why(err: BaseException) -> str:
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def _connect(path: str, timeout_s: float) -> socket.socket:
    """Connect, retrying for ``timeout_s`` (a broker restarting comes back within seconds)."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    delay = 0.05
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            _check_broker_owner(sock, path)
            return sock
        except OSError as err:
            sock.close()
            if time.monotonic() + delay > deadline:
                raise RegistryUnreachableError(
                    f"the lease broker at {path} cannot be reached ({_why(err)}): nothing was "
                    f"picked; {broker_fix(path)}"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def _check_broker_owner(sock: socket.socket, path: str) -> None:
    """The process serving ``path`` must be root's (or our own: a test or a private broker):
    a broker run by another user could hand out fake leases, so it is refused.

    In a container with its own user namespace the host's root is not mapped: the kernel
    reports it (``SO_PEERCRED``) as the overflow uid (65534). That uid is accepted only there,
    and only when the socket and its directory are the overflow uid's or root's and nobody can
    write the directory (a host root's directory bind-mounted in: no process of the container
    can have put a socket there)."""
    data = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _pid, uid, _gid = _UCRED.unpack(data)
    if uid not in (0, os.geteuid()) and not _host_root_seen_from_a_user_namespace(uid, path):
        sock.close()
        raise RegistryUntrustedError(
            f"the lease broker at {path} runs as uid {uid}, not root: refused (another user "
            f"could hand out fake leases); {broker_fix(path)}"
        )


def _host_root_seen_from_a_user_namespace(uid: int, path: str) -> bool:
    """See :func:`_check_broker_owner`."""
    try:
        with open("/proc/sys/kernel/overflowuid", encoding="ascii") as f:
            overflow = int(f.read().strip() or 65534)
        with open("/proc/self/uid_map", encoding="ascii") as f:
            initial = f.read().split() == ["0", "0", "4294967295"]
        where = os.stat(os.path.dirname(os.path.abspath(path)))
        sock = os.stat(path)
    except (OSError, ValueError):
        return False
    owners = (0, overflow)
    return (uid == overflow and not initial and where.st_uid in owners and sock.st_uid in owners
            and not stat.S_IMODE(where.st_mode) & 0o022)


def _records(items: Iterable[Any], path: str) -> list[LeaseRecord]:
    """Records from the broker's payloads (the record format's fields). The broker built and
    checked them with the readers' schema; here they are only typed, not re-validated (a pick
    reads every live record under the pick lock: 128 strict parses would cost ~10 ms)."""
    out = []
    for item in items:
        try:
            out.append(from_wire(item, path))
        except (KeyError, TypeError, ValueError) as err:
            raise RegistryError(f"lease broker at {path} sent a bad record: {err}") from None
    return out


def from_wire(d: Mapping[str, Any], path: str) -> LeaseRecord:
    """One record from its payload dict (see :meth:`LeaseRecord._payload`)."""
    lease_id = str(d["lease_id"])
    constraints = d.get("constraints")
    return LeaseRecord(
        lease_id=lease_id,
        kind=str(d["kind"]),
        device_uuids=tuple(str(u) for u in d["device_uuids"]),
        device_requested_bytes=tuple(
            None if b is None else int(b) for b in d["device_requested_bytes"]
        ),
        exclusive=bool(d["exclusive"]),
        user=str(d["user"]),
        uid=int(d["uid"]),
        host=str(d["host"]),
        pid=int(d["pid"]),
        created_s=float(d["created_s"]),
        kernel_id=_opt(d.get("kernel_id")),
        notebook_path=_opt(d.get("notebook_path")),
        command=_opt(d.get("command")),
        holder_kind=str(d.get("holder_kind") or "process"),
        seq=None if d.get("seq") is None else int(d["seq"]),
        constraints=dict(constraints) if isinstance(constraints, Mapping) else None,
        path=f"{path}#{lease_id}",
    )


def _view_records(devices: Iterable[Any], path: str) -> list[LeaseRecord]:
    """Other users' leases as the booking view of ``begin`` gives them (see the broker's
    ``_view``): one record per row, and one per lease folded into ``more`` (the first of them
    carries what they book together). :func:`core.decision.bookings_for` then counts, books and
    excludes exactly as it would from the full records; only the bookings folded into ``more``
    are always counted (their pids are not sent): a pick may see a device fuller than it is,
    never emptier."""
    out: list[LeaseRecord] = []
    try:
        for dev in devices:
            uuid = str(dev["uuid"])
            for exclusive, pid, booked, user, where in dev["rows"]:
                out.append(_view_record(uuid, len(out), bool(exclusive), int(pid),
                                        None if booked is None else int(booked),
                                        str(user), str(where) or None, path))
            more = dev.get("more") or {}
            folded = min(int(more.get("leases", 0)), MAX_LIST_RECORDS)
            if folded > 0:
                out.append(_view_record(uuid, len(out), bool(more.get("exclusive")), 0,
                                        int(more.get("booked") or 0), "others", None, path))
            if folded > 1:  # the others book nothing and are alike: one record, counted each
                rest = _view_record(uuid, len(out), False, 0, None, "others", None, path)
                out += [rest] * (folded - 1)
    except (KeyError, TypeError, ValueError) as err:
        raise RegistryError(f"lease broker at {path} sent a bad booking view: {err}") from None
    return out


def _reservations(reserved: Any, path: str) -> list[LeaseRecord]:
    """The devices the admin reserved away from us, as the broker's view names them (UUID ->
    groups): the admission's pseudo-leases, so a ranking words them as the directory would
    ("reserved for group(s) ml by the admin"), not as another lease."""
    if reserved is None:
        return []
    try:
        items = list(reserved.items())[:MAX_LIST_RECORDS]
        return [reservation(str(uuid), [str(g) for g in groups][:64], "")
                for uuid, groups in items]
    except (AttributeError, TypeError) as err:
        raise RegistryError(f"lease broker at {path} sent a bad booking view: {err}") from None


def _view_record(uuid: str, n: int, exclusive: bool, pid: int, booked: int | None, user: str,
                 where: str | None, path: str) -> LeaseRecord:
    lease_id = f"view{n:028x}"
    return LeaseRecord(
        lease_id=lease_id, kind="lease", device_uuids=(uuid,), device_requested_bytes=(booked,),
        exclusive=exclusive, user=user, uid=-1, host="", pid=pid, created_s=0.0,
        notebook_path=where, path=f"{path}#{lease_id}",
    )


def _opt(v: Any) -> str | None:
    return None if v is None else str(v)


def _holder_msg(requester: Requester | None) -> dict[str, Any]:
    if requester is None:
        return {"kind": "process"}
    return {
        "kernel_id": requester.kernel_id,
        "notebook_path": requester.notebook_path,
        "command": requester.command,
        "kind": requester.kind,
    }


class BrokerLease(HeldLease):
    """A lease (or ticket) the broker granted to this connection; it lives as long as the socket.
    """

    def __init__(self, record: LeaseRecord, conn: _Conn, registry: BrokerRegistry) -> None:
        self.record = record
        self._conn: _Conn | None = conn
        self._registry = registry
        self._owner_pid = os.getpid()

    @property
    def held(self) -> bool:
        return self._conn is not None

    def fileno(self) -> int:
        if self._conn is None:
            raise ValueError(f"lease {self.record.lease_id} was released")
        return self._conn.sock.fileno()

    def release(self) -> None:
        """End the lease now (even if a child still holds a copy of the socket). Idempotent."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if os.getpid() == self._owner_pid:
                try:
                    conn.call({"op": "release"}, timeout_s=5.0)
                except AutoGPUError:
                    # The broker restarted: our lease is an orphan there; release it by id.
                    self._registry._release_orphan(self.record.lease_id)
        finally:
            conn.close()

    def detach(self) -> None:
        """Close this process's copy only: a child holding the socket keeps the lease."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def set_pid(self, pid: int) -> None:
        """Record ``pid`` (the kernel a provisioner started) as the holder; same user only."""
        if self._conn is None:
            raise ValueError(f"lease {self.record.lease_id} was released")
        reply = self._conn.call({"op": "set_pid", "pid": int(pid)}, timeout_s=10.0)
        recs = _records([reply["record"]], self._registry.path)
        self.record = recs[0]

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()


class BrokerTransaction(StoreTransaction):
    """One pick under the broker's pick lock (see :meth:`BrokerRegistry.locked`)."""

    store: BrokerRegistry

    def __init__(self, registry: BrokerRegistry, conn: _Conn) -> None:
        """``conn`` has sent ``begin``; its answer (the pick lock and the booking view) is
        read when the view is first needed (:meth:`ready`)."""
        self.store = registry
        self._conn: _Conn | None = conn
        self._leases: list[LeaseRecord] | None = None
        self._tickets: list[LeaseRecord] = []

    def ready(self) -> float:
        """Wait for the pick lock asked for at ``begin``; the seconds this call waited.

        Raises
        ------
        RegistryUntrustedError
            The broker was lost twice on the way, or did not grant the lock in time (fail
            closed; nothing is leased).
        """
        if self._leases is not None:
            return 0.0
        start = time.monotonic()
        conn = self._conn
        if conn is None:
            raise RegistryError("this broker transaction is closed")
        registry = self.store
        try:
            reply = registry._granted(conn)
        except RegistryUnreachableError:  # lost (the broker restarted): once more, afresh
            conn.close()
            self._conn = conn = registry._conn()
            try:
                conn.send({"op": "begin"}, registry.lock_timeout_s)
                reply = registry._granted(conn)
            except BaseException:
                conn.close()
                self._conn = None
                raise
        except BaseException:
            conn.close()
            self._conn = None
            raise
        self._leases = (
            _records(reply.get("own", ()), registry.path)
            + _view_records(reply.get("devices", ()), registry.path)
            + _reservations(reply.get("reserved"), registry.path)
        )
        self._tickets = _records(reply.get("tickets", ()), registry.path)
        return time.monotonic() - start

    def live_leases(self) -> list[LeaseRecord]:
        self.ready()
        assert self._leases is not None
        return self.store._visible(self._leases)

    def live_tickets(self) -> list[LeaseRecord]:
        self.ready()
        return in_line(self._tickets)

    def create(
        self,
        *,
        devices: Sequence[DeviceSnapshot | str],
        requested_bytes: int | Sequence[int | None] | None = None,
        exclusive: bool = False,
        requester: Requester | None = None,
        parents: Mapping[str, str] | None = None,
    ) -> BrokerLease:
        """Ask the broker for a lease on ``devices``; it admits it by the one admission's rules
        (see :meth:`StoreTransaction.create`; ``RegistryError``: refused or lost). ``parents``
        is not sent: the broker reads the host's MIG layout from its own snapshot."""
        uuids = [d if isinstance(d, str) else d.uuid for d in devices]
        if not uuids:
            raise ValueError("a lease needs at least one device")
        if requested_bytes is None or isinstance(requested_bytes, int):
            booked: list[int | None] = [requested_bytes] * len(uuids)
        else:
            booked = list(requested_bytes)
        if self._conn is None:
            raise RegistryError("this broker transaction already made its lease")
        self.ready()
        assert self._conn is not None
        reply = self._conn.call(
            {
                "op": "lease",
                "devices": uuids,
                "requested_bytes": booked,
                "exclusive": bool(exclusive),
                "holder": _holder_msg(requester),
                **self.store._ignored(),
            }
        )
        rec = _records([reply["record"]], self.store.path)[0]
        conn, self._conn = self._conn, None
        assert self._leases is not None
        self._leases.append(rec)
        return BrokerLease(rec, conn, self.store)

    def create_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> BrokerLease:
        """A ticket is held by a connection of its own (see :meth:`BrokerRegistry.take_ticket`):
        this one's is the pick lock's."""
        return self.store.take_ticket(
            constraints=constraints, exclusive=exclusive, requester=requester
        )

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # closing gives the pick lock back


class BrokerRegistry(LeaseStore):
    """The broker at ``socket_path`` seen as a lease store (see the module docstring)."""

    leaves_dead_entries = False  # a lease ends the moment its holder's connection closes

    def __init__(
        self, socket_path: str, *, lock_timeout_s: float = 10.0, connect_timeout_s: float = 5.0
    ) -> None:
        self.path = socket_path
        self.lock_timeout_s = lock_timeout_s
        self.connect_timeout_s = connect_timeout_s
        #: The broker enforces the admin's quota; the client promises nothing of its own.
        self.max_devices_per_user = 0
        self.record_commands = False
        self.uid = os.geteuid()
        try:
            self.user = pwd.getpwuid(self.uid).pw_name
        except KeyError:
            self.user = str(self.uid)
        self.unusable_reason: str | None = None

    def __repr__(self) -> str:
        return f"BrokerRegistry({self.path!r})"

    def _conn(self) -> _Conn:
        return _Conn(self.path, self.connect_timeout_s)

    def _ignored(self) -> dict[str, Any]:
        """What a lease or ticket asks the broker to leave out of its admission: the caller's
        OWN leases this view hides (a re-pick replaces them; another user's lease is never
        ignored)."""
        return {"ignore_ids": sorted(self._hidden_ids), "ignore_kernel": self._hidden_kernel}

    @contextlib.contextmanager
    def locked(self) -> Iterator[BrokerTransaction]:
        """Take the broker's pick lock (served fairly across users) for one pick.

        Raises
        ------
        RegistryUntrustedError
            The broker cannot be reached, or did not grant the lock in time (fail closed).
        """
        txn = self._begin()
        try:
            yield txn
        finally:
            txn.close()

    def _begin(self) -> BrokerTransaction:
        """Connect and ask for the pick lock, without waiting for it: the caller reads the
        devices meanwhile, and the transaction waits for the lock when it first needs the
        view (:meth:`BrokerTransaction.ready`). A connection lost on the way (the broker
        restarted) is tried once more on a fresh one."""
        conn = self._conn()
        try:
            conn.send({"op": "begin"}, self.lock_timeout_s)
        except RegistryUnreachableError:
            conn.close()
            conn = self._conn()
            try:
                conn.send({"op": "begin"}, self.lock_timeout_s)
            except BaseException:
                conn.close()
                raise
        return BrokerTransaction(self, conn)

    def _granted(self, conn: _Conn) -> dict[str, Any]:
        """The broker's answer to ``begin`` on ``conn``: the lock granted, with the view."""
        return conn.receive("begin", timeout_s=self.lock_timeout_s,
                            waiting_for="its pick lock")

    def _read_unlocked(self) -> list[LeaseRecord]:
        """Every live record, and the devices reserved away from us as the broker's pseudo-
        leases: a dry run ranks them out as a pick does (an older broker sends none)."""
        try:
            conn = self._conn()
            try:
                first: dict[str, Any] = {}
                payloads = _pages(conn, {"op": "leases", "tickets": True}, first)
            finally:
                conn.close()
        except AutoGPUError:
            return []
        return sorted(
            self._visible(_records(payloads, self.path)), key=lambda r: (r.created_s, r.lease_id)
        ) + _reservations(first.get("reserved"), self.path)

    def list_leases(self, *, include_tickets: bool = False) -> list[LeaseRecord]:
        """Live leases of every user, oldest first (other users' command lines never sent)."""
        conn = self._conn()
        try:
            payloads = _pages(conn, {"op": "leases", "tickets": include_tickets})
        finally:
            conn.close()
        return sorted(
            self._visible(_records(payloads, self.path)),
            key=lambda r: (r.created_s, r.lease_id),
        )

    def status(self) -> dict[str, Any]:
        """The broker's ``status`` answer (counts, per-user rows), with its leases and tickets
        read page by page on the same connection."""
        conn = self._conn()
        try:
            st = conn.call({"op": "status"})
            records = _pages(conn, {"op": "leases", "tickets": True})
        finally:
            conn.close()
        st["leases"] = [r for r in records if r.get("kind") == "lease"]
        st["tickets"] = [r for r in records if r.get("kind") == "ticket"]
        return st

    def revoke(self, lease_id: str) -> str:
        """End another process's lease (root only); the holder's text."""
        return self.revoke_record(lease_id)[1]

    def revoke_record(self, lease_id: str) -> tuple[str, str]:
        """End another process's lease or ticket (root only): (``lease`` or ``ticket``, the
        holder's text)."""
        conn = self._conn()
        try:
            reply = conn.call({"op": "revoke", "lease_id": lease_id})
        finally:
            conn.close()
        return str(reply.get("kind", "lease")), str(reply.get("revoked", ""))

    def reload_tenants(self) -> dict[str, Any]:
        """Have the broker read its tenants again (root only; ``autogpu broker tenant``):
        what changed, by name (``added``, ``removed``, ``updated``)."""
        conn = self._conn()
        try:
            reply: dict[str, Any] = conn.call({"op": "reload"})
        finally:
            conn.close()
        return reply

    def list_tickets(self) -> list[LeaseRecord]:
        """The waiting line, oldest first (``autogpu broker tickets``)."""
        conn = self._conn()
        try:
            payloads = _pages(conn, {"op": "leases", "kind": "ticket"})
        finally:
            conn.close()
        return in_line(_records(payloads, self.path))

    def take_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> BrokerLease:
        """Join the broker's waiting line, if it admits the ticket: a ticket held by a
        connection of its own."""
        conn = self._conn()
        try:
            reply = conn.call(
                {
                    "op": "ticket",
                    "constraints": dict(constraints),
                    "exclusive": bool(exclusive),
                    "holder": _holder_msg(requester),
                    **self._ignored(),
                }
            )
            rec = _records([reply["record"]], self.path)[0]
        except BaseException:
            conn.close()
            raise
        return BrokerLease(rec, conn, self)

    def _release_orphan(self, lease_id: str) -> None:
        with contextlib.suppress(AutoGPUError):
            conn = self._conn()
            try:
                conn.call({"op": "release", "lease_id": lease_id}, timeout_s=5.0)
            finally:
                conn.close()

    def prune(self, all_users: bool = False) -> list[LeaseRecord]:
        """Nothing to prune: the broker frees a lease the moment its connection closes."""
        return []

    def check(self) -> None:
        """Raise :class:`RegistryUntrustedError` when the broker cannot be reached."""
        self._conn().close()

    def scan(self) -> ScanResult:
        """Diagnostics: the broker's live records (nothing is ever dead or ignored there)."""
        return ScanResult(live=self.list_leases(include_tickets=True))


def _pages(
    conn: _Conn, msg: Mapping[str, Any], first: dict[str, Any] | None = None
) -> list[Any]:
    """Every record of a paged ``leases`` request (at most :data:`MAX_LIST_RECORDS`);
    ``first`` gets the first page's reply."""
    out: list[Any] = []
    after = None
    while True:
        reply = conn.call({**msg, "after": after})
        if first is not None and after is None:
            first.update(reply)
        out += list(reply.get("records") or ())
        after = reply.get("next")
        if after is None or len(out) >= MAX_LIST_RECORDS:
            return out[:MAX_LIST_RECORDS]


def lease_events(fd: int) -> list[str]:
    """Messages the broker sent, unasked, on a lease connection this process holds (``fd``):
    ``lease ... revoked by the admin``, a place in the waiting line that lapsed; also when the
    broker closed it. Never blocks; an fd
    that is not a socket (a lease file of the shared-directory registry) has none.

    Returns
    -------
    list of str
        One line per event, for the notebook user; empty when nothing happened.
    """
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return []
        readable, _, _ = select.select([fd], [], [], 0)
        if not readable:
            return []
        data = os.read(fd, 65536)
    except OSError:
        return []
    if not data:
        return ["the lease broker closed this kernel's lease connection: a broker that "
                "restarted keeps the lease while this kernel runs (`autogpu leases` shows it); "
                "else the lease has ended"]
    out = []
    for line in data.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict):
            continue
        if event.get("event") == "revoked":
            out.append(
                f"your GPU lease {str(event.get('lease_id', ''))[:32]} was revoked by the admin: "
                "this kernel no longer holds it; others may now be given its GPU"
            )
        elif event.get("event") == "ticket_lapsed":
            out.append(
                f"your place in the GPU waiting line (ticket "
                f"{str(event.get('lease_id', ''))[:32]}) lapsed: a device was free for it but "
                "no lease was taken; pick again to wait again"
            )
    return out
