"""A pick's client side against a broker's book at host scale, in this process (issue 39): the
booking view ``begin`` answers, what the client makes of it, and the pick's own time.

    .venv/bin/python benchmarks/broker_view_profile.py [--leases 10000] [--gpus 64]
        [--repeat 40] [--view pids|rows] [--profile tottime|cumulative] [--top 25]

A ``Broker`` object with connections made by hand (no socket, no journal; as
tests/unit/test_broker_rules.py does), holding ``--leases`` shared leases of 256 MiB, 1,000 per
user and process, round robin over ``--gpus`` simulated GPUs (as benchmarks/broker_scale.py
grants them). One more user's ``begin`` is answered by the broker (``--view``: by process, as a
pick of this version asks, or the named rows an older client gets) and encoded as on the wire;
then ``core.picker.pick`` runs through the real client (``BrokerStore``) whose connection
hands it that answer and grants the lease the broker would: what is timed is the client's
decoding, the one decision and its bookkeeping, not a socket. Prints the view's size, the pick's
median and best of ``--repeat``, the decoding and the bookings alone (best of 50), and with
``--profile`` the top of a cProfile of the picks.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
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

from broker_herd import make_fleet  # noqa: E402

from autogpu_jupyter.broker import Broker, BrokerConfig, Conn  # noqa: E402
from autogpu_jupyter.brokerd import ops as ops_mod  # noqa: E402
from autogpu_jupyter.brokerd.identity import Account  # noqa: E402
from autogpu_jupyter.brokerd.views import encoded_line  # noqa: E402
from autogpu_jupyter.core.backends.simulated import SimulatedBackend  # noqa: E402
from autogpu_jupyter.core.decision import bookings_for  # noqa: E402
from autogpu_jupyter.core.leasing import wire  # noqa: E402
from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL, BrokerStore  # noqa: E402
from autogpu_jupyter.core.options import PickOptions  # noqa: E402
from autogpu_jupyter.core.picker import pick  # noqa: E402
from autogpu_jupyter.core.policy import Constraints  # noqa: E402

MiB = 1 << 20


def book(leases: int, fleet_file: Path) -> tuple[Broker, list[str], Conn]:
    b = Broker(BrokerConfig(socket_path="/nonexistent/b.sock"))
    b.fleet.backend = SimulatedBackend(str(fleet_file))
    b.fleet.snapshot()
    devices = sorted(d.uuid for d in b.book.snap.devices)
    for i in range(leases):
        uid = 2000 + i // 1000
        conn = Conn(b, uid, uid, 10000 + i // 1000, Account(uid, f"user{uid}", frozenset()))
        b.connections.conns.add(conn)
        conn.record = ops_mod.make_record(b, conn, "lease", {
            "device_uuids": [devices[i % len(devices)]], "device_requested_bytes": [256 * MiB],
            "exclusive": False, "pid": conn.pid, "kernel_id": f"{i:032x}",
            "notebook_path": f"projects/user-{i % 97}/nb-{i}.ipynb", "command": None,
            "holder_kind": "kernel",
        })
    viewer = Conn(b, 65534, 65534, os.getpid(), Account(65534, "nobody", frozenset()))
    b.connections.conns.add(viewer)
    return b, devices, viewer


class Answered:
    """The client's connection, answering from the broker's book (no socket)."""

    def __init__(self, b: Broker, viewer: Conn, begin: bytes) -> None:
        self.b, self.viewer, self.begin = b, viewer, begin

    def send(self, msg: Any, timeout_s: float = 30.0) -> None:
        pass

    def receive(self, op: str, timeout_s: float = 30.0, waiting_for: str = "") -> Any:
        return json.loads(self.begin)

    def call(self, msg: Any, timeout_s: float = 30.0, waiting_for: str = "") -> Any:
        rec = ops_mod.make_record(self.b, self.viewer, "lease", {
            "device_uuids": msg["devices"], "device_requested_bytes": msg["requested_bytes"],
            "exclusive": False, "pid": os.getpid(), "kernel_id": None, "notebook_path": None,
            "command": None, "holder_kind": "process",
        })
        return {"ok": True, "proto": PROTOCOL, "record": rec._payload()}

    def close(self) -> None:
        pass


def best_ms(fn: Callable[[], object], n: int = 50) -> float:
    out = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return 1000 * out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=10_000)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=40)
    ap.add_argument("--view", choices=wire.VIEW_SHAPES, default=wire.VIEW_BY_PID)
    ap.add_argument("--profile", choices=("tottime", "cumulative"))
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    fleet_file = Path(tempfile.mkdtemp(prefix="autogpu-view-")) / "fleet.json"
    fleet_file.write_text(json.dumps(make_fleet(a.gpus)))
    b, _, viewer = book(a.leases, fleet_file)

    def begin() -> bytes:
        reply = asyncio.run(b.run_op("begin", viewer, {"op": "begin", "view": a.view}))
        b.lock.release(viewer)
        msg = {**reply, "proto": PROTOCOL}  # encoded as the broker sends it
        return encoded_line(msg) or json.dumps(msg).encode() + b"\n"

    data = begin()
    registry = BrokerStore("/nonexistent/b.sock")
    registry._conn = lambda: Answered(b, viewer, data)  # type: ignore[method-assign,assignment,return-value]
    backend = SimulatedBackend(str(fleet_file))
    opts = PickOptions(Constraints())

    def one() -> None:
        result = pick(opts, backend=backend, store=registry, environ={})
        assert result.lease is not None

    one()
    times = []
    for _ in range(a.repeat):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    devices = json.loads(data)["devices"]
    records = wire.view_records(devices, "/s")
    snap = backend.snapshot()
    print(f"{a.leases:,} leases on {a.gpus} GPUs, view {a.view!r}: {len(data):,} bytes, "
          f"{len(records):,} records ({len({id(r) for r in records}):,} distinct)")
    print(f"pick (client side): median {1000 * statistics.median(times):.2f} ms, "
          f"best {1000 * min(times):.2f} ms of {a.repeat}")
    print(f"broker: begin and its encoding, best {best_ms(begin, 20):.2f} ms")
    print(f"client: json.loads {best_ms(lambda: json.loads(data)):.2f} ms, view_records "
          f"{best_ms(lambda: wire.view_records(devices, '/s')):.2f} ms, bookings_for "
          f"{best_ms(lambda: bookings_for(snap.devices, records)):.2f} ms (best of 50)")
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.repeat):
            one()
        prof.disable()
        pstats.Stats(prof).sort_stats(a.profile).print_stats(a.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
