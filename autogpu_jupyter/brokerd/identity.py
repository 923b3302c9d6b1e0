"""Who a connecting uid *is*, for the broker's accounting: one user is one user.

The kernel tells the broker the uid of each caller (``SO_PEERCRED``), but one person may run
processes under many uids: Debian's ``useradd`` gives every user 65,536 *subordinate* uids
(``/etc/subuid``), and with the ``uidmap`` package ``unshare --map-auto`` runs processes as
them. Keyed on the raw uid, each would be a user of its own (its own quota, connection and
message limits, its own turn at the pick lock). So every uid is *accounted* to an
:class:`Account`:

* a uid with a passwd entry is its own account (root included);
* a uid without one that lies in a ``/etc/subuid`` range is accounted to that range's owner:
  the owner's name, quota, groups, connection and message limits and turn at the lock;
* any other unknown uid falls into one shared bucket, :data:`UNKNOWN`, with small limits
  of its own (admin-configurable: ``unknown_uids`` in the rules file).

A uid that has a passwd entry wins over a subordinate range that happens to contain it.

An account's groups come from the account database only: the person's primary group (passwd)
and their supplementary groups (``getgrouplist``), never the gid the caller runs with. With
``uidmap`` a user maps any gid of their ``/etc/subgid`` range (``newgidmap``) and ``setgid``s to
it: where a real group's gid lies in that range, ``SO_PEERCRED`` reports that group's gid for a
process of someone who is no member of it.

The file is re-read when it changes (checked at most once a second); lookups are cached briefly,
with a bounded cache (a flood of fresh uids cannot grow it).
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import pwd
import time
from dataclasses import dataclass

__all__ = ["UNKNOWN_KEY", "Account", "Accounts", "tenant_key"]

log = logging.getLogger("autogpu.broker")

#: The account key of uids that are neither a passwd user nor anyone's subordinate uid.
UNKNOWN_KEY = -1
_CACHE_MAX = 4096
_CACHE_TTL_S = 30.0
_RECHECK_S = 1.0
_MAX_SUBUID_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Account:
    """What the broker counts a caller as.

    ``key`` identifies the account (the owner's uid; :data:`UNKNOWN_KEY` for the shared bucket
    of unknown uids); ``name`` is shown in records and messages; ``groups`` are the owner's
    group names (for reserved devices and group limits); ``via`` says how a uid other than the
    owner's own was mapped (``"subordinate uid 100003 of alice"``), for messages.
    """

    key: int
    name: str
    groups: frozenset[str]
    via: str = ""

    @property
    def unknown(self) -> bool:
        return self.key == UNKNOWN_KEY

    @property
    def tenant(self) -> bool:
        """A tenant's account (issue 40): a connection on that tenant's socket, whatever its
        uid; never root, whatever uid it runs as."""
        return self.key < UNKNOWN_KEY


def tenant_key(name: str) -> int:
    """The account key of tenant ``name``: below :data:`UNKNOWN_KEY`, where no uid lies (uids
    are >= 0), one per name (the name's bytes as a number) and the same after a restart, so
    that the journal's leases of a tenant are taken back by that tenant."""
    return UNKNOWN_KEY - 1 - int.from_bytes(name.encode(), "big")


class Accounts:
    """Maps uids to :class:`Account` (see the module docstring).

    Parameters
    ----------
    subuid_path
        The subordinate uid file (``/etc/subuid``); a missing file means no ranges.
    """

    def __init__(self, subuid_path: str = "/etc/subuid") -> None:
        self.subuid_path = subuid_path
        self._ranges: list[tuple[int, int, str]] = []  # (first, last, owner name or uid)
        self._stamp: tuple[int, int, int, int] | None = None
        self._checked = 0.0
        self._cache: dict[int, tuple[float, Account]] = {}

    @property
    def cached(self) -> int:
        """How many uids' accounts are kept (at most ``_CACHE_MAX``: one lookup each)."""
        return len(self._cache)

    def account(self, uid: int) -> Account:
        """The account of a caller with ``uid`` (from ``SO_PEERCRED``; the caller's gid is not
        asked for: see the module docstring)."""
        now = time.monotonic()
        self._refresh(now)
        hit = self._cache.get(uid)
        if hit is not None and now - hit[0] < _CACHE_TTL_S:
            return hit[1]
        acct = self._lookup(uid)
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[uid] = (now, acct)
        return acct

    def _lookup(self, uid: int) -> Account:
        try:
            pw = pwd.getpwuid(uid)
        except (KeyError, OverflowError):
            pw = None
        if pw is not None:
            return Account(uid, pw.pw_name, _group_names(pw.pw_name, pw.pw_gid))
        owner = self._owner_of(uid)
        if owner is None:
            return Account(UNKNOWN_KEY, "unknown uids", frozenset(), f"uid {uid} (no passwd entry)")
        try:
            opw = pwd.getpwnam(owner) if not owner.isdecimal() else pwd.getpwuid(int(owner))
        except (KeyError, OverflowError, ValueError):
            return Account(
                UNKNOWN_KEY, "unknown uids", frozenset(),
                f"uid {uid} (subordinate of {owner[:32]!r}, who has no passwd entry)",
            )
        return Account(
            opw.pw_uid,
            opw.pw_name,
            _group_names(opw.pw_name, opw.pw_gid),
            f"subordinate uid {uid} of {opw.pw_name}",
        )

    def _owner_of(self, uid: int) -> str | None:
        for first, last, owner in self._ranges:
            if first <= uid <= last:
                return owner
        return None

    def _refresh(self, now: float) -> None:
        if now - self._checked < _RECHECK_S and self._stamp is not None:
            return
        self._checked = now
        try:
            st = os.stat(self.subuid_path)
            stamp = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        except OSError:
            stamp = (0, 0, 0, 0)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        self._ranges = _read_ranges(self.subuid_path)
        self._cache.clear()


def _read_ranges(path: str) -> list[tuple[int, int, str]]:
    """``name:first:count`` lines of a subordinate id file; bad lines skipped (logged)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_SUBUID_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as err:
        log.warning("cannot read %s (%s): no subordinate uids are mapped", path, err)
        return []
    if len(data) > _MAX_SUBUID_BYTES:
        log.warning("%s is larger than %d bytes: read its start only", path, _MAX_SUBUID_BYTES)
    out = []
    for n, raw in enumerate(data[:_MAX_SUBUID_BYTES].splitlines(), 1):
        line = raw.decode("utf-8", "replace").strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(":")
        try:
            owner, first, count = parts[0], int(parts[1]), int(parts[2])
            if len(parts) != 3 or not owner or first < 0 or count <= 0:
                raise ValueError
        except (IndexError, ValueError):
            log.warning("%s line %d is not NAME:FIRST:COUNT: skipped", path, n)
            continue
        out.append((first, first + count - 1, owner))
    return out


def _group_names(user: str, gid: int) -> frozenset[str]:
    """The names of ``user``'s groups: ``gid`` (their primary group from passwd) and every
    group that lists them (``getgrouplist``)."""
    gids = {gid}
    with contextlib.suppress(KeyError, OSError):
        gids.update(os.getgrouplist(user, gid))
    names = set()
    for g in gids:
        try:
            names.add(grp.getgrgid(g).gr_name)
        except KeyError:
            names.add(str(g))
    return frozenset(names)
