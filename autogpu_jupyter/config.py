"""User and admin configuration: ``c.AutoGPU.*`` traits, seeded by ``AUTOGPU_*`` env vars.

Precedence (design decision 9): magic flag > ``%config`` / config file > env var > default.
The env vars only provide the defaults (``@default``), so a config file always wins over them.
"""

from __future__ import annotations

import os
from typing import Any

from traitlets import Bool, Float, Int, Unicode, default
from traitlets.config import Configurable

__all__ = [
    "ENV_NAMES", "AutoGPU", "default_registry_dir", "default_settings", "set_default_settings",
]


def default_registry_dir() -> str:
    """``$AUTOGPU_REGISTRY_DIR``, else ``/var/tmp/autogpu``: shared by all users of the host, and
    not under ``/tmp``, which systemd's ``PrivateTmp=`` makes private per service."""
    return os.environ.get("AUTOGPU_REGISTRY_DIR") or "/var/tmp/autogpu"  # noqa: S108


def _env(name: str, fallback: str = "") -> str:
    return os.environ.get(f"AUTOGPU_{name}", fallback)


class AutoGPU(Configurable):
    """Settings of the picker, the leases and the sampler.

    Set them in ``ipython_config.py`` / ``jupyter_server_config.py`` as
    ``c.AutoGPU.min_free = "10G"``,
    in a notebook with ``%config AutoGPU.min_free = "10G"``, or through ``AUTOGPU_MIN_FREE`` etc.
    """

    min_free = Unicode(
        "",
        help="Default --min-free for a pick: a size like 10G / 16GB or a share like 25%. "
        "Empty: no minimum.",
    ).tag(config=True)
    max_util = Unicode(
        "",
        help="Default --max-util: drop devices busier than this percentage (0-100). "
        "Empty: no limit.",
    ).tag(config=True)
    count = Int(1, help="Default number of devices a pick takes.").tag(config=True)
    wait = Unicode(
        "",
        help="Default --wait: how long a pick waits in line for a device (e.g. 10m). "
        "Empty: no wait.",
    ).tag(config=True)
    exclusive = Bool(
        False,
        help="Default --exclusive: take a device no other lease holds, and keep others off it.",
    ).tag(config=True)
    refuse_when_initialized = Bool(
        True,
        help="Refuse a pick when CUDA is already initialised in the kernel (it would have no "
        "effect). "
        "False: set the variables anyway, with a warning, as --force does.",
    ).tag(config=True)
    pick_on_load = Bool(
        False,
        help="Pick a device (with the defaults above) as soon as the extension loads, so a profile "
        "with c.InteractiveShellApp.extensions = ['autogpu'] makes every kernel pick.",
    ).tag(config=True)
    model = Unicode(
        help="Default model filter: only devices whose name contains one of these, comma "
        "separated (e.g. 'A100'); empty: any model (env AUTOGPU_MODEL).",
    ).tag(config=True)
    prefer = Unicode(
        help="Default model preference order, comma separated (e.g. 'L4,A100': L4s first, "
        "A100s next, others last), applied before load; an admin's way to keep large cards "
        "for large jobs. Empty: by load only (env AUTOGPU_PREFER).",
    ).tag(config=True)
    registry_dir = Unicode(
        help="Directory of the per-host lease registry, shared by every user of the host. "
        "The admin "
        "may create it (mode 1777, owned by root); autogpu creates it so when missing. "
        "Empty string disables leases."
    ).tag(config=True)
    use_leases = Bool(
        True, help="Take a lease on each pick (herd safety). False: no registry at all."
    ).tag(config=True)
    max_devices_per_user = Int(
        0, help="Admin limit: the most devices one user may hold leases on at once (0: no limit)."
    ).tag(config=True)
    max_leases_per_user = Int(
        0,
        help="Admin limit: the most leases one user may hold at once, shared or not (0: no "
        "limit; env AUTOGPU_MAX_LEASES_PER_USER).",
    ).tag(config=True)
    max_tickets_per_user = Int(
        2,
        help="Admin limit: the most places in the waiting line (picks with --wait) one user may "
        "hold at once (env AUTOGPU_MAX_TICKETS_PER_USER). A waiting ticket counts the devices "
        "it waits for against max_devices_per_user.",
    ).tag(config=True)
    registry_lock_timeout_s = Float(
        10.0,
        help="Seconds a pick waits for the registry lock held by another process. Past it, a "
        "plain pick goes on without a lease (and says so); an exclusive, waiting or quota-bound "
        "pick fails (env AUTOGPU_REGISTRY_LOCK_TIMEOUT).",
    ).tag(config=True)
    broker_socket = Unicode(
        help="Unix socket of the trusted lease broker (`autogpu broker`, docs/admin-broker.md). "
        "When it is set (here or env AUTOGPU_BROKER_SOCKET), or the default "
        "/run/autogpu/broker.sock exists, every pick leases through the broker and fails "
        "closed when it cannot be reached. 'off': never use a broker.",
    ).tag(config=True)
    broker_fallback = Unicode(
        "",
        help="Admin option: 'registry' lets picks use the shared-directory registry when the "
        "configured broker cannot be reached (default '': fail closed; env "
        "AUTOGPU_BROKER_FALLBACK).",
    ).tag(config=True)
    record_commands = Bool(
        False,
        help="Store the holder's command line in its lease file. Lease files are readable by "
        "every user of the host, so this is off unless the admin opts in "
        "(env AUTOGPU_RECORD_COMMANDS=1).",
    ).tag(config=True)
    sample_interval_s = Float(
        1.0, help="Seconds between NVML samples of the background sampler (>= 0.1)."
    ).tag(config=True)
    history_s = Float(
        900.0, help="Seconds of sampler history kept in memory (a bounded ring buffer)."
    ).tag(config=True)
    overload_util_pct = Float(
        90.0,
        help="The panel warns when this kernel's GPU stays above this utilisation (because of "
        "others).",
    ).tag(config=True)
    overload_window_s = Float(
        30.0, help="How long the load must last (seconds) before the overload warning shows."
    ).tag(config=True)
    overload_memory_pct = Float(
        95.0, help="The panel warns when this kernel's GPU memory is fuller than this percentage."
    ).tag(config=True)
    visible_ids = Unicode(
        "uuid",
        help="How a pick names its GPUs in CUDA_VISIBLE_DEVICES: 'uuid' (default: GPU-... "
        "UUIDs, unambiguous whatever the device order) or 'index' (NVML indices, with "
        "CUDA_DEVICE_ORDER=PCI_BUS_ID), for stacks that cannot read UUIDs there: Ray 2.8-2.9 "
        "(ray.get_gpu_ids), older dask-cuda, torch's NVML-based device_count() before its fix. "
        "'index' refuses MIG devices, which CUDA selects by UUID only (env "
        "AUTOGPU_VISIBLE_IDS).",
    ).tag(config=True)
    prometheus_url = Unicode(
        help="Base URL of the Prometheus server that scrapes this cluster's autogpu and DCGM "
        "exporter series (e.g. http://prometheus.example.org:9090). Set, it gives the sidebar's "
        "Cluster section and `autogpu hosts` their data. Empty (default, or "
        "$AUTOGPU_PROMETHEUS_URL): no cluster view.",
    ).tag(config=True)
    prometheus_timeout_s = Float(
        5.0, help="Seconds one request to Prometheus may take before the cluster view says so."
    ).tag(config=True)

    @default("prometheus_url")
    def _default_prometheus_url(self) -> str:
        return _env("PROMETHEUS_URL")

    @default("min_free")
    def _default_min_free(self) -> str:
        return _env("MIN_FREE")

    @default("max_util")
    def _default_max_util(self) -> str:
        return _env("MAX_UTIL")

    @default("count")
    def _default_count(self) -> int:
        return _int_env("COUNT", 1)

    @default("wait")
    def _default_wait(self) -> str:
        return _env("WAIT")

    @default("exclusive")
    def _default_exclusive(self) -> bool:
        return _bool_env("EXCLUSIVE", False)

    @default("pick_on_load")
    def _default_pick_on_load(self) -> bool:
        return _bool_env("PICK_ON_LOAD", False)

    @default("model")
    def _default_model(self) -> str:
        return _env("MODEL")

    @default("prefer")
    def _default_prefer(self) -> str:
        return _env("PREFER")

    @default("visible_ids")
    def _default_visible_ids(self) -> str:
        return _env("VISIBLE_IDS", "uuid")

    @default("registry_dir")
    def _default_registry_dir(self) -> str:
        return default_registry_dir()

    @default("use_leases")
    def _default_use_leases(self) -> bool:
        return _bool_env("USE_LEASES", True)

    @default("max_devices_per_user")
    def _default_max_devices(self) -> int:
        return _int_env("MAX_DEVICES_PER_USER", 0)

    @default("max_leases_per_user")
    def _default_max_leases(self) -> int:
        return _int_env("MAX_LEASES_PER_USER", 0)

    @default("max_tickets_per_user")
    def _default_max_tickets(self) -> int:
        return _int_env("MAX_TICKETS_PER_USER", 2)

    @default("registry_lock_timeout_s")
    def _default_lock_timeout(self) -> float:
        try:
            return min(max(0.0, float(_env("REGISTRY_LOCK_TIMEOUT", "10"))), 3600.0)
        except ValueError:
            return 10.0

    @default("broker_socket")
    def _default_broker_socket(self) -> str:
        return _env("BROKER_SOCKET")

    @default("broker_fallback")
    def _default_broker_fallback(self) -> str:
        return _env("BROKER_FALLBACK")

    @default("record_commands")
    def _default_record_commands(self) -> bool:
        return _bool_env("RECORD_COMMANDS", False)

    @default("sample_interval_s")
    def _default_interval(self) -> float:
        try:
            return max(0.1, float(_env("SAMPLE_INTERVAL", "1.0")))
        except ValueError:
            return 1.0


