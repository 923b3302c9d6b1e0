"""A fresh ``%gpu panel`` starts with the history its Jupyter server already has: the server is
found through its runtime file (``jpserver-<pid>.json``) and asked over HTTP (a real local HTTP
server here, answering as ``GET autogpu/api/v1/history`` does)."""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.widgets import panel as panel_mod
from tests.unit.test_chart import A

UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering ``autogpu/api/v1/history`` to the token ``t0k``; yields its URL
    and the paths it was asked for."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if self.headers.get("Authorization") != "token t0k":
                self.send_response(403)
                self.end_headers()
                return
            body = json.dumps({"series": [
                {"uuid": UUID, "timestamp_s": [1.0, 2.0], "utilization_pct": [10, None],
                 "memory_used_bytes": [1, 2], "memory_total_bytes": 8},
                {"uuid": 3}, "junk",
                # one series not a list: the entry is left out whole (never a partial series)
                {"uuid": "GPU-no-util", "timestamp_s": [1.0], "utilization_pct": None,
                 "memory_used_bytes": [1]},
                {"uuid": "GPU-no-ts", "timestamp_s": 1.0, "utilization_pct": [1],
                 "memory_used_bytes": [1]},
                {"uuid": "GPU-no-mem", "timestamp_s": [1.0], "utilization_pct": [1],
                 "memory_used_bytes": "1"},
            ]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/base/", asked
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_history_comes_from_the_servers_own_api(server: tuple[str, list[str]]) -> None:
    url, asked = server
    got = panel_mod.server_history(60, info={"url": url, "token": "t0k"})
    assert got == {UUID: ([1.0, 2.0], [10, None], [1, 2], 8)}  # malformed entries left out
    (path,) = asked
    assert path.startswith("/base/autogpu/api/v1/history?since=")


def test_no_history_without_a_server_that_answers(server: tuple[str, list[str]]) -> None:
    url, _ = server
    assert panel_mod.server_history(60, info={"url": url, "token": "wrong"}) == {}
    assert panel_mod.server_history(60, info={"url": "https://x/", "token": "t0k"}) == {}
    assert panel_mod.server_history(60, info={"url": url, "sock": "/s", "token": "t0k"}) == {}
    assert panel_mod.server_history(60, info={}) == {}
    closed = url.replace(url.split(":")[2].split("/")[0], "1")  # port 1: nothing listens
    assert panel_mod.server_history(60, info={"url": closed, "token": "t0k"}) == {}


@contextlib.contextmanager
def _servers(runtime: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Jupyter servers as a kernel finds them: ``write(pid, name)`` writes the runtime file
    ``jpserver-<pid>.json`` of server ``name`` (``JUPYTER_RUNTIME_DIR`` is ``runtime``);
    ``asked()`` is the name of the server a panel's history request went to (``None``: it
    asked none). All the servers are one local HTTP server, told apart by their base URL."""
    asked: list[str] = []
    tokens: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path.split("/")[1])
            tokens.append(self.headers.get("Authorization"))
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))

    def write(pid: int, name: str, token: str = "t0k") -> None:
        info = {"url": f"{base}{name}/", "token": token}
        (runtime / f"jpserver-{pid}.json").write_text(json.dumps(info, ensure_ascii=False),
                                                      encoding="utf-8")

    def found() -> str | None:
        asked.clear()
        panel_mod.server_history(60)
        return asked[0] if asked else None

    try:
        yield SimpleNamespace(write=write, asked=found, tokens=tokens)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_server_is_the_one_that_started_this_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A panel asks the server whose runtime file names this kernel's parent (this test process
    plays the kernel), not another one; a file that is no JSON, or no runtime directory, is no
    server."""
    with _servers(tmp_path, monkeypatch) as servers:
        servers.write(os.getppid(), "a")
        servers.write(1, "other")
        assert servers.asked() == "a"
        (tmp_path / f"jpserver-{os.getppid()}.json").write_text("not json")
        assert servers.asked() is None
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "missing"))
        assert servers.asked() is None


