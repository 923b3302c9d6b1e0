"""The first hour of a new user, in a real JupyterLab in Chromium at 1366x768 (a laptop), light
and dark: the quickstart, a pick from the sidebar in a notebook that already loaded the extension,
an overload told the same way by the cell's warning, the notification and the sidebar, a move,
and the same holders in the sidebar, ``%gpu``, the panel and ``autogpu list``.

One ``jupyter lab`` (the built lab extension, the server extension, the fake NVIDIA driver) and
its kernels serve the whole module, in order, as one user's session would (a fresh page for
each step); a second small server has no driver at all. Screenshots:
``test-artifacts/first-hour-*.png``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leasing import DirectoryStore
from tests import browserhelpers as browser
from tests.fakenvml import FakeNvml
from tests.kernelhelpers import kernel_environ

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
WIDTH, HEIGHT = 1366, 768
U0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
U1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
U2 = "GPU-3d3d3d3d-1111-2222-3333-444444444444"
U3 = "GPU-2c2c2c2c-1111-2222-3333-444444444444"

FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": U0, "pci_bus_id": "00000000:07:00.0",
         "memory_total": "80G", "memory_used": "20G", "utilization_pct": 35,
         "temperature_c": 51, "power_w": 210, "power_limit_w": 400,
         "processes": [{"pid": 4242, "used_memory": "20G"}]},
        {"name": "NVIDIA L4", "uuid": U1, "pci_bus_id": "00000000:17:00.0",
         "memory_total": "24G", "memory_used": "1G", "utilization_pct": 5, "temperature_c": 38,
         "power_w": 20, "power_limit_w": 72, "processes": []},
        # idle, and outside the allocation of the "two GPUs" kernel below
        {"name": "NVIDIA H100 80GB HBM3", "uuid": U2, "pci_bus_id": "00000000:37:00.0",
         "memory_total": "80G", "memory_used": "0G", "utilization_pct": 0,
         "temperature_c": 35, "power_w": 70, "power_limit_w": 700, "processes": []},
        {"name": "NVIDIA L4", "uuid": U3, "pci_bus_id": "00000000:27:00.0", "lost": True},
    ],
}

#: A plain kernel granted GPUs 0 and 1 only (as a scheduler or an admin's kernelspec grants).
TWO = "python3-two-gpus"
#: The autogpu kernelspec, min free 10G.
AUTOGPU = "python3-autogpu"


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
    """The fake NVIDIA host of the module (the test process and the server see it)."""
    fake = FakeNvml(tmp_path_factory.mktemp("first-hour-nvml"))
    fake.write(FLEET)
    return fake


@pytest.fixture(scope="module")
def lab(host: FakeNvml, tmp_path_factory: pytest.TempPathFactory) -> Iterator[browser.Lab]:
    tmp = tmp_path_factory.mktemp("first-hour")
    specs = {
        AUTOGPU: kernelspec.spec_dict("Python 3 (autogpu)", {"min_free": "10G"}),
        TWO: {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
              "display_name": "Python 3 (two GPUs)", "language": "python",
              "env": {"CUDA_VISIBLE_DEVICES": f"{U0},{U1}"}},
    }
    with browser.autogpu_lab(
        tmp, host, FLEET, _notebook("python3", "Python 3", "1 + 1"), token="first-hour",
        log_artifact="first-hour-lab.log", kernelspecs=specs,
        unset=("AUTOGPU_SIMULATE", "CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED",
               "AUTOGPU_MIN_FREE", "AUTOGPU_WAIT"),
    ) as server:
        # the user's notebooks: a copy of the quickstart, as make lab gives it
        shutil.copy(REPO / "notebooks" / "quickstart.ipynb", server.root / "quickstart.ipynb")
        (server.root / "two.ipynb").write_text(json.dumps(_notebook(
            TWO, "Python 3 (two GPUs)", "%load_ext autogpu",
            '%config AutoGPU.min_free = "30G"', '%config AutoGPU.min_free = ""',
            "%gpu status\nimport os; print(os.environ['CUDA_VISIBLE_DEVICES'])")))
        (server.root / "move.ipynb").write_text(json.dumps(_notebook(
            AUTOGPU, "Python 3 (autogpu)", "%load_ext autogpu",
            "import os; os.environ['CUDA_VISIBLE_DEVICES']")))
        (server.root / "views.ipynb").write_text(json.dumps(_notebook(
            "python3", "Python 3", "%load_ext autogpu\n%gpu status", "%gpu panel")))
        yield server


@pytest.fixture
def page() -> Iterator[Any]:
    """A fresh page at 1366x768 for each step (Playwright's loop must not outlive a test: the
    Jupyter test fixtures close theirs after each one)."""
    with browser.chromium_page(WIDTH, HEIGHT) as p:
        yield p


# --- helpers ---------------------------------------------------------------------------------


def _open(page: Any, lab: browser.Lab, path: str) -> Any:
    """Open ``path`` (a fresh workspace), wait for its kernel, show the sidebar; the notebook."""
    page.goto(f"{lab.url}/lab/workspaces/auto-{path.split('.')[0]}/tree/{path}?reset&"
              f"token={lab.token}")
    panel = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden)")
    panel.locator(".jp-Cell").first.wait_for(timeout=90_000)
    page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]',
                           timeout=90_000)
    page.wait_for_selector(".jp-Toolbar-kernelName", timeout=90_000)
    if not page.locator("#jp-AutoGPU-panel").is_visible():
        page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
    page.locator(".jp-AutoGPU-card").nth(3).wait_for(timeout=30_000)
    return panel


def _run_cell(page: Any, notebook: Any, n: int) -> Any:
    """Run the ``n``-th code cell; its output area once it has output."""
    from playwright.sync_api import expect

    cell = notebook.locator(".jp-CodeCell").nth(n)
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")
    expect(cell.locator(".jp-InputArea-prompt")).to_have_text(re.compile(r"\[\d+\]"),
                                                            timeout=60_000)
    return cell.locator(".jp-OutputArea")


def _both_themes(page: Any, name: str, target: Any = None) -> None:
    """Screenshots ``first-hour-<name>-light.png`` and ``-dark.png`` (back to light after)."""
    shot = target if target is not None else page
    page.wait_for_timeout(800)
    browser.screenshot(shot, f"first-hour-{name}-light.png")
    browser.menu(page, "Settings", "Theme", "JupyterLab Dark")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    page.wait_for_timeout(800)
    browser.screenshot(shot, f"first-hour-{name}-dark.png")
    browser.menu(page, "Settings", "Theme", "JupyterLab Light")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'true'", timeout=30_000)


def _cli(lab: browser.Lab, host: FakeNvml, *args: str, columns: int = 400) -> str:
    env = host.subprocess_env(AUTOGPU_REGISTRY_DIR=str(lab.registry_dir), COLUMNS=str(columns))
    for name in ("AUTOGPU_SIMULATE", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-m", "autogpu_jupyter.cli", *args], env=env,
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


# --- the walk --------------------------------------------------------------------------------


def test_the_quickstart_runs_readable_at_1366x768(
    page: Any, lab: browser.Lab, host: FakeNvml
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "first-hour-quickstart-failure.png"):
        nb = _open(page, lab, "quickstart.ipynb")
        browser.screenshot(page, "first-hour-open.png")
        # nothing covers the first outputs (the news question is off)
        assert page.locator(".Toastify__toast").count() == 0
        for n in range(3):  # %load_ext, %gpu status, %gpu pick
            out = _run_cell(page, nb, n)
        expect(out).to_contain_text("picked GPU 2 · NVIDIA H100 80GB HBM3", timeout=60_000)
        assert "already loaded" not in nb.inner_text()
        status = _run_cell(page, nb, 1)  # %gpu status again: this kernel's row marked
        table = status.locator("table")
        expect(table.locator("tr[data-mine]")).to_have_count(1, timeout=60_000)
        # the whole table inside the notebook, the sidebar open: nothing cut at the right edge
        box, area = table.bounding_box(), nb.locator(".jp-WindowedPanel-outer").bounding_box()
        assert box is not None and area is not None
        assert box["x"] + box["width"] <= area["x"] + area["width"], (box, area)
        caption = table.locator("caption").inner_text()
        assert caption.endswith("this kernel: ▶ GPU 2 (%gpu pick, min free 10.0 GiB)"), caption
        status.scroll_into_view_if_needed()
        _both_themes(page, "quickstart-status")
        # the sidebar names the notebook as JupyterLab does, relative to the server's root
        gpu2 = browser.card(page, "GPU 2")
        expect(gpu2.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
            "quickstart.ipynb", timeout=30_000)
        listed = _cli(lab, host, "leases")
        assert listed.rstrip().endswith(" quickstart.ipynb"), listed
        assert str(lab.root) not in listed
        _run_cell(page, nb, nb.locator(".jp-CodeCell").count() - 1)  # %gpu release


def test_a_pick_from_the_sidebar_in_a_notebook_that_loaded_the_extension(
    page: Any, lab: browser.Lab
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "first-hour-pick-failure.png"):
        nb = _open(page, lab, "two.ipynb")
        _run_cell(page, nb, 0)  # %load_ext autogpu, as the README says
        _run_cell(page, nb, 1)  # this notebook asks for 30 GiB by default
        # Pick buttons only where the kernel may go: GPUs 0 and 1 (GPU 2 is outside its
        # CUDA_VISIBLE_DEVICES, GPU 3 is lost)
        for label, offered in (("GPU 0", 1), ("GPU 1", 1), ("GPU 2", 0), ("GPU 3", 0)):
            expect(browser.card(page, label).locator(".jp-AutoGPU-pick")).to_have_count(
                offered, timeout=30_000)
        # nor is GPU 2 recommended to it (idle, but not the kernel's): the least loaded of its
        # own two, GPU 1
        expect(page.locator(".jp-AutoGPU-advice")).to_have_text(
            "best device for 10.0 GiB: GPU\u00a01")
        # the line carries its action: the first button is the recommended GPU's pick, not
        # GPU 0's on a busier card (issue 41)
        recommended = page.locator(".jp-AutoGPU-recommendation .jp-AutoGPU-recommendAction")
        expect(recommended).to_have_text("Pick GPU 1")
        first = page.locator("#jp-AutoGPU-panel button:visible").first
        assert first.inner_text() == "Pick GPU 1", first.inner_text()

        recommended.click()
        status = page.locator(".jp-AutoGPU-moveMessage")
        expect(status).to_have_text(
            "autogpu: GPU 1 cannot be picked: only 23.0 GiB free < 30.0 GiB wanted",
            timeout=60_000)
        box = page.locator(".jp-AutoGPU-moveStatus").bounding_box()
        assert box is not None and box["height"] < 90, box  # one line, not a red wall
        details = page.locator(".jp-AutoGPU-moveDetails")
        assert details.get_attribute("open") is None  # the rest on demand
        words = page.locator(".jp-AutoGPU-moveStatus").inner_text()
        for never in ("already loaded", "--exclude", "--wait", "excluded"):
            assert never not in words, words
        _both_themes(page, "pick-failed", page.locator("#jp-AutoGPU-panel"))
        details.locator("summary").click()
        expect(details.locator(".jp-AutoGPU-moveDetailsText")).to_have_text(
            "asked: min free 30.0 GiB (this notebook's defaults, %config AutoGPU)\n"
            "nothing changed: no variable set, no lease taken")

        _run_cell(page, nb, 2)  # back to no default
        browser.card(page, "GPU 1").locator(".jp-AutoGPU-pick").click()
        expect(status).to_have_text(re.compile(
            r"^autogpu: picked GPU 1 · NVIDIA L4 · GPU-1b1b1b1b: 23\.0 GiB free of 24\.0 GiB, "
            r"util 5%$"), timeout=60_000)
        gpu1 = browser.card(page, "GPU 1")
        expect(gpu1.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
            "two.ipynb", timeout=30_000)
        expect(page.locator(".jp-AutoGPU-pick")).to_have_count(0)
        _both_themes(page, "pick", page.locator("#jp-AutoGPU-panel"))
        out = _run_cell(page, nb, 3)  # %gpu status words the pick as the user made it
        expect(out).to_contain_text("this kernel: ▶ GPU 1 (picked from the sidebar)")
        # the variable is set in the kernel's own process
        expect(out.locator(".jp-OutputArea-output").last).to_have_text(U1)


def test_one_better_gpu_in_the_warning_the_notification_and_the_sidebar(
    page: Any, lab: browser.Lab, host: FakeNvml
) -> None:
    """two.ipynb holds GPU 1 (picked from the sidebar); another process fills it. The cell's
    warning, the notification and the sidebar name the same better device: GPU 0 (GPU 2 is
    idler but outside the kernel's grant; the pick's exclusion of every other GPU is no part
    of the question)."""
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "first-hour-overload-failure.png"):
        nb = _open(page, lab, "two.ipynb")
        busy = json.loads(json.dumps(FLEET))
        busy["devices"][1]["memory_used"] = "23.5G"
        busy["devices"][1]["processes"] = [{"pid": 4545, "used_memory": "23.5G"}]
        host.write(busy)
        toast = page.locator(".Toastify__toast", has_text="GPU 1 (this kernel's GPU) is overloaded")
        toast.wait_for(timeout=60_000)
        said = toast.inner_text()
        assert said.startswith("GPU 1 (this kernel's GPU) is overloaded: memory 98% full, 1 "
                               "other process. Better now: GPU 0."), said
        advice = page.locator(".jp-AutoGPU-advice")
        expect(advice).to_have_text(re.compile(r"Better now: GPU 0\.$"))
        expect(page.locator(".jp-AutoGPU-card:has(.jp-AutoGPU-best) .jp-AutoGPU-label")
               ).to_have_text(["GPU 0"])
        out = _run_cell(page, nb, 1)  # any cell: the kernel prints its warning under it
        expect(out).to_contain_text("autogpu: GPU 1 (this kernel's GPU) is overloaded",
                                    timeout=30_000)
        warning = out.inner_text()
        assert "Best alternative: move to GPU 0 (" in warning, warning
        assert "no better device" not in warning
        _both_themes(page, "overload")
        host.write(FLEET)


def test_a_move_restarts_the_kernel_and_the_notebook_follows(
    page: Any, lab: browser.Lab
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "first-hour-move-failure.png"):
        nb = _open(page, lab, "move.ipynb")
        out = _run_cell(page, nb, 0)  # the autogpu kernel loaded autogpu already: quiet
        assert out.inner_text().strip() == ""
        out = _run_cell(page, nb, 1)
        expect(out).to_contain_text(U2, timeout=30_000)  # the provisioner's pick: idle GPU 2
        gpu1, gpu2 = browser.card(page, "GPU 1"), browser.card(page, "GPU 2")
        advice = page.locator(".jp-AutoGPU-advice")
        action = page.locator(".jp-AutoGPU-recommendation .jp-AutoGPU-recommendAction")
        # the recommendation leaves the notebook's own lease out: it is on the best GPU already,
        # and nothing offers to move it away (issue 41: "Move to best GPU" on the best GPU's
        # own card moved it to GPU 1, whence the sidebar offered the move back)
        expect(advice).to_have_text("you are already on the best device for 10.0 GiB: GPU\u00a02")
        expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move here")
        expect(gpu2.locator(".jp-AutoGPU-move")).to_have_count(0)
        expect(action).to_have_count(0)
        assert browser.card(page, "GPU 3").locator(".jp-AutoGPU-move").count() == 0  # lost
        _both_themes(page, "move-on-best", page.locator("#jp-AutoGPU-panel"))
        gpu1.locator(".jp-AutoGPU-move-here").click()
        dialog = page.locator(".jp-Dialog")
        expect(dialog.locator(".jp-AutoGPU-movePlan")).to_have_text(
            "The kernel will restart on GPU 1 (NVIDIA L4, 23.0 GiB free), the requested device "
            "now. Restarting loses the kernel's state (variables, imports, data in memory): save "
            "what you need first.", timeout=30_000)
        # the plan says once that the state is lost; the second line only what stays
        expect(dialog.locator(".jp-AutoGPU-moveWarning")).to_have_text(
            "The outputs already in move.ipynb stay.")
        assert dialog.inner_text().count("lost") + dialog.inner_text().count("loses") == 1
        browser.screenshot(page, "first-hour-move-dialog.png")
        dialog.get_by_role("button", name="Restart on GPU 1").click()
        expect(page.locator(".jp-AutoGPU-moveMessage")).to_have_text(
            "The kernel restarted on GPU 1; its state (variables) was lost.", timeout=60_000)
        restarted = time.monotonic()
        # JupyterLab followed the restart: its indicator comes back to Idle by itself, with no
        # cell run (it used to stay on "Starting" until one ran), and no "kernel died" dialog
        page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]',
                               timeout=30_000)
        print(f"kernel indicator idle {time.monotonic() - restarted:.1f} s after the restart")
        assert page.locator(".jp-Dialog").count() == 0
        expect(gpu1.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
            "move.ipynb", timeout=30_000)
        expect(gpu2.locator(".jp-AutoGPU-holder-current")).to_have_count(0)
        # off the best GPU now: one answer everywhere, GPU 2 (the line, its action, the badge,
        # "Move to best GPU" on the kernel's own card)
        expect(advice).to_have_text("best device for 10.0 GiB: GPU\u00a02", timeout=30_000)
        expect(action).to_have_text("Move to GPU 2")
        expect(gpu1.locator(".jp-AutoGPU-move")).to_have_text("Move to best GPU")
        expect(gpu2.locator(".jp-AutoGPU-move")).to_have_text("Move here")
        expect(page.locator(".jp-AutoGPU-card:has(.jp-AutoGPU-best) .jp-AutoGPU-label")
               ).to_have_text(["GPU 2"])
        # the lease moved with the kernel, whose process sees the new GPU
        (lease,) = [r for r in DirectoryStore(str(lab.registry_dir)).list_leases()
                    if r.notebook_path == "move.ipynb"]
        assert lease.device_uuids == (U1,)
        assert kernel_environ(lease.pid)["CUDA_VISIBLE_DEVICES"] == U1
        _both_themes(page, "move")
        out = _run_cell(page, nb, 1)
        expect(out).to_contain_text(U1, timeout=30_000)

        # the line's action moves it to the best GPU; from there nothing moves it back
        action.click()
        expect(dialog.locator(".jp-AutoGPU-movePlan")).to_have_text(
            "The kernel will restart on GPU 2 (NVIDIA H100 80GB HBM3, 80.0 GiB free), the best "
            "device now. Restarting loses the kernel's state (variables, imports, data in "
            "memory): save what you need first.", timeout=30_000)
        dialog.get_by_role("button", name="Restart on GPU 2").click()
        expect(page.locator(".jp-AutoGPU-moveMessage")).to_have_text(
            "The kernel restarted on GPU 2; its state (variables) was lost.", timeout=60_000)
        page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]',
                               timeout=30_000)
        expect(gpu2.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what")).to_have_text(
            "move.ipynb", timeout=30_000)
        expect(advice).to_have_text("you are already on the best device for 10.0 GiB: GPU\u00a02")
        expect(gpu2.locator(".jp-AutoGPU-move")).to_have_count(0)
        expect(action).to_have_count(0)
        out = _run_cell(page, nb, 1)
        expect(out).to_contain_text(U2, timeout=30_000)


def _holder_words(text: str) -> list[str]:
    """The holders named in a view's text: notebooks and process ids, in order."""
    return sorted(re.findall(r"[\w.-]+\.ipynb|pid \d+", text))


