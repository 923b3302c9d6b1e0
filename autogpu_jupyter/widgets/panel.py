"""The live GPU panel (``%gpu panel`` or ``autogpu_jupyter.Panel()``), built from ipywidgets only.

Threading rule (design decision 8): the sampler thread calls :meth:`Panel._on_sample`, which only
sets trait values (``HTML.value``); it never displays, prints or uses ``with output:``. Those
value changes reach the frontend as comm messages, also while another cell is busy.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets as w
from IPython import get_ipython
from jupyter_core.paths import jupyter_runtime_dir

from autogpu_jupyter import api
from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core import (
    Overload,
    Sampler,
    Thresholds,
    get_sampler,
    kernel_device_uuids,
    procfs,
    session,
    status_table,
)
from autogpu_jupyter.core import cell_text as visible
from autogpu_jupyter.core import detect_overload as detect
from autogpu_jupyter.core import narrow_table as narrow
from autogpu_jupyter.core import table_text as to_text
from autogpu_jupyter.widgets import chart

if TYPE_CHECKING:
    from autogpu_jupyter.core import FleetSnapshot

__all__ = ["Panel"]

log = logging.getLogger(__name__)

_INTERVALS = (0.5, 1.0, 2.0, 5.0)
_WINDOWS = (60.0, 300.0, 900.0)


def _config() -> Any:
    """The ``AutoGPU`` configurable of this kernel (the one ``%config AutoGPU...`` changes)."""
    ip = get_ipython()
    if ip is not None:
        for c in getattr(ip, "configurables", ()):
            if isinstance(c, AutoGPU):
                return c
        return AutoGPU(parent=ip)
    return AutoGPU()


def _options(values: Sequence[float], current: float, fmt: Any) -> list[tuple[str, float]]:
    vals = sorted({*values, float(current)})
    return [(fmt(v), v) for v in vals]


def _interval_label(v: float) -> str:
    return f"{v:g} s"


def _window_label(v: float) -> str:
    return f"{v / 60:g} min" if v >= 60 else f"{v:g} s"


class Panel(w.VBox):  # type: ignore[misc]
    """Every GPU of this host, live: a chart per device, a table, controls, overload warnings.

    Parameters
    ----------
    window_s
        Seconds of history each chart shows (default 300).
    interval_s
        Sampler interval; default the running sampler's (``AutoGPU.sample_interval_s``).
        The sampler is shared by the whole kernel, so this changes it for every panel.
    thresholds
        Overload thresholds; default from ``AutoGPU.overload_*``.
    sampler
        Default: the process's sampler (:func:`autogpu_jupyter.core.sampler.get_sampler`).
    server_history
        Start the charts with the history the Jupyter server that started this kernel already
        has (its autogpu sampler's, :func:`server_history`), when this kernel's own is shorter
        than the window: a fresh panel then shows the last minutes, not an empty chart.

    Attributes
    ----------
    header, banner, charts, table, status : ipywidgets.HTML
        The parts, whose ``value`` the sampler thread updates.
    warnings : list[Overload]
        The overload warnings shown now.
    update_count : int
        How many times the panel redrew.
    """

    def __init__(
        self,
        window_s: float = 300.0,
        interval_s: float | None = None,
        thresholds: Thresholds | None = None,
        sampler: Sampler | None = None,
        server_history: bool = True,
        **kwargs: Any,
    ) -> None:
        self._sampler = sampler if sampler is not None else get_sampler(interval_s)
        if sampler is not None and interval_s is not None:
            sampler.set_interval(interval_s)
        if window_s > self._sampler.history_s:
            self._sampler.set_history(window_s)
        self.thresholds = thresholds or Thresholds.from_config(_config())
        self.window_s = float(window_s)
        self.warnings: list[Overload] = []
        self.update_count = 0
        self._lock = threading.Lock()
        self._paused = False
        self._drawn: tuple[Any, ...] | None = None  # the inputs of the last drawing
        self._leases: tuple[Any, ...] = ()

        self.header = w.HTML()
        self.banner = w.HTML(layout=w.Layout(display="none"))
        self.charts = w.HTML()
        self.table = w.HTML()
        self.status = w.HTML()
        self.interval = w.Dropdown(
            options=_options(_INTERVALS, self._sampler.interval_s, _interval_label),
            value=self._sampler.interval_s,
            description="interval",
            layout=w.Layout(width="150px"),
            style={"description_width": "52px"},
        )
        self.window = w.Dropdown(
            options=_options(_WINDOWS, self.window_s, _window_label),
            value=self.window_s,
            description="window",
            layout=w.Layout(width="150px"),
            style={"description_width": "52px"},
        )
        self.pause = w.ToggleButton(
            value=False,
            description="pause",
            icon="pause",
            layout=w.Layout(width="90px"),
            tooltip="Freeze this panel (the sampler keeps running for the others)",
        )
        self.interval.observe(self._on_interval, names="value")
        self.window.observe(self._on_window, names="value")
        self.pause.observe(self._on_pause, names="value")
        controls = w.HBox([self.interval, self.window, self.pause, self.status])
        super().__init__(
            children=[self.header, self.banner, self.charts, self.table, controls], **kwargs
        )
        self.add_class("autogpu-panel")
        if self._sampler.latest() is None:
            self._sampler.sample_now()  # draw something at once, from this (main) thread
        if server_history:
            self._seed_from_server()
        self.refresh()
        self._listener = _weak_listener(self)
        self._sampler.subscribe(self._listener)

    # -- controls (run in the kernel's main thread, from comm messages) -----------------------
    def _on_interval(self, change: dict[str, Any]) -> None:
        self._sampler.set_interval(float(change["new"]))
        self.refresh()

    def _on_window(self, change: dict[str, Any]) -> None:
        self.window_s = float(change["new"])
        if self.window_s > self._sampler.history_s:
            self._sampler.set_history(self.window_s)
        self.refresh()

    def _on_pause(self, change: dict[str, Any]) -> None:
        self._paused = bool(change["new"])
        self.pause.description = "resume" if self._paused else "pause"
        self.pause.icon = "play" if self._paused else "pause"
        if not self._paused:
            self.refresh()
        else:
            self.status.value = self._status_text(self._sampler.latest())

    @property
    def sampler(self) -> Sampler:
        return self._sampler

    def _seed_from_server(self) -> None:
        """Fill the sampler's history with the server's, where its own is shorter than the
        window (a kernel that just started); failures only leave the chart as it was."""
        s = self._sampler
        series = s.history_series()
        stamps = [t for x in series.values() for t in (x.timestamps_s[:1].tolist())]
        newest = s.latest()
        if newest is None or not stamps:
            return
        if newest.timestamp_s - min(stamps) >= self.window_s - 2 * s.interval_s:
            return
        added = s.seed(server_history(self.window_s))
        log.debug("panel: %d samples of the server's history", added)

    # -- drawing -------------------------------------------------------------------------------
    def _on_sample(self, sampler: Sampler, snapshot: FleetSnapshot | None) -> None:
        if not self._paused:
            self.refresh()

    def refresh(self) -> None:
        """Redraw every part from the sampler's data (sets ``value`` traits only)."""
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        s = self._sampler
        snapshot = s.latest()
        if snapshot is None:
            self._drawn = None
            self.header.value = chart.render_header((), ())
            errors = s.errors
            # Nothing was ever read: the reason is the news, in the banner, not in grey text.
            self.banner.value = chart.render_error(errors[-1].message) if errors else ""
            self.banner.layout.display = "block" if errors else "none"
            self.charts.value = ""
            self.table.value = ""
            self.status.value = self._status_text(None)
            return
        kernel = kernel_device_uuids(snapshot.devices)
        lease = _lease_text()
        self._leases = _live_leases()
        # Everything drawn below is a function of these: the same inputs (a failed read, a
        # second refresh for the same sample) redraw nothing.
        key = (
            snapshot,
            kernel,
            lease,
            tuple(r.lease_id for r in self._leases),
            self.window_s,
            self.thresholds,
            s.interval_s,
        )
        if key != self._drawn:
            self._draw(snapshot, kernel, lease)
            self._drawn = key
        self.status.value = self._status_text(snapshot)

    def _draw(self, snapshot: FleetSnapshot, kernel: tuple[str, ...], lease: str | None) -> None:
        s = self._sampler
        since = max(self.window_s, self.thresholds.window_s + 3 * s.interval_s)
        history = s.history_series(since_s=since)  # numpy arrays, no DataFrame per redraw
        # this kernel's process holds its lease even before it uses the GPU ("this kernel")
        own = s.latest_own_pids() | {os.getpid()}
        warnings = (
            detect(
                history, snapshot, kernel, own, self.thresholds, smoothed_util=s.smoothed_util(60.0)
            )
            if kernel
            else []
        )
        self.header.value = chart.render_header(
            snapshot.devices, kernel, lease_text=lease, simulated=snapshot.simulated
        )
        self.charts.value = chart.render_charts(
            history,
            snapshot.devices,
            window_s=self.window_s,
            now_s=snapshot.timestamp_s,
            highlight=kernel,
        )
        self.table.value = chart.render_table(
            snapshot, highlight=kernel, own_pids=own, leases=self._leases
        )
        banner = chart.render_banner(warnings)
        self.banner.value = banner
        self.banner.layout.display = "block" if banner else "none"
        # last: whoever sees the new warnings (another thread) sees the banner that shows them
        self.warnings = warnings
        self.update_count += 1

    def _status_text(self, snapshot: FleetSnapshot | None) -> str:
        s = self._sampler
        parts = []
        if snapshot is not None:
            parts.append(
                "sampled " + time.strftime("%H:%M:%S", time.localtime(snapshot.timestamp_s))
            )
        parts.append(f"{s.sample_count} samples")
        if self._paused:
            parts.append("paused")
        errors = s.errors
        if errors and (snapshot is None or errors[-1].timestamp_s >= snapshot.timestamp_s):
            parts.append(f"last read failed: {errors[-1].message}")
        text = " · ".join(parts)
        return (
            f'<span style="color:{chart.FG2};font-size:11px;font-family:{chart.FONT}">'
            f"{chart._e(text)}</span>"
        )

    def text(self, width: int = 100) -> str:
        """The panel as plain text, what a viewer without widgets shows (a headless run, a
        terminal, a notebook viewer): every GPU in a short table, this kernel's marked ``▶``,
        from the sampler's latest sweep (no device is read for it)."""
        snapshot = self._sampler.latest()
        if snapshot is None:
            errors = self._sampler.errors
            why = errors[-1].message if errors else "no sample yet"
            return f"autogpu panel: no GPU data ({visible(why)})"
        kernel = kernel_device_uuids(snapshot.devices)
        frame = api.status_frame(
            snapshot, session.Choice(uuids=kernel) if kernel else None, self._leases
        )
        sim = " — SIMULATED fleet" if snapshot.simulated else ""
        sampled = time.strftime("%H:%M:%S", time.localtime(snapshot.timestamp_s))
        lines = [f"autogpu panel: {len(snapshot.devices)} device(s){sim}, sampled {sampled}"]
        if len(frame):
            columns, rows, _mine = status_table(frame)
            lines.extend(to_text(*narrow(columns, rows, width), width=width))
        labels = [d.label for d in snapshot.devices if d.uuid in kernel]
        lines.append(
            f"this kernel: ▶ {', '.join(labels)}" if labels else "this kernel: no GPU picked"
        )
        lines.extend(visible(o.message()) for o in self.warnings)
        return "\n".join(lines)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any] | None:
        """The widget, and :meth:`text` as its ``text/plain`` (not the widget's repr)."""
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:
            data["text/plain"] = self.text()
        return data  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return self.text()

    def close(self) -> None:
        """Stop updating and close the widgets."""
        self._sampler.unsubscribe(self._listener)
        for child in (
            self.header,
            self.banner,
            self.charts,
            self.table,
            self.status,
            self.interval,
            self.window,
            self.pause,
        ):
            child.close()
        super().close()


