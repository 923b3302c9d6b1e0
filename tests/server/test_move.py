"""Moving a kernel to another GPU, for real: the server endpoint and the ``%gpu move`` magic.

A real Jupyter server (pytest-jupyter's ``jp_fetch``) starts kernels with the autogpu kernelspec;
the provisioner and the server extension run in this test process over the fake
``libnvidia-ml.so.1``. What a kernel got is read from ``/proc/<pid>/environ`` (what it had before
any user code ran), and the leases from the registry.
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient
from jupyter_client import AsyncKernelManager

from autogpu_jupyter import kernelspec
from autogpu_jupyter.core import moves
from autogpu_jupyter.core import sampler as sampler_mod
from autogpu_jupyter.core.leasing import DirectoryStore
from tests.kernelhelpers import kernel_environ
from tests.leasehelpers import fleet, uuid_of

pytest_plugins = ["pytest_jupyter.jupyter_server"]

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3
SPEC = "agp"

#: What the restart tells the user when the kernel went where the plan said.
NOT_AUTOGPU = (
    "this kernel was not started with the autogpu kernelspec, so no restart would move it; "
    "choose \"Python 3 (autogpu)\" as the notebook's kernel (install it with "
    "`autogpu kernelspec install`)"
)



@pytest.fixture
def gpus(fake_nvml: Any, registry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Three idle A100s on the fake driver, visible to this process and to kernels."""
    fake_nvml.write(fleet(3))
    for key, value in fake_nvml.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    for var in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "AUTOGPU_PICKED",
                "AUTOGPU_LEASE_ID", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_GPUS",
                "SLURM_STEP_GPUS", "AUTOGPU_MIN_FREE", "AUTOGPU_WAIT"):
        monkeypatch.delenv(var, raising=False)
    sampler_mod.stop_sampler()
    yield fake_nvml
    sampler_mod.stop_sampler()


@pytest.fixture
def jp_server_config(gpus: Any) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": {"interval_s": 0.1},
    }


@pytest.fixture
def autogpu_spec(jp_data_dir: Path) -> str:
    """The autogpu kernelspec (min free 10G) where the test server finds kernelspecs."""
    spec_dir = jp_data_dir / "kernels" / SPEC
    spec_dir.mkdir(parents=True)
    spec = kernelspec.spec_dict("Python 3 (autogpu)", {"min_free": "10G"})
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return SPEC


def leases(registry_dir: Path) -> list[tuple[int, tuple[str, ...], str | None]]:
    return [(r.pid, r.device_uuids, r.kernel_id)
            for r in DirectoryStore(str(registry_dir)).list_leases()]


async def open_notebook(jp_fetch: Any, kernel: str, path: str = "work/train.ipynb") -> Any:
    """What JupyterLab does when a notebook opens: a session with a new kernel."""
    response = await jp_fetch(
        "api", "sessions", method="POST",
        body=json.dumps({"path": path, "type": "notebook", "name": Path(path).name,
                         "kernel": {"name": kernel}}),
    )
    return json.loads(response.body)


async def post_move(jp_fetch: Any, kid: str, body: Any, **kwargs: Any) -> Any:
    return await jp_fetch("autogpu", "kernels", kid, "move", method="POST",
                          body=body if isinstance(body, str) else json.dumps(body), **kwargs)


async def move_error(jp_fetch: Any, kid: str, body: Any) -> tuple[int, str]:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await post_move(jp_fetch, kid, body)
    return err.value.code, json.loads(err.value.response.body)["message"]


def kernel_pid(serverapp: Any, kid: str) -> int:
    return int(serverapp.kernel_manager.get_kernel(kid).provisioner.pid)


