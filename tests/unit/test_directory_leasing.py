"""The lease registry in one process: files, modes, bookings, limits, refusals, pruning.

Real files and real ``flock``s; the devices come from a simulated fleet file (the registry never
reads NVML itself: bookings take the snapshot the picker read).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pwd
import stat
from pathlib import Path

import pytest

from autogpu_jupyter.core import decision
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.decision import bookings_for
from autogpu_jupyter.core.leasing import DirectoryStore, Requester
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import LeaseLimitError, LeaseStoreError, NoDeviceFitsError
from tests.leasehelpers import GiB, fleet, uuid_of


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(4)))
    return SimulatedBackend(str(path))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_pick_creates_registry_1777_user_dir_0755_and_a_held_lease_0644(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    reg_dir = tmp_path / "registry"
    registry = DirectoryStore(reg_dir, record_commands=True)  # the admin opted in (off by default)
    holder = Requester(kernel_id="5f1c2d3e-aaaa", notebook_path="work/train.ipynb",
                    command="python -m x", kind="kernel")
    result = pick(PickOptions(Constraints.parse(min_free="10G")), backend=backend, store=registry,
                  requester=holder)
    lease = result.lease
    assert lease is not None and result.lease_note is None
    uid = os.geteuid()
    assert _mode(reg_dir) == 0o1777
    assert _mode(reg_dir / str(uid)) == 0o755
    path = Path(lease.path)
    assert path.parent == reg_dir / str(uid)
    assert path.name == f"{lease.record.lease_id}.lease"
    assert _mode(path) == 0o644
    on_disk = json.loads(path.read_text())
    assert on_disk["device_uuids"] == [uuid_of(0)]
    assert on_disk["device_requested_bytes"] == [10 * GiB]
    assert on_disk["exclusive"] is False
    assert on_disk["pid"] == os.getpid()
    assert on_disk["uid"] == uid
    assert on_disk["kernel_id"] == "5f1c2d3e-aaaa"
    assert on_disk["notebook_path"] == "work/train.ipynb"
    assert on_disk["holder_kind"] == "kernel"

    (rec,) = registry.list_leases()
    assert rec.live and rec.lease_id == lease.record.lease_id
    assert rec.holder_text() == f"{registry.user}: work/train.ipynb"
    assert rec.to_dict(redact_command=True)["command"] is None
    assert rec.to_dict(redact_command=False)["command"] == "python -m x"

    lease.release()
    assert not path.exists()
    assert registry.list_leases() == []
    lease.release()  # idempotent


def test_bookings_hold_requested_memory_until_nvml_shows_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    spec = fleet(2)
    path.write_text(json.dumps(spec))
    backend = SimulatedBackend(str(path))
    registry = DirectoryStore(tmp_path / "registry")
    first = pick(PickOptions(Constraints.parse(min_free="30G")), backend=backend, store=registry)
    second = pick(PickOptions(Constraints.parse(min_free="30G", exclusive=False)), backend=backend,
                  store=registry)
    third = pick(PickOptions(Constraints.parse(min_free="30G")), backend=backend, store=registry)
    # 80 GiB each: 30 G booked on GPU 0 makes GPU 1 better, then GPU 0 again (50 >= 50, uuid).
    chosen = [r.chosen[0].uuid for r in (first, second, third)]
    assert chosen == [uuid_of(0), uuid_of(1), uuid_of(0)]
    snap = backend.snapshot()
    b = decision.gather(snap, store=registry).bookings
    assert (b[uuid_of(0)].lease_count, b[uuid_of(0)].booked_bytes) == (2, 60 * GiB)
    assert (b[uuid_of(1)].lease_count, b[uuid_of(1)].booked_bytes) == (1, 30 * GiB)

    # NVML now shows our process using 12 GiB on GPU 0: the real use counts, not the bookings.
    spec["devices"][0]["memory_used"] = 12 * GiB
    spec["devices"][0]["processes"] = [{"pid": os.getpid(), "used_memory": 12 * GiB}]
    path.write_text(json.dumps(spec))
    os.utime(path, ns=(1, 1))  # a new mtime for the backend to notice
    snap = backend.snapshot()
    b = bookings_for(snap.devices, registry.list_leases())
    assert (b[uuid_of(0)].lease_count, b[uuid_of(0)].booked_bytes) == (2, 0)
    assert b[uuid_of(1)].booked_bytes == 30 * GiB
    for r in (first, second, third):
        assert r.lease is not None
        r.lease.release()


def test_exclusive_lease_keeps_everyone_off(tmp_path: Path, backend: SimulatedBackend) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    exclusive = pick(
        PickOptions(Constraints(exclusive=True, exclude=("1", "2", "3"))),
        backend=backend,
        store=registry,
    )
    assert exclusive.chosen[0].uuid == uuid_of(0)
    with pytest.raises(NoDeviceFitsError) as err:
        pick(PickOptions(Constraints(exclude=("1", "2", "3"))), backend=backend, store=registry)
    assert str(err.value).splitlines()[1] == (
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: held exclusively by another lease"
    )
    # The transaction refuses it too, even when a caller skips the ranking.
    with registry.locked() as txn:
        assert txn is not None
        with pytest.raises(NoDeviceFitsError) as direct:
            txn.create(devices=[uuid_of(0)])
    assert str(direct.value) == (
        f"no device free: {uuid_of(0)} is held exclusively by {registry.user}: pid {os.getpid()}"
    )
    assert exclusive.lease is not None
    exclusive.lease.release()


def test_max_devices_per_user_refuses_past_the_limit(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    registry = DirectoryStore(tmp_path / "registry", max_devices_per_user=2)
    a = pick(PickOptions(Constraints()), backend=backend, store=registry)
    b = pick(PickOptions(Constraints()), backend=backend, store=registry)
    with pytest.raises(LeaseLimitError) as err:
        pick(PickOptions(Constraints()), backend=backend, store=registry)
    held = sorted(d.uuid for r in (a, b) for d in r.chosen)
    assert str(err.value) == (
        f"{registry.user} already holds leases on 2 device(s) ({', '.join(held)}); taking 1 more "
        "would exceed max_devices_per_user = 2 set by the admin. Release one first "
        "(%gpu release, or end the kernel / autogpu run holding it)."
    )
    assert a.lease is not None
    a.lease.release()
    c = pick(PickOptions(Constraints()), backend=backend, store=registry)
    assert c.lease is not None
    for r in (b, c):
        assert r.lease is not None
        r.lease.release()


def test_world_writable_registry_without_sticky_bit_is_refused_and_pick_goes_on(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    reg_dir = tmp_path / "registry"
    reg_dir.mkdir()
    os.chmod(reg_dir, 0o777)
    registry = DirectoryStore(reg_dir)
    result = pick(PickOptions(Constraints()), backend=backend, store=registry)
    assert result.lease is None
    assert [d.uuid for d in result.chosen] == [uuid_of(0)]
    assert result.lease_note == (
        f"lease registry {reg_dir} is writable by others without the sticky bit (mode 0777): "
        "any user could delete or replace other users' leases, so it is refused. "
        f"Fix: chmod 1777 {reg_dir}: picked without a lease"
    )
    assert list(reg_dir.iterdir()) == []  # nothing written into the unsafe directory
    with pytest.raises(LeaseStoreError):
        registry.list_leases()


def test_symlinked_or_foreign_registry_is_refused(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o1777)
    link = tmp_path / "registry"
    link.symlink_to(target)
    result = pick(PickOptions(Constraints()), backend=backend, store=DirectoryStore(link))
    assert result.lease is None
    assert result.lease_note == (
        f"lease registry {link} is a symlink: refused (another user could redirect leases "
        "elsewhere); the admin should make it a real directory, mode 1777: picked without a lease"
    )
    assert list(target.iterdir()) == []


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_a_registry_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    os.chmod(foreign, 0o1777)
    os.chown(foreign, 65534, 65534)
    with pytest.raises(LeaseStoreError) as err:
        DirectoryStore(foreign).check()
    assert str(err.value).startswith(
        f"lease registry {foreign} is owned by nobody (uid 65534), not by root or you"
    )


def test_unusable_registry_pick_works_without_a_lease(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    registry = DirectoryStore(blocker / "registry")
    result = pick(PickOptions(Constraints()), backend=backend, store=registry)
    assert result.lease is None
    assert result.chosen[0].uuid == uuid_of(0)
    assert result.lease_note == (
        f"cannot use lease registry {blocker}/registry: Not a directory; ask the admin to "
        f"create it (install -d -m 1777 -o root {blocker}/registry) or set AUTOGPU_REGISTRY_DIR / "
        "c.AutoGPU.registry_dir: picked without a lease"
    )


def test_registry_lock_held_too_long_means_no_lease(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    reg_dir = tmp_path / "registry"
    registry = DirectoryStore(reg_dir, lock_timeout_s=0.2)
    registry.check()
    fd = os.open(reg_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a stuck (or hostile) process holding the registry lock
    try:
        result = pick(PickOptions(Constraints()), backend=backend, store=registry)
    finally:
        os.close(fd)
    assert result.lease is None
    assert result.lease_note == (
        f"lease registry {reg_dir} stayed locked by another process for more than 0.2 s (the "
        f"admin can find the holder with `lslocks | grep {reg_dir}` and stop it): picked "
        "without a lease"
    )
    again = pick(PickOptions(Constraints()), backend=backend, store=registry)
    assert again.lease is not None and again.lease_note is None
    again.lease.release()


def test_prune_removes_only_dead_files(tmp_path: Path, backend: SimulatedBackend) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    live = pick(PickOptions(Constraints()), backend=backend, store=registry)
    dead = pick(PickOptions(Constraints()), backend=backend, store=registry)
    assert live.lease is not None and dead.lease is not None
    dead_path = dead.lease.path
    dead.lease.detach()  # its descriptor closed, its file left: as a SIGKILLed holder leaves it
    assert [r.lease_id for r in registry.scan().dead] == [dead.lease.record.lease_id]
    assert [r.path for r in registry.prune()] == [dead_path]
    assert not os.path.exists(dead_path)
    assert os.path.exists(live.lease.path)
    assert [r.lease_id for r in registry.list_leases()] == [live.lease.record.lease_id]
    assert registry.prune() == []
    live.lease.release()


def test_a_lease_held_by_this_process_is_live_to_its_own_scans(tmp_path: Path) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[uuid_of(3)], requested_bytes=[5 * GiB], exclusive=True)
    (rec,) = registry.list_leases()
    assert (rec.device_uuids, rec.requested_bytes, rec.exclusive, rec.live) == (
        (uuid_of(3),), 5 * GiB, True, True
    )
    # A forked child inherits the descriptor: the lease stays live while either runs, and the
    # child's release() only closes its copy (it must not remove the parent's lease).
    pid = os.fork()
    if pid == 0:
        lease.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert [r.live for r in registry.list_leases()] == [True]
    lease.release()
    assert registry.list_leases() == []


def test_set_pid_rewrites_the_holder_in_place_and_keeps_the_lock(tmp_path: Path) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[uuid_of(0)], requested_bytes=GiB)
    inode = os.stat(lease.path).st_ino
    lease.set_pid(424242)
    (rec,) = registry.list_leases()
    assert (rec.pid, rec.live, rec.lease_id) == (424242, True, lease.record.lease_id)
    assert os.stat(lease.path).st_ino == inode
    assert lease.record.pid == 424242
    # detach() hands the lease over: here nobody else holds the descriptor, so it ends.
    lease.detach()
    assert registry.list_leases() == []
    assert [r.pid for r in registry.scan().dead] == [424242]
    with pytest.raises(ValueError):
        lease.fileno()


def test_a_hiding_view_leaves_out_only_the_callers_own_leases(
    tmp_path: Path, backend: SimulatedBackend
) -> None:
    registry = DirectoryStore(tmp_path / "registry")
    first = pick(PickOptions(Constraints.parse(min_free="30G", exclusive=True)), backend=backend,
                 store=registry, requester=Requester(kernel_id="k-one"))
    second = pick(PickOptions(Constraints.parse(min_free="30G")), backend=backend, store=registry)
    assert first.lease is not None and second.lease is not None
    own = first.lease.record
    view = registry.hiding(lease_ids=[own.lease_id])
    assert [r.lease_id for r in view.list_leases()] == [second.lease.record.lease_id]
    assert [r.lease_id for r in registry.hiding(kernel_id="k-one").list_leases()] == [
        second.lease.record.lease_id
    ]
    snap = backend.snapshot()
    assert decision.gather(snap, store=view).bookings[own.device_uuids[0]].lease_count == 0
    # The exclusive lease no longer keeps this view's pick off its device...
    again = pick(PickOptions(Constraints.parse(min_free="30G", exclude="1,2,3")), backend=backend,
                 store=view)
    assert again.chosen[0].uuid == own.device_uuids[0]
    # ...but the registry itself still sees it, and nobody else's lease is ever hidden.
    with pytest.raises(NoDeviceFitsError):
        pick(PickOptions(Constraints.parse(exclude="1,2,3")), backend=backend, store=registry)
    other = dataclasses.replace(own, uid=own.uid + 1, lease_id="f" * 32)
    assert registry.hiding(lease_ids=["f" * 32], kernel_id="k-one")._visible([other]) == [other]
    for r in (first, second, again):
        assert r.lease is not None
        r.lease.release()


@pytest.mark.multiuser
@pytest.mark.skipif(os.geteuid() != 0, reason="writing a file owned by another uid needs root")
def test_a_record_not_owned_by_the_user_it_names_is_ignored(tmp_path: Path) -> None:
    # Root-owned, in nobody's directory, claiming to be nobody's, and held: still not a lease.
    registry = DirectoryStore(tmp_path / "registry")
    with registry.locked() as txn:
        assert txn is not None
        own = txn.create(devices=[uuid_of(0)], requested_bytes=GiB)
    claim = json.loads(Path(own.path).read_text())
    own.release()
    claim.update(uid=65534, user=pwd.getpwuid(65534).pw_name)
    user_dir = tmp_path / "registry" / "65534"
    user_dir.mkdir(mode=0o755)
    os.chown(user_dir, 65534, 65534)
    forged = user_dir / Path(own.path).name
    forged.write_text(json.dumps(claim))
    with open(forged, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert registry.list_leases() == []
        assert registry.scan().ignored == [
            (str(forged), "forged: owned by uid 0 in the directory of uid 65534")
        ]


def test_a_lease_whose_lock_cannot_be_tested_stays_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ENOLCK (lock table full, some network filesystems) says nothing about the holder: a lease
    # that cannot be tested is kept, never dropped or pruned as dead.
    registry = DirectoryStore(tmp_path / "registry")
    with registry.locked() as txn:
        assert txn is not None
        lease = txn.create(devices=[uuid_of(1)], requested_bytes=GiB)
    real_flock = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if op & fcntl.LOCK_NB and stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    assert [r.lease_id for r in registry.list_leases()] == [lease.record.lease_id]
    assert registry.prune() == []
    monkeypatch.undo()
    assert os.path.exists(lease.path)
    lease.release()
