"""The live panel (``widgets/panel.py``) in this process: its configuration, its listener, its
construction, its status and banner, and its table; and what it takes of its server's history
(the request itself is ``test_panel_history.py``). Found by the mutation run of issue 22; each
test names the mutants it catches."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ipywidgets as w
import pytest
from traitlets.config import Config, Configurable

from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.overload import Thresholds
from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.widgets import chart
from autogpu_jupyter.widgets import panel as panel_mod
from autogpu_jupyter.widgets.panel import Panel
from tests.unit.test_chart import A, GiB, _clocked_sampler, _panel_fleet

T0 = 1_000_000.0


@pytest.fixture(autouse=True)
def _no_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _fleet(util_a: float, util_b: float = 2.0) -> dict[str, Any]:
    """A (bob's pid 4242 on it, 60 of 80 GiB used) and B (1 of 80 GiB used, idle-ish)."""
    fleet = _panel_fleet(util_a)
    fleet["devices"][1].update(memory_used=1 * GiB, utilization_pct=util_b)
    return fleet


def _status(text: str) -> str:
    return (
        f'<span style="color:{chart.FG2};font-size:11px;font-family:{chart.FONT}">{text}</span>'
    )


@contextlib.contextmanager
def _panel(*args: Any, **kwargs: Any) -> Iterator[Panel]:
    p = Panel(*args, **kwargs)
    try:
        yield p
    finally:
        p.close()


# -- the AutoGPU configurable ------------------------------------------------------------------


def test_the_panels_thresholds_come_from_the_kernels_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shell without ``configurables`` (any Configurable parent): a fresh ``AutoGPU`` under
    it, so that the shell's config applies. Caught: ``AutoGPU(parent=None)`` (the config's
    thresholds ignored), the ``()`` default of ``getattr(ip, "configurables", ())`` made
    ``None`` or dropped (TypeError / AttributeError)."""
    shell = Configurable(config=Config({"AutoGPU": {"overload_util_pct": 42.0,
                                                     "overload_window_s": 7.0}}))
    monkeypatch.setattr(panel_mod, "get_ipython", lambda: shell)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    with _panel(window_s=60, sampler=_clocked_sampler(path, [T0]), server_history=False) as p:
        assert p.thresholds == Thresholds(42.0, 7.0, 95.0)
    # a shell that holds one already: that one
    mine = AutoGPU(overload_util_pct=55.0)
    shell.configurables = [object(), mine]  # type: ignore[attr-defined]
    with _panel(window_s=60, sampler=_clocked_sampler(path, [T0]), server_history=False) as p:
        assert p.thresholds == Thresholds(55.0, 30.0, 95.0)  # its own, not the shell's config


# -- the server's history ----------------------------------------------------------------------


def test_the_panel_logs_how_many_of_the_servers_samples_it_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Caught: the debug line's text or count lost, changed or reordered."""
    monkeypatch.setattr(panel_mod, "server_history",
                        lambda window_s: {A: ([1.0, 2.0], [10, 20], [1, 2], 8)})
    caplog.set_level(logging.DEBUG, logger=panel_mod.log.name)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    s = _clocked_sampler(path, [10.0])
    with _panel(window_s=60, sampler=s):
        assert len(s) == 3
    assert [r.getMessage() for r in caplog.records if r.name == panel_mod.log.name] == [
        "panel: 2 samples of the server's history"
    ]


