"""The kernel provisioner's decisions in this process: ``jupyter_client``'s own
``AsyncKernelManager.pre_start_kernel`` finds the installed kernelspec's provisioner (through its
entry point) and runs its ``pre_launch``, which picks, takes the lease and returns the kernel's
environment, without starting a kernel. A simulated fleet and a real registry. Real kernels
started by the provisioner are ``tests/kernel/test_provisioner.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client import AsyncKernelManager

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leasing import DirectoryStore, LeaseRecord, Requester
from autogpu_jupyter.errors import LeaseStoreError, NoDeviceFitsError, UsageErrorBase
from tests.jupyterpaths import keep_kernelspecs_in
from tests.leasehelpers import forget_backends, lease_files
from tests.payloadhelpers import GiB, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"


def fleet_file(path: Path, used_a: int = 10, used_b: int = 40) -> Path:
    return write_fleet(path, [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB,
         "memory_used": used_a * GiB, "utilization_pct": 0},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB,
         "memory_used": used_b * GiB, "utilization_pct": 0},
    ])


class Host:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:

        self.tmp = tmp
        self.prefix = tmp / "prefix"
        self.fleet = fleet_file(tmp / "fleet.json")
        self.registry = DirectoryStore(str(tmp / "registry"))
        runtime = tmp / "runtime"
        runtime.mkdir(mode=0o700)
        monkeypatch.setenv("JUPYTER_PATH", str(self.prefix / "share" / "jupyter"))
        keep_kernelspecs_in(tmp, monkeypatch)
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp / "registry"))
        monkeypatch.setenv("AUTOGPU_SIMULATE", str(self.fleet))
        for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED",
                    "AUTOGPU_LEASE_ID", "AUTOGPU_MIN_FREE", "AUTOGPU_WAIT",
                    "AUTOGPU_BROKER_SOCKET"):
            monkeypatch.delenv(var, raising=False)
        forget_backends()
        self.managers: list[AsyncKernelManager] = []

    def install(self, name: str, **options: Any) -> None:
        kernelspec.install(name, f"Python 3 ({name})", options, prefix=str(self.prefix))

    def pre_start(self, name: str, km: AsyncKernelManager | None = None,
                  **env: str) -> tuple[AsyncKernelManager, dict[str, Any]]:
        """What the provisioner of kernelspec ``name`` would start the kernel with."""
        if km is None:
            km = AsyncKernelManager(kernel_name=name)
            self.managers.append(km)
        _cmd, kwargs = asyncio.run(km.pre_start_kernel(env={**os.environ, **env}))
        return km, kwargs

    def close(self) -> None:

        for km in self.managers:
            if km.provisioner is not None:
                asyncio.run(km.provisioner.cleanup(restart=False))
        forget_backends()


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Host]:
    h = Host(tmp_path, monkeypatch)
    yield h
    h.close()


def test_the_kernel_gets_the_picked_device_and_its_lease(host: Host) -> None:
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    env = kwargs["env"]
    (lease,) = host.registry.list_leases()
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"], env["AUTOGPU_PICKED"]) == (
        A, "PCI_BUS_ID", A)
    assert env["AUTOGPU_LEASE_ID"] == lease.lease_id and lease.device_uuids == (A,)
    assert int(env["AUTOGPU_LEASE_FD"]) in kwargs["pass_fds"]  # the kernel inherits the lock
    assert "AUTOGPU_GRANT_CVD" not in env  # the server had no grant
    assert env["AUTOGPU_GRANT_ROCM"] == "{}"  # nor any ROCm variable
    assert km.provisioner.autogpu_picked == (A,)
    assert lease.kernel_id == km.kernel_id and lease.requested_bytes == 10 * GiB


def test_nothing_fits_starts_the_kernel_cpu_only_with_no_gpu_visible(host: Host) -> None:
    """Fail closed: a CPU-only start hides every GPU (``CUDA_VISIBLE_DEVICES=""``), never leaves
    them all visible. Caught: the empty CUDA_VISIBLE_DEVICES dropped."""
    host.install("big", min_free="75G")
    km, kwargs = host.pre_start("big")
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_PICKED"]) == ("", "")
    # CUDA reads the (empty) list in PCI order like any pick's; HIP needs its own empty list
    assert (env["CUDA_DEVICE_ORDER"], env["ROCR_VISIBLE_DEVICES"]) == ("PCI_BUS_ID", "")
    assert env["AUTOGPU_PICK_NOTE"].startswith(
        'no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES="") because no device '
        "fits (min free 75.0 GiB)")
    assert "AUTOGPU_LEASE_ID" not in env and host.registry.list_leases() == []
    assert km.provisioner.autogpu_picked == ()


def test_on_no_device_fail_refuses_to_start(host: Host) -> None:
    """Caught: ``on_no_device`` read the wrong way round."""
    host.install("strict", min_free="75G", on_no_device="fail")
    with pytest.raises(NoDeviceFitsError) as info:
        host.pre_start("strict")
    assert str(info.value).startswith(
        "autogpu: kernel not started: no device fits (min free 75.0 GiB)")
    assert 'The kernelspec says on_no_device="fail"' in str(info.value)
    assert host.registry.list_leases() == []


def test_the_servers_grant_bounds_the_pick_and_is_passed_on(host: Host) -> None:
    """The server was started with CUDA_VISIBLE_DEVICES=B (a scheduler's grant): the kernel gets
    B though A is less loaded, and the grant is kept for the kernel's own checks."""
    host.install("agp", min_free="10G")
    _km, kwargs = host.pre_start("agp", CUDA_VISIBLE_DEVICES=B)
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_GRANT_CVD"]) == (B, B)


def test_the_servers_rocm_variables_are_recorded_for_a_move(host: Host) -> None:
    """An AMD host's grant (ROCR_VISIBLE_DEVICES, HIP_VISIBLE_DEVICES) is recorded as the
    server had it, so a %gpu move in the kernel plans within it (core.moves.grant_environ)."""
    host.install("agp", min_free="10G")
    _km, kwargs = host.pre_start("agp", ROCR_VISIBLE_DEVICES="0,1", HIP_VISIBLE_DEVICES="0,1")
    recorded = json.loads(kwargs["env"]["AUTOGPU_GRANT_ROCM"])
    assert recorded == {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "0,1"}


def test_a_restart_stays_on_its_device_while_it_fits(host: Host) -> None:
    """Caught: the restart's "same device" step skipped (a restart would hop to the now less
    loaded GPU, the kernel's memory elsewhere)."""
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    fleet_file(host.fleet, used_a=50, used_b=0)  # B is now the better one
    os.utime(host.fleet, ns=(1, 2 * 10**18))
    _km, kwargs = host.pre_start("agp", km=km)  # the same kernel manager: a restart
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    assert [r.device_uuids for r in host.registry.list_leases()] == [(A,)]
    fleet_file(host.fleet, used_a=75, used_b=0)  # A no longer fits: it moves
    os.utime(host.fleet, ns=(1, 3 * 10**18))
    _km, kwargs = host.pre_start("agp", km=km)
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == B
    assert [r.device_uuids for r in host.registry.list_leases()] == [(B,)]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"min_fre": "10G"}, "min_fre='10G': unknown option; accepted: "),
        ({"on_no_device": "maybe"},
         "on_no_device='maybe': expected \"cpu\" (start without a GPU) or \"fail\""),
        ({"min_free": "ten"}, "min_free='ten': invalid size 'ten'"),
        # the JSON names (not the CLI's --count), and JSON's own rule: a size is a string
        ({"count": 0}, "count=0: invalid count 0: expected a whole number >= 1, e.g. 2"),
        ({"min_free": 10}, "min_free=10: "),
    ],
)
def test_bad_kernelspec_options_name_the_option(config: dict[str, Any], message: str) -> None:
    """Caught: an unknown (misspelt) option silently ignored."""
    from autogpu_jupyter.provisioner import validate_options

    with pytest.raises(UsageErrorBase) as info:
        validate_options(config, spec="gpu-big")
    assert str(info.value).startswith(
        "autogpu: kernelspec 'gpu-big' has a bad option in metadata.kernel_provisioner.config: "
        + message)
    assert str(info.value).endswith(
        ". Fix it with `autogpu kernelspec install --name gpu-big [--min-free 10G] "
        "[--max-util 50] [--count 1] [--exclusive] [--wait 10m] [--on-no-device cpu|fail]`.")
    assert validate_options({"on_no_device": " FAIL "}).on_no_device == "fail"


