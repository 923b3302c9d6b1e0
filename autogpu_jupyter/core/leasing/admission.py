"""Admission: may this requester take these devices, or join the waiting line? (design decision 15)

One module answers, for every store: the shared directory
(:class:`~autogpu_jupyter.core.leasing.directory.Transaction`, under the registry lock), the
trusted broker (``autogpu_jupyter.broker``, in its event loop) and the broker's in-memory view
of its state (what its own ``pick`` ranks against). The rules, in the order they are checked:

A **lease** on devices ``D`` for applicant ``A``:

1. *exclusive held* -- no device of ``D`` is held exclusively by another live lease;
2. *exclusive wanted* -- an exclusive lease takes only devices no live lease holds;
3. *reserved groups* -- a device the admin reserved for groups (the broker's rules file) goes
   only to their members (and root);
4. *quota* -- the distinct devices of ``A``'s live leases, with ``D``, stay within
   ``max_devices_per_user``; ``A``'s live leases, with this one, within ``max_leases_per_user``.

A **ticket** (a place in the waiting line, a promise of ``count`` devices) is admitted like a
lease:

1. ``A`` holds at most ``max_tickets_per_user`` live tickets (2 unless the admin says
   otherwise): one open socket or one script cannot reserve the line;
2. the devices it names (``allowed_uuids``) may not include a device reserved away from ``A``;
   devices reserved away are added to its ``exclude``, so it is never served from them;
3. the distinct devices of ``A``'s live leases, plus the devices ``A``'s live tickets wait for,
   plus this ticket's ``count``, stay within ``max_devices_per_user``.

The leases a check counts are the caller's to choose: a re-pick leaves out the lease it
replaces (its own, never another user's). A lease that serves a ticket counts only leases,
not the ticket it turns into (the ticket ends under the same lock).

Waiters are served in one order, :func:`line_key`: arrival number (``seq``), then creation time,
then id. Every message a refusal or a ranking shows is worded here, so the directory and the
broker say the same thing; a device taken by a waiting ticket says whose ticket it is
(:func:`ticket_text`), never "another lease".

Nothing here does I/O: the functions read records, raise an :class:`AutoGPUError`, or return.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autogpu_jupyter.core.leasing.records import MAX_DEVICES, LeaseRecord
from autogpu_jupyter.errors import LeaseLimitError, NoDeviceFitsError, UsageErrorBase

__all__ = [
    "DEFAULT_MAX_TICKETS",
    "EXCLUSIVE_LEASE",
    "ONE_PER_CONNECTION",
    "RESERVATION_ID",
    "Applicant",
    "Quota",
    "admit_lease",
    "admit_ticket",
    "exclusive_phrase",
    "in_line",
    "requested_count",
    "is_reservation",
    "line_key",
    "reservation",
    "reserved_away",
    "ticket_count",
    "ticket_text",
]

#: Live tickets one user may hold at once, unless the admin says otherwise.
DEFAULT_MAX_TICKETS = 2
#: Why a device held exclusively by a lease was dropped from a ranking.
EXCLUSIVE_LEASE = "held exclusively by another lease"
#: A broker connection holds one lease or one ticket.
ONE_PER_CONNECTION = "this connection already holds a lease or ticket"
#: The id of the pseudo-lease that stands for an admin's reservation in a ranking.
RESERVATION_ID = "f" * 32
_RELEASE_HINT = "Release one first (%gpu release, or end the kernel / autogpu run holding it)."


@dataclass(frozen=True, slots=True)
class Applicant:
    """Who asks: the identity admission checks (``uid`` from the kernel, never from a message).

    ``key`` is the account the quotas and the line count, where it is not the uid itself: the
    broker counts a subordinate uid (``/etc/subuid``) as its owner and every unknown uid as one
    bucket, and hands admission records whose ``uid`` is that key. Root's exemptions follow the
    uid, never the key.
    """

    uid: int
    user: str
    groups: frozenset[str] = frozenset()
    key: int | None = None

    @property
    def root(self) -> bool:
        return self.uid == 0

    @property
    def account(self) -> int:
        """What a record's ``uid`` must equal to count as this applicant's."""
        return self.uid if self.key is None else self.key


@dataclass(frozen=True, slots=True)
class Quota:
    """The admin's limits for one user (0: no limit), and how a refusal names them.

    ``source`` says whose rule it is (``" for alice"``, ``" for group students"``), ``enforcer``
    who enforces it (``" (enforced by the broker)"``).
    """

    max_devices: int = 0
    max_leases: int = 0
    max_tickets: int = DEFAULT_MAX_TICKETS
    source: str = ""
    enforcer: str = ""


# --------------------------------------------------------------------------------------------
# The waiting line


def line_key(rec: LeaseRecord) -> tuple[int, float, str]:
    """The serving order of tickets: arrival number, then creation time, then id."""
    return (rec.seq or 0, rec.created_s, rec.lease_id)


def in_line(tickets: Iterable[LeaseRecord]) -> list[LeaseRecord]:
    """``tickets`` in serving order (:func:`line_key`)."""
    return sorted(tickets, key=line_key)


def ticket_count(rec: LeaseRecord) -> int:
    """How many devices a ticket waits for (1 when its request does not say)."""
    return requested_count(rec.constraints or {})


def requested_count(constraints: Mapping[str, Any]) -> int:
    """How many devices a request in the record's schema asks for (at least 1)."""
    count = constraints.get("count")
    return max(count, 1) if isinstance(count, int) and not isinstance(count, bool) else 1


