"""Ranking devices: a pure function from snapshots and constraints to ranked candidates.

Hard filters (a device failing one is dropped, with the reason in words):

* it is available (not lost, readable);
* it is inside the allocation this process already has (CUDA_VISIBLE_DEVICES, Slurm, ...);
* it is not excluded by the user;
* its compute mode is not PROHIBITED, and not EXCLUSIVE_PROCESS while a process already uses it;
* a GPU in MIG mode is used through its MIG devices, not directly;
* its effective free memory (free memory minus memory booked by live leases) fits ``min_free``;
* its utilisation is at most ``max_util``;
* for ``exclusive``: no other live lease holds it; and nobody holds it exclusively;
* physical GPUs decide: the same two rules across a MIG device, its parent GPU and its sibling
  MIG devices (a lease held exclusively on one keeps the others out; an exclusive pick wants
  the whole physical GPU free), worded as the admission words its refusals
  (:mod:`autogpu_jupyter.core.leasing.admission`).

A value that is unknown (``None``, e.g. utilisation on MIG devices) neither passes nor fails a
filter silently: a ``max_util`` filter keeps such a device and says "utilisation unknown", a
``min_free`` filter drops a device whose free memory is unknown and says so.

Ranking key of the eligible devices, best first (deterministic; never "index 0 first"):

1. lowest load, in steps of 5 %: load = the larger of the smoothed utilisation (the sampler's
   mean over its window when available, else the instantaneous reading) and the share of memory
   in use or booked (1 - effective free / total). A device is as loaded as its busiest resource:
   an idle GPU with full memory is not free, nor is a GPU with empty memory at 100 % utilisation.
   Where one of the two is unknown (utilisation on MIG devices) the other alone decides, and the
   reasons say so;
2. fewest live leases (so that simultaneous pickers spread out, also when they book nothing);
3. most effective free memory, in steps of 1 GiB (headroom for the job to grow);
4. UUID, ascending (ties are broken by identity, not by index).

The 5 % and 1 GiB steps keep a few MiB or percent of noise from deciding between two devices
that are, for practical purposes, equally loaded.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autogpu_jupyter.core.devices import mig_parents, physical_gpu
from autogpu_jupyter.core.leasing.admission import EXCLUSIVE_LEASE, kin_phrase, kin_relation
from autogpu_jupyter.core.units import Size, format_bytes, parse_percent, parse_size
from autogpu_jupyter.errors import UsageErrorBase

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot
    from autogpu_jupyter.core.visibility import Allocation

__all__ = [
    "DEVICE_IDS_FORMS",
    "Booking",
    "Candidate",
    "Constraints",
    "matches_id",
    "names_device",
    "rank",
    "select",
]

_GIB = 1024**3
_UTIL_STEP = 5.0
#: An NVML index, ``"3"``, or a MIG device of one, ``"3:1"`` (ASCII digits, as nvidia-smi prints).
_INDEX_ID = re.compile(r"([0-9]+)(?::([0-9]+))?")


@dataclass(frozen=True, slots=True)
class Constraints:
    """What a pick asks for. Build it from user input with ``units.parse_*`` first."""

    min_free: Size | None = None
    max_util_pct: float | None = None
    count: int = 1
    exclude: tuple[str, ...] = ()
    exclusive: bool = False
    #: Only devices whose model name contains one of these (case-insensitive); () = any.
    models: tuple[str, ...] = ()
    #: Models preferred, in this order, before load (others after them).
    prefer: tuple[str, ...] = ()
    #: Only these devices (ids as the user named them: ``2``, ``3:1``, ``GPU-5a1b``); () = any.
    #: A GPU in MIG mode named stands for its MIG devices.
    devices: tuple[str, ...] = ()

    @classmethod
    def parse(
        cls,
        *,
        min_free: object = None,
        max_util: object = None,
        count: object = 1,
        exclude: object = None,
        exclusive: bool = False,
        models: Sequence[str] = (),
        prefer: Sequence[str] = (),
        devices: object = None,
    ) -> Constraints:
        """Build constraints from user input (strings or numbers), validating each value.

        Raises
        ------
        UsageErrorBase
            Naming the bad value and the accepted forms.
        """
        size = None if min_free in (None, "") else parse_size(min_free)
        util = None if max_util in (None, "") else parse_percent(max_util, "--max-util")
        try:
            # True/False never parse either: str() gives "True"/"False".
            n = int(str(count).strip())
        except ValueError:
            n = 0
        # A float never parses: str() of it has a ".", "e", "inf" or "nan" (2.0 is refused too).
        if n < 1:
            raise UsageErrorBase(f"invalid --count {count!r}: expected a whole number >= 1, e.g. 2")
        ids = _id_list(exclude, "--exclude", "NVML indices or UUIDs separated by commas, e.g. 0,2 "
                       "or GPU-5a1b")
        named = _id_list(devices, "--devices", DEVICE_IDS_FORMS)
        return cls(
            min_free=size,
            max_util_pct=util,
            count=n,
            exclude=ids,
            exclusive=bool(exclusive),
            models=tuple(models),
            prefer=tuple(prefer),
            devices=named,
        )

    def describe(self) -> str:
        """The parsed constraints in words, e.g. ``min free 10.0 GiB, max util 50%``."""
        parts = []
        if self.devices:
            word = "device" if len(self.devices) == 1 else "devices"
            some = f"{self.count} of " if self.count < len(self.devices) else ""
            parts.append(f"{some}{word} {','.join(self.devices)}")
        if self.min_free is not None:
            parts.append(f"min free {self.min_free.describe()}")
        if self.max_util_pct is not None:
            parts.append(f"max util {self.max_util_pct:g}%")
        if self.count != 1 and self.count != len(self.devices):
            parts.append(f"{self.count} devices")
        if self.exclude:
            parts.append(f"excluding {', '.join(self.exclude)}")
        if self.exclusive:
            parts.append("exclusive")
        if self.models:
            parts.append(f"model {' or '.join(self.models)}")
        if self.prefer:
            parts.append(f"preferring {', then '.join(self.prefer)}")
        return ", ".join(parts) if parts else "no constraints"

    def to_json(self) -> dict[str, object]:
        return {
            "min_free": None if self.min_free is None else self.min_free.to_json(),
            "max_util_pct": self.max_util_pct,
            "count": self.count,
            "exclude": list(self.exclude),
            "exclusive": self.exclusive,
            "models": list(self.models),
            "prefer": list(self.prefer),
            "devices": list(self.devices),
        }


#: How devices may be named (``%gpu pick 2``, ``--devices``, ``devices`` in JSON).
DEVICE_IDS_FORMS = (
    "device indices, UUIDs (or their first 6 or more characters) or MIG ids such as 3:1, "
    "separated by commas, e.g. 2 or 0,3 or GPU-5a1b"
)


def _id_list(value: object, flag: str, forms: str) -> tuple[str, ...]:
    """Device ids as the user gave them (``"0,2"`` or a list); an empty id is refused."""
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)  # JSON's {"devices": 2}
    parts = value.split(",") if isinstance(value, str) else [str(x) for x in value]  # type: ignore[attr-defined]
    ids = tuple(p.strip() for p in parts)
    if not ids or any(not p for p in ids):
        raise UsageErrorBase(f"invalid {flag} {value!r}: empty device id; expected {forms}")
    return ids


@dataclass(frozen=True, slots=True)
class Booking:
    """What live leases say about one device."""

    uuid: str
    lease_count: int = 0
    booked_bytes: int = 0
    exclusive: bool = False
    holders: tuple[str, ...] = ()
    #: Why it is exclusive, one phrase per cause (``held exclusively by another lease``,
    #: ``reserved for rt3b's waiting ticket (4 GPUs, since 12:01)``, an admin's reservation);
    #: empty with ``exclusive`` set means a lease.
    exclusive_by: tuple[str, ...] = ()
    #: The waiting tickets counted in ``lease_count``, in words (``rt3b's waiting ticket ...``).
    waiting: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Candidate:
    """One device as the policy sees it, with the reasons it was kept or dropped."""

    device: DeviceSnapshot
    eligible: bool
    reasons: tuple[str, ...]
    effective_free_bytes: int | None
    smoothed_util_pct: float | None
    lease_count: int = 0
    booked_bytes: int = 0
    #: The ranking key: (model preference, load step, live leases, -free GiB, UUID).
    key: tuple[float, float, float, float, str] = field(
        default=(0.0, 0.0, 0.0, 0.0, ""), compare=False
    )
    #: Dropped for a reason no wait changes (the request's own restrictions: not named,
    #: excluded, another model, outside the allocation, a MIG parent): waiting in line for it
    #: cannot help.
    fixed: bool = field(default=False, compare=False)

    def to_dict(self) -> dict[str, object]:
        return {
            "uuid": self.device.uuid,
            "label": self.device.label,
            "name": self.device.name,
            "index": self.device.index,
            "eligible": self.eligible,
            "reasons": list(self.reasons),
            "effective_free_bytes": self.effective_free_bytes,
            "smoothed_util_pct": self.smoothed_util_pct,
            "lease_count": self.lease_count,
            "booked_bytes": self.booked_bytes,
        }


def matches_id(device: DeviceSnapshot, ident: str) -> bool:
    """Whether a user-given id names ``device``: NVML index ``"3"``, ``"3:1"`` for MIG 1 of GPU 3,
    a label (``GPU 3``), or a full UUID / unique-looking UUID prefix (``GPU-5a1``), the
    runtime's id on AMD (``GPU-4d0a3d00``) included."""
    ident = ident.strip()
    if not ident:
        return False
    index = _INDEX_ID.fullmatch(ident)
    if index is not None:
        gpu, mig = index.groups()
        if mig is None:
            return not device.is_mig and device.index == int(gpu)
        return device.is_mig and device.index == int(gpu) and device.mig_index == int(mig)
    if ident.upper() == device.label.upper():
        return True
    # the id the runtime is given (ROCr's GPU-<hex> on AMD) names it too: the short id shown
    # is a prefix of it
    return any(
        uid == ident or (len(ident) >= 6 and uid.startswith(ident))
        for uid in (device.uuid, device.runtime_uuid)
        if uid
    )


