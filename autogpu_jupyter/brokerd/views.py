"""What the broker shows of its lease book: the compact booking view of a pick, a record as
one viewer may see it, and the book as :func:`core.decision.gather` reads a store."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.records import LeaseRecord, cut_encoded
from autogpu_jupyter.core.leasing.store import StoreTransaction
from autogpu_jupyter.core.leasing.wire import (
    VIEW_BY_PID,
    VIEW_ROWS_PER_DEVICE,
    VIEW_SHAPES,
    VIEW_TICKET_BYTES,
    VIEW_TICKETS,
)

__all__ = [
    "EncodedDevice",
    "RowCache",
    "StateView",
    "ViewWarmer",
    "device_pids",
    "device_rows",
    "encoded_line",
    "shown",
    "view",
]

#: How much of a holder's name and place (``alice``, ``analysis.ipynb``) the booking view
#: carries, in encoded bytes.
_VIEW_TEXT = 128


def shown(rec: LeaseRecord, see_all: bool) -> dict[str, Any]:
    """A record's payload for a viewer: its command line only when ``see_all`` (the viewer's
    own person's record, or root on the main socket); other people's and other tenants' are
    left out, whatever uid they run as."""
    out = rec if see_all else replace(rec, command=None)
    return out._payload()


def view(ctx: Any, conn: Any, shape: str = "rows") -> dict[str, Any]:
    """The compact booking view of a pick: what it needs from every live record, in a size
    that does not grow with other users' records.

    * ``own``: the caller's own leases (its person's), in full: a re-pick hides them;
    * ``devices``: per device, up to :data:`VIEW_ROWS_PER_DEVICE` rows of other leases
      (exclusive ones first, then the largest bookings) as ``[exclusive, pid, bytes, user,
      where]``, and the rest folded into one ``more`` row (count, exclusive, bytes); with
      ``shape`` :data:`VIEW_BY_PID` (what a client of this version asks for), the leases of
      each process together instead (:func:`device_pids`): what a decision reads, in rows
      that do not grow with each process's leases;
    * ``tickets``: the oldest waiters, at most :data:`VIEW_TICKETS` and
      :data:`VIEW_TICKET_BYTES` (a pick only yields to waiters ahead of it);
    * ``reserved``: the devices the admin reserved for groups the caller is not in (UUID ->
      those groups), which the client ranks out as the admission words them.
    """
    book = ctx.book
    index = book.index
    mine = index.own_leases(conn.key)
    own = [shown(rec, True) for rec in mine]
    cache = ctx.ops_cache
    devices = []
    mine_on = {uuid for rec in mine for uuid in rec.device_uuids}
    for uuid in index.leased_devices():  # each device's rows kept until its leases change
        if uuid in mine_on:
            if index.persons_on(uuid) - {conn.key}:
                devices.append(cache.rows_now(book, uuid, conn.key, shape))
        else:
            devices.append(cache.rows_now(book, uuid, None, shape))
    tickets: list[dict[str, Any]] = []
    size = 0
    waiting = [rec for _, rec in index.tickets() if book.reserving(rec)]
    waiting.sort(key=admission.line_key)
    for rec in waiting:
        payload = shown(rec, False)
        size += len(json.dumps(payload))
        if len(tickets) >= VIEW_TICKETS or size > VIEW_TICKET_BYTES:
            break
        tickets.append(payload)
    return {
        "own": own,
        "devices": devices,
        "tickets": tickets,
        "tickets_not_shown": len(waiting) - len(tickets),
        "reserved": book.reserved_reply(conn),
    }


class EncodedDevice(dict):  # type: ignore[type-arg]
    """One device of the booking view (:func:`device_rows`, :func:`device_pids`) with its JSON
    text, made once while :class:`RowCache` keeps it: a ``begin`` reply carries these bytes
    (:func:`encoded_line`) instead of encoding every device's rows again for each pick."""

    def __init__(self, rows: dict[str, Any]) -> None:
        super().__init__(rows)
        self.encoded = json.dumps(rows).encode()


