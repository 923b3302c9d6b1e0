"""The hardened filesystem toolkit under the shared-directory lease store.

Every call here treats the directory tree as shared with users who may be hostile: nothing is
reached by a path that another user could redirect.

* Directories are opened ``O_DIRECTORY | O_NOFOLLOW`` and files relative to a directory
  descriptor (``dir_fd``: the ``openat`` family), so a symlink planted anywhere on the way is
  refused, never followed.
* What was opened is checked with ``fstat`` on the descriptor, not on the path: the owner (the
  top directory root's or the caller's; a user directory its own uid's; a file the uid of the
  directory it is in), the mode (sticky when others can write; a user directory ``0755``), a
  regular file of at most the record size.
* A file is removed only if the name still points at the inode held (``lstat`` against the
  descriptor's ``fstat``), after taking its ``flock`` where it may be live.
* Liveness is an ``flock``: :func:`held` tests it without waiting; :func:`flock_wait` waits with
  a jittered poll (no helper thread, no extra descriptor).
* A negative cache (:func:`remember_bad`, :func:`known_bad`) keeps unheld entries a scan
  rejected, by (directory uid, name, inode), so planted junk costs a dictionary look-up per scan.

The error texts name the lease registry, its setting and the admin's fix: they are what a user
reads when the directory cannot be used (:class:`~autogpu_jupyter.errors.LeaseStoreError`). The
store's own rules -- which files are leases and tickets, the record format, admission, what a scan
reports -- are :mod:`~autogpu_jupyter.core.leasing.directory`'s.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pwd
import random
import stat
import time
from dataclasses import dataclass

from autogpu_jupyter.core import procfs
from autogpu_jupyter.errors import LeaseStoreError

__all__ = [
    "O_DIR",
    "O_FILE",
    "Untrusted",
    "acquire",
    "describe_owner",
    "flock_wait",
    "held",
    "held_only_by_others",
    "known_bad",
    "list_inodes",
    "open_peer_dir",
    "open_top",
    "open_user_dir",
    "prune_tmp",
    "read_untrusted",
    "remember_bad",
    "remove_dead",
    "remove_if_held_by_others",
    "shown",
    "unlink_if_same",
    "unlink_own",
    "user_name",
    "write_all",
]

# The store's logger, as before the cut: a logging set-up (or a server log) that names it keeps
# seeing these records.
log = logging.getLogger("autogpu_jupyter.core.leasing.directory")

#: How a directory is opened: read-only, a directory, never through a symlink.
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: How another user's file is opened: never through a symlink, never waiting on a FIFO.
O_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


# --------------------------------------------------------------------------------------------
# Writing and locking


def write_all(fd: int, data: bytes, offset: int | None = None) -> None:
    """Write every byte of ``data`` (a short write, e.g. on a nearly full disk, is continued;
    no progress raises): a record is complete on disk or the write fails."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        if offset is None:
            n = os.write(fd, view[done:])
        else:
            n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no space left on device (short write)")
        done += n


