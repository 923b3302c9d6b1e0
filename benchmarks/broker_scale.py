"""The broker at host scale (issue 39): 10,000 live leases and 1,000 more connected clients on a
simulated 64-GPU host, beside the shared directory with the same 10,000 leases.

    .venv/bin/python benchmarks/broker_scale.py [--leases 10000] [--idle 1000] [--gpus 64]
        [--quiet-picks 1000] [--picks 100] [--load-picks 50] [--loaders 4] [--phase-s 60] [--json]
        [--results FILE] [--raw FILE | --from-raw FILE]

Everything goes through what a user or an admin can reach: ``autogpu broker`` as a real
process (flags only: ``--max-connections``, ``--max-connections-per-user``, an empty rules
file of the benchmark's own), its Unix socket in raw JSON lines (the holders) and through the
real client (``BrokerStore`` under ``core.picker.pick``: the measured picks), ``kill -9``.

**A lease is a connection** (``autogpu_jupyter/broker.py``): the 10,000 leases are 10,000
connections, each with one shared lease on one of the 64 GPUs (256 MiB booked), held by 10
processes of 10 passwd users (``daemon`` ... ``uucp``, 1,000 each) that send ``lease`` and never
read again; the 1,000 *idle* clients are connections of one more user (``proxy``) that hold
nothing. As root the users are those passwd users (forked processes that ``setuid``); as
another user every process is that user (and the printed note says so).

Measured, in this order:

* the pick of one more user (``nobody``): ``core.picker.pick`` through the broker and through
  the shared directory (``DirectoryStore`` in ``/var/tmp``, the same 10,000 leases as lease files of
  the same users, held with ``flock`` by one process), released after each pick; *quiet*: the
  two alternate in 10 blocks, ``--quiet-picks`` through the broker (1,000: its p99 is then the
  11th slowest pick, not the 2nd) and ``--picks`` through the directory (100: it takes about
  130 ms a pick), every pick kept (the first after the grants too: no warm-up is left out);
  each p99 goes with its n; *under load*: ``--loaders`` more users pick and release without
  pause through the same store, the broker's run and then the directory's;
* the broker's CPU (``/proc/PID/stat``, user + system) idle for 5 s and per phase, and its
  memory (``VmRSS``, ``VmHWM``);
* compaction: the journal the broker wrote (10,000 live entries), copied, loaded and compacted
  by ``brokerd/journal.py``'s ``Journal`` (replay, then ``compact``: what a restart does first,
  and what the broker does whenever the log passes four times its live entries);
* restart: ``kill -9``, start again on the same state directory, until it answers ``status``
  with every lease taken back (``orphans``), beside a restart with an empty journal;
* after the restart: ``nobody``'s picks again, now that the 10,000 leases are orphans the broker
  re-checks every second.

Bounded: each phase of picks stops at its count or its time (``--phase-s`` quiet, 3/4 of it for
each run under load, half of it after the restart), the restart at ``--restart-timeout``. The
setup is not: granting the 10,000 leases takes what the broker takes (the time is printed).
Progress goes to stderr; ``--raw FILE`` keeps the measures, ``--from-raw FILE`` prints their
table again without a run.

Goals (issue 39): p99 <= 20 ms quiet, restart <= 1 s, RSS <= 256 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pwd
import resource
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from broker_herd import make_fleet  # noqa: E402

from autogpu_jupyter.core.backends.simulated import SimulatedBackend  # noqa: E402
from autogpu_jupyter.core.leasing.brokerclient import PROTOCOL, BrokerStore  # noqa: E402
from autogpu_jupyter.core.leasing.directory import DirectoryStore  # noqa: E402
from autogpu_jupyter.core.options import PickOptions  # noqa: E402
from autogpu_jupyter.core.picker import pick  # noqa: E402
from autogpu_jupyter.core.policy import Constraints  # noqa: E402

MiB = 1024**2
BOOKED = 256 * MiB
HOLDER_USERS = ("daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp")
IDLE_USER = "proxy"
VICTIM = "nobody"
LOADER_USERS = ("www-data", "backup", "list", "irc")


# ---- small pieces ------------------------------------------------------------------------------


_T0 = time.monotonic()


def say(what: str) -> None:
    """Progress, on stderr (the table goes to stdout)."""
    print(f"[{time.monotonic() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def raise_nofile(want: int) -> int:
    """Raise this process's descriptor limit (its children inherit it) to ``want`` where the
    hard limit (or, as root, ``nr_open``) allows; the soft limit reached."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if os.geteuid() == 0:
        try:
            nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            nr_open = hard
        hard = max(hard, min(want, nr_open))
    target = min(want, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, target), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def account(name: str) -> tuple[int, int]:
    """``name``'s uid and gid as root; as another user, that user's own (one person)."""
    if os.geteuid() != 0:
        return os.geteuid(), os.getegid()
    pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid


