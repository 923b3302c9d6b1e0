"""Which kernel a GPU process belongs to (``server.state.owning_kernel``, ``kernel_pid_map``): the
walk up the real process tree, and its bound; and the server's shared state (``AutoGPUServer``):
its sampler, settings, labels and executor. Survivors of ``make mutate SAMPLE=6`` and of later
sampled runs (issue 22), each seen failing with its mutant planted by hand."""

from __future__ import annotations

import asyncio
import getpass
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets.config import Config, Configurable

from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from autogpu_jupyter.server import state
from autogpu_jupyter.server.state import AutoGPUServer, kernel_pid_map, owning_kernel
from tests.leasehelpers import forget_backends
from tests.payloadhelpers import GiB, write_fleet

A = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
B = "GPU-1b1b1b1b-1111-2222-3333-444444444444"


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


def test_the_default_walk_up_finds_a_kernel_63_generations_up_but_not_64(tmp_path: Path) -> None:
    """The default bound is 64 lookups: the process itself and 63 ancestors. Caught: the default
    bound moved (65)."""
    pids = list(range(1000, 1066))
    _chain(tmp_path, pids)
    assert owning_kernel(1000, {pids[63]: "k-63"}, proc_root=str(tmp_path)) == "k-63"
    assert owning_kernel(1000, {pids[64]: "k-64"}, proc_root=str(tmp_path)) is None


def test_a_kernel_at_pid_2_is_found(tmp_path: Path) -> None:
    """In a container's own pid namespace a kernel may be pid 2 (its server pid 1): the walk up
    stops only at pid 1. Caught: the walk stopping at pid 2 (that kernel's GPU processes then
    belonged to no kernel)."""
    _chain(tmp_path, [40, 2])
    assert owning_kernel(40, {2: "k-2"}, proc_root=str(tmp_path)) == "k-2"
    assert owning_kernel(2, {2: "k-2"}, proc_root=str(tmp_path)) == "k-2"
    assert owning_kernel(1, {1: "k-1"}, proc_root=str(tmp_path)) is None


class _Kernels:
    """A kernel manager's ``list_kernel_ids`` / ``get_kernel`` over made-up kernel managers."""

    def __init__(self, **kms: Any) -> None:
        self.kms = kms

    def list_kernel_ids(self) -> list[str]:
        return [*self.kms, "k-gone"]

    def get_kernel(self, kid: str) -> Any:
        return self.kms[kid]  # "k-gone" ended meanwhile: KeyError


def test_kernel_pids_come_from_the_provisioner_its_process_or_the_kernel_object() -> None:
    """An older jupyter_client's provisioner has no ``pid``: its Popen (``process``) or the
    manager's ``kernel`` says it. Caught: the attribute names misspelt (``PROCESS``, a None name,
    which getattr refuses with TypeError)."""
    kernels = _Kernels(
        new=SimpleNamespace(provisioner=SimpleNamespace(pid=11)),
        popen=SimpleNamespace(provisioner=SimpleNamespace(pid=None,
                                                          process=SimpleNamespace(pid=12))),
        bare=SimpleNamespace(provisioner=None, kernel=SimpleNamespace(pid=13)),
        starting=SimpleNamespace(provisioner=SimpleNamespace(pid=None, process=None)),
    )
    assert kernel_pid_map(kernels) == {11: "new", 12: "popen", 13: "bare"}



class _KernelsGoneFirst(_Kernels):
    """As :class:`_Kernels`, the ended kernel listed first."""

    def list_kernel_ids(self) -> list[str]:
        return ["k-gone", *self.kms]


def test_a_kernel_ended_meanwhile_skips_only_itself() -> None:
    """A kernel listed but gone when asked (KeyError) is left out; those listed after it are
    still mapped. Caught (issue 22, seed 53): the walk stopped at the gone one."""
    kernels = _KernelsGoneFirst(new=SimpleNamespace(provisioner=SimpleNamespace(pid=11)))
    assert kernel_pid_map(kernels) == {11: "new"}


def test_a_kernel_object_without_a_provisioner_attribute_gives_its_kernels_pid() -> None:
    """An older jupyter_client's manager has no ``provisioner`` attribute at all. Caught
    (issue 22, seed 53): the attribute read without a default (AttributeError)."""
    kernels = _Kernels(old=SimpleNamespace(kernel=SimpleNamespace(pid=13)))
    assert kernel_pid_map(kernels) == {13: "old"}


