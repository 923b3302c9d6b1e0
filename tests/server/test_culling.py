"""Idle GPU holders, with a real Jupyter server (pytest-jupyter) and real kernels.

- ``GET autogpu/holders`` says, for this server's kernels, whether each is idle and for how long
  (jupyter_server's own ``last_activity``), next to the GPU it holds;
- ``c.AutoGPUServer.cull_idle_gpu_kernels_s`` culls a kernel that holds a GPU once it has been
  idle that long, through jupyter_server's own culler, and leaves a kernel without a GPU alone;
  without the option nothing is culled.

No fixed sleeps: the tests record each question the culler asks (:class:`Culls`) and wait for
the one that shows what they check; the fast checks of which kernel gets which limit are
``tests/unit/test_culling.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import sampler as sampler_mod
from tests.leasehelpers import forget_backends

pytest_plugins = ["pytest_jupyter.jupyter_server"]

CULL_S = 3


@pytest.fixture
def demo_fleet(monkeypatch: pytest.MonkeyPatch, registry_dir: Path) -> Any:
    monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID"):
        monkeypatch.delenv(name, raising=False)
    forget_backends()
    sampler_mod.stop_sampler()
    yield registry_dir
    sampler_mod.stop_sampler()
    forget_backends()


@pytest.fixture
def cull_s(request: pytest.FixtureRequest) -> float:
    """``c.AutoGPUServer.cull_idle_gpu_kernels_s`` of the server (0, the default: off)."""
    return float(getattr(request, "param", 0))


@pytest.fixture
def general_s(request: pytest.FixtureRequest) -> int:
    """``c.MappingKernelManager.cull_idle_timeout``, the admin's limit for every kernel (0, the
    default: jupyter_server culls nothing)."""
    return int(getattr(request, "param", 0))


@pytest.fixture
def jp_server_config(demo_fleet: Path, cull_s: float, general_s: int) -> dict[str, Any]:
    autogpu: dict[str, Any] = {"interval_s": 0.2}
    if cull_s:
        autogpu["cull_idle_gpu_kernels_s"] = cull_s
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": autogpu,
        "MappingKernelManager": {"cull_interval": 1, "cull_idle_timeout": general_s},
    }


async def _start(jp_fetch: Any) -> str:
    r = await jp_fetch("api", "kernels", method="POST", body=json.dumps({"name": "python3"}))
    return str(json.loads(r.body)["id"])


async def _run(serverapp: Any, kid: str, code: str) -> str:
    """Execute ``code`` in the server's kernel ``kid`` through its own connection info."""
    kc = serverapp.kernel_manager.get_kernel(kid).client()
    kc.start_channels()
    out: list[str] = []
    try:
        await kc.wait_for_ready(timeout=60)

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        await kc.execute_interactive(code, timeout=60, output_hook=hook)
    finally:
        kc.stop_channels()
    return "".join(out)


async def _two_kernels(jp_fetch: Any, serverapp: Any) -> tuple[str, str]:
    """A kernel that picked a GPU (holds a lease) and one that did not; both then idle. The one
    without a GPU ran last before the other's pick: it has been idle longer, so it passes the
    GPU limit while the other still holds its GPU."""
    gpu, plain = await _start(jp_fetch), await _start(jp_fetch)
    assert await _run(serverapp, plain, "print(6 * 7)") == "42\n"
    picked = await _run(serverapp, gpu, "%load_ext autogpu\n%gpu pick --min-free 10G")
    assert "autogpu [SIMULATED]: picked GPU " in picked
    return gpu, plain


async def _kernels(jp_fetch: Any) -> dict[str, dict[str, Any]]:
    holders = json.loads((await jp_fetch("autogpu", "holders")).body)
    return {k["kernel_id"]: k for k in holders["kernels"]}