def wire(msg: dict[str, Any]) -> bytes:
    return json.dumps({"proto": PROTOCOL, **msg}).encode() + b"\n"


def connect(path: str, timeout: float = 60.0) -> socket.socket:
    """A connection to ``path``; while the listen backlog is full (``EAGAIN``: thousands of
    connections at once), tried again after a moment, as a client would."""
    deadline = time.monotonic() + timeout
    while True:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(path)
            return s
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path}: the listen backlog stayed full for "
                                   f"{timeout:g} s") from None
            time.sleep(0.005)
        except BaseException:
            s.close()
            raise


def ask(path: str, msg: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    """One request on a fresh connection, its reply."""
    with connect(path, timeout) as s:
        s.sendall(wire(msg))
        line = s.makefile("rb").readline()
    if not line:
        raise OSError("the broker closed the connection without a reply")
    reply: dict[str, Any] = json.loads(line)
    return reply


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (p99 of 100 values: the 99th, the second largest)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered), round(q * len(ordered))) - 1)]


def summary_ms(seconds: Sequence[float]) -> dict[str, float]:
    ms = [1000.0 * s for s in seconds]
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50_ms": statistics.median(ms), "p90_ms": quantile(ms, 0.9),
            "p99_ms": quantile(ms, 0.99), "max_ms": max(ms)}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


class Child:
    """``fn(*args)`` in a forked child that dropped to ``uid``/``gid`` (as root); its JSON
    result on a pipe. The child keeps what ``fn`` opened until :meth:`stop`."""

    def __init__(self, uid: int, gid: int, fn: Callable[..., Any], *args: Any) -> None:
        r, w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.close(r)
                os.setpgid(0, 0)  # stop() ends it and everything it forked
                if os.geteuid() == 0 and uid != 0:
                    os.setgroups([])
                    os.setgid(gid)
                    os.setuid(uid)
                out = fn(*args)
                os.write(w, json.dumps(out).encode() + b"\n")
                os.close(w)
                signal.pause()  # until stop(): whatever fn opened stays open
            except BaseException as err:  # reported to the parent
                with contextlib.suppress(OSError):
                    os.write(w, json.dumps({"error": f"{type(err).__name__}: {err}"}).encode()
                             + b"\n")
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
        out = json.loads(data)
        if isinstance(out, dict) and "error" in out and len(out) == 1:
            raise SystemExit(f"a benchmark process (pid {self.pid}) failed: {out['error']}")
        return out

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(OSError):
            os.close(self._r)


HELD: list[Any] = []  # what a child keeps open until it is stopped


# ---- the broker ----------------------------------------------------------------------------------


