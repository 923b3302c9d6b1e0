"""The broker's lease book in memory, seen as a lease store
(:class:`~autogpu_jupyter.core.leasing.store.LeaseStore`).

Each lease or ticket is held by a connection of its own, as at the broker, but with no socket:
it is granted by the broker's own ops (:data:`autogpu_jupyter.brokerd.ops.OPS`, validate then
execute, the one admission inside), and it ends when it is released or its holder hangs up
(:meth:`BookStore.hang_up`, what the end of a connection does). So whatever the lease-store
contract asks of the directory and of the broker's client, it asks of the book too: one
admission for every holder of lease state.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from autogpu_jupyter.brokerd.book import BrokerRefusal
from autogpu_jupyter.brokerd.connections import Conn
from autogpu_jupyter.brokerd.ops import OPS, before
from autogpu_jupyter.core.leasing.admission import in_line
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
    LeaseStoreError,
    NoDeviceFitsError,
    UsageErrorBase,
)

__all__ = ["BookLease", "BookStore"]

_ERRORS: dict[str, type[AutoGPUError]] = {
    "LeaseLimitError": LeaseLimitError,
    "NoDeviceFitsError": NoDeviceFitsError,
    "UsageErrorBase": UsageErrorBase,
}


class BookLease(HeldLease):
    """A lease or ticket of the book, held by its own connection (a socket pair stands for
    its descriptor)."""

    def __init__(self, record: LeaseRecord, conn: Conn, store: BookStore) -> None:
        self.record = record
        self.conn = conn
        self._store = store
        self._ours, self._theirs = socket.socketpair()

    @property
    def held(self) -> bool:
        now = self.conn.record
        return now is not None and now.lease_id == self.record.lease_id

    def fileno(self) -> int:
        if self._ours.fileno() < 0:
            raise ValueError(f"lease {self.record.lease_id} was released")
        return self._ours.fileno()

    def release(self) -> None:
        if self.held:
            self._store._run("release", self.conn, {})
        self.detach()

    def detach(self) -> None:
        self._ours.close()
        self._theirs.close()

    def set_pid(self, pid: int) -> None:
        if not self.held:
            raise ValueError(f"lease {self.record.lease_id} was released")
        self._store._run("set_pid", self.conn, {"pid": pid})
        assert self.conn.record is not None
        self.record = self.conn.record


class BookTransaction(StoreTransaction):
    """One pick over the book: the records it reads, and the lease or ticket it takes."""

    def __init__(self, store: BookStore) -> None:
        self.store: BookStore = store

    def live_leases(self) -> list[LeaseRecord]:
        return self.store._visible(r for r in self.store._read_unlocked() if r.kind == "lease")

    def live_tickets(self) -> list[LeaseRecord]:
        return in_line(r for r in self.store._read_unlocked() if r.kind == "ticket")

    def create(
        self,
        *,
        devices: Sequence[Any],
        requested_bytes: int | Sequence[int | None] | None = None,
        exclusive: bool = False,
        requester: Requester | None = None,
        parents: Mapping[str, str] | None = None,
    ) -> BookLease:
        # ``parents`` is ignored, as the broker's client ignores it: the book decides the
        # physical GPU by its own snapshot's MIG layout.
        uuids = [d if isinstance(d, str) else d.uuid for d in devices]
        if requested_bytes is None or isinstance(requested_bytes, int):
            booked: list[int | None] = [requested_bytes] * len(uuids)
        else:
            booked = list(requested_bytes)
        return self.store._grant("lease", {"devices": uuids, "requested_bytes": booked,
                                           "exclusive": bool(exclusive)}, requester)

    def create_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> BookLease:
        return self.store._grant("ticket", {"constraints": dict(constraints),
                                            "exclusive": bool(exclusive)}, requester)


class BookStore(LeaseStore):
    """``broker``'s lease book (a :class:`autogpu_jupyter.broker.Broker`, no socket of its
    own) as a lease store of this process's user."""

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.path = "book:"
        self.uid = os.geteuid()
        self.account = broker.accounts.account(self.uid)
        self.user = self.account.name
        self.max_devices_per_user = 0  # the book enforces its own

    def _run(self, op: str, conn: Conn, msg: dict[str, Any]) -> dict[str, Any]:
        """Op ``op`` as the broker serves it to ``conn``; a refusal as the client raises it."""
        async def serve() -> dict[str, Any]:
            await before(self.broker, conn, op)
            return await OPS[op](self.broker, conn, {"op": op, **msg})

        try:
            return asyncio.run(serve())
        except BrokerRefusal as err:
            raise _ERRORS.get(err.kind, LeaseStoreError)(str(err)) from None

    def _grant(self, op: str, msg: dict[str, Any], requester: Requester | None) -> BookLease:
        pid = requester.pid if requester is not None else os.getpid()
        conn = Conn(self.broker, self.uid, os.getegid(), pid, self.account)
        holder = {"kind": "process"} if requester is None else {
            "kernel_id": requester.kernel_id, "notebook_path": requester.notebook_path,
            "command": requester.command, "kind": requester.kind,
        }
        ignored = {"ignore_ids": sorted(self._hidden_ids), "ignore_kernel": self._hidden_kernel}
        self._run(op, conn, {**msg, "holder": holder, **ignored})
        assert conn.record is not None
        return BookLease(conn.record, conn, self)

    def hang_up(self, lease: BookLease) -> None:
        """What the end of ``lease``'s connection does at the broker (its holder died)."""
        self.broker.lock.release(lease.conn)
        if lease.conn.record is not None:
            lease.conn.record = None
        lease.detach()

    @contextlib.contextmanager
    def locked(self) -> Iterator[BookTransaction]:
        yield BookTransaction(self)

    def take_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> BookLease:
        return BookTransaction(self).create_ticket(
            constraints=constraints, exclusive=exclusive, requester=requester)

    def _read_unlocked(self) -> list[LeaseRecord]:
        return [r for _, r in self.broker.book.live()]

    def list_leases(self, *, include_tickets: bool = False) -> list[LeaseRecord]:
        kinds = ("lease", "ticket") if include_tickets else ("lease",)
        return self._visible(
            r if self.uid in (0, r.uid) else replace(r, command=None)  # as the broker shows it
            for r in self._read_unlocked() if r.kind in kinds
        )

    def scan(self) -> ScanResult:
        return ScanResult(live=self._read_unlocked())

    def check(self) -> None:
        return None

    def prune(self, all_users: bool = False) -> list[LeaseRecord]:
        return []  # a record of the book lives exactly as long as its holder
