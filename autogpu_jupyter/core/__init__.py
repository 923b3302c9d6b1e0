"""The engine's one door: every name a front end uses, importable from ``autogpu_jupyter.core``.

core/ is the pure engine: no IPython, ipywidgets, tornado or Jupyter imports here (design
section 2). The front ends -- the magics, the widgets, the server extension, the provisioner,
the CLI, the kernelspec commands, the user API and the metrics -- import the names below from
this package, and the lease store port from :mod:`autogpu_jupyter.core.leasing`; never a module
inside (``tests/unit/test_house.py`` checks it, with the exceptions it names). The inside can
then be re-cut without touching a caller.

The façade is lazy: importing this package imports nothing else, and a name loads its module
when first asked for (``%load_ext autogpu`` stays cheap: the pick machinery, the lease stores
and numpy load with the first magic that needs them). A few modules are themselves part of the
door, read as namespaces where their names are a vocabulary (``options.parse``,
``contract.GRANT_ENV``, ``session.current``): they are listed at the end of ``__all__``.

Some names are spelt more fully here than inside, where the module's name said the rest:
``parse_options`` (``options.parse``), ``add_pick_arguments``, ``options_from_namespace``,
``option_defaults_from``, ``detect_overload``, ``SAMPLED_METRICS``, ``TableColumn``,
``narrow_table``, ``table_text``, ``table_html``, ``cell_text`` and ``current_session``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autogpu_jupyter.core import contract as contract
    from autogpu_jupyter.core import decision as decision
    from autogpu_jupyter.core import moves as moves
    from autogpu_jupyter.core import options as options
    from autogpu_jupyter.core import procfs as procfs
    from autogpu_jupyter.core import sampler as sampler
    from autogpu_jupyter.core import session as session
    from autogpu_jupyter.core.backends import SIMULATE_ENV as SIMULATE_ENV
    from autogpu_jupyter.core.backends import get_backend as get_backend
    from autogpu_jupyter.core.backends.simulated import resolve_fleet_source as resolve_fleet_source
    from autogpu_jupyter.core.cluster import ClusterCache as ClusterCache
    from autogpu_jupyter.core.cluster import PrometheusClient as PrometheusClient
    from autogpu_jupyter.core.cluster import check_history_s as check_history_s
    from autogpu_jupyter.core.cluster import fetch_cluster as fetch_cluster
    from autogpu_jupyter.core.cluster import fetch_history as fetch_history
    from autogpu_jupyter.core.cluster import rank_hosts as rank_hosts
    from autogpu_jupyter.core.contract import GRANT_ENV as GRANT_ENV
    from autogpu_jupyter.core.contract import GRANT_ROCM_ENV as GRANT_ROCM_ENV
    from autogpu_jupyter.core.contract import LEASE_ENV as LEASE_ENV
    from autogpu_jupyter.core.contract import LEASE_FD_ENV as LEASE_FD_ENV
    from autogpu_jupyter.core.contract import MOVE_FILE_ENV as MOVE_FILE_ENV
    from autogpu_jupyter.core.contract import NOTE_ENV as NOTE_ENV
    from autogpu_jupyter.core.contract import ON_NO_DEVICE as ON_NO_DEVICE
    from autogpu_jupyter.core.contract import OPTIONS_ENV as OPTIONS_ENV
    from autogpu_jupyter.core.contract import PICKED_ENV as PICKED_ENV
    from autogpu_jupyter.core.contract import PROVISIONED_ENV as PROVISIONED_ENV
    from autogpu_jupyter.core.contract import PROVISIONER_NAME as PROVISIONER_NAME
    from autogpu_jupyter.core.contract import ROCM_GRANT_VARS as ROCM_GRANT_VARS
    from autogpu_jupyter.core.contract import SERVER_CULL_ENV as SERVER_CULL_ENV
    from autogpu_jupyter.core.contract import SERVER_CULL_WARNING_ENV as SERVER_CULL_WARNING_ENV
    from autogpu_jupyter.core.contract import SERVER_ROOT_ENV as SERVER_ROOT_ENV
    from autogpu_jupyter.core.contract import KernelContract as KernelContract
    from autogpu_jupyter.core.contract import ProvisionerState as ProvisionerState
    from autogpu_jupyter.core.contract import notebook_path as notebook_path
    from autogpu_jupyter.core.cudastate import cuda_state as cuda_state
    from autogpu_jupyter.core.cudastate import hip_state as hip_state
    from autogpu_jupyter.core.decision import Decision as Decision
    from autogpu_jupyter.core.decision import bookings_for as bookings_for
    from autogpu_jupyter.core.decision import deciding_term as deciding_term
    from autogpu_jupyter.core.decision import describe_load as describe_load
    from autogpu_jupyter.core.devices import DeviceSnapshot as DeviceSnapshot
    from autogpu_jupyter.core.devices import FleetSnapshot as FleetSnapshot
    from autogpu_jupyter.core.holders import holders_by_device as holders_by_device
    from autogpu_jupyter.core.holders import holders_text as holders_text
    from autogpu_jupyter.core.leasing.admission import is_reservation as is_reservation
    from autogpu_jupyter.core.moves import best_move_target as best_move_target
    from autogpu_jupyter.core.moves import grant_environ as grant_environ
    from autogpu_jupyter.core.options import PICK_OPTIONS as PICK_OPTIONS
    from autogpu_jupyter.core.options import PickOptions as PickOptions
    from autogpu_jupyter.core.options import add_arguments as add_pick_arguments
    from autogpu_jupyter.core.options import defaults_from as option_defaults_from
    from autogpu_jupyter.core.options import from_namespace as options_from_namespace
    from autogpu_jupyter.core.options import join_negative_values as join_negative_values
    from autogpu_jupyter.core.options import parse as parse_options
    from autogpu_jupyter.core.overload import Alternative as Alternative
    from autogpu_jupyter.core.overload import Overload as Overload
    from autogpu_jupyter.core.overload import Thresholds as Thresholds
    from autogpu_jupyter.core.overload import alternative_constraints as alternative_constraints
    from autogpu_jupyter.core.overload import best_alternative as best_alternative
    from autogpu_jupyter.core.overload import detect as detect_overload
    from autogpu_jupyter.core.overload import kernel_device_uuids as kernel_device_uuids
    from autogpu_jupyter.core.overload import kernel_grant as kernel_grant
    from autogpu_jupyter.core.overload import pending_warning as pending_warning
    from autogpu_jupyter.core.overload import reset_pending as reset_pending
    from autogpu_jupyter.core.overload import set_move_hint as set_move_hint
    from autogpu_jupyter.core.picker import PickResult as PickResult
    from autogpu_jupyter.core.picker import pick as pick
    from autogpu_jupyter.core.policy import Candidate as Candidate
    from autogpu_jupyter.core.policy import Constraints as Constraints
    from autogpu_jupyter.core.policy import matches_id as matches_id
    from autogpu_jupyter.core.sampler import METRICS as SAMPLED_METRICS
    from autogpu_jupyter.core.sampler import DeviceSeries as DeviceSeries
    from autogpu_jupyter.core.sampler import Sampler as Sampler
    from autogpu_jupyter.core.sampler import get_sampler as get_sampler
    from autogpu_jupyter.core.sampler import own_pids as own_pids
    from autogpu_jupyter.core.sampler import series_from_frame as series_from_frame
    from autogpu_jupyter.core.sampler import stop_sampler as stop_sampler
    from autogpu_jupyter.core.session import current as current_session
    from autogpu_jupyter.core.tables import Column as TableColumn
    from autogpu_jupyter.core.tables import asked_text as asked_text
    from autogpu_jupyter.core.tables import narrow as narrow_table
    from autogpu_jupyter.core.tables import ranking_lines as ranking_lines
    from autogpu_jupyter.core.tables import status_table as status_table
    from autogpu_jupyter.core.tables import to_html as table_html
    from autogpu_jupyter.core.tables import to_text as table_text
    from autogpu_jupyter.core.tables import visible as cell_text
    from autogpu_jupyter.core.text import redact_command as redact_command
    from autogpu_jupyter.core.text import terminal_safe as terminal_safe
    from autogpu_jupyter.core.units import format_bytes as format_bytes
    from autogpu_jupyter.core.units import format_duration as format_duration
    from autogpu_jupyter.core.visibility import current_allocation as current_allocation
    from autogpu_jupyter.core.visibility import visible_env as visible_env
    from autogpu_jupyter.core.words import NOBODY as NOBODY
    from autogpu_jupyter.core.words import holder_memory as holder_memory
    from autogpu_jupyter.core.words import holder_where as holder_where
    from autogpu_jupyter.core.words import holder_who as holder_who

__all__ = [
    # The pick: one pipeline answers which GPU
    "pick",
    "PickResult",
    "Decision",
    "bookings_for",
    "is_reservation",
    "deciding_term",
    "describe_load",
    "Candidate",
    "Constraints",
    "matches_id",
    # Devices and backends
    "DeviceSnapshot",
    "FleetSnapshot",
    "SIMULATE_ENV",
    "get_backend",
    "resolve_fleet_source",
    "current_allocation",
    "visible_env",
    "cuda_state",
    "hip_state",
    # Pick options (one vocabulary for the magic, the CLI, the kernelspec and the REST API)
    "PICK_OPTIONS",
    "PickOptions",
    "parse_options",
    "add_pick_arguments",
    "options_from_namespace",
    "option_defaults_from",
    "join_negative_values",
    # The kernel contract between the provisioner, the kernel and the server
    "KernelContract",
    "ProvisionerState",
    "notebook_path",
    "GRANT_ENV",
    "GRANT_ROCM_ENV",
    "LEASE_ENV",
    "LEASE_FD_ENV",
    "MOVE_FILE_ENV",
    "NOTE_ENV",
    "ON_NO_DEVICE",
    "OPTIONS_ENV",
    "PICKED_ENV",
    "PROVISIONED_ENV",
    "PROVISIONER_NAME",
    "ROCM_GRANT_VARS",
    "SERVER_ROOT_ENV",
    "SERVER_CULL_ENV",
    "SERVER_CULL_WARNING_ENV",
    # Moves and overload
    "grant_environ",
    "best_move_target",
    "Alternative",
    "Overload",
    "Thresholds",
    "detect_overload",
    "alternative_constraints",
    "best_alternative",
    "kernel_device_uuids",
    "kernel_grant",
    "pending_warning",
    "reset_pending",
    "set_move_hint",
    # History (the sampler)
    "Sampler",
    "get_sampler",
    "stop_sampler",
    "own_pids",
    "DeviceSeries",
    "SAMPLED_METRICS",
    "series_from_frame",
    # The cluster view (Prometheus)
    "ClusterCache",
    "PrometheusClient",
    "fetch_cluster",
    "fetch_history",
    "check_history_s",
    "rank_hosts",
    # Words and tables for text front ends
    "holders_by_device",
    "holders_text",
    "NOBODY",
    "holder_where",
    "holder_who",
    "holder_memory",
    "asked_text",
    "ranking_lines",
    "TableColumn",
    "narrow_table",
    "status_table",
    "table_text",
    "table_html",
    "cell_text",
    "redact_command",
    "terminal_safe",
    "format_bytes",
    "format_duration",
    "current_session",
    # Modules read as namespaces (their names are the vocabulary)
    "contract",
    "decision",
    "moves",
    "options",
    "procfs",
    "sampler",
    "session",
]

#: Façade name -> (module under ``autogpu_jupyter.core``, attribute; ``None``: the module itself).
_LAZY: dict[str, tuple[str, str | None]] = {
    # The pick: one pipeline answers which GPU
    "pick": ("picker", "pick"),
    "PickResult": ("picker", "PickResult"),
    "Decision": ("decision", "Decision"),
    "bookings_for": ("decision", "bookings_for"),
    "is_reservation": ("leasing.admission", "is_reservation"),
    "deciding_term": ("decision", "deciding_term"),
    "describe_load": ("decision", "describe_load"),
    "Candidate": ("policy", "Candidate"),
    "Constraints": ("policy", "Constraints"),
    "matches_id": ("policy", "matches_id"),
    # Devices and backends
    "DeviceSnapshot": ("devices", "DeviceSnapshot"),
    "FleetSnapshot": ("devices", "FleetSnapshot"),
    "SIMULATE_ENV": ("backends", "SIMULATE_ENV"),
    "get_backend": ("backends", "get_backend"),
    "resolve_fleet_source": ("backends.simulated", "resolve_fleet_source"),
    "current_allocation": ("visibility", "current_allocation"),
    "visible_env": ("visibility", "visible_env"),
    "cuda_state": ("cudastate", "cuda_state"),
    "hip_state": ("cudastate", "hip_state"),
    # Pick options (one vocabulary for the magic, the CLI, the kernelspec and the REST API)
    "PICK_OPTIONS": ("options", "PICK_OPTIONS"),
    "PickOptions": ("options", "PickOptions"),
    "parse_options": ("options", "parse"),
    "add_pick_arguments": ("options", "add_arguments"),
    "options_from_namespace": ("options", "from_namespace"),
    "option_defaults_from": ("options", "defaults_from"),
    "join_negative_values": ("options", "join_negative_values"),
    # The kernel contract between the provisioner, the kernel and the server
    "KernelContract": ("contract", "KernelContract"),
    "ProvisionerState": ("contract", "ProvisionerState"),
    "notebook_path": ("contract", "notebook_path"),
    "GRANT_ENV": ("contract", "GRANT_ENV"),
    "GRANT_ROCM_ENV": ("contract", "GRANT_ROCM_ENV"),
    "LEASE_ENV": ("contract", "LEASE_ENV"),
    "LEASE_FD_ENV": ("contract", "LEASE_FD_ENV"),
    "MOVE_FILE_ENV": ("contract", "MOVE_FILE_ENV"),
    "NOTE_ENV": ("contract", "NOTE_ENV"),
    "ON_NO_DEVICE": ("contract", "ON_NO_DEVICE"),
    "OPTIONS_ENV": ("contract", "OPTIONS_ENV"),
    "PICKED_ENV": ("contract", "PICKED_ENV"),
    "PROVISIONED_ENV": ("contract", "PROVISIONED_ENV"),
    "PROVISIONER_NAME": ("contract", "PROVISIONER_NAME"),
    "ROCM_GRANT_VARS": ("contract", "ROCM_GRANT_VARS"),
    "SERVER_ROOT_ENV": ("contract", "SERVER_ROOT_ENV"),
    "SERVER_CULL_ENV": ("contract", "SERVER_CULL_ENV"),
    "SERVER_CULL_WARNING_ENV": ("contract", "SERVER_CULL_WARNING_ENV"),
    # Moves and overload
    "grant_environ": ("moves", "grant_environ"),
    "best_move_target": ("moves", "best_move_target"),
    "Alternative": ("overload", "Alternative"),
    "Overload": ("overload", "Overload"),
    "Thresholds": ("overload", "Thresholds"),
    "detect_overload": ("overload", "detect"),
    "alternative_constraints": ("overload", "alternative_constraints"),
    "best_alternative": ("overload", "best_alternative"),
    "kernel_device_uuids": ("overload", "kernel_device_uuids"),
    "kernel_grant": ("overload", "kernel_grant"),
    "pending_warning": ("overload", "pending_warning"),
    "reset_pending": ("overload", "reset_pending"),
    "set_move_hint": ("overload", "set_move_hint"),
    # History (the sampler)
    "Sampler": ("sampler", "Sampler"),
    "get_sampler": ("sampler", "get_sampler"),
    "stop_sampler": ("sampler", "stop_sampler"),
    "own_pids": ("sampler", "own_pids"),
    "DeviceSeries": ("sampler", "DeviceSeries"),
    "SAMPLED_METRICS": ("sampler", "METRICS"),
    "series_from_frame": ("sampler", "series_from_frame"),
    # The cluster view (Prometheus)
    "ClusterCache": ("cluster", "ClusterCache"),
    "PrometheusClient": ("cluster", "PrometheusClient"),
    "fetch_cluster": ("cluster", "fetch_cluster"),
    "fetch_history": ("cluster", "fetch_history"),
    "check_history_s": ("cluster", "check_history_s"),
    "rank_hosts": ("cluster", "rank_hosts"),
    # Words and tables for text front ends
    "holders_by_device": ("holders", "holders_by_device"),
    "holders_text": ("holders", "holders_text"),
    "NOBODY": ("words", "NOBODY"),
    "holder_where": ("words", "holder_where"),
    "holder_who": ("words", "holder_who"),
    "holder_memory": ("words", "holder_memory"),
    "asked_text": ("tables", "asked_text"),
    "ranking_lines": ("tables", "ranking_lines"),
    "TableColumn": ("tables", "Column"),
    "narrow_table": ("tables", "narrow"),
    "status_table": ("tables", "status_table"),
    "table_text": ("tables", "to_text"),
    "table_html": ("tables", "to_html"),
    "cell_text": ("tables", "visible"),
    "redact_command": ("text", "redact_command"),
    "terminal_safe": ("text", "terminal_safe"),
    "format_bytes": ("units", "format_bytes"),
    "format_duration": ("units", "format_duration"),
    "current_session": ("session", "current"),
    # Modules read as namespaces (their names are the vocabulary)
    "contract": ("contract", None),
    "decision": ("decision", None),
    "moves": ("moves", None),
    "options": ("options", None),
    "procfs": ("procfs", None),
    "sampler": ("sampler", None),
    "session": ("session", None),
}


def __getattr__(name: str) -> Any:
    # A name loads its module when first asked for (see the module docstring). It is read from
    # its module on every import, never copied here: what a caller imports is what the module
    # holds now, as with an import of the module itself.
    try:
        module, attribute = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'autogpu_jupyter.core' has no attribute {name!r}") from None
    loaded = importlib.import_module(f"autogpu_jupyter.core.{module}")
    return loaded if attribute is None else getattr(loaded, attribute)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