def _weak_listener(panel: Panel) -> Any:
    ref = weakref.ref(panel)

    def listener(sampler: Sampler, snapshot: FleetSnapshot | None) -> None:
        p = ref()
        if p is None:
            sampler.unsubscribe(listener)
            return
        p._on_sample(sampler, snapshot)

    return listener


def _live_leases() -> tuple[Any, ...]:
    """The registry's live leases (for the holders column); none when it cannot be read."""
    return tuple(api.live_leases())


def _lease_text() -> str | None:
    choice = session.current()
    if choice is None:
        return None
    if choice.lease_id:
        return str(choice.lease_id)
    return None


#: How long a panel waits for the server's history before drawing without it.
SERVER_HISTORY_TIMEOUT_S = 1.5
#: The most bytes of a history answer read (900 samples of 64 devices fit many times over).
_MAX_HISTORY_BYTES = 16 << 20


def _server_info(runtime_dir: str | None = None, max_depth: int = 4) -> dict[str, Any] | None:
    """The ``jpserver-<pid>.json`` of the Jupyter server that started this kernel (this process
    or one of its ancestors, a few levels up): its URL and token, from this user's private
    runtime directory. ``None`` outside a server's kernel."""
    if runtime_dir is None:
        runtime_dir = jupyter_runtime_dir()
    pid: int | None = os.getppid()
    for _ in range(max_depth):
        if pid is None or pid <= 1:
            return None
        path = os.path.join(runtime_dir, f"jpserver-{pid}.json")
        try:
            with open(path, encoding="utf-8") as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            pid = procfs.ppid(pid)
            continue
        return info if isinstance(info, dict) else None
    return None


