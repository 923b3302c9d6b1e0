"""One decision everywhere: a kernel never books its GPU twice, and every view names the same
best device (design decision 13).

* A "Python 3 (autogpu)" kernel (the provisioner picked and holds a lease) runs the quickstart's
  ``%gpu pick --min-free 10G``: it keeps its lease and says so; options its device does not
  meet name the device that would fit and how to move; never a second lease.
* ``%gpu pick`` twice in a plain kernel says "you had GPU N; now GPU M" and leaves one lease.
* A property test over random fleets, leases, waiters, allocations and options: the API's dry
  run, the server's ``select`` (the sidebar's recommendation), the panel's best alternative and
  the move planner name the same best device, and a real pick takes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jupyter_client import AsyncKernelManager

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core.leasing.directory import DirectoryStore
from tests.leasehelpers import fleet, uuid_of

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3


@pytest.fixture
def host(fake_nvml: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    prefix = tmp_path / "prefix"
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(tmp_path / "registry"))
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED", "AUTOGPU_LEASE_ID"):
        monkeypatch.delenv(var, raising=False)
    spec = fleet(4)
    for i, used in enumerate((70, 10, 20, 30)):  # GPU 1 is the least loaded
        spec["devices"][i]["memory_used"] = used * GiB
    fake_nvml.write(spec)
    kernelspec.install("agp", "Python 3 (autogpu)", {"min_free": "5G"}, prefix=str(prefix))
    env = dict(os.environ, **fake_nvml.env, PYTHONPATH=str(REPO))
    return {"env": env, "registry": tmp_path / "registry", "tmp": tmp_path, "fake": fake_nvml}


#: Run in the kernel: wait (at most 30 s) until the kernel's own sampler has read device
#: ``uuid`` with ``used`` bytes in use (a listener on the sampler, no fixed sleep).
SAMPLER_SEES = """
import threading
from autogpu_jupyter.core.sampler import current_sampler

_seen = threading.Event()
def _saw(sampler, snap):
    dev = snap.by_uuid({uuid!r}) if snap is not None else None
    if dev is not None and dev.memory_used_bytes == {used}:
        _seen.set()
_s = current_sampler()
_s.subscribe(_saw)
try:
    _saw(_s, _s.latest())
    assert _seen.wait(30), "the kernel's sampler never read the new memory use"
finally:
    _s.unsubscribe(_saw)
