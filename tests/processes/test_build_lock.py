"""Two builds of one clone at once (two ``pip install .`` in two shells) never race in
``labextension/``: the build backend holds the clone's build lock while it builds; a second build
says so in one line and waits, or gives up with one line after ``AUTOGPU_BUILD_WAIT_S``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.installhelpers import ROOT

HOLD = """
import sys, time
sys.path.insert(0, {backend!r})
import autogpu_build
with autogpu_build.one_build_at_a_time():
    print("building", flush=True)
    time.sleep(float(sys.argv[1]))
print("built", flush=True)
"""


def _clone(tmp: Path) -> Path:
    """A clone's build backend and ``labextension/`` folder (what the lock guards)."""
    (tmp / "build_backend").mkdir()
    shutil.copy(ROOT / "build_backend" / "autogpu_build.py", tmp / "build_backend")
    (tmp / "labextension").mkdir()
    return tmp / "build_backend"


def _build(backend: Path, seconds: float, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", HOLD.format(backend=str(backend)),
                             str(seconds)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_second_build_waits_for_the_first_and_says_so_once(tmp_path: Path) -> None:
    backend = _clone(tmp_path)
    env = dict(os.environ)
    first = _build(backend, 3.0, env)
    assert first.stdout is not None and first.stdout.readline() == "building\n"
    second = _build(backend, 0.0, env)
    out, err = second.communicate(timeout=60)
    first.communicate(timeout=60)
    assert second.returncode == 0, err
    assert out == "building\nbuilt\n"
    assert err.splitlines() == [
        f"autogpu-jupyter: another build of this clone is running ({tmp_path / 'labextension'}); "
        "waiting for it to finish"
    ]


def test_a_build_that_waited_too_long_gives_up_in_one_line(tmp_path: Path) -> None:
    backend = _clone(tmp_path)
    first = _build(backend, 30.0, dict(os.environ))
    try:
        assert first.stdout is not None and first.stdout.readline() == "building\n"
        second = _build(backend, 0.0, dict(os.environ, AUTOGPU_BUILD_WAIT_S="1"))
        out, err = second.communicate(timeout=60)
        assert first.poll() is None  # it gave up while the first still built
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 1
    assert out == ""
    assert err.splitlines()[-1] == (
        f"autogpu-jupyter: another build of this clone ({tmp_path / 'labextension'}) is still "
        "running after 1 s; let it finish, or stop it, and build again")
    assert "Traceback" not in err
    assert len(err.splitlines()) == 2


def test_builds_one_after_another_do_not_wait(tmp_path: Path) -> None:
    backend = _clone(tmp_path)
    for _ in range(2):
        proc = _build(backend, 0.0, dict(os.environ))
        out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out, err) == (0, "building\nbuilt\n", "")
