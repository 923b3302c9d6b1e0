"""REST handlers under ``{base_url}/autogpu/api/v1/``: devices, history, holders, select, move.

The paths are versioned (``API_PREFIX``): a change that breaks a client gets a ``v2`` beside
``v1``. The unversioned paths of 0.1 (``{base_url}/autogpu/devices`` ...) still answer the same,
with a ``Deprecation: true`` header and a ``Link`` to their successor, until 0.3 (CHANGELOG.md).

Every verb is ``@tornado.web.authenticated`` (``tests/server/test_rest.py`` walks the registered
handlers to check); POST goes through Jupyter's XSRF check. Blocking work runs on the state's
executor; the handlers only await it and write JSON. ``AutoGPUError`` becomes an HTTP error with
a JSON ``message`` (400 for bad input, 503 when no GPU backend is usable).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from autogpu_jupyter.core import check_history_s
from autogpu_jupyter.errors import AutoGPUError, NoDeviceFitsError, UsageErrorBase
from autogpu_jupyter.server import moving, payloads
from autogpu_jupyter.server.schema import (
    CancelAnswer,
    ClusterAnswer,
    ClusterHistoryAnswer,
    DevicesAnswer,
    ErrorAnswer,
    HistoryAnswer,
    HoldersAnswer,
    MoveAnswer,
    SelectAnswer,
)
from autogpu_jupyter.server.state import AutoGPUServer

__all__ = ["API_PREFIX", "HANDLERS", "NAMESPACE", "setup_handlers"]

NAMESPACE = "autogpu"
#: Where the current API lives under the namespace: ``{base_url}/autogpu/api/v1/<path>``.
API_PREFIX = "api/v1"
_AUTH_PARAMS = frozenset({"token", "_xsrf"})
#: What a handler answers with 200 (server/schema.py).
Answer = (
    DevicesAnswer | HistoryAnswer | HoldersAnswer | SelectAnswer | ClusterAnswer
    | ClusterHistoryAnswer | MoveAnswer | CancelAnswer
)


class _BaseHandler(APIHandler):
    state: AutoGPUServer
    #: On a deprecated unversioned path: (its prefix, the versioned prefix that replaces it).
    moved: tuple[str, str] | None

    def initialize(self, state: AutoGPUServer, moved: tuple[str, str] | None = None) -> None:
        self.state = state
        self.moved = moved

    def _successor(self) -> str | None:
        moved = getattr(self, "moved", None)  # clear() runs before initialize() too
        if moved is None:
            return None
        old, current = moved
        return str(current + self.request.path[len(old):])

    def _mark_deprecated(self) -> None:
        successor = self._successor()
        if successor is not None:
            # RFC 9745's header and RFC 8288's link: clients and proxies can see the move.
            self.set_header("Deprecation", "true")
            self.set_header("Link", f'<{successor}>; rel="successor-version"')

    def clear(self) -> None:
        # tornado clears the headers before an error page: an error says it too
        super().clear()
        self._mark_deprecated()

    def prepare(self, **kwargs: Any) -> Any:
        successor = self._successor()
        if successor is not None:
            self._mark_deprecated()
            self.log.debug(
                "autogpu: %s is deprecated (until 0.3); use %s", self.request.path, successor
            )
        # jupyter_server's prepare is a coroutine (tornado awaits what this returns)
        return super().prepare(**kwargs)

    def _finish_json(self, payload: Answer) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(payload, allow_nan=False))

    def _http_error(self, err: AutoGPUError) -> tornado.web.HTTPError:
        code = 400 if isinstance(err, UsageErrorBase) else 503
        return http_error(code, str(err))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """JSON ``{"message", "reason"}`` with the message as written: jupyter_server's own
        ``write_error`` sends the unformatted ``log_message`` (``"%s"`` for :func:`http_error`)."""
        exc = (kwargs.get("exc_info") or (None, None, None))[1]
        if isinstance(exc, tornado.web.HTTPError) and exc.log_message:
            try:
                message = exc.log_message % exc.args
            except (TypeError, ValueError):
                message = exc.log_message
            self.set_header("Content-Type", "application/json")
            answer: ErrorAnswer = {"message": message, "reason": exc.reason}
            self.finish(json.dumps(answer))
            return
        super().write_error(status_code, **kwargs)


def http_error(code: int, message: str) -> tornado.web.HTTPError:
    """An HTTP error whose message may hold any text (a ``%`` in "25%" included): tornado
    %-formats ``log_message`` with ``args`` when it logs, so the text travels as an argument."""
    return tornado.web.HTTPError(code, "%s", message)


def _one_paragraph(err: BaseException) -> str:
    """A multi-line explanation (first line, then one line per dropped device) as one line."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    head = lines[0].rstrip(":")
    return head + (": " + ". ".join(lines[1:]) if len(lines) > 1 else "")


