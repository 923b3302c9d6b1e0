"""autogpu: pick the right GPU from a notebook, before CUDA starts.

``%load_ext autogpu`` then ``%gpu pick --min-free 10G``. The Python API (:func:`pick`,
:func:`status`, :func:`release`, :func:`set_visible_devices`, :class:`Panel`) is imported lazily so
that importing this package stays cheap: no pandas, ipywidgets or pynvml at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autogpu_jupyter._version import __version__

if TYPE_CHECKING:
    from autogpu_jupyter.api import current, pick, release, set_visible_devices, status
    from autogpu_jupyter.widgets import Panel

__all__ = [
    "Panel",
    "__version__",
    "current",
    "load_ipython_extension",
    "pick",
    "release",
    "set_visible_devices",
    "status",
    "unload_ipython_extension",
]

_API = {"pick", "status", "release", "set_visible_devices", "current"}


# Every import below is lazy on purpose: `import autogpu_jupyter` (and `%load_ext autogpu`) must
# stay cheap, so the API, the widgets, the magics and the server load when first used.


def __getattr__(name: str) -> Any:
    if name in _API:
        from autogpu_jupyter import api  # noqa: PLC0415

        return getattr(api, name)
    if name == "Panel":
        from autogpu_jupyter.widgets import Panel  # noqa: PLC0415

        return Panel
    raise AttributeError(f"module 'autogpu_jupyter' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%gpu`` / ``%%gpu`` (``%load_ext autogpu``). Loading twice is a no-op."""
    from autogpu_jupyter.magics import load_ipython_extension as _load  # noqa: PLC0415

    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the sampler and unregister the magics (``%unload_ext`` / ``%reload_ext``)."""
    from autogpu_jupyter.magics import unload_ipython_extension as _unload  # noqa: PLC0415

    _unload(ipython)


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "autogpu_jupyter.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "autogpu-jupyter"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    from autogpu_jupyter.server import _load_jupyter_server_extension as _load  # noqa: PLC0415

    _load(server_app)