class Broker:
    """``autogpu broker`` as a real process on ``area``; :meth:`restart` keeps its state."""

    def __init__(self, area: Path, fleet_file: Path, args: Sequence[str]) -> None:
        self.area = area
        self.fleet_file = fleet_file
        self.socket = str(area / "run" / "broker.sock")
        self.args = list(args)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, expect_orphans: int = 0, timeout: float = 180.0) -> dict[str, float]:
        """Start it; seconds until it answers ``status`` (``answer_s``) and until that status
        counts ``expect_orphans`` leases taken back (``back_s``)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
        env.update(AUTOGPU_SIMULATE=str(self.fleet_file), PYTHONPATH=str(ROOT))
        log = open(self.area / "broker.log", "ab")  # noqa: SIM115 (the broker's, for its life)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--foreground",
             "--socket", self.socket, "--state-dir", str(self.area / "state"), *self.args],
            stdout=log, stderr=log, env=env, cwd=str(ROOT),
        )
        log.close()
        answer = None
        deadline = t0 + timeout
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                tail = (self.area / "broker.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"the broker exited ({self.proc.returncode}): {tail}")
            try:
                st = ask(self.socket, {"op": "status"}, timeout=max(1.0, deadline - time.time()))
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            now = time.perf_counter() - t0
            if answer is None:
                answer = now
            if int(st.get("orphans") or 0) >= expect_orphans:
                return {"answer_s": answer, "back_s": now}
            time.sleep(0.02)
        return {"answer_s": answer if answer is not None else float("inf"),
                "back_s": float("inf")}

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def status(self) -> dict[str, Any]:
        return ask(self.socket, {"op": "status"})


# ---- what the users do ---------------------------------------------------------------------------


def hold_leases(path: str, devices: list[str], first: int, n: int) -> dict[str, Any]:
    """``n`` connections, each with one shared lease (raw ``lease``, one after another), kept
    open and never read again."""
    t0 = time.perf_counter()
    ok = 0
    first_error = None
    for i in range(first, first + n):
        s = connect(path, timeout=600.0)
        s.sendall(wire({"op": "lease", "devices": [devices[i % len(devices)]],
                        "requested_bytes": [BOOKED],
                        "holder": {"kind": "kernel", "kernel_id": f"{i:032x}",
                                   "notebook_path": f"projects/user-{i % 97}/nb-{i}.ipynb"}}))
        line = s.makefile("rb").readline()
        reply = json.loads(line) if line else {"error": "connection closed"}
        if reply.get("ok"):
            ok += 1
        elif first_error is None:
            first_error = str(reply.get("error"))[:300]
        HELD.append(s)
    return {"ok": ok, "first_error": first_error, "s": time.perf_counter() - t0}


def hold_idle(path: str, n: int) -> int:
    """``n`` connected clients that hold nothing and send nothing."""
    for _ in range(n):
        HELD.append(connect(path))
    return n


def hold_lease_files(reg: str, devices: list[str], owners: list[int], n: int) -> int:
    """The same leases in the shared directory: lease files of ``owners`` (round robin), each
    held with ``flock`` by this process, as the users' kernels would (the directory's format:
    one JSON record per ``<registry>/<uid>/<lease id>.lease``)."""
    import fcntl

    root = os.geteuid() == 0
    for uid in set(owners):
        d = Path(reg) / str(uid)
        d.mkdir(mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
        if root:
            os.chown(d, uid, uid)
    for i in range(n):
        uid = owners[i % len(owners)]
        lease_id = secrets.token_hex(16)
        rec = {"version": 1, "kind": "lease", "lease_id": lease_id,
               "device_uuids": [devices[i % len(devices)]], "device_requested_bytes": [BOOKED],
               "exclusive": False, "user": _name(uid), "uid": uid, "host": socket.gethostname(),
               "pid": os.getpid(), "created_s": time.time(), "kernel_id": f"{i:032x}",
               "notebook_path": f"projects/user-{i % 97}/nb-{i}.ipynb", "command": None,
               "holder_kind": "kernel"}
        fd = os.open(Path(reg) / str(uid) / f"{lease_id}.lease",
                     os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        os.write(fd, json.dumps(rec).encode())
        if root:
            os.fchown(fd, uid, uid)
        fcntl.flock(fd, fcntl.LOCK_EX)
        HELD.append(fd)
    return n


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _store(kind: str, where: str) -> Any:
    if kind == "broker":
        return BrokerStore(where, lock_timeout_s=30.0)
    return DirectoryStore(where, lock_timeout_s=30.0)


def picks(fleet_file: str, plan: list[tuple[str, str, int]], wall_s: float) -> dict[str, Any]:
    """The measured user: for each ``(kind, where, count)`` of ``plan`` in turn, ``count``
    picks through that store (each released, outside the timing); stops at ``wall_s``."""
    backend = SimulatedBackend(fleet_file)
    backend.snapshot()  # warm, as a kernel whose sampler runs
    stores = {}
    times: dict[str, list[float]] = {}
    failed: dict[str, list[str]] = {}
    unleased: dict[str, int] = {}
    deadline = time.monotonic() + wall_s
    opts = PickOptions(Constraints())
    for kind, where, count in plan:
        store = stores.setdefault(kind, _store(kind, where))
        times.setdefault(kind, [])
        failed.setdefault(kind, [])
        unleased.setdefault(kind, 0)
        for _ in range(count):
            if time.monotonic() > deadline:
                break
            t0 = time.perf_counter()
            try:
                result = pick(opts, backend=backend, store=store, environ={})
            except Exception as err:  # counted and reported, the run goes on
                failed[kind].append(f"{type(err).__name__}: {err}"[:300])
                continue
            times[kind].append(time.perf_counter() - t0)
            if result.lease is None:
                unleased[kind] += 1
            else:
                result.lease.release()
    return {"times": times, "failed": failed, "unleased": unleased}


def load(fleet_file: str, kind: str, where: str, stop: str) -> int:
    """A loading user: picks and releases without pause until ``stop`` exists; how many."""
    backend = SimulatedBackend(fleet_file)
    store = _store(kind, where)
    opts = PickOptions(Constraints())
    n = 0
    while not os.path.exists(stop):
        with contextlib.suppress(Exception):
            result = pick(opts, backend=backend, store=store, environ={})
            if result.lease is not None:
                result.lease.release()
            n += 1
    return n


def timed_compaction(state: Path, work: Path) -> dict[str, Any]:
    """Load and compact a copy of the journal the broker wrote, with the broker's own journal
    code (``brokerd/journal.py``)."""
    try:
        from autogpu_jupyter.brokerd.journal import Journal
    except ImportError as err:  # the refactor moved it: say so, measure the rest
        return {"error": f"brokerd.journal.Journal not importable ({err})"}
    work.mkdir(mode=0o700)
    shutil.copy2(state / "journal.log", work / "journal.log")
    size = (work / "journal.log").stat().st_size
    j = Journal(str(work))
    t0 = time.perf_counter()
    entries = j.load()  # replay, then compact (what a restart does)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    j.compact()
    compact_s = time.perf_counter() - t0
    j.close()
    return {"entries": len(entries), "log_bytes": size,
            "compacted_bytes": (work / "journal.log").stat().st_size,
            "load_s": load_s, "compact_s": compact_s}


# ---- the run -------------------------------------------------------------------------------------


def run(a: argparse.Namespace) -> dict[str, Any]:
    root = os.geteuid() == 0
    need = a.leases + a.idle + 2048
    nofile = raise_nofile(need + 4096)
    if nofile < need:
        raise SystemExit(f"broker_scale.py: the descriptor limit is {nofile}, the run needs "
                         f"{need}: raise it (ulimit -n) or lower --leases/--idle")
    notes = []
    if not root:
        notes.append("not root: every holder, picker and loader is the caller's own uid (one "
                     "person); as root they are 16 passwd users")
    per_holder = -(-a.leases // len(HOLDER_USERS))
    area = Path(tempfile.mkdtemp(prefix="autogpu-scale-", dir="/var/tmp"))
    os.chmod(area, 0o755)
    (area / "run").mkdir(mode=0o755)
    fleet_file = area / "fleet.json"
    spec = make_fleet(a.gpus)
    fleet_file.write_text(json.dumps(spec))
    os.chmod(fleet_file, 0o644)
    devices = [d["uuid"] for d in spec["devices"]]
    rules = area / "rules.json"  # no limits; the host's own rules file is not read
    rules.write_text(json.dumps({"max_devices_per_user": 0, "max_leases_per_user": 0}))
    reg = str(area / "registry")
    DirectoryStore(reg).check()  # the shared directory (mode 1777)
    broker = Broker(area, fleet_file, [
        "--rules", str(rules), "--max-connections", str(a.leases + a.idle + 1024),
        "--max-connections-per-user", str(max(per_holder, a.idle) + 64)
        if root else str(a.leases + a.idle + 512),
    ])
    children: list[Child] = []
    out: dict[str, Any] = {"notes": notes, "leases": a.leases, "idle": a.idle, "gpus": a.gpus,
                           "loaders": a.loaders,
                           "load_average_at_start": float(
                               Path("/proc/loadavg").read_text().split()[0])}
    stop_file = area / "stop-loaders"
    def measure(plan: list[tuple[str, str, int]], wall_s: float) -> dict[str, Any]:
        v = Child(*account(VICTIM), picks, str(fleet_file), plan, wall_s)
        got: dict[str, Any] = v.result()
        v.stop()
        for kind, times in got["times"].items():
            errs = got["failed"][kind]
            say(f"  {kind}: {len(times)} picks, {len(errs)} failed"
                + (f" (first: {errs[0]})" if errs else ""))
        return got

    def loaded(kind: str, where: str) -> tuple[dict[str, Any], int, float, float]:
        with contextlib.suppress(FileNotFoundError):
            stop_file.unlink()
        loaders = [Child(*account(u), load, str(fleet_file), kind, where, str(stop_file))
                   for u in LOADER_USERS[: a.loaders]]
        time.sleep(1.0)  # under way
        cpu0, t0 = cpu_s(broker.pid), time.perf_counter()
        got = measure([(kind, where, a.load_picks)], a.phase_s * 0.75)
        wall = time.perf_counter() - t0
        cpu = cpu_s(broker.pid) - cpu0
        stop_file.touch()
        done = sum(int(c.result()) for c in loaders)
        for c in loaders:
            c.stop()
        return got, done, cpu, wall

    try:
        say("starting the broker")
        broker.start()  # the first start reads the modules from disk: not the baseline
        broker.kill9()
        out["start_empty"] = broker.start()  # a restart with an empty journal
        # the 10,000 leases: 10 holders at once, 1,000 each
        t0 = time.perf_counter()
        say(f"{a.leases} leases")
        holders = [Child(*account(u), hold_leases, broker.socket, devices, i * per_holder,
                         min(per_holder, a.leases - i * per_holder))
                   for i, u in enumerate(HOLDER_USERS) if i * per_holder < a.leases]
        children += holders
        granted = [h.result() for h in holders]
        out["grant_all_s"] = time.perf_counter() - t0
        out["granted"] = sum(g["ok"] for g in granted)
        errors = [g["first_error"] for g in granted if g["first_error"]]
        if out["granted"] < a.leases:
            raise SystemExit(f"only {out['granted']} of {a.leases} leases granted: {errors[:1]}")
        say("leases granted; idle clients")
        idle = Child(*account(IDLE_USER), hold_idle, broker.socket, a.idle)
        children.append(idle)
        idle.result()
        st = broker.status()
        out["status_after_setup"] = {k: st.get(k) for k in (
            "leases_total", "connections", "max_connections", "journal_bytes")}
        time.sleep(1.0)
        cpu0 = cpu_s(broker.pid)
        time.sleep(5.0)
        out["idle_cpu_pct"] = 100.0 * (cpu_s(broker.pid) - cpu0) / 5.0
        out["memory_setup"] = memory_mib(broker.pid)
        say("idle CPU measured; lease files")
        # the same leases in the shared directory
        owners = [account(u)[0] for u in HOLDER_USERS]
        files = Child(0 if root else os.geteuid(), 0 if root else os.getegid(),
                      hold_lease_files, reg, devices, owners, a.leases)
        children.append(files)
        files.result()

        say("quiet picks")
        # quiet: broker and directory alternate in 10 blocks (the broker's first)
        blocks = (("broker", broker.socket, max(1, a.quiet_picks // 10)),
                  ("directory", reg, max(1, a.picks // 10)))
        cpu0 = cpu_s(broker.pid)
        quiet = measure([b for _ in range(10) for b in blocks],
                        a.phase_s)
        out["quiet"] = quiet
        out["quiet_broker_cpu_s_per_pick"] = (
            (cpu_s(broker.pid) - cpu0) / max(1, len(quiet["times"]["broker"])))
        out["memory_quiet"] = memory_mib(broker.pid)

        say("picks under load, broker")
        # under load
        got, done, cpu, wall = loaded("broker", broker.socket)
        out["load_broker"] = {**got, "loader_picks": done, "broker_cpu_pct": 100 * cpu / wall,
                              "wall_s": wall}
        out["memory_load"] = memory_mib(broker.pid)
        say("picks under load, directory")
        got, done, _cpu, wall = loaded("directory", reg)
        out["load_directory"] = {**got, "loader_picks": done, "wall_s": wall}
        files.stop()
        children.remove(files)

        say("compaction")
        # compaction of the journal the broker wrote
        out["compaction"] = timed_compaction(area / "state", area / "journal-copy")

        say("restart")
        # restart
        broker.kill9()
        out["restart"] = broker.start(expect_orphans=a.leases, timeout=a.restart_timeout)
        say("restarted; picks after the restart")
        out["memory_restart"] = memory_mib(broker.pid)
        st = broker.status()
        out["status_after_restart"] = {k: st.get(k) for k in ("leases_total", "orphans")}
        cpu0, t0 = cpu_s(broker.pid), time.perf_counter()
        out["after_restart"] = measure([("broker", broker.socket, a.after_picks)],
                                       a.phase_s / 2)
        out["after_restart_broker_cpu_pct"] = (
            100 * (cpu_s(broker.pid) - cpu0) / (time.perf_counter() - t0))
        out["memory_end"] = memory_mib(broker.pid)
    finally:
        stop_file.touch()
        for c in children:
            c.stop()
        broker.stop()
        shutil.rmtree(area, ignore_errors=True)
    return out


def figures(out: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers from a run's raw output."""
    q = {k: summary_ms(v) for k, v in out["quiet"]["times"].items()}
    lb = summary_ms(out["load_broker"]["times"]["broker"])
    ld = summary_ms(out["load_directory"]["times"]["directory"])
    ar = summary_ms(out["after_restart"]["times"]["broker"])
    hwm = max(m["VmHWM"] for k, m in out.items() if k.startswith("memory_"))
    fig = {
        "quiet_broker": q["broker"], "quiet_directory": q["directory"],
        "load_broker": lb, "load_directory": ld, "after_restart": ar,
        "restart_s": out["restart"]["back_s"], "restart_answer_s": out["restart"]["answer_s"],
        "start_empty_s": out["start_empty"]["back_s"],
        "rss_mib": out["memory_load"]["VmRSS"], "hwm_mib": hwm,
        "rss_after_restart_mib": out["memory_end"]["VmRSS"],
        "idle_cpu_pct": out["idle_cpu_pct"],
        "cpu_ms_per_quiet_pick": 1000 * out["quiet_broker_cpu_s_per_pick"],
        "load_cpu_pct": out["load_broker"]["broker_cpu_pct"],
        "after_restart_cpu_pct": out["after_restart_broker_cpu_pct"],
        "compaction": out["compaction"],
    }
    fig["ratios"] = {
        "pick_p50_quiet_vs_directory": ratio(q["broker"], q["directory"], "p50_ms"),
        "pick_p99_quiet_vs_directory": ratio(q["broker"], q["directory"], "p99_ms"),
        "pick_p50_load_vs_directory": ratio(lb, ld, "p50_ms"),
        "pick_p99_load_vs_directory": ratio(lb, ld, "p99_ms"),
        "restart_vs_empty_start": ratio(fig, fig, "restart_s", "start_empty_s"),
    }
    return fig


