"""The wire to the browser: one ``TypedDict`` per JSON answer of the REST endpoints.

Field names and units are the wire's (``memory_used_bytes``, ``timestamp_s``, ``utilization_pct``);
``None`` (``null``) is unknown. The payload functions (:mod:`.payloads`, :mod:`.moving`) return
these types, ``labextension/src/schema.ts`` is generated from them and the field lists of
docs/rest.md too (``scripts/wire_schema.py --write``; ``tests/unit/test_docs.py`` fails when
either is stale). :data:`ENDPOINTS` names the answer of each endpoint, in docs/rest.md's order.

Only types here: no import beyond ``typing``, so the generator reads it without a server.
"""

from __future__ import annotations

from typing import Literal, TypedDict

__all__ = [
    "ENDPOINTS",
    "BetterDevice",
    "CandidateJSON",
    "CancelAnswer",
    "ChosenDevice",
    "ClusterAnswer",
    "ClusterDeviceJSON",
    "ClusterHistoryAnswer",
    "ClusterHostJSON",
    "ConstraintsJSON",
    "DeviceJSON",
    "DevicesAnswer",
    "ErrorAnswer",
    "HistoryAnswer",
    "HistorySeries",
    "HolderJSON",
    "HoldersAnswer",
    "HostHistoryJSON",
    "HostRank",
    "KernelJSON",
    "MoveAnswer",
    "ProcessJSON",
    "RankedDevice",
    "SelectAnswer",
    "SizeJSON",
]


# -- GET devices -------------------------------------------------------------------------------


class ProcessJSON(TypedDict):
    """A compute process on a device (``command`` is ``null`` for another user's unless the
    admin exposes commands)."""

    pid: int
    used_memory_bytes: int | None
    user: str | None
    command: str | None


class DeviceJSON(TypedDict):
    """One device of the latest sweep (``core.devices.DeviceSnapshot.to_dict``)."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    memory_free_bytes: int | None
    utilization_pct: float | None
    memory_utilization_pct: float | None
    temperature_c: float | None
    power_w: float | None
    power_limit_w: float | None
    compute_mode: str | None
    mig_enabled: bool | None
    is_mig: bool
    parent_uuid: str | None
    mig_index: int | None
    processes: list[ProcessJSON] | None
    available: bool
    error: str | None
    vendor: str
    runtime_uuid: str | None
    timestamp_s: float
    label: str


class DevicesAnswer(TypedDict):
    """``GET devices``: the shared sampler's latest sweep and its interval."""

    timestamp_s: float
    backend: str | None
    simulated: bool
    driver_version: str | None
    errors: list[str]
    devices: list[DeviceJSON]
    interval_s: float


# -- GET history -------------------------------------------------------------------------------


class HistorySeries(TypedDict):
    """One device's samples, oldest first (the lists are parallel)."""

    uuid: str
    timestamp_s: list[float]
    utilization_pct: list[float | None]
    memory_used_bytes: list[int | None]
    memory_total_bytes: int | None


class HistoryAnswer(TypedDict):
    """``GET history?since=<unix s>``: samples strictly newer than ``since_s``; pass ``until_s``
    as the next ``since``."""

    interval_s: float
    history_s: float
    since_s: float | None
    until_s: float | None
    series: list[HistorySeries]
    errors: list[str]


# -- GET holders -------------------------------------------------------------------------------


class HolderJSON(TypedDict):
    """Who holds a device: a lease, a GPU process, or both matched by pid."""

    kind: Literal["lease", "process", "lease+process"]
    uuid: str
    label: str
    user: str | None
    pid: int | None
    kernel_id: str | None
    this_server: bool
    notebook_path: str | None
    booked_bytes: int | None
    used_memory_bytes: int | None
    exclusive: bool
    created_s: float | None
    command: str | None
    #: The holder in words, as every view says it (``core/words.py``): ``train.ipynb``,
    #: ``kernel 1a2b3c4d`` or ``pid 4242``; the sidebar shows it as is.
    where: str
    #: ``10.0 GiB booked, 3.2 GiB used, exclusive`` (what is known; ``""`` when nothing).
    memory_text: str


class BetterDevice(TypedDict):
    """The device an overload warning names as better."""

    uuid: str
    label: str


class BestMoveJSON(TypedDict):
    """Where "Move to best GPU" would take a movable kernel now (only when elsewhere):
    ``target`` as the move endpoint takes it, and the devices' UUIDs and labels."""

    target: str
    uuids: list[str]
    labels: list[str]


class KernelJSON(TypedDict):
    """One of this server's kernels."""

    kernel_id: str
    notebook_path: str | None
    execution_state: str | None
    idle_s: float | None
    movable: bool
    picked_uuids: list[str]
    constraints_text: str | None
    note: str | None
    allowed_uuids: list[str] | None
    overload: str | None
    better: BetterDevice | None
    waiting: bool
    #: where a move to the best device would take it (``None``: it is on the best device)
    best_move: BestMoveJSON | None
    #: the warning that the server will soon cull this idle kernel and free its GPU
    cull_warning: str | None


class HoldersAnswer(TypedDict):
    """``GET holders``: every holder of every device, and this server's kernels."""

    timestamp_s: float
    simulated: bool
    user: str
    holders: list[HolderJSON]
    kernels: list[KernelJSON]
    errors: list[str]