async def test_move_restarts_the_kernel_on_the_target_with_the_lease_moved(
    jp_fetch: Any, jp_serverapp: Any, autogpu_spec: str, registry_dir: Path, gpus: Any,
) -> None:
    session = await open_notebook(jp_fetch, autogpu_spec)
    kid = session["kernel"]["id"]
    try:
        old_pid = kernel_pid(jp_serverapp, kid)
        # Three identical idle GPUs: the provisioner took the first (UUID order).
        assert kernel_environ(old_pid)["CUDA_VISIBLE_DEVICES"] == uuid_of(0)
        assert leases(registry_dir) == [(old_pid, (uuid_of(0),), kid)]

        # The sidebar learns that this notebook's kernel can move, and where it is.
        holders = json.loads((await jp_fetch("autogpu", "holders")).body)
        (info,) = holders["kernels"]
        # jupyter_server's activity: a fresh kernel is starting, busy or idle for a moment
        assert info.pop("execution_state") in ("starting", "idle", "busy")
        idle_s = info.pop("idle_s")
        assert idle_s is None or 0 <= idle_s < 60
        assert info.pop("overload") is None  # three idle GPUs: nobody overloads GPU 0
        assert info.pop("better") is None
        assert info.pop("waiting") is False
        # three identical idle GPUs: GPU 0 is as good as any, no move offered (issue 41)
        assert info.pop("best_move") is None
        assert info.pop("cull_warning") is None  # no culling here
        # the grant the kernel picked within (not its pick): every GPU of this server
        assert info.pop("allowed_uuids") == [uuid_of(i) for i in range(3)]
        assert info == {
            "kernel_id": kid, "notebook_path": "work/train.ipynb", "movable": True,
            "picked_uuids": [uuid_of(0)], "constraints_text": "min free 10.0 GiB", "note": None,
        }

        # "best" from the best device: nowhere to go (it moved to GPU 1, then back: issue 41)
        assert await move_error(jp_fetch, kid, {"target": "best", "dry_run": True}) == (
            400, "the kernel is already on the best device: GPU 0 (NVIDIA A100-SXM4-80GB, "
                 "80.0 GiB free); nothing to move")
        # A dry run (the sidebar's confirmation dialog) plans and changes nothing.
        response = await post_move(jp_fetch, kid, {"target": "1", "dry_run": True})
        plan_1 = (
            "The kernel will restart on GPU 1 (NVIDIA A100-SXM4-80GB, 80.0 GiB free), the "
            "requested device now. Restarting loses the kernel's state (variables, imports, data "
            "in memory): save what you need first."
        )
        assert json.loads(response.body) == {
            "dry_run": True, "pending": False, "plan": plan_1, "message": plan_1,
            "target": [uuid_of(1)], "target_labels": ["GPU 1"], "picked": None, "note": None,
        }
        assert kernel_pid(jp_serverapp, kid) == old_pid
        assert not (Path(os.environ["JUPYTER_RUNTIME_DIR"]) / f"autogpu-move-{kid}.json").exists()

        # The move itself: the kernel restarts on GPU 2, and its lease moves with it.
        response = await post_move(jp_fetch, kid, {"target": "2"})
        assert response.code == 200
        assert json.loads(response.body) == {
            "dry_run": False, "pending": False,
            "plan": "The kernel will restart on GPU 2 (NVIDIA A100-SXM4-80GB, 80.0 GiB free), "
                    "the requested device now. Restarting loses the kernel's state (variables, "
                    "imports, data in memory): save what you need first.",
            "message": "The kernel restarted on GPU 2; its state (variables) was lost.",
            "target": [uuid_of(2)], "target_labels": ["GPU 2"], "picked": [uuid_of(2)],
            "note": "moved at your request: the kernel's state was lost",
        }
        new_pid = kernel_pid(jp_serverapp, kid)
        assert new_pid != old_pid
        assert proc_env_gone(old_pid)
        env = kernel_environ(new_pid)
        assert env["CUDA_VISIBLE_DEVICES"] == uuid_of(2)
        assert env["AUTOGPU_PICKED"] == uuid_of(2)
        assert env["AUTOGPU_PICK_NOTE"] == "moved at your request: the kernel's state was lost"
        # the old device has no lease of this kernel, the new one has
        assert leases(registry_dir) == [(new_pid, (uuid_of(2),), kid)]
        holders = json.loads((await jp_fetch("autogpu", "holders")).body)
        lease_holders = [(h["uuid"], h["kernel_id"], h["notebook_path"])
                         for h in holders["holders"] if h["kind"] == "lease"]
        assert lease_holders == [(uuid_of(2), kid, "work/train.ipynb")]
        assert holders["kernels"][0]["picked_uuids"] == [uuid_of(2)]

        # Targets that cannot work: one clear message each, nothing recorded, no restart.
        gpus.set(1, memory_used=75 * GiB)
        code, message = await move_error(jp_fetch, kid, {"target": "1"})
        assert code == 400
        assert message.startswith(
            "GPU 1 does not fit this kernel's options (min free 10.0 GiB): only 5.0 GiB free "
            "< 10.0 GiB wanted"
        ), message
        assert await move_error(jp_fetch, kid, {"target": "2"}) == (
            400, "the kernel already runs on GPU 2")
        assert await move_error(jp_fetch, kid, {"target": "7"}) == (
            400, "unknown device '7' for a move: expected an NVML index (0, 1, 2), a (unique) "
                 "UUID, or --best")
        assert await move_error(jp_fetch, kid, {"target": 2.5}) == (
            400, "invalid target 2.5: expected \"best\", an NVML index such as \"2\", or a GPU "
                 "UUID")
        assert await move_error(jp_fetch, kid, {"gpu": "1"}) == (
            400, "unknown parameter 'gpu'; accepted: target, dry_run, restart")
        assert await move_error(jp_fetch, kid, "[1]") == (
            400, "expected a JSON object such as {\"target\": \"best\"} or {\"target\": \"2\"}, "
                 "got [1]")
        gpus.set(0, memory_used=75 * GiB)
        # the kernel's own lease (10 GiB booked) is hidden: the one decision pipeline, as the
        # sidebar's recommendation does
        assert await move_error(jp_fetch, kid, {"target": "best"}) == (
            400, "the kernel is already on the best device: GPU 2 (NVIDIA A100-SXM4-80GB, "
                 "80.0 GiB free); nothing to move")
        gpus.set(2, memory_used=75 * GiB)  # and then its own GPU is full too
        assert await move_error(jp_fetch, kid, {"target": "best"}) == (400, (
            "no better device to move to (min free 10.0 GiB; the current one excluded): "
            "GPU 0 (NVIDIA A100-SXM4-80GB): dropped: only 5.0 GiB free < 10.0 GiB wanted. "
            "GPU 1 (NVIDIA A100-SXM4-80GB): dropped: only 5.0 GiB free < 10.0 GiB wanted. "
            f"GPU 2 (NVIDIA A100-SXM4-80GB): dropped: excluded by --exclude {uuid_of(2)}; "
            "only 5.0 GiB free < 10.0 GiB wanted"))
        assert kernel_pid(jp_serverapp, kid) == new_pid
        assert not (Path(os.environ["JUPYTER_RUNTIME_DIR"]) / f"autogpu-move-{kid}.json").exists()
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")
    assert leases(registry_dir) == []


