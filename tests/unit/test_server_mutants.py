"""The server extension's survivors of the full mutation run (issue 22): its loading, the REST
handlers' error texts and answers, the move endpoint's planning and its re-read of the kernel's
provisioner after a restart, and the shared state's executor and defaults. Each test was seen
failing with its mutants planted by hand.

The HTTP checks run through the real Jupyter server of ``test_server_handlers.py`` (its
fixtures); a kernel there is a made-up kernel object put into the server's kernel manager for the
test's length (no process), where jupyter_server only looks it up.
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tornado.web
from traitlets.config import Config, LoggingConfigurable

import autogpu_jupyter.server as server_pkg
from autogpu_jupyter.core import moves
from autogpu_jupyter.core.contract import SERVER_ROOT_ENV
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.errors import NVMLUnavailableError, UsageErrorBase
from autogpu_jupyter.server import _TO_SERVER_LOG, handlers, moving, payloads, state
from autogpu_jupyter.server.state import AutoGPUServer
from tests.unit import test_server_handlers as th

# the Jupyter server of the handler tests: a simulated fleet of two A100s, the extension on
host = th.host
traits = th.traits
jp_server_config = th.jp_server_config
A, B, V1 = th.A, th.B, th.V1

# -- error texts -------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "paragraph"), [
    ("", "ValueError"),  # nothing to say: the error's kind
    (" \n \n", "ValueError"),
    ("no GPU fits", "no GPU fits"),
    ("no GPU fits:", "no GPU fits"),
    ("no better device:\n  GPU 0: dropped\n  GPU 1: dropped",
     "no better device: GPU 0: dropped. GPU 1: dropped"),
    # only the head's trailing colons go, not its other characters
    ("cannot move to MAX:\nGPU 0: busy", "cannot move to MAX: GPU 0: busy"),
])
def test_an_explanation_is_one_paragraph(text: str, paragraph: str) -> None:
    assert handlers._one_paragraph(ValueError(text)) == paragraph


def test_an_http_errors_text_is_kept_as_written() -> None:
    """tornado formats ``log_message % args`` when it logs or prints the error: a "%" in the
    text must not be read as a format, so the text is the argument of a ``"%s"`` (tornado 6.6
    escapes the "%" of a format given no arguments itself; older ones do not)."""
    err = handlers.http_error(503, "GPU 0 is 100% busy")
    assert (err.status_code, err.args, str(err)) == (
        503, ("GPU 0 is 100% busy",), "HTTP 503: Service Unavailable (GPU 0 is 100% busy)")
    assert str(handlers.http_error(400, "50%% of %s")) == "HTTP 400: Bad Request (50%% of %s)"


@pytest.mark.parametrize(("err", "text"), [
    (UsageErrorBase("invalid size '10'"), "HTTP 400: Bad Request (invalid size '10')"),
    (NVMLUnavailableError("driver not loaded"),
     "HTTP 503: Service Unavailable (driver not loaded)"),
])
def test_an_autogpu_error_is_400_for_bad_input_else_503(err: Exception, text: str) -> None:
    """Promptly, without a server: a status that is no number made the request hang until the
    client gave up (tornado cannot finish an error page without its status)."""
    handler = handlers.SelectHandler.__new__(handlers.SelectHandler)
    made = handler._http_error(err)
    assert isinstance(made, tornado.web.HTTPError)
    assert (made.status_code, str(made)) == (int(text[5:8]), text)


async def test_a_percent_sign_in_an_error_reaches_the_client_as_written(jp_fetch: Any) -> None:
    """A "%%" in the text is sent as "%%", not formatted into "%"."""
    code, body = await th.refused(jp_fetch, *V1, "history", params={"since": "5%%"})
    assert (code, body) == (400, {
        "message": "invalid since='5%%': expected a Unix timestamp in seconds, e.g. 1718000000.5",
        "reason": None})


async def test_an_answer_that_is_no_valid_json_is_a_500_not_sent(
    jp_fetch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JSON has no NaN: an answer holding one is refused (jupyter_server's JSON 500), never
    sent as ``NaN`` that the browser's ``JSON.parse`` rejects."""
    monkeypatch.setattr(payloads, "devices_payload", lambda *_a: {"util": math.nan})
    code, body = await th.refused(jp_fetch, *V1, "devices")
    assert (code, body) == (500, {"message": "Unhandled error", "reason": None, "traceback": ""})


