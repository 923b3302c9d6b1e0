"""Admission: may this requester take these devices, or join the waiting line? (design decision 15)

One module answers, for every store: the shared directory
(:class:`~autogpu_jupyter.core.leasing.directory.Transaction`, under the registry lock), the
trusted broker (``autogpu_jupyter.broker``, in its event loop) and the broker's in-memory view
of its state (what its own ``pick`` ranks against). The rules, in the order they are checked:

Physical GPUs decide. A MIG device is a slice of its parent GPU, and its UUID does not say
which (``MIG-<uuid>``): the store passes the fleet's MIG layout (``parents``, MIG UUID -> parent
UUID, :func:`autogpu_jupyter.core.devices.mig_parents` of a snapshot). Two devices are *on the
same physical GPU* when they are the same device, a GPU and one of its MIG devices, or two MIG
devices of one GPU.

A **lease** on devices ``D`` for applicant ``A``:

1. *exclusive held* -- no device of ``D`` is on the same physical GPU as a device another live
   lease holds exclusively (a MIG device, its parent, its siblings: both ways);
2. *exclusive wanted* -- an exclusive lease takes only devices whose physical GPU no live lease
   uses (through the device itself, its parent or another MIG device of it);
3. *reserved groups* -- a device the admin reserved for groups (the broker's rules file) goes
   only to their members (and root); a reservation covers the physical GPU: a reserved GPU's
   MIG devices, and the parent of a reserved MIG device (:func:`reserved_away`);
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

from autogpu_jupyter.core.devices import physical_gpu
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
    "kin_phrase",
    "kin_relation",
    "line_key",
    "reservation",
    "reserved_away",
    "reserved_reply",
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
    reserved: Mapping[str, Sequence[str]],
    applicant: Applicant,
    parents: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, ...]]:
    """The devices reserved for groups ``applicant`` is not in (UUID -> those groups); root
    and members pass.

    With the fleet's MIG layout (``parents``: MIG UUID -> parent UUID), a reservation covers
    its physical GPU: a reserved GPU's MIG devices are reserved with it, and so is the parent
    of a reserved MIG device (a lease on it would take the reserved slice too); not its
    siblings. A device several reservations cover is away when any of them excludes the
    applicant, and names the groups of each.
    """
    if applicant.root:
        return {}
    away: dict[str, tuple[str, ...]] = {}
    for uuid, groups in sorted(reserved.items()):
        if applicant.groups & set(groups):
            continue
        for dev in _covered(uuid, parents or {}):
            away[dev] = tuple(dict.fromkeys([*away.get(dev, ()), *groups]))
    return dict(sorted(away.items()))


def reserved_reply(
    reserved: Mapping[str, Sequence[str]],
    applicant: Applicant,
    parents: Mapping[str, str] | None = None,
) -> dict[str, list[str]]:
    """:func:`reserved_away` as the broker sends it to a client (UUID -> group names), which
    ranks those devices out as :func:`reservation` pseudo-leases."""
    away = reserved_away(reserved, applicant, parents)
    return {uuid: list(groups) for uuid, groups in away.items()}


def _covered(uuid: str, parents: Mapping[str, str]) -> list[str]:
    """What a reservation of ``uuid`` covers: it, its MIG devices, or its parent GPU."""
    out = [uuid]
    if uuid in parents:
        out.append(parents[uuid])
    out += sorted(mig for mig, parent in parents.items() if parent == uuid)
    return out


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


def kin_relation(uuid: str, other: str, parents: Mapping[str, str]) -> str:
    """What ``other`` is to ``uuid``, two devices on the same physical GPU, in words:
    ``its parent``, ``its MIG device`` or ``its sibling MIG device``."""
    if parents.get(uuid) == other:
        return "its parent"
    if parents.get(other) == uuid:
        return "its MIG device"
    return "its sibling MIG device"


def kin_phrase(relation: str, name: str, phrase: str) -> str:
    """Why a device is out because of another device on its physical GPU, in the words both
    the admission and the ranking use: ``its parent GPU 3 is held exclusively by ...``."""
    return f"{relation} {name} is {phrase}"


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
    parents: Mapping[str, str] | None = None,
) -> None:
    """Refuse a lease on ``devices`` that the rules forbid (see the module docstring).

    Parameters
    ----------
    leases
        The live leases that count (a re-pick leaves out the one it replaces).
    parents
        The fleet's MIG layout (MIG UUID -> parent UUID); without it a MIG device is judged
        as a GPU of its own.

    Raises
    ------
    NoDeviceFitsError
        A device's physical GPU is held exclusively, or used at all when ``exclusive`` is
        wanted; or a device is reserved.
    LeaseLimitError
        Past the applicant's quota.
    """
    parents = parents or {}
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
        _check_kin(leases, u, exclusive, parents)
    away = reserved_away(reserved or {}, applicant, parents)
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


def _check_kin(
    leases: Sequence[LeaseRecord], uuid: str, exclusive: bool, parents: Mapping[str, str]
) -> None:
    """Exclusivity across the other devices of ``uuid``'s physical GPU (its parent, its MIG
    devices, its siblings): a lease held exclusively there keeps ``uuid`` off; an exclusive
    lease wanted on ``uuid`` is kept off by any lease there."""
    if not parents:
        return
    gpu = physical_gpu(uuid, parents)
    for rec in leases:
        for other in rec.device_uuids:
            if other == uuid or physical_gpu(other, parents) != gpu:
                continue
            kin = kin_relation(uuid, other, parents)
            if rec.exclusive:
                raise NoDeviceFitsError(
                    f"no device free: {uuid}: "
                    + kin_phrase(kin, other, f"held exclusively by {rec.holder_text()}")
                )
            if exclusive:
                raise NoDeviceFitsError(
                    f"no device free: exclusive wanted but {uuid}: "
                    + kin_phrase(kin, other, f"held by {rec.holder_text()}")
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
    parents: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Refuse a ticket the rules forbid; the request it is admitted with.

    Parameters
    ----------
    leases, tickets
        The live leases and tickets that count.
    constraints
        The waiter's request in the record's schema
        (:func:`autogpu_jupyter.core.decision.ticket_constraints`).
    parents
        The fleet's MIG layout: a named MIG device of a GPU reserved away is refused too.

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
    covered = reserved_away(reserved or {}, applicant, parents)
    allowed = out.get("allowed_uuids")
    if isinstance(allowed, list):
        named = [u for u in allowed if u in covered]
        if named:
            raise NoDeviceFitsError(
                f"no device free: {named[0]} is {_reserved_phrase(covered[named[0]])}"
            )
    # The reserved ids themselves: the ranking's --exclude of a GPU drops its MIG devices too.
    away = reserved_away(reserved or {}, applicant)
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
