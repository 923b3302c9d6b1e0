"""The module-level helpers and small classes of ``magics.py``, each pinned to its exact output
(issue 22's mutation run of the magics): the one-line error text, the debug records of an
unreadable pending move and of a sampler that cannot start, the ``%gpu?`` option help, the
summary of a pick (several devices, a kept device, the wait, no lease, the variables of an AMD
host, nothing fitting) and the ``--dry-run`` ranking (unknown utilisation, several reasons, no
runner-up, its default width), the sidebar's answer, the words of a choice's source, the
``%%gpu`` cell's sampling and report, the waiting line, the provisioner's note, the lease
broker's events, and what loading and unloading the extension register and take back.

Everything runs in this process: hand-made snapshots and stand-ins for the sampler and the
lease, socket pairs for the broker's events, a simulated fleet file for the pick and the
ranking, and the in-process ``InteractiveShell`` over the fake NVML host of ``test_magics.py``
(its ``shell`` fixture) for the sidebar and for loading and unloading.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell

from autogpu_jupyter import magics
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from tests.unit.test_magics import U, _sidebar_pick, shell  # noqa: F401 (shell: a fixture)

GiB = 1024**3
#: A PID no process can have (above Linux's largest pid_max, 2**22): never this process's.
NOT_OURS = 2**22 + 7


# ---- one-line errors, the pending move ---------------------------------------------------------


def test_an_error_without_words_is_named_by_its_type() -> None:
    """An exception whose text is empty or blank is shown as its class name, never as an empty
    line. Caught: the name of ``NoneType`` shown instead of the exception's own."""
    assert magics._one_line(ValueError("  \n")) == "ValueError"
    assert magics._one_line(KeyError()) == "KeyError"


def test_an_unreadable_pending_move_is_no_move_and_a_debug_record_saying_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``%gpu status`` asks for a pending move; a move file that cannot be read is no move
    (``None``) and one debug record with the error's text. Caught: the record's text changed
    (in words, in capitals, or gone), the error left out of it, or the record's text replaced
    by the error (or by None)."""
    from autogpu_jupyter.core import moves
    from autogpu_jupyter.errors import AutoGPUError

    def unreadable() -> None:
        raise AutoGPUError("move file /tmp/k/move.json: not valid JSON")

    monkeypatch.setattr(moves, "pending_move_text", unreadable)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.magics")
    assert magics._pending_move_text() is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "autogpu_jupyter.magics"] == [
        (logging.DEBUG, "pending move not readable: move file /tmp/k/move.json: not valid JSON")
    ]


# ---- the %gpu? help ----------------------------------------------------------------------------


def _other_pick_parser() -> argparse.ArgumentParser:
    """A pick parser as a later version could have it: argparse's own ``-h``, a positional, and
    an option too long for the help column."""
    p = argparse.ArgumentParser(prog="x")  # add_help: a -h option
    p.add_argument("what")
    p.add_argument("--min-free", metavar="SIZE", help="Free memory wanted per device.")
    p.add_argument(
        "--a-rather-long-option-name", metavar="NAMES",
        help="Only the devices whose model name contains one of these names, like A100 or "
        "H100,A100.",
    )
    p.add_argument("--dry-run", action="store_true", help="Only show the ranking.")
    return p


def test_the_pick_help_wraps_at_90_columns_with_its_help_column_at_24_and_no_h_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``%gpu?``'s option help is laid out at 90 columns with the explanations from column 24
    (an option too long for that gets its own line), and never lists ``-h``; a positional
    (the devices of ``%gpu pick 2``, issue 41) is in the usage and listed first. Exactly 90
    columns: the first help line here would take one more word at 91. Caught: a width of 91,
    the help column at 25, ``-h`` listed."""
    monkeypatch.setattr(magics, "_PICK_PARSER", _other_pick_parser())
    assert magics._pick_help().splitlines() == [
        "usage: %gpu pick [--min-free SIZE] [--a-rather-long-option-name NAMES] [--dry-run] what",
        "",
        "pick options (also on top of a %%gpu cell):",
        "  what",
        "  --min-free SIZE       Free memory wanted per device.",
        "  --a-rather-long-option-name NAMES",
        "                        Only the devices whose model name contains one of these names,",
        "                        like A100 or H100,A100.",
        "  --dry-run             Only show the ranking.",
    ]


