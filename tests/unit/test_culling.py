"""Which of this server's kernels the idle culler judges by the GPU limit (``server.culling``),
in this process: the real ``AutoGPUServer`` state over a simulated fleet and a real registry, the
kernels real processes (:class:`tests.payloadhelpers.Kernels`). The real server culling real
kernels is ``tests/server/test_culling.py``.

A kernel holds a GPU through a live lease of this server's user naming it, a GPU process in its
process tree, or the autogpu provisioner's pick; every other kernel keeps the manager's own
``cull_idle_timeout`` (0: never culled).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from autogpu_jupyter.server import culling
from tests.payloadhelpers import (
    GiB,
    Kernels,
    other_users_lease,
    server_state,
    shared_registry,
    write_fleet,
)

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
LIMIT_S = 600.0


def fleet(processes: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    return [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
         "utilization_pct": 0, "processes": processes or []},
        {"uuid": B, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0,
         "utilization_pct": 0},
    ]


@pytest.fixture
def kernels() -> Iterator[Kernels]:
    k = Kernels("k-gpu", "k-cpu")
    yield k
    k.close()


def judged(kernels: Kernels, *kids: str) -> dict[str, float | None]:
    """Ask the (installed) culler about each kernel; the timeout each was judged by (``None``:
    not judged at all, i.e. never culled)."""
    kernels.seen.clear()
    for kid in kids:
        asyncio.run(kernels.cull_kernel_if_idle(kid))
    got: dict[str, float | None] = {kid: None for kid in kids}
    got.update(dict(kernels.seen))
    return got


def take_lease(registry: Path, uuid: str, kernel_id: str) -> Any:
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    with DirectoryStore(str(registry)).locked() as txn:
        assert txn is not None
        return txn.create(devices=[uuid], requester=Requester(kernel_id=kernel_id))


def test_only_the_kernel_holding_a_lease_gets_the_gpu_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """Caught: once any kernel holds a GPU, every kernel judged by the GPU limit."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=LIMIT_S) as state:
        lease = take_lease(tmp_path / "registry", A, "k-gpu")
        try:
            assert culling.install(state, kernels) is True
            # the manager culls only with a positive timeout: the GPU limit starts its culler
            assert kernels.cull_idle_timeout == LIMIT_S
            # no general timeout: a kernel without a GPU is never even judged
            assert judged(kernels, "k-gpu", "k-cpu") == {"k-gpu": LIMIT_S, "k-cpu": None}
            assert kernels.cull_idle_timeout == LIMIT_S  # restored after each judgement
        finally:
            lease.release()
        # the lease gone, nothing holds a GPU any more
        assert judged(kernels, "k-gpu", "k-cpu") == {"k-gpu": None, "k-cpu": None}


def test_kernels_without_a_gpu_keep_the_managers_own_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    kernels = Kernels("k-gpu", "k-cpu", cull_idle_timeout=3600)
    try:
        with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                          cull_idle_gpu_kernels_s=LIMIT_S) as state:
            lease = take_lease(tmp_path / "registry", B, "k-gpu")
            try:
                assert culling.install(state, kernels) is True
                assert kernels.cull_idle_timeout == 3600  # the admin's own timeout stays
                assert judged(kernels, "k-cpu", "k-gpu") == {"k-cpu": 3600, "k-gpu": LIMIT_S}
                assert kernels.cull_idle_timeout == 3600
            finally:
                lease.release()
    finally:
        kernels.close()


def test_without_the_option_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch) as state:
        original = kernels.cull_kernel_if_idle
        assert culling.install(state, kernels) is False
        assert kernels.cull_kernel_if_idle == original and kernels.cull_idle_timeout == 0


def test_a_gpu_process_in_the_kernels_process_tree_holds_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """NVML lists the kernel's own pid on GPU B (no lease): that kernel, only that one."""
    procs = [{"pid": kernels.pid("k-gpu"), "used_memory": 2 * GiB, "user": "root"}]
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet(procs))
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=LIMIT_S) as state:
        culling.install(state, kernels)
        assert judged(kernels, "k-gpu", "k-cpu") == {"k-gpu": LIMIT_S, "k-cpu": None}


