"""The JupyterLab sidebar in a real browser: ``jupyter lab`` on the fake NVIDIA driver, driven by
Playwright through Debian's Chromium. Screenshots land in ``test-artifacts/``.

Needs the built lab extension (``autogpu_jupyter/labextension``, from ``jlpm build:prod`` in
``labextension/`` or ``pip install .``); skipped, saying so, without it or without Chromium.
"""

from __future__ import annotations

import getpass
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import browserhelpers as browser

pytestmark = [pytest.mark.browser, pytest.mark.slow]

FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-0a0a0a0a-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:07:00.0", "memory_total": "80G", "memory_used": "20G",
         "utilization_pct": 35, "temperature_c": 51, "power_w": 210, "power_limit_w": 400,
         "processes": [{"pid": 4242, "used_memory": "20G"}]},
        {"name": "NVIDIA L4", "uuid": "GPU-1b1b1b1b-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:17:00.0", "memory_total": "24G", "memory_used": "1G",
         "utilization_pct": 40, "temperature_c": 38, "power_w": 20, "power_limit_w": 72,
         "processes": []},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-3d3d3d3d-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:37:00.0", "memory_total": "80G", "memory_used": "70G",
         "utilization_pct": 92, "temperature_c": 74, "power_w": 610, "power_limit_w": 700,
         "processes": [{"pid": 4343, "used_memory": "70G"}]},
        {"name": "NVIDIA L4", "uuid": "GPU-2c2c2c2c-1111-2222-3333-444444444444",
         "pci_bus_id": "00000000:27:00.0", "lost": True},
    ],
}

NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
               "outputs": [], "source": ["%load_ext autogpu\n", "%gpu pick --min-free 10G"]}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5,
}


@pytest.fixture
def lab(fake_nvml: Any, tmp_path: Path) -> Iterator[browser.Lab]:
    """``jupyter lab`` as a subprocess on the fake fleet."""
    with browser.autogpu_lab(
        tmp_path, fake_nvml, FLEET, NOTEBOOK, token="autogpu-browser-test",
        log_artifact="sidebar-lab.log",
    ) as server:
        yield server


def test_sidebar_shows_fleet_holder_and_updates(lab: browser.Lab, fake_nvml: Any) -> None:
    with browser.chromium_page() as page:
        with browser.screenshot_on_failure(page, "sidebar-failure.png"):
            _drive(page, lab, fake_nvml)
    # the same sidebar on a HiDPI screen (device pixel ratio 2): the same layout holds
    with browser.chromium_page(scale=2) as page, browser.screenshot_on_failure(
        page, "sidebar-2x-failure.png"
    ):
        lab.open(page, "train.ipynb")
        page.locator(".jp-Notebook").wait_for(timeout=60_000)
        if not page.locator("#jp-AutoGPU-panel").is_visible():
            page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
        page.locator(".jp-AutoGPU-holder-current").first.wait_for(timeout=30_000)
        page.wait_for_timeout(2000)
        _check_layout(page)
        browser.screenshot(page.locator("#jp-AutoGPU-panel"), "sidebar-2x.png")


