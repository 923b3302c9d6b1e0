"""What a user does to a broker from their subordinate uids (stdlib only; run by the tests).

Run as a real user inside ``unshare --map-auto --map-root-user`` (Debian's ``uidmap``): there
the user is root of a user namespace whose uids 1..65535 are their ``/etc/subuid`` range, so a
child that ``setuid(n)`` reaches the host as the n-th subordinate uid, and the broker's
``SO_PEERCRED`` says so::

    python3 subuid_agent.py SOCKET UIDS ACTION [ARG...]

Each of ``UIDS`` forked children (uids 1..UIDS inside the namespace) does ACTION, prints one JSON
line (its result) and keeps what it holds until stdin closes:

``lease DEV...``        child n leases DEV[n-1] (``--exclusive`` leases are not needed here)
``hog SECONDS``          take the broker's pick lock again and again, never giving it back
``flood N``              open N connections, each asking ``status``; how many were served
``fat N DEV``            hold N leases on DEV with every free-text field at the broker's cap
``silent N REQS``        N connections that each send REQS requests and never read
``ticket COUNT``         hold a ticket for COUNT exclusive GPUs
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from typing import Any

PROTO = 2  # the broker protocol of this checkout (core.leasing.brokerclient.PROTOCOL)
HELD: list[Any] = []


def line(msg: dict[str, Any]) -> bytes:
    return json.dumps({"proto": PROTO, **msg}).encode() + b"\n"


def call(s: socket.socket, msg: dict[str, Any]) -> Any:
    s.sendall(line(msg))
    data = s.makefile("rb").readline()
    return json.loads(data) if data else None


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(30)
    s.connect(path)
    return s


def act(path: str, n: int, action: str, args: list[str]) -> Any:
    if action == "lease":
        s = connect(path)
        HELD.append(s)
        return call(s, {"op": "lease", "devices": [args[n - 1]]})
    if action == "hog":
        end = time.monotonic() + float(args[0])
        grants = 0
        while time.monotonic() < end:
            with connect(path) as s:
                if (call(s, {"op": "begin"}) or {}).get("ok"):
                    grants += 1
                    time.sleep(2.5)  # past the broker's 2 s: it takes the lock back
        return {"grants": grants}
    if action == "flood":
        served = refused = 0
        for _ in range(int(args[0])):
            try:
                s = connect(path)
                reply = call(s, {"op": "status"})
            except OSError:
                reply = None
            if reply and reply.get("ok"):
                served += 1
                HELD.append(s)
            else:
                refused += 1
        return {"served": served, "refused": refused}
    if action == "fat":
        ok = 0
        for i in range(int(args[0])):
            s = connect(path)
            reply = call(s, {"op": "lease", "devices": [args[1]], "requested_bytes": [1 << 30],
                             "holder": {"kind": "kernel", "kernel_id": f"{n}-{i:062d}",
                                        "notebook_path": "\U0001f600" * 4096}})
            ok += bool(reply and reply.get("ok"))
            HELD.append(s)
        return {"leases": ok}
    if action == "silent":
        for _ in range(int(args[0])):
            s = connect(path)
            s.setblocking(False)
            try:
                s.send(line({"op": "leases"}) * int(args[1]))
            except BlockingIOError:
                pass
            HELD.append(s)
        return {"silent": int(args[0])}
    if action == "ticket":
        s = connect(path)
        HELD.append(s)
        count = int(args[0])
        return call(s, {"op": "ticket", "exclusive": True, "constraints": {
            "min_free_bytes": None, "min_free_fraction": None, "max_util_pct": None,
            "count": count, "exclude": [], "exclusive": True, "allowed_uuids": None}})
    raise SystemExit(f"unknown action {action!r}")


def main() -> int:
    path, uids, action, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
    r, w = os.pipe()
    kids = []
    for n in range(1, uids + 1):
        pid = os.fork()
        if pid == 0:
            os.close(w)
            try:
                os.setgroups([])
                os.setgid(n)
                os.setuid(n)
                out = act(path, n, action, args)
            except Exception as err:  # reported to the test, which asserts on it
                out = {"error": f"{type(err).__name__}: {err}"}
            sys.stdout.write(json.dumps({"uid": n, "result": out}) + "\n")
            sys.stdout.flush()
            os.read(r, 1)  # until the parent's end of the pipe closes
            os._exit(0)
        kids.append(pid)
    os.close(r)
    sys.stdin.read()  # the test closes our stdin when it is done
    os.close(w)
    for pid in kids:
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
