"""The lease store as a declared port (design decision 15): what the picker, the decision
pipeline and every front end may ask of a store, whichever one the settings chose.

Two stores implement it: the shared directory (:mod:`~autogpu_jupyter.core.leasing.directory`,
cooperative, for one user or a trusted team) and the client of the trusted broker
(:mod:`~autogpu_jupyter.core.leasing.brokerclient`). A pick is one transaction::

    with store.locked() as txn:             # None: the store cannot be used (a plain pick
        leases, tickets = store.live_records(txn)   # goes on without a lease and says why)
        ...                                 # decide (core.decision)
        lease = txn.create(devices=..., requested_bytes=..., exclusive=..., requester=...)

A :class:`HeldLease` lives as long as its descriptor (a locked file, or a broker connection):
the holder's death frees it, with no cleanup step. Whether a lease or ticket may be taken is
decided by :mod:`~autogpu_jupyter.core.leasing.admission` inside ``create`` and
``create_ticket``, the same rules in both stores.

The read side alone (:class:`RecordView`) is what :func:`autogpu_jupyter.core.decision.gather`
needs: a store, or the broker's in-memory view of its own state.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from autogpu_jupyter.core.leasing.admission import in_line
from autogpu_jupyter.core.leasing.records import LeaseRecord

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot

__all__ = [
    "HeldLease",
    "LeaseStore",
    "RecordView",
    "Requester",
    "ScanResult",
    "StoreTransaction",
]


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asks for a lease: shown to other users next to the device it holds.

    (Not :class:`autogpu_jupyter.core.holders.Holder`, which is who *holds* a device in a view:
    a lease, a process, or both.)
    """

    pid: int = field(default_factory=os.getpid)
    kernel_id: str | None = None
    notebook_path: str | None = None
    command: str | None = None
    kind: str = "process"  # "kernel", "cli", "provisioner", "api"


@dataclass
class ScanResult:
    """Everything one read of a store saw (diagnostics: dead and ignored entries too)."""

    live: list[LeaseRecord] = field(default_factory=list)
    dead: list[LeaseRecord] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (path, why)
    keep_ignored: bool = True  # False: a pick's scan, which does not report what it skipped


class HeldLease(abc.ABC):
    """A lease (or ticket) this process holds. Keep it (or the process) alive while the
    device is used: :meth:`release`, garbage collection, exit or SIGKILL end it."""

    record: LeaseRecord

    @property
    def path(self) -> str:
        """Where the store keeps it (a file, or ``socket#id``)."""
        return self.record.path

    @property
    @abc.abstractmethod
    def held(self) -> bool:
        """Whether this object still holds it."""

    @abc.abstractmethod
    def release(self) -> None:
        """End it now. Idempotent; in a forked child only the child's copy is closed."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """The descriptor that holds it (for ``pass_fds``: a child that inherits it holds it).

        Raises ``ValueError`` once released."""

    @abc.abstractmethod
    def detach(self) -> None:
        """Close this process's descriptor only: a child holding a copy keeps the lease."""

    @abc.abstractmethod
    def set_pid(self, pid: int) -> None:
        """Record ``pid`` (the kernel a provisioner started) as the process that uses it."""

    def __enter__(self) -> HeldLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self.held else "released"
        devices = ",".join(self.record.device_uuids)
        return f"<{type(self).__name__} {self.record.lease_id} {devices} {state}>"


class StoreTransaction(abc.ABC):
    """What one pick may do while it holds the store's pick lock (:meth:`LeaseStore.locked`)."""

    store: LeaseStore

    def ready(self) -> float:
        """Wait until the pick lock is held; the seconds this call waited.

        A store may ask for its lock in :meth:`LeaseStore.locked` without waiting for it (the
        broker: the caller reads the devices while the request travels); the first read of the
        records waits for it anyway. A caller that read something *before* this call and got
        a long wait here reads it again (what it read may be older than the lock). The
        default: the lock was taken in ``locked``, nothing to wait for."""
        return 0.0

    @abc.abstractmethod
    def live_leases(self) -> list[LeaseRecord]:
        """Live leases of every user, less those the store's view hides."""

    @abc.abstractmethod
    def live_tickets(self) -> list[LeaseRecord]:
        """Live tickets of every user, in serving order."""

    @abc.abstractmethod
    def create(
        self,
        *,
        devices: Sequence[DeviceSnapshot | str],
        requested_bytes: int | Sequence[int | None] | None = None,
        exclusive: bool = False,
        requester: Requester | None = None,
        parents: Mapping[str, str] | None = None,
    ) -> HeldLease:
        """Hold a lease on ``devices``, if admission allows it.

        Parameters
        ----------
        devices
            The chosen devices (snapshots or UUIDs).
        requested_bytes
            Memory booked on each device: one value for all, or one per device; ``None``:
            nothing.
        exclusive
            Keep every other lease off these devices (and off the rest of their physical
            GPUs: a MIG device's parent and siblings).
        requester
            Who the lease is for (default: this process).
        parents
            The host's MIG layout (MIG UUID -> parent UUID,
            :func:`autogpu_jupyter.core.devices.mig_parents` of the pick's snapshot), for the
            rules that follow physical GPUs. A store that reads the fleet itself (the broker)
            ignores it; without it, a MIG device named by a snapshot brings its own parent.

        Raises
        ------
        LeaseLimitError
            Past the admin's quota.
        NoDeviceFitsError
            A device is held exclusively, held at all when ``exclusive`` is wanted, or
            reserved for others.
        LeaseStoreError
            The store cannot write it (the pick goes on without a lease and says so).
        """

    @abc.abstractmethod
    def create_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> HeldLease:
        """Join the waiting line, if admission allows it (see :meth:`create` for errors).

        ``constraints`` is the waiter's request in the record's schema
        (:func:`autogpu_jupyter.core.decision.ticket_constraints`)."""


