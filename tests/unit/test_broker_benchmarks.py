"""benchmarks/broker_scale.py and broker_orphans.py (issue 39): their arguments, their table and
what they record for scripts/bench_compare.py, from a made-up run. Nothing is timed here: the
benchmarks themselves are never run."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str) -> Any:
    saved = list(sys.path)
    try:
        sys.path.insert(0, str(_BENCH))
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


scale = _load("broker_scale")
orphans = _load("broker_orphans")


def _picks(*ms: float) -> list[float]:
    return [m / 1000 for m in ms]


def _store_run(times: dict[str, list[float]]) -> dict[str, Any]:
    return {"times": times, "failed": {k: [] for k in times}, "unleased": {k: 0 for k in times}}


def _scale_run(restart_s: float = 0.5) -> dict[str, Any]:
    mem = {"VmRSS": 100.0, "VmHWM": 120.0}
    return {
        "notes": [], "leases": 10_000, "idle": 1_000, "gpus": 64, "loaders": 4,
        "load_average_at_start": 1.5, "grant_all_s": 80.0,
        "start_empty": {"answer_s": 0.25, "back_s": 0.25},
        "restart": {"answer_s": restart_s, "back_s": restart_s},
        "quiet": _store_run({"broker": _picks(*[10] * 99, 30),
                             "directory": _picks(*[20] * 99, 60)}),
        "load_broker": {**_store_run({"broker": _picks(40, 40, 80)}), "loader_picks": 7,
                        "wall_s": 3.0, "broker_cpu_pct": 50.0},
        "load_directory": {**_store_run({"directory": _picks(20, 20, 160)}),
                           "loader_picks": 9, "wall_s": 3.0},
        "after_restart": _store_run({"broker": []}),
        "memory_setup": mem, "memory_quiet": mem, "memory_load": {"VmRSS": 110.0, "VmHWM": 130.0},
        "memory_restart": mem, "memory_end": {"VmRSS": 90.0, "VmHWM": 90.0},
        "idle_cpu_pct": 0.0, "quiet_broker_cpu_s_per_pick": 0.002,
        "after_restart_broker_cpu_pct": 99.0,
        "compaction": {"entries": 10_000, "log_bytes": 9 << 20, "compacted_bytes": 6 << 20,
                       "load_s": 0.3, "compact_s": 0.1},
    }


def test_the_defaults_are_the_issues_scale() -> None:
    a = scale.parse_args([])
    assert (a.leases, a.idle, a.gpus, a.quiet_picks, a.picks, a.results) == (
        10_000, 1_000, 64, 1_000, 100, None)
    b = orphans.parse_args(["--results", "r.json"])
    assert (b.holders, b.fds, b.seconds, b.socket_at, b.results) == (
        120, 20_000, 30.0, "last", "r.json")


@pytest.mark.parametrize(
    ("module", "argv", "message"),
    [
        ("scale", ["--gpus", "0"], "--gpus 1-192"),
        ("scale", ["--picks", "3"], "--picks >= 10"),
        ("scale", ["--quiet-picks", "9"], "--quiet-picks >= 10"),
        ("scale", ["--loaders", "9"], "invalid choice: 9"),
        ("orphans", ["--holders", "0"], "--holders 1-240"),
        ("orphans", ["--seconds", "0.5"], "--seconds 1-300"),
        ("orphans", ["--socket-at", "middle"], "invalid choice: 'middle'"),
    ],
)
def test_a_bad_argument_is_one_line_naming_it(module: str, argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        {"scale": scale, "orphans": orphans}[module].parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err


def test_scale_table_and_results_beside_the_directory() -> None:
    out = _scale_run()
    fig = scale.figures(out)
    assert fig["quiet_broker"]["p99_ms"] == pytest.approx(10.0)  # 99th of 100: not the max
    assert fig["ratios"]["pick_p50_quiet_vs_directory"] == pytest.approx(0.5)
    assert fig["ratios"]["pick_p99_load_vs_directory"] == pytest.approx(0.5)
    assert fig["ratios"]["restart_vs_empty_start"] == pytest.approx(2.0)
    assert fig["hwm_mib"] == 130.0
    text = scale.table(out, fig)
    assert "| pick quiet, p50 / p99 / max ms | 10.0 / 10.0 / 30.0 (n=100) | " \
           "20.0 / 20.0 / 60.0 (n=100) | 0.500 / 0.500 | p99 <= 20 ms |" in text
    assert "| pick after the restart (the leases now orphans), p50 / p99 / max ms | no pick |" \
        in text
    assert "0.50 s (answers at 0.50 s) | - | 2.00x a restart with an empty journal" in text
    recorded = scale.results_of(fig)
    assert recorded == pytest.approx({
        "broker_scale.pick_p50_quiet_vs_directory": 0.5,
        "broker_scale.pick_p99_quiet_vs_directory": 0.5,
        "broker_scale.pick_p50_load_vs_directory": 2.0,
        "broker_scale.pick_p99_load_vs_directory": 0.5,
        "broker_scale.restart_vs_empty_start": 2.0,
        "broker_scale.rss_mib": 110.0,
        "broker_scale.broker_cpu_ms_per_quiet_pick": 2.0,
    })


def test_a_restart_that_never_finished_is_said_and_not_recorded(tmp_path: Path) -> None:
    fig = scale.figures(_scale_run(restart_s=math.inf))
    assert "not within the bound (answers at not within the bound) | - | -x" in scale.table(
        _scale_run(restart_s=math.inf), fig)
    recorded = scale.results_of(fig)
    assert "broker_scale.restart_vs_empty_start" not in recorded
    path = tmp_path / "latest.json"
    sys.path.insert(0, str(_BENCH))
    try:
        from results import record
    finally:
        sys.path.remove(str(_BENCH))
    record(path, recorded)  # what bench_compare then reads: finite numbers only
    assert all(math.isfinite(v) for v in json.loads(path.read_text()).values())


def test_orphans_table_and_results() -> None:
    out = {
        "notes": ["nr_open is 1000: 936 descriptors per holder, not 20000"],
        "holders": 120, "fds_per_holder": 936, "socket_at": "last",
        "load_average_at_start": 2.0, "holders_ready_s": 4.0, "orphans_at_end": 120,
        "start_empty": {"answer_s": 0.5, "back_s": 0.5},
        "restart": {"answer_s": 14.0, "back_s": 14.0},
        "before": _store_run({"broker": _picks(*[2] * 100)}), "before_wall_s": 5.0,
        "after": _store_run({"broker": _picks(*[5] * 90, *[9000] * 10)}), "after_wall_s": 30.0,
        "after_broker_cpu_pct": 95.0,
    }
    fig = orphans.figures(out)
    text = orphans.table(out, fig)
    assert "restart (kill -9, start, all 120 taken back): **14.00 s**" in text
    assert "| after the restart (30 s, leases orphans) | 100 | 5.0 | 5.0 | 9000.0 | 9000.0 |" \
        in text
    assert text.splitlines()[-1] == "note: nr_open is 1000: 936 descriptors per holder, not 20000"
    assert orphans.results_of(fig) == pytest.approx({
        "broker_orphans.restart_vs_empty_start": 28.0,
        "broker_orphans.pick_p99_after_vs_before_restart": 4500.0,
    })


@pytest.mark.parametrize("shape", ["pids", "rows"])
def test_the_view_profile_picks_through_the_client_and_says_the_views_size(shape: str) -> None:
    """benchmarks/broker_view_profile.py on a small book (300 leases on 8 GPUs): every pick
    takes a lease through the real client, and it reports the view it decoded -- its bytes and
    as many records as leases (a process's leases, or the rows and the folded ones). Caught:
    the profile run against a view the client does not read (no lease counted)."""
    import subprocess

    out = subprocess.run(
        [sys.executable, str(_BENCH / "broker_view_profile.py"), "--leases", "300", "--gpus",
         "8", "--repeat", "3", "--view", shape],
        capture_output=True, text=True, timeout=120, check=True,
        cwd=str(_BENCH.parent),
    ).stdout
    assert out.splitlines()[0].startswith(f"300 leases on 8 GPUs, view {shape!r}: ")
    assert ", 300 records (" in out.splitlines()[0]
    assert "pick (client side): median " in out and "bookings_for " in out
