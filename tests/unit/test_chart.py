"""Pure rendering and overload detection: history (arrays or DataFrame) / snapshots in, exact
text out; and the panel redraws only when what it draws from changed."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.overload import Overload, Thresholds, detect
from autogpu_jupyter.core.sampler import METRICS, DeviceSeries, series_from_frame
from autogpu_jupyter.widgets import chart

GiB = 1024**3
A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
C = "GPU-cccccccc-0000-0000-0000-000000000000"


def _snapshot(util_a: float = 97.0, mem_a_gib: int = 60, *, mine: bool = False) -> FleetSnapshot:
    procs = (ProcessSnapshot(pid=4242, used_memory_bytes=mem_a_gib * GiB, user="bob"),)
    if mine:
        procs = (ProcessSnapshot(pid=77, used_memory_bytes=mem_a_gib * GiB),)
    a = DeviceSnapshot(
        index=0,
        uuid=A,
        name="A100",
        memory_total_bytes=80 * GiB,
        memory_used_bytes=mem_a_gib * GiB,
        memory_free_bytes=(80 - mem_a_gib) * GiB,
        utilization_pct=util_a,
        temperature_c=60,
        power_w=300.0,
        processes=procs,
    )
    b = DeviceSnapshot(
        index=1,
        uuid=B,
        name="A100",
        memory_total_bytes=80 * GiB,
        memory_used_bytes=1 * GiB,
        memory_free_bytes=79 * GiB,
        utilization_pct=2.0,
        processes=(),
    )
    c = DeviceSnapshot(
        index=2, uuid=C, name="A100", available=False, error="GPU is lost", processes=None
    )
    return FleetSnapshot(devices=(a, b, c), timestamp_s=100.0, backend="simulated", simulated=True)


def _frame(utils_a: list[float], mem_a_gib: int = 60) -> pd.DataFrame:
    rows = []
    for i, u in enumerate(utils_a):
        t = 100.0 - (len(utils_a) - 1 - i) * 10
        for uuid, util, used in ((A, u, mem_a_gib * GiB), (B, 2.0, GiB)):
            rows.append(
                {
                    "timestamp_s": t,
                    "uuid": uuid,
                    "label": "",
                    "utilization_pct": util,
                    "memory_used_bytes": float(used),
                    "memory_total_bytes": float(80 * GiB),
                }
            )
        rows.append({"timestamp_s": t, "uuid": C, "label": "GPU 2", "available": 0.0})
    df = pd.DataFrame(rows)
    for m in METRICS:
        if m not in df:
            df[m] = float("nan")
    return df


def test_chart_per_device_with_kernel_highlight_and_lost() -> None:
    snap = _snapshot()
    html = chart.render_charts(_frame([50, 97]), snap.devices, window_s=60, highlight=[A])
    assert html.count("<svg") == 3
    assert f'data-uuid="{A}" data-kernel="1"' in html
    assert f'data-uuid="{B}" data-kernel="0"' in html
    assert "this kernel</span>" in html
    assert "lost: GPU is lost" in html
    assert "util 97%" in html and "mem 75%" in html
    assert "var(--jp-ui-font-color1, #1f1f1f)" in html
    assert 'fill="' not in html  # colours through style= so CSS variables resolve
    # utilisation 50 at t=90 (x = 30 + 264 * (1 - 10/60) = 250), 97 at t=100 (x = 294)
    assert 'class="autogpu-util" d="M250.0,44.0 L294.0,10.2"' in html


def test_unknown_values_break_the_line() -> None:
    html = chart.render_device_chart(
        _frame([50, float("nan"), 70])[lambda d: d["uuid"] == A],
        label="GPU 0",
        uuid=A,
        window_s=60,
        now_s=100.0,
    )
    assert 'class="autogpu-util" d="M206.0,44.0 M294.0,29.6"' in html
    assert "util 70%" in html


def test_table_and_header() -> None:
    snap = _snapshot()
    table = chart.render_table(snap, highlight=[A])
    assert "GPU 0 (this kernel)" in table
    assert '<td style="padding:1px 8px;text-align:left;border-bottom:1px solid ' in table
    assert "97%" in table and "60.0 GiB / 80.0 GiB" in table
    assert re.search(r"bob: pid \d+ \(60\.0 GiB used\)", table)
    assert "lost: GPU is lost" in table
    header = chart.render_header(snap.devices, [A], lease_text="lease-1", simulated=True)
    assert "This kernel: GPU 0 · A100 · GPU-aaaaaaaa — lease lease-1" in header
    assert ">simulated</span>" in header
    none = chart.render_header(snap.devices, [])
    assert "No GPU picked yet — run <code>%gpu pick --min-free 10G</code>" in none
    assert "simulated" not in none


def test_sustained_load_by_others_warns_with_alternative() -> None:
    th = Thresholds(util_pct=90, window_s=20, memory_pct=95)
    warnings = detect(_frame([50, 95, 96, 97]), _snapshot(), [A], own_pids=[77], thresholds=th)
    assert [w.message() for w in warnings] == [
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 96% for 20s (over 90%), "
        "caused by 1 other process holding 60.0 GiB (user bob). Best alternative: move to GPU 1 "
        "(79.0 GiB free, 2% busy): restart the kernel and run %gpu pick."
    ]
    banner = chart.render_banner(warnings)
    assert "<b>GPU 1 (79.0 GiB free, 2% busy)</b>" in banner
    assert "<code>restart the kernel and run %gpu pick</code>" in banner


def test_short_load_own_load_and_unknown_do_not_warn() -> None:
    th = Thresholds(util_pct=90, window_s=20, memory_pct=95)
    # above for only 10 s
    assert detect(_frame([50, 50, 96, 97]), _snapshot(), [A], [77], th) == []
    # a gap of unknown utilisation breaks the stretch
    assert detect(_frame([95, float("nan"), 96, 97]), _snapshot(), [A], [77], th) == []
    # the load is this kernel's own
    assert detect(_frame([95, 96, 97, 97]), _snapshot(mine=True), [A], [77], th) == []
    # no device picked
    assert detect(_frame([95, 96, 97, 97]), _snapshot(), [], [77], th) == []
    assert chart.render_banner([]) == ""


def test_memory_nearly_full_by_others_warns_at_once() -> None:
    th = Thresholds(util_pct=90, window_s=30, memory_pct=95)
    w = detect(_frame([5], 78), _snapshot(5.0, 78), [A], [77], th)
    assert len(w) == 1
    assert w[0].causes == ("memory 98% full (over 95%)",)
    assert w[0].others_text() == "1 other process holding 78.0 GiB (user bob)"


def test_charts_from_arrays_equal_charts_from_the_frame() -> None:
    snap = _snapshot()
    frame = _frame([50, float("nan"), 95, 97])
    series = series_from_frame(frame)
    assert set(series) == {A, B, C}
    from_arrays = chart.render_charts(series, snap.devices, window_s=60, highlight=[A])
    assert from_arrays == chart.render_charts(frame, snap.devices, window_s=60, highlight=[A])
    # utilisation 50 at t=70 (x = 162), unknown at t=80, 95 and 97 at t=90 and t=100
    assert 'class="autogpu-util" d="M162.0,44.0 M250.0,11.6 L294.0,10.2"' in from_arrays
    # memory 75% all along: a flat line keeps its ends only
    assert 'class="autogpu-mem" d="M162.0,26.0 L294.0,26.0"' in from_arrays
    # GPU 1: 2% utilisation, memory 1 of 80 GiB
    assert 'class="autogpu-util" d="M162.0,78.6 L294.0,78.6"' in from_arrays
    assert "mem 1%" in from_arrays


def test_samples_outside_the_window_are_left_out() -> None:
    series = series_from_frame(_frame([10, 20, 30, 40]))[A]
    html = chart.render_device_chart(series, label="GPU 0", uuid=A, window_s=15, now_s=100.0)
    # t=70 and t=80 are older than 15 s: the line starts at t=90 (x = 30 + 264 * (1 - 10/15))
    assert 'class="autogpu-util" d="M118.0,58.4 L294.0,51.2"' in html
    assert ">-15 s</text>" in html


def _panel_fleet(util_a: float, *, broken: bool = False) -> dict[str, Any]:
    return {
        "devices": [
            {
                "uuid": A,
                "name": "A100",
                "memory_total": "lots" if broken else 80 * GiB,
                "utilization_pct": util_a,
                "memory_used": 60 * GiB,
                "processes": [{"pid": 4242, "user": "bob", "used_memory": 60 * GiB}],
            },
            {"uuid": B, "name": "A100", "memory_total": 80 * GiB, "utilization_pct": 2},
        ]
    }


def test_panel_redraws_only_when_its_inputs_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", A)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(97)))
    now = [1_000_000.0]
    clock = lambda: now[0]  # noqa: E731
    s = Sampler(SimulatedBackend(str(path), clock=clock), history_s=900.0, clock=clock)
    panel = Panel(window_s=60, sampler=s, thresholds=Thresholds(90, 2, 95))
    try:
        assert panel.update_count == 1  # drawn at once, from its first sample
        assert panel.charts.value.count("<svg") == 2
        assert f'data-uuid="{A}" data-kernel="1"' in panel.charts.value
        charts = panel.charts.value
        panel.refresh()  # the same inputs: nothing is redrawn
        assert panel.update_count == 1
        # a failed read changes the status line only
        path.write_text(json.dumps(_panel_fleet(97, broken=True)))
        assert s.sample_now() is None
        assert panel.update_count == 1 and panel.charts.value == charts
        assert (
            f"last read failed: fleet file &#x27;{path}&#x27;, device 0 ({A}) memory_total: "
            "invalid size &#x27;lots&#x27;"
        ) in panel.status.value
        # new samples redraw; 97% for 2 s warns
        path.write_text(json.dumps(_panel_fleet(97)))
        for _ in range(2):
            now[0] += 1
            s.sample_now()
        assert panel.update_count == 3
        assert panel.charts.value != charts
        # three samples of 97% over the last 2 s of 60: one flat line, its middle point left out
        assert 'class="autogpu-util" d="M285.2,10.2 L294.0,10.2"' in panel.charts.value
        assert [w.causes for w in panel.warnings] == [("utilisation 97% for 2s (over 90%)",)]
        assert "<b>GPU 0 (this kernel's GPU) is overloaded</b>" in panel.banner.value
        # paused: samples go on, the panel stays as it is
        panel.pause.value = True
        now[0] += 1
        path.write_text(json.dumps(_panel_fleet(10)))
        s.sample_now()
        assert panel.update_count == 3 and "paused" in panel.status.value
        assert panel.warnings != []
        panel.pause.value = False  # resuming draws the newest sample at once
        assert panel.update_count == 4 and panel.warnings == []
        assert panel.banner.value == "" and panel.banner.layout.display == "none"
        panel.window.value = 300.0
        assert panel.update_count == 5 and ">-5 min</text>" in panel.charts.value
        panel.window.value = 300.0  # unchanged: no redraw
        assert panel.update_count == 5
    finally:
        panel.close()
    assert s.listener_count == 0


def test_panel_says_the_last_read_failed_only_until_a_newer_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clock moves between the good sample, the failure and the next good sample (with a
    frozen clock all three have one time, and either order of the comparison shows the failure).
    Caught: the "last read failed" comparison inverted (an old failure shown, a current one
    hidden)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    now = [1_000_000.0]
    clock = lambda: now[0]  # noqa: E731
    s = Sampler(SimulatedBackend(str(path), clock=clock), history_s=900.0, clock=clock)
    panel = Panel(window_s=60, sampler=s, thresholds=Thresholds(90, 2, 95))
    try:
        assert "last read failed" not in panel.status.value
        now[0] += 1
        path.write_text(json.dumps(_panel_fleet(10, broken=True)))
        assert s.sample_now() is None
        assert "1 samples · last read failed: fleet file" in panel.status.value
        now[0] += 1
        path.write_text(json.dumps(_panel_fleet(10)))
        assert s.sample_now() is not None
        sampled = time.strftime("%H:%M:%S", time.localtime(now[0]))
        assert panel.status.value.endswith(f">sampled {sampled} · 2 samples</span>")
    finally:
        panel.close()


#: Text other users control (a notebook path, a process's user or command line, a fleet file's
#: model name or path): markup that must arrive as text.
HOSTILE = '<img src=x onerror="alert(1)">&'
HOSTILE_E = "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;"


def test_every_part_of_the_panel_escapes_what_others_wrote() -> None:
    """Caught: the escape dropped from the holders cell, the overload banner's causes and
    holders, the error box, the header's device names (each one on its own)."""
    from autogpu_jupyter.core.leasing.records import LeaseRecord
    from autogpu_jupyter.core.overload import Overload

    a = DeviceSnapshot(
        index=0, uuid=A, name=f"A100 {HOSTILE}", memory_total_bytes=80 * GiB,
        memory_used_bytes=60 * GiB, memory_free_bytes=20 * GiB, utilization_pct=97.0,
        processes=(ProcessSnapshot(pid=4242, used_memory_bytes=60 * GiB, user=HOSTILE),),
    )
    lost = DeviceSnapshot(index=1, uuid=B, name="L4", available=False, error=HOSTILE)
    snap = FleetSnapshot((a, lost), 1_000_000.0, "simulated", simulated=True)
    lease = LeaseRecord(
        lease_id="l1", kind="lease", device_uuids=(A,), device_requested_bytes=(GiB,),
        exclusive=False, user="mallory", uid=4321, host="h", pid=4243, created_s=1.0,
        kernel_id="k", notebook_path=HOSTILE,
    )
    table = chart.render_table(snap, leases=[lease])
    header = chart.render_header(snap.devices, (A,), lease_text=HOSTILE)
    error = chart.render_error(f"fleet file {HOSTILE!r} is not valid JSON")
    warning = Overload(
        uuid=A, label="GPU 0", causes=(f"utilisation 97% by {HOSTILE}",),
        other_process_count=1, other_memory_bytes=None, users=(HOSTILE,), alternative=None,
        move="%gpu move --best",
    )
    banner = chart.render_banner([warning])
    for part in (table, header, error, banner):
        assert "<img" not in part
        assert HOSTILE_E in part


