"""Prometheus metrics: jupyter_server's ``/metrics`` with the autogpu collector, over the fake
NVIDIA driver (real pynvml), and ``autogpu exporter`` as a real process over a simulated fleet.

What a Prometheus server would read is parsed with ``prometheus_client``'s own text parser and
compared value by value.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient
from prometheus_client.parser import text_string_to_metric_families

from autogpu_jupyter.core import sampler as sampler_mod
from tests.browserhelpers import free_port

pytest_plugins = ["pytest_jupyter.jupyter_server"]

GiB = 1024**3
UUID0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
UUID1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
UUID2 = "GPU-2c2c2c2c-1111-2222-3333-444444444444"
HOST = "node-a"
#: A notebook path another user could choose: quotes, a backslash, a newline, non-ASCII. The
#: registry writes control characters as '?' (its records are checked by its reader), so the
#: label carries ODD_LABEL.
ODD_PATH = 'work/"quoted" \\ back{slash}\nline é.ipynb'
ODD_LABEL = 'work/"quoted" \\ back{slash}?line é.ipynb'

FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": UUID0, "pci_bus_id": "00000000:07:00.0",
         "memory_total": "80G", "memory_used": "20G", "utilization_pct": 35,
         "temperature_c": 51, "power_w": 210.5, "power_limit_w": 400.0, "processes": []},
        {"name": "NVIDIA L4", "uuid": UUID1, "pci_bus_id": "00000000:17:00.0",
         "memory_total": "24G", "memory_used": "6G", "utilization_pct": 5,
         "temperature_c": 38, "power_w": 20.0, "power_limit_w": 72.0, "processes": []},
        {"name": "NVIDIA L4", "uuid": UUID2, "pci_bus_id": "00000000:27:00.0", "lost": True},
    ],
}


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``(name, sorted labels) -> value`` of every ``autogpu_*`` sample in an exposition."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("autogpu_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def assert_gpu_series(got: dict[Any, float], want: dict[Any, float]) -> None:
    """The ``autogpu_gpu_*`` series of ``got`` are exactly ``want`` (names, labels, values)."""
    gpu = {k: v for k, v in got.items() if k[0].startswith("autogpu_gpu_")}
    assert sorted(set(gpu) - set(want)) == []
    assert sorted(set(want) - set(gpu)) == []
    assert gpu == pytest.approx(want)


def dev_labels(uuid: str, index: str, model: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"hostname": HOST, "uuid": uuid, "index": index, "model": model}.items()))


def expected(booked0: int = 0, leases0: int = 0) -> dict[Any, float]:
    a100 = dev_labels(UUID0, "0", "NVIDIA A100-SXM4-80GB")
    l4 = dev_labels(UUID1, "1", "NVIDIA L4")
    # NVML cannot read a lost GPU's UUID or name: the backend names it by its index
    lost = dev_labels("unknown-2", "2", "unknown")
    out: dict[Any, float] = {
        ("autogpu_gpu_available", a100): 1.0,
        ("autogpu_gpu_available", l4): 1.0,
        ("autogpu_gpu_available", lost): 0.0,
        ("autogpu_gpu_utilization_ratio", a100): 0.35,
        ("autogpu_gpu_utilization_ratio", l4): 0.05,
        ("autogpu_gpu_memory_used_bytes", a100): 20.0 * GiB,
        ("autogpu_gpu_memory_used_bytes", l4): 6.0 * GiB,
        ("autogpu_gpu_memory_total_bytes", a100): 80.0 * GiB,
        ("autogpu_gpu_memory_total_bytes", l4): 24.0 * GiB,
        ("autogpu_gpu_memory_booked_bytes", a100): float(booked0),
        ("autogpu_gpu_memory_booked_bytes", l4): 0.0,
        ("autogpu_gpu_memory_used_ratio", a100): (20 * GiB + booked0) / (80 * GiB),
        ("autogpu_gpu_memory_used_ratio", l4): 0.25,
        ("autogpu_gpu_temperature_celsius", a100): 51.0,
        ("autogpu_gpu_temperature_celsius", l4): 38.0,
        ("autogpu_gpu_power_watts", a100): 210.5,
        ("autogpu_gpu_power_watts", l4): 20.0,
        ("autogpu_gpu_leases", a100): float(leases0),
        ("autogpu_gpu_leases", l4): 0.0,
        ("autogpu_gpu_leases", lost): 0.0,
        ("autogpu_gpu_waiters", a100): 0.0,
        ("autogpu_gpu_waiters", l4): 0.0,
        ("autogpu_gpu_waiters", lost): 0.0,
    }
    return out


@pytest.fixture
def fleet(fake_nvml: Any, registry_dir: Path) -> Any:
    fake_nvml.write(FLEET)
    sampler_mod.stop_sampler()
    yield fake_nvml
    sampler_mod.stop_sampler()


@pytest.fixture
def jp_server_config(fleet: Any) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": {"interval_s": 0.1, "metrics_hostname": HOST,
                          "metrics_lease_details": True},
    }


async def scrape(jp_fetch: Any) -> str:
    for _ in range(100):  # the sampler's first sweep comes within 0.1 s of the server's start
        response = await jp_fetch("metrics")
        assert response.code == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.body.decode()
        if "autogpu_gpu_available" in text:
            return text
        await asyncio.sleep(0.05)
    raise AssertionError("no autogpu_gpu_* series after 5 s:\n" + text[-2000:])


async def test_metrics_need_a_token_by_default(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("metrics", headers={"Authorization": ""})
    assert err.value.code == 403


async def test_metrics_exact_values_over_fake_nvml(jp_fetch: Any) -> None:
    got = series(await scrape(jp_fetch))
    want = expected()
    assert_gpu_series(got, want)
    info = [k for k in got if k[0] == "autogpu_host_info"]
    assert info == [("autogpu_host_info", (("backend", "nvml"), ("hostname", HOST),
                                           ("simulated", "false"), ("vendor", "nvidia"),
                                           ("version", "0.1.0")))]
    stamp = got[("autogpu_sample_timestamp_seconds", (("hostname", HOST),))]
    assert time.time() - 5 < stamp <= time.time()
    assert [k for k in got if k[0] == "autogpu_lease_info"] == []


async def test_lease_booking_and_odd_notebook_path_round_trip(jp_fetch: Any,
                                                             registry_dir: Path) -> None:
    """A lease booking 30 GiB on GPU 0 for a notebook whose path has quotes, a backslash and a
    newline:
    booked bytes, the ratio, the lease count, and the path read back exactly by a parser."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    registry = DirectoryStore(str(registry_dir))
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[UUID0], requested_bytes=30 * GiB,
                           requester=Requester(kernel_id="k-1", notebook_path=ODD_PATH))
    try:
        deadline = time.monotonic() + 10
        while True:
            got = series(await scrape(jp_fetch))
            if got.get(("autogpu_gpu_leases", dev_labels(UUID0, "0", "NVIDIA A100-SXM4-80GB"))):
                break
            assert time.monotonic() < deadline, "the lease never showed"
            await asyncio.sleep(0.1)
        # escaped as the exposition format says: \" and \\
        text = await scrape(jp_fetch)
        assert 'notebook="work/\\"quoted\\" \\\\ back{slash}?line é.ipynb"' in text
        want = expected(booked0=30 * GiB, leases0=1)
        assert_gpu_series(got, want)
        import getpass

        lease_series = {k: v for k, v in got.items() if k[0] == "autogpu_lease_info"}
        assert lease_series == {
            ("autogpu_lease_info", tuple(sorted({
                "hostname": HOST, "uuid": UUID0, "index": "0", "model": "NVIDIA A100-SXM4-80GB",
                "user": getpass.getuser(), "kernel": "k-1", "notebook": ODD_LABEL}.items()))): 1.0
        }
    finally:
        lease.release()


