"""Kernels started by the autogpu provisioner lease through the broker (real kernels, a real
broker process, the fake ``libnvidia-ml.so.1``).

The provisioner hands the lease's connection to the kernel (``pass_fds``) as it hands a lease
file's descriptor; the broker records the kernel's pid; the lease ends with the kernel.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import AsyncKernelManager

from autogpu_jupyter import kernelspec
from autogpu_jupyter.errors import LeaseStoreUntrustedError
from tests.brokerhelpers import BrokerProc
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import fleet, uuid_of

REPO = Path(__file__).resolve().parents[2]


class Setup:
    def __init__(self, tmp: Path, fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.fake = fake
        self.prefix = tmp / "prefix"
        self.registry_dir = tmp / "registry"
        runtime = tmp / "runtime"
        runtime.mkdir(mode=0o700)
        (tmp / "broker" / "run").mkdir(parents=True)
        self.socket = tmp / "broker" / "run" / "broker.sock"
        monkeypatch.setenv("JUPYTER_PATH", str(self.prefix / "share" / "jupyter"))
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(self.registry_dir))
        monkeypatch.setenv("AUTOGPU_BROKER_SOCKET", str(self.socket))
        for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED",
                    "AUTOGPU_LEASE_ID", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_GPUS",
                    "SLURM_STEP_GPUS", "AUTOGPU_MIN_FREE", "AUTOGPU_WAIT"):
            monkeypatch.delenv(var, raising=False)
        fake.write(fleet(4))
        kernelspec.install("agp", "Python 3 (agp)", {"min_free": "10G"}, prefix=str(self.prefix))

    def kernel_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.fake.env)
        env["PYTHONPATH"] = str(REPO)
        return env


@pytest.fixture
def setup(fake_nvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    return Setup(tmp_path, fake_nvml, monkeypatch)


@pytest.fixture
def broker(setup: Setup) -> Iterator[BrokerProc]:
    proc = BrokerProc(setup.tmp / "broker")
    try:
        yield proc
    finally:
        proc.stop()


async def start(setup: Setup) -> AsyncKernelManager:
    km = AsyncKernelManager(kernel_name="agp")
    await km.start_kernel(env=setup.kernel_env(), cwd=str(setup.tmp))
    return km


def test_kernels_lease_through_the_broker_and_the_lease_dies_with_the_kernel(
    setup: Setup, broker: BrokerProc
) -> None:
    async def main() -> None:
        kms = await asyncio.gather(*(start(setup) for _ in range(8)))
        try:
            pids = [int(km.provisioner.pid) for km in kms]
            envs = [kernel_environ(pid) for pid in pids]
            counts: dict[str, int] = {}
            for env in envs:
                counts[env["CUDA_VISIBLE_DEVICES"]] = counts.get(env["CUDA_VISIBLE_DEVICES"], 0) + 1
            assert counts == {uuid_of(i): 2 for i in range(4)}
            st = broker.status()
            by_id = {r["lease_id"]: r for r in st["leases"]}
            assert len(by_id) == 8
            for km, pid, env in zip(kms, pids, envs, strict=True):
                rec = by_id[env["AUTOGPU_LEASE_ID"]]
                assert rec["pid"] == pid  # the kernel's pid, set by the provisioner
                assert rec["kernel_id"] == km.kernel_id and rec["holder_kind"] == "kernel"
                assert rec["device_uuids"] == [env["CUDA_VISIBLE_DEVICES"]]
            # The server kept no copy of any lease connection: only the kernels hold them.
            assert not any(setup.registry_dir.glob("*/*.lease"))
            # SIGKILL one kernel: its lease is gone, nothing else.
            os.kill(pids[0], signal.SIGKILL)
            st = broker.wait_for(lambda s: len(s["leases"]) == 7, timeout=5)
            assert envs[0]["AUTOGPU_LEASE_ID"] not in {r["lease_id"] for r in st["leases"]}
            # A restart stays on the same GPU with one lease, for the new kernel's pid.
            await kms[1].restart_kernel(now=True)
            new_pid = int(kms[1].provisioner.pid)
            same = envs[1]["CUDA_VISIBLE_DEVICES"]
            assert kernel_environ(new_pid)["CUDA_VISIBLE_DEVICES"] == same
            st = broker.wait_for(lambda s: new_pid in {r["pid"] for r in s["leases"]}, timeout=5)
            assert len(st["leases"]) == 7
        finally:
            await asyncio.gather(*(km.shutdown_kernel(now=True) for km in kms))
        broker.wait_for(lambda s: s["leases"] == [], timeout=5)

    asyncio.run(main())


def test_a_kernel_does_not_start_when_the_broker_is_down(setup: Setup) -> None:
    async def main() -> None:
        km = AsyncKernelManager(kernel_name="agp")
        with pytest.raises(LeaseStoreUntrustedError, match="cannot be reached"):
            await km.start_kernel(env=setup.kernel_env(), cwd=str(setup.tmp))

    asyncio.run(main())


def test_a_revoked_lease_is_said_in_the_notebook(setup: Setup, broker: BrokerProc) -> None:
    """Root revokes a kernel's lease; the notebook is told after its next cell, once."""
    import subprocess
    import sys

    async def main() -> None:
        km = await start(setup)
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)
            env = kernel_environ(int(km.provisioner.pid))
            lease_id = env["AUTOGPU_LEASE_ID"]
            out = subprocess.run(
                [sys.executable, "-m", "autogpu_jupyter.cli", "broker", "revoke", lease_id,
                 "--socket", str(setup.socket)],
                capture_output=True, text=True, timeout=60, check=False,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            assert out.returncode == 0, out.stderr
            texts: list[str] = []

            def hook(msg: dict[str, Any]) -> None:
                if msg["msg_type"] == "stream":
                    texts.append(msg["content"]["text"])

            await kc.execute_interactive("1 + 1", timeout=60, output_hook=hook)
            await kc.execute_interactive("2 + 2", timeout=60, output_hook=hook)
            said = [t for t in "".join(texts).splitlines() if "revoked" in t]
            assert said == [
                f"autogpu: your GPU lease {lease_id[:32]} was revoked by the admin: this kernel "
                "no longer holds it; others may now be given its GPU"
            ]
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    asyncio.run(main())
