"""Pure rendering: the sampler's history arrays and snapshot -> HTML with inline SVG.

No widgets and no state here, so every picture the panel shows can be tested as a string.
Colours come from JupyterLab's CSS variables (``var(--jp-ui-font-color1, #222)``) with fallbacks,
set through ``style=`` (SVG presentation attributes do not resolve ``var()``), so the panel reads
in light and dark themes, in Notebook 7 and VS Code too.
"""

from __future__ import annotations

import functools
import html
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from autogpu_jupyter.core import SAMPLED_METRICS as METRICS
from autogpu_jupyter.core import (
    DeviceSeries,
    format_bytes,
    holders_by_device,
    holders_text,
    series_from_frame,
)

if TYPE_CHECKING:
    import pandas as pd

    from autogpu_jupyter.core import DeviceSeries, DeviceSnapshot, FleetSnapshot, Overload
    from autogpu_jupyter.core.leasing import LeaseRecord

__all__ = [
    "render_charts",
    "render_device_chart",
    "render_table",
    "render_banner",
    "render_header",
    "render_error",
    "UTIL_COLOR",
    "MEM_COLOR",
]

FG = "var(--jp-ui-font-color1, #1f1f1f)"
FG2 = "var(--jp-ui-font-color2, #616161)"
BORDER = "var(--jp-border-color2, #c8c8c8)"
BG = "var(--jp-layout-color1, transparent)"
ACCENT = "var(--jp-brand-color1, #1976d2)"
UTIL_COLOR = "var(--jp-brand-color1, #1976d2)"
MEM_COLOR = "var(--jp-warn-color1, #e08600)"
ERROR_COLOR = "var(--jp-error-color1, #d32f2f)"
WARN_BG = "rgba(255, 152, 0, 0.14)"  # a tint that reads on light and dark backgrounds
FONT = "var(--jp-ui-font-family, system-ui, sans-serif)"

WIDTH = 300
HEIGHT = 96
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 30, 6, 8, 16
MAX_POINTS = 300
_COL_UTIL = METRICS.index("utilization_pct")
_COL_USED = METRICS.index("memory_used_bytes")
_COL_TOTAL = METRICS.index("memory_total_bytes")


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _pct(x: float | None) -> str:
    return "?" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0f}%"


# "12.3" for every tenth of a pixel in the picture: path points are table look-ups, not formatting
_TENTHS: list[str] = [f"{i / 10:.1f}" for i in range(10 * max(WIDTH, HEIGHT) + 1)]
_MAX_TENTH = len(_TENTHS) - 1


def _as_series(rows: DeviceSeries | pd.DataFrame, uuid: str) -> DeviceSeries:
    if isinstance(rows, DeviceSeries):
        return rows
    return series_from_frame(rows).get(uuid) or DeviceSeries.empty(uuid)


def _tenths(v: np.ndarray) -> np.ndarray:
    """Pixel coordinates in tenths, as table indices (NaN -> -1)."""
    out = np.full(v.shape, -1, dtype=np.intp)
    known = ~np.isnan(v)
    out[known] = np.clip(np.rint(v[known] * 10), 0, _MAX_TENTH).astype(np.intp)
    return out


def _path(x10: np.ndarray, y10: np.ndarray) -> str:
    """An SVG path through the points (tenths of a pixel; ``-1`` = unknown, which breaks the
    line: unknown is not zero). The inner points of a horizontal run are left out (the same
    picture, fewer bytes)."""
    n = len(y10)
    if n == 0:
        return ""
    known = y10 >= 0
    prev_known = np.zeros(n, dtype=bool)
    prev_known[1:] = known[:-1]
    keep = known.copy()
    if n > 2:
        flat = (
            known[1:-1] & known[:-2] & known[2:] & (y10[1:-1] == y10[:-2]) & (y10[1:-1] == y10[2:])
        )
        keep[1:-1] &= ~flat
    idx = np.flatnonzero(keep)
    t = _TENTHS
    return " ".join(
        [
            ("L" if pen else "M") + t[x] + "," + t[y]
            for pen, x, y in zip(
                prev_known[idx].tolist(), x10[idx].tolist(), y10[idx].tolist(), strict=True
            )
        ]
    )