async def test_a_move_the_client_restarts_goes_where_the_plan_said(
    jp_fetch: Any, jp_serverapp: Any, autogpu_spec: str, registry_dir: Path
) -> None:
    """The sidebar's way: the server records the move (``"restart": false``), the notebook's
    kernel restarts through Jupyter's own restart (what JupyterLab's "Restart Kernel" calls, so
    the notebook follows the restart), then ``GET`` says where the kernel runs; a request no
    restart took is dropped with ``DELETE``."""
    session = await open_notebook(jp_fetch, autogpu_spec)
    kid = session["kernel"]["id"]
    move_file = Path(os.environ["JUPYTER_RUNTIME_DIR"]) / f"autogpu-move-{kid}.json"
    try:
        old_pid = kernel_pid(jp_serverapp, kid)
        # nothing recorded yet: nothing to report
        with pytest.raises(tornado.httpclient.HTTPClientError) as err:
            await jp_fetch("autogpu", "kernels", kid, "move")
        assert err.value.code == 404
        response = await post_move(jp_fetch, kid, {"target": "1", "restart": False})
        recorded = json.loads(response.body)
        assert recorded["pending"] is True and recorded["target"] == [uuid_of(1)]
        assert recorded["message"] == "The move to GPU 1 waits for the kernel's restart."
        assert kernel_pid(jp_serverapp, kid) == old_pid and move_file.exists()
        got = json.loads((await jp_fetch("autogpu", "kernels", kid, "move")).body)
        assert got["pending"] is True

        # the notebook restarts its kernel as JupyterLab does: POST /api/kernels/<id>/restart
        await jp_fetch("api", "kernels", kid, "restart", method="POST", body="{}")
        new_pid = kernel_pid(jp_serverapp, kid)
        assert new_pid != old_pid and not move_file.exists()
        assert kernel_environ(new_pid)["CUDA_VISIBLE_DEVICES"] == uuid_of(1)
        got = json.loads((await jp_fetch("autogpu", "kernels", kid, "move")).body)
        assert (got["pending"], got["picked"], got["message"]) == (
            False, [uuid_of(1)], "The kernel restarted on GPU 1; its state (variables) was lost.")
        assert leases(registry_dir) == [(new_pid, (uuid_of(1),), kid)]

        # a recorded move whose restart never came: dropped, nothing moves later
        await post_move(jp_fetch, kid, {"target": "0", "restart": False})
        assert move_file.exists()
        dropped = await jp_fetch("autogpu", "kernels", kid, "move", method="DELETE")
        assert json.loads(dropped.body) == {"cancelled": True}
        assert not move_file.exists()
        with pytest.raises(tornado.httpclient.HTTPClientError) as err:
            await jp_fetch("autogpu", "kernels", kid, "move")
        assert err.value.code == 404
        assert await move_error(jp_fetch, kid, {"target": "best", "restart": "no"}) == (
            400, "invalid restart 'no': expected true or false")
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


