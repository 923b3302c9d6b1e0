"""core.session in detail: the choice a pick makes this process's, the variables it saves and
gives back, the leases it keeps or drops, and the provisioner's choice read from the environment.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from autogpu_jupyter.core import session
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.cudastate import (
    CudaState,
    hip_too_late_message,
)
from autogpu_jupyter.core.leasing import DirectoryStore
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import TooLateError
from tests.leasehelpers import fleet, uuid_of

ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(3)))
    return SimulatedBackend(str(path))


@pytest.fixture(autouse=True)
def no_choice(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No choice before or after each test, and no provisioner's choice in the environment."""
    for name in (session.PICKED_ENV, session.LEASE_ENV, "AUTOGPU_PICK_NOTE"):
        monkeypatch.delenv(name, raising=False)
    session.release(environ={})
    yield
    session.release(environ={})


def held(registry: DirectoryStore) -> list[tuple[str, ...]]:
    return [r.device_uuids for r in registry.list_leases()]


def test_a_choice_has_defaults_for_what_a_pick_did_not_say() -> None:
    before = time.time()
    c = session.Choice(uuids=("GPU-a",))
    after = time.time()
    assert (c.devices, c.lease, c.lease_id, c.source, c.constraints_text, c.constraints) == (
        (), None, None, "magic", "", None,
    )
    assert (c.forced, c.note) == (False, None)
    assert before <= c.picked_at_s <= after


def test_apply_makes_the_pick_this_process_s_choice(
    backend: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    result = pick(PickOptions(Constraints.parse(min_free="10G")), backend=backend, environ={},
                  store=registry)
    assert result.lease is not None
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "OTHER": "x"}
    choice = session.apply(result, source="api", forced=True, environ=env)
    assert env == {"CUDA_VISIBLE_DEVICES": uuid_of(0), "OTHER": "x", **ORDER}
    assert session.current() is choice
    assert choice.uuids == (uuid_of(0),)
    assert choice.devices == result.chosen
    assert choice.lease is result.lease
    assert choice.lease_id == result.lease.record.lease_id
    assert (choice.source, choice.forced, choice.note) == ("api", True, None)
    assert choice.constraints is result.constraints
    assert choice.constraints_text == "min free 10.0 GiB"
    assert session.original_environ(env) == {"CUDA_VISIBLE_DEVICES": "0,1", "OTHER": "x"}
    # release: the lease ends, the variables are as before (CUDA_DEVICE_ORDER was unset).
    assert session.release(environ=env) is choice
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "OTHER": "x"}
    assert held(registry) == []
    assert session.current() is None
    assert session.release(environ=env) is None
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "OTHER": "x"}


def test_apply_defaults_to_a_magic_s_unforced_choice_and_notes_a_lease_not_taken(
    backend: SimulatedBackend, tmp_path: Path
) -> None:
    broken = DirectoryStore(tmp_path / "missing" / "registry")
    result = pick(PickOptions(Constraints()), backend=backend, environ={}, store=broken)
    env: dict[str, str] = {}
    choice = session.apply(result, environ=env)
    assert (choice.source, choice.forced, choice.lease, choice.lease_id) == (
        "magic", False, None, None,
    )
    assert choice.note == result.lease_note
    assert choice.note is not None and choice.note.endswith(": picked without a lease")
    assert session.release(environ=env) is choice
    assert env == {}