def test_the_sidebar_gpu_status_the_panel_and_autogpu_list_show_the_same_holders(
    page: Any, lab: browser.Lab, host: FakeNvml
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "first-hour-holders-failure.png"):
        nb = _open(page, lab, "views.ipynb")
        status = _run_cell(page, nb, 0)
        panel = _run_cell(page, nb, 1)
        expect(panel.locator(".autogpu-table")).to_have_count(1, timeout=60_000)
        listed = _cli(lab, host, "list").splitlines()
        header = listed[1]
        views: dict[str, dict[str, list[str]]] = {"sidebar": {}, "%gpu": {}, "panel": {},
                                                  "autogpu list": {}}
        expected = {"GPU 0": ["pid 4242"], "GPU 1": ["two.ipynb"], "GPU 2": ["move.ipynb"]}
        for label in ("GPU 0", "GPU 1", "GPU 2"):
            card = browser.card(page, label)
            # the cards are re-rendered at each refresh: read the sidebar once it shows them
            for word in expected[label]:
                expect(card.locator(".jp-AutoGPU-holders")).to_contain_text(word,
                                                                            timeout=30_000)
            views["sidebar"][label] = _holder_words(
                card.locator(".jp-AutoGPU-holders").inner_text())
            row = status.locator("tr", has=page.locator("td", has_text=re.compile(f"^{label}$")))
            views["%gpu"][label] = _holder_words(row.locator("td").last.inner_text())
            prow = panel.locator(".autogpu-table tr", has=page.locator(
                "td", has_text=re.compile(f"^{label}( \\(this kernel\\))?$")))
            views["panel"][label] = _holder_words(prow.locator("td").last.inner_text())
            line = next(ln for ln in listed if ln.startswith(label + " "))
            views["autogpu list"][label] = _holder_words(line[header.index("holders"):])
        for name, seen in views.items():
            assert seen == expected, (name, seen)
        # one way of writing a notebook path: nowhere the server's absolute root
        texts = [status.inner_text(), panel.inner_text(), "\n".join(listed),
                 page.locator("#jp-AutoGPU-panel").inner_text()]
        assert not any(str(lab.root) in t for t in texts)
        panel.scroll_into_view_if_needed()
        # the panel's numbers stay whole ("38 °C", never "38" / "°C")
        for cell in panel.locator(".autogpu-table td").all()[:12]:
            assert cell.evaluate("e => getComputedStyle(e).whiteSpace") in ("nowrap", "normal")
        _both_themes(page, "views")


