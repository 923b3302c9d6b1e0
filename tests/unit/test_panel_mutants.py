"""The live panel (``widgets/panel.py``) and the lazy ``widgets`` package: what the survivors of
the full mutation run (issue 22) showed untested. Each test names the mutants it catches."""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import ipywidgets as w
import pytest
from traitlets.config import Config, Configurable

from autogpu_jupyter import widgets
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


# -- the package's lazy attribute -------------------------------------------------------------


def test_the_widgets_package_names_a_missing_attribute_in_its_error() -> None:
    """Caught: ``widgets.__getattr__``'s error lost its text (``AttributeError(None)``)."""
    assert widgets.Panel is Panel
    with pytest.raises(AttributeError) as err:
        _ = widgets.Nope  # type: ignore[attr-defined]
    assert str(err.value) == "module 'autogpu_jupyter.widgets' has no attribute 'Nope'"


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
    cfg = panel_mod._config()
    assert isinstance(cfg, AutoGPU) and cfg.parent is shell
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(10)))
    with _panel(window_s=60, sampler=_clocked_sampler(path, [T0]), server_history=False) as p:
        assert p.thresholds == Thresholds(42.0, 7.0, 95.0)
    # a shell that holds one already: that one
    mine = AutoGPU(overload_util_pct=55.0)
    shell.configurables = [object(), mine]  # type: ignore[attr-defined]
    assert panel_mod._config() is mine


# -- the runtime file --------------------------------------------------------------------------


def test_the_runtime_file_is_read_as_utf8_whatever_the_locale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a Latin-1 locale (``open`` without an encoding decodes Latin-1) a token with
    non-ASCII characters still reads back as written. Caught: ``encoding="utf-8"`` made
    ``None`` or dropped."""

    def latin1_locale_open(file: Any, mode: str = "r", buffering: int = -1,
                           encoding: str | None = None, **kw: Any) -> Any:
        return builtins.open(file, mode, buffering, encoding=encoding or "latin-1", **kw)

    monkeypatch.setattr(panel_mod, "open", latin1_locale_open, raising=False)
    monkeypatch.setattr(panel_mod.os, "getppid", lambda: 4000)
    info = {"url": "http://h/", "token": "tök€n"}
    (tmp_path / "jpserver-4000.json").write_text(json.dumps(info, ensure_ascii=False),
                                                encoding="utf-8")
    assert panel_mod._server_info(str(tmp_path)) == info


def test_a_runtime_file_that_is_not_an_object_is_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the ``isinstance(info, dict)`` check made always true (a JSON list returned)."""
    monkeypatch.setattr(panel_mod.os, "getppid", lambda: 4000)
    (tmp_path / "jpserver-4000.json").write_text('["http://h/"]')
    assert panel_mod._server_info(str(tmp_path)) is None


# -- the server's history ----------------------------------------------------------------------

SERIES = {"uuid": A, "timestamp_s": [1.0], "utilization_pct": [10], "memory_used_bytes": [1]}
GOT = {A: ([1.0], [10], [1], None)}


@contextlib.contextmanager
def _server(body: bytes, *, hold: bool = False) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """A local HTTP/1.0 server answering every GET with ``body`` and no Content-Length; yields
    its URL (no trailing slash) and the (path, headers) it was asked with. ``hold``: the
    connection stays open after the body (the answer's end never comes) until the server
    stops."""
    asked: list[tuple[str, Any]] = []
    done = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append((self.path, self.headers))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(body)
            if hold:
                done.wait(10)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/base", asked
    finally:
        done.set()
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize(("token", "authorization"), [
    ("t0k", "token t0k"), ("", None), (None, None), (123, None),
])
def test_the_history_is_asked_under_the_servers_base_url_with_its_token_only(
    token: Any, authorization: str | None
) -> None:
    """A base URL without a trailing slash keeps its last segment; only a non-empty text token
    is sent. Caught: the ``/`` never added (``or True``: the request went to ``/autogpu/...``),
    ``url - "/"`` (TypeError), ``"XX/XX"`` added; the token check made always true or
    ``isinstance(token, str) or token`` (``token `` / ``token None`` sent)."""
    body = json.dumps({"series": [SERIES]}).encode()
    with _server(body) as (url, asked):
        assert panel_mod.server_history(60, info={"url": url, "token": token}) == GOT
    ((path, headers),) = asked
    assert path.startswith("/base/autogpu/api/v1/history?since=")
    assert headers.get("Authorization") == authorization


def test_the_history_request_waits_as_long_as_it_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``SERVER_HISTORY_TIMEOUT_S`` unless ``timeout_s`` says otherwise. Caught: the timeout
    made ``None`` or dropped (a silent server blocked the panel for good), the choice
    inverted or made always one side."""
    seen: list[Any] = []
    real = urllib.request.urlopen

    def spy(request: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("timeout", "none given"))
        return real(request, *args, **kwargs)

    monkeypatch.setattr(panel_mod.urllib.request, "urlopen", spy)
    with _server(json.dumps({"series": [SERIES]}).encode()) as (url, _):
        assert panel_mod.server_history(60, info={"url": url}) == GOT
        assert panel_mod.server_history(60, info={"url": url}, timeout_s=0.25) == GOT
    assert seen == [panel_mod.SERVER_HISTORY_TIMEOUT_S, 0.25]


def test_an_answer_is_read_no_further_than_one_byte_past_the_limit() -> None:
    """A server that sends one byte more than the limit and then never ends its answer: the
    panel stops reading there (the first ``limit`` bytes, valid JSON here, are the history)
    instead of waiting for the end. Caught: ``read(None)`` (read to the end: timed out, no
    history), ``read(limit + 2)`` (waited for a byte that never came)."""
    limit = panel_mod._MAX_HISTORY_BYTES
    head = json.dumps({"series": [SERIES]}).encode()
    body = head + b" " * (limit + 1 - len(head))
    with _server(body, hold=True) as (url, _):
        assert panel_mod.server_history(60, info={"url": url}, timeout_s=0.5) == GOT


def test_an_answer_that_is_not_an_object_gives_no_history() -> None:
    """Caught: the ``isinstance(data, dict)`` check made always true (``[].get``: the panel
    raised AttributeError)."""
    with _server(b"[1, 2]") as (url, _):
        assert panel_mod.server_history(60, info={"url": url}) == {}


def test_a_malformed_series_is_skipped_and_the_ones_after_it_kept() -> None:
    """Caught: ``continue`` made ``break`` (every series after a malformed one lost)."""
    body = json.dumps({"series": ["junk", {"uuid": 3}, SERIES]}).encode()
    with _server(body) as (url, _):
        assert panel_mod.server_history(60, info={"url": url}) == GOT


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
