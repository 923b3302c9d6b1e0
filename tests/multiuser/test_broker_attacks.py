"""The broker against a hostile user: each attack of issue 20, by real Unix users, on a real root
broker (4 simulated GPUs, ``--max-devices-per-user 1``).

The attacker, ``agtest-mallory``, has a range of subordinate uids in ``/etc/subuid`` and runs
``unshare --map-auto --map-root-user`` (Debian's ``uidmap``) to act as them
(tests/subuid_agent.py); the victim, ``agtest-alice``, runs the real ``autogpu`` command. What the
victim sees, what root's ``autogpu broker status`` says and what the broker's own log and memory
show are asserted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.brokerhelpers import Area, BrokerProc, SubuidAgent, ensure_subids, wire
from tests.leasehelpers import AsUser, as_user, ensure_user, shared_area, uuid_of

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
    pytest.mark.skipif(shutil.which("newuidmap") is None,
                       reason="needs Debian's uidmap (scripts/setup.sh installs it)"),
]

VICTIM = "agtest-alice"
MALLORY = "agtest-mallory"


@pytest.fixture(scope="module")
def users() -> dict[str, tuple[int, int]]:
    out = {"victim": ensure_user(VICTIM), "mallory": ensure_user(MALLORY)}
    # a range no line of /etc/subuid or /etc/subgid holds yet (unless mallory has one)
    ensure_subids(MALLORY)
    return out


@pytest.fixture
def area(users: dict[str, tuple[int, int]]) -> Iterator[Area]:
    with shared_area("autogpu-attack") as root:
        yield Area(root)


def _broker(area: Area, *args: str) -> BrokerProc:
    return BrokerProc(area.root, "--max-devices-per-user", "1", *args,
                      env={"AUTOGPU_SIMULATE": str(area.fleet)})


@pytest.fixture
def broker(area: Area) -> Iterator[BrokerProc]:
    proc = _broker(area, "--ticket-grace", "2")
    try:
        yield proc
    finally:
        proc.stop()


def _kill_group(proc: Any) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _rss_mib(pid: int) -> float:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# ---- 1. one ticket blocks every GPU ----------------------------------------------------------


def test_a_ticket_for_every_gpu_does_not_block_everyone(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """Mallory's ticket for all 4 GPUs, exclusively, on one open socket: the GPUs are free, so
    it could be served at once; not taken, it loses its place and Alice picks."""
    agent = SubuidAgent(MALLORY, area.socket, 1, "ticket", "4")
    try:
        (ticket,) = agent.results()
        if ticket["result"].get("ok"):  # admitted (no quota on tickets yet): it must lapse
            broker.wait_for(lambda s: s["tickets"] == [], timeout=15)
        else:  # refused outright: a ticket's devices count against the quota
            assert "max_devices_per_user = 1" in ticket["result"]["error"], ticket
        ok = area.cli(VICTIM, "run", "--exclusive", "--", "true")
        assert ok.returncode == 0, ok.stderr
        assert broker.status()["tickets"] == []
    finally:
        agent.stop()


# ---- 2. fat records and clients that never read -----------------------------------------------


def test_fat_records_and_silent_clients_do_not_stop_other_picks(
    area: Area, users: dict[str, tuple[int, int]]
) -> None:
    proc = _broker(area, "--max-devices-per-user", "0", "--send-timeout", "2")
    fat = SubuidAgent(MALLORY, area.socket, 1, "fat", "100", uuid_of(0))
    silent = None
    try:
        assert fat.results()[0]["result"] == {"leases": 100}
        silent = SubuidAgent(MALLORY, area.socket, 2, "silent", "25", "400")
        assert [r["result"] for r in silent.results()] == [{"silent": 25}] * 2
        # The victim's pick (its begin reads a view of 100 fat leases) and root's status work.
        ok = area.cli(VICTIM, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
        st = proc.wait_for(lambda s: s["connections"] <= 100 + 1, timeout=30)  # silent: dropped
        assert st["leases_total"] == 100
        assert proc.proc is not None and _rss_mib(proc.proc.pid) < 128
        # Every record stored by the broker is within the caps, in encoded bytes.
        rec = st["leases"][0]
        assert len(json.dumps(rec["notebook_path"])) - 2 <= 1024
        assert len(rec["kernel_id"]) <= 64
        # The victim's list of leases reads them all, page by page.
        listed = area.cli(VICTIM, "leases", "--json")
        assert listed.returncode == 0 and len(json.loads(listed.stdout)) == 100
    finally:
        if silent is not None:
            silent.stop()
        fat.stop()
        proc.stop()


# ---- 3. subordinate uids make one user many ---------------------------------------------------


def test_subordinate_uids_share_their_owners_quota(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    agent = SubuidAgent(MALLORY, area.socket, 4, "lease", *(uuid_of(i) for i in range(4)))
    try:
        results = sorted(agent.results(), key=lambda r: r["uid"])
        granted = [r for r in results if r["result"].get("ok")]
        assert len(granted) == 1, results
        assert granted[0]["result"]["record"]["user"] == MALLORY
        for r in results:
            if not r["result"].get("ok"):
                assert r["result"]["type"] == "LeaseLimitError"
                assert r["result"]["error"].startswith(f"{MALLORY} already holds leases on 1")
        st = broker.status()
        assert st["per_user"] == {MALLORY: {"leases": 1, "devices": 1, "tickets": 0}}
        assert area.cli(VICTIM, "run", "--", "true").returncode == 0
    finally:
        agent.stop()


def test_sub_uids_taking_turns_at_the_pick_lock_do_not_starve_another_user(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    """16 subordinate uids take the pick lock and never give it back (the broker takes it back
    after 2 s): as 16 users they would be served 15 times (30 s) before the victim's pick, past
    its two tries of 10 s; as one person, the victim is next after one of them."""
    agent = SubuidAgent(MALLORY, area.socket, 16, "hog", "60")
    try:
        # one hog holds the lock, the 15 others wait for it, ahead of the victim
        broker.wait_for(lambda s: s["waiting_for_lock"] >= 15, timeout=30)
        ok = area.cli(VICTIM, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
    finally:
        agent.stop()


def test_thousands_of_connections_from_sub_uids_hit_one_cap_and_one_log_line(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    agent = SubuidAgent(MALLORY, area.socket, 5, "flood", "250")
    try:
        results = [r["result"] for r in agent.results(timeout=120)]
        assert sum(r["served"] for r in results) == 256, results  # the person's cap
        assert sum(r["refused"] for r in results) == 5 * 250 - 256
        ok = area.cli(VICTIM, "run", "--", "true")
        assert ok.returncode == 0, ok.stderr
        assert broker.status()["connections"] == 256 + 1
        log = broker.log.read_text()
        assert "Traceback" not in log
        assert len([ln for ln in log.splitlines() if "refused" in ln]) <= 3, log[-3000:]
    finally:
        agent.stop()


# ---- 4. a restart double-books -----------------------------------------------------------------


def test_a_restart_neither_loses_nor_doubles_a_lease_held_by_a_child(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    job = area.run_held(VICTIM, "run", "--exclusive", "--", "sleep", "90")
    try:
        st = broker.wait_for(lambda s: len(s["leases"]) == 1)
        held = st["leases"][0]
        children = Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split()
        wrapper = int(children[0])  # runuser's child: the `autogpu run` wrapper
        os.kill(wrapper, signal.SIGKILL)  # the job (`sleep`) keeps the lease's socket
        time.sleep(0.5)
        broker.restart()
        st = broker.status()
        assert [r["lease_id"] for r in st["leases"]] == [held["lease_id"]], st
        only = ",".join(str(i) for i in range(4) if uuid_of(i) not in held["device_uuids"])
        other = area.cli(MALLORY, "run", "--exclusive", "--exclude", only, "--", "true")
        assert other.returncode == 3, other.stdout + other.stderr
    finally:
        _kill_group(job)
    broker.wait_for(lambda s: s["leases"] == [], timeout=10)


# ---- 5. root chmods a user's symlink -------------------------------------------------------------

_SLOW_CHMOD = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
/* Give a racer time: every chmod of a path ending in broker.sock waits 300 ms first. */
static void slow(const char *p) {
    size_t n = strlen(p);
    if (n >= 11 && strcmp(p + n - 11, "broker.sock") == 0) usleep(300000);
}
int chmod(const char *p, mode_t m) {
    int (*real)(const char *, mode_t) = dlsym(RTLD_NEXT, "chmod");
    slow(p);
    return real(p, m);
}
int fchmodat(int d, const char *p, mode_t m, int f) {
    int (*real)(int, const char *, mode_t, int) = dlsym(RTLD_NEXT, "fchmodat");
    slow(p);
    return real(d, p, m, f);
}
"""