def test_a_re_pick_drops_the_old_lease_and_keeps_the_first_saved_variables(
    backend: SimulatedBackend, registry_dir: Path
) -> None:
    registry = DirectoryStore(registry_dir)
    env = {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    first = pick(PickOptions(Constraints()), backend=backend, environ={}, store=registry)
    session.apply(first, environ=env)
    second = pick(
        PickOptions(Constraints.parse(exclude="0")), backend=backend, environ={}, store=registry
    )
    assert held(registry) == [(uuid_of(0),), (uuid_of(1),)]
    session.apply(second, environ=env)
    assert held(registry) == [(uuid_of(1),)]
    assert first.lease is not None and not first.lease.held
    assert env == {"CUDA_VISIBLE_DEVICES": uuid_of(1), **ORDER}
    # Applying the same result again keeps its lease.
    session.apply(second, environ=env)
    assert second.lease is not None and second.lease.held
    assert session.original_environ(env) == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    session.release(environ=env)
    assert env == {"CUDA_DEVICE_ORDER": "FASTEST_FIRST"}
    assert not second.lease.held
    assert held(registry) == []


def test_a_dry_run_result_changes_no_variable(backend: SimulatedBackend) -> None:
    result = pick(PickOptions(Constraints()), backend=backend, environ={}, dry_run=True)
    env = {"CUDA_VISIBLE_DEVICES": "2"}
    choice = session.apply(result, environ=env)
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}
    assert choice.uuids == (uuid_of(0),)
    # Nothing to give back: CUDA_DEVICE_ORDER was never set, and stays unset.
    assert session.release(environ=env) is choice
    assert env == {"CUDA_VISIBLE_DEVICES": "2"}


def test_without_an_environ_the_process_environment_is_changed_and_given_back(
    backend: SimulatedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    result = pick(PickOptions(Constraints()), backend=backend)
    assert [d.uuid for d in result.chosen] == [uuid_of(1)]
    session.apply(result)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == uuid_of(1)
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    original = session.original_environ()
    assert original["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "CUDA_DEVICE_ORDER" not in original
    session.release()
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "CUDA_DEVICE_ORDER" not in os.environ


def test_original_environ_is_a_copy_as_is_when_nothing_was_changed() -> None:
    env = {"CUDA_VISIBLE_DEVICES": "3", "X": "1"}
    copy = session.original_environ(env)
    assert copy == env
    copy["X"] = "2"
    assert env["X"] == "1"
    assert session.original_environ()["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize(
    ("picked", "lease", "note", "expected"),
    [
        ("GPU-a,,GPU-b", "abc123", "a note", (("GPU-a", "GPU-b"), "abc123", "a note")),
        ("GPU-a", "", "", (("GPU-a",), None, None)),
        (" GPU-a ", None, None, (("GPU-a",), None, None)),
    ],
)
def test_the_provisioner_s_choice_is_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, picked: str, lease: str | None, note: str | None,
    expected: tuple[tuple[str, ...], str | None, str | None],
) -> None:
    monkeypatch.setenv(session.PICKED_ENV, picked)
    if lease is not None:
        monkeypatch.setenv(session.LEASE_ENV, lease)
    if note is not None:
        monkeypatch.setenv("AUTOGPU_PICK_NOTE", note)
    choice = session.current()
    assert choice is not None
    assert (choice.uuids, choice.lease_id, choice.note) == expected
    assert (choice.source, choice.lease, choice.devices) == ("provisioner", None, ())


def test_no_choice_when_the_provisioner_picked_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert session.current() is None
    monkeypatch.setenv(session.PICKED_ENV, "  ")
    assert session.current() is None


def test_this_process_s_own_choice_comes_before_the_provisioner_s(
    backend: SimulatedBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(session.PICKED_ENV, "GPU-from-provisioner")
    result = pick(PickOptions(Constraints()), backend=backend, environ={})
    env: dict[str, str] = {}
    choice = session.apply(result, environ=env)
    assert session.current() is choice
    session.release(environ=env)
    provisioner = session.current()
    assert provisioner is not None and provisioner.uuids == ("GPU-from-provisioner",)


# ---- the HIP too-late refusal (found by the mutation run of issue 22) ----
def test_a_pick_after_hip_started_is_refused_with_the_hip_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rocm = CudaState(True, "this process holds /dev/kfd open", "torch")
    monkeypatch.setattr(session, "cuda_state", lambda: CudaState(False, "no libcuda"))
    monkeypatch.setattr(session, "hip_state", lambda: rocm)
    message = hip_too_late_message(rocm)
    assert message.startswith("HIP (ROCm) is already initialised in this kernel, probably by "
                              "torch (this process holds /dev/kfd open). ")
    with pytest.raises(TooLateError) as info:
        session.check_not_too_late(force=False)
    assert str(info.value) == message
    assert session.check_not_too_late(force=True) == "--force: " + message
