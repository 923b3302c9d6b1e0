"""The server extension over a real Jupyter server (pytest-jupyter's ``jp_fetch``).

The server process is this test process, so the one sampler (``core.sampler``) is shared with
the test: each test gets a fresh one over its own fleet, and stops it at the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient
import tornado.web

from autogpu_jupyter.core import sampler as sampler_mod

pytest_plugins = ["pytest_jupyter.jupyter_server"]

GiB = 1024**3
#: A pid no process can have (above the kernel's pid_max): "gone from /proc" on any host, also
#: where a real process happens to run as pid 4242.
GONE_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 4242
UUID0 = "GPU-0a0a0a0a-1111-2222-3333-444444444444"
UUID1 = "GPU-1b1b1b1b-1111-2222-3333-444444444444"
UUID2 = "GPU-2c2c2c2c-1111-2222-3333-444444444444"

#: Three devices: a busy A100 (another user's process), an idle L4, a lost card.
FLEET: dict[str, Any] = {
    "driver_version": "550.54.15",
    "devices": [
        {
            "name": "NVIDIA A100-SXM4-80GB",
            "uuid": UUID0,
            "pci_bus_id": "00000000:07:00.0",
            "memory_total": "80G",
            "memory_used": "20G",
            "utilization_pct": 35,
            "temperature_c": 51,
            "power_w": 210.5,
            "power_limit_w": 400.0,
            "processes": [
                {"pid": GONE_PID, "user": "alice", "command": "python train.py --token=s3cret",
                 "used_memory": "20G"}
            ],
        },
        {
            "name": "NVIDIA L4",
            "uuid": UUID1,
            "pci_bus_id": "00000000:17:00.0",
            "memory_total": "24G",
            "memory_used": "1G",
            "utilization_pct": 5,
            "temperature_c": 38,
            "power_w": 20.0,
            "power_limit_w": 72.0,
            "processes": [],
        },
        {"name": "NVIDIA L4", "uuid": UUID2, "pci_bus_id": "00000000:27:00.0", "lost": True},
    ],
}


class SimulatedFleet:
    """The simulated backend's fleet file (``AUTOGPU_SIMULATE``), written like ``FakeNvml``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, fleet: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(fleet))
        os.replace(tmp, self.path)


@pytest.fixture
def fleet(fake_nvml: Any, registry_dir: Path) -> Any:
    """The fake NVIDIA driver (real pynvml over the fake ``libnvidia-ml.so.1``) showing FLEET,
    with this test process as a compute process on GPU 0 next to a vanished PID."""
    fake_nvml.write(nvml_fleet())
    sampler_mod.stop_sampler()
    yield fake_nvml
    sampler_mod.stop_sampler()


def nvml_fleet() -> dict[str, Any]:
    f = json.loads(json.dumps(FLEET))
    f["devices"][0]["processes"] = [
        {"pid": os.getpid(), "used_memory": "12G"},
        {"pid": GONE_PID, "used_memory": "8G"},  # gone from /proc: user and command unknown
    ]
    return f


@pytest.fixture
def jp_server_config(fleet: Any) -> dict[str, Any]:
    return {
        "ServerApp": {"jpserver_extensions": {"autogpu_jupyter": True}},
        "AutoGPUServer": {"interval_s": 0.1},
    }


async def get_json(jp_fetch: Any, *parts: str, **kwargs: Any) -> Any:
    response = await jp_fetch("autogpu", *parts, **kwargs)
    assert response.code == 200
    assert response.headers["Content-Type"] == "application/json"
    return json.loads(response.body)


def my_command() -> str:
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as fh:
        return fh.read().rstrip(b"\0").replace(b"\0", b" ").decode()


