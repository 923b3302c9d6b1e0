"""Fast unit tests of the cluster view (``core.cluster``) over recorded Prometheus answers.

``tests/data/cluster/*.json`` hold what Debian's ``prometheus`` answered to ``fetch_cluster`` and
``fetch_history`` over the set-up of the slow cluster tests (three ``autogpu exporter`` hosts, one
DCGM-format endpoint, a lease on gpu-c; recorded by ``tests/data/cluster/record.py``). A loopback
HTTP server in a thread of this process replays them, so the real ``urllib`` client, JSON parsing,
folding, host states and ranking run here in milliseconds; edge cases are those answers edited
(missing labels, NaN, a host gone stale, error answers, non-JSON, a hung server).
"""

from __future__ import annotations

import copy
import dataclasses
import http.server
import json
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.cluster import (
    DEFAULT_SCRAPE_INTERVAL_S,
    MAX_SERIES,
    ClusterError,
    ClusterView,
    PrometheusClient,
    RangeSeries,
    Rejected,
    Sample,
    check_history_s,
    check_url,
    fetch_cluster,
    fetch_history,
    prometheus,
    rank_hosts,
)
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import UsageErrorBase

GiB = 1024**3
MiB = 1024**2
DATA = Path(__file__).resolve().parents[1] / "data" / "cluster"

A100, L4, H100 = "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA H100 80GB HBM3"
#: The recorded scrape targets (loopback address and the port the recording got).
INST = {"gpu-a": "127.0.0.2:33827", "gpu-b": "127.0.0.3:39931", "gpu-c": "127.0.0.4:40579",
        "dgx-d": "127.0.0.5:58763"}

AUTOGPU_Q = '{__name__=~"autogpu_gpu_.*|autogpu_lease_info"}'
DCGM_Q = ('{__name__=~"DCGM_FI_DEV_GPU_UTIL|DCGM_FI_PROF_GR_ENGINE_ACTIVE|DCGM_FI_DEV_FB_USED|'
          'DCGM_FI_DEV_FB_FREE|DCGM_FI_DEV_GPU_TEMP|DCGM_FI_DEV_POWER_USAGE|'
          'gpu_gfx_activity|gpu_used_vram|gpu_total_vram|gpu_junction_temperature|'
          'gpu_edge_temperature|gpu_package_power|gpu_power_usage"}')
SCRAPED_Q = 'timestamp({__name__=~"autogpu_host_info|DCGM_FI_DEV_FB_USED|gpu_used_vram"})'
SWEEP_Q = "max by (instance, hostname) (last_over_time(autogpu_sample_timestamp_seconds[1h]))"
DCGM_NAMES_Q = ("max by (instance, hostname, Hostname) "
                '(last_over_time({__name__=~"DCGM_FI_DEV_FB_USED|gpu_used_vram"}[1h]))')


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((DATA / f"{name}.json").read_text())
    return data


