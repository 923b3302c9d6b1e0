"""What the full mutation run of ``widgets/chart.py`` (issue 22) found untested: a whole chart
of one sample (a point, not nothing), a lost chart's legend, values outside 0..100 % drawn on
the frame's edge, the thinning of long histories, memory of a zero or one-byte total, a sample
on the window's edge (in and out of time order), the path and tenths helpers' contracts, whole
minutes of a huge window, and the whole header, table, banner and row of charts (the joins,
the "unavailable" reason, the rows after a lost device, the kernel's own processes)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.overload import Overload
from autogpu_jupyter.core.sampler import METRICS, DeviceSeries, series_from_frame
from autogpu_jupyter.widgets import chart
from tests.unit.test_chart import A, B, GiB, _frame, _snapshot

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
    window divided in floats: 100000000000000000 for 100000000000000001 minutes)."""
    assert chart._window_text(window_s) == text


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
