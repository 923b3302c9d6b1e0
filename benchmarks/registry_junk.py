"""What planted junk in the shared registry costs a pick (the safety issue's benchmark).

    .venv/bin/python benchmarks/registry_junk.py [--repeat 30] [--json]

An in-process pick (``core.picker.pick``: lock, snapshot of a simulated 8-GPU fleet, scan,
rank, write a lease, unlock; the lease is released after each call) in three registries:

* ``clean`` -- empty;
* ``live`` -- 4,096 live leases (four users of 1,024, each file held with ``flock`` by this
  process, as their kernels would);
* ``live+junk`` -- the same plus 10,000 junk entries another user could plant: 2,000 directories
  and 2,000 files with names that are no uid (``¹``, ``٣``, undecodable bytes, words) at the top,
  and per user directory 500 names of no lease, 500 malformed ``.lease`` files and 500 ``.ticket``
  files of garbage.

Goal: the junk adds under 10 ms (``live+junk`` minus ``live``, medians of one run). Run as root
(the four users' directories are chowned to uids 60001-60004, which need no passwd entry);
otherwise every lease sits in the caller's own directory.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import resource
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autogpu_jupyter.core.backends.simulated import SimulatedBackend  # noqa: E402
from autogpu_jupyter.core.leasing import DirectoryStore  # noqa: E402
from autogpu_jupyter.core.options import PickOptions  # noqa: E402
from autogpu_jupyter.core.picker import pick  # noqa: E402
from autogpu_jupyter.core.policy import Constraints  # noqa: E402

UUIDS = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(8)]


def _fleet(path: Path) -> None:
    path.write_text(json.dumps({"devices": [
        {"uuid": u, "name": "NVIDIA A100-SXM4-80GB", "memory_total": "80G", "memory_used": 0,
         "utilization_pct": 0, "processes": []} for u in UUIDS
    ]}))


def _users() -> list[int]:
    return [60001 + i for i in range(4)] if os.geteuid() == 0 else [os.geteuid()]


def _add_live(reg: Path, held: list[int], total: int = 4096) -> None:
    users = _users()
    for uid in users:
        d = reg / str(uid)
        d.mkdir(mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
        if os.geteuid() == 0:
            os.chown(d, uid, uid)
    name = DirectoryStore(reg).user
    for i in range(total):
        uid = users[i % len(users)]
        lease_id = secrets.token_hex(16)
        rec = {"version": 1, "kind": "lease", "lease_id": lease_id,
               "device_uuids": [UUIDS[i % 8]], "device_requested_bytes": [1 << 20],
               "exclusive": False, "user": name if uid == os.geteuid() else str(uid), "uid": uid,
               "host": "bench", "pid": 1 + i, "created_s": time.time(), "kernel_id": None,
               "notebook_path": f"project/notebook-{i}.ipynb", "command": None,
               "holder_kind": "kernel"}
        path = reg / str(uid) / f"{lease_id}.lease"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        os.write(fd, json.dumps(rec).encode())
        if os.geteuid() == 0:
            os.fchown(fd, uid, uid)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held.append(fd)


def _add_junk(reg: Path) -> int:
    n = 0
    top = os.fsencode(reg)
    for i in range(2000):
        name = [f"¹{i}", f"٣{i}", f"x{i}", f"{i}.{i}"][i % 4].encode()
        if i % 5 == 0:
            name = b"\xff\xfe" + str(i).encode()
        os.mkdir(top + b"/" + name)
        with open(top + b"/" + name + b".f", "wb") as f:
            f.write(b"junk")
        n += 2
    for uid in _users():
        d = reg / str(uid)
        per = 1500 if len(_users()) > 1 else 1500 * 4 // 4
        for i in range(per // 3):
            (d / f"note-{i}.txt").write_bytes(b"junk")
            (d / f"{secrets.token_hex(16)}.lease").write_bytes(b'{"version": 1, "kind": ')
            (d / f"{secrets.token_hex(16)}.ticket").write_bytes(os.urandom(200))
            n += 3
    return n


def _time(reg: Path, fleet: Path, repeat: int) -> dict[str, float]:
    registry = DirectoryStore(reg)
    backend = SimulatedBackend(str(fleet))
    ms = []
    for _ in range(repeat + 2):
        t0 = time.perf_counter()
        result = pick(PickOptions(Constraints()), backend=backend, store=registry)
        ms.append((time.perf_counter() - t0) * 1000.0)
        assert result.lease is not None, result.lease_note
        result.lease.release()
    ms = sorted(ms[2:])
    return {"median_ms": round(statistics.median(ms), 2),
            "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    held: list[int] = []
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        base = Path(tmp)
        fleet = base / "fleet.json"
        _fleet(fleet)
        reg = base / "registry"
        DirectoryStore(reg).check()
        out["clean"] = _time(reg, fleet, args.repeat)
        _add_live(reg, held)
        out["live"] = _time(reg, fleet, args.repeat)
        out["junk_entries"] = _add_junk(reg)
        out["live+junk"] = _time(reg, fleet, args.repeat)
        for fd in held:
            os.close(fd)
    junk = out["live+junk"]["median_ms"] - out["live"]["median_ms"]  # type: ignore[index]
    out["junk_adds_ms"] = round(junk, 2)
    out["users"] = len(_users())
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for key in ("clean", "live", "live+junk"):
            print(f"{key:>10}: median {out[key]['median_ms']:7.2f} ms  p90 "  # type: ignore[index]
                  f"{out[key]['p90_ms']:7.2f} ms")  # type: ignore[index]
        print(f"{out['junk_entries']} junk entries add {junk:.2f} ms to a pick "
              f"(goal: under 10 ms); {out['users']} users' directories")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
