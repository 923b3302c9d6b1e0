"""What ``import autogpu_jupyter`` (and the ``%load_ext autogpu`` shim) costs over bare Python.

Run from the repository root::

    .venv/bin/python benchmarks/import_time.py            # 40 runs of each, interleaved
    .venv/bin/python benchmarks/import_time.py --runs 100

Each command runs as a fresh ``python -c`` (wall time of the whole process, medians over the
runs, the commands interleaved so machine load hits them alike). It also reports whether the
import pulled in the heavy modules that must stay lazy (pandas, ipywidgets, pynvml, IPython,
tornado). Goal: none of them imported, and under 30 ms over a bare interpreter.
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
COMMANDS = {
    "bare": "pass",
    "import autogpu_jupyter": "import autogpu_jupyter",
    "import autogpu": "import autogpu",
}


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

    bare = statistics.median(times["bare"]) * 1e3
    print(f"# import cost ({args.runs} runs each, Python {sys.version.split()[0]}, "
          f"{time.strftime('%Y-%m-%d')})")
    print("| command | median (ms) | over bare (ms) |")
    print("|---|---:|---:|")
    worst = 0.0
    for name in COMMANDS:
        med = statistics.median(times[name]) * 1e3
        over = med - bare
        if name != "bare":
            worst = max(worst, over)
        print(f"| python -c {COMMANDS[name]!r} | {med:.1f} | {over:+.1f} |")
    heavy = [m for m, present in loaded.items() if present]
    print(f"\nheavy modules imported by `import autogpu_jupyter, autogpu`: "
          f"{', '.join(heavy) if heavy else 'none'} (checked: {', '.join(HEAVY)})")
    ok = not heavy and worst < 30.0
    print(f"goal (no heavy module, < 30 ms over bare): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
