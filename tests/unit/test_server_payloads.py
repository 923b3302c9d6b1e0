"""The server extension's answers that need no server: what a request does before the sampler's
first good sweep."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import ServerContext


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
    state = ServerContext(sampler=sampler)
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
    assert payloads.latest_snapshot(ServerContext(sampler=sampler)) is None
    assert payloads.latest_snapshot(ServerContext(sampler=None)) is None


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


def test_devices_before_any_sweep_says_no_sample_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler that has not swept yet and has failed nothing: the answer says why it lists no
    device. Caught (mutation run, issue 22): the sidebar's reason text altered."""
    monkeypatch.setattr(payloads, "FIRST_SAMPLE_WAIT_S", 0.05)
    sampler = Sampler(backend=_NoDriver())  # type: ignore[arg-type]
    answer = payloads.devices_payload(ServerContext(sampler=sampler, interval_s=2.0))
    assert {k: v for k, v in answer.items() if k != "timestamp_s"} == {
        "backend": None, "simulated": False, "driver_version": None,
        "errors": ["no sample yet"], "devices": [], "interval_s": 2.0,
    }


def test_an_idle_kernel_says_how_long_it_has_been_idle() -> None:
    """jupyter_server's ``last_activity`` gives ``idle_s`` of an idle kernel (rounded to 0.1 s,
    never negative); busy or unknown is no idle time. Caught (mutation run, issue 22): the
    ``last is None`` check inverted (no idle kernel ever had an idle time)."""
    from datetime import datetime, timezone

    last = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)
    now = last.timestamp() + 42.26
    idle = SimpleNamespace(execution_state="idle", last_activity=last)
    assert payloads.kernel_activity(idle, now_s=now) == ("idle", 42.3)
    assert payloads.kernel_activity(idle, now_s=last.timestamp() - 5) == ("idle", 0.0)
    busy = SimpleNamespace(execution_state="busy", last_activity=last)
    assert payloads.kernel_activity(busy, now_s=now) == ("busy", None)
    unknown = SimpleNamespace(execution_state="idle", last_activity=None)
    assert payloads.kernel_activity(unknown, now_s=now) == ("idle", None)
    assert payloads.kernel_activity(SimpleNamespace(), now_s=now) == (None, None)


def test_a_long_list_or_dict_is_named_by_its_type_from_twenty_items() -> None:
    """A message shows a body's value: 19 items as written, 20 or more by their type. Caught
    (mutation run, issue 22): the bound moved to 21 (a 20-item list written out, cut)."""
    assert payloads.short_repr(list(range(19))) == repr(list(range(19)))[:48] + "…" + repr(
        list(range(19)))[-10:]
    assert payloads.short_repr(list(range(20))) == "list"
    assert payloads.short_repr({str(i): i for i in range(20)}) == "dict"
    assert payloads.short_repr({str(i): i for i in range(19)}).startswith("{'0': 0, ")
    assert payloads.short_repr("x" * 20) == repr("x" * 20)


def test_a_request_waiting_for_the_first_sweep_answers_soon_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first sweep lands 50 ms after the request (on a fake clock): the answer follows
    within the 20 ms poll, not a second later. Caught (mutation run, issue 22, seed 52): the
    poll stretched to 1.02 s (every sidebar opened with the server waited up to a second more)."""
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    snap = object()
    sampler = SimpleNamespace(errors=[], latest=lambda: snap if clock[0] >= 0.05 else None)
    monkeypatch.setattr(payloads, "time", SimpleNamespace(monotonic=lambda: clock[0],
                                                          sleep=sleep))
    assert payloads.latest_snapshot(ServerContext(sampler=sampler)) is snap
    assert 0.05 <= clock[0] <= 0.07


class _OldKernels:
    """A kernel manager whose one kernel object has no ``provisioner`` attribute at all (an
    older jupyter_client)."""

    def list_kernel_ids(self) -> list[str]:
        return ["k-old"]

    def get_kernel(self, kid: str) -> Any:
        return SimpleNamespace(execution_state="busy", last_activity=None)


def test_a_kernel_without_a_provisioner_attribute_is_listed_not_movable() -> None:
    """Caught (issue 22, seed 53): the attribute read without a default (AttributeError, the
    holders answer fails for every kernel)."""
    (info,) = payloads.kernel_infos(_OldKernels(), {})
    assert (info["kernel_id"], info["execution_state"], info["movable"], info["picked_uuids"]) \
        == ("k-old", "busy", False, [])
