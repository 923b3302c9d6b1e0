"""The server extension logs through the Jupyter server's logger, at the server's level.

A real ``jupyter server`` process (not pytest-jupyter's in-process app, whose test set-up installs
its own handlers): what the user sees on the server's terminal. Before the extension routed its
records to ``ServerApp.log``, the culling notice (INFO, from ``server/culling.py``) and every DEBUG
record of the core modules never appeared, whatever ``--log-level`` said.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "autogpu-log-test"
CULL_NOTICE = "autogpu: kernels holding a GPU are culled after 60 s idle"
# A DEBUG record of a core module logger (autogpu_jupyter.core.registry), made by a dry-run
# select on a server whose registry directory does not exist.
NO_REGISTRY = re.compile(
    r"\[D [^\]]* autogpu_jupyter\.core\.registry\] ranking without the registry: "
    r"lease registry \S+/missing does not exist"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_log(tmp_path: Path, *flags: str) -> str:
    """Start ``jupyter server`` with ``flags``, ask for a dry-run select, stop it; its log."""
    port = _free_port()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "JUPYTER", "CUDA_"))
    }
    env.update(
        AUTOGPU_SIMULATE="demo-4x",
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_DATA_DIR=str(tmp_path / "data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        PYTHONPATH=str(ROOT),
    )
    log_path = tmp_path / f"server-{port}.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={port}",
                f"--IdentityProvider.token={TOKEN}", "--ServerApp.allow_root=True",
                "--ServerApp.jpserver_extensions=autogpu_jupyter=True",
                f"--ServerApp.root_dir={tmp_path}",
                "--AutoGPUServer.cull_idle_gpu_kernels_s=60",
                f"--AutoGPUServer.registry_dir={tmp_path / 'missing'}",
                *flags,
            ],
            env=env, cwd=tmp_path, stdout=log_file, stderr=subprocess.STDOUT,
        )
        try:
            url = f"http://127.0.0.1:{port}/autogpu/api/v1/select?min_free=1G"
            deadline = time.monotonic() + 60
            while True:
                try:
                    request = urllib.request.Request(
                        url, headers={"Authorization": f"token {TOKEN}"}
                    )
                    with urllib.request.urlopen(request, timeout=10) as response:
                        assert response.status == 200
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(log_path.read_text()) from None
                    time.sleep(0.2)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return log_path.read_text()


def test_culling_notice_and_debug_records_reach_the_server_log_at_debug(tmp_path: Path) -> None:
    log = _server_log(tmp_path, "--log-level=DEBUG")
    notice = [line for line in log.splitlines() if CULL_NOTICE in line]
    # once, formatted by the server's own handler ("[I <time> ServerApp] ...")
    assert len(notice) == 1, log
    assert re.match(r"\[I [^\]]* ServerApp\] ", notice[0]), notice
    assert NO_REGISTRY.search(log), log


def test_the_server_level_decides_what_autogpu_logs(tmp_path: Path) -> None:
    log = _server_log(tmp_path)  # the default level, INFO
    assert sum(CULL_NOTICE in line for line in log.splitlines()) == 1, log
    assert "ranking without the registry" not in log
