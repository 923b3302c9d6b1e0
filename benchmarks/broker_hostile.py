"""A second user's pick while one user attacks the broker (issue 20).

``autogpu broker`` runs as a real root process (4 simulated GPUs, ``--max-devices-per-user 1``
as on the host where the attacks were found: 100 shared leases on one GPU are within it). The
attacker is one person: a passwd user and its subordinate uids (a ``--subuid-file`` of the
benchmark's own), as forked processes that ``setuid`` to them. The victim is another passwd
user (``daemon``): a forked process that runs :func:`autogpu_jupyter.core.picker.pick`
through the broker (begin, decide, lease), then releases, ``--picks`` times, one after the
other. Scenarios, each on the same broker:

``quiet``   nothing else runs;
``fat``     the attacker holds 100 leases on GPU 0 with every free-text field at its cap;
``silent``  256 connections that each send 400 requests and never read a reply;
``hog``     8 subordinate uids take the pick lock again and again and never give it back;
``storm``   8 subordinate uids take tickets for every GPU, exclusively, 100 a second
            each, keep the last few and drop the others.

Each round runs every scenario once, with a fresh attacker (another passwd user and its own
subordinate range: ``nobody``, ``bin``, ``sys``, ...; a person the broker barred from the waiting
line in one round is not the next round's). Reported per scenario: every pick succeeding, the
victim's median pick latency, its p99 in each round and the median of those p99s over the quiet
one's (one round's p99 is at the mercy of a noisy machine), and the broker's memory (VmRSS after
the scenario, VmHWM: the most it ever held). Then the churn measure: the victim's 200 lease/close
cycles (begin, lease, release on one connection each), quiet and with 100 maximal leases live, in
seconds and in the broker's CPU seconds.

Run as root::

    .venv/bin/python benchmarks/broker_hostile.py               # 3 rounds of 100 picks each
    .venv/bin/python benchmarks/broker_hostile.py --picks 50 --rounds 1 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autogpu_jupyter.core.backends.simulated import SimulatedBackend  # noqa: E402
from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL, BrokerStore  # noqa: E402
from autogpu_jupyter.core.options import PickOptions  # noqa: E402
from autogpu_jupyter.core.picker import pick  # noqa: E402
from autogpu_jupyter.core.policy import Constraints  # noqa: E402

GiB = 1024**3
SUBUID_FIRST = 700000


def fleet(n: int) -> dict[str, Any]:
    return {"driver_version": "550.54.15", "devices": [
        {"uuid": f"GPU-{i:08x}-dead-beef-cafe-{i:012x}", "name": "NVIDIA A100-SXM4-80GB",
         "pci_bus_id": f"00000000:{0x10 + i:02X}:00.0", "memory_total": 80 * GiB,
         "memory_used": 0, "utilization_pct": 0, "processes": []}
        for i in range(n)
    ]}


def wire(msg: dict[str, Any]) -> bytes:
    return json.dumps({"proto": PROTOCOL, **msg}).encode() + b"\n"


def call(s: socket.socket, msg: dict[str, Any]) -> Any:
    s.sendall(wire(msg))
    line = s.makefile("rb").readline()
    return json.loads(line) if line else None


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(path)
    return s


# ---- processes as other uids --------------------------------------------------------------------


class Child:
    """``fn(*args)`` in a forked child that dropped to ``uid``; its JSON result on a pipe. The
    child keeps running (holding what ``fn`` opened) until :meth:`stop`."""

    def __init__(self, uid: int, gid: int, fn: Any, *args: Any) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.close(r)
                os.setpgid(0, 0)  # stop() ends it and everything it forked
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                out = fn(*args)
                os.write(w, json.dumps(out).encode() + b"\n")
                os.close(w)
                signal.pause()  # until stop() kills us: whatever fn opened stays open
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        self._r = r

    def result(self) -> Any:
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise SystemExit(f"a benchmark process (pid {self.pid}) ended without a result")
            data += chunk
        return json.loads(data)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        os.close(self._r)


HELD: list[Any] = []


def fat(path: str, n: int, device: str) -> int:
    for i in range(n):
        s = connect(path)
        reply = call(s, {"op": "lease", "devices": [device], "requested_bytes": [GiB],
                         "holder": {"kind": "kernel", "kernel_id": f"{i:064d}",
                                    "notebook_path": "\U0001f600" * 4096}})
        assert reply and reply.get("ok"), reply
        HELD.append(s)
    return n


def silent(path: str, n: int, requests: int) -> int:
    for _ in range(n):
        s = connect(path)
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.send(wire({"op": "leases"}) * requests)
        HELD.append(s)
    return n


def hog_forever(path: str) -> None:
    """Take the pick lock, never give it back; again on a new connection once taken back."""
    while True:
        try:
            with connect(path) as s:
                call(s, {"op": "begin"})
                time.sleep(2.5)
        except OSError:
            time.sleep(0.1)


def storm_forever(path: str, devices: list[str]) -> None:
    """Tickets for every GPU, exclusively, 100 a second: each held for a moment, then dropped
    (the process paces itself so that the benchmark measures the broker, not 8 busy loops on
    the CPUs the victim needs; the broker refuses what is past a person's rate)."""
    ticket = {"op": "ticket", "exclusive": True, "constraints": {
        "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None,
        "count": len(devices), "exclude": [], "exclusive": True, "allowed_uuids": None}}
    held: list[socket.socket] = []
    while True:
        try:
            s = connect(path)
            reply = call(s, ticket)
            if reply and reply.get("ok"):
                held.append(s)
            else:
                s.close()
            if len(held) > 4:
                held.pop(0).close()
        except OSError:
            pass
        time.sleep(0.01)


def looping(fn: Any, *args: Any) -> str:
    pid = os.fork()
    if pid == 0:
        try:
            fn(*args)
        finally:
            os._exit(0)
    HELD.append(pid)
    return "started"


def victim_picks(path: str, fleet_file: str, n: int) -> dict[str, Any]:
    reg = BrokerStore(path, lock_timeout_s=30.0)
    backend = SimulatedBackend(fleet_file)
    backend.snapshot()
    times = []
    failed = []
    for _ in range(n):
        start = time.perf_counter()
        try:
            result = pick(PickOptions(Constraints.parse()), store=reg, backend=backend, environ={})
        except Exception as err:  # counted and reported, the run goes on
            failed.append(f"{type(err).__name__}: {err}"[:300])
            continue
        times.append(time.perf_counter() - start)
        if result.lease is not None:
            result.lease.release()
    return {"times": times, "failed": failed}


def victim_cycles(path: str, device: str, n: int) -> float:
    reg = BrokerStore(path)
    start = time.perf_counter()
    for _ in range(n):
        with reg.locked() as txn:
            lease = txn.create(devices=[device])
        lease.release()
    return time.perf_counter() - start


# ---- the broker -------------------------------------------------------------------------------


def memory_mib(pid: int) -> tuple[float, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out["VmRSS"], out["VmHWM"]


def start_broker(area: Path, fleet_file: Path) -> subprocess.Popen[bytes]:
    sock = area / "run" / "broker.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
    env.update(AUTOGPU_SIMULATE=str(fleet_file), PYTHONPATH=str(ROOT))
    log = open(area / "broker.log", "ab")  # noqa: SIM115 (the broker's for its whole life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--foreground", "--socket",
         str(sock), "--state-dir", str(area / "state"), "--max-devices-per-user", "1",
         "--subuid-file", str(area / "subuid")],
        stdout=log, stderr=log, env=env,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(sock))
            return proc
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the broker did not start")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_sync_s(directory: Path, n: int = 200) -> float:
    """What ``n`` appends of a journal line, each followed by ``fdatasync``, cost on the disk
    of ``directory`` alone: what ``n`` grants would cost if each were flushed (they are not: no
    lease outlives the boot, see brokerd/journal.py)."""
    path = directory / "sync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        start = time.perf_counter()
        for _ in range(n):
            os.write(fd, b"x" * 600 + b"\n")
            os.fdatasync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.99 * len(ordered)) - 1)]


