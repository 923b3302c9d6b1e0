"""Is this kernel's GPU overloaded by *other* processes? Pure detection, plus a once-only notice.

:func:`detect` is a pure function of the sampler's history (per-device arrays from
:meth:`~autogpu_jupyter.core.sampler.Sampler.history_series`, or the DataFrame of
:meth:`~autogpu_jupyter.core.sampler.Sampler.history_frame`), the newest snapshot, this kernel's
device UUIDs and PIDs, and the thresholds (``AutoGPU.overload_util_pct``,
``overload_window_s``, ``overload_memory_pct``). The panel draws its banner from it.

For users without the panel, :func:`pending_warning` returns the warning text once, when it first
appears (and again only after it cleared and came back). Nothing here prints: printing from the
sampler thread is forbidden, so the magics register an IPython hook that prints what it returns::

    def _post_run_cell(result):
        text = overload.pending_warning()
        if text:
            print(text)
    ip.events.register("post_run_cell", _post_run_cell)

This module imports no ipywidgets or IPython.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core import decision, session
from autogpu_jupyter.core.leasing import LeaseRecord, LeaseStore, RecordView, store_for
from autogpu_jupyter.core.moves import grant_environ
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.sampler import DeviceSeries, Sampler, current_sampler, series_from_frame
from autogpu_jupyter.core.units import Size, format_bytes, format_duration
from autogpu_jupyter.core.visibility import parse_cuda_visible_devices

if TYPE_CHECKING:
    import pandas as pd

    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot

__all__ = [
    "Alternative",
    "Overload",
    "Thresholds",
    "detect",
    "alternative_constraints",
    "best_alternative",
    "kernel_device_uuids",
    "kernel_grant",
    "pending_warning",
    "reset_pending",
    "set_move_hint",
    "move_hint",
]

_DEFAULT_MOVE_HINT = "restart the kernel and run %gpu pick"
_move_hint = _DEFAULT_MOVE_HINT


def set_move_hint(text: str | None) -> None:
    """How the warning tells people to move (the magics set ``"run %gpu move"`` once it exists).
    ``None`` restores the default, "restart the kernel and run %gpu pick"."""
    global _move_hint
    _move_hint = text or _DEFAULT_MOVE_HINT


def move_hint() -> str:
    return _move_hint


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a device counts as overloaded (defaults = the ``AutoGPU`` config defaults)."""

    util_pct: float = 90.0
    window_s: float = 30.0
    memory_pct: float = 95.0

    @classmethod
    def from_config(cls, config: Any | None = None) -> Thresholds:
        """From an ``AutoGPU`` configurable (default: a fresh one, env defaults applied)."""
        if config is None:
            config = AutoGPU()
        return cls(
            util_pct=float(config.overload_util_pct),
            window_s=float(config.overload_window_s),
            memory_pct=float(config.overload_memory_pct),
        )


@dataclass(frozen=True, slots=True)
class Alternative:
    """The best other device to move to."""

    uuid: str
    label: str
    memory_free_bytes: int | None
    utilization_pct: float | None

    def describe(self) -> str:
        util = "?" if self.utilization_pct is None else f"{self.utilization_pct:.0f}%"
        return f"{self.label} ({format_bytes(self.memory_free_bytes)} free, {util} busy)"


@dataclass(frozen=True, slots=True)
class Overload:
    """This kernel's device ``uuid`` is overloaded by other processes."""

    uuid: str
    label: str
    causes: tuple[str, ...]  # "utilisation 97% for 45s (over 90%)", "memory 97% full (over 95%)"
    other_process_count: int
    other_memory_bytes: int | None
    users: tuple[str, ...]
    alternative: Alternative | None
    move: str

    @property
    def key(self) -> tuple[str, str]:
        """What identifies "the same warning" for the once-only notice: device and cause kinds."""
        kinds = ",".join(sorted(c.split(" ", 1)[0] for c in self.causes))
        return (self.uuid, kinds)

    def others_text(self) -> str:
        n = self.other_process_count
        text = f"{n} other process{'es' if n != 1 else ''}"
        if self.other_memory_bytes is not None:
            text += f" holding {format_bytes(self.other_memory_bytes)}"
        if self.users:
            text += f" (user{'s' if len(self.users) != 1 else ''} {', '.join(self.users)})"
        return text

    def message(self) -> str:
        """One line for the cell output and the banner."""
        where = (
            f"move to {self.alternative.describe()}: {self.move}"
            if self.alternative is not None
            else "no better device right now"
        )
        return (
            f"autogpu: {self.label} (this kernel's GPU) is overloaded: {'; '.join(self.causes)}, "
            f"caused by {self.others_text()}. Best alternative: {where}."
        )


