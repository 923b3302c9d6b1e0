"""A user's process that reaches the broker with ids it chose in a user namespace (stdlib only).

Run as a real user inside ``unshare --map-auto --map-root-user`` (Debian's ``uidmap``): there uid
and gid 0 are the user's own, and 1..65535 are their ``/etc/subuid`` and ``/etc/subgid`` ranges,
so the broker's ``SO_PEERCRED`` sees the host ids these map to::

    python3 peercred_agent.py SOCKET ACTION [ARG...]

``forge GID DEV``   setgid(GID) (a subordinate gid on the host), lease DEV; print the reply and
                    this process's pid; hold the lease until stdin closes
``share N``         one connection as the user's own uid, one as their first subordinate uid
                    (uid 1 here); N ``status`` messages sent on each at once; print how many
                    replies were ok
``alone UID N``     setuid(UID), then N ``status`` messages on one connection; as ``share``
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import Any

PROTO = 2  # the broker protocol of this checkout (core.leasing.brokerclient.PROTOCOL)


def line(msg: dict[str, Any]) -> bytes:
    return json.dumps({"proto": PROTO, **msg}).encode() + b"\n"


def connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(60)
    s.connect(path)
    return s


def replies(s: socket.socket, n: int) -> int:
    f = s.makefile("rb")
    ok = 0
    for _ in range(n):
        reply = json.loads(f.readline() or b"null")
        ok += bool(reply and reply.get("ok"))
    return ok


def main(argv: list[str]) -> int:
    path, action, args = argv[0], argv[1], argv[2:]
    if action == "forge":
        os.setgroups([])
        os.setgid(int(args[0]))
        s = connect(path)
        s.sendall(line({"op": "lease", "devices": [args[1]]}))
        reply = json.loads(s.makefile("rb").readline() or b"null")
        print(json.dumps({"pid": os.getpid(), "reply": reply}), flush=True)
        sys.stdin.read()  # hold the lease (if any) until the test closes stdin
        return 0
    if action == "share":
        n = int(args[0])
        own = connect(path)  # uid 0 here: the user's own uid on the host
        os.setuid(1)  # from now on the first subordinate uid
        sub = connect(path)
        msgs = line({"op": "status"}) * n
        own.sendall(msgs)
        sub.sendall(msgs)
        print(json.dumps({"ok": replies(own, n) + replies(sub, n)}), flush=True)
        return 0
    if action == "alone":
        os.setuid(int(args[0]))
        n = int(args[1])
        s = connect(path)
        s.sendall(line({"op": "status"}) * n)
        print(json.dumps({"ok": replies(s, n)}), flush=True)
        return 0
    print(f"unknown action {action!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
