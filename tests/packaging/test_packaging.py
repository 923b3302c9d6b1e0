"""Packaging: the wheel a user installs, and the editable install the set-up makes.

Issue 2: ``%load_ext autogpu`` works from a wheel and from an editable install. Issue 5: the wheel
carries the prebuilt JupyterLab extension (no Node to install it) and enables the server extension.

The wheel is the session's (``conftest.py``), built from this checkout with the build backend of
the test environment (``--no-build-isolation``, no network); the hatch-jupyter-builder hook skips
the JS build because ``autogpu_jupyter/labextension/static/style.js`` exists (the set-up builds
it), so the build takes about a second. The wheel is installed with ``pip install --target`` into
a temporary directory that goes first on ``PYTHONPATH``, and every check asserts that the code it
ran came from there, not from the checkout.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BUILT_LABEXTENSION = ROOT / "autogpu_jupyter" / "labextension"
LAB_SHARE = "share/jupyter/labextensions/autogpu-jupyter"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d/autogpu_jupyter.json"
PIP_INSTALL = "-m pip install --no-deps --no-index --no-compile -q"
STATUS_COLUMNS = "gpu name uuid util memory used / total free temp power procs holders"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# Modules a user reaches by name (issue 2's layout, the entry points, the server extension point).
REQUIRED_MODULES = [
    "autogpu/__init__.py",
    "autogpu_jupyter/__init__.py",
    "autogpu_jupyter/_version.py",
    "autogpu_jupyter/py.typed",
    "autogpu_jupyter/errors.py",
    "autogpu_jupyter/config.py",
    "autogpu_jupyter/cli.py",
    "autogpu_jupyter/magics/__init__.py",
    "autogpu_jupyter/magics/words.py",
    "autogpu_jupyter/magics/progress.py",
    "autogpu_jupyter/magics/hooks.py",
    "autogpu_jupyter/api.py",
    "autogpu_jupyter/provisioner.py",
    "autogpu_jupyter/server/__init__.py",
    "autogpu_jupyter/widgets/__init__.py",
    "autogpu_jupyter/core/__init__.py",
    "autogpu_jupyter/core/units.py",
    "autogpu_jupyter/core/devices.py",
    "autogpu_jupyter/core/visibility.py",
    "autogpu_jupyter/core/cudastate.py",
    "autogpu_jupyter/core/policy.py",
    "autogpu_jupyter/core/text.py",
    "autogpu_jupyter/core/holders.py",
    "autogpu_jupyter/core/contract.py",
    "autogpu_jupyter/core/options.py",
    "autogpu_jupyter/core/decision.py",
    "autogpu_jupyter/core/procfs.py",
    "autogpu_jupyter/core/leasing/__init__.py",
    "autogpu_jupyter/core/leasing/store.py",
    "autogpu_jupyter/core/leasing/admission.py",
    "autogpu_jupyter/core/leasing/records.py",
    "autogpu_jupyter/core/leasing/directory.py",
    "autogpu_jupyter/core/leasing/safefs.py",
    "autogpu_jupyter/core/leasing/admin.py",
    "autogpu_jupyter/core/cluster/__init__.py",
    "autogpu_jupyter/core/cluster/prometheus.py",
    "autogpu_jupyter/core/cluster/series.py",
    "autogpu_jupyter/core/cluster/ranking.py",
    "autogpu_jupyter/core/cluster/cache.py",
    "autogpu_jupyter/core/cluster/history.py",
    "autogpu_jupyter/core/leasing/brokerclient.py",
    "autogpu_jupyter/core/leasing/wire.py",
    "autogpu_jupyter/core/leasing/factory.py",
    "autogpu_jupyter/broker.py",
    "autogpu_jupyter/brokerd/__init__.py",
    "autogpu_jupyter/core/backends/amdsmi.py",
    "autogpu_jupyter/core/backends/__init__.py",
    "autogpu_jupyter/core/backends/nvml.py",
    "autogpu_jupyter/core/backends/simulated.py",
]

DEMO_ROWS = [
    ("0", "NVIDIA A100-SXM4-80GB", "GPU-50000000", "80.0 GiB"),
    ("1", "NVIDIA A100-SXM4-80GB", "GPU-50000001", "80.0 GiB"),
    ("2", "NVIDIA L4", "GPU-50000002", "24.0 GiB"),
    ("3", "NVIDIA L4", "GPU-50000003", "24.0 GiB"),
]

# Runs in a subprocess: load the extension into a real InteractiveShell, run %gpu status, load the
# other name, and report where every autogpu module came from.
SHELL_SCRIPT = r"""
import contextlib, io, json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
first = io.StringIO()
with contextlib.redirect_stdout(first):
    shell.run_line_magic("load_ext", "autogpu")
    magics = shell.magics_manager.magics["line"]["gpu"].__self__
    shell.run_line_magic("gpu", "status")