def _drive(page: Any, lab: browser.Lab, fake_nvml: Any) -> None:
    from playwright.sync_api import expect

    lab.open(page, "train.ipynb")
    page.locator(".jp-Notebook").wait_for(timeout=60_000)
    page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
    cards = page.locator(".jp-AutoGPU-card")
    cards.nth(3).wait_for(timeout=30_000)

    # one card per device, with the names and numbers of the fleet
    assert cards.count() == 4
    assert page.locator(".jp-AutoGPU-label").all_inner_texts() == [
        "GPU 0", "GPU 1", "GPU 2", "GPU 3"]
    assert page.locator(".jp-AutoGPU-name").all_inner_texts() == [
        "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "NVIDIA H100 80GB HBM3", "unknown"]
    gpu0 = browser.card(page, "GPU 0")
    assert gpu0.locator(".jp-AutoGPU-util .jp-AutoGPU-metricValue").inner_text() == "35%"
    assert gpu0.locator(".jp-AutoGPU-mem .jp-AutoGPU-metricValue").inner_text() == (
        "20.0 GiB / 80.0 GiB")
    assert gpu0.locator(".jp-AutoGPU-thermals").inner_text() == "51 °C · 210 W / 400 W"
    assert browser.card(page, "GPU 3").locator(".jp-AutoGPU-lostNote").inner_text() == (
        "lost: GPU is lost")
    # the recommendation for the open notebook, from the server's dry run
    page.locator(".jp-AutoGPU-advice", has_text="best device").wait_for()
    assert page.locator(".jp-AutoGPU-advice").inner_text() == (
        "best device for 10.0 GiB: GPU\u00a00")  # a no-break space: never "GPU" / "0"
    assert page.locator(".jp-AutoGPU-notebook").inner_text() == "train.ipynb"
    browser.screenshot(page, "sidebar-fleet.png")

    # %gpu pick in the notebook: the notebook shows as holder of the chosen GPU
    browser.run_first_cell(page)
    output = page.locator(".jp-OutputArea-output").first
    output.wait_for(timeout=60_000)
    holder = page.locator(".jp-AutoGPU-holder-current")
    holder.wait_for(timeout=30_000)
    assert gpu0.locator(".jp-AutoGPU-holder-current .jp-AutoGPU-what").inner_text() == (
        "train.ipynb")
    assert "10.0 GiB booked" in gpu0.locator(
        ".jp-AutoGPU-holder-current .jp-AutoGPU-holderMem").inner_text()
    browser.screenshot(page, "sidebar-holder.png")

    # load changes in the fake driver: the card follows
    changed = json.loads(json.dumps(FLEET))
    changed["devices"][1]["utilization_pct"] = 97
    changed["devices"][1]["memory_used"] = "22G"
    fake_nvml.write(changed)
    gpu1 = browser.card(page, "GPU 1")
    # cards are re-rendered on each refresh: expect() re-resolves the locator
    expect(gpu1.locator(".jp-AutoGPU-util .jp-AutoGPU-metricValue")).to_have_text(
        "97%", timeout=30_000)
    expect(gpu1.locator(".jp-AutoGPU-mem .jp-AutoGPU-metricValue")).to_have_text(
        "22.0 GiB / 24.0 GiB")
    browser.screenshot(page, "sidebar-load-change.png")
    sidebar = page.locator("#jp-AutoGPU-panel")
    browser.screenshot(sidebar, "sidebar-panel.png")

    # at the sidebar's default width, in both themes: cards that read at a glance
    page.wait_for_timeout(3000)  # a few samples of history in the sparklines
    _check_layout(page)
    browser.screenshot(sidebar, "sidebar-light.png")
    browser.menu(page, "Settings", "Theme", "JupyterLab Dark")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    page.wait_for_timeout(1500)
    _check_layout(page)
    browser.screenshot(sidebar, "sidebar-dark.png")

    # "only my GPUs": the card of the notebook's GPU, and the totals per user
    page.locator(".jp-AutoGPU-onlyMine").check()
    expect(page.locator(".jp-AutoGPU-card")).to_have_count(1)
    assert page.locator(".jp-AutoGPU-label").all_inner_texts() == ["GPU 0"]
    totals = page.locator(".jp-AutoGPU-total").all_inner_texts()
    # (the fake driver's PIDs 4242/4343 may exist on this host, owned by someone: only our
    # own line is certain)
    (mine,) = [t for t in totals if t.startswith(f"{getpass.getuser()}: ")]
    assert mine.startswith(f"{getpass.getuser()}: 1 GPU, 10.0 GiB booked"), totals
    browser.screenshot(sidebar, "sidebar-dark-mine.png")
    page.locator(".jp-AutoGPU-onlyMine").uncheck()
    expect(page.locator(".jp-AutoGPU-card")).to_have_count(4)

    # another process fills the notebook's GPU 0: a JupyterLab notification says so, once
    overloaded = json.loads(json.dumps(changed))
    overloaded["devices"][0]["memory_used"] = "78G"
    overloaded["devices"][0]["processes"] = [{"pid": 4242, "used_memory": "70G"}]
    fake_nvml.write(overloaded)
    toast = page.locator(".Toastify__toast", has_text="GPU 0 (this kernel's GPU) is overloaded")
    toast.wait_for(timeout=30_000)
    text = toast.inner_text()
    assert text.startswith(
        "GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 1 other process. "
        "Better now: GPU 2."), text  # GPU 1 is 97 % busy now, GPU 2 less
    page.wait_for_timeout(1000)  # the toast slides in
    browser.screenshot(page, "sidebar-overload-notification.png")
    page.wait_for_timeout(3000)  # more refreshes: still one notification
    assert page.locator(
        ".Toastify__toast", has_text="GPU 0 (this kernel's GPU) is overloaded").count() == 1


_CONTRAST = """(el) => {
  const rgb = c => (c.match(/[\\d.]+/g) || []).slice(0, 3).map(Number);
  const lum = ([r, g, b]) => {
    const f = v => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  let bg = getComputedStyle(el).backgroundColor;
  for (let p = el; p && /rgba\\(0, 0, 0, 0\\)|transparent/.test(bg); p = p.parentElement) {
    bg = getComputedStyle(p).backgroundColor;
  }
  const [fg, back] = [rgb(getComputedStyle(el).color), rgb(bg)];
  if (fg.length < 3 || back.length < 3) {
    return null;  // not laid out at this instant (the cards are re-rendered each refresh)
  }
  const [a, b] = [lum(fg), lum(back)];
  return (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
}"""


def _check_layout(page: Any) -> None:
    """What a user reads at a glance, whatever the theme (measured in the page)."""
    # the active notebook's own holder line is readable (WCAG AA contrast, 4.5:1)
    current = page.locator(".jp-AutoGPU-holder-current").first
    contrast = None
    for _ in range(10):
        contrast = current.evaluate(_CONTRAST)
        if contrast is not None:
            break
        page.wait_for_timeout(200)
    assert contrast is not None and contrast >= 4.5, contrast
    # one line each: the recommendation's device label, the time stamp
    advice = page.locator(".jp-AutoGPU-advice").inner_text()
    # (an overloaded notebook is told what its notification says: "Better now: GPU 2.")
    assert re.search("GPU\u00a0\\d+$|Better now: GPU \\d+\\.$", advice), advice
    stamp = page.locator(".jp-AutoGPU-stamp")
    assert stamp.evaluate("e => e.getClientRects().length") == 1
    for i in range(3):  # the live cards (the 4th is lost)
        card = page.locator(".jp-AutoGPU-card").nth(i)
        util = mem = None
        for _ in range(10):  # the cards are re-rendered each refresh: read both of one render
            util = card.locator(".jp-AutoGPU-util svg").bounding_box()
            mem = card.locator(".jp-AutoGPU-mem svg").bounding_box()
            if util is not None and mem is not None:
                break
            page.wait_for_timeout(100)
        # equal-width sparklines, whatever the length of the value's text
        assert util is not None and mem is not None
        assert abs(util["width"] - mem["width"]) < 1 and util["width"] > 100
        # a scale beside them
        assert card.locator(".jp-AutoGPU-util .jp-AutoGPU-scaleTop").inner_text() == "100%"
        # the model's name is shown whole, BEST badge or not
        name = card.locator(".jp-AutoGPU-name")
        assert name.evaluate("e => e.scrollWidth <= e.clientWidth"), name.inner_text()
    assert page.locator(".jp-AutoGPU-card .jp-AutoGPU-best").count() == 1


WAITING_NOTEBOOK = {
    **NOTEBOOK,
    "cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {},
               "outputs": [],
               "source": ["%load_ext autogpu\n", "%gpu pick --min-free 70G --wait 2m"]}],
}


