"""What the browser tests share: a real Jupyter server as a subprocess, Debian's Chromium through
Playwright, screenshots in ``test-artifacts/``.

Plain helpers, no fixtures: each test module builds its own fixture from them. A test that
cannot run here (no Chromium, no built lab extension, no Playwright) is skipped, saying why; in
CI a skip of a ``browser`` test fails instead (see ``tests/conftest.py``).

- :func:`jupyter_server` starts ``python -m jupyterlab`` or ``python -m notebook`` on a free port
  with a token, waits until it answers and stops it afterwards.
- :func:`autogpu_lab` is that for the sidebar tests: ``jupyter lab`` with the built lab extension
  and the server extension, on the fake NVIDIA driver.
- :func:`panel_server` is that for the panel tests: ``notebooks/panel.ipynb`` on the simulated
  fleet of ``notebooks/panel-fleet.json``.
- :func:`chromium_page` opens a page in Chromium; :func:`screenshot` and
  :func:`screenshot_on_failure` write pictures into ``test-artifacts/``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.fakenvml import FakeNvml

ROOT = Path(__file__).resolve().parent.parent
BUILT = ROOT / "autogpu_jupyter" / "labextension"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
STARTUP_S = 60
"""How long a Jupyter server may take to answer ``/api/status`` before the test fails."""


# --- skips -----------------------------------------------------------------------------------


def require_chromium() -> None:
    """Skip the test (a failure in CI) where Debian's Chromium is not installed."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM}")


def require_lab_extension() -> None:
    """Skip the test (a failure in CI) where the lab extension is not built."""
    if not (BUILT / "package.json").is_file():
        pytest.skip("lab extension not built: run `jlpm build:prod` in labextension/")


# --- artifacts -------------------------------------------------------------------------------


def artifacts() -> Path:
    """``test-artifacts/`` at the repository root, created when missing."""
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def screenshot(target: Any, name: str, **kwargs: Any) -> None:
    """Screenshot of ``target`` (a Playwright page or locator) to ``test-artifacts/<name>``."""
    target.screenshot(path=str(artifacts() / name), **kwargs)


@contextlib.contextmanager
def screenshot_on_failure(page: Any, name: str, *, full_page: bool = False) -> Iterator[None]:
    """On an exception inside the block, screenshot ``page`` to ``test-artifacts/<name>`` and
    re-raise it."""
    try:
        yield
    except Exception:
        screenshot(page, name, full_page=full_page)
        raise


# --- the browser -----------------------------------------------------------------------------


@contextlib.contextmanager
def chromium_page(width: int = 1400, height: int = 900, scale: float = 1) -> Iterator[Any]:
    """A Playwright page of ``width`` x ``height`` pixels in Debian's Chromium, closed after;
    ``scale`` is the device pixel ratio (2: a HiDPI screen).

    Skips where Playwright is not installed.
    """
    playwright = pytest.importorskip("playwright.sync_api")
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(
                viewport={"width": width, "height": height}, device_scale_factor=scale
            )
        finally:
            browser.close()


def menu(page: Any, top: str, *items: str) -> None:
    """Click the menu ``top`` of the menu bar, then ``items`` in turn (sub-menus, the command)."""
    page.click(f'.lm-MenuBar-itemLabel:text-is("{top}")')
    for item in items:
        page.click(f'.lm-Menu-itemLabel:text-is("{item}")')


def card(page: Any, label: str) -> Any:
    """The sidebar's card of the device labelled ``label`` (``"GPU 0"``)."""
    return page.locator(
        ".jp-AutoGPU-card", has=page.locator(".jp-AutoGPU-label", has_text=label)
    )


def run_first_cell(page: Any) -> None:
    """Run the first cell of the open notebook (click it, Shift+Enter)."""
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.keyboard.press("Shift+Enter")


# --- the server ------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def jupyter_server(
    app: str,
    root: Path,
    *app_args: str,
    token: str,
    env: Mapping[str, str],
    unset: tuple[str, ...] = (),
    log: Path,
    log_artifact: str | None = None,
) -> Iterator[str]:
    """Run ``python -m <app>`` (``jupyterlab`` or ``notebook``) serving ``root`` on a free port of
    127.0.0.1 with ``token``; yields its base URL once ``/api/status`` answers.

    The server sees ``os.environ`` updated with ``env``, less the variables in ``unset``; it gets
    ``app_args`` after the common options. Its output goes to ``log``, copied to
    ``test-artifacts/<log_artifact>`` afterwards where that is given. The test fails, with the
    log's end, when the server exits or does not answer within :data:`STARTUP_S` seconds.
    """
    port = free_port()
    full_env = {**os.environ, **env}
    for name in unset:
        full_env.pop(name, None)
    out = log.open("w")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", app, "--no-browser", f"--port={port}",
            "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}", *app_args,
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        env=full_env, stdout=out, stderr=subprocess.STDOUT, cwd=root,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    out.flush()
                    pytest.fail(f"{app} did not start:\n" + log.read_text()[-3000:])
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
        if log_artifact is not None:
            shutil.copy(log, artifacts() / log_artifact)


