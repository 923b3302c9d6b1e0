"""The cluster view from a real Prometheus: Debian's ``prometheus`` scraping three
``autogpu exporter`` hosts and one DCGM-format endpoint every second (``tests/clusterhelpers.py``),
read back by the server extension's ``GET /autogpu/cluster`` and by ``autogpu hosts``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient

from autogpu_jupyter.core import sampler as sampler_mod
from tests.clusterhelpers import SCRAPE_INTERVAL_S, Cluster, GiB, MiB, prometheus_cluster

pytest_plugins = ["pytest_jupyter.jupyter_server"]
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with prometheus_cluster(tmp_path_factory.mktemp("cluster")) as running:
        yield running


@pytest.fixture
def jp_server_config(cluster: Cluster, registry_dir: Path,
                     monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
    sampler_mod.stop_sampler()
    yield {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": {"interval_s": 0.5},
        "AutoGPU": {"prometheus_url": cluster.url},
    }
    sampler_mod.stop_sampler()


async def get_cluster(jp_fetch: Any, **params: str) -> dict[str, Any]:
    response = await jp_fetch("autogpu", "cluster", params=params)
    assert response.code == 200
    data: dict[str, Any] = json.loads(response.body)
    return data


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


def expected_hosts(cluster: Cluster) -> dict[str, list[dict[str, Any]]]:
    import getpass

    a100, l4, h100 = "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA H100 80GB HBM3"
    # the simulated backend derives temperature and power from utilisation where not given
    return {
        "dgx-d": [
            device("GPU-dddd0000-0000-0000-0000-000000000000", 0, a100, util=90.0,
                   used=70000 * MiB, total=81920 * MiB, source="dcgm"),
            device("GPU-dddd0001-0000-0000-0000-000000000001/1", 1, a100, util=50.0,
                   used=1000 * MiB, total=40000 * MiB, source="dcgm", mig=1),
        ],
        "gpu-a": [
            device("GPU-aaaa0000-0000-0000-0000-000000000000", 0, a100, util=70.0,
                   used=60 * GiB, total=80 * GiB, temp=60.0, power=300.0),
            device("GPU-aaaa0001-0000-0000-0000-000000000001", 1, a100, util=10.0,
                   used=75 * GiB, total=80 * GiB, temp=40.0, power=90.0),
        ],
        "gpu-b": [
            device("GPU-bbbb0000-0000-0000-0000-000000000000", 0, l4, util=50.0,
                   used=4 * GiB, total=24 * GiB, temp=54.0),
            device("GPU-bbbb0001-0000-0000-0000-000000000001", 1, l4, util=5.0,
                   used=20 * GiB, total=24 * GiB, temp=34.0),
            device("GPU-bbbb0002-0000-0000-0000-000000000002", 2, l4, util=30.0,
                   used=2 * GiB, total=24 * GiB, temp=46.0),
            {**device("GPU-bbbb0003-0000-0000-0000-000000000003", 3, l4, util=None,
                      used=None, total=None, available=False), "memory_booked_bytes": 0},
        ],
        "gpu-c": [
            # the lease of `autogpu run --min-free 30G` on host gpu-c took GPU 0 and books 30 GiB
            device("GPU-cccc0000-0000-0000-0000-000000000000", 0, h100, util=20.0,
                   used=10 * GiB, total=80 * GiB, booked=30 * GiB, leases=1, temp=41.0,
                   holders=(getpass.getuser(),)),
            device("GPU-cccc0001-0000-0000-0000-000000000001", 1, h100, util=0.0,
                   used=40 * GiB, total=80 * GiB, temp=32.0),
        ],
    }


async def test_cluster_endpoint_lists_every_host_with_its_numbers(
    jp_fetch: Any, cluster: Cluster
) -> None:
    before = time.time()
    data = await get_cluster(jp_fetch, min_free="10G")
    assert data["configured"] is True
    assert data["prometheus_url"] == cluster.url
    assert data["errors"] == []
    hosts = {h["hostname"]: h for h in data["hosts"]}
    assert sorted(hosts) == ["dgx-d", "gpu-a", "gpu-b", "gpu-c"]
    for name, h in hosts.items():
        assert h["state"] == "ok", (name, h["note"])
        assert h["instances"] == [cluster.targets[name]]
        assert h["scrape_interval_s"] == SCRAPE_INTERVAL_S
        # "as of": when Prometheus last scraped the host, within two intervals of the answer
        assert before - 2 * SCRAPE_INTERVAL_S - 0.5 <= h["as_of_s"] <= data["timestamp_s"]
    got = {name: h["devices"] for name, h in hosts.items()}
    for d in got["gpu-b"] + got["gpu-a"] + got["gpu-c"]:
        if d["power_w"] is not None and d["uuid"].startswith(("GPU-bbbb", "GPU-cccc")):
            d["power_w"] = None  # derived from utilisation by the simulator; not under test
    assert got == expected_hosts(cluster)
    # the ranking for 10G, by the local policy: gpu-b's GPU 2 is the least loaded that fits
    assert data["best"] == "gpu-b"
    assert [(r["hostname"], [c["label"] for c in r["chosen"]]) for r in data["ranking"]] == [
        ("gpu-b", ["GPU 2"]), ("gpu-c", ["GPU 1"]), ("dgx-d", ["GPU 1 MIG 1"]),
        ("gpu-a", ["GPU 0"]),
    ]


class TestPrometheusUnreachable:
    @pytest.fixture
    def jp_server_config(self, registry_dir: Path,
                         monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
        from tests.browserhelpers import free_port

        monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
        sampler_mod.stop_sampler()
        self.url = f"http://127.0.0.1:{free_port()}"
        yield {
            "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
            "AutoGPU": {"prometheus_url": self.url, "prometheus_timeout_s": 2.0},
        }
        sampler_mod.stop_sampler()

    async def test_the_answer_says_why(self, jp_fetch: Any) -> None:
        data = await get_cluster(jp_fetch)
        assert data["configured"] is True
        assert data["hosts"] == [] and data["best"] is None
        assert data["errors"] == [
            f"cannot reach Prometheus at {self.url}: [Errno 111] Connection refused"]


class TestNoPrometheus:
    @pytest.fixture
    def jp_server_config(self, registry_dir: Path,
                         monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
        monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
        monkeypatch.delenv("AUTOGPU_PROMETHEUS_URL", raising=False)
        sampler_mod.stop_sampler()
        yield {"ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}}}
        sampler_mod.stop_sampler()

    async def test_not_configured_is_an_empty_answer(self, jp_fetch: Any) -> None:
        data = await get_cluster(jp_fetch)
        assert (data["configured"], data["prometheus_url"], data["hosts"], data["errors"]) == (
            False, None, [], [])
        response = await jp_fetch("autogpu", "cluster", "history")
        history = json.loads(response.body)
        assert (history["configured"], history["hosts"], history["seconds"]) == (
            False, [], 86400)


async def test_cluster_endpoint_needs_a_token(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "cluster", headers={"Authorization": ""})
    assert err.value.code == 403


async def test_cluster_bad_min_free_is_400(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "cluster", params={"min_free": "10"})
    assert err.value.code == 400
    assert "10" in json.loads(err.value.response.body)["message"]


def test_hosts_cli_agrees_with_a_local_pick_on_each_host(cluster: Cluster) -> None:
    result = cluster.autogpu("gpu-a", "hosts", "--prometheus", cluster.url, "--min-free", "10G",
                             "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["best"] == "gpu-b"
    chosen = {h["hostname"]: [c["uuid"] for c in h["chosen"]] for h in data["hosts"]}
    for host in ("gpu-a", "gpu-b", "gpu-c"):
        local = cluster.autogpu(host, "pick", "--min-free", "10G", "--json")
        assert local.returncode == 0, local.stderr
        assert [d["uuid"] for d in json.loads(local.stdout)["chosen"]] == chosen[host], host
    # the plain text form, for people, and --best for scripts (srun --nodelist=...)
    text = cluster.autogpu("gpu-a", "hosts", "--prometheus", cluster.url, "--min-free", "10G")
    lines = text.stdout.splitlines()
    assert lines[0] == f"4 host(s) from {cluster.url}; for min free 10.0 GiB:"
    assert lines[1] == ("  1. gpu-b                ok    GPU 2 NVIDIA L4 "
                        "(22.0 GiB free, util 30%)")
    best = cluster.autogpu("gpu-a", "hosts", "--prometheus", cluster.url, "--min-free", "10G",
                           "--best")
    assert best.stdout == "gpu-b\n"
    none_fit = cluster.autogpu("gpu-a", "hosts", "--prometheus", cluster.url, "--min-free",
                               "100G", "--best")
    assert none_fit.returncode == 3
    assert none_fit.stderr.strip() == "autogpu: no host has a device for min free 100.0 GiB"


def test_hosts_cli_without_prometheus_says_how_to_set_it(cluster: Cluster) -> None:
    result = cluster.autogpu("gpu-a", "hosts")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "autogpu: no Prometheus to ask: pass --prometheus http://HOST:9090, or set "
        "c.AutoGPU.prometheus_url or $AUTOGPU_PROMETHEUS_URL")
    from tests.browserhelpers import free_port

    closed = f"http://127.0.0.1:{free_port()}"
    down = cluster.autogpu("gpu-a", "hosts", "--prometheus", closed)
    assert down.returncode == 1
    assert down.stderr.strip() == (
        f"autogpu: cannot reach Prometheus at {closed}: [Errno 111] Connection refused")
    bad = cluster.autogpu("gpu-a", "hosts", "--prometheus", "prometheus:9090")
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "autogpu: invalid Prometheus URL 'prometheus:9090': expected http://HOST:PORT or "
        "https://HOST/PATH, e.g. http://prometheus.example.org:9090")


async def test_cluster_history_from_range_queries(jp_fetch: Any, cluster: Cluster) -> None:
    """The last two minutes, at 120 points: each host's mean utilisation and memory taken over
    its GPUs, as Prometheus holds them (static loads, so every known point is the same)."""
    response = await jp_fetch("autogpu", "cluster", "history", params={"seconds": "120"})
    data = json.loads(response.body)
    assert data["configured"] is True
    assert data["errors"] == []
    assert data["seconds"] == 120
    assert data["step_s"] == 1.0
    hosts = {h["hostname"]: h for h in data["hosts"]}
    assert sorted(hosts) == ["dgx-d", "gpu-a", "gpu-b", "gpu-c"]
    expected = {
        # host: (source, mean util %, mean memory taken %)
        "gpu-a": ("autogpu", (70 + 10) / 2, (60 / 80 + 75 / 80) / 2 * 100),
        "gpu-b": ("autogpu", (50 + 5 + 30) / 3, (4 / 24 + 20 / 24 + 2 / 24) / 3 * 100),
        # gpu-c's GPU 0 has 30 GiB booked by the lease: used + booked
        "gpu-c": ("autogpu", (20 + 0) / 2, ((10 + 30) / 80 + 40 / 80) / 2 * 100),
        # DCGM: GPU 0's GPU_UTIL 90 %, the MIG instance's GR_ENGINE_ACTIVE 0.5
        "dgx-d": ("dcgm", (90 + 50) / 2,
                  (70000 / 81920 + 1000 / 40000) / 2 * 100),
    }
    for name, (source, util, mem) in expected.items():
        h = hosts[name]
        assert h["source"] == source
        assert len(h["timestamps_s"]) == len(h["utilization_pct"]) == 121
        known = [(u, m) for u, m in zip(h["utilization_pct"], h["memory_used_pct"])
                 if u is not None]
        assert known, name
        assert h["utilization_pct"][-1] is not None  # the newest step has data
        for u, m in known:
            assert u == pytest.approx(util), name
            assert m == pytest.approx(mem), name


async def test_cluster_history_bad_length_is_400(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "cluster", "history", params={"seconds": "1d"})
    assert err.value.code == 400
    assert json.loads(err.value.response.body)["message"] == (
        "invalid history length '1d': expected seconds, more than 0 and at most 2592000 "
        "(30 days), e.g. 86400 for a day")
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "cluster", "history", headers={"Authorization": ""})
    assert err.value.code == 403


def test_hosts_without_recent_samples_are_stale(cluster: Cluster) -> None:
    """Asked about a moment 30 s after the newest scrape (as when Prometheus stopped scraping
    while ``up`` still says 1), every host is stale, none is ranked."""
    from autogpu_jupyter.core.cluster import PrometheusClient, fetch_cluster, rank_hosts
    from autogpu_jupyter.core.policy import Constraints

    view = fetch_cluster(PrometheusClient(cluster.url), now_s=time.time() + 30)
    assert {h.hostname: h.state for h in view.hosts} == {
        "dgx-d": "stale", "gpu-a": "stale", "gpu-b": "stale", "gpu-c": "stale"}
    for h in view.hosts:
        assert h.note is not None
        assert re.fullmatch(r"newest sample (29|30|31) s old \(> 2 scrape intervals\)", h.note)
    choices = rank_hosts(view, Constraints.parse(min_free="10G"))
    assert [c.fits for c in choices] == [False] * 4


def test_grafana_dashboard_queries_run_on_prometheus(cluster: Cluster) -> None:
    """Every query of docs/grafana-autogpu.json is valid PromQL and finds series here."""
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-autogpu.json")
                           .read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) == 12
    for expr in exprs:
        result = cluster.query(expr.replace("$hostname", ".*"))
        assert result, expr
    # the DCGM-only utilisation query shows the DCGM host's GPU, not autogpu's
    dcgm = cluster.query(dashboard["panels"][0]["targets"][1]["expr"].replace("$hostname", ".*"))
    assert [(r["metric"]["Hostname"], r["value"][1]) for r in dcgm] == [("dgx-d", "0.9")]


async def test_stopped_exporter_is_marked_down_within_two_scrapes(
    jp_fetch: Any, cluster: Cluster
) -> None:
    """Runs last in this module: it stops host gpu-a's exporter."""
    proc = cluster.exporters["gpu-a"]
    last_sweep = (await get_cluster(jp_fetch))
    assert {h["hostname"]: h["state"] for h in last_sweep["hosts"]}["gpu-a"] == "ok"
    proc.terminate()
    proc.wait(10)
    stopped = time.monotonic()
    deadline = stopped + 10 * SCRAPE_INTERVAL_S
    while True:
        data = await get_cluster(jp_fetch, min_free="10G")
        gpu_a = next(h for h in data["hosts"] if h["hostname"] == "gpu-a")
        if gpu_a["state"] == "down":
            took = time.monotonic() - stopped
            break
        assert time.monotonic() < deadline, gpu_a
        time.sleep(0.1)
    assert took <= 2 * SCRAPE_INTERVAL_S + 0.5, took
    assert gpu_a["note"] == "exporter down (up == 0)"
    assert gpu_a["devices"] == []
    # "as of": the last sweep Prometheus got from it, still known
    assert gpu_a["as_of_s"] is not None and gpu_a["as_of_s"] <= time.time() - took + 1
    others = {h["hostname"]: h["state"] for h in data["hosts"] if h["hostname"] != "gpu-a"}
    assert others == {"dgx-d": "ok", "gpu-b": "ok", "gpu-c": "ok"}
    assert [r["hostname"] for r in data["ranking"]] == ["gpu-b", "gpu-c", "dgx-d", "gpu-a"]
    assert data["ranking"][-1]["fits"] is False
