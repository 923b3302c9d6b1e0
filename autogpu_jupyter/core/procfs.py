"""What ``/proc`` says about a process: its parent, start time, uids, owner and command line,
and who holds an ``flock``. One reader for every module that asks (the sampler's own-process
test, the server's kernel of a pid, the broker's holders, the registry's prune, NVML's process
owners).

Everything here tolerates a process that vanished between two reads, a ``/proc`` mounted with
``hidepid`` and a pid from another pid namespace: the answer is then ``None`` (unknown), never
an exception. Lines from ``/proc`` are ASCII written by the kernel, except the command name and
command line, which the process chose: they are split from the right and decoded with
replacement.
"""

from __future__ import annotations

import os
import pwd

__all__ = [
    "PROC",
    "command_of",
    "flock_holders",
    "owner_uid",
    "ppid",
    "start_time",
    "uids",
    "user_of",
]

PROC = "/proc"
_STAT_READ = 4096  # bytes: /proc/<pid>/stat is 52 numbers and a name of at most 64 bytes


def _stat_fields(pid: int, proc: str = PROC) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 onwards)."""
    try:
        fd = os.open(os.path.join(proc, str(pid), "stat"), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # One read: the kernel writes the whole line (well under 4 KiB) into a buffer that
        # holds it; a buffered file object would cost twice as much (the broker reads this for
        # every lease).
        data = os.read(fd, _STAT_READ)
    except OSError:
        return None
    finally:
        os.close(fd)
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return data[data.rfind(b")") + 2 :].split()


def ppid(pid: int, proc: str = PROC) -> int | None:
    """The parent of ``pid`` (``None``: gone, hidden or unreadable)."""
    fields = _stat_fields(pid, proc)
    try:
        return int(fields[1]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def start_time(pid: int, proc: str = PROC) -> int | None:
    """When ``pid`` started, in clock ticks after boot: with the pid, it names one process
    (a reused pid has another start time). ``None``: gone."""
    fields = _stat_fields(pid, proc)
    try:
        return int(fields[19]) if fields is not None else None
    except (IndexError, ValueError):
        return None


def uids(pid: int, proc: str = PROC) -> set[int] | None:
    """Real, effective, saved and filesystem uids of ``pid`` (``None``: gone or hidden)."""
    try:
        with open(os.path.join(proc, str(pid), "status"), "rb") as fh:
            for line in fh:
                if line.startswith(b"Uid:"):
                    return {int(x) for x in line.split()[1:]}
    except (OSError, ValueError):
        return None
    return None


def owner_uid(pid: int, proc: str = PROC) -> int | None:
    """The uid that owns ``/proc/<pid>`` (the process's effective uid), ``None`` when gone."""
    try:
        return os.stat(os.path.join(proc, str(pid))).st_uid
    except OSError:
        return None


_user_names: dict[int, str] = {}


def user_of(pid: int, proc: str = PROC) -> str | None:
    """The name of the user who owns ``pid`` (its uid where it has no passwd entry, as in a
    container); ``None`` when the process is gone. Names are looked up once per uid."""
    uid = owner_uid(pid, proc)
    if uid is None:
        return None
    name = _user_names.get(uid)
    if name is None:
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:  # a uid without a passwd entry (containers): show the number
            name = str(uid)
        _user_names[uid] = name
    return name


def command_of(pid: int, proc: str = PROC) -> str | None:
    """``pid``'s command line, arguments joined by spaces (``None``: gone or empty)."""
    try:
        with open(os.path.join(proc, str(pid), "cmdline"), "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return text or None


def flock_holders(st: os.stat_result, locks: str = f"{PROC}/locks") -> list[int] | None:
    """PIDs holding an ``flock`` on the file of ``st``, per ``/proc/locks``; ``None``: unknown.

    A line reads ``1: FLOCK  ADVISORY  WRITE 4242 fe:00:2149016 0 EOF`` (device as hex
    major:minor, then the inode); waiters are marked ``->`` and do not hold anything.
    """
    key = b"%02x:%02x:%d" % (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    try:
        with open(locks, "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    pids = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == b"FLOCK" and parts[5] == key:
            try:
                pids.append(int(parts[4]))
            except ValueError:
                return None
    return pids