def rank(
    devices: Sequence[DeviceSnapshot],
    constraints: Constraints,
    *,
    allocation: Allocation | None = None,
    bookings: Mapping[str, Booking] | None = None,
    smoothed_util: Mapping[str, float | None] | None = None,
    self_pids: Iterable[int] = (),
    fleet: Sequence[DeviceSnapshot] | None = None,
) -> list[Candidate]:
    """Rank ``devices`` for ``constraints``: eligible candidates first, best first.

    Parameters
    ----------
    devices
        Snapshots (MIG devices are their own entries).
    constraints
        The parsed request.
    allocation
        What this process may use; ``None`` = every device.
    bookings
        Live leases per device UUID (see :func:`autogpu_jupyter.core.decision.bookings_for`).
    smoothed_util
        Mean utilisation per UUID over the sampler's window; falls back to the snapshot's reading.
    self_pids
        PIDs that are "us" (an EXCLUSIVE_PROCESS GPU we already use is not "occupied by others").
    fleet
        Every device of the host, when ``devices`` is a part of it: the other devices of a
        physical GPU (a MIG device's parent and siblings) are looked up there.

    Returns
    -------
    list of Candidate
        Every device, eligible ones first in ranking order, then the dropped ones by index.
    """
    bookings = bookings or {}
    smoothed_util = smoothed_util or {}
    mine = set(self_pids)
    kin = _Kin(devices if fleet is None else fleet, bookings)
    migs_by_parent: dict[str, int] = {}
    for d in devices:
        if d.parent_uuid:  # only a MIG device has a parent
            migs_by_parent[d.parent_uuid] = migs_by_parent.get(d.parent_uuid, 0) + 1

    out: list[Candidate] = []
    for dev in devices:
        booking = bookings.get(dev.uuid, Booking(dev.uuid))
        # A MIG device's parent bookings do not apply to it, and vice versa: separate memory.
        util = smoothed_util.get(dev.uuid, dev.utilization_pct)
        eff_free: int | None = None
        if dev.memory_free_bytes is not None:
            eff_free = max(dev.memory_free_bytes - booking.booked_bytes, 0)
        v = _Verdict()
        _check_usable(v, dev, devices, constraints, allocation)
        _check_compute_mode(v, dev, mine)
        _check_mig_and_model(v, dev, constraints, migs_by_parent)
        if dev.available:
            _check_memory(v, dev, constraints, eff_free, booking)
            _check_utilisation(v, util, constraints)
            _check_leases(v, constraints, booking)
            kin.check(v, dev, constraints, booking)
        key = (
            float(_preference(dev, constraints.prefer)),
            float(_load_step(util, eff_free, dev.memory_total_bytes)),
            float(booking.lease_count),
            -float(math.floor((eff_free if eff_free is not None else -_GIB) / _GIB)),
            dev.uuid,
        )
        out.append(
            Candidate(
                device=dev,
                eligible=v.ok,
                reasons=tuple(v.reasons),
                effective_free_bytes=eff_free,
                smoothed_util_pct=util,
                lease_count=booking.lease_count,
                booked_bytes=booking.booked_bytes,
                key=key,
                fixed=v.fixed,
            )
        )
    eligible = sorted((c for c in out if c.eligible), key=lambda c: c.key)
    dropped = sorted(
        (c for c in out if not c.eligible),
        key=lambda c: (
            c.device.index,
            c.device.mig_index if c.device.mig_index is not None else -1,
        ),
    )
    return eligible + dropped


