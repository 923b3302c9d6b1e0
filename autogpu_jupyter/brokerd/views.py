"""What the broker shows of its lease book: the compact booking view of a pick, a record as
one viewer may see it, and the book as :func:`core.decision.gather` reads a store."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.brokerclient import (
    VIEW_ROWS_PER_DEVICE,
    VIEW_TICKET_BYTES,
    VIEW_TICKETS,
)
from autogpu_jupyter.core.leasing.records import LeaseRecord, cut_encoded
from autogpu_jupyter.core.leasing.store import StoreTransaction

__all__ = ["RowCache", "StateView", "device_rows", "shown", "view"]

#: How much of a holder's name and place (``alice``, ``analysis.ipynb``) the booking view
#: carries, in encoded bytes.
_VIEW_TEXT = 128


def shown(rec: LeaseRecord, see_all: bool) -> dict[str, Any]:
    """A record's payload for a viewer: its command line only when ``see_all`` (the viewer's
    own person's record, or root on the main socket); other people's and other tenants' are
    left out, whatever uid they run as."""
    out = rec if see_all else replace(rec, command=None)
    return out._payload()


def view(ctx: Any, conn: Any) -> dict[str, Any]:
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
    book = ctx.book
    live = book.live()
    own = [shown(rec, True) for key, rec in live if key == conn.key and rec.kind == "lease"]
    per_dev: dict[str, list[LeaseRecord]] = {}
    for key, rec in live:
        if rec.kind == "lease" and key != conn.key:
            for uuid in rec.device_uuids:
                per_dev.setdefault(uuid, []).append(rec)
    devices = [ctx.ops_cache.rows_of(uuid, recs) for uuid, recs in sorted(per_dev.items())]
    tickets: list[dict[str, Any]] = []
    size = 0
    waiting = [rec for _, rec in live if book.reserving(rec)]
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


class RowCache:
    """The rows of a device's leases, by the ids of those leases (a pick on another device
    does not change them): bounded, cleared when full."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, ...], dict[str, Any]] = {}

    def rows_of(self, uuid: str, recs: list[LeaseRecord]) -> dict[str, Any]:
        """:func:`device_rows`, kept for the same leases of the same device."""
        # a record changes only by set_pid (its pid); a lease id names the rest
        key = (uuid, *(f"{r.lease_id}:{r.pid}" for r in recs))
        rows = self.rows.get(key)
        if rows is None:
            if len(self.rows) >= 256:
                self.rows.clear()
            rows = self.rows[key] = device_rows(uuid, recs)
        return rows


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
