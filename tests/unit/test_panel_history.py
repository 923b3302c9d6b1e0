"""A fresh ``%gpu panel`` starts with the history its Jupyter server already has: the server is
found through its runtime file (``jpserver-<pid>.json``) and asked over HTTP (a real local HTTP
server here, answering as ``GET autogpu/history`` does)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.widgets import panel as panel_mod

UUID = "GPU-aaaaaaaa-0000-0000-0000-000000000000"


@pytest.fixture
def server() -> Iterator[tuple[str, list[str]]]:
    """A local HTTP server answering ``/autogpu/history`` to the token ``t0k``; yields its URL
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
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
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
    assert path.startswith("/base/autogpu/history?since=")


def test_no_history_without_a_server_that_answers(server: tuple[str, list[str]]) -> None:
    url, _ = server
    assert panel_mod.server_history(60, info={"url": url, "token": "wrong"}) == {}
    assert panel_mod.server_history(60, info={"url": "https://x/", "token": "t0k"}) == {}
    assert panel_mod.server_history(60, info={"url": url, "sock": "/s", "token": "t0k"}) == {}
    assert panel_mod.server_history(60, info={}) == {}
    closed = url.replace(url.split(":")[2].split("/")[0], "1")  # port 1: nothing listens
    assert panel_mod.server_history(60, info={"url": closed, "token": "t0k"}) == {}


def test_the_server_is_the_one_that_started_this_kernel(tmp_path: Path) -> None:
    # this test process plays the kernel: its parent is "the server"
    (tmp_path / f"jpserver-{os.getppid()}.json").write_text(json.dumps({"url": "http://a/"}))
    (tmp_path / "jpserver-1.json").write_text(json.dumps({"url": "http://other/"}))
    assert panel_mod._server_info(str(tmp_path)) == {"url": "http://a/"}
    (tmp_path / f"jpserver-{os.getppid()}.json").write_text("not json")
    assert panel_mod._server_info(str(tmp_path), max_depth=1) is None
    assert panel_mod._server_info(str(tmp_path / "missing")) is None