# -- GET|POST select ---------------------------------------------------------------------------


class SizeJSON(TypedDict):
    """A memory requirement: bytes, or a fraction of the device's total; ``text`` as typed."""

    bytes: int | None
    fraction: float | None
    text: str


class ConstraintsJSON(TypedDict):
    """The pick options a ranking was asked for (``core.policy.Constraints.to_json``)."""

    min_free: SizeJSON | None
    max_util_pct: float | None
    count: int
    exclude: list[str]
    exclusive: bool
    models: list[str]
    prefer: list[str]
    #: the devices the pick was restricted to, as named (index, UUID, label, MIG id; issue 41)
    devices: list[str]


class ChosenDevice(TypedDict):
    """A device a dry-run pick would choose."""

    uuid: str
    label: str
    name: str


class CandidateJSON(TypedDict):
    """A device as the policy ranked it, with the reasons it was kept or dropped."""

    uuid: str
    label: str
    name: str
    eligible: bool
    reasons: list[str]
    effective_free_bytes: int | None
    smoothed_util_pct: float | None
    lease_count: int


class _SelectFields(TypedDict):
    constraints: ConstraintsJSON
    constraints_text: str
    simulated: bool
    timestamp_s: float
    notes: list[str]
    chosen: list[ChosenDevice]
    candidates: list[CandidateJSON]
    message: str | None


class SelectAnswer(_SelectFields, total=False):
    """``GET|POST select``: a dry-run pick. Nothing fits: ``chosen`` empty, ``message`` why;
    ``allocation`` only when a device was chosen (Python 3.10 has no ``NotRequired``)."""

    allocation: str


# -- GET cluster, GET cluster/history ----------------------------------------------------------


class ClusterDeviceJSON(TypedDict):
    """One GPU of a cluster host, from Prometheus."""

    uuid: str
    index: int
    mig_index: int | None
    label: str
    name: str
    available: bool
    source: str
    utilization_pct: float | None
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    memory_free_bytes: int | None
    memory_booked_bytes: int
    temperature_c: float | None
    power_w: float | None
    lease_count: int
    waiters: int
    holders: list[str]


class ClusterHostJSON(TypedDict):
    """One host; ``state`` is ``ok``, ``stale`` or ``down``; ``as_of_s`` its newest sample."""

    hostname: str
    instances: list[str]
    state: str
    as_of_s: float | None
    scrape_interval_s: float
    note: str | None
    devices: list[ClusterDeviceJSON]


class RankedDevice(TypedDict):
    """A device a host's ranking would choose."""

    uuid: str
    label: str
    effective_free_bytes: int | None


class HostRank(TypedDict):
    """A host in ranking order: whether the constraints fit there, and on which devices."""

    hostname: str
    fits: bool
    chosen: list[RankedDevice]


class ClusterAnswer(TypedDict):
    """``GET cluster``: every host Prometheus holds, ranked for the constraints."""

    configured: bool
    prometheus_url: str | None
    timestamp_s: float
    constraints: ConstraintsJSON
    constraints_text: str
    hosts: list[ClusterHostJSON]
    ranking: list[HostRank]
    best: str | None
    errors: list[str]


class HostHistoryJSON(TypedDict):
    """A host's mean GPU load per step, oldest first (``null``: no sample at that step)."""

    hostname: str
    source: str
    timestamps_s: list[float]
    utilization_pct: list[float | None]
    memory_used_pct: list[float | None]


class ClusterHistoryAnswer(TypedDict):
    """``GET cluster/history?seconds=<s>``."""

    configured: bool
    prometheus_url: str | None
    seconds: float
    step_s: float | None
    hosts: list[HostHistoryJSON]
    errors: list[str]


# -- kernels/<kernel_id>/move ------------------------------------------------------------------


class MoveAnswer(TypedDict):
    """``POST`` and ``GET kernels/<kernel_id>/move``: ``target`` the planned UUIDs, ``picked``
    where the restarted kernel runs (``null`` while the move waits or for a dry run)."""

    dry_run: bool
    pending: bool
    plan: str
    target: list[str]
    target_labels: list[str]
    message: str
    picked: list[str] | None
    note: str | None


class CancelAnswer(TypedDict):
    """``DELETE kernels/<kernel_id>/move``: whether a recorded move was dropped."""

    cancelled: bool


class ErrorAnswer(TypedDict):
    """Any 4xx/5xx answer: the message for people and the HTTP reason phrase."""

    message: str
    reason: str | None


#: (method and path, answer type) of each endpoint, in docs/rest.md's order.
ENDPOINTS: tuple[tuple[str, type], ...] = (
    ("GET devices", DevicesAnswer),
    ("GET history", HistoryAnswer),
    ("GET holders", HoldersAnswer),
    ("GET|POST select", SelectAnswer),
    ("GET cluster", ClusterAnswer),
    ("GET cluster/history", ClusterHistoryAnswer),
    ("POST|GET kernels/<kernel_id>/move", MoveAnswer),
    ("DELETE kernels/<kernel_id>/move", CancelAnswer),
    ("any error (4xx, 5xx)", ErrorAnswer),
)