def test_the_provisioners_pick_holds_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """A kernel the autogpu provisioner started on a GPU, before NVML lists it (no lease here:
    the provisioner's lease lives in its own registry). A provisioner that picked nothing (a
    CPU-only start) does not."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=LIMIT_S) as state:
        for kid, picked in (("k-gpu", (A,)), ("k-cpu", ())):
            kernels.provisioners[kid] = SimpleNamespace(
                pid=kernels.pid(kid), autogpu_picked=picked, autogpu_constraints=None,
                autogpu_note=None, autogpu_lease_id=None, autogpu_move_file=None)
        culling.install(state, kernels)
        assert judged(kernels, "k-gpu", "k-cpu") == {"k-gpu": LIMIT_S, "k-cpu": None}


def test_another_users_lease_naming_our_kernel_does_not_make_it_cullable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kernels: Kernels
) -> None:
    """A lease's kernel id is what its writer claims: user nobody's lease naming our idle
    CPU-only kernel must not get it culled on the GPU limit. Caught: the ``rec.uid`` check
    dropped from ``gpu_kernel_ids``."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with shared_registry() as registry, server_state(
        fleet_file, registry, monkeypatch, cull_idle_gpu_kernels_s=LIMIT_S
    ) as state, other_users_lease(registry, A, "k-cpu"):
        from autogpu_jupyter.core.leasing import DirectoryStore

        (theirs,) = DirectoryStore(str(registry)).list_leases()
        assert theirs.kernel_id == "k-cpu" and theirs.uid != os.geteuid()
        culling.install(state, kernels)
        assert judged(kernels, "k-gpu", "k-cpu") == {"k-gpu": None, "k-cpu": None}


