"""autogpu inside a real Slurm job: a single-node cluster (``munged``, ``slurmctld``, ``slurmd``
from Debian's ``slurm-wlm``) started on this host under a temporary directory, with GPU GRES on
``/dev/nvidia[0-3]`` (character devices made with ``mknod`` where absent), as
``docs/cluster.md`` and the team's measured recipe describe.

What runs for real: Slurm's scheduler grants GPUs, ``srun`` starts the step with Slurm's own
``CUDA_VISIBLE_DEVICES`` / ``SLURM_STEP_GPUS``, and ``autogpu pick`` runs inside it over a
simulated 4-GPU fleet (there is no NVIDIA driver here). What cannot run here: device-cgroup
confinement (``ConstrainDevices=yes`` needs cgroup v2 delegation and real NVIDIA devices), so
``TaskPlugin=task/none`` and NVML (simulated) still sees all four GPUs: exactly the case where
autogpu must narrow to the grant and never widen past it.

The last test runs docs/jupyterhub.md case (c) for real: a JupyterHub whose batchspawner
``SlurmSpawner`` starts a user's server as a Slurm job (as that user), and the server's default
autogpu kernel picks inside the job's GPUs. Differences from a production set-up, because of this
machine: ``exec_prefix`` is ``runuser -m -u {username} --`` (no sudo here), the user's job runs
Debian's ``/usr/bin/python3`` with the venv's site-packages on ``PYTHONPATH`` (the venv's
interpreter is under ``/root``), and the server listens on 127.0.0.1 (single node = this host).

Needs root and the Slurm binaries; skipped otherwise (a failure in CI: the ``slurm`` marker).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.browserhelpers import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3

#: Four GPUs; the idle ones (0 and 3) are exactly those the job below is NOT granted.
FLEET: dict[str, Any] = {"devices": [
    {"name": "NVIDIA A100-SXM4-80GB", "uuid": f"GPU-5105{i}000-0000-0000-0000-00000000000{i}",
     "pci_bus_id": f"00000000:{0x07 + 0x10 * i:02X}:00.0", "memory_total": "80G",
     "memory_used": used, "utilization_pct": util}
    for i, (used, util) in enumerate([("0G", 0), ("40G", 60), ("20G", 30), ("0G", 0)])
]}


@dataclass
class Slurm:
    """A running single-node Slurm: ``env`` has ``SLURM_CONF`` (and our PATH)."""

    conf: Path
    env: dict[str, str]
    log_dir: Path

    def run(self, *args: str, timeout_s: float = 60, **extra: str
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env={**self.env, **extra}, capture_output=True,
                              text=True, timeout=timeout_s)


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("a single-node Slurm needs root (slurmd runs jobs as their users)")
    missing = [b for b in ("munged", "slurmctld", "slurmd", "srun", "sinfo")
               if shutil.which(b) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)} missing; scripts/setup.sh "
                    "installs slurm-wlm and munge as root)")


def _pid(path: Path, deadline_s: float = 20) -> int:
    deadline = time.monotonic() + deadline_s
    while not path.exists() or not path.read_text().strip():
        if time.monotonic() > deadline:
            pytest.fail(f"no pid file {path}")
        time.sleep(0.1)
    return int(path.read_text().split()[0])


@pytest.fixture(scope="module")
def slurm() -> Iterator[Slurm]:
    _require()
    # Readable by every user (not pytest's 0700 tmp): a job's user reads slurm.conf and talks
    # to munged's socket, as on a real cluster.
    base = Path(tempfile.mkdtemp(prefix="autogpu-slurm-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    for sub in ("state", "spool", "log", "munge"):
        (base / sub).mkdir(mode=0o755)
    made: list[Path] = []
    for i in range(4):
        dev = Path(f"/dev/nvidia{i}")
        if not dev.exists():
            os.mknod(dev, 0o666 | 0o020000, os.makedev(195, i))  # S_IFCHR, major 195 as NVIDIA's
            made.append(dev)
    host = socket.gethostname().split(".")[0]
    sock = base / "munge" / "munge.socket"
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=autogpu-test",
        f"SlurmctldHost={host}",
        "AuthType=auth/munge",
        f"AuthInfo=socket={sock}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "GresTypes=gpu",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmUser=root",
        f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool'}",
        f"SlurmctldPidFile={base / 'slurmctld.pid'}",
        f"SlurmdPidFile={base / 'slurmd.pid'}",
        f"SlurmctldLogFile={base / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={base / 'log' / 'slurmd.log'}",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "ReturnToService=2",
        "MpiDefault=none",
        f"NodeName={host} CPUs={os.cpu_count() or 1} Gres=gpu:4 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    (base / "gres.conf").write_text("Name=gpu File=/dev/nvidia[0-3]\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for name in list(env):
        if name.startswith("SLURM_") and name != "SLURM_CONF":
            del env[name]
    pids: list[int] = []
    try:
        # A private munged (own socket, pid and log files): the package's key, nothing global.
        subprocess.run(
            ["munged", "--force", f"--socket={sock}", f"--pid-file={base / 'munge' / 'pid'}",
             f"--log-file={base / 'log' / 'munged.log'}",
             f"--seed-file={base / 'munge' / 'seed'}"],
            check=True, timeout=30, capture_output=True,
        )
        pids.append(_pid(base / "munge" / "pid"))
        subprocess.run(["slurmctld"], env=env, check=True, timeout=30, capture_output=True)
        pids.append(_pid(base / "slurmctld.pid"))
        subprocess.run(["slurmd"], env=env, check=True, timeout=30, capture_output=True)
        pids.append(_pid(base / "slurmd.pid"))
        deadline = time.monotonic() + 60
        while True:
            state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                                   text=True, timeout=30).stdout.strip()
            if state == "idle":
                break
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-1500:] for p in (base / "log").glob("*.log"))
                pytest.fail(f"the Slurm node never became idle (state {state!r}):\n{logs}")
            time.sleep(0.3)
        yield Slurm(conf, env, base / "log")
    finally:
        for pid in reversed(pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in reversed(pids):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
        for dev in made:
            dev.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def fleet_env(tmp_path: Path) -> dict[str, str]:
    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(FLEET))
    return {"AUTOGPU_SIMULATE": str(fleet), "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry"),
            "PYTHONPATH": str(ROOT)}


def autogpu_in_step(slurm: Slurm, env: dict[str, str], gres: str, *args: str
                    ) -> subprocess.CompletedProcess[str]:
    return slurm.run("srun", f"--gres={gres}", "--time=5", sys.executable, "-m",
                     "autogpu_jupyter.cli", *args, **env)


def test_srun_grant_is_the_upper_bound(slurm: Slurm, fleet_env: dict[str, str]) -> None:
    """Another job holds GPU 0, so ``srun --gres=gpu:2`` is granted GPUs 1 and 2; the idle GPUs
    0 and 3 are better, but outside the grant: autogpu picks GPU 2 (less loaded of 1 and 2)."""
    holder = subprocess.Popen(["srun", "--gres=gpu:1", "--time=5", "sleep", "120"],
                              env=slurm.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while "R" not in slurm.run("squeue", "-h", "-o", "%t").stdout.split():
            assert time.monotonic() < deadline, "the first job never started"
            time.sleep(0.2)
        grant = slurm.run("srun", "--gres=gpu:2", "--time=5", "sh", "-c",
                          "echo $CUDA_VISIBLE_DEVICES $SLURM_STEP_GPUS")
        assert grant.stdout.split() == ["1,2", "1,2"], grant.stderr
        result = autogpu_in_step(slurm, fleet_env, "gpu:2", "pick", "--json")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        uuids = [d["uuid"] for d in FLEET["devices"]]
        assert [d["uuid"] for d in data["chosen"]] == [uuids[2]]
        assert data["env"]["CUDA_VISIBLE_DEVICES"] == uuids[2]
        by_index = {c["index"]: c for c in data["candidates"]}
        assert [i for i, c in sorted(by_index.items()) if c["eligible"]] == [1, 2]
        for outside in (0, 3):
            assert by_index[outside]["eligible"] is False
            assert any("outside this process's allocation" in r
                       for r in by_index[outside]["reasons"]), by_index[outside]["reasons"]
        # two devices asked for inside a two-GPU grant: exactly the grant, in policy order
        both = autogpu_in_step(slurm, fleet_env, "gpu:2", "pick", "--count", "2", "--json")
        assert both.returncode == 0, both.stderr
        assert [d["uuid"] for d in json.loads(both.stdout)["chosen"]] == [uuids[2], uuids[1]]
        # three: more than the grant, never widened
        three = autogpu_in_step(slurm, fleet_env, "gpu:2", "pick", "--count", "3", "--json")
        assert three.returncode == 3, (three.stdout, three.stderr)
    finally:
        holder.terminate()
        holder.wait(30)


def test_whole_node_grant_picks_the_best(slurm: Slurm, fleet_env: dict[str, str]) -> None:
    """The same pick in a step granted all four GPUs: idle GPU 0 (UUID breaks the tie with 3)."""
    result = autogpu_in_step(slurm, fleet_env, "gpu:4", "pick", "--min-free", "70G", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["uuid"] for d in data["chosen"]] == [FLEET["devices"][0]["uuid"]]
    assert sorted(c["index"] for c in data["candidates"] if c["eligible"]) == [0, 3]



# -- batchspawner: a user's server as a Slurm job ---------------------------------------------

BATCH_USER = "agtest-alice"
SPEC = "python3-autogpu"

SPAWNER_CONFIG = '''\
# The hub of tests/cluster/test_slurm.py: docs/jupyterhub.md case (c), batchspawner on Slurm.
import batchspawner.api  # noqa: F401  (the endpoint a job reports its port to)
# docs/jupyterhub.md case (c)
c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.SlurmSpawner.req_options = "--gres=gpu:2"     # the job's GPUs; autogpu narrows inside them
c.SlurmSpawner.req_runtime = "0:10:00"
# sbatch, squeue and scancel as the user (no sudo on this machine: runuser, env kept)
c.SlurmSpawner.exec_prefix = "/usr/sbin/runuser -m -u {{username}} --"
# the user runs Debian's Python (the venv's is under /root, mode 0700)
c.SlurmSpawner.batchspawner_singleuser_cmd = "{python} -m batchspawner.singleuser"
c.SlurmSpawner.cmd = [{singleuser!r}]
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
c.Spawner.environment = {environment!r}
c.Spawner.default_url = "/lab"
# batchspawner asks the server to listen on every address (0.0.0.0); the single node here is
# this host (its name resolves to 127.0.0.1), and test servers listen on loopback only
c.Spawner.args = ["--ServerApp.ip=127.0.0.1"]
'''


@pytest.fixture
def batch_user() -> Iterator[str]:
    import pwd

    from tests.leasehelpers import ensure_user

    uid, gid = ensure_user(BATCH_USER)
    home = Path(pwd.getpwnam(BATCH_USER).pw_dir)
    made = not home.exists()
    if made:
        home.mkdir(parents=True, mode=0o700)
        os.chown(home, uid, gid)
    try:
        yield BATCH_USER
    finally:
        if made:
            shutil.rmtree(home, ignore_errors=True)


def test_batchspawner_server_is_a_slurm_job_whose_kernel_picks_inside_the_grant(
    slurm: Slurm, batch_user: str, fake_nvml_library: Path
) -> None:
    """A real JupyterHub with batchspawner's SlurmSpawner (``--gres=gpu:2``) starts the user's
    server as a Slurm job; another job holds GPU 0, so the grant is GPUs 1 and 2; the server's
    default kernel (the autogpu kernelspec, ``--min-free 10G``) picks GPU 2, the less loaded of
    the grant, although GPUs 0 and 3 are idle. Stopping the server cancels the job and frees
    the kernel's lease."""
    import pwd

    from autogpu_jupyter.core.leasing import DirectoryStore
    from tests.kernelhelpers import kernel_environ
    from tests.leasehelpers import SYSTEM_PYTHON, shared_area
    from tests.serverhelpers import Hub, chp, shared_host

    pytest.importorskip("batchspawner", reason="pip install batchspawner (the test extra has it)")
    proxy = chp()
    if proxy is None:
        pytest.skip("configurable-http-proxy missing (scripts/setup.sh installs it with npm)")
    with shared_area("autogpu-bspawn") as area:
        environment = shared_host(
            area, fake_nvml_library, FLEET, spec=SPEC, options={"min_free": "10G"},
            server_config='c = get_config()  # noqa: F821\n'
            f'c.MappingKernelManager.default_kernel_name = "{SPEC}"\n',
        )
        environment["SLURM_CONF"] = str(slurm.conf)
        registry = Path(environment["AUTOGPU_REGISTRY_DIR"])
        singleuser = area / "jupyterhub-singleuser"
        singleuser.write_text(f"#!{SYSTEM_PYTHON}\nfrom jupyterhub.singleuser import main\n"
                              "main()\n")
        os.chmod(singleuser, 0o755)

        blocker = subprocess.Popen(["srun", "--gres=gpu:1", "--time=5", "sleep", "300"],
                                   env=slurm.env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        hub = Hub(area, users={batch_user}, environment=environment, chp=proxy,
                  spawner_config=SPAWNER_CONFIG, fields={"singleuser": str(singleuser)},
                  hub_env={"SLURM_CONF": str(slurm.conf)})
        try:
            deadline = time.monotonic() + 60
            while "R" not in slurm.run("squeue", "-h", "-o", "%t").stdout.split():
                assert time.monotonic() < deadline, "the blocking job never started"
                time.sleep(0.2)
            hub.wait_up()
            hub.start_server(batch_user, timeout_s=120)
            jobs = slurm.run("squeue", "-h", "-u", batch_user, "-o", "%j %T %b").stdout.split()
            assert jobs == ["spawner-jupyterhub", "RUNNING", "gres:gpu:2"], (jobs, hub.log())
            code, model = hub.user_api(batch_user, "POST", "/kernels", {})
            assert code == 201, (code, model, hub.log())
            assert model["name"] == SPEC
            leases = DirectoryStore(str(registry)).list_leases()
            assert [r.kernel_id for r in leases] == [model["id"]]
            lease = leases[0]
            assert lease.user == batch_user
            kenv = kernel_environ(lease.pid)
            uuids = [d["uuid"] for d in FLEET["devices"]]
            assert kenv["CUDA_VISIBLE_DEVICES"] == uuids[2]
            assert lease.device_uuids == (uuids[2],)
            assert kenv["SLURM_JOB_GPUS"] == "1,2"  # the kernel runs inside the job's grant
            assert kenv["SLURM_JOB_ID"]
            status = Path(f"/proc/{lease.pid}/status").read_text()
            uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
            assert uid_line.split()[1] == str(pwd.getpwnam(batch_user).pw_uid)
            # stopping the server cancels the job; the kernel's lease goes with it
            code, body = hub.api("DELETE", f"/users/{batch_user}/server")
            assert code in (202, 204), (code, body)
            deadline = time.monotonic() + 60
            while slurm.run("squeue", "-h", "-u", batch_user, "-o", "%i").stdout.strip():
                assert time.monotonic() < deadline, "the server's job never ended"
                time.sleep(0.3)
            deadline = time.monotonic() + 30
            while DirectoryStore(str(registry)).list_leases():
                assert time.monotonic() < deadline, "the kernel's lease outlived the job"
                time.sleep(0.3)
        finally:
            hub.stop()
            blocker.terminate()
            blocker.wait(30)
            artifacts = ROOT / "test-artifacts"
            artifacts.mkdir(exist_ok=True)
            shutil.copy(hub.log_path, artifacts / "batchspawner-hub.log")
            home = Path(pwd.getpwnam(batch_user).pw_dir)
            for job_log in home.glob("jupyterhub_slurmspawner_*.log"):
                shutil.copy(job_log, artifacts / "batchspawner-job.log")
