"""Prometheus scrapes of 8 GPUs: their time, and that they make no NVML call.

The real pynvml binding over the fake ``libnvidia-ml.so.1`` (``tests/fakenvml``, 8 GPUs, a few
processes), one background :class:`Sampler` at 1 Hz, the :class:`AutoGPUCollector` served by
``prometheus_client``'s own HTTP server (what ``autogpu exporter`` runs; jupyter_server's
``/metrics`` calls the same ``generate_latest``), and a lease registry holding 4 live leases.

1. Sampler paused, NVML call counters zeroed: ``--scrapes`` scrapes over HTTP (default 2000);
   reports the NVML calls they made (must be 0) and the latency of one scrape (p50/p99/max),
   and the in-process ``generate_latest`` time alone.
2. Sampler running at 1 Hz for ``--seconds`` (default 20) while a client scrapes every second
   (as a Prometheus with ``scrape_interval: 1s``) and another at 20 per second: reports NVML
   sweeps per second (must stay at the sampler's 1 Hz).

Run:  .venv/bin/python benchmarks/metrics.py [--scrapes 2000] [--seconds 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.browserhelpers import free_port  # noqa: E402
from tests.fakenvml import FakeNvml, fleet_8x, preload_fake_nvml  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=2000)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()

    lib = preload_fake_nvml()
    fake = FakeNvml(tempfile.mkdtemp(prefix="bench-fakenvml-"))
    fake.write(fleet_8x())
    os.environ.update(fake.env)
    os.environ.pop("AUTOGPU_SIMULATE", None)

    from prometheus_client import CollectorRegistry, generate_latest, start_http_server

    from autogpu_jupyter.core.backends import get_backend
    from autogpu_jupyter.core.leasing import Requester
    from autogpu_jupyter.core.leasing.directory import DirectoryStore
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.metrics import AutoGPUCollector, MetricsSource

    backend = get_backend()
    sampler = Sampler(backend=backend, interval_s=1.0, history_s=60.0)
    sampler.start()
    while sampler.latest() is None:
        time.sleep(0.01)
    snap = sampler.latest()
    assert snap is not None
    registry = DirectoryStore(tempfile.mkdtemp(prefix="bench-registry-"))
    leases = []
    for i in range(4):
        with registry.locked() as txn:
            assert txn is not None
            leases.append(txn.create(devices=[snap.devices[i].uuid], requested_bytes=4 << 30,
                                     requester=Requester(notebook_path=f"user{i}/train.ipynb")))
    source = MetricsSource(latest=sampler.latest, store=lambda: registry, hostname="bench")
    prom = CollectorRegistry(auto_describe=False)
    prom.register(AutoGPUCollector(source))
    port = free_port()
    server, _ = start_http_server(port, addr="127.0.0.1", registry=prom)
    url = f"http://127.0.0.1:{port}/metrics"
    body = urllib.request.urlopen(url, timeout=5).read()
    n_series = sum(1 for line in body.decode().splitlines() if line.startswith("autogpu_"))

    # 1. scrapes with the sampler paused: NVML calls and latency
    sampler.pause()
    time.sleep(1.2)
    lib.fakenvml_reset_calls()
    times = []
    for _ in range(args.scrapes):
        t0 = time.perf_counter()
        with urllib.request.urlopen(url, timeout=5) as r:
            r.read()
        times.append((time.perf_counter() - t0) * 1000)
    nvml_calls = int(lib.fakenvml_total_calls())
    gen = []
    for _ in range(args.scrapes):
        t0 = time.perf_counter()
        generate_latest(prom)
        gen.append((time.perf_counter() - t0) * 1000)
    print(f"8 GPUs, 4 live leases, {n_series} autogpu_* samples per scrape ({len(body)} bytes)")
    print(f"{args.scrapes} HTTP scrapes, sampler paused: {nvml_calls} NVML calls")
    print(f"  scrape over HTTP  p50 {statistics.median(times):.2f} ms  "
          f"p99 {pct(times, 0.99):.2f} ms  max {max(times):.2f} ms")
    print(f"  generate_latest   p50 {statistics.median(gen):.2f} ms  p99 {pct(gen, 0.99):.2f} ms")

    # 2. the sampler at 1 Hz while scraping at 1/s and 20/s
    sampler.resume()
    stop = threading.Event()
    scrapes = [0, 0]

    def client(slot: int, period_s: float) -> None:
        while not stop.is_set():
            with urllib.request.urlopen(url, timeout=5) as r:
                r.read()
            scrapes[slot] += 1
            stop.wait(period_s)

    threads = [threading.Thread(target=client, args=(0, 1.0)),
               threading.Thread(target=client, args=(1, 0.05))]
    before = sampler.sample_count
    t0 = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    sweeps = sampler.sample_count - before
    print(f"{elapsed:.1f} s with the sampler at 1 Hz: {scrapes[0] + scrapes[1]} scrapes "
          f"({(scrapes[0] + scrapes[1]) / elapsed:.1f}/s), {sweeps} NVML sweeps "
          f"({sweeps / elapsed:.2f}/s)")
    server.shutdown()
    sampler.stop()
    for lease in leases:
        lease.release()


if __name__ == "__main__":
    main()