"""


async def _run(kc: Any, code: str) -> tuple[str, str, str]:
    outs: list[dict[str, Any]] = []
    reply = await kc.execute_interactive(code, timeout=60, output_hook=outs.append)
    stdout = "".join(m["content"].get("text", "") for m in outs
                     if m["msg_type"] == "stream" and m["content"]["name"] == "stdout")
    stderr = "".join(m["content"].get("text", "") for m in outs
                     if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")
    return reply["content"]["status"], stdout, stderr


def _leases_json(host: dict[str, Any]) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "autogpu_jupyter.cli", "leases", "--json"],
                         env=host["env"], capture_output=True, text=True, timeout=60, check=True)
    return list(json.loads(out.stdout))


def test_an_autogpu_kernel_keeps_its_lease_and_never_books_twice(host: dict[str, Any]) -> None:
    async def main() -> None:
        km = AsyncKernelManager(kernel_name="agp")
        await km.start_kernel(env=host["env"], cwd=str(host["tmp"]))
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)
            (before,) = _leases_json(host)
            assert before["device_uuids"] == [uuid_of(1)]
            status, out, err = await _run(kc, "%gpu pick --min-free 10G")
            assert status == "ok", err
            assert out.splitlines()[0].startswith("autogpu: kept GPU 1 · NVIDIA A100-SXM4-80GB")
            assert out.splitlines()[1] == (
                "  this kernel was started on it by the autogpu kernelspec and already holds its "
                "lease; it meets min free 10.0 GiB, so nothing changed (no second lease)"
            )
            assert _leases_json(host) == [before]
            # GPU 1 fills up: options it no longer meets name the device that does.
            host["fake"].set(1, memory_used=75 * GiB)
            # the kernel's sampler (1 Hz) sees it: waited for, not slept on
            status, out, err = await _run(kc, SAMPLER_SEES.format(uuid=uuid_of(1),
                                                                  used=75 * GiB))
            assert status == "ok", err
            status, out, err = await _run(kc, "%gpu pick --min-free 30G")
            assert status == "error", out
            assert err == (
                "UsageError: this kernel was started on GPU 1 by the autogpu kernelspec and can "
                "use only that (its CUDA_VISIBLE_DEVICES was set before it started), and GPU 1 "
                "does not meet min free 30.0 GiB (GPU 1: only 5.0 GiB free < 30.0 GiB wanted); "
                "GPU 2 would fit: move there with %gpu move 2 (restarts the kernel; its variables "
                "are lost). No second lease was taken.\n"
            ), err
            assert _leases_json(host) == [before]
            status, out, err = await _run(kc, "%gpu pick --min-free 75G")
            assert status == "error"
            assert "no other device fits either right now" in err
            assert _leases_json(host) == [before]
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    asyncio.run(main())


def test_a_plain_kernel_repick_says_what_it_had_and_keeps_one_lease(host: dict[str, Any]) -> None:
    from tests.kernelhelpers import Kernel, kernel_env

    k = Kernel(kernel_env({**{k: v for k, v in host["env"].items() if k.startswith(
        ("FAKE_NVML", "LD_", "AUTOGPU_"))}}))
    try:
        assert k.run("%load_ext autogpu").status == "ok"
        first = k.run("%gpu pick")
        assert first.status == "ok", first
        assert "you had" not in first.stdout
        second = k.run("%gpu pick --exclude 1")
        assert second.status == "ok", second
        assert "  you had GPU 1; now GPU 2 (one lease: the old one was released)" in (
            second.stdout.splitlines()
        )
        leases = DirectoryStore(host["registry"]).list_leases()
        assert [r.device_uuids for r in leases] == [(uuid_of(2),)]
    finally:
        k.close()


# ---- the property test: every view names the same best device ----------------------------------


def _spec(loads: list[tuple[int, int]]) -> dict[str, Any]:
    devices = []
    for i, (used_gib, util) in enumerate(loads):
        devices.append({
            "uuid": uuid_of(i), "name": "NVIDIA A100-SXM4-80GB", "memory_total": "80G",
            "memory_used": used_gib * GiB, "utilization_pct": util, "processes": [],
        })
    return {"driver_version": "550.54.15", "devices": devices}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    loads=st.lists(st.tuples(st.integers(0, 79), st.integers(0, 100)), min_size=2, max_size=6),
    held=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40)), max_size=5),
    waiters=st.lists(st.integers(0, 30), max_size=2),
    min_free=st.one_of(st.none(), st.integers(1, 60)),
    max_util=st.one_of(st.none(), st.integers(10, 100)),
    grant=st.one_of(st.none(), st.integers(2, 6)),
)
def test_every_view_names_the_same_best_device(
    tmp_path_factory: pytest.TempPathFactory,
    loads: list[tuple[int, int]],
    held: list[tuple[int, int]],
    waiters: list[int],
    min_free: int | None,
    max_util: int | None,
    grant: int | None,
) -> None:
    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.decision import ticket_constraints
    from autogpu_jupyter.core.leasing import Requester
    from autogpu_jupyter.core.moves import plan_move
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints
    from autogpu_jupyter.errors import NoDeviceFitsError

    base = tmp_path_factory.mktemp("views")
    (base / "fleet.json").write_text(json.dumps(_spec(loads)))
    backend = SimulatedBackend(str(base / "fleet.json"))
    registry = DirectoryStore(base / "registry")
    n = len(loads)
    env = {} if grant is None else {
        "CUDA_VISIBLE_DEVICES": ",".join(uuid_of(i) for i in range(min(grant, n)))
    }
    keep: list[Any] = []
    for dev, gib in held:  # other kernels' leases, booking memory
        with registry.locked() as txn:
            assert txn is not None
            keep.append(txn.create(devices=[uuid_of(dev % n)], requested_bytes=gib * GiB,
                                   requester=Requester(pid=1)))
    for gib in waiters:  # older waiters in line
        t = registry.take_ticket(constraints=ticket_constraints(
            Constraints.parse(min_free=f"{gib}G" if gib else None), None))
        keep.append(t)
    cons = Constraints.parse(min_free=None if min_free is None else f"{min_free}G",
                             max_util=max_util)
    try:
        try:
            dry = pick(
                PickOptions(cons), backend=backend, environ=env, store=registry, dry_run=True
            )
            best = dry.chosen[0].uuid
        except NoDeviceFitsError:
            best = None
        # The move planner, asked for the best device for a CPU-only kernel of these options.
        try:
            planned: str | None = plan_move("best", current_uuids=(), constraints=cons,
                                            backend=backend, environ=env, store=registry
                                            ).target[0].uuid
        except NoDeviceFitsError:
            planned = None
        assert planned == best
        # The server's select (the sidebar's recommendation) over the same snapshot.
        assert _select(backend, registry, cons, env) == best
        # The panel's best alternative, for a kernel that sits on another device with these
        # options (its own device excluded), names the same device.
        if best is not None:
            from autogpu_jupyter.core.overload import best_alternative

            elsewhere = next((uuid_of(i) for i in range(n) if uuid_of(i) != best), None)
            alt = best_alternative(backend.snapshot(), [elsewhere] if elsewhere else [],
                                   constraints=cons, store=registry, environ=env)
            assert alt is not None and alt.uuid == best
        # A real pick takes it.
        if best is not None:
            real = pick(PickOptions(cons), backend=backend, environ=env, store=registry)
            assert real.chosen[0].uuid == best
            assert real.lease is not None
            real.lease.release()
    finally:
        for x in keep:
            if x is not None:
                x.release()


def _select(backend: Any, registry: DirectoryStore, cons: Any, env: dict[str, str]) -> str | None:
    """What ``GET /autogpu/select`` answers, by its own payload function over the snapshot."""
    from autogpu_jupyter.server.payloads import select_answer

    data = select_answer(backend.snapshot(), cons, registry, environ=env)
    return data["chosen"][0]["uuid"] if data["chosen"] else None


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autogpu_jupyter.cli", *args], env=env,
                          capture_output=True, text=True, timeout=60, check=False)


def test_model_filter_and_preference_order(tmp_path: Path) -> None:
    """``--model`` selects by model name, ``--prefer`` (or the admin's ``AUTOGPU_PREFER``) orders
    by it before load; the dry run says which term decided."""
    spec = {"driver_version": "550.54.15", "devices": [
        {"uuid": uuid_of(0), "name": "NVIDIA A100-SXM4-80GB", "memory_total": "80G",
         "memory_used": 0, "utilization_pct": 0, "processes": []},
        {"uuid": uuid_of(1), "name": "NVIDIA L4", "memory_total": "24G",
         "memory_used": 0, "utilization_pct": 30, "processes": []},
    ]}
    (tmp_path / "fleet.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
    env.update(AUTOGPU_SIMULATE=str(tmp_path / "fleet.json"), PYTHONPATH=str(REPO),
               AUTOGPU_REGISTRY_DIR=str(tmp_path / "registry"))

    def chosen(*args: str, **extra: str) -> list[str]:
        out = _cli({**env, **extra}, "pick", "--json", *args)
        assert out.returncode == 0, out.stderr
        return [d["label"] for d in json.loads(out.stdout)["chosen"]]

    assert chosen() == ["GPU 0"]  # by load: the idle A100
    assert chosen("--model", "L4") == ["GPU 1"]
    assert chosen("--prefer", "L4,A100") == ["GPU 1"]
    assert chosen(AUTOGPU_PREFER="L4") == ["GPU 1"]  # the admin's default order
    assert chosen("--prefer", "A100", AUTOGPU_PREFER="L4") == ["GPU 0"]  # the flag wins
    none = _cli(env, "pick", "--model", "H100")
    assert none.returncode == 3
    assert none.stderr.splitlines()[1:3] == [
        "  GPU 0 (NVIDIA A100-SXM4-80GB): dropped: model NVIDIA A100-SXM4-80GB is not H100",
        "  GPU 1 (NVIDIA L4): dropped: model NVIDIA L4 is not H100",
    ]
    bad = _cli(env, "pick", "--model", "A100,")
    assert bad.returncode == 2
    assert bad.stderr.startswith("autogpu: invalid --model 'A100,': expected model names")

    from autogpu_jupyter.core.backends.simulated import SimulatedBackend
    from autogpu_jupyter.core.options import PickOptions
    from autogpu_jupyter.core.picker import pick
    from autogpu_jupyter.core.policy import Constraints
    from autogpu_jupyter.magics import format_ranking

    backend = SimulatedBackend(str(tmp_path / "fleet.json"))
    text = format_ranking(
        pick(PickOptions(Constraints(prefer=("L4",))), backend=backend, dry_run=True)
    )
    assert text.splitlines()[0] == "autogpu [SIMULATED] dry run (preferring L4): nothing changed"
    assert text.splitlines()[-1] == (
        "  why GPU 1 over GPU 0: preferred model (NVIDIA L4 before NVIDIA A100-SXM4-80GB)"
    )
    text = format_ranking(pick(PickOptions(Constraints()), backend=backend, dry_run=True))
    assert text.splitlines()[-1] == "  why GPU 0 over GPU 1: lower load (0% util vs 30% util)"


def test_a_dry_run_says_when_you_are_already_on_the_best_device(host: dict[str, Any]) -> None:
    from tests.kernelhelpers import Kernel, kernel_env

    k = Kernel(kernel_env({k: v for k, v in host["env"].items() if k.startswith(
        ("FAKE_NVML", "LD_", "AUTOGPU_"))}))
    try:
        assert k.run("%load_ext autogpu").status == "ok"
        assert k.run("%gpu pick").status == "ok"  # GPU 1, the least loaded
        r = k.run("%gpu pick --dry-run")
        assert r.status == "ok", r
        assert r.stdout.splitlines()[-1] == (
            "  you are already on the best device (GPU 1): nothing to change"
        )
        r = k.run("%gpu pick --dry-run --exclude 1")
        assert "already on the best" not in r.stdout
    finally:
        k.close()