def test_the_pick_help_says_usage_in_english_like_the_rest_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The help is English throughout: its "usage: " is its own, not argparse's word, which a
    translation catalogue for argparse would change. Caught: the prefix left to argparse (given
    as None, or not given)."""
    translations = {"usage: ": "utilisation : "}
    monkeypatch.setattr(argparse, "_", lambda text: translations.get(text, text))
    assert magics._pick_help().splitlines()[0] == (
        "usage: %gpu pick [--min-free SIZE] [--max-util PCT] [--count N] [--exclude IDS]"
    )


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
    assert magics.format_ranking(result).splitlines() == [
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
    lines = magics.format_ranking(result).splitlines()
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
    assert magics.format_ranking(result, width=121).splitlines()[2] == lines[2] + " wanted"


# ---- the sidebar's pick, the words of a source -------------------------------------------------


def test_the_sidebar_pick_answers_its_details_and_the_summary_as_plain_text(
    shell: InteractiveShell,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sidebar's answer is one display of two forms: the sidebar's own (ok, summary,
    details) and the summary as plain text, under the exact MIME type "text/plain". In a
    notebook that loaded the extension, the sidebar's pick does not load it again (the
    extension manager is not asked). Caught: the plain-text key changed (in words or in
    capitals); the extension loaded again on every sidebar pick."""
    shell.run_cell("%load_ext autogpu")
    asked: list[str] = []
    monkeypatch.setattr(shell.extension_manager, "load_extension", asked.append)
    (answer,) = _sidebar_pick(shell, U[1])
    pick = answer[magics.SIDEBAR_PICK_MIME]
    assert answer == {magics.SIDEBAR_PICK_MIME: pick, "text/plain": pick["summary"]}
    assert pick["ok"] is True and pick["summary"].startswith("autogpu: picked GPU 1 · ")
    assert asked == []


def test_a_source_without_words_of_its_own_is_shown_as_it_is() -> None:
    """``%gpu status`` words a choice's source as the user made it; a source it has no words
    for is shown as given, never as nothing. Caught: None returned for such a source."""
    assert magics.source_words("sidebar") == "picked from the sidebar"
    assert magics.source_words("set_visible_devices") == "set_visible_devices"


# ---- the %%gpu cell's numbers and report -------------------------------------------------------


class _Sampler:
    """The two questions ``_CellStats.add`` asks a sampler: its latest sweep, and the PIDs of
    this kernel it found in that sweep."""

    def __init__(self, latest: FleetSnapshot | None, own: set[int]) -> None:
        self._latest = latest
        self._own = own

    def latest(self) -> FleetSnapshot | None:
        return self._latest

    def latest_own_pids(self) -> set[int]:
        return self._own


def _sweep(ts: float, util0: float | None = None,
           procs0: tuple[ProcessSnapshot, ...] = (),
           procs1: tuple[ProcessSnapshot, ...] = ()) -> FleetSnapshot:
    return FleetSnapshot(
        devices=(
            DeviceSnapshot(index=0, uuid=U[0], name="Fake", utilization_pct=util0,
                           processes=procs0),
            DeviceSnapshot(index=1, uuid=U[1], name="Fake", utilization_pct=10.0,
                           processes=procs1),
        ),
        timestamp_s=ts,
        backend="test",
    )


def test_a_cell_takes_the_samplers_own_pids_for_its_latest_sweep() -> None:
    """For the sampler's latest sweep, this kernel's processes are the ones the sampler found
    (it walked /proc for that sweep), not found again; their memory is summed over every
    device, a process that reports no memory counting 0 bytes. Caught: the sampler's answer
    ignored (or asked only for another sweep), the sum started at 1 byte, a process without a
    memory figure counted as 1 byte."""
    snap = _sweep(
        1000.0,
        procs0=(ProcessSnapshot(pid=NOT_OURS, used_memory_bytes=3 * GiB),
                ProcessSnapshot(pid=os.getpid(), used_memory_bytes=1 * GiB)),
        procs1=(ProcessSnapshot(pid=NOT_OURS, used_memory_bytes=None),),
    )
    stats = magics._CellStats(uuids=(U[0],), start_s=999.0)
    stats.add(_Sampler(snap, {NOT_OURS}), snap)  # type: ignore[arg-type]
    assert stats.peak_own_bytes == 3 * GiB


