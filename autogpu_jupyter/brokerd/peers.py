"""Who holds a lease's socket: processes by (pid, start time), and the peer of a Unix socket.

A lease lives as long as its socket is open anywhere. The broker records the inode of the
client's end of each connection (its *peer*, from the kernel's ``sock_diag`` interface) and the
holder processes seen so far, as (pid, start time); a pid is only ever trusted together with
its start time, so a reused pid never keeps a lease alive. A socket of a client in another
network namespace lives in that namespace: it is asked about there.

After a restart the broker asks whether a recorded peer socket still exists (one ``sock_diag``
request, whatever the holders hold: nothing here reads a process's descriptors but
:func:`scan_socket_holders`, which runs off the event loop, once, at a restore).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from autogpu_jupyter.core import procfs

__all__ = [
    "find_socket",
    "holders_alive",
    "peer_inode",
    "pid_uids",
    "proc_ids",
    "scan_socket_holders",
    "socket_exists",
    "host_pid",
    "ns_pid",
    "start_time",
]

log = logging.getLogger("autogpu.broker")

Pids = list[tuple[int, int]]




def start_time(pid: int) -> int | None:
    """The start time (clock ticks after boot) of ``pid``, or ``None`` if it is gone
    (:func:`autogpu_jupyter.core.procfs.start_time`: one reader of ``/proc``)."""
    return procfs.start_time(pid)


def proc_ids(pid: int) -> Pids:
    """``[(pid, start time)]``, or ``[]`` when ``pid`` is gone."""
    start = start_time(pid)
    return [] if start is None else [(pid, start)]


def _nspids(pid: int | str) -> list[int]:
    """``pid``'s pids from the host's pid namespace down to its own (``NSpid``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


def ns_pid(pid: int) -> int | None:
    """Host pid ``pid`` as its own pid namespace numbers it (a container's view)."""
    ids = _nspids(pid)
    return ids[-1] if ids else None


def host_pid(pid: int, like: int) -> int | None:
    """The host pid of the process that host pid ``like``'s pid namespace calls ``pid`` (a
    pid a container sent in a message); ``None`` when there is none there."""
    try:
        ns = os.readlink(f"/proc/{like}/ns/pid")
        if ns == os.readlink("/proc/self/ns/pid"):
            return pid
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/pid") != ns:
                continue
        except OSError:
            continue
        ids = _nspids(name)
        if ids and ids[-1] == pid:
            return ids[0]
    return None


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
_MAX_NS_DIAGS = 256
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
        if ns == _own_ns():
            return None  # asked there already: no such socket (closed on the way)
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


# -- does a socket still exist? ----------------------------------------------------------------

#: The broker's own network namespace, as :func:`find_socket` names it.
OWN_NS = 0


_NLM_F_DUMP = 0x300
_NLMSG_DONE = 3


def unix_inodes() -> set[int]:
    """The inode of every Unix socket of the broker's own network namespace: one ``sock_diag``
    dump. Asking for one socket by its inode makes the kernel walk every Unix socket of the
    namespace, so a restart that asked for each of 10,000 sockets walked 10,000 x 10,000; the
    dump walks them once. Raises ``OSError`` where the kernel cannot be asked."""
    if _diag_broken:
        raise OSError("the kernel does not tell the peers of Unix sockets")
    diag = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG)
    try:
        diag.settimeout(5.0)
        req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 0xFFFFFFFF, 0, 0,
                          0xFFFFFFFF, 0xFFFFFFFF)
        diag.sendto(struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY,
                                _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req, (0, 0))
        out: set[int] = set()
        while True:
            data = diag.recv(1 << 20)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    code = -struct.unpack_from("=i", data, off + 16)[0]
                    raise OSError(code, f"sock_diag dump: error {code}")
                if length < 16 + 8:
                    raise OSError("sock_diag dump: a short message")
                out.add(struct.unpack_from("=I", data, off + 20)[0])  # unix_diag_msg.udiag_ino
                off += (length + 3) & ~3
            if not data:
                raise OSError("sock_diag dump: no end")
    except (struct.error, ValueError) as err:
        raise OSError(str(err)) from None
    finally:
        diag.close()


def socket_exists(ino: int, ns: int = OWN_NS) -> bool:
    """Whether the Unix socket ``ino`` still exists (some process holds it) in the network
    namespace ``ns`` (:data:`OWN_NS`, or one :func:`find_socket` found and keeps): one
    ``sock_diag`` request. Raises ``OSError`` where the kernel cannot be asked (no
    ``sock_diag``, or that namespace is no longer kept)."""
    if _diag_broken:
        raise OSError("the kernel does not tell the peers of Unix sockets")
    diag = None
    if ns != OWN_NS:
        diag = _ns_diags.get(ns)
        if diag is None:
            raise OSError(f"network namespace {ns} is not kept")
    try:
        _ask_peer(ino, diag)
    except _NotHere:
        return False
    except (struct.error, ValueError) as err:
        raise OSError(str(err)) from None
    return True


def host_namespaces() -> dict[int, int]:
    """Every network namespace a process of this host is in: its inode -> one of its pids
    (one ``stat`` per process, none per descriptor)."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for p in os.listdir("/proc"):
            if p.isascii() and p.isdecimal():
                with contextlib.suppress(OSError):
                    out.setdefault(os.stat(f"/proc/{p}/ns/net").st_ino, int(p))
    return out


def find_socket(ino: int, pids: Iterable[int] = (),
                namespaces: dict[int, int] | None = None) -> int | None:
    """The network namespace where the Unix socket ``ino`` lives: :data:`OWN_NS`, or the
    inode of another (its ``sock_diag`` socket is then kept, for :func:`socket_exists`);
    ``None`` when it exists in none of them. Asked: the broker's own namespace, those of
    ``pids``, then those of ``namespaces`` (:func:`host_namespaces`). Raises ``OSError``
    where the kernel cannot be asked."""
    if socket_exists(ino):
        return OWN_NS
    own = _own_ns()
    tried = {own}
    candidates = [(None, pid) for pid in pids] + list((namespaces or {}).items())
    for ns, pid in candidates:
        if ns in tried:
            continue
        try:
            nsfd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            found = os.fstat(nsfd).st_ino
            if found in tried:
                continue
            tried.add(found)
            if found not in _ns_diags:
                if len(_ns_diags) >= _MAX_NS_DIAGS:
                    _ns_diags.pop(next(iter(_ns_diags))).close()
                _ns_diags[found] = _diag_in(nsfd)
        except OSError as err:
            log.debug("network namespace of pid %d not asked: %s", pid, err)
            continue
        finally:
            os.close(nsfd)
        if socket_exists(ino, found):
            return found
    return None


@functools.cache
def _own_ns() -> int:
    return os.stat("/proc/self/ns/net").st_ino