def kernel_device_uuids(
    devices: Sequence[DeviceSnapshot], environ: dict[str, str] | None = None
) -> tuple[str, ...]:
    """The UUIDs of this kernel's device(s): the autogpu choice (:func:`core.session.current`),
    else the devices ``CUDA_VISIBLE_DEVICES`` names, read as CUDA reads it
    (:func:`~autogpu_jupyter.core.visibility.parse_cuda_visible_devices`); ``()`` when nothing
    was picked (an unset variable means "no choice yet", not "all")."""
    choice = session.current()
    if choice is not None and choice.uuids:
        return tuple(choice.uuids)
    env = os.environ if environ is None else environ
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if not raw:
        return ()
    return parse_cuda_visible_devices(raw, devices)[0]


def alternative_constraints(
    lease: LeaseRecord | None, constraints: Constraints | None = None
) -> Constraints:
    """What a better device must offer a kernel, the same wherever it is asked (the kernel's
    warning, the server's notification, the sidebar): the memory the kernel's own lease books
    (its pick's ``--min-free`` as bytes), as many devices, the same exclusivity.

    Without a lease (leases off, a dry run) the kernel's pick options are used, less their
    ``--exclude``: a device the pick left out (the sidebar's pick names one device) is still a
    candidate for "better", and the kernel's own devices are excluded by the caller anyway.
    """
    if lease is not None:
        booked = [b for b in lease.device_requested_bytes if b]
        return Constraints(
            min_free=Size(bytes=max(booked)) if booked else None,
            count=max(1, len(lease.device_uuids)),
            exclusive=lease.exclusive,
        )
    if constraints is None:
        return Constraints()
    return replace(constraints, exclude=())


def _own_lease(choice: Any, store: LeaseStore | None) -> LeaseRecord | None:
    """This kernel's lease record: the one its pick holds, else (a provisioned kernel) the
    store's record with the lease id the provisioner passed down."""
    lease = getattr(choice, "lease", None)
    if lease is not None:
        return lease.record  # type: ignore[no-any-return]
    lease_id = getattr(choice, "lease_id", None)
    if not lease_id or store is None:
        return None
    try:
        records = store.list_leases()
    except Exception:  # an unreadable store: no lease to go by, the options then
        return None
    return next((r for r in records if r.lease_id == lease_id), None)