def render_device_chart(
    rows: DeviceSeries | pd.DataFrame,
    *,
    label: str,
    uuid: str,
    window_s: float,
    now_s: float,
    highlight: bool = False,
    lost_reason: str | None = None,
    name: str = "",
) -> str:
    """One device's chart: utilisation (%) and memory used (% of total) over ``window_s``.

    ``rows`` is that device's history: a :class:`~autogpu_jupyter.core.sampler.DeviceSeries`
    (:meth:`Sampler.history_series`, what the panel passes) or its rows of
    :meth:`Sampler.history_frame`. Samples older than ``window_s`` before ``now_s`` are left
    out. Returns an HTML ``<div>`` holding an ``<svg>`` with ``data-uuid`` set; the kernel's
    device gets ``data-kernel="1"`` and an accent border; a lost device shows its reason
    instead of stale lines.
    """
    inner_w = WIDTH - _PAD_L - _PAD_R
    inner_h = HEIGHT - _PAD_T - _PAD_B
    border = f"2px solid {ACCENT}" if highlight else f"1px solid {BORDER}"
    tag = f' <span style="color:{ACCENT};font-weight:600">this kernel</span>' if highlight else ""
    title = (
        f'<div style="font-weight:600;color:{FG}">{_e(label)}{tag}'
        f' <span style="color:{FG2};font-weight:400" title="{_e(uuid)}">{_e(name)}</span></div>'
    )
    svg_open = (
        f'<svg class="autogpu-chart" data-uuid="{_e(uuid)}" data-kernel="{int(highlight)}" '
        f'width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{_e(label)} utilisation and memory" '
        f'style="display:block;font-family:{FONT};font-size:10px">'
    )
    grid = _grid(window_s)
    body: list[str] = []
    if lost_reason is not None:
        body.append(
            f'<text x="{_PAD_L + inner_w / 2:.1f}" y="{_PAD_T + inner_h / 2 + 4:.1f}" '
            f'text-anchor="middle" style="fill:{ERROR_COLOR};font-size:12px;font-weight:600">'
            f"lost: {_e(lost_reason)}</text>"
        )
        legend = f'<span style="color:{ERROR_COLOR}">lost</span>'
    else:
        series = _as_series(rows, uuid)
        ts = series.timestamps_s
        values = series.values
        if len(ts) and (ts[:-1] <= ts[1:]).all():  # in time order (always, from the sampler)
            first = int(np.searchsorted(ts, now_s - window_s, side="left"))
            ts, values = ts[first:], values[first:]
        elif len(ts):
            inside = ts >= now_s - window_s
            ts, values = ts[inside], values[inside]
        ts, values = ts[-MAX_POINTS * 4 :], values[-MAX_POINTS * 4 :]
        if len(ts) > MAX_POINTS:
            step = math.ceil(len(ts) / MAX_POINTS)
            ts, values = ts[::step], values[::step]
        util = values[:, _COL_UTIL]
        total = values[:, _COL_TOTAL]
        used = values[:, _COL_USED]
        with np.errstate(invalid="ignore", divide="ignore"):
            mem = np.where(total > 0, 100.0 * used / total, np.nan)
        age = np.clip(now_s - ts, 0.0, window_s)
        x10 = _tenths(_PAD_L + inner_w * (1 - age / window_s))

        def y10_of(v: np.ndarray) -> np.ndarray:
            return _tenths(_PAD_T + inner_h * (1 - np.clip(v, 0.0, 100.0) / 100))

        mem_path = _path(x10, y10_of(mem))
        util_path = _path(x10, y10_of(util))
        if mem_path:
            body.append(
                f'<path class="autogpu-mem" d="{mem_path}" '
                f'style="fill:none;stroke:{MEM_COLOR};stroke-width:1.5;stroke-dasharray:4 2"/>'
            )
        if util_path:
            body.append(
                f'<path class="autogpu-util" d="{util_path}" '
                f'style="fill:none;stroke:{UTIL_COLOR};stroke-width:2"/>'
            )
        last_util = float(util[-1]) if len(util) else math.nan
        last_mem = float(mem[-1]) if len(mem) else math.nan
        legend = (
            f'<span style="color:{UTIL_COLOR}">&#9644; util {_pct(last_util)}</span> '
            f'<span style="color:{MEM_COLOR}">&#9476; mem {_pct(last_mem)}</span>'
        )
    return (
        f'<div class="autogpu-device" data-uuid="{_e(uuid)}" style="border:{border};'
        f"border-radius:4px;padding:4px 6px;margin:3px;background:{BG};color:{FG};"
        f'font-family:{FONT};font-size:12px">{title}{svg_open}{grid}{"".join(body)}'
        f'</svg><div style="font-size:11px">{legend}</div></div>'
    )


