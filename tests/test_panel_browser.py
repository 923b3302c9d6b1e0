"""A real JupyterLab and a real browser (Debian's Chromium through Playwright).

JupyterLab serves a copy of ``notebooks/panel.ipynb`` with ``AUTOGPU_SIMULATE`` pointing at
``notebooks/panel-fleet.json``; the test runs all cells and checks the rendered panel: a chart per
device, this kernel's device marked, the "simulated" badge and the overload banner. Screenshots
(light and dark theme) go to ``test-artifacts/``.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    root = tmp_path_factory.mktemp("lab")
    shutil.copy(REPO / "notebooks" / "panel.ipynb", root / "panel.ipynb")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID"):
        env.pop(name, None)
    env.update(
        {
            "AUTOGPU_SIMULATE": str(REPO / "notebooks" / "panel-fleet.json"),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            "JUPYTER_CONFIG_DIR": str(root / "config"),
            "JUPYTERLAB_SETTINGS_DIR": str(root / "settings"),
            "JUPYTERLAB_WORKSPACES_DIR": str(root / "workspaces"),
        }
    )
    news = root / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    log = (root / "lab.log").open("w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            f"--port={port}",
            "--ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail("jupyter lab exited:\n" + (root / "lab.log").read_text())
                time.sleep(0.1)
        yield f"{base}/lab/tree/panel.ipynb?token={token}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _menu(page: object, top: str, *items: str) -> None:
    page.click(f'.lm-MenuBar-itemLabel:text-is("{top}")')  # type: ignore[attr-defined]
    for item in items:
        page.click(f'.lm-Menu-itemLabel:text-is("{item}")')  # type: ignore[attr-defined]


def test_panel_renders_charts_and_warning_in_jupyterlab(lab: str) -> None:
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(lab)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            page.wait_for_selector(
                '.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=90_000
            )
            # the indicator says idle before the kernel connection is up: wait for the kernel name
            page.wait_for_selector('.jp-Toolbar-kernelName:has-text("Python 3")', timeout=90_000)
            _menu(page, "Run", "Run All Cells")
            try:
                page.wait_for_selector(".autogpu-banner", timeout=90_000)
            except Exception:
                page.screenshot(path=str(ARTIFACTS / "panel-failure.png"), full_page=True)
                raise
            page.wait_for_function(
                "document.querySelectorAll('svg.autogpu-chart').length === 4", timeout=60_000
            )
            charts = page.locator("svg.autogpu-chart")
            assert charts.count() == 4
            kernel_charts = page.locator('svg.autogpu-chart[data-kernel="1"]')
            assert kernel_charts.count() == 1
            assert kernel_charts.get_attribute("data-uuid") == (
                "GPU-50000001-d3mo-4x01-a100-000000000001"
            )
            banner = page.locator(".autogpu-banner").inner_text()
            assert "GPU 1 (this kernel's GPU) is overloaded" in banner
            assert "caused by 2 other processes holding" in banner
            assert "(users bob, carol)" in banner
            # the demo's load moves, so the best alternative may change; never the busy GPU 1
            assert re.search(r"Best alternative: GPU [023] \(", banner)
            assert "restart the kernel and run %gpu pick" in banner
            assert page.locator(".autogpu-simulated").first.inner_text() == "simulated"
            assert (
                "This kernel: GPU 1 · NVIDIA A100-SXM4-80GB"
                in page.locator(".autogpu-header").first.inner_text()
            )
            # the text cell below prints the same warning
            assert page.get_by_text("autogpu: GPU 1 (this kernel's GPU) is overloaded").count() >= 1
            page.wait_for_timeout(2500)  # let a few samples draw lines before the picture
            page.locator(".autogpu-panel").first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "panel-light.png"), full_page=True)
            page.locator(".autogpu-panel").first.screenshot(
                path=str(ARTIFACTS / "panel-light-widget.png")
            )

            _menu(page, "Settings", "Theme", "JupyterLab Dark")
            page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
            page.wait_for_timeout(1000)
            color = page.evaluate(
                "getComputedStyle(document.querySelector('.autogpu-header')).color"
            )
            assert color != "rgb(31, 31, 31)"  # the theme's font colour, not the light fallback
            page.locator(".autogpu-panel").first.screenshot(
                path=str(ARTIFACTS / "panel-dark-widget.png")
            )
        finally:
            browser.close()
