"""Run by benchmarks/container_herd.py, in a container or on the host: start K real IPython
kernels (``jupyter_client``), ``%load_ext autogpu`` in each, print ``ready``, wait for a line on
stdin (the gate: every driver is told at once), then run ``%gpu pick`` in all K at once and print
one JSON line per kernel (``seconds``: the pick cell's own time, ``device``). The kernels hold
their leases until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from jupyter_client.manager import KernelManager

from tests.kernelhelpers import Kernel

PICK = (
    "import os, time as _t\n_t0 = _t.perf_counter()\n%gpu pick\n"
    "print('RESULT', _t.perf_counter() - _t0, os.environ.get('CUDA_VISIBLE_DEVICES'))"
)


class _IpcKernel(Kernel):
    """A kernel on Unix sockets (``transport="ipc"``), in both modes: on the host, drivers side
    by side picking TCP ports at the same moment collide (a container has a network namespace
    of its own)."""

    def __init__(self, cwd: str, n: int) -> None:
        self.km = KernelManager(kernel_name="python3", transport="ipc",
                                ip=os.path.join(cwd, f"k{os.getpid()}-{n}"))
        self.km.start_kernel(env=dict(os.environ), cwd=cwd)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)


def _started(cwd: str, n: int) -> Kernel:
    return _IpcKernel(cwd, n)


def main() -> int:
    k = int(sys.argv[1])
    cwd = os.environ.get("HERD_CWD", "/tmp")
    with ThreadPoolExecutor(k) as pool:
        kernels = [_started(cwd, n) for n in range(k)]
        try:
            for kern in kernels:
                r = kern.run("%load_ext autogpu", timeout=120)
                assert r.status == "ok", r.stderr
            print("ready", flush=True)
            sys.stdin.readline()
            lock = threading.Lock()

            def pick(kern: Kernel) -> None:
                r = kern.run(PICK, timeout=300)
                line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT")), "")
                parts = line.split()
                out = {"seconds": float(parts[1]) if parts else None,
                       "device": parts[2] if len(parts) > 2 else None,
                       "error": None if parts else (r.stderr or str(r.error))[-300:]}
                with lock:
                    print(json.dumps(out), flush=True)

            list(pool.map(pick, kernels))
            sys.stdin.read()
        finally:
            for kern in kernels:
                kern.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