@functools.lru_cache(maxsize=16)
def _grid(window_s: float) -> str:
    """The frame, the y labels and the x labels of a chart (the same for every device)."""
    inner_w = WIDTH - _PAD_L - _PAD_R
    inner_h = HEIGHT - _PAD_T - _PAD_B
    grid = [
        f'<rect x="{_PAD_L}" y="{_PAD_T}" width="{inner_w}" height="{inner_h}" '
        f'style="fill:none;stroke:{BORDER}"/>'
    ]
    for frac in (0.0, 0.5, 1.0):
        y = _PAD_T + inner_h * (1 - frac)
        grid.append(
            f'<text x="{_PAD_L - 3}" y="{y + 3:.1f}" text-anchor="end" '
            f'style="fill:{FG2}">{int(frac * 100)}%</text>'
        )
    grid.append(
        f'<text x="{_PAD_L}" y="{HEIGHT - 3}" style="fill:{FG2}">'
        f"-{_e(_window_text(window_s))}</text>"
        f'<text x="{WIDTH - _PAD_R}" y="{HEIGHT - 3}" text-anchor="end" '
        f'style="fill:{FG2}">now</text>'
    )
    return "".join(grid)


def _window_text(window_s: float) -> str:
    if window_s >= 60 and window_s % 60 == 0:
        return f"{int(window_s // 60)} min"
    return f"{window_s:g} s"


def render_charts(
    history: Mapping[str, DeviceSeries] | pd.DataFrame,
    devices: Sequence[DeviceSnapshot],
    *,
    window_s: float,
    now_s: float | None = None,
    highlight: Iterable[str] = (),
) -> str:
    """A chart per device of ``devices`` (in that order), in a wrapping flex row.

    Parameters
    ----------
    history
        Per-UUID arrays (:meth:`Sampler.history_series`, what the panel passes: no pandas per
        redraw) or the long table of :meth:`Sampler.history_frame`.
    devices
        The newest snapshot's devices: their order, labels and lost state.
    window_s
        Seconds shown (the x axis ends at ``now_s``, default the newest sample).
    highlight
        UUIDs of this kernel's devices.
    """
    marked = set(highlight)
    series = history if isinstance(history, Mapping) else series_from_frame(history)
    if now_s is None:
        now_s = max((float(s.timestamps_s.max()) for s in series.values() if len(s)), default=0.0)
    charts = []
    for dev in devices:
        charts.append(
            render_device_chart(
                series.get(dev.uuid) or DeviceSeries.empty(dev.uuid),
                label=dev.label,
                uuid=dev.uuid,
                name=dev.name,
                window_s=window_s,
                now_s=now_s,
                highlight=dev.uuid in marked,
                lost_reason=None if dev.available else (dev.error or "unavailable"),
            )
        )
    if not charts:
        return f'<div style="color:{FG2}">No devices.</div>'
    return (
        '<div class="autogpu-charts" style="display:flex;flex-wrap:wrap">'
        + "".join(charts)
        + "</div>"
    )