def expected_devices(ts: list[float]) -> list[dict[str, Any]]:
    """FLEET as the NVML backend reads it through the fake driver."""
    import getpass

    common = {"memory_utilization_pct": 0.0, "compute_mode": "DEFAULT", "mig_enabled": False,
              "is_mig": False, "parent_uuid": None, "mig_index": None, "available": True,
              "error": None, "vendor": "nvidia", "runtime_uuid": None}
    return [
        {
            **common, "index": 0, "uuid": UUID0, "name": "NVIDIA A100-SXM4-80GB",
            "pci_bus_id": "00000000:07:00.0", "memory_total_bytes": 80 * GiB,
            "memory_used_bytes": 20 * GiB, "memory_free_bytes": 60 * GiB,
            "utilization_pct": 35.0, "temperature_c": 51.0, "power_w": 210.5,
            "power_limit_w": 400.0, "timestamp_s": ts[0], "label": "GPU 0",
            "processes": [
                # our own process: its command line is shown to us
                {"pid": os.getpid(), "used_memory_bytes": 12 * GiB, "user": getpass.getuser(),
                 "command": my_command()},
                {"pid": GONE_PID, "used_memory_bytes": 8 * GiB, "user": None, "command": None},
            ],
        },
        {
            **common, "index": 1, "uuid": UUID1, "name": "NVIDIA L4",
            "pci_bus_id": "00000000:17:00.0", "memory_total_bytes": 24 * GiB,
            "memory_used_bytes": 1 * GiB, "memory_free_bytes": 23 * GiB, "utilization_pct": 5.0,
            "temperature_c": 38.0, "power_w": 20.0, "power_limit_w": 72.0, "processes": [],
            "timestamp_s": ts[1], "label": "GPU 1",
        },
        {
            "index": 2, "uuid": "unknown-2", "name": "unknown", "pci_bus_id": None,
            "memory_total_bytes": None, "memory_used_bytes": None, "memory_free_bytes": None,
            "utilization_pct": None, "memory_utilization_pct": None, "temperature_c": None,
            "power_w": None, "power_limit_w": None, "compute_mode": None, "mig_enabled": None,
            "is_mig": False, "parent_uuid": None, "mig_index": None, "processes": None,
            "available": False, "error": "GPU is lost", "vendor": "nvidia", "runtime_uuid": None,
            "timestamp_s": ts[2], "label": "GPU 2",
        },
    ]


async def test_devices_exact_json(jp_fetch: Any) -> None:
    data = await get_json(jp_fetch, "devices")
    ts = [d["timestamp_s"] for d in data["devices"]]
    assert all(isinstance(t, float) and abs(t - data["timestamp_s"]) < 5 for t in ts)
    assert data == {
        "timestamp_s": data["timestamp_s"],
        "backend": "nvml",
        "simulated": False,
        "driver_version": "550.54.15",
        "errors": [],
        "interval_s": 0.1,
        "devices": expected_devices(ts),
    }


async def test_devices_follow_load_change(jp_fetch: Any, fleet: Any) -> None:
    first = await get_json(jp_fetch, "devices")
    assert first["devices"][1]["utilization_pct"] == 5.0
    changed = nvml_fleet()
    changed["devices"][1]["utilization_pct"] = 97
    changed["devices"][1]["memory_used"] = "22G"
    fleet.write(changed)
    sampler = sampler_mod.current_sampler()
    assert sampler is not None
    sampler.sample_now()
    data = await get_json(jp_fetch, "devices")
    assert data["devices"][1]["utilization_pct"] == 97.0
    assert data["devices"][1]["memory_free_bytes"] == 2 * GiB


