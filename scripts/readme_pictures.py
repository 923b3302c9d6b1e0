"""Regenerate the README's pictures (docs/img/panel.png, docs/img/sidebar.png) with history.

Runs JupyterLab on the simulated fleet demo-4x (what ``make lab`` shows without a GPU), lets the
server's sampler collect a few minutes of moving load first, so that the sidebar's sparklines
and the panel's charts show realistic history rather than a few samples at the right edge,
then drives Debian's Chromium through Playwright:

    .venv/bin/python scripts/readme_pictures.py            # about 4 minutes

A notebook ``train.ipynb`` picks a GPU (the sidebar shows it as holder of its card);
``notebooks/panel.ipynb`` shows the panel with the overload banner.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
WARMUP_S = float(os.environ.get("README_PICTURES_WARMUP_S", "150"))
PANEL_WINDOW_S = 60


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    from playwright.sync_api import sync_playwright

    tmp = Path(tempfile.mkdtemp(prefix="autogpu-pictures-"))
    root = tmp / "root"
    root.mkdir()
    shutil.copy(ROOT / "notebooks" / "panel.ipynb", root / "panel.ipynb")
    (root / "train.ipynb").write_text(json.dumps({
        "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
                   "outputs": [], "source": ["%load_ext autogpu\n", "%gpu pick --min-free 10G"]}],
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                    "name": "python3"}},
        "nbformat": 4, "nbformat_minor": 5,
    }))
    settings = tmp / "settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(json.dumps({
        "autogpu-jupyter:plugin": {"refreshInterval": 1, "historyPoints": 150},
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
    }))
    port, token = _port(), secrets.token_hex(16)
    env = {**os.environ, "AUTOGPU_SIMULATE": "demo-4x",
           "AUTOGPU_REGISTRY_DIR": str(tmp / "registry"),
           "JUPYTER_CONFIG_DIR": str(tmp / "config"), "IPYTHONDIR": str(tmp / "ipython")}
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID"):
        env.pop(name, None)
    log = (tmp / "lab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}", f"--LabApp.app_settings_dir={settings}",
         "--LabApp.news_url=None", "--AutoGPUServer.interval_s=1",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                probe = f"{url}/autogpu/devices?token={token}"  # http://127.0.0.1 we started
                urllib.request.urlopen(probe, timeout=2).close()  # noqa: S310
                break
            except OSError:
                time.sleep(0.2)
        print(f"collecting {WARMUP_S:.0f} s of history on demo-4x ...", flush=True)
        time.sleep(WARMUP_S)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium",
                                         args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 900},
                                    device_scale_factor=2)
            page.goto(f"{url}/lab/tree/panel.ipynb?token={token}")
            page.wait_for_selector('.jp-Toolbar-kernelName:has-text("Python 3")', timeout=90_000)
            page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]')
            page.click('.lm-MenuBar-itemLabel:text-is("Run")')
            page.click('.lm-Menu-itemLabel:text-is("Run All Cells")')
            page.wait_for_selector(".autogpu-banner", timeout=90_000)
            print(f"letting the panel's window ({PANEL_WINDOW_S} s) fill ...", flush=True)
            time.sleep(PANEL_WINDOW_S + 5)
            panel = page.locator(".autogpu-panel").first
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=str(IMG / "panel.png"))

            # a fresh page and workspace (?reset): only train.ipynb open, its cell the one run
            page = browser.new_page(viewport={"width": 1400, "height": 900},
                                    device_scale_factor=2)
            page.goto(f"{url}/lab/tree/train.ipynb?reset&token={token}")
            notebook = page.locator(".jp-NotebookPanel:visible")
            notebook.locator('.jp-Toolbar-kernelName:has-text("Python 3")').wait_for(
                timeout=90_000)
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
            notebook.locator(".jp-Cell").first.click()
            page.keyboard.press("Shift+Enter")
            page.locator(".jp-AutoGPU-holder-current").wait_for(timeout=60_000)
            time.sleep(3)
            page.locator("#jp-AutoGPU-panel").screenshot(path=str(IMG / "sidebar.png"))
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
        log.close()
    print(f"wrote {IMG / 'panel.png'} and {IMG / 'sidebar.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