def test_the_sidebar_sees_the_leases_even_where_the_server_takes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``c.AutoGPU.use_leases = False`` (the server itself takes no lease): the sidebar's view
    of the host's leases is still the shared directory. Caught (issue 22, seed 53): the store
    asked for without ``view`` (no store: holders and bookings never shown)."""
    monkeypatch.setenv("AUTOGPU_BROKER_SOCKET", "off")
    config = Config()
    config.AutoGPU.use_leases = False
    state = AutoGPUServer(parent=Configurable(config=config), registry_dir=str(tmp_path / "reg"),
                          log=logging.getLogger("autogpu-test-server"))
    try:
        store = state.store()
    finally:
        state.stop()
    assert isinstance(store, DirectoryStore)
    assert store.path == str(tmp_path / "reg")

@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:

    path = write_fleet(tmp_path / "fleet.json", [
        {"uuid": A, "name": "NVIDIA A100", "memory_total": 80 * GiB, "memory_used": 0},
        {"uuid": B, "name": "NVIDIA L4", "memory_total": 24 * GiB, "memory_used": 0},
    ])
    monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
    monkeypatch.delenv("AUTOGPU_SAMPLE_INTERVAL", raising=False)
    sampler_mod.stop_sampler()
    forget_backends()
    yield path
    sampler_mod.stop_sampler()
    forget_backends()


def test_the_servers_sampler_runs_at_the_servers_interval_and_history(fleet: Path) -> None:
    """``c.AutoGPUServer.interval_s`` / ``history_s`` reach the process's sampler (the history
    at least 1 s). Caught: the interval not passed (the sampler kept AutoGPU's 1 s)."""
    state = AutoGPUServer(registry_dir="", interval_s=0.5, history_s=0.25,
                          log=logging.getLogger("autogpu-test-server"))
    try:
        s = state.sampler()
        assert s is sampler_mod.current_sampler() and state.sampler() is s
        assert (s.interval_s, s.history_s) == (0.5, 1.0)
    finally:
        state.stop()


class _Sampler:
    def __init__(self, snap: Any) -> None:
        self.snap = snap

    def latest(self) -> Any:
        return self.snap


def test_labels_come_from_the_samplers_latest_sweep(
    fleet: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UUID -> label from the latest sweep; none before the first sweep, none without a sampler.
    Caught: the sampler never read (always no labels); a sampler without a sweep yet read as
    one (AttributeError on None)."""
    from autogpu_jupyter.core import sampler as sampler_mod

    process_sampler = _Sampler(None)  # the process's sampler, its sweeps the test's
    monkeypatch.setattr(sampler_mod, "get_sampler", lambda **_kw: process_sampler)
    state = AutoGPUServer(registry_dir="", log=logging.getLogger("autogpu-test-server"))
    try:
        assert state.labels() == {}  # no sampler started yet
        assert state.sampler() is process_sampler
        assert state.labels() == {}  # no sweep yet
        process_sampler.snap = SimulatedBackend(str(fleet)).snapshot()
        assert state.labels() == {A: "GPU 0", B: "GPU 1"}
    finally:
        state.stop()


def test_blocking_calls_run_on_the_servers_own_executor() -> None:
    """``run`` uses the extension's threads (``executor_threads``, named autogpu-server), not
    the IOLoop's default executor. Caught: the default executor used."""
    state = AutoGPUServer(registry_dir="", log=logging.getLogger("autogpu-test-server"))
    try:
        name = asyncio.run(state.run(lambda: threading.current_thread().name))
    finally:
        state.stop()
    assert name.startswith("autogpu-server")


def test_a_stale_cluster_view_is_refreshed_on_the_servers_own_executor() -> None:
    """Past half a scrape interval every sidebar gets the kept view at once while one of the
    server's threads asks Prometheus again (a fake fetch and clock). Caught (issue 22, seed
    54): the server's cache made without the executor (each sidebar then waited on Prometheus
    in turn).

    A reasoned private seam: the server makes its cache itself, with its executor; the test
    gives that cache a pretend clock and Prometheus (no public input sets them)."""
    from tests.unit.test_cluster_cache import URL, Clock, Fetches

    state = AutoGPUServer(registry_dir="", log=logging.getLogger("autogpu-test-server"))
    cache = state.cluster_cache
    clock, fetch = Clock(), Fetches(interval_s=10.0)
    threads: list[str] = []

    def fetching(url: str, timeout_s: float) -> Any:
        threads.append(threading.current_thread().name)
        return fetch(url, timeout_s)

    cache._clock, cache._fetch = clock, fetching  # reasoned: the server makes its own cache
    try:
        first = cache.get(URL, 5.0)
        clock.now += 6.0
        kept = cache.get(URL, 5.0)
    finally:
        state.executor.shutdown(wait=True)  # the refresh done
    assert kept is first
    assert threads == [threading.current_thread().name, "autogpu-server_0"]
    assert cache.get(URL, 5.0).view.timestamp_s == 2.0  # the refreshed view, now fresh


@pytest.mark.parametrize(("bad_count", "quota"), [(False, 5), (True, 3)])
def test_the_servers_autogpu_config_shapes_the_sidebars_lease_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_count: bool, quota: int
) -> None:
    """``c.AutoGPU.max_devices_per_user = 5`` in the server's config is the quota of the store
    the sidebar reads (over ``$AUTOGPU_MAX_DEVICES_PER_USER``). Caught (issue 22, seed 54): the
    settings made without the server as their parent (the config not read: the env's 3).
    A config that cannot be read (``c.AutoGPU.count = "two"``) still gives the sidebar a store,
    from the ``AUTOGPU_*`` defaults (a quota of 3). Caught: the settings left None (the store's
    factory then fails on every request)."""
    monkeypatch.setenv("AUTOGPU_BROKER_SOCKET", "off")
    monkeypatch.setenv("AUTOGPU_MAX_DEVICES_PER_USER", "3")
    config = Config()
    if bad_count:
        config.AutoGPU.count = "two"
    config.AutoGPU.max_devices_per_user = 5
    state = AutoGPUServer(parent=Configurable(config=config), registry_dir=str(tmp_path / "reg"),
                          log=logging.getLogger("autogpu-test-server"))
    try:
        store = state.store()
    finally:
        state.stop()
    assert isinstance(store, DirectoryStore)
    assert (store.path, store.max_devices_per_user) == (str(tmp_path / "reg"), quota)


@pytest.mark.parametrize("threads", [1, 0])
def test_executor_threads_bounds_how_many_blocking_calls_run_at_once(threads: int) -> None:
    """``c.AutoGPUServer.executor_threads = 1`` (0 counts as 1): a second call waits for the
    first's thread, never gets one of its own. Caught (issue 22): the setting not handed to the
    executor (Python's default, several threads)."""
    state = AutoGPUServer(registry_dir="", executor_threads=threads,
                          log=logging.getLogger("autogpu-test-server"))
    started, go = threading.Event(), threading.Event()

    def first() -> str:
        started.set()
        go.wait(5)
        return threading.current_thread().name

    try:
        one = state.executor.submit(first)
        assert started.wait(5)
        two = state.executor.submit(lambda: threading.current_thread().name)
        go.set()
        names = [one.result(5), two.result(5)]
    finally:
        go.set()
        state.stop()
    assert names == ["autogpu-server_0", "autogpu-server_0"]


# ---- the user, and stop (found by the mutation run of issue 22) ----
def test_the_user_is_the_uid_where_it_has_no_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def nameless() -> str:
        raise KeyError("getpwuid(): uid not found: 4242")

    monkeypatch.setattr(getpass, "getuser", nameless)
    assert state.current_user() == str(os.getuid())


def test_stop_does_not_wait_for_a_running_call() -> None:
    """The server's shutdown is not held by a blocking call on the executor (an NVML read
    that hangs); that call ends on its own. And no sampler error before a sampler was asked."""
    server = AutoGPUServer(registry_dir="")
    assert server.sampler_error is None
    release = threading.Event()
    running = server.executor.submit(release.wait, 10)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    stopper.join(1.0)
    stopped_at_once = not stopper.is_alive()
    release.set()
    stopper.join()
    assert stopped_at_once
    assert running.result(5) is True
