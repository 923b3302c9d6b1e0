"""The shared-directory lease store: herd safety across processes and users (design decision 5).

Layout (``c.AutoGPU.registry_dir`` / ``$AUTOGPU_REGISTRY_DIR``, default ``/var/tmp/autogpu``)::

    /var/tmp/autogpu/            mode 1777 (sticky), owned by root (or by the user who created it)
        <uid>/                   one per user: mode 0755, owned by that uid (others read, to rank)
            <id>.lease           a lease: JSON record, mode 0644, held with flock(LOCK_EX)
            <id>.ticket          a place in the waiting line, held the same way

A pick runs as one transaction under the registry-wide lock, an ``flock(LOCK_EX)`` on the
registry directory itself (an ``O_RDONLY`` directory fd: nothing to create, nothing another user
could replace)::

    with registry.locked() as txn:          # txn is None when the registry is unusable
        context = decision.gather(snapshot, store=registry, txn=txn)   # reads txn's leases
        chosen = decision.decide(context, constraints).chosen
        lease = txn.create(devices=..., requested_bytes=..., exclusive=..., requester=...)

It is one of the two implementations of the lease store port
(:mod:`autogpu_jupyter.core.leasing.store`). The registry stores; it decides nothing: who may
take a device or a place in line is :mod:`~autogpu_jupyter.core.leasing.admission`'s (the same
rules as the broker's), what a lease books and how waiters are served is
:mod:`autogpu_jupyter.core.decision`'s, the record format
:mod:`~autogpu_jupyter.core.leasing.records`'.

Liveness is the ``flock`` itself: the holder keeps the lease file open with ``LOCK_EX`` for its
whole life (the descriptor is not inherited across ``exec``); a reader tries ``LOCK_SH|LOCK_NB``:
refused means live, granted means the holder is gone (a SIGKILLed kernel frees its lease with no
cleanup step, and PIDs never have to be trusted). Dead files are ignored and removed by their
owner's next pick or by :meth:`DirectoryStore.prune`.

Security on a shared host: the top directory must be sticky when others can write it and owned
by root or by the caller; each user's directory must be owned by the uid it is named after;
files are created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to a directory fd and checked with
``fstat``; another user's file is untrusted input (size cap, strict JSON schema, owner uid ==
directory uid == the uid in the record, else ignored as forged) and is never put in a shell.
A registry that cannot be used safely makes :meth:`DirectoryStore.locked` yield ``None``
with :attr:`DirectoryStore.unusable_reason` set: a plain pick goes on without a lease and says
why; one that promised exclusivity, a wait or a quota fails closed (see
:mod:`autogpu_jupyter.core.picker`).

The hardened filesystem calls themselves (``openat`` with ``O_NOFOLLOW``, the owner and mode
checks on descriptors, the ``flock`` tests and waits, the inode-checked removals, the negative
cache of rejected entries) are :mod:`~autogpu_jupyter.core.leasing.safefs`'s; this module keeps
the store's rules: the layout, which files are leases and tickets, what a transaction may write,
what a scan reports and what ``prune`` removes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import socket
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from autogpu_jupyter.core.devices import mig_parents
from autogpu_jupyter.core.leasing import admission, safefs
from autogpu_jupyter.core.leasing.records import (
    LEASE_SUFFIX,
    MAX_RECORD_BYTES,
    MAX_SEQ,
    TICKET_SUFFIX,
    Invalid,
    LeaseRecord,
    encode,
    field_text,
    parse_checked,
)
from autogpu_jupyter.core.leasing.store import (
    HeldLease,
    LeaseStore,
    Requester,
    ScanResult,
    StoreTransaction,
)
from autogpu_jupyter.errors import LeaseStoreError

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot

__all__ = [
    "LEASE_SUFFIX",
    "MAX_RECORD_BYTES",
    "TICKET_SUFFIX",
    "Lease",
    "LeaseRecord",
    "DirectoryStore",
    "ScanResult",
    "Ticket",
    "Transaction",
]

log = logging.getLogger(__name__)

#: Most entries read from one user's directory per scan (a flood of files cannot stall a pick).
MAX_FILES_PER_USER = 4096


# --------------------------------------------------------------------------------------------
# Held files


class Lease(HeldLease):
    """A lease this process holds: an open, ``flock``-ed file in our user directory.

    Keep the object (or the process) alive for as long as the device is used: closing the
    descriptor (``release()``, garbage collection, process exit, SIGKILL) ends the lease.
    """

    suffix = LEASE_SUFFIX

    def __init__(self, record: LeaseRecord, fd: int, registry: DirectoryStore, name: str) -> None:
        self.record = record
        self._fd: int | None = fd
        self._registry = registry
        self._name = name
        self._owner_pid = os.getpid()

    @property
    def held(self) -> bool:
        """Whether this object still holds the lease."""
        return self._fd is not None

    def release(self) -> None:
        """Remove the file and drop the lock. Idempotent; in a forked child it only closes."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if os.getpid() == self._owner_pid:
                self._registry._unlink_own(self._name, fd)
        finally:
            os.close(fd)

    def fileno(self) -> int:
        """The held descriptor (e.g. for ``pass_fds``: a child that inherits it holds the lease)."""
        if self._fd is None:
            raise ValueError(f"lease {self.record.lease_id} was released")
        return self._fd

    def detach(self) -> None:
        """Close this process's descriptor without removing the file or unlocking it.

        For a process that handed the descriptor to a child (``pass_fds``): the child's copy of
        the open file description keeps the ``flock``, so the lease lives as long as the child.
        """
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def set_pid(self, pid: int) -> None:
        """Record ``pid`` as the holder (the kernel a provisioner started), under the lock.

        The booking ends when NVML shows this pid on the device, so it must be the process
        that creates the CUDA context. Rewritten in place: the inode (and its flock) stays.
        """
        if self._fd is None:
            raise ValueError(f"lease {self.record.lease_id} was released")
        record = replace(self.record, pid=int(pid))
        data = self._registry._checked_bytes(record, self._name)
        with self._registry.locked() as txn:
            if txn is None:
                return
            # Same length or longer (a pid only grows in digits, rarely): write, then cut. A
            # short write raises (ENOSPC, EFBIG) and leaves the old, still valid, record.
            safefs.write_all(self._fd, data, offset=0)
            os.ftruncate(self._fd, len(data))
        self.record = record

    def __del__(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):  # EBADF: closed behind our back
                os.close(self._fd)


