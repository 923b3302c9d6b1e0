"""The one decision pipeline: every answer to "which GPU?" comes from here (design decision 13).

A pick, a dry run, the sidebar's recommendation (the server's ``select``), the panel's best
alternative, the move planner and the provisioner's start and restart all do the same two steps:

1. :func:`gather` -- the :class:`Context` of a decision: the snapshot, the allocation this
   process may use (``CUDA_VISIBLE_DEVICES``, Slurm, ... from ``environ``), the live leases'
   bookings (with the caller's own lease hidden: pass a :meth:`LeaseStore.hiding` view), the
   devices older waiters would take now (FIFO tickets), the sampler's smoothed utilisation and
   the caller's own pids;
2. :func:`decide` -- :func:`core.policy.rank` and :func:`core.policy.select` over that context:
   a :class:`Decision` with every candidate, the chosen device(s), the runner-up and why.

The lease store (:mod:`core.leasing`) stores records and admits or refuses leases; the scheduling
rules that read them (how a lease books memory, how waiters are served) live here, next to the
policy, worded by the same admission module (a device a waiting ticket takes says whose ticket).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import is_not
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core.leasing import admission
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.leasing.store import HeldLease, RecordView, StoreTransaction
from autogpu_jupyter.core.policy import Booking, Candidate, Constraints, rank, select
from autogpu_jupyter.core.units import Size, format_bytes
from autogpu_jupyter.core.visibility import Allocation, current_allocation
from autogpu_jupyter.errors import AutoGPUError

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot

__all__ = [
    "Context",
    "Decision",
    "bookings_for",
    "decide",
    "gather",
    "reserve_for_waiters",
    "served_waiters",
    "ticket_constraints",
]

log = logging.getLogger(__name__)

SmoothedUtil = Mapping[str, float | None]


@dataclass(frozen=True)
class Context:
    """Everything a decision depends on, gathered once (see :func:`gather`)."""

    snapshot: FleetSnapshot
    allocation: Allocation
    bookings: Mapping[str, Booking]
    smoothed_util: SmoothedUtil | None = None
    self_pids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Decision:
    """The ranked candidates for one request, and the chosen device(s) (empty: nothing fits)."""

    constraints: Constraints
    context: Context
    ranked: tuple[Candidate, ...]
    chosen: tuple[Candidate, ...]

    @property
    def best(self) -> Candidate | None:
        """The first chosen candidate (``None`` when nothing fits)."""
        return self.chosen[0] if self.chosen else None

    @property
    def runner_up(self) -> Candidate | None:
        """The best eligible candidate that was not chosen."""
        picked = {c.device.uuid for c in self.chosen}
        return next((c for c in self.ranked if c.eligible and c.device.uuid not in picked), None)

    def candidate(self, uuid: str) -> Candidate | None:
        return next((c for c in self.ranked if c.device.uuid == uuid), None)


def gather(
    snapshot: FleetSnapshot,
    *,
    environ: Mapping[str, str] | None = None,
    store: RecordView | None = None,
    txn: StoreTransaction | None = None,
    ticket: HeldLease | None = None,
    smoothed_util: SmoothedUtil | Callable[[], SmoothedUtil | None] | None = None,
    self_pids: Sequence[int] = (),
) -> Context:
    """The context of a decision on ``snapshot``.

    Parameters
    ----------
    environ
        Whose allocation bounds the choice (default ``os.environ``; a kernel passes the
        environment as it was before autogpu changed it).
    store
        Where leases and tickets are read: a lease store (a :meth:`LeaseStore.hiding` view
        leaves the caller's own lease out), or the broker's view of its own state; ``None``:
        no bookings.
    txn
        The store transaction of a pick (read under the lock); ``None``: one unlocked read.
    ticket
        The caller's own place in the waiting line: only older waiters are served before it.
    smoothed_util
        The sampler's mean utilisation per UUID, or a function giving it now.
    self_pids
        PIDs that are the caller (an EXCLUSIVE_PROCESS GPU it already uses is not "taken").
    """
    util = smoothed_util() if callable(smoothed_util) else smoothed_util
    allocation = current_allocation(snapshot.devices, environ)  # None: os.environ
    bookings: dict[str, Booking] = {}
    if store is not None:
        leases, tickets = store.live_records(txn)
        bookings = bookings_for(snapshot.devices, leases)
        bookings = reserve_for_waiters(
            snapshot.devices, bookings, tickets, ticket=ticket, smoothed_util=util
        )
    return Context(snapshot, allocation, bookings, util, tuple(self_pids))


def decide(context: Context, constraints: Constraints) -> Decision:
    """Rank every device of ``context`` for ``constraints`` and choose (the one policy)."""
    ranked = rank(
        context.snapshot.devices,
        constraints,
        allocation=context.allocation,
        bookings=context.bookings,
        smoothed_util=context.smoothed_util,
        self_pids=context.self_pids,
    )
    chosen = select(ranked, constraints.count)
    return Decision(constraints, context, tuple(ranked), tuple(chosen))


# --------------------------------------------------------------------------------------------
# What leases and waiters mean for a decision


def bookings_for(
    devices: Sequence[DeviceSnapshot], leases: Sequence[LeaseRecord]
) -> dict[str, Booking]:
    """Fold live leases into one :class:`~autogpu_jupyter.core.policy.Booking` per device.

    A lease books its requested memory on a device until NVML lists the lease's pid on that
    device with a known memory use: from then on the real use (already in the device's free
    memory) counts, not both. ``processes is None`` (unknown) keeps the booking.

    Returns
    -------
    dict
        UUID -> Booking, for every device in ``devices`` (unleased ones with zero counts).
    """
    # Each device's leases in their order, a record given n times in a row (a broker's folded
    # leases) as one run of n: read once, counted n times (issue 39: 10,000 leases per pick).
    # With each, what it books there (LeaseRecord.requested_on), read once.
    # The runs start where a record is not the one before it (found in C, not one Python step
    # per lease).
    on: dict[str, list[tuple[LeaseRecord, int, int | None]]] = {}
    starts = list(itertools.compress(itertools.count(1),
                                     map(is_not, itertools.islice(leases, 1, None), leases)))
    for start, end in zip([0, *starts], [*starts, len(leases)], strict=True):
        rec = leases[start] if end > start else None  # None: no leases at all
        if rec is not None and rec.live and rec.kind == "lease":
            uuids = rec.device_uuids
            if len(uuids) == 1:  # most leases (every one of a broker's view): one device
                asked = rec.device_requested_bytes
                on.setdefault(uuids[0], []).append((rec, end - start,
                                                    asked[0] if asked else None))
                continue
            for uuid in dict.fromkeys(uuids):
                on.setdefault(uuid, []).append((rec, end - start, rec.requested_on(uuid)))
    out: dict[str, Booking] = {}
    for dev in devices:
        count = 0
        booked = 0
        exclusive_by: list[str] = []
        holders: list[str] = []
        pids_using = {p.pid for p in (dev.processes or ()) if p.used_memory_bytes is not None}
        for rec, n, req in on.get(dev.uuid, ()):
            count += n
            if rec.exclusive:
                exclusive_by.append(admission.exclusive_phrase(rec))
            holders += [rec.holder_text()] * n
            if req and rec.pid not in pids_using:
                booked += req * n
        out[dev.uuid] = Booking(
            uuid=dev.uuid,
            lease_count=count,
            booked_bytes=booked,
            exclusive=bool(exclusive_by),
            holders=tuple(holders),
            exclusive_by=tuple(dict.fromkeys(exclusive_by)),
        )
    return out


def ticket_constraints(
    constraints: Constraints | None, allowed_uuids: Sequence[str] | None
) -> dict[str, Any]:
    """A waiter's request as its ticket stores it (read back by :func:`reserve_for_waiters`):
    the whole request, so that older waiters are served, and reserved for, as they asked.

    ``models`` and ``prefer`` are written only when set: a ticket without them has the shape
    older clients and brokers read.
    """
    mf = None if constraints is None else constraints.min_free
    out: dict[str, Any] = {
        "min_free_bytes": None if mf is None else mf.bytes,
        "min_free_fraction": None if mf is None else mf.fraction,
        "max_util_pct": None if constraints is None else constraints.max_util_pct,
        "count": 1 if constraints is None else constraints.count,
        "exclude": [] if constraints is None else list(constraints.exclude),
        "exclusive": bool(constraints is not None and constraints.exclusive),
        "allowed_uuids": None if allowed_uuids is None else list(allowed_uuids),
    }
    if constraints is not None and constraints.models:
        out["models"] = list(constraints.models)
    if constraints is not None and constraints.prefer:
        out["prefer"] = list(constraints.prefer)
    return out


def _ticket_request(c: Mapping[str, Any]) -> Constraints:
    size = None
    if c.get("min_free_bytes") is not None:
        size = Size(bytes=int(c["min_free_bytes"]))
    elif c.get("min_free_fraction") is not None:
        size = Size(fraction=float(c["min_free_fraction"]))
    return Constraints(
        min_free=size,
        max_util_pct=c.get("max_util_pct"),
        count=int(c.get("count", 1)),
        exclude=tuple(c.get("exclude", ())),
        exclusive=bool(c.get("exclusive")),
        models=tuple(c.get("models", ())),
        prefer=tuple(c.get("prefer", ())),
    )


def reserve_for_waiters(
    devices: Sequence[DeviceSnapshot],
    bookings: Mapping[str, Booking],
    tickets: Sequence[LeaseRecord],
    *,
    ticket: HeldLease | None = None,
    smoothed_util: SmoothedUtil | None = None,
) -> dict[str, Booking]:
    """Bookings with the devices that older waiters would take now reserved for them.

    Fairness rule (FIFO): live tickets (``tickets``, oldest first) are served in arrival order.
    Each ticket older than ours (all of them when ``ticket`` is ``None``: a pick that does not
    wait arrived last) is given, in turn, the device(s) its own constraints would pick from what
    is left; those are booked for it as if it held an (exclusive if it asked so) lease. We then
    rank against what remains. So a waiter takes a device only if no older live waiter could
    take it, and nobody is passed over by someone who polled first. A device so reserved says
    whose ticket holds it (:func:`admission.ticket_text`), in every drop reason it causes.
    """
    return _serve_waiters(devices, bookings, tickets, ticket, smoothed_util)[0]


def served_waiters(
    devices: Sequence[DeviceSnapshot],
    bookings: Mapping[str, Booking],
    tickets: Sequence[LeaseRecord],
    *,
    smoothed_util: SmoothedUtil | None = None,
) -> dict[str, tuple[str, ...]]:
    """The waiters (``tickets``, oldest first) that :func:`reserve_for_waiters` would serve
    now, by lease id, with the UUIDs each would be given (the broker lets a ticket that could
    be served, but is not taken, lapse)."""
    return _serve_waiters(devices, bookings, tickets, None, smoothed_util)[1]


def _serve_waiters(
    devices: Sequence[DeviceSnapshot],
    bookings: Mapping[str, Booking],
    tickets: Sequence[LeaseRecord],
    ticket: HeldLease | None,
    smoothed_util: SmoothedUtil | None,
) -> tuple[dict[str, Booking], dict[str, tuple[str, ...]]]:
    out = dict(bookings)
    served: dict[str, tuple[str, ...]] = {}
    my_id = None if ticket is None else ticket.record.lease_id
    my_seq = None if ticket is None else ticket.record.seq
    for t in tickets:
        if t.lease_id == my_id or (my_seq is not None and (t.seq or 0) >= my_seq):
            continue
        c = t.constraints or {}
        allowed = c.get("allowed_uuids")
        pool = [
            d
            for d in devices
            if allowed is None or d.uuid in allowed or (d.parent_uuid in allowed)
        ]
        try:
            cons = _ticket_request(c)
            ranked = rank(pool, cons, bookings=out, smoothed_util=smoothed_util, fleet=devices)
            chosen = select(ranked, cons.count)
        except (AutoGPUError, TypeError, ValueError) as err:  # another user's ticket never
            log.debug("ignoring ticket %s: %s", t.lease_id, err)  # breaks our pick
            continue
        if chosen:
            served[t.lease_id] = tuple(cand.device.uuid for cand in chosen)
        for cand in chosen:
            b = out.get(cand.device.uuid)
            if b is None:
                continue
            need = cons.min_free.resolve(cand.device.memory_total_bytes) if cons.min_free else 0
            waiting = admission.ticket_text(t)
            out[cand.device.uuid] = replace(
                b,
                lease_count=b.lease_count + 1,
                booked_bytes=b.booked_bytes + (need or 0),
                exclusive=b.exclusive or cons.exclusive,
                holders=(*b.holders, f"{t.user}: waiting (ticket {t.seq})"),
                exclusive_by=(*b.exclusive_by, f"reserved for {waiting}")
                if cons.exclusive
                else b.exclusive_by,
                waiting=(*b.waiting, waiting),
            )
    return out, served


def describe_load(candidate: Candidate, short: bool = False) -> str:
    """The figure a candidate was ranked by: ``load 35% (utilisation)``, or short ``35% util``.

    Load is the larger of the (smoothed) utilisation and the share of memory in use or booked.
    """
    dev = candidate.device
    util = candidate.smoothed_util_pct
    mem = None
    if candidate.effective_free_bytes is not None and dev.memory_total_bytes:
        mem = 100.0 * (1.0 - candidate.effective_free_bytes / dev.memory_total_bytes)
    if util is None and mem is None:
        return "?" if short else "load unknown"
    if mem is None or (util is not None and util >= mem):
        return f"{util:.0f}% util" if short else f"load {util:.0f}% (utilisation)"
    return f"{mem:.0f}% mem" if short else f"load {mem:.0f}% (memory in use or booked)"


def deciding_term(first: Candidate, second: Candidate | None) -> str:
    """Why ``first`` ranks before ``second``: the first term of the ranking key that differs."""
    if second is None:
        return "the only device that fits"
    a, b = first.key, second.key
    if a[0] != b[0]:
        return f"preferred model ({first.device.name} before {second.device.name})"
    if a[1] != b[1]:
        return f"lower load ({describe_load(first, True)} vs {describe_load(second, True)})"
    if a[2] != b[2]:
        return f"fewer live leases ({int(a[2])} vs {int(b[2])})"
    if a[3] != b[3]:
        return (
            f"more free memory ({format_bytes(first.effective_free_bytes)} vs "
            f"{format_bytes(second.effective_free_bytes)})"
        )
    return "equal load, leases and free memory: the lower UUID breaks the tie"
