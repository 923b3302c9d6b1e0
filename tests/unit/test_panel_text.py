"""The panel's text form (issue 41): what a viewer without widgets shows for ``%gpu panel`` (a
headless run, a terminal, a notebook viewer) is a short table of the GPUs with this kernel's
marked, not the widget's repr (``Panel(children=(HTML(value='<div…``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.overload import Thresholds
from autogpu_jupyter.core.sampler import Sampler
from autogpu_jupyter.widgets.panel import Panel

GiB = 1024**3
A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def _fleet(util_a: float) -> dict[str, Any]:
    return {
        "devices": [
            {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB,
             "utilization_pct": util_a, "memory_used": 60 * GiB,
             "processes": [{"pid": 4242, "user": "bob", "used_memory": 60 * GiB}]},
            {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "utilization_pct": 2},
        ]
    }


NOW = [1_000_000.0]


@pytest.fixture
def panel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Panel]:
    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", A)  # this kernel's GPU: GPU 0
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_fleet(97)))
    NOW[0] = 1_000_000.0
    s = Sampler(SimulatedBackend(str(path), clock=lambda: NOW[0]), history_s=900.0,
                clock=lambda: NOW[0])
    p = Panel(window_s=60, sampler=s, thresholds=Thresholds(90, 2, 95))
    try:
        yield p
    finally:
        p.close()


def test_the_panels_text_plain_is_a_table_with_this_kernels_gpu_marked(panel: Panel) -> None:
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # still the live widget
    text = bundle["text/plain"]
    assert "Panel(" not in text and "<div" not in text
    lines = text.splitlines()
    assert lines[0].startswith("autogpu panel: 2 device(s) — SIMULATED fleet, sampled ")
    assert lines[1:] == [
        "   gpu    name         util  memory used / total      free   temp  procs  holders",
        "▶  GPU 0  NVIDIA A100   97%  60.0 GiB / 80.0 GiB  20.0 GiB  76 °C      1  bob: pid 4242",
        "                                                                          (60.0 GiB used)",
        "   GPU 1  NVIDIA A100    2%       0 B / 80.0 GiB  80.0 GiB  33 °C      0  nobody",
        "this kernel: ▶ GPU 0",
    ]
    assert repr(panel) == text  # what a terminal prints for the object


def test_the_text_form_ends_with_the_overload_warning_of_this_kernels_gpu(panel: Panel) -> None:
    for _ in range(2):  # 97% for 2 s: over the 90% threshold
        NOW[0] += 1
        panel.sampler.sample_now()
    assert panel.warnings
    assert panel.text().splitlines()[-1].startswith(
        "autogpu: GPU 0 (this kernel's GPU) is overloaded: utilisation 97% for 2s (over 90%)")


def test_the_text_form_without_a_sample_says_why(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text("{not json")
    s = Sampler(SimulatedBackend(str(path)), history_s=60.0)
    p = Panel(window_s=60, sampler=s, server_history=False)
    try:
        assert p.text().startswith("autogpu panel: no GPU data (")
        assert p._repr_mimebundle_()["text/plain"] == p.text()
    finally:
        p.close()