@dataclass
class _Verdict:
    """What the filters say of one device: kept or dropped, and why (in the order checked)."""

    ok: bool = True
    reasons: list[str] = field(default_factory=list)
    #: dropped for a reason that no wait changes (see :attr:`Candidate.fixed`)
    fixed: bool = False

    def drop(self, why: str, fixed: bool = False) -> None:
        self.ok = False
        self.fixed = self.fixed or fixed
        self.reasons.append(why)

    def note(self, why: str) -> None:
        self.reasons.append(why)


def _check_usable(
    v: _Verdict,
    dev: DeviceSnapshot,
    devices: Sequence[DeviceSnapshot],
    constraints: Constraints,
    allocation: Allocation | None,
) -> None:
    """Available, inside the allocation, named (when devices were), not excluded by the user."""
    if not dev.available:
        v.drop(f"unavailable: {dev.error or 'unknown error'}")
    if allocation is not None and not allocation.allows(dev):
        v.drop(f"outside this process's allocation ({allocation.describe()})", fixed=True)
    if constraints.devices and not any(
        names_device(dev, ident, devices) for ident in constraints.devices
    ):
        v.drop(f"not named (only {','.join(constraints.devices)} asked for)", fixed=True)
    hit = next((ident for ident in constraints.exclude if names_device(dev, ident, devices)), None)
    if hit is not None:
        v.drop(f"excluded by --exclude {hit}", fixed=True)


