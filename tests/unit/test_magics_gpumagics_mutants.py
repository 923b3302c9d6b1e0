"""``GPUMagics`` (``%gpu`` / ``%%gpu``) in an in-process IPython shell: what the surviving mutants
of issue 22's full mutation run of ``magics.py`` showed untested.

``%gpu move`` (the target it hands on, its refusals), the sidebar's pick (``_pick_one``: its
settings, its words, its details), ``%gpu release`` (AMD's variable, a restored value, two
devices), ``%gpu status`` (a pending move, devices the host does not list, the notebook's HTML
and the widths it is laid out for, a simulated fleet), the ``%%gpu`` cell (its options' words,
its report's labels and wall time, how its error is passed on, its history) and the check of a
kernel's device against a cell's options (``_violations``). The devices come from the fake NVML
of ``tests/unit/test_magics.py``'s ``shell`` fixture, or from a simulated fleet file.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from IPython.core.interactiveshell import InteractiveShell

from autogpu_jupyter import magics
from autogpu_jupyter.core import session
from autogpu_jupyter.errors import NoDeviceFitsError, RegistryError
from tests.fakenvml import FakeNvml, fleet_4x
from tests.unit.test_magics import U, _BlindSampler, _capture_displays, _sidebar_pick, run
from tests.unit.test_magics import shell as shell  # the fixture, re-exported

PICK = magics.SIDEBAR_PICK_MIME
MOVE_TAIL = (
    "Restarting loses the kernel's state (variables, imports, data in memory): save what you "
    "need first. Restart the kernel now (Kernel > Restart Kernel) to move; until then nothing "
    "changes.\n"
)


def _provisioned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, on: str) -> Path:
    """Make this process a kernel the autogpu kernelspec started on ``on``; its move file."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    move_file = runtime / "autogpu-move-k-3.json"
    for name, value in (("AUTOGPU_PROVISIONED", "1"), ("AUTOGPU_MOVE_FILE", str(move_file)),
                        ("AUTOGPU_PICKED", on), ("CUDA_VISIBLE_DEVICES", on)):
        monkeypatch.setenv(name, value)
    return move_file


def _simulated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **extra: Any) -> Iterator[Path]:
    """Point ``AUTOGPU_SIMULATE`` at a file holding the 4-GPU fleet (with ``extra`` keys)."""
    from autogpu_jupyter.core import backends

    fleet = fleet_4x()
    fleet.update(extra)
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet))
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
    backends._cache.clear()
    yield path
    backends._cache.clear()


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    yield from _simulated(monkeypatch, tmp_path)


@pytest.fixture
def simulated_amd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    for name in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    yield from _simulated(monkeypatch, tmp_path, vendor="amd")


def _other_holders_lease(registry: Path, uuid: str, notebook: str) -> Any:
    """A lease on ``uuid`` held by another live process of this user (our parent), for
    ``notebook``: what another user's notebook looks like in the status table."""
    from autogpu_jupyter.core.leasing import Registry, Requester

    with Registry(str(registry)).locked() as txn:
        assert txn is not None
        return txn.create(devices=[uuid],
                          requester=Requester(pid=os.getppid(), notebook_path=notebook))


def _displays(shell: InteractiveShell, code: str) -> list[dict[str, Any]]:
    """Run ``code`` as in a notebook's kernel; the displays it published (mimetype -> data)."""
    with pytest.MonkeyPatch.context() as mp:
        shown = _capture_displays(shell, mp)
        with patch.object(magics.GPUMagics, "_in_kernel", return_value=True):
            assert shell.run_cell(code).success
    return [data for data, _update in shown]


def _me() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name


# ---- %gpu move ---------------------------------------------------------------------------------