class Replay(http.server.ThreadingHTTPServer):
    """Answers ``GET path?query=...`` from ``routes`` (keyed by path and ``query`` parameter);
    records every request's path and parameters."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _ReplayHandler)
        self.routes: dict[tuple[str, str | None], tuple[int, bytes, str]] = {}
        self.requests: list[tuple[str, dict[str, str]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, path: str, query: str | None, body: Any, status: int = 200,
               content_type: str = "application/json") -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.routes[(path, query)] = (status, raw, content_type)

    def replay(self, exchanges: list[dict[str, Any]]) -> None:
        for e in exchanges:
            self.answer(e["path"], e["params"].get("query"), e["body"], e["status"])


class Answering(http.server.ThreadingHTTPServer):
    """A Prometheus on loopback whose API answers ``get(path, params)`` as its ``data`` (the
    ``{"status": "success", "data": ...}`` envelope), whatever is asked."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _AnsweringHandler)
        self.get: Callable[[str, dict[str, str]], object] = lambda path, params: {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _AnsweringHandler(http.server.BaseHTTPRequestHandler):
    server: Answering

    def do_GET(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        data = self.server.get(split.path, dict(urllib.parse.parse_qsl(split.query)))
        body = json.dumps({"status": "success", "data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[Answering]:
    """An answering Prometheus on loopback for one test."""
    server = Answering()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class _ReplayHandler(http.server.BaseHTTPRequestHandler):
    server: Replay

    def do_GET(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(split.query))
        self.server.requests.append((split.path, params))
        status, body, ctype = self.server.routes.get(
            (split.path, params.get("query")), (404, b"404 page not found\n", "text/plain"))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def _server() -> Iterator[Replay]:
    server = Replay()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def prom(_server: Replay) -> Replay:
    """The replaying server, with no answers yet and no requests seen."""
    _server.routes.clear()
    _server.requests.clear()
    return _server


def scenario(prom: Replay, name: str,
             edit: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None
             ) -> tuple[PrometheusClient, float]:
    """Serve recorded scenario ``name``; ``edit`` may change the result lists first (keyed by
    query; the targets' list under ``"targets"``)."""
    data = copy.deepcopy(load(name))
    results: dict[str, list[dict[str, Any]]] = {}
    for e in data["exchanges"]:
        if e["path"] == "/api/v1/targets":
            results["targets"] = e["body"]["data"]["activeTargets"]
        elif e["status"] == 200:
            results[e["params"]["query"]] = e["body"]["data"]["result"]
    if edit is not None:
        edit(results)
    prom.replay(data["exchanges"])
    return PrometheusClient(prom.url), data["now_s"]


def sample(labels: dict[str, str], value: str, at: float = 1796270649.176) -> dict[str, Any]:
    return {"metric": labels, "value": [at, value]}


def device(uuid: str, index: int, name: str, *, util: float | None, used: int | None,
           total: int | None, source: str = "autogpu", booked: int = 0, leases: int = 0,
           temp: float | None = None, power: float | None = None, mig: int | None = None,
           holders: tuple[str, ...] = (), available: bool = True) -> dict[str, Any]:
    label = f"GPU {index}" + (f" MIG {mig}" if mig is not None else "")
    return {
        "uuid": uuid, "index": index, "mig_index": mig, "label": label, "name": name,
        "available": available, "source": source, "utilization_pct": util,
        "memory_used_bytes": used, "memory_total_bytes": total,
        "memory_free_bytes": None if used is None or total is None else total - used,
        "memory_booked_bytes": booked, "temperature_c": temp, "power_w": power,
        "lease_count": leases, "waiters": 0, "holders": list(holders),
    }


DEVICES: dict[str, list[dict[str, Any]]] = {
    "dgx-d": [
        device("GPU-dddd0000-0000-0000-0000-000000000000", 0, A100, util=90.0,
               used=70000 * MiB, total=81920 * MiB, source="dcgm"),
        device("GPU-dddd0001-0000-0000-0000-000000000001/1", 1, A100, util=50.0,
               used=1000 * MiB, total=40000 * MiB, source="dcgm", mig=1),
    ],
    "gpu-a": [
        device("GPU-aaaa0000-0000-0000-0000-000000000000", 0, A100, util=70.0,
               used=60 * GiB, total=80 * GiB, temp=60.0, power=300.0),
        device("GPU-aaaa0001-0000-0000-0000-000000000001", 1, A100, util=10.0,
               used=75 * GiB, total=80 * GiB, temp=40.0, power=90.0),
    ],
    "gpu-b": [
        device("GPU-bbbb0000-0000-0000-0000-000000000000", 0, L4, util=50.0,
               used=4 * GiB, total=24 * GiB, temp=54.0),
        device("GPU-bbbb0001-0000-0000-0000-000000000001", 1, L4, util=5.0,
               used=20 * GiB, total=24 * GiB, temp=34.0),
        device("GPU-bbbb0002-0000-0000-0000-000000000002", 2, L4, util=30.0,
               used=2 * GiB, total=24 * GiB, temp=46.0),
        device("GPU-bbbb0003-0000-0000-0000-000000000003", 3, L4, util=None,
               used=None, total=None, available=False),
    ],
    "gpu-c": [
        device("GPU-cccc0000-0000-0000-0000-000000000000", 0, H100, util=20.0,
               used=10 * GiB, total=80 * GiB, booked=30 * GiB, leases=1, temp=41.0,
               holders=("root",)),
        device("GPU-cccc0001-0000-0000-0000-000000000001", 1, H100, util=0.0,
               used=40 * GiB, total=80 * GiB, temp=32.0),
    ],
}
#: When Prometheus last scraped each host (the recorded ``timestamp(...)`` answers).
AS_OF = {"dgx-d": 1796270648.239, "gpu-a": 1796270648.185, "gpu-b": 1796270648.665,
         "gpu-c": 1796270648.913}


def host_dict(name: str, **changes: Any) -> dict[str, Any]:
    return {"hostname": name, "instances": [INST[name]], "state": "ok", "as_of_s": AS_OF[name],
            "scrape_interval_s": 1.0, "note": None, "devices": DEVICES[name], **changes}


# ---- the view of every host -----------------------------------------------------------------


def test_every_host_with_its_devices_as_prometheus_holds_them(prom: Replay) -> None:
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    assert view.to_dict() == {
        "prometheus_url": prom.url,
        "timestamp_s": now,
        "hosts": [host_dict(h) for h in ("dgx-d", "gpu-a", "gpu-b", "gpu-c")],
        "errors": [],
    }
    lost = view.hosts[2].devices[3].snapshot
    assert (lost.available, lost.error) == (False, "lost (exporter says unavailable)")
    assert view.hosts[2].devices[0].snapshot.error is None
    mig = view.hosts[0].devices[1].snapshot
    assert (mig.is_mig, mig.parent_uuid, mig.timestamp_s) == (
        True, "GPU-dddd0001-0000-0000-0000-000000000001", now)
    assert view.hosts[0].devices[0].snapshot.parent_uuid is None
    assert view.hosts[1].devices[0].snapshot.is_mig is False
    assert view.hosts[1].devices[0].snapshot.timestamp_s == now


def test_the_queries_asked_at_the_given_moment(prom: Replay) -> None:
    client, now = scenario(prom, "all-up")
    fetch_cluster(client, now_s=now)
    at = {"time": "1796270649.176"}
    assert prom.requests == [
        ("/api/v1/query", {"query": AUTOGPU_Q, **at}),
        ("/api/v1/query", {"query": DCGM_Q, **at}),
        ("/api/v1/query", {"query": SCRAPED_Q, **at}),
        ("/api/v1/query", {"query": "up", **at}),
        ("/api/v1/query", {"query": SWEEP_Q, **at}),
        ("/api/v1/query", {"query": DCGM_NAMES_Q, **at}),
        ("/api/v1/targets", {"state": "active"}),
    ]


def test_without_a_moment_the_queries_ask_for_now(prom: Replay) -> None:
    client, _ = scenario(prom, "all-up")
    before = time.time()
    view = fetch_cluster(client)
    assert before <= view.timestamp_s <= time.time()
    assert {p.get("time") for _, p in prom.requests} == {f"{view.timestamp_s:.3f}", None}


def test_host_lookup_by_name(prom: Replay) -> None:
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    host = view.host("gpu-b")
    assert host is not None and host.hostname == "gpu-b"
    assert view.host("gpu-z") is None
    assert ClusterView("http://p:9090", 0.0, ()).to_dict() == {
        "prometheus_url": "http://p:9090", "timestamp_s": 0.0, "hosts": [], "errors": []}


def test_a_stopped_exporter_marks_its_host_down_as_of_its_last_sweep(prom: Replay) -> None:
    client, now = scenario(prom, "gpu-a-down")
    view = fetch_cluster(client, now_s=now)
    data = load("gpu-a-down")
    sweep = next(e for e in data["exchanges"] if e["params"].get("query") == SWEEP_Q)
    last = {r["metric"]["hostname"]: float(r["value"][1]) for r in sweep["body"]["data"]["result"]}
    a = view.to_dict()["hosts"][1]
    assert a == {"hostname": "gpu-a", "instances": [INST["gpu-a"]], "state": "down",
                 "as_of_s": last["gpu-a"], "scrape_interval_s": 1.0,
                 "note": "exporter down (up == 0)", "devices": []}
    assert [(h.hostname, h.state, h.note) for h in view.hosts] == [
        ("dgx-d", "ok", None), ("gpu-a", "down", "exporter down (up == 0)"),
        ("gpu-b", "ok", None), ("gpu-c", "ok", None)]


# ---- host states --------------------------------------------------------------------------


def test_hosts_without_a_sample_for_two_scrape_intervals_are_stale_and_never_ranked(
    prom: Replay,
) -> None:
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now + 30)
    assert [(h.hostname, h.state, h.note, h.as_of_s) for h in view.hosts] == [
        ("dgx-d", "stale", "newest sample 31 s old (> 2 scrape intervals)", AS_OF["dgx-d"]),
        ("gpu-a", "stale", "newest sample 31 s old (> 2 scrape intervals)", AS_OF["gpu-a"]),
        ("gpu-b", "stale", "newest sample 31 s old (> 2 scrape intervals)", AS_OF["gpu-b"]),
        ("gpu-c", "stale", "newest sample 30 s old (> 2 scrape intervals)", AS_OF["gpu-c"]),
    ]
    # a stale host still shows the devices Prometheus last had
    assert [len(h.devices) for h in view.hosts] == [2, 2, 4, 2]
    choices = rank_hosts(view, Constraints.parse(min_free="10G"))
    assert [(c.host.hostname, c.fits, c.chosen, c.candidates) for c in choices] == [
        ("dgx-d", False, (), ()), ("gpu-a", False, (), ()), ("gpu-b", False, (), ()),
        ("gpu-c", False, (), ())]


def edit_value(results: dict[str, list[dict[str, Any]]], query: str, host: str,
               value: str) -> None:
    """Set the value of ``query``'s samples of ``host`` (by hostname label or instance)."""
    for r in results[query]:
        m = r["metric"]
        if host in (m.get("hostname"), m.get("Hostname"), m.get("instance")):
            r["value"][1] = value


@pytest.mark.parametrize(
    ("age_s", "interval", "state", "note"),
    [
        (2.0, "1s", "ok", None),
        (2.5, "1s", "stale", "newest sample 2 s old (> 2 scrape intervals)"),
        (3.0, "1s", "stale", "newest sample 3 s old (> 2 scrape intervals)"),
        (30.0, "15s", "ok", None),
        (31.0, "15s", "stale", "newest sample 31 s old (> 2 scrape intervals)"),
        (-1.0, "1s", "ok", None),
    ],
)
def test_a_host_is_stale_past_two_of_its_scrape_intervals(
    prom: Replay, age_s: float, interval: str, state: str, note: str | None
) -> None:
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        edit_value(results, SCRAPED_Q, "gpu-c", repr(1796270649.176 - age_s))
        for t in results["targets"]:
            if t["labels"]["instance"] == INST["gpu-c"]:
                t["scrapeInterval"] = interval

    client, now = scenario(prom, "all-up", edit)
    host = fetch_cluster(client, now_s=now).host("gpu-c")
    assert host is not None
    assert (host.state, host.note, host.as_of_s, host.scrape_interval_s) == (
        state, note, 1796270649.176 - age_s, {"1s": 1.0, "15s": 15.0}[interval])


def test_a_host_never_scraped_is_stale_with_no_samples(prom: Replay) -> None:
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[SCRAPED_Q][:] = [r for r in results[SCRAPED_Q]
                                 if r["metric"].get("hostname") != "gpu-b"]

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert view.to_dict()["hosts"][2] == host_dict("gpu-b", state="stale", as_of_s=None,
                                                   note="no samples")


def test_the_newest_scrape_of_a_host_counts(prom: Replay) -> None:
    """dgx-d's two GPUs are scraped at different moments (edited): the later one is "as of"."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[SCRAPED_Q][0]["value"][1] = "1796270640.5"

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert view.hosts[0].as_of_s == AS_OF["dgx-d"]

    def edit_second(results: dict[str, list[dict[str, Any]]]) -> None:
        results[SCRAPED_Q][1]["value"][1] = "1796270640.5"

    client, now = scenario(prom, "all-up", edit_second)
    assert fetch_cluster(client, now_s=now).hosts[0].as_of_s == AS_OF["dgx-d"]


def test_a_host_is_down_only_when_every_target_is_down(prom: Replay) -> None:
    """gpu-b scraped through two targets (edited): one down, one up, it is ok; both down, down."""
    second = "127.0.0.3:10000"  # sorts first, listed last

    def one_down(results: dict[str, list[dict[str, Any]]]) -> None:
        results["up"].append(sample({"__name__": "up", "instance": second}, "0"))
        results[SWEEP_Q].append(sample({"hostname": "gpu-b", "instance": second},
                                       "1796270600.5"))

    client, now = scenario(prom, "all-up", one_down)
    b = fetch_cluster(client, now_s=now).host("gpu-b")
    assert b is not None
    assert (b.instances, b.state, b.as_of_s, len(b.devices)) == (
        (second, INST["gpu-b"]), "ok", AS_OF["gpu-b"], 4)

    def both_down(results: dict[str, list[dict[str, Any]]]) -> None:
        one_down(results)
        edit_value(results, "up", INST["gpu-b"], "0")

    client, now = scenario(prom, "all-up", both_down)
    view = fetch_cluster(client, now_s=now)
    b = view.host("gpu-b")
    assert b is not None
    # "as of": the newest last sweep of its targets
    assert (b.state, b.note, b.as_of_s, b.devices) == (
        "down", "exporter down (up == 0)", 1796270648.501806, ())
    assert [h.state for h in view.hosts] == ["ok", "ok", "down", "ok"]


def test_a_down_host_without_a_known_sweep_keeps_its_last_scrape(prom: Replay) -> None:
    """DCGM hosts have no autogpu sweep time: down, "as of" is their newest scrape."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        edit_value(results, "up", INST["dgx-d"], "0")

    client, now = scenario(prom, "all-up", edit)
    d = fetch_cluster(client, now_s=now).host("dgx-d")
    assert d is not None
    assert (d.state, d.as_of_s, d.devices) == ("down", AS_OF["dgx-d"], ())


def test_targets_that_never_exported_gpus_are_not_hosts(prom: Replay) -> None:
    """Prometheus scraping itself (and a node exporter) gives ``up`` series, no host."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results["up"][:0] = [sample({"__name__": "up", "instance": "localhost:9090"}, "1"),
                             sample({"__name__": "up", "instance": "127.0.0.9:9100"}, "0")]

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert [(h.hostname, h.instances, h.state) for h in view.hosts] == [
        ("dgx-d", (INST["dgx-d"],), "ok"), ("gpu-a", (INST["gpu-a"],), "ok"),
        ("gpu-b", (INST["gpu-b"],), "ok"), ("gpu-c", (INST["gpu-c"],), "ok")]


def test_a_host_known_only_by_its_series_has_no_targets(prom: Replay) -> None:
    """Neither ``up`` nor the name queries know gpu-c's target (edited out): its devices still
    make it a host, with no instances, ok by its scrape time, under the default 60 s interval."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for q in ("up", SWEEP_Q):
            results[q][:] = [r for r in results[q] if r["metric"]["instance"] != INST["gpu-c"]]

    client, now = scenario(prom, "all-up", edit)
    assert fetch_cluster(client, now_s=now).to_dict()["hosts"][3] == host_dict(
        "gpu-c", instances=[], scrape_interval_s=60.0)


def test_a_target_left_out_of_the_name_queries_is_tied_to_its_host_by_its_gpu_series(
    prom: Replay,
) -> None:
    """gpu-c's and dgx-d's targets missing from the name queries (edited out): the ``instance``
    label of their GPU series still ties their ``up`` and scrape interval to them."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for q in (SWEEP_Q, DCGM_NAMES_Q):
            results[q][:] = [r for r in results[q]
                             if r["metric"]["instance"] not in (INST["gpu-c"], INST["dgx-d"])]

    client, now = scenario(prom, "all-up", edit)
    assert fetch_cluster(client, now_s=now).to_dict()["hosts"] == [
        host_dict(h) for h in ("dgx-d", "gpu-a", "gpu-b", "gpu-c")]


def test_a_scrape_time_is_its_targets_host_else_that_of_its_hostname_label(
    prom: Replay,
) -> None:
    """gpu-c's scrape time without a ``hostname`` label (edited) is its target's host's; gpu-b's
    without an ``instance`` label goes by its ``hostname`` label."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for r in results[SCRAPED_Q]:
            m = r["metric"]
            if m.get("hostname") == "gpu-c":
                del m["hostname"]
            elif m.get("hostname") == "gpu-b":
                del m["instance"]

    client, now = scenario(prom, "all-up", edit)
    assert fetch_cluster(client, now_s=now).to_dict()["hosts"] == [
        host_dict(h) for h in ("dgx-d", "gpu-a", "gpu-b", "gpu-c")]


# ---- scrape intervals ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("15s", 15.0), ("1s", 1.0), ("500ms", 0.5), ("1m30s", 90.0), ("2m", 120.0),
        ("1h", 3600.0), ("1d", 3600.0), ("1h1m1s", 3600.0), ("59m59s", 3599.0), ("1.5s", 1.5),
        ("10ms5s", 5.01), ("0s", None), ("", None), ("s", None), ("15", None), ("1x", None),
        ("15 s", None), ("1m30", None), ("ms", None), ("1.2.3s", None),
    ],
)
def test_a_targets_prometheus_duration_is_its_scrape_interval_in_seconds(
    answering: Answering, text: str, seconds: float | None
) -> None:
    """What the targets API says as ``scrapeInterval`` (``1m30s``, ``500ms``), in seconds, at most
    an hour; unreadable or zero: the default interval (``None`` here)."""
    client = _client(answering, {"targets": {"activeTargets": [
        {"labels": {"instance": "a:1"}, "scrapeInterval": text}]}})
    want = DEFAULT_SCRAPE_INTERVAL_S if seconds is None else seconds
    assert client.scrape_intervals() == {"a:1": want}


def test_each_hosts_scrape_interval_is_its_slowest_targets(prom: Replay) -> None:
    """gpu-a's target scraped every 1m30s, gpu-b's interval unreadable (the 60 s default),
    gpu-c's target unknown to the targets API (60 s), dgx-d's 500 ms."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        by_inst = {t["labels"]["instance"]: t for t in results["targets"]}
        by_inst[INST["gpu-a"]]["scrapeInterval"] = "1m30s"
        by_inst[INST["gpu-b"]]["scrapeInterval"] = "soon"
        by_inst[INST["dgx-d"]]["scrapeInterval"] = "500ms"
        results["targets"].remove(by_inst[INST["gpu-c"]])

    client, now = scenario(prom, "all-up", edit)
    assert client.scrape_intervals() == {INST["gpu-a"]: 90.0, INST["gpu-b"]: 60.0,
                                         INST["dgx-d"]: 0.5}
    view = fetch_cluster(client, now_s=now + 1.5)
    assert [(h.hostname, h.scrape_interval_s, h.state) for h in view.hosts] == [
        ("dgx-d", 0.5, "stale"), ("gpu-a", 90.0, "ok"), ("gpu-b", 60.0, "ok"),
        ("gpu-c", 60.0, "ok")]
    assert view.errors == ()


def test_targets_without_labels_or_interval(prom: Replay) -> None:
    prom.answer("/api/v1/targets", None, {"status": "success", "data": {"activeTargets": [
        {"scrapeInterval": "5s"}, {"labels": {"instance": "h:1"}}, {"labels": {}}]}})
    assert PrometheusClient(prom.url).scrape_intervals() == {"": 60.0, "h:1": 60.0}
    prom.answer("/api/v1/targets", None, {"status": "success", "data": {}})
    assert PrometheusClient(prom.url).scrape_intervals() == {}
    prom.answer("/api/v1/targets", None, {"status": "success"})
    assert PrometheusClient(prom.url).scrape_intervals() == {}


def test_without_the_targets_api_the_default_interval_is_assumed_and_said(prom: Replay) -> None:
    client, now = scenario(prom, "all-up")
    prom.answer("/api/v1/targets", None, {"status": "error", "errorType": "unavailable",
                                          "error": "targets API disabled"}, status=503)
    view = fetch_cluster(client, now_s=now)
    assert view.errors == (
        f"scrape intervals unknown (Prometheus at {prom.url} answered 503 to /api/v1/targets: "
        "targets API disabled); assuming 60 s",)
    assert [(h.hostname, h.scrape_interval_s, h.state) for h in view.hosts] == [
        ("dgx-d", 60.0, "ok"), ("gpu-a", 60.0, "ok"), ("gpu-b", 60.0, "ok"),
        ("gpu-c", 60.0, "ok")]
    assert view.to_dict()["errors"] == list(view.errors)


# ---- how series become devices ------------------------------------------------------------


def autogpu(name: str, host: str, uuid: str | None, value: str, **labels: str) -> dict[str, Any]:
    metric = {"__name__": name, "hostname": host, "instance": INST.get(host, host + ":1"),
              "job": "autogpu", **labels}
    if uuid is not None:
        metric["uuid"] = uuid
    return sample(metric, value)


def test_lease_holders_are_named_with_their_notebook_sorted(prom: Replay) -> None:
    uuid = "GPU-aaaa0000-0000-0000-0000-000000000000"

    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[AUTOGPU_Q] += [
            autogpu("autogpu_lease_info", "gpu-a", uuid, "1", user="bob", notebook="x.ipynb"),
            autogpu("autogpu_lease_info", "gpu-a", uuid, "1", notebook="a.ipynb"),
            autogpu("autogpu_lease_info", "gpu-a", uuid, "1", user="alice", notebook=""),
            autogpu("autogpu_lease_info", "gpu-a", uuid, "1", user="carol"),
        ]

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert view.hosts[1].devices[0].holders == ("?: a.ipynb", "alice", "bob: x.ipynb", "carol")
    # lease_info series are not device values
    assert view.to_dict()["hosts"][1]["devices"][0] == {
        **DEVICES["gpu-a"][0], "holders": ["?: a.ipynb", "alice", "bob: x.ipynb", "carol"]}


def test_series_without_a_uuid_are_ignored(prom: Replay) -> None:
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[AUTOGPU_Q][:0] = [
            autogpu("autogpu_gpu_available", "gpu-e", None, "1"),
            autogpu("autogpu_gpu_available", "gpu-e", "", "1"),
        ]
        results[DCGM_Q][:0] = [
            sample({"__name__": "DCGM_FI_DEV_FB_USED", "Hostname": "dgx-e", "gpu": "0",
                    "instance": "127.0.0.6:9400"}, "5"),
            sample({"__name__": "DCGM_FI_DEV_FB_USED", "Hostname": "dgx-e", "gpu": "0",
                    "UUID": "", "instance": "127.0.0.6:9400"}, "5"),
        ]

    client, now = scenario(prom, "all-up", edit)
    assert fetch_cluster(client, now_s=now).to_dict()["hosts"] == [
        host_dict(h) for h in ("dgx-d", "gpu-a", "gpu-b", "gpu-c")]


def test_autogpus_series_win_over_dcgms_for_the_same_gpu(prom: Replay) -> None:
    """gpu-a also runs a DCGM exporter (edited in, listed first): its GPU 0 stays autogpu's."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[DCGM_Q][:0] = [
            sample({"__name__": f, "Hostname": "gpu-a", "gpu": "0", "instance": "127.0.0.2:9400",
                    "UUID": "GPU-aaaa0000-0000-0000-0000-000000000000", "modelName": "A100"}, v)
            for f, v in (("DCGM_FI_DEV_FB_USED", "1"), ("DCGM_FI_DEV_GPU_UTIL", "99"))
        ]

    client, now = scenario(prom, "all-up", edit)
    assert fetch_cluster(client, now_s=now).to_dict()["hosts"] == [
        host_dict(h) for h in ("dgx-d", "gpu-a", "gpu-b", "gpu-c")]


