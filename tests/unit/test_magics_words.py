"""The words of the magics (``autogpu_jupyter/magics/words.py``): ``%gpu pick``'s summary
(``format_pick``) for the cases a plain pick does not reach (a kernel that kept the device the
kernelspec gave it, a re-pick), ``--dry-run``'s ranking (``format_ranking``), the one line an
error becomes and what a notebook shows when nothing fits. Each line checked whole."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import PickResult, pick
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.magics import format_pick, format_ranking, words
from tests.leasehelpers import fleet, forget_backends, uuid_of

GiB = 1024**3


@pytest.fixture
def notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """``run(code)``: a cell in the process's IPython shell with ``%load_ext autogpu`` done,
    over a simulated two-GPU fleet and a private registry; returns (success, out + err)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    from autogpu_jupyter.core import session
    from autogpu_jupyter.core.sampler import stop_sampler

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(2)))
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED",
                 "AUTOGPU_LEASE_FD", "AUTOGPU_PICK_NOTE"):
        monkeypatch.delenv(name, raising=False)
    forget_backends()
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=cfg)
    sh.run_cell("%load_ext autogpu")
    capsys.readouterr()

    def run(code: str) -> tuple[bool, str]:
        r = sh.run_cell(code)
        out, err = capsys.readouterr()
        return bool(r.success), out + err

    yield run
    for name in ("autogpu", "autogpu_jupyter"):
        sh.extension_manager.unload_extension(name)
    session.release()
    stop_sampler()
    forget_backends()


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


def test_a_narrow_ranking_puts_each_verdict_under_its_row(result: PickResult) -> None:
    """At 80 columns the columns leave the verdict too little room: it goes on the line under
    its row, from the device column on, and no line is wider than 80. Caught (issue 22, seed
    52): the verdict not wrapping (lines past the width); (issue 42) lines 96 wide, the verdict
    kept beside the row at its least width."""
    lines = format_ranking(result, width=80).splitlines()
    assert lines[2:6] == [
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0",
        "        would pick: 80.0 GiB free >= 10.0 GiB wanted",
        "  2     GPU 1   NVIDIA A100-SXM4-80GB  80.0 GiB    0%  0% util       0",
        "        fits: 80.0 GiB free >= 10.0 GiB wanted",
    ]
    assert max(len(line) for line in lines) <= 80


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
    from autogpu_jupyter.core.leasing import DirectoryStore

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(1)))
    registry = DirectoryStore(str(tmp_path / "registry"))
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


# ==== folded from test_magics_functions_mutants.py (issue 42) ====================================
# The words' small parts that issue 22's mutation run of the magics found unchecked, each pinned
# to its exact output: the one-line error text, the debug record of an unreadable pending move,
# the ``--dry-run`` ranking (unknown utilisation, several reasons, no runner-up, its default
# width) and the summary of a pick (several devices, a kept device, the wait, no lease, the
# variables of an AMD host, nothing fitting). Hand-made snapshots and a simulated fleet file.


# ---- one-line errors, the pending move ---------------------------------------------------------


def test_an_error_without_words_is_named_by_its_type() -> None:
    """An exception whose text is empty or blank is shown as its class name, never as an empty
    line. Caught: the name of ``NoneType`` shown instead of the exception's own.

    A reasoned private seam: every error the magics raise today has words, so no cell shows
    this; the one-line maker is asked directly."""
    assert words._one_line(ValueError("  \n")) == "ValueError"
    assert words._one_line(KeyError()) == "KeyError"


