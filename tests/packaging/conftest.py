"""The install tests' one wheel per session.

Built once from this checkout with the test environment's build backend
(``--no-build-isolation``); its JS build is skipped because the set-up built the lab extension
(``autogpu_jupyter/labextension``).
``test_install_from_clone.py`` builds everything from a clean copy instead, as a user's
``pip install .`` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.installhelpers import BUILT_LABEXTENSION, ROOT, run


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built once for the session."""
    if not (BUILT_LABEXTENSION / "static" / "style.js").is_file():
        pytest.fail(
            "autogpu_jupyter/labextension is not built, so the wheel build would run the JS build "
            "(minutes): run scripts/setup.sh, or `jlpm build:prod` in labextension/"
        )
    out = tmp_path_factory.mktemp("wheel")
    version_file = ROOT / "autogpu_jupyter" / "_version.py"
    version_before = version_file.read_bytes()
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--no-cache-dir", "-q", "-w", str(out), str(ROOT)],
        env=os.environ, cwd=out,
    )
    # The version hook rewrites this tracked file at every build; it must come out as committed.
    assert version_file.read_bytes() == version_before
    (built,) = out.glob("autogpu_jupyter-*-py3-none-any.whl")
    return built
