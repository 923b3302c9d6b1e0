"""jupyter_server's ``/metrics`` on an AMD host: the autogpu collector over AMD's real ``amdsmi``
binding and the fake ``libamd_smi.so``; what Prometheus would read, parsed with
``prometheus_client``'s own parser and compared value by value."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from autogpu_jupyter.core import sampler as sampler_mod
from tests.fakeamdsmi import FakeAmdSmi, amd_uuid

pytest_plugins = ["pytest_jupyter.jupyter_server"]

GiB = 1024**3
HOST = "mi300-node"
FLEET: dict[str, Any] = {
    "driver_version": "6.10.5",
    "devices": [
        {"name": "AMD Instinct MI300X", "uuid": amd_uuid(0), "pci_bus_id": "0000:05:00.0",
         "memory_total": "192G", "memory_used": "48G", "utilization_pct": 35,
         "temperature_c": 51, "power_w": 420, "power_limit_w": 750, "processes": []},
        {"name": "AMD Instinct MI300X", "uuid": amd_uuid(1),
         "pci_bus_id": "0000:25:00.0", "compute_partition": "CPX", "partition_id": 3,
         "memory_total": "24G", "memory_used": "6G", "utilization_pct": 5,
         "power_limit_w": 750, "processes": []},
        {"name": "AMD Instinct MI300X", "uuid": amd_uuid(2), "lost": True},
    ],
}


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("autogpu_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(uuid: str, index: str, model: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"hostname": HOST, "uuid": uuid, "index": index, "model": model}.items()))


@pytest.fixture
def fleet(fake_amdsmi: FakeAmdSmi, registry_dir: Path) -> Any:
    fake_amdsmi.write(FLEET)
    sampler_mod.stop_sampler()
    yield fake_amdsmi
    sampler_mod.stop_sampler()


@pytest.fixture
def jp_server_config(fleet: Any) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": {"interval_s": 0.1, "metrics_hostname": HOST},
    }


async def scrape(jp_fetch: Any) -> str:
    for _ in range(100):
        response = await jp_fetch("metrics")
        text = response.body.decode()
        if "autogpu_gpu_available" in text:
            return text
        time.sleep(0.05)
    raise AssertionError("no autogpu_gpu_* series after 5 s:\n" + text[-2000:])


async def test_metrics_exact_values_over_fake_amdsmi(jp_fetch: Any) -> None:
    got = series(await scrape(jp_fetch))
    whole = labels(amd_uuid(0), "0", "AMD Instinct MI300X")
    part = labels(amd_uuid(1), "1", "AMD Instinct MI300X (CPX 3, NPS1)")
    lost = labels("unknown-2", "2", "unknown")
    want = {
        ("autogpu_gpu_available", whole): 1.0,
        ("autogpu_gpu_available", part): 1.0,
        ("autogpu_gpu_available", lost): 0.0,
        ("autogpu_gpu_utilization_ratio", whole): 0.35,
        # a partition has no utilisation, temperature or power of its own: no sample at all
        ("autogpu_gpu_memory_used_bytes", whole): 48.0 * GiB,
        ("autogpu_gpu_memory_used_bytes", part): 6.0 * GiB,
        ("autogpu_gpu_memory_total_bytes", whole): 192.0 * GiB,
        ("autogpu_gpu_memory_total_bytes", part): 24.0 * GiB,
        ("autogpu_gpu_memory_booked_bytes", whole): 0.0,
        ("autogpu_gpu_memory_booked_bytes", part): 0.0,
        ("autogpu_gpu_memory_used_ratio", whole): 0.25,
        ("autogpu_gpu_memory_used_ratio", part): 0.25,
        ("autogpu_gpu_temperature_celsius", whole): 51.0,
        ("autogpu_gpu_power_watts", whole): 420.0,
        ("autogpu_gpu_leases", whole): 0.0,
        ("autogpu_gpu_leases", part): 0.0,
        ("autogpu_gpu_leases", lost): 0.0,
        ("autogpu_gpu_waiters", whole): 0.0,
        ("autogpu_gpu_waiters", part): 0.0,
        ("autogpu_gpu_waiters", lost): 0.0,
    }
    gpu = {k: v for k, v in got.items() if k[0].startswith("autogpu_gpu_")}
    assert sorted(set(gpu) - set(want)) == []
    assert sorted(set(want) - set(gpu)) == []
    assert gpu == pytest.approx(want)
    info = [k for k in got if k[0] == "autogpu_host_info"]
    assert info == [("autogpu_host_info", (("backend", "amdsmi"), ("hostname", HOST),
                                           ("simulated", "false"), ("vendor", "amd"),
                                           ("version", "0.1.0")))]
