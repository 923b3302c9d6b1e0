"""Two REAL Unix users, each running a Jupyter server, start autogpu kernels at the same time.

As on a single multi-GPU host (docs/jupyterhub.md, case a): one kernelspec with the provisioner,
the fake ``libnvidia-ml.so.1`` showing four GPUs, and one lease store for the host, both ways an
admin can run it: the shared-directory registry under ``/var/tmp`` (root-owned, mode 1777), or
the trusted broker (``autogpu broker`` as root, found through ``AUTOGPU_BROKER_SOCKET``;
docs/admin-broker.md). The kernels ask for ``exclusive``: four kernels get four different GPUs,
the fifth starts CPU-only with a note, and each user's ``autogpu leases`` / ``/autogpu/holders``
shows the other's holders without command lines. With the broker, the shared directory is never
touched. The set-up (users' servers run by Debian's Python, the readable fake driver) is
``tests/serverhelpers.py``'s.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.leasing.brokerclient import BrokerStore
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from tests.brokerhelpers import BrokerProc
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import cli_as, ensure_user, fleet, shared_area, uuid_of
from tests.serverhelpers import UserServer, shared_host

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users (useradd) "
                       "and run their servers (runuser)"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

USERS = ("agtest-alice", "agtest-bob")
SPEC = "agp"


@pytest.fixture
def area() -> Iterator[Path]:
    with shared_area("autogpu-mu") as root:
        (root / "run").mkdir(mode=0o755)
        os.chmod(root / "run", 0o755)
        yield root


def _fifth_kernel_environ(kernel_id: str) -> dict[str, str] | None:
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if kernel_id.encode() in cmdline:
            return kernel_environ(pid)
    return None


@pytest.mark.parametrize("store", ["directory", "broker"])
def test_two_users_two_servers_share_four_gpus_without_double_booking(
    area: Path, fake_nvml_library: Path, store: str
) -> None:
    for u in USERS:
        ensure_user(u)
    env = shared_host(area, fake_nvml_library, fleet(4), spec=SPEC,
                      options={"exclusive": True, "min_free": "10G"})
    broker = None
    live: Any = DirectoryStore(env["AUTOGPU_REGISTRY_DIR"])
    if store == "broker":
        broker = BrokerProc(area, env={"AUTOGPU_RECORD_COMMANDS": "1"})
        env["AUTOGPU_BROKER_SOCKET"] = str(broker.socket)
        live = BrokerStore(str(broker.socket))  # root's view: every record
    servers = {u: UserServer(u, area, env) for u in USERS}
    try:
        for s in servers.values():
            s.wait_up()
        alice, bob = (servers[u] for u in USERS)
        # Both users open two notebooks each, all at the same time.
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(s.start_session, f"nb{i}", SPEC)
                       for s in (alice, bob) for i in (1, 2)]
            sessions = [f.result() for f in futures]
        leases = live.list_leases()
        assert sorted(r.user for r in leases) == sorted([*USERS, *USERS])
        devices = sorted(u for r in leases for u in r.device_uuids)
        assert devices == [uuid_of(i) for i in range(4)]  # exclusive: never two on one GPU
        kernel_ids = {s["kernel"]["id"] for s in sessions}
        assert {r.kernel_id for r in leases} == kernel_ids
        for r in leases:
            assert kernel_environ(r.pid)["CUDA_VISIBLE_DEVICES"] == r.device_uuids[0]
            assert r.exclusive
            # A kernel's lease names the kernel, never a command line (even where the broker
            # records commands: the provisioner sends none).
            assert r.command is None
        # A fifth kernel: nothing is free any more, so it starts CPU-only and says why.
        fifth = alice.start_session("nb5", SPEC)
        assert len(live.list_leases()) == 4
        assert fifth["kernel"]["id"] not in {r.kernel_id for r in live.list_leases()}
        fifth_env = _fifth_kernel_environ(fifth["kernel"]["id"])
        assert fifth_env is not None
        assert fifth_env["CUDA_VISIBLE_DEVICES"] == ""
        assert fifth_env["AUTOGPU_PICK_NOTE"].startswith("no device fits: kernel started CPU-only")
        # Each user sees the other's holders, without command lines.
        cli_env = dict(env, HOME="/nonexistent")
        for me, other in ((USERS[0], USERS[1]), (USERS[1], USERS[0])):
            out = cli_as(me, cli_env, "leases", "--json")
            assert out.returncode == 0, out.stderr
            theirs = [d for d in json.loads(out.stdout) if d["user"] == other]
            assert len(theirs) == 2
            assert all(d["command"] is None and d["kernel_id"] in kernel_ids for d in theirs)
            text = cli_as(me, cli_env, "leases")
            assert sum(line.startswith(other) for line in text.stdout.splitlines()) == 2
        # ... and so does the sidebar's endpoint of alice's server.
        code, holders = alice.request("GET", "autogpu", "holders")
        assert code == 200, holders
        rows = json.dumps(holders)
        assert USERS[1] in rows
        assert '"command": "' not in rows
        if broker is not None:  # the shared-directory registry was never used
            assert not any((area / "registry").rglob("*.lease"))
    finally:
        for s in servers.values():
            s.stop()
        if broker is not None:
            try:
                broker.wait_for(lambda st: st["leases"] == [], timeout=10)
            finally:
                broker.stop()
    # Servers stopped their kernels: every lease is gone.
    if broker is None:
        assert live.list_leases() == []