def test_a_panels_window_grows_the_shared_history_and_never_shrinks_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler is the kernel's, shared by every panel: a panel needing a longer window makes
    it keep more history; a shorter one leaves it alone (another panel may show 15 minutes).
    Caught: the comparison flipped (a 1-minute panel would cut every other panel's history)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    s = Sampler(SimulatedBackend(str(path)), history_s=120.0)
    panel = Panel(window_s=60, sampler=s)
    try:
        assert s.history_s == 120.0
        panel.window.value = 300.0
        assert s.history_s == 300.0
        panel.window.value = 60.0
        assert s.history_s == 300.0
        other = Panel(window_s=900, sampler=s)
        other.close()
        assert s.history_s == 900.0
    finally:
        panel.close()


def test_the_table_names_its_columns_and_tells_no_holders_from_unknown_holders() -> None:
    """A device whose process list was read and is empty has no holders ("nobody"); one whose
    list could not be read (None) has unknown ones ("?"). Only the holders cell wraps. Caught
    (mutation run, issue 22): the two cases swapped, a column's name changed, the holders
    cell's wrapping style lost."""
    gib = 1024**3

    def dev(index: int, processes: Any) -> DeviceSnapshot:
        return DeviceSnapshot(index=index, uuid=f"GPU-{index}", name="A100",
                              memory_total_bytes=80 * gib, memory_used_bytes=0,
                              memory_free_bytes=80 * gib, utilization_pct=0.0,
                              processes=processes)

    table = chart.render_table(FleetSnapshot((dev(0, ()), dev(1, None)), 1.0, "simulated"))
    heads = re.findall(r"<th style=\"[^\"]*white-space:nowrap\">([^<]*)</th>", table)
    assert heads == ["GPU", "util", "memory used / total", "temp", "power", "holders"]
    holders = re.findall(r'white-space:normal;overflow-wrap:anywhere">([^<]*)</td></tr>', table)
    assert holders == ["nobody", "?"]


def test_the_panel_names_this_kernels_lease_in_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a pick with a lease, the panel's header says which lease this kernel holds (the
    id an admin revokes by). Caught: the lease's id lost (a survivor of the sampled mutation
    run: the header said "lease None")."""
    from autogpu_jupyter import api
    from autogpu_jupyter.config import default_settings
    from autogpu_jupyter.core import session
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets.panel import Panel

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    result, _warning = api.pick_result(api.pick_options(default_settings(), {}))
    try:
        assert result.lease is not None
        lease_id = result.lease.record.lease_id
        s = Sampler(SimulatedBackend(str(path)), history_s=900.0)
        panel = Panel(window_s=60, sampler=s)
        try:
            assert f" — lease {lease_id}" in panel.header.value
            assert "lease None" not in panel.header.value
        finally:
            panel.close()
    finally:
        session.release()


def test_a_chart_has_a_thin_border_and_the_kernels_chart_an_accent_one() -> None:
    """Caught (mutation run, issue 22): the border's style lost (``border:None``)."""
    series = series_from_frame(_frame([50, 97]))
    plain = chart.render_device_chart(series[B], label="GPU 1", uuid=B, window_s=60, now_s=100.0)
    mine = chart.render_device_chart(
        series[A], label="GPU 0", uuid=A, window_s=60, now_s=100.0, highlight=True
    )
    assert plain.startswith(
        f'<div class="autogpu-device" data-uuid="{B}" style="border:1px solid '
        'var(--jp-border-color2, #c8c8c8);border-radius:4px;'
    )
    assert mine.startswith(
        f'<div class="autogpu-device" data-uuid="{A}" style="border:2px solid '
        'var(--jp-brand-color1, #1976d2);border-radius:4px;'
    )


