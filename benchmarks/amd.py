"""Snapshot and pick cost on a fake 8-GPU AMD host beside the same on a fake 8-GPU NVIDIA host.

    .venv/bin/python benchmarks/amd.py [--reps 300] [--rounds 3] [--json]

Each vendor runs in its own interpreter, through its real binding over its fake library:

* NVIDIA: ``NvmlBackend`` over ``tests/fakenvml`` (``fleet_8x``: 4 x A100 + 4 x L4) via pynvml;
* AMD: ``AmdSmiBackend`` over ``tests/fakeamdsmi`` (``fleet_amd_8x``: 4 x MI300X + 4 x MI210)
  via AMD's ``amdsmi`` package;

with six GPUs holding a process each (a real ``sleep``, so the ``/proc`` lookups are real).
Timed after init and a warm-up: a full snapshot (``backend.snapshot()``, one backend reused, as
the sampler does) and a pick (``api.pick_result`` of ``--min-free 10G --max-util 50``, lease on a
fresh registry, then released). The rounds alternate the vendors so that load on the machine hits
both alike. The fakes answer in well under a microsecond, so this measures the Python side (the
bindings' own wrappers included) and reports each library's calls per snapshot: on real drivers
every call costs more. Results in docs/benchmarks.md, as ratios AMD / NVIDIA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENDORS = ("nvidia", "amd")

WORKER = r"""
import ctypes, json, os, sys, time
vendor, reps = sys.argv[1], int(sys.argv[2])
if vendor == "amd":
    from autogpu_jupyter.core.backends.amdsmi import AmdSmiBackend as B
    lib = ctypes.CDLL("libamd_smi.so"); total = lib.fakeamdsmi_total_calls
else:
    from autogpu_jupyter.core.backends.nvml import NvmlBackend as B
    lib = ctypes.CDLL("libnvidia-ml.so.1"); total = lib.fakenvml_total_calls
total.restype = ctypes.c_ulong
from autogpu_jupyter import api
from autogpu_jupyter.config import default_settings
from autogpu_jupyter.core import backends, session
opts = api.pick_options(default_settings(), {"min_free": "10G", "max_util": 50})
backend = B()
assert backends.get_backend().name == backend.name
for _ in range(20):
    snap = backend.snapshot()
before = total(); backend.snapshot(); calls = total() - before
snaps = []
for _ in range(reps):
    t0 = time.perf_counter_ns(); backend.snapshot(); snaps.append(time.perf_counter_ns() - t0)
for _ in range(5):
    api.pick_result(opts); session.release()
picks = []
for _ in range(max(1, reps // 3)):
    t0 = time.perf_counter_ns()
    result = api.pick_result(opts)
    picks.append(time.perf_counter_ns() - t0)
    session.release()
print(json.dumps({"vendor": vendor, "devices": len(snap.devices), "calls": calls,
                  "snapshot_ns": snaps, "pick_ns": picks,
                  "chosen": result[0].chosen[0].name}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--results", help="merge the ratios into this JSON file (make bench)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from tests.fakeamdsmi import FakeAmdSmi, fleet_amd_8x
    from tests.fakenvml import FakeNvml, fleet_8x

    sleeper = subprocess.Popen(["sleep", "3600"])
    try:
        with tempfile.TemporaryDirectory(prefix="autogpu-bench-amd-") as tmp:
            envs = {}
            nv, nv_fleet = FakeNvml(Path(tmp) / "nvml"), fleet_8x()
            amd, amd_fleet = FakeAmdSmi(Path(tmp) / "amd"), fleet_amd_8x()
            for fleet in (nv_fleet, amd_fleet):
                for dev in fleet["devices"]:
                    for proc in dev["processes"]:
                        proc["pid"] = sleeper.pid
            nv.write(nv_fleet)
            amd.write(amd_fleet)
            common = {"PYTHONPATH": str(REPO), "AUTOGPU_BACKEND": "",
                      "AUTOGPU_REGISTRY_DIR": str(Path(tmp) / "registry")}
            envs["nvidia"] = nv.subprocess_env(**common)
            envs["amd"] = amd.subprocess_env(**common)
            snaps: dict[str, list[int]] = {v: [] for v in VENDORS}
            picks: dict[str, list[int]] = {v: [] for v in VENDORS}
            info: dict[str, dict[str, object]] = {}
            for _ in range(args.rounds):
                for vendor in VENDORS:
                    out = subprocess.run([sys.executable, "-c", WORKER, vendor, str(args.reps)],
                                         env=envs[vendor], capture_output=True, text=True,
                                         check=True, cwd=REPO)
                    data = json.loads(out.stdout.strip().splitlines()[-1])
                    snaps[vendor] += data["snapshot_ns"]
                    picks[vendor] += data["pick_ns"]
                    info[vendor] = {"devices": data["devices"], "calls": data["calls"],
                                    "chosen": data["chosen"]}
    finally:
        sleeper.kill()
        sleeper.wait()

    def ms(values: list[int]) -> float:
        return round(statistics.median(values) / 1e6, 3)

    result = {
        "reps": args.reps, "rounds": args.rounds,
        "snapshot_median_ms": {v: ms(snaps[v]) for v in VENDORS},
        "pick_median_ms": {v: ms(picks[v]) for v in VENDORS},
        "library_calls_per_snapshot": {v: info[v]["calls"] for v in VENDORS},
        "chosen": {v: info[v]["chosen"] for v in VENDORS},
    }
    result["ratio_amd_vs_nvidia"] = {
        "snapshot": round(ms(snaps["amd"]) / ms(snaps["nvidia"]), 2),
        "pick": round(ms(picks["amd"]) / ms(picks["nvidia"]), 2),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results import record

    record(args.results, {
        "amd.snapshot_amd_vs_nvidia": result["ratio_amd_vs_nvidia"]["snapshot"],
        "amd.pick_amd_vs_nvidia": result["ratio_amd_vs_nvidia"]["pick"],
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
