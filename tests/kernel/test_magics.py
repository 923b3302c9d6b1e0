"""``%gpu`` / ``%%gpu`` in REAL IPython kernels (jupyter_client) over the fake NVML library.

One kernel serves the whole module (state is reset between tests with ``%gpu release``); the test
moves load by rewriting the fake driver's scenario, which the library re-reads. After every magic
the test reads ``os.environ`` inside the kernel. The too-late test gets its own kernel because it
really initialises (fake) CUDA there, which cannot be undone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from autogpu_jupyter.core.cudastate import CudaState, too_late_message
from autogpu_jupyter.core.leasing import DirectoryStore
from tests.fakecuda import INIT_SNIPPET, STATE_SNIPPET, build_fake_cuda
from tests.fakenvml import FakeNvml, fleet_4x, fleet_edge_cases, fleet_mig
from tests.kernelhelpers import Kernel, kernel_env

GiB = 1024**3
# fleet_4x: GPU 0 A100 (77.5 GiB free, 3%), GPU 1 A100 (39.5 GiB free, 97%),
#           GPU 2 L4 (21.1 GiB free, 12%), GPU 3 L4 (10.1 GiB free, 80%)
# Load (max of utilisation and memory share, 5 % steps) ranks them 0 (3%), 2 (12%), 3 (80%),
# 1 (97%): least loaded first, whatever the free memory.
U = [d["uuid"] for d in fleet_4x()["devices"]]
OPTIONS = (
    "accepted options: --min-free SIZE, --max-util PCT, --count N, --exclude IDS, "
    "--exclusive, --wait DURATION, --model NAMES, --prefer NAMES, --devices IDS, --dry-run, "
    "--force (see %gpu?)"
)
ENV0: dict[str, str | None] = {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}


def env_of(*uuids: str) -> dict[str, str | None]:
    return {"CUDA_VISIBLE_DEVICES": ",".join(uuids), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("magics-kernel")
    fake = FakeNvml(base / "nvml")
    fake.write(fleet_4x())
    registry = base / "registry"
    env = kernel_env({**fake.env, "AUTOGPU_REGISTRY_DIR": str(registry)})
    kernel = Kernel(env)
    try:
        r = kernel.run("%load_ext autogpu")
        assert r.status == "ok", r
        yield {"fake": fake, "kernel": kernel, "registry": registry, "env": env, "base": base}
    finally:
        kernel.close()


@pytest.fixture
def k(host: dict[str, Any]) -> Iterator[Kernel]:
    """The module's kernel with nothing picked, no pre-set variables, the 4-GPU fleet and no
    sampler running (a pick starts one; its 30 s history would carry one test's utilisation into
    the next test's ranking), i.e. as a fresh kernel."""
    host["fake"].write(fleet_4x())
    kernel: Kernel = host["kernel"]
    kernel.run("%gpu release")
    r = kernel.run(
        "from autogpu_jupyter.core.sampler import current_sampler as _cs, stop_sampler as _ss\n"
        "_ss()\nprint(_cs())"
    )
    assert r.stdout == "None\n", r
    kernel.run(
        "import os\nfor _v in ('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER'):\n"
        "    os.environ.pop(_v, None)"
    )
    assert kernel.env() == ENV0
    yield kernel


def lines_without_lease(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if not ln.startswith("  lease ")]


def usage_error(r: Any) -> str:
    assert r.status == "error" and r.error[0] == "UsageError", r
    assert r.stderr.startswith("UsageError: "), r
    return str(r.stderr.removeprefix("UsageError: ").rstrip("\n"))


def no_fit(r: Any) -> str:
    """What a notebook shows when nothing fits: the error output's lines (no "UsageError:",
    no traceback), the cell failed."""
    assert r.status == "error" and r.error[0] == "NoDeviceFitsError", r
    (err,) = [o for o in r.outputs if o["msg_type"] == "error"]
    text = "\n".join(err["content"]["traceback"])
    assert "UsageError" not in text and "Traceback" not in text
    return text


def test_pick_of_a_named_gpu_in_a_real_kernel(k: Kernel, host: dict[str, Any]) -> None:
    """``%gpu pick 2`` (issue 41): GPU 2, not the least-loaded GPU 0, with a lease on it and
    the summary of any pick; a named GPU that does not fit is one line naming it and why, and
    the environment is left as it was."""
    r = k.run("%gpu pick 2")
    assert r.status == "ok", r
    assert lines_without_lease(r.stdout) == [
        "autogpu: picked GPU 2 · NVIDIA L4 · GPU-a1000004: 21.1 GiB free of 22.5 GiB, util 12%",
        "  asked: device 2 · no runner-up (nothing else fits)",
        f"  CUDA_VISIBLE_DEVICES={U[2]}",
    ]
    assert k.env() == env_of(U[2])
    (lease,) = DirectoryStore(str(host["registry"])).list_leases()
    assert lease.device_uuids == (U[2],)
    k.run("%gpu release")
    r = k.run("%gpu pick 0,3 --min-free 20G")
    assert no_fit(r).splitlines()[0] == (
        "autogpu: only 1 of GPU 0, GPU 3 fit(s), 2 wanted (devices 0,3, min free 20.0 GiB): "
        "GPU 3: only 10.1 GiB free < 20.0 GiB wanted")
    assert k.env() == ENV0


def test_pick_sets_full_uuids_and_prints_summary(k: Kernel, host: dict[str, Any]) -> None:
    r = k.run("%gpu pick --min-free 10G")
    assert r.status == "ok", r
    assert lines_without_lease(r.stdout) == [
        "autogpu: picked GPU 0 · NVIDIA A100-SXM4-80GB · GPU-a1000000: 77.5 GiB free of "
        "80.0 GiB, util 3%",
        "  asked: min free 10.0 GiB · runner-up GPU 2 (21.1 GiB free, util 12%)",
        f"  CUDA_VISIBLE_DEVICES={U[0]}",
    ]
    assert k.env() == env_of(U[0])
    # the lease is really in the registry, for this kernel, booking what was asked
    (lease,) = DirectoryStore(str(host["registry"])).list_leases()
    assert lease.device_uuids == (U[0],)
    assert lease.requested_bytes == 10 * GiB
    assert f"  lease {lease.lease_id} held until this kernel exits or %gpu release" in r.stdout
    r = k.run("%gpu release")
    assert r.stdout == (
        "autogpu: released GPU 0 and its lease; CUDA_VISIBLE_DEVICES is unset again\n"
    )
    assert k.env() == ENV0
    assert DirectoryStore(str(host["registry"])).list_leases() == []


BAD_INPUTS = [
    ("%gpu pick --bogus", f"%gpu pick: unrecognized arguments: --bogus; {OPTIONS}"),
    ("%gpu pick --min-free", f"%gpu pick: argument --min-free: expected one argument; {OPTIONS}"),
    (
        "%gpu pick --min-free 10",
        "invalid size '10': a bare number is ambiguous, add a unit; "
        "expected a number with a unit, e.g. 10G, 10GiB, 512M, 0.5T, 16GB (decimal), or a share of "
        "the device like 25%",
    ),
    (
        "%gpu pick --min-free 10X",
        "invalid size '10X': unknown unit 'X'; expected a number with a "
        "unit, e.g. 10G, 10GiB, 512M, 0.5T, 16GB (decimal), or a share of the device like 25%",
    ),
    ("%gpu pick --count -1", "invalid --count '-1': expected a whole number >= 1, e.g. 2"),
    ("%gpu pick --count 0", "invalid --count '0': expected a whole number >= 1, e.g. 2"),
    (
        "%gpu pick --max-util 150",
        "invalid --max-util '150': must be 0-100; expected a number from "
        "0 to 100, optionally followed by %, e.g. 50 or 50%",
    ),
    (
        "%gpu pick --exclude 9",
        "unknown device id '9' in --exclude; expected an NVML index (0, 1, 2, 3) or a UUID",
    ),
    (
        "%gpu pick --exclude GPU-ffffffff",
        "unknown device id 'GPU-ffffffff' in --exclude; expected "
        "an NVML index (0, 1, 2, 3) or a UUID",
    ),
    (
        '%gpu pick --exclude ""',
        "invalid --exclude '': empty device id; expected NVML indices or "
        "UUIDs separated by commas, e.g. 0,2 or GPU-5a1b",
    ),
    (
        "%gpu pick --wait soon",
        "invalid duration 'soon': expected seconds or a number with s, m, "
        "h or d, e.g. 90, 30s, 10m, 1.5h",
    ),
    (
        "%gpu frobnicate",
        "%gpu: unknown subcommand 'frobnicate'; expected one of pick, status, "
        "release, panel, move (see %gpu?)",
    ),
]


def test_every_bad_input_is_one_line_and_changes_nothing(k: Kernel) -> None:
    assert k.run("%gpu pick --exclude 0").status == "ok"
    before = k.env()
    assert before == env_of(U[2])
    for line, message in BAD_INPUTS:
        r = k.run(line)
        assert usage_error(r) == message, line
        assert "\n" not in message and "Traceback" not in r.stderr
        assert k.env() == before, line


def test_nothing_fits_lists_each_device_and_changes_nothing(k: Kernel) -> None:
    r = k.run("%gpu pick --min-free 78G --max-util 50")
    assert no_fit(r).splitlines() == [
        "autogpu: no device fits (min free 78.0 GiB, max util 50%):",
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: only 77.5 GiB free < 78.0 GiB wanted",
        "  GPU 1 (NVIDIA A100-SXM4-80GB): dropped: only 39.5 GiB free < 78.0 GiB wanted; "
        "utilisation 97% > max 50%",
        "  GPU 2 (NVIDIA L4): dropped: only 21.1 GiB free < 78.0 GiB wanted",
        "  GPU 3 (NVIDIA L4): dropped: only 10.1 GiB free < 78.0 GiB wanted; "
        "utilisation 80% > max 50%",
        "  nothing changed; to wait in line until a device fits, add --wait: "
        "%gpu pick ... --wait 10m (interrupt the kernel to cancel)",
    ]
    assert k.env() == ENV0


def test_options_count_exclude_max_util_exclusive(k: Kernel, host: dict[str, Any]) -> None:
    r = k.run("%gpu pick --count 2 --exclude 0")
    assert r.status == "ok", r
    assert r.stdout.splitlines()[:3] == [
        "autogpu: picked 2 devices:",
        "  GPU 2 · NVIDIA L4 · GPU-a1000004: 21.1 GiB free of 22.5 GiB, util 12%",
        "  GPU 3 · NVIDIA L4 · GPU-a1000005: 10.1 GiB free of 22.5 GiB, util 80%",
    ]
    assert "  asked: 2 devices, excluding 0 · runner-up GPU 1 (39.5 GiB free, util 97%)" in r.stdout
    assert k.env() == env_of(U[2], U[3])
    # a new pick replaces the old one and its lease
    r = k.run("%gpu pick --max-util 50 --exclude GPU-a1000000 --exclusive")
    assert r.status == "ok", r
    assert r.stdout.splitlines()[1] == (
        "  asked: max util 50%, excluding GPU-a1000000, exclusive · "
        "no runner-up (nothing else fits)"
    )
    assert k.env() == env_of(U[2])
    (lease,) = DirectoryStore(str(host["registry"])).list_leases()
    assert lease.exclusive and lease.device_uuids == (U[2],)
    # --force with CUDA not initialised just picks
    r = k.run("%gpu pick --force --min-free 25%")
    assert r.status == "ok" and "WARNING" not in r.stdout, r
    assert "  asked: min free 25% of the device · runner-up GPU 2" in r.stdout
    assert k.env() == env_of(U[0])


def test_dry_run_shows_ranking_and_changes_nothing(k: Kernel) -> None:
    r = k.run("%gpu pick --dry-run --min-free 20G")
    assert r.status == "ok", r
    # aligned columns, numbers right-aligned, one line per device at a notebook's width
    assert r.stdout.splitlines() == [
        "autogpu dry run (min free 20.0 GiB): nothing changed",
        "  rank  device  name                       free  util  load      leases  verdict",
        "  1     GPU 0   NVIDIA A100-SXM4-80GB  77.5 GiB    3%  3% mem         0  would pick: "
        "77.5 GiB free >= 20.0 GiB wanted",
        "  2     GPU 2   NVIDIA L4              21.1 GiB   12%  12% util       0  fits: "
        "21.1 GiB free >= 20.0 GiB wanted",
        "  3     GPU 1   NVIDIA A100-SXM4-80GB  39.5 GiB   97%  97% util       0  fits: "
        "39.5 GiB free >= 20.0 GiB wanted",
        "  -     GPU 3   NVIDIA L4              10.1 GiB   80%  -              0  dropped: "
        "only 10.1 GiB free < 20.0 GiB wanted",
        "  why GPU 0 over GPU 2: lower load (3% mem vs 12% util)",
    ]
    assert k.env() == ENV0


def test_preset_cuda_visible_devices_narrows_the_choice(k: Kernel) -> None:
    k.run("os.environ['CUDA_VISIBLE_DEVICES'] = '3,2'")
    r = k.run("%gpu pick")
    assert r.status == "ok", r
    assert r.stdout.startswith("autogpu: picked GPU 2 · NVIDIA L4 · GPU-a1000004:")
    assert k.env() == env_of(U[2])
    r = k.run("%gpu pick --exclude 2")
    assert r.stdout.startswith("autogpu: picked GPU 3 · NVIDIA L4 · GPU-a1000005:"), r
    assert "no runner-up" in r.stdout
    # GPU 0 is the best of the host but outside the allocation: dropped, never chosen
    r = k.run("%gpu pick --exclude 2,3")
    assert no_fit(r).splitlines()[1] == (
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: outside this process's allocation "
        "(CUDA_VISIBLE_DEVICES='3,2' grants GPU 3, GPU 2)"
    )
    assert k.env() == env_of(U[3])
    r = k.run("%gpu release")
    assert r.stdout == (
        "autogpu: released GPU 3 and its lease; CUDA_VISIBLE_DEVICES restored to '3,2'\n"
    )
    assert k.env() == {"CUDA_VISIBLE_DEVICES": "3,2", "CUDA_DEVICE_ORDER": None}


def test_mig_device_is_picked_never_its_parent(k: Kernel, host: dict[str, Any]) -> None:
    host["fake"].write(fleet_mig())
    r = k.run("%gpu pick --min-free 20G --exclude 1")
    assert r.status == "ok", r
    assert r.stdout.splitlines()[0] == (
        "autogpu: picked GPU 0 MIG 0 · NVIDIA A100-SXM4-80GB MIG 3g.40gb · MIG-11111111: "
        "29.5 GiB free of 39.5 GiB, util unknown"
    )
    assert k.env() == env_of("MIG-11111111-aaaa-5bbb-8ccc-000000000001")
    r = k.run("%gpu pick --count 2 --exclude 1")
    assert no_fit(r).splitlines()[0] == "autogpu: no device fits (2 devices, excluding 1):"
    assert (
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: MIG mode is on: use one of its 2 MIG "
        "devices instead"
    ) in no_fit(r)
    assert k.env() == env_of("MIG-11111111-aaaa-5bbb-8ccc-000000000001")


def test_lost_gpu_and_utilisation_not_supported(k: Kernel, host: dict[str, Any]) -> None:
    host["fake"].write(fleet_edge_cases())
    r = k.run("%gpu pick --dry-run --max-util 50")
    assert r.status == "ok", r
    header = r.stdout.splitlines()[1]
    assert r.stdout.splitlines()[-1].startswith("  why GPU 0 over GPU 3: ")
    rows: list[str] = []
    for line in r.stdout.splitlines()[2:-1]:
        if line.startswith("  ") and not line[2].strip():
            # a long verdict continues under its own column, never back at column 0
            assert len(line) - len(line.lstrip()) == header.index("verdict"), line
            rows[-1] += " " + line.strip()
        else:
            rows.append(line)
    assert [row.split()[0] + " " + row.split()[2] for row in rows] == [
        "1 0",
        "2 3",
        "- 1",
        "- 2",
        "- 4",
    ]
    assert rows[1].endswith("fits: utilisation unknown (not supported here): not filtered on it")
    assert rows[2].endswith("dropped: unavailable: GPU is lost")
    assert rows[3].endswith("dropped: unavailable: no permission")
    assert rows[4].endswith("dropped: compute mode PROHIBITED: no CUDA context allowed")
    r = k.run("%gpu pick --exclude 0")
    assert r.status == "ok", r
    assert r.stdout.splitlines()[0] == (
        "autogpu: picked GPU 3 · NVIDIA A100-SXM4-80GB · GPU-a1000003: 9.5 GiB free of "
        "80.0 GiB, util unknown"
    )
    assert k.env() == env_of(fleet_edge_cases()["devices"][3]["uuid"])


def test_wait_succeeds_when_memory_is_freed(k: Kernel, host: dict[str, Any]) -> None:
    fake: FakeNvml = host["fake"]
    progress: list[str] = []

    def on_output(msg: dict[str, Any]) -> None:
        text = msg["content"].get("data", {}).get("text/plain", "")
        if text.startswith("waiting for a device") and not progress:
            # someone else's job on GPU 1 ends while we wait
            fake.set(1, memory_used=0, processes=[], utilization_pct=0)
        if text:
            progress.append(text)

    r = k.run("%gpu pick --min-free 78G --wait 30s", on_output=on_output)
    assert r.status == "ok", r
    assert progress[0].startswith("waiting for a device (min free 78.0 GiB), ")
    assert progress[0].endswith(" of 30s; best now GPU 0: only 77.5 GiB free < 78.0 GiB wanted")
    assert r.stdout.startswith(
        "autogpu: picked GPU 1 · NVIDIA A100-SXM4-80GB · GPU-a1000001: "
        "79.5 GiB free of 80.0 GiB, util 0%"
    )
    assert k.env() == env_of(U[1])


def test_wait_cancelled_by_kernel_interrupt(k: Kernel, host: dict[str, Any]) -> None:
    progress: list[str] = []

    def on_output(msg: dict[str, Any]) -> None:
        text = msg["content"].get("data", {}).get("text/plain", "")
        # Interrupt at the first UPDATE of the progress line, so that the line is surely on the
        # page. (An interrupt during the first display is marked too: tests/unit/test_magics.py,
        # test_a_waiting_line_interrupted_in_its_first_display_is_still_marked.)
        if msg["msg_type"] == "update_display_data" and text.startswith("waiting for a device ("):
            if len(progress) == 1:
                k.km.interrupt_kernel()  # what the notebook's stop button does
        if text:
            progress.append(text)

    r = k.run("%gpu pick --min-free 200G --wait 40s", on_output=on_output, timeout=50)
    assert usage_error(r) == (
        "pick cancelled (interrupted): no device picked, no lease kept, environment unchanged"
    )
    assert progress[-1] == "waiting for a device: cancelled"
    assert k.env() == ENV0
    assert DirectoryStore(str(host["registry"])).list_leases(include_tickets=True) == []
    # the kernel still works
    assert k.run("%gpu pick").status == "ok"


def test_status_is_a_compact_escaped_table_with_this_kernel_marked(k: Kernel) -> None:
    # (other users' hostile notebook paths: tests/multiuser/test_safety_kernel.py; the caption here)
    k.run("%gpu pick --exclude 0")
    r = k.run("%gpu")
    assert r.status == "ok", r
    (out,) = r.outputs
    html = out["content"]["data"]["text/html"]
    assert "GPUs on this host · this kernel: ▶ GPU 2 (%gpu pick, excluding 0)" in html
    assert html.count("<table") == 1 and "<img" not in html and "<script" not in html
    # this kernel's own lease, on GPU 2's line (the other holder is the fleet's process)
    gpu2 = html.split("<tr")[4]
    assert ">GPU 2</td>" in gpu2 and ">this kernel, pid 1000004 (1.0 GiB used)</td>" in gpu2
    # one row per device; only GPU 2's row is marked (theme colours, not a fixed yellow)
    rows = html.split("<tr")[2:]
    assert len(rows) == 4
    assert [("data-mine" in row) for row in rows] == [False, False, True, False]
    assert "var(--jp-layout-color2" in rows[2] and "#fff3cd" not in html
    # cells that must not break stay on one line: the model, the label, the memory
    assert '<td style="padding:1px 8px;text-align:left;white-space:nowrap;">NVIDIA L4</td>' in html
    assert "overflow-wrap:anywhere" in html  # only the holders column may wrap
    # sized for a notebook at 1366x768 with the sidebar open: the short UUID (what it can do
    # without) is left out, so the holders are never cut at the right edge
    assert "NVIDIA L4" in html and "GPU-a1000005" not in html and ">uuid</th>" not in html
    # the same table as text for frontends without HTML, 120 columns at most
    text = out["content"]["data"]["text/plain"].splitlines()
    assert text[0] == "GPUs on this host"
    assert text[1].split() == [
        "gpu", "name", "util", "memory", "used", "/", "total", "free", "temp", "power",
        "procs", "holders",
    ]
    assert all(len(line) <= 120 for line in text[1:-1]), text


def test_cell_magic_picks_runs_and_reports(k: Kernel) -> None:
    r = k.run("%%gpu --min-free 10G\nx = 6 * 7\nx")
    assert r.status == "ok", r
    out = r.stdout.splitlines()
    assert out[0].startswith("autogpu: picked GPU 0 · NVIDIA A100-SXM4-80GB")
    assert out[-1].startswith("autogpu %%gpu on GPU 0: wall ")
    assert out[-1].endswith(
        " · peak GPU memory of this kernel 0 B · mean utilisation 3% (1 sample)"
    )
    assert r.texts() == ["42"]
    assert k.env() == env_of(U[0])
    # already has a GPU that does not meet the cell's options: kept, and said so
    r = k.run("%%gpu --min-free 79G\ny = x + 1")
    assert r.status == "ok", r
    assert r.stdout.splitlines()[:2] == [
        "autogpu: this kernel already has a GPU that does not meet min free 79.0 GiB (kept; to "
        "change: %gpu release, restart the kernel, %gpu pick):",
        "  GPU 0: only 77.5 GiB free < 79.0 GiB wanted",
    ]
    assert k.run("print(y)").stdout == "43\n"
    # an error in the cell fails the cell with the user's exception, after the report
    r = k.run("%%gpu\n1 / 0")
    assert r.error == ("ZeroDivisionError", "division by zero")
    assert r.stdout.startswith("autogpu %%gpu on GPU 0: wall ")
    # a failed pick does not run the cell
    k.run("%gpu release")
    r = k.run("%%gpu --max-util 1\nz = 1")
    assert no_fit(r).startswith("autogpu: no device fits (max util 1%):")
    assert no_fit(r).endswith("add --wait: %%gpu ... --wait 10m (interrupt the kernel to cancel)")
    assert k.run("print('z' in dir())").stdout == "False\n"
    assert k.env() == ENV0


def test_too_late_refused_then_forced(host: dict[str, Any]) -> None:
    build_fake_cuda()
    kernel = Kernel(host["env"])
    try:
        assert kernel.run("%load_ext autogpu").status == "ok"
        r = kernel.run(INIT_SNIPPET)
        assert r.status == "ok", r
        state = CudaState(**json.loads(kernel.run(STATE_SNIPPET).stdout))
        assert state.initialized
        r = kernel.run("%gpu pick --min-free 10G")
        assert usage_error(r) == too_late_message(state)
        assert "Restart the kernel and run `%gpu pick` first" in usage_error(r)
        assert kernel.env() == ENV0
        r = kernel.run("%gpu pick --force")
        assert r.status == "ok", r
        assert r.stdout.splitlines()[-1] == "  WARNING --force: " + too_late_message(state)
        assert kernel.env() == env_of(U[0])
        r = kernel.run("%gpu release")
        assert r.stdout.splitlines()[1] == (
            "  CUDA is already initialised in this kernel: it "
            "keeps using GPU 0 until you restart the kernel"
        )
    finally:
        kernel.close()


def test_panel_text_plain_is_a_table_not_the_widgets_repr(k: Kernel) -> None:
    """Issue 41: what a viewer without widgets shows for ``%gpu panel`` (a headless run, nbconvert
    to text) is the GPUs with this kernel's marked, not ``Panel(children=(HTML(value='<div…``."""
    assert k.run("%gpu pick 2").status == "ok"
    r = k.run("%gpu panel")
    assert r.status == "ok", r
    (data,) = [o["content"]["data"] for o in r.outputs if o["msg_type"] == "display_data"]
    assert "application/vnd.jupyter.widget-view+json" in data
    text = data["text/plain"]
    assert text.startswith("autogpu panel: 4 device(s)"), text
    assert "Panel(" not in text
    (mine,) = [line for line in text.splitlines() if line.startswith("▶")]
    assert mine.split()[1:3] == ["GPU", "2"]
    assert text.splitlines()[-1] == "this kernel: ▶ GPU 2"


def test_visible_ids_index_writes_nvml_indices_and_refuses_mig(
    k: Kernel, host: dict[str, Any]
) -> None:
    """``%config AutoGPU.visible_ids = "index"`` (issue 41): ``%gpu pick 2`` writes ``2`` with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which the kernel reads back as GPU 2; a MIG device is
    refused in one line, the environment and the registry untouched."""
    try:
        assert k.run('%config AutoGPU.visible_ids = "index"').status == "ok"
        r = k.run("%gpu pick 2")
        assert r.status == "ok", r
        assert r.stdout.splitlines()[-1] == "  CUDA_VISIBLE_DEVICES=2"
        assert k.env() == {"CUDA_VISIBLE_DEVICES": "2", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        r = k.run(
            "from autogpu_jupyter.core.backends import get_backend as _gb\n"
            "from autogpu_jupyter.core.visibility import parse_cuda_visible_devices as _p\n"
            "print(_p(os.environ['CUDA_VISIBLE_DEVICES'], _gb().snapshot().devices)[0])")
        assert r.stdout.strip() == repr((U[2],)), r
        k.run("%gpu release")
        host["fake"].write(fleet_mig())
        r = k.run("%gpu pick --exclude 1")
        assert r.status == "error" and r.error[0] == "UsageError", r
        assert r.error[1] == (
            "visible_ids = 'index' cannot select GPU 0 MIG 1: CUDA selects a MIG device by its "
            "UUID only; set c.AutoGPU.visible_ids = 'uuid' (the default) for MIG devices"), r
        assert k.env() == ENV0
        assert DirectoryStore(str(host["registry"])).list_leases() == []
    finally:
        k.run('%config AutoGPU.visible_ids = "uuid"')
