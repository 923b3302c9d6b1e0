"""The demo as the README tells a new user to run it: ``make lab``, the notebooks, the CLI.

- ``make lab`` (run for real, headless) on this host without an NVIDIA driver: the simulated
  fleet, the "Python 3 (autogpu)" kernel installed into the environment, the printed URL opening
  the quickstart, and a lease taken in a notebook's kernel listed by a plain ``autogpu leases``
  in another shell (one registry for the demo and the CLI).
- ``notebooks/panel.ipynb`` under ``demo-4x`` (what ``make lab`` starts) shows the overload
  warning its text promises.
- A relative ``AUTOGPU_SIMULATE`` fleet path is resolved once by the server: its kernels, which
  run in their notebooks' folders, get the absolute path.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from jupyter_client import BlockingKernelClient
from nbclient import NotebookClient

from autogpu_jupyter.core import sampler as sampler_mod
from tests.browserhelpers import free_port
from tests.kernelhelpers import REPO, kernel_env
from tests.leasehelpers import forget_backends

pytest_plugins = ["pytest_jupyter.jupyter_server"]

VENV_BIN = Path(sys.executable).parent
GPU1 = "GPU-50000001-d3mo-4x01-a100-000000000001"


def _outputs_text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def _no_driver() -> bool:
    probe = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False)
    return "libnvidia-ml.so.1" not in probe.stdout


# --- make lab --------------------------------------------------------------------------------


@pytest.fixture
def make_lab(tmp_path: Path) -> Iterator[tuple[str, str, Path, Path]]:
    """``make lab LAB_ARGS="--no-browser --port P ..."`` from the checkout, as a user starts it
    on a headless server, in an environment with no autogpu variables. Yields (url, token,
    runtime dir, log file)."""
    if not _no_driver():
        pytest.skip("this host has an NVIDIA driver: make lab does not simulate here")
    port = free_port()
    token = secrets.token_hex(16)
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("AUTOGPU_", "CUDA_", "PYTEST_")) and k not in ("MAKEFLAGS", "MFLAGS")
    }
    env.update(
        JUPYTER_RUNTIME_DIR=str(runtime),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        AUTOGPU_SKIP_BROWSER="1",
        AUTOGPU_SKIP_IPK6="1",
        VENV=str(VENV_BIN.parent),
    )
    args = (
        f"--no-browser --port {port} --ServerApp.ip=127.0.0.1 "
        f"--IdentityProvider.token={token} --LabApp.news_url=None "
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"
    )
    log = tmp_path / "make-lab.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["make", "-s", "lab", f"VENV={VENV_BIN.parent}", f"LAB_ARGS={args}"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2):
                        break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        pytest.fail("make lab did not start:\n" + log.read_text()[-3000:])
                    time.sleep(0.3)
            yield url, token, runtime, log
        finally:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def _api(url: str, token: str, path: str, body: dict[str, Any] | None = None) -> Any:
    req = urllib.request.Request(
        f"{url}/api/{path}",
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Authorization": f"token {token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _execute(kc: BlockingKernelClient, code: str) -> str:
    """Run ``code``; what it printed (stdout and stderr)."""
    msg_id = kc.execute(code)
    text = []
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            text.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text)


def test_make_lab_then_the_readme_cli_sees_the_notebooks_lease(
    make_lab: tuple[str, str, Path, Path],
) -> None:
    url, token, runtime, log = make_lab
    printed = log.read_text()
    # No driver: said, and the simulated fleet used.
    assert "No NVIDIA driver found: starting on the SIMULATED fleet demo-4x" in printed
    # The URL a headless user copies opens the quickstart, not an empty Launcher.
    deadline = time.monotonic() + 30
    while f"{url}/lab/tree/demo/quickstart.ipynb?token=" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.3)
    # Nothing covers the quickstart's first outputs: JupyterLab's "get notified about official
    # Jupyter news?" toast (asked whatever news_url says) is answered "never" for this
    # environment, in the settings the front end reads (Notebook 7 reads the same directory).
    req = urllib.request.Request(
        f"{url}/lab/api/settings/@jupyterlab/apputils-extension:notification",
        headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        notification = json.loads(resp.read())
    # (overrides become the schema's defaults; this user has set nothing)
    news = notification["schema"]["properties"]["fetchNews"]["default"]
    assert (news, notification["settings"]) == ("false", {})
    # The autogpu kernel is in the Launcher: installed into the environment by make lab.
    specs = _api(url, token, "kernelspecs")["kernelspecs"]
    assert specs["python3-autogpu"]["spec"]["display_name"] == "Python 3 (autogpu)"
    installed = VENV_BIN.parent / "share" / "jupyter" / "kernels" / "python3-autogpu"
    assert (installed / "kernel.json").is_file()  # in the environment, not in $HOME

    # The demo runs copies (untracked): running them leaves the clone's notebooks as they were.
    assert "The demo runs your copies in demo/" in log.read_text()
    for name in ("quickstart.ipynb", "panel.ipynb"):
        assert (REPO / "demo" / name).is_file()
    ignored = subprocess.run(["git", "check-ignore", "-q", "demo/quickstart.ipynb"], cwd=REPO,
                             check=False)
    assert ignored.returncode == 0, "demo/ must be ignored by git"

    # The quickstart's kernel, as a user opens it.
    session = _api(url, token, "sessions", {
        "path": "demo/quickstart.ipynb", "type": "notebook", "name": "quickstart.ipynb",
        "kernel": {"name": "python3"},
    })
    kid = session["kernel"]["id"]
    kc = BlockingKernelClient(connection_file=str(runtime / f"kernel-{kid}.json"))
    kc.load_connection_file()
    # No heartbeat channel: wait_for_ready then waits for the kernel_info reply itself, instead
    # of calling a kernel "dead" whose first heartbeat is late on a loaded machine.
    kc.start_channels(hb=False)
    try:
        kc.wait_for_ready(timeout=60)
        out = _execute(kc, "%load_ext autogpu\n%gpu pick --min-free 10G\nimport os, shutil\n"
                           "print('which', shutil.which('autogpu'))\nprint('pid', os.getpid())")
        # what the server's children (kernels, JupyterLab's terminals) run as `autogpu`
        assert f"which {VENV_BIN / 'autogpu'}\n" in out, out
        assert "autogpu [SIMULATED]: picked GPU " in out, out
        lease_id = re.search(r"lease (\S+) held until", out)
        assert lease_id is not None, out
        pid = int(out.split("pid ")[-1].split()[0])

        # The README's way, in another shell: plain `autogpu leases`, no variables set.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AUTOGPU_", "CUDA_"))}
        listed = subprocess.run(
            [str(VENV_BIN / "autogpu"), "leases"], capture_output=True, text=True, env=env,
            timeout=60, check=False,
        )
        assert listed.returncode == 0, listed.stderr
        mine = [line for line in listed.stdout.splitlines() if f" pid {pid} " in line]
        assert len(mine) == 1, listed.stdout
        assert "GPU-5" in mine[0] and "booked 10.0 GiB" in mine[0]
        # the notebook as JupyterLab names it, relative to the server's root
        assert mine[0].endswith(" demo/quickstart.ipynb"), mine[0]

        # A JupyterLab terminal (File > New > Terminal) has `autogpu` on its PATH, also where
        # a login shell's profile resets PATH (make lab under nohup, as root on Debian).
        assert f"{VENV_BIN / 'autogpu'}" in _terminal_run(url, token, "command -v autogpu")
    finally:
        kc.stop_channels()
        _api_delete(url, token, f"sessions/{session['id']}")

    # A JupyterLab terminal (File > New > Terminal) finds the same `autogpu`, although make lab
    # runs here without a TTY, where jupyter starts terminals as login shells (their profile
    # resets PATH) unless told otherwise.
    shown = _in_a_terminal(url, token, "echo which $(command -v autogpu)")
    assert f"which {VENV_BIN / 'autogpu'}" in shown.replace("\r", "\n").splitlines(), shown


def _in_a_terminal(url: str, token: str, command: str) -> str:
    """Open a JupyterLab terminal, type ``command``; what the terminal showed until it ended."""
    import asyncio

    from tornado.websocket import websocket_connect

    name = _api(url, token, "terminals", {})["name"]

    async def talk() -> str:
        ws = await websocket_connect(
            f"{url.replace('http', 'ws', 1)}/terminals/websocket/{name}?token={token}"
        )
        ws.write_message(json.dumps(["stdin", f"{command}; echo END-OF-TEST\r"]))
        shown = ""
        while "\nEND-OF-TEST" not in shown:
            message = await asyncio.wait_for(ws.read_message(), timeout=60)
            assert message is not None, shown
            kind, *content = json.loads(message)
            if kind == "stdout":
                shown += content[0]
        ws.close()
        return shown

    try:
        return asyncio.run(talk())
    finally:
        _api_delete(url, token, f"terminals/{name}")


def _terminal_run(url: str, token: str, command: str) -> str:
    """Run ``command`` in a new JupyterLab terminal of the server (its websocket, as the
    browser talks to it); what it printed, once the command's end marker came back."""
    from tornado.httpclient import HTTPRequest
    from tornado.ioloop import IOLoop
    from tornado.websocket import websocket_connect

    name = _api(url, token, "terminals", {})["name"]
    marker = "__autogpu_done__"

    async def talk() -> str:
        ws = await websocket_connect(HTTPRequest(
            f"{url.replace('http', 'ws', 1)}/terminals/websocket/{name}",
            headers={"Authorization": f"token {token}"},
        ))
        ws.write_message(json.dumps(["stdin", f"{command}; echo {marker[:9]}''{marker[9:]}\r"]))
        out = ""
        deadline = time.monotonic() + 60
        while marker not in out and time.monotonic() < deadline:
            msg = await ws.read_message()
            if msg is None:
                break
            kind, *rest = json.loads(msg)
            if kind == "stdout":
                out += rest[0]
        ws.close()
        return out

    try:
        return IOLoop.current().run_sync(talk, timeout=90)
    finally:
        _api_delete(url, token, f"terminals/{name}")