def test_a_device_with_no_memory_at_all_shows_unknown_memory_and_no_numpy_warning() -> None:
    """0 of 0 bytes is unknown memory, not 0 %, and numpy's "invalid value encountered in
    divide" is not printed under the user's cell. Caught (mutation run, issue 22): the
    ``invalid="ignore"`` of the division's errstate lost."""
    frame = _frame([50, 97], mem_a_gib=0)
    frame.loc[frame["uuid"] == A, "memory_total_bytes"] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        html = chart.render_device_chart(
            series_from_frame(frame)[A], label="GPU 0", uuid=A, window_s=60, now_s=100.0
        )
    assert "mem ?</span>" in html
    assert 'class="autogpu-mem"' not in html  # no line at all: unknown is not zero
    assert 'class="autogpu-util" d="M250.0,44.0 L294.0,10.2"' in html


def test_a_sample_newer_than_now_is_drawn_at_now_not_past_the_frame() -> None:
    """``now_s`` is the caller's (render_charts takes one): a sample after it sits on the right
    edge. Caught (mutation run, issue 22): the age's lower clip dropped (x = 316, outside the
    frame)."""
    series = series_from_frame(_frame([50, 97]))[A]  # t=90 and t=100
    html = chart.render_device_chart(series, label="GPU 0", uuid=A, window_s=60, now_s=95.0)
    # t=90 is 5 s old (x = 30 + 264 * (1 - 5/60) = 272); t=100 clamps to now (x = 294)
    assert 'class="autogpu-util" d="M272.0,44.0 L294.0,10.2"' in html


@pytest.mark.parametrize(
    ("window_s", "text"),
    [
        (60.0, "1 min"), (300.0, "5 min"), (900.0, "15 min"), (120.0, "2 min"),
        (61.0, "61 s"), (90.0, "90 s"), (30.0, "30 s"), (0.5, "0.5 s"),
    ],
)
def test_the_x_axis_says_whole_minutes_in_minutes_and_the_rest_in_seconds(
    window_s: float, text: str
) -> None:
    """Caught (mutation run, issue 22): ``% 60 == 0`` made ``== 1`` (61 s said "1 min", 5 min
    said "300 s"), ``// 60`` made ``// 61`` ("4 min" for 5). The frame is cached per window
    (``_grid``): a label drawn earlier in this process would hide a changed text, so clear it."""
    chart._grid.cache_clear()
    html = chart.render_device_chart(
        DeviceSeries.empty(A), label="GPU 0", uuid=A, window_s=window_s, now_s=100.0
    )
    assert f">-{text}</text>" in html