def test_dcgm_values_in_mib_and_percent_become_bytes_and_percent(prom: Replay) -> None:
    """A DCGM exporter of 2026 (``hostname`` label) with temperature and power, one GPU without
    utilisation and free memory, one MIG instance without a GPU index."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        base = {"hostname": "dgx-e", "instance": "127.0.0.6:9400", "modelName": "NVIDIA B200"}
        g0 = {**base, "gpu": "0", "UUID": "GPU-eeee0000"}
        g1 = {**base, "gpu": "1", "UUID": "GPU-eeee0001"}
        mig = {**base, "gpu": "", "UUID": "GPU-eeee0002", "GPU_I_ID": "3"}
        results[DCGM_Q] += [
            sample({"__name__": "DCGM_FI_DEV_FB_USED", **g0}, "1024.5"),
            sample({"__name__": "DCGM_FI_DEV_FB_FREE", **g0}, "2048"),
            sample({"__name__": "DCGM_FI_DEV_GPU_UTIL", **g0}, "7"),
            sample({"__name__": "DCGM_FI_PROF_GR_ENGINE_ACTIVE", **g0}, "0.9"),
            sample({"__name__": "DCGM_FI_DEV_GPU_TEMP", **g0}, "55"),
            sample({"__name__": "DCGM_FI_DEV_POWER_USAGE", **g0}, "612.5"),
            sample({"__name__": "DCGM_FI_DEV_FB_USED", **g1}, "100"),
            sample({"__name__": "DCGM_FI_DEV_FB_FREE", **mig}, "10"),
        ]
        results["up"].append(sample({"__name__": "up", "instance": "127.0.0.6:9400"}, "1"))
        results[DCGM_NAMES_Q].append(sample({"hostname": "dgx-e", "instance": "127.0.0.6:9400"},
                                            "1024.5"))
        results[SCRAPED_Q].append(sample({"hostname": "dgx-e", "instance": "127.0.0.6:9400"},
                                         "1796270648.5"))

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    e = view.host("dgx-e")
    assert e is not None
    assert (e.instances, e.state, e.as_of_s, e.scrape_interval_s) == (
        ("127.0.0.6:9400",), "ok", 1796270648.5, 60.0)
    assert [d.to_dict() for d in e.devices] == [
        {**device("GPU-eeee0002/3", -1, "NVIDIA B200", util=None, used=None, total=None,
                  source="dcgm", mig=3), "label": "GPU -1 MIG 3", "memory_free_bytes": 10 * MiB},
        {**device("GPU-eeee0000", 0, "NVIDIA B200", util=7.0, used=1024 * MiB + MiB // 2,
                  total=3072 * MiB + MiB // 2, source="dcgm", temp=55.0, power=612.5)},
        {**device("GPU-eeee0001", 1, "NVIDIA B200", util=None, used=100 * MiB, total=None,
                  source="dcgm"), "memory_free_bytes": None},
    ]
    assert e.devices[0].snapshot.parent_uuid == "GPU-eeee0002"
    assert e.devices[0].snapshot.is_mig is True
    assert (e.devices[0].booked_bytes, e.devices[0].lease_count, e.devices[0].waiters,
            e.devices[0].holders) == (0, 0, 0, ())


@pytest.mark.parametrize(
    ("labels", "host"),
    [
        ({"hostname": "n1", "Hostname": "n2", "instance": "10.0.0.1:9400"}, "n1"),
        ({"hostname": "", "Hostname": "n2", "instance": "10.0.0.1:9400"}, "n2"),
        ({"Hostname": "n2", "instance": "10.0.0.1:9400"}, "n2"),
        ({"hostname": "", "instance": "10.0.0.1:9400"}, "10.0.0.1"),
        ({"instance": "[::1]:9400"}, "[::1]"),
        ({"instance": "node7"}, "node7"),
        ({"instance": ""}, "unknown"),
        ({}, "unknown"),
    ],
)
def test_a_devices_host_is_its_hostname_label_else_its_targets_host(
    prom: Replay, labels: dict[str, str], host: str
) -> None:
    prom.answer("/api/v1/query", DCGM_Q, {"status": "success", "data": {
        "resultType": "vector", "result": [sample({"__name__": "DCGM_FI_DEV_FB_USED",
                                                   "UUID": "GPU-1", "gpu": "0", **labels}, "1")]}})
    for q in (AUTOGPU_Q, SCRAPED_Q, "up", SWEEP_Q, DCGM_NAMES_Q):
        prom.answer("/api/v1/query", q, {"status": "success",
                                          "data": {"resultType": "vector", "result": []}})
    prom.answer("/api/v1/targets", None, {"status": "success", "data": {"activeTargets": []}})
    view = fetch_cluster(PrometheusClient(prom.url), now_s=1000.0)
    assert [(h.hostname, h.state, h.note, h.as_of_s) for h in view.hosts] == [
        (host, "stale", "no samples", None)]
    assert [d.snapshot.uuid for d in view.hosts[0].devices] == ["GPU-1"]


@pytest.mark.parametrize(
    ("index", "shown", "label"),
    [("0", 0, "GPU 0"), ("12", 12, "GPU 12"), ("", -1, "GPU -1"), ("x", -1, "GPU -1"),
     ("-1", -1, "GPU -1"), ("\u0663", -1, "GPU -1"), ("1.0", -1, "GPU -1")],
)
def test_a_gpu_index_label_that_is_not_a_number_shows_as_minus_one(
    prom: Replay, index: str, shown: int, label: str
) -> None:
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for r in results[AUTOGPU_Q]:
            if r["metric"]["uuid"] == "GPU-cccc0001-0000-0000-0000-000000000001":
                r["metric"]["index"] = index

    client, now = scenario(prom, "all-up", edit)
    d = fetch_cluster(client, now_s=now).hosts[3].devices
    got = next(x.to_dict() for x in d if x.snapshot.uuid.startswith("GPU-cccc0001"))
    assert (got["index"], got["label"], got["mig_index"]) == (shown, label, None)


def test_devices_are_ordered_by_index_then_mig_instance(prom: Replay) -> None:
    """Series in any order (reversed here) give the devices by GPU index, MIG index, UUID."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for q in (AUTOGPU_Q, DCGM_Q):
            results[q].reverse()
        mig = {"Hostname": "dgx-d", "instance": INST["dgx-d"], "modelName": A100}
        results[DCGM_Q] += [
            sample({"__name__": "DCGM_FI_DEV_FB_USED", "gpu": "1", "GPU_I_ID": "0",
                    "UUID": "GPU-dddd0001-0000-0000-0000-000000000001", **mig}, "1"),
            sample({"__name__": "DCGM_FI_DEV_FB_USED", "gpu": "1", "GPU_I_ID": "2",
                    "UUID": "GPU-dddd0001-0000-0000-0000-000000000001", **mig}, "1"),
            sample({"__name__": "DCGM_FI_DEV_FB_USED", "gpu": "0", "UUID": "GPU-0000", **mig},
                   "1"),
        ]

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert [d.snapshot.uuid for d in view.hosts[0].devices] == [
        "GPU-0000", "GPU-dddd0000-0000-0000-0000-000000000000",
        "GPU-dddd0001-0000-0000-0000-000000000001/0", "GPU-dddd0001-0000-0000-0000-000000000001/1",
        "GPU-dddd0001-0000-0000-0000-000000000001/2"]
    assert view.to_dict()["hosts"][2] == host_dict("gpu-b")


