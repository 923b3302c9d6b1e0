"""The GPU sidebar in Notebook 7 (``jupyter notebook``, package ``notebook>=7``), in Chromium.

Notebook 7's shell has a left area but no ``ILabShell``; the sidebar plugin takes ``ILabShell`` as
optional and adds its panel through ``app.shell`` there. A user opens it from View → Left Sidebar
→ Show GPUs (autogpu), which is what the test clicks. Screenshots go to
``test-artifacts/notebook7-sidebar*.png``.

The second test serves the same front end without autogpu's server extension (the state a
``pip install --user`` on JupyterHub leaves: the lab extension found on the data path, the server
extension not loaded): the sidebar says so in one line instead of showing bare 404s.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import browserhelpers as browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FLEET_FILE = Path(__file__).resolve().parents[2] / "notebooks" / "panel-fleet.json"


def _open_sidebar(page: object, url: str) -> None:
    page.goto(url)  # type: ignore[attr-defined]
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)  # type: ignore[attr-defined]
    # the Notebook 7 shell (not JupyterLab): its body says which page it is
    assert page.evaluate("document.body.dataset.notebook") == "notebooks"  # type: ignore[attr-defined]
    browser.menu(page, "View", "Left Sidebar", "Show GPUs (autogpu)")


def test_sidebar_shows_every_gpu_in_notebook7(tmp_path: Path) -> None:
    browser.require_chromium()
    browser.require_lab_extension()
    devices = json.loads(FLEET_FILE.read_text())["devices"]
    with browser.panel_server(tmp_path, "notebook", "notebooks/panel.ipynb") as url, \
            browser.chromium_page(1400, 900) as page, \
            browser.screenshot_on_failure(page, "notebook7-sidebar-failure.png"):
        _open_sidebar(page, url)
        panel = page.locator("#jp-AutoGPU-panel")
        panel.wait_for(state="visible", timeout=30_000)
        cards = panel.locator(".jp-AutoGPU-card")
        cards.first.wait_for(timeout=30_000)
        assert cards.count() == len(devices)
        assert [cards.nth(i).locator(".jp-AutoGPU-label").inner_text()
                for i in range(len(devices))] == [f"GPU {i}" for i in range(len(devices))]
        assert panel.locator(".jp-AutoGPU-error").count() == 0
        browser.screenshot(page, "notebook7-sidebar.png")


def test_sidebar_without_the_server_extension_says_so_in_notebook7(tmp_path: Path) -> None:
    browser.require_chromium()
    browser.require_lab_extension()
    with browser.panel_server(
        tmp_path, "notebook", "notebooks/panel.ipynb",
        "--ServerApp.jpserver_extensions=autogpu_jupyter=False",
    ) as url, browser.chromium_page(1400, 900) as page, \
            browser.screenshot_on_failure(page, "notebook7-no-server-failure.png"):
        _open_sidebar(page, url)
        # said once, as the whole story (no "server answered 404:" before it): the cluster
        # section, which asks the same missing server extension, stays hidden
        error = page.locator("#jp-AutoGPU-panel .jp-AutoGPU-errors > .jp-AutoGPU-error")
        error.first.wait_for(timeout=30_000)
        assert error.count() == 1
        text = error.inner_text()
        assert text == (
            "autogpu's server extension is not running on this Jupyter server: install "
            "autogpu-jupyter[lab] where the server runs (or `jupyter server extension enable "
            "autogpu_jupyter` there) and restart it"
        )
        page.wait_for_timeout(3_000)  # the cluster section asks on its own poll
        assert page.locator("#jp-AutoGPU-panel .jp-AutoGPU-error").count() == 1
        assert page.locator("#jp-AutoGPU-panel .jp-AutoGPU-cluster").inner_text() == ""
        browser.screenshot(page, "notebook7-sidebar-no-server.png")