def test_a_move_to_a_device_asks_for_that_device_and_best_or_dash_dash_best_for_the_best(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``%gpu move 3`` in a kernel the kernelspec started on GPU 1 plans the move onto GPU 3 (the
    device typed), ``%gpu move best`` and ``%gpu move --best`` onto the best one (GPU 0, the
    idlest: "the best device", GPU 1 still fits), and the pending move is recorded for the
    restart. Caught: every target taken for
    "best" (the move to GPU 3 planned onto GPU 0); "best" handed on in capitals (no such
    device); the target read from a second word that is not there (an IndexError)."""
    from autogpu_jupyter.core import moves

    move_file = _provisioned(monkeypatch, tmp_path, on=U[1])
    shell.run_cell("%load_ext autogpu")
    capsys.readouterr()
    r, out, err = run(shell, "%gpu move 3", capsys)
    assert (r.success, err) == (True, "")
    assert out == (
        "The kernel will restart on GPU 3 (NVIDIA L4, 10.1 GiB free), the requested device now. "
        + MOVE_TAIL
    )
    request = moves.read_move(move_file)
    assert request is not None and request.target_uuids == (U[3],)
    for line in ("%gpu move best", "%gpu move --best"):
        r, out, err = run(shell, line, capsys)
        assert (r.success, err) == (True, "")
        assert out == (
            "The kernel will restart on GPU 0 (NVIDIA A100-SXM4-80GB, 77.5 GiB free), the best "
            "device now. " + MOVE_TAIL
        )


def test_a_move_with_an_unknown_option_or_two_targets_is_one_usage_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """``%gpu move --fast`` is refused as an unknown option (not handed on as a device name),
    ``%gpu move 1 2`` quotes the two words it got; both in one line. Caught: options never
    recognised (the word handed on to the move), the refusal without its words, the words of
    the line joined with something else than a space."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu move --fast", capsys)
    assert (r.success, out) == (False, "")
    assert err == "UsageError: %gpu move: unknown option '--fast'; expected a device or --best\n"
    r, out, err = run(shell, "%gpu move 1 2", capsys)
    assert (r.success, out) == (False, "")
    assert err == (
        "UsageError: %gpu move takes one target, got '1 2'; expected a device (an NVML index like "
        "2, or a UUID) or --best, e.g. %gpu move --best\n"
    )


