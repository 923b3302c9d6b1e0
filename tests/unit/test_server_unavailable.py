"""The server extension when its sampler cannot run: the reason is logged once and answered,
never raised (``AutoGPUServer.sampler``, ``payloads.devices_payload``). Survivors of the sampled
mutation run (issue 22), each seen failing with its mutant planted by hand."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import pytest

from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import AutoGPUServer

#: What the sampler says of an unbounded history (``c.AutoGPUServer.history_s = inf``).
WHY = "invalid sampler history inf: expected a positive number of seconds, e.g. 900"


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> Iterator[AutoGPUServer]:
    monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
    sampler_mod.stop_sampler()
    server = AutoGPUServer(registry_dir="", history_s=math.inf, interval_s=2.0,
                           log=logging.getLogger("autogpu-test-server"))
    yield server
    server.stop()
    sampler_mod.stop_sampler()


def test_a_sampler_that_cannot_start_is_logged_with_its_reason(
    state: AutoGPUServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Caught: the warning's text dropped (a log line saying nothing)."""
    with caplog.at_level(logging.WARNING, logger="autogpu-test-server"):
        assert state.sampler() is None
    assert state.sampler_error == WHY
    assert [r.getMessage() for r in caplog.records] == [f"autogpu: sampler unavailable: {WHY}"]


def test_the_devices_answer_without_a_sample_says_why_and_lists_no_device(
    state: AutoGPUServer,
) -> None:
    """Caught: the "devices" key misspelt on this path (the sidebar reads it on every poll)."""
    state.start()
    answer = payloads.devices_payload(state.context())
    assert {k: v for k, v in answer.items() if k != "timestamp_s"} == {
        "backend": None, "simulated": False, "driver_version": None, "errors": [WHY],
        "devices": [], "interval_s": 2.0,
    }


@pytest.mark.parametrize(("given", "used"), [(math.inf, 1.0), (math.nan, 1.0), (0.01, 0.1),
                                             (-2.0, 0.1), (0.1, 0.1), (2.5, 2.5)])
def test_a_sampling_rate_the_sampler_cannot_keep_is_said_and_replaced(
    given: float, used: float, caplog: pytest.LogCaptureFixture
) -> None:
    """``c.AutoGPUServer.interval_s = inf`` made every devices answer a 500 (the rate is in
    the answer, and JSON has no infinity); below 0.1 s the answer named a rate the sampler did
    not use. Now: one warning naming the value and the accepted form, and the rate used."""
    with caplog.at_level(logging.WARNING, logger="autogpu-test-server"):
        server = AutoGPUServer(registry_dir="", interval_s=given,
                               log=logging.getLogger("autogpu-test-server"))
    assert server.interval_s == used
    if given == used:
        assert caplog.records == []
    else:
        assert [r.getMessage() for r in caplog.records] == [
            f"autogpu: c.AutoGPUServer.interval_s = {given!r} is not a number of seconds >= 0.1 "
            f"(e.g. 1.0): {used} s is used"
        ]