def test_an_unreadable_pending_move_is_no_move_and_a_debug_record_saying_why(
    notebook: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``%gpu status`` asks for a pending move; a move file that cannot be read is no move
    (nothing after the kernel's own line) and one debug record with the error's text. Caught:
    the record's text changed (in words, in capitals, or gone), the error left out of it, or
    the record's text replaced by the error (or by None)."""
    from autogpu_jupyter.core import moves
    from autogpu_jupyter.errors import AutoGPUError

    def unreadable() -> None:
        raise AutoGPUError("move file /tmp/k/move.json: not valid JSON")

    assert notebook("%gpu pick")[0]
    monkeypatch.setattr(moves, "pending_move_text", unreadable)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.magics")
    ok, text = notebook("%gpu status")
    assert ok and text.splitlines()[-1] == "this kernel: ▶ GPU 0 (%gpu pick, no constraints)"
    assert [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "autogpu_jupyter.magics"] == [
        (logging.DEBUG, "pending move not readable: move file /tmp/k/move.json: not valid JSON")
    ]


# ---- the --dry-run ranking ---------------------------------------------------------------------


def _ranking_of(tmp_path: Path, data: dict[str, Any], **asked: Any) -> Any:
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(data))
    return pick(PickOptions(Constraints.parse(**asked)), backend=SimulatedBackend(str(path)),
                environ={}, dry_run=True)


def test_a_ranking_shows_unknown_utilisation_as_a_question_mark_and_every_reason(
    tmp_path: Path,
) -> None:
    """GPU 0 does not report its utilisation ("?"), GPU 1 is dropped for two reasons (both
    shown, joined by "; "), and with nothing else fitting the last line names no runner-up.
    Caught: the unknown utilisation formatted as a number (a TypeError) or shown as another
    mark, the reasons joined by something else, and "over" text made up for no runner-up."""
    from tests.leasehelpers import fleet

    data = fleet(2)
    data["devices"][0]["utilization_pct"] = None
    data["devices"][1].update(memory_used=75 * GiB, utilization_pct=90)
    result = _ranking_of(tmp_path, data, min_free="10G", max_util="50")
    under = " " * 71
    assert words.format_ranking(result).splitlines() == [
        "autogpu [SIMULATED] dry run (min free 10.0 GiB, max util 50%): nothing changed",
        "  rank  device  name                       free  util  load    leases  verdict",
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  80.0 GiB     ?  0% mem       0  would pick: "
        "80.0 GiB free >= 10.0 GiB wanted;",
        f"{under}utilisation unknown (not supported here): not",
        f"{under}filtered on it",
        "  -     GPU 1   NVIDIA A100-SXM4-80GB   5.0 GiB   90%  -            0  dropped: only "
        "5.0 GiB free < 10.0 GiB wanted;",
        f"{under}utilisation 90% > max 50%",
        "  why GPU 0: the only device that fits",
    ]


def test_a_ranking_is_120_columns_wide_unless_told(tmp_path: Path) -> None:
    """``%gpu pick --dry-run`` calls the ranking without a width: it fits 120 columns, so a
    verdict that would end at column 121 wraps under itself. Caught: a default width of 121."""
    from tests.leasehelpers import fleet

    data = fleet(2)
    for device in data["devices"]:
        device["name"] = "NVIDIA H100 PCIe 80GB HBM2"  # 26 characters: the lines reach 121
    data["devices"][1]["memory_used"] = 75 * GiB
    result = _ranking_of(tmp_path, data, min_free="10G")
    under = " " * 77
    lines = words.format_ranking(result).splitlines()
    assert lines == [
        "autogpu [SIMULATED] dry run (min free 10.0 GiB): nothing changed",
        "  rank  device  name                            free  util  load     leases  verdict",
        "  1     GPU 0   NVIDIA H100 PCIe 80GB HBM2  80.0 GiB    0%  0% util       0  would pick: "
        "80.0 GiB free >= 10.0 GiB",
        f"{under}wanted",
        "  -     GPU 1   NVIDIA H100 PCIe 80GB HBM2   5.0 GiB    0%  -             0  dropped: "
        "only 5.0 GiB free < 10.0 GiB",
        f"{under}wanted",
        "  why GPU 0: the only device that fits",
    ]
    assert words.format_ranking(result, width=121).splitlines()[2] == lines[2] + " wanted"


# ---- the summary's small parts -----------------------------------------------------------------


def test_the_utilisation_words_of_a_summary(tmp_path: Path) -> None:
    """The summary words a device's utilisation as a whole percentage, an unknown one as "util
    unknown" (here the runner-up's). Caught: the unknown utilisation's words changed (in words
    or in capitals)."""
    data = fleet(2)
    data["devices"][0]["utilization_pct"] = 42.4
    data["devices"][1].update(utilization_pct=None, memory_used=40 * GiB)
    picked = format_pick(_ranking_of(tmp_path, data)).splitlines()
    assert picked[0].endswith(", util 42%")
    assert picked[1].endswith(" · runner-up GPU 1 (40.0 GiB free, util unknown)")


def test_the_variables_line_of_an_amd_pick_names_rocr_then_hip_as_set(
    result: PickResult,
) -> None:
    """On an AMD host the summary shows ROCr's variable, then HIP's where it is set (not
    CUDA's); elsewhere CUDA's. Caught: either ROCm name misspelt (in words or small letters,
    so a variable left out or CUDA's shown), the set ones left out (or a missing one read:
    a KeyError), the line not indented by two spaces, the names joined by something else
    than a space, nothing joined (a TypeError), the indent subtracted (a TypeError)."""
    both = {"ROCR_VISIBLE_DEVICES": "GPU-ab12", "HIP_VISIBLE_DEVICES": "0",
            "CUDA_VISIBLE_DEVICES": "0"}

    def last_line(env: dict[str, str]) -> str:
        return format_pick(dataclasses.replace(result, env=env)).splitlines()[-1]

    assert last_line(both) == "  ROCR_VISIBLE_DEVICES=GPU-ab12 HIP_VISIBLE_DEVICES=0"
    assert last_line({"ROCR_VISIBLE_DEVICES": "GPU-ab12"}) == "  ROCR_VISIBLE_DEVICES=GPU-ab12"
    assert last_line({"CUDA_VISIBLE_DEVICES": "GPU-1"}) == "  CUDA_VISIBLE_DEVICES=GPU-1"


def test_nothing_fitting_is_shown_as_its_reasons_under_one_autogpu_line_and_how_to_wait(
    notebook: Any,
) -> None:
    """When no device fits, the notebook shows the error's own lines, the first one prefixed
    "autogpu: ", the per-device reasons as they are, then what to do. Caught: the error's text
    replaced by "None", the prefix on no line, on every line, or on the second one only."""
    ok, text = notebook("%gpu pick --min-free 500G")
    assert not ok
    assert text.splitlines() == [
        "autogpu: no device fits (min free 500.0 GiB):",
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: only 80.0 GiB free < 500.0 GiB wanted",
        "  GPU 1 (NVIDIA A100-SXM4-80GB): dropped: only 80.0 GiB free < 500.0 GiB wanted",
        "  nothing changed; to wait in line until a device fits, add --wait: %gpu pick ... "
        "--wait 10m (interrupt the kernel to cancel)",
    ]


def _picked(tmp_path: Path, n: int, count: int = 1) -> Any:
    """A dry-run pick of ``count`` of ``n`` idle simulated GPUs, ranked by the smoothed loads
    GPU 0: 30 %, GPU 1: 20 %, GPU 2: 25 % (what the sampler would have given)."""
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints
    from tests.leasehelpers import fleet, uuid_of

    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(n)))
    loads = {uuid_of(0): 30.0, uuid_of(1): 20.0, uuid_of(2): 25.0}
    return pick(PickOptions(Constraints.parse(count=str(count))),
                backend=SimulatedBackend(str(path)), environ={}, dry_run=True,
                smoothed_util={u: v for u, v in loads.items() if int(u[-1]) < n})


