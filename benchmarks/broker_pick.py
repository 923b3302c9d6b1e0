"""One uncontended pick through the trusted broker beside one through the shared directory
(issue 26: the broker's at most 1.5x the directory's).

    .venv/bin/python benchmarks/broker_pick.py [--repeat 300] [--backend simulated|nvml]
        [--json] [--profile] [--results FILE]

``autogpu broker`` runs as a real process on a Unix socket (as ``benchmarks/broker_herd.py``
starts it); this process picks through :func:`autogpu_jupyter.core.picker.pick` on a simulated
8-GPU fleet (warm, as a kernel whose sampler runs), once with the broker's client
(``BrokerStore``: connect, ``begin`` under the pick lock, ``lease``) and once with the shared
directory (``DirectoryStore`` in a temp dir: lock, scan, write the lease file), releasing the lease
after each pick, outside the timing. The two alternate in 10 blocks so that load on the shared
machine hits both alike; medians and p90 of ``--repeat`` picks each. ``--profile`` prints the
top of a cProfile of the broker picks (this process's side only).

``--backend``: where the devices are read. ``simulated`` (the default, and what ``make bench``
records): the simulated fleet, whose snapshot costs ~0.1 ms, so the stores' own costs dominate
(the strictest form). ``nvml``: the fake 8-GPU ``libnvidia-ml.so.1`` of tests/fakenvml through
the real pynvml binding, as ``pick_latency.py`` reads it: a snapshot costs what NVML's calls
cost, as on a user's host.

The floor: a pick through the broker makes two round trips to another process (``begin``,
``lease``) where the directory makes none, so the run also times a bare round trip between two
Python processes over a Unix socket (one line out, one line back, blocking reads, nothing else
done), on the same machine in the same run: ``floor_rtt_ms``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from broker_herd import make_fleet, start_broker  # noqa: E402


def _timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        lease = fn()
        out.append((time.perf_counter() - t0) * 1000.0)
        if lease is not None:
            lease.release()  # type: ignore[attr-defined]
    return out


def _stats(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {
        "median_ms": round(statistics.median(ms), 3),
        "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3),
    }


_ECHO = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile('rb')\n"
    "for line in f:\n"
    "    s.sendall(line)\n"
)


def floor_rtt(tmp: Path, repeat: int) -> list[float]:
    """Milliseconds of ``repeat`` bare round trips to an echoing Python process."""
    import subprocess

    path = str(tmp / "echo.sock")
    with socket.socket(socket.AF_UNIX) as srv:
        srv.bind(path)
        srv.listen(1)
        proc = subprocess.Popen([sys.executable, "-c", _ECHO, path])
        try:
            conn, _ = srv.accept()
            with conn:
                out = []
                for i in range(repeat + 20):
                    t0 = time.perf_counter()
                    conn.sendall(b"ping\n")
                    got = b""
                    while not got.endswith(b"\n"):
                        got += conn.recv(64)
                    if i >= 20:  # the first ones warm both sides
                        out.append((time.perf_counter() - t0) * 1000.0)
        finally:
            proc.kill()
            proc.wait(10)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--backend", choices=("simulated", "nvml"), default="simulated")
    ap.add_argument("--results", help="merge the ratio into this JSON file (make bench)")
    a = ap.parse_args()

    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.leasing.brokerclient import BrokerStore
    from autogpu_jupyter.core.leasing.directory import DirectoryStore
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints

    with tempfile.TemporaryDirectory(prefix="autogpu-broker-pick-") as t:
        tmp = Path(t)
        fleet_file = tmp / "fleet.json"
        fleet_file.write_text(json.dumps(make_fleet(8)))
        broker, sock = start_broker(tmp)
        try:
            backend: Any = SimulatedBackend(str(fleet_file))
            if a.backend == "nvml":
                from autogpu_jupyter.core.backends.nvml import NvmlBackend
                from tests.fakenvml import FakeNvml, fleet_8x, preload_fake_nvml

                preload_fake_nvml()
                fake = FakeNvml(tmp / "nvml")
                fake.write(fleet_8x())
                os.environ["FAKE_NVML_SCENARIO"] = str(fake.scenario_path)
                backend = NvmlBackend()
                backend.warm_up()
            backend.snapshot()
            stores = {
                "broker": BrokerStore(sock, lock_timeout_s=30.0),
                "directory": DirectoryStore(str(tmp / "registry"), lock_timeout_s=30.0),
            }
            opts = PickOptions(Constraints())

            def picker(store: object) -> Callable[[], object]:
                def one() -> object:
                    return pick(opts, backend=backend, store=store).lease  # type: ignore[arg-type]

                return one

            for store in stores.values():  # connections, first files, imports: untimed
                _timed(picker(store), 3)
            times: dict[str, list[float]] = {k: [] for k in stores}
            block = max(1, a.repeat // 10)
            for _ in range(10):
                for name, store in stores.items():
                    times[name] += _timed(picker(store), block)
            floor = floor_rtt(tmp, block * 10)
            if a.profile:
                prof = cProfile.Profile()
                one = picker(stores["broker"])
                for _ in range(block):
                    prof.enable()
                    lease = one()
                    prof.disable()
                    lease.release()  # type: ignore[attr-defined]
                pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        finally:
            broker.terminate()
            broker.wait(10)
    stats = {k: _stats(v) for k, v in times.items()}
    result = {
        "repeat": block * 10,
        "backend": a.backend,
        "stats": stats,
        "ratio_broker_vs_directory": round(
            stats["broker"]["median_ms"] / stats["directory"]["median_ms"], 3
        ),
        "floor_rtt_ms": _stats(floor)["median_ms"],
    }
    from results import record

    key = "broker_pick.broker_vs_directory" + ("" if a.backend == "simulated" else f".{a.backend}")
    record(a.results, {key: result["ratio_broker_vs_directory"]})
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in stats.items():
            print(f"  {k:10} median {v['median_ms']:7.3f} ms  p90 {v['p90_ms']:7.3f} ms")
        print(f"  broker / directory: {result['ratio_broker_vs_directory']:.3f} (goal <= 1.5)")
        print(f"  a bare round trip between two processes: {result['floor_rtt_ms']:.3f} ms "
              "(a broker pick makes two)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