async def test_history_since_and_bounds(jp_fetch: Any) -> None:
    sampler = sampler_mod.current_sampler()
    assert sampler is not None
    sampler.pause()  # the test takes the samples itself
    for _ in range(3):
        sampler.sample_now()
    data = await get_json(jp_fetch, "history")
    assert [s["uuid"] for s in data["series"]] == [UUID0, UUID1, "unknown-2"]
    s0 = data["series"][0]
    n = len(s0["timestamp_s"])
    assert n >= 3
    assert s0["utilization_pct"] == [35.0] * n
    assert s0["memory_used_bytes"] == [20 * GiB] * n
    assert s0["memory_total_bytes"] == 80 * GiB
    lost = data["series"][2]
    assert lost["utilization_pct"] == [None] * n
    assert lost["memory_total_bytes"] is None
    assert data["until_s"] == s0["timestamp_s"][-1]
    # since = the last timestamp: nothing new until the next sample, which then comes alone
    newer = await get_json(jp_fetch, "history", params={"since": str(data["until_s"])})
    assert newer["series"] == []
    assert newer["until_s"] == data["until_s"]
    sampler.sample_now()
    newer = await get_json(jp_fetch, "history", params={"since": str(data["until_s"])})
    assert [len(s["timestamp_s"]) for s in newer["series"]] == [1, 1, 1]
    assert newer["series"][1]["utilization_pct"] == [5.0]


async def test_history_is_bounded(jp_fetch: Any, jp_serverapp: Any) -> None:
    sampler = sampler_mod.current_sampler()
    assert sampler is not None
    sampler.pause()
    for _ in range(12):
        sampler.sample_now()
    state = _state(jp_serverapp)
    state.max_history_points = 5
    data = await get_json(jp_fetch, "history")
    assert [len(s["timestamp_s"]) for s in data["series"]] == [5, 5, 5]


async def test_history_rejects_bad_since(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "history", params={"since": "yesterday"})
    assert err.value.code == 400
    body = json.loads(err.value.response.body)
    assert body["message"] == (
        "invalid since='yesterday': expected a Unix timestamp in seconds, e.g. 1718000000.5"
    )


async def test_select_get_and_post_match_the_policy(jp_fetch: Any) -> None:
    # Least loaded: the idle L4 beats the A100 that another user's job keeps 35 % busy.
    data = await get_json(jp_fetch, "select", params={"min_free": "10G"})
    assert data["chosen"] == [{"uuid": UUID1, "label": "GPU 1", "name": "NVIDIA L4"}]
    assert data["constraints_text"] == "min free 10.0 GiB"
    assert data["message"] is None
    assert data["simulated"] is False
    eligible = {c["label"]: c["eligible"] for c in data["candidates"]}
    assert eligible == {"GPU 0": True, "GPU 1": True, "GPU 2": False}
    posted = await get_json(jp_fetch, "select", method="POST",
                            body=json.dumps({"min_free": "30G"}))
    assert posted["chosen"] == [{"uuid": UUID0, "label": "GPU 0", "name": "NVIDIA A100-SXM4-80GB"}]
    assert posted["constraints_text"] == "min free 30.0 GiB"
    # 30 GiB do not fit the 24 GiB L4; and the A100 is next when the L4 is excluded
    data = await get_json(jp_fetch, "select", params={"exclude": "1"})
    assert data["chosen"] == [{"uuid": UUID0, "label": "GPU 0", "name": "NVIDIA A100-SXM4-80GB"}]


async def test_select_nothing_fits_is_an_answer(jp_fetch: Any) -> None:
    data = await get_json(jp_fetch, "select", params={"min_free": "70G"})
    assert data["chosen"] == []
    assert data["message"] == "no device fits (min free 70.0 GiB):"


async def test_select_bad_input_is_400_with_message(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "select", params={"min_free": "10"})
    assert err.value.code == 400
    message = json.loads(err.value.response.body)["message"]
    assert "'10'" in message
    assert "10G" in message
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "select", params={"gpus": "2"})
    assert err.value.code == 400
    assert json.loads(err.value.response.body)["message"] == (
        "unknown parameter 'gpus'; accepted: count, devices, exclude, exclusive, kernel_id, "
        "max_util, min_free, model, prefer"
    )
    # devices named (issue 41): the same dry run among them; a name no device has is a 400
    data = await get_json(jp_fetch, "select", params={"devices": "1"})
    assert ([c["label"] for c in data["chosen"]], data["constraints_text"]) == (
        ["GPU 1"], "device 1")
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "select", params={"devices": "9"})
    assert err.value.code == 400
    assert json.loads(err.value.response.body)["message"].startswith(
        "no device '9' on this host; name devices by index (0, 1")