class RecordView(Protocol):
    """The read side of a store, all :func:`autogpu_jupyter.core.decision.gather` needs."""

    def live_records(
        self, txn: StoreTransaction | None = None
    ) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        """Live leases (less the hidden ones) and live tickets in serving order."""
        ...


def _split(records: Iterable[LeaseRecord]) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
    leases: list[LeaseRecord] = []
    tickets: list[LeaseRecord] = []
    for r in records:
        (tickets if r.kind == "ticket" else leases).append(r)
    return leases, tickets


class LeaseStore(abc.ABC):
    """Where a host's leases live (see the module docstring).

    Attributes
    ----------
    path
        The directory, or the broker's socket.
    uid, user
        Whose leases this process makes.
    max_devices_per_user
        The quota this store promises to enforce on the client side (0: none here; the
        broker enforces its own): a pick under it fails closed without the store.
    unusable_reason
        Why the last :meth:`locked` yielded ``None`` (``None``: it worked).
    """

    path: str
    uid: int
    user: str
    #: Whether a holder that dies leaves an entry behind for :meth:`prune` to remove (the shared
    #: directory's files); ``False`` where a lease ends with its holder's connection (the broker).
    leaves_dead_entries: bool = True
    max_devices_per_user: int = 0
    lock_timeout_s: float = 10.0
    unusable_reason: str | None = None
    _hidden_ids: frozenset[str] = frozenset()
    _hidden_kernel: str | None = None

    # -- the caller's own leases, hidden -------------------------------------------------------

    def hiding(
        self, *, lease_ids: Iterable[str] = (), kernel_id: str | None = None
    ) -> LeaseStore:
        """This store as seen without some of the caller's OWN leases.

        A re-pick replaces the process's lease, so that lease must not book memory, count
        towards the quota or hold "exclusive" against the new pick; a notebook asking "which
        GPU is best for me?" must not count its own kernel's lease. Other users' leases are
        never hidden. The view applies to :meth:`list_leases`, :meth:`live_records` and a
        transaction's ``live_leases()`` (so to admission in ``create``).
        """
        view = copy.copy(self)
        view._hidden_ids = frozenset(lease_ids)
        view._hidden_kernel = kernel_id
        return view

    def _visible(self, records: Iterable[LeaseRecord]) -> list[LeaseRecord]:
        if not self._hidden_ids and self._hidden_kernel is None:
            return list(records)
        return [r for r in records if not self._hides(r)]

    def _hides(self, r: LeaseRecord) -> bool:
        return r.uid == self.uid and (
            r.lease_id in self._hidden_ids
            or (self._hidden_kernel is not None and r.kernel_id == self._hidden_kernel)
        )

    # -- reading -------------------------------------------------------------------------------

    def live_records(
        self, txn: StoreTransaction | None = None
    ) -> tuple[list[LeaseRecord], list[LeaseRecord]]:
        """Live leases (less the hidden ones) and live tickets in serving order, for ranking.

        With ``txn``, the transaction's (read under the lock); without, one unlocked read. A
        store that cannot be read gives nothing (a pick already says it has no lease).
        """
        if txn is not None:
            return txn.live_leases(), txn.live_tickets()
        leases, tickets = _split(self._read_unlocked())
        return self._visible(leases), in_line(tickets)

    @abc.abstractmethod
    def _read_unlocked(self) -> list[LeaseRecord]:
        """Every live lease and ticket, read without the lock (``[]`` when unreadable)."""

    @abc.abstractmethod
    def list_leases(self, *, include_tickets: bool = False) -> list[LeaseRecord]:
        """Live leases (and tickets) of every user, oldest first, for status surfaces; other
        users' command lines are not shown.

        Raises :class:`LeaseStoreError` when the store cannot be read."""

    @abc.abstractmethod
    def scan(self) -> ScanResult:
        """Diagnostics: live, dead and ignored entries."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise :class:`LeaseStoreError` when the store cannot be used."""

    @abc.abstractmethod
    def prune(self, all_users: bool = False) -> list[LeaseRecord]:
        """Remove dead entries (the caller's own, or every user's as root); the records removed."""

    # -- writing -------------------------------------------------------------------------------

    @abc.abstractmethod
    def locked(self) -> contextlib.AbstractContextManager[StoreTransaction | None]:
        """Hold the store's pick lock for one pick (see the module docstring)."""

    def take_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> HeldLease | None:
        """Join the waiting line under the lock; ``None`` when the store cannot be used."""
        with self.locked() as txn:
            if txn is None:
                return None
            return txn.create_ticket(
                constraints=constraints, exclusive=exclusive, requester=requester
            )