def proc_env_gone(pid: int) -> bool:
    """A zombie or a reused pid: not the old kernel any more."""
    try:
        return "AUTOGPU_PICKED" not in kernel_environ(pid, timeout_s=0)
    except OSError:
        return True


async def test_recommendation_ignores_the_notebooks_own_lease(
    jp_fetch: Any, jp_serverapp: Any, autogpu_spec: str, registry_dir: Path,
) -> None:
    """Two identical idle GPUs; the notebook holds GPU 0. Asked "best for this notebook", the
    server must not count the notebook's own lease against GPU 0 (it would then say GPU 1)."""
    session = await open_notebook(jp_fetch, autogpu_spec)
    kid = session["kernel"]["id"]
    try:
        assert leases(registry_dir) == [(kernel_pid(jp_serverapp, kid), (uuid_of(0),), kid)]
        plain = json.loads((await jp_fetch("autogpu", "select",
                                           params={"min_free": "10G"})).body)
        assert [c["label"] for c in plain["chosen"]] == ["GPU 1"]  # anyone else: the free one
        mine = json.loads((await jp_fetch("autogpu", "select",
                                          params={"min_free": "10G", "kernel_id": kid})).body)
        assert [c["label"] for c in mine["chosen"]] == ["GPU 0"]  # this notebook: where it is
        by_label = {c["label"]: c for c in mine["candidates"]}
        assert by_label["GPU 0"]["lease_count"] == 0
        posted = json.loads((await jp_fetch(
            "autogpu", "select", method="POST",
            body=json.dumps({"min_free": "10G", "kernel_id": kid}))).body)
        assert [c["label"] for c in posted["chosen"]] == ["GPU 0"]
        with pytest.raises(tornado.httpclient.HTTPClientError) as err:
            await jp_fetch("autogpu", "select", params={"kernel_id": "../etc"})
        assert err.value.code == 400
        assert json.loads(err.value.response.body)["message"] == (
            "invalid kernel_id '../etc': expected a kernel id such as "
            "'5e6f7a8b-1c2d-4e5f-8a9b-0c1d2e3f4a5b'"
        )
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


