"""core.cudastate against a real (fake) libcuda.so.1, in fresh subprocesses (pitfalls case 8).

Nothing is patched: each test starts a Python process, maps the fake driver (or not), calls
cuInit (or not) and runs ``cuda_state()`` there, which reads that process's /proc/self/maps and
reopens the library with RTLD_NOLOAD.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.cudastate import CudaState, cuda_state, mapped_libcuda, too_late_message
from tests.fakecuda import INIT_SNIPPET, LIB_PATH, LOAD_SNIPPET, STATE_SNIPPET, build_fake_cuda

ROOT = Path(__file__).resolve().parents[2]
LIB = str(LIB_PATH)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="cudastate reads /proc/self/maps (Linux only)"
)


@pytest.fixture(scope="module")
def fake_cuda() -> Path:
    return build_fake_cuda()


def run_py(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter; returns its stdout (fails the test on error)."""
    full_env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    full_env.update(PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def state_after(code: str, **env: str) -> dict[str, Any]:
    out = run_py(code + STATE_SNIPPET, **env)
    return json.loads(out.strip().splitlines()[-1])


def test_fresh_process_is_not_initialised(fake_cuda: Path) -> None:
    assert state_after("") == {
        "initialized": False,
        "evidence": "no libcuda mapped in this process: nothing has called cuInit",
        "framework": None,
    }


def test_mapped_without_cuinit_is_not_initialised(fake_cuda: Path) -> None:
    assert state_after(LOAD_SNIPPET) == {
        "initialized": False,
        "evidence": f"libcuda is mapped ({LIB}) but cuDeviceGetCount returned "
        "CUDA_ERROR_NOT_INITIALIZED (3): cuInit has not run yet",
        "framework": None,
    }


def test_after_cuinit_is_initialised(fake_cuda: Path) -> None:
    assert state_after(INIT_SNIPPET) == {
        "initialized": True,
        "evidence": f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {LIB}: "
        "cuInit has run",
        "framework": None,
    }


def test_cuinit_with_no_visible_device_still_counts(fake_cuda: Path) -> None:
    code = LOAD_SNIPPET + "assert _fake_cuda.cuInit(0) == 100\n"
    assert state_after(code, CUDA_VISIBLE_DEVICES="") == {
        "initialized": True,
        "evidence": f"cuDeviceGetCount returned CUDA_ERROR_NO_DEVICE (100) from {LIB}: "
        "cuInit has run",
        "framework": None,
    }


def test_checking_neither_loads_nor_initialises_cuda(fake_cuda: Path) -> None:
    # libcuda.so.1 is findable through LD_LIBRARY_PATH: a fresh dlopen would succeed and map it.
    code = (
        "from autogpu_jupyter.core.cudastate import cuda_state, mapped_libcuda\n"
        "cuda_state(); cuda_state()\n"
        "print(mapped_libcuda())\n"
    )
    assert run_py(code, LD_LIBRARY_PATH=str(fake_cuda.parent)).strip() == "[]"
    code = LOAD_SNIPPET + (
        "from autogpu_jupyter.core.cudastate import cuda_state\n"
        "cuda_state(); cuda_state()\n"
        "print(_fake_cuda.cuInit.__name__, _fake_cuda.fakeCudaInitCount())\n"
    )
    assert run_py(code).strip() == "cuInit 0"


def test_cuda_visible_devices_is_read_at_cuinit_only(fake_cuda: Path) -> None:
    # What the too-late refusal protects: changing CVD after cuInit changes nothing.
    code = INIT_SNIPPET + (
        "import ctypes, os\n"
        "os.environ['CUDA_VISIBLE_DEVICES'] = 'GPU-changed-later'\n"
        "_fake_cuda.cuInit(0)\n"
        "_fake_cuda.fakeCudaInitVisibleDevices.restype = ctypes.c_char_p\n"
        "n = ctypes.c_int(); _fake_cuda.cuDeviceGetCount(ctypes.byref(n))\n"
        "print(_fake_cuda.fakeCudaInitVisibleDevices().decode(), n.value)\n"
    )
    assert run_py(code, CUDA_VISIBLE_DEVICES="0,1").strip() == "0,1 2"


def test_framework_hint_names_torch(fake_cuda: Path) -> None:
    # A stand-in torch module (real torch is not installed here): the hint only words messages.
    stub = (
        "import sys, types\n"
        "_t = types.ModuleType('torch')\n"
        "_t.cuda = types.SimpleNamespace(is_initialized=lambda: False)\n"
        "sys.modules['torch'] = _t\n"
    )
    assert state_after(stub + INIT_SNIPPET) == {
        "initialized": True,
        "evidence": f"cuDeviceGetCount returned CUDA_SUCCESS (0, 4 device(s)) from {LIB}: "
        "cuInit has run (torch.cuda.is_initialized() is False)",
        "framework": "torch",
    }
    assert state_after("import sys, types; sys.modules['jax'] = types.ModuleType('jax')\n") == {
        "initialized": False,
        "evidence": "no libcuda mapped in this process: nothing has called cuInit",
        "framework": "jax",
    }


def test_mapped_but_not_reopenable_counts_as_initialised(fake_cuda: Path, tmp_path: Path) -> None:
    # A maps file naming the fake library, which this test process has not loaded: RTLD_NOLOAD
    # must refuse to load it, and the answer is the conservative one.
    maps = tmp_path / "maps"
    maps.write_text(f"7f0000000000-7f0000001000 r-xp 00000000 08:01 42 {LIB}\n", encoding="utf-8")
    code = (
        "from autogpu_jupyter.core.cudastate import cuda_state, mapped_libcuda\n"
        f"s = cuda_state({str(maps)!r})\n"
        "print(s.initialized, mapped_libcuda())\n"
        "print(s.evidence)\n"
    )
    first, evidence = run_py(code).strip().splitlines()
    assert first == "True []"
    assert evidence.startswith(
        f"libcuda is mapped ({LIB}) but could not be reopened with RTLD_NOLOAD ("
    )
    assert evidence.endswith("); assuming CUDA is initialised")


def test_one_initialised_copy_of_two_mapped_is_enough(fake_cuda: Path, tmp_path: Path) -> None:
    # Two libcuda copies mapped (a container's compat driver next to the host's): the fake is
    # loaded but not initialised; the other cannot be asked, so it counts as initialised.
    other = "/opt/compat/libcuda.so.1"
    maps = tmp_path / "maps"
    maps.write_text(
        f"7f01-7f02 r-xp 00000000 08:01 1 {LIB}\n7f02-7f03 r-xp 00000000 08:01 2 {other}\n",
        encoding="utf-8",
    )
    code = (
        LOAD_SNIPPET
        + "from autogpu_jupyter.core.cudastate import cuda_state\n"
        + f"s = cuda_state({str(maps)!r})\n"
        + "print(s.initialized)\n"
        + "print(s.evidence)\n"
    )
    initialized, evidence = run_py(code).strip().splitlines()
    assert initialized == "True"
    assert evidence.startswith(
        f"libcuda is mapped ({other}) but could not be reopened with RTLD_NOLOAD ("
    )
    assert evidence.endswith("); assuming CUDA is initialised")


def test_mapped_libcuda_reads_only_the_driver(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "00400000-00401000 r-xp 00000000 08:01 1 /usr/bin/python3.11\n"
        "7f01-7f02 r-xp 00000000 08:01 2 /usr/local/cuda/lib64/libcudart.so.12.4.127\n"
        "7f02-7f03 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libcudadebugger.so.1\n"
        "7f03-7f04 r-xp 00000000 08:01 4 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
        "7f04-7f05 r--p 00001000 08:01 4 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
        "7f05-7f06 r-xp 00000000 08:01 5 /opt/compat/libcuda.so.1 (deleted)\n"
        "7f06-7f07 rw-p 00000000 00:00 0 \n"
        "7ffc-7ffd rw-p 00000000 00:00 0                          [stack]\n",
        encoding="utf-8",
    )
    assert mapped_libcuda(str(maps)) == [
        "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15",
        "/opt/compat/libcuda.so.1",
    ]


def test_unreadable_maps_is_not_initialised(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    assert mapped_libcuda(missing) is None
    state = cuda_state(missing)
    assert (state.initialized, state.evidence) == (
        False,
        f"cannot read {missing} (not Linux?): no sign of CUDA",
    )


def test_too_late_message_wording() -> None:
    state = CudaState(True, "cuDeviceGetCount returned CUDA_SUCCESS (0, 2 device(s))", "torch")
    assert too_late_message(state) == (
        "CUDA is already initialised in this kernel, probably by torch (cuDeviceGetCount returned "
        "CUDA_SUCCESS (0, 2 device(s))). CUDA_VISIBLE_DEVICES is read once, when CUDA "
        "initialises, so changing it now has no effect; nothing was changed. Restart the kernel "
        "and run `%gpu pick` first, before importing torch or anything that uses CUDA, or start "
        'the notebook with the "Python 3 (autogpu)" kernel, which picks before the kernel '
        "starts."
    )
    generic = too_late_message(CudaState(True, "x", None), where="this process")
    assert generic == (
        "CUDA is already initialised in this process (x). CUDA_VISIBLE_DEVICES is read once, when "
        "CUDA initialises, so changing it now has no effect; nothing was changed. Restart the "
        "kernel and run `%gpu pick` first, before importing torch, jax, cupy, tensorflow or "
        'anything that uses CUDA, or start the notebook with the "Python 3 (autogpu)" kernel, '
        "which picks before the kernel starts."
    )
