"""What ``import autogpu_jupyter`` (and the ``%load_ext autogpu`` shim) costs over bare Python,
and what ``%load_ext autogpu`` costs in an IPython shell over the shell alone.

Run from the repository root::

    .venv/bin/python benchmarks/import_time.py            # 40 runs of each, interleaved
    .venv/bin/python benchmarks/import_time.py --runs 100

Each command runs as a fresh ``python -c`` (wall time of the whole process, medians over the
runs, the commands interleaved so machine load hits them alike). It also reports whether the
import pulled in the heavy modules that must stay lazy (pandas, ipywidgets, pynvml, IPython,
tornado). Goal: none of them imported, and under 30 ms over a bare interpreter.
``%load_ext autogpu`` is measured the same way (a fresh process that creates an
``InteractiveShell`` and loads the extension, against one that only creates the shell); its
goal: no heavy module beyond IPython's own, and no lease store (``core.leasing``'s directory or
broker client) or pick machinery imported until a magic runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("pandas", "ipywidgets", "pynvml", "IPython", "tornado", "numpy")
_SHELL = (
    "from IPython.core.interactiveshell import InteractiveShell; s = InteractiveShell.instance()"
)
COMMANDS = {
    "bare": "pass",
    "import autogpu_jupyter": "import autogpu_jupyter",
    "import autogpu": "import autogpu",
    "IPython shell": _SHELL,
    "%load_ext autogpu": f"{_SHELL}; s.run_line_magic('load_ext', 'autogpu')",
}
#: Modules a ``%load_ext autogpu`` must not import (they come with the first pick or panel).
LAZY_AT_LOAD = ("pandas", "ipywidgets", "pynvml", "numpy", "autogpu_jupyter.core.leasing.directory",
                "autogpu_jupyter.core.leasing.brokerclient", "autogpu_jupyter.core.picker",
                "autogpu_jupyter.api")


def _run(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs of each command")
    args = parser.parse_args(argv)

    for code in COMMANDS.values():  # warm the file cache
        _run(code)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, code in COMMANDS.items():
            times[name].append(_run(code))

    probe = (
        "import json, sys, autogpu_jupyter, autogpu; "
        f"print(json.dumps({{m: m in sys.modules for m in {list(HEAVY)!r}}}))"
    )
    loaded = json.loads(
        subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True,
                       cwd=REPO).stdout
    )

    probe_load = (
        f"import json, sys; {COMMANDS['%load_ext autogpu']}; "
        f"print(json.dumps({{m: m in sys.modules for m in {list(LAZY_AT_LOAD)!r}}}))"
    )
    at_load = json.loads(
        subprocess.run([sys.executable, "-c", probe_load], check=True, capture_output=True,
                       text=True, cwd=REPO).stdout.splitlines()[-1]
    )

    bare = statistics.median(times["bare"]) * 1e3
    print(f"# import cost ({args.runs} runs each, Python {sys.version.split()[0]}, "
          f"{time.strftime('%Y-%m-%d')})")
    print("| command | median (ms) | over bare (ms) |")
    print("|---|---:|---:|")
    worst = 0.0
    for name in COMMANDS:
        med = statistics.median(times[name]) * 1e3
        over = med - bare
        if name in ("import autogpu_jupyter", "import autogpu"):
            worst = max(worst, over)
        print(f"| {name} | {med:.1f} | {over:+.1f} |")
    shell = statistics.median(times["IPython shell"]) * 1e3
    load = statistics.median(times["%load_ext autogpu"]) * 1e3
    print(f"\n%load_ext autogpu over the IPython shell alone: {load - shell:+.1f} ms")
    heavy = [m for m, present in loaded.items() if present]
    print(f"\nheavy modules imported by `import autogpu_jupyter, autogpu`: "
          f"{', '.join(heavy) if heavy else 'none'} (checked: {', '.join(HEAVY)})")
    lazy = [m for m, present in at_load.items() if present]
    print(f"imported by %load_ext autogpu that must wait for the first pick: "
          f"{', '.join(lazy) if lazy else 'none'} (checked: {', '.join(LAZY_AT_LOAD)})")
    ok = not heavy and not lazy and worst < 30.0
    print(f"goal (no heavy module, nothing lazy at load, < 30 ms over bare): "
          f"{'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
