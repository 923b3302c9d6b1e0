"""The mutation score per module from mutmut's results (``make mutate``, issues 15 and 22).

Reads ``mutants/autogpu_jupyter/**.py.meta`` (mutmut 3's per-file results) and
``tests/mutation_equivalent.txt`` (the survivors judged equivalent, one per line: the mutant's
name, then the reason), and prints per module: mutants, killed, survived, not reached, equivalent,
and the share of the non-equivalent mutants that are killed. A timeout or a crash of the test run
counts as killed (the tests noticed the change); a mutant no fast test reaches counts as not
killed. ``--min 95`` exits 1 below that share.

``--sample mutants/sample.txt`` (written by ``scripts/mutation_run.py --sample N``) scores only the
sampled mutants, and adds a 95 % (Wilson) interval for each module's share: the share of a random
sample estimates the module's score, and the interval says how far off it may be. Modules of which
no mutant was checked are left out of the table.

A line of the equivalents file that names a checked mutant which no longer survives is reported as
stale (the code moved, or a test now kills it) so that the list is kept true.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KILLED = {1, 3, 36, 24, -24, 152, 255, -11, -9, 37}
SURVIVED = {0}
NOT_REACHED = {5, 33}


def load_equivalents(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            sys.exit(f"{path}:{n}: {name!r} has no reason (a line is: mutant-name reason)")
        out[name] = reason.strip()
    return out


def module_of(key: str) -> str:
    # autogpu_jupyter.core.backends.nvml.x_func__mutmut_3 -> core.backends.nvml
    # autogpu_jupyter.broker.xǁBrokerǁrevoke__mutmut_7 -> broker
    mod = []
    for p in key.split(".")[1:]:
        if p.startswith("x_") or p.startswith("xǁ"):
            break
        mod.append(p)
    return ".".join(m for m in mod if m != "__init__") or "__init__"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a share k/n, in percent."""
    if n == 0:
        return (0.0, 100.0)
    p = k / n
    denom = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (100 * max(0.0, mid - half), 100 * min(1.0, mid + half))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mutants", type=Path, nargs="+", default=[REPO / "mutants"],
                    help="mutmut's result folder(s); with several (narrowed runs of different"
                    " modules), each module's results come from the first folder that checked it")
    ap.add_argument("--equivalents", type=Path, default=REPO / "tests" / "mutation_equivalent.txt")
    ap.add_argument("--min", type=float, default=None, help="exit 1 below this percentage")
    ap.add_argument("--survivors", action="store_true", help="list every non-equivalent survivor")
    ap.add_argument("--sample", type=Path, default=None,
                    help="score only the mutants named in this file (one per line)")
    args = ap.parse_args(argv)
    sample: set[str] | None = None
    if args.sample is not None:
        sample = set(args.sample.read_text(encoding="utf-8").split())

    # Per module, the results of the first folder that checked any of its mutants (with several
    # folders, each from a run narrowed to some modules on its own branch, a module's mutant names
    # are those of the branch that ran it).
    codes_by_key: dict[str, int | None] = {}
    owner: dict[str, Path] = {}
    for folder in args.mutants:
        root = folder / "autogpu_jupyter"
        metas = sorted(root.rglob("*.py.meta"))
        if not metas:
            print(f"no mutmut results under {root}: run `make mutate` first", file=sys.stderr)
            return 2
        by_module: dict[str, dict[str, int | None]] = defaultdict(dict)
        for meta in metas:
            for key, code in json.loads(meta.read_text())["exit_code_by_key"].items():
                if sample is None or key in sample:
                    by_module[module_of(key)][key] = code
        for mod, codes in by_module.items():
            checked = any(code is not None for code in codes.values())
            if mod not in owner and (checked or folder == args.mutants[-1]):
                owner[mod] = folder
                codes_by_key.update(codes)
    equivalents = load_equivalents(args.equivalents)
    rows: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    survivors: list[str] = []
    status_of: dict[str, str] = {}
    for key, code in codes_by_key.items():
        if sample is not None and code is None:
            continue  # drawn but not run (an interrupted run): not part of the estimate
        row = rows[module_of(key)]
        row["mutants"] += 1
        if code in KILLED:
            status = "killed"
        elif code in SURVIVED:
            status = "equivalent" if key in equivalents else "survived"
        elif code in NOT_REACHED:
            status = "not reached"
        elif code is None:
            status = "not checked"
        else:
            status = "other"
        status_of[key] = status
        row[status] += 1
        if status in ("survived", "not reached", "not checked", "other"):
            survivors.append(key)
    if len(args.mutants) > 1:
        for mod in sorted(owner):
            print(f"{mod}: results from {owner[mod]}")
        print()

    cols = ["mutants", "killed", "survived", "not reached", "not checked", "equivalent"]
    total: dict[str, int] = defaultdict(int)
    extra = " 95 % interval |" if sample is not None else ""
    print(f"| module | {' | '.join(cols)} | killed of non-equivalent |{extra}")
    print("|---|" + "---:|" * (len(cols) + 1 + bool(extra)))

    def share(r: dict[str, int]) -> float:
        denom = r["mutants"] - r["equivalent"]
        return 100.0 * r["killed"] / denom if denom else 100.0

    def shown(r: dict[str, int]) -> str:
        # rounded down, so that one survivor in 10,000 never reads as 100 %
        text = f"{math.floor(share(r) * 100) / 100:.2f} %"
        if sample is not None:
            lo, hi = wilson(r["killed"], r["mutants"] - r["equivalent"])
            text += f" | {lo:.0f}-{hi:.0f} %"
        return text

    for mod in sorted(rows):
        r = rows[mod]
        for c in cols:
            total[c] += r[c]
        print(f"| {mod} | {' | '.join(str(r[c]) for c in cols)} | {shown(r)} |")
    cells = " | ".join(str(total[c]) for c in cols)
    label = "all sampled" if sample is not None else "all"
    print(f"| **{label}** | {cells} | **{shown(total)}** |")

    # An entry is stale when its mutant was checked and did not survive (or no longer exists in a
    # full run); entries of mutants this run did not check are unknown, not stale.
    stale = [k for k in equivalents
             if (k in status_of and status_of[k] not in ("equivalent", "not checked"))
             or (sample is None and k not in status_of)]
    if stale:
        name = args.equivalents.name
        print(f"\n{len(stale)} stale line(s) in {name} (not a surviving mutant now):")
        for k in stale:
            print(f"  {k}: {status_of.get(k, 'no such mutant')}")
    if args.survivors:
        print(f"\n{len(survivors)} mutants not killed and not judged equivalent:")
        for k in survivors:
            print(f"  {k}: {status_of[k]}")
    if args.min is not None and share(total) < args.min:
        print(f"\n{share(total):.1f} % is below the goal of {args.min:g} %", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