def test_the_charts_sit_in_one_wrapping_row_each_titled_with_its_model() -> None:
    """Caught (mutation run, issue 22): the row's markup changed, the model's name lost from a
    chart's title ("None")."""
    snap = _snapshot()
    html = chart.render_charts(_frame([50, 97]), snap.devices, window_s=60)
    assert html.startswith(
        '<div class="autogpu-charts" style="display:flex;flex-wrap:wrap">'
        f'<div class="autogpu-device" data-uuid="{A}" '
    )
    assert html.endswith("</div></div></div>")
    titles = re.findall(r'<span style="[^"]*" title="([^"]*)">([^<]*)</span>', html)
    assert titles == [(A, "A100"), (B, "A100"), (C, "A100")]


def test_a_table_row_is_one_cell_per_column_with_temperature_and_power_in_units() -> None:
    """Caught (mutation run, issue 22): the power cell lost ("None"), text put between the
    cells."""
    border = "border-bottom:1px solid var(--jp-border-color2, #c8c8c8)"
    fixed = f"padding:1px 8px;text-align:left;{border};white-space:nowrap"
    wrap = f"padding:1px 8px;text-align:left;{border};white-space:normal;overflow-wrap:anywhere"

    def row(*cells: str) -> str:
        tds = [f'<td style="{fixed}">{c}</td>' for c in cells[:-1]]
        return '<tr style="">' + "".join(tds) + f'<td style="{wrap}">{cells[-1]}</td></tr>'

    table = chart.render_table(_snapshot())
    assert row("GPU 0", "97%", "60.0 GiB / 80.0 GiB", "60 °C", "300 W",
               "bob: pid 4242 (60.0 GiB used)") in table
    # GPU 1 has no temperature or power reading
    assert row("GPU 1", "2%", "1.0 GiB / 80.0 GiB", "?", "?", "nobody") in table


def _clocked_sampler(path: Path, now: list[float]) -> Any:
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.sampler import Sampler

    clock = lambda: now[0]  # noqa: E731
    return Sampler(SimulatedBackend(str(path), clock=clock), history_s=900.0, clock=clock)


def test_the_panels_interval_sets_the_samplers_and_pause_says_what_pressing_it_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught (mutation run, issue 22): the interval dropdown's observer lost (the sampler kept
    its interval), the pause button still saying "pause" while paused, its icon on resuming
    "PAUSE" (no such Font Awesome icon: no icon)."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    s = _clocked_sampler(path, [1_000_000.0])
    panel = Panel(window_s=60, sampler=s, server_history=False)
    try:
        assert (panel.pause.description, panel.pause.icon) == ("pause", "pause")
        assert s.interval_s == 1.0 and panel.update_count == 1
        panel.interval.value = 2.0
        assert s.interval_s == 2.0
        assert panel.update_count == 2  # redrawn: the look-back depends on the interval
        panel.pause.value = True
        assert (panel.pause.description, panel.pause.icon) == ("resume", "play")
        panel.pause.value = False
        assert (panel.pause.description, panel.pause.icon) == ("pause", "pause")
    finally:
        panel.close()


def test_a_panel_over_a_simulated_fleet_says_simulated_in_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught (mutation run, issue 22): the snapshot's ``simulated`` not passed to the header
    (a made-up fleet drawn as if it were the host's GPUs)."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    panel = Panel(window_s=60, sampler=_clocked_sampler(path, [1_000_000.0]),
                  server_history=False)
    try:
        assert '<b>autogpu</b> <span class="autogpu-simulated" ' in panel.header.value
        assert ">simulated</span> · No GPU picked yet" in panel.header.value
    finally:
        panel.close()


def test_a_panel_on_a_host_without_gpus_says_no_devices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A readable fleet of no devices has no history to compare with the server's: the panel
    draws "No devices." (server_history on, the default). Caught (mutation run, issue 22):
    ``or`` made ``and`` in the seeding's guard (``min()`` of no timestamps: the panel raised)."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"devices": []}))
    panel = Panel(window_s=60, sampler=_clocked_sampler(path, [1_000_000.0]))
    try:
        assert panel.charts.value == (
            '<div style="color:var(--jp-ui-font-color2, #616161)">No devices.</div>'
        )
        assert panel.update_count == 1
    finally:
        panel.close()


def test_the_panels_overload_banner_looks_back_over_the_panels_window_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redraw reads the history it shows (the window, or the overload window plus three
    samples when longer), not the sampler's whole history: a load older than that is not
    counted in the banner's "for ...". Caught (mutation run, issue 22): the look-back dropped
    (the whole 5 minutes of history read at every redraw)."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", A)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(97)))
    now = [1_000_000.0]
    s = _clocked_sampler(path, now)
    for _ in range(31):  # 97 % for 300 s, a sample each 10 s
        s.sample_now()
        now[0] += 10
    panel = Panel(window_s=60, sampler=s, thresholds=Thresholds(90, 20, 95),
                  server_history=False)
    try:
        assert [w.causes for w in panel.warnings] == [("utilisation 97% for 1m (over 90%)",)]
    finally:
        panel.close()


def test_a_point_between_two_different_values_is_kept() -> None:
    """Only the inner points of a flat run are left out: a point whose neighbours are known but
    whose value differs from theirs stays. Caught (mutation run, issue 22): ``&`` made ``|`` in
    the flat-run test (every point after a known one dropped: a bend drawn as a straight line)."""
    series = series_from_frame(_frame([10, 50, 90]))[A]  # t=80, 90, 100
    html = chart.render_device_chart(series, label="GPU 0", uuid=A, window_s=60, now_s=100.0)
    assert 'class="autogpu-util" d="M206.0,72.8 L250.0,44.0 L294.0,15.2"' in html
    assert 'class="autogpu-mem" d="M206.0,26.0 L294.0,26.0"' in html  # flat: ends only


def test_rows_out_of_time_order_are_kept_by_their_time_inside_the_window() -> None:
    """Rows not in time order (a frame sorted otherwise) are filtered by their timestamps, not
    cut at a position found by binary search. Caught (mutation run, issue 22): the order check
    ``ts[:-1] <= ts[1:]`` made ``ts[:+1] <= ts[1:]`` (only the first row compared: the t=100
    point lost), the window's start ``now - window`` made ``now + window`` (nothing drawn)."""
    s = series_from_frame(_frame([10, 20, 30, 40, 50]))[A]  # t=60, 70, 80, 90, 100
    order = [0, 4, 1, 3, 2]  # t=60, 100, 70, 90, 80: the oldest first, the rest shuffled
    rows = DeviceSeries(A, s.timestamps_s[order], s.values[order])
    html = chart.render_device_chart(rows, label="GPU 0", uuid=A, window_s=25, now_s=100.0)
    # t=100, 90 and 80 are inside the last 25 s (in the rows' order); t=60 and t=70 are not
    assert 'class="autogpu-util" d="M294.0,44.0 L188.4,51.2 L82.8,58.4"' in html


