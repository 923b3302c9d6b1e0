"""A real JupyterLab and a real browser (Debian's Chromium through Playwright).

JupyterLab serves a copy of ``notebooks/panel.ipynb`` with ``AUTOGPU_SIMULATE`` pointing at
``notebooks/panel-fleet.json``; the test runs all cells and checks the rendered panel: a chart per
device, this kernel's device marked, the "simulated" badge and the overload banner. Screenshots
(light and dark theme) go to ``test-artifacts/``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import browser

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
