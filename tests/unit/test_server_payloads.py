"""The server extension's answers that need no server: what a request does before the sampler's
first good sweep."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.server import payloads


class _NoDriver:
    name = "nvml"
    simulated = False

    def snapshot(self) -> Any:
        from autogpu_jupyter.errors import NVMLUnavailableError

        raise NVMLUnavailableError("no NVIDIA driver on this host")


def test_a_failed_first_sweep_is_answered_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver: the request does not wait for a first sample that will never come (it held the
    executor thread, which a stopping server joins), it answers with the reason."""
    sampler = Sampler(backend=_NoDriver())  # type: ignore[arg-type]
    sampler.sample_now()
    assert sampler.latest() is None and sampler.errors
    monkeypatch.setattr(payloads, "FIRST_SAMPLE_WAIT_S", 3600.0)
    state = SimpleNamespace(sampler=lambda: sampler)
    done: list[Any] = []
    worker = threading.Thread(
        target=lambda: done.append(payloads.latest_snapshot(state)), daemon=True
    )
    worker.start()
    worker.join(60)  # an hour, had it waited
    assert done == [None]


def test_a_sampler_that_has_not_swept_yet_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payloads, "FIRST_SAMPLE_WAIT_S", 0.2)
    sampler = Sampler(backend=_NoDriver())  # type: ignore[arg-type]
    assert payloads.latest_snapshot(SimpleNamespace(sampler=lambda: sampler)) is None
    assert payloads.latest_snapshot(SimpleNamespace(sampler=lambda: None)) is None


def test_a_kernel_may_be_offered_only_the_devices_its_environment_allows() -> None:
    """The sidebar's Pick buttons: the devices of a kernel's starting allocation, its grant for
    an autogpu kernel. Caught: every device of the host offered (a pick outside the kernel's
    CUDA_VISIBLE_DEVICES would fail, or worse, widen what a scheduler granted)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend

    snap = SimulatedBackend("demo-4x").snapshot()
    uuids = [d.uuid for d in snap.devices]
    assert payloads.kernel_allowed_uuids(snap, {}) == uuids
    assert payloads.kernel_allowed_uuids(
        snap, {"CUDA_VISIBLE_DEVICES": f"{uuids[2]},{uuids[0]}"}) == [uuids[0], uuids[2]]
    # an autogpu kernel on GPU 2 picked within the server's grant of GPUs 1 and 2
    assert payloads.kernel_allowed_uuids(snap, {
        "AUTOGPU_PROVISIONED": "1", "CUDA_VISIBLE_DEVICES": uuids[2],
        "AUTOGPU_GRANT_CVD": f"{uuids[1]},{uuids[2]}"}) == [uuids[1], uuids[2]]
    assert payloads.kernel_allowed_uuids(snap, None) is None  # unknown: the server's grant
    assert payloads.kernel_allowed_uuids(None, {}) is None
