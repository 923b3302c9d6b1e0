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
from autogpu_jupyter.core.leasing import Registry, Requester
from autogpu_jupyter.errors import NoDeviceFitsError, UsageErrorBase
from tests.jupyterpaths import keep_kernelspecs_in
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
        from autogpu_jupyter.core import backends

        self.tmp = tmp
        self.prefix = tmp / "prefix"
        self.fleet = fleet_file(tmp / "fleet.json")
        self.registry = Registry(str(tmp / "registry"))
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
        backends._cache.clear()
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
        from autogpu_jupyter.core import backends

        for km in self.managers:
            if km.provisioner is not None:
                asyncio.run(km.provisioner.cleanup(restart=False))
        backends._cache.clear()


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


class _Lease:
    """A lease whose pid cannot be recorded (its file unwritable)."""

    def __init__(self) -> None:
        self.detached = False

    def set_pid(self, pid: int) -> None:
        raise OSError(f"cannot record pid {pid}: read-only file system")

    def detach(self) -> None:
        self.detached = True


def test_a_pid_that_cannot_be_recorded_is_logged_and_the_lease_still_handed_over(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel is launched (here: a stand-in for jupyter_client's launch), its lease is
    handed over all the same (our copy detached), and the warning says why the pid is not in
    the lease. Caught: the warning's reason dropped (a literal "%s")."""
    from jupyter_client.provisioning.local_provisioner import LocalProvisioner

    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    async def launched(self: Any, cmd: list[str], **kwargs: Any) -> dict[str, Any]:
        self.pid = 4242
        return {"launched": cmd}

    monkeypatch.setattr(LocalProvisioner, "launch_kernel", launched)
    prov = AutoGPUProvisioner(kernel_id="k-1", log=logging.getLogger("autogpu-test-kernels"))
    lease = _Lease()
    prov._lease = lease  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, logger="autogpu-test-kernels"):
        info = asyncio.run(prov.launch_kernel(["python"]))
    assert info == {"launched": ["python"]} and lease.detached and prov._lease is None
    assert [r.getMessage() for r in caplog.records] == [
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


class _Store:
    """A lease store whose prune fails as a file system can (the registry's disk gone)."""

    def __init__(self) -> None:
        self.pruned = 0

    def prune(self) -> list[Any]:
        self.pruned += 1
        raise OSError(5, "Input/output error")


def test_a_prune_failing_with_an_os_error_does_not_stop_the_kernels_cleanup() -> None:
    """The dead-lease prune after a kernel ends is a courtesy: an OSError from it is swallowed
    and the cleanup goes on (the move request is cancelled). Caught: OSError no longer
    suppressed (the kernel's cleanup then fails)."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    prov = AutoGPUProvisioner(kernel_id="k-1")
    store = _Store()
    prov._store = store  # type: ignore[assignment]
    asyncio.run(prov.cleanup(restart=False))
    assert store.pruned == 1


class _UnreachableStore:
    """A lease store whose prune fails as a broker or registry can (an AutoGPUError)."""

    def __init__(self) -> None:
        self.pruned = 0

    def prune(self) -> list[Any]:
        from autogpu_jupyter.errors import RegistryError

        self.pruned += 1
        raise RegistryError("the lease broker is unreachable")


def test_a_prune_failing_with_a_registry_error_does_not_stop_the_kernels_cleanup() -> None:
    """As for an OSError: the store's own error is swallowed and the cleanup goes on. Caught
    (issue 22, seed 53): only OSError suppressed (the kernel's cleanup then fails)."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    prov = AutoGPUProvisioner(kernel_id="k-1")
    store = _UnreachableStore()
    prov._store = store  # type: ignore[assignment]
    asyncio.run(prov.cleanup(restart=False))
    assert store.pruned == 1


def test_a_runtime_dir_that_cannot_be_made_is_logged_and_moves_are_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No move file, and the server's log says for which kernel and why. Caught (issue 22,
    seed 53): the warning's text altered."""
    from autogpu_jupyter.provisioner import AutoGPUProvisioner

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(blocker / "runtime"))
    prov = AutoGPUProvisioner(kernel_id="k-1", log=logging.getLogger("autogpu-test-kernels"))
    with caplog.at_level(logging.WARNING, logger="autogpu-test-kernels"):
        assert prov._move_file() is None
    (said,) = [r.getMessage() for r in caplog.records]
    assert said == (
        f"autogpu: moves unavailable for kernel k-1: [Errno 20] Not a directory: "
        f"'{blocker / 'runtime'}'")


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