def test_a_move_that_no_longer_fits_at_the_restart_is_said_and_picked_as_usual(
    host: Host,
) -> None:
    """A move to B is requested, then B fills up before the restart: the kernel is picked as
    usual and its note says why the move was not made, in full (the server's log and the
    kernel's ``%gpu`` show it). Caught: the note's wording lost (a survivor of the sampled
    mutation run)."""
    from autogpu_jupyter.core import moves

    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    prov = km.provisioner
    assert prov is not None and prov.autogpu_move_file
    moves.request_move(prov.autogpu_move_file, B, current_uuids=(A,),
                       constraints=prov.autogpu_constraints, kernel_id=km.kernel_id)
    fleet_file(host.fleet, used_a=10, used_b=75)  # B no longer fits 10 GiB
    os.utime(host.fleet, ns=(1, 2 * 10**18))
    _km, kwargs = host.pre_start("agp", km=km)
    env = kwargs["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == A
    assert env["AUTOGPU_PICK_NOTE"].startswith("the requested move could not be honoured (")
    assert env["AUTOGPU_PICK_NOTE"].endswith("); picked again as usual")
    assert "no device fits" in env["AUTOGPU_PICK_NOTE"]
    assert [r.device_uuids for r in host.registry.list_leases()] == [(A,)]


def _restarted(path: Path, used_a: int, used_b: int, at: int) -> None:
    """The fleet file as it reads at a restart (a new mtime: the backend reads it again)."""
    fleet_file(path, used_a=used_a, used_b=used_b)
    os.utime(path, ns=(1, at * 10**18))


def test_a_restart_kept_off_its_device_by_the_quota_is_picked_as_usual(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Quota of one device per user, and this user meanwhile holds B with another lease: staying
    on A would be a second device (refused), so the restart picks as usual and gets B, which
    the quota allows. Caught: the quota's refusal of the "same device" step not caught (the
    kernel then started CPU-only though B was free to take)."""
    monkeypatch.setenv("AUTOGPU_MAX_DEVICES_PER_USER", "1")
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    with host.registry.locked() as txn:
        assert txn is not None
        other = txn.create(devices=[B], requester=Requester(kernel_id="another-kernel"))
    try:
        _restarted(host.fleet, used_a=50, used_b=0, at=2)
        _km, kwargs = host.pre_start("agp", km=km)
        env = kwargs["env"]
        assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_PICKED"]) == (B, B)
        assert "AUTOGPU_PICK_NOTE" not in env
        assert sorted(r.kernel_id for r in host.registry.list_leases()
                      if r.device_uuids == (B,)) == sorted(["another-kernel", km.kernel_id])
    finally:
        other.release()


def test_a_restart_reads_the_devices_of_the_kernels_environment(
    host: Host, tmp_path: Path
) -> None:
    """The kernel's environment (``AUTOGPU_SIMULATE`` here) says which devices the kernel
    sees, for the restart's "same device" step as for a first pick, not the server's own
    variables. The server's fleet has A full; the kernel's has A still fitting, so the restart
    stays on A. Caught: the restart's pick made without the kernel's backend."""
    _restarted(host.fleet, used_a=79, used_b=0, at=1)
    kernels_fleet = fleet_file(tmp_path / "kernels-fleet.json")
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp", AUTOGPU_SIMULATE=str(kernels_fleet))
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    _restarted(kernels_fleet, used_a=50, used_b=0, at=2)  # B is now the better one
    _km, kwargs = host.pre_start("agp", km=km, AUTOGPU_SIMULATE=str(kernels_fleet))
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    assert [r.device_uuids for r in host.registry.list_leases()] == [(A,)]


def test_the_kernel_is_told_its_move_file_and_options(host: Host) -> None:
    """A move request for the kernel is written to ``autogpu-move-<kernel id>.json`` in the
    user's runtime directory, which the kernel's ``%gpu move`` is told; the options it picked
    with are the kernelspec's (its min_free as written). Caught: the move file's path lost
    ("None", a file in the server's working directory); the kernelspec's min_free replaced by
    the server's default."""
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    env = kwargs["env"]
    want = str(host.tmp / "runtime" / f"autogpu-move-{km.kernel_id}.json")
    assert (env["AUTOGPU_MOVE_FILE"], km.provisioner.autogpu_move_file) == (want, want)
    assert json.loads(env["AUTOGPU_PICK_OPTIONS"]) == {
        "min_free": "10G", "max_util": None, "count": 1, "exclusive": False}


def test_the_servers_log_says_which_kernel_gets_which_device(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """One info line per start: the kernel, the device(s) (label and UUID) or "no GPU", the
    constraints and the note. Caught: the kernel id, the devices or the "no GPU" wording lost."""
    from jupyter_client import AsyncKernelManager

    logger = logging.getLogger("autogpu-test-kernels")
    host.install("agp", min_free="10G")
    host.install("big", min_free="75G")
    kms = [AsyncKernelManager(kernel_name=name, log=logger) for name in ("agp", "big")]
    host.managers += kms
    with caplog.at_level(logging.INFO, logger="autogpu-test-kernels"):
        host.pre_start("agp", km=kms[0])
        _km, big = host.pre_start("big", km=kms[1])
    said = [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"
            and r.getMessage().startswith("autogpu: kernel ")]
    assert said == [
        f"autogpu: kernel {kms[0].kernel_id} gets GPU 0 {A} (min free 10.0 GiB)",
        f"autogpu: kernel {kms[1].kernel_id} gets no GPU (min free 75.0 GiB); "
        + big["env"]["AUTOGPU_PICK_NOTE"],
    ]


async def _launched(self: Any, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
    """A stand-in for jupyter_client's launch: kernel pid 4242, nothing started."""
    self.pid = 4242
    return {"launched": cmd}


def _server_descriptors_on(path: Path) -> list[str]:
    """This (the server's) process's descriptors open on ``path``: its copy of a lease."""
    fds = Path("/proc/self/fd")
    return [fd.name for fd in fds.iterdir()
            if os.path.realpath(fd) == os.path.realpath(path)]


def _lease_on_disk(host: Host) -> tuple[Path, dict[str, Any]]:
    """The one lease file in the host's registry, and the record in it."""
    (path,) = lease_files(host.tmp / "registry")
    return path, json.loads(path.read_text())


def test_a_pid_that_cannot_be_recorded_is_logged_and_the_lease_still_handed_over(
    host: Host, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel is launched (here: a stand-in for jupyter_client's launch), its lease is
    handed over all the same (the file stays, the server keeps no descriptor on it), and the
    warning says why the pid is not in the lease. Caught: the warning's reason dropped (a
    literal "%s").

    A reasoned seam: the lease's public ``set_pid`` is made to fail as a read-only file system
    makes it fail; as root no file mode can refuse the write."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from autogpu_jupyter.core.leasing.directory import Lease

    def read_only(self: Lease, pid: int) -> None:
        raise OSError(f"cannot record pid {pid}: read-only file system")

    monkeypatch.setattr(LocalProvisioner, "launch_kernel", _launched)
    monkeypatch.setattr(Lease, "set_pid", read_only)
    logger = logging.getLogger("autogpu-test-kernels")
    host.install("agp", min_free="10G")
    km = AsyncKernelManager(kernel_name="agp", log=logger)
    host.managers.append(km)
    host.pre_start("agp", km=km)
    path, before = _lease_on_disk(host)
    with caplog.at_level(logging.WARNING, logger="autogpu-test-kernels"):
        info = asyncio.run(km.provisioner.launch_kernel(["python"]))
    assert info == {"launched": ["python"]}
    assert _lease_on_disk(host) == (path, before) and _server_descriptors_on(path) == []
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"] == [
        "autogpu: could not record the kernel pid in its lease: cannot record pid 4242: "
        "read-only file system"]


def test_the_pick_is_kept_in_the_provisioners_persisted_info() -> None:
    """A server that restarts reloads its kernels' picks from the (JSON) provisioner info.
    Caught: the picked UUIDs not saved (a reloaded kernel forgot its devices)."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    prov = AutoGPUProvisioner(kernel_id="k-1")
    prov.autogpu_picked, prov.autogpu_lease_id = (A, B), "lease-1"
    info = json.loads(json.dumps(asyncio.run(prov.get_provisioner_info())))
    assert (info["autogpu_picked"], info["autogpu_lease_id"]) == ([A, B], "lease-1")
    again = AutoGPUProvisioner(kernel_id="k-1")
    asyncio.run(again.load_provisioner_info(info))
    assert (again.autogpu_picked, again.autogpu_lease_id) == ((A, B), "lease-1")


# ---- mutation run (issue 22, seed 52): what the provisioner says and records -------------------


def test_a_cpu_only_note_says_why_in_full_and_how_long_it_waited(host: Host) -> None:
    """Nothing fits: the note ends with the reason, plus how long the kernel waited only when
    the kernelspec asked it to wait. Caught: the "waited" part replaced by ``None`` (the note
    then ends "...GiB)None")."""
    host.install("big", min_free="75G")
    _km, kwargs = host.pre_start("big")
    assert kwargs["env"]["AUTOGPU_PICK_NOTE"] == (
        'no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES="") because no device '
        "fits (min free 75.0 GiB):\n"
        "  GPU 0 (NVIDIA A100): dropped: only 70.0 GiB free < 75.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 75.0 GiB wanted")


def test_a_waiting_kernels_progress_is_logged_with_its_kernel_id(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """While a kernel waits in line (here 0.05 s), each waiting line goes to the server's log
    after the kernel's id; the note then says how long it waited. Caught: the line dropped from
    the log call's arguments (a logging error instead of the message)."""
    host.install("big", min_free="75G", wait=0.05)
    with caplog.at_level(logging.INFO, logger="autogpu_jupyter.provisioner"):
        km, kwargs = host.pre_start("big")
    (said,) = [r.getMessage() for r in caplog.records if r.name == "autogpu_jupyter.provisioner"]
    # the time waited so far (0s, 0.0s or 0.1s) is the clock's
    assert said.startswith(f"kernel {km.kernel_id}: waiting for a device (min free 75.0 GiB), ")
    assert said.endswith(" of 0.1s; best now GPU 0: only 70.0 GiB free < 75.0 GiB wanted")
    assert kwargs["env"]["AUTOGPU_PICK_NOTE"].endswith(
        "GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 75.0 GiB wanted (waited 0.1s)")


def test_the_servers_autogpu_config_fills_what_the_kernelspec_leaves_out(host: Host) -> None:
    """``c.AutoGPU.min_free`` in the server's config (reaching the provisioner through its
    kernel manager) applies to a kernelspec without min_free. Caught: the options checked
    against the environment's defaults only (the server's config ignored)."""
    from traitlets.config import Config

    config = Config()
    config.AutoGPU.min_free = "75G"
    host.install("agp")
    km = AsyncKernelManager(kernel_name="agp", config=config)
    host.managers.append(km)
    _km, kwargs = host.pre_start("agp", km=km)
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert kwargs["env"]["AUTOGPU_PICK_NOTE"].startswith(
        'no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES="") because no device '
        "fits (min free 75.0 GiB)")


def test_a_bad_kernelspec_option_is_logged_as_the_error_it_raises(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """The server's log gets the refusal's own text. Caught: the log call's format replaced by
    ``None`` (a logging error instead of the message)."""
    logger = logging.getLogger("autogpu-test-kernels")
    host.install("bad", min_free="10G")
    spec_file = host.prefix / "share" / "jupyter" / "kernels" / "bad" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    spec["metadata"]["kernel_provisioner"]["config"]["min_free"] = "ten"  # edited by hand
    spec_file.write_text(json.dumps(spec))
    km = AsyncKernelManager(kernel_name="bad", log=logger)
    host.managers.append(km)
    with caplog.at_level(logging.ERROR, logger="autogpu-test-kernels"), \
            pytest.raises(UsageErrorBase) as info:
        host.pre_start("bad", km=km)
    said = [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"]
    assert said == [str(info.value)]
    assert str(info.value).startswith(
        "autogpu: kernelspec 'bad' has a bad option in metadata.kernel_provisioner.config: "
        "min_free='ten': invalid size 'ten'")


def test_the_kernels_lease_says_a_kernel_holds_it(host: Host) -> None:
    """The lease record's holder kind is "kernel" (``autogpu leases`` and the panel show who
    holds a device). Caught: the requester's kind left at its default ("process")."""
    host.install("agp", min_free="10G")
    km, _kwargs = host.pre_start("agp")
    (lease,) = host.registry.list_leases()
    assert (lease.holder_kind, lease.kernel_id) == ("kernel", km.kernel_id)


def test_a_move_outside_the_servers_grant_is_not_honoured(host: Host) -> None:
    """The server was granted A only (CUDA_VISIBLE_DEVICES, as the kernel's environment has
    it): a move request to B is refused and the kernel picked again within the grant. Caught:
    the move's pick made without the kernel's environment (B then taken, outside the grant)."""
    from autogpu_jupyter.core import moves

    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp", CUDA_VISIBLE_DEVICES=A)
    assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == A
    prov = km.provisioner
    assert prov is not None and prov.autogpu_move_file
    moves.request_move(prov.autogpu_move_file, B, current_uuids=(A,),
                       constraints=prov.autogpu_constraints, kernel_id=km.kernel_id)
    _km, kwargs = host.pre_start("agp", km=km, CUDA_VISIBLE_DEVICES=A)
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_PICKED"]) == (A, A)
    assert env["AUTOGPU_PICK_NOTE"].startswith("the requested move could not be honoured (")
    assert [r.device_uuids for r in host.registry.list_leases()] == [(A,)]


def _started_with_a_move_request(host: Host) -> tuple[AsyncKernelManager, Path]:
    """A kernel of kernelspec "agp" started on A, and a move request written for it."""
    from autogpu_jupyter.core import moves

    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    request = Path(kwargs["env"]["AUTOGPU_MOVE_FILE"])
    moves.request_move(str(request), B, current_uuids=(A,),
                       constraints=km.provisioner.autogpu_constraints, kernel_id=km.kernel_id)
    assert request.exists()
    return km, request


@pytest.mark.parametrize("error", [OSError(5, "Input/output error"),
                                   LeaseStoreError("the lease broker is unreachable")])
def test_a_prune_failing_does_not_stop_the_kernels_cleanup(
    host: Host, monkeypatch: pytest.MonkeyPatch, error: Exception
) -> None:
    """The dead-lease prune after a kernel ends is a courtesy: an OSError (the registry's disk
    gone) or the store's own error (a broker or registry unreachable) from it is swallowed and
    the cleanup goes on: the kernel's move request is cancelled, its lease file removed.
    Caught: OSError no longer suppressed; (issue 22, seed 53) only OSError suppressed (the
    kernel's cleanup then fails).

    A reasoned seam: the store's public ``prune`` is made to fail, as a failing disk or an
    unreachable broker makes it fail; no input to a healthy registry does."""
    km, request = _started_with_a_move_request(host)
    pruned: list[bool] = []

    def failing(self: DirectoryStore, all_users: bool = False) -> list[Any]:
        pruned.append(all_users)
        raise error

    monkeypatch.setattr(DirectoryStore, "prune", failing)
    asyncio.run(km.provisioner.cleanup(restart=False))
    assert pruned == [False]
    assert not request.exists() and list(lease_files(host.tmp / "registry")) == []


def test_a_runtime_dir_that_cannot_be_made_is_logged_and_moves_are_off(
    host: Host, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No move file, and the server's log says for which kernel and why. Caught (issue 22,
    seed 53): the warning's text altered."""
    blocker = host.tmp / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(blocker / "runtime"))
    host.install("agp", min_free="10G")
    km = AsyncKernelManager(kernel_name="agp", log=logging.getLogger("autogpu-test-kernels"))
    host.managers.append(km)
    with caplog.at_level(logging.WARNING, logger="autogpu-test-kernels"):
        _km, kwargs = host.pre_start("agp", km=km)
    assert "AUTOGPU_MOVE_FILE" not in kwargs["env"]
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [
        f"autogpu: moves unavailable for kernel {km.kernel_id}: [Errno 20] Not a directory: "
        f"'{blocker / 'runtime'}'"]


# ---- mutation run (issue 22, seed 54): restarts, cleanup, and what a start is told -----------


def test_a_provisioner_that_has_started_no_kernel_yet_has_no_note() -> None:
    """Before its first start (and reloaded from the persisted info by a restarted server) the
    provisioner exposes no pick, no note, no lease and no move file: ``None`` for "no message",
    as ``ProvisionerState`` types it, not an empty one. Caught (issue 22, seed 54): the note
    starting as ``""``."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    prov = AutoGPUProvisioner(kernel_id="k-1")
    assert (prov.autogpu_picked, prov.autogpu_constraints, prov.autogpu_note,
            prov.autogpu_lease_id, prov.autogpu_move_file) == ((), None, None, None, None)


class _NoDriver:
    """A backend on a host whose GPUs cannot be read (no driver loaded)."""

    def snapshot(self) -> Any:
        from autogpu_jupyter.errors import NVMLUnavailableError

        raise NVMLUnavailableError("no NVIDIA driver on this host (NVML: Driver Not Loaded)")


def test_a_host_whose_gpus_cannot_be_read_starts_the_kernel_with_its_environment_unchanged(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``on_no_device="cpu"`` (the default): the kernel starts as it would without autogpu (no
    GPU hidden: the pick could not even look), and its note says why. Caught (issue 22, seed
    54): the ``on_no_device`` test read the wrong way round (the kernel refused to start)."""
    from autogpu_jupyter import provisioner

    monkeypatch.setattr(provisioner, "get_backend", lambda _simulate: _NoDriver())
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    env = kwargs["env"]
    assert env["AUTOGPU_PICK_NOTE"] == (
        "no GPU pick: no NVIDIA driver on this host (NVML: Driver Not Loaded); kernel started "
        "with the environment unchanged")
    assert "CUDA_VISIBLE_DEVICES" not in env and "AUTOGPU_PICKED" not in env
    assert km.provisioner.autogpu_picked == () and host.registry.list_leases() == []


def test_a_host_whose_gpus_cannot_be_read_refuses_a_fail_kernelspecs_kernel_saying_why(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught (issue 22, seed 54): the refusal's message replaced by ``None``."""
    from autogpu_jupyter import provisioner
    from autogpu_jupyter.errors import NVMLUnavailableError

    monkeypatch.setattr(provisioner, "get_backend", lambda _simulate: _NoDriver())
    host.install("strict", min_free="10G", on_no_device="fail")
    with pytest.raises(NVMLUnavailableError) as info:
        host.pre_start("strict")
    assert str(info.value) == (
        "autogpu: kernel not started: no NVIDIA driver on this host (NVML: Driver Not Loaded)")


def test_a_kernels_cleanup_removes_its_users_dead_leases(host: Host) -> None:
    """After a kernel ends, the lease files of this user's gone holders are removed (the store
    the kernel's pick used is pruned). Caught (issue 22, seed 54): the pick's store not kept
    (the cleanup then pruned nothing)."""
    host.install("agp", min_free="10G")
    km, _kwargs = host.pre_start("agp")
    with host.registry.locked() as txn:
        assert txn is not None
        txn.create(devices=[B], requester=Requester(kernel_id="gone-kernel")).detach()
    assert [r.kernel_id for r in host.registry.scan().dead] == ["gone-kernel"]
    asyncio.run(km.provisioner.cleanup(restart=False))
    host.managers.remove(km)
    assert host.registry.scan().dead == [] and host.registry.list_leases() == []


M = "MIG-5c5c5c5c-1111-2222-3333-444444444444"
P = "GPU-2c2c2c2c-1111-2222-3333-444444444444"


def test_a_restart_stays_on_its_mig_device_though_another_gpu_became_better(
    host: Host
) -> None:
    """The kernel got the MIG device of GPU 0; at its restart GPU 1 is emptier, the MIG device
    still fits: the kernel stays there, its parent GPU not excluded with the other devices
    (that would exclude its MIG device too). Caught (issue 22, seed 54): the parent of a kept
    MIG device told apart by the devices not kept (the restart then hopped to GPU 1)."""

    def mig_fleet(used_b: int) -> None:
        write_fleet(host.fleet, [
            {"uuid": P, "name": "NVIDIA A100", "memory_total": 80 * GiB,
             "memory_used": 5 * GiB, "utilization_pct": 0,
             "mig_devices": [{"uuid": M, "profile": "3g.40gb", "memory_total": 40 * GiB,
                              "memory_used": 5 * GiB}]},
            {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB,
             "memory_used": used_b * GiB, "utilization_pct": 0},
        ])

    mig_fleet(used_b=70)
    os.utime(host.fleet, ns=(1, 10**18))
    host.install("agp", min_free="5G")
    km, kwargs = host.pre_start("agp")
    assert kwargs["env"]["AUTOGPU_PICKED"] == M
    mig_fleet(used_b=0)  # GPU 1 is now the better one
    os.utime(host.fleet, ns=(1, 2 * 10**18))
    _km, kwargs = host.pre_start("agp", km=km)
    assert kwargs["env"]["AUTOGPU_PICKED"] == M
    assert [r.device_uuids for r in host.registry.list_leases()] == [(M,)]


def test_a_bad_option_under_a_parent_that_is_no_kernel_manager_names_no_kernelspec() -> None:
    """A provisioner whose parent carries the configuration but no kernel name (not a kernel
    manager) still refuses a bad option in words, the kernelspec unnamed. Caught (issue 22,
    seed 54): the kernel name read with no default (an AttributeError instead)."""
    from traitlets.config import Configurable

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    prov = AutoGPUProvisioner(kernel_id="k-1", parent=Configurable(), min_fre="10G")
    with pytest.raises(UsageErrorBase) as info:
        asyncio.run(prov.pre_launch())
    assert str(info.value).startswith(
        "autogpu: the kernelspec has a bad option in metadata.kernel_provisioner.config: "
        "min_fre='10G': unknown option")
    assert "`autogpu kernelspec install --name NAME [--min-free 10G]" in str(info.value)


def test_a_pick_without_a_lease_says_why_in_its_note_alone(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry cannot be used: the kernel gets its device, and the note is the lease's
    note, nothing before it. Caught (issue 22, seed 54): the lease's note always appended to
    the pick's (``"None; cannot use lease registry ..."``)."""
    blocker = host.tmp / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(blocker / "registry"))
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_PICKED"]) == (A, A)
    assert "AUTOGPU_LEASE_ID" not in env
    assert env["AUTOGPU_PICK_NOTE"] == km.provisioner.autogpu_note == (
        f"cannot use lease registry {blocker}/registry: Not a directory; ask the admin to "
        f"create it (install -d -m 1777 -o root {blocker}/registry) or set "
        "AUTOGPU_REGISTRY_DIR / c.AutoGPU.registry_dir: picked without a lease")


def test_the_descriptors_the_caller_passes_to_the_kernel_are_kept_with_the_leases(
    host: Host
) -> None:
    """A caller that hands the kernel descriptors of its own (``pass_fds``, a Popen argument
    ``start_kernel`` passes on) still gets them passed, the lease's added. Caught (issue 22,
    seed 54): the caller's ``pass_fds`` read under another name (dropped)."""
    host.install("agp", min_free="10G")
    km = AsyncKernelManager(kernel_name="agp")
    host.managers.append(km)
    read_end, write_end = os.pipe()
    try:
        _cmd, kwargs = asyncio.run(
            km.pre_start_kernel(env=dict(os.environ), pass_fds=(read_end,)))
        assert kwargs["pass_fds"] == (read_end, int(kwargs["env"]["AUTOGPU_LEASE_FD"]))
    finally:
        os.close(read_end)
        os.close(write_end)


# ---- whole environments, refusals and leases around a launch ----
# The whole environment a kernel starts with (a pick, CPU-only), the whole refusal of a "fail"
# kernelspec, the runtime directory it makes, the arguments it keeps for itself, the lease around
# a launch, cleanup before a restart, and the option refusals. Found by the mutation run of
# issue 22.
def test_the_first_line_of_an_error_without_text_is_its_type() -> None:
    """The note of a move that could not be honoured quotes the first line of the error; an
    error with no text is named by its type. Caught: the text's first line taken even when
    there is none (an IndexError), and the type's name taken from None ("NoneType")."""
    from autogpu_jupyter.provisioner import _first_line

    assert _first_line(NoDeviceFitsError("")) == "NoDeviceFitsError"
    assert _first_line(NoDeviceFitsError("no device fits\n  GPU 0: busy")) == "no device fits"


def _started_with(env: dict[str, str]) -> dict[str, str]:
    """What the provisioner set or changed in the kernel's environment."""
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


def test_a_kernel_is_started_with_exactly_the_picks_variables(host: Host) -> None:
    """The whole of what a start adds to the kernel's environment, and nothing else: the pick
    (device order, devices, picked UUIDs), its lease and descriptor, the (empty) ROCm grant,
    that it was provisioned, its options and its move file; the notes and grant a server
    inherited from a kernel of its own are dropped. The provisioner's attributes say the same.
    Caught: any of those values altered or left out, an inherited note or grant passed on."""
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp", AUTOGPU_PICK_NOTE="stale", AUTOGPU_GRANT_CVD="0")
    (lease,) = host.registry.list_leases()
    fd = kwargs["pass_fds"][-1]
    move_file = str(host.tmp / "runtime" / f"autogpu-move-{km.kernel_id}.json")
    assert _started_with(kwargs["env"]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": A,
        "AUTOGPU_PICKED": A,
        "AUTOGPU_LEASE_ID": lease.lease_id,
        "AUTOGPU_LEASE_FD": str(fd),
        "AUTOGPU_GRANT_ROCM": "{}",
        "AUTOGPU_PROVISIONED": "1",
        "AUTOGPU_PICK_OPTIONS": '{"min_free": "10G", "max_util": null, "count": 1, '
                                '"exclusive": false}',
        "AUTOGPU_MOVE_FILE": move_file,
    }
    assert "AUTOGPU_PICK_NOTE" not in kwargs["env"] and "AUTOGPU_GRANT_CVD" not in kwargs["env"]
    assert kwargs["pass_fds"] == (fd,)
    prov = km.provisioner
    assert (prov.autogpu_picked, prov.autogpu_constraints.describe(), prov.autogpu_note,
            prov.autogpu_lease_id, prov.autogpu_move_file) == (
        (A,), "min free 10.0 GiB", None, lease.lease_id, move_file)


def test_a_cpu_only_kernel_is_started_with_exactly_the_hiding_variables(host: Host) -> None:
    """Nothing fits: the start adds every GPU hidden (empty CUDA and ROCr lists, in PCI order),
    no picked device, the note, and no lease; the provisioner keeps the note and no pick.
    Caught: a hiding variable or the note altered, a lease variable set without a lease."""
    host.install("big", min_free="75G")
    km, kwargs = host.pre_start("big")
    note = (
        'no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES="") because no device '
        "fits (min free 75.0 GiB):\n"
        "  GPU 0 (NVIDIA A100): dropped: only 70.0 GiB free < 75.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 75.0 GiB wanted"
    )
    assert _started_with(kwargs["env"]) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "",
        "ROCR_VISIBLE_DEVICES": "",
        "AUTOGPU_PICKED": "",
        "AUTOGPU_PICK_NOTE": note,
        "AUTOGPU_GRANT_ROCM": "{}",
        "AUTOGPU_PROVISIONED": "1",
        "AUTOGPU_PICK_OPTIONS": '{"min_free": "75G", "max_util": null, "count": 1, '
                                '"exclusive": false}',
        "AUTOGPU_MOVE_FILE": str(host.tmp / "runtime" / f"autogpu-move-{km.kernel_id}.json"),
    }
    assert "pass_fds" not in kwargs
    prov = km.provisioner
    assert (prov.autogpu_picked, prov.autogpu_note, prov.autogpu_lease_id) == ((), note, None)


def test_a_two_device_kernel_is_told_both_uuids_and_the_log_names_both_devices(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel is told its UUIDs joined by ","; the server's log line names both devices
    (label and UUID) joined by ", ". Caught: either joined by another separator."""
    logger = logging.getLogger("autogpu-test-kernels")
    host.install("two", count=2)
    km = AsyncKernelManager(kernel_name="two", log=logger)
    host.managers.append(km)
    with caplog.at_level(logging.INFO, logger="autogpu-test-kernels"):
        _km, kwargs = host.pre_start("two", km=km)
    assert kwargs["env"]["AUTOGPU_PICKED"] == f"{A},{B}"
    assert km.provisioner.autogpu_picked == (A, B)
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"] == [
        f"autogpu: kernel {km.kernel_id} gets GPU 0 {A}, GPU 1 {B} (2 devices)"]


def test_a_move_made_without_a_lease_says_both_in_its_note(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move to B is honoured while the registry cannot be used: the note says both, the
    move's first, joined by "; ". Caught: the pick's own note dropped when a lease note
    follows."""
    from autogpu_jupyter.core import moves

    host.install("agp", min_free="10G")
    km, _kwargs = host.pre_start("agp")
    prov = km.provisioner
    moves.request_move(prov.autogpu_move_file, B, current_uuids=(A,),
                       constraints=prov.autogpu_constraints, kernel_id=km.kernel_id)
    blocker = host.tmp / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(blocker / "registry"))
    _km, kwargs = host.pre_start("agp", km=km)
    assert kwargs["env"]["AUTOGPU_PICKED"] == B
    assert kwargs["env"]["AUTOGPU_PICK_NOTE"] == (
        "moved at your request: the kernel's state was lost; cannot use lease registry "
        f"{blocker}/registry: Not a directory; ask the admin to create it (install -d -m 1777 "
        f"-o root {blocker}/registry) or set AUTOGPU_REGISTRY_DIR / c.AutoGPU.registry_dir: "
        "picked without a lease"
    )


def test_a_refused_start_is_logged_as_the_error_it_raises(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing fits a "fail" kernelspec: the server's log gets the refusal's own text, once.
    Caught: the log call's argument or format changed (None, a bare "%s", other words)."""
    logger = logging.getLogger("autogpu-test-kernels")
    host.install("strict", min_free="75G", on_no_device="fail")
    km = AsyncKernelManager(kernel_name="strict", log=logger)
    host.managers.append(km)
    with caplog.at_level(logging.ERROR, logger="autogpu-test-kernels"), \
            pytest.raises(NoDeviceFitsError) as info:
        host.pre_start("strict", km=km)
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu-test-kernels"] == [
        str(info.value)]


def test_a_kernels_lease_names_the_notebook_of_the_kernels_session(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """jupyter_server names the notebook in the kernel's environment (``JPY_SESSION_NAME``),
    not in its own: the kernel's lease names it. Caught: the lease taken without a notebook,
    or with the server's own (none)."""
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("AUTOGPU_SERVER_ROOT", raising=False)
    host.install("agp", min_free="10G")
    host.pre_start("agp", JPY_SESSION_NAME="work/train.ipynb")
    (lease,) = host.registry.list_leases()
    assert lease.notebook_path == "work/train.ipynb"


def test_a_fail_kernelspec_refuses_with_the_whole_reason(host: Host) -> None:
    """``on_no_device="fail"`` and nothing fits: the refusal is the pick's reason in full, then
    what to do, and no "waited" part (the kernelspec did not wait). Caught: the message's words
    altered, or a "waited" part added without a wait."""
    host.install("strict", min_free="75G", on_no_device="fail")
    with pytest.raises(NoDeviceFitsError) as info:
        host.pre_start("strict")
    assert str(info.value) == (
        "autogpu: kernel not started: no device fits (min free 75.0 GiB):\n"
        "  GPU 0 (NVIDIA A100): dropped: only 70.0 GiB free < 75.0 GiB wanted\n"
        "  GPU 1 (NVIDIA A100): dropped: only 40.0 GiB free < 75.0 GiB wanted. The kernelspec "
        'says on_no_device="fail"; try again later, or use a kernelspec with other options.'
    )


def test_the_servers_min_free_is_the_one_the_kernel_is_told_when_the_kernelspec_has_none(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The options the kernel is told name the server's min_free where the kernelspec has none,
    and null where neither has one. Caught: the server's setting not read, or read the wrong
    way (null in place of it, or "" in place of null)."""
    host.install("agp")
    _km, kwargs = host.pre_start("agp")
    assert json.loads(kwargs["env"]["AUTOGPU_PICK_OPTIONS"])["min_free"] is None
    monkeypatch.setenv("AUTOGPU_MIN_FREE", "10G")
    _km, kwargs = host.pre_start("agp")
    assert json.loads(kwargs["env"]["AUTOGPU_PICK_OPTIONS"])["min_free"] == "10G"


def test_a_missing_runtime_directory_is_made_private(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's runtime directory, where move requests are written, is created mode 0700
    when it does not exist yet. Caught: it created with another mode."""
    runtime = host.tmp / "not-yet" / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    host.install("agp", min_free="10G")
    old = os.umask(0o022)
    try:
        km, kwargs = host.pre_start("agp")
    finally:
        os.umask(old)
    assert kwargs["env"]["AUTOGPU_MOVE_FILE"] == str(runtime / f"autogpu-move-{km.kernel_id}.json")
    assert runtime.stat().st_mode & 0o777 == 0o700


def test_a_kernel_without_a_move_file_is_still_given_its_device(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runtime directory cannot be made (a file is in the way): moves are off, no move
    request is looked for, and the kernel starts on its device all the same, told no move
    file. Caught: a move request looked for with no file (a TypeError stopping the start)."""
    blocker = host.tmp / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(blocker / "runtime"))
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["AUTOGPU_PICKED"]) == (A, A)
    assert "AUTOGPU_MOVE_FILE" not in env and km.provisioner.autogpu_move_file is None


def _pick_for_kernel(
    host: Host, previous: tuple[str, ...], config: dict[str, Any], environ: dict[str, str],
) -> tuple[list[str], LeaseRecord, str | None]:
    """What a restart of kernel k-1 (kernelspec options ``config``) that last had ``previous``
    is started with, in a kernel environment of the server's plus ``environ``: the devices it
    is told (``AUTOGPU_PICKED``), the lease it holds, and its note. Our copy of the lease is
    then given back (the kernel's cleanup)."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    host.install("restart", **config)
    km = AsyncKernelManager(kernel_name="restart")
    km.kernel_id = "k-1"
    km.provisioner = AutoGPUProvisioner(kernel_id="k-1", kernel_spec=km.kernel_spec, parent=km,
                                        **config)
    km.provisioner.autogpu_picked = previous
    _km, kwargs = host.pre_start("restart", km=km, **environ)
    env = kwargs["env"]
    (lease,) = host.registry.list_leases()
    asyncio.run(km.provisioner.cleanup(restart=False))
    return env["AUTOGPU_PICKED"].split(","), lease, env.get("AUTOGPU_PICK_NOTE")


C = "GPU-3c3c3c3c-1111-2222-3333-444444444444"


def test_a_restart_asking_fewer_devices_than_it_had_picks_as_usual(host: Host) -> None:
    """The kernel had A and B; its kernelspec now asks for one device: the restart does not
    stay within A and B, it takes the best of all (C, the emptiest). Caught: the "same
    devices" step taken whenever there was a previous pick, whatever the count."""
    fleet = write_fleet(host.tmp / "three.json", [
        {"uuid": u, "name": "NVIDIA A100", "memory_total": 80 * GiB,
         "memory_used": used * GiB, "utilization_pct": 0}
        for u, used in ((A, 40), (B, 40), (C, 0))
    ])
    picked, _lease, note = _pick_for_kernel(host, (A, B), {"count": 1},
                                            {"AUTOGPU_SIMULATE": str(fleet)})
    assert picked == [C] and note is None


def test_a_restart_stays_within_the_kernels_grant_and_leases_as_the_kernel(
    host: Host,
) -> None:
    """The kernel had B, but its environment now grants only A: the restart does not stay on
    B (outside the grant), it picks A; a restart that stays leases as the kernel. Caught: the
    "same devices" step made without the kernel's environment (B kept, outside the grant) or
    without the kernel as requester (a lease no kernel is named in)."""
    picked, _lease, note = _pick_for_kernel(host, (B,), {"min_free": "10G"},
                                            {"CUDA_VISIBLE_DEVICES": A})
    assert picked == [A] and note is None
    picked, lease, note = _pick_for_kernel(host, (B,), {"min_free": "10G"}, {})
    assert picked == [B] and note is None
    assert (lease.kernel_id, lease.holder_kind) == ("k-1", "kernel")


def test_an_honoured_move_picks_from_the_kernels_devices_and_says_so(host: Host) -> None:
    """A move to B is requested; the kernel's environment sees a fleet where B fits (the
    server's own has B full): the move is made, and the note says the kernel's state was lost.
    Caught: the move's pick made without the kernel's backend (the server's fleet read, the
    move refused)."""
    from autogpu_jupyter.core import moves
    from autogpu_jupyter.core.backends import get_backend
    from autogpu_jupyter.provisioner import validate_options

    servers = fleet_file(host.fleet, used_a=10, used_b=79)  # the server's: B full
    os.utime(servers, ns=(1, 2 * 10**18))
    kernels = fleet_file(host.tmp / "kernels-fleet.json")  # A 10 GiB used, B 40
    move_file = str(host.tmp / "runtime" / "autogpu-move-k-1.json")
    moves.request_move(move_file, B, current_uuids=(A,),
                       constraints=validate_options({"min_free": "10G"}).constraints,
                       kernel_id="k-1", backend=get_backend(str(kernels)))
    picked, _lease, note = _pick_for_kernel(host, (A,), {"min_free": "10G"},
                                            {"AUTOGPU_SIMULATE": str(kernels)})
    assert picked == [B]
    assert note == "moved at your request: the kernel's state was lost"


def test_the_provisioners_own_arguments_are_not_taken_for_kernelspec_options(
    host: Host,
) -> None:
    """What jupyter_client and traitlets pass a provisioner (kernel id, kernelspec, parent,
    config, log) are not kernelspec options; anything else is: the kernel starts with the
    kernelspec's min_free, and its lease names kernel k-1. Caught: one of those names misspelt
    (then refused as an unknown option, or lost for the provisioner)."""
    from traitlets.config import Config

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    log = logging.getLogger("autogpu-test-kernels")
    host.install("agp")
    km = AsyncKernelManager(kernel_name="agp")
    km.kernel_id = "k-1"
    km.provisioner = AutoGPUProvisioner(kernel_id="k-1", kernel_spec=km.kernel_spec, parent=km,
                                        config=Config(), log=log, min_free="10G")
    host.managers.append(km)
    _km, kwargs = host.pre_start("agp", km=km)
    assert json.loads(kwargs["env"]["AUTOGPU_PICK_OPTIONS"])["min_free"] == "10G"
    (lease,) = host.registry.list_leases()
    assert (lease.kernel_id, lease.requested_bytes) == ("k-1", 10 * GiB)
    assert km.provisioner.log is log


def test_a_launched_kernels_pid_is_recorded_and_our_copy_of_its_lease_detached(
    host: Host, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the launch the kernel's pid goes into its lease file, then our copy is detached:
    the file stays (never released: the kernel holds the lock) and the server keeps no
    descriptor on it. Caught: the pid not recorded, or the lease released."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    monkeypatch.setattr(LocalProvisioner, "launch_kernel", _launched)
    host.install("agp", min_free="10G")
    km, _kwargs = host.pre_start("agp")
    path, record = _lease_on_disk(host)
    assert record["pid"] == os.getpid() and _server_descriptors_on(path) != []
    assert asyncio.run(km.provisioner.launch_kernel(["python"])) == {"launched": ["python"]}
    assert _lease_on_disk(host) == (path, {**record, "pid": 4242})
    assert _server_descriptors_on(path) == []


def test_a_kernel_that_fails_to_launch_gives_its_lease_back(
    host: Host, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No kernel started: nobody will hold the lease, so it is released (its file removed),
    and the launch's error goes on. Caught: the lease only detached (left to be pruned)."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    async def failed(self: Any, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
        raise OSError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(LocalProvisioner, "launch_kernel", failed)
    host.install("agp", min_free="10G")
    km, _kwargs = host.pre_start("agp")
    path, _record = _lease_on_disk(host)
    with pytest.raises(OSError, match="No such file or directory"):
        asyncio.run(km.provisioner.launch_kernel(["no-such-python"]))
    assert list(lease_files(host.tmp / "registry")) == [] and _server_descriptors_on(path) == []


def test_a_second_start_lets_go_of_the_old_lease_without_removing_it(host: Host) -> None:
    """A restart's new start closes the provisioner's copy of the old lease but leaves its file
    (the old kernel, here a copy of the descriptor it inherited, still holds it: only its end
    frees it); the kernel's cleanup removes the lease it holds. Caught: the two ways swapped
    (the old kernel's lease removed under it, or the new one only detached)."""
    host.install("agp", min_free="10G")
    km, kwargs = host.pre_start("agp")
    old, _record = _lease_on_disk(host)
    kernels_copy = os.dup(int(kwargs["env"]["AUTOGPU_LEASE_FD"]))  # what pass_fds gives it
    try:
        host.pre_start("agp", km=km)
        files = list(lease_files(host.tmp / "registry"))
        assert old in files and len(files) == 2
        assert _server_descriptors_on(old) == [str(kernels_copy)]
        (new,) = [f for f in files if f != old]
        asyncio.run(km.provisioner.cleanup(restart=True))
        assert not new.exists() and old.exists()
    finally:
        os.close(kernels_copy)


def test_a_restarts_cleanup_keeps_the_move_request_and_a_shutdowns_cancels_it(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move request waits for the kernel's restart: the cleanup before a restart keeps it,
    the cleanup of a shutdown (the default) removes it; either way our copy of the lease is
    released (its file removed) and jupyter_client's own cleanup is told whether it is a
    restart. Caught: the restart flag read the wrong way round, on by default, or not passed
    on; the lease only detached."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    told: list[object] = []

    async def cleaned(self: Any, restart: bool = False) -> None:
        told.append(restart)

    monkeypatch.setattr(LocalProvisioner, "cleanup", cleaned)
    km, request = _started_with_a_move_request(host)
    path, _record = _lease_on_disk(host)
    asyncio.run(km.provisioner.cleanup(restart=True))
    assert request.exists() and not path.exists() and _server_descriptors_on(path) == []
    asyncio.run(km.provisioner.cleanup())
    assert not request.exists()
    assert told == [True, False]


def test_an_unknown_kernelspec_option_is_refused_with_every_accepted_name() -> None:
    """The refusal of an unknown option lists the accepted ones, joined by ", ". Caught: the
    list joined by another separator."""
    from autogpu_jupyter.provisioner import validate_options

    with pytest.raises(UsageErrorBase) as info:
        validate_options({"min_fre": "10G", "zz": 1}, spec="gpu-big")
    assert str(info.value) == (
        "autogpu: kernelspec 'gpu-big' has a bad option in metadata.kernel_provisioner.config: "
        "min_fre='10G': unknown option; accepted: min_free, max_util, count, exclusive, wait, "
        "model, prefer, devices, on_no_device. Fix it with `autogpu kernelspec install "
        "--name gpu-big "
        "[--min-free 10G] [--max-util 50] [--count 1] [--exclusive] [--wait 10m] "
        "[--on-no-device cpu|fail]`."
    )


def test_an_on_no_device_that_is_no_string_is_refused() -> None:
    """``on_no_device`` must be one of the two words; a number is refused as a bad option (not
    a crash). Caught: the type check joined to the word check by "and" (an AttributeError)."""
    from autogpu_jupyter.provisioner import validate_options

    with pytest.raises(UsageErrorBase) as info:
        validate_options({"on_no_device": 1})
    assert str(info.value).startswith(
        "autogpu: the kernelspec has a bad option in metadata.kernel_provisioner.config: "
        'on_no_device=1: expected "cpu" (start without a GPU) or "fail". Fix it with')


def test_a_kernelspec_may_name_its_devices_as_the_pick_does() -> None:
    """``"devices": "2"`` in a kernelspec's config (issue 41): the same option as ``%gpu pick
    2``, read the same way (the count follows the devices named); a bad one is named."""
    from autogpu_jupyter.provisioner import validate_options

    got = validate_options({"devices": "0,3"}).pick.constraints
    assert (got.devices, got.count) == (("0", "3"), 2)
    with pytest.raises(UsageErrorBase) as info:
        validate_options({"devices": ""}, spec="gpu-two")
    assert "devices='': invalid devices '': empty device id; expected device indices" in str(
        info.value)


def test_a_kernelspec_with_named_devices_and_index_ids(host: Host) -> None:
    """Issue 41: a kernelspec naming GPU 1 starts its kernel on B (A is the less loaded), and
    the server's ``c.AutoGPU.visible_ids = "index"`` writes ``1`` with PCI_BUS_ID, and is
    passed on so that the kernel's own picks write indices too."""
    from traitlets.config import Config

    host.install("one", devices="1")
    km = AsyncKernelManager(kernel_name="one",
                            config=Config({"AutoGPU": {"visible_ids": "index"}}))
    host.managers.append(km)
    _km, kwargs = host.pre_start("one", km=km)
    env = kwargs["env"]
    assert (env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"], env["AUTOGPU_PICKED"]) == (
        "1", "PCI_BUS_ID", B)
    assert env["AUTOGPU_VISIBLE_IDS"] == "index"
    assert [r.device_uuids for r in host.registry.list_leases()] == [(B,)]
