"""How many packages, and how many megabytes, each kind of install brings (issue 24).

Run from the repository root, after ``make dist`` (or give ``--wheel``)::

    .venv/bin/python benchmarks/install_size.py
    .venv/bin/python benchmarks/install_size.py --wheel dist/autogpu_jupyter-0.1.0-py3-none-any.whl

Each kind is installed with ``uv pip install`` into a fresh ``uv venv`` (this interpreter's
version, highest versions of every dependency, byte-compiled as pip does); the count is every
distribution installed, autogpu-jupyter included (a uv venv has no pip or setuptools), the size
that of ``site-packages``.

Kinds: the kernel (``autogpu-jupyter``: magics, API, panel, CLI, broker, exporter), the full
install (``autogpu-jupyter[lab]``: plus the server extension and JupyterLab), plain ``ipykernel``
for scale, and 0.1's dependency list (jupyter_server and jupyterlab in the base) for comparison.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UV = str(Path(sys.executable).parent / "uv")
#: The base dependencies of 0.1 (pyproject.toml before the split), for the comparison.
DEPENDENCIES_0_1 = [
    "nvidia-ml-py>=12.535", "ipython>=8.0", "ipykernel>=6.20", "ipywidgets>=8.0", "pandas>=1.5",
    "traitlets>=5.9", "jupyter_server>=2.4", "prometheus_client>=0.17", "jupyter_client>=8.0",
    "jupyterlab>=4.0,<5",
]


def measure(requirements: list[str], extra_args: list[str] | None = None) -> tuple[int, float]:
    """(distributions, MiB of site-packages) of a fresh venv with ``requirements`` installed."""
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([UV, "venv", "-q", "-p", sys.executable, str(venv)], check=True)
        python = str(venv / "bin" / "python")
        subprocess.run([UV, "pip", "install", "-q", "--compile-bytecode", "-p", python,
                        *requirements, *(extra_args or [])], check=True)
        listed = subprocess.run([UV, "pip", "list", "-p", python, "--format", "freeze"],
                                check=True, capture_output=True, text=True).stdout.split()
        (site,) = venv.glob("lib/python3.*/site-packages")
        size = sum(p.stat().st_size for p in site.rglob("*") if p.is_file() and not p.is_symlink())
        return len(listed), size / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help="the wheel (default: the one in dist/)")
    args = parser.parse_args(argv)
    wheel = args.wheel or next(iter(sorted((REPO / "dist").glob("autogpu_jupyter-*.whl"))), None)
    if wheel is None or shutil.which(UV) is None:
        print("needs a wheel (make dist) and uv (make setup)", file=sys.stderr)
        return 2
    kinds = {
        "kernel: autogpu-jupyter": ([str(wheel)], None),
        "full: autogpu-jupyter[lab]": ([f"{wheel}[lab]"], None),
        "plain ipykernel (for scale)": (["ipykernel"], None),
        "0.1's dependencies (+ autogpu)": (DEPENDENCIES_0_1, None),
    }
    print(f"python {sys.version.split()[0]}, {wheel.name}")
    print(f"{'install':34} {'packages':>8} {'MiB':>7}")
    for name, (reqs, extra) in kinds.items():
        count, mib = measure(reqs, extra)
        if name.startswith("0.1"):
            count += 1  # autogpu-jupyter itself
        print(f"{name:34} {count:8d} {mib:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