def test_autogpu_memory_and_availability_edge_values(prom: Replay) -> None:
    """Used above total (a racing sweep) gives 0 free; no ``available`` series means available;
    bookings, leases and waiters are whole numbers; utilisation is a percentage to 6 places."""
    uuid = "GPU-ffff0000"

    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[AUTOGPU_Q] += [
            autogpu("autogpu_gpu_memory_total_bytes", "gpu-f", uuid, "1000", index="0"),
            autogpu("autogpu_gpu_memory_used_bytes", "gpu-f", uuid, "1500.7", index="0"),
            autogpu("autogpu_gpu_utilization_ratio", "gpu-f", uuid, "0.1234567891", index="0"),
            autogpu("autogpu_gpu_memory_booked_bytes", "gpu-f", uuid, "2048.9", index="0"),
            autogpu("autogpu_gpu_leases", "gpu-f", uuid, "2", index="0"),
            autogpu("autogpu_gpu_waiters", "gpu-f", uuid, "3", index="0"),
        ]

    client, now = scenario(prom, "all-up", edit)
    f = fetch_cluster(client, now_s=now).host("gpu-f")
    assert f is not None
    assert [d.to_dict() for d in f.devices] == [{
        **device(uuid, 0, "", util=12.345679, used=1500, total=1000, booked=2048, leases=2),
        "memory_free_bytes": 0, "waiters": 3}]
    assert f.devices[0].snapshot.error is None
    assert (f.state, f.note, f.instances) == ("stale", "no samples", ())


def test_series_without_index_model_or_count_series(prom: Replay) -> None:
    """Labels and series left out (edited in): no GPU index is -1, no model an empty name, no
    leases or waiters series 0 of each, memory used without a total gives no free memory."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[AUTOGPU_Q].append(
            autogpu("autogpu_gpu_memory_used_bytes", "gpu-f", "GPU-ffff0000", "5"))
        results[DCGM_Q].append(sample({"__name__": "DCGM_FI_DEV_FB_USED", "hostname": "dgx-e",
                                       "instance": "127.0.0.6:9400", "UUID": "GPU-eeee0000"},
                                      "1"))

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert [(h.hostname, [d.to_dict() for d in h.devices]) for h in view.hosts
            if h.hostname in ("dgx-e", "gpu-f")] == [
        ("dgx-e", [{**device("GPU-eeee0000", -1, "", util=None, used=MiB, total=None,
                             source="dcgm"), "memory_free_bytes": None}]),
        ("gpu-f", [{**device("GPU-ffff0000", -1, "", util=None, used=5, total=None),
                    "memory_free_bytes": None}]),
    ]


def test_autogpus_mig_devices_follow_their_gpu_by_mig_index(prom: Replay) -> None:
    """An autogpu host with a GPU in MIG mode (edited in; MIG UUIDs in another order than their
    MIG indexes): the GPU, then its MIG devices 0 and 1."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        results[AUTOGPU_Q] += [
            autogpu("autogpu_gpu_available", "gpu-f", "MIG-ffff0001", "1", index="0:1"),
            autogpu("autogpu_gpu_available", "gpu-f", "MIG-ffff0002", "1", index="0:0"),
            autogpu("autogpu_gpu_available", "gpu-f", "GPU-ffff0000", "1", index="0"),
        ]

    client, now = scenario(prom, "all-up", edit)
    f = fetch_cluster(client, now_s=now).host("gpu-f")
    assert f is not None
    assert [(d.snapshot.uuid, d.snapshot.label, d.snapshot.is_mig, d.snapshot.mig_index)
            for d in f.devices] == [
        ("GPU-ffff0000", "GPU 0", False, None), ("MIG-ffff0002", "GPU 0 MIG 0", True, 0),
        ("MIG-ffff0001", "GPU 0 MIG 1", True, 1)]


# ---- ranking hosts ------------------------------------------------------------------------


def chosen(choices: list[Any]) -> list[tuple[str, bool, list[str]]]:
    return [(c.host.hostname, c.fits, [x.device.label for x in c.chosen]) for c in choices]


def test_hosts_ranked_by_the_key_of_the_device_a_local_pick_would_choose(prom: Replay) -> None:
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    choices = rank_hosts(view, Constraints.parse(min_free="10G"))
    assert chosen(choices) == [("gpu-b", True, ["GPU 2"]), ("gpu-c", True, ["GPU 1"]),
                               ("dgx-d", True, ["GPU 1 MIG 1"]), ("gpu-a", True, ["GPU 0"])]
    assert choices[0].to_dict() == {
        "hostname": "gpu-b", "state": "ok", "as_of_s": AS_OF["gpu-b"], "fits": True,
        "chosen": [choices[0].candidates[0].to_dict()],
        "candidates": [c.to_dict() for c in choices[0].candidates],
        "note": None,
    }
    assert [(c["label"], c["eligible"], c["reasons"], c["effective_free_bytes"])
            for c in choices[0].to_dict()["candidates"]] == [
        ("GPU 2", True, ["22.0 GiB free >= 10.0 GiB wanted"], 22 * GiB),
        ("GPU 0", True, ["20.0 GiB free >= 10.0 GiB wanted"], 20 * GiB),
        ("GPU 1", False, ["only 4.0 GiB free < 10.0 GiB wanted"], 4 * GiB),
        ("GPU 3", False, ["unavailable: lost (exporter says unavailable)"], None),
    ]


def test_leases_seen_in_prometheus_book_memory_in_the_ranking(prom: Replay) -> None:
    """gpu-c's GPU 0 has 70 GiB free but its lease books 30 GiB: nothing there fits 45 GiB."""
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    choices = rank_hosts(view, Constraints.parse(min_free="45G"))
    assert chosen(choices) == [("dgx-d", False, []), ("gpu-a", False, []), ("gpu-b", False, []),
                               ("gpu-c", False, [])]
    assert choices[3].to_dict()["candidates"][0] == {
        "uuid": "GPU-cccc0000-0000-0000-0000-000000000000", "label": "GPU 0", "name": H100,
        "index": 0, "eligible": False,
        "reasons": ["only 40.0 GiB free after 30.0 GiB booked by leases < 45.0 GiB wanted"],
        "effective_free_bytes": 40 * GiB, "smoothed_util_pct": 20.0, "lease_count": 1,
        "booked_bytes": 30 * GiB,
    }
    assert choices[3].fits is False