@pytest.fixture
def waiting_lab(fake_nvml: Any, tmp_path: Path) -> Iterator[browser.Lab]:
    """``jupyter lab`` where the notebook waits in line: no GPU has 70 GiB free yet."""
    with browser.autogpu_lab(
        tmp_path, fake_nvml, FLEET, WAITING_NOTEBOOK, token="autogpu-browser-test",
        log_artifact="sidebar-wait-lab.log",
    ) as server:
        yield server


def test_a_notification_says_when_a_waiting_pick_gets_its_gpu(
    waiting_lab: browser.Lab, fake_nvml: Any
) -> None:
    with browser.chromium_page() as page, browser.screenshot_on_failure(
        page, "sidebar-wait-failure.png"
    ):
        waiting_lab.open(page, "train.ipynb")
        page.locator(".jp-Notebook").wait_for(timeout=60_000)
        page.locator('.lm-TabBar-tab[data-id="jp-AutoGPU-panel"]').click()
        page.locator(".jp-AutoGPU-card").nth(3).wait_for(timeout=30_000)
        browser.run_first_cell(page)
        page.locator(".jp-OutputArea-output", has_text="waiting").wait_for(timeout=60_000)
        page.wait_for_timeout(3000)  # the sidebar has seen the notebook in line
        freed = json.loads(json.dumps(FLEET))
        freed["devices"][0]["memory_used"] = "1G"
        freed["devices"][0]["processes"] = []
        fake_nvml.write(freed)
        toast = page.locator(".Toastify__toast", has_text="got its GPU")
        toast.wait_for(timeout=60_000)
        assert toast.inner_text().startswith(
            "train.ipynb got its GPU: GPU 0 (it waited in line)"), toast.inner_text()
        page.wait_for_timeout(1000)
        browser.screenshot(page, "sidebar-wait-notification.png")


# The sidebar's pick: tests/browser/test_first_hour.py (in a notebook that loaded the extension).