def test_the_own_history_is_measured_from_its_first_kept_sample(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the clock stepped back the history's first kept sample (its front, before which
    ``Sampler.seed`` puts the server's samples) is not its oldest stamp: the panel measures its
    own history from that first sample, as seeding does (960 s - 1000 s: short of the window,
    so the server is asked). Caught: the first two stamps of each series taken
    (``[:2]``: measured from 900 s, 60 s: the server not asked)."""
    asked: list[float] = []
    monkeypatch.setattr(panel_mod, "server_history",
                        lambda window_s: asked.append(window_s) or {})
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    now = [1000.0]
    s = _clocked_sampler(path, now)
    for t in (1000.0, 900.0, 960.0):
        now[0] = t
        s.sample_now()
    with _panel(window_s=60, sampler=s):
        assert asked == [60.0]


# -- the listener ------------------------------------------------------------------------------


def test_the_weak_listener_passes_the_snapshot_and_unsubscribes_once_its_panel_is_gone(
    tmp_path: Path,
) -> None:
    """Caught: the snapshot not passed on (``None``), ``unsubscribe(None)`` (a dead panel's
    listener kept for ever)."""

    class Owner:
        def __init__(self) -> None:
            self.got: list[Any] = []

        def _on_sample(self, sampler: Sampler, snapshot: Any) -> None:
            self.got.append((sampler, snapshot))

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    s = _clocked_sampler(path, [T0])
    owner = Owner()
    s.subscribe(panel_mod._weak_listener(owner))
    snap = s.sample_now()
    assert snap is not None and owner.got == [(s, snap)]
    del owner
    assert s.listener_count == 1
    s.sample_now()
    assert s.listener_count == 0


# -- the panel's construction ------------------------------------------------------------------


def test_the_panel_is_one_box_of_its_parts_with_its_class_and_the_callers_options(
    tmp_path: Path,
) -> None:
    """Caught: the children or ``**kwargs`` not passed to the VBox, the CSS class reworded,
    the pause button's width lost or changed, the window's label of a window under a minute
    in minutes ("0.5 min")."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    with _panel(window_s=30, sampler=_clocked_sampler(path, [T0]), server_history=False,
                layout=w.Layout(width="640px")) as p:
        assert p.layout.width == "640px"
        assert p._dom_classes == ("autogpu-panel",)
        header, banner, charts, table, controls = p.children
        assert (header, banner, charts, table) == (p.header, p.banner, p.charts, p.table)
        assert controls.children == (p.interval, p.window, p.pause, p.status)
        assert p.pause.layout.width == "90px"
        assert [label for label, _v in p.window.options] == ["30 s", "1 min", "5 min", "15 min"]
        assert p.window.label == "30 s"


def test_the_panels_interval_is_set_on_the_sampler_it_was_given_or_the_shared_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: ``set_interval(None)`` (the panel raised), the ``sampler is not None`` check
    inverted (the interval never set), ``get_sampler(None)`` (the shared sampler's interval
    not changed)."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    s = _clocked_sampler(path, [T0])
    with _panel(window_s=60, interval_s=2.0, sampler=s, server_history=False) as p:
        assert s.interval_s == 2.0 and p.interval.value == 2.0
    asked: list[Any] = []

    def shared(interval_s: float | None = None) -> Sampler:
        asked.append(interval_s)
        return s

    monkeypatch.setattr(panel_mod, "get_sampler", shared)
    with _panel(window_s=60, interval_s=5.0, server_history=False):
        pass
    with _panel(window_s=60, server_history=False):
        pass
    assert asked == [5.0, None]


class _Unread(Sampler):
    """A sampler fed from elsewhere (``add``): it reads nothing itself, never fails."""

    def sample_now(self) -> None:  # type: ignore[override]
        return None


def test_a_panel_with_nothing_read_and_nothing_failed_shows_an_empty_hidden_banner(
    tmp_path: Path,
) -> None:
    """Caught: the error banner shown without an error (``errors[-1]``: IndexError), its
    empty value made "XXXX", its display "block" or a misspelt "none"; the warnings ``None``
    until a first drawing."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    s = _Unread(SimulatedBackend(str(path), clock=lambda: T0), clock=lambda: T0)
    with _panel(window_s=60, sampler=s, server_history=False) as p:
        assert (p.banner.value, p.banner.layout.display) == ("", "none")
        assert (p.charts.value, p.table.value) == ("", "")
        assert p.warnings == [] and p.update_count == 0
        assert p.status.value == _status("0 samples")


def test_a_panel_whose_first_read_failed_has_no_warnings(tmp_path: Path) -> None:
    """Caught: the warnings ``None`` (not a list) until a first drawing."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_panel_fleet(10, broken=True)))
    with _panel(window_s=60, sampler=_clocked_sampler(path, [T0]), server_history=False) as p:
        assert p.warnings == []