async def test_move_of_a_kernel_not_started_by_autogpu_is_400(
    jp_fetch: Any, jp_serverapp: Any,
) -> None:
    session = await open_notebook(jp_fetch, "python3", "plain.ipynb")
    kid = session["kernel"]["id"]
    try:
        pid = kernel_pid(jp_serverapp, kid)
        assert await move_error(jp_fetch, kid, {"target": "best"}) == (400, NOT_AUTOGPU)
        assert kernel_pid(jp_serverapp, kid) == pid
        holders = json.loads((await jp_fetch("autogpu", "holders")).body)
        (info,) = holders["kernels"]
        info.pop("execution_state")
        info.pop("idle_s")
        assert info.pop("overload") is None
        assert info.pop("better") is None
        assert info.pop("waiting") is False
        assert info.pop("best_move") is None  # it cannot move
        assert info.pop("cull_warning") is None
        assert info.pop("allowed_uuids") == [uuid_of(i) for i in range(3)]
        assert info == {
            "kernel_id": kid, "notebook_path": "plain.ipynb", "movable": False,
            "picked_uuids": [], "constraints_text": None, "note": None,
        }
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


async def test_move_of_an_unknown_kernel_is_404(jp_fetch: Any) -> None:
    kid = "00000000-0000-0000-0000-000000000000"
    assert await move_error(jp_fetch, kid, {"target": "best"}) == (
        404, f"no kernel '{kid}' on this server")


async def test_move_needs_authentication_and_xsrf(
    jp_fetch: Any, jp_serverapp: Any, http_server_client: Any, jp_base_url: str,
    autogpu_spec: str,
) -> None:
    session = await open_notebook(jp_fetch, autogpu_spec)
    kid = session["kernel"]["id"]
    try:
        pid = kernel_pid(jp_serverapp, kid)
        with pytest.raises(tornado.httpclient.HTTPClientError) as err:
            await post_move(jp_fetch, kid, {"target": "1"}, headers={"Authorization": ""})
        assert err.value.code == 403
        # A browser session (cookie, no token header) without the XSRF token: refused.
        cookie, xsrf = await _browser_login(jp_serverapp, http_server_client, jp_base_url)
        url = f"{jp_base_url}autogpu/kernels/{kid}/move"
        body = json.dumps({"target": "1"})
        without = await http_server_client.fetch(
            url, method="POST", body=body, headers={"Cookie": cookie}, raise_error=False)
        assert without.code == 403
        assert b"XSRF" in without.body or b"_xsrf" in without.body
        assert kernel_pid(jp_serverapp, kid) == pid  # nothing happened
        assert kernel_environ(pid)["CUDA_VISIBLE_DEVICES"] == uuid_of(0)
        # With it, the same request moves the kernel.
        with_xsrf = await http_server_client.fetch(
            url, method="POST", body=body, headers={"Cookie": cookie, "X-XSRFToken": xsrf},
            raise_error=False)
        assert with_xsrf.code == 200, with_xsrf.body
        assert kernel_environ(kernel_pid(jp_serverapp, kid))["CUDA_VISIBLE_DEVICES"] == uuid_of(1)
        # Two moves of one kernel at once (a double click): one runs, the other is refused.
        answers = await asyncio.gather(
            post_move(jp_fetch, kid, {"target": "0"}), post_move(jp_fetch, kid, {"target": "2"}),
            return_exceptions=True,
        )
        done = [a for a in answers if not isinstance(a, BaseException)]
        refused = [a for a in answers if isinstance(a, tornado.httpclient.HTTPClientError)]
        assert (len(done), len(refused)) == (1, 1), answers
        assert refused[0].code == 409
        assert json.loads(refused[0].response.body)["message"] == (
            "a move of this kernel is already in progress")
        winner = json.loads(done[0].body)["picked"]
        assert [kernel_environ(kernel_pid(jp_serverapp, kid))["CUDA_VISIBLE_DEVICES"]] == winner
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