def test_the_environments_visible_devices_do_not_bound_a_remote_host(
    prom: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This process's CUDA_VISIBLE_DEVICES / Slurm grant says nothing about another host."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-none")
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    assert chosen(rank_hosts(view, Constraints.parse(min_free="10G")))[0] == (
        "gpu-b", True, ["GPU 2"])


def test_a_host_giving_several_devices_ranks_by_its_worst_one(prom: Replay) -> None:
    """For two GPUs (gpu-c's lease edited away): gpu-c's two 40 GiB GPUs beat gpu-b's 22 and
    20 GiB ones though gpu-b's best is the best single GPU."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for name in ("autogpu_gpu_leases", "autogpu_gpu_memory_booked_bytes"):
            for r in results[AUTOGPU_Q]:
                if r["metric"]["__name__"] == name:
                    r["value"][1] = "0"

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    assert chosen(rank_hosts(view, Constraints.parse(min_free="10G", count=2))) == [
        ("gpu-c", True, ["GPU 0", "GPU 1"]), ("gpu-b", True, ["GPU 2", "GPU 0"]),
        ("dgx-d", False, []), ("gpu-a", False, [])]


def test_a_host_whose_best_gpu_is_idle_but_second_busy_ranks_after_an_even_host(
    prom: Replay,
) -> None:
    """Issue 22: data where best-device and worst-device order differ. For two GPUs, gpu-b's pair
    (GPUs 2 and 0, edited: one idle, one at 60 %) has the best single GPU of the two hosts, but
    its worst is busier than both of gpu-c's (edited: 30 % each, lease gone). A pick on gpu-b
    gets a 60 % GPU, on gpu-c none busier than 30 %: gpu-c first. Caught: ranking hosts by
    ``min`` (their best device) instead of ``max`` of the chosen devices' keys."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        util = {"GPU-bbbb0002-0000-0000-0000-000000000002": "0",
                "GPU-bbbb0000-0000-0000-0000-000000000000": "0.6",
                "GPU-cccc0000-0000-0000-0000-000000000000": "0.3",
                "GPU-cccc0001-0000-0000-0000-000000000001": "0.3"}
        used = {"GPU-cccc0000-0000-0000-0000-000000000000": str(10 * GiB),
                "GPU-cccc0001-0000-0000-0000-000000000001": str(10 * GiB)}
        for r in results[AUTOGPU_Q]:
            name, uuid = r["metric"]["__name__"], r["metric"].get("uuid")
            if name == "autogpu_gpu_utilization_ratio" and uuid in util:
                r["value"][1] = util[uuid]
            elif name == "autogpu_gpu_memory_used_bytes" and uuid in used:
                r["value"][1] = used[uuid]
            elif name in ("autogpu_gpu_leases", "autogpu_gpu_memory_booked_bytes"):
                r["value"][1] = "0"

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    choices = rank_hosts(view, Constraints.parse(min_free="10G", count=2))
    assert chosen(choices) == [
        ("gpu-c", True, ["GPU 0", "GPU 1"]), ("gpu-b", True, ["GPU 2", "GPU 0"]),
        ("dgx-d", False, []), ("gpu-a", False, [])]
    b, c = choices[1], choices[0]
    # the two orders really differ here: gpu-b's best beats gpu-c's best, its worst loses
    assert min(x.key[:-1] for x in b.chosen) < min(x.key[:-1] for x in c.chosen)
    assert max(x.key[:-1] for x in b.chosen) > max(x.key[:-1] for x in c.chosen)


def test_hosts_that_cannot_be_chosen_come_last_by_state_then_name(prom: Replay) -> None:
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    h = {x.hostname: x for x in view.hosts}
    mixed = ClusterView(view.prometheus_url, now, (
        dataclasses.replace(h["dgx-d"], state="down", devices=()),
        dataclasses.replace(h["gpu-a"], hostname="dgx-0", state="weird"),
        dataclasses.replace(h["gpu-a"], state="stale"),
        dataclasses.replace(h["gpu-a"], hostname="gpu-9", state="stale"),
        dataclasses.replace(h["gpu-a"], hostname="gpu-z"),
        h["gpu-b"],
        dataclasses.replace(h["gpu-c"], hostname="gpu-0c"),
    ))
    assert chosen(rank_hosts(mixed, Constraints.parse(min_free="21G"))) == [
        ("gpu-b", True, ["GPU 2"]), ("gpu-0c", True, ["GPU 1"]), ("gpu-z", False, []),
        ("gpu-9", False, []), ("gpu-a", False, []), ("dgx-d", False, []), ("dgx-0", False, [])]


def test_equally_loaded_hosts_go_by_hostname_not_by_their_gpus_uuids(prom: Replay) -> None:
    """gpu-b and a twin (its GPUs under other UUIDs, named gpu-a) give keys equal but for the
    UUID, the tie-break between one host's devices: the hostname orders them."""
    client, now = scenario(prom, "all-up")
    view = fetch_cluster(client, now_s=now)
    b = view.host("gpu-b")
    assert b is not None
    twin = dataclasses.replace(b, hostname="gpu-a", devices=tuple(
        dataclasses.replace(d, snapshot=dataclasses.replace(
            d.snapshot, uuid=d.snapshot.uuid.replace("bbbb", "ffff")))
        for d in b.devices))
    choices = rank_hosts(ClusterView(view.prometheus_url, now, (b, twin)),
                         Constraints.parse(min_free="10G"))
    assert [(c.host.hostname, [x.device.uuid for x in c.chosen]) for c in choices] == [
        ("gpu-a", ["GPU-ffff0002-0000-0000-0000-000000000002"]),
        ("gpu-b", ["GPU-bbbb0002-0000-0000-0000-000000000002"]),
    ]


# ---- the client ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://127.0.0.1:9090", "http://127.0.0.1:9090"),
        ("  http://prom:9090/  ", "http://prom:9090"),
        ("https://example.org/prometheus//", "https://example.org/prometheus"),
        ("HTTP://prom", "HTTP://prom"),
        ("http://prom/BOX/", "http://prom/BOX"),
    ],
)
def test_prometheus_urls_accepted(url: str, base: str) -> None:
    assert check_url(url) == base
    assert PrometheusClient(url).url == base


@pytest.mark.parametrize("url", ["prometheus:9090", "ftp://prom:21", "http://", "http:///x",
                                 "", "127.0.0.1:9090"])
def test_prometheus_urls_refused_with_the_accepted_form(url: str) -> None:
    with pytest.raises(UsageErrorBase) as err:
        PrometheusClient(url)
    assert str(err.value) == (
        f"invalid Prometheus URL {url!r}: expected http://HOST:PORT or https://HOST/PATH, "
        "e.g. http://prometheus.example.org:9090")


def test_prometheus_errors_are_passed_on_with_its_reason(prom: Replay) -> None:
    """Prometheus's own answers (recorded) to a PromQL syntax error, a scalar instant query and
    a range that ends before it starts."""
    data = load("errors")
    prom.replay(data["exchanges"])
    client = PrometheusClient(prom.url + "/")
    now = data["now_s"]
    with pytest.raises(ClusterError) as err:
        client.query("rate(", now)
    assert str(err.value) == (
        f"Prometheus at {prom.url} answered 400 to /api/v1/query: invalid parameter \"query\": "
        "1:6: parse error: unclosed left parenthesis")
    with pytest.raises(ClusterError) as err:
        client.query("1", now)
    assert str(err.value) == "Prometheus: '1' did not give an instant vector"
    with pytest.raises(ClusterError) as err:
        client.query_range("up", now, now - 60, 1.0)
    assert str(err.value) == (
        f"Prometheus at {prom.url} answered 400 to /api/v1/query_range: invalid parameter "
        "\"end\": end timestamp must not be before start time")
    assert prom.requests == [
        ("/api/v1/query", {"query": "rate(", "time": "1796270651.030"}),
        ("/api/v1/query", {"query": "1", "time": "1796270651.030"}),
        ("/api/v1/query_range", {"query": "up", "start": "1796270651.030",
                                 "end": "1796270591.030", "step": "1.000"}),
    ]


def test_a_query_without_a_moment_asks_for_prometheuss_now(prom: Replay) -> None:
    prom.answer("/api/v1/query", "up", {"status": "success",
                                        "data": {"resultType": "vector", "result": []}})
    assert PrometheusClient(prom.url).query("up") == []
    assert prom.requests == [("/api/v1/query", {"query": "up"})]


def test_an_instant_query_gives_each_series_labels_value_and_evaluation_time(
    prom: Replay,
) -> None:
    """As Prometheus answers (``value`` is ``[time, "text"]``); a vector without ``result`` is
    empty."""
    prom.answer("/api/v1/query", "up", {"status": "success", "data": {
        "resultType": "vector", "result": [
            sample({"__name__": "up", "instance": "h:1"}, "1", at=1000.5),
            sample({"__name__": "up", "instance": "h:2"}, "0", at=1000.5)]}})
    prom.answer("/api/v1/query", "none", {"status": "success",
                                          "data": {"resultType": "vector"}})
    client = PrometheusClient(prom.url)
    assert client.query("up", 1000.5) == [
        Sample({"__name__": "up", "instance": "h:1"}, 1.0, 1000.5),
        Sample({"__name__": "up", "instance": "h:2"}, 0.0, 1000.5)]
    assert client.query("none", 1000.5) == []


