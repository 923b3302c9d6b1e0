"""Cull idle kernels that hold a GPU, with jupyter_server's own idle culler.

jupyter_server's ``MappingKernelManager`` already culls idle kernels: every ``cull_interval``
seconds its ``cull_kernels`` asks ``cull_kernel_if_idle(kernel_id)``, which compares the
kernel's ``last_activity`` with ``cull_idle_timeout`` and honours ``cull_busy`` and
``cull_connected``. On a shared GPU host the admin usually wants that for GPU holders only (an
idle notebook sitting on 40 GiB), with a shorter limit, and leave CPU-only notebooks alone.

:func:`install` (called when ``c.AutoGPUServer.cull_idle_gpu_kernels_s > 0``) keeps that loop
and that idle test, and only chooses the timeout per kernel: ``cull_idle_gpu_kernels_s`` for a
kernel that holds a GPU (a live lease naming it, a GPU process in its process tree, the autogpu
kernelspec's pick), the manager's own ``cull_idle_timeout`` for the others (0: never). No new
loop, no second idea of "idle". Culling shuts the kernel down, which frees its lease.
"""

from __future__ import annotations

from typing import Any

from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import AutoGPUServer

__all__ = ["install"]


def install(state: AutoGPUServer, kernel_manager: Any) -> bool:
    """Make ``kernel_manager``'s idle culler cull GPU-holding kernels after
    ``state.cull_idle_gpu_kernels_s``; ``False`` (nothing changed) when that is 0."""
    limit = float(state.cull_idle_gpu_kernels_s)
    if limit <= 0:
        return False
    general = float(kernel_manager.cull_idle_timeout)
    original = kernel_manager.cull_kernel_if_idle
    if general <= 0:
        # The manager starts its culler (at the first kernel start) only for a positive
        # timeout; kernels without a GPU still get ``general`` (never) below.
        kernel_manager.cull_idle_timeout = int(max(1, limit))

    async def cull_kernel_if_idle(kernel_id: str) -> None:
        holders = await state.answer(payloads.gpu_kernel_ids, kernel_manager)
        timeout = limit if kernel_id in holders else general
        if timeout <= 0:
            return
        saved = kernel_manager.cull_idle_timeout
        # jupyter_server reads the timeout before its first await: this kernel's limit applies
        kernel_manager.cull_idle_timeout = timeout
        try:
            await original(kernel_id)
        finally:
            kernel_manager.cull_idle_timeout = saved

    kernel_manager.cull_kernel_if_idle = cull_kernel_if_idle
    state.log.info(
        "autogpu: kernels holding a GPU are culled after %.0f s idle (jupyter_server's culler, "
        "every %s s); other kernels: %s",
        limit,
        kernel_manager.cull_interval,
        f"after {general:.0f} s" if general > 0 else "never",
    )
    return True
