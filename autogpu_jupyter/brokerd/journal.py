"""The broker's journal: what survives a restart, written before the reply, O(change) per change.

An append-only log of JSON lines in the broker's root-only state directory
(``journal.log``)::

    {"seq": 41}                                          the ticket counter (a compaction's head)
    {"boot": "<boot id>"}                                the boot the log describes (ditto)
    {"add": "<lease id>", "uid": 1000, "record": "...", "peer": 81234, "pids": [[4242, 98765]]}
    {"pids": "<lease id>", "pids": [[4300, 99001]]}      new holders (set_pid)
    {"del": "<lease id>"}

Each change appends one line with one ``write`` *before* the broker replies, so a lease a
client was told it holds is in the file when the broker dies (``kill -9``, a crash, a restart):
the kernel's page cache keeps what a dead process wrote. When the log has grown past four times
the live entries (and at least :data:`COMPACT_MIN_BYTES`), it is rewritten as a snapshot
(temporary file, ``fsync``, ``rename``, ``fsync`` of the directory): the log's size stays
bounded by the live state, and the cost per change stays O(1) amortised, however many leases
are live.

**A lease does not outlive the boot.** Every holder of a lease is a process on this host (the
broker's socket is a Unix socket: only processes of the broker's own kernel can connect), and
the only event that loses written-but-unsynced lines, a crash of the kernel itself (power loss,
panic), ends every holder with it. So a grant is not ``fdatasync``-ed before its reply: that
would cost a disk flush per pick (about 0.4-4 ms here) and protect no live lease. What must not
happen instead is a journal from an earlier boot taken for this one: socket inodes and pids
start again at each boot, and a stale entry whose inode or (pid, start time) happens to be
reused would keep a GPU booked for nobody. The log's head names the boot it describes (the
kernel's ``boot_id``); a log of another boot is dropped whole at load (logged). A log without a
head (written by a broker before this one) is read as before: by pid and start time.

**A full disk.** A change that cannot be written (``ENOSPC``, ``EIO``, a quota) leaves nothing
of itself in the file: the log is cut back to its last whole line and :class:`NotRecorded` is
raised, so the broker refuses that grant (a lease it cannot write is a lease a restart would not
know). The end of a lease and its new holders cannot be refused (the client is gone, or the
holder already runs): they are kept and written with the next change that can be, or by the next
compaction. A compaction that cannot be written is left for later; the log appended to is whole.

A torn last line (a crash mid-``write``) is skipped on reading; where a line was written after a
torn fragment (its piece never cut back), each whole line in it is still read: a top-level
``{"`` only ever starts a line (every quote inside a string is escaped). The whole-file journal
of the first broker (``journal.json``) is read once when no log exists yet, then removed.

**Holders.** A lease lives as long as *its socket* is open anywhere, not as long as the process
that connected: ``autogpu run`` and the provisioner hand the socket to a child and may exit. So
the journal records the inode of the client's end of the connection (its *peer*) and the holder
processes seen so far, as (pid, start time); :mod:`autogpu_jupyter.brokerd.peers` finds them
and :mod:`autogpu_jupyter.brokerd.restore` reads them back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote  # json.dumps's own, for one str
from typing import Any

from autogpu_jupyter.brokerd.peers import (  # noqa: F401 (the journal's names, kept)
    holders_alive,
    holds_socket,
    peer_inode,
    pid_uids,
    proc_ids,
    scan_socket_holders,
    start_time,
)

__all__ = [
    "COMPACT_MIN_BYTES",
    "Entry",
    "Journal",
    "NotRecorded",
    "holders_alive",
    "peer_inode",
    "proc_ids",
    "boot_id",
    "scan_socket_holders",
    "start_time",
]

log = logging.getLogger("autogpu.broker")

LOG_NAME = "journal.log"
LEGACY_NAME = "journal.json"
#: The log is compacted once it is larger than this and four times its live entries.
COMPACT_MIN_BYTES = 256 * 1024
#: A journal line longer than this is not ours (records are capped far below): skipped.
MAX_LINE_BYTES = 256 * 1024
#: Where the kernel names the current boot (a random UUID, new at each boot).
BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id(path: str | None = None) -> str | None:
    """This boot's id, from ``path`` (default :data:`BOOT_ID_PATH`); ``None`` where the kernel
    does not say (then no log is dropped as another boot's)."""
    try:
        with open(path or BOOT_ID_PATH, encoding="ascii") as f:
            value = f.read(128).strip()
    except (OSError, ValueError):
        return None
    return value or None

Pids = list[tuple[int, int]]


class NotRecorded(OSError):
    """A change the journal could not write (its disk full, an I/O error): nothing of it is in
    the file, and the journal's entries are as before the call."""

    def __init__(self, directory: str, err: OSError) -> None:
        if err.strerror:
            why = f"{err.strerror[:1].lower()}{err.strerror[1:]} in {directory}"
        else:  # ours, naming the path already
            why = str(err) or type(err).__name__
        super().__init__(err.errno, why)

    def __str__(self) -> str:
        return str(self.strerror)

    def refusal(self, kind: str, new: bool = True) -> str:
        """The one line a client is told: what could not be recorded, why, and that it was not
        granted (``new``) or not changed."""
        if new:
            return (f"cannot record the {kind}: {self} (the broker's state directory); "
                    f"the {kind} was not granted")
        return (f"cannot record the change of the {kind}: {self} (the broker's state "
                f"directory); the {kind} is kept as it was")


@dataclass
class Entry:
    """One live lease or ticket as the journal knows it."""

    lease_id: str
    uid: int
    record: str  # the record's exact encoded bytes, as text
    peer: int | None = None  # inode of the client's end of the connection
    pids: Pids = field(default_factory=list)  # holder processes seen: (pid, start time)
    tenant: str | None = None  # the tenant whose socket it came through (issue 40)

    def line(self) -> dict[str, Any]:
        out = {"add": self.lease_id, "uid": self.uid, "record": self.record,
               "peer": self.peer, "pids": [list(p) for p in self.pids]}
        return out if self.tenant is None else {**out, "tenant": self.tenant}

    def encoded(self, seq: int | None = None) -> bytes:
        """:meth:`line` (plus ``seq`` when given) as its journal line: exactly the bytes
        ``json.dumps(..., separators=(",", ":"))`` writes, put together by hand (a grant writes
        one; ``json.dumps`` of a dict costs several times more than the strings it quotes)."""
        peer = "null" if self.peer is None else str(int(self.peer))
        tail = "" if seq is None else f',"seq":{int(seq)}'
        if self.tenant is not None:
            tail += f',"tenant":{_quote(self.tenant)}'
        return (
            f'{{"add":{_quote(self.lease_id)},"uid":{int(self.uid)},'
            f'"record":{_quote(self.record)},"peer":{peer},"pids":{_pids_text(self.pids)}'
            f"{tail}}}\n"
        ).encode()


class Journal:
    """The append log in ``directory`` (root's, mode 0700; checked by the broker)."""

    def __init__(self, directory: str, boot: str | None = None) -> None:
        """``boot``: this boot's id (default: the kernel's, :func:`boot_id`)."""
        self.directory = directory
        self.boot = boot if boot is not None else boot_id()
        self.logged_boot: str | None = None  # the boot a loaded log said it describes
        self.dropped = 0  # entries of another boot dropped at load
        self.path = os.path.join(directory, LOG_NAME)
        self.entries: dict[str, Entry] = {}
        self.seq = 0
        self._fd = -1
        self._bytes = 0
        self._sizes: dict[str, int] = {}  # encoded size of each live entry's line
        self._live = 0  # their sum
        #: Lines not written yet (the disk was full), by lease: the end of a lease or its new
        #: holders, written before the next change (or made moot by the next compaction).
        self._owed: dict[str, bytes] = {}
        self._torn = False  # a failed write's piece could not be cut back: cut it first
        self._compact_from = 0  # a compaction failed: not tried again below this size
        self._whole = 0  # where the last whole line of the replayed log ends

    # -- reading -----------------------------------------------------------------------------

    def load(self) -> dict[str, Entry]:
        """Read the log (or the first broker's ``journal.json``); the live entries. A log of
        another boot is dropped (its holders ended with that boot; :attr:`dropped` counts its
        entries). Then the log is compacted (rewritten with only them, under this boot's head)
        and opened for appending."""
        legacy = os.path.join(self.directory, LEGACY_NAME)
        if os.path.lexists(self.path):
            self._replay()
        elif os.path.exists(legacy):
            self._read_legacy(legacy)
        if self.logged_boot is not None and self.boot is not None and self.logged_boot != self.boot:
            self.dropped = len(self.entries)
            self.entries.clear()
        try:
            self.compact()
        except OSError as err:
            # A full disk at a restart: a log of this very boot is kept as it is (its torn
            # tail cut off) and appended to; anything else must be rewritten, so cannot start.
            if self.logged_boot is None or self.logged_boot != self.boot:
                raise
            log.warning("journal %s not compacted at start (%s): appended to as it is",
                        self.path, err)
            self._open()
            if self._bytes > self._whole:
                os.ftruncate(self._fd, self._whole)
                self._bytes = self._whole
            return dict(self.entries)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(legacy)
        return dict(self.entries)

    def _replay(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # ours, not a link
        with os.fdopen(fd, "rb") as f:
            for n, raw in enumerate(f, 1):
                whole = raw.endswith(b"\n")
                if whole:
                    self._whole += len(raw)
                if len(raw) > MAX_LINE_BYTES or not whole:
                    log.warning("journal line %d skipped (torn or too long)", n)
                    continue
                try:
                    doc = json.loads(raw)
                except ValueError as err:
                    if not self._apply_pieces(raw, n):
                        log.warning("journal line %d skipped: %s", n, str(err)[:200])
                    continue
                try:
                    self._apply(doc)
                except (ValueError, TypeError, KeyError) as err:
                    log.warning("journal line %d skipped: %s", n, str(err)[:200])

    def _apply_pieces(self, raw: bytes, n: int) -> bool:
        """A line that is not JSON: a torn fragment with whole lines written after it (each
        starts with ``{"``, which nothing inside a line contains: every quote in a string is
        escaped). Each piece that parses is applied; ``False`` when there are no pieces."""
        starts = []
        at = raw.find(b'{"')
        while at >= 0:
            starts.append(at)
            at = raw.find(b'{"', at + 2)
        if len(starts) < 2:
            return False
        read = 0
        for a, b in zip(starts, [*starts[1:], len(raw)], strict=True):
            try:
                self._apply(json.loads(raw[a:b]))
            except (ValueError, TypeError, KeyError):
                continue
            read += 1
        log.warning("journal line %d: a torn piece skipped, %d whole line(s) after it read",
                    n, read)
        return True

    def _apply(self, doc: Any) -> None:
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        if set(doc) == {"seq"}:
            self.seq = max(self.seq, _int(doc["seq"]))
        elif set(doc) == {"boot"}:
            self.logged_boot = str(doc["boot"])[:128]
        elif "add" in doc:
            e = Entry(
                lease_id=str(doc["add"]),
                uid=_int(doc["uid"]),
                record=str(doc["record"]),
                peer=None if doc.get("peer") is None else _int(doc["peer"]),
                pids=_pids(doc.get("pids", [])),
                tenant=doc["tenant"] if isinstance(doc.get("tenant"), str) else None,
            )
            self.entries[e.lease_id] = e
            if isinstance(doc.get("seq"), int):
                self.seq = max(self.seq, doc["seq"])
        elif "del" in doc:
            self.entries.pop(str(doc["del"]), None)
        elif "holders" in doc:
            known = self.entries.get(str(doc["holders"]))
            if known is not None:
                known.pids = _pids(doc.get("pids", []))
        else:
            raise ValueError("unknown line")

    def _read_legacy(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                doc = json.loads(f.read())
            self.seq = _int(doc.get("seq", 0))
            items = doc.get("entries", [])
        except (OSError, ValueError, TypeError, AttributeError) as err:
            log.warning("journal %s unreadable (%s): starting empty", path, err)
            return
        for item in items:
            try:
                record = str(item["record"])
                lease_id = str(json.loads(record)["lease_id"])
                self.entries[lease_id] = Entry(lease_id, _int(item["uid"]), record, None,
                                               _pids(item["pids"]))
            except (ValueError, TypeError, KeyError) as err:
                log.warning("journal entry skipped: %s", str(err)[:200])

    # -- writing -----------------------------------------------------------------------------

    def add(self, entry: Entry, seq: int | None = None) -> None:
        """Append a new live entry, or a changed one (written when this returns: tell the
        client after). :class:`NotRecorded` when it cannot be written: then nothing changed,
        in the file or here (refuse what it was for)."""
        size = self._append(entry.encoded(seq))
        self.entries[entry.lease_id] = entry
        if seq is not None:
            self.seq = max(self.seq, seq)
        self._live += size - self._sizes.get(entry.lease_id, 0)
        self._sizes[entry.lease_id] = size
        self._maybe_compact()

    def set_pids(self, lease_id: str, pids: Pids) -> None:
        """New holders of a live entry (written now, or with the next change that can be)."""
        e = self.entries.get(lease_id)
        if e is None:
            return
        e.pids = list(pids)
        self._append_or_owe(
            lease_id, f'{{"holders":{_quote(lease_id)},"pids":{_pids_text(pids)}}}\n'.encode())

    def remove(self, lease_id: str) -> None:
        """Append the end of an entry (now, or with the next change that can be written)."""
        if self.entries.pop(lease_id, None) is None:
            return
        self._live -= self._sizes.pop(lease_id, 0)
        self._append_or_owe(lease_id, f'{{"del":{_quote(lease_id)}}}\n'.encode())

    def _append_or_owe(self, lease_id: str, data: bytes) -> None:
        """A line that cannot be refused: written, or kept for the next write (a lease whose
        end is not written yet is kept by a restart only while its holders still run)."""
        try:
            self._append(data)
        except NotRecorded as err:
            self._owed[lease_id] = data
            log.warning("journal: a line of %s kept to be written later (%s)", lease_id, err)
            return
        self._maybe_compact()

    def _append(self, data: bytes) -> int:
        """Write one line, ``data`` with its newline, after the lines owed (one ``write``: in
        the file, for any later reader, when this returns; see the module docstring for why it
        is not synced). :class:`NotRecorded` when it cannot: what was written of it is cut off
        again, so the next line starts where the last whole one ended."""
        owed = b"".join(self._owed.values())
        try:
            if self._fd < 0:
                self._open()
            if self._torn:
                os.ftruncate(self._fd, self._bytes)
                self._torn = False
            _write_all(self._fd, owed + data)
        except OSError as err:
            self._cut_back()
            raise NotRecorded(self.directory, err) from None
        self._owed.clear()
        self._bytes += len(owed) + len(data)
        return len(data)

    def _cut_back(self) -> None:
        """Cut the log back to its last whole line after a failed write (shrinking a file
        needs no space); where even that fails, before the next write."""
        if self._fd < 0:
            return
        try:
            os.ftruncate(self._fd, self._bytes)
        except OSError as err:
            self._torn = True
            log.warning("journal %s: a failed write not cut back yet (%s)", self.path, err)

    def _maybe_compact(self) -> None:
        """Compact once the log is past its bound; one that cannot be written (a full disk) is
        logged and tried again when the log has grown as much again."""
        if self._bytes <= max(COMPACT_MIN_BYTES, 4 * self._live, self._compact_from):
            return
        try:
            self.compact()
        except OSError as err:
            self._compact_from = 2 * self._bytes
            log.warning("journal %s not compacted (%s): appended to as it is", self.path, err)

    def compact(self) -> None:
        """Rewrite the log as the live entries only (atomically), and go on appending to it."""
        tmp = self.path + ".tmp"
        head = [json.dumps({"seq": self.seq}).encode() + b"\n"]
        if self.boot is not None:
            head.append(json.dumps({"boot": self.boot}).encode() + b"\n")
        lines = [e.encoded() for e in self.entries.values()]
        self._sizes = {
            e.lease_id: len(x) for e, x in zip(self.entries.values(), lines, strict=True)
        }
        self._live = sum(self._sizes.values())
        data = b"".join(head + lines)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)  # its space back: the old log stays, whole
            raise
        os.replace(tmp, self.path)
        self.close()
        self._owed.clear()  # the snapshot has only the live entries: nothing is owed
        self._torn = False
        self._compact_from = 0
        with contextlib.suppress(OSError):
            _fsync_dir(self.directory)
        self._bytes = len(data)
        self._open()

    def _open(self) -> None:
        self._fd = os.open(
            self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            self.close()
            raise OSError(f"{self.path} is not a file of ours")
        self._bytes = st.st_size

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    @property
    def size_bytes(self) -> int:
        return self._bytes

    @property
    def live_bytes(self) -> int:
        """The bytes of the live entries' lines: what a compaction leaves, and what decides it
        (the log is compacted once past four times this)."""
        return self._live


def _pids_text(pids: Iterable[Sequence[int]]) -> str:
    """``[[pid,start],...]`` as ``json.dumps`` writes it compactly."""
    return "[" + ",".join(f"[{','.join(str(int(x)) for x in p)}]" for p in pids) + "]"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"expected an integer, got {str(v)[:20]!r}")
    return v


def _pids(v: Any) -> Pids:
    if not isinstance(v, list):
        raise TypeError("pids: expected a list")
    return [(_int(p), _int(s)) for p, s in v][:64]
