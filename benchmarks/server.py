"""Many browser tabs polling the sidebar's devices endpoint: NVML sweeps stay at the sampler rate.

Starts a real Jupyter server (subprocess) with the autogpu server extension on the fake NVIDIA
driver (``tests/fakenvml``: the real pynvml binding over the fake ``libnvidia-ml.so.1``), 8 GPUs.
The server counts every ``NvmlBackend.snapshot()`` (one NVML sweep of all devices) and reports it
through a file. ``--clients`` concurrent clients (default 50) then poll ``/autogpu/devices`` in a
closed loop (each sends its next request as soon as the previous answer arrived: far harsher than
the sidebar's one request per 2 s) for ``--seconds`` (default 30; ``--quick`` is 10).

Reports requests/s, p50/p99 latency, NVML sweeps/s versus the sampler's rate, and the same load
as a jupyterlab-nvdashboard-style server would cost (its GPU websocket handlers read NVML per
connection per tick: 1 sweep per second per open chart, see docs/benchmarks.md).

Run:  .venv/bin/python benchmarks/server.py [--clients 50] [--seconds 30] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SERVER_BOOT = r"""
import os, sys, threading, time
from autogpu_jupyter.core.backends import nvml as _nvml
_count = [0]
_orig = _nvml.NvmlBackend.snapshot
def _counting(self):
    _count[0] += 1
    return _orig(self)
_nvml.NvmlBackend.snapshot = _counting
out = os.environ["BENCH_COUNT_FILE"]
def _report():
    while True:
        with open(out + ".tmp", "w") as fh:
            fh.write(f"{time.time()} {_count[0]}")
        os.replace(out + ".tmp", out)
        time.sleep(0.2)
threading.Thread(target=_report, daemon=True).start()
from jupyter_server.serverapp import main
sys.exit(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_count(path: Path) -> int:
    for _ in range(50):
        try:
            return int(path.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            time.sleep(0.05)
    raise RuntimeError(f"no sweep count in {path}")


async def client(url: str, headers: dict[str, str], stop_at: float, lat: list[float],
                 errors: list[str]) -> None:
    from tornado.httpclient import AsyncHTTPClient, HTTPClientError

    http = AsyncHTTPClient()
    while time.monotonic() < stop_at:
        t0 = time.perf_counter()
        try:
            resp = await http.fetch(url, headers=headers, request_timeout=30)
            json.loads(resp.body)
        except (HTTPClientError, OSError) as err:
            errors.append(str(err))
            continue
        lat.append(time.perf_counter() - t0)


async def load(url: str, token: str, clients: int, seconds: float) -> tuple[list[float], list[str]]:
    from tornado.httpclient import AsyncHTTPClient

    AsyncHTTPClient.configure(None, max_clients=clients)
    lat: list[float] = []
    errors: list[str] = []
    stop_at = time.monotonic() + seconds
    headers = {"Authorization": f"token {token}"}
    await asyncio.gather(*(client(url, headers, stop_at, lat, errors) for _ in range(clients)))
    return lat, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="10 s instead of 30 s")
    ap.add_argument("--interval", type=float, default=1.0, help="the sampler interval (s)")
    args = ap.parse_args()
    seconds = 10.0 if args.quick else args.seconds

    from tests.fakenvml import FakeNvml, build_fake_nvml, fleet_8x

    build_fake_nvml()
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        fake = FakeNvml(tmp / "fake")
        fake.write(fleet_8x())
        count_file = tmp / "count"
        port = free_port()
        token = "bench"
        env = {**os.environ, **fake.env, "BENCH_COUNT_FILE": str(count_file),
               "AUTOGPU_REGISTRY_DIR": str(tmp / "registry"), "PYTHONPATH": str(ROOT),
               "JUPYTER_RUNTIME_DIR": str(tmp / "rt"), "JUPYTER_CONFIG_DIR": str(tmp / "cfg")}
        env.pop("AUTOGPU_SIMULATE", None)
        cmd = [sys.executable, "-c", SERVER_BOOT, "--no-browser", f"--port={port}",
               "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
               f"--ServerApp.root_dir={tmp}",
               "--ServerApp.jpserver_extensions={'autogpu_jupyter': True}",
               f"--AutoGPUServer.interval_s={args.interval}", "--ServerApp.log_level=WARN"]
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                  stderr=open(tmp / "server.log", "w"))  # noqa: SIM115
        url = f"http://127.0.0.1:{port}/autogpu/devices"
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    req = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        first = json.loads(resp.read())
                    if first["devices"]:
                        break
                except OSError:
                    pass
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("server did not start:\n" + (tmp / "server.log").read_text())
                time.sleep(0.3)
            # idle baseline: the sampler alone
            c0, t0 = read_count(count_file), time.monotonic()
            time.sleep(3.0)
            idle_rate = (read_count(count_file) - c0) / (time.monotonic() - t0)
            c1, t1 = read_count(count_file), time.monotonic()
            lat, errors = asyncio.run(load(url, token, args.clients, seconds))
            elapsed = time.monotonic() - t1
            sweeps = read_count(count_file) - c1
        finally:
            server.terminate()
            server.wait(15)

    lat_ms = sorted(x * 1000 for x in lat)
    p50 = statistics.median(lat_ms)
    p99 = lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))]
    sweep_rate = sweeps / elapsed
    result = {
        "clients": args.clients,
        "seconds": round(elapsed, 1),
        "devices": len(first["devices"]),
        "requests": len(lat),
        "errors": len(errors),
        "requests_per_s": round(len(lat) / elapsed, 1),
        "p50_ms": round(p50, 2),
        "p99_ms": round(p99, 2),
        "sampler_interval_s": args.interval,
        "nvml_sweeps_idle_per_s": round(idle_rate, 2),
        "nvml_sweeps_under_load_per_s": round(sweep_rate, 2),
        "sweeps_per_request": round(sweeps / max(len(lat), 1), 5),
        # nvdashboard: each open GPU chart is a websocket whose PeriodicCallback reads NVML
        # for every device once per second (its default updateFrequency: 1000 ms)
        "nvdashboard_style_sweeps_per_s_same_clients": args.clients * 1.0,
    }
    print(json.dumps(result, indent=2))
    print(
        f"\n{args.clients} clients, {elapsed:.0f} s: {result['requests_per_s']} req/s, "
        f"p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms; NVML sweeps "
        f"{result['nvml_sweeps_under_load_per_s']}/s under load vs "
        f"{result['nvml_sweeps_idle_per_s']}/s idle (sampler every {args.interval} s); "
        f"an nvdashboard-style per-connection poller would sweep {args.clients}/s"
    )


if __name__ == "__main__":
    main()
