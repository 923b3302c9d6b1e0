"""``GET /autogpu/cluster`` of a real Jupyter server when one Prometheus target sends values that
are not numbers (issue 20): the answer is still 200 for every user, the bad samples left out and
named per host. Prometheus is a real HTTP server answering a recorded scrape
(tests/data/cluster/all-up.json) with one host's values replaced.
"""

from __future__ import annotations

import copy
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import sampler as sampler_mod

pytest_plugins = ["pytest_jupyter.jupyter_server"]

RECORDED = Path(__file__).resolve().parents[1] / "data" / "cluster" / "all-up.json"
UUID = "GPU-aaaa0000-0000-0000-0000-000000000000"  # a GPU of host gpu-a
BAD = {"autogpu_gpu_memory_total_bytes": "+Inf", "autogpu_gpu_utilization_ratio": "NaN",
       "autogpu_gpu_memory_used_bytes": "1e400"}


class _Prometheus(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answers: dict[tuple[str, str | None], bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Answer)
        self.answers = answers


class _Answer(http.server.BaseHTTPRequestHandler):
    server: _Prometheus

    def do_GET(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(split.query)).get("query")
        body = self.server.answers.get((split.path, query))
        if body is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[str]:
    data = json.loads(RECORDED.read_text())
    answers: dict[tuple[str, str | None], bytes] = {}
    for e in data["exchanges"]:
        body = copy.deepcopy(e["body"])
        for item in (body.get("data") or {}).get("result") or []:
            if not isinstance(item, dict):
                continue
            name = item.get("metric", {}).get("__name__")
            if item.get("metric", {}).get("uuid") == UUID and name in BAD:
                item["value"][1] = BAD[name]
        answers[(e["path"], e["params"].get("query"))] = json.dumps(body).encode()
    server = _Prometheus(answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def jp_server_config(prometheus: str, registry_dir: Path,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
    sampler_mod.stop_sampler()
    yield {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPU": {"prometheus_url": prometheus, "prometheus_timeout_s": 5.0},
    }
    sampler_mod.stop_sampler()


async def test_a_target_sending_inf_and_nan_does_not_break_the_cluster_view(
    jp_fetch: Any,
) -> None:
    response = await jp_fetch("autogpu", "cluster", params={"min_free": "10G"})
    assert response.code == 200
    data = json.loads(response.body)  # JSON without NaN: a browser can read it
    hosts = {h["hostname"]: h for h in data["hosts"]}
    assert sorted(hosts) == ["dgx-d", "gpu-a", "gpu-b", "gpu-c"]
    assert hosts["gpu-a"]["note"].endswith("3 sample(s) skipped (not finite numbers)")
    # (the recording is hours old: every host is stale now, and says so)
    assert not any("skipped" in (h["note"] or "") for n, h in hosts.items() if n != "gpu-a")
    assert data["errors"][-1].startswith(
        "gpu-a: 3 sample(s) skipped, not finite numbers (e.g. autogpu_gpu_memory_")
    dev = next(d for d in hosts["gpu-a"]["devices"] if d["uuid"] == UUID)
    assert (dev["memory_total_bytes"], dev["utilization_pct"], dev["memory_used_bytes"]) == (
        None, None, None)
    assert sorted(r["hostname"] for r in data["ranking"]) == sorted(hosts)
