"""A herd of real kernels in containers picking at once through tenant sockets, beside the same
herd on the host (issue 40).

One ``autogpu broker`` (root, a real process) on a simulated fleet of G GPUs serves T tenants
(``t0`` ... from its rules file), each on its own socket. Two modes, one after the other:

* ``containers`` -- T podman containers (rootful, runc, uid 1000, own pid/net/mount namespaces;
  tests/containerhelpers.py), tenant ``tN``'s socket directory mounted at ``/run/autogpu`` in
  container N; each container runs benchmarks/container_herd_kernels.py: K real kernels;
* ``host`` -- the same T drivers as plain processes on the host (root, the host's namespaces),
  each on the same tenant's socket.

In both, every driver starts its kernels and loads the extension, then all wait on one gate; the
gate opens for all drivers at once and every kernel runs ``%gpu pick``. Reported per mode: the
spread (leases per GPU, max - min: 0 is perfect when T*K is a multiple of G; any GPU left empty
while another holds two is a failure), the pick cell's time in each kernel (p50, p99, max), and
the ratio containers / host.

Run (root, podman and runc installed)::

    .venv/bin/python benchmarks/container_herd.py                       # 8 x 4 kernels, 8 GPUs
    .venv/bin/python benchmarks/container_herd.py --tenants 2 --kernels 2 --gpus 4 --json
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.brokerhelpers import Area, BrokerProc, broker_area  # noqa: E402
from tests.containerhelpers import (  # noqa: E402
    SYSTEM_PYTHON,
    Container,
    container_problem,
    podman_env,
)

DRIVER = str(ROOT / "benchmarks" / "container_herd_kernels.py")


def quantile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(q * len(ordered) + 0.999999) - 1))]


class _Lines:
    """The lines a driver prints, read from its descriptor (no Python buffer for ``select``
    to miss)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.fd = proc.stdout.fileno()
        self.buf = b""
        self.log = ""

    def next(self, deadline: float) -> str:
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.fd, 65536) if ready else b""
            if not chunk:
                raise RuntimeError(f"a driver stopped or was silent (its stderr: {self.log})")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode(errors="replace")


def _wait_line(lines: _Lines, want: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while lines.next(deadline).strip() != want:
        pass


def _results(lines: _Lines, k: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    out: list[dict[str, Any]] = []
    while len(out) < k:
        with contextlib.suppress(ValueError):
            out.append(json.loads(lines.next(deadline)))
    return out


def run_mode(mode: str, tenants: int, k: int, area: Area, sockets: Path,
             tmp: Path) -> list[dict[str, Any]]:
    env = {"AUTOGPU_SIMULATE": str(area.fleet), "AUTOGPU_BROKER_FALLBACK": ""}
    procs: list[subprocess.Popen[bytes]] = []
    stack = contextlib.ExitStack()
    try:
        for n in range(tenants):
            if mode == "containers":
                box = stack.enter_context(Container(
                    tmp, socket_dir=sockets / f"t{n}",
                    env={**env, "AUTOGPU_BROKER_SOCKET": "/run/autogpu/broker.sock"},
                    mounts={str(area.fleet): str(area.fleet)}))
                argv = box.argv([SYSTEM_PYTHON, DRIVER, str(k)], name=f"herd-{os.getpid()}-{n}")
                penv = podman_env(box.workdir)
            else:
                argv = [sys.executable, DRIVER, str(k)]
                penv = {**os.environ, **env, "PYTHONPATH": str(ROOT), "HERD_CWD": str(tmp),
                        "AUTOGPU_BROKER_SOCKET": str(sockets / f"t{n}" / "broker.sock"),
                        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
            log = stack.enter_context(open(tmp / f"{mode}-{n}.log", "wb"))  # noqa: SIM115
            procs.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log, env=penv, start_new_session=True))
        readers = [_Lines(p) for p in procs]
        for n, r in enumerate(readers):
            r.log = str(tmp / f"{mode}-{n}.log")
        for r in readers:
            _wait_line(r, "ready", 600)
        for p in procs:  # the gate: one line to every driver, back to back
            assert p.stdin is not None
            p.stdin.write(b"go\n")
            p.stdin.flush()
        results = [res for r in readers for res in _results(r, k, 600)]
        return results
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                assert p.stdin is not None
                p.stdin.close()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        stack.close()


def summary(results: list[dict[str, Any]], gpus: int) -> dict[str, Any]:
    times = [r["seconds"] for r in results if r["seconds"] is not None]
    per = collections.Counter(r["device"] for r in results if r["device"])
    counts = [per.get(d, 0) for d in sorted(per)] + [0] * (gpus - len(per))
    return {
        "kernels": len(results), "failed": sum(1 for r in results if r["seconds"] is None),
        "leases_per_gpu": sorted(counts), "spread": max(counts) - min(counts),
        "p50_s": quantile(times, 0.5) if times else None,
        "p99_s": quantile(times, 0.99) if times else None,
        "max_s": max(times) if times else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=8, help="containers / tenants (default 8)")
    ap.add_argument("--kernels", type=int, default=4, help="kernels per tenant (default 4)")
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs (default 8)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    problem = container_problem()
    if problem:
        print(f"container_herd: {problem}", file=sys.stderr)
        return 1
    tmp = Path(tempfile.mkdtemp(prefix="autogpu-herd-", dir="/var/tmp"))
    os.chmod(tmp, 0o755)
    sockets = tmp / "tenant-sockets"
    rules = tmp / "rules.json"
    rules.write_text(json.dumps({"tenants": {f"t{n}": {} for n in range(args.tenants)}}))
    out: dict[str, Any] = {"tenants": args.tenants, "kernels_per_tenant": args.kernels,
                           "gpus": args.gpus}
    with broker_area(args.gpus) as root:
        area = Area(root, args.gpus)
        broker = BrokerProc(root, "--tenant-socket-root", str(sockets), "--rules", str(rules),
                            env={"AUTOGPU_SIMULATE": str(area.fleet)})
        try:
            for mode in ("containers", "host"):
                print(f"container_herd: {mode} ...", file=sys.stderr, flush=True)
                results = run_mode(mode, args.tenants, args.kernels, area, sockets, tmp)
                out[mode] = summary(results, args.gpus)
                broker.wait_for(lambda s: s["leases_total"] == 0, timeout=120)
        finally:
            broker.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    c, h = out["containers"], out["host"]
    if c["p50_s"] and h["p50_s"]:
        out["ratio_p50"] = c["p50_s"] / h["p50_s"]
        out["ratio_p99"] = c["p99_s"] / h["p99_s"]
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for mode in ("containers", "host"):
            m = out[mode]
            print(f"{mode:<10} kernels {m['kernels']} (failed {m['failed']})  leases per GPU "
                  f"{m['leases_per_gpu']}  spread {m['spread']}  pick p50 {m['p50_s']:.3f} s  "
                  f"p99 {m['p99_s']:.3f} s  max {m['max_s']:.3f} s")
        if "ratio_p50" in out:
            print(f"containers / host: p50 x{out['ratio_p50']:.2f}, p99 x{out['ratio_p99']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
