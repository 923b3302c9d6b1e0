"""The active notebook's GPU in the status bar, and the warning before an idle GPU kernel is
culled (issue 41), in a real JupyterLab and Notebook 7 in Chromium, light and dark.

JupyterLab shows the item in its status bar; Notebook 7, which has no status bar, in its top
bar. The item names the GPU the notebook's kernel holds, its utilisation and memory, carries a
warning mark while other processes overload that GPU, is absent for a kernel without a GPU, and
opens the GPU sidebar when clicked. With ``c.AutoGPUServer.cull_idle_gpu_kernels_s`` set, the
notebook's user gets a notification before the idle kernel is shut down. And in Notebook 7, the
sidebar's one decision: no move off the best GPU, the recommended GPU's pick the first button.

One fake NVIDIA host (``libnvidia-ml.so.1`` of ``tests/fakenvml``) for the module; the autogpu
kernelspec (min free 10G) picks the idle GPU 2. Screenshots: ``test-artifacts/statusbar-*.png``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import kernelspec
from tests import browserhelpers as browser
from tests.fakenvml import FakeNvml

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WIDTH, HEIGHT = 1366, 768
U0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
U1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
U2 = "GPU-3d3d3d3d-1111-2222-3333-444444444444"
AUTOGPU = "python3-autogpu"

FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": U0, "pci_bus_id": "00000000:07:00.0",
         "memory_total": "80G", "memory_used": "70G", "utilization_pct": 98,
         "processes": [{"pid": 4242, "used_memory": "70G"}]},
        {"name": "NVIDIA L4", "uuid": U1, "pci_bus_id": "00000000:17:00.0",
         "memory_total": "24G", "memory_used": "1G", "utilization_pct": 5, "processes": []},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": U2, "pci_bus_id": "00000000:37:00.0",
         "memory_total": "80G", "memory_used": "0G", "utilization_pct": 0, "processes": []},
    ],
}
#: GPU 2 as another process fills it (79.5 of 80 GiB): the kernel on it is overloaded.
BUSY: dict[str, Any] = json.loads(json.dumps(FLEET))
BUSY["devices"][2].update(memory_used="79.5G", utilization_pct=97,
                          processes=[{"pid": 4545, "used_memory": "79.5G"}])
ITEM = "#jp-AutoGPU-statusItem"
CULL_S, WARN_S = 60, 55
WARNING = (
    "GPU 2: this idle kernel will be shut down in less than a minute (idle limit 1 min), "
    "freeing the GPU. Run any cell to keep it."
)


def _notebook(spec: str, display: str, *cells: str) -> dict[str, Any]:
    return {
        "cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {},
                   "outputs": [], "source": source} for i, source in enumerate(cells)],
        "metadata": {"kernelspec": {"display_name": display, "language": "python",
                                    "name": spec}},
        "nbformat": 4, "nbformat_minor": 5,
    }


@pytest.fixture(scope="module")
def host(fake_nvml_library: Path, tmp_path_factory: pytest.TempPathFactory) -> FakeNvml:
    fake = FakeNvml(tmp_path_factory.mktemp("statusbar-nvml"))
    fake.write(FLEET)
    return fake


def _serve(tmp: Path, host: FakeNvml, app: str, log: str, *server_args: str) -> Any:
    """A server (``app``) whose root holds ``gpu.ipynb`` (the autogpu kernelspec) and
    ``cpu.ipynb`` (plain Python 3)."""
    specs = {AUTOGPU: kernelspec.spec_dict("Python 3 (autogpu)", {"min_free": "10G"})}
    server = browser.autogpu_lab(
        tmp, host, FLEET, _notebook(AUTOGPU, "Python 3 (autogpu)", "1 + 1"), token=log,
        log_artifact=f"{log}.log", kernelspecs=specs, app=app, server_args=server_args,
        unset=("AUTOGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED",
               "AUTOGPU_MIN_FREE", "AUTOGPU_WAIT"),
    )
    return server


@pytest.fixture
def page() -> Iterator[Any]:
    with browser.chromium_page(WIDTH, HEIGHT) as p:
        yield p


def _write_notebooks(root: Path) -> None:
    (root / "gpu.ipynb").write_text(
        json.dumps(_notebook(AUTOGPU, "Python 3 (autogpu)", "1 + 1")))
    (root / "cpu.ipynb").write_text(json.dumps(_notebook("python3", "Python 3", "1 + 1")))


def _open(page: Any, lab: browser.Lab, path: str, app: str = "jupyterlab") -> None:
    """Open ``path`` (a fresh workspace in JupyterLab) and wait until its kernel is idle."""
    if app == "jupyterlab":
        page.goto(f"{lab.url}/lab/workspaces/auto-{path.split('.')[0]}/tree/{path}?reset&"
                  f"token={lab.token}")
    else:
        page.goto(f"{lab.url}/notebooks/{path}?token={lab.token}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=90_000)
    page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]',
                           timeout=90_000)


def _both_themes(page: Any, name: str, target: Any = None) -> None:
    """Screenshots ``statusbar-<name>-light.png`` and ``-dark.png`` (back to light after)."""
    shot = target if target is not None else page
    page.wait_for_timeout(800)
    browser.screenshot(shot, f"statusbar-{name}-light.png")
    browser.menu(page, "Settings", "Theme", "JupyterLab Dark")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    page.wait_for_timeout(800)
    browser.screenshot(shot, f"statusbar-{name}-dark.png")
    browser.menu(page, "Settings", "Theme", "JupyterLab Light")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'true'", timeout=30_000)


# --- JupyterLab ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(host: FakeNvml, tmp_path_factory: pytest.TempPathFactory) -> Iterator[browser.Lab]:
    with _serve(tmp_path_factory.mktemp("statusbar"), host, "jupyterlab",
                "statusbar-lab") as server:
        _write_notebooks(server.root)
        yield server


def test_the_status_bar_names_the_notebooks_gpu_and_opens_the_sidebar(
    page: Any, lab: browser.Lab, host: FakeNvml
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "statusbar-lab-failure.png"):
        _open(page, lab, "gpu.ipynb")
        item = page.locator(f"#jp-main-statusbar {ITEM}")
        # the autogpu kernelspec picked the idle GPU 2: its label, utilisation and memory
        expect(item).to_have_text(re.compile(r"^GPU 2 · \d+% · .+ / 80\.0 GiB$"),
                                  timeout=60_000)
        expect(item).to_have_attribute(
            "title", "This notebook's GPU: GPU 2. Click to open the GPU sidebar.")
        expect(item.locator(".jp-AutoGPU-statusMark")).to_be_hidden()
        # the sidebar is closed (a fresh workspace); a click on the item opens it
        if page.locator("#jp-AutoGPU-panel").is_visible():
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
        expect(page.locator("#jp-AutoGPU-panel")).to_be_hidden()
        item.click()
        expect(page.locator("#jp-AutoGPU-panel")).to_be_visible(timeout=30_000)
        page.locator(".jp-AutoGPU-card").nth(2).wait_for(timeout=30_000)
        _both_themes(page, "lab")

        # another process fills GPU 2: the warning mark, the server's words in the tooltip
        host.write(BUSY)
        try:
            expect(item).to_have_class(re.compile(r"\bjp-AutoGPU-statusOverloaded\b"),
                                       timeout=60_000)
            expect(item.locator(".jp-AutoGPU-statusMark")).to_be_visible()
            expect(item.locator(".jp-AutoGPU-statusMark")).to_have_text("⚠")
            title = item.get_attribute("title") or ""
            assert title.startswith("GPU 2 (this kernel's GPU) is overloaded: memory"), title
            _both_themes(page, "lab-overloaded", page.locator("#jp-main-statusbar"))
        finally:
            host.write(FLEET)
        expect(item.locator(".jp-AutoGPU-statusMark")).to_be_hidden(timeout=60_000)


def test_a_notebook_without_a_gpu_has_no_status_item(page: Any, lab: browser.Lab) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "statusbar-cpu-failure.png"):
        _open(page, lab, "gpu.ipynb")
        item = page.locator(f"#jp-main-statusbar {ITEM}")
        expect(item).to_be_visible(timeout=60_000)
        # the plain Python 3 notebook, opened from the file browser, becomes the active one:
        # its kernel holds no GPU
        page.locator(".jp-DirListing-item", has_text="cpu.ipynb").dblclick()
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current",
                     has_text="cpu.ipynb").wait_for(timeout=90_000)
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell").first.wait_for(
            timeout=90_000)
        page.wait_for_selector(
            '.jp-NotebookPanel:not(.lm-mod-hidden) '
            '.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=90_000)
        expect(item).to_be_hidden(timeout=30_000)
        assert page.locator(f"#jp-main-statusbar {ITEM}").inner_text() == ""
        browser.screenshot(page, "statusbar-cpu-notebook.png")
        # back to the GPU notebook's tab: the item again
        page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="gpu.ipynb").click()
        expect(item).to_have_text(re.compile(r"^GPU 2 · "), timeout=30_000)


# --- the warning before the cull, JupyterLab and Notebook 7 ----------------------------------


@pytest.fixture(scope="module", params=["jupyterlab", "notebook"])
def culling(request: pytest.FixtureRequest, host: FakeNvml,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[browser.Lab, str]]:
    """A server that culls idle GPU kernels after a minute and warns 55 s before (the culler
    itself looks only once an hour here: nothing is shut down during the test), also kernels
    open in a browser (``cull_connected``)."""
    app = request.param
    with _serve(
        tmp_path_factory.mktemp(f"statusbar-cull-{app}"), host, app, f"statusbar-cull-{app}",
        f"--AutoGPUServer.cull_idle_gpu_kernels_s={CULL_S}",
        f"--AutoGPUServer.cull_warning_s={WARN_S}",
        "--MappingKernelManager.cull_connected=True",
        "--MappingKernelManager.cull_interval=3600",
    ) as server:
        _write_notebooks(server.root)
        yield server, app


def test_the_notebooks_user_is_warned_before_its_idle_gpu_kernel_is_culled(
    page: Any, culling: tuple[browser.Lab, str]
) -> None:
    from playwright.sync_api import expect

    lab, app = culling
    with browser.screenshot_on_failure(page, f"statusbar-cull-{app}-failure.png"):
        _open(page, lab, "gpu.ipynb", app)
        item = page.locator(ITEM)
        expect(item).to_have_text(re.compile(r"^GPU 2 · "), timeout=60_000)
        if app == "notebook":  # Notebook 7 has no status bar: the item is in its top bar
            assert page.evaluate("document.body.dataset.notebook") == "notebooks"
            assert page.locator("#jp-main-statusbar").count() == 0
            expect(item).to_be_visible()
            box, title = item.bounding_box(), page.locator("#jp-title").bounding_box()
            assert box is not None and title is not None
            assert box["y"] < title["y"] + title["height"], (box, title)  # the top bar
            assert box["x"] > title["x"] + title["width"], (box, title)  # after the title
        # idle for 5 s of its minute: the warning names the GPU and how to keep it
        toast = page.locator(".Toastify__toast", has_text="this idle kernel will be shut down")
        toast.wait_for(timeout=60_000)
        assert toast.inner_text().startswith(WARNING), toast.inner_text()
        assert len(WARNING) <= 140  # all of it in the notification
        expect(item).to_have_attribute("title", WARNING, timeout=30_000)
        # said once, not at every refresh
        page.wait_for_timeout(3000)
        assert page.locator(".Toastify__toast",
                            has_text="this idle kernel will be shut down").count() == 1
        _both_themes(page, f"cull-{app}")
        # the item opens the sidebar (closed on a new page), which says the same under its
        # recommendation
        if page.locator("#jp-AutoGPU-panel").is_visible():
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
        expect(page.locator("#jp-AutoGPU-panel")).to_be_hidden()
        item.click()
        expect(page.locator("#jp-AutoGPU-panel")).to_be_visible(timeout=30_000)
        page.locator(".jp-AutoGPU-card").nth(2).wait_for(timeout=30_000)
        expect(page.locator(".jp-AutoGPU-recommendation .jp-AutoGPU-cullWarning")).to_have_text(
            WARNING, timeout=30_000)
        _both_themes(page, f"cull-{app}-sidebar")


# --- the sidebar's one decision and its button, in Notebook 7 (issue 41, items 1 and 6) -------


@pytest.fixture(scope="module")
def notebook7(host: FakeNvml, tmp_path_factory: pytest.TempPathFactory) -> Iterator[browser.Lab]:
    with _serve(tmp_path_factory.mktemp("statusbar-nb7"), host, "notebook",
                "statusbar-nb7") as server:
        _write_notebooks(server.root)
        yield server


def test_notebook7_offers_no_move_off_the_best_gpu_and_the_recommended_pick_first(
    page: Any, notebook7: browser.Lab
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "statusbar-nb7-sidebar-failure.png"):
        # the autogpu kernel picked the best GPU, 2: its card offers no move away from it
        _open(page, notebook7, "gpu.ipynb", "notebook")
        page.locator(ITEM).click()
        panel = page.locator("#jp-AutoGPU-panel")
        expect(panel).to_be_visible(timeout=30_000)
        gpu1, gpu2 = browser.card(page, "GPU 1"), browser.card(page, "GPU 2")
        expect(gpu2.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
            "gpu.ipynb", timeout=30_000)
        expect(page.locator(".jp-AutoGPU-advice")).to_have_text(
            "you are already on the best device for 10.0 GiB: GPU\u00a02")
        expect(gpu2.locator(".jp-AutoGPU-move")).to_have_count(0)
        expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move here")
        expect(page.locator(".jp-AutoGPU-recommendAction")).to_have_count(0)
        _both_themes(page, "nb7-on-best")

        # a plain notebook without a GPU: the first button is the recommended GPU's pick
        # (GPU 0, 98 % busy, comes first among the cards; GPU 2 has gpu.ipynb's lease: GPU 1)
        _open(page, notebook7, "cpu.ipynb", "notebook")
        expect(page.locator(ITEM)).to_be_hidden()
        browser.menu(page, "View", "Left Sidebar", "Show GPUs (autogpu)")
        expect(panel).to_be_visible(timeout=30_000)
        action = page.locator(".jp-AutoGPU-recommendation .jp-AutoGPU-recommendAction")
        expect(action).to_have_text("Pick GPU 1", timeout=30_000)
        first = page.locator("#jp-AutoGPU-panel button:visible").first
        assert first.inner_text() == "Pick GPU 1", first.inner_text()
        _both_themes(page, "nb7-pick")
        action.click()
        expect(page.locator(".jp-AutoGPU-moveMessage")).to_have_text(
            re.compile(r"^autogpu: picked GPU 1 · NVIDIA L4"), timeout=60_000)
        # now it holds GPU 1: the status item says so, the button is gone
        expect(page.locator(ITEM)).to_have_text(re.compile(r"^GPU 1 · "), timeout=30_000)
        expect(action).to_have_count(0)
