"""The client of the trusted lease broker (``autogpu broker``, issue 11): a lease store.

:class:`BrokerStore` is the second implementation of the lease store port
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
import socket
import stat
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core.leasing.admission import in_line
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.leasing.store import (
    HeldLease,
    LeaseStore,
    Requester,
    ScanResult,
    StoreTransaction,
)
from autogpu_jupyter.core.leasing.wire import (
    ERRORS,
    HOLDER_KINDS,
    MAX_LIST_RECORDS,
    MAX_REPLY_BYTES,
    MAX_REQUEST_BYTES,
    PAGE_BYTES,
    PAGE_RECORDS,
    PROTOCOL,
    VIEW_BY_PID,
    VIEW_ROWS_PER_DEVICE,
    VIEW_TICKET_BYTES,
    VIEW_TICKETS,
    from_wire,
    holder_msg,
    lease_events,
    reservations,
    version_mismatch,
    view_records,
    wire_records,
)
from autogpu_jupyter.errors import (
    AutoGPUError,
    LeaseStoreError,
    LeaseStoreUnreachableError,
    LeaseStoreUntrustedError,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot

#: The wire's names (:mod:`~autogpu_jupyter.core.leasing.wire`) stay importable from here.
__all__ = [
    "DEFAULT_SOCKET",
    "HOLDER_KINDS",
    "MAX_LIST_RECORDS",
    "MAX_REPLY_BYTES",
    "MAX_REQUEST_BYTES",
    "PAGE_BYTES",
    "PAGE_RECORDS",
    "PROTOCOL",
    "VIEW_ROWS_PER_DEVICE",
    "VIEW_TICKETS",
    "VIEW_TICKET_BYTES",
    "BrokerLease",
    "BrokerStore",
    "BrokerTransaction",
    "broker_fix",
    "from_wire",
    "lease_events",
]

DEFAULT_SOCKET = "/run/autogpu/broker.sock"

_MAX_LINE = MAX_REPLY_BYTES
#: A pick's ``begin``: the booking view by process (an older broker sends its rows instead).
_BEGIN = {"op": "begin", "view": VIEW_BY_PID}
#: ``struct ucred`` (pid, uid, gid) of ``SO_PEERCRED``, unsigned: a uid may be >= 2**31.
_UCRED = struct.Struct("3I")


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
            raise LeaseStoreUnreachableError(
                f"the lease broker at {self.path} did not give {what} within {timeout_s:g} s "
                "(it is busy, or other picks hold it): nothing was picked; try again"
            ) from None
        except OSError as err:
            raise LeaseStoreUnreachableError(
                f"lost the lease broker at {self.path} ({_why(err)}); {broker_fix(self.path)}"
            ) from None
        except ValueError as err:  # a reply that is not JSON: not a broker we can trust
            raise LeaseStoreUntrustedError(
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
            raise LeaseStoreUntrustedError(version_mismatch(self.path, reply))
        self._greeted = True
        if not reply.get("ok"):
            cls = ERRORS.get(str(reply.get("type")), LeaseStoreError)
            raise cls(f"lease broker: {reply.get('error', 'refused')}")
        return reply

    def _read_line(self, op: str) -> dict[str, Any]:
        while b"\n" not in self._buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("the broker closed the connection")
            self._buf += chunk
            if len(self._buf) > _MAX_LINE:
                raise LeaseStoreError(
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
                raise LeaseStoreUnreachableError(
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
        raise LeaseStoreUntrustedError(
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



class BrokerLease(HeldLease):
    """A lease (or ticket) the broker granted to this connection; it lives as long as the socket.
    """

    def __init__(self, record: LeaseRecord, conn: _Conn, registry: BrokerStore) -> None:
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
        recs = wire_records([reply["record"]], self._registry.path)
        self.record = recs[0]

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()


class BrokerTransaction(StoreTransaction):
    """One pick under the broker's pick lock (see :meth:`BrokerStore.locked`)."""

    store: BrokerStore

    def __init__(self, registry: BrokerStore, conn: _Conn) -> None:
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
        LeaseStoreUntrustedError
            The broker was lost twice on the way, or did not grant the lock in time (fail
            closed; nothing is leased).
        """
        if self._leases is not None:
            return 0.0
        start = time.monotonic()
        conn = self._conn
        if conn is None:
            raise LeaseStoreError("this broker transaction is closed")
        registry = self.store
        try:
            reply = registry._granted(conn)
        except LeaseStoreUnreachableError:  # lost (the broker restarted): once more, afresh
            conn.close()
            self._conn = conn = registry._conn()
            try:
                conn.send(_BEGIN, registry.lock_timeout_s)
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
            wire_records(reply.get("own", ()), registry.path)
            + view_records(reply.get("devices", ()), registry.path)
            + reservations(reply.get("reserved"), registry.path)
        )
        self._tickets = wire_records(reply.get("tickets", ()), registry.path)
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
        (see :meth:`StoreTransaction.create`; ``LeaseStoreError``: refused or lost). ``parents``
        is not sent: the broker reads the host's MIG layout from its own snapshot."""
        uuids = [d if isinstance(d, str) else d.uuid for d in devices]
        if not uuids:
            raise ValueError("a lease needs at least one device")
        if requested_bytes is None or isinstance(requested_bytes, int):
            booked: list[int | None] = [requested_bytes] * len(uuids)
        else:
            booked = list(requested_bytes)
        if self._conn is None:
            raise LeaseStoreError("this broker transaction already made its lease")
        self.ready()
        assert self._conn is not None
        reply = self._conn.call(
            {
                "op": "lease",
                "devices": uuids,
                "requested_bytes": booked,
                "exclusive": bool(exclusive),
                "holder": holder_msg(requester),
                **self.store._ignored(),
            }
        )
        rec = wire_records([reply["record"]], self.store.path)[0]
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
        """A ticket is held by a connection of its own (see :meth:`BrokerStore.take_ticket`):
        this one's is the pick lock's."""
        return self.store.take_ticket(
            constraints=constraints, exclusive=exclusive, requester=requester
        )

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()  # closing gives the pick lock back


class BrokerStore(LeaseStore):
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
        return f"BrokerStore({self.path!r})"

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
        LeaseStoreUntrustedError
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
            conn.send(_BEGIN, self.lock_timeout_s)
        except LeaseStoreUnreachableError:
            conn.close()
            conn = self._conn()
            try:
                conn.send(_BEGIN, self.lock_timeout_s)
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
            self._visible(wire_records(payloads, self.path)),
            key=lambda r: (r.created_s, r.lease_id),
        ) + reservations(first.get("reserved"), self.path)

    def list_leases(self, *, include_tickets: bool = False) -> list[LeaseRecord]:
        """Live leases of every user, oldest first (other users' command lines never sent)."""
        conn = self._conn()
        try:
            payloads = _pages(conn, {"op": "leases", "tickets": include_tickets})
        finally:
            conn.close()
        return sorted(
            self._visible(wire_records(payloads, self.path)),
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
        return in_line(wire_records(payloads, self.path))

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
                    "holder": holder_msg(requester),
                    **self._ignored(),
                }
            )
            rec = wire_records([reply["record"]], self.path)[0]
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
        """Raise :class:`LeaseStoreUntrustedError` when the broker cannot be reached."""
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


def __getattr__(name: str) -> Any:
    # The names before the lease-store renames, deprecated for one release.
    from autogpu_jupyter._renamed import old_name  # noqa: PLC0415

    return old_name(__name__, name)