def render_table(
    snapshot: FleetSnapshot,
    *,
    highlight: Iterable[str] = (),
    own_pids: Iterable[int] = (),
    leases: Sequence[LeaseRecord] = (),
) -> str:
    """A compact table of current values and holders, one row per device.

    Holders are the one holder model's (:mod:`autogpu_jupyter.core.holders`): leases and
    processes, matched by pid, worded as ``%gpu status`` and the sidebar word them.
    """
    marked = set(highlight)
    by_device = holders_by_device(snapshot, leases, own_pids=own_pids)
    cell = f"padding:1px 8px;text-align:left;border-bottom:1px solid {BORDER}"
    # Numbers and labels never break ("74 °C", not "74" / "°C"): only the holders wrap.
    fixed = f"{cell};white-space:nowrap"
    wrap = f"{cell};white-space:normal;overflow-wrap:anywhere"
    head = "".join(
        f'<th style="{fixed}">{h}</th>'
        for h in ("GPU", "util", "memory used / total", "temp", "power", "holders")
    )
    rows = []
    for dev in snapshot.devices:
        style = f"font-weight:600;color:{ACCENT}" if dev.uuid in marked else ""
        label = dev.label + (" (this kernel)" if dev.uuid in marked else "")
        if not dev.available:
            rows.append(
                f'<tr style="{style}"><td style="{fixed}">{_e(label)}</td>'
                f'<td style="{cell};color:{ERROR_COLOR}" colspan="5">lost: '
                f"{_e(dev.error or 'unavailable')}</td></tr>"
            )
            continue
        holders = (
            holders_text(by_device[dev.uuid])
            if dev.processes is not None or any(by_device[dev.uuid])
            else "?"
        )
        temp = "?" if dev.temperature_c is None else f"{dev.temperature_c:.0f} °C"
        power = "?" if dev.power_w is None else f"{dev.power_w:.0f} W"
        values = (
            _e(label),
            _pct(dev.utilization_pct),
            f"{format_bytes(dev.memory_used_bytes)} / {format_bytes(dev.memory_total_bytes)}",
            temp,
            power,
            _e(holders),
        )
        rows.append(
            f'<tr style="{style}">'
            + "".join(
                f'<td style="{wrap if i == len(values) - 1 else fixed}">{v}</td>'
                for i, v in enumerate(values)
            )
            + "</tr>"
        )
    return (
        f'<table class="autogpu-table" style="border-collapse:collapse;font-size:12px;color:{FG};'
        f'font-family:{FONT}"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def render_banner(warnings: Sequence[Overload]) -> str:
    """The overload banner (empty string when there is nothing to warn about)."""
    if not warnings:
        return ""
    items = []
    for w in warnings:
        alt = (
            f"Best alternative: <b>{_e(w.alternative.describe())}</b>; to move there: "
            f"<code>{_e(w.move)}</code>."
            if w.alternative is not None
            else "No better device right now."
        )
        items.append(
            f'<div class="autogpu-overload" data-uuid="{_e(w.uuid)}">&#9888; '
            f"<b>{_e(w.label)} (this kernel's GPU) is overloaded</b>: {_e('; '.join(w.causes))}, "
            f"caused by {_e(w.others_text())}. {alt}</div>"
        )
    return (
        f'<div class="autogpu-banner" role="alert" style="border:1px solid {MEM_COLOR};'
        f"border-left:6px solid {MEM_COLOR};background:{WARN_BG};color:{FG};padding:6px 10px;"
        f'border-radius:4px;font-family:{FONT};font-size:13px">{"".join(items)}</div>'
    )


def render_error(message: str) -> str:
    """A prominent error box: why the panel has no GPU data at all (a bad fleet file, no driver).

    Shown where the charts would be, so that the reason is the first thing a user reads rather
    than "No GPU picked yet" with the cause in small grey text.
    """
    return (
        f'<div class="autogpu-error" role="alert" style="border:1px solid {ERROR_COLOR};'
        f"border-left:6px solid {ERROR_COLOR};background:rgba(211, 47, 47, 0.10);color:{FG};"
        f'padding:6px 10px;border-radius:4px;font-family:{FONT};font-size:13px">'
        f"&#10006; <b>autogpu cannot read the GPUs</b>: {_e(message)}</div>"
    )


def render_header(
    devices: Sequence[DeviceSnapshot],
    kernel_uuids: Sequence[str],
    *,
    lease_text: str | None = None,
    simulated: bool = False,
    pick_command: str = "%gpu pick --min-free 10G",
) -> str:
    """The header: this kernel's device(s) and lease, or how to pick; a "simulated" badge."""
    badge = (
        f' <span class="autogpu-simulated" style="background:{MEM_COLOR};color:#fff;'
        f'border-radius:3px;padding:0 5px;font-size:11px;font-weight:600">simulated</span>'
        if simulated
        else ""
    )
    if kernel_uuids:
        by_uuid = {d.uuid: d for d in devices}
        names = []
        for u in kernel_uuids:
            d = by_uuid.get(u)
            names.append(f"{d.label} · {d.name} · {d.short_uuid}" if d else u)
        text = "This kernel: " + _e("; ".join(names))
        text += f" — lease {_e(lease_text)}" if lease_text else " — no lease"
    else:
        text = f"No GPU picked yet — run <code>{_e(pick_command)}</code>"
    return (
        f'<div class="autogpu-header" style="font-family:{FONT};font-size:13px;color:{FG}">'
        f"<b>autogpu</b>{badge} · {text}</div>"
    )