def test_the_panels_controls_show_the_samplers_interval_and_the_window_with_their_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both dropdowns open on the current values, their labels given the same width, and the
    pause button says what it does. Caught (mutation run, issue 22): the interval dropdown's
    value lost (None: nothing selected), the window dropdown's label width lost, the pause
    button's tooltip upper-cased; (seed 53) the window dropdown's label reworded, the interval
    dropdown's width lost."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    s = _clocked_sampler(path, [1_000_000.0])
    s.set_interval(5.0)
    panel = Panel(window_s=60, sampler=s, server_history=False)
    try:
        assert (panel.interval.value, panel.interval.label) == (5.0, "5 s")
        assert (panel.window.value, panel.window.label) == (60.0, "1 min")
        assert panel.interval.style.description_width == "52px"
        assert panel.window.style.description_width == "52px"
        assert (panel.interval.description, panel.window.description) == ("interval", "window")
        assert panel.interval.layout.width == panel.window.layout.width == "150px"
        assert panel.pause.tooltip == (
            "Freeze this panel (the sampler keeps running for the others)"
        )
    finally:
        panel.close()


def test_a_panel_shows_five_minutes_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default window is one of the dropdown's own choices, 5 min, and the charts' x axis
    says so. Caught (issue 22, seed 54): a default of 301 s (an odd extra choice, "-301 s")."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    panel = Panel(sampler=_clocked_sampler(path, [1_000_000.0]), server_history=False)
    try:
        assert (panel.window_s, panel.window.value, panel.window.label) == (300.0, 300.0, "5 min")
        assert [label for label, _v in panel.window.options] == ["1 min", "5 min", "15 min"]
        assert ">-5 min</text>" in panel.charts.value
    finally:
        panel.close()


def test_a_panel_whose_first_read_failed_shows_the_error_and_no_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No sample at all: the reason in the banner, empty charts and table. Caught (mutation
    run, issue 22): the table's value set to "XXXX" instead of emptied."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10, broken=True)))
    panel = Panel(window_s=60, sampler=_clocked_sampler(path, [1_000_000.0]),
                  server_history=False)
    try:
        assert panel.sampler.latest() is None
        assert "<b>autogpu cannot read the GPUs</b>: fleet file" in panel.banner.value
        assert panel.banner.layout.display == "block"
        assert (panel.charts.value, panel.table.value) == ("", "")
    finally:
        panel.close()


def test_after_the_clock_stepped_back_the_panels_charts_end_at_the_newest_samples_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The charts' "now" is the newest snapshot's time, not the largest timestamp in the history:
    after the system clock stepped back 10 s, the sample stamped before the step sits on the
    right edge (as a sample newer than now does). Caught (mutation run, issue 22): the panel's
    ``now_s=snapshot.timestamp_s`` dropped (the newest sample drawn 10 s in the past)."""
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(97)))
    now = [1_000_000.0]
    s = _clocked_sampler(path, now)
    s.sample_now()
    now[0] -= 10  # the clock steps back
    path.write_text(json.dumps(_panel_fleet(10)))
    s.sample_now()
    panel = Panel(window_s=60, sampler=s, server_history=False)
    try:
        # 97 % stamped 10 s after "now" clamps to x = 294; 10 % is now (x = 294)
        assert 'class="autogpu-util" d="M294.0,10.2 L294.0,72.8"' in panel.charts.value
        assert "util 10%" in panel.charts.value
    finally:
        panel.close()


def test_the_panels_table_names_the_registrys_leases_as_holders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease of another user on a GPU its process does not use yet is a holder in the
    table. Caught (mutation run, issue 22): the live leases not passed to the table (the
    leased GPU said "none")."""
    from autogpu_jupyter import api
    from autogpu_jupyter.core.leasing.records import LeaseRecord
    from autogpu_jupyter.widgets.panel import Panel

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    lease = LeaseRecord(
        lease_id="l1", kind="lease", device_uuids=(B,), device_requested_bytes=(10 * GiB,),
        exclusive=False, user="mallory", uid=4321, host="h", pid=4243, created_s=1.0,
        kernel_id="k", notebook_path="train.ipynb",
    )
    monkeypatch.setattr(api, "live_leases", lambda: [lease])
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10)))
    panel = Panel(window_s=60, sampler=_clocked_sampler(path, [1_000_000.0]),
                  server_history=False)
    try:
        assert re.findall(r'overflow-wrap:anywhere">([^<]*)</td></tr>', panel.table.value) == [
            "bob: pid 4242 (60.0 GiB used)",
            "mallory: train.ipynb (10.0 GiB booked)",
        ]
    finally:
        panel.close()


def test_the_banner_names_every_cause_and_who_caused_them_with_no_alternative() -> None:
    """Caught (mutation run, issue 22, seed 53): the causes lost from the banner ("None")."""
    from autogpu_jupyter.core.overload import Overload

    warning = Overload(
        uuid=A, label="GPU 0", causes=("utilisation 97% for 45s (over 90%)", "memory 97% full"),
        other_process_count=2, other_memory_bytes=None, users=("bob", "eve"),
        alternative=None, move="",
    )
    banner = chart.render_banner([warning])
    assert (
        f'<div class="autogpu-overload" data-uuid="{A}">&#9888; '
        "<b>GPU 0 (this kernel's GPU) is overloaded</b>: "
        "utilisation 97% for 45s (over 90%); memory 97% full, "
        "caused by 2 other processes (users bob, eve). No better device right now.</div>"
    ) in banner


def test_charts_of_no_devices_and_no_history_say_no_devices() -> None:
    """With no sample at all, "now" defaults to 0 and the charts say so. Caught (mutation run,
    issue 22, seed 53): the default of "now" lost (max() of nothing raised ValueError)."""
    html = chart.render_charts({}, (), window_s=60)
    assert html == '<div style="color:var(--jp-ui-font-color2, #616161)">No devices.</div>'
    empty = {A: DeviceSeries.empty(A)}
    assert chart.render_charts(empty, (), window_s=60) == html


