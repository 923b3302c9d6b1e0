"""A real JupyterLab and a real browser (Debian's Chromium through Playwright).

JupyterLab serves a copy of ``notebooks/panel.ipynb`` with ``AUTOGPU_SIMULATE`` pointing at
``notebooks/panel-fleet.json``; the test runs all cells and checks the rendered panel: a chart per
device, this kernel's device marked, the "simulated" badge and the overload banner. Screenshots
(light and dark theme) go to ``test-artifacts/``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests import browserhelpers as browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    browser.require_chromium()
    with browser.panel_server(
        tmp_path_factory.mktemp("lab"),
        "jupyterlab",
        "lab/tree/panel.ipynb",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ) as url:
        yield url


def test_panel_renders_charts_and_warning_in_jupyterlab(lab: str) -> None:
    with browser.chromium_page(1400, 1000) as page:
        page.goto(lab)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        browser.run_panel_notebook(page, "panel-failure.png")
        browser.assert_panel_in_both_themes(page, "panel")


def _run_all(page: Any) -> None:
    browser.run_all_cells(page)


def _both_themes(page: Any, prefix: str) -> None:
    panel = page.locator(".autogpu-panel").first
    panel.scroll_into_view_if_needed()
    browser.screenshot(panel, f"{prefix}-light.png")
    browser.menu(page, "Settings", "Theme", "JupyterLab Dark")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    page.wait_for_timeout(1000)
    browser.screenshot(panel, f"{prefix}-dark.png")


def test_panel_notebook_on_the_make_lab_fleet_shows_the_overload(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """What make lab starts (demo-4x): panel.ipynb shows the banner its text promises."""
    browser.require_chromium()
    with browser.panel_server(
        tmp_path_factory.mktemp("demo4x"), "jupyterlab", "lab/tree/panel.ipynb",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        simulate="demo-4x",
    ) as url, browser.chromium_page(1400, 1000) as page:
        page.goto(url)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        _run_all(page)
        with browser.screenshot_on_failure(page, "panel-demo4x-failure.png", full_page=True):
            page.wait_for_selector(".autogpu-banner", timeout=90_000)
            banner = page.locator(".autogpu-banner").inner_text()
            assert "GPU 1 (this kernel's GPU) is overloaded" in banner
            assert "caused by 1 other process holding" in banner and "(user bob)" in banner
            assert page.get_by_text("autogpu: GPU 1 (this kernel's GPU) is overloaded").count()
            outputs = page.locator(".jp-OutputArea-output")
            assert outputs.filter(has_text="no overload").count() == 0
            page.wait_for_timeout(2500)
            _both_themes(page, "panel-demo4x")


def test_a_fleet_error_is_shown_prominently_in_the_panel(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A fleet file that does not exist: the panel's first line is the error, in an alert box.
    (panel.ipynb's first cell, a pick, would stop "Run All" with the same error; here the panel
    opens first, as in a notebook that shows it before picking.)"""
    browser.require_chromium()
    root = tmp_path_factory.mktemp("badfleet")
    with browser.panel_server(
        root, "jupyterlab", "lab/tree/panel.ipynb",
        "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        simulate="notebooks/no-such-fleet.json",
    ) as url, browser.chromium_page(1400, 1000) as page:
        nb = json.loads((root / "panel.ipynb").read_text())
        nb["cells"] = [c for c in nb["cells"] if "%gpu pick" not in "".join(c["source"])]
        (root / "panel.ipynb").write_text(json.dumps(nb))
        page.goto(url)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        _run_all(page)
        with browser.screenshot_on_failure(page, "panel-error-failure.png", full_page=True):
            error = page.locator(".autogpu-error[role=alert]")
            error.wait_for(timeout=90_000)
            text = error.inner_text()
            assert text.startswith("✖ autogpu cannot read the GPUs: AUTOGPU_SIMULATE=")
            assert "no-such-fleet.json': not a fleet file (looked in " in text
            # in the panel's banner area, above the charts: bigger than the grey status text
            size = error.evaluate("e => parseFloat(getComputedStyle(e).fontSize)")
            assert size >= 13
            _both_themes(page, "panel-error")
