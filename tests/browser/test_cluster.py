"""The sidebar's Cluster section in a real browser: ``jupyter lab`` (on the fake NVIDIA driver)
with ``AUTOGPU_PROMETHEUS_URL`` pointing at a real Prometheus that scrapes three emulated hosts
and a DCGM-format endpoint (``tests/clusterhelpers.py``). Screenshots land in ``test-artifacts/``.
"""

from __future__ import annotations

import getpass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import browserhelpers as browser
from tests.clusterhelpers import Cluster, prometheus_cluster

pytestmark = [pytest.mark.browser, pytest.mark.cluster, pytest.mark.slow]

FLEET: dict[str, Any] = {"devices": [
    {"name": "NVIDIA L4", "uuid": "GPU-1b1b1b1b-1111-2222-3333-444444444444",
     "pci_bus_id": "00000000:17:00.0", "memory_total": "24G", "memory_used": "1G",
     "utilization_pct": 5, "processes": []},
]}
NOTEBOOK = {
    "cells": [],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with prometheus_cluster(tmp_path / "cluster") as running:
        yield running


@pytest.fixture
def lab(fake_nvml: Any, tmp_path: Path, cluster: Cluster,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[browser.Lab]:
    monkeypatch.setenv("AUTOGPU_PROMETHEUS_URL", cluster.url)
    with browser.autogpu_lab(
        tmp_path, fake_nvml, FLEET, NOTEBOOK, token="autogpu-cluster-test",
        log_artifact="cluster-lab.log",
    ) as server:
        yield server


def test_cluster_section_shows_every_host_and_a_host_going_down(
    lab: browser.Lab, cluster: Cluster
) -> None:
    with browser.chromium_page(height=1400) as page:
        with browser.screenshot_on_failure(page, "cluster-failure.png", full_page=True):
            _drive(page, lab, cluster)


def _drive(page: Any, lab: browser.Lab, cluster: Cluster) -> None:
    from playwright.sync_api import expect

    lab.open(page, "train.ipynb")
    page.locator(".jp-Notebook").wait_for(timeout=60_000)
    page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
    section = page.locator(".jp-AutoGPU-cluster")
    hosts = section.locator(".jp-AutoGPU-host")
    hosts.nth(3).wait_for(timeout=30_000)
    assert section.locator(".jp-AutoGPU-clusterSource").inner_text() == f"from {cluster.url}"
    assert section.locator(".jp-AutoGPU-clusterAdvice").inner_text() == (
        "best host for min free 10.0 GiB: gpu-b (GPU 2)")
    # best first, as the server ranked them with the local pick's policy
    assert section.locator(".jp-AutoGPU-hostName").all_inner_texts() == [
        "gpu-b", "gpu-c", "dgx-d", "gpu-a"]
    gpu_b = section.locator('.jp-AutoGPU-host[data-hostname="gpu-b"]')
    assert gpu_b.locator(".jp-AutoGPU-best").inner_text().lower() == "best"
    assert gpu_b.locator(".jp-AutoGPU-asOf").inner_text().startswith("as of ")
    rows = [[s.strip() for s in li.locator("span").all_inner_texts()]
            for li in gpu_b.locator(".jp-AutoGPU-hostGpu").all()]
    assert rows == [
        ["GPU 0", "NVIDIA L4", "50%", "4.0 GiB / 24.0 GiB"],
        ["GPU 1", "NVIDIA L4", "5%", "20.0 GiB / 24.0 GiB"],
        ["GPU 2", "NVIDIA L4", "30%", "2.0 GiB / 24.0 GiB"],
        ["GPU 3", "NVIDIA L4", "lost", ""],
    ]
    gpu_c0 = section.locator('.jp-AutoGPU-host[data-hostname="gpu-c"] .jp-AutoGPU-hostGpu').first
    assert gpu_c0.locator(".jp-AutoGPU-hostMem").inner_text() == (
        "10.0 GiB / 80.0 GiB + 30.0 GiB booked")
    assert gpu_c0.locator(".jp-AutoGPU-hostHolders").inner_text() == getpass.getuser()
    dgx = section.locator('.jp-AutoGPU-host[data-hostname="dgx-d"]')
    assert dgx.locator(".jp-AutoGPU-source").all_inner_texts() == ["DCGM", "DCGM"] or (
        dgx.locator(".jp-AutoGPU-source").all_inner_texts() == ["dcgm", "dcgm"])
    assert dgx.locator(".jp-AutoGPU-label").all_inner_texts() == ["GPU 0", "GPU 1 MIG 1"]
    # the last day from Prometheus range queries: mean utilisation of the host's GPUs
    assert gpu_b.locator(".jp-AutoGPU-hostHistoryText").inner_text() == (
        "last 24 h: util mean 28%, max 28%")
    assert dgx.locator(".jp-AutoGPU-hostHistoryText").inner_text() == (
        "last 24 h: util mean 70%, max 70%")
    browser.screenshot(section, "sidebar-cluster.png")

    # stop host gpu-a's exporter: the section marks it down (it refreshes every 5 s at most)
    cluster.exporters["gpu-a"].terminate()
    cluster.exporters["gpu-a"].wait(10)
    gpu_a = section.locator('.jp-AutoGPU-host[data-hostname="gpu-a"]')
    expect(gpu_a.locator(".jp-AutoGPU-hostState")).to_have_text("down", ignore_case=True,
                                                               timeout=30_000)
    assert gpu_a.locator(".jp-AutoGPU-hostNote").inner_text() == "exporter down (up == 0)"
    assert gpu_a.locator(".jp-AutoGPU-hostGpu").count() == 0
    browser.screenshot(section, "sidebar-cluster-host-down.png")
