"""A real Prometheus over emulated hosts, for the cluster tests and the sidebar's browser test.

Three ``autogpu exporter`` processes on 127.0.0.2, .3 and .4 (each over its own simulated fleet
and lease registry), one DCGM-exporter-format endpoint on 127.0.0.5 (static text served by a
thread of the test process), and Debian's ``prometheus`` on 127.0.0.1 scraping them every second.
Where the ``prometheus`` binary is missing the test is skipped (a failure in CI: the ``cluster``
marker, see ``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.browserhelpers import free_port

GiB = 1024**3
MiB = 1024**2
SCRAPE_INTERVAL_S = 1.0

#: hostname -> (loopback address, fleet). Static loads: a local pick and the cluster view read
#: the same numbers.
FLEETS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpu-a": ("127.0.0.2", {"devices": [
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-aaaa0000-0000-0000-0000-000000000000",
         "memory_total": "80G", "memory_used": "60G", "utilization_pct": 70,
         "temperature_c": 60, "power_w": 300},
        {"name": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-aaaa0001-0000-0000-0000-000000000001",
         "memory_total": "80G", "memory_used": "75G", "utilization_pct": 10,
         "temperature_c": 40, "power_w": 90},
    ]}),
    "gpu-b": ("127.0.0.3", {"devices": [
        {"name": "NVIDIA L4", "uuid": "GPU-bbbb0000-0000-0000-0000-000000000000",
         "memory_total": "24G", "memory_used": "4G", "utilization_pct": 50},
        {"name": "NVIDIA L4", "uuid": "GPU-bbbb0001-0000-0000-0000-000000000001",
         "memory_total": "24G", "memory_used": "20G", "utilization_pct": 5},
        {"name": "NVIDIA L4", "uuid": "GPU-bbbb0002-0000-0000-0000-000000000002",
         "memory_total": "24G", "memory_used": "2G", "utilization_pct": 30},
        {"name": "NVIDIA L4", "uuid": "GPU-bbbb0003-0000-0000-0000-000000000003", "lost": True},
    ]}),
    "gpu-c": ("127.0.0.4", {"devices": [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-cccc0000-0000-0000-0000-000000000000",
         "memory_total": "80G", "memory_used": "10G", "utilization_pct": 20},
        {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-cccc0001-0000-0000-0000-000000000001",
         "memory_total": "80G", "memory_used": "40G", "utilization_pct": 0},
    ]}),
}

DCGM_HOST = "dgx-d"
DCGM_ADDR = "127.0.0.5"
_GPU0 = ('gpu="0",UUID="GPU-dddd0000-0000-0000-0000-000000000000",pci_bus_id="00000000:07:00.0",'
         'device="nvidia0",modelName="NVIDIA A100-SXM4-80GB",Hostname="dgx-d"')
_MIG1 = ('gpu="1",UUID="GPU-dddd0001-0000-0000-0000-000000000001",pci_bus_id="00000000:17:00.0",'
         'device="nvidia1",modelName="NVIDIA A100-SXM4-80GB",Hostname="dgx-d",'
         'GPU_I_PROFILE="3g.40gb",GPU_I_ID="1"')
#: What NVIDIA's dcgm-exporter serves (FB in MiB, util in %), one full GPU and one MIG instance
#: (where DCGM_FI_DEV_GPU_UTIL is not supported and DCGM_FI_PROF_GR_ENGINE_ACTIVE is).
DCGM_TEXT = f"""\
# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
# TYPE DCGM_FI_DEV_GPU_UTIL gauge
DCGM_FI_DEV_GPU_UTIL{{{_GPU0}}} 90
# HELP DCGM_FI_DEV_FB_USED Framebuffer memory used (in MiB).
# TYPE DCGM_FI_DEV_FB_USED gauge
DCGM_FI_DEV_FB_USED{{{_GPU0}}} 70000
DCGM_FI_DEV_FB_USED{{{_MIG1}}} 1000
# HELP DCGM_FI_DEV_FB_FREE Framebuffer memory free (in MiB).
# TYPE DCGM_FI_DEV_FB_FREE gauge
DCGM_FI_DEV_FB_FREE{{{_GPU0}}} 11920
DCGM_FI_DEV_FB_FREE{{{_MIG1}}} 39000
# HELP DCGM_FI_PROF_GR_ENGINE_ACTIVE Ratio of time the graphics engine is active.
# TYPE DCGM_FI_PROF_GR_ENGINE_ACTIVE gauge
DCGM_FI_PROF_GR_ENGINE_ACTIVE{{{_MIG1}}} 0.5
"""


def require_prometheus() -> str:
    """The ``prometheus`` binary; skips (a failure in CI) where it is not installed."""
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("no prometheus binary (apt-get install prometheus; scripts/setup.sh does)")
    return path


class _DcgmHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = DCGM_TEXT.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@dataclass
class Cluster:
    """The running set-up: ``url`` of Prometheus, each host's exporter and files."""

    url: str
    root: Path
    exporters: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    targets: dict[str, str] = field(default_factory=dict)

    def fleet_file(self, host: str) -> Path:
        return self.root / host / "fleet.json"

    def registry(self, host: str) -> Path:
        return self.root / host / "registry"

    def host_env(self, host: str) -> dict[str, str]:
        """The environment of a process "on" ``host``: its simulated fleet and lease registry."""
        env = {**os.environ, "AUTOGPU_SIMULATE": str(self.fleet_file(host)),
               "AUTOGPU_REGISTRY_DIR": str(self.registry(host)),
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        env.pop("AUTOGPU_PROMETHEUS_URL", None)
        return env

    def autogpu(self, host: str, *args: str) -> subprocess.CompletedProcess[str]:
        """``autogpu ARGS`` run "on" ``host``."""
        return subprocess.run(
            [sys.executable, "-m", "autogpu_jupyter.cli", *args], env=self.host_env(host),
            capture_output=True, text=True, timeout=60,
        )

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            return list(json.load(r)["data"]["result"])


def _wait_http(url: str, deadline_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if proc is not None and proc.poll() is not None:
                pytest.fail(f"{proc.args!r} exited with {proc.returncode}")
            if time.monotonic() > deadline:
                pytest.fail(f"{url} did not answer within {deadline_s:.0f} s")
            time.sleep(0.1)


@contextlib.contextmanager
def prometheus_cluster(root: Path, *, lease_on_c: bool = True) -> Iterator[Cluster]:
    """Start the exporters, the DCGM endpoint and Prometheus; yield once Prometheus has scraped
    every target successfully. ``lease_on_c``: ``autogpu run --min-free 30G -- sleep`` holds a
    lease on host gpu-c (it books 30 GiB on the GPU it picks there)."""
    binary = require_prometheus()
    procs: list[subprocess.Popen[bytes]] = []
    dcgm: http.server.ThreadingHTTPServer | None = None
    cluster = Cluster(url="", root=root)
    logs = root / "logs"
    logs.mkdir(parents=True)
    try:
        for host, (addr, fleet) in FLEETS.items():
            (root / host).mkdir()
            cluster.fleet_file(host).write_text(json.dumps(fleet))
            port = free_port()
            proc = subprocess.Popen(
                [sys.executable, "-m", "autogpu_jupyter.cli", "exporter", "--host", addr,
                 "--port", str(port), "--hostname", host, "--interval", "0.5"],
                env=cluster.host_env(host), stdout=subprocess.DEVNULL,
                stderr=(logs / f"{host}.log").open("wb"),
            )
            procs.append(proc)
            cluster.exporters[host] = proc
            cluster.targets[host] = f"{addr}:{port}"
        dport = free_port()
        dcgm = http.server.ThreadingHTTPServer((DCGM_ADDR, dport), _DcgmHandler)
        threading.Thread(target=dcgm.serve_forever, daemon=True).start()
        cluster.targets[DCGM_HOST] = f"{DCGM_ADDR}:{dport}"
        if lease_on_c:
            holder = subprocess.Popen(
                [sys.executable, "-m", "autogpu_jupyter.cli", "run", "--min-free", "30G", "--",
                 "sleep", "600"],
                env=cluster.host_env("gpu-c"), stdout=subprocess.DEVNULL,
                stderr=(logs / "lease-holder.log").open("wb"),
            )
            procs.append(holder)
        config = root / "prometheus.yml"
        autogpu_targets = [t for h, t in cluster.targets.items() if h != DCGM_HOST]
        config.write_text(json.dumps({  # JSON is YAML
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": "autogpu", "static_configs": [{"targets": autogpu_targets}]},
                {"job_name": "dcgm", "static_configs": [{"targets": [cluster.targets[DCGM_HOST]]}]},
            ],
        }))
        pport = free_port()
        prom = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=(logs / "prometheus.log").open("wb"),
        )
        procs.append(prom)
        cluster.url = f"http://127.0.0.1:{pport}"
        _wait_http(f"{cluster.url}/-/ready", 60, prom)
        # every target up, every exporter's GPUs and the lease on gpu-c in Prometheus
        deadline = time.monotonic() + 60
        while True:
            up = cluster.query("up == 1")
            devices = cluster.query("autogpu_gpu_available")
            leases = cluster.query("autogpu_lease_info")
            if len(up) == 4 and len(devices) == 8 and (leases or not lease_on_c):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"Prometheus never saw every target: up={up} devices={len(devices)}")
            time.sleep(0.2)
        yield cluster
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if dcgm is not None:
            dcgm.shutdown()
            dcgm.server_close()

