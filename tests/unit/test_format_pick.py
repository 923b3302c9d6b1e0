"""``%gpu pick``'s summary (``magics.format_pick``) for the cases a plain pick does not reach: a
kernel that kept the device the kernelspec gave it, and a re-pick; and ``--dry-run``'s ranking
(``magics.format_ranking``). Each line checked whole."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import PickResult, pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.magics import format_pick, format_ranking
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


def test_the_dry_run_ranking_is_an_aligned_table_with_the_dropped_devices_unranked(
    tmp_path: Path,
) -> None:
    """Each line whole: the free memory right-aligned, a dropped device without rank or load.
    Caught: the free column left-aligned, and a dropped device given a rank or a load figure."""
    data = fleet(3)
    data["devices"][1]["memory_used"] = 75 * 1024**3
    data["devices"][2].update(memory_used=50 * 1024**3, utilization_pct=40)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(data))
    result = pick(PickOptions(Constraints.parse(min_free="10G")),
                  backend=SimulatedBackend(str(path)), environ={}, dry_run=True)
    assert format_ranking(result).splitlines() == [
        "autogpu [SIMULATED] dry run (min free 10.0 GiB): nothing changed",
        "  rank  device  name                       free  util  load     leases  verdict",
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0  would pick: "
        "80.0 GiB free >= 10.0 GiB wanted",
        "  2     GPU 2   NVIDIA A100-SXM4-80GB  30.0 GiB   40%  62% mem       0  fits: "
        "30.0 GiB free >= 10.0 GiB wanted",
        "  -     GPU 1   NVIDIA A100-SXM4-80GB   5.0 GiB    0%  -             0  dropped: only "
        "5.0 GiB free < 10.0 GiB wanted",
        "  why GPU 0 over GPU 2: lower load (0% util vs 62% mem)",
    ]


def test_a_ranking_that_chose_nothing_says_a_real_pick_would_fail(result: PickResult) -> None:
    """``format_ranking`` of a result without a chosen device (the picker raises instead, so
    only a direct caller hands it one) ends with why. Caught: that line lost (a TypeError)."""
    lines = format_ranking(dataclasses.replace(result, chosen=())).splitlines()
    assert lines[-1] == (
        "  no device fits: a real pick would fail now (--wait DURATION waits in line)"
    )
    assert not [ln for ln in lines if ln.startswith("  why ")]


def test_a_pick_that_asked_nothing_says_any_device(tmp_path: Path) -> None:
    """No option given: the summary and the ranking say "any device", not the policy's "no
    constraints". Caught (issue 22, seed 52): the stand-in never used."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(2)))
    bare = pick(PickOptions(Constraints()), backend=SimulatedBackend(str(path)), environ={},
                dry_run=True)
    assert format_pick(bare).splitlines()[1] == (
        "  asked: any device · runner-up GPU 1 (80.0 GiB free, util 0%)"
    )
    assert format_ranking(bare).splitlines()[0] == (
        "autogpu [SIMULATED] dry run (any device): nothing changed"
    )


def test_a_kept_device_without_a_visible_devices_variable_shows_it_empty(
    result: PickResult,
) -> None:
    """A kept pick whose process has no CUDA_VISIBLE_DEVICES shows the variable empty. Caught
    (issue 22, seed 52): ``CUDA_VISIBLE_DEVICES=None`` shown instead."""
    kept = dataclasses.replace(result, kept=True, env={})
    assert format_pick(kept).split("\n")[2] == "  CUDA_VISIBLE_DEVICES="


def test_a_narrow_ranking_wraps_the_verdict_under_its_own_column(result: PickResult) -> None:
    """At 80 columns the verdict wraps under itself (never back to column 0, never past the
    width). Caught (issue 22, seed 52): the verdict column not wrapping (lines past the width).
    """
    under = " " * 72  # the verdict column starts at character 73
    assert format_ranking(result, width=80).splitlines()[2:6] == [
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0  "
        "would pick: 80.0 GiB",
        f"{under}free >= 10.0 GiB wanted",
        "  2     GPU 1   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0  "
        "fits: 80.0 GiB free >=",
        f"{under}10.0 GiB wanted",
    ]


def test_a_device_without_a_ranking_is_summed_up_from_its_own_reading(result: PickResult) -> None:
    """A result with no candidate for its device (``set_visible_devices`` ranks nothing): the
    summary reads free memory and load off the device itself. Caught (issue 22, seed 53): the
    missing candidate's free memory read all the same (an AttributeError)."""
    bare = dataclasses.replace(result, candidates=())
    assert format_pick(bare).splitlines()[0] == (
        "autogpu [SIMULATED]: picked GPU 0 · NVIDIA A100-SXM4-80GB · GPU-00000000: 80.0 GiB free "
        "of 80.0 GiB, util 0%"
    )


def test_a_picked_device_is_summed_up_as_it_was_ranked(tmp_path: Path) -> None:
    """One device picked: its line gives the free memory after other holders' bookings and the
    smoothed load the pick ranked it by, not the device's raw reading. Caught (issue 22, seed
    54): the picked device summed up from its raw reading (the booking and the load lost)."""
    from autogpu_jupyter.core.leasing import Registry

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(1)))
    registry = Registry(str(tmp_path / "registry"))
    with registry.locked() as txn:
        assert txn is not None
        other = txn.create(devices=[uuid_of(0)], requested_bytes=20 * 1024**3)
    try:
        ranked = pick(PickOptions(Constraints()), backend=SimulatedBackend(str(path)),
                      environ={}, store=registry, dry_run=True,
                      smoothed_util={uuid_of(0): 30.0})
    finally:
        other.release()
    assert format_pick(ranked).splitlines()[0] == (
        "autogpu [SIMULATED]: picked GPU 0 · NVIDIA A100-SXM4-80GB · GPU-00000000: 60.0 GiB free "
        "of 80.0 GiB after 20.0 GiB booked, util 30%"
    )


def test_an_eligible_device_without_reasons_is_ok_in_the_ranking(tmp_path: Path) -> None:
    """Nothing asked: a fitting device has no reason to show and its verdict says "ok".
    Caught (issue 22, seed 53): another word ("OK") shown."""
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(2)))
    bare = pick(PickOptions(Constraints()), backend=SimulatedBackend(str(path)), environ={},
                dry_run=True)
    assert [ln.split("  ")[-1] for ln in format_ranking(bare).splitlines()[2:4]] == [
        "would pick: ok", "fits: ok"]