def test_a_cell_finds_its_own_pids_for_a_sweep_that_is_not_the_samplers_latest() -> None:
    """A sweep that is no longer the sampler's latest: the sampler's PIDs belong to another
    sweep, so this kernel's processes are found in this one's (this process and its
    descendants, on every device). Caught: the latest sweep's PIDs used for it, no PIDs
    looked for (a TypeError, or nothing found), the PIDs of no device looked at."""
    snap = _sweep(
        1000.0,
        procs0=(ProcessSnapshot(pid=NOT_OURS, used_memory_bytes=2 * GiB),
                ProcessSnapshot(pid=os.getpid(), used_memory_bytes=1 * GiB)),
    )
    newer = _sweep(1001.0)
    stats = magics._CellStats(uuids=(U[0],), start_s=999.0)
    stats.add(_Sampler(newer, {NOT_OURS}), snap)  # type: ignore[arg-type]
    assert stats.peak_own_bytes == 1 * GiB


def test_a_cell_whose_kernel_has_no_gpu_process_peaks_at_zero_bytes() -> None:
    """No process of this kernel on any device: the peak is 0 B (known, and nothing), not 1 B.
    Caught: the running peak started at 1 byte."""
    snap = _sweep(1000.0, procs0=(ProcessSnapshot(pid=NOT_OURS, used_memory_bytes=GiB),))
    stats = magics._CellStats(uuids=(U[0],), start_s=999.0)
    stats.add(_Sampler(snap, set()), snap)  # type: ignore[arg-type]
    assert stats.peak_own_bytes == 0
    assert stats.report(1.0, "GPU 0", simulated=False).split(" · ")[1] == (
        "peak GPU memory of this kernel 0 B"
    )


def test_a_cell_counts_each_sweep_from_its_start_once_and_averages_their_utilisation() -> None:
    """The cell counts the sweeps taken from its start on (one taken at its very start
    included), each once however often it is handed in, skips none-readings and older sweeps,
    and reports the mean utilisation of its device over them. Caught: a missing reading read
    (an AttributeError) or an older sweep counted, a sweep at the start skipped, a sweep
    counted twice, the sample count or the utilisation kept as the last sweep's only instead
    of summed, the mean computed as a product."""
    stats = magics._CellStats(uuids=(U[0],), start_s=1000.0)
    first, second = _sweep(1000.0, util0=40.0), _sweep(1001.0, util0=80.0)
    sampler = _Sampler(second, set())
    stats.add(sampler, None)  # type: ignore[arg-type]
    stats.add(sampler, _sweep(999.9, util0=100.0))  # type: ignore[arg-type]
    stats.add(sampler, first)  # type: ignore[arg-type]
    stats.add(sampler, first)  # type: ignore[arg-type]
    stats.add(sampler, second)  # type: ignore[arg-type]
    assert (stats.samples, stats.util_sum, stats.util_n) == (2, 120.0, 2)
    assert stats.report(3.0, "GPU 0", simulated=False) == (
        "autogpu %%gpu on GPU 0: wall 3s · peak GPU memory of this kernel 0 B · mean "
        "utilisation 60% (2 samples)"
    )


def test_a_cell_report_says_simulated_and_its_wall_time_to_the_hundredth() -> None:
    """On a simulated fleet the cell's report says [SIMULATED]; its wall time is rounded to the
    hundredth of a second before being written (so 2.004 s is "2s" and 2.5 s is "2.5s").
    Caught: the mark never shown, shown in other words or in small letters; the wall time
    rounded to whole seconds, to the thousandth, or replaced by 2."""
    stats = magics._CellStats(uuids=(U[0],), start_s=0.0)
    assert stats.report(2.004, "GPU 0", simulated=True) == (
        "autogpu [SIMULATED] %%gpu on GPU 0: wall 2s · peak GPU memory of this kernel unknown · "
        "mean utilisation unknown (not reported for this device) (0 samples)"
    )
    assert stats.report(2.5, "GPU 0", simulated=True).split(" · ")[0] == (
        "autogpu [SIMULATED] %%gpu on GPU 0: wall 2.5s"
    )
    assert stats.report(5.0, "GPU 0", simulated=False).split(" · ")[0] == (
        "autogpu %%gpu on GPU 0: wall 5s"
    )


# ---- the waiting line in a terminal ------------------------------------------------------------


