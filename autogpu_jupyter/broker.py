"""``autogpu broker``: the trusted lease broker for hosts with many users (issue 11).

A small daemon, run by root, on a Unix socket every user may connect to. It alone owns the
lease state of the host; clients (:mod:`autogpu_jupyter.core.leasing.brokerclient`) talk to it in
newline-delimited JSON, one object per line: requests of at most ``MAX_REQUEST_BYTES``, replies
of at most ``MAX_REPLY_BYTES`` (both defined there: the two sides agree). Every request and reply
carries ``"proto"``; the protocol before it (messages without a version) is served too, its
replies in the shapes it reads. The first message of a connection with any other protocol is
answered with one line naming both sides' versions, and the connection is closed.

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
    reload     root only (main socket): read the tenants again (brokerd/tenantd.py)

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
back each journaled lease or ticket whose socket still exists, in whatever namespace its holder
runs (else: whose recorded holders still run, by pid and start time) as an *orphan*: held
until no process holds it any more, so no live lease is lost or doubled; nothing is handed out
on its devices in the meantime (:mod:`autogpu_jupyter.brokerd.restore`).

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
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autogpu_jupyter.brokerd import journal as jrnl
from autogpu_jupyter.brokerd import net, startup
from autogpu_jupyter.brokerd import tenants as tenancy
from autogpu_jupyter.brokerd.book import (  # noqa: F401 (the broker's names, re-exported)
    LINE_BAR_S,
    SETTLED_S,
    TICKET_BURST,
    TICKETS_PER_S,
    BrokerRefusal,
    LeaseBook,
    Orphan,
)
from autogpu_jupyter.brokerd.connections import (  # noqa: F401
    OUT_BUFFER_BYTES,
    Conn,
    Connections,
    _protocol_mismatch,
    notify,
    peer_credentials,
)
from autogpu_jupyter.brokerd.fleet import Fleet
from autogpu_jupyter.brokerd.identity import Accounts
from autogpu_jupyter.brokerd.ops import OPS
from autogpu_jupyter.brokerd.picklock import (  # noqa: F401
    LOCK_MISUSE_MEMORY_S,
    LOCK_SLICE_S,
    PickLock,
)
from autogpu_jupyter.brokerd.restore import Restorer
from autogpu_jupyter.brokerd.tenantd import TenantSockets
from autogpu_jupyter.brokerd.views import RowCache, ViewWarmer
from autogpu_jupyter.brokerd.views import StateView as _StateView  # noqa: F401
from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.brokerclient import DEFAULT_SOCKET, MAX_REQUEST_BYTES

__all__ = ["Broker", "BrokerConfig", "DEFAULT_SOCKET", "MAX_MESSAGE_BYTES", "main", "serve"]

log = logging.getLogger("autogpu.broker")

#: The longest message line accepted; a longer one closes that connection.
MAX_MESSAGE_BYTES = MAX_REQUEST_BYTES


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
    #: The rules file's tenants (issue 40; brokerd/tenants.py), beside the state directory's
    #: table: each served on its own socket under ``tenant_socket_root`` (brokerd/tenantd.py).
    tenants: dict[str, tenancy.Tenant] = field(default_factory=dict)
    tenant_socket_root: str = tenancy.DEFAULT_SOCKET_ROOT
    #: The rules file read (``--rules``): its tenants are read again on a reload.
    rules_path: str | None = None

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
                "groups", "reserved", "unknown_uids", "tenants",
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
            self.tenants = tenancy.parse_rules(doc.get("tenants", {}))
            self.rules_path = path
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


def _count(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{v!r} is not a whole number >= 0")
    return v


class Broker:
    """The broker's rooms, wired together (one asyncio loop, no threads): the lease book
    (:mod:`~autogpu_jupyter.brokerd.book`), the pick lock, the fleet, the op table, the
    connections and the journal's restore."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.host = socket.gethostname()
        self.started = time.time()
        #: Set on SIGTERM once the last journal is written: connections closed by the shutdown
        #: must not erase it (their holders still run and are taken back by the next broker).
        self.stopping = False
        self.accounts = Accounts(config.subuid_path)
        self.book = LeaseBook(config, self.host)
        self.book.notify = notify
        self.lock = PickLock(config)
        self.fleet = Fleet(self.book)
        self.ops_cache = RowCache()
        self.views = ViewWarmer(self.book, self.ops_cache)  # rows built again off a pick's path
        self.book.index.on_change = self.views.changed
        self.connections = Connections(self)
        self.book.active = self.connections.per_key
        journal = None
        if config.state_dir:
            startup.check_state_dir(config.state_dir)
            journal = jrnl.Journal(config.state_dir)
        self.restorer = Restorer(self, journal)
        self.tenant_sockets = TenantSockets(self)
        if journal is not None:
            self.restorer.load()

    def reload(self) -> dict[str, list[str]]:
        """Read the tenants (at start; SIGHUP and root's ``reload`` read them again off the
        loop, :meth:`TenantSockets.reload_off_loop`): see brokerd/tenantd.py."""
        return self.tenant_sockets.reload()

    async def run_op(self, op: str, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Run one protocol op for ``conn`` (validate, then execute), as the serve loop does."""
        return await OPS[op](self, conn, msg)

    def accepted(self, sock: socket.socket) -> None:
        self.connections.accepted(sock)



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
        broker.fleet.snapshot()
    except Exception as err:  # no GPU library here: neither check can be made
        log.warning("the broker cannot see this host's devices (%s): reserved ids and leased "
                    "ids are not checked against the fleet", err)
        return
    broker.config.check_reserved(broker.fleet.ids)


async def serve(config: BrokerConfig, ready: Any = None) -> None:
    """Run the broker until cancelled (SIGTERM/SIGINT stop it cleanly)."""
    broker = Broker(config)
    _initial_fleet(broker)
    sock = _inherited_socket() or net.listen(config.socket_path)
    listener = net.Listener(sock, broker.accepted)
    try:
        broker.reload()
    except tenancy.TenantError as err:
        raise SystemExit(f"autogpu broker: {err}") from None
    reaper = asyncio.create_task(broker.restorer.reap_orphans())
    broker.views.changed()  # the restored leases' rows, before the first pick
    if ready is not None:
        ready()
    loop = asyncio.get_running_loop()
    stop = loop.create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: None if stop.done() else stop.set_result(None))
    loop.add_signal_handler(signal.SIGHUP, _reload, broker)
    try:
        await stop
    finally:
        reaper.cancel()
        broker.stopping = True
        listener.close()
        broker.tenant_sockets.close()


def _reload(broker: Broker) -> None:
    """SIGHUP: read the tenants again, the files read off the loop."""
    task = asyncio.get_running_loop().create_task(_reload_off_loop(broker))
    _RELOADS.add(task)  # kept until done (the loop holds tasks weakly)
    task.add_done_callback(_RELOADS.discard)


_RELOADS: set[asyncio.Task[None]] = set()


async def _reload_off_loop(broker: Broker) -> None:
    try:
        await broker.tenant_sockets.reload_off_loop()
    except (tenancy.TenantError, OSError) as err:
        log.warning("reload refused, the tenants served are unchanged: %s", err)


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