def test_a_two_device_summary_gives_each_device_as_it_was_ranked(tmp_path: Path) -> None:
    """Two devices picked: each line gives the smoothed load the pick ranked the device by (not
    its raw 0 % reading), and a re-pick names the devices it has now, comma separated.
    Caught: the devices summed up from their raw readings (no candidate, or the candidate of
    no UUID), the devices joined by something else."""
    result = _picked(tmp_path, 3, count=2)
    lines = words.format_pick(dataclasses.replace(result, previous="GPU 1")).splitlines()
    assert lines[:3] == [
        "autogpu [SIMULATED]: picked 2 devices:",
        "  GPU 1 · NVIDIA A100-SXM4-80GB · GPU-00000001: 80.0 GiB free of 80.0 GiB, util 20%",
        "  GPU 2 · NVIDIA A100-SXM4-80GB · GPU-00000002: 80.0 GiB free of 80.0 GiB, util 25%",
    ]
    assert lines[4] == "  you had GPU 1; now GPU 1, GPU 2 (one lease: the old one was released)"


def test_a_kept_device_is_summed_up_as_ranked_and_a_kept_pick_without_one_says_its_device(
    tmp_path: Path,
) -> None:
    """A kept pick (the kernelspec's lease) shows its device as the pick ranked it (smoothed
    load 30 %, not the raw 0 %); one whose result names no device says "its device". Caught:
    the kept device's candidate not looked up (or looked up by no UUID), the first device read
    from an empty result (an IndexError), a missing device read (an AttributeError), "its
    device" in other words or capitals."""
    result = _picked(tmp_path, 1)
    kept = dataclasses.replace(result, kept=True)
    assert words.format_pick(kept).splitlines()[0] == (
        "autogpu [SIMULATED]: kept GPU 0 · NVIDIA A100-SXM4-80GB · GPU-00000000: 80.0 GiB free "
        "of 80.0 GiB, util 30%"
    )
    bare = dataclasses.replace(result, kept=True, chosen=())
    assert words.format_pick(bare).splitlines()[0] == "autogpu [SIMULATED]: kept its device"


@pytest.mark.parametrize(("waited_s", "line"), [
    (0.99, None),
    (1.0, "  waited 1s in line"),
    (1.04, "  waited 1s in line"),
    (1.5, "  waited 1.5s in line"),
])
def test_a_summary_says_how_long_the_pick_waited_from_one_second_on(
    tmp_path: Path, waited_s: float, line: str | None
) -> None:
    """A wait of a second or more is said, rounded to the tenth (1.04 s is "1s"); a shorter one
    is not. Caught: a wait of exactly 1 s (or 1.5 s) left out, the line made None (a
    TypeError), the duration read from None, rounded to whole seconds, to the hundredth, or
    replaced by 1."""
    result = dataclasses.replace(_picked(tmp_path, 1), waited_s=waited_s)
    waited = [ln for ln in words.format_pick(result).splitlines() if ln.startswith("  waited")]
    assert waited == ([] if line is None else [line])


def test_a_summary_without_a_lease_says_why(tmp_path: Path) -> None:
    """No lease taken (the store refused, read-only): the summary says so with the reason,
    before the variables. Caught: the line made None (a TypeError)."""
    result = dataclasses.replace(_picked(tmp_path, 1), lease=None,
                                 lease_note="the lease registry is read-only")
    assert words.format_pick(result).splitlines()[-2:] == [
        "  no lease: the lease registry is read-only",
        "  CUDA_VISIBLE_DEVICES=",
    ]
