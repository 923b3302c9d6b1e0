"""Who the broker counts a caller as, against real Unix users in user namespaces (issue 39).

A user with ``/etc/subuid`` and ``/etc/subgid`` ranges runs ``unshare --map-auto
--map-root-user`` (Debian's ``uidmap``: ``newuidmap``/``newgidmap``) and reaches the root broker
with host ids they chose inside their ranges (tests/peercred_agent.py): a subordinate gid that
a real group of the host happens to have, or a subordinate uid beside their own. What the
broker replies and what root's ``autogpu broker status`` counts are asserted.
"""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.brokerhelpers import REPO, Area, BrokerProc, ensure_subids, wire
from tests.leasehelpers import SYSTEM_PYTHON, as_user, ensure_user, shared_area, uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
    pytest.mark.skipif(shutil.which("newgidmap") is None,
                       reason="needs Debian's uidmap (scripts/setup.sh installs it)"),
]

FORGER = "agtest-gforger"  # has subordinate ids; one of their sub-gids is GROUP's gid
MEMBER = "agtest-gmember"  # a real member of GROUP (a supplementary group of theirs)
GROUP = "agtest-subgid-ml"  # the group the rules reserve GPU 3 for
AGENT = str(REPO / "tests" / "peercred_agent.py")


def _group_in_range(name: str, first: int, count: int) -> int:
    """Make group ``name`` have a gid inside ``first``..``first + count - 1`` (as LDAP/sssd
    gids >= 200000 often lie in users' subordinate ranges); its gid."""
    lo, hi = first + 1, first + count - 2  # namespace gids 2..count-1: never 0 or 1
    try:
        have = grp.getgrnam(name).gr_gid
    except KeyError:
        have = None
    if have is not None and lo <= have <= hi:
        return have
    gid = first + 4242
    while True:
        try:
            grp.getgrgid(gid)
        except KeyError:
            break
        gid += 1
    assert gid <= hi, "no free gid in the sub-gid range"
    cmd = ["groupadd", "-g", str(gid), name] if have is None else ["groupmod", "-g", str(gid),
                                                                    name]
    subprocess.run(cmd, check=True, capture_output=True)
    return gid


@pytest.fixture(scope="module")
def people() -> dict[str, Any]:
    forger = ensure_user(FORGER)
    first, count = ensure_subids(FORGER)
    gid = _group_in_range(GROUP, first, count)
    member = ensure_user(MEMBER)
    subprocess.run(["usermod", "-a", "-G", GROUP, MEMBER], check=True, capture_output=True)
    return {"forger": forger, "member": member, "gid": gid, "sub_first": first}


@pytest.fixture
def area(people: dict[str, Any]) -> Iterator[Area]:
    with shared_area("autogpu-ident") as root:
        yield Area(root)


def _agent(user: str, area: Area, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["runuser", "-u", user, "--", "unshare", "--map-auto", "--map-root-user",
         SYSTEM_PYTHON, AGENT, str(area.socket), *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _first_line(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    out = proc.stdout.readline()
    if not out:
        proc.wait(30)
        raise AssertionError(f"the agent ended early: {proc.stderr.read() if proc.stderr else ''}")
    data: dict[str, Any] = json.loads(out)
    return data


def _end(proc: subprocess.Popen[str]) -> None:
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    proc.wait(30)


def _lease(path: str, dev: str) -> Any:
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(wire({"op": "lease", "devices": [dev]}))
        return json.loads(s.makefile("rb").readline())


def test_a_subordinate_gid_of_a_real_group_does_not_make_its_user_a_member(
    area: Area, people: dict[str, Any]
) -> None:
    """Issue 39, break 2: the forger maps a gid of their ``/etc/subgid`` range that a real
    group has (``newgidmap``) and ``setgid``s to it; the broker's ``SO_PEERCRED`` says that gid.
    GPU 3 is reserved for that group: a real member gets it, the forger is refused."""
    gid = people["gid"]
    rules = area.root / "rules.json"
    rules.write_text(json.dumps({"reserved": {uuid_of(3): [GROUP]}}))
    broker = BrokerProc(area.root, "--rules", str(rules),
                        env={"AUTOGPU_SIMULATE": str(area.fleet)})
    try:
        # the reservation works: a member (GROUP is a supplementary group of theirs) gets GPU 3
        uid, own_gid = people["member"]
        got = as_user(uid, own_gid, _lease, str(area.socket), uuid_of(3))
        assert got["ok"] is True, got
        broker.wait_for(lambda s: s["leases_total"] == 0)  # the member's connection ended
        # the forger runs with GROUP's gid on the host, through their own sub-gid range
        forged = _agent(FORGER, area, "forge", str(gid - people["sub_first"] + 1), uuid_of(3))
        try:
            out = _first_line(forged)
            status = Path(f"/proc/{out['pid']}/status").read_text()
            gids = next(ln.split()[1:] for ln in status.splitlines() if ln.startswith("Gid:"))
            assert gids[0] == str(gid), status  # what SO_PEERCRED tells the broker
            reply = out["reply"]
            assert reply["ok"] is False, reply  # before issue 39: granted
            assert f"reserved for group(s) {GROUP}" in reply["error"], reply
            assert broker.status()["leases_total"] == 0
        finally:
            _end(forged)
    finally:
        broker.stop()


RATE = 20  # messages a second per person (and as many at once)


def test_a_persons_own_uid_and_subordinate_uid_share_one_message_rate(
    area: Area, people: dict[str, Any]
) -> None:
    """Issue 39, break 8: the message-rate limit is kept per person. ``RATE`` messages from one
    uid fit its burst (none waits: ``messages_paced`` stays 0); ``RATE`` from the user's own
    uid and ``RATE`` from a subordinate uid of theirs, sent at once, are twice the burst of
    one bucket: some wait. (A bucket per uid would let both through unpaced.)"""
    broker = BrokerProc(area.root, "--max-messages-per-s-per-user", str(RATE),
                        env={"AUTOGPU_SIMULATE": str(area.fleet)})
    try:
        assert broker.status()["messages_paced"] == 0
        alone = _agent(FORGER, area, "alone", "2", str(RATE))  # the second subordinate uid
        try:
            assert _first_line(alone) == {"ok": RATE}
        finally:
            _end(alone)
        assert broker.status()["messages_paced"] == 0  # within one bucket's burst
        both = _agent(FORGER, area, "share", str(RATE))
        try:
            assert _first_line(both) == {"ok": 2 * RATE}
        finally:
            _end(both)
        assert broker.status()["messages_paced"] >= 1
    finally:
        broker.stop()
