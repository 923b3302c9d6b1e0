"""The ``autogpu`` command, run as a real process on a simulated fleet file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GiB = 1024**3
UUIDS = [f"GPU-{i}{i}{i}{i}{i}{i}{i}{i}-0000-0000-0000-00000000000{i}" for i in range(4)]


def fleet() -> dict:
    used = [60, 10, 30, 79]
    return {
        "driver_version": "550.54.15",
        "devices": [
            {"name": "NVIDIA A100-SXM4-80GB", "uuid": UUIDS[i], "pci_bus_id": f"00000000:0{i}:00.0",
             "memory_total": "80GiB", "memory_used": f"{used[i]}GiB", "utilization_pct": 10 * i}
            for i in range(4)
        ],
    }


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet()))
    e = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_", "SLURM_", "NVIDIA_"))}
    e.update(AUTOGPU_SIMULATE=str(path), AUTOGPU_REGISTRY_DIR=str(tmp_path / "registry"))
    return e


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autogpu_jupyter.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_list_table_and_json(env: dict[str, str]) -> None:
    out = run({**env, "COLUMNS": "200"}, "list")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (
        "4 device(s) via simulated — SIMULATED fleet (AUTOGPU_SIMULATE), not real GPUs"
    )
    assert lines[3].startswith("GPU 1  NVIDIA A100-SXM4-80GB  GPU-11111111")
    assert "10.0 GiB / 80.0 GiB" in lines[3] and "70.0 GiB" in lines[3]
    data = json.loads(run(env, "list", "--json").stdout)
    assert data["simulated"] is True
    assert [d["uuid"] for d in data["devices"]] == UUIDS
    assert data["devices"][3]["memory_free_bytes"] == 1 * GiB
    assert data["leases"] == []


@pytest.mark.parametrize("width", [80, 200])
def test_list_fits_the_terminal_with_text_left_aligned(env: dict[str, str], width: int) -> None:
    """``autogpu list`` is the table of ``%gpu status``, as wide as the terminal: an 80-column
    one leaves out what it can do without (UUID, power, temperature, processes, memory in use),
    never the free memory or the holders; text columns are left-aligned, numbers right."""
    out = run({**env, "COLUMNS": str(width)}, "list")
    assert out.returncode == 0, out.stderr
    _title, header, *rows = out.stdout.splitlines()
    assert all(len(line) <= width for line in [header, *rows]), out.stdout
    names = header.split()
    if width == 80:
        assert names == ["gpu", "name", "util", "free", "holders"]
    else:
        assert names == ["gpu", "name", "uuid", "util", "memory", "used", "/", "total", "free",
                         "temp", "power", "procs", "holders"]
    # text starts under its title (left-aligned); numbers end under theirs (right-aligned)
    for row in rows:
        assert row[header.index("name"):].startswith("NVIDIA A100-SXM4-80GB")
        assert row[header.index("gpu"):].startswith("GPU ")
        util_end = header.index("util") + len("util")
        assert row[:util_end].endswith("%")
        assert row[:util_end][-2].isdigit()
    assert rows[1][: header.index("free") + len("free")].endswith("70.0 GiB")


def test_pick_prints_choice_runner_up_and_variables(env: dict[str, str]) -> None:
    out = run(env, "pick", "--min-free", "10G")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        f"GPU 1 NVIDIA A100-SXM4-80GB {UUIDS[1]}: 70.0 GiB free, util 10%",
        "asked: min free 10.0 GiB",
        "runner-up: GPU 2 (50.0 GiB free)",
        "note: SIMULATED fleet (AUTOGPU_SIMULATE)",
        f"set: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={UUIDS[1]}",
    ]


def test_pick_export_is_evaluable(env: dict[str, str]) -> None:
    out = run(env, "pick", "--count", "2", "--export")
    assert out.stdout.strip() == (
        f"export CUDA_DEVICE_ORDER=PCI_BUS_ID; export CUDA_VISIBLE_DEVICES={UUIDS[1]},{UUIDS[2]};"
    )
    shell = subprocess.run(["bash", "-c", out.stdout + 'echo "$CUDA_VISIBLE_DEVICES"'],
                           capture_output=True, text=True, check=True)
    assert shell.stdout.strip() == f"{UUIDS[1]},{UUIDS[2]}"


def test_pick_json(env: dict[str, str]) -> None:
    data = json.loads(run(env, "pick", "--exclude", "1", "--json").stdout)
    assert [d["uuid"] for d in data["chosen"]] == [UUIDS[2]]
    assert data["env"] == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": UUIDS[2]}
    dropped = {c["label"]: c["reasons"] for c in data["candidates"] if not c["eligible"]}
    assert dropped == {"GPU 1": ["excluded by --exclude 1"]}


def test_pick_stays_inside_an_inherited_allocation(env: dict[str, str]) -> None:
    env["CUDA_VISIBLE_DEVICES"] = "3,0"
    out = run(env, "pick", "--json")
    assert [d["uuid"] for d in json.loads(out.stdout)["chosen"]] == [UUIDS[0]]


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["pick", "--min-free", "10Q"], 2,
         "autogpu: invalid size '10Q': unknown unit 'Q'; expected"),
        (["pick", "--min-free", "10"], 2, "autogpu: invalid size '10': a bare number is ambiguous"),
        (["pick", "--count", "-1"], 2,
         "autogpu: invalid --count '-1': expected a whole number >= 1"),
        (["pick", "--max-util", "150"], 2, "autogpu: invalid --max-util '150': must be 0-100"),
        (["pick", "--exclude", "7"], 2,
         "autogpu: unknown device id '7' in --exclude; expected an NVML index (0, 1, 2, 3) or a "
         "UUID"),
        (["pick", "--min-free", "75G"], 3, "autogpu: no device fits (min free 75.0 GiB):"),
        (["pick", "--bogus"], 2, "autogpu pick: error: unrecognized arguments: --bogus"),
        (["run"], 2, "autogpu: error: run needs a command"),
    ],
)
def test_errors_are_one_clear_message_and_exit_code(env: dict[str, str], args: list[str], code: int,
                                                     message: str) -> None:
    out = run(env, *args)
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_no_fit_lists_every_device_and_why(env: dict[str, str]) -> None:
    out = run(env, "pick", "--min-free", "75G")
    assert out.stderr.splitlines()[1:-1] == [
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: only 20.0 GiB free < 75.0 GiB wanted",
        "  GPU 1 (NVIDIA A100-SXM4-80GB): dropped: only 70.0 GiB free < 75.0 GiB wanted",
        "  GPU 2 (NVIDIA A100-SXM4-80GB): dropped: only 50.0 GiB free < 75.0 GiB wanted",
        "  GPU 3 (NVIDIA A100-SXM4-80GB): dropped: only 1.0 GiB free < 75.0 GiB wanted",
    ]


@pytest.mark.parametrize("value", ["", "-1", "NoDevFiles"])
def test_empty_grant_exits_3(env: dict[str, str], value: str) -> None:
    env["CUDA_VISIBLE_DEVICES"] = value
    out = run(env, "pick")
    assert out.returncode == 3
    assert out.stderr.startswith("autogpu: no GPU granted to this process")


def test_no_driver_exits_4(env: dict[str, str]) -> None:
    del env["AUTOGPU_SIMULATE"]
    env["LD_LIBRARY_PATH"] = "/nonexistent"
    out = run(env, "list")
    assert out.returncode == 4
    assert "no NVIDIA driver on this host" in out.stderr
    assert "to try autogpu without a GPU, set AUTOGPU_SIMULATE=demo-4x" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_sets_variables_and_returns_the_command_exit_code(env: dict[str, str]) -> None:
    code = ("import os,sys; "
            "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['CUDA_DEVICE_ORDER']);"
            "sys.exit(7)")
    out = run(env, "run", "--min-free", "1G", "--", sys.executable, "-c", code)
    assert out.returncode == 7
    assert out.stdout.strip() == f"{UUIDS[1]} PCI_BUS_ID"


def test_pick_without_options_says_any_device(env: dict[str, str]) -> None:
    out = run(env, "pick")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1] == "asked: any device"
    assert "no constraints" not in out.stdout


def test_pick_dry_run_shows_the_ranking(env: dict[str, str]) -> None:
    env["COLUMNS"] = "120"  # the terminal's width: one line per device
    out = run(env, "pick", "--dry-run", "--min-free", "30G")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "autogpu [SIMULATED] dry run (min free 30.0 GiB): nothing changed",
        "  rank  device  name                       free  util  load     leases  verdict",
        "  1     GPU 1   NVIDIA A100-SXM4-80GB  70.0 GiB   10%  12% mem       0  would pick: "
        "70.0 GiB free >= 30.0 GiB wanted",
        "  2     GPU 2   NVIDIA A100-SXM4-80GB  50.0 GiB   20%  38% mem       0  fits: "
        "50.0 GiB free >= 30.0 GiB wanted",
        "  -     GPU 0   NVIDIA A100-SXM4-80GB  20.0 GiB    0%  -             0  dropped: "
        "only 20.0 GiB free < 30.0 GiB wanted",
        "  -     GPU 3   NVIDIA A100-SXM4-80GB   1.0 GiB   30%  -             0  dropped: "
        "only 1.0 GiB free < 30.0 GiB wanted",
        "  why GPU 1 over GPU 2: lower load (12% mem vs 38% mem)",
    ]
    assert not (Path(env["AUTOGPU_REGISTRY_DIR"]).exists()
                and any(Path(env["AUTOGPU_REGISTRY_DIR"]).rglob("*.json")))


def test_an_option_error_is_one_line_naming_the_subcommand(env: dict[str, str]) -> None:
    """Issue 41: one line, no argparse usage dump before it."""
    out = run(env, "pick", "--dry-rnu")
    assert out.returncode == 2
    assert out.stderr == "autogpu pick: error: unrecognized arguments: --dry-rnu\n"


def test_help_lists_the_same_exit_codes_as_the_docs(env: dict[str, str]) -> None:
    import re

    readme = (Path(__file__).resolve().parents[2] / "docs" / "usage.md").read_text()
    documented = sorted(set(re.findall(r"^\| (\d) \|", readme, flags=re.MULTILINE)))
    helped = " ".join(run(env, "--help").stdout.split())
    listed = sorted(set(re.findall(r"(?:codes: |, )(\d) ", helped)))
    assert documented == listed == ["0", "1", "2", "3", "4", "5"]


def test_no_fit_suggests_waiting_in_line(env: dict[str, str]) -> None:
    out = run(env, "pick", "--min-free", "75G")
    assert out.returncode == 3
    assert out.stderr.splitlines()[-1] == (
        "nothing picked; to wait in line until a device fits, add --wait DURATION (e.g. --wait 10m)"
    )
    assert "usage:" not in out.stderr
    env["COLUMNS"] = "80"  # a narrow terminal: each verdict goes under its device's row
    narrow = run(env, "pick", "--dry-run", "--min-free", "30G").stdout.splitlines()
    assert narrow[2:4] == [
        "  1     GPU 1   NVIDIA A100-SXM4-80GB  70.0 GiB   10%  12% mem       0",
        "        would pick: 70.0 GiB free >= 30.0 GiB wanted",
    ]
    assert max(map(len, narrow)) <= 80


# ---- naming GPUs (issue 41) --------------------------------------------------------------------


def test_pick_names_a_gpu_as_a_real_process(env: dict[str, str]) -> None:
    """``autogpu pick 2``: GPU 2 although GPU 1 has more free memory, and the variables to set;
    ``--export`` prints them for eval."""
    out = run(env, "pick", "2")
    assert (out.returncode, out.stderr) == (0, "")
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"GPU 2 NVIDIA A100-SXM4-80GB {UUIDS[2]}: 50.0 GiB free")
    assert "asked: device 2" in lines
    assert lines[-1] == f"set: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={UUIDS[2]}"
    out = run(env, "pick", "GPU-33333333", "--export")
    assert out.stdout == (
        f"export CUDA_DEVICE_ORDER=PCI_BUS_ID; export CUDA_VISIBLE_DEVICES={UUIDS[3]};\n")


def test_a_named_gpu_that_does_not_fit_is_one_line_and_a_usage_error_is_one_line(
    env: dict[str, str],
) -> None:
    out = run(env, "pick", "3", "--min-free", "10G")
    assert out.returncode == 3
    assert out.stderr.splitlines()[0] == (
        "autogpu: GPU 3 does not fit (device 3, min free 10.0 GiB): only 1.0 GiB free < 10.0 GiB "
        "wanted")
    out = run(env, "pick", "2", "--gpus", "3")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == "autogpu pick: error: unrecognized arguments: --gpus 3\n"
    out = run(env, "pick", "2,x")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr == (
        "autogpu: no device 'x' on this host; name devices by index (0, 1, 2, 3) or by UUID or "
        "its first 6 or more characters (e.g. GPU-00000000)\n")