def held(fd: int) -> bool:
    """Whether another open file description holds an ``flock`` on the file of ``fd``."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as err:  # ENOLCK and friends: cannot tell, so count it (conservative)
        log.debug("cannot test lease liveness: %s", err)
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def flock_wait(fd: int, timeout_s: float) -> bool:
    """Try ``flock(fd, LOCK_EX | LOCK_NB)`` until it succeeds or ``timeout_s`` passes.

    Polled with a short, growing, jittered sleep (0.2 ms doubling up to 20 ms): no helper
    thread and no extra descriptor, so a registry lock held by a stuck or hostile process costs
    a timed-out pick nothing that outlives it (a thread blocked in ``flock`` could never be
    cancelled: one thread and one fd would leak per attempt). Raises the ``OSError`` of the
    ``flock`` call (``ENOLCK``, ...).
    """
    deadline = time.monotonic() + max(timeout_s, 0.0)
    delay = 0.0002
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay * (0.5 + random.random()), left))  # noqa: S311 (jitter only)
        delay = min(delay * 2, 0.02)


def acquire(top_fd: int, path: str, timeout_s: float) -> None:
    """Take the registry-wide ``flock`` on ``top_fd``, waiting at most ``timeout_s``.

    The uncontended case is one non-blocking ``flock``; otherwise :func:`flock_wait` polls.
    Raises :class:`LeaseStoreError` naming ``path`` when it stays locked or cannot be locked.
    """
    try:
        fcntl.flock(top_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    except OSError as err:
        raise _lock_error(path, err) from None
    try:
        acquired = flock_wait(top_fd, timeout_s)
    except OSError as err:
        raise _lock_error(path, err) from None
    if not acquired:
        raise LeaseStoreError(
            f"lease registry {path} stayed locked by another process for more than "
            f"{timeout_s:g} s (the admin can find the holder with "
            f"`lslocks | grep {path}` and stop it)"
        )


def _lock_error(path: str, err: OSError) -> LeaseStoreError:
    return LeaseStoreError(
        f"cannot lock lease registry {path}: {err.strerror} (a filesystem "
        "without flock, e.g. some NFS mounts? Use a local AUTOGPU_REGISTRY_DIR)"
    )


# --------------------------------------------------------------------------------------------
# Names and owners


def shown(name: str) -> str:
    """A directory entry's name as printable text (undecodable bytes spelled out), for the
    paths a scan reports: another user picks these names."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def user_name(uid: int) -> str:
    """The login name of ``uid``, else the uid as text."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def describe_owner(uid: int) -> str:
    return f"{user_name(uid)} (uid {uid})"


def held_only_by_others(st: os.stat_result, owner_uid: int) -> bool:
    """True when the file's ``flock`` is held, and every holder runs as a uid other than
    ``owner_uid`` (a lease kept looking alive by someone else). Unknown holders: False."""
    pids = procfs.flock_holders(st)
    if not pids:
        return False
    for pid in pids:
        uids = procfs.uids(pid)  # None for a pid of 0 or less too: /proc has no such entry
        if uids is None or owner_uid in uids:
            return False
    return True


# --------------------------------------------------------------------------------------------
# The negative cache

#: Entries a scan rejected that nobody holds (no ``flock``), by (directory uid, name, inode),
#: with why: planted junk then costs a dictionary look-up per scan, not open, read, parse and
#: close. Safe because a record only counts while its holder holds its ``flock``, and our writer
#: never makes a file valid in place: it creates a new name (new inode), locked before it is
#: visible. A held file that fails is never remembered (it is read again every scan), so a torn
#: read of a lease being rewritten (``set_pid``) cannot hide it. Only its owner can rewrite a file
#: in its directory; the owner hiding their own lease from others harms nobody else.
REJECTED: dict[tuple[int, str, int], str] = {}
REJECTED_MAX = 16384


def remember_bad(key: tuple[int, str, int] | None, st: os.stat_result, why: str) -> str:
    """Keep ``why`` for the unheld entry ``key`` if it is still the inode ``st`` describes;
    returns ``why``."""
    if key is not None and key[2] == st.st_ino:
        if len(REJECTED) >= REJECTED_MAX:
            REJECTED.clear()
        REJECTED[key] = why
    return why


def known_bad(key: tuple[int, str, int]) -> str | None:
    """Why the unheld entry ``key`` was rejected before (``None``: read it)."""
    return REJECTED.get(key)


# --------------------------------------------------------------------------------------------
# Opening the directories, with the safety checks


def open_top(path: str, uid: int, create: bool) -> int:
    """Open the top directory ``path`` (creating it 1777 when missing, if ``create``) and check
    it is safe for ``uid`` to use: owned by root or ``uid``, sticky when others can write it."""
    try:
        fd = os.open(path, O_DIR)
    except FileNotFoundError:
        if not create:
            raise LeaseStoreError(f"lease registry {path} does not exist") from None
        try:
            os.mkdir(path, 0o700)  # tightened before anyone else can use it
            fd = os.open(path, O_DIR)
            if os.fstat(fd).st_uid == uid:  # (whatever the umask left of 0700)
                os.fchmod(fd, 0o1777)
                log.info("created lease registry %s (mode 1777)", path)
        except FileExistsError:
            fd = _open_existing_top(path)
        except OSError as err:
            raise LeaseStoreError(
                f"cannot create lease registry {path}: {err.strerror}; ask the admin to "
                f"create it (install -d -m 1777 -o root {path}) or set "
                "AUTOGPU_REGISTRY_DIR / c.AutoGPU.registry_dir"
            ) from None
    except OSError as err:
        raise _open_error(path, err) from None
    try:
        _check_top(path, uid, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_existing_top(path: str) -> int:
    try:
        return os.open(path, O_DIR)
    except OSError as err:
        raise _open_error(path, err) from None


def _open_error(path: str, err: OSError) -> LeaseStoreError:
    final_is_odd = os.path.islink(path) or (os.path.lexists(path) and not os.path.isdir(path))
    if err.errno in (errno.ELOOP, errno.ENOTDIR) and final_is_odd:
        what = "a symlink" if os.path.islink(path) else "not a directory"
        return LeaseStoreError(
            f"lease registry {path} is {what}: refused (another user could redirect "
            "leases elsewhere); the admin should make it a real directory, mode 1777"
        )
    return LeaseStoreError(
        f"cannot use lease registry {path}: {err.strerror}; ask the admin to create it "
        f"(install -d -m 1777 -o root {path}) or set AUTOGPU_REGISTRY_DIR / "
        "c.AutoGPU.registry_dir"
    )


def _check_top(path: str, uid: int, fd: int) -> None:
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid not in (0, uid):
        raise LeaseStoreError(
            f"lease registry {path} is owned by {describe_owner(st.st_uid)}, not by root "
            f"or you: its owner could hide or replace other users' leases, so it is refused. "
            f"Ask the admin to create it as root (install -d -m 1777 -o root {path}), "
            "or set AUTOGPU_REGISTRY_DIR to another directory"
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH) and not mode & stat.S_ISVTX:
        raise LeaseStoreError(
            f"lease registry {path} is writable by others without the sticky bit "
            f"(mode {mode:04o}): any user could delete or replace other users' leases, so it "
            f"is refused. Fix: chmod 1777 {path}"
        )


def open_user_dir(path: str, top_fd: int, uid: int, create: bool) -> int | None:
    """``uid``'s directory ``<top>/<uid>`` (its own, 0755); ``None`` if missing and not
    ``create``. ``path`` is the top directory's, for the messages."""
    name = str(uid)
    where = os.path.join(path, name)
    try:
        fd = os.open(name, O_DIR, dir_fd=top_fd)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.mkdir(name, 0o755, dir_fd=top_fd)
        except FileExistsError:
            pass
        except OSError as err:
            raise LeaseStoreError(
                f"cannot create {where} in the lease registry: {err.strerror}"
            ) from None
        try:
            fd = os.open(name, O_DIR, dir_fd=top_fd)
        except OSError as err:
            raise _user_dir_error(where, err) from None
    except OSError as err:
        raise _user_dir_error(where, err) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise LeaseStoreError(
                f"{where} is owned by {describe_owner(st.st_uid)}, not by you: someone "
                "created your lease directory before you did, so it is refused. Ask the admin "
                f"to remove it (rm -r {where})"
            )
        if stat.S_IMODE(st.st_mode) != 0o755:
            os.fchmod(fd, 0o755)  # umask, or a chmod of ours: others must read, not write
    except BaseException:
        os.close(fd)
        raise
    return fd