second = io.StringIO()
with contextlib.redirect_stdout(second):
    shell.run_line_magic("load_ext", "autogpu_jupyter")
import autogpu_jupyter
print(json.dumps({
    "status": first.getvalue(),
    "second_load_output": second.getvalue(),
    "same_magics_after_second_load": shell.magics_manager.magics["line"]["gpu"].__self__ is magics,
    "cell_magic": "gpu" in shell.magics_manager.magics["cell"],
    "loaded": sorted(shell.extension_manager.loaded),
    "version": autogpu_jupyter.__version__,
    "modules": {
        name: getattr(mod, "__file__", None)
        for name, mod in sorted(sys.modules.items())
        if name == "autogpu" or name.startswith(("autogpu.", "autogpu_jupyter"))
    },
}))
"""


def clean_env(tmp: Path) -> dict[str, str]:
    """The environment of a user on a host without a driver: the simulated demo fleet, no
    allocation variables, Jupyter and IPython state in ``tmp``, nothing on ``PYTHONPATH``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AUTOGPU_", "CUDA_", "NVIDIA_", "SLURM_", "JUPYTER", "IPYTHON"))
        and k not in ("PYTHONPATH", "LD_PRELOAD", "FAKE_NVML_SCENARIO")
    }
    env.update(
        AUTOGPU_SIMULATE="demo-4x",
        # a terminal wide enough for every column of %gpu status (a narrow one drops the UUID)
        COLUMNS="200",
        AUTOGPU_REGISTRY_DIR=str(tmp / "registry"),
        JUPYTER_CONFIG_DIR=str(tmp / "jupyter-config"),
        JUPYTER_DATA_DIR=str(tmp / "jupyter-data"),
        JUPYTER_RUNTIME_DIR=str(tmp / "jupyter-runtime"),
        JUPYTER_PLATFORM_DIRS="1",
        IPYTHONDIR=str(tmp / "ipython"),
        NO_COLOR="1",
    )
    return env


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel installed with ``pip install --target`` (packages, data files and scripts)."""
    target = tmp_path_factory.mktemp("installed") / "site"
    run(
        [sys.executable, *PIP_INSTALL.split(), "--target", str(target), str(wheel)],
        env=dict(os.environ),
        cwd=target.parent,
    )
    return target


def test_wheel_holds_exactly_the_package_the_lab_extension_and_the_server_config(
    wheel: Path,
) -> None:
    version = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    data = f"autogpu_jupyter-{version}.data/data"
    dist_info = f"autogpu_jupyter-{version}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        lab_package = json.loads(zf.read(f"{data}/{LAB_SHARE}/package.json"))
        install = json.loads(zf.read(f"{data}/{LAB_SHARE}/install.json"))
        server_config = json.loads(zf.read(f"{data}/{SERVER_CONFIG}"))

    assert wheel.name == f"autogpu_jupyter-{version}-py3-none-any.whl"

    # Python side: every module of both packages, nothing else (no tests, caches, sources of the
    # lab extension; the built lab extension goes to share/, not inside the package).
    package_files = {n for n in names if not n.startswith((data, dist_info))}
    on_disk = {
        f"{pkg}/{rel}"
        for pkg in ("autogpu", "autogpu_jupyter")
        for rel in files_under(ROOT / pkg)
        if "__pycache__" not in rel
        and not rel.startswith("labextension/")
        and not rel.endswith("ruff.toml")  # the layer rules, for development only
    }
    assert package_files == on_disk
    assert set(REQUIRED_MODULES) <= package_files
    assert {n for n in package_files if not n.endswith(".py")} == {"autogpu_jupyter/py.typed"}

    # Data side: the prebuilt lab extension exactly as built, plus install.json and the
    # server-config file that enables the server extension at install time.
    built = files_under(BUILT_LABEXTENSION)
    assert {"package.json", "static/style.js", "schemas/autogpu-jupyter/plugin.json"} <= built
    assert {n for n in names if n.startswith(data)} == {
        f"{data}/{LAB_SHARE}/{rel}" for rel in built
    } | {f"{data}/{LAB_SHARE}/install.json", f"{data}/{SERVER_CONFIG}"}
    assert lab_package["name"] == "autogpu-jupyter"
    assert lab_package["version"] == version
    remote_entry = lab_package["jupyterlab"]["_build"]["load"]
    assert re.fullmatch(r"static/remoteEntry\.[0-9a-f]+\.js", remote_entry)
    assert f"{data}/{LAB_SHARE}/{remote_entry}" in names
    assert install == {
        "packageManager": "python",
        "packageName": "autogpu-jupyter",
        "uninstallInstructions": "Use your Python package manager (pip, conda, etc.) to uninstall "
        "the package autogpu-jupyter",
    }
    assert server_config == {"ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}}}

    assert {n for n in names if n.startswith(dist_info)} - {
        n for n in names if n.startswith(f"{dist_info}/licenses/")
    } == {f"{dist_info}/{f}" for f in ("METADATA", "WHEEL", "entry_points.txt", "RECORD")}
    for junk in ("node_modules", ".venv", "tests/", "test_", "labextension/src", ".ts", ".pyc"):
        assert not [n for n in names if junk in n], junk


def test_wheel_metadata_version_and_entry_points(wheel: Path) -> None:
    version = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    built_version = json.loads((BUILT_LABEXTENSION / "package.json").read_text())["version"]
    dist_info = f"autogpu_jupyter-{version}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        metadata = Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
        version_py = zf.read("autogpu_jupyter/_version.py").decode()

    assert metadata["Name"] == "autogpu-jupyter"
    assert metadata["Version"] == version == built_version
    assert f'__version__ = VERSION = "{version}"' in version_py
    assert metadata["Requires-Python"] == ">=3.10"
    requires = [r.split(";")[0] for r in metadata.get_all("Requires-Dist")]
    assert "nvidia-ml-py>=12.535" in requires
    assert not [r for r in requires if r.startswith("pynvml")]
    assert {s: dict(entry_points[s]) for s in entry_points.sections()} == {
        "console_scripts": {"autogpu": "autogpu_jupyter.cli:main"},
        "jupyter_client.kernel_provisioners": {
            "autogpu-provisioner": "autogpu_jupyter.provisioner:AutoGPUProvisioner",
        },
    }


def check_shell_run(proc: subprocess.CompletedProcess[str], package_root: Path) -> None:
    """What ``%load_ext autogpu`` + ``%gpu status`` showed, and where the code came from."""
    report = json.loads(proc.stdout.splitlines()[-1])
    lines = report["status"].splitlines()
    assert lines[0] == "GPUs on this host — SIMULATED fleet (AUTOGPU_SIMULATE=demo-4x)"
    assert lines[1].split() == STATUS_COLUMNS.split()
    # One row per device (a long holders cell continues under its column on the next line).
    device_lines = [line for line in lines[2:-1] if re.match(r" +GPU \d ", line)]
    rows = [
        re.match(
            r" +GPU (\d) +(NVIDIA [\w-]+(?: [\w-]+)?) +(GPU-\w+) +\d+% +[\d.]+ \w+ / "
            r"(\d+\.\d GiB) ",
            line,
        )
        for line in device_lines
    ]
    assert [m.groups() if m else line for m, line in zip(rows, device_lines)] == DEMO_ROWS
    assert lines[-1] == "this kernel: no GPU picked yet (%gpu pick)"

    assert report["second_load_output"] == ""
    assert report["same_magics_after_second_load"] is True
    assert report["cell_magic"] is True
    assert report["loaded"] == ["autogpu", "autogpu_jupyter"]
    assert (
        report["version"]
        == json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    )
    modules = report["modules"]
    assert {"autogpu", "autogpu_jupyter", "autogpu_jupyter.magics"} <= set(modules)
    elsewhere = {
        name: path
        for name, path in modules.items()
        if path is not None and not Path(path).is_relative_to(package_root)
    }
    assert elsewhere == {}
    assert Path(modules["autogpu_jupyter"]) == package_root / "autogpu_jupyter" / "__init__.py"
    assert Path(modules["autogpu"]) == package_root / "autogpu" / "__init__.py"


def test_load_ext_autogpu_from_the_wheel(site: Path, tmp_path: Path) -> None:
    env = clean_env(tmp_path) | {"PYTHONPATH": str(site)}
    proc = run([sys.executable, "-c", SHELL_SCRIPT], env=env, cwd=tmp_path)
    check_shell_run(proc, site)


def test_console_script_from_the_wheel(site: Path, tmp_path: Path) -> None:
    env = clean_env(tmp_path) | {"PYTHONPATH": str(site)}
    script = site / "bin" / "autogpu"
    assert script.read_text().splitlines()[1:3] == [
        "import sys",
        "from autogpu_jupyter.cli import main",
    ]
    proc = run([sys.executable, str(script), "list"], env=env, cwd=tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "4 device(s) via simulated — SIMULATED fleet (AUTOGPU_SIMULATE), not real GPUs"
    )
    assert [line.split()[:2] for line in lines[2:6]] == [["GPU", str(i)] for i in range(4)]
    assert len(lines) == 6
    # The same script must import the wheel's copy, not the checkout's.
    where = run(
        [sys.executable, "-c", "import autogpu_jupyter.cli as c; print(c.__file__)"],
        env=env,
        cwd=tmp_path,
    )
    assert Path(where.stdout.strip()) == site / "autogpu_jupyter" / "cli.py"


def test_wheel_enables_the_lab_and_server_extensions(site: Path, tmp_path: Path) -> None:
    """``jupyter labextension list`` / ``jupyter server extension list``, as a user runs them,
    see the extension from the wheel's data files (no Node involved) enabled and OK."""
    env = clean_env(tmp_path) | {
        "PYTHONPATH": str(site),
        "JUPYTER_PATH": str(site / "share" / "jupyter"),
        # `server extension list` reads the user, sys-prefix and system config dirs; pointing the
        # user one at the wheel's etc/jupyter shows what the wheel alone enables.
        "JUPYTER_CONFIG_DIR": str(site / "etc" / "jupyter"),
    }
    version = json.loads((ROOT / "labextension" / "package.json").read_text())["version"]
    jupyter = str(Path(sys.executable).parent / "jupyter")
    procs = [
        subprocess.Popen(
            [jupyter, *args],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args in (["labextension", "list"], ["server", "extension", "list"])
    ]
    lab, server = (ANSI.sub("", p.communicate(timeout=120)[0]) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], lab + server

    lab_sections = lab.split("\n\n")
    ours = next(s for s in lab_sections if f"{site}/share/jupyter/labextensions" in s)
    assert ours.splitlines()[-2:] == [
        f"{site}/share/jupyter/labextensions",
        f"        autogpu-jupyter v{version} enabled OK (python, autogpu-jupyter)",
    ]
    assert lab.count("autogpu-jupyter v") == 1

    server_sections = server.split("\n\n")
    ours = next(s for s in server_sections if s.startswith(f"Config dir: {site}/etc/jupyter"))
    assert ours.splitlines() == [
        f"Config dir: {site}/etc/jupyter",
        "    autogpu_jupyter enabled",
        "    - Validating autogpu_jupyter...",
        f"      autogpu_jupyter {version} OK",
    ]


def test_load_ext_autogpu_from_the_editable_install(tmp_path: Path) -> None:
    """The set-up installs the checkout editable into the test environment; from a directory
    outside the checkout, with nothing on PYTHONPATH, the import goes through that install."""
    env = clean_env(tmp_path)
    show = run([sys.executable, "-m", "pip", "show", "autogpu-jupyter"], env=env, cwd=tmp_path)
    assert f"Editable project location: {ROOT}" in show.stdout.splitlines(), (
        "autogpu-jupyter is not installed editable from this checkout: run scripts/setup.sh "
        f"(or `pip install --no-deps -e {ROOT}`)\n{show.stdout}"
    )
    proc = run([sys.executable, "-c", SHELL_SCRIPT], env=env, cwd=tmp_path)
    check_shell_run(proc, ROOT)
