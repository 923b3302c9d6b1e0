"""The words of the magics: what ``%gpu pick`` prints (:func:`format_pick`), the ``--dry-run``
ranking table (:func:`format_ranking`), the one line a failure becomes and the lines a notebook
shows when nothing fits. Pure text from the pick's result: no IPython display, no printing.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from autogpu_jupyter.core import (
    asked_text,
    format_bytes,
    format_duration,
    ranking_lines,
    terminal_safe,
)
from autogpu_jupyter.errors import AutoGPUError, NoDeviceFitsError

if TYPE_CHECKING:
    from autogpu_jupyter.core import Candidate, Constraints, DeviceSnapshot, PickResult

__all__ = ["format_pick", "format_ranking", "source_words"]

log = logging.getLogger("autogpu_jupyter.magics")


def _one_line(err: BaseException) -> str:
    return terminal_safe(str(err).strip() or type(err).__name__)


def _no_fit(err: NoDeviceFitsError, args: argparse.Namespace, where: str) -> NoDeviceFitsError:
    """The error a notebook shows when nothing fits: not a usage error (the options were fine),
    so no "UsageError:" prefix; the per-device reasons, that nothing changed, and how to wait.

    The cell still fails (so "Run All" stops before code that needs the GPU), through the
    exception's ``_render_traceback_``, which IPython shows instead of a traceback.
    """
    text = terminal_safe(str(err))
    lines = [f"autogpu: {line}" if i == 0 else line for i, line in enumerate(text.splitlines())]
    if not getattr(err, "waitable", True):
        hint = "nothing changed; no wait can help: these options themselves rule out every device"
    elif args.wait:
        hint = f"nothing changed; a longer --wait than {args.wait} waits longer in line"
    else:
        hint = (
            f"nothing changed; to wait in line until a device fits, add --wait: "
            f"{where} ... --wait 10m (interrupt the kernel to cancel)"
        )
    lines.append(f"  {hint}")
    err._render_traceback_ = lambda: lines  # type: ignore[attr-defined]
    return err


def _pct(value: float | None) -> str:
    return "util unknown" if value is None else f"util {value:.0f}%"


def _free(c: Candidate) -> str:
    return f"{format_bytes(c.effective_free_bytes)} free"


def _device_line(d: DeviceSnapshot, c: Candidate | None) -> str:
    free = c.effective_free_bytes if c is not None else d.memory_free_bytes
    util = c.smoothed_util_pct if c is not None else d.utilization_pct
    booked = (
        f" after {format_bytes(c.booked_bytes)} booked" if c is not None and c.booked_bytes else ""
    )
    return (
        f"{d.label} · {d.name} · {d.short_uuid}: {format_bytes(free)} free of "
        f"{format_bytes(d.memory_total_bytes)}{booked}, {_pct(util)}"
    )


def format_pick(result: PickResult, warning: str | None = None) -> str:
    """The short, friendly summary of a pick (what ``%gpu pick`` prints)."""
    sim = " [SIMULATED]" if result.snapshot.simulated else ""
    lines = []
    head = "picked" if len(result.chosen) == 1 else f"picked {len(result.chosen)} devices:"
    if len(result.chosen) == 1:
        d = result.chosen[0]
        lines.append(f"autogpu{sim}: {head} {_device_line(d, result.candidate(d.uuid))}")
    else:
        lines.append(f"autogpu{sim}: {head}")
        lines.extend(f"  {_device_line(d, result.candidate(d.uuid))}" for d in result.chosen)
    ru = result.runner_up
    runner = (
        f"runner-up {ru.device.label} ({_free(ru)}, {_pct(ru.smoothed_util_pct)})"
        if ru is not None
        else "no runner-up (nothing else fits)"
    )
    if result.kept:
        kept = result.chosen[0] if result.chosen else None
        where = (
            _device_line(kept, result.candidate(kept.uuid)) if kept is not None else "its device"
        )
        return "\n".join(
            [
                f"autogpu{sim}: kept {where}",
                f"  this kernel was started on it by the autogpu kernelspec and already holds its "
                f"lease; it meets {result.constraints.describe()}, so nothing changed (no second "
                "lease)",
                _env_line(result.env),
            ]
        )
    lines.append(f"  asked: {_asked(result.constraints)} · {runner}")
    if result.previous is not None:
        now = ", ".join(d.label for d in result.chosen)
        lines.append(
            f"  you had {result.previous}; now {now} (one lease: the old one was released)"
            if result.previous != now
            else f"  you had {now} already: kept it, with a new lease for these options"
        )
    if result.waited_s >= 1.0:
        lines.append(f"  waited {format_duration(round(result.waited_s, 1))} in line")
    if result.lease is not None:
        lines.append(
            f"  lease {result.lease.record.lease_id} held until this kernel exits or %gpu release"
        )
    elif result.lease_note:
        lines.append(f"  no lease: {result.lease_note}")
    lines.append(_env_line(result.env))
    if warning:
        lines.append(f"  WARNING {warning}")
    return "\n".join(lines)


def _env_line(env: Mapping[str, str]) -> str:
    """The variable(s) a pick set, as the summary shows them (ROCm's on an AMD host)."""
    if "ROCR_VISIBLE_DEVICES" in env:
        return "  " + " ".join(
            f"{k}={env[k]}" for k in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES") if k in env
        )
    return f"  CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '')}"


def format_ranking(result: PickResult, width: int = 120) -> str:
    """The ranking table of ``--dry-run``: every device, its rank or why it was dropped, the
    load figure it was ranked by, and what decided between the best and the runner-up.

    The table fits ``width`` characters (:func:`autogpu_jupyter.core.tables.ranking_lines`: the
    verdict beside its row, or under it where the columns leave it too little room); control
    characters in any cell are made visible.
    """
    return "\n".join(ranking_lines(result, width))


def _asked(constraints: Constraints) -> str:
    """What was asked, for people: "min free 10.0 GiB", or "any device" when nothing was."""
    return asked_text(constraints)


def _pending_move_text() -> str | None:
    """A move this kernel asked for (``%gpu move``) that waits for the kernel's restart."""
    # The pick machinery comes with the first pick, not with %load_ext.
    from autogpu_jupyter.core import moves  # noqa: PLC0415

    try:
        return moves.pending_move_text()
    except AutoGPUError as err:
        log.debug("pending move not readable: %s", err)
        return None


_SOURCE_WORDS = {
    "magic": "%gpu pick",
    "api": "autogpu_jupyter.pick",
    "provisioner": "picked by the autogpu kernelspec",
    "sidebar": "picked from the sidebar",
}


def source_words(source: str) -> str:
    """How a choice was made, as the user did it: ``picked from the sidebar``, ``%gpu pick``."""
    return _SOURCE_WORDS.get(source, source)
