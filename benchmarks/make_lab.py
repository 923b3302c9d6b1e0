"""Time from a fresh clone to the first pick with ``make lab`` (issue 24), cold and warm caches.

Run from the repository root (it clones the committed HEAD)::

    .venv/bin/python benchmarks/make_lab.py            # a cold run, then a warm one
    .venv/bin/python benchmarks/make_lab.py --warm-only   # with your own (warm) caches

Each run: ``git clone`` of this repository into a temporary folder, then ``make lab`` there,
headless (``LAB_ARGS="--no-browser --port ..."``), without a TTY, as a user on a GPU server
starts it; the clock stops when the server answers (``server up``) and when a kernel of the
quickstart notebook has run ``%load_ext autogpu`` and ``%gpu pick`` (``first pick``).

"Cold": pip's, uv's and yarn's caches are new, empty folders (every package is downloaded).
"Warm": the same caches again, now filled by the cold run, for a second fresh clone (what a
user who installed once before sees). The pip and Node.js tools themselves come from the
machine (Python 3, git, make; Node.js if installed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from jupyter_client import BlockingKernelClient

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _api(url: str, token: str, path: str, body: dict[str, object] | None = None) -> object:
    req = urllib.request.Request(
        f"{url}/api/{path}", data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def one_run(work: Path, caches: Path | None) -> tuple[float, float, float]:
    """(seconds to server up, seconds to first pick, CPU seconds of the whole run) of one clone +
    ``make lab``. The CPU time (every process of the run, the server's included, until it is
    stopped) says how much work it was, whatever else the machine was doing."""
    clone = work / "autogpu"
    t0 = time.monotonic()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    port, token = _free_port(), secrets.token_hex(16)
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AUTOGPU_", "CUDA_", "VIRTUAL_ENV", "PYTEST_", "JUPYTER"))
           and k not in ("MAKEFLAGS", "MFLAGS", "VENV", "PYTHONPATH")}
    if caches is not None:
        env.update(PIP_CACHE_DIR=str(caches / "pip"), UV_CACHE_DIR=str(caches / "uv"),
                   YARN_GLOBAL_FOLDER=str(caches / "yarn"))
    env.update(JUPYTER_RUNTIME_DIR=str(runtime), JUPYTER_CONFIG_DIR=str(work / "config"),
               IPYTHONDIR=str(work / "ipython"))
    args = f"--no-browser --port {port} --ServerApp.ip=127.0.0.1 --IdentityProvider.token={token}"
    log = (work / "make-lab.log").open("w")
    proc = subprocess.Popen(["make", "-s", "lab", f"LAB_ARGS={args}"], cwd=clone, env=env,
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                _api(url, token, "status")
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError((work / "make-lab.log").read_text()[-3000:]) from None
                time.sleep(0.5)
        up = time.monotonic() - t0
        session = _api(url, token, "sessions", {
            "path": "notebooks/quickstart.ipynb", "type": "notebook", "name": "quickstart.ipynb",
            "kernel": {"name": "python3"}})
        kid = session["kernel"]["id"]  # type: ignore[index]
        kc = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kid}.json"))
        kc.load_connection_file()
        kc.start_channels()
        deadline = time.monotonic() + 120
        while True:  # the client's heartbeat may call a kernel still starting dead: ask again
            try:
                kc.wait_for_ready(timeout=30)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        reply = kc.execute_interactive("%load_ext autogpu\n%gpu pick", timeout=120,
                                       output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply
        picked = time.monotonic() - t0
        kc.stop_channels()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:  # a server slow to stop on a loaded machine
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return up, picked, cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm-only", action="store_true",
                        help="one run with your own pip and yarn caches (as filled by earlier use)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        caches = None if args.warm_only else Path(tmp) / "caches"
        runs = ["warm"] if args.warm_only else ["cold", "warm"]
        for i, kind in enumerate(runs):
            work = Path(tmp) / f"run{i}"
            work.mkdir()
            load = os.getloadavg()[0]
            up, picked, cpu = one_run(work, caches)
            print(f"{kind}: server up {up:.0f} s, first pick {picked:.0f} s, {cpu:.0f} CPU s "
                  f"(load average {load:.1f} -> {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