def test_charts_of_devices_with_no_samples_yet_are_drawn_empty() -> None:
    """The first sweep has not come back: each device gets its frame and unknown values, no
    line, as at "now" 0. Caught (issue 22, seed 54): "now" defaulting to ``None`` (a TypeError
    instead of the charts)."""
    dev = DeviceSnapshot(index=0, uuid=A, name="NVIDIA A100")
    html = chart.render_charts({}, [dev], window_s=60)
    alone = chart.render_device_chart(DeviceSeries.empty(A), label="GPU 0", uuid=A,
                                      name="NVIDIA A100", window_s=60, now_s=0.0)
    assert html == f'<div class="autogpu-charts" style="display:flex;flex-wrap:wrap">{alone}</div>'
    assert "autogpu-util" not in alone and "autogpu-mem" not in alone
    assert "util ?</span>" in alone and "mem ?</span>" in alone


def test_a_lost_devices_reason_sits_in_the_middle_of_its_chart() -> None:
    """x = 30 + 264 / 2, y = 8 + 72 / 2 + 4. Caught (mutation run, issue 22, seed 53): the
    reason drawn below the frame (y = 8 + 72 * 2 + 4)."""
    html = chart.render_device_chart(
        DeviceSeries.empty(C), label="GPU 2", uuid=C, window_s=60, now_s=100.0,
        lost_reason="GPU is lost",
    )
    assert '<text x="162.0" y="48.0" text-anchor="middle" ' in html
    assert ">lost: GPU is lost</text>" in html


def test_the_header_of_a_kernel_without_a_lease_says_no_lease() -> None:
    """Caught (mutation run, issue 22, seed 53): "no lease" reworded ("XX — no leaseXX")."""
    header = chart.render_header(_snapshot().devices, [A])
    assert header.endswith("· This kernel: GPU 0 · A100 · GPU-aaaaaaaa — no lease</div>")


def test_the_table_marks_the_kernels_row_and_names_a_lost_device_with_its_reason() -> None:
    """The kernel's row is bold in the accent colour; the head is one cell per column with
    nothing between them; a lost device's row keeps its label. Caught (mutation run, issue 22,
    seed 53): the accent style never applied, text put between the head cells, a lost
    device's label lost ("None")."""
    border = "border-bottom:1px solid var(--jp-border-color2, #c8c8c8)"
    fixed = f"padding:1px 8px;text-align:left;{border};white-space:nowrap"
    table = chart.render_table(_snapshot(), highlight=[A])
    head = "".join(
        f'<th style="{fixed}">{h}</th>'
        for h in ("GPU", "util", "memory used / total", "temp", "power", "holders")
    )
    assert f"<thead><tr>{head}</tr></thead>" in table
    accent = "font-weight:600;color:var(--jp-brand-color1, #1976d2)"
    assert f'<tr style="{accent}"><td style="{fixed}">GPU 0 (this kernel)</td>' in table
    assert f'<tr style=""><td style="{fixed}">GPU 1</td>' in table
    assert (
        f'<tr style=""><td style="{fixed}">GPU 2</td>'
        f'<td style="padding:1px 8px;text-align:left;{border};'
        'color:var(--jp-error-color1, #d32f2f)" colspan="5">lost: GPU is lost</td></tr>'
    ) in table


# ---- whole charts, found by the mutation run of issue 22 ----
# A chart of one sample (a point, not nothing), a lost chart's legend, values outside 0..100 %
# drawn on the frame's edge, the thinning of long histories, memory of a zero or one-byte total,
# a sample on the window's edge (in and out of time order), the path and tenths helpers'
# contracts, whole minutes of a huge window, and the whole header, table, banner and row of charts.
FG = "var(--jp-ui-font-color1, #1f1f1f)"
FG2 = "var(--jp-ui-font-color2, #616161)"
BORDER = "var(--jp-border-color2, #c8c8c8)"
FONT = "var(--jp-ui-font-family, system-ui, sans-serif)"
UTIL = "var(--jp-brand-color1, #1976d2)"
MEM = "var(--jp-warn-color1, #e08600)"
ERR = "var(--jp-error-color1, #d32f2f)"


def _series(ts: object, util: object, used: object = 0.0, total: object = 80.0 * GiB,
            uuid: str = A) -> DeviceSeries:
    """A device's history by hand: utilisation and memory per sample, the rest unknown."""
    t = np.asarray(ts, dtype=float)
    values = np.full((len(t), len(METRICS)), np.nan)
    values[:, METRICS.index("utilization_pct")] = util
    values[:, METRICS.index("memory_used_bytes")] = used
    values[:, METRICS.index("memory_total_bytes")] = total
    return DeviceSeries(uuid, t, values)


def _paths(html: str) -> tuple[str | None, str | None]:
    """The memory and utilisation paths' ``d`` (None: no such path)."""
    def d(cls: str) -> str | None:
        key = f'class="autogpu-{cls}" d="'
        return html.split(key, 1)[1].split('"', 1)[0] if key in html else None
    return d("mem"), d("util")


def _open(uuid: str, label: str, kernel: int = 0) -> str:
    """A chart's ``<svg>`` tag and its frame (a 60 s window)."""
    texts = "".join(
        f'<text x="27" y="{y}" text-anchor="end" style="fill:{FG2}">{p}</text>'
        for y, p in (("83.0", "0%"), ("47.0", "50%"), ("11.0", "100%"))
    )
    return (
        f'<svg class="autogpu-chart" data-uuid="{uuid}" data-kernel="{kernel}" width="300" '
        f'height="96" viewBox="0 0 300 96" role="img" aria-label="{label} utilisation and memory" '
        f'style="display:block;font-family:{FONT};font-size:10px">'
        f'<rect x="30" y="8" width="264" height="72" style="fill:none;stroke:{BORDER}"/>{texts}'
        f'<text x="30" y="93" style="fill:{FG2}">-1 min</text>'
        f'<text x="294" y="93" text-anchor="end" style="fill:{FG2}">now</text>'
    )


def _div(uuid: str, title: str, inner: str) -> str:
    return (
        f'<div class="autogpu-device" data-uuid="{uuid}" style="border:1px solid {BORDER};'
        f"border-radius:4px;padding:4px 6px;margin:3px;background:var(--jp-layout-color1, "
        f'transparent);color:{FG};font-family:{FONT};font-size:12px">'
        f'<div style="font-weight:600;color:{FG}">{title}</div>{inner}</div>'
    )


def test_one_sample_is_a_point_of_each_line_in_a_whole_chart() -> None:
    """A device's first sample is drawn (a path of one point), the chart titled with its label
    and no model (none given) nor "this kernel" tag. Caught (full mutation run, issue 22): a
    path of one point made empty, the tag shown on every chart or "XXXX" in its place, the label
    lost from the title and the svg's aria-label ("None"), the model's default "XXXX", text put
    between the two lines."""
    html = chart.render_device_chart(
        series_from_frame(_frame([50]))[A], label="GPU 0", uuid=A, window_s=60, now_s=100.0
    )
    title = f'GPU 0 <span style="color:{FG2};font-weight:400" title="{A}"></span>'
    assert html == _div(A, title, (
        _open(A, "GPU 0")
        + '<path class="autogpu-mem" d="M294.0,26.0" style="fill:none;stroke:'
        f'{MEM};stroke-width:1.5;stroke-dasharray:4 2"/>'
        f'<path class="autogpu-util" d="M294.0,44.0" style="fill:none;stroke:{UTIL};'
        'stroke-width:2"/></svg>'
        f'<div style="font-size:11px"><span style="color:{UTIL}">&#9644; util 50%</span> '
        f'<span style="color:{MEM}">&#9476; mem 75%</span></div>'
    ))