def _api_delete(url: str, token: str, path: str) -> None:
    req = urllib.request.Request(
        f"{url}/api/{path}", method="DELETE", headers={"Authorization": f"token {token}"}
    )
    with urllib.request.urlopen(req, timeout=30):
        pass


# --- the panel notebook ----------------------------------------------------------------------


def test_panel_notebook_shows_the_overload_on_the_make_lab_fleet(tmp_path: Path) -> None:
    """panel.ipynb under demo-4x (what make lab runs): the text cell prints the warning that the
    notebook's text promises, naming the cause and a better GPU."""
    nb = nbformat.read(REPO / "notebooks" / "panel.ipynb", as_version=4)
    assert "GPU 1 is nearly full and\nbusy because of other users' jobs" in nb.cells[0].source
    env = kernel_env(
        {"AUTOGPU_SIMULATE": "demo-4x", "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry")}
    )
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3",
        resources={"metadata": {"path": str(REPO / "notebooks")}},
    )
    client.execute(env=env)
    warning = _outputs_text(nb.cells[-1])
    assert warning.startswith("autogpu: GPU 1 (this kernel's GPU) is overloaded: "), warning
    assert "memory 9" in warning and "% full (over 95%)" in warning
    assert "caused by 1 other process holding " in warning and "(user bob)" in warning
    assert re.search(r"Best alternative: move to GPU [023] \(", warning), warning
    assert "no overload" not in warning


