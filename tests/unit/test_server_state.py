"""Which kernel a GPU process belongs to (``server.state.owning_kernel``): the walk up the real
process tree, and its bound. Survivors of ``make mutate SAMPLE=6`` (issue 22)."""

from __future__ import annotations

import os
from pathlib import Path

from autogpu_jupyter.server.state import owning_kernel


def test_a_process_belongs_to_the_kernel_among_its_ancestors_in_the_real_proc() -> None:
    """The default process table is the host's /proc: this test's process is found through its
    parent. Caught: another default root (every lookup then answers None)."""
    assert owning_kernel(os.getpid(), {os.getppid(): "k-parent"}) == "k-parent"
    assert owning_kernel(os.getpid(), {os.getpid(): "k-self"}) == "k-self"
    assert owning_kernel(os.getpid(), {}) is None


def _chain(root: Path, pids: list[int]) -> None:
    """A made-up process table in which each pid's parent is the next one of ``pids``."""
    for pid, parent in zip(pids, [*pids[1:], 1], strict=True):
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} (py thon) S {parent} 0 0\n")


def test_the_walk_up_stops_after_max_depth_ancestors(tmp_path: Path) -> None:
    """A kernel more than ``max_depth`` generations up is not found (the bound keeps a long or
    looping chain from holding a request). Caught: the depth counted down instead of up."""
    pids = [100, 101, 102, 103, 104, 105]
    _chain(tmp_path, pids)
    kernels = {105: "k-far"}
    assert owning_kernel(100, kernels, proc_root=str(tmp_path), max_depth=6) == "k-far"
    assert owning_kernel(100, kernels, proc_root=str(tmp_path), max_depth=5) is None
    assert owning_kernel(100, kernels, proc_root=str(tmp_path), max_depth=2) is None
