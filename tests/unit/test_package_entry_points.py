"""The package's own ``__init__``: its lazy attributes and the entry points Jupyter calls (the
lab extension's folder, the server extension's loader). Found by the mutation run of issue 22;
each test was seen failing with its mutants planted by hand."""

from __future__ import annotations

from typing import Any

import pytest

import autogpu_jupyter
from autogpu_jupyter import widgets
from autogpu_jupyter.widgets.panel import Panel


def test_the_package_gives_panel_lazily_and_refuses_other_names() -> None:
    """``autogpu_jupyter.Panel`` is the widget class; any other unknown name an AttributeError
    that names it. Caught: the name compared inverted or misspelt (``Panel`` refused, an unknown
    name given the Panel), the message dropped (``None``)."""
    from autogpu_jupyter.widgets.panel import Panel

    assert autogpu_jupyter.Panel is Panel
    with pytest.raises(AttributeError) as info:
        autogpu_jupyter.no_such_thing
    assert str(info.value) == "module 'autogpu_jupyter' has no attribute 'no_such_thing'"


def test_the_widgets_package_refuses_other_names_by_name() -> None:
    """Caught: the message dropped (``None``)."""
    import autogpu_jupyter.widgets

    with pytest.raises(AttributeError) as info:
        autogpu_jupyter.widgets.no_such_thing
    assert str(info.value) == "module 'autogpu_jupyter.widgets' has no attribute 'no_such_thing'"


def test_the_lab_extension_is_installed_from_the_packages_labextension_folder() -> None:
    """JupyterLab copies ``<package>/labextension`` to ``labextensions/autogpu-jupyter`` (the
    name in package.json). Caught: keys or values changed."""
    assert autogpu_jupyter._jupyter_labextension_paths() == [
        {"src": "labextension", "dest": "autogpu-jupyter"}]


def test_the_server_extension_entry_point_passes_the_server_app_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Caught: ``None`` passed on instead of the ServerApp."""
    import autogpu_jupyter.server

    got: list[Any] = []
    monkeypatch.setattr(autogpu_jupyter.server, "_load_jupyter_server_extension", got.append)
    app = object()
    assert autogpu_jupyter._load_jupyter_server_extension(app) is None
    assert got == [app]


# ---- the widgets package's lazy attribute (found by the mutation run of issue 22) ----
def test_the_widgets_package_names_a_missing_attribute_in_its_error() -> None:
    """Caught: ``widgets.__getattr__``'s error lost its text (``AttributeError(None)``)."""
    assert widgets.Panel is Panel
    with pytest.raises(AttributeError) as err:
        _ = widgets.Nope  # type: ignore[attr-defined]
    assert str(err.value) == "module 'autogpu_jupyter.widgets' has no attribute 'Nope'"