async def test_scrapes_make_no_nvml_call(jp_fetch: Any, fleet: Any) -> None:
    await scrape(jp_fetch)
    sampler = sampler_mod.current_sampler()
    assert sampler is not None
    # the sampler's thread ends (joined: no sweep still in flight); its latest sweep stays
    sampler.stop()
    assert not sampler.running
    fleet.reset_calls()
    for _ in range(20):
        await scrape(jp_fetch)
    assert preload_total_calls() == 0


def preload_total_calls() -> int:
    from tests.fakenvml import preload_fake_nvml

    return int(preload_fake_nvml().fakenvml_total_calls())


class TestMetricsOff:
    @pytest.fixture
    def jp_server_config(self, fleet: Any) -> dict[str, Any]:
        return {
            "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True},
                          "authenticate_prometheus": False},
            "AutoGPUServer": {"interval_s": 0.1, "metrics_hostname": HOST},
        }

    async def test_admin_can_open_metrics_and_hide_lease_details(
        self, jp_fetch: Any, registry_dir: Path
    ) -> None:
        from autogpu_jupyter.core.leasing import DirectoryStore, Requester

        registry = DirectoryStore(str(registry_dir))
        with registry.locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[UUID1], requester=Requester(notebook_path="secret.ipynb"))
        try:
            response = await jp_fetch("metrics", headers={"Authorization": ""})
            assert response.code == 200
            deadline = time.monotonic() + 10
            while "autogpu_lease_info{" not in response.body.decode():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
                response = await jp_fetch("metrics", headers={"Authorization": ""})
            text = response.body.decode()
            assert "secret.ipynb" not in text
            got = series(text)
            import getpass

            assert {k: v for k, v in got.items() if k[0] == "autogpu_lease_info"} == {
                ("autogpu_lease_info", tuple(sorted({
                    "hostname": HOST, "uuid": UUID1, "index": "1", "model": "NVIDIA L4",
                    "user": getpass.getuser()}.items()))): 1.0
            }
        finally:
            lease.release()