def ticket_text(rec: LeaseRecord) -> str:
    """A waiting ticket in words: ``rt3b's waiting ticket (4 GPUs, since 12:01)``."""
    n = ticket_count(rec)
    try:
        since = time.strftime("%H:%M", time.localtime(rec.created_s))
    except (OverflowError, OSError, ValueError):  # another user's record: any finite number
        since = "?"
    return f"{rec.user}'s waiting ticket ({n} GPU{'' if n == 1 else 's'}, since {since})"


# --------------------------------------------------------------------------------------------
# Reserved devices


def reserved_away(
    reserved: Mapping[str, Sequence[str]], applicant: Applicant
) -> dict[str, tuple[str, ...]]:
    """The devices reserved for groups ``applicant`` is not in (UUID -> those groups); root
    and members pass."""
    if applicant.root:
        return {}
    return {
        uuid: tuple(groups)
        for uuid, groups in sorted(reserved.items())
        if not applicant.groups & set(groups)
    }


def _reserved_phrase(groups: Sequence[str]) -> str:
    return f"reserved for group(s) {', '.join(groups)} by the admin"


def reservation(uuid: str, groups: Sequence[str], host: str) -> LeaseRecord:
    """A device reserved away from the viewer, as an exclusive pseudo-lease: the one decision
    then ranks it out, worded by :func:`exclusive_phrase`, with no rule of its own."""
    return LeaseRecord(
        lease_id=RESERVATION_ID,
        kind="lease",
        device_uuids=(uuid,),
        device_requested_bytes=(None,),
        exclusive=True,
        user=f"reserved for {','.join(groups)}"[:200],
        uid=0,
        host=host,
        pid=1,
        created_s=0.0,
        holder_kind="reserved",
        path="broker:reserved",
    )


def is_reservation(rec: LeaseRecord) -> bool:
    """Whether ``rec`` is an admin's reservation (:func:`reservation`), not a real lease."""
    return rec.lease_id == RESERVATION_ID and rec.uid == 0 and rec.holder_kind == "reserved"


def exclusive_phrase(rec: LeaseRecord) -> str:
    """Why a device ``rec`` holds exclusively is out of a ranking, in words."""
    if is_reservation(rec):
        return _reserved_phrase(rec.user.removeprefix("reserved for ").split(","))
    if rec.kind == "ticket":
        return f"reserved for {ticket_text(rec)}"
    return EXCLUSIVE_LEASE


# --------------------------------------------------------------------------------------------
# Leases