class Culls:
    """Every question jupyter_server's idle culler asks (``cull_kernel_if_idle``, autogpu's
    wrapper included), recorded as it returns: the kernel, how long it had been idle (its own
    ``last_activity``) and whether it still exists. :meth:`until` waits for a recorded
    question, never for a fixed time."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.seen: list[tuple[str, float, bool]] = []
        self._new = asyncio.Event()
        inner = manager.cull_kernel_if_idle

        async def recorded(kernel_id: str) -> None:
            last = manager.get_kernel(kernel_id).last_activity
            idle_s = (datetime.now(timezone.utc) - last).total_seconds()
            await inner(kernel_id)
            self.seen.append((kernel_id, idle_s, kernel_id in manager.list_kernel_ids()))
            self._new.set()

        manager.cull_kernel_if_idle = recorded

    async def until(self, what: str, done: Any, timeout_s: float) -> tuple[str, float, bool]:
        """The first recorded question for which ``done(kernel, idle_s, still_there)`` holds."""
        deadline = time.monotonic() + timeout_s
        checked = 0
        while True:
            for entry in self.seen[checked:]:
                if done(*entry):
                    return entry
            checked = len(self.seen)
            self._new.clear()
            left = deadline - time.monotonic()
            assert left > 0, f"the culler never {what}: {self.seen}"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._new.wait(), left)


async def _until_state(jp_fetch: Any, kid: str, state: str, timeout_s: float) -> dict[str, Any]:
    """The kernel's entry in ``GET holders`` once its execution state is ``state`` (asked again
    on each answer; bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        kernel = (await _kernels(jp_fetch))[kid]
        if kernel["execution_state"] == state:
            return kernel
        assert time.monotonic() < deadline, f"kernel {kid} never {state}: {kernel}"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("cull_s", [CULL_S], indirect=True)
async def test_an_idle_gpu_kernel_is_culled_when_the_admin_opted_in(
    jp_fetch: Any, jp_serverapp: Any
) -> None:
    manager = jp_serverapp.kernel_manager
    culls = Culls(manager)
    gpu, plain = await _two_kernels(jp_fetch, jp_serverapp)
    # asked about the GPU kernel before its limit, it stays; the first time it is gone, it had
    # been idle at least the limit
    await culls.until("kept the GPU kernel before its limit",
                      lambda k, idle, there: k == gpu and idle < CULL_S and there, 30)
    _, idle, _ = await culls.until("culled the GPU kernel",
                                   lambda k, _idle, there: k == gpu and not there, CULL_S + 30)
    assert idle >= CULL_S
    # the kernel without a GPU passed the same limit first, and stays, however idle
    await culls.until("kept the idle kernel without a GPU past the GPU limit",
                      lambda k, idle, there: k == plain and idle >= CULL_S + 1 and there, 30)
    assert not any(k == plain and not there for k, _, there in culls.seen)
    kernels = await _kernels(jp_fetch)
    assert gpu not in kernels and kernels[plain]["idle_s"] >= CULL_S + 1
    await manager.shutdown_kernel(plain)


@pytest.mark.parametrize("general_s", [60], indirect=True)
async def test_idle_holders_are_shown_and_not_culled_without_the_option(
    jp_fetch: Any, jp_serverapp: Any, demo_fleet: Path
) -> None:
    """The admin's own limit (60 s) for every kernel, no GPU limit: jupyter_server's culler asks
    about both kernels every second and culls neither after CULL_S + 1 idle seconds."""
    manager = jp_serverapp.kernel_manager
    culls = Culls(manager)
    gpu, plain = await _two_kernels(jp_fetch, jp_serverapp)
    for kid in (gpu, plain):
        await culls.until(f"asked about {kid} past {CULL_S + 1} s idle",
                          lambda k, idle, there, kid=kid: k == kid and idle >= CULL_S + 1
                          and there, 30)
    assert {gpu, plain} <= set(manager.list_kernel_ids())
    kernels = await _kernels(jp_fetch)
    assert kernels[gpu]["execution_state"] == "idle"
    assert kernels[gpu]["idle_s"] >= CULL_S + 1
    holders = json.loads((await jp_fetch("autogpu", "holders")).body)["holders"]
    (lease,) = [h for h in holders if h["kind"] == "lease" and h["kernel_id"] == gpu]
    assert lease["booked_bytes"] == 10 * 1024**3
    # busy is not idle
    task = asyncio.ensure_future(_run(jp_serverapp, gpu, "import time; time.sleep(3)"))
    busy = await _until_state(jp_fetch, gpu, "busy", 30)
    assert busy["idle_s"] is None
    await task
    for kid in (gpu, plain):
        await manager.shutdown_kernel(kid)
