"""The sidebar's move button in a real browser: ``jupyter lab`` on the fake NVIDIA driver with the
autogpu kernelspec, driven by Playwright through Debian's Chromium. Screenshots land in
``test-artifacts/`` (``move-*.png``).

Needs the built lab extension (``jlpm build`` in ``labextension/``); skipped, saying so, without
it or without Chromium (in CI a skip fails: see ``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leases import Registry
from tests.test_sidebar_browser import ARTIFACTS, BUILT, CHROMIUM, CHROMIUM_ARGS, ROOT, _free_port

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


def _artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


@pytest.fixture
def lab(fake_nvml: Any, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """``jupyter lab`` with the autogpu kernelspec (min free 10G) on the fake fleet."""
    if not (BUILT / "package.json").is_file():
        pytest.skip("lab extension not built: run `jlpm build` in labextension/")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")
    fake_nvml.write(FLEET)
    root = tmp_path / "root"
    root.mkdir()
    (root / "train.ipynb").write_text(json.dumps(NOTEBOOK))
    data = tmp_path / "data"
    (data / "labextensions").mkdir(parents=True)
    (data / "labextensions" / "autogpu-jupyter").symlink_to(BUILT)
    spec_dir = data / "kernels" / SPEC
    spec_dir.mkdir(parents=True)
    spec = kernelspec.spec_dict("Python 3 (autogpu)", {"min_free": "10G"})
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    settings = tmp_path / "app-settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(
        json.dumps({"autogpu-jupyter:plugin": {"refreshInterval": 1},
                    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}})
    )
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    registry = tmp_path / "registry"
    port = _free_port()
    token = "autogpu-move-test"
    env = {
        **os.environ, **fake_nvml.env,
        "AUTOGPU_REGISTRY_DIR": str(registry),
        "JUPYTER_PATH": str(data),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "PYTHONPATH": str(ROOT),
    }
    for var in ("AUTOGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_MIN_FREE"):
        env.pop(var, None)
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
        yield {"url": url, "token": token, "registry": Registry(str(registry))}
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.copy(tmp_path / "lab.log", _artifacts() / "move-lab.log")


def _card(page: Any, label: str) -> Any:
    return page.locator(".jp-AutoGPU-card", has=page.locator(".jp-AutoGPU-label",
                                                            has_text=label))


def test_move_button_restarts_the_notebook_kernel_on_another_gpu(lab: dict[str, Any]) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            try:
                _drive(page, lab)
            except Exception:
                page.screenshot(path=str(_artifacts() / "move-failure.png"))
                raise
        finally:
            browser.close()


def _run_cell(page: Any) -> None:
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.keyboard.press("Shift+Enter")


def _drive(page: Any, lab: dict[str, Any]) -> None:
    from playwright.sync_api import expect

    page.goto(f"{lab['url']}/lab/tree/train.ipynb?token={lab['token']}")
    page.locator(".jp-Notebook").wait_for(timeout=60_000)
    page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
    gpu0, gpu1 = _card(page, "GPU 0"), _card(page, "GPU 1")

    # The provisioner put the notebook's kernel on GPU 0 (idle, most free): its card shows the
    # notebook as current holder and the "Move to best GPU" button; other live cards "Move here".
    expect(gpu0.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
        "train.ipynb", timeout=60_000)
    expect(gpu0.locator(".jp-AutoGPU-move")).to_have_text("Move to best GPU")
    expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move here")
    assert _card(page, "GPU 3").locator(".jp-AutoGPU-move").count() == 0  # lost
    # The recommendation does not count the notebook's own lease: GPU 0 stays best for it.
    expect(page.locator(".jp-AutoGPU-advice")).to_have_text("best device for 10.0 GiB: GPU 0")
    _run_cell(page)
    output = page.locator(".jp-OutputArea-output").first
    expect(output).to_contain_text(UUID0, timeout=60_000)
    page.screenshot(path=str(_artifacts() / "move-before.png"))

    # Click, read the plan in the dialog, accept.
    gpu0.locator(".jp-AutoGPU-move").click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog.locator(".jp-AutoGPU-movePlan")).to_have_text(
        "The kernel will restart on GPU 1 (NVIDIA L4, 23.0 GiB free), the best other device now. "
        "Restarting loses the kernel's state (variables, imports, data in memory): save what "
        "you need first.", timeout=30_000)
    expect(dialog.locator(".jp-AutoGPU-moveWarning")).to_have_text(
        "Variables, imports and data in memory of train.ipynb are lost; the outputs already in "
        "the notebook stay.")
    page.screenshot(path=str(_artifacts() / "move-dialog.png"))
    dialog.get_by_role("button", name="Restart on GPU 1").click()

    # The kernel restarted on GPU 1: the panel says so, and the notebook holds GPU 1 now.
    expect(page.locator(".jp-AutoGPU-moveMessage")).to_have_text(
        "The kernel restarted on GPU 1; its state (variables) was lost.", timeout=60_000)
    expect(gpu1.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
        "train.ipynb", timeout=30_000)
    expect(gpu0.locator(".jp-AutoGPU-holder-current")).to_have_count(0)
    expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move to best GPU")
    expect(gpu0.locator(".jp-AutoGPU-move")).to_have_text("Move here")
    (lease,) = lab["registry"].list_leases()
    assert lease.device_uuids == (UUID1,)
    assert proc_env(lease.pid)["CUDA_VISIBLE_DEVICES"] == UUID1
    # Running the cell again in the restarted kernel shows the new device.
    _run_cell(page)
    expect(output).to_contain_text(UUID1, timeout=60_000)
    page.screenshot(path=str(_artifacts() / "move-after.png"))
    page.locator("#jp-AutoGPU-panel").screenshot(path=str(_artifacts() / "move-panel.png"))