@pytest.mark.parametrize(
    ("status", "body", "content_type", "message"),
    [
        # a proxy's error page in front of Prometheus: its text, cut at 2000 bytes
        (502, b"<html><body>Bad Gateway</body></html>", "text/html",
         "answered 502 to /api/v1/query: <html><body>Bad Gateway</body></html>"),
        (500, b"x" * 2500, "text/plain", "answered 500 to /api/v1/query: " + "x" * 2000),
        (404, b"404 page not found\n", "text/plain",
         "answered 404 to /api/v1/query: 404 page not found\n"),
        # JSON without an "error" field, and JSON that is not an object
        (422, b'{"status": "error"}', "application/json",
         "answered 422 to /api/v1/query: {\"status\": \"error\"}"),
        (400, b'["error"]', "application/json", "answered 400 to /api/v1/query: [\"error\"]"),
        (503, b'{"status": "error", "error": 7}', "application/json",
         "answered 503 to /api/v1/query: 7"),
        (500, b"\xff\xfe bad", "text/plain", "answered 500 to /api/v1/query: \ufffd\ufffd bad"),
        # a 200 that is not Prometheus's JSON
        (200, b"<html>login</html>", "text/html", "answered /api/v1/query with non-JSON"),
        (200, b'{"status": "error", "error": "x"}', "application/json",
         "/api/v1/query failed: {'status': 'error', 'error': 'x'}"),
        (200, b'["success"]', "application/json", "/api/v1/query failed: ['success']"),
        (200, b'{"status": "success", "data": {"resultType": "matrix", "result": []}}',
         "application/json", "did not give an instant vector"),
        (200, b'{"status": "success"}', "application/json", "did not give an instant vector"),
    ],
)
def test_answers_that_are_not_a_vector_say_what_came(
    prom: Replay, status: int, body: bytes, content_type: str, message: str
) -> None:
    prom.answer("/api/v1/query", "up", body, status, content_type)
    with pytest.raises(ClusterError) as err:
        PrometheusClient(prom.url).query("up", 1.0)
    if message.startswith("did not"):
        assert str(err.value) == f"Prometheus: 'up' {message}"
    elif message.startswith("/api"):
        assert str(err.value) == f"Prometheus at {prom.url}: {message}"
    else:
        assert str(err.value) == f"Prometheus at {prom.url} {message}"


def test_a_failed_answer_is_quoted_up_to_300_characters(prom: Replay) -> None:
    body = {"status": "error", "error": "y" * 400}
    prom.answer("/api/v1/targets", None, body)
    with pytest.raises(ClusterError) as err:
        PrometheusClient(prom.url).scrape_intervals()
    assert str(err.value) == (
        f"Prometheus at {prom.url}: /api/v1/targets failed: " + repr(body)[:300])


def test_a_range_query_answering_a_vector_is_refused(prom: Replay) -> None:
    prom.answer("/api/v1/query_range", "up", {"status": "success",
                                              "data": {"resultType": "vector", "result": []}})
    with pytest.raises(ClusterError) as err:
        PrometheusClient(prom.url).query_range("up", 0.0, 60.0, 15.0)
    assert str(err.value) == "Prometheus: 'up' did not give a range vector"
    prom.answer("/api/v1/query_range", "up", {"status": "success"})
    with pytest.raises(ClusterError) as err:
        PrometheusClient(prom.url).query_range("up", 0.0, 60.0, 15.0)
    assert str(err.value) == "Prometheus: 'up' did not give a range vector"
    prom.answer("/api/v1/query_range", "up", {"status": "success",
                                              "data": {"resultType": "matrix"}})
    assert PrometheusClient(prom.url).query_range("up", 0.0, 60.0, 15.0) == []


def test_unreachable_prometheus() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(ClusterError) as err:
            PrometheusClient(url).query("up")
    assert str(err.value) == (
        f"cannot reach Prometheus at {url}: [Errno 111] Connection refused")


def test_a_prometheus_that_does_not_answer_times_out() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # accepts the connection (backlog), never answers
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        client = PrometheusClient(url, timeout_s=0.2)
        assert client.timeout_s == 0.2
        with pytest.raises(ClusterError) as err:
            client.query("up")
    assert str(err.value) == f"cannot reach Prometheus at {url}: timed out"


def test_the_default_timeout_is_five_seconds() -> None:
    assert PrometheusClient("http://127.0.0.1:9").timeout_s == 5.0


# ---- history ------------------------------------------------------------------------------

UTIL_Q = "avg by (hostname) (autogpu_gpu_utilization_ratio)"
MEM_Q = "avg by (hostname) (autogpu_gpu_memory_used_ratio)"
DCGM_UTIL_Q = "avg by (Hostname) (DCGM_FI_DEV_GPU_UTIL / 100 or DCGM_FI_PROF_GR_ENGINE_ACTIVE)"
DCGM_MEM_Q = ("avg by (Hostname) (DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + "
              "DCGM_FI_DEV_FB_FREE))")


def test_history_gives_each_hosts_mean_load_at_every_step(prom: Replay) -> None:
    """Two minutes at 120 points, recorded a few seconds after Prometheus started: the steps
    before its first scrape have no value."""
    client, now = scenario(prom, "all-up")
    step, hosts = fetch_history(client, 120.0, now_s=now)
    assert step == 1.0
    grid = [1796270529.176 + i for i in range(121)]
    assert hosts[1].to_dict() == {
        "hostname": "gpu-a", "source": "autogpu", "timestamps_s": grid,
        "utilization_pct": [None] * 115 + [40.0] * 6,
        "memory_used_pct": [None] * 115 + [84.375] * 6,
    }
    assert [(h.hostname, h.source, h.utilization_pct[-8:], h.memory_used_pct[-8:])
            for h in hosts] == [
        ("dgx-d", "dcgm", (70.0,) * 8, (43.974609,) * 8),
        ("gpu-a", "autogpu", (None, None) + (40.0,) * 6, (None, None) + (84.375,) * 6),
        ("gpu-b", "autogpu", (None,) + (28.333333,) * 7, (None,) + (36.111111,) * 7),
        ("gpu-c", "autogpu", (None, None) + (10.0,) * 6, (None, None) + (50.0,) * 6),
    ]
    assert hosts[0].utilization_pct[109:111] == (None, 70.0)
    assert [h.timestamps_s == tuple(grid) for h in hosts] == [True] * 4
    span = {"start": "1796270529.176", "end": "1796270649.176", "step": "1.000"}
    assert prom.requests == [("/api/v1/query_range", {"query": q, **span})
                             for q in (UTIL_Q, MEM_Q, DCGM_UTIL_Q, DCGM_MEM_Q)]


def test_history_prefers_autogpus_series_and_drops_nan(prom: Replay) -> None:
    """gpu-a also has DCGM series (edited in): autogpu's are shown. NaN and infinite steps (a
    division by zero in PromQL) have no value; a host without memory (utilisation) series shows
    none."""
    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for q in (DCGM_UTIL_Q, DCGM_MEM_Q):
            results[q].insert(0, {"metric": {"Hostname": "gpu-a"},
                                  "values": [[1796270649.176, "0.99"]]})
        util = results[UTIL_Q][0]["values"]
        util[-1][1], util[-2][1], util[-3][1] = "NaN", "+Inf", "-Inf"
        results[MEM_Q][:] = [s for s in results[MEM_Q] if s["metric"]["hostname"] != "gpu-c"]
        results[UTIL_Q][:] = [s for s in results[UTIL_Q] if s["metric"]["hostname"] != "gpu-b"]

    client, now = scenario(prom, "all-up", edit)
    _, hosts = fetch_history(client, 120.0, now_s=now)
    assert (hosts[1].hostname, hosts[1].source) == ("gpu-a", "autogpu")
    assert hosts[1].utilization_pct[-7:] == (None, 40.0, 40.0, 40.0, None, None, None)
    assert hosts[1].memory_used_pct[-2:] == (84.375, 84.375)
    assert (hosts[2].hostname, hosts[2].utilization_pct) == ("gpu-b", (None,) * 121)
    assert hosts[2].memory_used_pct[-1] == 36.111111
    assert (hosts[3].hostname, hosts[3].memory_used_pct) == ("gpu-c", (None,) * 121)
    assert hosts[3].utilization_pct[-1] == 10.0


@pytest.mark.parametrize(
    ("seconds", "points", "step", "grid"),
    [
        (3600.0, 120, 30.0, 121),
        (10.0, 120, 1.0, 11),
        (7.0, 3, 2.333, 4),
        (5.0, 3, 1.667, 3),  # 3 steps of 1.667 s end past 5 s: Prometheus answers 3 points
        (5.0, 0, 5.0, 2),
        (86400.0, 7, 12342.857, 8),
        (126.0, 120, 1.05, 121),  # Prometheus answers at 120 steps of 1.05 s after the start
    ],
)
def test_history_steps_are_the_span_over_the_points_at_least_a_second(
    prom: Replay, seconds: float, points: int, step: float, grid: int
) -> None:
    end = 1796270649.176
    start = round(end - seconds, 3)
    last = round(start + (grid - 1) * step, 3)
    prom.answer("/api/v1/query_range", UTIL_Q, {"status": "success", "data": {
        "resultType": "matrix", "result": [
            {"metric": {"hostname": "n1"}, "values": [[start + step, "0.5"], [last, "0.25"],
                                                      [end + step, "1"]]}]}})
    for q in (MEM_Q, DCGM_UTIL_Q, DCGM_MEM_Q):
        prom.answer("/api/v1/query_range", q, {"status": "success",
                                               "data": {"resultType": "matrix", "result": []}})
    got_step, hosts = fetch_history(PrometheusClient(prom.url), seconds, points=points,
                                    now_s=end)
    assert got_step == step
    assert [h.hostname for h in hosts] == ["n1"]
    assert hosts[0].timestamps_s[:2] == (start, start + step)
    assert len(hosts[0].timestamps_s) == grid
    expected: list[float | None] = [None] * grid
    expected[1], expected[-1] = 50.0, 25.0  # the step after the start and the last one
    assert hosts[0].utilization_pct == tuple(expected)
    assert prom.requests[0] == ("/api/v1/query_range", {
        "query": UTIL_Q, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:.3f}"})


def test_history_times_are_those_of_prometheus_to_the_millisecond(prom: Replay) -> None:
    """A point Prometheus stamps 1000.1234 is the step at 1000.123 (it answers in ms)."""
    prom.answer("/api/v1/query_range", UTIL_Q, {"status": "success", "data": {
        "resultType": "matrix", "result": [
            {"metric": {"hostname": "n1"}, "values": [[991.1234, "0.5"], [1000.1234, "0.25"]]}]}})
    for q in (MEM_Q, DCGM_UTIL_Q, DCGM_MEM_Q):
        prom.answer("/api/v1/query_range", q, {"status": "success",
                                               "data": {"resultType": "matrix", "result": []}})
    _, hosts = fetch_history(PrometheusClient(prom.url), 10.0, now_s=1000.12345)
    assert hosts[0].timestamps_s[0] == 990.123
    assert hosts[0].utilization_pct == (None, 50.0) + (None,) * 8 + (25.0,)


def test_history_defaults_to_120_points_until_now(prom: Replay) -> None:
    for q in (UTIL_Q, MEM_Q, DCGM_UTIL_Q, DCGM_MEM_Q):
        prom.answer("/api/v1/query_range", q, {"status": "success",
                                               "data": {"resultType": "matrix", "result": []}})
    before = time.time()
    assert fetch_history(PrometheusClient(prom.url), 1200.0) == (10.0, [])
    after = time.time()
    params = prom.requests[0][1]
    assert params["step"] == "10.000"
    assert round(before, 3) - 0.001 <= float(params["end"]) <= round(after, 3) + 0.001
    assert float(params["start"]) == pytest.approx(float(params["end"]) - 1200.0, abs=0.002)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("86400", 86400.0), (1, 1.0), ("0.5", 0.5), (2592000, 2592000.0), (" 60 ", 60.0)],
)
def test_history_lengths_accepted(value: object, seconds: float) -> None:
    assert check_history_s(value) == seconds


