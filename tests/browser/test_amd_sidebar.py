"""The JupyterLab sidebar in a real browser on an AMD host: ``jupyter lab`` and its kernels find
AMD's library by themselves (only the fake ``libamd_smi.so`` on their library path, no
``AUTOGPU_BACKEND``) and read it through the real ``amdsmi`` binding; Playwright drives Debian's
Chromium. The sidebar's code is the NVIDIA one: an AMD fleet just renders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import browserhelpers as browser
from tests.fakeamdsmi import FakeAmdSmi, amd_uuid, default_rocr_uuid

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FLEET: dict[str, Any] = {
    "driver_version": "6.10.5",
    "devices": [
        {"name": "AMD Instinct MI300X", "uuid": amd_uuid(0), "pci_bus_id": "0000:05:00.0",
         "memory_total": "192G", "memory_used": "150G", "utilization_pct": 91,
         "temperature_c": 71, "power_w": 690, "power_limit_w": 750,
         "processes": [{"pid": 4242, "used_memory": "150G"}]},
        {"name": "AMD Instinct MI300X", "uuid": amd_uuid(1), "pci_bus_id": "0000:25:00.0",
         "memory_total": "192G", "memory_used": "2G", "utilization_pct": 3,
         "temperature_c": 38, "power_w": 140, "power_limit_w": 750, "processes": []},
        {"name": "AMD Instinct MI300X", "uuid": amd_uuid(2), "pci_bus_id": "0000:45:00.0",
         "compute_partition": "CPX", "partition_id": 5, "memory_total": "24G",
         "memory_used": "1G", "utilization_pct": 0, "power_limit_w": 750, "processes": []},
        {"name": "AMD Instinct MI210", "uuid": amd_uuid(3), "pci_bus_id": "0000:65:00.0",
         "lost": True},
    ],
}

NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
               "outputs": [], "source": ["%load_ext autogpu\n", "%gpu pick --min-free 10G"]}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


@pytest.fixture
def lab(fake_amdsmi: FakeAmdSmi, tmp_path: Path) -> Iterator[browser.Lab]:
    with browser.autogpu_lab(
        tmp_path, fake_amdsmi, FLEET, NOTEBOOK, token="autogpu-amd-browser-test",
        log_artifact="amd-sidebar-lab.log",
        unset=("AUTOGPU_SIMULATE", "AUTOGPU_BACKEND", "FAKE_NVML_SCENARIO"),
    ) as server:
        yield server


def test_sidebar_shows_an_amd_fleet_and_the_notebooks_pick(lab: browser.Lab) -> None:
    with browser.chromium_page() as page, browser.screenshot_on_failure(
        page, "amd-sidebar-failure.png"
    ):
        lab.open(page, "train.ipynb")
        page.locator(".jp-Notebook").wait_for(timeout=60_000)
        page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
        cards = page.locator(".jp-AutoGPU-card")
        cards.nth(3).wait_for(timeout=30_000)
        assert cards.count() == 4
        assert page.locator(".jp-AutoGPU-label").all_inner_texts() == [
            "GPU 0", "GPU 1", "GPU 2", "GPU 3"]
        assert page.locator(".jp-AutoGPU-name").all_inner_texts() == [
            "AMD Instinct MI300X", "AMD Instinct MI300X", "AMD Instinct MI300X (CPX 5, NPS1)",
            "unknown"]
        gpu0 = browser.card(page, "GPU 0")
        assert gpu0.locator(".jp-AutoGPU-util .jp-AutoGPU-metricValue").inner_text() == "91%"
        assert gpu0.locator(".jp-AutoGPU-mem .jp-AutoGPU-metricValue").inner_text() == (
            "150.0 GiB / 192.0 GiB")
        assert gpu0.locator(".jp-AutoGPU-thermals").inner_text() == "71 °C · 690 W / 750 W"
        # a partition has no utilisation of its own: shown as unknown, never 0 %
        part = browser.card(page, "GPU 2")
        assert part.locator(".jp-AutoGPU-mem .jp-AutoGPU-metricValue").inner_text() == (
            "1.0 GiB / 24.0 GiB")
        assert browser.card(page, "GPU 3").locator(".jp-AutoGPU-lostNote").inner_text() == (
            "lost: amdsmi error: AMDSMI_STATUS_IO")
        page.locator(".jp-AutoGPU-advice", has_text="best device").wait_for()
        assert page.locator(".jp-AutoGPU-advice").inner_text() == (
            "best device for 10.0 GiB: GPU\u00a01")
        browser.screenshot(page, "amd-sidebar-fleet.png")

        # %gpu pick in the notebook's kernel (which finds amdsmi by itself too)
        browser.run_first_cell(page)
        page.locator(".jp-OutputArea-output").first.wait_for(timeout=60_000)
        page.locator(".jp-AutoGPU-holder-current").wait_for(timeout=30_000)
        gpu1 = browser.card(page, "GPU 1")
        assert gpu1.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what").inner_text() == (
            "train.ipynb")
        output = page.locator(".jp-OutputArea-output").first.inner_text()
        # ROCr's UUID of GPU 1 (the fake derives it from the amd-smi UUID), HIP's device 0
        assert output.splitlines()[-1] == (
            f"  ROCR_VISIBLE_DEVICES={default_rocr_uuid(amd_uuid(1))} HIP_VISIBLE_DEVICES=0")
        browser.screenshot(page, "amd-sidebar-holder.png")