def admit_lease(
    leases: Sequence[LeaseRecord],
    *,
    applicant: Applicant,
    devices: Sequence[str],
    exclusive: bool,
    quota: Quota,
    reserved: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Refuse a lease on ``devices`` that the rules forbid (see the module docstring).

    Parameters
    ----------
    leases
        The live leases that count (a re-pick leaves out the one it replaces).

    Raises
    ------
    NoDeviceFitsError
        A device is held exclusively, held at all when ``exclusive`` is wanted, or reserved.
    LeaseLimitError
        Past the applicant's quota.
    """
    for u in devices:
        holders = [r for r in leases if u in r.device_uuids]
        if any(r.exclusive for r in holders):
            who = ", ".join(r.holder_text() for r in holders if r.exclusive)
            raise NoDeviceFitsError(f"no device free: {u} is held exclusively by {who}")
        if exclusive and holders:
            raise NoDeviceFitsError(
                f"no device free: exclusive wanted but {u} is held by "
                + ", ".join(r.holder_text() for r in holders)
            )
    away = reserved_away(reserved or {}, applicant)
    for u in devices:
        if u in away:
            raise NoDeviceFitsError(f"no device free: {u} is {_reserved_phrase(away[u])}")
    mine = [r for r in leases if r.uid == applicant.account]
    if quota.max_devices > 0:
        held = {d for r in mine for d in r.device_uuids}
        if len(held | set(devices)) > quota.max_devices:
            raise LeaseLimitError(
                f"{applicant.user} already holds leases on {len(held)} device(s) "
                f"({', '.join(sorted(held)) or 'none'}); taking {len(set(devices) - held)} more "
                f"would exceed max_devices_per_user = {quota.max_devices} set by the "
                f"admin{quota.source}{quota.enforcer}. {_RELEASE_HINT}"
            )
    if quota.max_leases > 0 and len(mine) >= quota.max_leases:
        raise LeaseLimitError(
            f"{applicant.user} already holds {len(mine)} lease(s); another would exceed "
            f"max_leases_per_user = {quota.max_leases} set by the admin{quota.source}"
            f"{quota.enforcer}. {_RELEASE_HINT}"
        )


# --------------------------------------------------------------------------------------------
# Tickets


def admit_ticket(
    leases: Sequence[LeaseRecord],
    tickets: Sequence[LeaseRecord],
    *,
    applicant: Applicant,
    constraints: Mapping[str, Any],
    quota: Quota,
    reserved: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Refuse a ticket the rules forbid; the request it is admitted with.

    Parameters
    ----------
    leases, tickets
        The live leases and tickets that count.
    constraints
        The waiter's request in the record's schema
        (:func:`autogpu_jupyter.core.decision.ticket_constraints`).

    Returns
    -------
    dict
        ``constraints``, with the devices reserved away from the applicant added to
        ``exclude``: a waiting line never serves a ticket from them.

    Raises
    ------
    LeaseLimitError
        Past the tickets per user, or past the device quota with what it waits for.
    NoDeviceFitsError
        It names a device reserved away from the applicant.
    """
    mine = [t for t in tickets if t.uid == applicant.account]
    if len(mine) >= quota.max_tickets:
        raise LeaseLimitError(
            f"{applicant.user} already waits in line with {len(mine)} ticket(s); another "
            f"would exceed max_tickets_per_user = {quota.max_tickets} set by the "
            f"admin{quota.source}{quota.enforcer}. Wait for one of them to be served, or "
            "cancel it (interrupt the waiting pick)."
        )
    out = dict(constraints)
    away = reserved_away(reserved or {}, applicant)
    allowed = out.get("allowed_uuids")
    if isinstance(allowed, list):
        named = [u for u in allowed if u in away]
        if named:
            raise NoDeviceFitsError(
                f"no device free: {named[0]} is {_reserved_phrase(away[named[0]])}"
            )
    if away:
        exclude = list(dict.fromkeys([*out.get("exclude", ()), *away]))
        if len(exclude) > MAX_DEVICES:
            raise UsageErrorBase(
                f"ticket refused: more than {MAX_DEVICES} devices to exclude (with the "
                f"{len(away)} the admin reserved for other groups)"
            )
        out["exclude"] = exclude
    if quota.max_devices > 0:
        held = {d for r in leases if r.uid == applicant.account for d in r.device_uuids}
        waiting = sum(ticket_count(t) for t in mine)
        wanted = requested_count(out)
        if len(held) + waiting + wanted > quota.max_devices:
            raise LeaseLimitError(
                f"{applicant.user} holds leases on {len(held)} device(s) and waits in line for "
                f"{waiting} more; waiting for {wanted} more would exceed max_devices_per_user "
                f"= {quota.max_devices} set by the admin{quota.source}{quota.enforcer}. "
                f"{_RELEASE_HINT}"
            )
    return out
