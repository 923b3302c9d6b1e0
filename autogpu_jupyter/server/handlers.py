"""REST handlers under ``{base_url}/autogpu/``: devices, history, holders, select.

Every verb is ``@tornado.web.authenticated`` (``tests/test_server.py`` walks the registered
handlers to check); POST goes through Jupyter's XSRF check. Blocking work runs on the state's
executor; the handlers only await it and write JSON. ``AutoGPUError`` becomes an HTTP error with
a JSON ``message`` (400 for bad input, 503 when no GPU backend is usable).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from autogpu_jupyter.errors import AutoGPUError, UsageErrorBase
from autogpu_jupyter.server import payloads
from autogpu_jupyter.server.state import AutoGPUServer

log = logging.getLogger(__name__)

__all__ = ["setup_handlers", "HANDLERS", "NAMESPACE"]

NAMESPACE = "autogpu"


class _BaseHandler(APIHandler):
    state: AutoGPUServer

    def initialize(self, state: AutoGPUServer) -> None:
        self.state = state

    def _finish_json(self, payload: dict[str, Any]) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(payload, allow_nan=False))

    def _http_error(self, err: AutoGPUError) -> tornado.web.HTTPError:
        code = 400 if isinstance(err, UsageErrorBase) else 503
        return tornado.web.HTTPError(code, str(err).replace("%", "%%"))


class DevicesHandler(_BaseHandler):
    """``GET devices``: the latest snapshot of the shared sampler."""

    @tornado.web.authenticated
    async def get(self) -> None:
        payload = await self.state.run(payloads.devices_payload, self.state)
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
                raise tornado.web.HTTPError(
                    400,
                    f"invalid since={raw!r}: expected a Unix timestamp in seconds, "
                    "e.g. 1718000000.5",
                )
        payload = await self.state.run(payloads.history_payload, self.state, since)
        self._finish_json(payload)


class HoldersHandler(_BaseHandler):
    """``GET holders``: leases and GPU processes, joined with this server's kernels."""

    @tornado.web.authenticated
    async def get(self) -> None:
        sessions = await payloads.kernel_sessions(self.session_manager)
        payload = await self.state.run(
            payloads.holders_payload, self.state, self.kernel_manager, sessions
        )
        self._finish_json(payload)


class SelectHandler(_BaseHandler):
    """``GET|POST select``: a dry-run pick (no lease), the same policy as ``%gpu pick``."""

    async def _select(self, params: dict[str, Any]) -> None:
        try:
            constraints = payloads.parse_constraints(params)
            payload = await self.state.run(payloads.select_payload, self.state, constraints)
        except AutoGPUError as err:
            raise self._http_error(err) from err
        self._finish_json(payload)

    @tornado.web.authenticated
    async def get(self) -> None:
        # JupyterLab's ServerConnection appends a cache buster (``&1718000000123``) to GETs.
        params = {
            k: self.get_argument(k) for k in self.request.arguments if not k.isdigit()
        }
        await self._select(params)

    @tornado.web.authenticated
    async def post(self) -> None:
        body = self.request.body or b"{}"
        try:
            params = json.loads(body)
        except ValueError:
            raise tornado.web.HTTPError(400, "request body is not JSON; expected an object such as "
                                             '{"min_free": "10G"}') from None
        if not isinstance(params, dict):
            raise tornado.web.HTTPError(400, 'expected a JSON object such as {"min_free": "10G"}')
        await self._select(params)


#: (path under the namespace, handler class)
HANDLERS: list[tuple[str, type[_BaseHandler]]] = [
    ("devices", DevicesHandler),
    ("history", HistoryHandler),
    ("holders", HoldersHandler),
    ("select", SelectHandler),
]


def setup_handlers(web_app: Any, state: AutoGPUServer) -> None:
    """Register the handlers on ``web_app`` under ``{base_url}/autogpu/``."""
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base_url, NAMESPACE, path), cls, {"state": state})
            for path, cls in HANDLERS
        ],
    )