def _bool_env(name: str, fallback: bool) -> bool:
    value = _env(name).strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    return fallback


def _int_env(name: str, fallback: int) -> int:
    try:
        return int(_env(name, str(fallback)))
    except ValueError:
        return fallback


def settings(**overrides: Any) -> AutoGPU:
    """An :class:`AutoGPU` with the current env defaults and ``overrides`` applied (for scripts)."""
    return AutoGPU(**overrides)


# The settings the magics registered with the shell (so that ``%config AutoGPU.x = ...`` also
# reaches the Python API in that kernel); ``None`` outside IPython: a fresh ``AutoGPU()``.
_default_settings: AutoGPU | None = None


def set_default_settings(settings: AutoGPU | None) -> None:
    """Make ``settings`` what API calls without explicit settings use (the magics call this)."""
    global _default_settings
    _default_settings = settings


#: Every ``AUTOGPU_*`` variable the defaults of :class:`AutoGPU` read (tests/unit/test_config.py
#: holds the list complete): :func:`default_settings` makes new settings when one changes.
ENV_NAMES = tuple(
    f"AUTOGPU_{name}"
    for name in (
        "PROMETHEUS_URL", "MIN_FREE", "MAX_UTIL", "COUNT", "WAIT", "EXCLUSIVE", "PICK_ON_LOAD",
        "MODEL", "PREFER", "REGISTRY_DIR", "USE_LEASES", "MAX_DEVICES_PER_USER",
        "MAX_LEASES_PER_USER", "MAX_TICKETS_PER_USER", "REGISTRY_LOCK_TIMEOUT", "BROKER_SOCKET",
        "BROKER_FALLBACK", "RECORD_COMMANDS", "SAMPLE_INTERVAL", "VISIBLE_IDS",
    )
)
# The env-seeded settings of this process outside IPython, with the values of ENV_NAMES they
# were made under. One pair, replaced as a whole (no lock needed: a race makes two equal ones).
_env_settings: tuple[tuple[str | None, ...], AutoGPU] | None = None


def default_settings() -> AutoGPU:
    """The shell's ``AutoGPU`` when the extension is loaded, else one seeded by the environment.

    Outside IPython the settings are made once per process and made again when one of the
    ``AUTOGPU_*`` variables they read (:data:`ENV_NAMES`) changes: a pick does not build a
    traitlets configurable each time. Treat the result as read-only (it is shared); for
    settings of your own, make an ``AutoGPU(...)``.
    """
    global _env_settings
    if _default_settings is not None:
        return _default_settings
    key = tuple(map(os.environ.get, ENV_NAMES))
    made = _env_settings
    if made is not None and made[0] == key:
        return made[1]
    settings = AutoGPU()
    _env_settings = (key, settings)
    return settings
