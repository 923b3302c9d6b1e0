"""autogpu inside a real Slurm job on an AMD node: a single-node cluster (Debian's ``slurm-wlm``)
whose GPU GRES are AMD render nodes ``/dev/dri/renderD[128-131]`` (character devices made with
``mknod`` where absent), so Slurm sets the ROCm variables as it does on AMD nodes, and
``autogpu pick`` runs inside the step over AMD's real ``amdsmi`` binding and the fake
``libamd_smi.so`` (found by itself: only the AMD fake is on the library path).

Two ``gres.conf`` set-ups, as ``man gres.conf`` describes them: ``Flags=amd_gpu_env`` (only
``ROCR_VISIBLE_DEVICES``, what ``AutoDetect=rsmi`` implies and Slurm recommends for AMD) and no
flags (Slurm then also writes ``CUDA_VISIBLE_DEVICES`` and ``GPU_DEVICE_ORDINAL`` with the same
ids, the set-up Slurm's manual warns about). In both, the grant is the upper bound: never
widened. What cannot run here is device-cgroup confinement (``TaskPlugin=task/none``): amdsmi
sees all four GPUs and Slurm writes global ids, exactly the case where autogpu must narrow.

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

from tests.fakeamdsmi import FakeAmdSmi, amd_rocr_uuid, amd_uuid
from tests.leasehelpers import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GiB = 1024**3

#: Four MI300X; the idle ones (0 and 3) are exactly those the job below is NOT granted.
FLEET: dict[str, Any] = {"devices": [
    {"name": "AMD Instinct MI300X", "uuid": amd_uuid(i), "rocr_uuid": amd_rocr_uuid(i),
     "pci_bus_id": f"0000:{0x05 + 0x20 * i:02x}:00.0", "memory_total": "192G",
     "memory_used": used, "utilization_pct": util}
    for i, (used, util) in enumerate([("0G", 0), ("90G", 60), ("40G", 30), ("0G", 0)])
]}


@dataclass
class Slurm:
    env: dict[str, str]

    def run(self, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env={**self.env, **extra}, capture_output=True,
                              text=True, timeout=60)


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


@pytest.fixture(scope="module", params=["Flags=amd_gpu_env", ""], ids=["amd_gpu_env", "no-flags"])
def slurm(request: pytest.FixtureRequest) -> Iterator[Slurm]:
    _require()
    base = Path(tempfile.mkdtemp(prefix="autogpu-amd-slurm-", dir="/var/tmp"))
    os.chmod(base, 0o755)
    for sub in ("state", "spool", "log", "munge"):
        (base / sub).mkdir(mode=0o755)
    made: list[Path] = []
    dri = Path("/dev/dri")
    made_dri = not dri.exists()
    dri.mkdir(exist_ok=True)
    for i in range(4):
        dev = dri / f"renderD{128 + i}"
        if not dev.exists():
            os.mknod(dev, 0o666 | 0o020000, os.makedev(226, 128 + i))  # DRM's major, 226
            made.append(dev)
    host = socket.gethostname().split(".")[0]
    sock = base / "munge" / "munge.socket"
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=autogpu-amd-test", f"SlurmctldHost={host}", "AuthType=auth/munge",
        f"AuthInfo=socket={sock}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "GresTypes=gpu", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SlurmUser=root", f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool'}", f"SlurmctldPidFile={base / 'slurmctld.pid'}",
        f"SlurmdPidFile={base / 'slurmd.pid'}",
        f"SlurmctldLogFile={base / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={base / 'log' / 'slurmd.log'}", f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}", "ReturnToService=2", "MpiDefault=none",
        f"NodeName={host} CPUs={os.cpu_count() or 1} Gres=gpu:4 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", "",
    ]))
    (base / "gres.conf").write_text(f"Name=gpu File=/dev/dri/renderD[128-131] {request.param}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    pids: list[int] = []
    try:
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
        while subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                             text=True, timeout=30).stdout.strip() != "idle":
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-1500:] for p in (base / "log").glob("*.log"))
                pytest.fail(f"the Slurm node never became idle:\n{logs}")
            time.sleep(0.3)
        yield Slurm(env)
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
        if made_dri:
            shutil.rmtree(dri, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def amd_env(tmp_path: Path) -> dict[str, str]:
    fake = FakeAmdSmi(tmp_path / "amd")
    fake.write(FLEET)
    env = dict(fake.env)
    env.update(AUTOGPU_REGISTRY_DIR=str(tmp_path / "registry"), PYTHONPATH=str(ROOT),
               AUTOGPU_BACKEND="auto", FAKE_NVML_SCENARIO="", AUTOGPU_SIMULATE="")
    return env


def pick_in_step(slurm: Slurm, env: dict[str, str], gres: str, *args: str
                 ) -> subprocess.CompletedProcess[str]:
    return slurm.run("srun", f"--gres={gres}", "--time=5", sys.executable, "-m",
                     "autogpu_jupyter.cli", "pick", "--json", *args, **env)


def test_slurms_amd_grant_is_never_widened(slurm: Slurm, amd_env: dict[str, str]) -> None:
    """Another job holds GPU 0, so ``srun --gres=gpu:2`` is granted GPUs 1 and 2; the idle GPUs
    0 and 3 are better but outside the grant: autogpu picks GPU 2 and writes the ROCm
    variables for it alone."""
    holder = subprocess.Popen(["srun", "--gres=gpu:1", "--time=5", "sleep", "120"],
                              env=slurm.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while "R" not in slurm.run("squeue", "-h", "-o", "%t").stdout.split():
            assert time.monotonic() < deadline, "the first job never started"
            time.sleep(0.2)
        seen = slurm.run("srun", "--gres=gpu:2", "--time=5", "sh", "-c",
                         "echo ${ROCR_VISIBLE_DEVICES-unset} ${CUDA_VISIBLE_DEVICES-unset} "
                         "${SLURM_STEP_GPUS-unset}")
        rocr, cvd, step = seen.stdout.split()
        assert (rocr, step) == ("1,2", "1,2"), seen.stderr
        assert cvd in ("1,2", "unset")  # set unless gres.conf says Flags=amd_gpu_env

        result = pick_in_step(slurm, amd_env, "gpu:2")
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert [d["uuid"] for d in data["chosen"]] == [amd_uuid(2)]
        assert data["env"] == {"ROCR_VISIBLE_DEVICES": amd_rocr_uuid(2),
                               "HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0",
                               "GPU_DEVICE_ORDINAL": "0"}
        by_index = {c["index"]: c for c in data["candidates"]}
        assert [i for i, c in sorted(by_index.items()) if c["eligible"]] == [1, 2]
        for outside in (0, 3):
            assert any("outside this process's allocation" in r
                       for r in by_index[outside]["reasons"]), by_index[outside]["reasons"]
        both = pick_in_step(slurm, amd_env, "gpu:2", "--count", "2")
        assert [d["uuid"] for d in json.loads(both.stdout)["chosen"]] == [
            amd_uuid(2), amd_uuid(1)]
        three = pick_in_step(slurm, amd_env, "gpu:2", "--count", "3")
        assert three.returncode == 3, (three.stdout, three.stderr)
    finally:
        holder.terminate()
        holder.wait(30)