def server_history(
    window_s: float, *, info: dict[str, Any] | None = None, timeout_s: float | None = None
) -> dict[str, Any]:
    """The last ``window_s`` seconds of the history the Jupyter server that started this kernel
    already has (``GET {base_url}autogpu/api/v1/history``, its shared sampler's), as
    :meth:`~autogpu_jupyter.core.sampler.Sampler.seed` takes it. Empty when there is no such
    server, it has no autogpu extension, or it does not answer in time (TLS with a private
    certificate, a Unix socket, a proxy): the panel then starts with this kernel's own samples.
    """
    info = _server_info() if info is None else info
    if not info:
        return {}
    url, token = info.get("url"), info.get("token")
    if not isinstance(url, str) or not url.startswith("http://") or info.get("sock"):
        return {}
    since = time.time() - float(window_s) - 5.0
    query = urllib.parse.urlencode({"since": f"{since:.3f}"})
    # http:// only (checked above): the server's own URL from its runtime file
    base = url if url.endswith("/") else url + "/"
    request = urllib.request.Request(  # noqa: S310
        urllib.parse.urljoin(base, f"autogpu/api/v1/history?{query}"),
        headers={"Authorization": f"token {token}"} if isinstance(token, str) and token else {},
    )
    try:
        with urllib.request.urlopen(  # noqa: S310
            request, timeout=SERVER_HISTORY_TIMEOUT_S if timeout_s is None else timeout_s
        ) as resp:
            data = json.loads(resp.read(_MAX_HISTORY_BYTES + 1)[:_MAX_HISTORY_BYTES])
    except (OSError, ValueError, urllib.error.URLError) as err:
        log.debug("no server history: %s", err)
        return {}
    out: dict[str, Any] = {}
    for entry in data.get("series", []) if isinstance(data, dict) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("uuid"), str):
            continue
        ts, util, used = (entry.get(k) for k in
                          ("timestamp_s", "utilization_pct", "memory_used_bytes"))
        if isinstance(ts, list) and isinstance(util, list) and isinstance(used, list):
            out[entry["uuid"]] = (ts, util, used, entry.get("memory_total_bytes"))
    return out