class DevicesHandler(_BaseHandler):
    """``GET devices``: the latest snapshot of the shared sampler."""

    @tornado.web.authenticated
    async def get(self) -> None:
        payload = await self.state.answer(payloads.devices_payload)
        self._finish_json(payload)


class HistoryHandler(_BaseHandler):
    """``GET history?since=<timestamp_s>``: per-device series, at most ``max_history_points``."""

    @tornado.web.authenticated
    async def get(self) -> None:
        raw = self.get_argument("since", "")
        since: float | None = None
        if raw:
            try:
                since = float(raw)
            except ValueError:
                since = math.nan
            if not math.isfinite(since):
                raise http_error(
                    400,
                    f"invalid since={payloads.short_repr(raw)}: expected a Unix timestamp in "
                    "seconds, e.g. 1718000000.5",
                )
        payload = await self.state.answer(payloads.history_payload, since)
        self._finish_json(payload)


class HoldersHandler(_BaseHandler):
    """``GET holders``: leases and GPU processes, joined with this server's kernels."""

    @tornado.web.authenticated
    async def get(self) -> None:
        sessions = await payloads.kernel_sessions(self.session_manager)
        payload = await self.state.answer(payloads.holders_payload, self.kernel_manager, sessions)
        self._finish_json(payload)


class SelectHandler(_BaseHandler):
    """``GET|POST select``: a dry-run pick (no lease), the same policy as ``%gpu pick``."""

    async def _select(self, params: Mapping[str, object]) -> None:
        try:
            constraints = payloads.parse_constraints(params)
            kernel_id = payloads.parse_kernel_id(params.get("kernel_id"))
            # the notebook's kernel bounds the answer by its own allocation
            environ = await self.state.run(
                payloads.kernel_environ, self.kernel_manager, kernel_id
            )
            payload = await self.state.answer(
                payloads.select_payload, constraints, kernel_id, environ
            )
        except AutoGPUError as err:
            raise self._http_error(err) from err
        self._finish_json(payload)

    @tornado.web.authenticated
    async def get(self) -> None:
        # JupyterLab's ServerConnection appends a cache buster (``&1718000000123``) to GETs;
        # ``token`` and ``_xsrf`` are Jupyter's own authentication parameters, not options.
        params = {
            k: self.get_argument(k)
            for k in self.request.arguments
            if not (k.isascii() and k.isdigit()) and k not in _AUTH_PARAMS
        }
        await self._select(params)

    @tornado.web.authenticated
    async def post(self) -> None:
        try:
            params = payloads.parse_json_object(self.request.body, '{"min_free": "10G"}')
        except UsageErrorBase as err:
            raise self._http_error(err) from err
        await self._select(params)


class ClusterHandler(_BaseHandler):
    """``GET cluster?min_free=<size>``: the cluster's hosts from Prometheus, ranked."""

    @tornado.web.authenticated
    async def get(self) -> None:
        params = {
            k: self.get_argument(k) for k in self.request.arguments if not k.isdigit()
        }
        try:
            constraints = payloads.parse_constraints(params)
        except AutoGPUError as err:
            raise self._http_error(err) from err
        # urllib blocks: on the executor, never on the IOLoop.
        payload = await self.state.answer(payloads.cluster_payload, constraints)
        self._finish_json(payload)


class ClusterHistoryHandler(_BaseHandler):
    """``GET cluster/history?seconds=<s>``: each host's mean load over time, from Prometheus."""

    @tornado.web.authenticated
    async def get(self) -> None:
        try:
            seconds = check_history_s(self.get_argument("seconds", "86400"))
        except AutoGPUError as err:
            raise self._http_error(err) from err
        payload = await self.state.answer(payloads.cluster_history_payload, seconds)
        self._finish_json(payload)


