"""What the broker sees of the host's devices: its own snapshot (NVML, or ``AUTOGPU_SIMULATE``).

Snapshots are taken off the event loop (an executor) and kept in the lease book
(:class:`autogpu_jupyter.brokerd.book.LeaseBook`, which judges tickets by the last one); the
ids of the fleet check the devices a lease names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from autogpu_jupyter.brokerd.book import BrokerRefusal, LeaseBook
from autogpu_jupyter.core.backends import get_backend
from autogpu_jupyter.core.devices import mig_parents

__all__ = ["Fleet", "fleet_ids"]

log = logging.getLogger("autogpu.broker")

_FLEET_RECHECK_S = 5.0


class Fleet:
    """The broker's backend, its last snapshot (in the book) and the ids of its devices."""

    def __init__(self, book: LeaseBook) -> None:
        self.book = book
        self.backend: Any = None
        self.ids: set[str] | None = None
        self.checked_at = -_FLEET_RECHECK_S

    def snapshot(self) -> Any:
        """The fleet now, from the broker's own backend (NVML, or ``AUTOGPU_SIMULATE``)."""
        if self.backend is None:
            self.backend = get_backend()
        snap = self.backend.snapshot()
        self.ids = fleet_ids(snap)
        self.book.parents = mig_parents(snap.devices)
        self.checked_at = self.book.snap_at = time.monotonic()
        self.book.snap = snap
        return snap

    async def fresh_snapshot(self) -> None:
        """A snapshot at most a second old for judging a new ticket (none without a fleet)."""
        if time.monotonic() - self.book.snap_at <= 1.0:
            return
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.snapshot)
        except Exception as err:  # no GPU library: tickets reserve as they always did
            log.debug("no snapshot for a new ticket: %s", err)
            self.book.snap, self.book.snap_at = None, time.monotonic()

    async def check_known(self, devices: list[Any]) -> None:
        """Refuse ids that are not devices of this host (a lease on ``gpu-...`` in lower case,
        or on a made-up id, would count against nothing real). Where the broker cannot see
        the fleet (no GPU library), ids are only checked by the record schema."""
        unknown = [d for d in devices if self.ids is None or d not in self.ids]
        if not unknown:
            return
        now = time.monotonic()
        if now - self.checked_at >= _FLEET_RECHECK_S:
            self.checked_at = now
            loop = asyncio.get_running_loop()
            with contextlib.suppress(Exception):  # any backend failure: the fleet stays unknown
                await loop.run_in_executor(None, self.snapshot)
        if self.ids is None:
            return
        for d in devices:
            if d not in self.ids:
                raise BrokerRefusal(
                    f"{str(d)[:80]!r} is not a device of this host (its devices: "
                    f"{', '.join(sorted(self.ids)[:16]) or 'none'})",
                    "UsageErrorBase",
                )


def fleet_ids(snap: Any) -> set[str]:
    """Every id a lease may name on this host: each device's UUID (MIG devices included)."""
    return {d.uuid for d in snap.devices}
