"""The sample outputs in README.md and docs/usage.md, produced by running them.

    .venv/bin/python scripts/readme_samples.py           # print them
    .venv/bin/python scripts/readme_samples.py --write   # update the pages

Each sample sits between ``<!-- sample: NAME -->`` and ``<!-- end sample: NAME -->`` in a page,
as a fenced block. The commands run as a user runs them (IPython with ``%load_ext autogpu``, the
``autogpu`` command at 80 columns) on the simulated fleet ``make lab`` starts (``demo-4x``),
stopped at one instant (:data:`SAMPLE_AT`) so that every run shows the same load, with a private
lease registry. ``tests/processes/test_readme.py`` runs them again and compares,
lease ids aside (a new one each run).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The instant (Unix seconds) at which demo-4x's moving load is stopped for the samples.
SAMPLE_AT = 1_000_000.0
PAGES = (ROOT / "README.md", ROOT / "docs" / "usage.md")
LEASE_ID = re.compile(r"\b[0-9a-f]{32}\b")

#: name -> (the command as the page shows it, how to run it)
_PICK = (
    "get_ipython().run_line_magic('load_ext', 'autogpu'); "
    "get_ipython().run_line_magic('gpu', 'pick --min-free 10G')"
)


def _fleet(tmp: str) -> str:
    """demo-4x, stopped at :data:`SAMPLE_AT`, as a fleet file in ``tmp``."""
    sys.path.insert(0, str(ROOT))
    from autogpu_jupyter.core.backends.simulated import builtin_fleet, fleet_at  # noqa: PLC0415

    path = Path(tmp) / "demo-4x.json"
    path.write_text(json.dumps(fleet_at(builtin_fleet("demo-4x"), SAMPLE_AT)))
    return str(path)


def _env(registry: str, fleet: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AUTOGPU_", "CUDA_", "NVIDIA_", "SLURM_", "JPY_"))}
    env.update(AUTOGPU_SIMULATE=fleet, AUTOGPU_REGISTRY_DIR=registry, COLUMNS="80",
               PYTHONPATH=str(ROOT))
    return env


def _run(args: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                         check=False, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stdout}{out.stderr}")
    return out.stdout.rstrip("\n")


def samples() -> dict[str, str]:
    """Every sample's text, freshly run."""
    with tempfile.TemporaryDirectory(prefix="autogpu-readme-") as tmp:
        env = _env(str(Path(tmp) / "registry"), _fleet(tmp))
        python = sys.executable
        return {
            "pick": _run([python, "-m", "IPython", "--quick", "--no-banner",
                          "--colors=NoColor", "-c", _PICK], env),
            "list": _run([python, "-m", "autogpu_jupyter.cli", "list"], env),
        }


def normalized(text: str) -> str:
    """``text`` with what changes from run to run (lease ids) spelled the same."""
    return LEASE_ID.sub("<lease id>", text)


def blocks(page: str) -> dict[str, str]:
    """The samples a page shows, by name (the text inside each fenced block)."""
    found = re.finditer(
        r"<!-- sample: (\w+) -->\n```\w*\n(.*?)\n```\n<!-- end sample: \1 -->", page, re.S
    )
    return {m.group(1): m.group(2) for m in found}


def render(page: str, fresh: dict[str, str]) -> str:
    """``page`` with each sample replaced by its fresh text."""
    def repl(m: re.Match[str]) -> str:
        name = m.group(1)
        text = fresh.get(name, m.group(3))
        return f"<!-- sample: {name} -->\n```{m.group(2)}\n{text}\n```\n<!-- end sample: {name} -->"

    return re.sub(
        r"<!-- sample: (\w+) -->\n```(\w*)\n(.*?)\n```\n<!-- end sample: \1 -->", repl, page,
        flags=re.S,
    )


def main(argv: list[str]) -> int:
    fresh = samples()
    if "--write" in argv:
        for page in PAGES:
            page.write_text(render(page.read_text(), fresh))
            print(f"updated {page.relative_to(ROOT)}")
        return 0
    for name, text in fresh.items():
        print(f"--- {name}\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