async def test_holders_joins_processes(jp_fetch: Any) -> None:
    import getpass

    data = await get_json(jp_fetch, "holders")
    assert data["simulated"] is False
    assert data["errors"] == []
    assert data["user"] == getpass.getuser()
    common = {"kind": "process", "uuid": UUID0, "label": "GPU 0", "kernel_id": None,
              "this_server": False, "notebook_path": None, "booked_bytes": None,
              "exclusive": False, "created_s": None}
    assert data["holders"] == [
        {**common, "user": getpass.getuser(), "pid": os.getpid(), "used_memory_bytes": 12 * GiB,
         "command": my_command(), "where": f"pid {os.getpid()}", "memory_text": "12.0 GiB used"},
        {**common, "user": None, "pid": GONE_PID, "used_memory_bytes": 8 * GiB, "command": None,
         "where": f"pid {GONE_PID}", "memory_text": "8.0 GiB used"},
    ]


# -- authentication ------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["devices", "history", "holders", "select"])
async def test_unauthenticated_get_is_403(jp_fetch: Any, path: str) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", path, headers={"Authorization": ""})
    assert err.value.code == 403


async def test_unauthenticated_post_is_403(jp_fetch: Any) -> None:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "select", method="POST", body="{}",
                       headers={"Authorization": ""})
    assert err.value.code == 403


async def test_cookie_post_without_xsrf_is_403(
    jp_fetch: Any, http_server_client: Any, jp_base_url: str, jp_serverapp: Any
) -> None:
    """A browser session (cookie, no token header) must send the XSRF token to POST."""
    token = jp_serverapp.identity_provider.token
    page = await http_server_client.fetch(jp_base_url + "login", raise_error=False)
    xsrf_cookies = [c.split(";", 1)[0] for c in page.headers.get_list("Set-Cookie")]
    login = await http_server_client.fetch(
        jp_base_url + "login?" + urllib.parse.urlencode({"token": token}),
        follow_redirects=False, raise_error=False,
    )
    cookies = xsrf_cookies + [c.split(";", 1)[0] for c in login.headers.get_list("Set-Cookie")]
    assert any(c.startswith("username-") for c in cookies), cookies
    xsrf = next(c.split("=", 1)[1] for c in cookies if c.startswith("_xsrf="))
    cookie_header = "; ".join(cookies)
    url = jp_base_url + "autogpu/select"
    without = await http_server_client.fetch(
        url, method="POST", body="{}", headers={"Cookie": cookie_header}, raise_error=False
    )
    assert without.code == 403
    assert b"XSRF" in without.body or b"_xsrf" in without.body
    with_xsrf = await http_server_client.fetch(
        url, method="POST", body="{}",
        headers={"Cookie": cookie_header, "X-XSRFToken": xsrf}, raise_error=False,
    )
    assert with_xsrf.code == 200


def test_every_handler_is_authenticated(jp_web_app: tornado.web.Application) -> None:
    """Walk the registered routes: each verb of each autogpu handler is @authenticated."""
    from autogpu_jupyter.server.handlers import HANDLERS

    ours = [r for r in _routes(jp_web_app) if "/autogpu/" in r[0]]
    names = sorted(p.split("/autogpu/", 1)[1] for p, _ in ours)
    paths = ["cluster", "cluster/history", "devices", "history", "holders",
             "kernels/(?P<kernel_id>[^/]+)/move", "select"]
    # the versioned API and, until 0.3, the deprecated paths of 0.1
    assert names == sorted([f"api/v1/{p}" for p in paths] + paths)
    assert {cls for _, cls in ours} == {cls for _, cls in HANDLERS}
    for _path, cls in ours:
        for verb in ("get", "post", "put", "patch", "delete"):
            method = cls.__dict__.get(verb)
            if method is None:
                continue
            assert _is_authenticated(method), f"{cls.__name__}.{verb} lacks @authenticated"