async def _browser_login(serverapp: Any, client: Any, base_url: str) -> tuple[str, str]:
    token = serverapp.identity_provider.token
    page = await client.fetch(base_url + "login", raise_error=False)
    cookies = [c.split(";", 1)[0] for c in page.headers.get_list("Set-Cookie")]
    login = await client.fetch(
        base_url + "login?" + urllib.parse.urlencode({"token": token}),
        follow_redirects=False, raise_error=False,
    )
    cookies += [c.split(";", 1)[0] for c in login.headers.get_list("Set-Cookie")]
    assert any(c.startswith("username-") for c in cookies), cookies
    xsrf = next(c.split("=", 1)[1] for c in cookies if c.startswith("_xsrf="))
    return "; ".join(cookies), xsrf


# ---------------------------------------------------------------------------------------------
# %gpu move in a provisioned kernel (jupyter_client, no server)


def test_gpu_move_best_magic_then_restart(
    gpus: Any, tmp_path: Path, registry_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    prefix = tmp_path / "prefix"
    runtime = tmp_path / "kruntime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(runtime))
    kernelspec.install(SPEC, "Python 3 (autogpu)", {"min_free": "10G"}, prefix=str(prefix))

    async def run(kc: Any, code: str) -> tuple[str, str]:
        out: list[str] = []
        err: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                (out if msg["content"]["name"] == "stdout" else err).append(
                    msg["content"]["text"])
            elif msg["msg_type"] == "error":
                err.append(msg["content"]["evalue"])
            elif msg["msg_type"] == "display_data":
                out.append(msg["content"]["data"]["text/plain"])

        await kc.execute_interactive(code, timeout=60, output_hook=hook)
        return "".join(out), "".join(err)

    async def main() -> None:
        km = AsyncKernelManager(kernel_name=SPEC)
        await km.start_kernel(env=dict(os.environ), cwd=str(tmp_path))
        try:
            assert kernel_environ(int(km.provisioner.pid))["CUDA_VISIBLE_DEVICES"] == uuid_of(0)
            # other processes fill GPU 0: the kernel's 10G no longer fit there
            gpus.set(0, memory_used=75 * GiB)
            kc = km.client()
            kc.start_channels()
            try:
                await kc.wait_for_ready(timeout=60)
                out, err = await run(kc, "%gpu move --best")
                # until the restart, the kernel's status says the move is pending
                status, _ = await run(kc, "%gpu status")
            finally:
                kc.stop_channels()
            assert status.splitlines()[-1].endswith(
                " · move to GPU 1 pending: restart the kernel (Kernel > Restart Kernel) "
                "to move"
            ), status
            assert err == ""
            assert out == (
                "The kernel will restart on GPU 1 (NVIDIA A100-SXM4-80GB, 80.0 GiB free), the "
                "best other device now. Restarting loses the kernel's state (variables, "
                "imports, data in memory): save what you need first. Restart the kernel now "
                "(Kernel > Restart Kernel) to move; until then nothing changes.\n"
            )
            request = moves.read_move(moves.move_file_for(runtime, km.kernel_id))
            assert request is not None
            # the device the plan named: the restart goes where the message said
            assert (request.target_uuids, request.from_uuids, request.source) == (
                (uuid_of(1),), (uuid_of(0),), "magic")
            await km.restart_kernel()
            pid = int(km.provisioner.pid)
            assert kernel_environ(pid)["CUDA_VISIBLE_DEVICES"] == uuid_of(1)
            kc = km.client()
            kc.start_channels()
            try:
                await kc.wait_for_ready(timeout=60)
                out, err = await run(kc, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
                status, _ = await run(kc, "%gpu status")
            finally:
                kc.stop_channels()
            # The first execution also shows the provisioner's note (the kernel loads autogpu).
            assert (out, err) == (
                uuid_of(1) + "\nautogpu: moved at your request: the kernel's state was lost\n", "")
            assert leases(registry_dir) == [(pid, (uuid_of(1),), km.kernel_id)]
            assert "pending" not in status and "▶ GPU 1" in status
        finally:
            await km.shutdown_kernel(now=True)
        assert leases(registry_dir) == []

    asyncio.run(main())
