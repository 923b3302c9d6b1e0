"""No script from another user's lease runs in this user's page (item 1 of the safety issue).

A real second Unix user holds a lease whose notebook path is an ``<img onerror>`` tag. Root runs
``jupyter lab`` on the same shared registry (simulated fleet), opens a notebook in Debian's
Chromium, runs ``%load_ext autogpu`` and ``%gpu``, and opens the GPU sidebar. Before the fix the
status table's pandas Styler rendered the path as HTML and the ``onerror`` script ran in root's
page. Now: no dialog, no injected element, and the path shows as text in both places.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest

from tests import browserhelpers as browser
from tests.multiuser.test_safety import planted_lease

pytestmark = [
    pytest.mark.browser,
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
]

XSS = "<img src=x class=pwned onerror=alert(document.domain)>.ipynb"


def test_another_users_notebook_path_is_text_not_script(tmp_path: Path) -> None:
    browser.require_chromium()
    browser.require_lab_extension()
    with planted_lease("autogpu-xss", 2, 0, XSS) as (fleet_path, registry):
        _run_in_lab(tmp_path, fleet_path, registry)


def _run_in_lab(tmp_path: Path, fleet_path: Path, registry: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    nb = {
        "cells": [
            {
                "cell_type": "code",
                "execution_count": None,
                "id": "c1",
                "metadata": {},
                "outputs": [],
                "source": "%load_ext autogpu\n%gpu",
            }
        ],
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}
        },
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (root / "status.ipynb").write_text(json.dumps(nb))
    settings = tmp_path / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (
        settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    ).write_text('{"fetchNews": "false"}')
    data = tmp_path / "data" / "labextensions"
    data.mkdir(parents=True)
    (data / "autogpu-jupyter").symlink_to(browser.BUILT)
    token = secrets.token_hex(16)
    env = {
        "AUTOGPU_SIMULATE": str(fleet_path),
        "AUTOGPU_REGISTRY_DIR": str(registry),
        "PYTHONPATH": str(browser.ROOT),
        "JUPYTER_PATH": str(tmp_path / "data"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
    }
    with (
        browser.jupyter_server(
            "jupyterlab",
            root,
            "--ServerApp.jpserver_extensions={'autogpu_jupyter': True}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            token=token,
            env=env,
            unset=("CUDA_VISIBLE_DEVICES",),
            log=tmp_path / "lab.log",
            log_artifact="safety-xss-lab.log",
        ) as url,
        browser.chromium_page(1400, 900) as page,
    ):
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(f"{url}/lab/tree/status.ipynb?token={token}")
        with browser.screenshot_on_failure(page, "safety-xss-failure.png", full_page=True):
            page.wait_for_selector('.jp-Toolbar-kernelName:has-text("Python 3")', timeout=90_000)
            page.wait_for_selector(
                '.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=90_000
            )
            browser.run_first_cell(page)
            table = page.locator(".jp-OutputArea-output table")
            table.wait_for(timeout=90_000)
            page.get_by_text("agtest-bob: <img src=x class=pwned").first.wait_for(timeout=30_000)
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
            sidebar = page.locator("#jp-AutoGPU-panel")
            sidebar.get_by_text(XSS).first.wait_for(timeout=30_000)
            page.wait_for_timeout(1500)  # give any injected onerror handler time to fire
            browser.screenshot(page, "safety-xss.png")
        assert dialogs == []
        assert page.locator("img.pwned").count() == 0
        assert page.evaluate("document.querySelectorAll('img[src=\"x\"]').length") == 0
