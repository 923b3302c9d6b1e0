"""The server's cluster answers ask Prometheus with the admin's timeout
(``c.AutoGPU.prometheus_timeout_s``), against a real HTTP server that does not answer in time,
and the history's step against one that answers every range query with no series. Survivors of
the sampled mutation run (issue 22: the timeout not passed, so a slow Prometheus held a sidebar
request for the client's 5 s default; the reason or the step left out of the answer); each seen
failing with it planted by hand."""

from __future__ import annotations

import http.server
import json
import logging
import threading
import urllib.parse
from collections.abc import Iterator

import pytest
from traitlets.config import Config, Configurable

from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import AutoGPUServer


class _Slow(http.server.BaseHTTPRequestHandler):
    """Answers every request 503, but only after 1 s (or when the test lets it go): far later
    than the admin's 0.2 s, far sooner than the client's 5 s default."""

    release = threading.Event()

    def do_GET(self) -> None:
        self.release.wait(1.0)
        try:
            self.send_error(503, "late")
        except OSError:  # the client gave up: the expected case
            pass

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_prometheus() -> Iterator[str]:
    _Slow.release = threading.Event()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        _Slow.release.set()
        server.shutdown()
        server.server_close()


def test_the_cluster_history_gives_up_after_the_admins_timeout(slow_prometheus: str) -> None:
    config = Config()
    config.AutoGPU.prometheus_url = slow_prometheus
    config.AutoGPU.prometheus_timeout_s = 0.2
    parent = Configurable(config=config)
    state = AutoGPUServer(parent=parent, registry_dir="",
                          log=logging.getLogger("autogpu-test-server"))
    try:
        answer = payloads.cluster_history_payload(state.context(), 600.0)
    finally:
        _Slow.release.set()
        state.stop()
    assert answer["configured"] is True and answer["hosts"] == []
    assert answer["errors"] == [f"cannot reach Prometheus at {slow_prometheus}: timed out"]


def _state(url: str, timeout_s: float = 0.2) -> AutoGPUServer:
    config = Config()
    config.AutoGPU.prometheus_url = url
    config.AutoGPU.prometheus_timeout_s = timeout_s
    return AutoGPUServer(parent=Configurable(config=config), registry_dir="",
                         log=logging.getLogger("autogpu-test-server"))


def test_the_cluster_answer_says_why_prometheus_gave_no_hosts(slow_prometheus: str) -> None:
    """Caught: the reason written under another key than ``errors`` (the sidebar showed an empty
    cluster with no word of why)."""
    from autogpu_jupyter.core.policy import Constraints

    state = _state(slow_prometheus)
    try:
        answer = payloads.cluster_payload(state.context(), Constraints.parse(min_free="10G"))
    finally:
        _Slow.release.set()
        state.stop()
    assert (answer["configured"], answer["hosts"], answer["ranking"], answer["best"]) == (
        True, [], [], None)
    assert answer["errors"] == [f"cannot reach Prometheus at {slow_prometheus}: timed out"]


class _NoSeries(http.server.BaseHTTPRequestHandler):
    """Answers every range query at once: a matrix with no series (a cluster with no GPU host)."""

    def do_GET(self) -> None:
        body = json.dumps({"status": "success",
                           "data": {"resultType": "matrix", "result": []}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_cluster_history_says_its_step() -> None:
    """Ten minutes in 120 points: one every 5 s, said in ``step_s`` (the sidebar's chart spaces
    its points by it). Caught: ``step_s`` left ``null`` once Prometheus answered."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSeries)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state = _state(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5.0)
    try:
        answer = payloads.cluster_history_payload(state.context(), 600.0)
    finally:
        state.stop()
        server.shutdown()
        server.server_close()
    assert {k: v for k, v in answer.items() if k != "prometheus_url"} == {
        "configured": True, "seconds": 600.0, "step_s": 5.0, "hosts": [], "errors": []}


class _NotFinite(http.server.BaseHTTPRequestHandler):
    """Host gpu-a's utilisation series has one NaN point, its memory series two ``+Inf``; DCGM's
    queries give no series."""

    def do_GET(self) -> None:
        query = urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query)["query"][0]
        bad = {"avg by (hostname) (autogpu_gpu_utilization_ratio)": ["NaN"],
               "avg by (hostname) (autogpu_gpu_memory_used_ratio)": ["+Inf", "+Inf"]}.get(query)
        points = [[1000.0 + i, v] for i, v in enumerate(bad or ())]
        result = [{"metric": {"hostname": "gpu-a"}, "values": points}] if points else []
        body = json.dumps({"status": "success",
                           "data": {"resultType": "matrix", "result": result}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_cluster_history_says_which_series_had_points_left_out() -> None:
    """Two series had points that are not finite numbers: the answer counts them and shows the
    first. Caught (mutation run, issue 22, seed 52): another series than the first shown (with
    one series only, an IndexError: the whole answer a 500)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFinite)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state = _state(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=5.0)
    try:
        answer = payloads.cluster_history_payload(state.context(), 600.0)
    finally:
        state.stop()
        server.shutdown()
        server.server_close()
    assert answer["errors"] == [
        "2 series had points that are not finite numbers, left out (e.g. ? has 1 point(s) that "
        "are not finite)"]
    assert [h["hostname"] for h in answer["hosts"]] == ["gpu-a"]