@dataclass(frozen=True)
class Lab:
    """A running ``jupyter lab`` of :func:`autogpu_lab`."""

    url: str
    """Base URL, without the token."""
    token: str
    root: Path
    """The server's root dir, holding ``train.ipynb``."""
    registry_dir: Path
    """``AUTOGPU_REGISTRY_DIR`` of the server and its kernels."""

    def open(self, page: Any, path: str) -> None:
        """Open ``/lab/tree/<path>`` in ``page``, logged in with the token."""
        page.goto(f"{self.url}/lab/tree/{path}?token={self.token}")


@contextlib.contextmanager
def autogpu_lab(
    tmp_path: Path,
    fake_nvml: FakeNvml,
    fleet: dict[str, Any],
    notebook: dict[str, Any],
    *,
    token: str,
    log_artifact: str,
    kernelspecs: Mapping[str, dict[str, Any]] | None = None,
    unset: tuple[str, ...] = ("AUTOGPU_SIMULATE",),
    app: str = "jupyterlab",
    server_args: tuple[str, ...] = (),
) -> Iterator[Lab]:
    """``jupyter lab`` with the built lab extension (sidebar refreshing every second) and the
    autogpu server extension (sampling every 0.5 s), on ``fake_nvml`` showing ``fleet``, news and
    update checks off. Skips (a failure in CI) without the built lab extension or Chromium.

    Its root dir holds ``notebook`` as ``train.ipynb``; ``kernelspecs`` (name to ``kernel.json``
    content) are installed on its ``JUPYTER_PATH``. Config, runtime, IPython and registry dirs are
    under ``tmp_path``; the log is copied to ``test-artifacts/<log_artifact>``.

    ``app="notebook"`` serves Notebook 7 instead (the same front end, ``/notebooks/<path>``);
    ``server_args`` are added to the server's command line (``--AutoGPUServer.…=…``).
    """
    require_lab_extension()
    require_chromium()
    fake_nvml.write(fleet)
    root = tmp_path / "root"
    root.mkdir()
    (root / "train.ipynb").write_text(json.dumps(notebook))
    data = tmp_path / "data"
    (data / "labextensions").mkdir(parents=True)
    (data / "labextensions" / "autogpu-jupyter").symlink_to(BUILT)
    for name, spec in (kernelspecs or {}).items():
        (data / "kernels" / name).mkdir(parents=True)
        (data / "kernels" / name / "kernel.json").write_text(json.dumps(spec))
    settings = tmp_path / "app-settings"
    settings.mkdir()
    (settings / "overrides.json").write_text(
        json.dumps({"autogpu-jupyter:plugin": {"refreshInterval": 1},
                    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"}})
    )
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    registry = tmp_path / "registry"
    env = {
        **fake_nvml.env,
        "AUTOGPU_REGISTRY_DIR": str(registry),
        "JUPYTER_PATH": str(data),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(runtime),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "PYTHONPATH": str(ROOT),
    }
    lab_args = (
        (f"--LabApp.app_settings_dir={settings}", "--LabApp.news_url=None",
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
        if app == "jupyterlab"
        else (f"--JupyterNotebookApp.app_settings_dir={settings}",)
    )
    with jupyter_server(
        app, root, *lab_args,
        "--ServerApp.jpserver_extensions={'autogpu_jupyter': True}",
        "--AutoGPUServer.interval_s=0.5", *server_args,
        token=token, env=env, unset=unset, log=tmp_path / "lab.log", log_artifact=log_artifact,
    ) as url:
        yield Lab(url=url, token=token, root=root, registry_dir=registry)


# --- the panel (notebooks/panel.ipynb) -------------------------------------------------------


@contextlib.contextmanager
def panel_server(
    root: Path, app: str, page: str, *app_args: str, simulate: str | None = None
) -> Iterator[str]:
    """Serve ``root`` with ``python -m <app>`` (``jupyterlab`` or ``notebook``) on the simulated
    panel fleet (or ``simulate``: ``AUTOGPU_SIMULATE`` as a user would set it), with news off;
    yields the URL of ``page`` (with the token).

    A copy of ``notebooks/panel.ipynb`` is put in ``root``; the server's log goes to
    ``root/<app>.log``.
    """
    shutil.copy(ROOT / "notebooks" / "panel.ipynb", root / "panel.ipynb")
    news = root / "settings" / "@jupyterlab" / "apputils-extension"
    news.mkdir(parents=True)
    (news / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    token = secrets.token_hex(16)
    env = {
        "AUTOGPU_SIMULATE": simulate or str(ROOT / "notebooks" / "panel-fleet.json"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "JUPYTER_CONFIG_DIR": str(root / "config"),
        "JUPYTERLAB_SETTINGS_DIR": str(root / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(root / "workspaces"),
    }
    with jupyter_server(
        app, root, *app_args, token=token, env=env,
        unset=("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID"),
        log=root / f"{app}.log",
    ) as url:
        yield f"{url}/{page}?token={token}"


def run_all_cells(page: Any) -> None:
    """Run all cells of the open notebook once its kernel is up (Run > Run All Cells)."""
    page.wait_for_selector('.jp-Notebook-ExecutionIndicator[data-status="idle"]', timeout=90_000)
    # the indicator says idle before the kernel connection is up: wait for the kernel name
    page.wait_for_selector('.jp-Toolbar-kernelName:has-text("Python 3")', timeout=90_000)
    menu(page, "Run", "Run All Cells")
    # Right after the kernel connects, the frontend can drop a "run all" (seen about once in
    # ten runs under load: no cell ever started). A started cell shows [*] or [n]; if none has
    # after a while, ask once more (running the notebook twice is harmless).
    started = (
        "Array.from(document.querySelectorAll('.jp-InputArea-prompt'))"
        ".some(e => /\\[(\\*|\\d+)\\]/.test(e.textContent))"
    )
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(started, timeout=20_000)
    except PlaywrightTimeout:
        menu(page, "Run", "Run All Cells")


def run_panel_notebook(page: Any, failure: str) -> None:
    """Run all cells of the open ``panel.ipynb`` once its kernel is up; wait for the banner and a
    chart per device (4). On a failure there, screenshot the page to ``test-artifacts/<failure>``.
    """
    run_all_cells(page)
    with screenshot_on_failure(page, failure, full_page=True):
        page.wait_for_selector(".autogpu-banner", timeout=90_000)
        page.wait_for_function(
            "document.querySelectorAll('svg.autogpu-chart').length === 4", timeout=60_000
        )


def assert_panel(page: Any) -> None:
    """What the rendered panel of ``notebooks/panel.ipynb`` must show, whatever the frontend:
    a chart per device of the fleet, the kernel's GPU 1 marked, the overload banner, the
    "simulated" badge, the header and the same warning printed by the next cell."""
    charts = page.locator("svg.autogpu-chart")
    assert charts.count() == 4
    kernel_charts = page.locator('svg.autogpu-chart[data-kernel="1"]')
    assert kernel_charts.count() == 1
    assert kernel_charts.get_attribute("data-uuid") == ("GPU-50000001-d3mo-4x01-a100-000000000001")
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


def assert_panel_in_both_themes(page: Any, prefix: str) -> None:
    """:func:`assert_panel`, then screenshots ``<prefix>-light.png`` (the page),
    ``<prefix>-light-widget.png`` and, after switching to JupyterLab Dark,
    ``<prefix>-dark-widget.png``, checking that the header took the dark theme's font colour."""
    assert_panel(page)
    page.wait_for_timeout(2500)  # let a few samples draw lines before the picture
    panel = page.locator(".autogpu-panel").first
    panel.scroll_into_view_if_needed()
    screenshot(page, f"{prefix}-light.png", full_page=True)
    screenshot(panel, f"{prefix}-light-widget.png")

    menu(page, "Settings", "Theme", "JupyterLab Dark")
    page.wait_for_function("document.body.dataset.jpThemeLight === 'false'", timeout=30_000)
    page.wait_for_timeout(1000)
    color = page.evaluate("getComputedStyle(document.querySelector('.autogpu-header')).color")
    assert color != "rgb(31, 31, 31)"  # the theme's font colour, not the light fallback
    screenshot(panel, f"{prefix}-dark-widget.png")
