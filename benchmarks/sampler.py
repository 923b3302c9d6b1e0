"""Sampler cost: CPU at 1 Hz on 8 GPUs (fake NVML), memory after 24 simulated hours, and, side by
side, a gpustat-polling widget loop at the same interval.

Run: ``.venv/bin/python benchmarks/sampler.py [--seconds 30]`` from the repository root.
Results go to stdout (copy them into docs/benchmarks.md). No timed assertions: numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.fakenvml import FakeNvml, fleet_8x, preload_fake_nvml  # noqa: E402


def cpu_of(loop_body, seconds: float, interval_s: float = 1.0) -> float:  # type: ignore[no-untyped-def]
    """Percent of one core used by ``loop_body`` run at ``interval_s`` in a thread."""
    stop = threading.Event()
    cpu = [0.0]

    def run() -> None:
        start = time.thread_time()
        while not stop.wait(interval_s):
            loop_body()
        cpu[0] = time.thread_time() - start

    t = threading.Thread(target=run)
    wall = time.monotonic()
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    return 100.0 * cpu[0] / (time.monotonic() - wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0, help="wall time per CPU measurement")
    args = ap.parse_args()

    preload_fake_nvml()
    fake = FakeNvml(tempfile.mkdtemp(prefix="bench-fakenvml-"))
    fake.write(fleet_8x())
    os.environ.update(fake.env)
    os.environ.pop("AUTOGPU_SIMULATE", None)

    from autogpu_jupyter.core.backends import get_backend
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets.panel import Panel

    backend = get_backend()
    first = backend.snapshot()
    n_dev = len(first.devices)
    # the panel's kernel sits on GPU 1 (97% busy because of another process): the warning shows
    os.environ["CUDA_VISIBLE_DEVICES"] = first.devices[1].uuid
    window_s = 300.0
    rng = random.Random(4)

    def varied(snap: Any, t: float) -> Any:
        devices = tuple(
            dataclasses.replace(
                d,
                utilization_pct=float(rng.randint(0, 100)),
                memory_used_bytes=int(d.memory_total_bytes * rng.uniform(0.05, 0.95)),
            )
            for d in snap.devices
        )
        return dataclasses.replace(snap, devices=devices, timestamp_s=t)

    def sampler(moving: bool) -> Sampler:
        """A sampler whose 900 s history is already full (a panel open for a while), so each
        redraw draws a whole 5-min window (300 points per line)."""
        s = Sampler(backend, interval_s=1.0, history_s=900.0)
        now = time.time()
        for i in range(900):
            t = now - 900 + i
            s.add(varied(first, t) if moving else dataclasses.replace(first, timestamp_s=t))
        return s

    stop_mover = threading.Event()

    def mover() -> None:  # new values for every GPU every second, written by another thread
        fleet = fleet_8x()
        while not stop_mover.wait(1.0):
            for d in fleet["devices"]:
                d["utilization_pct"] = rng.randint(0, 100)
                d["memory_used"] = int(d["memory_total"] * rng.uniform(0.05, 0.95))
                if d["processes"]:
                    d["processes"][0]["used_memory"] = d["memory_used"]
            fake.write(fleet)

    results = {}
    for moving in (False, True):
        if moving:
            threading.Thread(target=mover, daemon=True).start()
        # 1. our sampler alone (what every kernel pays)
        s = sampler(moving)
        results["alone", moving] = cpu_of(s.sample_now, args.seconds)
        # 2. the same + a real Panel subscribed to it (redraws from the sampler thread)
        s = sampler(moving)
        panel = Panel(window_s=window_s, sampler=s)
        results["panel", moving] = cpu_of(s.sample_now, args.seconds)
        if not moving:
            warned = bool(panel.warnings)
        panel.close()
    stop_mover.set()
    fake.write(fleet_8x())

    # 3. memory after 24 simulated hours: 86400 samples of 8 devices into the ring buffer
    snap = backend.snapshot()
    mem = Sampler(backend, interval_s=1.0, history_s=900.0)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    marks = {}
    for i in range(86_400):
        mem.add(dataclasses.replace(snap, timestamp_s=float(i)), own=())
        if i + 1 in (900, 3_600, 21_600, 86_400):
            marks[i + 1] = (tracemalloc.get_traced_memory()[0] - base) / 2**20
    tracemalloc.stop()

    big = Sampler(backend, interval_s=1.0, history_s=86_400.0)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(86_400):
        big.add(dataclasses.replace(snap, timestamp_s=float(i)), own=())
    big_mib = (tracemalloc.get_traced_memory()[0] - base) / 2**20
    tracemalloc.stop()

    # gpustat last: importing it patches pynvml.nvmlDeviceGetMemoryInfo in this process
    # 2. a gpustat-polling widget loop: query every second, render its table into an HTML widget
    import gpustat
    import ipywidgets as w

    gs_html = w.HTML()

    def gpustat_loop() -> None:
        stats = gpustat.new_query()
        rows = "".join(
            f"<tr><td>{g.index}</td><td>{g.name}</td><td>{g.utilization}%</td>"
            f"<td>{g.memory_used}/{g.memory_total} MiB</td></tr>"
            for g in stats.gpus
        )
        gs_html.value = f"<table>{rows}</table>"

    theirs = cpu_of(gpustat_loop, args.seconds)

    print(
        f"devices: {n_dev} (fake libnvidia-ml.so.1 through pynvml), interval 1 s, "
        f"{args.seconds:g} s per CPU measurement"
    )
    print(f"panel: {window_s:g} s window, full 900 s history, overload warning shown: {warned}")
    print("CPU, % of one core               steady load   moving load (every GPU, every second)")
    for name, key in (("autogpu sampler alone", "alone"), ("autogpu sampler + Panel", "panel")):
        print(f"  {name:<30} {results[key, False]:8.3f}%   {results[key, True]:8.3f}%")
    print(f"  {'gpustat query + HTML widget':<30} {theirs:8.3f}%")
    print(f"ratio sampler + Panel (moving) / gpustat loop: {results['panel', True] / theirs:.2f}")
    print("memory of the history (default 900 s ring buffer), tracemalloc, after N samples:")
    for n, mib in marks.items():
        print(f"  {n:>6} samples ({n / 3600:5.2f} h): {mib:.2f} MiB (buffer holds {len(mem)})")
    print(f"memory with history_s=86400 (whole day kept, {len(big)} samples): {big_mib:.2f} MiB")


if __name__ == "__main__":
    main()
