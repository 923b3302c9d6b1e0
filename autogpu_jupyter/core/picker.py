"""One pick, end to end: lock the lease store, read the devices and live leases, rank, lease,
unlock.

:func:`pick` never touches ``os.environ``: it returns what to set (``PickResult.env``) and the
caller applies it after its own checks (see :mod:`autogpu_jupyter.core.session`).

The decision itself is :mod:`autogpu_jupyter.core.decision`'s (the one pipeline every view uses);
the picker adds what only a real pick does: the store's lock around gather-decide-lease, the
lease, waiting in line with a ticket, and failing closed when a promise needs the store. What a
pick asks is one :class:`~autogpu_jupyter.core.options.PickOptions`, as every front end parsed
it; whether the store lets it take the devices is the store's admission's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core import decision
from autogpu_jupyter.core.backends import Backend, get_backend
from autogpu_jupyter.core.devices import mig_parents
from autogpu_jupyter.core.leasing.store import (
    HeldLease,
    LeaseStore,
    Requester,
    StoreTransaction,
)
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.policy import Candidate, Constraints, matches_id, names_device
from autogpu_jupyter.core.units import format_duration
from autogpu_jupyter.core.visibility import (
    Allocation,
    check_visible_ids,
    current_allocation,
    visible_env,
)
from autogpu_jupyter.errors import (
    LeaseStoreError,
    LeaseStoreUnreachableError,
    LeaseStoreUntrustedError,
    NoDeviceFitsError,
    NoDeviceGrantedError,
    UsageErrorBase,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot

__all__ = [
    "PickResult", "Requester", "pick", "explain_drops", "can_never_fit", "POLL_INTERVAL_S"
]

log = logging.getLogger(__name__)

#: Seconds between two tries of a waiting pick (NVML utilisation is a ~1 s average anyway).
POLL_INTERVAL_S = 1.0
#: A pick reads the devices while the store's pick lock is on its way (the broker's round trip
#: overlaps the snapshot). When the lock came more than this after the snapshot (the pick
#: waited behind others), the devices are read again: what the lock's earlier holders did to
#: them since is seen. Below it, the snapshot is as fresh as one taken after the grant (NVML's
#: own readings are that coarse, and no lock orders a process's memory use anyway).
LOCK_WAIT_RESNAPSHOT_S = 0.05


@dataclass(frozen=True)
class PickResult:
    """What a pick chose, why, and what to set."""

    chosen: tuple[DeviceSnapshot, ...]
    candidates: tuple[Candidate, ...]
    constraints: Constraints
    env: dict[str, str]
    allocation: Allocation
    snapshot: FleetSnapshot
    lease: HeldLease | None = None
    lease_note: str | None = None
    dry_run: bool = False
    waited_s: float = 0.0
    #: This process already held a lease on ``chosen`` (a kernel the autogpu kernelspec started)
    #: and kept it: nothing new was leased or set.
    kept: bool = False
    #: The device label(s) this process had before a re-pick (``"GPU 1"``), if any.
    previous: str | None = None

    @property
    def runner_up(self) -> Candidate | None:
        """The best eligible candidate that was not chosen."""
        chosen = {d.uuid for d in self.chosen}
        for c in self.candidates:
            if c.eligible and c.device.uuid not in chosen:
                return c
        return None

    def candidate(self, uuid: str) -> Candidate | None:
        for c in self.candidates:
            if c.device.uuid == uuid:
                return c
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": [d.to_dict() for d in self.chosen],
            "candidates": [c.to_dict() for c in self.candidates],
            "constraints": self.constraints.to_json(),
            "constraints_text": self.constraints.describe(),
            "env": dict(self.env),
            "allocation": self.allocation.describe(),
            "simulated": self.snapshot.simulated,
            "lease": None
            if self.lease is None
            else self.lease.record.to_dict(redact_command=False),
            "lease_note": self.lease_note,
            "dry_run": self.dry_run,
            "kept": self.kept,
        }


def explain_drops(candidates: tuple[Candidate, ...] | list[Candidate]) -> str:
    """One line per device: why it was dropped (or that it fits)."""
    lines = []
    for c in candidates:
        status = "fits" if c.eligible else "dropped"
        lines.append(
            f"  {c.device.label} ({c.device.name}): {status}: {'; '.join(c.reasons) or 'ok'}"
        )
    return "\n".join(lines)


def _known(devices: tuple[DeviceSnapshot, ...]) -> str:
    return ", ".join(
        d.label.replace("GPU ", "") if not d.is_mig else f"{d.index}:{d.mig_index}"
        for d in devices
    )


def _check_ids(devices: tuple[DeviceSnapshot, ...], constraints: Constraints) -> None:
    for ident in constraints.exclude:
        if not ident.strip():
            raise UsageErrorBase(
                "invalid --exclude: empty device id; expected NVML indices or UUIDs, "
                "e.g. 0,2 or GPU-5a1"
            )
        if not any(matches_id(d, ident) for d in devices):
            raise UsageErrorBase(
                f"unknown device id {ident!r} in --exclude; expected an NVML index "
                f"({_known(devices)}) or a UUID"
            )
    for ident in constraints.devices:
        if not any(matches_id(d, ident) for d in devices):
            example = devices[0].short_uuid if devices else "GPU-5a1b"
            raise UsageErrorBase(
                f"no device {ident!r} on this host; name devices by index ({_known(devices)}) "
                f"or by UUID or its first 6 or more characters (e.g. {example})"
            )
    if constraints.count < 1:
        raise UsageErrorBase(f"invalid count {constraints.count!r}: expected a whole number >= 1")


def can_never_fit(candidates: Sequence[Candidate], count: int) -> bool:
    """Whether the request's own restrictions rule out so many devices that no wait could
    give it ``count`` (see :attr:`Candidate.fixed`)."""
    return sum(1 for c in candidates if c.eligible or not c.fixed) < count


def _named_message(
    candidates: Sequence[Candidate], constraints: Constraints, waited_s: float
) -> str:
    """Nothing fits among the devices the user named: one line naming each and why."""
    devices = [c.device for c in candidates]
    named = [
        c for c in candidates
        if any(names_device(c.device, i, devices) for i in constraints.devices)
    ]
    fit = [c for c in named if c.eligible]
    # a GPU in MIG mode named for its MIG devices: its own "use a MIG device" is no news
    dropped = [
        c for c in named
        if not c.eligible and not (len(named) > 1 and c.device.mig_enabled and not c.device.is_mig)
    ] or [c for c in named if not c.eligible]
    labels = ", ".join(c.device.label for c in named)
    if fit:
        head = f"only {len(fit)} of {labels} fit(s), {constraints.count} wanted"
    else:
        head = f"{labels} {'does' if len(named) == 1 else 'do'} not fit"
    head += f" ({constraints.describe()})"
    if waited_s > 0:
        head += f" after waiting {format_duration(waited_s)}"
    why = "; ".join(
        (f"{c.device.label}: " if len(named) > 1 else "") + "; ".join(c.reasons)
        for c in dropped
    )
    return f"{head}: {why}"


def _no_fit_message(
    result_candidates: list[Candidate],
    constraints: Constraints,
    waited_s: float,
) -> str:
    if constraints.devices:
        return _named_message(result_candidates, constraints, waited_s)
    eligible = sum(1 for c in result_candidates if c.eligible)
    head = (
        f"no device fits ({constraints.describe()})"
        if eligible == 0
        else f"only {eligible} device(s) fit, {constraints.count} wanted ({constraints.describe()})"
    )
    if waited_s > 0:
        head += f" after waiting {format_duration(waited_s)}"
    return f"{head}:\n{explain_drops(result_candidates)}"


def _create_lease(
    txn: StoreTransaction,
    chosen: list[Candidate],
    constraints: Constraints,
    requester: Requester,
    parents: Mapping[str, str],
) -> tuple[HeldLease | None, str | None]:
    """Write the lease; a store that refuses the write means no lease, said once (a note). A
    broker that answers it cannot record the lease (:class:`LeaseStoreUntrustedError`: its disk is
    full) fails the pick closed: a lease it did not grant is no lease to go on without.
    ``parents``: the host's MIG layout, for the admission's physical-GPU rules."""
    try:
        lease = txn.create(
            devices=[c.device for c in chosen],
            requested_bytes=[
                constraints.min_free.resolve(c.device.memory_total_bytes)
                if constraints.min_free is not None
                else None
                for c in chosen
            ],
            exclusive=constraints.exclusive,
            requester=requester,
            parents=parents,
        )
    except LeaseStoreUntrustedError as err:
        if not isinstance(err, LeaseStoreUnreachableError):
            raise LeaseStoreUntrustedError(
                f"{err}. Nothing was picked and the environment is unchanged"
            ) from None
        log.info("no lease: %s", err)
        return None, str(err)
    except LeaseStoreError as err:
        log.info("no lease: %s", err)
        return None, str(err)
    return lease, None


def _promises(options: PickOptions, store: LeaseStore | None) -> str | None:
    """What this pick promised that only a working lease store can keep (``None``: nothing).

    An exclusive pick, a wait in line (FIFO tickets) and the admin's per-user quota all live in
    the store: without it they would silently not hold, so such a pick fails closed.
    """
    if store is None:
        return None
    if options.constraints.exclusive:
        return "an exclusive pick (--exclusive)"
    if options.wait_s > 0:
        return "a pick that waits in line (--wait)"
    if store.max_devices_per_user > 0:
        return "a pick under the admin's max_devices_per_user quota"
    return None


def _fail_closed(what: str, cause: str | None) -> LeaseStoreUntrustedError:
    return LeaseStoreUntrustedError(
        f"refused {what} without a lease: {cause or 'the lease registry cannot be used'}. "
        "Nothing was picked and the environment is unchanged; a plain pick (without --exclusive "
        "or --wait) still works, without a lease"
    )


@contextlib.contextmanager
def _no_store() -> Iterator[None]:
    yield None


def pick(
    options: PickOptions,
    *,
    backend: Backend | None = None,
    environ: Mapping[str, str] | None = None,
    store: LeaseStore | None = None,
    requester: Requester | None = None,
    dry_run: bool = False,
    on_progress: Callable[[str], None] | None = None,
    smoothed_util: (
        Mapping[str, float | None] | Callable[[], Mapping[str, float | None] | None] | None
    ) = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    visible_ids: str = "uuid",
) -> PickResult:
    """Choose device(s) for ``options`` and, unless ``dry_run``, take a lease on them.

    Parameters
    ----------
    options
        The validated request (:func:`autogpu_jupyter.core.options.parse`): its constraints,
        and how long to wait in line for a device to fit (0: fail at once; interrupt cancels).
    backend
        Where snapshots come from (default: :func:`get_backend`).
    environ
        The environment whose allocation bounds the choice (default ``os.environ``); it is read,
        never written.
    store
        The lease store (:func:`autogpu_jupyter.core.leasing.store_for`); ``None`` picks
        without leases.
    requester
        Who the lease is for (default: this process).
    dry_run
        Rank only: no lease, nothing to apply.
    on_progress
        Called with a one-line status while waiting.
    smoothed_util
        The sampler's mean utilisation per UUID, when a sampler runs; or a function returning
        it, called at each try, so that a waiting pick ranks on the load of now, not of the
        moment it started waiting.
    sleep, clock
        How a waiting pick sleeps between tries and reads the time (``time.sleep`` and
        ``time.monotonic``; tests pass their own).
    visible_ids
        How ``env`` names the devices: ``"uuid"`` or ``"index"`` (``c.AutoGPU.visible_ids``,
        :func:`~autogpu_jupyter.core.visibility.visible_env`); a choice ``"index"`` cannot name
        (a MIG device) is refused before any lease is taken.

    Returns
    -------
    PickResult

    Raises
    ------
    NoDeviceGrantedError
        The inherited allocation grants no GPU.
    NoDeviceFitsError
        Nothing fits (after waiting ``options.wait_s``), or admission refused a device.
    LeaseLimitError
        Past the admin's quota of devices, leases or tickets.
    LeaseStoreUntrustedError
        A promise (exclusivity, a wait, a quota) needs the store and it cannot be used. A
        broker lost while this pick waits in line (:class:`LeaseStoreUnreachableError`: it may be
        restarting) is tried again, the place kept, until the wait ends.
    UsageErrorBase
        An unknown device id in ``exclude``, a bad count.
    NVMLUnavailableError
        No NVIDIA driver.
    """
    if backend is None:
        backend = get_backend()
    visible_ids = check_visible_ids(visible_ids)
    requester = requester or Requester()
    constraints, wait_s = options.constraints, options.wait_s
    start = clock()
    deadline = start + max(wait_s, 0.0)
    ticket = None
    promised = None if dry_run else _promises(options, store)
    if store is not None and not dry_run:
        # Pay NVML's one-time start-up (library load, init, first handles) before taking the
        # registry lock, so that other pickers do not queue behind it.
        warm_up = getattr(backend, "warm_up", None)
        if warm_up is not None:
            warm_up()
    waited = False  # in line: a ticket taken and slept on at least once
    try:
        while True:
            try:
                made, lease, lease_note = _attempt(
                    constraints,
                    backend,
                    environ,
                    store,
                    requester,
                    ticket,
                    dry_run,
                    promised,
                    smoothed_util,
                    visible_ids,
                )
            except LeaseStoreUnreachableError as err:
                _keep_place(err, ticket is not None, deadline, clock, sleep, on_progress)
                continue
            if made.chosen:  # our ticket, if any, was released under the lock (again: a no-op)
                waited_s = clock() - start if waited else 0.0
                return _result(made, lease, lease_note, store, dry_run, waited_s, visible_ids)
            now = clock()
            hopeless = can_never_fit(made.ranked, constraints.count)
            if now >= deadline or hopeless:  # no wait helps what the request itself rules out
                raise NoDeviceFitsError(
                    _no_fit_message(
                        list(made.ranked),
                        constraints,
                        now - start if wait_s > 0 else 0.0,
                    ),
                    candidates=made.ranked,
                    waitable=not hopeless,
                )
            if store is not None and ticket is None:
                ticket = store.take_ticket(
                    constraints=decision.ticket_constraints(
                        constraints, _ticket_pool(made, constraints)
                    ),
                    exclusive=constraints.exclusive,
                    requester=requester,
                )
            if on_progress is not None:
                on_progress(_waiting_line(made, now - start, wait_s))
            sleep(min(POLL_INTERVAL_S, max(deadline - now, 0.0)))
            waited = True
    finally:
        if ticket is not None:
            ticket.release()


def _keep_place(
    err: LeaseStoreUnreachableError,
    in_line: bool,
    deadline: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    on_progress: Callable[[str], None] | None,
) -> None:
    """A try lost its broker (it may be restarting). In line, the restarted broker takes our
    ticket back (we keep its socket open): keep the place, say so, and sleep until the next try.
    Otherwise, or once the wait is over, ``err`` is raised (nothing was picked)."""
    now = clock()
    if not in_line or now >= deadline:
        raise err
    if on_progress is not None:
        on_progress(f"{err} (still in line: trying again for {format_duration(deadline - now)})")
    sleep(min(POLL_INTERVAL_S, deadline - now))


def _attempt(
    constraints: Constraints,
    backend: Backend,
    env: Mapping[str, str] | None,
    store: LeaseStore | None,
    requester: Requester,
    ticket: HeldLease | None,
    dry_run: bool,
    promised: str | None,
    smoothed_util: Any,
    visible_ids: str = "uuid",
) -> tuple[decision.Decision, HeldLease | None, str | None]:
    """One try, under the store's lock (a real pick): read, decide, and lease what was chosen.

    When something was chosen, ``ticket`` is released under the same lock (nobody sees both
    our ticket and our lease).
    """
    lock_cm: contextlib.AbstractContextManager[StoreTransaction | None] = _no_store()
    if store is not None and not dry_run:
        lock_cm = store.locked()
    lease_note: str | None = None
    with lock_cm as txn:
        if txn is None and promised is not None:
            assert store is not None  # promised implies a store (see _promises)
            raise _fail_closed(promised, store.unusable_reason)
        snap = backend.snapshot()  # while a broker's pick lock is on its way (txn.ready)
        if txn is not None and txn.ready() > LOCK_WAIT_RESNAPSHOT_S:
            snap = backend.snapshot()  # waited in line for the lock: the devices of now
        _check_granted(snap, env)
        _check_ids(snap.devices, constraints)
        # FIFO reservations included, in a dry run too: it answers what a pick would do.
        context = decision.gather(
            snap,
            environ=env,
            store=store,
            txn=txn,
            ticket=ticket,
            smoothed_util=smoothed_util,
            self_pids=(requester.pid,),
        )
        made = decision.decide(context, constraints)
        lease = None
        if made.chosen and not dry_run:
            # what cannot be written (a MIG device as an index) is refused before any lease
            visible_env([c.device.uuid for c in made.chosen], snap.devices, visible_ids)
        if made.chosen and not dry_run and txn is not None:
            lease, lease_note = _create_lease(
                txn, list(made.chosen), constraints, requester, mig_parents(snap.devices)
            )
            if lease is None and promised is not None:
                raise _fail_closed(promised, lease_note)
        if made.chosen and ticket is not None:
            ticket.release()
    return made, lease, lease_note


def _ticket_pool(made: decision.Decision, constraints: Constraints) -> list[str] | None:
    """The devices a waiting ticket may be served from: the allocation's, and of those only
    the named ones (a ticket stores them as UUIDs, as other pickers read them)."""
    allowed = made.context.allocation.uuids
    if not constraints.devices:
        return None if allowed is None else list(allowed)
    devices = made.context.snapshot.devices
    return [
        d.uuid
        for d in devices
        if any(names_device(d, i, devices) for i in constraints.devices)
        and (allowed is None or d.uuid in allowed or d.parent_uuid in allowed)
    ]


def _check_granted(snap: FleetSnapshot, env: Mapping[str, str] | None) -> None:
    """Raise :class:`NoDeviceGrantedError` when there is no GPU, or none granted to us."""
    if not snap.devices:
        why = "; ".join(snap.errors)
        raise NoDeviceGrantedError(
            f"no GPU on this host: {snap.backend} lists no devices" + (f" ({why})" if why else "")
        )
    allocation = current_allocation(snap.devices, env)
    if allocation.empty:
        raise NoDeviceGrantedError(f"no GPU granted to this process: {allocation.describe()}")


def _result(
    made: decision.Decision,
    lease: HeldLease | None,
    lease_note: str | None,
    store: LeaseStore | None,
    dry_run: bool,
    waited_s: float,
    visible_ids: str = "uuid",
) -> PickResult:
    if store is not None and not dry_run and store.unusable_reason:
        lease_note = store.unusable_reason
    chosen = [c.device for c in made.chosen]
    return PickResult(
        chosen=tuple(chosen),
        candidates=made.ranked,
        constraints=made.constraints,
        env={}
        if dry_run
        else visible_env([d.uuid for d in chosen], made.context.snapshot.devices, visible_ids),
        allocation=made.context.allocation,
        snapshot=made.context.snapshot,
        lease=lease,
        lease_note=f"{lease_note}: picked without a lease" if lease_note else None,
        dry_run=dry_run,
        waited_s=waited_s,
    )


def _waiting_line(made: decision.Decision, waited_s: float, wait_s: float) -> str:
    best = made.ranked[0]  # never empty: a host without devices was refused before
    why = f"{best.device.label}: {'; '.join(best.reasons)}"
    return (
        f"waiting for a device ({made.constraints.describe()}), "
        f"{format_duration(waited_s)} of {format_duration(wait_s)}; best now {why}"
    )