async def test_versioned_paths_answer_and_the_old_ones_say_they_are_deprecated(
    jp_fetch: Any, jp_base_url: str
) -> None:
    """``/autogpu/api/v1/<path>`` is the API; ``/autogpu/<path>`` (0.1) answers the same with a
    ``Deprecation`` header and a ``Link`` to its successor."""
    current = await jp_fetch("autogpu", "api", "v1", "select", params={"min_free": "10G"})
    old = await jp_fetch("autogpu", "select", params={"min_free": "10G"})
    assert current.code == old.code == 200
    assert json.loads(current.body)["chosen"] == json.loads(old.body)["chosen"]
    assert "Deprecation" not in current.headers
    assert old.headers["Deprecation"] == "true"
    assert old.headers["Link"] == f'<{jp_base_url}autogpu/api/v1/select>; rel="successor-version"'
    # also on errors, and for a path with a parameter
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", "kernels", "no-such-kernel", "move", method="POST",
                       body=json.dumps({"target": "best"}))
    assert err.value.code == 404
    assert err.value.response is not None
    assert err.value.response.headers["Link"] == (
        f'<{jp_base_url}autogpu/api/v1/kernels/no-such-kernel/move>; rel="successor-version"'
    )


def test_server_reports_no_auth_warning() -> None:
    """The extension template's check: a server that forbids unauthenticated access warns
    about (and here fails on) any handler verb without an authentication decorator."""
    code = (
        "import sys, warnings\n"
        "from jupyter_server.serverapp import ServerApp\n"
        "from jupyter_server.utils import JupyterServerAuthWarning\n"
        "app = ServerApp(allow_unauthenticated_access=False,"
        " jpserver_extensions={'autogpu_jupyter': True}, reraise_server_extension_failures=True)\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        "    warnings.simplefilter('always')\n"
        "    app.initialize(argv=[], find_extensions=False, new_httpserver=False)\n"
        "bad = [str(r.message) for r in rec if issubclass(r.category, JupyterServerAuthWarning)]\n"
        "print('\\n'.join(bad) or 'OK')\n"
        "sys.exit(1 if bad else 0)\n"
    )
    env = {**os.environ, "AUTOGPU_SIMULATE": "demo-4x"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.stdout.strip().splitlines()[-1:] == ["OK"], proc.stdout + proc.stderr
    assert proc.returncode == 0


def _rules(router: Any) -> list[Any]:
    out = []
    for rule in getattr(router, "rules", []):
        if isinstance(rule.target, type):
            out.append(rule)
        else:
            out.extend(_rules(rule.target))
    return out


def _all_rules(app: tornado.web.Application) -> list[Any]:
    return _rules(app.default_router) + _rules(app.wildcard_router)


def _routes(app: tornado.web.Application) -> list[tuple[str, type]]:
    out = []
    for rule in _all_rules(app):
        regex = getattr(rule.matcher, "regex", None)
        if regex is not None:
            out.append((re.sub(r"\$$", "", regex.pattern), rule.target))
    return out


def _is_authenticated(method: Any) -> bool:
    # tornado.web.authenticated wraps with functools.wraps: the wrapper's code is tornado's.
    wrapped = getattr(method, "__wrapped__", None)
    return wrapped is not None and method.__code__.co_filename.endswith(
        os.path.join("tornado", "web.py")
    )


def _state(serverapp: Any) -> Any:
    for rule in _all_rules(serverapp.web_app):
        if "/autogpu/" in getattr(getattr(rule.matcher, "regex", None), "pattern", ""):
            return rule.target_kwargs["state"]
    raise AssertionError("autogpu handlers not registered")


async def test_holders_join_leases_and_processes_with_kernels(
    jp_fetch: Any, jp_serverapp: Any, fleet: Any
) -> None:
    """A notebook's kernel holds a lease on GPU 1 and runs a process on it: both show as that
    notebook's, with the booked and the used memory."""
    from autogpu_jupyter.core.leasing import DirectoryStore, Requester

    response = await jp_fetch(
        "api", "sessions", method="POST",
        body=json.dumps({"path": "work/train.ipynb", "type": "notebook", "name": "train.ipynb",
                         "kernel": {"name": "python3"}}),
    )
    session = json.loads(response.body)
    kid = session["kernel"]["id"]
    try:
        km = jp_serverapp.kernel_manager.get_kernel(kid)
        kernel_pid = km.provisioner.pid
        assert isinstance(kernel_pid, int)
        changed = nvml_fleet()
        changed["devices"][1]["processes"] = [{"pid": kernel_pid, "used_memory": "3G"}]
        fleet.write(changed)
        sampler = sampler_mod.current_sampler()
        assert sampler is not None
        sampler.pause()
        sampler.sample_now()
        registry = DirectoryStore(os.environ["AUTOGPU_REGISTRY_DIR"])
        with registry.locked() as txn:
            assert txn is not None
            lease = txn.create(devices=[UUID1], requested_bytes=10 * GiB,
                               requester=Requester(pid=kernel_pid, kernel_id=kid, kind="kernel"))
        try:
            data = await get_json(jp_fetch, "holders")
        finally:
            lease.release()
        # one holder, joined as every view joins them (core.holders): the lease and the
        # kernel's process on the same device, matched by pid
        (joined,) = [h for h in data["holders"] if h["uuid"] == UUID1]
        assert joined == {
            "kind": "lease+process", "uuid": UUID1, "label": "GPU 1", "user": registry.user,
            "pid": kernel_pid, "kernel_id": kid, "this_server": True,
            "notebook_path": "work/train.ipynb", "booked_bytes": 10 * GiB,
            "used_memory_bytes": 3 * GiB, "exclusive": False,
            "created_s": lease.record.created_s, "command": joined["command"],
            "where": "work/train.ipynb", "memory_text": "10.0 GiB booked, 3.0 GiB used",
        }
        assert "ipykernel_launcher" in joined["command"]
        # the released lease is gone from the next answer
        data = await get_json(jp_fetch, "holders")
        assert [h["kind"] for h in data["holders"] if h["uuid"] == UUID1] == ["process"]
    finally:
        await jp_fetch("api", "sessions", session["id"], method="DELETE")


class TestPrivacyOnSimulatedFleet:
    """Other users' command lines: the simulated fleet declares processes of other users."""

    @pytest.fixture
    def fleet(self, tmp_path: Path, registry_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
        path = tmp_path / "fleet.json"
        path.write_text(json.dumps(FLEET))
        monkeypatch.setenv("AUTOGPU_SIMULATE", str(path))
        sampler_mod.stop_sampler()
        yield SimulatedFleet(path)
        sampler_mod.stop_sampler()

    async def test_other_users_command_hidden_by_default(self, jp_fetch: Any) -> None:
        data = await get_json(jp_fetch, "devices")
        assert data["simulated"] is True
        assert data["devices"][0]["processes"] == [
            {"pid": GONE_PID, "used_memory_bytes": 20 * GiB, "user": "alice", "command": None}
        ]
        holders = await get_json(jp_fetch, "holders")
        assert [(h["user"], h["command"]) for h in holders["holders"]] == [("alice", None)]

    async def test_expose_commands_shows_them(self, jp_fetch: Any, jp_serverapp: Any) -> None:
        _state(jp_serverapp).expose_commands = True
        data = await get_json(jp_fetch, "devices")
        assert data["devices"][0]["processes"] == [
            {"pid": GONE_PID, "used_memory_bytes": 20 * GiB, "user": "alice",
             "command": "python train.py --token=s3cret"}
        ]