def num(x: float, spec: str) -> str:
    """``x`` formatted, or ``-`` where it was not measured (``nan``)."""
    return format(x, spec) if math.isfinite(x) else "-"


def secs(x: float) -> str:
    """Seconds, or what an unfinished wait was (``inf``: not within the run's bound)."""
    return f"{x:.2f} s" if math.isfinite(x) else "not within the bound"


def ratio(a: dict[str, Any], b: dict[str, Any], key: str, key_b: str | None = None) -> float:
    """``a[key] / b[key_b or key]``; ``nan`` where either is missing or not finite (no pick
    made, a restart that did not finish)."""
    x, y = a.get(key), b.get(key_b or key)
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)) or y <= 0:
        return math.nan
    return float(x) / float(y)


def results_of(fig: dict[str, Any]) -> dict[str, float]:
    """What ``--results`` records (every figure lower-is-better, for scripts/bench_compare.py):
    the ratios, the broker's RSS under load in MiB and its CPU per quiet pick in ms (the figure
    the machine's load moves least)."""
    out = {f"broker_scale.{k}": float(v) for k, v in fig["ratios"].items()}
    out["broker_scale.rss_mib"] = float(fig["rss_mib"])
    out["broker_scale.broker_cpu_ms_per_quiet_pick"] = float(fig["cpu_ms_per_quiet_pick"])
    return {k: v for k, v in out.items() if math.isfinite(v)}  # not measured: left out