def names_device(dev: DeviceSnapshot, ident: str, devices: Sequence[DeviceSnapshot]) -> bool:
    """Whether ``ident`` names ``dev``, or the GPU a MIG device ``dev`` is part of."""
    return matches_id(dev, ident) or bool(dev.parent_uuid and _parent_excluded(dev, ident, devices))


def _check_compute_mode(v: _Verdict, dev: DeviceSnapshot, mine: set[int]) -> None:
    """Not PROHIBITED; not EXCLUSIVE_PROCESS/THREAD while another process uses it."""
    if dev.compute_mode == "PROHIBITED":
        v.drop("compute mode PROHIBITED: no CUDA context allowed", fixed=True)
    elif dev.compute_mode in ("EXCLUSIVE_PROCESS", "EXCLUSIVE_THREAD"):
        others = [p for p in (dev.processes or ()) if p.pid not in mine]
        if others:
            v.drop(f"compute mode {dev.compute_mode} and already used by {len(others)} process(es)")


def _check_mig_and_model(
    v: _Verdict, dev: DeviceSnapshot, constraints: Constraints, migs_by_parent: Mapping[str, int]
) -> None:
    """A GPU in MIG mode is used through its MIG devices; one MIG device per process; the
    model asked for."""
    if not dev.is_mig and migs_by_parent.get(dev.uuid):
        v.drop(
            f"MIG mode is on: use one of its {migs_by_parent[dev.uuid]} MIG devices instead",
            fixed=True,
        )
    elif not dev.is_mig and dev.mig_enabled:
        v.drop("MIG mode is on but it has no MIG devices", fixed=True)
    if dev.is_mig and constraints.count > 1:
        v.drop(
            f"a process can use only one MIG device; {constraints.count} devices were asked for",
            fixed=True,
        )
    if constraints.models and not _model_matches(dev, constraints.models):
        v.drop(f"model {dev.name} is not {' or '.join(constraints.models)}", fixed=True)


def _check_memory(
    v: _Verdict,
    dev: DeviceSnapshot,
    constraints: Constraints,
    eff_free: int | None,
    booking: Booking,
) -> None:
    """Effective free memory (free minus booked by leases) fits ``min_free``."""
    if constraints.min_free is None:
        if eff_free is None:
            v.note("free memory unknown: ranked last on memory")
        return
    need = constraints.min_free.resolve(dev.memory_total_bytes)
    if eff_free is None or need is None:
        v.drop(f"free memory unknown: cannot check min free {constraints.min_free.describe()}")
    elif eff_free < need:
        after = (
            f" after {format_bytes(booking.booked_bytes)} booked by leases"
            if booking.booked_bytes
            else ""
        )
        v.drop(f"only {format_bytes(eff_free)} free{after} < {format_bytes(need)} wanted")
    else:
        v.note(f"{format_bytes(eff_free)} free >= {format_bytes(need)} wanted")


