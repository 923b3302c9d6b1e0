"""The lease book: every live lease and ticket of the broker, and the waiting line's bars.

What the book holds: the record of each connection that holds one (a lease or a ticket), the
*orphans* (leases and tickets taken back from the journal after a restart, held by processes
that are not connected), the ticket counter, and the waiting line's state (tickets that reserve
nothing yet, when a ticket could first be served, who may not join the line for a while).
Every question the admission asks of the broker's state, and the state the one-message pick
ranks over, is answered here.

Synchronous and self-contained: no event loop, no sockets. A holder is anything with ``key``
(the person, :class:`autogpu_jupyter.brokerd.identity.Account`), ``uid``, ``user``,
``groups`` and ``account``; the broker's connections are such holders, and tests hold leases
on plain objects. Changes are reported to :attr:`LeaseBook.on_change` (the journal) and
unsolicited lines to :attr:`LeaseBook.notify` (the holder's connection).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from autogpu_jupyter.brokerd.liveindex import LiveIndex
from autogpu_jupyter.core import decision
from autogpu_jupyter.core.devices import physical_gpu
from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.records import MAX_ID_LIST, LeaseRecord, encode
from autogpu_jupyter.core.leasing.wire import WIRE_STORE_ERROR, wire_kind
from autogpu_jupyter.errors import AutoGPUError

__all__ = ["BrokerRefusal", "Holder", "LeaseBook", "Orphan", "LINE_BAR_S", "SETTLED_S",
           "TICKETS_PER_S", "TICKET_BURST"]

log = logging.getLogger("autogpu.broker")

#: Tickets a person may take per second on average, and at once.
TICKETS_PER_S = 2.0
TICKET_BURST = 8
#: How long a person who left a servable ticket (lapsed, or dropped) may not join the line.
LINE_BAR_S = 60.0
#: A lease younger than this does not make a new ticket wait (see ``LeaseBook.servable_now``).
SETTLED_S = 2.0


class BrokerRefusal(Exception):
    """A request the broker refuses; the message goes back to the client (one line)."""

    def __init__(self, message: str, kind: str = WIRE_STORE_ERROR) -> None:
        super().__init__(message)
        self.kind = kind


class Holder(Protocol):
    """Who holds a record in the book (a connection of the broker)."""

    uid: int
    account: Any

    @property
    def key(self) -> int: ...

    @property
    def user(self) -> str: ...

    @property
    def groups(self) -> set[str]: ...


@dataclass(eq=False)
class Orphan:
    """A lease or ticket taken back from the journal after a restart: held while its socket
    exists (``peer``; some process holds it), or, where no socket is known, while its recorded
    holders run. ``netns``: the network namespace its socket was found in (``None``: not
    looked for yet, or no socket)."""

    uid: int
    record: LeaseRecord
    holder_pids: list[tuple[int, int]]
    key: int = 0
    peer: int | None = None
    netns: int | None = None


class LeaseBook:
    """The broker's live leases and tickets, the orphans and the waiting line (no asyncio)."""

    def __init__(self, config: Any, host: str) -> None:
        self.config = config
        self.host = host
        #: The live record of each holder that has one (a connection's lease or ticket).
        self.held: dict[Any, LeaseRecord] = {}
        self.orphans: dict[str, Orphan] = {}
        self.seq = 0
        #: Bumped by every change of the live records (see :meth:`live`).
        self.version = 0
        self._live: tuple[int, list[tuple[int, LeaseRecord]]] = (-1, [])
        #: The live records, indexed as each one changes (:class:`LiveIndex`).
        self.index = LiveIndex()
        self.lapsed = 0  # tickets that lost their place, in all
        self.servable_since: dict[str, float] = {}  # ticket id -> when it could first be served
        #: Tickets that joined the line while a device was free for them: they reserve nothing
        #: (a waiter only waits when nothing fits) until the line is full for them once.
        self.dormant: set[str] = set()
        self.joined: dict[int, list[float]] = {}  # person -> [tokens, last refill]: tickets/s
        self.line_barred: dict[int, float] = {}  # person -> until when it may not join the line
        self.last_lease_at: dict[int, float] = {}  # person -> when it was last granted a lease
        #: The people connected now, with their connections (who else is remembered is
        #: bounded by it); the broker's connections set it.
        self.active: Mapping[int, int] = {}
        #: The last fleet snapshot and when it was taken (monotonic); set by the broker's fleet.
        self.snap: Any = None
        self.snap_at = -1e9
        #: The host's MIG layout (MIG device -> its GPU), by the last snapshot: reservations
        #: and exclusivity are decided on the physical GPU.
        self.parents: dict[str, str] = {}
        #: Told of every change: ``(holder, old, new)`` (the journal writes it).
        self.on_change: Callable[[Any, LeaseRecord | None, LeaseRecord | None], None] | None = None
        #: Told of an orphan that ended (the journal forgets it).
        self.on_forget: Callable[[str], None] | None = None
        #: Sends an unsolicited line to a holder, then closes it when asked: ``(holder, event,
        #: close)``.
        self.notify: Callable[[Any, dict[str, Any], bool], None] | None = None
        self._last_encoded: tuple[LeaseRecord | None, bytes] = (None, b"")
        #: The tenants served now, by name (their own device limits); set by the broker.
        self.tenants: Mapping[str, Any] = {}

    # -- the live state ---------------------------------------------------------------------

    def live(self) -> list[tuple[int, LeaseRecord]]:
        """Every live lease and ticket as (person, record), oldest first (computed once per
        change of the state: a pick reads it several times)."""
        if self._live[0] != self.version:
            self._live = (self.version, self.index.ordered())
        return list(self._live[1])

    def _hold(self, holder: Any, rec: LeaseRecord | None) -> None:
        """``holder``'s live record is ``rec`` now (``None``: none)."""
        old = self.held.pop(holder, None) if rec is None else self.held.get(holder)
        if old is not None:
            self.index.remove(old, self.version)
        if rec is not None:
            self.held[holder] = rec
            self.index.add(holder.key, rec, self.version, holder)

    def encoded(self, rec: LeaseRecord) -> bytes:
        """``encode(rec)``, kept for the last record (records are immutable): a grant's
        journal line and its reply carry the same bytes, encoded once."""
        last, data = self._last_encoded
        if last is not rec:
            data = encode(rec)
            self._last_encoded = (rec, data)
        return data

    def holder_of(self, lease_id: Any) -> Any:
        """The holder of the live record ``lease_id`` (``None``: none, or an orphan's)."""
        return self.index.holders.get(lease_id) if isinstance(lease_id, str) else None

    def record_changed(self, holder: Any, old: LeaseRecord | None,
                       new: LeaseRecord | None) -> None:
        """``holder``'s record was set: the live state's version moves on, a ticket's line
        state follows, and :attr:`on_change` gets the change."""
        self.version += 1
        self._hold(holder, new)
        ended = old is not None and (new is None or new.lease_id != old.lease_id)
        began = new is not None and (old is None or new.lease_id != old.lease_id)
        if ended:
            assert old is not None
            since = self.servable_since.pop(old.lease_id, None)
            self.dormant.discard(old.lease_id)
            if (old.kind == "ticket" and since is not None
                    and self.last_lease_at.get(holder.key, -1e9) < since):
                self.bar_from_line(holder.key, old)  # left a place it could have taken
        if began and new is not None and new.kind == "lease":
            self.last_lease_at[holder.key] = time.monotonic()
        if began and new is not None and new.kind == "ticket" and self.servable_now(new):
            self.dormant.add(new.lease_id)
        if self.on_change is not None:
            try:
                self.on_change(holder, old, new)
            except BrokerRefusal:  # the journal could not record it: not granted (nor changed)
                undone = None if ended else old
                self.version += 1
                self._hold(holder, undone)
                if new is not None:
                    self.dormant.discard(new.lease_id)
                raise

    def adopt(self, orphan: Orphan) -> None:
        """Hold ``orphan`` (taken back from the journal) in the book."""
        self.version += 1
        old = self.orphans.get(orphan.record.lease_id)
        if old is not None:
            self.index.remove(old.record, self.version)
        self.orphans[orphan.record.lease_id] = orphan
        self.index.add(orphan.key, orphan.record, self.version)
        self.seq = max(self.seq, orphan.record.seq or 0)

    def forget_orphan(self, lease_id: str) -> None:
        gone = self.orphans.pop(lease_id, None)
        if gone is not None:
            self.version += 1
            self.index.remove(gone.record, self.version)
            self.servable_since.pop(lease_id, None)
            self.dormant.discard(lease_id)
            if self.on_forget is not None:
                self.on_forget(lease_id)

    # -- admission --------------------------------------------------------------------------

    def applicant(self, conn: Holder) -> admission.Applicant:
        """Who asks, for the admission: the quota and the lines count the *person*
        (``conn.key``: a subordinate uid is its owner), the root check is the uid itself."""
        uid = conn.key if conn.account.tenant else conn.uid  # a tenant is never root
        return admission.Applicant(uid, conn.user, frozenset(conn.groups), key=conn.key)

    def quota(self, conn: Holder) -> admission.Quota:
        limit, why = self.limit_for(conn)
        return admission.Quota(
            max_devices=limit,
            max_leases=self.config.max_leases_per_user,
            max_tickets=self.config.max_tickets_per_user,
            source=why,
            enforcer=" (enforced by the broker)",
        )

    def limit_for(self, conn: Holder) -> tuple[int, str]:
        """The device limit of ``conn``'s user (0: none) and where it comes from."""
        cfg = self.config
        user = conn.user
        if conn.account.unknown:
            return cfg.unknown_max_devices, " for uids without a passwd entry"
        tenant = self.tenants.get(user) if conn.account.tenant else None
        if tenant is not None and tenant.max_devices is not None:
            return tenant.max_devices, f" for tenant {user}"
        if user in cfg.user_limits:
            return cfg.user_limits[user], f" for {user}"
        mine = {g: cfg.group_limits[g] for g in conn.groups if g in cfg.group_limits}
        if mine:
            group = max(mine, key=lambda g: (mine[g] == 0, mine[g]))  # 0 = no limit: the most
            return mine[group], f" for group {group}"
        return cfg.max_devices_per_user, ""

    def reserved_away(self, conn: Holder) -> list[LeaseRecord]:
        """Devices reserved for groups ``conn``'s user is not in, as exclusive pseudo-leases
        (:func:`admission.reservation`): the one decision then ranks them out, worded by the
        admission ("reserved for group(s) ml by the admin"), with no rule of its own."""
        if not self.config.reserved:
            return []
        away = admission.reserved_away(self.config.reserved, self.applicant(conn), self.parents)
        return [admission.reservation(u, groups, self.host) for u, groups in away.items()]

    def reserved_reply(self, conn: Holder) -> dict[str, list[str]]:
        """The devices reserved away from ``conn``'s user, as a client ranks them out."""
        return admission.reserved_reply(self.config.reserved, self.applicant(conn), self.parents)

    def replaced(self, conn: Holder, msg: Mapping[str, Any]) -> set[str]:
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
            for r in self.index.own.get(conn.key, {}).values()
            if r.lease_id in ids or bool(kernel and r.kernel_id == kernel)
        }

    def end_replaced(self, replaced: set[str]) -> None:
        for other in [self.index.holders[i] for i in replaced if i in self.index.holders]:
            other.record = None
            self.tell(other, {"event": "replaced", "message": "lease replaced by a re-pick"})
        for lease_id in replaced:
            self.forget_orphan(lease_id)

    def live_split(self, replaced: set[str]) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        """Live leases (less the ``replaced`` ones of a re-pick) and tickets, for admission,
        each marked with its person: the copies' ``uid`` is the account key of the uid that
        holds it (a subordinate uid's owner), as :attr:`admission.Applicant.key` counts."""
        live = [r if r.uid == key else replace(r, uid=key) for key, r in self.live()]
        leases = [r for r in live if r.kind == "lease" and r.lease_id not in replaced]
        return leases, [r for r in live if r.kind == "ticket"]

    def counted_for(self, conn: Holder, devices: Any, replaced: set[str]) -> list[LeaseRecord]:
        """The live leases the admission of a lease on ``devices`` reads, as :meth:`live_split`
        gives them (less ``replaced``, marked with their person, oldest first): those on any
        device of the physical GPUs of ``devices`` (its exclusivity and MIG-kin checks read only
        those) and the person's own (its quotas read only those). Every other lease is passed
        over by each of :func:`admission.admit_lease`'s checks, so its verdict and its words are
        the ones it gives over every live lease; this costs what those leases hold, not what
        the whole book holds."""
        parents = self.parents
        gpus = {physical_gpu(u, parents) for u in devices}
        picked = {i: (conn.key, r) for i, r in self.index.own.get(conn.key, {}).items()}
        for uuid, on in self.index.on_device.items():
            if physical_gpu(uuid, parents) in gpus:
                picked.update(on)
        ordered = sorted((p for i, p in picked.items() if i not in replaced),
                         key=lambda p: (p[1].created_s, p[1].lease_id))
        return [r if r.uid == key else replace(r, uid=key) for key, r in ordered]

    def check_lease(self, conn: Holder, rec: LeaseRecord, replaced: set[str]) -> None:
        """The one admission's verdict on ``rec`` (:func:`admission.admit_lease`), over the
        leases it reads (:meth:`counted_for`)."""
        leases = self.counted_for(conn, rec.device_uuids, replaced)
        try:
            admission.admit_lease(
                leases,
                applicant=self.applicant(conn),
                devices=rec.device_uuids,
                exclusive=rec.exclusive,
                quota=self.quota(conn),
                reserved=self.config.reserved,
                parents=self.parents,
            )
        except AutoGPUError as err:
            raise BrokerRefusal(str(err), wire_kind(err)) from None

    def check_ticket(self, conn: Holder, rec: LeaseRecord, replaced: set[str]) -> LeaseRecord:
        """The one admission's verdict on a ticket (:func:`admission.admit_ticket`): ``rec``
        with the constraints it admitted. Of the leases it reads only the person's own (its
        device quota), so only those are given; the tickets all."""
        leases = [r for r in self.index.own_leases(conn.key) if r.lease_id not in replaced]
        leases = [r if r.uid == conn.key else replace(r, uid=conn.key) for r in leases]
        tickets = [r if r.uid == key else replace(r, uid=key) for key, r in self.index.tickets()]
        try:
            admitted = admission.admit_ticket(
                leases,
                tickets,
                applicant=self.applicant(conn),
                constraints=rec.constraints or {},
                quota=self.quota(conn),
                reserved=self.config.reserved,
                parents=self.parents,
            )
        except AutoGPUError as err:
            raise BrokerRefusal(str(err), wire_kind(err)) from None
        return rec if admitted == rec.constraints else replace(rec, constraints=admitted)

    # -- the waiting line -------------------------------------------------------------------

    def reserving(self, rec: LeaseRecord) -> bool:
        """Whether ``rec`` is a ticket that reserves devices for its waiter (not dormant)."""
        return rec.kind == "ticket" and rec.lease_id not in self.dormant

    def line(self) -> list[LeaseRecord]:
        return admission.in_line([r for _, r in self.index.tickets()])

    def waiters(
        self, snap: Any, tickets: list[LeaseRecord], settled_only: bool = False
    ) -> dict[str, tuple[str, ...]]:
        """The tickets of ``tickets`` (in line order) the one decision would serve now;
        ``settled_only``: as if the leases younger than :data:`SETTLED_S` were not there."""
        born = time.time() - SETTLED_S if settled_only else float("inf")
        leases = [r for _, r in self.live() if r.kind == "lease" and r.created_s <= born]
        bookings = decision.bookings_for(snap.devices, leases)
        return decision.served_waiters(snap.devices, bookings, tickets)

    def servable_now(self, ticket: LeaseRecord) -> bool:
        """Whether a device is free for a ticket, behind the reserving tickets (by the last
        snapshot, at most a second old; without one: no), counting only leases held for
        :data:`SETTLED_S` at least: a waiter waits for a job to end, not for another user's
        pick of a moment ago (a ticket taken while such a pick held its device would otherwise
        reserve every device the moment that pick let go)."""
        snap = self.snap
        if snap is None or time.monotonic() - self.snap_at > 1.0:
            return False
        line = [r for r in self.line() if self.reserving(r) and r.lease_id != ticket.lease_id]
        try:
            return ticket.lease_id in self.waiters(snap, [*line, ticket], settled_only=True)
        except Exception as err:  # a ticket the decision cannot read reserves as before
            log.debug("ticket %s not judged: %s", ticket.lease_id, err)
            return False

    def may_join(self, conn: Holder) -> None:
        """A person joins the waiting line at most :data:`TICKETS_PER_S` times a second (a
        burst of :data:`TICKET_BURST`): a waiting pick takes one ticket; each costs the broker
        a decision."""
        if conn.uid == 0 and not conn.account.tenant:
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
        if len(self.joined) > 4 * len(self.active) + 64:  # people who left: forgotten
            for k in [k for k in self.joined if k not in self.active]:
                del self.joined[k]

    def lapse_tickets(self, snap: Any) -> None:
        """With a fresh snapshot ``snap``: a dormant ticket for which nothing is free any more
        starts reserving (it waits now); a ticket (dormant or reserving) the broker could serve,
        for longer than ``ticket_grace_s``, but that was not turned into a lease loses its
        place (its holder is told, then closed)."""
        for rec in self.line():
            if rec.lease_id in self.dormant and not self.servable_now(rec):
                self.dormant.discard(rec.lease_id)  # leases that stay block it: it waits now
        reserving = [r for r in self.line() if self.reserving(r)]
        servable = set(self.waiters(snap, reserving))
        for rec in self.line():  # a dormant ticket could be served too, behind the others
            if rec.lease_id in self.dormant and rec.lease_id in self.waiters(
                snap, [*reserving, rec]
            ):
                servable.add(rec.lease_id)
        now = time.monotonic()
        for rec in self.line():
            if rec.lease_id not in servable:
                self.servable_since.pop(rec.lease_id, None)
                continue
            since = self.servable_since.setdefault(rec.lease_id, now)
            if now - since >= self.config.ticket_grace_s:
                self.lapse(rec)

    def bar_from_line(self, key: int, rec: LeaseRecord) -> None:
        """A person whose ticket could be served but was not taken (it lapsed, or was dropped
        while servable) may not join the line for :data:`LINE_BAR_S`: otherwise a stream of
        tickets taken and left would keep a place ahead of everyone."""
        now = time.monotonic()
        self.line_barred[key] = now + LINE_BAR_S
        if len(self.line_barred) > 4096:
            self.line_barred = {k: t for k, t in self.line_barred.items() if t > now}
        log.info("%s left ticket %d that could be served: barred from the line for %.0f s",
                 rec.user, rec.seq or 0, LINE_BAR_S)

    def lapse(self, rec: LeaseRecord) -> None:
        self.lapsed += 1
        self.servable_since.pop(rec.lease_id, None)
        key = self.index.person_of(rec.lease_id)
        if key is not None:
            self.bar_from_line(key, rec)
        log.info("ticket %d of %s lapsed: it could be served for %.0f s but was not taken",
                 rec.seq or 0, rec.user, self.config.ticket_grace_s)
        holder = self.holder_of(rec.lease_id)
        if holder is None:
            self.forget_orphan(rec.lease_id)
            return
        holder.record = None
        self.tell(holder, {
            "event": "ticket_lapsed", "lease_id": rec.lease_id,
            "message": f"your place in the waiting line (ticket {rec.seq}) lapsed: a "
            f"device was free for it for {self.config.ticket_grace_s:.0f} s but no "
            "lease was taken",
        }, close=True)

    def revoke(self, lease_id: Any) -> LeaseRecord | None:
        """End the live lease or ticket ``lease_id`` (its holder is told, then closed); the
        record ended, ``None`` when there is none."""
        holder = self.holder_of(lease_id)
        if holder is not None:
            rec = self.held[holder]
            holder.record = None
            self.tell(holder, {
                "event": "revoked",
                "lease_id": rec.lease_id,
                "kind": rec.kind,
                "message": f"{rec.kind} {rec.lease_id} revoked by the admin",
            }, close=True)
            return rec
        if isinstance(lease_id, str) and lease_id in self.orphans:
            rec = self.orphans[lease_id].record
            self.forget_orphan(lease_id)
            return rec
        return None

    def tell(self, holder: Any, event: dict[str, Any], close: bool = False) -> None:
        """Send ``holder`` the unsolicited line ``event`` (:attr:`notify`), then ``close`` it."""
        if self.notify is not None:
            self.notify(holder, event, close)

    def servable_times(self) -> dict[str, float]:
        """The tickets the lapse checks found servable, with when each first was (monotonic
        clock; a copy): each lapses ``ticket_grace_s`` after it unless it stops being so."""
        return dict(self.servable_since)

    def dormant_tickets(self) -> set[str]:
        """The live tickets that reserve nothing yet (a copy; :meth:`reserving` asks of one)."""
        return set(self.dormant)

    def bars(self) -> dict[int, float]:
        """The people barred from the waiting line, with until when (monotonic clock; a copy),
        as :meth:`may_join` refuses them; ended bars stay listed until the next pruning."""
        return dict(self.line_barred)