def test_a_paused_panels_status_keeps_the_time_of_its_last_sample(tmp_path: Path) -> None:
    """Caught: the paused status drawn without the snapshot (its "sampled ..." lost),
    "paused" reworded."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    with _panel(window_s=60, sampler=_clocked_sampler(path, [T0]), server_history=False) as p:
        p.pause.value = True
        sampled = time.strftime("%H:%M:%S", time.localtime(T0))
        assert p.status.value == _status(f"sampled {sampled} · 1 samples · paused")


# -- drawing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("overload_window_s", "causes"), [
    (100.0, ("utilisation 97% for 2m10s (over 90%)",)),
    (20.0, ("utilisation 97% for 1m (over 90%)",)),
])
def test_the_banner_looks_back_over_the_overload_window_and_three_samples(
    overload_window_s: float, causes: tuple[str, ...], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At a 10 s interval and a 60 s panel window, an overload window of 100 s reads the last
    100 + 3 * 10 s (2m10s of load shown; a shorter window, the panel's 60 s). Caught: ``+``
    made ``-`` (70 s read: no warning), ``3 * interval`` made ``3 / interval`` (1m40s) or
    ``4 * interval`` (2m20s); the banner's display "block" when it warns lost or misspelt."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", A)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(97)))
    now = [T0]
    s = _clocked_sampler(path, now)
    s.set_interval(10.0)
    for _ in range(31):  # 97 % for 300 s, a sample each 10 s
        s.sample_now()
        now[0] += 10
    with _panel(window_s=60, sampler=s, thresholds=Thresholds(90, overload_window_s, 95),
                server_history=False) as p:
        assert [x.causes for x in p.warnings] == [causes]
        assert p.banner.layout.display == "block"


def test_the_banners_alternative_is_ranked_by_the_last_minutes_mean_utilisation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B was 90 % busy 120 s ago, 60 % 61 s ago, 30 % 60 s ago and is idle now: the banner's
    alternative shows its mean over the last 60 s (15 %). Caught: no smoothed utilisation
    passed (0 %, its current one), the mean over the whole history (``smoothed_util(None)``:
    45 %) or over 61 s (30 %)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", A)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(97)))
    now = [T0]
    s = _clocked_sampler(path, now)
    for dt, util_b in ((0.0, 90.0), (59.0, 60.0), (60.0, 30.0), (120.0, 0.0)):
        now[0] = T0 + dt
        path.write_text(json.dumps(_fleet(97, util_b)))
        s.sample_now()
    with _panel(window_s=60, sampler=s, thresholds=Thresholds(90, 2, 95),
                server_history=False) as p:
        (warning,) = p.warnings
        assert warning.alternative is not None
        assert warning.alternative.describe() == "GPU 1 (79.0 GiB free, 15% busy)"


def test_the_table_marks_the_kernels_device_and_its_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sampler counts pid 4242 as this kernel's (a child of it): the table says "this
    kernel" for it and the kernel's row is marked; a load of its own is no overload. Caught:
    the own pids intersected with this process's (``&``: pid 4242 someone else's, a
    warning), the table's ``highlight`` or ``own_pids`` not passed."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", A)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(97)))
    now = [T0]
    backend = SimulatedBackend(str(path), clock=lambda: now[0])
    s = Sampler(backend, history_s=900.0, clock=lambda: now[0])
    for _ in range(3):
        s.add(backend.snapshot(), own={4242})
        now[0] += 1
    with _panel(window_s=60, sampler=s, thresholds=Thresholds(90, 2, 95),
                server_history=False) as p:
        assert p.warnings == []
        assert "GPU 0 (this kernel)</td>" in p.table.value
        assert "this kernel (60.0 GiB used)</td>" in p.table.value
        assert "bob" not in p.table.value
