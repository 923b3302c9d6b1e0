"""The cluster view over AMD's device metrics exporter: its series, as Prometheus returns them,
folded into devices where a host exports no autogpu series (as DCGM's are), then ranked by the
one decision pipeline. Prometheus is answered in-process, query by query."""

from __future__ import annotations

from typing import Any

from autogpu_jupyter.core.cluster import (
    _DCGM_QUERY,
    _NAMES_QUERIES,
    _SCRAPED_QUERY,
    PrometheusClient,
    fetch_cluster,
    rank_hosts,
)
from autogpu_jupyter.core.policy import Constraints

MiB = 1024**2
NOW = 1_800_000_000.0
INST = "10.0.0.9:5000"
UUID0 = "5aff74a1-0000-1000-8000-c0ffee000000"


class Answers(PrometheusClient):
    """Answers each query from ``answers`` (an empty vector for the rest) without a server."""

    def __init__(self, answers: dict[str, list[dict[str, Any]]]) -> None:
        super().__init__("http://127.0.0.1:1")
        self.answers = answers
        self.asked: list[str] = []

    def _get(self, path: str, params: Any) -> Any:
        if path == "/api/v1/targets":
            return {"activeTargets": [{"labels": {"instance": INST}, "scrapeInterval": "15s"}]}
        self.asked.append(params["query"])
        return {"resultType": "vector", "result": self.answers.get(params["query"], [])}


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


def test_amd_exporter_series_are_devices_and_are_ranked() -> None:
    client = Answers({
        _DCGM_QUERY: amd_series(),
        _SCRAPED_QUERY: [s({}, NOW - 5)],
        "up": [s({"job": "amd"}, 1)],
        _NAMES_QUERIES[1]: [s({}, 1)],
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


def test_autogpus_own_series_win_over_the_amd_exporters() -> None:
    own = [{"metric": {"__name__": "autogpu_gpu_memory_used_bytes", "instance": "h:9445",
                       "hostname": "mi300-a", "uuid": UUID0, "index": "0",
                       "model": "AMD Instinct MI300X"}, "value": [NOW, "1073741824"]}]
    client = Answers({
        '{__name__=~"autogpu_gpu_.*|autogpu_lease_info"}': own,
        _DCGM_QUERY: amd_series(),
        _SCRAPED_QUERY: [s({}, NOW - 5)],
        "up": [s({}, 1)],
    })
    devices = fetch_cluster(client, now_s=NOW).hosts[0].devices
    by_uuid = {d.snapshot.uuid: d for d in devices}
    assert by_uuid[UUID0].source == "autogpu"
    assert by_uuid[UUID0].snapshot.memory_used_bytes == 1024**3
    assert by_uuid["mi300-a/gpu-1"].source == "amd"