_L = TypeVar("_L", bound=Lease)


class Ticket(Lease):
    """A place in the waiting line (FIFO across processes and users), held like a lease."""

    suffix = TICKET_SUFFIX


# --------------------------------------------------------------------------------------------
# The registry


def _kind_of(name: str) -> str | None:
    """``"lease"`` or ``"ticket"`` by the file name's suffix; ``None`` for anything else."""
    if name.endswith(LEASE_SUFFIX):
        return "lease"
    if name.endswith(TICKET_SUFFIX):
        return "ticket"
    return None


class Transaction(StoreTransaction):
    """What a pick may do while it holds the registry lock (see :meth:`DirectoryStore.locked`)."""

    store: DirectoryStore

    def __init__(self, registry: DirectoryStore, top_fd: int, user_fd: int) -> None:
        self.store = registry
        self._top_fd = top_fd
        self._user_fd = user_fd  # our own user directory, opened and checked by locked()
        self._scan: ScanResult | None = None

    def scan(self) -> ScanResult:
        """Every user's leases and tickets (read once per transaction; our dead ones removed)."""
        if self._scan is None:
            self._scan = self.store._scan_fd(self._top_fd, prune_own=True, keep_ignored=False)
        return self._scan

    def live_leases(self) -> list[LeaseRecord]:
        """Live leases of every user (less those the registry view hides)."""
        return self.store._visible(r for r in self.scan().live if r.kind == "lease")

    def live_tickets(self) -> list[LeaseRecord]:
        """Live tickets of every user, in serving order (:func:`admission.in_line`)."""
        return admission.in_line(r for r in self.scan().live if r.kind == "ticket")

    def create(
        self,
        *,
        devices: Sequence[DeviceSnapshot | str],
        requested_bytes: int | Sequence[int | None] | None = None,
        exclusive: bool = False,
        requester: Requester | None = None,
        parents: Mapping[str, str] | None = None,
    ) -> Lease:
        """Write and hold a lease on ``devices``, if :func:`admission.admit_lease` allows it
        (see :meth:`StoreTransaction.create` for the parameters and errors; ``LeaseStoreError``:
        the file cannot be written)."""
        if parents is None:
            parents = mig_parents(d for d in devices if not isinstance(d, str))
        uuids = [d if isinstance(d, str) else d.uuid for d in devices]
        if not uuids:
            raise ValueError("a lease needs at least one device")
        if requested_bytes is None or isinstance(requested_bytes, int):
            booked: list[int | None] = [requested_bytes] * len(uuids)
        else:
            booked = list(requested_bytes)
            if len(booked) != len(uuids):
                raise ValueError("requested_bytes: one value per device expected")
        admission.admit_lease(
            self.live_leases(),
            applicant=self.store.applicant,
            devices=uuids,
            exclusive=exclusive,
            quota=self.store.quota,
            parents=parents,
        )
        lease = self.store._write_held(
            Lease,
            kind="lease",
            uuids=uuids,
            booked=booked,
            exclusive=exclusive,
            requester=requester,
            user_fd=self._user_fd,
        )
        if self._scan is not None:
            self._scan.live.append(lease.record)
        return lease

    def create_ticket(
        self,
        *,
        constraints: Mapping[str, Any],
        exclusive: bool = False,
        requester: Requester | None = None,
    ) -> Ticket:
        """Join the waiting line, if :func:`admission.admit_ticket` allows it: a ticket whose
        ``seq`` is after every live ticket's.

        ``constraints`` is the waiter's request in the record's schema (see
        :func:`autogpu_jupyter.core.decision.ticket_constraints`): storage keeps it, the decision
        pipeline reads it back to serve waiters in order.
        """
        tickets = self.live_tickets()
        admitted = admission.admit_ticket(
            self.live_leases(),
            tickets,
            applicant=self.store.applicant,
            constraints=constraints,
            quota=self.store.quota,
        )
        # Clamped: another user's ticket at MAX_SEQ must not push ours past what readers accept
        # (ties are served by creation time).
        seq = min(max((r.seq or 0 for r in tickets), default=0) + 1, MAX_SEQ)
        ticket = self.store._write_held(
            Ticket,
            kind="ticket",
            uuids=[],
            booked=[],
            exclusive=exclusive,
            requester=requester,
            user_fd=self._user_fd,
            seq=seq,
            constraints=admitted,
        )
        if self._scan is not None:
            self._scan.live.append(ticket.record)
        return ticket