@pytest.mark.parametrize(
    "value", ["1d", "", None, 0, "0", -60, 2592000.5, "nan", "inf", "-inf", math.nan],
)
def test_history_lengths_refused_with_the_accepted_range(value: object) -> None:
    with pytest.raises(UsageErrorBase) as err:
        check_history_s(value)
    assert str(err.value) == (
        f"invalid history length {value!r}: expected seconds, more than 0 and at most 2592000 "
        "(30 days), e.g. 86400 for a day")


# ---- what a hostile or broken target sends ----------------------------------------------------


def test_samples_that_are_not_finite_numbers_are_skipped_and_said_per_host(
    prom: Replay,
) -> None:
    """One exporter sends ``+Inf``, ``NaN``, ``1e400`` and a ``value`` that is no pair: its
    host is still shown (the bad samples left out, and counted in its note); the others are
    untouched; the answer is JSON a browser can read (no NaN)."""
    uuid = "GPU-aaaa0000-0000-0000-0000-000000000000"

    def edit(results: dict[str, list[dict[str, Any]]]) -> None:
        for s in results[AUTOGPU_Q]:
            if s["metric"].get("uuid") != uuid:
                continue
            name = s["metric"]["__name__"]
            if name == "autogpu_gpu_memory_total_bytes":
                s["value"][1] = "+Inf"
            elif name == "autogpu_gpu_utilization_ratio":
                s["value"][1] = "NaN"
            elif name == "autogpu_gpu_memory_used_bytes":
                s["value"][1] = "1e400"
            elif name == "autogpu_gpu_temperature_celsius":
                s["value"] = "oops"

    client, now = scenario(prom, "all-up", edit)
    view = fetch_cluster(client, now_s=now)
    gpu_a = view.host("gpu-a")
    assert gpu_a is not None and gpu_a.state == "ok"
    assert gpu_a.note == "4 sample(s) skipped (not finite numbers)"
    dev = gpu_a.devices[0].snapshot
    assert (dev.memory_total_bytes, dev.utilization_pct, dev.memory_used_bytes,
            dev.temperature_c) == (None, None, None, None)
    assert view.errors == (
        "gpu-a: 4 sample(s) skipped, not finite numbers (e.g. autogpu_gpu_memory_total_bytes "
        "= +Inf)",)
    assert [h.note for h in view.hosts if h.hostname != "gpu-a"] == [None, None, None]
    json.dumps(view.to_dict(), allow_nan=False)
    rank_hosts(view, Constraints.parse())  # ranks without an error


