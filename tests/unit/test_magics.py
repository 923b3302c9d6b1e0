"""``%gpu`` / ``%%gpu`` in an in-process IPython ``InteractiveShell`` (the fast cases).

The devices come from the fake ``libnvidia-ml.so.1`` through the real pynvml binding
(``fake_nvml``), or from a simulated fleet file where the SIMULATED label is under test. The
real-kernel behaviour (os.environ inside a kernel, interrupts, too late) is in
``tests/kernel/test_magics.py``.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from autogpu_jupyter import magics
from autogpu_jupyter.core import session
from autogpu_jupyter.core.sampler import THREAD_NAME, stop_sampler
from tests.fakenvml import FakeNvml, fleet_4x

U = [d["uuid"] for d in fleet_4x()["devices"]]


def sampler_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == THREAD_NAME)


@pytest.fixture
def shell(
    fake_nvml: FakeNvml, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[InteractiveShell]:
    """The process's InteractiveShell with nothing loaded, over the 4-GPU fake host."""
    fake_nvml.write(fleet_4x())
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    cfg = Config()
    cfg.HistoryManager.hist_file = ":memory:"
    sh = InteractiveShell.instance(config=cfg)
    yield sh
    for name in ("autogpu", "autogpu_jupyter"):
        sh.extension_manager.unload_extension(name)
    session.release()
    stop_sampler()
    sh.config.pop("AutoGPU", None)


def run(
    sh: InteractiveShell, code: str, capsys: pytest.CaptureFixture[str]
) -> tuple[Any, str, str]:
    result = sh.run_cell(code)
    out, err = capsys.readouterr()
    return result, out, err


def test_load_twice_under_both_names_registers_once(shell: InteractiveShell) -> None:
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.magics import _overload_hook

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%load_ext autogpu_jupyter")
    assert sum(isinstance(c, AutoGPU) for c in shell.configurables) == 1
    assert shell.events.callbacks["post_run_cell"].count(_overload_hook) == 1
    assert shell.find_line_magic("gpu") is not None and shell.find_cell_magic("gpu") is not None


def test_load_is_cheap_and_starts_nothing(shell: InteractiveShell) -> None:
    shell.run_cell("%load_ext autogpu")
    assert sampler_threads() == 0


