"""``pip install "<clone>[lab]"`` on a machine without Node.js, as the README says.

A copy of the checkout's files as a fresh clone has them (tracked and not ignored: no
``node_modules``, no built lab extension), a fresh venv, and a ``PATH`` from which every ``node``,
``npm`` and ``yarn`` is removed. pip builds the wheel in its isolated build environment: the build
backend (``build_backend/autogpu_build.py``) asks for Node.js from PyPI because none is usable, and
``jlpm`` builds the lab extension with it. Then ``jupyter labextension list`` and ``jupyter server
extension list``, as a user runs them, show both halves of autogpu enabled and OK.

0.1 failed here after 36 s with a ``jlpm`` traceback ("Please install Node.js").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the test environment's Python is 3.11+ here
    import tomli as tomllib

import pytest

from tests.installhelpers import ANSI, ROOT, UV, clean_env, run

pytestmark = pytest.mark.slow

NODE_NAMES = {"node", "nodejs", "npm", "npx", "corepack", "yarn", "yarnpkg", "jlpm"}


def _path_without_node(tmp: Path) -> str:
    """This ``PATH`` with every directory that holds a Node.js tool replaced by a copy of it
    (symbolic links) without those tools."""
    parts = []
    for i, entry in enumerate(os.environ["PATH"].split(os.pathsep)):
        d = Path(entry)
        if not d.is_dir() or not any((d / n).exists() for n in NODE_NAMES):
            parts.append(entry)
            continue
        mirror = tmp / f"path{i}"
        mirror.mkdir()
        for f in d.iterdir():
            if f.name not in NODE_NAMES:
                (mirror / f.name).symlink_to(f)
        parts.append(str(mirror))
    return os.pathsep.join(parts)


def _dependencies(clone: Path, extra: str) -> list[str]:
    """The base dependencies and those of ``extra``, as pyproject.toml declares them."""
    project = tomllib.loads((clone / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def _clone(dest: Path) -> Path:
    """The files a fresh clone of this checkout has (tracked or new, never ignored ones)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    """What a command showed the user (the two lists write to stdout or stderr), without colour."""
    return ANSI.sub("", proc.stdout + proc.stderr)


def test_a_clone_installs_without_node_and_both_extensions_are_ok(tmp_path: Path) -> None:
    clone = _clone(tmp_path / "autogpu")
    assert not (clone / "autogpu_jupyter" / "labextension").exists()
    assert not (clone / "labextension" / "node_modules").exists()
    path = _path_without_node(tmp_path)
    assert all(shutil.which(n, path=path) is None for n in NODE_NAMES)
    env = clean_env(tmp_path, {"PATH": path})
    run([sys.executable, "-m", "venv", str(tmp_path / "venv")], env, tmp_path)
    venv_bin = tmp_path / "venv" / "bin"
    env["PATH"] = f"{venv_bin}{os.pathsep}{path}"
    env["VIRTUAL_ENV"] = str(tmp_path / "venv")
    # The dependencies first, with uv (seconds from its cache, where pip takes minutes to
    # resolve and copy about a hundred packages): pip then builds and installs the clone itself.
    deps = [str(r) for r in _dependencies(clone, "lab")]
    run([UV, "pip", "install", "-q", "-p", str(venv_bin / "python"), *deps], env, tmp_path)
    run([str(venv_bin / "pip"), "install", "-q", f"{clone}[lab]"], env, tmp_path, timeout=900)
    # the extension was built here, by the Node.js from PyPI: still none on PATH
    assert shutil.which("node", path=env["PATH"]) is None

    version = json.loads((clone / "labextension" / "package.json").read_text())["version"]
    lab = _output(run([str(venv_bin / "jupyter"), "labextension", "list"], env, tmp_path))
    prefix = f"{tmp_path / 'venv'}/share/jupyter/labextensions"
    section = next(s for s in lab.split("\n\n") if prefix in s)
    assert f"        autogpu-jupyter v{version} enabled OK (python, autogpu-jupyter)" in (
        section.splitlines()), lab
    server = _output(run([str(venv_bin / "jupyter"), "server", "extension", "list"], env,
                         tmp_path)).splitlines()
    start = server.index(f"Config dir: {tmp_path / 'venv'}/etc/jupyter")
    i = server.index("    autogpu_jupyter enabled", start)
    assert server[i + 1:i + 3] == [
        "    - Validating autogpu_jupyter...", f"      autogpu_jupyter {version} OK"
    ], server
    # Notebook 7 came with [lab]: `jupyter notebook` is there, and lists the same extension
    notebook = _output(run([str(venv_bin / "jupyter"), "notebook", "--version"], env, tmp_path))
    assert notebook.strip().startswith("7."), notebook