def best_alternative(
    snapshot: FleetSnapshot,
    exclude: Iterable[str],
    smoothed_util: dict[str, float | None] | None = None,
    *,
    constraints: Constraints | None = None,
    store: RecordView | Literal["config"] | None = "config",
    environ: Mapping[str, str] | None = None,
    self_pids: Iterable[int] | None = None,
) -> Alternative | None:
    """The best device outside ``exclude``, by the one decision pipeline (:mod:`core.decision`).

    It is what ``%gpu pick --dry-run`` would choose for this kernel
    (:func:`alternative_constraints`) when its current device(s) are excluded: the same
    allocation (the environment before autogpu changed it), the same lease store (other holders'
    bookings and waiters; this kernel's own lease hidden), the same smoothing. The server asks
    the same question for its kernels, passing ``constraints``, ``store`` and ``environ``;
    ``store="config"``: the store the ``AutoGPU`` settings select.
    """
    skip = tuple(exclude)
    choice = session.current()
    if store == "config":
        configured = store_for(AutoGPU())
        if constraints is None:
            constraints = alternative_constraints(
                _own_lease(choice, configured), choice.constraints if choice is not None else None
            )
        if configured is not None and choice is not None and choice.lease_id:
            configured = configured.hiding(lease_ids=[choice.lease_id])
        store = configured
    if constraints is None:
        constraints = alternative_constraints(
            getattr(getattr(choice, "lease", None), "record", None),
            choice.constraints if choice is not None else None,
        )
    if environ is None:
        environ = kernel_grant(snapshot, skip)
    context = decision.gather(
        snapshot,
        environ=environ,
        store=store,
        smoothed_util=smoothed_util,
        self_pids=(os.getpid(),) if self_pids is None else tuple(self_pids),
    )
    # A skipped MIG device's GPU is avoided too; the policy's exclude already drops the MIG
    # devices of an excluded GPU.
    parents = {d.parent_uuid for d in snapshot.devices if d.uuid in skip and d.parent_uuid}
    avoid = tuple(d.uuid for d in snapshot.devices if d.uuid in skip or d.uuid in parents)
    made = decision.decide(context, replace(constraints, exclude=constraints.exclude + avoid))
    best = made.best
    if best is None:
        return None
    dev = best.device
    util = best.smoothed_util_pct if best.smoothed_util_pct is not None else dev.utilization_pct
    return Alternative(dev.uuid, dev.label, best.effective_free_bytes, util)