ATTACKERS = ("nobody", "bin", "sys", "sync", "games")  # one person per round


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--picks", type=int, default=100, help="the victim's picks per scenario")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("broker_hostile.py: run as root (the users are other uids)")
    if not 1 <= a.rounds <= len(ATTACKERS):
        raise SystemExit(f"broker_hostile.py: --rounds is 1 to {len(ATTACKERS)}")
    victim = pwd.getpwnam("daemon")
    area = Path(f"/var/tmp/autogpu-hostile-{secrets.token_hex(4)}")
    (area / "run").mkdir(parents=True, mode=0o755)
    os.chmod(area, 0o755)
    os.chmod(area / "run", 0o755)
    fleet_file = area / "fleet.json"
    spec = fleet(4)
    fleet_file.write_text(json.dumps(spec))
    os.chmod(fleet_file, 0o644)
    # each round's attacker is a passwd user with a subordinate range of its own
    (area / "subuid").write_text("".join(
        f"{name}:{SUBUID_FIRST + 65536 * i}:65536\n" for i, name in enumerate(ATTACKERS)))
    devices = [d["uuid"] for d in spec["devices"]]
    path = str(area / "run" / "broker.sock")
    broker = start_broker(area, fleet_file)
    load = Path("/proc/loadavg").read_text().split()[0]
    picks: dict[str, list[dict[str, Any]]] = {}
    memory: dict[str, tuple[float, float]] = {}

    def measure(name: str, attack: list[Child]) -> None:
        time.sleep(1.0)  # the attack is under way
        v = Child(victim.pw_uid, victim.pw_gid, victim_picks, path, str(fleet_file), a.picks)
        got = v.result()
        v.stop()
        for c in attack:
            c.stop()
        picks.setdefault(name, []).append(got)
        memory[name] = memory_mib(broker.pid)

    try:
        for r in range(a.rounds):
            def sub(n: int, r: int = r) -> tuple[int, int]:
                uid = SUBUID_FIRST + 65536 * r + n
                return uid, uid

            measure("quiet", [])
            fat_child = Child(*sub(1), fat, path, 100, devices[0])
            fat_child.result()
            measure("fat", [fat_child])
            silent_child = Child(*sub(2), silent, path, 256, 400)
            silent_child.result()
            measure("silent", [silent_child])
            hogs = [Child(*sub(10 + i), looping, hog_forever, path) for i in range(8)]
            for h in hogs:
                h.result()
            measure("hog", hogs)
            storms = [Child(*sub(20 + i), looping, storm_forever, path, devices)
                      for i in range(8)]
            for st in storms:
                st.result()
            measure("storm", storms)
        # Churn: 200 lease/close cycles of the victim, quiet, then with 100 maximal leases live.
        cpu0 = cpu_s(broker.pid)
        cyc = Child(victim.pw_uid, victim.pw_gid, victim_cycles, path, devices[1], 200)
        quiet_cycles_s = cyc.result()
        cyc.stop()
        quiet_cpu = cpu_s(broker.pid) - cpu0
        fat_child = Child(SUBUID_FIRST + 1, SUBUID_FIRST + 1, fat, path, 100, devices[0])
        fat_child.result()
        cpu0 = cpu_s(broker.pid)
        cyc = Child(victim.pw_uid, victim.pw_gid, victim_cycles, path, devices[1], 200)
        cycles_s = cyc.result()
        cyc.stop()
        fat_cpu = cpu_s(broker.pid) - cpu0
        fat_child.stop()
        journal = (area / "state" / "journal.log").stat().st_size
        syncs = disk_sync_s(area / "state")
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(10)
        log_lines = len((area / "broker.log").read_text().splitlines())
        shutil.rmtree(area, ignore_errors=True)

    rows = []
    for name, rounds in picks.items():
        p99s = [1000 * p99(g["times"]) for g in rounds if g["times"]]
        failed = [f for g in rounds for f in g["failed"]]
        rows.append({
            "scenario": name,
            "picks": sum(len(g["times"]) for g in rounds), "failed": len(failed),
            "first_failure": failed[0] if failed else None,
            "median_ms": 1000 * statistics.median(t for g in rounds for t in g["times"]),
            "p99_ms_rounds": p99s, "p99_ms": statistics.median(p99s),
            "rss_mib": memory[name][0], "hwm_mib": memory[name][1],
        })
    quiet = rows[0]["p99_ms"]
    for row in rows:
        row["p99_ratio"] = row["p99_ms"] / quiet
    out = {"scenarios": rows, "cycles_200_s": cycles_s, "quiet_cycles_200_s": quiet_cycles_s,
           "load_average_at_start": float(load),
           "broker_cpu_s_quiet_cycles": quiet_cpu, "broker_cpu_s_fat_cycles": fat_cpu,
           "journal_bytes_after": journal, "broker_log_lines": log_lines,
           "disk_200_fdatasync_s": syncs}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    print("| scenario | picks ok / failed | median (ms) | p99 per round (ms) | median p99 / "
          "quiet's | broker RSS / peak (MiB) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        per_round = ", ".join(f"{v:.1f}" for v in row["p99_ms_rounds"])
        print(f"| {row['scenario']} | {row['picks']} / {row['failed']} | "
              f"{row['median_ms']:.1f} | {per_round} | {row['p99_ratio']:.2f} | "
              f"{row['rss_mib']:.1f} / {row['hwm_mib']:.1f} |")
        if row["first_failure"]:
            print(f"\nfirst failure ({row['scenario']}): {row['first_failure']}\n")
    print(f"\nload average at the start: {load}")
    print(f"200 lease/close cycles: {quiet_cycles_s:.2f} s quiet ({quiet_cpu:.2f} s of the "
          f"broker's CPU), {cycles_s:.2f} s with 100 maximal leases live ({fat_cpu:.2f} s of "
          f"its CPU); journal {journal / 1024:.0f} KiB after; broker log {log_lines} lines")
    print(f"the disk alone: 200 appends with fdatasync {syncs:.2f} s (what flushing each grant "
          "would add; grants are written, not flushed)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