def test_a_limit_under_a_second_still_starts_the_managers_culler_at_one_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernels: Kernels
) -> None:
    """The manager's culler runs only for a positive whole timeout: a GPU limit of 0.4 s starts
    it at 1 s, never 0 (off) nor more. Caught (mutation run): ``max(2, limit)``."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=0.4) as state:
        assert culling.install(state, kernels) is True
        assert kernels.cull_idle_timeout == 1


@pytest.mark.parametrize(("general", "others"),
                         [(0, "never"), (1, "after 1 s"), (3600, "after 3600 s")])
def test_the_log_says_which_kernels_are_culled_after_how_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, general: int, others: str
) -> None:
    """The admin reads in the server's log what the option does. Caught (mutation run): the
    message's words, its limit or its other-kernels part changed or dropped; (seed 53) a
    one-second timeout called "never"."""
    import logging

    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    kernels = Kernels("k-gpu", cull_idle_timeout=general)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    try:
        with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                          cull_idle_gpu_kernels_s=LIMIT_S) as state:
            keep, level = Keep(), state.log.level
            state.log.addHandler(keep)
            state.log.setLevel(logging.INFO)
            try:
                culling.install(state, kernels)
            finally:
                state.log.removeHandler(keep)
                state.log.setLevel(level)
    finally:
        kernels.close()
    assert lines == [
        "autogpu: kernels holding a GPU are culled after 600 s idle (jupyter_server's culler, "
        f"every {kernels.cull_interval} s); other kernels: {others}"
    ]


def test_a_one_second_timeout_still_judges_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manager's own timeout of 1 s (the smallest it takes) is a timeout, not "never": a
    kernel without a GPU is judged by it, and the manager keeps it (its culler already runs).
    Caught (issue 22, seed 53): ``timeout <= 1`` taken for off (such a kernel never culled);
    (seed 54) the manager's 1 s replaced by the GPU limit, as if it had none."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    kernels = Kernels("k-cpu", cull_idle_timeout=1)
    try:
        with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                          cull_idle_gpu_kernels_s=LIMIT_S) as state:
            culling.install(state, kernels)
            assert kernels.cull_idle_timeout == 1  # the admin's own timeout stays
            assert judged(kernels, "k-cpu") == {"k-cpu": 1}
    finally:
        kernels.close()


# ---- the warning before the cull (issue 41) --------------------------------------------------


class IdleKernels(Kernels):
    """:class:`Kernels` whose kernels report jupyter_server's activity: idle for ``idle_s``
    seconds (``None``: busy), with ``connections`` open websockets each."""

    def __init__(self, *names: str, cull_connected: bool = False) -> None:
        super().__init__(*names)
        self.idle_s: dict[str, float | None] = dict.fromkeys(names, 0.0)
        self.cull_connected = cull_connected
        self._kernel_connections: dict[str, int] = dict.fromkeys(names, 0)

    def get_kernel(self, kid: str) -> Any:
        import datetime

        idle = self.idle_s[kid]
        now = datetime.datetime.now(datetime.timezone.utc)
        return SimpleNamespace(
            provisioner=self.provisioners[kid],
            execution_state="busy" if idle is None else "idle",
            last_activity=now - datetime.timedelta(seconds=idle or 0.0),
        )


def warnings_of(state: Any, kernels: Kernels) -> dict[str, Any]:
    from autogpu_jupyter.server import payloads

    data = payloads.holders_payload(state.context(), kernels, {})
    return {k["kernel_id"]: k["cull_warning"] for k in data["kernels"]}


@pytest.fixture
def idle_kernels() -> Iterator[IdleKernels]:
    k = IdleKernels("k-gpu", "k-cpu")
    yield k
    k.close()


def warned(idle_s: float, lead: str = "less than a minute", limit: str = "10 min",
           gpu: str = "GPU 0") -> str:
    return (f"{gpu}: this idle kernel will be shut down in {lead} (idle limit {limit}), "
            "freeing the GPU. Run any cell to keep it.")


def test_an_idle_gpu_kernel_is_warned_a_tenth_of_the_limit_before_its_cull(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_kernels: IdleKernels
) -> None:
    """600 s limit: the warning starts 60 s before (a tenth); the kernel without a GPU, idle
    as long, is never warned (it is not culled by this limit)."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=LIMIT_S) as state:
        lease = take_lease(tmp_path / "registry", A, "k-gpu")
        try:
            idle_kernels.idle_s.update({"k-gpu": 530.0, "k-cpu": 590.0})
            early = warnings_of(state, idle_kernels)
            idle_kernels.idle_s.update({"k-gpu": 590.0})
            late = warnings_of(state, idle_kernels)
            idle_kernels.idle_s.update({"k-gpu": None})  # a cell runs: busy, not idle
            busy = warnings_of(state, idle_kernels)
        finally:
            lease.release()
    assert early == {"k-gpu": None, "k-cpu": None}
    assert late == {"k-gpu": warned(590), "k-cpu": None}
    assert len(warned(590)) <= 140  # what a JupyterLab notification keeps
    assert busy == {"k-gpu": None, "k-cpu": None}


@pytest.mark.parametrize(("lead_s", "idle_s", "expected"), [
    (300.0, 400.0, "4 min"),  # 200 s left, rounded up
    (300.0, 290.0, None),  # 310 s left: not yet
    (0.0, 599.0, None),  # no warning at all
    (1e9, 1.0, "10 min"),  # at most the whole limit
])
def test_the_warnings_lead_is_configurable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_kernels: IdleKernels,
    lead_s: float, idle_s: float, expected: str | None,
) -> None:
    """The autogpu provisioner's pick is a GPU too (no lease needed)."""
    idle_kernels.provisioners["k-gpu"] = SimpleNamespace(
        pid=idle_kernels.pid("k-gpu"), autogpu_picked=(B,), autogpu_constraints=None,
        autogpu_note=None, autogpu_lease_id=None, autogpu_move_file=None)
    idle_kernels.idle_s["k-gpu"] = idle_s
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=LIMIT_S, cull_warning_s=lead_s) as state:
        got = warnings_of(state, idle_kernels)["k-gpu"]
    assert got == (None if expected is None else warned(idle_s, expected, gpu="GPU 1"))


