"""Herd benchmark: N pickers released at the same instant on one fake host, per picking method.

Methods, side by side on the same fake fleet (the fake ``libnvidia-ml.so.1`` from
``tests/fakenvml``, read through the real pynvml binding by every method):

* ``autogpu``  – :func:`autogpu_jupyter.core.picker.pick` with the lease registry
  (``--min-free`` = the job's memory, so the lease books it), cold: NVML is initialised inside
  the timed pick, as for every other method;
* ``autogpu-warm`` – the same, with NVML initialised before the gate (a kernel whose sampler
  already runs, or any second pick of a kernel);
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

Latency, three views. The N workers block on a shared ``flock`` gate that the benchmark holds
and then drops, so the kernel wakes them all at once, like kernels started together.
``pick call`` is the pick function's own duration in its process (from its return from the gate:
NVML start-up, queueing for the registry lock, the critical section). ``from gate`` is measured
from the instant the gate opened to the pick's return (``CLOCK_MONOTONIC`` is one clock for every
process), so it also counts the wait for a CPU: 128 processes woken on 2 cores do not all run at
once. For autogpu the benchmark also times the critical section alone (``service``: from holding
the registry lock to the end of the transaction: snapshot, scan of the live leases, rank, lease
write), through a :class:`DirectoryStore` subclass that only records two timestamps; it checks that
no two critical sections overlap. The pick is serialised by that lock (that is what makes it
herd-safe), so the last of N simultaneous pickers waits for about N service times: ``serial`` is
their sum.

Run::

    .venv/bin/python benchmarks/herd.py            # N = 8, 32, 128 on 4 and 8 GPUs (~2 min)
    .venv/bin/python benchmarks/herd.py --n 32 --gpus 4 --methods autogpu,nvitop
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
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
METHODS = ("autogpu", "autogpu-warm", "nvitop", "gputil", "setgpu")


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


#: perf_counter() when this process got / released the registry lock (autogpu only).
LOCK_TIMES: dict[str, float] = {}


def _timed_registry(path: str) -> Any:
    """A :class:`DirectoryStore` that records when it holds the lock; nothing else differs."""
    from autogpu_jupyter.core.leasing import DirectoryStore

    class TimedRegistry(DirectoryStore):
        def _acquire(self, top_fd: int) -> None:
            super()._acquire(top_fd)
            LOCK_TIMES["acquired"] = time.perf_counter()

        @contextlib.contextmanager
        def locked(self) -> Any:
            with super().locked() as txn:
                try:
                    yield txn
                finally:  # the transaction is over; what is left is closing the two fds
                    LOCK_TIMES["released"] = time.perf_counter()

    return TimedRegistry(path)


def pick_autogpu(job: int, registry: str) -> tuple[int, Any]:
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints
    from autogpu_jupyter.core.units import Size

    result = pick(
        PickOptions(Constraints(min_free=Size(bytes=job))), store=_timed_registry(registry)
    )
    if result.lease is None:
        raise RuntimeError(f"no lease: {result.lease_note}")
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


PICKERS = {"autogpu": pick_autogpu, "autogpu-warm": pick_autogpu, "nvitop": pick_nvitop,
           "gputil": pick_gputil, "setgpu": pick_setgpu}
MODULES = {"autogpu": ["autogpu_jupyter.core.picker", "autogpu_jupyter.core.leasing",
                       "autogpu_jupyter.core.backends.nvml", "pynvml"],
           "nvitop": ["nvitop"], "gputil": ["pynvml"], "setgpu": ["gpustat"]}
MODULES["autogpu-warm"] = MODULES["autogpu"]


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
           ready: Any, gate: Path, alloc: Any, out: Any, done: Any) -> None:
    import importlib

    # Each method's modules are imported before the gate opens (as in a running kernel; the
    # parent imported them before forking); NVML initialisation and everything else happen
    # inside the timed pick, for every method except autogpu-warm.
    for mod in MODULES[method]:
        importlib.import_module(mod)
    if method == "autogpu-warm":
        # NVML already initialised (a kernel whose sampler runs, or a kernel's second pick).
        from autogpu_jupyter.core.backends import get_backend

        get_backend().snapshot()
    gate_fd = os.open(gate, os.O_RDONLY)
    ready.wait()
    fcntl.flock(gate_fd, fcntl.LOCK_SH)  # the parent holds LOCK_EX until it opens the gate
    t0 = time.perf_counter()
    try:
        index, keep = PICKERS[method](job, registry)
        err = None
    except Exception as e:  # a picker that finds nothing: report it
        index, keep, err = -1, None, f"{type(e).__name__}: {e}"
    t1 = time.perf_counter()
    service = None
    if "acquired" in LOCK_TIMES and "released" in LOCK_TIMES:
        service = LOCK_TIMES["released"] - LOCK_TIMES["acquired"]
    alloc.wait()
    ok = index >= 0 and allocate(state, lock, fake_dir, index, job)
    os.close(gate_fd)
    out.put({"index": index, "latency_s": t1 - t0, "service_s": service, "ok": ok, "error": err,
             "t0": t0, "t1": t1, "acquired": LOCK_TIMES.get("acquired"),
             "released": LOCK_TIMES.get("released")})
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
    ready, alloc, done = ctx.Barrier(n + 1), ctx.Barrier(n + 1), ctx.Barrier(n + 1)
    gate = work / "gate"
    gate_fd = os.open(gate, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(gate_fd, fcntl.LOCK_EX)
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(method, job, str(registry), state, work / "lock",
                                              fake_dir, ready, gate, alloc, out, done))
             for _ in range(n)]
    for p in procs:
        p.start()
    ready.wait()  # every worker imported its library and is about to block on the gate
    time.sleep(0.2)  # ... and now blocks there
    t_gate = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the host
    fcntl.flock(gate_fd, fcntl.LOCK_UN)  # the kernel wakes every waiter at once
    os.close(gate_fd)
    alloc.wait()  # every worker picked: now the jobs create their contexts
    results = [out.get(timeout=120) for _ in range(n)]
    done.wait()
    for p in procs:
        p.join(30)
    counts = [sum(1 for r in results if r["index"] == i) for i in range(gpus)]
    lat = sorted(r["latency_s"] for r in results)  # the pick call itself, in its process
    e2e = sorted(r["t1"] - t_gate for r in results)  # from the gate opening: also CPU queueing
    svc = sorted(r["service_s"] for r in results if r["service_s"] is not None)
    # perf_counter() is CLOCK_MONOTONIC, one clock for every process of the host.
    held = sorted((r["acquired"], r["released"]) for r in results if r["acquired"] is not None)
    overlaps = sum(1 for a, b in itertools.pairwise(held) if b[0] < a[1] - 1e-3)
    return {
        "method": method, "n": n, "gpus": gpus, "job_gib": round(job / GiB, 2),
        "counts": counts, "spread": max(counts) - min(counts),
        "oom": sum(1 for r in results if not r["ok"]),
        "errors": sorted({r["error"] for r in results if r["error"]})[:2],
        "latency_ms_median": round(statistics.median(lat) * 1e3, 1),
        "latency_ms_p95": round(lat[int(0.95 * (len(lat) - 1))] * 1e3, 1),
        "latency_ms_max": round(lat[-1] * 1e3, 1),
        "e2e_ms_median": round(statistics.median(e2e) * 1e3, 1),
        "e2e_ms_p95": round(e2e[int(0.95 * (len(e2e) - 1))] * 1e3, 1),
        "e2e_ms_max": round(e2e[-1] * 1e3, 1),
        "service_ms_median": round(statistics.median(svc) * 1e3, 2) if svc else None,
        "service_ms_p95": round(svc[int(0.95 * (len(svc) - 1))] * 1e3, 2) if svc else None,
        "service_ms_max": round(svc[-1] * 1e3, 2) if svc else None,
        "service_ms_sum": round(sum(svc) * 1e3, 1) if svc else None,
        "gate_spread_ms": round((max(r["t0"] for r in results) - t_gate) * 1e3, 1),
        "lock_overlaps": overlaps if held else None,
    }


def _fmt_row(r: dict[str, Any]) -> str:
    svc = ""
    if r["service_ms_median"] is not None:
        svc = (f"  service ms median {r['service_ms_median']} p95 {r['service_ms_p95']} "
               f"max {r['service_ms_max']} serial {r['service_ms_sum']}")
    return (f"{r['gpus']} GPUs  N={r['n']:<4} {r['method']:<13} per-GPU {r['counts']}  "
            f"spread {r['spread']:<3} OOM {r['oom']:<4} pick call ms median "
            f"{r['latency_ms_median']} p95 {r['latency_ms_p95']} max {r['latency_ms_max']}  "
            f"from gate ms median {r['e2e_ms_median']} p95 {r['e2e_ms_p95']} max "
            f"{r['e2e_ms_max']} (last through the gate {r['gate_spread_ms']}){svc}"
            + (f"  errors {r['errors']}" if r["errors"] else ""))


def _markdown(rows: list[dict[str, Any]]) -> str:
    out = ["| GPUs | N | method | per-GPU counts | max−min | OOM | pick call ms median / p95 / max "
           "| from gate ms median / p95 / max | service ms median / p95 / max | serial ms |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        counts = f"{c[0]} ×{len(c)}" if len(set(c)) == 1 else " ".join(map(str, c))
        svc = ("–", "–") if r["service_ms_median"] is None else (
            f"{r['service_ms_median']} / {r['service_ms_p95']} / {r['service_ms_max']}",
            f"{r['service_ms_sum']}")
        out.append(f"| {r['gpus']} | {r['n']} | {r['method']} | {counts} | {r['spread']} | "
                   f"{r['oom']} | {r['latency_ms_median']} / {r['latency_ms_p95']} / "
                   f"{r['latency_ms_max']} | {r['e2e_ms_median']} / {r['e2e_ms_p95']} / "
                   f"{r['e2e_ms_max']} | {svc[0]} | {svc[1]} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="8,32,128")
    ap.add_argument("--gpus", default="4,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    a = ap.parse_args()
    unknown = set(a.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"unknown method(s) {sorted(unknown)}: expected some of {', '.join(METHODS)}")
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
    import importlib

    for method in a.methods.split(","):  # import once here; the forked workers inherit them
        for mod in MODULES[method]:
            importlib.import_module(mod)
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
                        print(_fmt_row(rows[-1]), flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))
    else:
        if a.markdown:
            print(_markdown(rows))
        print(f"total {time.perf_counter() - t0:.1f} s")
    with contextlib.suppress(OSError):
        import shutil

        shutil.rmtree(os.environ["FAKE_NVML_DIR"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
