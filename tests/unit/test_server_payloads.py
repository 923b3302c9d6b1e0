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
