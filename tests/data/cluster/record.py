"""Record what a real Prometheus answers to ``core.cluster`` (the replay data of
``tests/unit/test_cluster.py``).

Run from the repository root (needs Debian's ``prometheus``; takes about half a minute)::

    .venv/bin/python tests/data/cluster/record.py

It starts the set-up of the slow cluster tests (``tests/clusterhelpers.py``: three
``autogpu exporter`` hosts, one DCGM-format endpoint, Prometheus scraping every second, a lease
on gpu-c), puts a recording proxy in front of Prometheus and writes, for each scenario, every
request ``fetch_cluster`` / ``fetch_history`` made and Prometheus's JSON answer:

* ``all-up.json``: every host up, ``fetch_cluster`` and ``fetch_history(120 s)``;
* ``gpu-a-down.json``: the same after gpu-a's exporter was stopped (``up == 0`` for it);
* ``errors.json``: Prometheus's answers to a PromQL syntax error, a scalar instant query and a
  range query that ends before it starts.

Each file: ``{"now_s": ..., "exchanges": [{"path", "params", "status", "body"}, ...]}``.
"""

from __future__ import annotations

import http.server
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from autogpu_jupyter.core.cluster import (  # noqa: E402
    ClusterError,
    PrometheusClient,
    fetch_cluster,
    fetch_history,
)
from tests.clusterhelpers import prometheus_cluster  # noqa: E402

HERE = Path(__file__).resolve().parent


class _Recorder(http.server.ThreadingHTTPServer):
    upstream = ""
    exchanges: list[dict[str, Any]]


class _Proxy(http.server.BaseHTTPRequestHandler):
    server: _Recorder

    def do_GET(self) -> None:
        url = self.server.upstream + self.path
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read()
        split = urllib.parse.urlsplit(self.path)
        self.server.exchanges.append({
            "path": split.path,
            "params": dict(urllib.parse.parse_qsl(split.query)),
            "status": status,
            "body": json.loads(body),
        })
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _record(proxy: _Recorder, name: str, history: bool) -> None:
    proxy.exchanges = []
    now = round(time.time(), 3)
    client = PrometheusClient(f"http://127.0.0.1:{proxy.server_address[1]}")
    view = fetch_cluster(client, now_s=now)
    if history:
        fetch_history(client, 120.0, now_s=now)
    (HERE / f"{name}.json").write_text(json.dumps(
        {"now_s": now, "exchanges": proxy.exchanges}, indent=1, sort_keys=True) + "\n")
    print(name, {h.hostname: h.state for h in view.hosts})


def _record_errors(proxy: _Recorder) -> None:
    proxy.exchanges = []
    now = round(time.time(), 3)
    client = PrometheusClient(f"http://127.0.0.1:{proxy.server_address[1]}")
    for ask in (lambda: client.query("rate(", now), lambda: client.query("1", now),
                lambda: client.query_range("up", now, now - 60, 1.0)):
        try:
            ask()
        except ClusterError as err:
            print(err)
    (HERE / "errors.json").write_text(json.dumps(
        {"now_s": now, "exchanges": proxy.exchanges}, indent=1, sort_keys=True) + "\n")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, prometheus_cluster(Path(tmp)) as cluster:
        proxy = _Recorder(("127.0.0.1", 0), _Proxy)
        proxy.upstream = cluster.url
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        time.sleep(5)  # a few scrapes, so the history has points
        _record(proxy, "all-up", history=True)
        cluster.exporters["gpu-a"].terminate()
        cluster.exporters["gpu-a"].wait(10)
        deadline = time.monotonic() + 30
        down = 'up{instance="' + cluster.targets["gpu-a"] + '"} == 0'
        while not cluster.query(down):
            if time.monotonic() > deadline:
                raise SystemExit("gpu-a never went down")
            time.sleep(0.2)
        _record(proxy, "gpu-a-down", history=False)
        _record_errors(proxy)
        proxy.shutdown()


if __name__ == "__main__":
    main()
