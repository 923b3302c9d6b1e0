"""Idle GPU holders, with a real Jupyter server (pytest-jupyter) and real kernels.

- ``GET autogpu/holders`` says, for this server's kernels, whether each is idle and for how long
  (jupyter_server's own ``last_activity``), next to the GPU it holds;
- ``c.AutoGPUServer.cull_idle_gpu_kernels_s`` culls a kernel that holds a GPU once it has been
  idle that long, through jupyter_server's own culler, and leaves a kernel without a GPU alone;
  without the option nothing is culled.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core import backends
from autogpu_jupyter.core import sampler as sampler_mod

pytest_plugins = ["pytest_jupyter.jupyter_server"]

CULL_S = 3


@pytest.fixture
def demo_fleet(monkeypatch: pytest.MonkeyPatch, registry_dir: Path) -> Any:
    monkeypatch.setenv("AUTOGPU_SIMULATE", "demo-4x")
    for name in ("CUDA_VISIBLE_DEVICES", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID"):
        monkeypatch.delenv(name, raising=False)
    backends._cache.clear()
    sampler_mod.stop_sampler()
    yield registry_dir
    sampler_mod.stop_sampler()
    backends._cache.clear()


@pytest.fixture
def cull_s(request: pytest.FixtureRequest) -> float:
    """``c.AutoGPUServer.cull_idle_gpu_kernels_s`` of the server (0, the default: off)."""
    return float(getattr(request, "param", 0))


@pytest.fixture
def jp_server_config(demo_fleet: Path, cull_s: float) -> dict[str, Any]:
    autogpu: dict[str, Any] = {"interval_s": 0.2}
    if cull_s:
        autogpu["cull_idle_gpu_kernels_s"] = cull_s
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": autogpu,
        "MappingKernelManager": {"cull_interval": 1},
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
    """A kernel that picked a GPU (holds a lease) and one that did not; both then idle."""
    gpu, plain = await _start(jp_fetch), await _start(jp_fetch)
    picked = await _run(serverapp, gpu, "%load_ext autogpu\n%gpu pick --min-free 10G")
    assert "autogpu [SIMULATED]: picked GPU " in picked
    assert await _run(serverapp, plain, "print(6 * 7)") == "42\n"
    return gpu, plain


async def _kernels(jp_fetch: Any) -> dict[str, dict[str, Any]]:
    holders = json.loads((await jp_fetch("autogpu", "holders")).body)
    return {k["kernel_id"]: k for k in holders["kernels"]}


@pytest.mark.parametrize("cull_s", [CULL_S], indirect=True)
async def test_an_idle_gpu_kernel_is_culled_when_the_admin_opted_in(
    jp_fetch: Any, jp_serverapp: Any
) -> None:
    gpu, plain = await _two_kernels(jp_fetch, jp_serverapp)
    manager = jp_serverapp.kernel_manager
    started = time.monotonic()
    await asyncio.sleep(1)
    assert gpu in manager.list_kernel_ids()  # not idle long enough yet
    deadline = time.monotonic() + CULL_S + 20
    while gpu in manager.list_kernel_ids():
        assert time.monotonic() < deadline, "the idle GPU kernel was not culled"
        await asyncio.sleep(0.5)
    assert time.monotonic() - started >= CULL_S
    # culled after (not before) the limit; the kernel without a GPU stays, however idle
    assert plain in manager.list_kernel_ids()
    kernels = await _kernels(jp_fetch)
    assert gpu not in kernels and kernels[plain]["idle_s"] >= CULL_S
    await asyncio.sleep(2)
    assert plain in manager.list_kernel_ids()
    await manager.shutdown_kernel(plain)


async def test_idle_holders_are_shown_and_not_culled_without_the_option(
    jp_fetch: Any, jp_serverapp: Any, demo_fleet: Path
) -> None:
    gpu, plain = await _two_kernels(jp_fetch, jp_serverapp)
    await asyncio.sleep(CULL_S + 2)
    manager = jp_serverapp.kernel_manager
    assert {gpu, plain} <= set(manager.list_kernel_ids())
    kernels = await _kernels(jp_fetch)
    assert kernels[gpu]["execution_state"] == "idle"
    assert kernels[gpu]["idle_s"] >= CULL_S + 1
    holders = json.loads((await jp_fetch("autogpu", "holders")).body)["holders"]
    (lease,) = [h for h in holders if h["kind"] == "lease" and h["kernel_id"] == gpu]
    assert lease["booked_bytes"] == 10 * 1024**3
    # busy is not idle
    task = asyncio.ensure_future(_run(jp_serverapp, gpu, "import time; time.sleep(3)"))
    await asyncio.sleep(1.5)
    assert (await _kernels(jp_fetch))[gpu]["idle_s"] is None
    await task
    for kid in (gpu, plain):
        await manager.shutdown_kernel(kid)