def _race(path: str, target: str, seconds: float) -> int:
    """Swap the socket at ``path`` for a symlink to ``target`` the moment it appears."""
    import stat as st

    swaps = 0
    end = time.monotonic() + seconds
    tmp = path + ".swap"
    while time.monotonic() < end:
        try:
            if st.S_ISSOCK(os.lstat(path).st_mode):
                os.symlink(target, tmp)
                os.rename(tmp, path)
                swaps += 1
        except OSError:
            pass
    return swaps


def test_a_user_cannot_make_root_chmod_a_file_through_the_socket_path(
    area: Area, users: dict[str, tuple[int, int]], tmp_path: Path
) -> None:
    shim = area.root / "slowchmod.so"
    src = tmp_path / "slowchmod.c"
    src.write_text(_SLOW_CHMOD)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(shim), str(src), "-ldl"], check=True)
    secret = area.root / "secret"
    secret.write_text("root's")
    os.chmod(secret, 0o600)
    uid, gid = users["mallory"]
    own = area.root / "mallory-run"
    own.mkdir()
    os.chown(own, uid, gid)  # a socket directory the user owns (as docs allowed for tests)
    sock = own / "broker.sock"
    racer = AsUser(uid, gid, _race, str(sock), str(secret), 8.0)
    env = {**os.environ, "LD_PRELOAD": str(shim), "AUTOGPU_SIMULATE": str(area.fleet),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    started = subprocess.Popen(
        [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "--socket", str(sock),
         "--state-dir", ""],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _out, err = started.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        started.kill()
        _out, err = started.communicate()
    racer.result()
    racer.stop()
    assert oct(secret.stat().st_mode & 0o777) == "0o600"  # was 0o666 through the symlink
    assert started.returncode != 0
    assert err.strip().splitlines()[-1].startswith(
        f"autogpu broker: socket directory {own} is owned by uid {uid} with mode "
    ), err


# ---- 6. small things a user sends ----------------------------------------------------------------


def _raw(path: str, *msgs: Any) -> list[Any]:
    from tests.brokerhelpers import RawConn

    out = []
    for m in msgs:
        with RawConn(path) as c:
            c.send(m if isinstance(m, bytes) else wire(m))
            out.append(c.read())
    return out


def test_odd_requests_from_a_user_get_one_line_each(
    area: Area, broker: BrokerProc, users: dict[str, tuple[int, int]]
) -> None:
    uid, gid = users["mallory"]
    replies = as_user(uid, gid, _raw, str(area.socket),
                      {"op": []},
                      {"op": "lease", "devices": [uuid_of(0).lower()]},
                      {"op": "lease", "devices": [uuid_of(0)], "holder": {"kind": "reserved"}},
                      json.dumps({"op": "status", "proto": 99}).encode() + b"\n")
    assert [r["ok"] for r in replies] == [False] * 4, replies
    assert replies[0]["error"].startswith("unknown message (op []; expected one of")
    assert "is not a device of this host" in replies[1]["error"]
    assert replies[2]["error"].startswith("holder.kind 'reserved' is not one of")
    assert replies[3]["error"].startswith("this autogpu speaks protocol 99, the lease broker")
    assert broker.status()["leases"] == []
    assert "Traceback" not in broker.log.read_text()
