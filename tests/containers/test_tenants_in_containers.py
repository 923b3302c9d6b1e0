"""Two hub users' containers, both uid 1000, share the host's GPUs as two tenants (issue 40,
phase B).

The host's broker (a real ``autogpu broker`` process, root) serves the rules file's tenants
``alice`` (up to 2 devices) and ``bob`` (up to 2 devices), each on its own socket under a 0700
socket root; each tenant's socket directory is mounted at ``/run/autogpu`` in that tenant's
containers (podman, rootful, runc: own pid, network, mount namespaces; uid 1000 in both). Real
IPython kernels run ``%gpu pick`` in them:

* a herd of 4 kernels started at once, 2 per tenant, on 4 simulated GPUs lands on 4 different
  GPUs;
* the leases are named alice and bob on the host (``autogpu leases``, ``broker status``) and in
  each container (``autogpu leases`` there), and each tenant sees its own command lines, never
  the other's;
* bob, asking for more devices than his limit, is refused in one line;
* a broker killed with SIGKILL and started again takes every lease back under the same tenant
  (nothing lost, nothing doubled);
* a kernel's container killed with SIGKILL frees its lease.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter import hub
from tests.brokerhelpers import Area, BrokerProc, broker_area
from tests.containerhelpers import (
    SYSTEM_PYTHON,
    Container,
    KernelInContainer,
    container_problem,
    podman_env,
)

pytestmark = pytest.mark.skipif(container_problem() is not None,
                                reason=str(container_problem()))

REPO = Path(__file__).resolve().parents[2]

PICK = [
    "%load_ext autogpu",
    "%gpu pick",
    "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))",
]

#: The broker's ``leases`` answer, as any client in the container gets it on its socket.
_RAW_LEASES = (
    "import json, socket; s = socket.socket(socket.AF_UNIX); s.connect('/run/autogpu/broker.sock');"
    " s.sendall(b'{\"op\": \"leases\", \"proto\": 2}\\n'); f = s.makefile('rb');"
    " print(f.readline().decode())"
)


def _host_leases(area: Area) -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "autogpu_jupyter.cli", "leases", "--json"],
        capture_output=True, text=True, check=True, cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO), "AUTOGPU_BROKER_SOCKET": str(area.socket),
             "AUTOGPU_SIMULATE": str(area.fleet)},
    )
    rows: list[dict[str, Any]] = json.loads(out.stdout)
    return rows


def _in(container: Container, *args: str) -> subprocess.CompletedProcess[str]:
    return container.run(SYSTEM_PYTHON, "-m", "autogpu_jupyter.cli", *args)


def _device(kernel: KernelInContainer) -> str:
    assert [r["status"] for r in kernel.results] == ["ok"] * len(PICK), kernel.results
    return str(kernel.results[-1]["stdout"]).strip()


def test_two_tenants_of_uid_1000_share_the_hosts_gpus(tmp_path: Path) -> None:
    sockets = tmp_path / "tenant-sockets"
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"tenants": {"alice": {"max_devices": 2},
                                             "bob": {"max_devices": 2}}}))
    with broker_area(4) as root:
        area = Area(root, 4)
        broker = BrokerProc(root, "--tenant-socket-root", str(sockets), "--rules", str(rules),
                            env={"AUTOGPU_SIMULATE": str(area.fleet),
                                 "AUTOGPU_RECORD_COMMANDS": "1"})
        stack = contextlib.ExitStack()
        kernels: list[KernelInContainer] = []
        try:
            env = {**hub.container_environment(), "AUTOGPU_SIMULATE": str(area.fleet)}
            box = {
                name: stack.enter_context(Container(
                    tmp_path, socket_dir=sockets / name, env=env,
                    mounts={str(area.fleet): str(area.fleet)},
                ))
                for name in ("alice", "bob")
            }
            # The herd: 4 kernels at once, 2 per tenant, on 4 free GPUs.
            owners = ["alice", "bob", "alice", "bob"]
            with ThreadPoolExecutor(len(owners)) as pool:
                futures = [pool.submit(box[o].kernel, PICK) for o in owners]
                for f in futures:
                    with contextlib.suppress(Exception):
                        kernels.append(f.result())
            assert len(kernels) == len(owners), [str(f.exception()) for f in futures]
            devices = [_device(k) for k in kernels]
            assert len(set(devices)) == 4, devices  # spread: no two on one GPU

            rows = _host_leases(area)
            assert sorted((r["user"], r["device_uuids"][0]) for r in rows) == sorted(
                zip(owners, devices, strict=True))
            st = broker.status()
            assert {u: r["leases"] for u, r in st["per_user"].items()} == {"alice": 2, "bob": 2}

            # In each container: everyone's leases by tenant name (``autogpu leases``), and
            # the broker's own answer carries only that tenant's command lines.
            for name, other in (("alice", "bob"), ("bob", "alice")):
                seen = _in(box[name], "leases", "--json")
                assert seen.returncode == 0, seen.stderr
                mine = json.loads(seen.stdout)
                assert sorted(r["user"] for r in mine) == ["alice", "alice", "bob", "bob"]
                raw = box[name].run(SYSTEM_PYTHON, "-c", _RAW_LEASES)
                assert raw.returncode == 0, raw.stderr
                records = json.loads(raw.stdout)["records"]
                assert sorted(r["user"] for r in records) == ["alice", "alice", "bob", "bob"]
                assert all(r["command"] for r in records if r["user"] == name), records
                assert all(r["command"] is None for r in records if r["user"] == other), records

            # bob asking for more devices than his limit: refused in one line, nothing leased.
            over = _in(box["bob"], "run", "--count", "3", "--", "true")
            assert over.returncode != 0
            lines = [ln for ln in over.stderr.splitlines() if ln.strip()]
            assert len(lines) == 1 and "max_devices_per_user = 2" in lines[0], over.stderr
            assert len(_host_leases(area)) == 4

            # The broker killed and started again: every lease taken back, by the same tenant.
            before = sorted((r["lease_id"], r["user"]) for r in _host_leases(area))
            broker.restart()
            broker.wait_for(lambda s: s["orphans"] == 4)
            assert sorted((r["lease_id"], r["user"]) for r in _host_leases(area)) == before

            # SIGKILL of one of alice's kernels (its container's first process): its lease ends.
            gone = kernels.pop(0)
            subprocess.run(["podman", "kill", "--signal", "KILL", gone.name],
                           capture_output=True, check=False, env=podman_env(gone.workdir))
            gone.close()
            st = broker.wait_for(lambda s: s["leases_total"] == 3, timeout=30)
            assert {u: r["leases"] for u, r in st["per_user"].items()} == {"alice": 1, "bob": 2}
        finally:
            for k in kernels:
                k.close()
            broker.stop()
            stack.close()


def test_a_container_given_some_gpus_picks_only_inside_them(tmp_path: Path) -> None:
    """A container granted GPUs by UUID (``NVIDIA_VISIBLE_DEVICES``, as ``--gpus`` or a device
    plugin grants them) picks only inside its grant, and the host's broker books exactly the
    UUIDs the container chose, whatever the container's own numbering: on 4 idle GPUs, whose
    tie would go to GPU 0, carol's kernel granted GPU 3 lands on GPU 3, and dave's granted GPUs
    1 and 2 gets both with ``--count 2``."""
    from tests.leasehelpers import uuid_of

    sockets = tmp_path / "tenant-sockets"
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"tenants": {"carol": {}, "dave": {}}}))
    with broker_area(4) as root:
        area = Area(root, 4)
        broker = BrokerProc(root, "--tenant-socket-root", str(sockets), "--rules", str(rules),
                            env={"AUTOGPU_SIMULATE": str(area.fleet)})
        kernels: list[KernelInContainer] = []
        try:
            with contextlib.ExitStack() as stack:
                base = {**hub.container_environment(), "AUTOGPU_SIMULATE": str(area.fleet)}
                carol = stack.enter_context(Container(
                    tmp_path, socket_dir=sockets / "carol",
                    env={**base, "NVIDIA_VISIBLE_DEVICES": uuid_of(3)},
                    mounts={str(area.fleet): str(area.fleet)}))
                dave = stack.enter_context(Container(
                    tmp_path, socket_dir=sockets / "dave",
                    env={**base, "NVIDIA_VISIBLE_DEVICES": f"{uuid_of(1)},{uuid_of(2)}"},
                    mounts={str(area.fleet): str(area.fleet)}))
                kernels.append(carol.kernel(PICK))
                assert _device(kernels[-1]) == uuid_of(3)
                kernels.append(dave.kernel(["%load_ext autogpu", "%gpu pick --count 2",
                                            PICK[-1]]))
                assert [r["status"] for r in kernels[-1].results] == ["ok"] * 3
                got = str(kernels[-1].results[-1]["stdout"]).strip()
                assert sorted(got.split(",")) == [uuid_of(1), uuid_of(2)]
                rows = _host_leases(area)
                assert sorted((r["user"], tuple(sorted(r["device_uuids"]))) for r in rows) == [
                    ("carol", (uuid_of(3),)), ("dave", (uuid_of(1), uuid_of(2)))]
                for k in kernels:
                    k.close()
                kernels.clear()
        finally:
            for k in kernels:
                k.close()
            broker.stop()
