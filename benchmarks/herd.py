"""Herd benchmark: N pickers released at the same instant on one fake host, per picking method.

Methods, side by side on the same fake fleet (the fake ``libnvidia-ml.so.1`` from
``tests/fakenvml``, read through the real pynvml binding by every method):

* ``autogpu``  – :func:`autogpu_jupyter.core.picker.pick` with the lease registry
  (``--min-free`` = the job's memory, so the lease books it);
* ``nvitop``   – ``nvitop.select_devices(min_count=1, max_count=1, min_free_memory=job)``;
* ``gputil``   – GPUtil's ``getAvailable(order='memory', limit=1)`` semantics: the GPU with the
  lowest ``memoryUtil`` (used / total), first index on ties (GPUtil itself shells out to
  nvidia-smi, which the fake does not provide, so its rule is reimplemented here over pynvml);
* ``setgpu``   – setGPU's choice via gpustat: ``min(memory.used)`` over
  ``gpustat.new_query()``, first index on ties.

Each run: N processes (forked from this one, a ``multiprocessing.Barrier`` releases them
together) pick; only when all have picked do they "allocate" their job memory in the fake (a
process entry added to the scenario under a file lock) — a new kernel uses no GPU memory until
it creates its CUDA context, which is the herd problem. A job that does not fit in the free
memory left on its GPU counts as an out-of-memory failure. Job size: 90 % of an even share
(``0.9 * gpus * 80 GiB / N``), so a perfect spread always fits and piling up does not.

Run::

    .venv/bin/python benchmarks/herd.py            # N = 8, 32, 128 on 4 and 8 GPUs
    .venv/bin/python benchmarks/herd.py --n 32 --gpus 4 --methods autogpu,nvitop
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 1024**3
TOTAL = 80 * GiB
METHODS = ("autogpu", "nvitop", "gputil", "setgpu")


def make_fleet(gpus: int) -> dict[str, Any]:
    return {
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": f"GPU-{i:08x}-beef-beef-beef-{i:012x}",
                "name": "NVIDIA A100-SXM4-80GB",
                "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0",
                "memory_total": TOTAL,
                "utilization_pct": 0,
                "processes": [],
            }
            for i in range(gpus)
        ],
    }


# ---- the four pickers (run in the worker processes) --------------------------------------------


def pick_autogpu(job: int, registry: str) -> tuple[int, Any]:
    from autogpu_jupyter.core.leases import Registry
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints
    from autogpu_jupyter.core.units import Size

    result = pick(Constraints(min_free=Size(bytes=job)), registry=Registry(registry))
    return result.chosen[0].index, result.lease  # the lease lives as long as the worker


def pick_nvitop(job: int, registry: str) -> tuple[int, Any]:
    from nvitop import select_devices

    chosen = select_devices(format="index", min_count=1, max_count=1, min_free_memory=job)
    return int(chosen[0]), None


def pick_gputil(job: int, registry: str) -> tuple[int, Any]:
    import pynvml

    pynvml.nvmlInit()
    utils = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        mem = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
        utils.append((mem.used / mem.total, i))
    return sorted(utils, key=lambda x: x[0])[0][1], None  # stable sort: first index on ties


def pick_setgpu(job: int, registry: str) -> tuple[int, Any]:
    import gpustat

    stats = gpustat.new_query()
    pairs = [(g.entry["index"], g.entry["memory.used"]) for g in stats]
    return int(min(pairs, key=lambda x: x[1])[0]), None


PICKERS = {"autogpu": pick_autogpu, "nvitop": pick_nvitop, "gputil": pick_gputil,
           "setgpu": pick_setgpu}


def allocate(state: Path, lock: Path, fake_dir: Path, index: int, job: int) -> bool:
    """Add this process's job to GPU ``index`` in the fake, if it fits; False = out of memory."""
    from tests.fakenvml import FakeNvml

    with open(lock, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fleet = json.loads(state.read_text())
        dev = fleet["devices"][index]
        used = sum(p["used_memory"] for p in dev["processes"])
        if used + job > TOTAL:
            return False
        dev["processes"].append({"pid": os.getpid(), "used_memory": job, "user": "bench",
                                 "command": "python job.py"})
        state.write_text(json.dumps(fleet))
        FakeNvml(fake_dir).write(fleet)
        return True


def worker(method: str, job: int, registry: str, state: Path, lock: Path, fake_dir: Path,
           go: Any, alloc: Any, out: Any, done: Any) -> None:
    import importlib

    # Each method's modules are imported before the gate opens (as in a running kernel);
    # NVML initialisation and everything else happen inside the timed pick, for every method.
    for mod in {"autogpu": ["autogpu_jupyter.core.picker", "autogpu_jupyter.core.leases",
                            "autogpu_jupyter.core.backends.nvml", "pynvml"],
                "nvitop": ["nvitop"],
                "gputil": ["pynvml"], "setgpu": ["gpustat"]}[method]:
        importlib.import_module(mod)
    if method == "autogpu" and os.environ.get("HERD_WARM") == "1":
        # --warm: NVML already initialised (a kernel whose sampler runs), as after %load_ext.
        from autogpu_jupyter.core.backends import get_backend

        get_backend().snapshot()
    go.wait()
    t0 = time.perf_counter()
    try:
        index, keep = PICKERS[method](job, registry)
        err = None
    except Exception as e:  # a picker that finds nothing: report it
        index, keep, err = -1, None, f"{type(e).__name__}: {e}"
    latency = time.perf_counter() - t0
    alloc.wait()
    ok = index >= 0 and allocate(state, lock, fake_dir, index, job)
    out.put({"index": index, "latency_s": latency, "ok": ok, "error": err})
    done.wait()
    del keep


def run(method: str, n: int, gpus: int, work: Path) -> dict[str, Any]:
    from tests.fakenvml import FakeNvml

    fake_dir = Path(os.environ["FAKE_NVML_DIR"])
    fleet = make_fleet(gpus)
    state = work / "state.json"
    state.write_text(json.dumps(fleet))
    FakeNvml(fake_dir).write(fleet)
    registry = work / f"registry-{method}-{n}-{gpus}"
    job = int(0.9 * gpus * TOTAL / n)
    ctx = mp.get_context("fork")
    go, alloc, done = ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(method, job, str(registry), state, work / "lock",
                                              fake_dir, go, alloc, out, done))
             for _ in range(n)]
    for p in procs:
        p.start()
    go.wait()  # every worker imported its library: release them together
    alloc.wait()  # every worker picked: now the jobs create their contexts
    results = [out.get(timeout=120) for _ in range(n)]
    done.wait()
    for p in procs:
        p.join(30)
    counts = [sum(1 for r in results if r["index"] == i) for i in range(gpus)]
    lat = sorted(r["latency_s"] for r in results)
    return {
        "method": method, "n": n, "gpus": gpus, "job_gib": round(job / GiB, 2),
        "counts": counts, "spread": max(counts) - min(counts),
        "oom": sum(1 for r in results if not r["ok"]),
        "errors": sorted({r["error"] for r in results if r["error"]})[:2],
        "latency_ms_median": round(statistics.median(lat) * 1e3, 1),
        "latency_ms_p95": round(lat[int(0.95 * (len(lat) - 1))] * 1e3, 1),
        "latency_ms_max": round(lat[-1] * 1e3, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="8,32,128")
    ap.add_argument("--gpus", default="4,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--warm", action="store_true",
                    help="initialise autogpu's NVML backend before the gate (a kernel whose "
                    "sampler already runs); by default every method initialises NVML in its pick")
    a = ap.parse_args()
    if a.warm:
        os.environ["HERD_WARM"] = "1"
    if "FAKE_NVML_DIR" not in os.environ:
        # The fake library must be on LD_LIBRARY_PATH when the interpreter starts: re-exec.
        from tests.fakenvml import FakeNvml, build_fake_nvml

        lib = build_fake_nvml()
        fake_dir = Path(tempfile.mkdtemp(prefix="herd-fake-"))
        fake = FakeNvml(fake_dir)
        fake.write({"devices": []})
        env = dict(os.environ)
        env.update(fake.env)
        env["FAKE_NVML_DIR"] = str(fake_dir)
        env.pop("AUTOGPU_SIMULATE", None)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        del lib
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="herd-") as tmp:
        for gpus in (int(x) for x in a.gpus.split(",")):
            for n in (int(x) for x in a.n.split(",")):
                for method in a.methods.split(","):
                    work = Path(tmp) / f"{method}-{n}-{gpus}"
                    work.mkdir()
                    rows.append(run(method, n, gpus, work))
                    if not a.json:
                        r = rows[-1]
                        print(f"{r['gpus']} GPUs  N={r['n']:<4} {r['method']:<8} "
                              f"per-GPU {r['counts']}  spread {r['spread']:<3} OOM {r['oom']:<4} "
                              f"pick ms median {r['latency_ms_median']:<6} p95 "
                              f"{r['latency_ms_p95']:<6} max {r['latency_ms_max']}"
                              + (f"  errors {r['errors']}" if r["errors"] else ""), flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"total {time.perf_counter() - t0:.1f} s")
    with contextlib.suppress(OSError):
        import shutil

        shutil.rmtree(os.environ["FAKE_NVML_DIR"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