def test_the_waiting_line_in_a_terminal_rewrites_itself_and_ends_with_a_newline(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Outside a kernel the waiting line is rewritten in place (a carriage return before each
    text) and, once shown, ended with a newline when the wait ends. Caught: other characters
    written before the text; the line not marked as shown (no newline at the end)."""
    with magics._Progress(in_kernel=False) as progress:
        progress.update("waiting for a device (1s)")
        progress.update("waiting for a device (2s)")
    assert capsys.readouterr().out == "\rwaiting for a device (1s)\rwaiting for a device (2s)\n"


def test_a_waiting_line_in_a_kernel_ends_with_no_newline_of_its_own(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In a kernel the waiting line is a display, not text on stdout: ending the wait writes no
    newline there, shown or not. Caught: the newline written in a kernel instead of in a
    terminal."""
    progress = magics._Progress(in_kernel=True)
    progress.shown = True  # as after its first display
    progress.__exit__(None, None, None)
    assert capsys.readouterr().out == ""


# ---- the summary's small parts -----------------------------------------------------------------


def test_the_utilisation_words_of_a_summary() -> None:
    """Caught: the unknown utilisation's words changed (in words or in capitals)."""
    assert magics._pct(None) == "util unknown"
    assert magics._pct(42.4) == "util 42%"


def test_the_variables_line_of_an_amd_pick_names_rocr_then_hip_as_set() -> None:
    """On an AMD host the summary shows ROCr's variable, then HIP's where it is set (not
    CUDA's); elsewhere CUDA's. Caught: either ROCm name misspelt (in words or small letters,
    so a variable left out or CUDA's shown), the set ones left out (or a missing one read:
    a KeyError), the line not indented by two spaces, the names joined by something else
    than a space, nothing joined (a TypeError), the indent subtracted (a TypeError)."""
    both = {"ROCR_VISIBLE_DEVICES": "GPU-ab12", "HIP_VISIBLE_DEVICES": "0",
            "CUDA_VISIBLE_DEVICES": "0"}
    assert magics._env_line(both) == "  ROCR_VISIBLE_DEVICES=GPU-ab12 HIP_VISIBLE_DEVICES=0"
    assert magics._env_line({"ROCR_VISIBLE_DEVICES": "GPU-ab12"}) == (
        "  ROCR_VISIBLE_DEVICES=GPU-ab12")
    assert magics._env_line({"CUDA_VISIBLE_DEVICES": "GPU-1"}) == "  CUDA_VISIBLE_DEVICES=GPU-1"


def test_nothing_fitting_is_shown_as_its_reasons_under_one_autogpu_line_and_how_to_wait() -> None:
    """When no device fits, the notebook shows the error's own lines, the first one prefixed
    "autogpu: ", the per-device reasons as they are, then what to do. Caught: the error's text
    replaced by "None", the prefix on no line, on every line, or on the second one only."""
    from autogpu_jupyter.errors import NoDeviceFitsError

    err = NoDeviceFitsError("no device fits (min free 500.0 GiB):\n  GPU 0: only 80.0 GiB free\n"
                            "  GPU 1: only 79.0 GiB free")
    shown = magics._no_fit(err, argparse.Namespace(wait=None), "%gpu pick")
    assert shown._render_traceback_() == [  # type: ignore[attr-defined]
        "autogpu: no device fits (min free 500.0 GiB):",
        "  GPU 0: only 80.0 GiB free",
        "  GPU 1: only 79.0 GiB free",
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
    lines = magics.format_pick(dataclasses.replace(result, previous="GPU 1")).splitlines()
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
    assert magics.format_pick(kept).splitlines()[0] == (
        "autogpu [SIMULATED]: kept GPU 0 · NVIDIA A100-SXM4-80GB · GPU-00000000: 80.0 GiB free "
        "of 80.0 GiB, util 30%"
    )
    bare = dataclasses.replace(result, kept=True, chosen=())
    assert magics.format_pick(bare).splitlines()[0] == "autogpu [SIMULATED]: kept its device"


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
    waited = [ln for ln in magics.format_pick(result).splitlines() if ln.startswith("  waited")]
    assert waited == ([] if line is None else [line])


def test_a_summary_without_a_lease_says_why(tmp_path: Path) -> None:
    """No lease taken (the store refused, read-only): the summary says so with the reason,
    before the variables. Caught: the line made None (a TypeError)."""
    result = dataclasses.replace(_picked(tmp_path, 1), lease=None,
                                 lease_note="the lease registry is read-only")
    assert magics.format_pick(result).splitlines()[-2:] == [
        "  no lease: the lease registry is read-only",
        "  CUDA_VISIBLE_DEVICES=",
    ]


# ---- the sampler's start, the provisioner's note, the lease events -----------------------------


class _Watched:
    """A sampler with or without a first reading, counting the readings asked for."""

    def __init__(self, latest: object) -> None:
        self._latest = latest
        self.asked = 0

    def latest(self) -> object:
        return self._latest

    def sample_now(self) -> None:
        self.asked += 1


@pytest.mark.parametrize(("latest", "asked"), [(None, 1), (object(), 0)])
def test_watching_takes_a_first_reading_only_when_the_sampler_has_none(
    monkeypatch: pytest.MonkeyPatch, latest: object, asked: int
) -> None:
    """After a pick the sampler reads the devices at once, unless it has a reading already.
    Caught: the reading taken only when there already was one."""
    from autogpu_jupyter.core import sampler as sampler_mod

    watched = _Watched(latest)
    monkeypatch.setattr(sampler_mod, "get_sampler", lambda: watched)
    magics._watch()
    assert watched.asked == asked


def test_no_sampler_to_watch_with_is_a_debug_record_saying_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No driver: nothing is watched, and one debug record says why. Caught: the record's
    text changed (in words, in capitals, or gone), the error left out of it, or the text
    replaced by the error (or by None)."""
    from autogpu_jupyter.core import sampler as sampler_mod
    from autogpu_jupyter.errors import NVMLUnavailableError

    def no_driver() -> None:
        raise NVMLUnavailableError("NVIDIA driver not loaded")

    monkeypatch.setattr(sampler_mod, "get_sampler", no_driver)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.magics")
    magics._watch()
    assert [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "autogpu_jupyter.magics"] == [
        (logging.DEBUG, "sampler not started: NVIDIA driver not loaded")
    ]


def test_the_provisioners_note_is_printed_once_under_the_first_cell(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The kernelspec's note ("started CPU-only because ...") is printed after the first cell,
    with "autogpu: " before it, and never again. Caught: the note dropped (None, or "" for any
    note), printed only once already shown, printed again (not marked as shown), printed as
    "None"."""
    monkeypatch.setattr(magics.hooks, "_note_shown", False)
    monkeypatch.setenv("AUTOGPU_PICK_NOTE", "started CPU-only because no GPU fits")
    magics._pick_note_once()
    magics._pick_note_once()
    assert capsys.readouterr().out == "autogpu: started CPU-only because no GPU fits\n"


class _Lease:
    """This kernel's lease as ``_lease_events`` sees it: whether it is held, and its socket."""

    def __init__(self, fd: int, held: bool) -> None:
        self.held = held
        self._fd = fd

    def fileno(self) -> int:
        return self._fd


REVOKED = b'{"event": "revoked", "lease_id": "abc"}\n'
SAID = ("autogpu: your GPU lease abc was revoked by the admin: this kernel no longer holds it; "
        "others may now be given its GPU\n")


def test_a_revoke_on_this_kernels_own_lease_is_said_once_and_only_its_first_event(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lease the kernel took itself (``%gpu pick``) is read after a cell: a revoke there is
    told, its first event only, and once. Caught: the kernel's choice or its lease not read
    (by another name, or of nothing), the held check asked of nothing, by another name, or
    turned around; two events told."""
    import socket

    from autogpu_jupyter.core import session as session_mod

    monkeypatch.delenv("AUTOGPU_LEASE_FD", raising=False)
    monkeypatch.setattr(magics.hooks, "_ended_lease_fds", set())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        choice = argparse.Namespace(lease=_Lease(ours.fileno(), held=True))
        monkeypatch.setattr(session_mod, "current", lambda: choice)
        theirs.sendall(REVOKED + REVOKED.replace(b"abc", b"def"))
        magics._lease_events()
        theirs.sendall(REVOKED)
        magics._lease_events()
    assert capsys.readouterr().out == SAID


def test_a_lease_no_longer_held_is_not_read(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lease the kernel no longer holds (released, its connection another's by now) is not
    read for events. Caught: any lease read, held or not."""
    import socket

    from autogpu_jupyter.core import session as session_mod

    monkeypatch.delenv("AUTOGPU_LEASE_FD", raising=False)
    monkeypatch.setattr(magics.hooks, "_ended_lease_fds", set())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        choice = argparse.Namespace(lease=_Lease(ours.fileno(), held=False))
        monkeypatch.setattr(session_mod, "current", lambda: choice)
        theirs.sendall(REVOKED)
        magics._lease_events()
    assert capsys.readouterr().out == ""


def test_an_ended_lease_connection_does_not_hide_the_inherited_ones_revoke(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The kernel's own lease connection already ended (said before); the descriptor it
    inherited from the kernelspec still is read, and its revoke told. Caught: the loop stopped
    at the first ended connection."""
    import socket

    from autogpu_jupyter.core import session as session_mod

    own, own_peer = socket.socketpair()
    inherited, inherited_peer = socket.socketpair()
    with own, own_peer, inherited, inherited_peer:
        monkeypatch.setattr(magics.hooks, "_ended_lease_fds", {own.fileno()})
        choice = argparse.Namespace(lease=_Lease(own.fileno(), held=True))
        monkeypatch.setattr(session_mod, "current", lambda: choice)
        monkeypatch.setenv("AUTOGPU_LEASE_FD", str(inherited.fileno()))
        inherited_peer.sendall(REVOKED)
        magics._lease_events()
    assert capsys.readouterr().out == SAID


# ---- load and unload ---------------------------------------------------------------------------


def test_a_kernel_the_kernelspec_started_is_told_how_to_move_in_its_overload_notice(
    shell: InteractiveShell,  # noqa: F811 (the fixture imported above)
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In a kernel of the autogpu kernelspec, loading the extension sets the overload notice's
    hint to the move that works there. Caught: the hint None, in other words or capitals."""
    from autogpu_jupyter.core import overload

    hints: list[Any] = []
    monkeypatch.setattr(overload, "set_move_hint", hints.append)
    monkeypatch.setenv("AUTOGPU_PROVISIONED", "1")
    shell.run_cell("%load_ext autogpu")
    assert hints == ["run %gpu move --best, then restart the kernel (its state is lost)"]


def test_unload_removes_the_hook_the_config_and_the_magics_class_it_registered(
    shell: InteractiveShell,  # noqa: F811 (the fixture imported above)
) -> None:
    """Unloading takes back all that loading registered: the post-run hook, the AutoGPU
    configurable and the magics class in the magics manager's registry. Caught: the hook not
    remembered (or another one unregistered: the hook stayed), the configurable not removed,
    the registry entry looked up by another name."""
    from autogpu_jupyter.config import AutoGPU

    shell.run_cell("%load_ext autogpu")
    assert "GPUMagics" in shell.magics_manager.registry
    shell.run_cell("%unload_ext autogpu")
    assert shell.events.callbacks["post_run_cell"].count(magics._overload_hook) == 0
    assert [c for c in shell.configurables if isinstance(c, AutoGPU)] == []
    assert "GPUMagics" not in shell.magics_manager.registry


def test_unload_after_someone_took_the_hook_config_and_registry_entry_away_still_unloads(
    shell: InteractiveShell,  # noqa: F811 (the fixture imported above)
) -> None:
    """Another extension (or the user) removed the hook, the configurable and the registry
    entry first: unloading still succeeds and removes the magics. Caught: a missing registry
    entry, hook or configurable raising out of the unload."""
    from autogpu_jupyter.config import AutoGPU

    shell.run_cell("%load_ext autogpu")
    shell.events.unregister("post_run_cell", magics._overload_hook)
    (settings,) = [c for c in shell.configurables if isinstance(c, AutoGPU)]
    shell.configurables.remove(settings)
    del shell.magics_manager.registry["GPUMagics"]
    assert shell.run_cell("%unload_ext autogpu").success
    assert shell.find_line_magic("gpu") is None and shell.find_cell_magic("gpu") is None


def test_a_pick_on_load_after_cuda_started_prints_its_warning_under_the_summary(
    shell: InteractiveShell,  # noqa: F811 (the fixture imported above)
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``c.AutoGPU.pick_on_load`` in a kernel where CUDA already started (and
    ``refuse_when_initialized`` off): the pick made at load prints its summary with the
    warning that it came too late. Caught: the summary printed without its warning."""
    from autogpu_jupyter.core import session as session_mod
    from autogpu_jupyter.core.cudastate import CudaState

    monkeypatch.setattr(session_mod, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))
    shell.config.AutoGPU.pick_on_load = True
    shell.config.AutoGPU.refuse_when_initialized = False
    shell.run_cell("%load_ext autogpu")
    (warning,) = [ln for ln in capsys.readouterr().out.splitlines() if "WARNING" in ln]
    assert warning.startswith(
        "  WARNING --force: CUDA is already initialised in this kernel (cuInit has run (test)).")
