"""The JupyterLab sidebar in a real browser: ``jupyter lab`` on the fake NVIDIA driver, driven by
Playwright through Debian's Chromium. Screenshots land in ``test-artifacts/``.

Needs the built lab extension (``autogpu_jupyter/labextension``, from ``jlpm build:prod`` in
``labextension/`` or ``pip install .``); skipped, saying so, without it or without Chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
BUILT = ROOT / "autogpu_jupyter" / "labextension"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
]
GiB = 1024**3

FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0a0a0a0a-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:07:00.0", "memory_total": "80G", "memory_used": "20G",
         "utilization_pct": 35, "temperature_c": 51, "power_w": 210, "power_limit_w": 400,
         "processes": [{"pid": 4242, "used_memory": "20G"}]},
        {"name": "NVIDIA L4", "uuid": "GPU-1b1b1b1b-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:17:00.0", "memory_total": "24G", "memory_used": "1G",
         "utilization_pct": 40, "temperature_c": 38, "power_w": 20, "power_limit_w": 72,
         "processes": []},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-3d3d3d3d-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:37:00.0", "memory_total": "80G", "memory_used": "70G",
         "utilization_pct": 92, "temperature_c": 74, "power_w": 610, "power_limit_w": 700,
         "processes": [{"pid": 4343, "used_memory": "70G"}]},
        {"name": "NVIDIA L4", "uuid": "GPU-2c2c2c2c-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:27:00.0", "lost": True},
    ],
}

NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
               "outputs": [], "source": ["%load_ext autogpu\n", "%gpu pick --min-free 10G"]}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def lab(fake_nvml: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``jupyter lab`` as a subprocess on the fake fleet; yields its URL, token and root dir."""
    if not (BUILT / "package.json").is_file():
        pytest.skip("lab extension not built: run `jlpm build:prod` in labextension/")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    fake_nvml.write(FLEET)
    root = tmp_path / "root"
    root.mkdir()
    (root / "train.ipynb").write_text(json.dumps(NOTEBOOK))
    data = tmp_path / "data"
    (data / "labextensions").mkdir(parents=True)
    (data / "labextensions" / "autogpu-jupyter").symlink_to(BUILT)
    settings = tmp_path / "app-settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(
        json.dumps({"autogpu-jupyter:plugin": {"refreshInterval": 1},
                    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}})
    )
    port = _free_port()
    token = "autogpu-browser-test"
    env = {
        **os.environ, **fake_nvml.env,
        "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry"),
        "JUPYTER_PATH": str(data),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "PYTHONPATH": str(ROOT),
    }
    env.pop("AUTOGPU_SIMULATE", None)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", f"--LabApp.app_settings_dir={settings}",
         "--ServerApp.jpserver_extensions={'autogpu_jupyter': True}",
         "--AutoGPUServer.interval_s=0.5", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.flush()
                    pytest.fail("jupyter lab did not start:\n"
                                + (tmp_path / "lab.log").read_text()[-3000:])
                time.sleep(0.3)
        yield {"url": url, "token": token, "root": root, "fake": fake_nvml,
               "log": tmp_path / "lab.log"}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.copy(tmp_path / "lab.log", _artifacts() / "sidebar-lab.log")


def _artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def _card(page: Any, label: str) -> Any:
    return page.locator(".jp-AutoGPU-card", has=page.locator(".jp-AutoGPU-label",
                                                            has_text=label))


def test_sidebar_shows_fleet_holder_and_updates(lab: dict[str, Any]) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            try:
                _drive(page, lab)
            except Exception:
                page.screenshot(path=str(_artifacts() / "sidebar-failure.png"))
                raise
        finally:
            browser.close()


def _drive(page: Any, lab: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    if True:
        if True:
            page.goto(f"{lab['url']}/lab/tree/train.ipynb?token={lab['token']}")
            page.locator(".jp-Notebook").wait_for(timeout=60_000)
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
            cards = page.locator(".jp-AutoGPU-card")
            cards.nth(3).wait_for(timeout=30_000)

            # one card per device, with the names and numbers of the fleet
            assert cards.count() == 4
            assert page.locator(".jp-AutoGPU-label").all_inner_texts() == [
                "GPU 0", "GPU 1", "GPU 2", "GPU 3"]
            assert page.locator(".jp-AutoGPU-name").all_inner_texts() == [
                "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA H100 80GB HBM3", "unknown"]
            gpu0 = _card(page, "GPU 0")
            assert gpu0.locator(".jp-AutoGPU-util .jp-AutoGPU-metricValue").inner_text() == "35%"
            assert gpu0.locator(".jp-AutoGPU-mem .jp-AutoGPU-metricValue").inner_text() == (
                "20.0 GiB / 80.0 GiB")
            assert gpu0.locator(".jp-AutoGPU-thermals").inner_text() == "51 °C · 210 W / 400 W"
            assert _card(page, "GPU 3").locator(".jp-AutoGPU-lostNote").inner_text() == (
                "lost: GPU is lost")
            # the recommendation for the open notebook, from the server's dry run
            page.locator(".jp-AutoGPU-advice", has_text="best device").wait_for()
            assert page.locator(".jp-AutoGPU-advice").inner_text() == (
                "best device for 10.0 GiB: GPU 0")
            assert page.locator(".jp-AutoGPU-notebook").inner_text() == "train.ipynb"
            page.screenshot(path=str(_artifacts() / "sidebar-fleet.png"))

            # %gpu pick in the notebook: the notebook shows as holder of the chosen GPU
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Shift+Enter")
            output = page.locator(".jp-OutputArea-output").first
            output.wait_for(timeout=60_000)
            holder = page.locator(".jp-AutoGPU-holder-current")
            holder.wait_for(timeout=30_000)
            assert gpu0.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what").inner_text() == (
                "train.ipynb")
            assert "10.0 GiB booked" in gpu0.locator(
                ".jp-AutoGPU-holder-current .jp-AutoGPU-holderMem").inner_text()
            page.screenshot(path=str(_artifacts() / "sidebar-holder.png"))

            # load changes in the fake driver: the card follows
            changed = json.loads(json.dumps(FLEET))
            changed["devices"][1]["utilization_pct"] = 97
            changed["devices"][1]["memory_used"] = "22G"
            lab["fake"].write(changed)
            gpu1 = _card(page, "GPU 1")
            # cards are re-rendered on each refresh: expect() re-resolves the locator
            expect(gpu1.locator(".jp-AutoGPU-util .jp-AutoGPU-metricValue")).to_have_text(
                "97%", timeout=30_000)
            expect(gpu1.locator(".jp-AutoGPU-mem .jp-AutoGPU-metricValue")).to_have_text(
                "22.0 GiB / 24.0 GiB")
            page.screenshot(path=str(_artifacts() / "sidebar-load-change.png"))
            sidebar = page.locator("#jp-AutoGPU-panel")
            sidebar.screenshot(path=str(_artifacts() / "sidebar-panel.png"))
