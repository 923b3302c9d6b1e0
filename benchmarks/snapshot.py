"""How long a full snapshot of every GPU takes: autogpu vs nvitop vs gpustat, same fake 8-GPU host.

Run from the repository root::

    .venv/bin/python benchmarks/snapshot.py            # 3 rounds x 300 snapshots per tool
    .venv/bin/python benchmarks/snapshot.py --reps 1000 --rounds 5

All three read the same fake ``libnvidia-ml.so.1`` (``tests/fakenvml``) through the same real
pynvml binding, with ``tests.fakenvml.fleet_8x()`` (4 x A100 + 4 x L4, six GPUs with a process each,
every process a real ``sleep`` so that ``/proc`` lookups are real too). Each tool runs in its own
interpreter (gpustat monkey-patches pynvml on import, which would slow the others), after NVML
init and a warm-up; the rounds alternate the tools so that load on the machine hits them alike.

What is timed per snapshot:

* autogpu: ``NvmlBackend().snapshot()`` (one backend, reused: what the sampler and pick do) - every
  field of ``DeviceSnapshot`` including processes with user and command;
* nvitop: ``[d.as_snapshot() for d in Device.all()]`` (its ``SNAPSHOT_KEYS``: ~45 fields, no
  processes);
* gpustat: ``gpustat.new_query()`` (init, every device with processes, shutdown); it sleeps
  0.1 s per GPU that has processes (to sample their CPU use), so it is also timed with those
  sleeps removed (``gpustat-nosleep``).

The fake answers in well under a microsecond, so this measures the Python side of each tool; on a
real driver every NVML call costs more, which favours the tool making fewer calls (reported too).
Goal: autogpu's median <= nvitop's (ratio <= 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = ("autogpu", "nvitop", "gpustat", "gpustat-nosleep")

WORKER = r"""
import ctypes, json, sys, time, warnings
warnings.simplefilter("ignore")
tool, reps = sys.argv[1], int(sys.argv[2])
lib = ctypes.CDLL("libnvidia-ml.so.1")
lib.fakenvml_total_calls.restype = ctypes.c_ulong
if tool == "autogpu":
    from autogpu_jupyter.core.backends.nvml import NvmlBackend
    backend = NvmlBackend()
    def once():
        return backend.snapshot()
    def count(r):
        return len(r.devices)
elif tool == "nvitop":
    from nvitop import Device
    def once():
        return [d.as_snapshot() for d in Device.all()]
    def count(r):
        return len(r)
else:
    import gpustat
    if tool == "gpustat-nosleep":
        # gpustat sleeps 0.1 s per GPU with processes (to sample their CPU use); without those
        # sleeps this is the cost of its NVML and psutil work alone.
        gpustat.core.time.sleep = lambda s: None
    def once():
        return gpustat.new_query()
    def count(r):
        return len(r.gpus)
for _ in range(20 if tool != "gpustat" else 1):
    result = once()
before = lib.fakenvml_total_calls()
once()
calls = lib.fakenvml_total_calls() - before
times = []
for _ in range(reps):
    t0 = time.perf_counter_ns()
    once()
    times.append(time.perf_counter_ns() - t0)
print(json.dumps({"tool": tool, "devices": count(result), "calls": calls, "times_ns": times}))
"""


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300, help="timed snapshots per tool and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (tools alternate)")
    parser.add_argument("--results", help="merge the ratio into this JSON file (make bench)")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from tests.fakenvml import FakeNvml, fleet_8x

    sleeper = subprocess.Popen(["sleep", "3600"])
    try:
        with tempfile.TemporaryDirectory(prefix="autogpu-bench-") as tmp:
            fake = FakeNvml(tmp)
            fleet = fleet_8x()
            for dev in fleet["devices"]:
                for proc in dev["processes"]:
                    proc["pid"] = sleeper.pid
            fake.write(fleet)
            env = fake.subprocess_env(PYTHONPATH=str(REPO))
            samples: dict[str, list[int]] = {t: [] for t in TOOLS}
            info: dict[str, dict[str, int]] = {}
            for _ in range(args.rounds):
                for tool in TOOLS:
                    # gpustat as-is takes ~0.1 s per busy GPU: a few snapshots tell enough
                    reps = args.reps if tool != "gpustat" else max(3, args.reps // 100)
                    out = subprocess.run(
                        [sys.executable, "-c", WORKER, tool, str(reps)],
                        env=env, capture_output=True, text=True, check=True, cwd=REPO,
                    )
                    res = json.loads(out.stdout.strip().splitlines()[-1])
                    samples[tool].extend(res["times_ns"])
                    info[tool] = {"devices": res["devices"], "calls": res["calls"]}
    finally:
        sleeper.kill()
        sleeper.wait()

    med = {t: statistics.median(samples[t]) / 1e3 for t in TOOLS}
    q = {t: statistics.quantiles(samples[t], n=10, method="inclusive") for t in TOOLS}
    print(f"# full snapshot of a fake 8-GPU host ({args.rounds} rounds x {args.reps} reps, "
          f"Python {sys.version.split()[0]}, nvidia-ml-py {_version('nvidia-ml-py')}, "
          f"nvitop {_version('nvitop')}, gpustat {_version('gpustat')}, "
          f"{time.strftime('%Y-%m-%d')})")
    print("| tool | median (us) | p10 (us) | p90 (us) | NVML calls / snapshot | devices | "
          "ratio vs nvitop |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for t in TOOLS:
        print(f"| {t} | {med[t]:.0f} | {q[t][0] / 1e3:.0f} | {q[t][-1] / 1e3:.0f} | "
              f"{info[t]['calls']} | {info[t]['devices']} | {med[t] / med['nvitop']:.2f} |")
    ratio = med["autogpu"] / med["nvitop"]
    verdict = "met" if ratio <= 1.0 else "NOT met"
    print(f"\nautogpu / nvitop = {ratio:.2f} (goal <= 1.0: {verdict})")
    sys.path.insert(0, str(REPO / "benchmarks"))
    from results import record

    record(args.results, {"snapshot.autogpu_vs_nvitop": ratio})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
