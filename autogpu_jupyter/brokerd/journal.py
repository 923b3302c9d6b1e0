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

A torn last line (a crash mid-``write``) is skipped on reading. The whole-file journal of the
first broker (``journal.json``) is read once when no log exists yet, then removed.

**Holders.** A lease lives as long as *its socket* is open anywhere, not as long as the process
that connected: ``autogpu run`` and the provisioner hand the socket to a child and may exit. So
the journal records the inode of the client's end of the connection (its *peer*, from the
kernel's ``sock_diag`` interface) and the holder processes seen so far, as (pid, start time).
After a restart, the processes that still hold that inode (found in ``/proc/*/fd``) are the
holders; a pid is only ever trusted together with its start time, so a reused pid never keeps a
lease alive. Where ``sock_diag`` is unavailable, the recorded pids (connecting process, and the
one given by ``set_pid``) are used instead, checked with their start times and uid.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import functools
import json
import logging
import os
import socket
import stat
import struct
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _quote  # json.dumps's own, for one str
from typing import Any

from autogpu_jupyter.core import procfs

__all__ = [
    "COMPACT_MIN_BYTES",
    "Entry",
    "Journal",
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


@dataclass
class Entry:
    """One live lease or ticket as the journal knows it."""

    lease_id: str
    uid: int
    record: str  # the record's exact encoded bytes, as text
    peer: int | None = None  # inode of the client's end of the connection
    pids: Pids = field(default_factory=list)  # holder processes seen: (pid, start time)

    def line(self) -> dict[str, Any]:
        return {"add": self.lease_id, "uid": self.uid, "record": self.record,
                "peer": self.peer, "pids": [list(p) for p in self.pids]}

    def encoded(self, seq: int | None = None) -> bytes:
        """:meth:`line` (plus ``seq`` when given) as its journal line: exactly the bytes
        ``json.dumps(..., separators=(",", ":"))`` writes, put together by hand (a grant writes
        one; ``json.dumps`` of a dict costs several times more than the strings it quotes)."""
        peer = "null" if self.peer is None else str(int(self.peer))
        tail = "" if seq is None else f',"seq":{int(seq)}'
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
        self.compact()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(legacy)
        return dict(self.entries)

    def _replay(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # ours, not a link
        with os.fdopen(fd, "rb") as f:
            for n, raw in enumerate(f, 1):
                if len(raw) > MAX_LINE_BYTES or not raw.endswith(b"\n"):
                    log.warning("journal line %d skipped (torn or too long)", n)
                    continue
                try:
                    self._apply(json.loads(raw))
                except (ValueError, TypeError, KeyError) as err:
                    log.warning("journal line %d skipped: %s", n, str(err)[:200])

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
        """Append a new live entry (written when this returns: tell the client after)."""
        self.entries[entry.lease_id] = entry
        if seq is not None:
            self.seq = max(self.seq, seq)
        size = self._append(entry.encoded(seq))
        self._live += size - self._sizes.get(entry.lease_id, 0)
        self._sizes[entry.lease_id] = size

    def set_pids(self, lease_id: str, pids: Pids) -> None:
        e = self.entries.get(lease_id)
        if e is None:
            return
        e.pids = list(pids)
        self._append(f'{{"holders":{_quote(lease_id)},"pids":{_pids_text(pids)}}}\n'.encode())

    def remove(self, lease_id: str) -> None:
        """Append the end of an entry."""
        if self.entries.pop(lease_id, None) is None:
            return
        self._live -= self._sizes.pop(lease_id, 0)
        self._append(f'{{"del":{_quote(lease_id)}}}\n'.encode())

    def _append(self, data: bytes) -> int:
        """Write one line, ``data`` with its newline (one ``write``: in the file, for any
        later reader, when this returns; see the module docstring for why it is not synced)."""
        if self._fd < 0:
            self._open()
        _write_all(self._fd, data)
        self._bytes += len(data)
        if self._bytes > max(COMPACT_MIN_BYTES, 4 * self._live):
            self.compact()
        return len(data)

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
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        _fsync_dir(self.directory)
        self.close()
        self._open()
        self._bytes = len(data)

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


# -- processes and sockets -------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """The start time (clock ticks after boot) of ``pid``, or ``None`` if it is gone
    (:func:`autogpu_jupyter.core.procfs.start_time`: one reader of ``/proc``)."""
    return procfs.start_time(pid)


def proc_ids(pid: int) -> Pids:
    """``[(pid, start time)]``, or ``[]`` when ``pid`` is gone."""
    start = start_time(pid)
    return [] if start is None else [(pid, start)]


def pid_uids(pid: int) -> set[int]:
    """The uids of ``pid`` (none when it is gone or hidden)."""
    return procfs.uids(pid) or set()


def holds_socket(pid: int, inode: int) -> bool:
    """Whether process ``pid`` has the socket ``inode`` open."""
    target = f"socket:[{inode}]"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
    return False


def holders_alive(pids: Sequence[tuple[int, int]], peer: int | None, uid: int) -> Pids:
    """The recorded holders that still run (same start time) and, when the socket's inode is
    known, still hold it; without an inode, those of ``uid`` (root: any)."""
    out = []
    for pid, start in pids:
        if start_time(pid) != start:
            continue
        if peer is not None:
            if holds_socket(pid, peer):
                out.append((pid, start))
        elif uid == 0 or uid in pid_uids(pid):
            out.append((pid, start))
    return out


def scan_socket_holders(inodes: Iterable[int]) -> dict[int, Pids]:
    """Every process holding one of ``inodes`` (one pass over ``/proc/*/fd``): inode -> holders.

    Costs one ``readlink`` per open descriptor on the host: run it rarely (at a restart, and
    when every known holder of an orphan has gone) and off the event loop.
    """
    wanted = {f"socket:[{i}]": i for i in inodes}
    out: dict[int, Pids] = {}
    if not wanted:
        return out
    try:
        pids = [p for p in os.listdir("/proc") if p.isascii() and p.isdecimal()]
    except OSError:
        return out
    for p in pids:
        try:
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        found: set[int] = set()
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{p}/fd/{fd}")
            except OSError:
                continue
            ino = wanted.get(link)
            if ino is not None:
                found.add(ino)
        if found:
            start = start_time(int(p))
            if start is None:
                continue
            for ino in found:
                out.setdefault(ino, []).append((int(p), start))
    return out


# -- the peer of a Unix socket (sock_diag) ---------------------------------------------------

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_UDIAG_SHOW_PEER = 0x4
_UNIX_DIAG_PEER = 2
_diag_broken = False
_SIOCGSKNS = 0x894C  # the network namespace of a socket, as a descriptor (Linux 4.9)
_CLONE_NEWNET = 0x40000000
_MAX_NS_DIAGS = 64
_ns_diags: dict[int, socket.socket] = {}  # network namespace inode -> its sock_diag socket


_diag: socket.socket | None = None  # the sock_diag socket, opened once and kept
_diag_seq = 0


def peer_inode(sock: socket.socket) -> int | None:
    """The inode of the other end of the connected Unix socket ``sock`` (``sock_diag``), or
    ``None`` where the kernel does not tell (no ``unix_diag``: logged once, not asked again).

    A client in another network namespace (a container, ``unshare -n``) connects through
    the socket's path, and both ends of its connection live in *its* namespace, where a
    ``sock_diag`` socket of the broker's does not see them: that one socket is asked about in
    its own namespace (:func:`_peer_elsewhere`); nothing changes for any other connection."""
    global _diag_broken
    if _diag_broken:
        return None
    try:
        ino = os.fstat(sock.fileno()).st_ino
    except OSError:
        return None  # this connection is already gone (closed): nothing to ask the kernel
    try:
        return _ask_peer(ino)
    except _NotHere:
        return _peer_elsewhere(sock, ino)
    except (OSError, struct.error, ValueError) as err:
        _diag_broken = True
        _close_diag()
        log.warning("the kernel does not tell the peers of Unix sockets (sock_diag: %s): after "
                    "a restart, leases are kept by the pids that took them", err)
        return None


class _NotHere(ValueError):
    """``sock_diag`` knows no such socket in the namespace it was asked in (``ENOENT``)."""


def _peer_elsewhere(sock: socket.socket, ino: int) -> int | None:
    """:func:`peer_inode` for a socket of another network namespace: asked there, on a
    ``sock_diag`` socket made in that namespace (kept, one per namespace, at most
    :data:`_MAX_NS_DIAGS`). ``None`` where that cannot be done (not root, no such socket)."""
    try:
        nsfd = fcntl.ioctl(sock.fileno(), _SIOCGSKNS)
    except OSError as err:
        log.debug("no network namespace for socket %d: %s", ino, err)
        return None
    try:
        ns = os.fstat(nsfd).st_ino
        diag = _ns_diags.get(ns)
        if diag is None:
            diag = _diag_in(nsfd)
            if len(_ns_diags) >= _MAX_NS_DIAGS:
                _ns_diags.pop(next(iter(_ns_diags))).close()
            _ns_diags[ns] = diag
        return _ask_peer(ino, diag)
    except (OSError, struct.error, ValueError) as err:
        log.debug("socket %d: no peer in its own network namespace: %s", ino, err)
        return None
    finally:
        os.close(nsfd)


def _diag_in(nsfd: int) -> socket.socket:
    """A ``sock_diag`` socket of the network namespace ``nsfd`` (made by a thread of its own
    that enters it, so no thread of the broker ever changes its namespace)."""
    made: list[Any] = []

    def enter() -> None:
        try:
            if _libc().setns(nsfd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            made.append(socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG))
        except OSError as err:
            made.append(err)

    t = threading.Thread(target=enter, name="autogpu-sock-diag")
    t.start()
    t.join()
    if not made or isinstance(made[0], OSError):
        raise made[0] if made else OSError("no sock_diag socket made")
    diag: socket.socket = made[0]
    diag.settimeout(1.0)
    return diag


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _ask_peer(ino: int, diag: socket.socket | None = None) -> int | None:
    """One ``SOCK_DIAG_BY_FAMILY`` request for socket ``ino`` on ``diag`` (default: the kept
    netlink socket of the broker's namespace, one per broker: opening one per connection cost
    as much again); its answer is the reply that carries the request's sequence number."""
    global _diag, _diag_seq
    if diag is None:
        if _diag is None:
            _diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
            _diag.settimeout(1.0)
        diag = _diag
    _diag_seq = _diag_seq % 0xFFFFFFFF + 1
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, ino,
                      _UDIAG_SHOW_PEER, 0xFFFFFFFF, 0xFFFFFFFF)
    hdr = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST,
                      _diag_seq, 0)
    diag.sendto(hdr + req, (0, 0))
    while True:
        data = diag.recv(8192)
        if struct.unpack_from("=I", data, 8)[0] == _diag_seq:  # nlmsg_seq
            return _parse_peer(data)


def _close_diag() -> None:
    global _diag
    if _diag is not None:
        _diag.close()
        _diag = None
    while _ns_diags:
        _ns_diags.popitem()[1].close()


atexit.register(_close_diag)  # the kept socket ends with the process, not as a ResourceWarning


def _parse_peer(data: bytes) -> int | None:
    length, kind = struct.unpack_from("=IH", data)
    if kind == _NLMSG_ERROR:
        code = -struct.unpack_from("=i", data, 16)[0]
        raise (_NotHere if code == errno.ENOENT else ValueError)(f"error {code}")
    off = 16 + 16  # nlmsghdr, unix_diag_msg
    end = min(length, len(data))
    while off + 4 <= end:
        alen, atype = struct.unpack_from("=HH", data, off)
        if alen < 4:
            break
        if atype == _UNIX_DIAG_PEER:
            if alen < 8 or off + 8 > end:
                return None  # its payload is not all there: a truncated answer names no peer
            peer: int = struct.unpack_from("=I", data, off + 4)[0]
            return peer or None
        off += (alen + 3) & ~3
    return None
