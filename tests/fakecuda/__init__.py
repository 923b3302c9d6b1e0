"""A fake CUDA driver, ``libcuda.so.1`` built from ``fakecuda.c`` with gcc, for tests.

It lets tests exercise :mod:`autogpu_jupyter.core.cudastate` for real (the module reads
``/proc/self/maps`` and reopens the mapped library with ``RTLD_NOLOAD``) in a subprocess or a
real kernel, on machines without an NVIDIA driver:

* :func:`build_fake_cuda` compiles it (once; again when the C source changes) and returns its path.
* :data:`LOAD_SNIPPET` is Python code that maps the fake into the process without ``cuInit``.
* :data:`INIT_SNIPPET` maps it and calls ``cuInit(0)``: CUDA is then initialised in that process,
  as after ``import torch; torch.zeros(1, device="cuda")``. Run it inside a kernel to test the
  magics' too-late refusal. It reads ``CUDA_VISIBLE_DEVICES`` at that moment, as CUDA does;
  ``fakeCudaInitVisibleDevices()`` returns what it saw.
* :data:`STATE_SNIPPET` prints ``cuda_state()`` as one JSON line.

Build :func:`build_fake_cuda` before running a snippet: they use :data:`LIB_PATH`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "SOURCE",
    "LIB_PATH",
    "build_fake_cuda",
    "LOAD_SNIPPET",
    "INIT_SNIPPET",
    "STATE_SNIPPET",
]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fakecuda.c"
BUILD_DIR = HERE / "build"
LIB_PATH = BUILD_DIR / "libcuda.so.1"


def build_fake_cuda() -> Path:
    """Compile ``fakecuda.c`` into ``build/libcuda.so.1`` unless it is up to date.

    Safe when several test processes build at once (each writes its own file, then renames).

    Raises
    ------
    RuntimeError
        gcc is missing or the build fails (the compiler's output is in the message).
    """
    if LIB_PATH.exists() and LIB_PATH.stat().st_mtime_ns >= SOURCE.stat().st_mtime_ns:
        return LIB_PATH
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        raise RuntimeError("building the fake libcuda needs gcc (or $CC) on PATH")
    BUILD_DIR.mkdir(exist_ok=True)
    tmp = BUILD_DIR / f".libcuda.so.1.{os.getpid()}"
    cmd = [
        cc,
        "-shared",
        "-fPIC",
        "-O1",
        "-Wall",
        "-Werror",
        "-Wl,-soname,libcuda.so.1",
        "-o",
        str(tmp),
        str(SOURCE),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building the fake libcuda failed: {' '.join(cmd)}\n{proc.stderr}")
    os.replace(tmp, LIB_PATH)
    return LIB_PATH


#: Maps the fake libcuda into this process, without calling cuInit (``_fake_cuda`` is its handle).
LOAD_SNIPPET = f"import ctypes as _ct; _fake_cuda = _ct.CDLL({str(LIB_PATH)!r})\n"

#: Maps the fake libcuda and initialises CUDA; raises if cuInit does not return CUDA_SUCCESS.
INIT_SNIPPET = LOAD_SNIPPET + (
    "_rc = _fake_cuda.cuInit(0)\n"
    "if _rc != 0:\n"
    "    raise RuntimeError(f'fake cuInit returned {_rc}')\n"
)

#: Prints this process's ``cuda_state()`` as one JSON line.
STATE_SNIPPET = (
    "import dataclasses as _dc, json as _json\n"
    "from autogpu_jupyter.core.cudastate import cuda_state as _cs\n"
    "print(_json.dumps(_dc.asdict(_cs())))\n"
)
