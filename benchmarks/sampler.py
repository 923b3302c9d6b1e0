"""Sampler cost: CPU at 1 Hz on 8 GPUs (fake NVML), memory after 24 simulated hours, and, side by
side, a gpustat-polling widget loop at the same interval.

Run: ``.venv/bin/python benchmarks/sampler.py [--seconds 30]`` from the repository root.
Results go to stdout (copy them into docs/benchmarks-sampler.md). No timed assertions: numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

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

    import ipywidgets as w

    from autogpu_jupyter.core.backends import get_backend
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets import chart

    backend = get_backend()
    n_dev = len(backend.snapshot().devices)

    # 1. our sampler alone (what every kernel pays), then sampler + panel redraw
    s = Sampler(backend, interval_s=1.0, history_s=900.0)
    ours = cpu_of(s.sample_now, args.seconds)
    html = w.HTML()

    def sample_and_draw() -> None:
        snap = s.sample_now()
        if snap is not None:
            frame = s.history_frame(since_s=300)
            html.value = chart.render_charts(
                frame, snap.devices, window_s=300
            ) + chart.render_table(snap)

    ours_panel = cpu_of(sample_and_draw, args.seconds)

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
    print(f"CPU, autogpu sampler alone:              {ours:.3f}% of one core")
    print(f"CPU, autogpu sampler + panel redraw:     {ours_panel:.3f}% of one core")
    print(f"CPU, gpustat query + HTML widget:        {theirs:.3f}% of one core")
    print(f"ratio gpustat loop / autogpu panel loop: {theirs / ours_panel:.2f}")
    print("memory of the history (default 900 s ring buffer), tracemalloc, after N samples:")
    for n, mib in marks.items():
        print(f"  {n:>6} samples ({n / 3600:5.2f} h): {mib:.2f} MiB (buffer holds {len(mem)})")
    print(f"memory with history_s=86400 (whole day kept, {len(big)} samples): {big_mib:.2f} MiB")


if __name__ == "__main__":
    main()