def test_an_open_notebook_is_warned_only_where_the_culler_takes_connected_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """jupyter_server culls a kernel with open connections only with ``cull_connected``: the
    warning says what will happen, not more."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    got = {}
    for connected in (False, True):
        k = IdleKernels("k-gpu", cull_connected=connected)
        try:
            k._kernel_connections["k-gpu"] = 1
            k.idle_s["k-gpu"] = 590.0
            with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                              cull_idle_gpu_kernels_s=LIMIT_S) as state:
                lease = take_lease(tmp_path / "registry", A, "k-gpu")
                try:
                    got[connected] = warnings_of(state, k)["k-gpu"]
                finally:
                    lease.release()
        finally:
            k.close()
    assert got == {False: None, True: warned(590)}


def test_no_warning_without_culling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_kernels: IdleKernels
) -> None:
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    idle_kernels.idle_s["k-gpu"] = 1e6
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_warning_s=300.0) as state:
        lease = take_lease(tmp_path / "registry", A, "k-gpu")
        try:
            assert warnings_of(state, idle_kernels) == {"k-gpu": None, "k-cpu": None}
        finally:
            lease.release()


@pytest.mark.parametrize("bad", [-5.0, float("nan"), float("inf")])
def test_a_cull_warning_that_is_no_number_of_seconds_is_said_and_replaced(
    bad: float, caplog: pytest.LogCaptureFixture
) -> None:
    from autogpu_jupyter.server.state import AutoGPUServer

    state = AutoGPUServer(registry_dir="", cull_idle_gpu_kernels_s=7200.0)
    try:
        with caplog.at_level("WARNING"):
            state.cull_warning_s = bad
        assert state.cull_warning_s is None
        assert state.cull_warning_lead_s() == 300.0  # a tenth of 2 h is more: 5 min at most
        assert [r.getMessage() for r in caplog.records] == [
            f"autogpu: c.AutoGPUServer.cull_warning_s = {bad!r} is not None or a number of "
            "seconds >= 0 (e.g. 300): the default (a tenth of cull_idle_gpu_kernels_s, at most "
            "300 s) is used"]
    finally:
        state.stop()


def test_the_warning_words_the_limit_as_a_length_and_the_rest_as_a_countdown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_kernels: IdleKernels
) -> None:
    """Caught in the browser (issue 41): a one-minute limit said "less than a minute"."""
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    idle_kernels.idle_s["k-gpu"] = 5.0
    got = {}
    for limit in (60.0, 45.0, 7500.0):
        idle_kernels.idle_s["k-gpu"] = limit - 30
        with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                          cull_idle_gpu_kernels_s=limit, cull_warning_s=limit) as state:
            lease = take_lease(tmp_path / "registry", A, "k-gpu")
            try:
                got[limit] = warnings_of(state, idle_kernels)["k-gpu"]
            finally:
                lease.release()
    assert got == {60.0: warned(30, limit="1 min"), 45.0: warned(15, limit="45 s"),
                   7500.0: warned(7470, limit="2 h 5 min")}


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------


def test_a_picked_gpu_the_sweep_no_longer_shows_is_warned_by_its_uuid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, idle_kernels: IdleKernels
) -> None:
    """Mutation run of 2026-12-07 found the words for a provisioner's GPU that is not in the
    latest sweep unpinned (server/kernels.py): the warning names it by its UUID."""
    gone = "GPU-0000dead-0000-0000-0000-000000000000"
    idle_kernels.provisioners["k-gpu"] = SimpleNamespace(
        pid=idle_kernels.pid("k-gpu"), autogpu_picked=(gone,), autogpu_constraints=None,
        autogpu_note=None, autogpu_lease_id=None, autogpu_move_file=None)
    idle_kernels.idle_s["k-gpu"] = 590.0
    fleet_file = write_fleet(tmp_path / "fleet.json", fleet())
    with server_state(fleet_file, tmp_path / "registry", monkeypatch,
                      cull_idle_gpu_kernels_s=LIMIT_S) as state:
        got = warnings_of(state, idle_kernels)["k-gpu"]
    assert got == warned(590, gpu=gone)