# -- autogpu exporter -----------------------------------------------------------------------


def test_exporter_serves_the_simulated_fleet(tmp_path: Path) -> None:
    fleet_file = tmp_path / "fleet.json"
    sim = json.loads(json.dumps(FLEET))
    sim["devices"][0]["mig_devices"] = [
        {"uuid": "MIG-aaaa0000-1111-2222-3333-444444444444", "profile": "3g.40gb",
         "memory_total": "40G", "memory_used": "4G"}]
    fleet_file.write_text(json.dumps(sim))
    port = free_port()
    env = {**os.environ, "AUTOGPU_SIMULATE": str(fleet_file),
           "AUTOGPU_REGISTRY_DIR": str(tmp_path / "reg")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "autogpu_jupyter.cli", "exporter", "--host", "127.0.0.3",
         "--port", str(port), "--hostname", "batch-7", "--interval", "0.2"],
        env=env, stderr=subprocess.PIPE, text=True,
    )
    try:
        text = ""
        deadline = time.monotonic() + 30
        while "autogpu_gpu_available" not in text:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, text
            try:
                with urllib.request.urlopen(f"http://127.0.0.3:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                time.sleep(0.1)
        got = series(text)
        mig = tuple(sorted({"hostname": "batch-7",
                            "uuid": "MIG-aaaa0000-1111-2222-3333-444444444444",
                            "index": "0:0", "model": "NVIDIA A100-SXM4-80GB MIG 3g.40gb"}.items()))
        parent = tuple(sorted({"hostname": "batch-7", "uuid": UUID0, "index": "0",
                               "model": "NVIDIA A100-SXM4-80GB"}.items()))
        assert got[("autogpu_gpu_memory_used_bytes", mig)] == 4 * GiB
        assert got[("autogpu_gpu_memory_total_bytes", mig)] == 40 * GiB
        assert got[("autogpu_gpu_memory_used_ratio", mig)] == 0.1
        # MIG: utilisation is not supported, so there is no sample (never a made-up zero)
        assert ("autogpu_gpu_utilization_ratio", mig) not in got
        assert ("autogpu_gpu_utilization_ratio", parent) not in got
        assert got[("autogpu_host_info", (("backend", "simulated"), ("hostname", "batch-7"),
                                          ("simulated", "true"), ("vendor", "nvidia"),
                                          ("version", "0.1.0")))] == 1.0
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_exporter_bad_port_says_what_is_accepted() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", "exporter", "--port", "70000"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "AUTOGPU_SIMULATE": "demo-4x"},
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "autogpu: invalid --port 70000: expected 1-65535, e.g. 9445"
