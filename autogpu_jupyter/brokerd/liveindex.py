"""The lease book's live records, indexed as each one changes: by their live order, by person,
by device, the tickets apart, and the holder of each.

A grant, a pick's booking view and the admission then cost what the devices asked for and the
person's own records hold, not what the whole book holds (issue 39: 10,000 live leases on a
64-GPU host). Synchronous; the book (:class:`autogpu_jupyter.brokerd.book.LeaseBook`) calls
:meth:`LiveIndex.add` and :meth:`LiveIndex.remove` for every record that becomes live or ends.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

from autogpu_jupyter.core.leasing.records import LeaseRecord

__all__ = ["LiveIndex"]


def _oldest_first(p: tuple[int, LeaseRecord]) -> tuple[float, str]:
    return p[1].created_s, p[1].lease_id


class LiveIndex:
    """Every live record (a connection's or an orphan's) with its person (account key)."""

    def __init__(self) -> None:
        self.order: list[tuple[float, str]] = []  # (created_s, lease_id): the live order
        self.entries: dict[str, tuple[int, LeaseRecord]] = {}  # lease_id -> (person, record)
        self.holders: dict[str, Any] = {}  # lease_id -> its holder (a connection's only)
        self.own: dict[int, dict[str, LeaseRecord]] = {}  # person -> their leases
        self.on_device: dict[str, dict[str, tuple[int, LeaseRecord]]] = {}  # uuid -> leases
        self.ticket_entries: dict[str, tuple[int, LeaseRecord]] = {}
        #: Per device, the book's version when its leases last changed (a pick's booking view
        #: keeps a device's rows until then).
        self.device_stamp: dict[str, int] = {}
        #: Called when some device's stamp moved (the broker's shell keeps the view warm).
        self.on_change: Callable[[], None] | None = None

    def add(self, key: int, rec: LeaseRecord, version: int, holder: Any = None) -> None:
        """``rec`` (of person ``key``, held by ``holder``; ``None``: an orphan) is live, as of
        the book's ``version``."""
        lid = rec.lease_id
        bisect.insort(self.order, (rec.created_s, lid))
        self.entries[lid] = (key, rec)
        if holder is not None:
            self.holders[lid] = holder
        if rec.kind == "ticket":
            self.ticket_entries[lid] = (key, rec)
            return
        self.own.setdefault(key, {})[lid] = rec
        for uuid in rec.device_uuids:
            self.on_device.setdefault(uuid, {})[lid] = (key, rec)
            self.device_stamp[uuid] = version
        if self.on_change is not None and rec.device_uuids:
            self.on_change()

    def remove(self, rec: LeaseRecord, version: int) -> None:
        """``rec`` is no longer live, as of the book's ``version``."""
        lid = rec.lease_id
        entry = self.entries.pop(lid, None)
        if entry is None:
            return
        at = bisect.bisect_left(self.order, (rec.created_s, lid))
        if at < len(self.order) and self.order[at] == (rec.created_s, lid):
            del self.order[at]
        self.holders.pop(lid, None)
        if self.ticket_entries.pop(lid, None) is not None:
            return
        own = self.own.get(entry[0], {})
        own.pop(lid, None)
        if not own:
            self.own.pop(entry[0], None)
        for uuid in rec.device_uuids:
            on = self.on_device.get(uuid)
            if on is not None and on.pop(lid, None) is not None:
                self.device_stamp[uuid] = version
                if not on:
                    del self.on_device[uuid]
        if self.on_change is not None and rec.device_uuids:
            self.on_change()

    def ordered(self) -> list[tuple[int, LeaseRecord]]:
        """Every live record as (person, record), oldest first."""
        entries = self.entries
        return [entries[i] for _, i in self.order]

    def person_of(self, lease_id: str) -> int | None:
        entry = self.entries.get(lease_id)
        return None if entry is None else entry[0]

    def own_leases(self, key: int) -> list[LeaseRecord]:
        """Person ``key``'s live leases, oldest first."""
        return sorted(self.own.get(key, {}).values(), key=lambda r: (r.created_s, r.lease_id))

    def leases_on(self, uuid: str) -> list[tuple[int, LeaseRecord]]:
        """The live leases on ``uuid`` as (person, record), oldest first."""
        return sorted(self.on_device.get(uuid, {}).values(), key=_oldest_first)

    def leased_devices(self) -> list[str]:
        """The devices some live lease is on, by id."""
        return sorted(self.on_device)

    def persons_on(self, uuid: str) -> set[int]:
        return {k for k, _ in self.on_device.get(uuid, {}).values()}

    def tickets(self) -> list[tuple[int, LeaseRecord]]:
        """The live tickets as (person, record), oldest first."""
        return sorted(self.ticket_entries.values(), key=_oldest_first)