# --- a relative fleet path -------------------------------------------------------------------


@pytest.fixture
def relative_fleet(monkeypatch: pytest.MonkeyPatch, registry_dir: Path) -> Iterator[None]:
    """The server started from the checkout with AUTOGPU_SIMULATE=notebooks/panel-fleet.json."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("AUTOGPU_SIMULATE", "notebooks/panel-fleet.json")
    forget_backends()
    sampler_mod.stop_sampler()
    yield
    sampler_mod.stop_sampler()
    forget_backends()


@pytest.fixture
def jp_server_config(relative_fleet: None) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": {"interval_s": 0.2},
    }


@pytest.fixture
def jp_root_dir(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "notebooks").mkdir(parents=True)
    return root


def _proc_environ(pid: int) -> dict[str, str]:
    deadline = time.monotonic() + 20
    while True:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"ipykernel" in cmdline or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


async def test_a_relative_fleet_path_reaches_kernels_absolute(jp_fetch: Any, jp_serverapp: Any
                                                              ) -> None:
    absolute = str(REPO / "notebooks" / "panel-fleet.json")
    assert os.environ["AUTOGPU_SIMULATE"] == absolute
    devices = json.loads((await jp_fetch("autogpu", "devices")).body)
    assert devices["simulated"] is True and len(devices["devices"]) == 4
    assert devices["errors"] == []
    response = await jp_fetch("api", "sessions", method="POST", body=json.dumps({
        "path": "notebooks/panel.ipynb", "type": "notebook", "name": "panel.ipynb",
        "kernel": {"name": "python3"},
    }))
    kid = json.loads(response.body)["kernel"]["id"]
    km = jp_serverapp.kernel_manager.get_kernel(kid)
    pid = km.provisioner.pid
    env = _proc_environ(pid)
    assert env["AUTOGPU_SIMULATE"] == absolute
    assert os.readlink(f"/proc/{pid}/cwd").endswith("/notebooks")  # not where the path is from
    await jp_serverapp.kernel_manager.shutdown_kernel(kid)


def test_a_fleet_error_is_the_panels_headline(tmp_path: Path) -> None:
    """A fleet path the kernel cannot read: the panel's banner says why, prominently (an alert
    box), instead of "No GPU picked yet" with the cause in small grey text."""
    from tests.kernelhelpers import Kernel

    kernel = Kernel(
        kernel_env({"AUTOGPU_SIMULATE": "panel-fleet.json",
                    "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry")}),
        cwd=tmp_path,
    )
    try:
        run = kernel.run(
            "from autogpu_jupyter import Panel\n"
            "p = Panel(window_s=60)\n"
            "print(p.banner.layout.display)\nprint(p.banner.value)"
        )
    finally:
        kernel.close()
    assert run.status == "ok", run
    display, banner = run.stdout.split("\n", 1)
    assert display == "block"
    assert 'class="autogpu-error" role="alert"' in banner
    assert (
        "autogpu cannot read the GPUs</b>: AUTOGPU_SIMULATE=&#x27;panel-fleet.json&#x27;: not a "
        f"fleet file (looked in {tmp_path}) and not a built-in fleet" in banner
    )