def encoded_line(msg: dict[str, Any]) -> bytes | None:
    """``msg`` as its JSON line where its ``devices`` are the view's :class:`EncodedDevice`
    (their kept bytes spliced in, ``devices`` last); ``None`` for any other reply. The same
    JSON as ``json.dumps(msg)`` but for the order of the keys."""
    devices = msg.get("devices")
    if type(devices) is not list or not all(type(d) is EncodedDevice for d in devices):
        return None
    head = json.dumps({k: v for k, v in msg.items() if k != "devices"}).encode()
    rows = b", ".join(d.encoded for d in devices)
    return head[:-1] + (b", " if len(head) > 2 else b"") + b'"devices": [' + rows + b"]}\n"


class RowCache:
    """The rows of a device's leases, kept until one of them changes (a pick on another
    device does not change them): bounded, cleared when full. :class:`ViewWarmer` builds
    them again off a pick's path after the leases change."""

    #: How many (device, person left out) rows it keeps before it starts afresh.
    SIZE = 1024

    def __init__(self) -> None:
        #: (device, the person left out or ``None``, the view's shape) -> (the device's stamp,
        #: its rows).
        self.current: dict[tuple[str, int | None, str], tuple[int, EncodedDevice]] = {}
        #: How many device rows a pick's view had to build (:meth:`rows_now` found none kept),
        #: and how many were built off its path (:meth:`warm`).
        self.built = 0
        self.warmed = 0
        #: The shapes of the view that picks asked for, kept warm for any viewer.
        self.shapes: set[str] = {VIEW_BY_PID}

    def rows_now(self, book: Any, uuid: str, left_out: int | None,
                 shape: str = "rows") -> EncodedDevice:
        """:func:`device_rows` (or :func:`device_pids`, by ``shape``) of the live leases on
        ``uuid`` but person ``left_out``'s, kept while the book's stamp of that device stays
        (any change of its leases moves it)."""
        stamp = book.index.device_stamp.get(uuid, -1)
        got = self.current.get((uuid, left_out, shape))
        if got is not None and got[0] == stamp:
            return got[1]
        self.built += 1
        if left_out is None and shape in VIEW_SHAPES:
            self.shapes.add(shape)
        return self._build(book, uuid, left_out, shape, stamp)

    def _build(self, book: Any, uuid: str, left_out: int | None, shape: str,
               stamp: int) -> EncodedDevice:
        recs = [r for k, r in book.index.leases_on(uuid) if k != left_out]
        rows = EncodedDevice(
            device_pids(uuid, recs) if shape == VIEW_BY_PID else device_rows(uuid, recs))
        if len(self.current) >= self.SIZE:
            self.current.clear()
        self.current[(uuid, left_out, shape)] = (stamp, rows)
        return rows

    def stale(self, book: Any) -> list[tuple[str, str]]:
        """The (device, shape) whose rows for any viewer are not kept as the book holds them
        now: those a pick would build."""
        stamps = book.index.device_stamp
        current = self.current
        out = []
        for uuid in book.index.leased_devices():
            stamp = stamps.get(uuid, -1)
            for shape in sorted(self.shapes):
                got = current.get((uuid, None, shape))
                if got is None or got[0] != stamp:
                    out.append((uuid, shape))
        return out

    def warm(self, book: Any, todo: list[tuple[str, str]]) -> None:
        """Build the rows of ``todo`` (from :meth:`stale`) that are still not kept."""
        stamps = book.index.device_stamp
        for uuid, shape in todo:
            stamp = stamps.get(uuid, -1)
            got = self.current.get((uuid, None, shape))
            if got is None or got[0] != stamp:
                self.warmed += 1
                self._build(book, uuid, None, shape, stamp)