def test_a_move_outside_a_kernelspec_kernel_says_in_one_line_what_it_needs(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel not started by the autogpu kernelspec cannot be moved: the reason, whole, as one
    usage line. Caught: the reason replaced by "None" (the error's text not passed on)."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu move --best", capsys)
    assert (r.success, out) == (False, "")
    assert err == (
        "UsageError: %gpu move needs a kernel started with the autogpu kernelspec (its "
        "provisioner picks at each restart). Install one with `autogpu kernelspec install` and "
        "choose \"Python 3 (autogpu)\" as this notebook's kernel; here, `%gpu pick` in a fresh "
        "kernel does the same.\n"
    )


# ---- the sidebar's pick (_pick_one) -------------------------------------------------------------


def test_the_sidebar_pick_takes_its_lease_in_the_registry_of_the_magics_own_settings(
    shell: InteractiveShell, tmp_path: Path
) -> None:
    """A ``GPUMagics`` made with settings of its own (a registry of their own) picks under
    those settings, not the process's defaults: the lease is in that registry. Caught: the pick
    made with no settings (the process's defaults: the lease in the environment's registry)."""
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.core.leasing import Registry

    own = tmp_path / "own-registry"
    gm = magics.GPUMagics(shell, AutoGPU(registry_dir=str(own)))
    ok, summary, _details = gm._pick_one(U[1])
    assert (ok, summary.split(" · ")[0]) == (True, "autogpu: picked GPU 1")
    assert [lease.device_uuids for lease in Registry(str(own)).list_leases()] == [(U[1],)]
    assert Registry(str(tmp_path / "registry")).list_leases() == []


def test_the_sidebar_pick_never_waits_in_line_even_where_the_notebook_says_wait(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A click is not a queue: the sidebar's pick asks with no wait, whatever ``%config
    AutoGPU.wait`` says. Caught: the pick asked to wait a second."""
    from autogpu_jupyter import api

    asked: list[float] = []
    real = api.pick_result

    def recording(opts: Any, **kw: Any) -> Any:
        asked.append(opts.wait_s)
        return real(opts, **kw)

    monkeypatch.setattr(api, "pick_result", recording)
    shell.run_cell('%load_ext autogpu\n%config AutoGPU.wait = "10m"')
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[PICK]["ok"] is True
    assert asked == [0.0]


def test_a_sidebar_pick_on_unreadable_gpus_answers_the_first_line_and_details_all_the_rest(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The devices cannot be read, with a message of three lines: the answer is the first line,
    the details the two others. Caught: the message split at its last line break (two lines as
    the one-line answer)."""
    from autogpu_jupyter import api
    from autogpu_jupyter.errors import NVMLUnavailableError

    def unreadable() -> None:
        raise NVMLUnavailableError("NVIDIA driver not loaded\nis the module loaded?\n"
                                   "or use a simulated fleet")

    monkeypatch.setattr(api, "read_snapshot", unreadable)
    shell.run_cell("%load_ext autogpu")
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[PICK] == {
        "ok": False, "summary": "autogpu: NVIDIA driver not loaded",
        "details": "is the module loaded?\nor use a simulated fleet",
    }


def test_a_sidebar_pick_that_fits_in_no_way_the_ranking_tells_says_it_does_not_fit(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The notebook's defaults ask for two devices and the sidebar's pick has only the one
    clicked: the device itself has no reason against it, so the answer says it does not fit;
    and so does a no-fit error that carries no ranking at all. Caught: those words changed
    (marked, in capitals); a ranking that is no tuple read anyway (a TypeError)."""
    from autogpu_jupyter import api
    from autogpu_jupyter.errors import NoDeviceFitsError

    shell.run_cell("%load_ext autogpu\n%config AutoGPU.count = 2")
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[PICK] == {
        "ok": False, "summary": "autogpu: GPU 1 cannot be picked: it does not fit",
        "details": "asked: 2 devices (this notebook's defaults, %config AutoGPU)\n"
                   "nothing changed: no variable set, no lease taken",
    }

    def no_ranking(*_args: Any, **_kw: Any) -> None:
        raise NoDeviceFitsError("no device fits", candidates=None)

    monkeypatch.setattr(api, "pick_result", no_ranking)
    (answer,) = _sidebar_pick(shell, U[2])
    assert answer[PICK]["summary"] == "autogpu: GPU 2 cannot be picked: it does not fit"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and session.current() is None


def test_a_sidebar_pick_refused_for_two_reasons_names_both_separated_by_a_semicolon(
    shell: InteractiveShell,
) -> None:
    """GPU 1 has too little free memory and too much load for the notebook's defaults: the
    answer names both reasons. Caught: the reasons joined with something else than "; "."""
    shell.run_cell('%load_ext autogpu\n%config AutoGPU.min_free = "79G"\n'
                   '%config AutoGPU.max_util = "5"')
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[PICK]["summary"] == (
        "autogpu: GPU 1 cannot be picked: only 39.5 GiB free < 79.0 GiB wanted; utilisation 97% "
        "> max 5%"
    )


def test_the_sidebar_picks_details_are_its_lease_and_variable_one_a_line(
    shell: InteractiveShell,
) -> None:
    """The details of a sidebar pick: the lease line and the variable, one a line, without the
    "asked:" line. Caught: the lines joined with something else than a line break."""
    shell.run_cell("%load_ext autogpu")
    (answer,) = _sidebar_pick(shell, U[1])
    choice = session.current()
    assert choice is not None and choice.lease_id is not None
    assert answer[PICK]["details"] == (
        f"lease {choice.lease_id} held until this kernel exits or %gpu release\n"
        f"CUDA_VISIBLE_DEVICES={U[1]}"
    )


def test_a_sidebar_pick_after_cuda_started_carries_the_warning_in_its_details(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the notebook lets a pick go on after CUDA started (``refuse_when_initialized =
    False``), the sidebar's details end with the warning that it has no effect until a restart.
    Caught: the pick's warning dropped from the details."""
    from autogpu_jupyter.core.cudastate import CudaState

    monkeypatch.setattr(session, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))
    shell.run_cell("%load_ext autogpu\n%config AutoGPU.refuse_when_initialized = False")
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[PICK]["ok"] is True
    warning = answer[PICK]["details"].splitlines()[-1]
    assert warning.startswith(
        "WARNING --force: CUDA is already initialised in this kernel (cuInit has run (test)).")


def test_a_sidebar_pick_of_the_kernelspecs_own_device_keeps_it_and_says_why(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """In a kernel the kernelspec started on GPU 1, clicking GPU 1 keeps it: the answer's first
    line says "kept", its details why (the kernelspec's lease) and the variable. Caught: the
    details losing their first line (the reason)."""
    _provisioned(monkeypatch, tmp_path, on=U[1])
    shell.run_cell("%load_ext autogpu")
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[PICK]["summary"].split(" · ")[0] == "autogpu: kept GPU 1"
    assert answer[PICK]["details"] == (
        "this kernel was started on it by the autogpu kernelspec and already holds its lease; it "
        f"meets excluding {U[0]}, {U[2]}, {U[3]}, so nothing changed (no second lease)\n"
        f"CUDA_VISIBLE_DEVICES={U[1]}"
    )


# ---- %gpu release ------------------------------------------------------------------------------


def test_release_of_two_devices_names_both(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the released devices' labels joined with something else than ", "."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --count 2")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == (
        "autogpu: released GPU 0, GPU 2 and its lease; CUDA_VISIBLE_DEVICES is unset again\n"
    )


def test_release_on_an_amd_host_names_the_rocm_variable(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], simulated_amd: Path
) -> None:
    """An AMD device was picked (ROCm's variables set): the release says ROCR_VISIBLE_DEVICES
    is unset again. Caught: CUDA_VISIBLE_DEVICES named instead (the vendor never "amd"; the
    vendor compared in capitals or another word), the variable's name changed."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == "autogpu: released GPU 0 and its lease; ROCR_VISIBLE_DEVICES is unset again\n"
    assert "ROCR_VISIBLE_DEVICES" not in os.environ


def test_release_restores_the_visible_devices_the_kernel_had_and_says_which(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel started with ``CUDA_VISIBLE_DEVICES=0,1``: the release puts it back and says
    the value. Caught: the variable always said to be unset again."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == "autogpu: released GPU 0 and its lease; CUDA_VISIBLE_DEVICES restored to '0,1'\n"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"


# ---- %gpu status -------------------------------------------------------------------------------


def test_status_names_a_pending_move_by_the_devices_label(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """After ``%gpu move 3`` in a kernel of the kernelspec, ``%gpu status`` ends with this
    kernel's device and the move waiting for the restart, its target named "GPU 3" (not its
    short UUID). Caught: the pending move not read, or replacing the kernel's own words, or
    its short UUID left (or replaced by "None", or by nothing); the table's columns confused
    (a KeyError, a TypeError)."""
    monkeypatch.setenv("COLUMNS", "160")
    _provisioned(monkeypatch, tmp_path, on=U[1])
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu move 3")
    capsys.readouterr()
    r, out, err = run(shell, "%gpu status", capsys)
    assert (r.success, err) == (True, "")
    assert out.splitlines()[-1] == (
        "this kernel: ▶ GPU 1 (picked by the autogpu kernelspec) · move to GPU 3 pending: restart "
        "the kernel (Kernel > Restart Kernel) to move"
    )


def test_status_names_a_kernelspec_pick_the_host_does_not_list_by_its_uuids(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernelspec gave this kernel two devices the host no longer lists: no row is marked,
    so the last line names them by UUID. Caught: the UUIDs not joined (a TypeError), or joined
    with something else than ", "."""
    monkeypatch.setenv("AUTOGPU_PICKED", "GPU-gone,GPU-lost")
    shell.run_cell("%load_ext autogpu")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu status", capsys)
    assert out.splitlines()[-1] == (
        "this kernel: ▶ GPU-gone, GPU-lost (picked by the autogpu kernelspec)"
    )


def test_status_on_unreadable_gpus_is_the_reason_in_one_usage_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the reason replaced by "None" (the error's text not passed on)."""
    from autogpu_jupyter import api
    from autogpu_jupyter.errors import NVMLUnavailableError

    def unreadable() -> None:
        raise NVMLUnavailableError("NVIDIA driver not loaded")

    monkeypatch.setattr(api, "read_snapshot", unreadable)
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu status", capsys)
    assert (r.success, out, err) == (False, "", "UsageError: NVIDIA driver not loaded\n")


def test_status_reads_the_leases_of_the_magics_own_settings(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A ``GPUMagics`` made with a registry of its own shows that registry's leases (another
    notebook's lease on GPU 1), not those of the process's default registry (empty). Caught:
    the status read with no settings (the process's defaults: the lease not shown)."""
    from autogpu_jupyter.config import AutoGPU

    monkeypatch.setenv("COLUMNS", "200")
    own = tmp_path / "own-registry"
    held = _other_holders_lease(own, U[1], "/home/ana/train.ipynb")
    try:
        magics.GPUMagics(shell, AutoGPU(registry_dir=str(own)))._status()
    finally:
        held.release()
    out = capsys.readouterr().out
    (row,) = [ln for ln in out.splitlines() if ln.startswith("  GPU 1 ")]
    assert row.split("  ")[-1] == (
        f"{_me()}: /home/ana/train.ipynb, pid 1000001 (40.0 GiB used)"
    )


def test_status_of_a_simulated_fleet_says_so_after_the_variable_went(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    simulated: Path,
) -> None:
    """The kernel's sampler reads a simulated fleet, then ``AUTOGPU_SIMULATE`` is unset: the
    status (from the sampler's reading) still says SIMULATED, with the variable now empty.
    Caught: the empty value shown as "None" (or as another word)."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    monkeypatch.delenv("AUTOGPU_SIMULATE")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu status", capsys)
    assert out.splitlines()[0] == "GPUs on this host — SIMULATED fleet (AUTOGPU_SIMULATE=)"


def test_status_in_a_notebook_captions_its_table_and_marks_this_kernels_row(
    shell: InteractiveShell,
) -> None:
    """The notebook's table has the title and this kernel's line as its caption, and the row of
    this kernel's device (only that one) marked. Caught: the caption left out or empty; the
    row not marked."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --min-free 10G")
    (data,) = _displays(shell, "%gpu status")
    html = data["text/html"]
    assert re.findall(r"<caption[^>]*>(.*?)</caption>", html) == [
        "GPUs on this host · this kernel: ▶ GPU 0 (%gpu pick, min free 10.0 GiB)"
    ]
    marked = re.findall(r'<tr data-mine="1"[^>]*>(.*?)</tr>', html)
    assert [re.findall(r"<td[^>]*>(.*?)</td>", row)[:2] for row in marked] == [["▶", "GPU 0"]]


def test_status_in_a_notebook_is_laid_out_for_120_columns(
    shell: InteractiveShell, fake_nvml: FakeNvml, tmp_path: Path
) -> None:
    """The notebook's plain-text table is laid out for 120 columns: with a model name 28
    characters long, the power column is left out (it fits only from 121 on) and another
    notebook's long path is cut at exactly column 120. Caught: the columns chosen for 121
    (one line 121 long) or the lines laid out for 121."""
    fleet = fleet_4x()
    fleet["devices"][0]["name"] = "N" * 28  # a model name 28 characters long
    fake_nvml.write(fleet)
    held = _other_holders_lease(tmp_path / "registry", U[0], "/" + "n" * 200 + ".ipynb")
    try:
        shell.run_cell("%load_ext autogpu")
        (data,) = _displays(shell, "%gpu status")
    finally:
        held.release()
    lines = data["text/plain"].splitlines()
    assert lines[1].split() == ["gpu", "name", "util", "memory", "used", "/", "total", "free",
                                "temp", "procs", "holders"]
    assert max(len(ln) for ln in lines) == 120


def test_status_in_a_terminal_of_unknown_size_is_laid_out_for_100_columns(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    fake_nvml: FakeNvml, tmp_path: Path,
) -> None:
    """No COLUMNS and no terminal to ask: the table is laid out for 100 columns (with a model
    name 22 characters long, the procs column is left out: it fits only from 101 on; another
    notebook's long path is cut at exactly column 100). Caught: 101 columns assumed."""

    def no_terminal(*_args: Any) -> os.terminal_size:
        raise OSError("not a terminal")

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(os, "get_terminal_size", no_terminal)
    fleet = fleet_4x()
    fleet["devices"][0]["name"] = "N" * 22  # a model name 22 characters long
    fake_nvml.write(fleet)
    held = _other_holders_lease(tmp_path / "registry", U[0], "/" + "n" * 200 + ".ipynb")
    try:
        shell.run_cell("%load_ext autogpu")
        _, out, _ = run(shell, "%gpu status", capsys)
    finally:
        held.release()
    lines = out.splitlines()
    assert lines[1].split() == ["gpu", "name", "util", "memory", "used", "/", "total", "free",
                                "holders"]
    assert max(len(ln) for ln in lines) == 100


# ---- %%gpu ---------------------------------------------------------------------------------


def test_a_cells_bad_option_is_refused_in_the_cells_own_name(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the refusal named "%gpu pick" (or "None", or another word) instead of
    "%%gpu"."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%%gpu --bogus\nnever_set = 1", capsys)
    assert (r.success, out) == (False, "")
    assert err == (
        f"UsageError: %%gpu: unrecognized arguments: --bogus; accepted options: "
        f"{magics.PICK_OPTIONS} (see %gpu?)\n"
    )
    assert "never_set" not in shell.user_ns


def test_a_cell_that_finds_no_device_tells_how_to_wait_on_a_cell(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """No device fits a ``%%gpu`` cell's options: the hint shows the ``--wait`` on a cell.
    Caught: the hint written for ``%gpu pick`` (or for "None", or another word)."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%%gpu --min-free 500G\nnever_set = 1", capsys)
    assert not r.success and "never_set" not in shell.user_ns
    assert (out + err).splitlines()[-1] == (
        "  nothing changed; to wait in line until a device fits, add --wait: %%gpu ... --wait 10m "
        "(interrupt the kernel to cancel)"
    )


def test_a_cell_on_two_devices_names_both_in_its_report(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the devices' labels joined with something else than ", "."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --count 2")
    capsys.readouterr()
    r, out, _ = run(shell, "%%gpu\nx = 1", capsys)
    assert r.success
    assert out.splitlines()[-1].startswith("autogpu %%gpu on GPU 0, GPU 2: wall ")


def test_a_cell_whose_sampler_has_no_reading_names_both_its_devices_by_uuid(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the UUIDs joined with something else than ", "."""
    from autogpu_jupyter.core import sampler as sampler_mod

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --count 2")
    capsys.readouterr()
    monkeypatch.setattr(sampler_mod, "get_sampler", lambda *_a, **_k: _BlindSampler())
    r, out, _ = run(shell, "%%gpu\nx = 3", capsys)
    assert r.success
    assert out.splitlines()[-1].startswith(f"autogpu %%gpu on {U[0]}, {U[2]}: wall ")


def test_a_cell_on_a_simulated_fleet_says_so_in_its_report(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], simulated: Path
) -> None:
    """Caught: the report never marked SIMULATED (the flag dropped where it is found or where
    it is passed to the report)."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    r, out, _ = run(shell, "%%gpu\nx = 1", capsys)
    assert r.success
    assert out.splitlines()[-1].startswith("autogpu [SIMULATED] %%gpu on GPU 0: wall ")


def test_a_cell_without_a_sampler_logs_why(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Where no sampler can start, a debug record says why. Caught: the record's text changed,
    or made without the reason (or with "None" for it), or of the reason alone."""
    from autogpu_jupyter.core import sampler as sampler_mod
    from autogpu_jupyter.errors import AutoGPUError

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")

    def no_sampler(*_args: Any, **_kwargs: Any) -> Any:
        raise AutoGPUError("no sampler (test)")

    monkeypatch.setattr(sampler_mod, "get_sampler", no_sampler)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.magics")
    r, _, _ = run(shell, "%%gpu\nx = 2", capsys)
    assert r.success
    assert [rec.getMessage() for rec in caplog.records if rec.name == "autogpu_jupyter.magics"] == [
        "no sampler for %%gpu: no sampler (test)"
    ]


def test_a_cells_wall_time_is_the_time_between_its_start_and_its_end(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clock reads 100.0 s when the cell starts and 102.5 s when it ends: the report says
    2.5 s. Caught: the two readings added instead of subtracted."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    import time

    readings = iter([100.0, 102.5])
    fake_time = types.SimpleNamespace(perf_counter=lambda: next(readings), time=time.time)
    monkeypatch.setattr(magics, "time", fake_time)
    r, out, _ = run(shell, "%%gpu\nx = 1", capsys)
    assert r.success
    assert out.splitlines()[-1].startswith("autogpu %%gpu on GPU 0: wall 2.5s · ")


def test_a_cells_body_is_not_stored_in_the_history(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """The body of a ``%%gpu`` cell runs as a cell IPython does not store: its pre-run event
    says store_history False, as for the cell that holds it. Caught: the body stored in the
    history (True), or store_history passed as None."""
    shell.run_cell("%load_ext autogpu")
    seen: list[object] = []

    def pre(info: Any) -> None:
        seen.append(info.store_history)

    shell.events.register("pre_run_cell", pre)
    try:
        r, _, _ = run(shell, "%%gpu\nx = 1", capsys)
    finally:
        shell.events.unregister("pre_run_cell", pre)
    assert r.success
    assert seen == [False, False]


def test_a_cell_raising_an_exception_that_takes_no_attributes_fails_with_that_exception(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frozen dataclass exception refuses the one-line traceback the cell adds to what it
    raises: the ``%%gpu`` cell still fails with that very exception. Caught: the refusal (an
    AttributeError) no longer suppressed (a TypeError instead)."""
    shell.run_cell("%load_ext autogpu")
    code = (
        "%%gpu\nimport dataclasses\n"
        "@dataclasses.dataclass(frozen=True)\nclass Frozen(Exception):\n    code: int\n"
        "raise Frozen(3)"
    )
    r, out, _ = run(shell, code, capsys)
    assert type(r.error_in_exec) is shell.user_ns["Frozen"]
    assert "autogpu %%gpu on GPU 0: wall " in out


def test_a_forced_line_pick_after_cuda_started_prints_the_warning_last(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``%gpu pick --force`` once CUDA has started picks and says, last, that the pick came too
    late. Caught: the summary printed without the warning."""
    from autogpu_jupyter.core.cudastate import CudaState

    monkeypatch.setattr(session, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))
    shell.run_cell("%load_ext autogpu")
    r, out, _ = run(shell, "%gpu pick --force", capsys)
    assert r.success
    assert out.splitlines()[-1].startswith(
        "  WARNING --force: CUDA is already initialised in this kernel (cuInit has run (test)).")


# ---- a kernel's device against a cell's options (_violations) ------------------------------------


def test_a_cell_on_this_kernels_exclusive_lease_does_not_count_that_lease_against_it(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``%gpu pick --exclusive --min-free 70G``, a ``%%gpu`` cell with the same options
    finds the kernel's own device fine: its own lease (exclusive, 70 GiB booked) is not held
    against it. Caught: the device checked as a bare choice without its lease (the kernel's
    own lease then counted against it)."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --exclusive --min-free 70G")
    capsys.readouterr()
    r, out, _ = run(shell, "%%gpu --exclusive --min-free 70G\nx = 1", capsys)
    assert r.success
    assert len(out.splitlines()) == 1
    assert out.startswith("autogpu %%gpu on GPU 0: wall ")


def test_a_cell_whose_options_cannot_be_read_on_a_kernel_with_a_device_is_one_usage_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the reason replaced by "None" (the error's text not passed on)."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    r, out, err = run(shell, "%%gpu --min-free lots\nnever_set = 1", capsys)
    assert (r.success, out) == (False, "")
    assert err == (
        "UsageError: invalid size 'lots': not understood; expected a number with a unit, e.g. "
        "10G, 10GiB, 512M, 0.5T, 16GB (decimal), or a share of the device like 25%\n"
    )
    assert "never_set" not in shell.user_ns


def test_a_cell_whose_device_fails_two_ways_lists_each_on_its_own_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the reasons joined with something else than a line break."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    r, out, _ = run(shell, "%%gpu --count 2 --min-free 79G\nx = 1", capsys)
    assert r.success
    assert out.splitlines()[:3] == [
        "autogpu: this kernel already has a GPU that does not meet min free 79.0 GiB, 2 devices "
        "(kept; to change: %gpu release, restart the kernel, %gpu pick):",
        "  it has 1 device(s), 2 asked for",
        "  GPU 0: only 77.5 GiB free < 79.0 GiB wanted",
    ]


# ---- %gpu pick (_pick, _run_pick) ---------------------------------------------------------------


def _waits_then(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    """Make every pick wait in line once (one progress line), then end with ``error``."""
    from autogpu_jupyter import api

    def waits(*_args: Any, on_progress: Any, **_kw: Any) -> None:
        on_progress("waiting for a device (1s)")
        raise error

    monkeypatch.setattr(api, "pick_result", waits)


@pytest.mark.parametrize(
    ("error", "word", "message"),
    [
        (KeyboardInterrupt(), "cancelled",
         "UsageError: pick cancelled (interrupted): no device picked, no lease kept, environment "
         "unchanged\n"),
        (RegistryError("lease registry unreadable (test)"), "gave up",
         "UsageError: lease registry unreadable (test)\n"),
    ],
)
def test_a_pick_waiting_in_a_notebook_shows_one_line_and_marks_how_it_ended(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    error: BaseException, word: str, message: str,
) -> None:
    """In a kernel, a pick that waits shows its waiting line as a display, then marks it
    "cancelled" (an interrupt) or "gave up" (an error), and the error is one usage line.
    Caught: the progress not given to the pick (a TypeError), or given as if in a terminal
    (lines written to stdout); the mark's word changed or "None"; the interrupt's message
    changed or "None"."""
    _waits_then(monkeypatch, error)
    monkeypatch.setattr(magics.GPUMagics, "_in_kernel", lambda self: True)
    shell.run_cell("%load_ext autogpu")
    shown = _capture_displays(shell, monkeypatch)
    capsys.readouterr()
    r, out, err = run(shell, "%gpu pick", capsys)
    assert (r.success, out, err) == (False, "", message)
    assert shown == [
        ({"text/plain": "waiting for a device (1s)"}, False),
        ({"text/plain": f"waiting for a device: {word}"}, True),
    ]


def test_a_pick_that_waited_in_a_notebook_and_found_nothing_marks_its_line_gave_up(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught: the waiting line of a pick that found no device marked with another word, or
    "None"."""
    _waits_then(monkeypatch, NoDeviceFitsError("no device fits (min free 500.0 GiB):"))
    monkeypatch.setattr(magics.GPUMagics, "_in_kernel", lambda self: True)
    shell.run_cell("%load_ext autogpu")
    shown = _capture_displays(shell, monkeypatch)
    r, _, _ = run(shell, "%gpu pick --min-free 500G --wait 1s", capsys)
    assert not r.success
    assert shown == [
        ({"text/plain": "waiting for a device (1s)"}, False),
        ({"text/plain": "waiting for a device: gave up"}, True),
    ]


def test_a_dry_run_changes_nothing(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """``%gpu pick --dry-run`` shows the ranking and sets no variable, takes no lease, makes no
    choice. Caught: the dry run not passed on to the pick (a real pick made, then its ranking
    shown)."""
    shell.run_cell("%load_ext autogpu")
    r, out, _ = run(shell, "%gpu pick --dry-run", capsys)
    assert r.success
    assert out.splitlines()[0] == "autogpu dry run (any device): nothing changed"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and session.current() is None


def test_a_line_pick_takes_its_lease_in_the_registry_of_the_magics_own_settings(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A ``GPUMagics`` made with a registry of its own picks under those settings: the lease is
    in that registry. Caught: the pick made with no settings (the process's defaults)."""
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.core.leasing import Registry

    own = tmp_path / "own-registry"
    magics.GPUMagics(shell, AutoGPU(registry_dir=str(own)))._pick(magics._parse_pick([]))
    assert capsys.readouterr().out.startswith("autogpu: picked GPU 0 · ")
    assert [lease.device_uuids for lease in Registry(str(own)).list_leases()] == [(U[0],)]
    assert Registry(str(tmp_path / "registry")).list_leases() == []


def test_a_repeated_pick_on_the_same_device_prints_its_summary_alone(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second ``%gpu pick`` that lands on the kernel's device again prints its summary, ending
    with the variable, and no "already on the best device" line (that is the dry run's).
    Caught: that line added to every pick that lands where the kernel already is."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    r, out, _ = run(shell, "%gpu pick", capsys)
    assert r.success
    assert out.splitlines()[-1] == f"  CUDA_VISIBLE_DEVICES={U[0]}"


def test_a_dry_run_after_a_two_device_pick_names_both_devices_it_is_already_on(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the two labels joined with something else than ", "."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --count 2")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu pick --count 2 --dry-run", capsys)
    assert out.splitlines()[-1] == (
        "  you are already on the best device (GPU 0, GPU 2): nothing to change"
    )


def test_a_move_to_a_word_that_only_contains_best_is_no_move_to_the_best(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Only "best" and "--best" (any case) mean the best device; another word is a device id,
    refused when no device has it. Caught: a word merely containing "best" taken for best."""
    _provisioned(monkeypatch, tmp_path, on=U[1])
    shell.run_cell("%load_ext autogpu")
    capsys.readouterr()
    r, out, err = run(shell, "%gpu move XXbestXX", capsys)
    assert (r.success, out) == (False, "")
    assert err == (
        "UsageError: unknown device 'XXbestXX' for a move: expected an NVML index (0, 1, 2, 3), a "
        "(unique) UUID, or --best\n"
    )
