"""Herd through the trusted broker beside the shared-directory registry, in one run (issue 11).

N picker processes (forked from this one after the imports, blocked on one ``flock`` gate that
the benchmark drops, so the kernel wakes them all at once) each run
:func:`autogpu_jupyter.core.picker.pick` on the same simulated fleet of G GPUs, then hold their
lease until every picker is done. Two modes, alternating in one run:

* ``registry`` -- the shared-directory registry (``core.leasing.directory.DirectoryStore``) in a
  temp dir;
* ``broker``   -- ``autogpu broker`` as a real process on a Unix socket, the picks through
  ``core.leasing.brokerclient.BrokerStore`` (the same picker code).

Reported per mode: spread (leases per GPU, max - min), pick latency (median / p95 of the pick
call in each process, and from the gate's opening, which counts the wait for a CPU), and for the
broker its CPU time (user + system, from ``/proc/<pid>/stat``) and memory (VmRSS, VmHWM) while
idle for a few seconds and across the herd.

Run::

    .venv/bin/python benchmarks/broker_herd.py                 # N = 128 on 8 GPUs, 3 rounds
    .venv/bin/python benchmarks/broker_herd.py --n 32 --gpus 4 --rounds 1 --json
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 1024**3


def make_fleet(gpus: int) -> dict[str, Any]:
    return {
        "driver_version": "550.54.15",
        "devices": [
            {
                "uuid": f"GPU-{i:08x}-beef-beef-beef-{i:012x}",
                "name": "NVIDIA A100-SXM4-80GB",
                "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0",
                "memory_total": 80 * GiB,
                "memory_used": 0,
                "utilization_pct": 0,
                "processes": [],
            }
            for i in range(gpus)
        ],
    }


def _worker(mode: str, where: str, fleet_file: str, gate: str, out_fd: int, hold_fd: int) -> None:
    """One picker (a forked child): wait at the gate, pick, report, hold until told."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints

    registry: Any
    if mode == "broker":
        from autogpu_jupyter.core.leasing.brokerclient import BrokerStore

        registry = BrokerStore(where, lock_timeout_s=120.0)
    else:
        from autogpu_jupyter.core.leasing.directory import DirectoryStore

        registry = DirectoryStore(where, lock_timeout_s=120.0)
    backend = SimulatedBackend(fleet_file)
    backend.snapshot()  # warm, as a kernel whose sampler runs
    fd = os.open(gate, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    t0 = time.monotonic()
    result = pick(PickOptions(Constraints()), backend=backend, store=registry)
    t1 = time.monotonic()
    line = json.dumps({
        "uuid": result.chosen[0].uuid, "lease": result.lease is not None,
        "start": t0, "end": t1,
    })
    os.write(out_fd, line.encode() + b"\n")
    while os.read(hold_fd, 1):  # until the benchmark closes the pipe
        pass
    if result.lease is not None:
        result.lease.release()


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _mem_kib(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def herd(mode: str, where: str, fleet_file: str, n: int, tmp: Path) -> dict[str, Any]:
    gate = tmp / f"gate-{mode}"
    gfd = os.open(gate, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(gfd, fcntl.LOCK_EX)
    r_out, w_out = os.pipe()
    r_hold, w_hold = os.pipe()
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(r_out)
                os.close(w_hold)
                _worker(mode, where, fleet_file, str(gate), w_out, r_hold)
            except BaseException as err:  # report, never return into the benchmark
                print(f"worker failed: {err!r}", file=sys.stderr)
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(w_out)
    os.close(r_hold)
    time.sleep(1.0 + n * 0.01)  # every worker waits at the gate
    opened = time.monotonic()
    fcntl.flock(gfd, fcntl.LOCK_UN)
    rows = []
    with os.fdopen(r_out, "rb") as f:
        for _ in range(n):
            line = f.readline()
            if not line:
                break
            rows.append(json.loads(line))
    os.close(w_hold)
    for pid in pids:
        os.waitpid(pid, 0)
    os.close(gfd)
    counts = collections.Counter(r["uuid"] for r in rows)
    call = sorted((r["end"] - r["start"]) * 1000 for r in rows)
    gate_ms = sorted((r["end"] - opened) * 1000 for r in rows)
    return {
        "mode": mode,
        "picked": len(rows),
        "leased": sum(1 for r in rows if r["lease"]),
        "per_gpu": sorted(counts.values()),
        "spread": (max(counts.values()) - min(counts.values())) if counts else None,
        "call_ms_median": statistics.median(call),
        "call_ms_p95": call[int(0.95 * (len(call) - 1))],
        "gate_ms_median": statistics.median(gate_ms),
        "gate_ms_p95": gate_ms[int(0.95 * (len(gate_ms) - 1))],
    }


def start_broker(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    sock = str(tmp / "broker.sock")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--socket", sock,
         "--state-dir", str(tmp / "state")],
        env=env, stderr=subprocess.DEVNULL,
    )
    for _ in range(400):
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return proc, sock
        except OSError:
            time.sleep(0.05)
    raise SystemExit("broker did not start")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds of idle broker measured")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    # Import everything the workers use before forking (they start warm, like kernels).

    with tempfile.TemporaryDirectory(prefix="autogpu-broker-bench-") as t:
        tmp = Path(t)
        fleet_file = tmp / "fleet.json"
        fleet_file.write_text(json.dumps(make_fleet(a.gpus)))
        broker, sock = start_broker(tmp)
        try:
            time.sleep(1.0)
            c0, t0 = _cpu_s(broker.pid), time.monotonic()
            time.sleep(a.idle)
            idle = {"cpu_pct": 100 * (_cpu_s(broker.pid) - c0) / (time.monotonic() - t0),
                    **_mem_kib(broker.pid)}
            runs = []
            for i in range(a.rounds):
                reg = tmp / f"registry-{i}"
                runs.append(herd("registry", str(reg), str(fleet_file), a.n, tmp))
                c0, t0 = _cpu_s(broker.pid), time.monotonic()
                run = herd("broker", sock, str(fleet_file), a.n, tmp)
                run["broker_cpu_s"] = _cpu_s(broker.pid) - c0
                run["broker_cpu_pct"] = 100 * run["broker_cpu_s"] / (time.monotonic() - t0)
                run.update({f"broker_{k}": v for k, v in _mem_kib(broker.pid).items()})
                runs.append(run)
        finally:
            broker.terminate()
            broker.wait(10)
    report = {"n": a.n, "gpus": a.gpus, "broker_idle": idle, "runs": runs}
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"herd of {a.n} pickers on {a.gpus} GPUs; broker idle: {idle['cpu_pct']:.2f} % CPU, "
          f"RSS {idle.get('VmRSS', 0) / 1024:.1f} MiB")
    print("| mode | picked / leased | per GPU | spread | pick call median / p95 (ms) "
          "| from gate median / p95 (ms) | broker CPU s (% of the herd's wall) | broker RSS / peak "
          "(MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        cpu = (f"{r['broker_cpu_s']:.2f} ({r['broker_cpu_pct']:.0f} %)"
               if "broker_cpu_s" in r else "-")
        mem = (f"{r['broker_VmRSS'] / 1024:.1f} / {r['broker_VmHWM'] / 1024:.1f}"
               if "broker_VmRSS" in r else "-")
        print(f"| {r['mode']} | {r['picked']} / {r['leased']} | {min(r['per_gpu'])}-"
              f"{max(r['per_gpu'])} | {r['spread']} | {r['call_ms_median']:.0f} / "
              f"{r['call_ms_p95']:.0f} | {r['gate_ms_median']:.0f} / {r['gate_ms_p95']:.0f} | "
              f"{cpu} | {mem} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