def _check_utilisation(v: _Verdict, util: float | None, constraints: Constraints) -> None:
    """Utilisation at most ``max_util``; unknown neither passes nor fails silently."""
    if constraints.max_util_pct is not None:
        if util is None:
            v.note("utilisation unknown (not supported here): not filtered on it")
        elif util > constraints.max_util_pct:
            v.drop(f"utilisation {util:.0f}% > max {constraints.max_util_pct:g}%")
    elif util is None:
        v.note("utilisation unknown: ranked by memory and leases")


def _check_leases(v: _Verdict, constraints: Constraints, booking: Booking) -> None:
    """Exclusive wants no other lease; nobody else holds it exclusively. A waiting ticket that
    takes the device is named, never counted as "another lease"."""
    if constraints.exclusive and booking.lease_count:
        leases = booking.lease_count - len(booking.waiting)
        held = [f"{leases} lease(s) hold it"] if leases > 0 else []
        v.drop("exclusive wanted but " + "; ".join([*held, *(
            f"it is reserved for {w}" for w in booking.waiting
        )]))
    elif booking.exclusive:
        v.drop("; ".join(booking.exclusive_by) or EXCLUSIVE_LEASE)
    if booking.lease_count and v.ok:
        v.note(f"{booking.lease_count} live lease(s)")


class _Kin:
    """The other devices on each device's physical GPU, and what their bookings forbid."""

    def __init__(self, fleet: Sequence[DeviceSnapshot], bookings: Mapping[str, Booking]) -> None:
        self.parents = mig_parents(fleet)
        self.bookings = bookings
        self.by_gpu: dict[str, list[DeviceSnapshot]] = {}
        if self.parents:
            for d in fleet:
                self.by_gpu.setdefault(physical_gpu(d.uuid, self.parents), []).append(d)

    def check(
        self, v: _Verdict, dev: DeviceSnapshot, constraints: Constraints, booking: Booking
    ) -> None:
        """:func:`_check_leases` across the physical GPU: a device held exclusively there
        drops ``dev``; so does any lease there when exclusive is wanted. A device already
        out for being held exclusively itself is not judged again."""
        if not self.parents or booking.exclusive:
            return
        for other in self.by_gpu.get(physical_gpu(dev.uuid, self.parents), ()):
            b = self.bookings.get(other.uuid)
            if other.uuid == dev.uuid or b is None or not b.lease_count:
                continue
            rel = kin_relation(dev.uuid, other.uuid, self.parents)
            if b.exclusive:
                for phrase in b.exclusive_by or (EXCLUSIVE_LEASE,):
                    v.drop(kin_phrase(rel, other.label, phrase))
            elif constraints.exclusive:
                leases = b.lease_count - len(b.waiting)
                held = [f"held by {leases} lease(s)"] if leases > 0 else []
                what = " and ".join([*held, *(f"reserved for {w}" for w in b.waiting)])
                v.drop("exclusive wanted but " + kin_phrase(rel, other.label, what))


def _model_matches(dev: DeviceSnapshot, names: Sequence[str]) -> bool:
    name = dev.name.lower()
    return any(n.lower() in name for n in names)


def _preference(dev: DeviceSnapshot, prefer: Sequence[str]) -> int:
    """Place of the device's model in the preference order (unlisted models after all)."""
    name = dev.name.lower()
    return next((i for i, n in enumerate(prefer) if n.lower() in name), len(prefer))


def _load_step(util: float | None, eff_free: int | None, total: int | None) -> int:
    """The load of a device in 5 % steps (see the module docstring); 100 % when nothing is known."""
    shares = []
    if util is not None:
        shares.append(float(util))
    if eff_free is not None and total:
        shares.append(100.0 * (1.0 - eff_free / total))
    return math.floor(max(shares) / _UTIL_STEP) if shares else math.floor(100.0 / _UTIL_STEP)


def _parent_excluded(dev: DeviceSnapshot, ident: str, devices: Sequence[DeviceSnapshot]) -> bool:
    for d in devices:
        if d.uuid == dev.parent_uuid:
            return matches_id(d, ident)
    return False


def select(candidates: Sequence[Candidate], count: int) -> list[Candidate]:
    """The best ``count`` eligible candidates (at most one MIG device), or ``[]`` if too few fit."""
    chosen: list[Candidate] = []
    for cand in candidates:
        if not cand.eligible:
            continue
        # Several devices cannot include a MIG device; one is returned as soon as it is chosen.
        if cand.device.is_mig and count > 1:
            continue
        chosen.append(cand)
        if len(chosen) == count:
            return chosen
    return []
