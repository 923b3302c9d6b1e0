"""A fake ROCm runtime for tests: ``libamdhip64.so`` (HIP) linked against a fake
``libhsa-runtime64.so.1`` (ROCr), built with gcc from ``fakehip.c`` and ``fakehsa.c``.

It lets tests exercise :func:`autogpu_jupyter.core.cudastate.hip_state` for real (it reads
``/proc/self/maps`` and asks the mapped ROCr through ``RTLD_NOLOAD``) in a subprocess or a real
kernel, on machines without an AMD GPU:

* :func:`build_fake_hip` compiles both (again when a source changes) and returns HIP's path.
* :data:`LOAD_SNIPPET` maps HIP (and with it ROCr) without initialising anything, as
  ``import torch`` does on a ROCm build.
* :data:`INIT_SNIPPET` maps it and calls ``hipInit(0)``: HIP is then initialised, as after
  ``torch.zeros(1, device="cuda")`` on ROCm. The fake ROCr reads ``ROCR_VISIBLE_DEVICES`` at that
  moment; ``fakeHsaInitVisibleDevices()`` returns what it saw.
* :data:`STATE_SNIPPET` prints ``hip_state()`` as one JSON line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = ["HIP_PATH", "HSA_PATH", "build_fake_hip", "LOAD_SNIPPET", "INIT_SNIPPET",
           "STATE_SNIPPET"]

HERE = Path(__file__).resolve().parent
BUILD_DIR = HERE / "build"
HSA_PATH = BUILD_DIR / "libhsa-runtime64.so.1"
HIP_PATH = BUILD_DIR / "libamdhip64.so"


def _compile(out: Path, source: Path, extra: list[str]) -> None:
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("building the fake HIP needs gcc (or $CC) on PATH")
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-Wl,-soname,{out.name}",
           "-o", str(tmp), str(source), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building the fake HIP failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, out)


def build_fake_hip() -> Path:
    """Compile the fake ROCr and HIP unless up to date; returns ``libamdhip64.so``'s path."""
    BUILD_DIR.mkdir(exist_ok=True)
    hsa_src, hip_src = HERE / "fakehsa.c", HERE / "fakehip.c"
    if not HSA_PATH.exists() or HSA_PATH.stat().st_mtime_ns < hsa_src.stat().st_mtime_ns:
        _compile(HSA_PATH, hsa_src, [])
    if not HIP_PATH.exists() or HIP_PATH.stat().st_mtime_ns < max(
        hip_src.stat().st_mtime_ns, HSA_PATH.stat().st_mtime_ns
    ):
        # linked by path with $ORIGIN as its run path: HIP maps "its" ROCr, as the real one does
        _compile(HIP_PATH, hip_src, [str(HSA_PATH), "-Wl,-rpath,$ORIGIN"])
    return HIP_PATH


#: Maps the fake HIP (and ROCr) into this process without initialising (``_fake_hip``).
LOAD_SNIPPET = f"import ctypes as _ct; _fake_hip = _ct.CDLL({str(HIP_PATH)!r})\n"

#: Maps the fake HIP and initialises it; raises if hipInit does not return hipSuccess.
INIT_SNIPPET = LOAD_SNIPPET + (
    "_rc = _fake_hip.hipInit(0)\n"
    "if _rc != 0:\n"
    "    raise RuntimeError(f'fake hipInit returned {_rc}')\n"
)

#: Prints this process's ``hip_state()`` as one JSON line.
STATE_SNIPPET = (
    "import dataclasses as _dc, json as _json\n"
    "from autogpu_jupyter.core.cudastate import hip_state as _hs\n"
    "print(_json.dumps(_dc.asdict(_hs())))\n"
)
