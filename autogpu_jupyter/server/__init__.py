"""Jupyter server extension: every GPU of the host, live, and who holds it, as REST endpoints.

Enabled on install by ``jupyter-config/server-config/autogpu_jupyter.json``. Endpoints, all
authenticated, under ``{base_url}/autogpu/``:

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
"""

from __future__ import annotations

from typing import Any

__all__ = ["_jupyter_server_extension_points", "_load_jupyter_server_extension"]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "autogpu_jupyter.server"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Create the shared state (one sampler per server process) and register the handlers."""
    # Imported here so that listing the extension point stays cheap (no tornado, no pynvml).
    import os

    from autogpu_jupyter.core.backends import SIMULATE_ENV
    from autogpu_jupyter.core.backends.simulated import resolve_fleet_source
    from autogpu_jupyter.server.handlers import setup_handlers
    from autogpu_jupyter.server.state import AutoGPUServer

    # A relative fleet file is resolved once, here, against the directory the server started
    # in: its kernels inherit the absolute path, although they run in their notebooks' folders.
    simulate = os.environ.get(SIMULATE_ENV, "")
    resolved = resolve_fleet_source(simulate)
    if resolved != simulate:
        os.environ[SIMULATE_ENV] = resolved
        server_app.log.info("autogpu: %s=%s (resolved from %r)", SIMULATE_ENV, resolved, simulate)

    # Kernels (and terminals) inherit the server's environment: with the root they write
    # notebook paths as the sidebar shows them, relative to it (core.contract.notebook_path).
    from autogpu_jupyter.core.contract import SERVER_ROOT_ENV

    root = getattr(server_app, "root_dir", None)
    if isinstance(root, str) and root:
        os.environ[SERVER_ROOT_ENV] = os.path.abspath(os.path.expanduser(root))

    state = AutoGPUServer(parent=server_app)
    state.start()
    setup_handlers(server_app.web_app, state)
    if state.cull_idle_gpu_kernels_s > 0:
        from autogpu_jupyter.server import culling

        culling.install(state, server_app.kernel_manager)
    if state.metrics:
        from autogpu_jupyter.metrics import MetricsSource, install

        def latest() -> Any:
            sampler = state._sampler
            return sampler.latest() if sampler is not None else None

        install(MetricsSource(latest=latest, registry=state.registry,
                              hostname=state.metrics_hostname,
                              lease_details=state.metrics_lease_details))
    server_app.log.info(
        "autogpu server extension loaded: %sautogpu/ (sampling every %.1f s)",
        server_app.web_app.settings.get("base_url", "/"),
        state.interval_s,
    )


# Jupyter Server < 2 looked for this name.
load_jupyter_server_extension = _load_jupyter_server_extension
