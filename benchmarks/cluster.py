"""The cluster endpoint over 100 hosts x 8 GPUs, with hours of history in Prometheus.

1. History: ``--hours`` (default 3) of ``autogpu_*`` series for 100 hosts x 8 GPUs at one sample
   a minute, written as OpenMetrics and backfilled with
   ``promtool tsdb create-blocks-from openmetrics`` into a fresh TSDB.
2. Live: 100 static endpoints (one per host, on 127.0.1.1-100, threads of this process) serving
   each host's current ``autogpu_*`` exposition (made by the real ``AutoGPUCollector`` from a
   fixed snapshot), scraped by Debian's ``prometheus`` every ``--scrape-interval`` (15 s) over
   that TSDB.
3. A Jupyter server (subprocess) with the autogpu extension and ``AUTOGPU_PROMETHEUS_URL``;
   ``GET /autogpu/cluster?min_free=10G`` is asked ``--requests`` times (default 30), one at a time.

Reports the backfill's size and time, the endpoint's latency (p50/p99/max) and the same work
in-process (``fetch_cluster`` + ``rank_hosts``) split into its parts.

Run:  .venv/bin/python benchmarks/cluster.py [--hours 3] [--requests 30]
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.browserhelpers import free_port  # noqa: E402

GiB = 1024**3
N_HOSTS = 100
N_GPUS = 8
METRICS = (
    "available", "utilization_ratio", "memory_used_bytes", "memory_total_bytes",
    "memory_booked_bytes", "memory_used_ratio", "temperature_celsius", "power_watts",
    "leases", "waiters",
)


def host_name(h: int) -> str:
    return f"node{h:03d}"


def gpu_values(h: int, g: int, t: float) -> dict[str, float]:
    """Deterministic, slowly moving load of GPU ``g`` of host ``h`` at time ``t``."""
    rnd = random.Random(h * 100 + g)
    base_util = rnd.random()
    base_mem = rnd.random()
    phase = (t / 3600.0 + rnd.random()) % 1.0
    util = min(1.0, max(0.0, base_util * (0.6 + 0.8 * phase)))
    total = 80 * GiB
    used = int(total * min(0.98, base_mem * (0.5 + phase)))
    booked = 4 * GiB if (h + g) % 7 == 0 else 0
    return {
        "available": 1.0, "utilization_ratio": round(util, 3), "memory_used_bytes": used,
        "memory_total_bytes": total, "memory_booked_bytes": booked,
        "memory_used_ratio": min(1.0, (used + booked) / total),
        "temperature_celsius": round(30 + 50 * util), "power_watts": round(80 + 300 * util),
        "leases": 1.0 if booked else 0.0, "waiters": 0.0,
    }


def labels(h: int, g: int) -> str:
    uuid = f"GPU-{h:04d}{g:04d}-0000-0000-0000-{h * 8 + g:012d}"
    return (f'hostname="{host_name(h)}",uuid="{uuid}",index="{g}",'
            f'model="NVIDIA A100-SXM4-80GB"')


def target_labels(h: int, targets: list[str]) -> str:
    """The labels Prometheus adds to what it scrapes, so history and live series are one."""
    return f'instance="{targets[h]}",job="autogpu"'


def write_history(path: Path, start: float, end: float, step: float, targets: list[str]) -> int:
    """OpenMetrics of every series from ``start`` to ``end``; returns the number of samples."""
    n = 0
    times = []
    t = start
    while t <= end:
        times.append(t)
        t += step
    with path.open("w") as out:
        for metric in METRICS:
            name = f"autogpu_gpu_{metric}"
            out.write(f"# TYPE {name} gauge\n")
            for h in range(N_HOSTS):
                for g in range(N_GPUS):
                    lab = f"{labels(h, g)},{target_labels(h, targets)}"
                    for ts in times:
                        out.write(f"{name}{{{lab}}} {gpu_values(h, g, ts)[metric]} {ts:.0f}\n")
                        n += 1
        for name in ("autogpu_sample_timestamp_seconds", "autogpu_host_info"):
            out.write(f"# TYPE {name} gauge\n")
            for h in range(N_HOSTS):
                lab = f'hostname="{host_name(h)}",{target_labels(h, targets)}'
                if name == "autogpu_host_info":
                    lab += ',backend="nvml",simulated="false",version="0.1.0"'
                for ts in times:
                    value = f"{ts:.3f}" if name.endswith("seconds") else "1"
                    out.write(f"{name}{{{lab}}} {value} {ts:.0f}\n")
                    n += 1
        out.write("# EOF\n")
    return n


def live_text(h: int) -> bytes:
    """What host ``h``'s exporter serves now, made by the real collector."""
    from prometheus_client import CollectorRegistry, generate_latest

    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot
    from autogpu_jupyter.metrics import AutoGPUCollector, MetricsSource

    now = time.time()
    devices = []
    for g in range(N_GPUS):
        v = gpu_values(h, g, now)
        devices.append(DeviceSnapshot(
            index=g, uuid=labels(h, g).split('uuid="')[1].split('"')[0],
            name="NVIDIA A100-SXM4-80GB", memory_total_bytes=int(v["memory_total_bytes"]),
            memory_used_bytes=int(v["memory_used_bytes"]),
            memory_free_bytes=int(v["memory_total_bytes"] - v["memory_used_bytes"]),
            utilization_pct=100 * v["utilization_ratio"], temperature_c=v["temperature_celsius"],
            power_w=v["power_watts"], timestamp_s=now))
    snap = FleetSnapshot(devices=tuple(devices), timestamp_s=now, backend="nvml")
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AutoGPUCollector(MetricsSource(latest=lambda: snap, store=lambda: None,
                                                hostname=host_name(h))))
    return generate_latest(reg)


