"""The cluster view over AMD's device metrics exporter: its series, as Prometheus returns them,
folded into devices where a host exports no autogpu series (as DCGM's are), then ranked by the
one decision pipeline. Prometheus is answered in-process, query by query."""

from __future__ import annotations

from typing import Any

import pytest

from autogpu_jupyter.core.cluster import (
    _DCGM_QUERY,
    _NAMES_QUERIES,
    _SCRAPED_QUERY,
    ClusterDevice,
    PrometheusClient,
    Sample,
    _Acc,
    _amd_snapshot,
    _fold_amd,
    fetch_cluster,
    rank_hosts,
)
from autogpu_jupyter.core.devices import DeviceSnapshot
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


# ---- one exporter sample folded into its device, and the device's snapshot, whole ----
# Found by the mutation run of issue 22.
def sample(value: float, **labels: str) -> Sample:
    return Sample({"__name__": "gpu_gfx_activity", "instance": INST, **labels}, value, NOW)


@pytest.mark.parametrize(
    ("labels", "key", "expected"),
    [
        ({"hostname": "mi300-a", "gpu_id": "2", "gpu_uuid": UUID0,
          "card_series": "AMD Instinct MI300X", "card_model": "102-D65209-0C"},
         UUID0, _Acc("mi300-a", INST, UUID0, "2", "AMD Instinct MI300X", "amd")),
        ({"hostname": "mi300-a", "gpu_id": "1", "card_model": "102-D65209-0C"},
         "mi300-a/gpu-1", _Acc("mi300-a", INST, "mi300-a/gpu-1", "1", "102-D65209-0C", "amd")),
        # no optional label at all: the host from the instance, no index, no model
        ({}, "10.0.0.9/gpu-", _Acc("10.0.0.9", INST, "10.0.0.9/gpu-", "", "", "amd")),
    ],
)
def test_an_amd_exporter_sample_is_folded_into_its_device(
    labels: dict[str, str], key: str, expected: _Acc
) -> None:
    acc: dict[str, _Acc] = {}
    _fold_amd(sample(45.0, **labels), acc)
    _fold_amd(Sample({**sample(0, **labels).labels, "__name__": "gpu_used_vram"}, 2048.0, NOW),
              acc)
    expected.values.update(gpu_gfx_activity=45.0, gpu_used_vram=2048.0)
    assert acc == {key: expected}


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
        (None, {}, NONE),
        (1, {"gpu_used_vram": 7}, {**NONE, "memory_used_bytes": 7 * MiB}),
        (1, {"gpu_total_vram": 7}, {**NONE, "memory_total_bytes": 7 * MiB}),
    ],
)
def test_an_amd_exporter_device_s_snapshot(
    index: int | None, values: dict[str, float], fields: dict[str, Any]
) -> None:
    dev = _Acc("mi300-a", INST, UUID0, "3", "AMD Instinct MI300X", "amd", dict(values))
    assert _amd_snapshot(dev, index, NOW) == amd_device(index, **fields)