def _user_dir_error(where: str, err: OSError) -> LeaseStoreError:
    if err.errno in (errno.ELOOP, errno.ENOTDIR):
        return LeaseStoreError(
            f"{where} is a symlink or not a directory (planted by another user?): refused; "
            "nothing was written. Ask the admin to remove it"
        )
    return LeaseStoreError(f"cannot open {where}: {err.strerror}")


def open_peer_dir(top_fd: int, name: str, dir_uid: int) -> int | str:
    """The directory ``name`` of the top directory, named for ``dir_uid``, opened for reading
    its entries; or why it is ignored: not a directory (a symlink), owned by another uid than
    the one it is named for (forged), or writable by others (its files are untrusted)."""
    try:
        fd = os.open(name, O_DIR | os.O_NONBLOCK, dir_fd=top_fd)
    except OSError as err:
        why = (
            "a symlink or not a directory"
            if err.errno in (errno.ELOOP, errno.ENOTDIR)
            else err.strerror
        )
        return f"unreadable user directory: {why}"
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    why = None
    if st.st_uid != dir_uid:
        why = f"forged: owned by uid {st.st_uid}, named for uid {dir_uid}"
    elif stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
        why = "writable by others: its leases are untrusted"
    if why is not None:
        os.close(fd)
        return why
    return fd