def test_a_lost_chart_says_lost_in_its_legend_and_an_unreasoned_loss_is_unavailable() -> None:
    """A device lost with no error says "unavailable" in its chart; the row of charts is the
    charts one after the other. Caught (full mutation run, issue 22): a lost chart's legend
    "None", "unavailable" reworded ("XXunavailableXX", "UNAVAILABLE"), text put between two
    charts."""
    lost = DeviceSnapshot(index=1, uuid=B, name="A100", available=False, error=None)
    alive = _snapshot().devices[0]
    history = series_from_frame(_frame([50, 97]))
    html = chart.render_charts(history, [alive, lost], window_s=60)
    first = chart.render_device_chart(history[A], label="GPU 0", uuid=A, name="A100",
                                      window_s=60, now_s=100.0)
    second = chart.render_device_chart(history[B], label="GPU 1", uuid=B, name="A100",
                                       window_s=60, now_s=100.0, lost_reason="unavailable")
    assert html == (
        f'<div class="autogpu-charts" style="display:flex;flex-wrap:wrap">{first}{second}</div>'
    )
    title = f'GPU 1 <span style="color:{FG2};font-weight:400" title="{B}">A100</span>'
    assert second == _div(B, title, (
        _open(B, "GPU 1")
        + '<text x="162.0" y="48.0" text-anchor="middle" style="fill:'
        f'{ERR};font-size:12px;font-weight:600">lost: unavailable</text></svg>'
        f'<div style="font-size:11px"><span style="color:{ERR}">lost</span></div>'
    ))


def test_values_below_zero_and_above_a_hundred_percent_are_drawn_on_the_frames_edge() -> None:
    """Utilisation -10, 0, 100 and 150 % sit on the bottom (y = 80) and top (y = 8) edges.
    Caught (full mutation run, issue 22): the y clip's lower bound lost (-10 % below the frame)
    or made 1 % (0 % drawn at 79.3), its upper bound lost (150 % at y = 0) or made 101 %."""
    html = chart.render_device_chart(
        series_from_frame(_frame([-10, 0, 100, 150]))[A], label="GPU 0", uuid=A, window_s=60,
        now_s=100.0,
    )
    assert _paths(html) == (
        "M162.0,26.0 L294.0,26.0", "M162.0,80.0 L206.0,80.0 L250.0,8.0 L294.0,8.0"
    )


def test_a_point_equal_to_the_next_but_not_the_previous_is_kept() -> None:
    """Only a point equal to both neighbours is left out. Caught (full mutation run, issue 22):
    the flat-run test's last ``&`` made ``|`` (a point equal to the next one alone dropped)."""
    html = chart.render_device_chart(
        series_from_frame(_frame([10, 50, 50]))[A], label="GPU 0", uuid=A, window_s=60,
        now_s=100.0,
    )
    assert _paths(html)[1] == "M206.0,72.8 L250.0,44.0 L294.0,44.0"


def test_a_long_history_is_cut_to_its_last_1200_samples_then_thinned_to_300_points() -> None:
    """1,500 samples in the window: the last 1,200 are kept, every 4th drawn (300 points), the
    same chart as those 300 samples alone. Caught (full mutation run, issue 22): timestamps or
    values cut to 1,500 (times and values out of step: other x, or an IndexError), no thinning
    (``step = None``: 1,200 points), ``math.ceil(None)``, ``len * MAX_POINTS`` (one point), the
    thinned arrays lost (``None``)."""
    n = 1500
    ts = np.arange(n, dtype=float)
    util = (np.arange(n) * 7) % 101
    used = ((np.arange(n) * 3) % 80) * GiB
    full = _series(ts, util, used)
    kept = slice(n - 1200, n, 4)
    alone = _series(ts[kept], util[kept], used[kept])

    def draw(s: DeviceSeries) -> str:
        return chart.render_device_chart(s, label="GPU 0", uuid=A, window_s=n, now_s=n - 1.0)

    html = draw(full)
    assert html == draw(alone)
    mem, util_d = _paths(html)
    assert util_d is not None and util_d.count(" ") == 299  # 300 points, no flat runs
    assert mem is not None


def test_memory_of_a_zero_byte_total_is_unknown_without_a_warning_and_of_one_byte_known() -> (
    None
):
    """Some memory used of 0 bytes in all is unknown (no line, no "divide by zero" printed under
    the user's cell); 1 of 1 byte is 100 %. Caught (full mutation run, issue 22): the
    division's ``divide="ignore"`` dropped or made None (numpy's warning), ``total > 0`` made
    ``>= 0`` (an infinite percentage drawn at the top), ``total > 1`` (1 of 1 byte unknown)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zero = chart.render_device_chart(
            _series([90.0, 100.0], [50.0, 97.0], used=5.0, total=0.0), label="GPU 0", uuid=A,
            window_s=60, now_s=100.0,
        )
    assert _paths(zero) == (None, "M250.0,44.0 L294.0,10.2")
    assert "mem ?</span>" in zero
    one = chart.render_device_chart(
        _series([100.0], [50.0], used=1.0, total=1.0), label="GPU 0", uuid=A, window_s=60,
        now_s=100.0,
    )
    assert _paths(one) == ("M294.0,8.0", "M294.0,44.0")
    assert "mem 100%</span>" in one


def test_a_sample_on_the_windows_start_is_drawn_on_the_frames_left_edge() -> None:
    """A sample at ``now - window`` is in the window, and drawn on the left edge even where float
    rounding makes its age a little more than the window (``now`` 1e9, a 10 µs window). Caught
    (full mutation run, issue 22): the age's upper clip lost (x = 29.6, left of the frame)."""
    now, window = 1e9, 1e-5
    assert now - (now - window) > window  # the rounding this test is about
    html = chart.render_device_chart(
        _series([now - window], [50.0]), label="GPU 0", uuid=A, window_s=window, now_s=now
    )
    assert _paths(html) == ("M30.0,80.0", "M30.0,44.0")


