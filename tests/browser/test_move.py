"""The sidebar's move button in a real browser: ``jupyter lab`` on the fake NVIDIA driver with the
autogpu kernelspec, driven by Playwright through Debian's Chromium. Screenshots land in
``test-artifacts/`` (``move-*.png``).

Needs the built lab extension (``jlpm build`` in ``labextension/``); skipped, saying so, without
it or without Chromium (in CI a skip fails: see ``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leasing import Registry
from tests import browserhelpers as browser
from tests.kernelhelpers import kernel_environ

pytestmark = [pytest.mark.browser, pytest.mark.slow]

UUID0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
UUID1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
UUID2 = "GPU-3d3d3d3d-1111-2222-3333-444444444444"
SPEC = "python3-autogpu"

FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": UUID0, "pci_bus_id": "00000000:07:00.0",
         "memory_total": "80G", "memory_used": "0G", "utilization_pct": 0, "temperature_c": 35,
         "power_w": 60, "power_limit_w": 400, "processes": []},
        {"name": "NVIDIA L4", "uuid": UUID1, "pci_bus_id": "00000000:17:00.0",
         "memory_total": "24G", "memory_used": "1G", "utilization_pct": 5, "temperature_c": 38,
         "power_w": 20, "power_limit_w": 72, "processes": []},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": UUID2, "pci_bus_id": "00000000:37:00.0",
         "memory_total": "80G", "memory_used": "70G", "utilization_pct": 92,
         "temperature_c": 74, "power_w": 610, "power_limit_w": 700,
         "processes": [{"pid": 4343, "used_memory": "70G"}]},
        {"name": "NVIDIA L4", "uuid": "GPU-2c2c2c2c-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:27:00.0", "lost": True},
    ],
}

NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
               "outputs": [],
               "source": ["import os\n", "print(os.environ['CUDA_VISIBLE_DEVICES'])"]}],
    "metadata": {"kernelspec": {"display_name": "Python 3 (autogpu)", "language": "python",
                                "name": SPEC}},
    "nbformat": 4, "nbformat_minor": 5,
}



@pytest.fixture
def lab(fake_nvml: Any, tmp_path: Path) -> Iterator[browser.Lab]:
    """``jupyter lab`` with the autogpu kernelspec (min free 10G) on the fake fleet."""
    with browser.autogpu_lab(
        tmp_path, fake_nvml, FLEET, NOTEBOOK, token="autogpu-move-test",
        log_artifact="move-lab.log",
        kernelspecs={SPEC: kernelspec.spec_dict("Python 3 (autogpu)", {"min_free": "10G"})},
        unset=("AUTOGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_MIN_FREE"),
    ) as server:
        yield server


def test_move_button_restarts_the_notebook_kernel_on_another_gpu(lab: browser.Lab) -> None:
    with browser.chromium_page() as page:
        with browser.screenshot_on_failure(page, "move-failure.png"):
            _drive(page, lab)


def _drive(page: Any, lab: browser.Lab) -> None:
    from playwright.sync_api import expect

    lab.open(page, "train.ipynb")
    page.locator(".jp-Notebook").wait_for(timeout=60_000)
    page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
    gpu0, gpu1 = browser.card(page, "GPU 0"), browser.card(page, "GPU 1")

    # The provisioner put the notebook's kernel on GPU 0 (idle, most free): its card shows the
    # notebook as current holder and the "Move to best GPU" button; other live cards "Move here".
    expect(gpu0.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
        "train.ipynb", timeout=60_000)
    expect(gpu0.locator(".jp-AutoGPU-move")).to_have_text("Move to best GPU")
    expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move here")
    assert browser.card(page, "GPU 3").locator(".jp-AutoGPU-move").count() == 0  # lost
    # The recommendation does not count the notebook's own lease: GPU 0 stays best for it, and
    # it says the notebook is already there (one decision, said the same way everywhere).
    expect(page.locator(".jp-AutoGPU-advice")).to_have_text(
        "you are already on the best device for 10.0 GiB: GPU 0"
    )
    browser.run_first_cell(page)
    output = page.locator(".jp-OutputArea-output").first
    expect(output).to_contain_text(UUID0, timeout=60_000)
    browser.screenshot(page, "move-before.png")

    # Click, read the plan in the dialog, accept.
    gpu0.locator(".jp-AutoGPU-move").click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog.locator(".jp-AutoGPU-movePlan")).to_have_text(
        "The kernel will restart on GPU 1 (NVIDIA L4, 23.0 GiB free), the best other device now. "
        "Restarting loses the kernel's state (variables, imports, data in memory): save what "
        "you need first.", timeout=30_000)
    # the plan says once that the state is lost; the second line only what stays
    expect(dialog.locator(".jp-AutoGPU-moveWarning")).to_have_text(
        "The outputs already in train.ipynb stay.")
    assert dialog.inner_text().count("lost") + dialog.inner_text().count("loses") == 1
    browser.screenshot(page, "move-dialog.png")
    dialog.get_by_role("button", name="Restart on GPU 1").click()

    # The kernel restarted on GPU 1: the panel says so, and the notebook holds GPU 1 now.
    expect(page.locator(".jp-AutoGPU-moveMessage")).to_have_text(
        "The kernel restarted on GPU 1; its state (variables) was lost.", timeout=60_000)
    expect(gpu1.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
        "train.ipynb", timeout=30_000)
    expect(gpu0.locator(".jp-AutoGPU-holder-current")).to_have_count(0)
    expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move to best GPU")
    expect(gpu0.locator(".jp-AutoGPU-move")).to_have_text("Move here")
    (lease,) = Registry(str(lab.registry_dir)).list_leases()
    assert lease.device_uuids == (UUID1,)
    assert kernel_environ(lease.pid)["CUDA_VISIBLE_DEVICES"] == UUID1
    # Running the cell again in the restarted kernel shows the new device.
    browser.run_first_cell(page)
    expect(output).to_contain_text(UUID1, timeout=60_000)
    browser.screenshot(page, "move-after.png")
    browser.screenshot(page.locator("#jp-AutoGPU-panel"), "move-panel.png")
