"""The broker's pick lock: one pick at a time, served fairly across people.

A waiter is a connection (anything with ``key``, ``uid``, ``pid`` and the slots ``granted``,
``lock_handle``, ``granted_at``). The lock goes to the waiter of the person served least
recently (FIFO per person: a user's subordinate uids are that user); it is held at most
``lock_timeout_s``, and only :data:`LOCK_SLICE_S` by a person who let it time out within
:data:`LOCK_MISUSE_MEMORY_S` while someone else waits. The timer is the loop's; the rest is
plain bookkeeping.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

__all__ = ["LOCK_MISUSE_MEMORY_S", "LOCK_SLICE_S", "PickLock"]

log = logging.getLogger("autogpu.broker")

#: The pick lock of a person who let it time out within :data:`LOCK_MISUSE_MEMORY_S` is taken
#: back after this long when someone else waits: holding it idle then blocks nobody for long.
#: A pick that gets the lock and leases at once never meets it.
LOCK_SLICE_S = 0.01
LOCK_MISUSE_MEMORY_S = 60.0


class PickLock:
    """Who holds the pick lock, who waits for it, and whose turn is next."""

    def __init__(self, config: Any) -> None:
        self.config = config  # its ``lock_timeout_s``
        self.lock_holder: Any = None
        self.waiting: deque[Any] = deque()
        self.last_grant: dict[int, float] = {}
        #: When each person last let the pick lock time out (see :meth:`arm_timer`).
        self.lock_misuse: dict[int, float] = {}

    async def acquire(self, conn: Any) -> None:
        """Wait until ``conn`` holds the lock (at once when it already does)."""
        if self.lock_holder is conn:
            return
        conn.granted = asyncio.get_running_loop().create_future()
        self.waiting.append(conn)
        holder = self.lock_holder
        if holder is not None and holder.key != conn.key and self.suspect(holder.key):
            self.arm_timer(holder)  # a short slice now that someone else waits
        self.grant_next()
        await conn.granted

    def grant_next(self) -> None:
        """Give the lock to the waiter of the person served least recently."""
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
            self.arm_timer(conn)
            conn.granted.set_result(None)

    def arm_timer(self, conn: Any) -> None:
        """How long ``conn`` may keep the lock: ``lock_timeout_s``; only :data:`LOCK_SLICE_S`
        when its person let the lock time out lately and someone else is waiting."""
        if conn.lock_handle is not None:
            conn.lock_handle.cancel()
        hold = self.config.lock_timeout_s
        if self.suspect(conn.key) and any(w.key != conn.key for w in self.waiting):
            hold = LOCK_SLICE_S
        left = max(0.0, conn.granted_at + hold - time.monotonic())
        loop = asyncio.get_running_loop()
        conn.lock_handle = loop.call_later(left, self.expire, conn)

    def suspect(self, key: int) -> bool:
        since = self.lock_misuse.get(key)
        return since is not None and time.monotonic() - since < LOCK_MISUSE_MEMORY_S

    def expire(self, conn: Any) -> None:
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
            self.release(conn)

    def release(self, conn: Any) -> None:
        """``conn`` neither holds nor waits for the lock any more; the next waiter gets it."""
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
            self.grant_next()