def test_reload_keeps_one_sampler_and_unload_leaves_no_thread(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%load_ext autogpu")
    r, out, _ = run(shell, "%%gpu\nx = 1", capsys)
    assert r.success and sampler_threads() == 1
    shell.run_cell("%reload_ext autogpu")
    # unload stopped it; the load found this kernel's pick and watches it again: exactly one
    assert sampler_threads() == 1
    r, out, _ = run(shell, "%%gpu\nx = 2", capsys)
    assert r.success and sampler_threads() == 1
    assert "autogpu %%gpu on GPU 0: wall " in out
    shell.run_cell("%unload_ext autogpu")
    assert sampler_threads() == 0
    assert shell.find_line_magic("gpu") is None and shell.find_cell_magic("gpu") is None
    # the pick survives the unload: the variables keep their values
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[0]


def test_unload_leaves_a_gpu_magic_registered_since_by_someone_else(
    shell: InteractiveShell,
) -> None:
    """A ``%gpu`` line magic registered after autogpu's (a plain function, bound to no magics
    object) is not autogpu's: unloading leaves it in place and succeeds. Caught (issue 22, seed
    54): the owner check asked for the function's ``__self__`` without a default (the unload
    failed with an AttributeError)."""
    shell.run_cell("%load_ext autogpu")

    def gpu(line: str) -> str:
        return f"theirs: {line}"

    mm = shell.magics_manager
    shell.register_magic_function(gpu, "line", "gpu")
    try:
        assert shell.run_cell("%unload_ext autogpu").success
        assert shell.find_line_magic("gpu") is gpu
        assert shell.find_cell_magic("gpu") is None  # autogpu's own cell magic went
    finally:
        mm.magics["line"].pop("gpu", None)
        if hasattr(mm.user_magics, "gpu"):
            delattr(mm.user_magics, "gpu")


def test_line_pick_starts_the_one_sampler_and_reload_keeps_one(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%load_ext autogpu")
    r, _, _ = run(shell, "%gpu pick --dry-run", capsys)
    assert r.success and sampler_threads() == 0  # a dry run picks nothing: nothing to watch
    r, _, _ = run(shell, "%gpu pick --min-free 500G", capsys)
    assert not r.success and sampler_threads() == 0  # nothing picked: nothing to watch
    r, _, _ = run(shell, "%gpu pick", capsys)
    assert r.success and sampler_threads() == 1
    r, _, _ = run(shell, "%gpu pick --exclude 0", capsys)
    assert r.success and sampler_threads() == 1  # a re-pick keeps the one sampler
    shell.run_cell("%reload_ext autogpu")
    assert sampler_threads() == 1
    shell.run_cell("%unload_ext autogpu")
    assert sampler_threads() == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[2]


def test_config_sets_defaults_and_flags_win(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%load_ext autogpu")
    shell.run_cell('%config AutoGPU.min_free = "70G"')
    _, out, _ = run(shell, "%gpu pick --dry-run", capsys)
    assert out.splitlines()[0] == "autogpu dry run (min free 70.0 GiB): nothing changed"
    _, out, _ = run(shell, "%gpu pick --dry-run --min-free 1G --max-util 50", capsys)
    assert (
        out.splitlines()[0] == "autogpu dry run (min free 1.0 GiB, max util 50%): nothing changed"
    )
    # the Python API in this shell sees the same settings
    import autogpu_jupyter as ag

    assert ag.pick()[0].uuid == U[0]
    assert session.current().constraints_text == "min free 70.0 GiB"  # type: ignore[union-attr]


def test_config_file_value_and_pick_on_load(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.config.AutoGPU.pick_on_load = True
    shell.config.AutoGPU.max_util = "50"
    shell.config.AutoGPU.count = 2
    _, out, _ = run(shell, "%load_ext autogpu", capsys)
    assert out.splitlines()[0] == "autogpu: picked 2 devices:"
    assert "  asked: max util 50%, 2 devices · no runner-up (nothing else fits)" in out
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{U[0]},{U[2]}"


def test_pick_on_load_that_fails_says_so_and_loads(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.config.AutoGPU.pick_on_load = True
    shell.config.AutoGPU.min_free = "500G"
    _, _, err = run(shell, "%load_ext autogpu", capsys)
    assert err.splitlines()[0] == (
        "autogpu: pick_on_load did not pick: no device fits (min free 500.0 GiB):"
    )
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert shell.find_line_magic("gpu") is not None


def test_help_is_written_for_notebook_users(shell: InteractiveShell) -> None:
    shell.run_cell("%load_ext autogpu")
    doc = shell.find_line_magic("gpu").__doc__
    assert "%gpu pick --min-free 10G          # the best GPU with 10 GiB free" in doc
    assert "%%gpu --min-free 10G" in doc
    assert "--wait DURATION" in doc and "Interrupt the kernel to cancel." in doc
    # plain text, not reStructuredText: no ``literals``, no "::" blocks, one usage of %gpu pick
    assert "``" not in doc and "::" not in doc
    assert "(import torch is fine, torch.cuda is not):" in doc
    assert doc.count("usage: %gpu pick [--min-free SIZE]") == 1 and "_pick_options" not in doc
    assert "%gpu move --best" in doc


def test_the_pick_help_opens_with_the_whole_usage_of_gpu_pick() -> None:
    """What ``%gpu?`` ends with: the usage of ``%gpu pick`` (its options in order, wrapped at 90
    columns), then the options explained. Caught (issue 22, seed 54): the usage built with no
    list of option groups (a TypeError, so no help; the help is made once, at import)."""
    text = magics._pick_help()
    assert text.splitlines()[:5] == [
        "usage: %gpu pick [--min-free SIZE] [--max-util PCT] [--count N] [--exclude IDS]",
        "                 [--exclusive] [--wait DURATION] [--model NAMES] [--prefer NAMES]",
        "                 [--devices IDS] [--dry-run] [--force]",
        "                 [IDS]",
        "",
    ]
    assert text.splitlines()[5] == "pick options (also on top of a %%gpu cell):"
    assert magics.GPUMagics.gpu.__doc__.endswith(text)


def test_an_argparse_exit_is_one_usage_line_naming_the_words_not_a_kernel_exit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where argparse exits by itself (its help and version actions call ``exit()``), the magic
    answers one UsageError line quoting the words it was given, and the kernel lives on.
    Caught (issue 22, seed 54): the words quoted from nothing (a TypeError instead)."""

    def exits(args: Any) -> Any:
        magics._PICK_PARSER.exit(2)

    monkeypatch.setattr(magics._PICK_PARSER, "parse_args", exits)
    magics._parsed.cache_clear()
    try:
        with pytest.raises(UsageError) as info:
            magics._parse_pick(["--count", "2", "--exclusive"], where="%%gpu")
    finally:
        magics._parsed.cache_clear()
    assert str(info.value) == (
        f"%%gpu: invalid options '--count 2 --exclusive'; accepted options: {magics.PICK_OPTIONS} "
        "(see %gpu?)"
    )


def test_status_plain_text_in_a_terminal(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # a wide terminal: every column
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --exclude 0")  # GPU 2 (L4, 12 %) is the least loaded of GPUs 1-3
    capsys.readouterr()
    r, out, _ = run(shell, "%gpu status", capsys)
    assert r.success
    lines = out.splitlines()
    assert lines[0] == "GPUs on this host"
    assert lines[1].split()[:4] == ["gpu", "name", "uuid", "util"]
    # one row per device; a long holders cell continues under its column on the next line
    holders_at = lines[1].index("holders")
    rows = [ln for ln in lines[2:-1] if ln[:holders_at].strip()]
    assert all(len(ln) - len(ln.lstrip()) == holders_at for ln in lines[2:-1] if ln not in rows)
    assert [ln.split()[:3] for ln in rows[0:2]] == [["GPU", "0", "NVIDIA"], ["GPU", "1", "NVIDIA"]]
    assert rows[2].split()[:5] == ["▶", "GPU", "2", "NVIDIA", "L4"]
    assert rows[3].split()[:3] == ["GPU", "3", "NVIDIA"]
    assert lines[-1] == "this kernel: ▶ GPU 2 (%gpu pick, excluding 0)"
    # an 80-column terminal: the table fits it, without the columns it can do without
    monkeypatch.setenv("COLUMNS", "80")
    _, out, _ = run(shell, "%gpu status", capsys)
    narrow = out.splitlines()
    assert narrow[1].split() == ["gpu", "name", "util", "free", "holders"]
    assert all(len(ln) <= 80 for ln in narrow[1:-1]), out


def test_status_says_simulated(
    shell: InteractiveShell,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from autogpu_jupyter.core import backends

    fleet = tmp_path / "fleet.json"
    fleet.write_text(json.dumps(fleet_4x()))
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet))
    backends._cache.clear()
    shell.run_cell("%load_ext autogpu")
    _, out, _ = run(shell, "%gpu", capsys)
    assert out.splitlines()[0] == f"GPUs on this host — SIMULATED fleet (AUTOGPU_SIMULATE={fleet})"
    _, out, _ = run(shell, "%gpu pick", capsys)
    assert out.startswith("autogpu [SIMULATED]: picked GPU 0 · NVIDIA A100-SXM4-80GB")
    backends._cache.clear()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("%gpu status now", "UsageError: %gpu status takes no options, got 'now'"),
        ("%gpu release all", "UsageError: %gpu release takes no options, got 'all'"),
        ("%gpu panel --window 5m", "UsageError: %gpu panel takes no options, got '--window 5m'"),
        (
            "%gpu --min-free 10G",
            "UsageError: %gpu: unknown subcommand '--min-free'; expected one of "
            "pick, status, release, panel, move (see %gpu?); "
            "did you mean %gpu pick --min-free 10G?",
        ),
        (
            "%gpu pick --min-free '10G",
            'UsageError: %gpu: cannot read "pick --min-free \'10G": No closing quotation',
        ),
        (
            "%%gpu --dry-run\nnever_set = 1",
            "UsageError: %%gpu: --dry-run is for %gpu pick (a dry run would not run the cell)",
        ),
        (
            "%%gpu --count x\nnever_set = 1",
            "UsageError: invalid --count 'x': expected a whole number >= 1, e.g. 2",
        ),
    ],
)
def test_usage_errors_are_one_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    shell.run_cell("%load_ext autogpu")
    r, _, err = run(shell, line, capsys)
    assert not r.success
    assert err == message + "\n"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert "never_set" not in shell.user_ns


def test_release_when_nothing_was_picked_and_bare_move(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%load_ext autogpu")
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == "autogpu: nothing to release (no GPU picked in this kernel)\n"
    r, out, err = run(shell, "%gpu move", capsys)
    assert not r.success and out == ""
    assert err == (
        "UsageError: %gpu move takes one target, got 'none'; expected a device (an NVML index "
        "like 2, or a UUID) or --best, e.g. %gpu move --best\n"
    )


def test_a_move_counts_the_other_holders_leases(
    shell: InteractiveShell,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """``%gpu move --best`` in a kernel the kernelspec started on GPU 1: another kernel's
    exclusive lease keeps the move off GPU 0 (the idlest), so it goes to GPU 2, and the request
    is written. Caught (issue 22, seed 54): the move planned without the lease store (onto the
    device another kernel holds exclusively)."""
    from autogpu_jupyter.core import moves
    from autogpu_jupyter.core.leasing import Registry, Requester

    shell.run_cell("%load_ext autogpu")
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    move_file = runtime / "autogpu-move-k-3.json"
    for name, value in (("AUTOGPU_PROVISIONED", "1"), ("AUTOGPU_MOVE_FILE", str(move_file)),
                        ("AUTOGPU_PICKED", U[1]), ("CUDA_VISIBLE_DEVICES", U[1])):
        monkeypatch.setenv(name, value)
    with Registry(str(tmp_path / "registry")).locked() as txn:
        assert txn is not None
        held = txn.create(devices=[U[0]], exclusive=True, requester=Requester(kernel_id="other"))
    try:
        capsys.readouterr()
        r, out, err = run(shell, "%gpu move --best", capsys)
    finally:
        held.release()
    assert r.success, err
    assert out.startswith("The kernel will restart on GPU 2 (NVIDIA L4, ")
    request = moves.read_move(move_file)
    assert request is not None and request.target_uuids == (U[2],)


def test_cell_errors_propagate_after_the_report(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%load_ext autogpu")
    r, out, _ = run(shell, "%%gpu\ny = 5\n1 / 0", capsys)
    assert isinstance(r.error_in_exec, ZeroDivisionError)
    assert shell.user_ns["y"] == 5
    assert out.splitlines()[0].startswith("autogpu: picked GPU 0")
    assert "autogpu %%gpu on GPU 0: wall " in out
    assert out.count("Traceback (most recent call last)") == 1  # shown once, not twice
    assert "ZeroDivisionError: division by zero (in the %%gpu cell; traceback above)" in out


def test_a_cell_that_cannot_run_fails_the_gpu_cell_too(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """A syntax error in the body (an error before it runs) fails the ``%%gpu`` cell, so that
    "Run all" stops there. Caught: only errors raised while running were passed on."""
    shell.run_cell("%load_ext autogpu")
    r, out, _ = run(shell, "%%gpu\ny = (", capsys)
    assert isinstance(r.error_in_exec, SyntaxError)  # the %%gpu cell itself failed
    assert "autogpu %%gpu on GPU 0: wall " in out


def test_a_kernels_device_that_the_host_no_longer_lists_is_said_not_crashed_on(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A kernel the autogpu kernelspec started on a device this host does not list any more
    # (a GPU that fell off the bus, a fleet that changed): its options are checked, not crashed.
    monkeypatch.setenv("AUTOGPU_PICKED", "GPU-gone")
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%%gpu --min-free 1G\ny = 5", capsys)
    assert r.error_in_exec is None and r.error_before_exec is None, err
    assert shell.user_ns["y"] == 5
    assert out.splitlines()[:2] == [
        "autogpu: this kernel already has a GPU that does not meet min free 1.0 GiB (kept; to "
        "change: %gpu release, restart the kernel, %gpu pick):",
        "  GPU-gone: not among this host's devices now",
    ]


def test_each_cell_removes_its_listener_from_the_sampler(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``%%gpu`` cell listens to the kernel's sampler while it runs, and only then. Caught:
    the per-cell listener never unsubscribed (every cell would leave one behind in the sampler
    thread, adding up samples for ever), also when the cell fails."""
    from autogpu_jupyter.core.sampler import current_sampler

    shell.run_cell("%load_ext autogpu")
    shell.user_ns["current_sampler"] = current_sampler
    for n, code in enumerate(("x = 1", "x = 2", "1 / 0")):
        r, out, _ = run(shell, f"%%gpu\nduring = current_sampler().listener_count\n{code}",
                        capsys)
        assert ("autogpu %%gpu on GPU 0: wall " in out) and (r.success is (n < 2))
        assert shell.user_ns["during"] == 1
        sampler = current_sampler()
        assert sampler is not None and sampler.listener_count == 0


def test_cell_reports_peak_memory_of_this_process(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], fake_nvml: FakeNvml
) -> None:
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    # the cell "allocates" 3 GiB on GPU 0 as this very process (the fake driver lists our PID)
    shell.user_ns["fake"] = fake_nvml
    shell.user_ns["me"] = os.getpid()
    r, out, _ = run(
        shell,
        "%%gpu\nfake.set(0, processes=[{'pid': me, 'used_memory': 3 * 1024**3}], "
        "memory_used=5 * 1024**3, utilization_pct=40)",
        capsys,
    )
    assert r.success, out
    assert out.splitlines()[-1].split(" · ")[1:] == [
        "peak GPU memory of this kernel 3.0 GiB",
        "mean utilisation 40% (1 sample)",
    ]


def test_a_forced_cell_after_cuda_started_prints_the_warning_with_its_pick(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``%%gpu --force`` once CUDA has started picks, runs the cell and says the pick came too
    late, under the summary. Caught (issue 22, seed 53): the cell's summary printed without it."""
    from autogpu_jupyter.core.cudastate import CudaState

    monkeypatch.setattr(session, "cuda_state",
                        lambda: CudaState(True, "cuInit has run (test)", None))
    shell.run_cell("%load_ext autogpu")
    r, out, _ = run(shell, "%%gpu --force\nx = 1", capsys)
    assert r.success and shell.user_ns["x"] == 1
    (warning,) = [ln for ln in out.splitlines() if "WARNING" in ln]
    assert warning.startswith(
        "  WARNING --force: CUDA is already initialised in this kernel (cuInit has run (test)).")


def test_a_cell_without_a_sampler_reports_its_wall_time_only(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where no sampler can start, the cell still runs and its report says the GPU was not
    readable. Caught (issue 22, seed 53): the sampler's report used without a sampler."""
    from autogpu_jupyter.core import sampler as sampler_mod
    from autogpu_jupyter.errors import AutoGPUError

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()

    def no_sampler(*_args: Any, **_kwargs: Any) -> Any:
        raise AutoGPUError("no sampler (test)")

    monkeypatch.setattr(sampler_mod, "get_sampler", no_sampler)
    r, out, _ = run(shell, "%%gpu\nx = 2", capsys)
    assert r.success and shell.user_ns["x"] == 2
    assert re.fullmatch(
        r"autogpu %%gpu: wall \d+\.\d\ds · GPU not readable \(no sampler\)",
        out.splitlines()[-1])


class _BlindSampler:
    """A sampler that has read nothing yet and cannot read now (every reading ``None``)."""

    def latest(self) -> None:
        return None

    def sample_now(self) -> None:
        return None

    def subscribe(self, _fn: Any) -> None:
        pass

    def unsubscribe(self, _fn: Any) -> None:
        pass


def test_a_cell_whose_sampler_has_no_reading_names_its_devices_by_uuid(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reading to take labels from: the report names the device by its UUID. Caught (issue
    22, seed 53): the UUIDs not joined (a TypeError instead of the report)."""
    from autogpu_jupyter.core import sampler as sampler_mod

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    monkeypatch.setattr(sampler_mod, "get_sampler", lambda *_a, **_k: _BlindSampler())
    r, out, _ = run(shell, "%%gpu\nx = 3", capsys)
    assert r.success and shell.user_ns["x"] == 3
    assert out.splitlines()[-1].startswith(f"autogpu %%gpu on {U[0]}: wall ")
    assert out.splitlines()[-1].endswith(
        " · peak GPU memory of this kernel unknown · mean utilisation unknown (not reported for "
        "this device) (0 samples)")


# ---- the sidebar's pick ------------------------------------------------------------------------


def _sidebar_pick(shell: InteractiveShell, uuid: str) -> list[dict[str, Any]]:
    """Run what the sidebar runs; the displays it made (its answer among them)."""
    from IPython.core.displaypub import DisplayPublisher

    shown: list[dict[str, Any]] = []

    class Capture(DisplayPublisher):
        def publish(self, data: Any, metadata: Any = None, **kw: Any) -> None:
            shown.append(data)

    old = shell.display_pub
    shell.display_pub = Capture(shell=shell)
    try:
        r = shell.run_cell(
            f'__import__("autogpu_jupyter.magics", fromlist=["sidebar_pick"])'
            f'.sidebar_pick("{uuid}")',
            store_history=False,
        )
    finally:
        shell.display_pub = old
    assert r.success, r.error_in_exec
    return shown


def test_the_sidebar_pick_takes_that_gpu_quietly_and_says_so_in_one_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    monkeypatch.setenv("COLUMNS", "160")
    shell.run_cell("%load_ext autogpu")  # as the README says: loaded already
    capsys.readouterr()
    (answer,) = _sidebar_pick(shell, U[1])
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # no "The autogpu extension is already loaded"
    pick = answer[SIDEBAR_PICK_MIME]
    assert pick["ok"] is True
    assert pick["summary"].startswith("autogpu: picked GPU 1 · ")
    assert "\n" not in pick["summary"]
    assert "asked:" not in pick["details"] and "runner-up" not in pick["details"]
    assert f"CUDA_VISIBLE_DEVICES={U[1]}" in pick["details"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[1]
    choice = session.current()
    assert choice is not None and choice.lease is not None and choice.source == "sidebar"
    # as after %gpu pick, the sampler watches the GPU: an overload is printed under a cell
    assert sampler_threads() == 1
    # %gpu status words it as the user did it: no --exclude the user never typed
    _, out, _ = run(shell, "%gpu status", capsys)
    assert out.splitlines()[-1] == "this kernel: ▶ GPU 1 (picked from the sidebar)"


def test_a_pending_overload_is_printed_under_the_next_cell_not_into_the_sidebars_answer(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sidebar's request runs as a cell of the kernel: what the post-run hook prints there
    would reach the sidebar's request, never a notebook cell. Caught: the hook not told to skip
    the sidebar's cell (the warning lost; a test with a real kernel saw it too, slowly)."""
    from autogpu_jupyter.core import overload

    warning = "autogpu: GPU 1 (this kernel's GPU) is overloaded"
    monkeypatch.setattr(overload, "pending_warning", lambda *_: warning)
    shell.run_cell("%load_ext autogpu")
    capsys.readouterr()
    _sidebar_pick(shell, U[1])
    out, _ = capsys.readouterr()
    assert warning not in out
    _, out, _ = run(shell, "x = 1", capsys)
    assert warning in out  # the notebook's next cell prints it


def test_a_sidebar_pick_on_a_host_whose_gpus_cannot_be_read_answers_its_first_line(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No driver (or a lost NVML): the sidebar's answer is the error's first line, its details
    the rest, and nothing is set. Caught: the error not split into its line and details."""
    from autogpu_jupyter import api
    from autogpu_jupyter.errors import NVMLUnavailableError
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    def unreadable() -> None:
        raise NVMLUnavailableError("NVIDIA driver not loaded\ninstall it, or use a simulated fleet")

    monkeypatch.setattr(api, "read_snapshot", unreadable)
    shell.run_cell("%load_ext autogpu")
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[SIDEBAR_PICK_MIME] == {
        "ok": False, "summary": "autogpu: NVIDIA driver not loaded",
        "details": "install it, or use a simulated fleet",
    }
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and session.current() is None


def test_a_sidebar_pick_that_fails_in_several_lines_answers_the_first_and_details_the_rest(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The devices were read, then the pick itself failed (not a no-fit) with a message of
    several lines: the answer is its first line, the details the rest, and nothing is set.
    Caught (issue 22, seed 54): the pick's error split at no line (the whole text as the
    one-line answer, no details)."""
    from autogpu_jupyter import api
    from autogpu_jupyter.errors import RegistryError
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    def refused(*_args: Any, **_kw: Any) -> None:
        raise RegistryError("lease registry refused the lease\n  the admin must fix its mode")

    monkeypatch.setattr(api, "pick_result", refused)
    shell.run_cell("%load_ext autogpu")
    (answer,) = _sidebar_pick(shell, U[1])
    assert answer[SIDEBAR_PICK_MIME] == {
        "ok": False, "summary": "autogpu: lease registry refused the lease",
        "details": "the admin must fix its mode",
    }
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and session.current() is None


def test_the_sidebar_pick_loads_the_extension_itself_without_a_word(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    (answer,) = _sidebar_pick(shell, U[2])  # no %load_ext before
    assert capsys.readouterr() == ("", "")
    assert answer[SIDEBAR_PICK_MIME]["ok"] is True
    assert shell.find_line_magic("gpu") is not None
    # the notebook's own %load_ext afterwards is quiet too
    assert run(shell, "%load_ext autogpu", capsys)[1] == ""


def test_a_failed_sidebar_pick_is_one_line_about_that_gpu_and_never_about_wait(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    shell.run_cell('%load_ext autogpu\n%config AutoGPU.min_free = "79G"\n'
                   '%config AutoGPU.wait = "10m"')
    capsys.readouterr()
    (answer,) = _sidebar_pick(shell, U[0])
    pick = answer[SIDEBAR_PICK_MIME]
    assert pick["ok"] is False
    assert pick["summary"].startswith("autogpu: GPU 0 cannot be picked: only ")
    assert pick["summary"].endswith("< 79.0 GiB wanted")
    text = pick["summary"] + pick["details"]
    assert "--exclude" not in text and "--wait" not in text and "excluded" not in text
    assert pick["details"] == (
        "asked: min free 79.0 GiB (this notebook's defaults, %config AutoGPU)\n"
        "nothing changed: no variable set, no lease taken"
    )
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and session.current() is None


def test_an_unknown_device_is_said_in_one_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    (answer,) = _sidebar_pick(shell, "GPU-gone")
    assert answer[SIDEBAR_PICK_MIME] == {
        "ok": False, "details": "",
        "summary": "autogpu: no device 'GPU-gone' on this host (the sidebar is stale?)",
    }


def test_a_device_name_cannot_steer_the_terminal(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], fake_nvml: FakeNvml
) -> None:
    """A model name with an escape sequence and a bidi override (a fleet or a driver we do not
    control) is spelled out in the pick's summary, its dry run and its error. Caught: the
    terminal escaping dropped from the pick's output."""
    fleet = fleet_4x()
    for d in fleet["devices"]:
        d["name"] = "A100\x1b[2J\u202egpj.exe"
    fake_nvml.write(fleet)
    shell.run_cell("%load_ext autogpu")
    for line in ("%gpu pick --dry-run", "%gpu pick"):
        _, out, _ = run(shell, line, capsys)
        assert "A100\\x1b[2J\\u202egpj.exe" in out
        assert "\x1b" not in out and "\u202e" not in out


def test_no_fit_after_waiting_says_a_longer_wait_waits_longer(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the hint of the no-fit message read the wrong way round (telling a user who
    waited to add --wait)."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu pick --min-free 500G --wait 0.2s", capsys)
    assert not r.success and "CUDA_VISIBLE_DEVICES" not in os.environ
    text = out + err
    assert "  nothing changed; a longer --wait than 0.2s waits longer in line" in text
    assert "to wait in line until a device fits" not in text
    r, out, err = run(shell, "%gpu pick --min-free 500G", capsys)
    text = out + err
    assert ("  nothing changed; to wait in line until a device fits, add --wait: %gpu pick ... "
            "--wait 10m (interrupt the kernel to cancel)") in text


def test_a_cell_on_fewer_devices_than_it_asks_says_so(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the device count of the cell's options checked the wrong way round."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    r, out, _ = run(shell, "%%gpu --count 2\nx = 3", capsys)
    assert r.success and shell.user_ns["x"] == 3
    assert out.splitlines()[:2] == [
        "autogpu: this kernel already has a GPU that does not meet 2 devices (kept; to change: "
        "%gpu release, restart the kernel, %gpu pick):",
        "  it has 1 device(s), 2 asked for",
    ]
    _, out, _ = run(shell, "%%gpu --count 1\nx = 4", capsys)
    assert "does not meet" not in out


def test_a_repeated_pick_line_parses_alike_each_time_with_a_namespace_of_its_own() -> None:
    """What a line parsed to is remembered (issue 26): a caller that changes its namespace
    changes nobody else's, and a bad line is refused every time, in the same words."""
    first = magics._parse_pick(magics._split("--min-free 10G --max-util 50"))
    first.min_free = "99G"
    again = magics._parse_pick(magics._split("--min-free 10G --max-util 50"))
    assert (again.min_free, again.max_util, again.dry_run) == ("10G", "50", False)
    words = magics._split("pick --dry-run")
    words.append("--force")
    assert magics._split("pick --dry-run") == ["pick", "--dry-run"]
    messages = []
    for _ in range(2):
        with pytest.raises(UsageError) as info:
            magics._parse_pick(["--count"])
        messages.append(str(info.value))
    assert messages[0] == messages[1] and messages[0].startswith("%gpu pick: ")
    for _ in range(2):
        with pytest.raises(UsageError, match="cannot read"):
            magics._split("pick --model 'A100")


def test_a_dry_run_on_the_best_device_shows_the_ranking_and_says_nothing_to_change(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """After a pick, ``--dry-run`` with the same options: the whole ranking, then one line
    saying the kernel is already there. Caught: that line replacing the ranking."""
    shell.run_cell("%load_ext autogpu")
    _, out, _ = run(shell, "%gpu pick", capsys)
    label = out.split("picked ", 1)[1].split(" · ", 1)[0]
    _, out, _ = run(shell, "%gpu pick --dry-run", capsys)
    lines = out.splitlines()
    assert lines[-1] == f"  you are already on the best device ({label}): nothing to change"
    assert sum(1 for ln in lines if re.search(r"\bGPU [0-3]\b", ln)) >= 4  # the ranking stays


def _status_shown_in_a_notebook(shell: InteractiveShell) -> dict[str, Any]:
    """``%gpu status`` run as in a kernel: the one display it publishes (mimetype -> data)."""
    from IPython.core.displaypub import DisplayPublisher

    shown: list[Any] = []

    class Capture(DisplayPublisher):
        def publish(self, data: Any, metadata: Any = None, **kw: Any) -> None:
            shown.append(data)

    shell.run_cell("%load_ext autogpu")
    old = shell.display_pub
    shell.display_pub = Capture(shell=shell)
    try:
        with patch.object(magics.GPUMagics, "_in_kernel", return_value=True):
            assert shell.run_cell("%gpu status").success
    finally:
        shell.display_pub = old
    (data,) = shown
    return data


def test_status_html_keeps_every_cell_but_the_short_uuid(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """The notebook's status table drops one column (the short UUID, in the text) and keeps
    every other cell of every row. Caught: the rows' cells lost while the columns stayed."""
    data = _status_shown_in_a_notebook(shell)
    html = data["text/html"]
    for uuid in U:
        assert uuid[:12] not in html  # the short UUID: only in the text
    for i, name in enumerate(("NVIDIA A100-SXM4-80GB", "NVIDIA L4")):
        assert name in html, i
    assert html.count("<tr") >= 1 + len(U)
    assert all(f"GPU {i}" in html for i in range(len(U)))


def test_status_in_a_notebook_has_a_plain_text_form_too(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """The notebook's status is shown with a text/plain form (what a console front end, or a
    notebook saved as text, shows): the title, the table, this kernel's line. Caught (issue 22,
    seed 54): the text form shown as None."""
    data = _status_shown_in_a_notebook(shell)
    lines = data["text/plain"].splitlines()
    assert lines[0] == "GPUs on this host"
    assert lines[1].split()[:3] == ["gpu", "name", "util"]  # sized for 120 columns
    assert [ln.split()[:2] for ln in lines[2:-1]] == [["GPU", str(i)] for i in range(len(U))]
    assert all(len(ln) <= 120 for ln in lines)
    assert lines[-1] == "this kernel: no GPU picked yet (%gpu pick)"


def test_a_sidebar_pick_past_the_admins_quota_answers_the_refusals_first_line(
    shell: InteractiveShell, tmp_path: Path
) -> None:
    """The admin's quota refuses the lease (not a device that does not fit): the sidebar's
    answer is the refusal's first line, its details the rest, and nothing is set. Caught: the
    refusal's split turned into a TypeError (a survivor of the sampled mutation run: the
    sidebar got a traceback instead of one line)."""
    import pwd
    import subprocess

    from autogpu_jupyter.core.leasing import Registry, Requester
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME

    holder = subprocess.Popen(["sleep", "60"])  # another process of this user holds GPU 0
    other = None
    try:
        with Registry(str(tmp_path / "registry")).locked() as txn:
            assert txn is not None
            other = txn.create(devices=[U[0]], requester=Requester(pid=holder.pid))
        shell.run_cell("%load_ext autogpu\n%config AutoGPU.max_devices_per_user = 1")
        (answer,) = _sidebar_pick(shell, U[1])
        me = pwd.getpwuid(os.geteuid()).pw_name
        assert answer[SIDEBAR_PICK_MIME] == {
            "ok": False,
            "summary": f"autogpu: {me} already holds leases on 1 device(s) ({U[0]}); taking 1 "
            "more would exceed max_devices_per_user = 1 set by the admin. Release one first "
            "(%gpu release, or end the kernel / autogpu run holding it).",
            "details": "",
        }
        assert "CUDA_VISIBLE_DEVICES" not in os.environ and session.current() is None
    finally:
        if other is not None:
            other.release()
        holder.kill()
        holder.wait()


def test_gpu_panel_in_a_terminal_says_it_needs_a_notebook_and_in_a_kernel_shows_the_panel(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A terminal IPython draws no widgets: one hint, no repr. A kernel (a shell with a
    ``kernel``) displays a real Panel. Caught: neither was run in-process before (the kernel
    tests saw the panel, slowly)."""
    from IPython.core.displaypub import DisplayPublisher

    from autogpu_jupyter.magics import PANEL_NEEDS_FRONTEND
    from autogpu_jupyter.widgets import Panel

    shell.run_cell("%load_ext autogpu")
    capsys.readouterr()
    _, out, err = run(shell, "%gpu panel", capsys)
    assert (out, err) == (PANEL_NEEDS_FRONTEND + "\n", "")
    shown: list[Any] = []

    class Capture(DisplayPublisher):
        def publish(self, data: Any, metadata: Any = None, **kw: Any) -> None:
            shown.append(data)

    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    monkeypatch.setattr(shell, "display_pub", Capture(shell=shell))
    panels: list[Panel] = []
    monkeypatch.setattr(Panel, "__init__", _recording_init(Panel.__init__, panels))
    try:
        result, out, _ = run(shell, "%gpu panel", capsys)
        assert result.success and PANEL_NEEDS_FRONTEND not in out
        assert len(panels) == 1 and len(shown) == 1
        assert "application/vnd.jupyter.widget-view+json" in shown[0]
    finally:
        for p in panels:
            p.close()


def _recording_init(init: Any, into: list[Any]) -> Any:
    def recorded(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        into.append(self)

    return recorded


# ---- what the surviving mutants of issue 22's sample showed untested -----------------------------


def test_status_names_both_devices_of_a_two_device_pick(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: the marked devices' labels joined with something else than ", "."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick --count 2")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu status", capsys)
    assert out.splitlines()[-1] == "this kernel: ▶ GPU 0, GPU 2 (%gpu pick, 2 devices)"


def test_release_says_the_lease_went_too_and_only_when_there_was_one(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught: " and its lease" never said after a pick that held one."""
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == "autogpu: released GPU 0 and its lease; CUDA_VISIBLE_DEVICES is unset again\n"
    shell.run_cell("import autogpu_jupyter as ag; ag.set_visible_devices([3])")  # no lease
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == "autogpu: released GPU 3; CUDA_VISIBLE_DEVICES is unset again\n"


@pytest.mark.parametrize(("cuda", "hip", "runtime"), [(True, False, "CUDA"),
                                                     (False, True, "HIP (ROCm)")])
def test_release_after_the_runtime_started_says_which_keeps_the_device(
    shell: InteractiveShell,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    cuda: bool,
    hip: bool,
    runtime: str,
) -> None:
    """The variables are restored, but a runtime already initialised keeps its device until
    the kernel restarts; the line names that runtime. Caught: the runtime's name lost."""
    from autogpu_jupyter.core.cudastate import CudaState

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    monkeypatch.setattr(magics, "cuda_state", lambda: CudaState(cuda, "test", None))
    monkeypatch.setattr(magics, "hip_state", lambda: CudaState(hip, "test", None))
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out.splitlines() == [
        "autogpu: released GPU 0 and its lease; CUDA_VISIBLE_DEVICES is unset again",
        f"  {runtime} is already initialised in this kernel: it keeps using GPU 0 until you "
        "restart the kernel",
    ]


def test_a_vscode_kernels_lease_names_its_notebook(
    shell: InteractiveShell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VS Code gives its kernels no JPY_SESSION_NAME but ``__vsc_ipynb_file__`` in the user
    namespace: the lease names that notebook. Caught: the IPython shell never asked."""
    from autogpu_jupyter.core.leasing import Registry

    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setitem(shell.user_ns, "__vsc_ipynb_file__", "/home/ana/train.ipynb")
    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%gpu pick")
    (lease,) = Registry(str(tmp_path / "registry")).list_leases()
    assert lease.notebook_path == "/home/ana/train.ipynb"


@pytest.mark.parametrize("value", ["", 7, Path("/home/ana/train.ipynb")])
def test_a_vscode_notebook_variable_that_is_no_path_names_no_notebook(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch, value: object
) -> None:
    """Only a non-empty string is a notebook's path. Caught: any true value (or any string, the
    empty one too) taken for one."""
    from autogpu_jupyter.api import notebook_of_this_process

    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setitem(shell.user_ns, "__vsc_ipynb_file__", value)
    assert notebook_of_this_process() is None


def _capture_displays(shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    from IPython.core.displaypub import DisplayPublisher

    shown: list[Any] = []

    class Capture(DisplayPublisher):
        def publish(self, data: Any, metadata: Any = None, **kw: Any) -> None:
            shown.append((data, kw.get("update", False)))

    monkeypatch.setattr(shell, "display_pub", Capture(shell=shell))
    return shown


def test_the_waiting_line_in_a_notebook_is_the_text_itself(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a kernel the waiting line is one display, updated in place, then marked. Caught: its
    first display not raw (the notebook would show the repr of a dict)."""
    shown = _capture_displays(shell, monkeypatch)
    progress = magics._Progress(in_kernel=True)
    progress.update("waiting for a device (1s)")
    progress.update("waiting for a device (2s)")
    progress.done("gave up")
    assert shown == [
        ({"text/plain": "waiting for a device (1s)"}, False),
        ({"text/plain": "waiting for a device (2s)"}, True),
        ({"text/plain": "waiting for a device: gave up"}, True),
    ]


def test_a_waiting_line_interrupted_in_its_first_display_is_still_marked(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interrupt (Ctrl-C, the kernel's interrupt) can land while the first display is being
    sent: the line may already be on the page, so it is still marked "cancelled". Caught (a bug
    a mutant of issue 22's sample showed): ``done`` asked whether the display had returned."""
    from IPython.core.displaypub import DisplayPublisher

    shown: list[Any] = []

    class InterruptedOnce(DisplayPublisher):
        def publish(self, data: Any, metadata: Any = None, **kw: Any) -> None:
            shown.append((data, kw.get("update", False)))
            if len(shown) == 1:
                raise KeyboardInterrupt

    monkeypatch.setattr(shell, "display_pub", InterruptedOnce(shell=shell))
    progress = magics._Progress(in_kernel=True)
    with pytest.raises(KeyboardInterrupt):
        progress.update("waiting for a device (1s)")
    progress.done("cancelled")
    assert shown == [
        ({"text/plain": "waiting for a device (1s)"}, False),
        ({"text/plain": "waiting for a device: cancelled"}, True),
    ]


def test_a_wait_that_never_showed_its_line_marks_nothing(
    shell: InteractiveShell, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pick that gave up before its first progress display (the wait shorter than one tick)
    has no line to mark, and says so by doing nothing. Caught: ``done`` asking for a kernel *or*
    a display handle (an AttributeError on the missing handle)."""
    shown = _capture_displays(shell, monkeypatch)
    magics._Progress(in_kernel=True).done("gave up")
    assert shown == []


def test_a_revoke_on_the_inherited_lease_connection_is_said_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel the autogpu kernelspec started holds its lease on the descriptor it inherited
    (``AUTOGPU_LEASE_FD``): the broker's revoke there is told after the cell, once. Caught: the
    inherited descriptor never read."""
    import socket

    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    monkeypatch.setattr(magics.hooks, "_ended_lease_fds", set())
    ours, theirs = socket.socketpair()
    with ours, theirs:
        monkeypatch.setenv("AUTOGPU_LEASE_FD", str(ours.fileno()))
        theirs.sendall(b'{"event": "revoked", "lease_id": "abc"}\n')
        magics._lease_events()
        theirs.sendall(b'{"event": "revoked", "lease_id": "abc"}\n')  # said: not again
        magics._lease_events()
    assert capsys.readouterr().out == (
        "autogpu: your GPU lease abc was revoked by the admin: this kernel no longer holds it; "
        "others may now be given its GPU\n"
    )


def test_a_panel_takes_its_overload_thresholds_from_this_kernels_config(
    shell: InteractiveShell, tmp_path: Path
) -> None:
    """The panel reads the extension's own ``AutoGPU`` configurable (the one the magics register
    with the shell and the API uses), not a fresh one built from ``shell.config``: a value set
    on that configurable alone reaches the panel (``%config`` reaches both, so it cannot tell).
    Caught (mutation run, issue 22): the shell's configurables not looked through (a fresh
    ``AutoGPU(parent=shell)`` with the defaults)."""
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.overload import Thresholds
    from autogpu_jupyter.core.sampler import Sampler
    from autogpu_jupyter.widgets import Panel

    shell.run_cell("%load_ext autogpu")
    shell.run_cell("%config AutoGPU.overload_window_s = 7")
    (settings,) = [c for c in shell.configurables if isinstance(c, AutoGPU)]
    settings.overload_util_pct = 50.0
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet_4x()))
    panel = Panel(window_s=60, sampler=Sampler(SimulatedBackend(str(path))), server_history=False)
    try:
        assert panel.thresholds == Thresholds(util_pct=50.0, window_s=7.0, memory_pct=95.0)
    finally:
        panel.close()


def _sweep_with_unknown_processes_on_gpu_0() -> tuple[Any, Any]:
    """A sweep of two GPUs: GPU 0's processes unknown (no permission), GPU 1 running this kernel
    (2 GiB); and a sampler answering its two questions for that sweep."""
    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot

    me = os.getpid()
    snap = FleetSnapshot(
        devices=(
            DeviceSnapshot(index=0, uuid=U[0], name="Fake", utilization_pct=40.0, processes=None),
            DeviceSnapshot(index=1, uuid=U[1], name="Fake", utilization_pct=90.0,
                           processes=(ProcessSnapshot(pid=me, used_memory_bytes=2 * 1024**3),)),
        ),
        timestamp_s=1000.0,
        backend="test",
    )

    class LastSweep:  # the sampler's two questions, for its latest sweep
        def latest(self) -> FleetSnapshot:
            return snap

        def latest_own_pids(self) -> set[int]:
            return {me}

    return snap, LastSweep()


def test_a_cell_on_a_device_whose_processes_are_unknown_reports_its_peak_unknown() -> None:
    """NVML lists no processes for the cell's GPU (no permission): this kernel's peak memory is
    unknown, not a sum of the other devices' processes, while the GPU's utilisation, which NVML
    did report, is still the cell's. Caught (issue 22, seed 52): "unknown" marked as "" (a
    TypeError in the sampler thread) and the report's word in capitals; and a bug that test
    showed: the utilisation of such a device skipped with its processes ("unknown")."""
    snap, sampler = _sweep_with_unknown_processes_on_gpu_0()
    stats = magics._CellStats(uuids=(U[0],), start_s=999.0)
    stats.add(sampler, snap)
    assert stats.peak_own_bytes is None
    head, peak, util = stats.report(2.0, "GPU 0", simulated=False).split(" · ")
    assert head == "autogpu %%gpu on GPU 0: wall 2s"
    assert peak == "peak GPU memory of this kernel unknown"
    assert util == "mean utilisation 40% (1 sample)"


def test_a_cell_still_counts_its_device_after_another_whose_processes_are_unknown() -> None:
    """NVML lists no processes for another GPU (no permission), listed before the cell's: the
    cell's GPU, read after it, still gives its utilisation and this kernel's memory. Caught
    (issue 22, seed 54): the devices after such a GPU skipped (utilisation unknown, peak 0 B)."""
    snap, sampler = _sweep_with_unknown_processes_on_gpu_0()
    stats = magics._CellStats(uuids=(U[1],), start_s=999.0)
    stats.add(sampler, snap)
    _head, peak, util = stats.report(2.0, "GPU 1", simulated=False).split(" · ")
    assert peak == "peak GPU memory of this kernel 2.0 GiB"
    assert util == "mean utilisation 90% (1 sample)"


@pytest.mark.parametrize("index", [0, 1])
def test_the_sidebar_pick_of_a_mig_device_takes_that_mig_device(
    shell: InteractiveShell, fake_nvml: FakeNvml, index: int
) -> None:
    """Picking a MIG device from the sidebar leaves out every other device (the idle plain A100
    GPU 1 and the other MIG device of GPU 0 among them): the kernel gets the one clicked.
    Caught (issue 22, seed 52): the MIG device's parent left out of its family (every plain GPU
    then stayed in the running, and the idle GPU 1 was picked); and a bug that mutant showed:
    the clicked device's sibling on the same GPU stayed in the running, so clicking the busier
    MIG 0 gave the kernel MIG 1."""
    from autogpu_jupyter.magics import SIDEBAR_PICK_MIME
    from tests.fakenvml import fleet_mig

    fake_nvml.write(fleet_mig())
    mig = fleet_mig()["devices"][0]["mig_devices"][index]["uuid"]
    shell.run_cell("%load_ext autogpu")
    (answer,) = _sidebar_pick(shell, mig)
    pick = answer[SIDEBAR_PICK_MIME]
    assert pick["ok"] is True
    assert pick["summary"].startswith(f"autogpu: picked GPU 0 MIG {index} · "), pick["summary"]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == mig
    choice = session.current()
    assert choice is not None and choice.uuids == (mig,) and choice.source == "sidebar"


def test_release_in_a_kernel_the_kernelspec_started_says_its_lease_stays(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernelspec picked GPU 0 before the kernel started: ``%gpu release`` cannot undo
    that, and says so whole. Caught (issue 22, seed 52): the message's wording changed."""
    monkeypatch.setenv("AUTOGPU_PICKED", U[0])
    shell.run_cell("%load_ext autogpu")
    capsys.readouterr()
    _, out, _ = run(shell, "%gpu release", capsys)
    assert out == (
        "this kernel's GPU was picked by the autogpu kernelspec before it started: its lease "
        "ends when the kernel stops (or restart it with another kernel)\n"
    )
    assert session.current() is not None  # still the kernelspec's choice


def test_an_overload_check_that_fails_is_logged_not_printed(
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a cell, an overload check that cannot read the devices prints nothing and leaves a
    debug record saying why. Caught (issue 22, seed 52): the record's text changed."""
    import logging

    from autogpu_jupyter.core import overload
    from autogpu_jupyter.errors import NVMLUnavailableError

    def unreadable() -> None:
        raise NVMLUnavailableError("NVIDIA driver not loaded")

    monkeypatch.setattr(overload, "pending_warning", unreadable)
    monkeypatch.setattr(magics.hooks, "_skip_hook_once", False)
    monkeypatch.delenv("AUTOGPU_PICKED", raising=False)
    caplog.set_level(logging.DEBUG, logger="autogpu_jupyter.magics")
    magics._overload_hook()
    assert capsys.readouterr() == ("", "")
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu_jupyter.magics"] == [
        "overload check failed: NVIDIA driver not loaded"
    ]


# ---- naming GPUs (issue 41) --------------------------------------------------------------------


def test_gpu_pick_names_a_gpu_without_a_flag(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """``%gpu pick 2`` and ``%gpu pick 0,3``: the named GPUs, through the one pipeline (a
    lease, the summary of a pick)."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu pick 2", capsys)
    assert r.success, err
    assert out.startswith("autogpu: picked GPU 2 · ")
    assert "  asked: device 2 · " in out
    assert os.environ["CUDA_VISIBLE_DEVICES"] == U[2]
    r, out, err = run(shell, "%gpu pick 0,3", capsys)
    assert r.success, err
    assert os.environ["CUDA_VISIBLE_DEVICES"] in (f"{U[0]},{U[3]}", f"{U[3]},{U[0]}")


def test_gpu_pick_of_a_gpu_that_is_not_there_is_one_line(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu pick 9", capsys)
    assert not r.success and "CUDA_VISIBLE_DEVICES" not in os.environ
    text = (out + err).strip()
    assert text.endswith(
        "no device '9' on this host; name devices by index (0, 1, 2, 3) or by UUID or its first "
        "6 or more characters (e.g. GPU-a1000000)")
    assert len(text.splitlines()) == 1


def test_no_wait_is_suggested_where_the_options_rule_out_every_gpu(
    shell: InteractiveShell, capsys: pytest.CaptureFixture[str]
) -> None:
    """Caught (issue 41): ``--exclude 0,1,2,3`` answered "add --wait", which never helps."""
    shell.run_cell("%load_ext autogpu")
    r, out, err = run(shell, "%gpu pick --exclude 0,1,2,3", capsys)
    assert not r.success and "CUDA_VISIBLE_DEVICES" not in os.environ
    text = out + err
    assert "  nothing changed; no wait can help: these options themselves rule out every device" \
        in text
    assert "--wait" not in text