class DirectoryStore(LeaseStore):
    """The lease registry in directory ``path`` (shared by every user of the host).

    Parameters
    ----------
    path
        The registry directory; created (mode 1777) when missing, if its parent exists.
    max_devices_per_user
        Admin limit on the distinct devices one user may hold leases on (0: none).
    max_leases_per_user
        Admin limit on the leases one user may hold at once (0: none).
    max_tickets_per_user
        Admin limit on the places in the waiting line one user may hold at once.
    lock_timeout_s
        How long a pick waits for the registry lock before going on without a lease (another
        process holding it that long is stuck or hostile).
    record_commands
        Store the holder's command line in its lease. Lease files are readable by every user of
        the host, so this is off unless the admin opts in (``c.AutoGPU.record_commands``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        max_devices_per_user: int = 0,
        max_leases_per_user: int = 0,
        max_tickets_per_user: int = admission.DEFAULT_MAX_TICKETS,
        lock_timeout_s: float = 10.0,
        record_commands: bool = False,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.max_devices_per_user = max(int(max_devices_per_user), 0)
        self.max_leases_per_user = max(int(max_leases_per_user), 0)
        self.max_tickets_per_user = max(int(max_tickets_per_user), 0)
        self.lock_timeout_s = lock_timeout_s
        self.record_commands = bool(record_commands)
        self.uid = os.geteuid()
        self.user = safefs.user_name(self.uid)
        self.host = socket.gethostname()
        #: Why the last :meth:`locked` yielded ``None`` (``None`` when the registry worked).
        self.unusable_reason: str | None = None

    @property
    def applicant(self) -> admission.Applicant:
        """Who this process is to admission (the shared directory reserves nothing by group)."""
        return admission.Applicant(self.uid, self.user)

    @property
    def quota(self) -> admission.Quota:
        """The limits this registry enforces on our own leases and tickets (a cooperative
        promise: another user's client may not keep it; the broker enforces)."""
        return admission.Quota(
            max_devices=self.max_devices_per_user,
            max_leases=self.max_leases_per_user,
            max_tickets=self.max_tickets_per_user,
        )

    def __repr__(self) -> str:
        return f"DirectoryStore({self.path!r})"

    # -- opening, with the safety checks ------------------------------------------------------

    def _open_top(self, create: bool) -> int:
        """Open the top directory (creating it 1777 when missing) and check it is safe."""
        return safefs.open_top(self.path, self.uid, create)

    def _open_user_dir(self, top_fd: int, create: bool) -> int | None:
        """Our directory ``<top>/<uid>`` (ours, 0755); ``None`` if missing and not ``create``."""
        return safefs.open_user_dir(self.path, top_fd, self.uid, create)

    # -- the lock -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[Transaction | None]:
        """Hold the registry-wide lock for one pick; yields ``None`` when the registry is unusable.

        When it yields ``None``, :attr:`unusable_reason` says why (a plain pick goes on without a
        lease and reports it; a promising one fails closed). Errors raised inside the block
        propagate unchanged (a :class:`LeaseStoreError` from :meth:`Transaction.create` means "no
        lease" to the picker).
        """
        top_fd: int | None = None
        ufd: int | None = None
        try:
            top_fd = self._open_top(create=True)
            self._acquire(top_fd)
            # Our own directory must be usable before a pick relies on a lease there; it stays
            # open for the transaction (the lease is written there).
            ufd = self._open_user_dir(top_fd, create=True)
        except LeaseStoreError as err:
            if top_fd is not None:
                os.close(top_fd)  # also drops the flock, if we had it
            self.unusable_reason = str(err)
            log.info("lease registry unusable: %s", err)
            yield None
            return
        assert ufd is not None  # create=True: our directory, or a LeaseStoreError
        try:
            self.unusable_reason = None
            yield Transaction(self, top_fd, ufd)
        finally:
            os.close(ufd)
            os.close(top_fd)  # also drops the flock

    def _acquire(self, top_fd: int) -> None:
        """Take the registry-wide ``flock``, waiting at most :attr:`lock_timeout_s`
        (:func:`safefs.acquire`: no helper thread, so a stuck holder costs a timed-out pick
        nothing that outlives it)."""
        safefs.acquire(top_fd, self.path, self.lock_timeout_s)

    # -- writing ------------------------------------------------------------------------------

    def _write_held(
        self,
        cls: type[_L],
        *,
        kind: str,
        uuids: Sequence[str],
        booked: Sequence[int | None],
        exclusive: bool,
        requester: Requester | None,
        user_fd: int,
        seq: int | None = None,
        constraints: Mapping[str, Any] | None = None,
    ) -> _L:
        """Create, lock and fill a new file in our user directory ``user_fd`` (the one
        :meth:`locked` opened and checked), visible only once complete."""
        lease_id = secrets.token_hex(16)
        name = lease_id + cls.suffix
        tmp = f".{lease_id}.tmp"
        pid = os.getpid() if requester is None else requester.pid
        record = LeaseRecord(
            lease_id=lease_id,
            kind=kind,
            device_uuids=tuple(uuids),
            device_requested_bytes=tuple(booked),
            exclusive=exclusive,
            user=self.user,
            uid=self.uid,
            host=field_text(self.host) or "?",
            pid=pid,
            created_s=time.time(),
            kernel_id=field_text(None if requester is None else requester.kernel_id),
            notebook_path=field_text(None if requester is None else requester.notebook_path),
            command=(
                field_text(requester.command)
                if requester is not None and self.record_commands
                else None
            ),
            holder_kind=field_text("process" if requester is None else requester.kind, 32)
            or "process",
            seq=seq,
            constraints=constraints,
            path=os.path.join(self.path, str(self.uid), name),
        )
        data = self._checked_bytes(record, name)
        try:
            fd = os.open(
                tmp,
                os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_WRONLY | os.O_CLOEXEC,
                0o644,
                dir_fd=user_fd,
            )
        except OSError as err:
            raise LeaseStoreError(
                f"cannot write a lease in {os.path.join(self.path, str(self.uid))}: "
                f"{err.strerror}"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.fstat(fd)
            if st.st_uid != self.uid or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                raise LeaseStoreError(f"lease file {record.path} is not ours after creation")
            os.fchmod(fd, 0o644)
            safefs.write_all(fd, data)
            # Rename keeps the inode and its flock: readers see whole records only.
            os.rename(tmp, name, src_dir_fd=user_fd, dst_dir_fd=user_fd)
        except OSError as err:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=user_fd)
            os.close(fd)
            raise LeaseStoreError(f"cannot write lease {record.path}: {err.strerror}") from None
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=user_fd)
            os.close(fd)
            raise
        return cls(record, fd, self, name)

    def _checked_bytes(self, record: LeaseRecord, name: str) -> bytes:
        """The exact bytes of ``record``, after the readers' own parse accepted them.

        Raises :class:`LeaseStoreError` when a reader would reject the record: the lease is then
        refused here, never reported held while every reader ignores it.
        """
        data = encode(record)
        if len(data) > MAX_RECORD_BYTES:
            raise LeaseStoreError("lease record too large (a very long command or path?)")
        try:
            parse_checked(
                data,
                kind=record.kind,
                name=name,
                path=record.path,
                dir_uid=self.uid,
                real_user=self.user,
                live=True,
            )
        except Invalid as err:
            raise LeaseStoreError(
                f"lease record refused: readers would reject it ({err})") from None
        return data

    def _unlink_own(self, name: str, fd: int) -> None:
        """Remove our file ``name`` if it is still the inode ``fd`` holds."""
        safefs.unlink_own(self.path, self.uid, name, fd)

    # -- reading ------------------------------------------------------------------------------

    def _scan_fd(
        self,
        top_fd: int,
        *,
        prune_own: bool = False,
        prune_all: bool = False,
        keep_ignored: bool = True,
    ) -> ScanResult:
        """Scan every user's directory. ``keep_ignored=False`` (a pick's scans) skips the
        bookkeeping of what was ignored and why: planted junk then costs as little as can be."""
        result = ScanResult(keep_ignored=keep_ignored)
        user_names: dict[int, str] = {}  # uid -> name, looked up once per scan
        try:
            names = os.listdir(top_fd)
        except OSError as err:
            raise LeaseStoreError(
                f"cannot list lease registry {self.path}: {err.strerror}") from None
        for uname in sorted(names) if keep_ignored else names:
            # isdecimal() alone is true for '¹' or '٣' (int() then fails or differs): ASCII only.
            if not (uname.isascii() and uname.isdecimal()) or len(uname) > 10:
                if keep_ignored:
                    result.ignored.append((
                        f"{self.path}/{safefs.shown(uname)}",
                        "not a user directory (name is not a uid)",
                    ))
                continue
            upath = f"{self.path}/{uname}"
            dir_uid = int(uname)
            ufd = safefs.open_peer_dir(top_fd, uname, dir_uid)
            if isinstance(ufd, str):
                result.ignored.append((upath, ufd))
                continue
            try:
                prune = (prune_own and dir_uid == self.uid) or prune_all
                self._scan_user(ufd, upath, dir_uid, result, prune=prune, user_names=user_names)
            finally:
                os.close(ufd)
        return result

    def _scan_user(
        self,
        ufd: int,
        upath: str,
        dir_uid: int,
        result: ScanResult,
        *,
        prune: bool,
        user_names: dict[int, str],
    ) -> None:
        entries = safefs.list_inodes(ufd)
        if isinstance(entries, str):
            result.ignored.append((upath, entries))
            return
        names = list(entries)
        if len(names) > MAX_FILES_PER_USER:
            result.ignored.append((upath, f"more than {MAX_FILES_PER_USER} entries; rest skipped"))
            names = sorted(names)[:MAX_FILES_PER_USER]
        prefix = upath + "/"
        for name in names:
            kind = _kind_of(name)
            if kind is None:
                if name.startswith(".") and name.endswith(".tmp"):
                    if prune:
                        safefs.prune_tmp(ufd, name)
                elif result.keep_ignored:
                    why = "not a lease or ticket file"
                    result.ignored.append((prefix + safefs.shown(name), why))
                continue
            path = prefix + (name if name.isascii() else safefs.shown(name))
            key = (dir_uid, name, entries[name])
            known = safefs.known_bad(key)
            rec = (
                known
                if known is not None
                else self._read_one(ufd, name, path, dir_uid, kind, user_names, key)
            )
            if isinstance(rec, str):
                result.ignored.append((path, rec))
                continue
            if rec.live:
                result.live.append(rec)
            else:
                result.dead.append(rec)
                if prune:
                    safefs.remove_dead(ufd, name)

    def _read_one(
        self,
        ufd: int,
        name: str,
        path: str,
        dir_uid: int,
        kind: str,
        user_names: dict[int, str],
        key: tuple[int, str, int] | None = None,
    ) -> LeaseRecord | str:
        """The record in file ``name``, or why it is ignored. ``user_names``: the scan's
        uid -> user name look-ups, each uid looked up once per scan."""
        got = safefs.read_untrusted(ufd, name, dir_uid, MAX_RECORD_BYTES, key)
        if isinstance(got, str):
            return got
        real_user = user_names.get(dir_uid)
        if real_user is None:
            real_user = user_names[dir_uid] = safefs.user_name(dir_uid)
        try:
            return parse_checked(
                got.data,
                kind=kind,
                name=name,
                path=path,
                dir_uid=dir_uid,
                real_user=real_user,
                live=got.live,
            )
        except Invalid as err:
            why = str(err)
            why = why if why.startswith("forged: ") else f"malformed: {why}"
            return why if got.live else safefs.remember_bad(key, got.st, why)

    def scan(self) -> ScanResult:
        """Read the registry without the lock: live, dead and ignored entries (for diagnostics).

        Raises
        ------
        LeaseStoreError
            The registry is missing or unsafe.
        """
        top = self._open_top(create=False)
        try:
            return self._scan_fd(top)
        finally:
            os.close(top)

    def check(self) -> None:
        """Raise :class:`LeaseStoreError` if the registry cannot be used (creating it if
        missing)."""
        top = self._open_top(create=True)
        try:
            fcntl.flock(top, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        except OSError as err:
            raise LeaseStoreError(
                f"cannot lock lease registry {self.path}: {err.strerror}") from None
        finally:
            os.close(top)

    def list_leases(self, *, include_tickets: bool = False) -> list[LeaseRecord]:
        """Live leases of every user, oldest first (no lock taken; for status surfaces).

        A missing registry lists nothing. Raises :class:`LeaseStoreError` when it is unsafe.
        """
        try:
            top = self._open_top(create=False)
        except LeaseStoreError:
            if not os.path.lexists(self.path):
                return []
            raise
        try:
            live = self._scan_fd(top, keep_ignored=False).live
        finally:
            os.close(top)
        if not include_tickets:
            live = [r for r in live if r.kind == "lease"]
        return sorted(self._visible(live), key=lambda r: (r.created_s, r.lease_id, r.uid))

    def _read_unlocked(self) -> list[LeaseRecord]:
        """One scan without the lock; an unusable registry gives nothing (the pick already
        says it has no lease)."""
        try:
            top = self._open_top(create=False)
        except LeaseStoreError as err:
            log.debug("ranking without the registry: %s", err)
            return []
        try:
            return self._scan_fd(top, keep_ignored=False).live
        except LeaseStoreError as err:
            log.debug("ranking without the registry: %s", err)
            return []
        finally:
            os.close(top)

    def prune(self, all_users: bool = False) -> list[LeaseRecord]:
        """Remove dead lease and ticket files: the caller's own, or every user's (root only).

        Dead means its holder is gone. A file whose ``flock`` is held only by processes of
        *other* users (one who opened a 0644 lease of ours and locked it, to keep a dead lease
        looking alive) counts as dead too: per ``/proc/locks`` and ``/proc/<pid>/status``,
        nobody of the lease's own uid holds it. Where that cannot be told (a holder pid hidden
        by ``hidepid``, or gone), the lease is kept.

        Returns
        -------
        list of LeaseRecord
            The records removed (their ``path``, devices and holders say what was freed).

        Raises
        ------
        LeaseStoreError
            Unsafe or missing registry, or ``all_users`` without root.
        """
        if all_users and self.uid != 0:
            raise LeaseStoreError("pruning every user's dead leases needs root (--all)")
        top = self._open_top(create=False)
        try:
            self._acquire(top)
            before = self._scan_fd(top)
            self._scan_fd(top, prune_own=True, prune_all=all_users)
            mine = [r for r in before.live if all_users or r.uid == self.uid]
            kept_alive = [r for r in mine if self._remove_if_held_by_others(top, r)]
            after = self._scan_fd(top)
        finally:
            os.close(top)
        still = {r.path for r in after.live} | {r.path for r in after.dead}
        dead = [r for r in before.dead if all_users or r.uid == self.uid]
        return [r for r in (*dead, *kept_alive) if r.path not in still]

    def _remove_if_held_by_others(self, top_fd: int, rec: LeaseRecord) -> bool:
        """Unlink ``rec``'s file if only other users' processes hold its ``flock``."""
        name = rec.lease_id + (TICKET_SUFFIX if rec.kind == "ticket" else LEASE_SUFFIX)
        return safefs.remove_if_held_by_others(top_fd, rec.uid, name, rec.path)


def __getattr__(name: str) -> Any:
    # The names before the lease-store renames, deprecated for one release.
    from autogpu_jupyter._renamed import old_name  # noqa: PLC0415

    return old_name(__name__, name)
