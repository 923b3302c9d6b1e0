"""The CI rule of ``tests/conftest.py``: under ``CI=true`` a skip fails (a root-only test on a
non-root runner, a missing tool, a module skipped while collected), except a ``gpu`` test; an
expected failure stays one. Run on small test files through pytest's own ``pytester``, with the
hooks of the real ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import conftest

pytest_plugins = ["pytester"]

TESTS = Path(conftest.__file__).resolve().parent

CONFTEST = """
from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport
"""

#: Skips of single tests: the run goes on.
FILES = {
    "test_root_only": """
import pytest

@pytest.mark.skipif(True, reason="needs root to create the test users")
def test_by_marker():
    pass

def test_at_run_time():
    pytest.skip("giving a file to another uid needs root")

def test_runs():
    pass
""",
    "test_gpu_skip": """
import pytest

@pytest.mark.gpu
def test_needs_a_gpu():
    pytest.skip("no NVIDIA driver here (nvidia-smi not found)")
""",
    "test_known_bug": """
import pytest

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_fails():
    assert False
""",
}

#: Whole modules skipped while collected: in CI a collection error, which stops the run.
MODULES = {
    "test_whole_module": """
import pytest

pytest.skip("chromium is missing", allow_module_level=True)

def test_never_collected():
    pass
""",
    "test_missing_module": """
import pytest

pytest.importorskip("a_module_nobody_installed")

def test_never_collected():
    pass
""",
}


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    # only pytest itself and these hooks: no installed plugin (jupyter, anyio, ...) to load
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    pytester.syspathinsert(TESTS.parent)
    return pytester


def test_in_ci_every_skip_fails_but_a_gpu_tests_and_an_expected_failure(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(**FILES)
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-p", "no:cacheprovider", "-rA")
    # a skip marker acts at set-up (an error there), pytest.skip() in the test (a failure)
    result.assert_outcomes(passed=1, errors=1, failed=1, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines_random([
        "ERROR test_root_only.py::test_by_marker - skipped in CI, where it must run: "
        "Skipped: needs root to create the test users (*test_root_only.py:*)",
        "FAILED test_root_only.py::test_at_run_time - skipped in CI, where it must run: "
        "Skipped: giving a file to another uid needs root (*test_root_only.py:*)",
        "SKIPPED [[]1[]] test_gpu_skip.py:5: no NVIDIA driver here (nvidia-smi not found)",
        "XFAIL test_known_bug.py::test_fails - a known bug",
    ])


def test_in_ci_a_module_skipped_while_collected_stops_the_run(
    suite: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite.makepyfile(**MODULES)
    monkeypatch.setenv("CI", "true")
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines_random([
        "ERROR test_whole_module.py - skipped in CI, where it must run: Skipped: chromium is "
        "missing (*test_whole_module.py:*)",
        "ERROR test_missing_module.py - skipped in CI, where it must run: Skipped: could not "
        "import 'a_module_nobody_installed'*",
        "*Interrupted: 2 errors during collection*",
    ])


def test_outside_ci_a_skip_is_a_skip(suite: pytest.Pytester,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    suite.makepyfile(**FILES, **MODULES)
    monkeypatch.delenv("CI", raising=False)
    result = suite.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)


def test_only_the_gpu_folder_may_skip_a_whole_module() -> None:
    assert conftest._folder_markers(TESTS / "gpu" / "test_hardware.py") == ("gpu",)
    for folder in ("unit", "multiuser", "browser", "cluster"):
        assert "gpu" not in conftest._folder_markers(TESTS / folder / "test_x.py")
