"""``%gpu pick``'s summary (``magics.format_pick``) for the cases a plain pick does not reach: a
kernel that kept the device the kernelspec gave it, and a re-pick. Each line checked whole."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import PickResult, pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.magics import format_pick
from tests.leasehelpers import fleet, uuid_of


@pytest.fixture
def result(tmp_path: Path) -> PickResult:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(2)))
    return pick(PickOptions(Constraints.parse(min_free="10G")), backend=SimulatedBackend(str(path)),
                environ={}, dry_run=True)


def test_a_kept_device_says_so_and_nothing_else(result: PickResult) -> None:
    """Caught: the kept summary's lines joined with something else than newlines."""
    kept = dataclasses.replace(result, kept=True, env={"CUDA_VISIBLE_DEVICES": uuid_of(0)})
    lines = format_pick(kept).split("\n")
    assert len(lines) == 3
    assert lines[0] == (
        "autogpu [SIMULATED]: kept GPU 0 · NVIDIA A100-SXM4-80GB · GPU-00000000: 80.0 GiB free of "
        "80.0 GiB, util 0%"
    )
    assert lines[1] == (
        "  this kernel was started on it by the autogpu kernelspec and already holds its lease; "
        "it meets min free 10.0 GiB, so nothing changed (no second lease)"
    )
    assert lines[2] == f"  CUDA_VISIBLE_DEVICES={uuid_of(0)}"


def test_a_repick_says_what_the_kernel_had(result: PickResult) -> None:
    """Caught: the previous device's line printed when there was none (or never)."""
    assert not [ln for ln in format_pick(result).splitlines() if "you had" in ln]
    moved = format_pick(dataclasses.replace(result, previous="GPU 1")).splitlines()
    assert "  you had GPU 1; now GPU 0 (one lease: the old one was released)" in moved
    same = format_pick(dataclasses.replace(result, previous="GPU 0")).splitlines()
    assert "  you had GPU 0 already: kept it, with a new lease for these options" in same