def test_rows_out_of_time_order_keep_a_sample_on_the_windows_start() -> None:
    """Rows not in time order are filtered by ``t >= now - window``: a row exactly 30 s old is
    in a 30 s window. Caught (full mutation run, issue 22): ``>=`` made ``>`` (the t=70 row
    lost)."""
    s = series_from_frame(_frame([10, 20, 30, 40, 50]))[A]  # t=60, 70, 80, 90, 100
    order = [0, 4, 1, 3, 2]  # t=60, 100, 70, 90, 80
    rows = DeviceSeries(A, s.timestamps_s[order], s.values[order])
    html = chart.render_device_chart(rows, label="GPU 0", uuid=A, window_s=30, now_s=100.0)
    # t=100 (x 294), t=70 (x 30), t=90 (x 206), t=80 (x 118)
    assert _paths(html)[1] == "M294.0,44.0 L30.0,65.6 L206.0,51.2 L118.0,58.4"


# _path and _tenths directly: the frame's margins keep every drawn point off y = 0 and inside
# the table of tenths, so no rendered chart tells these mutants apart
def test_a_path_draws_a_point_at_zero_and_breaks_only_at_unknown() -> None:
    """``_path``'s contract: tenths of a pixel, -1 (any negative) unknown, 0 a place like any
    other (the frame's top-left corner). Caught (full mutation run, issue 22): ``y10 >= 0`` made
    ``y10 > 0`` (a point at y = 0 taken for unknown)."""
    assert chart._path(np.array([0, 10, 20, 30]), np.array([0, 5, -1, 0])) == (
        "M0.0,0.0 L1.0,0.5 M3.0,0.0"
    )
    assert chart._path(np.array([], dtype=np.intp), np.array([], dtype=np.intp)) == ""


def test_tenths_are_rounded_table_indices_inside_the_table() -> None:
    """``_tenths``' contract: coordinates in tenths, rounded, NaN -1, and clipped to the table
    of tenths (0 .. 3000), so that every result is a valid index of ``_TENTHS``. Caught (full
    mutation run, issue 22): the clip's upper bound lost (4000, past the table), its lower bound
    made 1 (0 read as 0.1)."""
    out = chart._tenths(np.array([0.0, 12.34, 12.35, 299.99, 400.0, np.nan, -5.0]))
    assert out.tolist() == [0, 123, 124, 3000, 3000, -1, 0]
    assert chart._TENTHS[out[4]] == "300.0"


@pytest.mark.parametrize(
    ("window_s", "text"),
    [(60 * (10**17 + 1), f"{10**17 + 1} min"), (60.0 * 2**60, f"{2**60} min")],
)
def test_a_huge_whole_number_of_minutes_is_said_exactly(window_s: float, text: str) -> None:
    """Caught (full mutation run, issue 22): ``window_s // 60`` made ``window_s / 60`` (an int
    window divided in floats: 100000000000000000 for 100000000000000001 minutes). No sampler
    keeps a window this long, but the chart draws whatever window it is given. The frame is
    cached per window (``_grid``), so cleared first, as above."""
    chart._grid.cache_clear()
    html = chart.render_device_chart(
        DeviceSeries.empty(A), label="GPU 0", uuid=A, window_s=window_s, now_s=100.0
    )
    assert f">-{text}</text>" in html


def test_the_whole_header_of_a_kernel_on_a_device_the_fleet_no_longer_lists() -> None:
    """A kernel device missing from the snapshot is named by its UUID, the devices joined by
    "; ", no badge on a real fleet. Caught (full mutation run, issue 22): the badge's absence
    "XXXX", ``if d`` made ``if d or True`` (an AttributeError on the missing device), the join
    reworded ("XX; XX")."""
    header = chart.render_header(_snapshot().devices, [A, "GPU-gone"])
    assert header == (
        f'<div class="autogpu-header" style="font-family:{FONT};font-size:13px;color:{FG}">'
        "<b>autogpu</b> · This kernel: GPU 0 · A100 · GPU-aaaaaaaa; GPU-gone — no lease</div>"
    )


def test_the_whole_table_after_a_device_lost_without_a_reason() -> None:
    """A lost device with no error says "unavailable", the rows after it are still drawn, rows
    follow each other with nothing between, and the kernel's own processes are "this kernel".
    Caught (full mutation run, issue 22): "unavailable" reworded ("XXunavailableXX",
    "UNAVAILABLE"), ``continue`` made ``break`` (the rows after a lost device lost), text put
    between rows, ``own_pids`` not passed on to the holders (pid 77 shown as a stranger's)."""
    lost = DeviceSnapshot(index=0, uuid=B, name="A100", available=False, error=None)
    mine = DeviceSnapshot(
        index=1, uuid=A, name="A100", memory_total_bytes=80 * GiB, memory_used_bytes=60 * GiB,
        memory_free_bytes=20 * GiB, utilization_pct=97.0,
        processes=(ProcessSnapshot(pid=77, used_memory_bytes=60 * GiB),),
    )
    table = chart.render_table(FleetSnapshot((lost, mine), 100.0, "simulated"), own_pids=[77])
    cell = f"padding:1px 8px;text-align:left;border-bottom:1px solid {BORDER}"
    fixed = f"{cell};white-space:nowrap"
    wrap = f"{cell};white-space:normal;overflow-wrap:anywhere"
    cells = ["GPU 1", "97%", "60.0 GiB / 80.0 GiB", "?", "?"]
    body = (
        f'<tr style=""><td style="{fixed}">GPU 0</td><td style="{cell};color:{ERR}" colspan="5">'
        "lost: unavailable</td></tr>"
        '<tr style="">' + "".join(f'<td style="{fixed}">{c}</td>' for c in cells)
        + f'<td style="{wrap}">this kernel (60.0 GiB used)</td></tr>'
    )
    assert table.endswith(f"<tbody>{body}</tbody></table>")


def test_a_banner_of_two_warnings_is_the_two_one_after_the_other() -> None:
    """Caught (full mutation run, issue 22): text put between the banner's warnings."""
    def warning(uuid: str, label: str) -> Overload:
        return Overload(uuid=uuid, label=label, causes=("memory 97% full",),
                        other_process_count=1, other_memory_bytes=None, users=(),
                        alternative=None, move="")

    def item(uuid: str, label: str) -> str:
        return (
            f'<div class="autogpu-overload" data-uuid="{uuid}">&#9888; <b>{label} (this '
            "kernel's GPU) is overloaded</b>: memory 97% full, caused by 1 other process. "
            "No better device right now.</div>"
        )

    banner = chart.render_banner([warning(A, "GPU 0"), warning(B, "GPU 1")])
    assert banner == (
        f'<div class="autogpu-banner" role="alert" style="border:1px solid {MEM};'
        f"border-left:6px solid {MEM};background:rgba(255, 152, 0, 0.14);color:{FG};"
        f'padding:6px 10px;border-radius:4px;font-family:{FONT};font-size:13px">'
        f'{item(A, "GPU 0")}{item(B, "GPU 1")}</div>'
    )
