"""Two REAL Unix users, each running a Jupyter server, start autogpu kernels through the broker.

tests/test_multiuser_servers.py with the broker on (a single JupyterHub host, docs/admin-broker.md):
``autogpu broker`` runs as root, both users' servers and kernels find it through
``AUTOGPU_BROKER_SOCKET``. The kernels ask for ``exclusive``: four kernels get four distinct GPUs,
the fifth starts CPU-only, each user sees the other's holders without command lines, and the
shared-directory registry is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.brokerclient import BrokerRegistry
from tests.brokerhelpers import BrokerProc
from tests.fakenvml import FakeNvml
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import SYSTEM_PYTHON, cli_as, ensure_user, fleet, shared_area, uuid_of
from tests.test_multiuser_servers import Server

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users (useradd) "
                       "and run their servers (runuser)"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

REPO = Path(__file__).resolve().parent.parent
USERS = ("agtest-alice", "agtest-bob")


@pytest.fixture
def area() -> Iterator[Path]:
    with shared_area("autogpu-mub") as root:
        (root / "run").mkdir(mode=0o755)
        os.chmod(root / "run", 0o755)
        yield root


def test_two_users_two_servers_share_four_gpus_through_the_broker(
    area: Path, fake_nvml_library: Path
) -> None:
    for u in USERS:
        ensure_user(u)
    libdir = area / "lib"
    libdir.mkdir()
    shutil.copy(fake_nvml_library, libdir / "libnvidia-ml.so.1")
    os.chmod(libdir / "libnvidia-ml.so.1", 0o755)
    fake = FakeNvml(area / "fake")
    fake.write(fleet(4))
    os.chmod(area / "fake", 0o755)
    os.chmod(fake.scenario_path, 0o644)
    prefix = area / "prefix"
    kernelspec.install("agp", "Python 3 (autogpu)", {"exclusive": True, "min_free": "10G"},
                       prefix=str(prefix), python=SYSTEM_PYTHON)
    for p in [prefix, *prefix.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    broker = BrokerProc(area, env={"AUTOGPU_RECORD_COMMANDS": "1"})
    site = sysconfig.get_paths()["purelib"]
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{site}:{REPO}",
        "LD_LIBRARY_PATH": str(libdir),
        "FAKE_NVML_SCENARIO": str(fake.scenario_path),
        "AUTOGPU_REGISTRY_DIR": str(area / "registry"),
        "AUTOGPU_BROKER_SOCKET": str(broker.socket),
        "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
    }
    servers = {u: Server(u, area, env) for u in USERS}
    as_root = BrokerRegistry(str(broker.socket))
    try:
        for s in servers.values():
            s.wait_up()
        alice, bob = (servers[u] for u in USERS)
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(s.start_session, f"nb{i}") for s in (alice, bob) for i in (1, 2)]
            sessions = [f.result() for f in futures]
        leases = as_root.list_leases()
        assert sorted(r.user for r in leases) == sorted([*USERS, *USERS])
        devices = sorted(u for r in leases for u in r.device_uuids)
        assert devices == [uuid_of(i) for i in range(4)]  # exclusive: never two on one GPU
        kernel_ids = {s["kernel"]["id"] for s in sessions}
        assert {r.kernel_id for r in leases} == kernel_ids
        for r in leases:
            assert kernel_environ(r.pid)["CUDA_VISIBLE_DEVICES"] == r.device_uuids[0]
            assert r.exclusive
        fifth = alice.start_session("nb5")
        assert len(as_root.list_leases()) == 4
        assert fifth["kernel"]["id"] not in {r.kernel_id for r in as_root.list_leases()}
        # Each user sees the other's holders, without command lines.
        cli_env = dict(env, HOME="/nonexistent")
        for me, other in ((USERS[0], USERS[1]), (USERS[1], USERS[0])):
            out = cli_as(me, cli_env, "leases", "--json")
            assert out.returncode == 0, out.stderr
            theirs = [d for d in json.loads(out.stdout) if d["user"] == other]
            assert len(theirs) == 2
            assert all(d["command"] is None and d["kernel_id"] in kernel_ids for d in theirs)
        # ... and so does the sidebar's endpoint of alice's server (read from the broker).
        code, holders = alice.request("GET", "autogpu", "holders")
        assert code == 200, holders
        rows = json.dumps(holders)
        assert USERS[1] in rows
        assert '"command": "' not in rows
        # The shared-directory registry was never used.
        assert not any((area / "registry").rglob("*.lease"))
    finally:
        for s in servers.values():
            s.stop()
        try:
            broker.wait_for(lambda st: st["leases"] == [], timeout=10)
        finally:
            broker.stop()
