"""In-process set-ups for the server extension's fast tests (``tests/unit/test_payloads.py``,
``tests/unit/test_culling.py``): no Jupyter server, no kernels.

- :func:`server_state`: the real :class:`~autogpu_jupyter.server.state.AutoGPUServer` (its real
  sampler thread over a simulated fleet file, its real lease registry);
- :class:`Kernels`: what the server extension reads of jupyter_server's ``MappingKernelManager``
  (``list_kernel_ids``, ``get_kernel(kid).provisioner.pid``, the idle culler's
  ``cull_idle_timeout`` / ``cull_interval`` / ``cull_kernel_if_idle``), with real processes as
  the kernels; the real server and kernels are in ``tests/server/``;
- :func:`shared_registry` and :func:`other_users_lease`: a lease of another real Unix user
  (``nobody``, through a forked child that drops to its uid), for the ownership checks;
- :func:`recorded_prometheus`: a recorded Prometheus answer (``tests/data/cluster/``) replayed as
  if scraped just now, for the callers that ask Prometheus for "now" (the ``cluster`` answer,
  ``autogpu hosts``).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.leasehelpers import AsUser, forget_backends

GiB = 1024**3

__all__ = ["GiB", "Kernels", "other_users_lease", "recorded_prometheus", "server_state",
           "shared_registry", "write_fleet"]


def write_fleet(path: Path, devices: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"driver_version": "550.54.15", "devices": devices}))
    return path


@contextlib.contextmanager
def server_state(fleet_file: Path, registry_dir: Path | str, monkeypatch: pytest.MonkeyPatch,
                 **traits: Any) -> Iterator[Any]:
    """An ``AutoGPUServer`` over ``fleet_file`` (simulated) and ``registry_dir``, its sampler
    started and its first sweep taken; stopped afterwards."""
    from autogpu_jupyter.core import sampler as sampler_mod
    from autogpu_jupyter.server.state import AutoGPUServer

    monkeypatch.setenv("AUTOGPU_SIMULATE", str(fleet_file))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(registry_dir))
    monkeypatch.delenv("AUTOGPU_BROKER_SOCKET", raising=False)
    sampler_mod.stop_sampler()
    forget_backends()
    state = AutoGPUServer(registry_dir=str(registry_dir), interval_s=traits.pop("interval_s", 5.0),
                          **traits)
    try:
        swept = threading.Event()

        def first_sweep(_sampler: Any, _snapshot: Any) -> None:
            swept.set()

        state.start()
        sampler = state.sampler()
        assert sampler is not None, state.sampler_error
        # The sampler thread's own first sweep, not one of ours beside it: two sweeps at once
        # land in either order, and a test that holds "the sweep the sidebar shows" saw the
        # other one replace it (a flake under mutmut's clean run).
        sampler.subscribe(first_sweep)
        try:
            if sampler.latest() is None and not sampler.errors:  # neither came yet
                assert swept.wait(30), "the sampler's first sweep did not come in 30 s"
        finally:
            sampler.unsubscribe(first_sweep)
        yield state
    finally:
        state.stop()
        sampler_mod.stop_sampler()
        forget_backends()


class Kernels:
    """This server's kernels as jupyter_server's ``MappingKernelManager`` shows them to the
    extension. Each kernel is a real process (``sleep``), its pid on ``provisioner.pid`` as
    jupyter_client's ``LocalProvisioner`` has it.

    ``cull_kernel_if_idle`` stands for jupyter_server's: it reads ``cull_idle_timeout`` before
    anything else (as jupyter_server does before its first ``await``); ``seen`` records, per
    call, the kernel and the timeout it was judged by.
    """

    def __init__(self, *names: str, cull_idle_timeout: int = 0) -> None:
        self.procs = {n: subprocess.Popen(["sleep", "300"]) for n in names}
        self.provisioners: dict[str, Any] = {
            n: SimpleNamespace(pid=p.pid) for n, p in self.procs.items()}
        self.cull_idle_timeout = cull_idle_timeout
        self.cull_interval = 300
        self.seen: list[tuple[str, float]] = []

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def list_kernel_ids(self) -> list[str]:
        return list(self.procs)

    def get_kernel(self, kid: str) -> Any:
        return SimpleNamespace(provisioner=self.provisioners[kid])

    async def cull_kernel_if_idle(self, kid: str) -> None:
        self.seen.append((kid, self.cull_idle_timeout))

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()


@contextlib.contextmanager
def shared_registry() -> Iterator[Path]:
    """A lease registry another user can write (``/var/tmp/.../registry``, mode 1777, as
    docs/jupyterhub.md makes it); removed afterwards."""
    root = Path(f"/var/tmp/autogpu-catch-{secrets.token_hex(4)}")
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    reg = root / "registry"
    reg.mkdir()
    os.chmod(reg, 0o1777)
    try:
        yield reg
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _take_lease(registry: str, uuid: str, kernel_id: str, command: str) -> Any:
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    with DirectoryStore(registry, record_commands=True).locked() as txn:
        assert txn is not None
        return txn.create(devices=[uuid], requested_bytes=GiB,
                          requester=Requester(kernel_id=kernel_id, command=command))


@contextlib.contextmanager
def other_users_lease(registry: Path, uuid: str, kernel_id: str,
                      command: str = "python secret.py --token=hunter2") -> Iterator[str]:
    """A live lease of user ``nobody`` on ``uuid`` naming ``kernel_id`` (held by a forked child
    running as ``nobody``); yields its lease id. Needs root (skips otherwise: under CI, which
    runs as root, a skip fails)."""
    if os.geteuid() != 0:
        pytest.skip("another user's lease needs root (to run a child as nobody)")
    pw = pwd.getpwnam("nobody")
    child = AsUser(pw.pw_uid, pw.pw_gid, _take_lease, str(registry), uuid, kernel_id, command,
                   hold=True)
    try:
        got = child.result()
        assert isinstance(got, dict) and got.get("lease_id"), got
        yield str(got["lease_id"])
    finally:
        assert child.stop() == 0


@contextlib.contextmanager
def recorded_prometheus(name: str = "all-up",
                        rename: dict[str, str] | None = None,
                        edit: Callable[[dict[str, list[dict[str, Any]]]], None] | None = None,
                        ) -> Iterator[str]:
    """A loopback server replaying recorded scenario ``name`` with its hosts scraped just now,
    once a minute (the recording's own times are long past), hosts renamed as ``rename`` says
    (old name -> new), then ``edit`` applied to the result lists (as ``scenario`` of
    test_cluster.py takes it); yields its URL."""
    from tests.unit.test_cluster import DCGM_NAMES_Q, SCRAPED_Q, SWEEP_Q, Replay, scenario

    def recent(results: dict[str, list[dict[str, Any]]]) -> None:
        for query in (SCRAPED_Q, SWEEP_Q, DCGM_NAMES_Q):
            for r in results[query]:
                r["value"] = [time.time(), str(time.time())]
        for t in results["targets"]:
            t["scrapeInterval"] = "1m"
        for series in [*results.values(), [{"metric": t.get("labels", {})}
                                           for t in results["targets"]]]:
            for r in series:
                labels = r.get("metric", {})
                for key in ("hostname", "Hostname"):
                    if labels.get(key) in (rename or {}):
                        labels[key] = (rename or {})[labels[key]]
        if edit is not None:
            edit(results)

    server = Replay()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        scenario(server, name, recent)
        yield server.url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
