"""The kernel provisioner over the fake ``libnvidia-ml.so.1``: real kernels via ``jupyter_client``.

The kernelspecs are installed into a temporary prefix (``JUPYTER_PATH``) with
``autogpu_jupyter.kernelspec.install``; the provisioner (found through its entry point, as Jupyter
finds it) runs in this process, so the fake NVML preloaded here is what it reads. Each check reads
the kernel's environment from ``/proc/<pid>/environ``: what the kernel had before any user code.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import AsyncKernelManager

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core import moves
from autogpu_jupyter.core.leasing import DirectoryStore
from autogpu_jupyter.errors import NoDeviceFitsError, UsageErrorBase
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import fleet, uuid_of

pytest_plugins = ["pytest_jupyter.jupyter_server"]

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3


class Setup:
    """A temporary Jupyter prefix with kernelspecs, a registry, and the fake GPUs."""

    def __init__(self, tmp: Path, fake: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp
        self.fake = fake
        self.prefix = tmp / "prefix"
        self.registry_dir = tmp / "registry"
        runtime = tmp / "runtime"
        runtime.mkdir(mode=0o700)
        monkeypatch.setenv("JUPYTER_PATH", str(self.prefix / "share" / "jupyter"))
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(self.registry_dir))
        for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED",
                    "AUTOGPU_LEASE_ID", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_GPUS",
                    "SLURM_STEP_GPUS", "AUTOGPU_MIN_FREE", "AUTOGPU_WAIT"):
            monkeypatch.delenv(var, raising=False)
        fake.write(fleet(4))

    def install(self, name: str, **options: Any) -> None:
        kernelspec.install(name, f"Python 3 ({name})", options, prefix=str(self.prefix))

    def kernel_env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.fake.env)
        env["PYTHONPATH"] = str(REPO)
        env.update(extra)
        return env

    def registry(self) -> DirectoryStore:
        return DirectoryStore(str(self.registry_dir))

    def live(self) -> list[Any]:
        return self.registry().list_leases()

    def files(self) -> list[str]:
        return sorted(str(p.name) for p in self.registry_dir.glob("*/*.lease"))


@pytest.fixture
def setup(fake_nvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    return Setup(tmp_path, fake_nvml, monkeypatch)


async def start(setup: Setup, name: str, **extra: str) -> AsyncKernelManager:
    km = AsyncKernelManager(kernel_name=name)
    await km.start_kernel(env=setup.kernel_env(**extra), cwd=str(setup.tmp))
    return km


def open_files(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor
            pass
    return out


def kernel_pid(km: AsyncKernelManager) -> int:
    return int(km.provisioner.pid)


def test_kernelspec_names_the_provisioner_and_entry_point_is_registered(setup: Setup) -> None:
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="jupyter_client.kernel_provisioners")}
    assert eps["autogpu-provisioner"] == "autogpu_jupyter.provisioner:AutoGPUProvisioner"
    setup.install("agp", min_free="10G")
    spec = json.loads((setup.prefix / "share/jupyter/kernels/agp/kernel.json").read_text())
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": "autogpu-provisioner", "config": {"min_free": "10G"},
    }
    assert spec["argv"][:3] == [sys.executable, "-m", "ipykernel_launcher"]


def test_kernel_env_set_before_user_code_and_visible_to_the_kernel(setup: Setup) -> None:
    setup.install("agp", min_free="10G")
    # GPU 0 and 1 busy: the pick must be GPU 2 (most free, then UUID order).
    setup.fake.set(0, memory_used=60 * GiB)
    setup.fake.set(1, memory_used=50 * GiB)
    setup.fake.set(3, memory_used=1 * GiB)

    async def main() -> None:
        km = await start(setup, "agp")
        try:
            env = kernel_environ(kernel_pid(km))
            assert env["CUDA_VISIBLE_DEVICES"] == uuid_of(2)
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert env["AUTOGPU_PICKED"] == uuid_of(2)
            (lease,) = setup.live()
            assert env["AUTOGPU_LEASE_ID"] == lease.lease_id
            assert lease.device_uuids == (uuid_of(2),)
            assert lease.requested_bytes == 10 * GiB
            assert lease.kernel_id == km.kernel_id
            assert lease.pid == kernel_pid(km)  # the kernel's pid, not the server's
            assert "AUTOGPU_PICK_NOTE" not in env
            # The server holds no copy of the lease descriptor: only the kernel does.
            assert lease.path not in open_files(os.getpid())
            assert lease.path in open_files(kernel_pid(km))
            kc = km.client()
            kc.start_channels()
            try:
                await kc.wait_for_ready(timeout=60)
                reply = await kc.execute_interactive(
                    "import os\nfrom autogpu_jupyter.core import session\n"
                    "c = session.current()\n"
                    "print(os.environ['CUDA_VISIBLE_DEVICES'], c.source, c.uuids[0], c.lease_id)",
                    timeout=60, output_hook=lambda m: outs.append(m),
                )
                assert reply["content"]["status"] == "ok"
            finally:
                kc.stop_channels()
            text = "".join(m["content"].get("text", "") for m in outs)
            assert text.strip() == f"{uuid_of(2)} provisioner {uuid_of(2)} {lease.lease_id}"
        finally:
            await km.shutdown_kernel(now=True)
        assert setup.live() == []
        assert setup.files() == []  # the dead file is removed at cleanup

    outs: list[dict[str, Any]] = []
    asyncio.run(main())


def test_sixteen_concurrent_kernels_spread_evenly(setup: Setup) -> None:
    setup.install("agp", min_free="10G")

    async def main() -> dict[str, int]:
        kms = await asyncio.gather(*(start(setup, "agp") for _ in range(16)))
        try:
            counts: dict[str, int] = {}
            for km in kms:
                env = kernel_environ(kernel_pid(km))
                counts[env["CUDA_VISIBLE_DEVICES"]] = counts.get(env["CUDA_VISIBLE_DEVICES"], 0) + 1
            assert len(setup.live()) == 16
            return counts
        finally:
            await asyncio.gather(*(km.shutdown_kernel(now=True) for km in kms))

    counts = asyncio.run(main())
    assert counts == {uuid_of(i): 4 for i in range(4)}
    assert setup.live() == []


def test_exclusive_kernels_never_share_and_the_fifth_starts_cpu_only(setup: Setup) -> None:
    setup.install("agx", exclusive=True)

    async def main() -> None:
        kms = await asyncio.gather(*(start(setup, "agx") for _ in range(5)))
        try:
            envs = [kernel_environ(kernel_pid(km)) for km in kms]
            gpus = sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs if e["CUDA_VISIBLE_DEVICES"])
            assert gpus == [uuid_of(i) for i in range(4)]
            (cpu,) = [e for e in envs if e["CUDA_VISIBLE_DEVICES"] == ""]
            assert cpu["AUTOGPU_PICKED"] == ""
            assert cpu["AUTOGPU_PICK_NOTE"].startswith(
                "no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES=\"\") because "
            )
            assert "AUTOGPU_LEASE_ID" not in cpu
        finally:
            await asyncio.gather(*(km.shutdown_kernel(now=True) for km in kms))

    asyncio.run(main())


def test_hundred_restarts_leak_no_lease_and_stay_on_the_same_gpu(setup: Setup) -> None:
    setup.install("agp", min_free="10G")

    async def main() -> None:
        km = await start(setup, "agp")
        first = kernel_environ(kernel_pid(km))["CUDA_VISIBLE_DEVICES"]
        seen_pids = {kernel_pid(km)}
        try:
            for _ in range(100):
                await km.restart_kernel(now=True)
                pid = kernel_pid(km)
                seen_pids.add(pid)
                assert kernel_environ(pid)["CUDA_VISIBLE_DEVICES"] == first
                live = setup.live()
                assert [(r.pid, r.device_uuids) for r in live] == [(pid, (first,))]
            assert len(seen_pids) == 101
            assert len(setup.files()) == 1
        finally:
            await km.shutdown_kernel(now=True)
        assert setup.live() == []
        assert setup.files() == []

    asyncio.run(main())


def test_killing_the_kernel_frees_its_lease(setup: Setup) -> None:
    setup.install("agp", min_free="10G")

    async def main() -> None:
        km = await start(setup, "agp")
        try:
            pid = kernel_pid(km)
            assert [r.pid for r in setup.live()] == [pid]
            os.kill(pid, signal.SIGKILL)
            for _ in range(100):
                if await km.is_alive() is False:
                    break
                await asyncio.sleep(0.05)
            # No cleanup step ran (no shutdown, no restart): the flock died with the process.
            assert setup.live() == []
            assert [r.pid for r in setup.registry().scan().dead] == [pid]
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(main())


def test_pick_stays_inside_the_servers_grant(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    setup.install("agp")
    setup.fake.set(3, memory_used=70 * GiB)
    # The server (e.g. a Slurm job or a K8s pod) was granted GPUs 1 and 3 only.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuid_of(3)},{uuid_of(1)}")

    async def main() -> None:
        km = AsyncKernelManager(kernel_name="agp")
        env = setup.kernel_env()
        await km.start_kernel(env=env, cwd=str(setup.tmp))
        try:
            kenv = kernel_environ(kernel_pid(km))
            assert kenv["CUDA_VISIBLE_DEVICES"] == uuid_of(1)
            assert kenv["AUTOGPU_GRANT_CVD"] == f"{uuid_of(3)},{uuid_of(1)}"
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(main())


def test_wait_then_cpu_only_and_fail_give_the_reason(setup: Setup) -> None:
    setup.install("big-cpu", min_free="100G")
    setup.install("big-fail", min_free="100G", on_no_device="fail")

    async def main() -> None:
        km = await start(setup, "big-cpu")
        try:
            env = kernel_environ(kernel_pid(km))
            assert env["CUDA_VISIBLE_DEVICES"] == ""
            note = env["AUTOGPU_PICK_NOTE"]
            assert note.startswith("no device fits: kernel started CPU-only")
            assert "no device fits (min free 100.0 GiB)" in note
        finally:
            await km.shutdown_kernel(now=True)
        km2 = AsyncKernelManager(kernel_name="big-fail")
        with pytest.raises(NoDeviceFitsError) as info:
            await km2.start_kernel(env=setup.kernel_env(), cwd=str(setup.tmp))
        msg = str(info.value)
        assert msg.startswith("autogpu: kernel not started: no device fits (min free 100.0 GiB)")
        assert 'The kernelspec says on_no_device="fail"' in msg
        assert km2.provisioner is None or not km2.provisioner.has_process

    asyncio.run(main())


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"min_free": "ten"}, "min_free='ten': "),
        ({"max_util": "150"}, "max_util='150': "),
        ({"count": 0}, "count=0: invalid count 0: expected a whole number >= 1, e.g. 2"),
        ({"wait": "soon"}, "wait='soon': "),
        ({"on_no_device": "gpu"}, "on_no_device='gpu': expected \"cpu\" (start without a GPU) or "
                                  "\"fail\""),
        ({"min_fre": "10G"}, "min_fre='10G': unknown option; accepted: min_free, max_util, count, "
                             "exclusive, wait, model, prefer, devices, on_no_device"),
    ],
)
def test_bad_kernelspec_options_refuse_to_start_with_one_clear_line(
    setup: Setup, options: dict[str, Any], expected: str
) -> None:
    spec_dir = setup.prefix / "share/jupyter/kernels/bad"
    spec_dir.mkdir(parents=True)
    spec = kernelspec.spec_dict("Python 3 (bad)")
    spec["metadata"]["kernel_provisioner"]["config"] = options
    (spec_dir / "kernel.json").write_text(json.dumps(spec))

    async def main() -> str:
        km = AsyncKernelManager(kernel_name="bad")
        with pytest.raises(UsageErrorBase) as info:
            await km.start_kernel(env=setup.kernel_env(), cwd=str(setup.tmp))
        return str(info.value)

    msg = asyncio.run(main())
    assert msg.startswith("autogpu: kernelspec 'bad' has a bad option in "
                          "metadata.kernel_provisioner.config: ")
    assert expected in msg
    assert "\n" not in msg
    assert setup.live() == []


def test_move_to_a_named_gpu_and_to_the_best_at_restart(setup: Setup) -> None:
    setup.install("agp", min_free="10G")
    setup.fake.set(1, memory_used=30 * GiB)
    setup.fake.set(2, memory_used=20 * GiB)
    setup.fake.set(3, memory_used=10 * GiB)

    async def main() -> None:
        km = await start(setup, "agp")
        try:
            assert kernel_environ(kernel_pid(km))["CUDA_VISIBLE_DEVICES"] == uuid_of(0)
            prov = km.provisioner
            path = moves.move_file_for(setup.tmp / "runtime", km.kernel_id)
            assert prov.autogpu_move_file == str(path)
            assert kernel_environ(kernel_pid(km))["AUTOGPU_MOVE_FILE"] == str(path)
            plan = moves.request_move(
                path, "2", current_uuids=prov.autogpu_picked,
                constraints=prov.autogpu_constraints, kernel_id=km.kernel_id,
                store=setup.registry(),
            )
            assert plan.message.startswith(
                "The kernel will restart on GPU 2 (NVIDIA A100-SXM4-80GB, 60.0 GiB free), the "
                "requested device now. Restarting loses the kernel's state"
            )
            await km.restart_kernel(now=True)
            env = kernel_environ(kernel_pid(km))
            assert env["CUDA_VISIBLE_DEVICES"] == uuid_of(2)
            assert env["AUTOGPU_PICK_NOTE"] == "moved at your request: the kernel's state was lost"
            assert [r.device_uuids for r in setup.live()] == [(uuid_of(2),)]
            assert not path.exists()
            # --best: the best device other than the current one (GPU 0, idle).
            moves.request_move(
                path, "best", current_uuids=km.provisioner.autogpu_picked,
                constraints=km.provisioner.autogpu_constraints, store=setup.registry(),
            )
            await km.restart_kernel(now=True)
            assert kernel_environ(kernel_pid(km))["CUDA_VISIBLE_DEVICES"] == uuid_of(0)
            # A plain restart afterwards stays there (no request pending).
            await km.restart_kernel(now=True)
            assert kernel_environ(kernel_pid(km))["CUDA_VISIBLE_DEVICES"] == uuid_of(0)
            assert len(setup.live()) == 1
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(main())


def test_move_requests_that_cannot_work_say_why(setup: Setup) -> None:
    setup.install("agp", min_free="10G")
    setup.fake.set(3, memory_used=75 * GiB)
    from autogpu_jupyter.core.policy import Constraints

    cons = Constraints.parse(min_free="10G")
    path = setup.tmp / "runtime" / "autogpu-move-k1.json"
    with pytest.raises(UsageErrorBase, match=r"^GPU 3 does not fit this kernel's options "
                       r"\(min free 10\.0 GiB\): "):
        moves.request_move(path, "3", current_uuids=(uuid_of(0),), constraints=cons)
    with pytest.raises(UsageErrorBase, match=r"^the kernel already runs on GPU 0$"):
        moves.request_move(path, "0", current_uuids=(uuid_of(0),), constraints=cons)
    with pytest.raises(UsageErrorBase, match=r"^unknown device '9' for a move: expected an NVML "
                       r"index \(0, 1, 2, 3\), a \(unique\) UUID, or --best$"):
        moves.request_move(path, "9", current_uuids=(uuid_of(0),), constraints=cons)
    assert not path.exists()
    with pytest.raises(UsageErrorBase, match=r"^%gpu move needs a kernel started with the "
                       r"autogpu kernelspec"):
        moves.request_move_from_kernel("best", environ={})


def test_magic_side_of_a_move_from_the_kernel_environment(setup: Setup) -> None:
    """What ``%gpu move 1`` does in a provisioned kernel: plan within the grant, record."""
    setup.install("agp", min_free="10G")

    async def main() -> None:
        km = await start(setup, "agp")
        try:
            env = kernel_environ(kernel_pid(km))
            plan = moves.request_move_from_kernel("1", environ=env)
            assert plan.message.endswith(
                "Restart the kernel now (Kernel > Restart Kernel) to move; until then nothing "
                "changes."
            )
            req = moves.read_move(env["AUTOGPU_MOVE_FILE"])
            assert req is not None
            assert req.target_uuids == (uuid_of(1),)
            assert req.from_uuids == (env["AUTOGPU_PICKED"],)
            assert req.kernel_id == km.kernel_id
            assert req.source == "magic"
            await km.restart_kernel(now=True)
            assert kernel_environ(kernel_pid(km))["CUDA_VISIBLE_DEVICES"] == uuid_of(1)
        finally:
            await km.shutdown_kernel(now=True)
        assert not Path(env["AUTOGPU_MOVE_FILE"]).exists()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------
# What a notebook user sees: the server's REST reply when the kernel cannot start


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {}}}


async def test_bad_options_reach_the_notebook_and_the_server_log(
    fake_nvml: Any, jp_fetch: Any, jp_data_dir: Path, jp_serverapp: Any,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:
    from tornado.httpclient import HTTPClientError

    fake_nvml.write(fleet(2))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    spec_dir = jp_data_dir / "kernels" / "bad"
    spec_dir.mkdir(parents=True)
    spec = kernelspec.spec_dict("Python 3 (bad)")
    spec["metadata"]["kernel_provisioner"]["config"] = {"min_free": "lots"}
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    with pytest.raises(HTTPClientError) as info:
        # What JupyterLab does when a notebook opens with this kernel.
        await jp_fetch("api", "sessions", method="POST", body=json.dumps(
            {"path": "analysis.ipynb", "type": "notebook", "name": "", "kernel": {"name": "bad"}}
        ))
    assert info.value.code == 500
    reply = json.loads(info.value.response.body)
    # JupyterLab shows `message` in its "Error Starting Kernel" dialog.
    assert reply["message"].startswith(
        "autogpu: kernelspec 'bad' has a bad option in metadata.kernel_provisioner.config: "
        "min_free='lots': "
    )
    logged = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert any(m.startswith("autogpu: kernelspec 'bad' has a bad option") for m in logged)


def test_a_planted_name_in_the_registry_does_not_stop_a_kernel_start(setup: Setup) -> None:
    """Safety item 2: a directory named '¹' (isdigit() true, int() fails) made starting a
    "Python 3 (autogpu)" kernel fail; it starts and picks as usual."""
    setup.install("agp", min_free="10G")
    setup.registry().check()
    (setup.registry_dir / "¹").mkdir()
    (setup.registry_dir / "٣").mkdir()

    async def main() -> None:
        km = await start(setup, "agp")
        try:
            env = kernel_environ(kernel_pid(km))
            (lease,) = setup.live()
            assert env["AUTOGPU_PICKED"] == lease.device_uuids[0]
            assert env["CUDA_VISIBLE_DEVICES"] == lease.device_uuids[0]
        finally:
            await km.shutdown_kernel(now=True)
        assert setup.live() == []

    asyncio.run(main())