# --- no driver, no simulation ----------------------------------------------------------------


@pytest.fixture(scope="module")
def no_driver_lab(
    fake_nvml_library: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[browser.Lab]:
    tmp = tmp_path_factory.mktemp("first-hour-no-driver")
    fake = FakeNvml(tmp / "nvml")
    with browser.autogpu_lab(
        tmp, fake, {"driver": "none", "devices": []}, _notebook("python3", "Python 3", "1"),
        token="no-driver", log_artifact="first-hour-no-driver-lab.log",
    ) as server:
        yield server


def test_without_a_driver_the_sidebar_says_so_once(
    page: Any, no_driver_lab: browser.Lab
) -> None:
    from playwright.sync_api import expect

    with browser.screenshot_on_failure(page, "first-hour-no-driver-failure.png"):
        # (no notebook: no kernel to start and stop; the sidebar is the server's)
        page.goto(f"{no_driver_lab.url}/lab?reset&token={no_driver_lab.token}")
        page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').wait_for(timeout=90_000)
        if not page.locator("#jp-AutoGPU-panel").is_visible():
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
        errors = page.locator(".jp-AutoGPU-error")
        expect(errors.first).to_be_visible(timeout=30_000)
        page.wait_for_timeout(3000)  # a few refreshes: still said once
        texts = errors.all_inner_texts()
        assert len(texts) == 1, texts
        assert "NVIDIA" in texts[0] or "driver" in texts[0], texts
        sidebar = page.locator("#jp-AutoGPU-panel").inner_text()
        assert "server answered" not in sidebar and "no recommendation" not in sidebar
        _both_themes(page, "no-driver", page.locator("#jp-AutoGPU-panel"))
