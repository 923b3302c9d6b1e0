"""A kernel-only install: ``pip install autogpu-jupyter`` where a kernel runs, without Jupyter's
server or JupyterLab (a JupyterHub image's kernel environment, a batch node, a conda env registered
as a kernel).

It must stay light (at most half of 0.1's 98 packages) and hold no jupyterlab or jupyter_server,
and everything a kernel and a terminal do must work there: the magics in a real kernel started
from that environment, the panel, ``autogpu pick``; the exporter and the broker must run without
importing any Jupyter or IPython module at all.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.installhelpers import (
    SMOKE,
    EnvKernel,
    check_cli_pick,
    check_kernel_magics,
    check_smoke,
    clean_env,
    installed,
    run,
    uv_venv,
)
from tests.kernelhelpers import Kernel

pytestmark = pytest.mark.slow

#: 0.1 installed 98 distributions (autogpu-jupyter included) where a kernel runs.
PACKAGES_0_1 = 98
NOT_IN_A_KERNEL_ENV = ("jupyterlab", "jupyter-server", "notebook", "jupyterlab-server",
                       "jupyter-lsp", "jupyter-server-terminals", "nbconvert")
JUPYTER_MODULES = ("IPython", "ipykernel", "ipywidgets", "jupyter_client", "jupyter_core",
                   "jupyter_server", "jupyterlab", "notebook", "tornado", "zmq")


@pytest.fixture(scope="module")
def kernel_env(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(python, home) of a fresh venv with the wheel and its base dependencies, nothing else."""
    home = tmp_path_factory.mktemp("kernel-only")
    env = clean_env(home)
    python = uv_venv(home / "venv", sys.executable, env)
    # --refresh-package: this wheel, never a cached one of the same name and version
    run([str(Path(sys.executable).parent / "uv"), "pip", "install", "-q", "-p", str(python),
         "--refresh-package", "autogpu-jupyter", str(wheel)], env, home)
    return python, home


def test_kernel_env_is_light_and_has_no_jupyter_server(kernel_env: tuple[Path, Path]) -> None:
    python, home = kernel_env
    dists = installed(python, clean_env(home))
    assert "autogpu-jupyter" in dists
    assert {"ipykernel", "ipywidgets", "numpy", "pandas", "nvidia-ml-py"} <= set(dists)
    assert [d for d in NOT_IN_A_KERNEL_ENV if d in dists] == []
    assert len(dists) <= PACKAGES_0_1 // 2, sorted(dists)


def test_magics_and_cli_in_a_terminal_ipython(kernel_env: tuple[Path, Path]) -> None:
    python, home = kernel_env
    env = clean_env(home)
    check_smoke(run([str(python), "-c", SMOKE], env, home))
    check_cli_pick(python, env, home)
    # `ipython -c`, as a user types it: the panel is one line, not a widget's repr
    proc = run([str(python.parent / "ipython"), "--no-banner", "-c",
                "%load_ext autogpu\n%gpu panel"], env, home)
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "autogpu: %gpu panel is a live widget and needs a notebook")
    assert "Panel(" not in proc.stdout


@pytest.fixture
def kernel(kernel_env: tuple[Path, Path]) -> Iterator[Kernel]:
    python, home = kernel_env
    k = EnvKernel(python, clean_env(home), home)
    try:
        yield k
    finally:
        k.close()


def test_magics_and_panel_in_a_real_kernel(kernel: Kernel) -> None:
    check_kernel_magics(kernel, "kernel-only")


def _imported_top_modules(stderr: str) -> set[str]:
    """Top-level names of every module a ``python -X importtime`` process imported."""
    names = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", stderr, flags=re.M)
    return {n.split(".")[0] for n in names}


def _cli_with_importtime(python: Path, args: list[str], env: dict[str, str], cwd: Path,
                         log: Path) -> subprocess.Popen[bytes]:
    code = "import sys; from autogpu_jupyter.cli import main; sys.exit(main())"
    return subprocess.Popen([str(python), "-X", "importtime", "-c", code, *args], env=env,
                            cwd=cwd, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_exporter_and_broker_run_without_any_jupyter_module(
    kernel_env: tuple[Path, Path],
) -> None:
    from tests.browserhelpers import free_port

    python, home = kernel_env
    env = clean_env(home)
    port = free_port()
    exporter_log = home / "exporter.imports"
    exporter = _cli_with_importtime(python, ["exporter", "--port", str(port)], env, home,
                                    exporter_log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    metrics = r.read().decode()
                if "autogpu_gpu_" in metrics or time.monotonic() > deadline:
                    break
            except OSError:
                if exporter.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(exporter_log.read_text()[-3000:]) from None
            time.sleep(0.2)
    finally:
        _stop(exporter)
    assert re.search(r'^autogpu_gpu_\w+\{[^}]*uuid="GPU-1b1b1b1b', metrics, flags=re.M), metrics

    sock = home / "broker" / "broker.sock"
    sock.parent.mkdir()
    broker_log = home / "broker.imports"
    broker = _cli_with_importtime(
        python, ["broker", "--socket", str(sock), "--state-dir", str(home / "broker-state")],
        env, home, broker_log,
    )
    try:
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert broker.poll() is None, broker_log.read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        status = run([str(python.parent / "autogpu"), "broker", "status", "--socket", str(sock)],
                     env, home)
        assert status.stdout.startswith(f"broker {sock} (pid {broker.pid}):"), status.stdout
    finally:
        _stop(broker)

    for log in (exporter_log, broker_log):
        imported = _imported_top_modules(log.read_text())
        assert "autogpu_jupyter" in imported
        assert sorted(imported & set(JUPYTER_MODULES)) == [], log.name