@contextlib.contextmanager
def _serving(body: bytes) -> Iterator[str]:
    """A local HTTP server answering every GET with ``body`` (200); yields its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_fresh_panel_asks_its_server_for_its_window_and_starts_with_that_history(
    server: tuple[str, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The panel's own sampler has one sample (shorter than the window): it asks the server for
    the window's last seconds (and 5 more) and seeds its sampler with the answer. Caught
    (mutation run, issue 22): ``server_history(None)`` (the panel raised a TypeError)."""

    url, asked = server
    runtime = tmp_path / "runtime"  # the server that started this "kernel" (the test process)
    runtime.mkdir()
    (runtime / f"jpserver-{os.getppid()}.json").write_text(json.dumps({"url": url, "token": "t0k"}))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"devices": [
        {"uuid": UUID, "name": "A100", "memory_total": 8, "memory_used": 1,
         "utilization_pct": 10},
    ]}))
    clock = lambda: 10.0  # noqa: E731  (the server's samples at 1 s and 2 s are older)
    s = Sampler(SimulatedBackend(str(path), clock=clock), history_s=900.0, clock=clock)
    before = time.time()
    panel = panel_mod.Panel(window_s=60, sampler=s)
    after = time.time()
    try:
        (path_asked,) = asked
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(path_asked).query)
        since = float(query["since"][0])
        assert before - 65.0 - 0.001 <= since <= after - 65.0 + 0.001
        assert len(s) == 3  # the server's two samples before the panel's own
        assert s.history_series()[UUID].timestamps_s.tolist() == [1.0, 2.0, 10.0]
    finally:
        panel.close()