def list_inodes(dir_fd: int) -> dict[str, int] | str:
    """Each entry of the directory ``dir_fd`` with its inode number; or why it cannot be listed."""
    try:
        with os.scandir(dir_fd) as it:
            return {e.name: e.inode() for e in it}
    except OSError as err:
        return f"cannot list: {err.strerror}"


# --------------------------------------------------------------------------------------------
# Reading another user's file


@dataclass(frozen=True, slots=True)
class Untrusted:
    """A file's bytes, read safely but not yet parsed: ``live`` whether its ``flock`` is held,
    ``st`` its ``fstat`` (for :func:`remember_bad`)."""

    data: bytes
    live: bool
    st: os.stat_result


def read_untrusted(
    ufd: int, name: str, dir_uid: int, max_bytes: int, key: tuple[int, str, int] | None = None
) -> Untrusted | str:
    """File ``name`` of the directory ``ufd`` (named for ``dir_uid``), or why it is ignored: a
    symlink, not a regular file, owned by another uid than the directory's (forged), larger than
    ``max_bytes``. Rejections of what cannot change in place are remembered under ``key``."""
    try:
        fd = os.open(name, O_FILE, dir_fd=ufd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "a symlink"
        return f"unreadable: {err.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_uid != dir_uid:
            why = f"forged: owned by uid {st.st_uid} in the directory of uid {dir_uid}"
            return remember_bad(key, st, why)
        if st.st_size > max_bytes:
            return remember_bad(key, st, f"larger than {max_bytes} bytes")
        data = os.read(fd, max_bytes + 1)
        if len(data) > max_bytes:
            return f"larger than {max_bytes} bytes"
        return Untrusted(data, held(fd), st)
    except OSError as err:
        return f"unreadable: {err.strerror}"
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Removing


def unlink_if_same(ufd: int, name: str, fd: int) -> None:
    """Remove ``name`` from the directory ``ufd`` if it is still the inode ``fd`` holds."""
    try:
        st = os.lstat(name, dir_fd=ufd)
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(name, dir_fd=ufd)
    except FileNotFoundError:
        pass


def unlink_own(path: str, uid: int, name: str, fd: int) -> None:
    """Remove file ``name`` of ``uid``'s directory under the top directory ``path`` if it is
    still the inode ``fd`` holds (reopening both directories safely); failures are logged."""
    try:
        top = os.open(path, O_DIR)
    except OSError as err:
        log.debug("cannot reopen registry to remove %s: %s", name, err)
        return
    try:
        ufd = open_user_dir(path, top, uid, create=False)
        if ufd is None:
            return
        try:
            unlink_if_same(ufd, name, fd)
        finally:
            os.close(ufd)
    except (OSError, LeaseStoreError) as err:
        log.debug("cannot remove lease %s: %s", name, err)
    finally:
        os.close(top)


def remove_dead(ufd: int, name: str) -> None:
    """Unlink a file whose holder is gone, re-checking under its own lock (race-free)."""
    try:
        fd = os.open(name, O_FILE, dir_fd=ufd)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        st = os.stat(name, dir_fd=ufd, follow_symlinks=False)
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(name, dir_fd=ufd)
    except OSError as err:
        log.debug("not removing %s: %s", name, err)
    finally:
        os.close(fd)


def prune_tmp(ufd: int, name: str) -> None:
    """Remove the temporary file ``name`` of a writer that crashed (older than a minute)."""
    try:
        st = os.stat(name, dir_fd=ufd, follow_symlinks=False)
    except OSError:
        return
    if time.time() - st.st_mtime > 60:  # a writer crashed between create and rename
        remove_dead(ufd, name)


def remove_if_held_by_others(top_fd: int, uid: int, name: str, path: str) -> bool:
    """Unlink file ``name`` of ``uid``'s directory if only other users' processes hold its
    ``flock`` (``path``: the file's, for the log)."""
    try:
        ufd = os.open(str(uid), O_DIR, dir_fd=top_fd)
    except OSError:
        return False
    try:
        fd = os.open(name, O_FILE, dir_fd=ufd)
        try:
            st = os.fstat(fd)
            if st.st_uid != uid or not held_only_by_others(st, uid):
                return False
            now = os.lstat(name, dir_fd=ufd)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False
            os.unlink(name, dir_fd=ufd)
            log.info("removed %s: its lock is held only by other users' processes", path)
            return True
        finally:
            os.close(fd)
    except OSError as err:
        log.debug("not removing %s: %s", path, err)
        return False
    finally:
        os.close(ufd)