# -- move: the body, the plan, the provisioner after the restart --------------------------------


def test_a_move_body_restarts_the_kernel_unless_told_not_to() -> None:
    assert moving.MoveBody("best", False).restart is True
    body = moving.parse_move_body(b'{"target": "best"}')
    assert (body.target, body.dry_run, body.restart) == ("best", False, True)


def test_a_move_body_that_is_no_json_is_answered_with_an_example() -> None:
    with pytest.raises(UsageErrorBase) as err:
        moving.parse_move_body(b"{not json")
    assert str(err.value) == (
        'request body is not JSON; expected an object such as {"target": "best"} or '
        '{"target": "2"}')


def test_devices_are_named_by_label_else_uuid() -> None:
    assert moving._labels((A, B), {A: "GPU 0"}) == f"GPU 0, {B}"
    assert moving._labels((), {A: "GPU 0"}) == "no GPU"


@pytest.mark.parametrize("provisioner", [None, object(), SimpleNamespace(autogpu_move_file="/x")])
def test_a_kernel_without_the_autogpu_provisioner_has_no_move_to_cancel(
    provisioner: Any,
) -> None:
    assert moving.pending(provisioner) is False
    moving.cancel(provisioner)  # nothing to drop, nothing raised


def _provisioner(move_file: Path, picked: tuple[str, ...] = (B,),
                 note: str | None = None) -> SimpleNamespace:
    """What the autogpu provisioner shows the server (``core.contract.ProvisionerState``): a
    kernel asking 10G, now on ``picked``."""
    return SimpleNamespace(autogpu_picked=picked,
                           autogpu_constraints=Constraints.parse(min_free="10G"),
                           autogpu_note=note, autogpu_lease_id=None,
                           autogpu_move_file=str(move_file))


class _Sampler:
    """The server's sampler as a move reads it: the mean utilisation over a window."""

    def __init__(self) -> None:
        self.windows: list[Any] = []

    def smoothed_util(self, window_s: Any) -> dict[str, float | None]:
        self.windows.append(window_s)
        return {A: 0.0, B: 0.0}


@pytest.mark.parametrize("with_sampler", [False, True])
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_move_is_planned_by_the_server_over_the_servers_smoothing_window(
    host: Path, tmp_path: Path, with_sampler: bool, dry_run: bool
) -> None:
    """The plan (and the request recorded for the restart) says the server asked for it; the
    sampler's mean utilisation is taken over ``smoothing_window_s``, and a server whose sampler
    cannot run plans without it."""
    th.fill_gpu1(host)  # the kernel's GPU 1 no longer fits: "best" plans GPU 0
    sampler = _Sampler() if with_sampler else None
    server = SimpleNamespace(registry=lambda: None, sampler=lambda: sampler,
                             smoothing_window_s=12.5)
    prov = _provisioner(tmp_path / "move.json")
    plan = moving.plan_or_request(server, prov, "k-1", moving.MoveBody("best", dry_run))
    assert (plan.message, plan.request.source, plan.request.kernel_id,
            plan.request.target_uuids, plan.request.from_uuids) == (
        th.PLAN_TO_A, "server", "k-1", (A,), (B,))
    recorded = moves.read_move(prov.autogpu_move_file)
    assert (None if recorded is None else recorded.source) == (None if dry_run else "server")
    if sampler is not None:
        assert sampler.windows == [12.5]


@pytest.fixture
def kernel(jp_serverapp: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A kernel ``k-1`` of the server's kernel manager (``{"k-1": kernel object}``, the test
    fills it in), until the test ends: the server's own teardown never sees it."""
    km = jp_serverapp.kernel_manager
    with monkeypatch.context() as patched:
        patched.setitem(km._kernels, "k-1", SimpleNamespace())
        yield km._kernels


async def test_a_kernel_object_without_a_provisioner_cannot_move(
    jp_fetch: Any, kernel: dict[str, Any]
) -> None:
    for method, body in (("POST", json.dumps({"target": "best"})), ("GET", None),
                         ("DELETE", None)):
        code, answer = await th.refused(jp_fetch, *th.move("k-1"), method=method, body=body)
        assert (code, answer) == (400, {"message": th.NOT_AUTOGPU, "reason": None})


MOVED = "moved at your request: the kernel's state was lost"


