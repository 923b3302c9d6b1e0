"""A notebook kernel in a real container leases through the host's broker (issue 40, phase A).

podman (rootful, runc) runs a container as uid 1000 in its own pid, network (loopback only),
mount, IPC and UTS namespaces, from a root filesystem built of this host's files
(tests/containerhelpers.py). The host's broker (a real ``autogpu broker`` process, root) has its
socket directory mounted read-only at ``/run/autogpu`` in the container, with the environment
that ``autogpu_jupyter.hub`` gives a container. A real IPython kernel, started by
``jupyter_client`` inside the container, runs ``%load_ext autogpu`` and ``%gpu pick``: the
lease it gets is listed by the host's ``autogpu broker status`` and ``autogpu leases``, under the
name of the container's uid (1000). That is today's baseline: every container's uid is the same,
so phase B serves tenants' own sockets, on which the lease is named by the tenant instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from autogpu_jupyter import hub
from tests.brokerhelpers import Area, BrokerProc, broker_area
from tests.containerhelpers import Container, container_problem

pytestmark = pytest.mark.skipif(container_problem() is not None,
                                reason=str(container_problem()))

REPO = Path(__file__).resolve().parents[2]


def _name_of(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "unknown uids"


@pytest.mark.parametrize("userns", [False, True], ids=["own-pid-net", "own-pid-net-user"])
def test_a_kernel_in_a_container_leases_through_the_hosts_broker(
    tmp_path: Path, userns: bool,
) -> None:
    """Without a user namespace the lease is named by the host's user of uid 1000; with one,
    the container's uid 1000 is a host uid of no user: the broker's shared bucket of unknown
    uids (the baseline tenants replace)."""
    with broker_area(4) as root:
        area = Area(root, 4)
        broker = BrokerProc(root, env={"AUTOGPU_SIMULATE": str(area.fleet)})
        stack = contextlib.ExitStack()
        try:
            container = stack.enter_context(Container(
                tmp_path, socket_dir=root / "run",
                env={**hub.container_environment(), "AUTOGPU_SIMULATE": str(area.fleet)},
                mounts={str(area.fleet): str(area.fleet)}, userns=userns,
            ))
            owner = _name_of(container.host_uid)
            kernel = container.kernel([
                "import os; print(os.getuid(), os.getpid())",
                "%load_ext autogpu",
                "%gpu pick",
                "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
                "('CUDA_VISIBLE_DEVICES', 'AUTOGPU_LEASE_ID')}))",
            ])
            try:
                who, loaded, picked, env = kernel.results
                assert [r["status"] for r in kernel.results] == ["ok"] * 4, kernel.results
                uid, pid = map(int, who["stdout"].split())
                assert uid == 1000
                assert pid < 100  # a pid of the container's own namespace
                assert loaded["stderr"] == ""
                chosen = json.loads(env["stdout"])
                assert chosen["CUDA_VISIBLE_DEVICES"], picked
                assert chosen["CUDA_VISIBLE_DEVICES"] in picked["stdout"] + "".join(picked["texts"])

                st = broker.status()
                leases = st["leases"]
                assert len(leases) == 1, st
                assert (leases[0]["user"], leases[0]["uid"]) == (owner, container.host_uid)
                assert leases[0]["device_uuids"] == [chosen["CUDA_VISIBLE_DEVICES"]]
                listed = subprocess.run(
                    [sys.executable, "-m", "autogpu_jupyter.cli", "leases", "--json"],
                    capture_output=True, text=True, check=True, cwd=str(REPO),
                    env={**os.environ, "PYTHONPATH": str(REPO),
                         "AUTOGPU_BROKER_SOCKET": str(area.socket),
                         "AUTOGPU_SIMULATE": str(area.fleet)},
                )
                rows = json.loads(listed.stdout)
                assert [(r["user"], r["device_uuids"]) for r in rows] == [
                    (owner, [chosen["CUDA_VISIBLE_DEVICES"]])]
            finally:
                kernel.close()
            # The kernel's end (its socket closed inside the container) ends the lease.
            broker.wait_for(lambda s: not s["leases"])
        finally:
            broker.stop()
            stack.close()
