"""What the magics show while they work: the one updating line while a pick waits in line
(:class:`_Progress`) and what the sampler saw while a ``%%gpu`` cell ran (:class:`_CellStats`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from IPython.display import DisplayHandle

from autogpu_jupyter.core import format_bytes, format_duration

if TYPE_CHECKING:
    from autogpu_jupyter.core import FleetSnapshot, Sampler


@dataclass
class _CellStats:
    """What the sampler saw while a ``%%gpu`` cell ran (filled from the sampler thread)."""

    uuids: tuple[str, ...]
    start_s: float
    util_sum: float = 0.0
    util_n: int = 0
    peak_own_bytes: int | None = None
    samples: int = 0
    seen: set[float] = field(default_factory=set)

    def add(self, sampler: Sampler, snap: FleetSnapshot | None) -> None:
        # Runs in the sampler thread: only updates numbers (never prints or displays).
        if snap is None or snap.timestamp_s < self.start_s or snap.timestamp_s in self.seen:
            return
        self.seen.add(snap.timestamp_s)
        self.samples += 1
        ours = sampler.latest_own_pids() if sampler.latest() is snap else None
        if ours is None:
            # Numpy: only with a sampler.
            from autogpu_jupyter.core import own_pids  # noqa: PLC0415

            ours = own_pids(p.pid for d in snap.devices for p in (d.processes or ()))
        own: int | None = 0
        for d in snap.devices:
            if d.uuid in self.uuids and d.utilization_pct is not None:
                self.util_sum += d.utilization_pct
                self.util_n += 1
            if d.processes is None:
                if d.uuid in self.uuids:
                    own = None
                continue
            if own is not None:
                own += sum(p.used_memory_bytes or 0 for p in d.processes if p.pid in ours)
        if own is not None:
            self.peak_own_bytes = max(self.peak_own_bytes or 0, own)

    def report(self, wall_s: float, labels: str, simulated: bool) -> str:
        util = (
            "unknown (not reported for this device)"
            if self.util_n == 0
            else f"{self.util_sum / self.util_n:.0f}%"
        )
        peak = "unknown" if self.peak_own_bytes is None else format_bytes(self.peak_own_bytes)
        sim = " [SIMULATED]" if simulated else ""
        return (
            f"autogpu{sim} %%gpu on {labels}: wall {format_duration(round(wall_s, 2))} · "
            f"peak GPU memory of this kernel {peak} · mean utilisation {util} "
            f"({self.samples} sample{'s' if self.samples != 1 else ''})"
        )


class _Progress:
    """One updating line while a pick waits (main thread only: the wait loop runs there)."""

    def __init__(self, in_kernel: bool) -> None:
        self.in_kernel = in_kernel
        self.handle: Any = None
        self.shown = False

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.shown and not self.in_kernel:
            sys.stdout.write("\n")
            sys.stdout.flush()

    def update(self, text: str) -> None:
        if self.in_kernel:
            data = {"text/plain": text}
            if self.handle is None:
                # The handle exists before its first display, so an interrupt arriving during
                # that display still finds it and can mark the line "cancelled".
                make_handle: Callable[[], Any] = DisplayHandle  # untyped in IPython
                self.handle = make_handle()
                self.handle.display(data, raw=True)
            else:
                self.handle.update(data, raw=True)
        else:
            sys.stdout.write("\r" + text)
            sys.stdout.flush()
        self.shown = True

    def done(self, word: str) -> None:
        # Not `self.shown`: an interrupt during the first display leaves it False although the
        # line may already be on the page; an update of a display the page never got is ignored.
        if self.in_kernel and self.handle is not None:
            self.handle.update({"text/plain": f"waiting for a device: {word}"}, raw=True)
