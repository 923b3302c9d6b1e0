"""A real IPython kernel (jupyter_client) driven from a test: run code, collect what it printed.

Used by the magics tests. ``KernelRun`` holds the streams and outputs of one execution the way a
notebook shows them: ``stdout``, ``stderr`` (where ``UsageError: ...`` lands), ``error`` (ename,
evalue) of the execute reply, and the raw ``outputs`` (display data, updates).
"""

from __future__ import annotations

import json
import os
import queue
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jupyter_client.manager import KernelManager

REPO = Path(__file__).resolve().parent.parent

__all__ = ["Kernel", "KernelRun", "kernel_env"]


def kernel_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The test process's environment for a kernel: the repo importable, no GPU variables."""
    env = dict(os.environ)
    for name in (
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "AUTOGPU_SIMULATE",
        "AUTOGPU_PICKED",
        "AUTOGPU_LEASE_ID",
        "NVIDIA_VISIBLE_DEVICES",
        "SLURM_JOB_GPUS",
        "SLURM_STEP_GPUS",
        "PYTEST_CURRENT_TEST",
    ):
        env.pop(name, None)
    env["PYTHONPATH"] = str(REPO) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""
    )
    env.update(extra)
    return env


@dataclass
class KernelRun:
    stdout: str = ""
    stderr: str = ""
    status: str = ""
    error: tuple[str, str] | None = None
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def texts(self) -> list[str]:
        """``text/plain`` of every display / update message, in order."""
        return [
            o["content"]["data"].get("text/plain", "")
            for o in self.outputs
            if o["msg_type"] in ("display_data", "update_display_data", "execute_result")
        ]


class Kernel:
    """One started kernel with a blocking client."""

    def __init__(self, env: Mapping[str, str], cwd: str | os.PathLike[str] | None = None) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=dict(env), cwd=str(cwd or REPO))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    def run(
        self,
        code: str,
        timeout: float = 60.0,
        on_output: Callable[[dict[str, Any]], None] | None = None,
    ) -> KernelRun:
        """Execute ``code``; ``on_output(msg)`` is called for each iopub output as it arrives."""
        msg_id = self.kc.execute(code, store_history=True)
        out = KernelRun()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"kernel did not finish {code!r} in {timeout}s")
            try:
                msg = self.kc.get_iopub_msg(timeout=remaining)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            mt = msg["msg_type"]
            if mt == "stream":
                if msg["content"]["name"] == "stdout":
                    out.stdout += msg["content"]["text"]
                else:
                    out.stderr += msg["content"]["text"]
            elif mt in ("display_data", "update_display_data", "execute_result", "error"):
                out.outputs.append(msg)
            if mt != "status" and on_output is not None:
                on_output(msg)
            if mt == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        out.status = reply["content"]["status"]
        if out.status == "error":
            out.error = (reply["content"].get("ename", ""), reply["content"].get("evalue", ""))
        return out

    def env(self) -> dict[str, str | None]:
        """The kernel's ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` right now."""
        r = self.run(
            "import json as _j, os as _o\n"
            "print(_j.dumps({k: _o.environ.get(k) for k in "
            "('CUDA_VISIBLE_DEVICES', 'CUDA_DEVICE_ORDER')}))"
        )
        assert r.status == "ok", r
        return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def kernel_environ(pid: int, timeout_s: float = 10.0) -> dict[str, str]:
    """The environment of a kernel the autogpu provisioner started, from /proc/<pid>/environ
    (what it had before any user code). Read once the process has exec'd: between fork and
    exec, /proc still shows the parent's (the server's) environment."""
    deadline = time.monotonic() + timeout_s
    while True:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(e.decode().split("=", 1) for e in raw if b"=" in e)
        if "AUTOGPU_PROVISIONED" in env or time.monotonic() > deadline:
            return env
        time.sleep(0.01)
