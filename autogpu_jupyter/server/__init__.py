"""Jupyter server extension: every GPU of the host, live, and who holds it, as REST endpoints.

Enabled on install by ``jupyter-config/server-config/autogpu_jupyter.json``. Endpoints, all
authenticated, under ``{base_url}/autogpu/api/v1/`` (and, deprecated until 0.3, under the
unversioned ``{base_url}/autogpu/`` of 0.1; see ``handlers.py``):

``GET devices``
    The shared sampler's latest snapshot (``FleetSnapshot.to_dict()``), ``simulated``, ``errors``.
``GET history?since=<timestamp_s>``
    Per-device utilisation and memory series since a timestamp, bounded by ``max_history_points``.
``GET holders``
    Live leases and NVML processes per device, joined with this server's kernels and sessions.
``GET|POST select``
    A dry-run pick with the same policy as ``%gpu pick`` (``core.picker.pick(dry_run=True)``).
``GET cluster?min_free=<size>``
    Every host of the cluster from ``c.AutoGPU.prometheus_url`` (``core.cluster``), hosts ranked
    for the constraints by the same policy; ``configured: false`` when no Prometheus is set.
``GET cluster/history?seconds=<s>``
    Each host's mean GPU utilisation and memory taken over the last ``seconds`` (default a day),
    from Prometheus range queries.

It also registers the ``autogpu_*`` gauges (``autogpu_jupyter.metrics``) on the Prometheus registry
that jupyter_server serves at ``{base_url}/metrics``.

Configure with ``c.AutoGPUServer.*`` in ``jupyter_server_config.py`` (see :class:`AutoGPUServer`).

Logging: the extension's own messages go to the server's logger (``ServerApp.log``); the records
of autogpu's module loggers (``autogpu_jupyter.*``: the sampler, the registry, the metrics) are
handed to it too (:func:`route_logs_to`), so they appear in the server's log, formatted as its own,
at the server's ``--log-level``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = [
    "_jupyter_server_extension_points",
    "_load_jupyter_server_extension",
    "route_logs_to",
]


class _ToServerLog(logging.Handler):
    """Hands the package's records to the server's logger (its handlers, formatter and level).

    Without it they reach no handler under jupyter_server: its ``ServerApp`` logger does not
    propagate to the root, which has none, so INFO and DEBUG records are dropped and warnings
    come out as bare lines through Python's last-resort handler. One per process: a later server
    in the same process (a test suite) takes it over.
    """

    def __init__(self) -> None:
        super().__init__()
        self.target: logging.Logger | None = None

    def emit(self, record: logging.LogRecord) -> None:
        target = self.target
        if target is not None and target.isEnabledFor(record.levelno):
            target.handle(record)


_TO_SERVER_LOG = _ToServerLog()


def route_logs_to(server_log: logging.Logger) -> None:
    """Send the records of the ``autogpu_jupyter`` loggers to ``server_log`` at its level.

    This is the application's choice (the server's), made where the server hands us its logger;
    the library itself configures no handler.
    """
    package = logging.getLogger("autogpu_jupyter")
    _TO_SERVER_LOG.target = server_log
    if _TO_SERVER_LOG not in package.handlers:
        package.addHandler(_TO_SERVER_LOG)
    # Records below the package's level are never made: follow the server's (--log-level).
    package.setLevel(server_log.getEffectiveLevel())


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "autogpu_jupyter.server"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Create the shared state (one sampler per server process) and register the handlers."""
    # Imported here so that listing the extension point stays cheap (no tornado, no pynvml).
    from autogpu_jupyter.core import (  # noqa: PLC0415
        SERVER_CULL_ENV,
        SERVER_CULL_WARNING_ENV,
        SERVER_ROOT_ENV,
        SIMULATE_ENV,
        resolve_fleet_source,
    )
    from autogpu_jupyter.server.handlers import setup_handlers  # noqa: PLC0415
    from autogpu_jupyter.server.state import AutoGPUServer  # noqa: PLC0415

    # A relative fleet file is resolved once, here, against the directory the server started
    # in: its kernels inherit the absolute path, although they run in their notebooks' folders.
    simulate = os.environ.get(SIMULATE_ENV, "")
    resolved = resolve_fleet_source(simulate)
    if resolved != simulate:
        os.environ[SIMULATE_ENV] = resolved
        server_app.log.info("autogpu: %s=%s (resolved from %r)", SIMULATE_ENV, resolved, simulate)

    route_logs_to(server_app.log)

    # Kernels (and terminals) inherit the server's environment: with the root they write
    # notebook paths as the sidebar shows them, relative to it (core.contract.notebook_path).
    root = getattr(server_app, "root_dir", None)
    if isinstance(root, str) and root:
        os.environ[SERVER_ROOT_ENV] = os.path.abspath(os.path.expanduser(root))

    state = AutoGPUServer(parent=server_app)
    state.start()
    setup_handlers(server_app.web_app, state)
    if state.cull_idle_gpu_kernels_s > 0:
        from autogpu_jupyter.server import culling  # noqa: PLC0415 (only when culling is on)

        # The kernels it starts say so under the first cell that runs on a GPU (magics.hooks).
        os.environ[SERVER_CULL_ENV] = f"{float(state.cull_idle_gpu_kernels_s):g}"
        os.environ[SERVER_CULL_WARNING_ENV] = f"{state.cull_warning_lead_s():g}"

        culling.install(state, server_app.kernel_manager)
    if state.metrics:
        from autogpu_jupyter.metrics import MetricsSource, install  # noqa: PLC0415 (when on)

        install(MetricsSource(latest=state.latest, store=state.store,
                              hostname=state.metrics_hostname,
                              lease_details=state.metrics_lease_details))
    server_app.log.info(
        "autogpu server extension loaded: %sautogpu/api/v1/ (sampling every %.1f s)",
        server_app.web_app.settings.get("base_url", "/"),
        state.interval_s,
    )


# Jupyter Server < 2 looked for this name.
load_jupyter_server_extension = _load_jupyter_server_extension