def test_an_answer_past_the_byte_or_series_cap_is_refused_in_one_line(
    prom: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, now = scenario(prom, "all-up")
    monkeypatch.setattr(prometheus, "MAX_BODY_BYTES", 1000)
    with pytest.raises(ClusterError) as err:
        fetch_cluster(client, now_s=now)
    assert str(err.value) == (
        f"Prometheus at {prom.url} answered /api/v1/query ({AUTOGPU_Q}) with more than 0 MiB: "
        "the cluster view reads no more; scrape fewer targets into this Prometheus, or point "
        "c.AutoGPU.prometheus_url at one that holds only the GPU hosts"
    )
    monkeypatch.setattr(prometheus, "MAX_BODY_BYTES", 16 * 1024 * 1024)
    monkeypatch.setattr(prometheus, "MAX_SERIES", 3)
    with pytest.raises(ClusterError) as err:
        fetch_cluster(client, now_s=now)
    n = len(load("all-up")["exchanges"][0]["body"]["data"]["result"])
    assert str(err.value).startswith(
        f"Prometheus at {prom.url} answered {n} series to {AUTOGPU_Q!r}, more than the 3 the "
        "cluster view reads")


@pytest.mark.parametrize(
    ("given", "seconds"),
    [("9" * 40 + "h", 3600.0), ("100000d", 3600.0), ("1ms", 0.01), ("0s", 60.0),
     ("1.2.3s", 60.0), ("15s", 15.0)],
)
def test_a_targets_scrape_interval_is_clamped(prom: Replay, given: str, seconds: float) -> None:
    prom.answer("/api/v1/targets", None, {"status": "success", "data": {"activeTargets": [
        {"labels": {"instance": "h:1"}, "scrapeInterval": given}]}})
    assert PrometheusClient(prom.url).scrape_intervals() == {"h:1": seconds}


def test_malformed_answers_of_the_targets_api_are_no_targets(prom: Replay) -> None:
    for data in ([1, 2], {"activeTargets": "x"}, {"activeTargets": [7, {"labels": "x"}]}):
        prom.answer("/api/v1/targets", None, {"status": "success", "data": data})
        assert PrometheusClient(prom.url).scrape_intervals() in ({}, {"": 60.0})


# ---- rejected samples' shortened values and names, the range query's bad points ----
# Found by the mutation run of issue 22; Prometheus's answers come from an answering Prometheus on
# loopback (``answering``).
@pytest.mark.parametrize(("raw", "text"), [
    ("a" * 24, "a" * 24),  # 24 characters are kept whole
    ("0123456789" * 2 + "abcde", "0123456789" * 2 + "a..."),  # 25: 21 and "..."
    ("x" + "0123456789" * 5, "x" + "0123456789" * 2 + "..."),
    ([1, "x"], '[1, "x"]'),  # not a string: its JSON
    (None, "null"),
    (True, "true"),  # a JSON boolean is no number
    ({"v": list(range(20))}, '{"v": [0, 1, 2, 3, 4,...'),
])
def test_a_rejected_value_is_shown_as_json_in_24_characters_at_most(
    answering: Answering, raw: Any, text: str
) -> None:
    """A sample whose value is no finite number is skipped and named with its value, shortened.
    Caught: the bound moved (< 24, <= 25), the cut at 22, "..." reworded or subtracted, the
    JSON of None or of nothing, the raw value kept as is. (A value that is not JSON, shown by
    its ``str``, cannot come from Prometheus: its answer is JSON.)"""
    client = _client(answering, {"m": [_item(raw, __name__="m")]})
    assert client.query("m") == []
    assert [r.text() for r in client.rejected] == [f"m = {text}"]


def test_a_rejected_sample_of_an_instant_query_names_its_short_value(
    answering: Answering,
) -> None:
    client = PrometheusClient(answering.url)
    long = "not a number, " * 3
    answering.get = lambda path, params: {
        "resultType": "vector", "result": [
            {"metric": {"__name__": "m"}, "value": [1.0, long]},
            {"metric": {"__name__": "n"}, "value": [1.0, [1, "x"]]},
        ]}
    assert client.query("m") == []
    assert [r.text() for r in client.rejected] == [f"m = {long[:21]}...", 'n = [1, "x"]']


def test_a_rejected_series_name_is_cut_at_60_characters() -> None:
    name = "".join(chr(ord("a") + i % 26) for i in range(70))
    assert Rejected({"__name__": name}, "= NaN").text() == f"{name[:60]} = NaN"
    assert Rejected({}, "= NaN").text() == "? = NaN"


def _ranged(
    answering: Answering, data: object
) -> tuple[PrometheusClient, list[tuple[str, dict[str, str]]]]:
    """A client of ``answering``, which answers ``data`` to anything; what it was asked."""
    asked: list[tuple[str, dict[str, str]]] = []

    def get(path: str, params: dict[str, str]) -> object:
        asked.append((path, dict(params)))
        return data

    answering.get = get
    return PrometheusClient(answering.url), asked


def test_range_points_that_are_not_finite_are_counted_per_series(
    answering: Answering,
) -> None:
    """Caught: the count set to 1 rather than added to; a series without a ``values`` list
    walked over anyway (it is one bad point)."""
    client, asked = _ranged(answering, {"resultType": "matrix", "result": [
        {"metric": {"__name__": "u", "hostname": "a"},
         "values": [[0, "1"], [15, "NaN"], [30, "x"], [45, "+Inf"], [60, "0.5"]]},
        {"metric": {"__name__": "v"}},
        {"metric": {"__name__": "w"}, "values": "12"},
        {"metric": {"__name__": "z"}, "values": [[0, "2"]]},
    ]})
    assert client.query_range("u", 0.0, 60.0, 15.0) == [
        RangeSeries({"__name__": "u", "hostname": "a"}, ((0.0, 1.0), (60.0, 0.5))),
        RangeSeries({"__name__": "v"}, ()),
        RangeSeries({"__name__": "w"}, ()),
        RangeSeries({"__name__": "z"}, ((0.0, 2.0),)),
    ]
    assert [r.text() for r in client.rejected] == [
        "u has 3 point(s) that are not finite",
        "v has 1 point(s) that are not finite",
        "w has 1 point(s) that are not finite",
    ]
    assert asked == [("/api/v1/query_range",
                      {"query": "u", "start": "0.000", "end": "60.000", "step": "15.000"})]


def test_a_range_answer_without_a_result_list_names_the_query(answering: Answering) -> None:
    """Caught: the query not handed on to the series check (the message said ``None``)."""
    client, _ = _ranged(answering, {"resultType": "matrix", "result": "nope"})
    with pytest.raises(ClusterError) as err:
        client.query_range("up", 0.0, 60.0, 15.0)
    assert str(err.value) == f"Prometheus at {answering.url}: 'up' gave no result list"


# ---- the folds of autogpu's and DCGM's series, fetch_cluster, the client's series and targets ----
# Found by the mutation run of issue 22; Prometheus's answers come from an answering Prometheus on
# loopback (``answering``).
URL = "http://prometheus.example:9090"


def _client(answering: Answering, answers: dict[str, Any]) -> PrometheusClient:
    """A client of ``answering``, which answers ``answers[query]`` (a vector result list), or,
    for the targets API, ``answers["targets"]``."""

    def get(path: str, params: dict[str, str]) -> object:
        if path == "/api/v1/targets":
            return answers.get("targets", {"activeTargets": []})
        return {"resultType": "vector", "result": answers.get(params["query"], [])}

    answering.get = get
    return PrometheusClient(answering.url)


def _item(value: Any, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [100.0, value]}


@pytest.mark.parametrize(("raw", "shown"), [
    (True, "true"), (None, "null"), ([1], "[1]"), ({"a": 1}, '{"a": 1}'), ("NaN", "NaN"),
    ("+Inf", "+Inf"), ("0" * 21 + "1e999", "0" * 21 + "..."), ("x", "x"),
])
def test_a_value_that_is_no_finite_number_is_skipped_and_named(
    answering: Answering, raw: Any, shown: str
) -> None:
    """A JSON boolean, null, list or object, a non-finite number or text that is no number:
    the sample is skipped, named with its value; the good one beside it is read."""
    client = _client(answering, {"m": [_item(raw, __name__="m"), _item("1.5", __name__="g")]})
    assert client.query("m") == [Sample({"__name__": "g"}, 1.5, 100.0)]
    assert [r.text() for r in client.rejected] == [f"m = {shown}"]


def test_a_number_sent_as_a_json_number_is_read_too(answering: Answering) -> None:
    client = _client(answering, {"m": [_item(2, __name__="m"), {"metric": {}, "value": [7, "3"]}]})
    assert client.query("m") == [Sample({"__name__": "m"}, 2.0, 100.0), Sample({}, 3.0, 7.0)]
    assert client.rejected == []


def test_a_sample_with_a_time_that_is_no_finite_number_is_skipped(answering: Answering) -> None:
    client = _client(answering, {"m": [{"metric": {"__name__": "m"}, "value": ["NaN", "3"]}]})
    assert client.query("m") == []
    assert [r.text() for r in client.rejected] == ["m = 3"]


def _devices(view: ClusterView) -> list[dict[str, Any]]:
    """Each device of the cluster payload as ``hostname``, ``uuid``, ``index``, ``mig_index``,
    ``name``, ``source`` and ``memory_used_bytes``."""
    keys = ("uuid", "index", "mig_index", "name", "source", "memory_used_bytes")
    return [{"hostname": host["hostname"], **{k: d[k] for k in keys}}
            for host in view.to_dict()["hosts"] for d in host["devices"]]


def test_an_autogpu_series_without_name_or_index_is_a_device_without_either(
    answering: Answering,
) -> None:
    """Caught: the series' ``__name__`` or ``index`` read as required (a forged series broke
    the whole view)."""
    client = _client(answering, {AUTOGPU_Q: [_item("3", uuid="GPU-a", hostname="h")]})
    assert _devices(fetch_cluster(client, now_s=1000.0)) == [
        {"hostname": "h", "uuid": "GPU-a", "index": -1, "mig_index": None, "name": "",
         "source": "autogpu", "memory_used_bytes": None}]


def test_a_dcgm_series_without_name_or_gpu_is_a_device_without_either(
    answering: Answering,
) -> None:
    client = _client(answering, {DCGM_Q: [
        _item("3", UUID="GPU-a", hostname="h"),
        _item("4", UUID="GPU-b", hostname="h", gpu="2", __name__="DCGM_FI_DEV_FB_USED"),
    ]})
    assert _devices(fetch_cluster(client, now_s=1000.0)) == [
        {"hostname": "h", "uuid": "GPU-a", "index": -1, "mig_index": None, "name": "",
         "source": "dcgm", "memory_used_bytes": None},
        {"hostname": "h", "uuid": "GPU-b", "index": 2, "mig_index": None, "name": "",
         "source": "dcgm", "memory_used_bytes": 4 * MiB},
    ]


def test_a_skipped_sample_is_named_by_its_targets_host_else_by_its_labels(
    answering: Answering,
) -> None:
    """A skipped sample counts for the host its target exports (the hostname of the sweep's
    series), else for its own ``hostname`` label, else its instance's address, else
    ``unknown``; the view's errors say so per host, in host order."""
    client = _client(answering, {
        SWEEP_Q: [_item("900", instance="10.0.0.1:9400", hostname="gpu-1")],
        AUTOGPU_Q: [
            _item("NaN", __name__="a", instance="10.0.0.1:9400"),
            _item("NaN", __name__="b", instance="10.0.0.2:9400"),
            _item("NaN", __name__="c"),
            _item("+Inf", __name__="d", hostname="named"),
            _item("NaN", __name__="e", hostname="named"),
        ],
    })
    assert fetch_cluster(client, now_s=1000.0).errors == (
        "10.0.0.2: 1 sample(s) skipped, not finite numbers (e.g. b = NaN)",
        "gpu-1: 1 sample(s) skipped, not finite numbers (e.g. a = NaN)",
        "named: 2 sample(s) skipped, not finite numbers (e.g. d = +Inf)",
        "unknown: 1 sample(s) skipped, not finite numbers (e.g. c = NaN)",
    )


def test_an_amd_device_is_seen_at_the_views_moment(answering: Answering) -> None:
    client = _client(answering, {DCGM_Q: [
        _item("1", __name__="gpu_used_vram", hostname="h", gpu_id="0", card_series="MI300X")]})
    (host,) = fetch_cluster(client, now_s=123.5).hosts
    assert [(d.snapshot.uuid, d.snapshot.name, d.snapshot.timestamp_s) for d in host.devices] == [
        ("h/gpu-0", "MI300X", 123.5)]


def test_a_gpu_sorts_before_a_mig_device_of_the_same_index_by_uuid_and_notes_join(
    answering: Answering,
) -> None:
    """A host's devices sort by index, MIG index (none and 0 alike) and UUID; a host with a
    note and skipped samples keeps both."""
    client = _client(answering, {
        DCGM_Q: [
            _item("5", __name__="DCGM_FI_DEV_FB_USED", UUID="GPU-b", GPU_I_ID="0", gpu="0",
                  hostname="h"),
            _item("6", __name__="DCGM_FI_DEV_FB_USED", UUID="GPU-a", gpu="0", hostname="h"),
            _item("NaN", __name__="DCGM_FI_DEV_FB_FREE", UUID="GPU-a", gpu="0", hostname="h"),
        ],
        AUTOGPU_Q: [],
    })
    view = fetch_cluster(client, now_s=1000.0)
    (host,) = view.hosts
    assert [d.snapshot.uuid for d in host.devices] == ["GPU-a", "GPU-b/0"]
    assert host.state == "stale"
    assert host.note == "no samples; 1 sample(s) skipped (not finite numbers)"


def test_exactly_max_series_are_read(answering: Answering) -> None:
    client = _client(answering, {"m": [{} for _ in range(MAX_SERIES)]})
    assert client.query("m") == []
    assert len(client.rejected) == MAX_SERIES
    assert client.rejected[0] == Rejected({}, "has no [time, value] pair")


def test_more_than_max_series_are_refused_with_the_query_cut_at_80(answering: Answering) -> None:
    expr = "".join(chr(ord("a") + i % 26) for i in range(100))
    client = _client(answering, {expr: [{} for _ in range(MAX_SERIES + 1)]})
    with pytest.raises(ClusterError) as err:
        client.query(expr)
    assert str(err.value) == (
        f"Prometheus at {answering.url} answered {MAX_SERIES + 1} series to {expr[:80]!r}, more "
        f"than the {MAX_SERIES} the cluster view reads: scrape fewer targets into this "
        "Prometheus, or point c.AutoGPU.prometheus_url at one that holds only the GPU hosts"
    )


def test_series_that_are_not_objects_are_read_as_empty_ones(answering: Answering) -> None:
    client = _client(answering, {"m": [[1, 2], "x", _item("1", __name__="m")]})
    assert client.query("m") == [Sample({"__name__": "m"}, 1.0, 100.0)]
    assert [r.text() for r in client.rejected] == [
        "? has no [time, value] pair", "? has no [time, value] pair"]


def test_an_answer_without_a_result_list_names_the_query(answering: Answering) -> None:
    client = PrometheusClient(answering.url)
    answering.get = lambda path, params: {"resultType": "vector", "result": "nope"}
    with pytest.raises(ClusterError) as err:
        client.query("up")
    assert str(err.value) == f"Prometheus at {answering.url}: 'up' gave no result list"


def test_a_target_that_is_not_an_object_is_skipped_not_the_rest(answering: Answering) -> None:
    client = _client(answering, {"targets": {"activeTargets": [
        "junk", {"labels": {"instance": "a:1"}, "scrapeInterval": "30s"}]}})
    assert client.scrape_intervals() == {"a:1": 30.0}


def test_a_dcgm_mig_devices_parent_is_its_whole_uuid_label(answering: Answering) -> None:
    """The key is ``UUID/GPU_I_ID``: a UUID label with a ``/`` in it stays whole as the parent
    (it was cut at its first ``/``; found by the ``rpartition`` mutant)."""
    client = _client(answering, {DCGM_Q: [
        _item("1", __name__="DCGM_FI_DEV_FB_USED", UUID="GPU-a/b", GPU_I_ID="1", gpu="0",
              hostname="h"),
        _item("1", __name__="DCGM_FI_DEV_FB_USED", UUID="GPU-c", GPU_I_ID="2", gpu="1",
              hostname="h"),
    ]})
    (host,) = fetch_cluster(client, now_s=1.0).hosts
    assert [(d.snapshot.uuid, d.snapshot.parent_uuid, d.snapshot.mig_index)
            for d in host.devices] == [("GPU-a/b/1", "GPU-a/b", 1), ("GPU-c/2", "GPU-c", 2)]


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_a_targets_answer_past_the_byte_cap_is_refused_in_one_line(
    prom: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mutation run of 2026-12-07 found the byte cap's words for a request without a query
    (the scrape intervals' ``/api/v1/targets``) unpinned: the same one line, with nothing in the
    parentheses, not an error of its own."""
    prom.answer("/api/v1/targets", None, {"status": "success", "data": {"activeTargets": [
        {"labels": {"instance": f"h:{i}"}, "scrapeInterval": "15s"} for i in range(100)]}})
    monkeypatch.setattr(prometheus, "MAX_BODY_BYTES", 1000)
    with pytest.raises(ClusterError) as err:
        PrometheusClient(prom.url).scrape_intervals()
    assert str(err.value) == (
        f"Prometheus at {prom.url} answered /api/v1/targets () with more than 0 MiB: "
        "the cluster view reads no more; scrape fewer targets into this Prometheus, or point "
        "c.AutoGPU.prometheus_url at one that holds only the GPU hosts"
    )
