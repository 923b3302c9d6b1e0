"""Honest floors: the lowest declared versions install together and work, and so does every Python
this machine has (3.10 to 3.13 under pyenv).

- ``uv pip install --resolution lowest-direct`` of the wheel's own ``Requires-Dist`` on the oldest
  supported Python (3.10): each direct dependency at its declared floor (checked), the rest as the
  resolver chooses; then the smoke test, a real kernel and ``autogpu pick``. 0.1 declared no numpy
  floor, so this resolution gave pandas 1.5.0 with numpy 2.x and ``%gpu`` crashed.
- the same for ``[lab]`` (the server, JupyterLab and Notebook 7 at their floors): the server
  extension and the sidebar are enabled, ``jupyter notebook`` exists, and a real server answers
  the versioned REST path with the fleet.
- the wheel with the newest dependencies on each Python found: the smoke test and ``autogpu pick``.
"""

from __future__ import annotations

import glob
import json
import re
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.installhelpers import (
    ANSI,
    SMOKE,
    UV,
    EnvKernel,
    check_cli_pick,
    check_kernel_magics,
    check_smoke,
    clean_env,
    installed,
    run,
    uv_venv,
)

pytestmark = pytest.mark.slow

PYENV = Path.home() / ".pyenv" / "versions"


def _pythons() -> dict[str, str]:
    """The newest interpreter of each of 3.10 ... 3.13 under pyenv, and this one's version."""
    found = {f"{sys.version_info[0]}.{sys.version_info[1]}": sys.executable}
    for minor in ("3.10", "3.11", "3.12", "3.13"):
        matches = sorted(glob.glob(str(PYENV / f"{minor}.*" / "bin" / "python")),
                         key=lambda p: Version(Path(p).parts[-3]))
        if matches:
            found[minor] = matches[-1]
    return dict(sorted(found.items(), key=lambda kv: Version(kv[0])))


def _base_requirements(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(meta).decode())
    reqs = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    return [r for r in reqs if r.marker is None or "extra" not in str(r.marker)]


def _extra_requirements(wheel: Path, extra: str) -> list[Requirement]:
    """The wheel's requirements for ``extra``, without their ``extra == ...`` marker."""
    with zipfile.ZipFile(wheel) as zf:
        (meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(zf.read(meta).decode())
    reqs = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    out = []
    for r in reqs:
        if r.marker is not None and r.marker.evaluate({"extra": extra}) and not \
                r.marker.evaluate({"extra": ""}):
            r.marker = None
            out.append(r)
    return out


def _check_floors(python: Path, env: dict[str, str], requirements: list[Requirement]) -> None:
    versions = installed(python, env)
    for req in requirements:
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        floor = _floor(req)
        got = Version(versions[name])
        # the floor itself, or its first release with wheels
        assert got.release[: len(floor.release)] == floor.release, (name, floor, got)


def _floor(req: Requirement) -> Version:
    (floor,) = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return floor


def test_lowest_direct_bounds_install_and_work(wheel: Path, tmp_path: Path) -> None:
    pythons = _pythons()
    assert "3.10" in pythons, f"no Python 3.10 under {PYENV} (the oldest supported)"
    env = clean_env(tmp_path)
    python = uv_venv(tmp_path / "venv", pythons["3.10"], env)
    requirements = _base_requirements(wheel)
    assert "numpy" in {r.name for r in requirements}
    reqs_file = tmp_path / "requirements.txt"
    reqs_file.write_text("\n".join(str(r) for r in requirements) + "\n")
    run([UV, "pip", "install", "-q", "-p", str(python), "--resolution", "lowest-direct",
         "-r", str(reqs_file)], env, tmp_path)
    run([UV, "pip", "install", "-q", "-p", str(python), "--no-deps", "--refresh-package",
         "autogpu-jupyter", str(wheel)], env, tmp_path)

    _check_floors(python, env, requirements)

    report = check_smoke(run([str(python), "-c", SMOKE], env, tmp_path))
    assert report["versions"]["numpy"] == str(_floor(next(r for r in requirements
                                                          if r.name == "numpy")))
    check_cli_pick(python, env, tmp_path)
    kernel = EnvKernel(python, env, tmp_path)
    try:
        check_kernel_magics(kernel, str(tmp_path / "venv"))
    finally:
        kernel.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_lab_extra_at_its_floors_serves_the_sidebar_and_notebook_7(
    wheel: Path, tmp_path: Path
) -> None:
    """``[lab]`` at its lowest declared bounds: JupyterLab, the server and Notebook 7 install
    together with the kernel's floors, the extension is enabled in both front ends, and a real
    server answers the versioned REST path."""
    pythons = _pythons()
    assert "3.10" in pythons, f"no Python 3.10 under {PYENV} (the oldest supported)"
    env = clean_env(tmp_path)
    python = uv_venv(tmp_path / "venv", pythons["3.10"], env)
    lab = _extra_requirements(wheel, "lab")
    names = {re.sub(r"[-_.]+", "-", r.name).lower() for r in lab}
    assert names >= {"jupyterlab", "jupyter-server", "notebook"}, lab
    requirements = _base_requirements(wheel) + lab
    reqs_file = tmp_path / "requirements.txt"
    reqs_file.write_text("\n".join(str(r) for r in requirements) + "\n")
    run([UV, "pip", "install", "-q", "-p", str(python), "--resolution", "lowest-direct",
         "-r", str(reqs_file)], env, tmp_path)
    run([UV, "pip", "install", "-q", "-p", str(python), "--no-deps", "--refresh-package",
         "autogpu-jupyter", str(wheel)], env, tmp_path)
    _check_floors(python, env, requirements)

    bindir = python.parent
    exts = run([str(bindir / "jupyter"), "server", "extension", "list"], env, tmp_path)
    exts_text = ANSI.sub("", exts.stdout + exts.stderr)
    assert re.search(r"autogpu_jupyter +enabled", exts_text), exts_text
    labexts = run([str(bindir / "jupyter"), "labextension", "list"], env, tmp_path)
    labexts_text = ANSI.sub("", labexts.stdout + labexts.stderr)
    assert re.search(r"autogpu-jupyter v\S+ enabled", labexts_text), labexts_text
    nb = run([str(bindir / "jupyter"), "notebook", "--version"], env, tmp_path)
    assert nb.stdout.strip().startswith("7."), nb.stdout

    port, token = _free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [str(bindir / "jupyter"), "server", "--no-browser", f"--port={port}",
         f"--IdentityProvider.token={token}", "--ServerApp.ip=127.0.0.1", "--allow-root"],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/autogpu/api/v1/devices?token={token}"
        deadline, answer = time.monotonic() + 90, None
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as resp:
                    answer = json.loads(resp.read())
                break
            except OSError:
                time.sleep(0.5)
        failed = server.poll() is not None
        assert answer is not None, server.stderr.read() if failed else "no answer"
        assert "GPU-1b1b1b1b-1111-2222-3333-444444444444" in json.dumps(answer)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.parametrize("minor", list(_pythons()))
def test_each_python_installs_and_works(minor: str, wheel: Path, tmp_path: Path) -> None:
    env = clean_env(tmp_path)
    python = uv_venv(tmp_path / "venv", _pythons()[minor], env)
    run([UV, "pip", "install", "-q", "-p", str(python), "--refresh-package", "autogpu-jupyter",
         str(wheel)], env, tmp_path)
    check_smoke(run([str(python), "-c", SMOKE], env, tmp_path))
    check_cli_pick(python, env, tmp_path)