class ViewWarmer:
    """Keeps the booking view warm: once the book's leases change (:meth:`changed`, called by
    its index), the rows of the devices whose leases moved are built again on the event loop,
    a little later (the changes of a burst come together) and a few per turn (answers go out
    between them), so that the next pick finds them kept instead of building every device's
    rows on its own path."""

    #: Seconds from a change of the book to the first rebuild: the changes within it coalesce.
    DELAY_S = 0.05
    #: Device rows built per turn of the loop (about 0.15 ms each at 10,000 leases on 64 GPUs).
    PER_TURN = 8

    def __init__(self, book: Any, cache: RowCache) -> None:
        self._book = book
        self._cache = cache
        self._loop: asyncio.AbstractEventLoop | None = None  # while a rebuild is due on it
        self._todo: list[tuple[str, str]] = []

    def changed(self) -> None:
        """Some device's leases changed: rebuild their rows soon (once per burst)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a book loaded before serving): the next pick builds
            return
        if self._loop is not loop:
            self._loop = loop
            loop.call_later(self.DELAY_S, self._turn)

    def _turn(self) -> None:
        loop = self._loop
        if loop is None:
            return
        if not self._todo:
            self._todo = self._cache.stale(self._book)
        now, self._todo = self._todo[:self.PER_TURN], self._todo[self.PER_TURN:]
        self._cache.warm(self._book, now)
        if self._todo:
            loop.call_soon(self._turn)
        elif self._cache.stale(self._book):  # changed meanwhile: again, after the delay
            loop.call_later(self.DELAY_S, self._turn)
        else:
            self._loop = None

    async def settled(self) -> None:
        """Return once no rebuild is due on this loop."""
        while self._loop is asyncio.get_running_loop():
            await asyncio.sleep(self.DELAY_S)


def device_rows(uuid: str, recs: list[LeaseRecord]) -> dict[str, Any]:
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


def device_pids(uuid: str, recs: list[LeaseRecord]) -> dict[str, Any]:
    """One device of the booking view by process: the leases of each pid together as ``[pid,
    leases, bytes booked, exclusive]``, the first :data:`VIEW_ROWS_PER_DEVICE` processes
    (those with an exclusive lease first, then the largest bookings) as rows, the rest folded
    into ``more``. A decision needs no more (core.decision.bookings_for: counts, bookings,
    exclusivity; a booking stops counting when NVML lists its pid on the device, so one pid's
    leases count together); the names are the admission's to word, in the broker."""
    by_pid: dict[int, list[Any]] = {}
    for rec in recs:
        booked = rec.requested_on(uuid) or 0
        row = by_pid.get(rec.pid)
        if row is None:
            by_pid[rec.pid] = [rec.pid, 1, booked, rec.exclusive]
        else:
            row[1] += 1
            row[2] += booked
            row[3] = row[3] or rec.exclusive
    ranked = sorted(by_pid.values(), key=lambda row: (not row[3], -row[2]))
    rest = ranked[VIEW_ROWS_PER_DEVICE:]
    more = {
        "leases": sum(row[1] for row in rest),
        "exclusive": any(row[3] for row in rest),
        "booked": sum(row[2] for row in rest),
    }
    return {"uuid": uuid, "pids": ranked[:VIEW_ROWS_PER_DEVICE], "more": more}


class StateView:
    """The book's live records as :func:`core.decision.gather` reads a store
    (:class:`~autogpu_jupyter.core.leasing.store.RecordView`), with the devices reserved away
    from the asking user as the admission's pseudo-leases; dormant tickets reserve nothing."""

    def __init__(self, book: Any, conn: Any) -> None:
        self._book = book
        self._conn = conn

    def live_records(
        self, txn: StoreTransaction | None = None
    ) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        live = [r for _, r in self._book.live()]
        leases = [r for r in live if r.kind == "lease"] + self._book.reserved_away(self._conn)
        tickets = [r for r in live if r.kind == "ticket" and self._book.reserving(r)]
        return leases, admission.in_line(tickets)