def table(out: dict[str, Any], fig: dict[str, Any]) -> str:
    """The run as Markdown: one row per measure, with its goal."""
    def pk(s: dict[str, float]) -> str:
        if not s.get("n"):
            return "no pick"
        return (f"{s['p50_ms']:.1f} / {s['p99_ms']:.1f} / {s['max_ms']:.1f} (n={s['n']})")

    r = fig["ratios"]
    c = fig["compaction"]
    comp = (f"{1000 * c['compact_s']:.0f} ms ({c['entries']:,} entries, "
            f"{c['compacted_bytes'] / MiB:.1f} MiB; load with replay {1000 * c['load_s']:.0f} ms)"
            if "compact_s" in c else c.get("error", "?"))
    fails = {k: sum(len(v) for v in out[p]["failed"].values())
             for k, p in (("quiet", "quiet"), ("load", "load_broker"),
                          ("after restart", "after_restart"))}
    lines = [
        f"{out['leases']:,} live leases (one connection each) + {out['idle']:,} idle clients on "
        f"{out['gpus']} simulated GPUs; load average at the start {out['load_average_at_start']}",
        "",
        "| measure | broker | shared directory | broker / directory | goal |",
        "|---|---:|---:|---:|---|",
        f"| pick quiet, p50 / p99 / max ms | {pk(fig['quiet_broker'])} | "
        f"{pk(fig['quiet_directory'])} | {num(r['pick_p50_quiet_vs_directory'], '.3f')} / "
        f"{num(r['pick_p99_quiet_vs_directory'], '.3f')} | p99 <= 20 ms |",
        f"| pick under load ({out['loaders']} users picking), p50 / p99 / max ms | "
        f"{pk(fig['load_broker'])} | {pk(fig['load_directory'])} | "
        f"{num(r['pick_p50_load_vs_directory'], '.3f')} / "
        f"{num(r['pick_p99_load_vs_directory'], '.3f')} | |",
        "| the loaders' picks (from 1 s before the measured picks to their end) | "
        f"{out['load_broker']['loader_picks']} in "
        f"{out['load_broker']['wall_s']:.1f} s | {out['load_directory']['loader_picks']} in "
        f"{out['load_directory']['wall_s']:.1f} s | | |",
        f"| restart (kill -9, start, all {out['leases']:,} taken back) | "
        f"{secs(fig['restart_s'])} (answers at {secs(fig['restart_answer_s'])}) | - | "
        f"{num(r['restart_vs_empty_start'], '.2f')}x a restart with an empty journal "
        f"({fig['start_empty_s']:.2f} s) | <= 1 s |",
        f"| pick after the restart (the leases now orphans), p50 / p99 / max ms | "
        f"{pk(fig['after_restart'])} | - | | |",
        f"| broker RSS under load / peak | {fig['rss_mib']:.1f} / {fig['hwm_mib']:.1f} MiB "
        f"(after the restart {fig['rss_after_restart_mib']:.1f}) | - | | <= 256 MiB |",
        f"| broker CPU: idle / per quiet pick / under load / after restart | "
        f"{fig['idle_cpu_pct']:.2f} % / {fig['cpu_ms_per_quiet_pick']:.2f} ms / "
        f"{fig['load_cpu_pct']:.0f} % / {fig['after_restart_cpu_pct']:.0f} % of a core | - | | |",
        f"| journal compaction | {comp} | - | | |",
        "",
        f"leases granted in {out['grant_all_s']:.1f} s by {len(HOLDER_USERS)} holders; "
        f"failed picks: " + ", ".join(f"{k} {v}" for k, v in fails.items()),
    ]
    for where in ("quiet", "load_broker", "load_directory", "after_restart"):
        for kind, errs in out[where]["failed"].items():
            if errs:
                lines.append(f"first failure ({where}, {kind}): {errs[0]}")
        for kind, n in out[where]["unleased"].items():
            if n:
                lines.append(f"picks without a lease ({where}, {kind}): {n}")
    lines += [f"note: {n}" for n in out["notes"]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leases", type=int, default=10_000)
    ap.add_argument("--idle", type=int, default=1_000, help="connected clients holding nothing")
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--quiet-picks", type=int, default=1000, help="quiet picks, broker")
    ap.add_argument("--picks", type=int, default=100, help="quiet picks, directory")
    ap.add_argument("--load-picks", type=int, default=50, help="picks per store under load")
    ap.add_argument("--after-picks", type=int, default=50, help="picks after the restart")
    ap.add_argument("--phase-s", type=float, default=60.0,
                    help="the quiet picks' bound in seconds (under load: 3/4 of it each, "
                    "after the restart: 1/2)")
    ap.add_argument("--loaders", type=int, default=4, choices=range(0, len(LOADER_USERS) + 1))
    ap.add_argument("--restart-timeout", type=float, default=180.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--results", help="merge the ratios into this JSON file (make bench)")
    ap.add_argument("--raw", metavar="FILE", help="also write the run's raw measures here")
    ap.add_argument("--from-raw", metavar="FILE",
                    help="no run: the table (and --results) of measures written by --raw")
    a = ap.parse_args(argv)
    if (a.leases < 1 or a.idle < 0 or not 1 <= a.gpus <= 192 or a.picks < 10
            or a.quiet_picks < 10):
        ap.error("--leases >= 1, --idle >= 0, --gpus 1-192, --picks >= 10, --quiet-picks >= 10")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = json.loads(Path(a.from_raw).read_text()) if a.from_raw else run(a)
    if a.raw:
        Path(a.raw).write_text(json.dumps(out))
    fig = figures(out)
    from results import record

    record(a.results, results_of(fig))
    if a.json:
        print(json.dumps({"figures": fig, "raw": {k: v for k, v in out.items()
                                                  if k not in ("quiet", "load_broker",
                                                               "load_directory",
                                                               "after_restart")}},
                         indent=2, default=str))
    else:
        print(table(out, fig))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
