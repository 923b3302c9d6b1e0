"""Run mutmut over the whole package, one module, or a seeded sample (``make mutate``, issue 22).

mutmut 3 mutates every function of ``[tool.mutmut] only_mutate`` (pyproject.toml), runs the test
selection once with each function wrapped in a trampoline to learn which tests reach it, then for
each mutant runs only those tests in a child forked from its own process (the first failing test
kills it). A full run of the package is about ten thousand mutants; on a small machine that is a
night. So this script can narrow the run, and the score of a narrowed run says what it measured:

- ``--modules broker 'brokerd.*' cli``: every mutant of those modules (dotted names below the
  package, as ``scripts/mutation_score.py`` prints them; shell-style globs);
- ``--sample N [--seed S]``: a uniform random sample of N mutants of each module (all of them where
  a module has fewer), drawn with ``random.Random(f"{S}:{module}")`` from the sorted mutant names,
  so that one module's sample does not depend on which other modules are drawn. The sample's
  names are written to ``mutants/sample.txt``; ``scripts/mutation_score.py --sample`` scores those
  only, with a 95 % interval for the share killed;
- names or globs of mutmut's own (``autogpu_jupyter.cli.x_main__mutmut_3``,
  ``'autogpu_jupyter.core.units*'``) are handed to ``mutmut run`` as they are.

Without any of these, ``mutmut run`` over everything.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTANTS = REPO / "mutants"
SAMPLE_FILE = MUTANTS / "sample.txt"


def module_of(key: str) -> str:
    """``autogpu_jupyter.core.units.x_parse__mutmut_3`` -> ``core.units``;
    ``autogpu_jupyter.broker.xǁBrokerǁrevoke__mutmut_7`` -> ``broker``."""
    mod = []
    for p in key.split(".")[1:]:
        if p.startswith("x_") or p.startswith("xǁ"):
            break
        mod.append(p)
    return ".".join(m for m in mod if m != "__init__") or "__init__"


def generate() -> None:
    """Write mutants/ (the mutated copy of the package and its .meta files) without running a
    test: what the first step of ``mutmut run`` does. Unchanged files are kept as they are."""
    # mutmut only when generating: importing its __main__ sets the start method of multiprocessing
    from mutmut.__main__ import create_mutants  # noqa: PLC0415
    from mutmut.mutation.trampoline import set_mutant_under_test  # noqa: PLC0415
    from mutmut.utils.file_utils import (  # noqa: PLC0415
        copy_also_copy_files,
        copy_src_dir,
        setup_source_paths,
    )

    set_mutant_under_test("mutant_generation")
    MUTANTS.mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    create_mutants(2)


def all_mutants() -> dict[str, list[str]]:
    by_module: dict[str, list[str]] = defaultdict(list)
    for meta in sorted((MUTANTS / "autogpu_jupyter").rglob("*.py.meta")):
        for key in json.loads(meta.read_text())["exit_code_by_key"]:
            by_module[module_of(key)].append(key)
    return {m: sorted(keys) for m, keys in by_module.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="mutmut mutant names or globs, passed as they are")
    ap.add_argument("--modules", nargs="+", default=[], help="module names or globs (core.units)")
    ap.add_argument("--sample", type=int, default=0, help="N mutants per module, drawn at random")
    ap.add_argument("--seed", default="22", help="the sample's seed")
    ap.add_argument("--jobs", type=int, default=2, help="mutmut's --max-children")
    ap.add_argument("--list", action="store_true", help="print the mutant counts (or the sample)"
                    " and stop")
    args = ap.parse_args(argv)
    os.chdir(REPO)

    if args.names and (args.modules or args.sample):
        ap.error("mutant names and --modules/--sample are exclusive")
    selected: list[str] = list(args.names)
    if args.modules or args.sample or args.list:
        generate()
        mutants = all_mutants()
        modules = sorted(mutants)
        if args.modules:
            modules = [m for m in modules if any(fnmatch.fnmatch(m, g) for g in args.modules)]
            if not modules:
                known = ", ".join(sorted(mutants))
                print(f"no module matches {args.modules}; the modules are: {known}",
                      file=sys.stderr)
                return 2
        for m in modules:
            keys = mutants[m]
            if args.sample and len(keys) > args.sample:
                keys = sorted(random.Random(f"{args.seed}:{m}")  # noqa: S311 (a reproducible sample)
                              .sample(keys, args.sample))
            selected += keys
            if args.list:
                print(f"{m}: {len(keys)} of {len(mutants[m])}")
        if args.sample:
            SAMPLE_FILE.write_text("".join(k + "\n" for k in selected), encoding="utf-8")
            print(f"{len(selected)} mutants sampled (seed {args.seed}) -> {SAMPLE_FILE}")
        elif SAMPLE_FILE.exists():
            SAMPLE_FILE.unlink()
        if args.list:
            return 0
    mutmut = Path(sys.executable).with_name("mutmut")
    cmd = [str(mutmut), "run", "--max-children", str(args.jobs), *selected]
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