def test_the_server_is_looked_for_four_processes_up_and_no_further(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's parent, its parent, and so on: four processes up (a kernel under a shell
    under a launcher under the server), not a fifth (some other user-session's server).
    Caught (mutation run, issue 22): the depth made 5."""
    parents = {100: 101, 101: 102, 102: 103, 103: 104, 104: 105}
    monkeypatch.setattr(panel_mod.os, "getppid", lambda: 100)
    monkeypatch.setattr(panel_mod.procfs, "ppid", parents.get)
    with _servers(tmp_path, monkeypatch) as servers:
        servers.write(104, "fifth")
        assert servers.asked() is None
        servers.write(103, "fourth")
        assert servers.asked() == "fourth"


def test_a_runtime_file_without_a_url_gives_no_history() -> None:
    """Caught (mutation run, issue 22): ``or`` made ``and`` in the URL check (a missing or
    non-text ``url`` raised AttributeError instead of giving no history)."""
    assert panel_mod.server_history(60, info={"token": "t0k"}) == {}
    assert panel_mod.server_history(60, info={"url": 8888, "token": "t0k"}) == {}


def test_an_answer_that_is_not_json_is_logged_with_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Caught (mutation run, issue 22): the log line lost its words (only the error's text).
    The reason after them is json's own wording: only that one is given is pinned."""
    caplog.set_level(logging.DEBUG, logger=panel_mod.log.name)
    with _serving(b"<html>not json</html>") as url:
        assert panel_mod.server_history(60, info={"url": url, "token": "t0k"}) == {}
    (said,) = [r.getMessage() for r in caplog.records if r.name == panel_mod.log.name]
    assert said.startswith("no server history: ") and said[len("no server history: "):].strip()


def test_an_answer_without_series_gives_no_history() -> None:
    """A server whose answer has no ``series`` (an older or other extension) gives no history.
    Caught (mutation run, issue 22): the ``[]`` default of ``data.get("series", [])`` dropped
    (iterating None raised TypeError)."""
    with _serving(b'{"other": 1}') as url:
        assert panel_mod.server_history(60, info={"url": url, "token": "t0k"}) == {}


@pytest.mark.parametrize(("span_s", "asks"), [(55.0, True), (56.0, False), (57.0, False)])
def test_the_server_is_asked_only_while_the_own_history_is_two_samples_short_of_the_window(
    span_s: float, asks: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a 2 s interval and a 60 s window, own history covering 56 s or more is enough (within
    two samples of the window): the server is not asked. Caught (mutation run, issue 22): the
    margin ``2 * interval`` made ``2 / interval`` (1 s: the server asked at 56 and 57 s)."""

    asked: list[float] = []

    def fake_history(window_s: float) -> dict[str, Any]:
        asked.append(window_s)
        return {}

    monkeypatch.setattr(panel_mod, "server_history", fake_history)
    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps({"devices": [
        {"uuid": UUID, "name": "A100", "memory_total": 8, "memory_used": 1,
         "utilization_pct": 10},
    ]}))
    now = [1_000_000.0]
    s = Sampler(SimulatedBackend(str(path), clock=lambda: now[0]), interval_s=2.0,
                history_s=900.0, clock=lambda: now[0])
    s.sample_now()
    now[0] += span_s
    s.sample_now()
    panel = panel_mod.Panel(window_s=60, sampler=s)
    try:
        assert asked == ([60.0] if asks else [])
    finally:
        panel.close()


def test_a_server_whose_pid_is_2_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a container the server may well be pid 2 (under an init such as tini, pid 1); only
    pid 1 (init itself) and below end the search. Caught (mutation run, issue 22): the stop
    made ``pid <= 2`` (a server of pid 2 never found)."""
    with _servers(tmp_path, monkeypatch) as servers:
        servers.write(1, "init")
        servers.write(2, "two")
        monkeypatch.setattr(panel_mod.os, "getppid", lambda: 2)
        assert servers.asked() == "two"
        monkeypatch.setattr(panel_mod.os, "getppid", lambda: 1)
        assert servers.asked() is None


def _answer_of(size: int) -> bytes:
    """A valid history answer of exactly ``size`` bytes (blanks before its closing brace)."""
    head = json.dumps({"series": [
        {"uuid": UUID, "timestamp_s": [1.0], "utilization_pct": [10], "memory_used_bytes": [1]},
    ]}).encode()[:-1]
    return head + b" " * (size - len(head) - 1) + b"}"


def test_an_answer_of_exactly_the_size_limit_is_read_whole_and_a_longer_one_not_at_all() -> None:
    """Caught (mutation run, issue 22): the read made ``_MAX_HISTORY_BYTES - 1`` (an answer of
    exactly the limit lost its last byte: no history)."""
    limit = panel_mod._MAX_HISTORY_BYTES
    with _serving(_answer_of(limit)) as url:
        got = panel_mod.server_history(60, info={"url": url, "token": "t0k"})
    assert got == {UUID: ([1.0], [10], [1], None)}
    with _serving(_answer_of(limit + 1)) as url:  # cut at the limit: not JSON, so no history
        assert panel_mod.server_history(60, info={"url": url, "token": "t0k"}) == {}


# ---- the runtime file and the history request, read whole ----
# Found by the mutation run of issue 22.
def test_the_runtime_file_is_read_as_utf8_whatever_the_locale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a Latin-1 locale (``open`` without an encoding decodes Latin-1) a token with
    non-ASCII characters still reads back as written (and reaches the server so). Caught:
    ``encoding="utf-8"`` made ``None`` or dropped."""

    def latin1_locale_open(file: Any, mode: str = "r", buffering: int = -1,
                           encoding: str | None = None, **kw: Any) -> Any:
        return builtins.open(file, mode, buffering, encoding=encoding or "latin-1", **kw)

    monkeypatch.setattr(panel_mod, "open", latin1_locale_open, raising=False)
    monkeypatch.setattr(panel_mod.os, "getppid", lambda: 4000)
    with _servers(tmp_path, monkeypatch) as servers:
        servers.write(4000, "h", token="tök")  # as written: the server gets the same token
        assert servers.asked() == "h"
        assert servers.tokens == ["token tök"]


def test_a_runtime_file_that_is_not_an_object_is_no_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the ``isinstance(info, dict)`` check made always true (a JSON list returned)."""
    monkeypatch.setattr(panel_mod.os, "getppid", lambda: 4000)
    with _servers(tmp_path, monkeypatch) as servers:
        servers.write(4000, "h")
        assert servers.asked() == "h"
        info = json.loads((tmp_path / "jpserver-4000.json").read_text())
        (tmp_path / "jpserver-4000.json").write_text(json.dumps([info["url"]]))
        assert servers.asked() is None


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
