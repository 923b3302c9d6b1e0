"""The cluster view of AMD hosts through a real Prometheus (Debian's, on loopback): one host
runs ``autogpu exporter`` over AMD's real ``amdsmi`` binding and the fake ``libamd_smi.so``, one
serves AMD device metrics exporter text (its metric and label names, static values); ``autogpu
hosts`` ranks both from what Prometheus scraped."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clusterhelpers import require_prometheus
from tests.fakeamdsmi import FakeAmdSmi, amd_uuid, fleet_amd_8x
from tests.leasehelpers import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3
EXPORTER_UUID = "4bff74a1-0000-1000-8000-0123456789ab"
_LABELS = ('gpu_id="{gpu}",gpu_uuid="{uuid}",card_series="AMD Instinct MI300X",'
           'card_model="102-D65209-0C",gpu_partition_id="0",hostname="mi300-x"')
L0 = _LABELS.format(gpu=0, uuid=EXPORTER_UUID)
L1 = 'gpu_id="1",card_model="102-D65209-0C",gpu_partition_id="0",hostname="mi300-x"'
#: AMD's device metrics exporter's names and units (ROCm/device-metrics-exporter); GPU 1
#: without the optional gpu_uuid label.
AMD_TEXT = f"""\
# HELP gpu_gfx_activity Graphics engine usage percentage
# TYPE gpu_gfx_activity gauge
gpu_gfx_activity{{{L0}}} 97
gpu_gfx_activity{{{L1}}} 4
# HELP gpu_used_vram Used VRAM memory of the GPU (in MB)
# TYPE gpu_used_vram gauge
gpu_used_vram{{{L0}}} 180000
gpu_used_vram{{{L1}}} 1024
# HELP gpu_total_vram Total VRAM memory of the GPU (in MB)
# TYPE gpu_total_vram gauge
gpu_total_vram{{{L0}}} 196592
gpu_total_vram{{{L1}}} 196592
# HELP gpu_junction_temperature Hotspot (aka junction) temperature value in Celsius
# TYPE gpu_junction_temperature gauge
gpu_junction_temperature{{{L0}}} 80
gpu_junction_temperature{{{L1}}} 41
# HELP gpu_package_power Current socket power in Watts
# TYPE gpu_package_power gauge
gpu_package_power{{{L0}}} 700
gpu_package_power{{{L1}}} 150
"""


class _AmdHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = AMD_TEXT.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def query(url: str, expr: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}",
                                timeout=10) as resp:
        return json.loads(resp.read())["data"]["result"]  # type: ignore[no-any-return]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[str]:
    binary = require_prometheus()
    fake = FakeAmdSmi(tmp_path / "amd")
    fleet = fleet_amd_8x(processes=False)
    fleet["devices"] = fleet["devices"][:2]
    fleet["devices"][0].update(memory_used=150 * GiB, utilization_pct=90)
    fleet["devices"][1].update(memory_used=0, utilization_pct=0)
    fake.write(fleet)
    env = fake.subprocess_env(PYTHONPATH=str(ROOT), AUTOGPU_REGISTRY_DIR=str(tmp_path / "reg"))
    procs: list[subprocess.Popen[bytes]] = []
    port, aport, pport = free_port(), free_port(), free_port()
    amd = http.server.ThreadingHTTPServer(("127.0.0.7", aport), _AmdHandler)
    threading.Thread(target=amd.serve_forever, daemon=True).start()
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "autogpu_jupyter.cli", "exporter", "--host", "127.0.0.8",
             "--port", str(port), "--hostname", "mi300-a", "--interval", "0.5"],
            env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "exporter.log").open("wb")))
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
            "scrape_configs": [
                {"job_name": "autogpu", "static_configs": [{"targets": [f"127.0.0.8:{port}"]}]},
                {"job_name": "amd", "static_configs": [{"targets": [f"127.0.0.7:{aport}"]}]},
            ],
        }))
        procs.append(subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{pport}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb")))
        url = f"http://127.0.0.1:{pport}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if (len(query(url, "up == 1")) == 2
                        and len(query(url, "autogpu_gpu_available")) == 2
                        and len(query(url, "gpu_used_vram")) == 2):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = (tmp_path / "exporter.log").read_text()[-2000:]
                pytest.fail(f"Prometheus never saw both hosts; exporter log:\n{logs}")
            time.sleep(0.3)
        yield url
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(15)
        amd.shutdown()
        amd.server_close()


def test_hosts_ranks_amd_hosts_from_prometheus(prometheus: str) -> None:
    info = query(prometheus, "autogpu_host_info")
    assert [(r["metric"]["backend"], r["metric"]["vendor"]) for r in info] == [
        ("amdsmi", "amd")]
    out = subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", "hosts", "--prometheus", prometheus,
         "--min-free", "100G", "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert out.returncode == 0, out.stderr
    hosts = json.loads(out.stdout)
    ranked = hosts["hosts"] if isinstance(hosts, dict) else hosts
    # mi300-a's GPU 1 is idle (autogpu's own series); mi300-x's GPU 1 has 4 % (exporter's)
    assert [(h["hostname"], h["state"], [c["uuid"] for c in h["chosen"]])
            for h in ranked] == [
        ("mi300-a", "ok", [amd_uuid(1)]),
        ("mi300-x", "ok", ["mi300-x/gpu-1"]),
    ]
