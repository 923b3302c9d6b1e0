"""One way of writing a notebook path: relative to the Jupyter server's root when the notebook
lies under it (as JupyterLab and the sidebar show it), in the leases every view reads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from autogpu_jupyter.api import requester_for_this_process
from autogpu_jupyter.core.contract import SERVER_ROOT_ENV, SESSION_NAME_ENV, notebook_path


@pytest.mark.parametrize(
    ("session", "root", "shown"),
    [
        ("/srv/work/notebooks/train.ipynb", "/srv/work", "notebooks/train.ipynb"),
        ("/srv/work/notebooks/train.ipynb", "/srv/work/", "notebooks/train.ipynb"),
        ("/srv/work/train.ipynb", "/srv/work", "train.ipynb"),
        # outside the root (a root that changed, a symlinked home): as jupyter_server gave it
        ("/elsewhere/train.ipynb", "/srv/work", "/elsewhere/train.ipynb"),
        ("/srv/workshop/a.ipynb", "/srv/work", "/srv/workshop/a.ipynb"),
        # no root known (a kernel of an older server extension): as given
        ("/srv/work/train.ipynb", "", "/srv/work/train.ipynb"),
        ("relative.ipynb", "/srv/work", "relative.ipynb"),
        ("", "/srv/work", None),
    ],
)
def test_notebook_path_is_relative_to_the_server_root(
    session: str, root: str, shown: str | None
) -> None:
    assert notebook_path({SESSION_NAME_ENV: session, SERVER_ROOT_ENV: root}) == shown


def test_a_kernels_lease_names_its_notebook_as_the_sidebar_does(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(SESSION_NAME_ENV, str(tmp_path / "notebooks" / "train.ipynb"))
    monkeypatch.setenv(SERVER_ROOT_ENV, str(tmp_path))
    assert requester_for_this_process().notebook_path == "notebooks/train.ipynb"
    monkeypatch.delenv(SESSION_NAME_ENV)
    assert requester_for_this_process().notebook_path is None


# ---- without the server's root (found by the mutation run of issue 22) ----
def test_an_absolute_notebook_path_without_a_server_root_is_kept_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the server's root, an absolute path is not made relative to anything (not to
    the current directory, nor to a made-up root under it)."""
    monkeypatch.chdir(tmp_path)
    nb = str(tmp_path / "XXXX" / "nb.ipynb")
    assert notebook_path({SESSION_NAME_ENV: nb}) == nb
    assert notebook_path({SESSION_NAME_ENV: nb, SERVER_ROOT_ENV: "  "}) == nb
    assert notebook_path({SESSION_NAME_ENV: nb, SERVER_ROOT_ENV: str(tmp_path)}) == os.path.join(
        "XXXX", "nb.ipynb")