class MoveHandler(_BaseHandler):
    """``POST|GET|DELETE kernels/<kernel_id>/move``: restart an autogpu kernel on another GPU.

    POST body: ``{"target": "best" | "<NVML index>" | "<UUID>", "dry_run": false,
    "restart": true}``. A dry run only plans (the sidebar's confirmation dialog shows its
    ``message``). Otherwise the request is recorded and, with ``restart`` (the default), the
    kernel restarted here; the answer says where it runs now. With ``"restart": false`` the
    client restarts the kernel itself, as the sidebar does through JupyterLab's own restart (so
    that the notebook follows the restart: its kernel indicator, widgets, pending requests),
    then asks ``GET`` where the kernel runs now; ``DELETE`` drops a request no restart took.
    Errors: 404 unknown kernel, 400 not an autogpu kernel / bad body / target that does not fit,
    409 a move of this kernel already running, 500 the restart failed.
    """

    def _provisioner(self, kernel_id: str) -> Any:
        if kernel_id not in self.kernel_manager:
            raise http_error(404, f"no kernel {payloads.short_repr(kernel_id)} on this server")
        prov = getattr(self.kernel_manager.get_kernel(kernel_id), "provisioner", None)
        if not moving.is_movable(prov):
            raise tornado.web.HTTPError(
                400,
                "this kernel was not started with the autogpu kernelspec, so no restart would "
                "move it; choose \"Python 3 (autogpu)\" as the notebook's kernel (install it with "
                "`autogpu kernelspec install`)",
            )
        return prov

    @tornado.web.authenticated
    async def post(self, kernel_id: str) -> None:
        try:
            body = moving.parse_move_body(self.request.body)
        except UsageErrorBase as err:
            raise self._http_error(err) from err
        prov = self._provisioner(kernel_id)
        if kernel_id in self.state.moving:
            raise tornado.web.HTTPError(409, "a move of this kernel is already in progress")
        self.state.moving.add(kernel_id)
        try:
            payload = await self._move(kernel_id, prov, body)
        finally:
            self.state.moving.discard(kernel_id)
        self._finish_json(payload)

    @tornado.web.authenticated
    async def get(self, kernel_id: str) -> None:
        """Where the kernel runs after the last recorded move (``pending`` while it waits)."""
        prov = self._provisioner(kernel_id)
        plan = self.state.move_plans.get(kernel_id)
        if plan is None:
            raise http_error(404, "no move of this kernel was recorded by this server")
        if await self.state.run(moving.pending, prov):
            self._finish_json(moving.pending_payload(plan))
            return
        self.state.move_plans.pop(kernel_id, None)
        self._finish_json(moving.result_payload(plan, prov, False, self.state.labels()))

    @tornado.web.authenticated
    async def delete(self, kernel_id: str) -> None:
        """Drop a recorded move that no restart took (the client's restart failed)."""
        prov = self._provisioner(kernel_id)
        was = await self.state.run(moving.pending, prov)
        await self.state.run(moving.cancel, prov)
        self.state.move_plans.pop(kernel_id, None)
        cancelled: CancelAnswer = {"cancelled": was}
        self._finish_json(cancelled)

    async def _move(self, kernel_id: str, prov: Any, body: moving.MoveBody) -> MoveAnswer:
        try:
            plan = await self.state.answer(moving.plan_or_request, prov, kernel_id, body)
        except (UsageErrorBase, NoDeviceFitsError) as err:
            raise http_error(400, _one_paragraph(err)) from err
        except AutoGPUError as err:
            raise self._http_error(err) from err
        if body.dry_run:
            return moving.result_payload(plan, prov, True, self.state.labels())
        if not body.restart:
            for gone in [k for k in self.state.move_plans if k not in self.kernel_manager]:
                del self.state.move_plans[gone]  # bounded: one plan per live kernel
            self.state.move_plans[kernel_id] = plan
            return moving.pending_payload(plan)
        kernel_manager: Any = self.kernel_manager  # jupyter_server's is untyped
        try:
            await kernel_manager.restart_kernel(kernel_id)
        except Exception as err:  # the kernel could not restart: say why, keep serving
            self.log.exception("autogpu: restarting kernel %s for a move failed", kernel_id)
            await self.state.run(moving.cancel, prov)
            raise http_error(500, f"the kernel could not restart: {err}") from err
        prov = getattr(kernel_manager.get_kernel(kernel_id), "provisioner", prov)
        return moving.result_payload(plan, prov, False, self.state.labels())


#: (path under the namespace, handler class)
HANDLERS: list[tuple[str, type[_BaseHandler]]] = [
    ("devices", DevicesHandler),
    ("history", HistoryHandler),
    ("holders", HoldersHandler),
    ("select", SelectHandler),
    ("cluster", ClusterHandler),
    ("cluster/history", ClusterHistoryHandler),
    (r"kernels/(?P<kernel_id>[^/]+)/move", MoveHandler),
]


def setup_handlers(web_app: Any, state: AutoGPUServer) -> None:
    """Register the handlers on ``web_app`` under ``{base_url}/autogpu/api/v1/``, and under the
    deprecated ``{base_url}/autogpu/`` of 0.1 (same handlers, with a ``Deprecation`` header)."""
    base_url = web_app.settings["base_url"]
    current = url_path_join(base_url, NAMESPACE, API_PREFIX)
    old = url_path_join(base_url, NAMESPACE)
    web_app.add_handlers(
        ".*$",
        [(url_path_join(current, path), cls, {"state": state}) for path, cls in HANDLERS]
        + [
            (url_path_join(old, path), cls, {"state": state, "moved": (old, current)})
            for path, cls in HANDLERS
        ],
    )