def kernel_grant(
    snapshot: FleetSnapshot, own: Sequence[str], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment a restarted kernel would pick within: the server's grant (a provisioned
    kernel's ``AUTOGPU_GRANT_CVD``), else the environment before autogpu changed it; a
    ``CUDA_VISIBLE_DEVICES`` that names only this kernel's own devices is the kernel's own
    narrowing, not a scheduler's grant (``SLURM_*`` / ``NVIDIA_VISIBLE_DEVICES`` still bound).

    ``environ``: the kernel's environment as it started (the server reads its kernels' from
    ``/proc``); default this process's, before autogpu changed it.
    """
    env = grant_environ(session.original_environ() if environ is None else environ)
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw:
        granted, _ = parse_cuda_visible_devices(raw, snapshot.devices)
        if granted and set(granted) <= set(own):
            env.pop("CUDA_VISIBLE_DEVICES")
    return env


def _busy_for_s(
    history: Mapping[str, DeviceSeries] | pd.DataFrame, uuid: str, util_pct: float
) -> tuple[float, float | None]:
    """How long ``uuid`` has been above ``util_pct`` up to its newest sample, and the mean
    utilisation over that stretch. ``(0.0, None)`` when the newest sample is not above."""
    if not isinstance(history, Mapping):
        history = series_from_frame(history)
    series = history.get(uuid)
    if series is None or not len(series):
        return 0.0, None
    ts = series.timestamps_s
    util = series.column("utilization_pct")
    over = util > util_pct  # NaN (unknown, lost) compares False: unknown is never "busy"
    if not over[-1]:
        return 0.0, None
    below = np.flatnonzero(~over)
    start = int(below[-1]) + 1 if len(below) else 0
    return float(ts[-1] - ts[start]), float(util[start:].mean())


def detect(
    frame: Mapping[str, DeviceSeries] | pd.DataFrame,
    snapshot: FleetSnapshot | None,
    kernel_uuids: Sequence[str],
    own_pids: Iterable[int],
    thresholds: Thresholds,
    *,
    smoothed_util: dict[str, float | None] | None = None,
    move: str | None = None,
    alternative: Callable[[Sequence[str]], Alternative | None] | None = None,
) -> list[Overload]:
    """The overload warnings for this kernel's devices (empty when none).

    A device is overloaded when its utilisation has stayed above ``thresholds.util_pct`` for at
    least ``thresholds.window_s`` seconds (every sample of that stretch above; unknown breaks the
    stretch), or its memory is fuller than ``thresholds.memory_pct`` — and, in either case,
    because of others: at least one process on it is not this kernel's, and for memory, the
    others hold more than this kernel does.

    Parameters
    ----------
    frame
        The sampler's history covering at least the window: per-UUID arrays
        (:meth:`Sampler.history_series`) or the long table (:meth:`Sampler.history_frame`).
    snapshot
        The newest snapshot (processes, users); ``None``: nothing to say.
    kernel_uuids
        This kernel's device UUIDs.
    own_pids
        PIDs that are this kernel or its children.
    thresholds
        Utilisation / window / memory thresholds.
    smoothed_util
        Per-UUID mean utilisation, to rank the alternative.
    move
        How to move (default :func:`move_hint`).
    alternative
        Finds the better device given the kernel's devices (default: :func:`best_alternative`
        for this process's kernel; the server passes one for each of its kernels).
    """
    if snapshot is None:
        return []
    ours = set(own_pids)
    out: list[Overload] = []
    for uuid in kernel_uuids:
        dev = snapshot.by_uuid(uuid)
        if dev is None or not dev.available or not dev.processes:
            continue
        others = [p for p in dev.processes if p.pid not in ours]
        if not others:
            continue
        other_mem_known = [p.used_memory_bytes for p in others if p.used_memory_bytes is not None]
        other_mem = sum(other_mem_known) if other_mem_known else None
        own_mem = sum(p.used_memory_bytes or 0 for p in dev.processes if p.pid in ours)
        causes: list[str] = []
        busy_s, mean_util = _busy_for_s(frame, uuid, thresholds.util_pct)
        if mean_util is not None and busy_s >= thresholds.window_s:
            causes.append(
                f"utilisation {mean_util:.0f}% for {format_duration(round(busy_s))} "
                f"(over {thresholds.util_pct:g}%)"
            )
        if dev.memory_used_bytes is not None and dev.memory_total_bytes:
            mem_pct = 100.0 * dev.memory_used_bytes / dev.memory_total_bytes
            others_hold_more = other_mem is None or other_mem > own_mem
            if mem_pct > thresholds.memory_pct and others_hold_more:
                causes.append(f"memory {mem_pct:.0f}% full (over {thresholds.memory_pct:g}%)")
        if not causes:
            continue
        users = tuple(sorted({p.user for p in others if p.user}))
        out.append(
            Overload(
                uuid=uuid,
                label=dev.label,
                causes=tuple(causes),
                other_process_count=len(others),
                other_memory_bytes=other_mem,
                users=users,
                alternative=(
                    alternative(kernel_uuids)
                    if alternative is not None
                    else best_alternative(snapshot, kernel_uuids, smoothed_util)
                ),
                move=move or _move_hint,
            )
        )
    return out


def detect_from_sampler(
    sampler: Sampler, thresholds: Thresholds, kernel_uuids: Sequence[str] | None = None
) -> list[Overload]:
    """:func:`detect` on ``sampler``'s data (history over the window plus a margin)."""
    snapshot = sampler.latest()
    if snapshot is None:
        return []
    if kernel_uuids is None:
        kernel_uuids = kernel_device_uuids(snapshot.devices)
    if not kernel_uuids:
        return []
    since = thresholds.window_s + 3 * sampler.interval_s
    return detect(
        sampler.history_series(since_s=max(since, 1.0)),
        snapshot,
        kernel_uuids,
        sampler.latest_own_pids(),
        thresholds,
        smoothed_util=sampler.smoothed_util(60.0),
    )


_pending_lock = threading.Lock()
_announced: set[tuple[str, str]] = set()


def pending_warning(thresholds: Thresholds | None = None) -> str | None:
    """The overload warning to print now, once: text when a warning appeared since the last
    call, else ``None``. A warning that clears is announced again when it comes back.

    Never starts the sampler (no thread from a hook): it reads the running one, if any.
    Call it from the main thread (an IPython ``post_run_cell`` hook) and print the result.
    """
    sampler = current_sampler()
    if sampler is None:
        return None
    warnings = detect_from_sampler(sampler, thresholds or Thresholds.from_config())
    with _pending_lock:
        active = {w.key for w in warnings}
        new = [w for w in warnings if w.key not in _announced]
        _announced.intersection_update(active)
        _announced.update(active)
    if not new:
        return None
    return "\n".join(w.message() for w in new)


def reset_pending() -> None:
    """Forget which warnings were announced (unload / tests)."""
    with _pending_lock:
        _announced.clear()