@pytest.mark.parametrize("after", ["a new provisioner", "no provisioner attribute"])
async def test_a_move_answers_where_the_restarted_kernel_runs(
    jp_fetch: Any, jp_serverapp: Any, kernel: dict[str, Any], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, after: str, host: Path,
) -> None:
    """After the restart the answer reads the kernel's provisioner again (a kernel manager may
    make a new one per start); a kernel object without one leaves the provisioner the move
    started with (jupyter_client's, updated in place)."""
    th.fill_gpu1(host)  # the kernel's GPU 1 no longer fits: "best" plans GPU 0
    old = _provisioner(tmp_path / "move.json")
    kernel["k-1"] = SimpleNamespace(provisioner=old)

    async def restart_kernel(kernel_id: str, **_kwargs: Any) -> None:
        if after == "a new provisioner":
            kernel[kernel_id] = SimpleNamespace(
                provisioner=_provisioner(tmp_path / "move.json", (A,), MOVED))
        else:
            old.autogpu_picked, old.autogpu_note = (A,), MOVED
            kernel[kernel_id] = SimpleNamespace()

    monkeypatch.setattr(jp_serverapp.kernel_manager, "restart_kernel", restart_kernel)
    data = await th.get_json(jp_fetch, *th.move("k-1"), method="POST",
                             body=json.dumps({"target": "best"}))
    assert data == {"dry_run": False, "plan": th.PLAN_TO_A, "target": [A],
                    "target_labels": ["GPU 0"],
                    "message": "The kernel restarted on GPU 0; its state (variables) was lost.",
                    "picked": [A], "note": MOVED}


# -- the shared state ------------------------------------------------------------------------


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


# -- loading the extension into a server application --------------------------------------------


class _App(LoggingConfigurable):
    """What the extension reads of jupyter_server's ``ServerApp``: its log, its web application's
    settings and handlers, its kernel manager. No ``root_dir``: a server application without
    one (not jupyter_server's) exports none to the kernels."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.added: list[tuple[Any, ...]] = []
        self.web_app = SimpleNamespace(
            settings={"base_url": "/base/"},
            add_handlers=lambda _host, rules: self.added.extend(rules))
        self.kernel_manager = SimpleNamespace(cull_idle_timeout=0)


@pytest.fixture
def package_logging() -> Iterator[None]:
    """The package logger's level and the server log it hands records to, restored after."""
    package = logging.getLogger("autogpu_jupyter")
    level, target = package.level, _TO_SERVER_LOG.target
    yield
    package.setLevel(level)
    _TO_SERVER_LOG.target = target


def test_loading_into_a_minimal_app_leaves_the_environment_and_culling_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    package_logging: None,
) -> None:
    """No fleet file is named: none is made up from the files of the directory the server starts
    in (whatever their names); no ``root_dir``: none is exported; culling off: its module is not
    even imported."""
    from autogpu_jupyter.core import sampler as sampler_mod

    for name in ("fleet.json", "XXXX", "XX"):
        (tmp_path / name).write_text("{}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AUTOGPU_SIMULATE", raising=False)
    monkeypatch.delenv(SERVER_ROOT_ENV, raising=False)
    monkeypatch.delitem(sys.modules, "autogpu_jupyter.server.culling", raising=False)
    monkeypatch.delattr(server_pkg, "culling", raising=False)
    sampler_mod.stop_sampler()
    # no sampler (an unbounded history), no metrics: nothing runs beyond the loading
    app = _App(log=logging.getLogger("autogpu-test-app"), config=Config(
        {"AutoGPUServer": {"history_s": math.inf, "metrics": False}}))
    with caplog.at_level(logging.INFO, logger="autogpu-test-app"):
        server_pkg._load_jupyter_server_extension(app)
    servers = {id(rule[2]["state"]): rule[2]["state"] for rule in app.added}
    for server in servers.values():
        server.stop()
    sampler_mod.stop_sampler()
    assert len(servers) == 1
    assert [rule[0] for rule in app.added][:2] == [
        "/base/autogpu/api/v1/devices", "/base/autogpu/api/v1/history"]
    assert "AUTOGPU_SIMULATE" not in os.environ
    assert SERVER_ROOT_ENV not in os.environ
    assert "autogpu_jupyter.server.culling" not in sys.modules
    assert [r.getMessage() for r in caplog.records if r.name == "autogpu-test-app"
            and r.levelno == logging.INFO] == [
        "autogpu server extension loaded: /base/autogpu/api/v1/ (sampling every 1.0 s)"]
