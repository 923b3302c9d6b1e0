"""The panel in Notebook 7 (``jupyter notebook``, package ``notebook>=7``) and a real browser.

Like ``tests/browser/test_panel.py`` (same server helper, same checks, from
``tests/browserhelpers.py``), but the notebook opens in the Notebook 7 frontend
(``/notebooks/panel.ipynb``): a chart per device of the simulated fleet, this kernel's device
marked, the "simulated" badge and the overload banner.
Screenshots (light and dark theme) go to ``test-artifacts/notebook7-*.png``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests import browserhelpers as browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def notebook7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    browser.require_chromium()
    notebook = pytest.importorskip("notebook")
    major = int(notebook.__version__.split(".")[0])
    if major < 7:
        pytest.skip(f"notebook {notebook.__version__} installed; this test needs notebook>=7")
    root = tmp_path_factory.mktemp("nb7")
    with browser.panel_server(root, "notebook", "notebooks/panel.ipynb") as url:
        yield url


def test_panel_renders_charts_and_warning_in_notebook7(notebook7: str) -> None:
    with browser.chromium_page(1400, 1000) as page:
        page.goto(notebook7)
        page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
        # the Notebook 7 shell (not JupyterLab): its body says which page it is
        assert page.evaluate("document.body.dataset.notebook") == "notebooks"
        browser.run_panel_notebook(page, "notebook7-failure.png")
        browser.assert_panel_in_both_themes(page, "notebook7")