def serve_static(addr: str, body: bytes) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((addr, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hours", type=float, default=3.0)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--scrape-interval", type=int, default=15)
    ap.add_argument("--results", help="merge p50 / p99 (ms) into this JSON file (make bench)")
    args = ap.parse_args()
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not prometheus or not promtool:
        sys.exit("needs Debian's prometheus and promtool (scripts/setup.sh installs them)")
    work = Path(tempfile.mkdtemp(prefix="bench-cluster-"))
    procs: list[subprocess.Popen[bytes]] = []
    servers = []
    try:
        targets = []
        for h in range(N_HOSTS):
            server = serve_static(f"127.0.1.{h + 1}", live_text(h))
            servers.append(server)
            targets.append(f"127.0.1.{h + 1}:{server.server_address[1]}")
        now = time.time()
        t0 = time.perf_counter()
        history = work / "history.om"
        n = write_history(history, now - args.hours * 3600, now - 60, 60.0, targets)
        t1 = time.perf_counter()
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q",
                        str(history), str(work / "tsdb")], check=True)
        t2 = time.perf_counter()
        size = history.stat().st_size
        history.unlink()
        print(f"history: {N_HOSTS} hosts x {N_GPUS} GPUs, {args.hours:g} h at 1/min: "
              f"{n:,} samples ({size / 1e6:.0f} MB OpenMetrics) written in {t1 - t0:.0f} s, "
              f"backfilled by promtool in {t2 - t1:.0f} s")

        config = work / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": f"{args.scrape_interval}s"},
            "scrape_configs": [{"job_name": "autogpu",
                                "static_configs": [{"targets": targets}]}],
        }))
        pport = free_port()
        procs.append(subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=(work / "prometheus.log").open("wb")))
        url = f"http://127.0.0.1:{pport}"
        from autogpu_jupyter.core.cluster import PrometheusClient, fetch_cluster, rank_hosts
        from autogpu_jupyter.core.policy import Constraints

        client = PrometheusClient(url)
        deadline = time.monotonic() + 120
        while True:
            try:
                if len(client.query("up == 1")) == N_HOSTS:
                    break
            except Exception:  # not up yet
                pass
            if time.monotonic() > deadline:
                sys.exit("Prometheus did not scrape every host:\n"
                         + (work / "prometheus.log").read_text()[-2000:])
            time.sleep(0.5)
        window = f"{round(args.hours * 60)}m"
        hist = client.query(f"count_over_time(autogpu_gpu_utilization_ratio[{window}])")
        print(f"Prometheus: {len(hist)} utilisation series, "
              f"{int(sum(s.value for s in hist)):,} samples of them in the last {args.hours:g} h")

        token = "bench-cluster"
        jport = free_port()
        env = {**os.environ, "AUTOGPU_PROMETHEUS_URL": url, "AUTOGPU_SIMULATE": "demo-4x",
               "AUTOGPU_REGISTRY_DIR": str(work / "registry"),
               "JUPYTER_RUNTIME_DIR": str(work / "runtime"),
               "JUPYTER_CONFIG_DIR": str(work / "config")}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", f"--port={jport}",
             "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
             "--ServerApp.jpserver_extensions={'autogpu_jupyter': True}",
             f"--ServerApp.root_dir={work}", *(["--allow-root"] if os.geteuid() == 0 else [])],
            env=env, stdout=subprocess.DEVNULL, stderr=(work / "jupyter.log").open("wb")))
        endpoint = f"http://127.0.0.1:{jport}/autogpu/cluster?min_free=10G"
        headers = {"Authorization": f"token {token}"}
        deadline = time.monotonic() + 60
        while True:
            try:
                req = urllib.request.Request(endpoint, headers=headers)
                with urllib.request.urlopen(req, timeout=30) as r:
                    first = json.load(r)
                break
            except OSError:
                if time.monotonic() > deadline:
                    sys.exit("the Jupyter server did not answer")
                time.sleep(0.3)
        states = [h["state"] for h in first["hosts"]]
        ndev = sum(len(h["devices"]) for h in first["hosts"])
        print(f"GET /autogpu/cluster: {len(first['hosts'])} hosts ({states.count('ok')} ok), "
              f"{ndev} GPUs, best {first['best']}, errors {first['errors']}")
        lat = []
        for _ in range(args.requests):
            t = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(endpoint, headers=headers),
                                        timeout=30) as r:
                r.read()
            lat.append((time.perf_counter() - t) * 1000)
        print(f"  {args.requests} requests: p50 {statistics.median(lat):.0f} ms  "
              f"p99 {pct(lat, 0.99):.0f} ms  max {max(lat):.0f} ms")
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from results import record

        record(args.results, {"cluster.p50_ms": statistics.median(lat),
                              "cluster.p99_ms": pct(lat, 0.99)})
        fetch, ranking = [], []
        for _ in range(10):
            t = time.perf_counter()
            view = fetch_cluster(client)
            t_mid = time.perf_counter()
            rank_hosts(view, Constraints.parse(min_free="10G"))
            fetch.append((t_mid - t) * 1000)
            ranking.append((time.perf_counter() - t_mid) * 1000)
        print(f"  in-process: fetch_cluster (7 Prometheus requests) p50 "
              f"{statistics.median(fetch):.0f} ms, rank_hosts p50 "
              f"{statistics.median(ranking):.1f} ms")
        from autogpu_jupyter.core import cluster as cluster_mod

        exprs = [cluster_mod._AUTOGPU_QUERY, cluster_mod._DCGM_QUERY,
                 cluster_mod._SCRAPED_QUERY, "up", *cluster_mod._NAMES_QUERIES]
        for expr in exprs:
            times = []
            for _ in range(5):
                t = time.perf_counter()
                result = client.query(expr)
                times.append((time.perf_counter() - t) * 1000)
            print(f"    {statistics.median(times):6.1f} ms  {len(result):5d} series  {expr}")
        times = []
        for _ in range(5):
            t = time.perf_counter()
            client.scrape_intervals()
            times.append((time.perf_counter() - t) * 1000)
        print(f"    {statistics.median(times):6.1f} ms  /api/v1/targets")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for server in servers:
            server.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
