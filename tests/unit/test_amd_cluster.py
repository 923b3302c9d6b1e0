"""The cluster view over AMD's device metrics exporter: its series, as Prometheus returns them,
folded into devices where a host exports no autogpu series (as DCGM's are), then ranked by the
one decision pipeline. Prometheus is answered on loopback, query by query."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator
from typing import Any

import pytest

from autogpu_jupyter.core.cluster import (
    ClusterDevice,
    PrometheusClient,
    fetch_cluster,
    rank_hosts,
)
from autogpu_jupyter.core.devices import DeviceSnapshot
from autogpu_jupyter.core.policy import Constraints

MiB = 1024**2
NOW = 1_800_000_000.0
INST = "10.0.0.9:5000"
UUID0 = "5aff74a1-0000-1000-8000-c0ffee000000"
#: The queries the cluster view sends that AMD's exporter answers (as Prometheus receives them).
AMD_Q = ('{__name__=~"DCGM_FI_DEV_GPU_UTIL|DCGM_FI_PROF_GR_ENGINE_ACTIVE|DCGM_FI_DEV_FB_USED|'
         'DCGM_FI_DEV_FB_FREE|DCGM_FI_DEV_GPU_TEMP|DCGM_FI_DEV_POWER_USAGE|'
         'gpu_gfx_activity|gpu_used_vram|gpu_total_vram|gpu_junction_temperature|'
         'gpu_edge_temperature|gpu_package_power|gpu_power_usage"}')
SCRAPED_Q = 'timestamp({__name__=~"autogpu_host_info|DCGM_FI_DEV_FB_USED|gpu_used_vram"})'
NAMES_Q = ("max by (instance, hostname, Hostname) "
           '(last_over_time({__name__=~"DCGM_FI_DEV_FB_USED|gpu_used_vram"}[1h]))')


class _Prometheus(http.server.ThreadingHTTPServer):
    """A Prometheus on loopback answering each instant query from ``answers`` (an empty vector
    for the rest) and its targets API with one 15 s target."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answers: dict[str, list[dict[str, Any]]] = {}


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Prometheus

    def do_GET(self) -> None:
        split = urllib.parse.urlsplit(self.path)
        params = dict(urllib.parse.parse_qsl(split.query))
        if split.path == "/api/v1/targets":
            data: Any = {"activeTargets": [
                {"labels": {"instance": INST}, "scrapeInterval": "15s"}]}
        else:
            data = {"resultType": "vector",
                    "result": self.server.answers.get(params.get("query", ""), [])}
        body = json.dumps({"status": "success", "data": data}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def _prometheus() -> Iterator[_Prometheus]:
    server = _Prometheus()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def answers(_prometheus: _Prometheus) -> Any:
    """``answers(by_query)``: a client of the loopback Prometheus, which answers those."""

    def client(by_query: dict[str, list[dict[str, Any]]]) -> PrometheusClient:
        _prometheus.answers = by_query
        return PrometheusClient(f"http://127.0.0.1:{_prometheus.server_address[1]}")

    return client


def s(labels: dict[str, str], value: float) -> dict[str, Any]:
    return {"metric": {"instance": INST, "hostname": "mi300-a", **labels},
            "value": [NOW, repr(value)]}


def amd_series() -> list[dict[str, Any]]:
    gpu0 = {"gpu_id": "0", "gpu_uuid": UUID0, "card_series": "AMD Instinct MI300X",
            "card_model": "102-D65209-0C", "gpu_partition_id": "0"}
    gpu1 = {"gpu_id": "1", "card_model": "102-D65209-0C", "gpu_partition_id": "0"}
    out = []
    for name, v0, v1 in (("gpu_gfx_activity", 45, 2), ("gpu_used_vram", 150_000, 2_048),
                         ("gpu_total_vram", 196_592, 196_592),
                         ("gpu_junction_temperature", 61, 40),
                         ("gpu_package_power", 512, 140)):
        out.append(s({"__name__": name, **gpu0}, v0))
        out.append(s({"__name__": name, **gpu1}, v1))
    return out


def test_amd_exporter_series_are_devices_and_are_ranked(answers: Any) -> None:
    client = answers({
        AMD_Q: amd_series(),
        SCRAPED_Q: [s({}, NOW - 5)],
        "up": [s({"job": "amd"}, 1)],
        NAMES_Q: [s({}, 1)],
    })
    view = fetch_cluster(client, now_s=NOW)
    assert [(h.hostname, h.state, h.instances) for h in view.hosts] == [
        ("mi300-a", "ok", (INST,))]
    assert [d.to_dict() for d in view.hosts[0].devices] == [
        {"uuid": UUID0, "index": 0, "mig_index": None, "label": "GPU 0",
         "name": "AMD Instinct MI300X", "available": True, "source": "amd",
         "utilization_pct": 45.0, "memory_used_bytes": 150_000 * MiB,
         "memory_total_bytes": 196_592 * MiB, "memory_free_bytes": 46_592 * MiB,
         "memory_booked_bytes": 0, "temperature_c": 61.0, "power_w": 512.0, "lease_count": 0,
         "waiters": 0, "holders": []},
        # no gpu_uuid label (an optional one): keyed by host and gpu_id, named by card_model
        {"uuid": "mi300-a/gpu-1", "index": 1, "mig_index": None, "label": "GPU 1",
         "name": "102-D65209-0C", "available": True, "source": "amd",
         "utilization_pct": 2.0, "memory_used_bytes": 2_048 * MiB,
         "memory_total_bytes": 196_592 * MiB, "memory_free_bytes": 194_544 * MiB,
         "memory_booked_bytes": 0, "temperature_c": 40.0, "power_w": 140.0, "lease_count": 0,
         "waiters": 0, "holders": []},
    ]
    (best,) = rank_hosts(view, Constraints.parse(min_free="100G"))
    assert [c.device.uuid for c in best.chosen] == ["mi300-a/gpu-1"]


def test_autogpus_own_series_win_over_the_amd_exporters(answers: Any) -> None:
    own = [{"metric": {"__name__": "autogpu_gpu_memory_used_bytes", "instance": "h:9445",
                       "hostname": "mi300-a", "uuid": UUID0, "index": "0",
                       "model": "AMD Instinct MI300X"}, "value": [NOW, "1073741824"]}]
    client = answers({
        '{__name__=~"autogpu_gpu_.*|autogpu_lease_info"}': own,
        AMD_Q: amd_series(),
        SCRAPED_Q: [s({}, NOW - 5)],
        "up": [s({}, 1)],
    })
    devices = fetch_cluster(client, now_s=NOW).hosts[0].devices
    by_uuid = {d.snapshot.uuid: d for d in devices}
    assert by_uuid[UUID0].source == "autogpu"
    assert by_uuid[UUID0].snapshot.memory_used_bytes == 1024**3
    assert by_uuid["mi300-a/gpu-1"].source == "amd"


# ---- one exporter sample folded into its device, and the device's snapshot, whole ----
# Found by the mutation run of issue 22; seen in what fetch_cluster answers.
def sample(value: float, **labels: str) -> dict[str, Any]:
    return {"metric": {"__name__": "gpu_gfx_activity", "instance": INST, **labels},
            "value": [NOW, repr(value)]}


@pytest.mark.parametrize(
    ("labels", "host", "device"),
    [
        ({"hostname": "mi300-a", "gpu_id": "2", "gpu_uuid": UUID0,
          "card_series": "AMD Instinct MI300X", "card_model": "102-D65209-0C"},
         "mi300-a", (UUID0, 2, "AMD Instinct MI300X")),
        ({"hostname": "mi300-a", "gpu_id": "1", "card_model": "102-D65209-0C"},
         "mi300-a", ("mi300-a/gpu-1", 1, "102-D65209-0C")),
        # no optional label at all: the host from the instance, no index, no model
        ({}, "10.0.0.9", ("10.0.0.9/gpu-", -1, "")),
    ],
)
def test_an_amd_exporter_sample_is_folded_into_its_device(
    answers: Any, labels: dict[str, str], host: str, device: tuple[str, int, str]
) -> None:
    """Two series of one device (keyed by ``gpu_uuid``, else host and ``gpu_id``) are one
    device, named by ``card_series``, else ``card_model``."""
    used = sample(2048.0, **labels)
    used["metric"]["__name__"] = "gpu_used_vram"
    view = fetch_cluster(answers({AMD_Q: [sample(45.0, **labels), used]}), now_s=NOW)
    (got,) = view.hosts
    assert [(got.hostname, d.snapshot.uuid, d.snapshot.index, d.snapshot.name,
             d.snapshot.utilization_pct, d.snapshot.memory_used_bytes, d.source)
            for d in got.devices] == [(host, *device, 45.0, 2048 * MiB, "amd")]


def amd_device(index: int | None, **fields: Any) -> ClusterDevice:
    return ClusterDevice(DeviceSnapshot(
        index=-1 if index is None else index, uuid=UUID0, name="AMD Instinct MI300X",
        vendor="amd", timestamp_s=NOW, **fields), "amd")


NONE = {"memory_total_bytes": None, "memory_used_bytes": None, "memory_free_bytes": None,
        "utilization_pct": None, "temperature_c": None, "power_w": None}


@pytest.mark.parametrize(
    ("index", "values", "fields"),
    [
        (3, {"gpu_used_vram": 150_000, "gpu_total_vram": 196_592, "gpu_gfx_activity": 45,
             "gpu_junction_temperature": 61.0, "gpu_edge_temperature": 50.0,
             "gpu_package_power": 512.0, "gpu_power_usage": 100.0},
         {"memory_total_bytes": 196_592 * MiB, "memory_used_bytes": 150_000 * MiB,
          "memory_free_bytes": 46_592 * MiB, "utilization_pct": 45.0, "temperature_c": 61.0,
          "power_w": 512.0}),
        # the older exporters' names; more used than the total never makes the free negative
        (0, {"gpu_used_vram": 2.5, "gpu_total_vram": 2, "gpu_gfx_activity": 0,
             "gpu_edge_temperature": 50.0, "gpu_power_usage": 100.0},
         {"memory_total_bytes": 2 * MiB, "memory_used_bytes": int(2.5 * MiB),
          "memory_free_bytes": 0, "utilization_pct": 0.0, "temperature_c": 50.0,
          "power_w": 100.0}),
        (None, {"gpu_used_vram": 7}, {**NONE, "memory_used_bytes": 7 * MiB}),
        (1, {"gpu_used_vram": 7}, {**NONE, "memory_used_bytes": 7 * MiB}),
        (1, {"gpu_total_vram": 7}, {**NONE, "memory_total_bytes": 7 * MiB}),
        (1, {"gpu_junction_temperature": 61.0}, {**NONE, "temperature_c": 61.0}),
        (1, {"gpu_package_power": 512.0}, {**NONE, "power_w": 512.0}),
    ],
)
def test_an_amd_exporter_device_s_snapshot(
    answers: Any, index: int | None, values: dict[str, float], fields: dict[str, Any]
) -> None:
    """The device's snapshot from its series (``gpu_id`` its index; none: -1), at the view's
    moment."""
    labels = {"hostname": "mi300-a", "gpu_uuid": UUID0, "card_series": "AMD Instinct MI300X"}
    if index is not None:
        labels["gpu_id"] = str(index)
    series = [{"metric": {**labels, "__name__": name, "instance": INST}, "value": [NOW, repr(v)]}
              for name, v in values.items()]
    (host,) = fetch_cluster(answers({AMD_Q: series}), now_s=NOW).hosts
    assert host.devices == (amd_device(index, **fields),)
