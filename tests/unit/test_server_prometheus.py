"""The server's cluster history asks Prometheus with the admin's timeout
(``c.AutoGPU.prometheus_timeout_s``), against a real HTTP server that does not answer in time.
A survivor of the sampled mutation run (issue 22: the timeout not passed, so a slow Prometheus
held a sidebar request for the client's 5 s default); seen failing with it planted by hand."""

from __future__ import annotations

import http.server
import logging
import threading
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
        answer = payloads.cluster_history_payload(state, 600.0)
    finally:
        _Slow.release.set()
        state.stop()
    assert answer["configured"] is True and answer["hosts"] == []
    assert answer["errors"] == [f"cannot reach Prometheus at {slow_prometheus}: timed out"]
