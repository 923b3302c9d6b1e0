"""The JSON the endpoints answer, built from the shared sampler, the registry and the kernels.

Everything here except :func:`kernel_sessions` is blocking and runs on the state's executor.
Field names carry units (``memory_used_bytes``, ``timestamp_s``); ``None`` is unknown.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from autogpu_jupyter.core import (
    Constraints,
    PickOptions,
    PrometheusClient,
    ProvisionerState,
    fetch_history,
    grant_environ,
    holder_memory,
    holder_where,
    holders_by_device,
    options,
    pick,
)
from autogpu_jupyter.errors import (
    AutoGPUError,
    NoDeviceFitsError,
    NoDeviceGrantedError,
    NVMLUnavailableError,
    UsageErrorBase,
)
from autogpu_jupyter.server.schema import (
    CandidateJSON,
    ClusterAnswer,
    ClusterHistoryAnswer,
    ConstraintsJSON,
    DevicesAnswer,
    HistoryAnswer,
    HistorySeries,
    HolderJSON,
    HoldersAnswer,
    HostHistoryJSON,
    SelectAnswer,
)
from autogpu_jupyter.server.state import (
    KernelSource,
    ServerContext,
    kernel_pid_map,
    owning_kernel,
    redact,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core import Candidate, FleetSnapshot
    from autogpu_jupyter.core.leasing import LeaseStore

from autogpu_jupyter.server.kernels import (  # noqa: F401 (imported from here before the cut)
    Sessions,
    SessionSource,
    _duration,
    _lease_records,
    _overload_summary,
    _str_or_none,
    cull_warnings,
    kernel_activity,
    kernel_allowed_uuids,
    kernel_best_moves,
    kernel_environ,
    kernel_infos,
    kernel_options,
    kernel_overloads,
    kernel_sessions,
    process_environ,
)

__all__ = [
    "devices_payload",
    "history_payload",
    "holders_payload",
    "select_payload",
    "parse_constraints",
    "parse_kernel_id",
    "kernel_sessions",
    "kernel_infos",
    "kernel_activity",
    "gpu_kernel_ids",
    # the kernels' facts, from autogpu_jupyter.server.kernels (imported from here before the cut)
    "SessionSource",
    "Sessions",
    "cull_warnings",
    "kernel_allowed_uuids",
    "kernel_best_moves",
    "kernel_environ",
    "kernel_options",
    "kernel_overloads",
    "process_environ",
]

#: How long a request waits for the sampler's first sweep after the server starts.
FIRST_SAMPLE_WAIT_S = 10.0


class _LatestBackend:
    """A backend whose ``snapshot()`` is the sampler's latest sweep: a select costs no NVML call."""

    def __init__(self, snapshot: FleetSnapshot) -> None:
        self._snapshot = snapshot
        self.name = snapshot.backend
        self.simulated = snapshot.simulated

    def snapshot(self) -> FleetSnapshot:
        return self._snapshot


def latest_snapshot(ctx: ServerContext) -> FleetSnapshot | None:
    """The sampler's latest snapshot, waiting (on the executor) for its first sweep."""
    sampler = ctx.sampler
    if sampler is None:
        return None
    deadline = time.monotonic() + FIRST_SAMPLE_WAIT_S
    snap: FleetSnapshot | None = sampler.latest()
    # A failed first sweep (no driver, a bad fleet file) is an answer too: say it at once
    # rather than hold the request (and the executor thread, which a stopping server joins).
    while snap is None and not sampler.errors and time.monotonic() < deadline:
        time.sleep(0.02)
        snap = sampler.latest()
    return snap


def _sampler_errors(ctx: ServerContext) -> list[str]:
    errors: list[str] = []
    if ctx.sampler_error:
        errors.append(ctx.sampler_error)
    sampler = ctx.sampler
    if sampler is None or not sampler.errors:
        return errors
    last = sampler.errors[-1]
    latest = sampler.latest()
    # Only a failure newer than the newest good sweep is current; older ones healed.
    if latest is None or last.timestamp_s >= latest.timestamp_s:
        errors.append(last.message)
    return errors


def devices_payload(ctx: ServerContext) -> DevicesAnswer:
    """``GET devices``: ``FleetSnapshot.to_dict()`` plus the sampling interval.

    Other users' process command lines are ``null`` unless ``expose_commands``.
    """
    snap = latest_snapshot(ctx)
    errors = _sampler_errors(ctx)
    if snap is None:
        return {
            "timestamp_s": time.time(),
            "backend": None,
            "simulated": False,
            "driver_version": None,
            "errors": errors or ["no sample yet"],
            "devices": [],
            "interval_s": ctx.interval_s,
        }
    # FleetSnapshot.to_dict is core's (untyped) JSON; schema.DeviceJSON names its fields
    # (tests/unit/test_wire_schema.py holds the two together)
    payload = cast("DevicesAnswer", {**snap.to_dict(), "interval_s": ctx.interval_s})
    for dev in payload["devices"]:
        for proc in dev["processes"] or ():
            proc["command"] = redact(proc["user"], proc["command"], ctx.user, ctx.expose_commands)
    payload["errors"] = list(payload["errors"]) + [e for e in errors if e not in payload["errors"]]
    return payload


def _finite(value: object) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)  # type: ignore[arg-type]  # a pandas cell: any number, NaN, None
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _int_or_none(value: object) -> int | None:
    f = _finite(value)
    return None if f is None else int(f)


def history_payload(ctx: ServerContext, since_s: float | None) -> HistoryAnswer:
    """``GET history``: one series per device (oldest first), newer than ``since_s``.

    Each series holds at most ``max_history_points`` samples (the newest).
    """
    sampler = ctx.sampler
    out: HistoryAnswer = {
        "interval_s": ctx.interval_s,
        "history_s": ctx.history_s,
        "since_s": since_s,
        "until_s": since_s,
        "series": [],
        "errors": _sampler_errors(ctx),
    }
    if sampler is None:
        return out
    latest = sampler.latest()
    window_s = None
    if since_s is not None and latest is not None:
        # history_frame takes a window relative to the newest sample; ``since`` is absolute.
        window_s = max(latest.timestamp_s - since_s, 0.0) + ctx.interval_s
    frame = sampler.history_frame(since_s=window_s)
    if len(frame) == 0:
        return out
    if since_s is not None:  # ``since`` is exclusive: the client passes its last timestamp
        frame = frame[frame["timestamp_s"] > since_s]
    cap = max(1, ctx.max_history_points)
    series: list[HistorySeries] = []
    until = since_s
    for uuid, rows in frame.groupby("uuid", sort=False):
        group = rows.sort_values("timestamp_s").tail(cap)
        ts = [float(t) for t in group["timestamp_s"]]
        total = group["memory_total_bytes"].dropna()
        series.append(
            {
                "uuid": str(uuid),
                "timestamp_s": ts,
                "utilization_pct": [_finite(v) for v in group["utilization_pct"]],
                "memory_used_bytes": [_int_or_none(v) for v in group["memory_used_bytes"]],
                "memory_total_bytes": _int_or_none(total.iloc[-1]) if len(total) else None,
            }
        )
        if ts and (until is None or ts[-1] > until):
            until = ts[-1]
    out["series"] = series
    out["until_s"] = until
    return out


def holders_payload(
    ctx: ServerContext, kernel_manager: KernelSource | None, sessions: Sessions
) -> HoldersAnswer:
    """``GET holders``: per device, who holds it, joined by :mod:`core.holders` (the one holder
    model of ``%gpu``, the panel and ``autogpu list``): a lease, a GPU process, or both matched
    by pid (``kind`` ``lease``, ``process``, ``lease+process``), each with the memory it books
    and uses. The sidebar only sorts and renders them.

    What only the server knows is added: a process in one of this server's kernels' process
    trees (or a lease of this server's uid naming one of its kernels) is ``this_server``, with
    that kernel's id and its session's notebook path.
    """
    snap = latest_snapshot(ctx)
    errors = _sampler_errors(ctx)
    kernel_pids = kernel_pid_map(kernel_manager) if kernel_manager is not None else {}
    our_kernels = set(kernel_pids.values())
    if kernel_manager is not None:
        our_kernels.update(kernel_manager.list_kernel_ids())
    everything, lease_errors = _lease_records(ctx, include_tickets=True)
    server_uid = os.geteuid()
    for e in lease_errors:
        if e not in errors:
            errors.append(e)
    records = [r for r in everything if r.kind == "lease"]
    # kernels in line for a GPU (a --wait pick): the sidebar tells when their wait ends
    # (only our own uid's tickets: another user could write a ticket naming our kernel ids)
    waiting = {
        r.kernel_id
        for r in everything
        if r.kind == "ticket" and r.kernel_id and r.uid == server_uid
    }
    holders: list[HolderJSON] = []
    if snap is not None:
        kernel_of_pid = {}
        for dev in snap.devices:
            for proc in dev.processes or ():
                kid = owning_kernel(proc.pid, kernel_pids)
                if kid is not None:
                    kernel_of_pid[proc.pid] = kid
        paths = {k: str(v["path"]) for k, v in sessions.items() if v.get("path")}
        by_lease = {r.lease_id: r for r in records}
        joined = holders_by_device(snap, records, kernel_of_pid=kernel_of_pid)
        for dev in snap.devices:
            procs = {p.pid: p for p in dev.processes or ()}
            for h in joined[dev.uuid]:
                rec = by_lease.get(h.lease_id) if h.lease_id is not None else None
                # A lease's kernel id is what its writer claims: only a lease of this server's
                # own uid can be one of this server's kernels (another user could copy our ids).
                # A process found in one of our kernels' process trees is ours whoever wrote.
                ours = kernel_of_pid.get(h.pid) if h.pid in procs else None
                if ours is None and rec is not None and rec.uid == server_uid and (
                    rec.kernel_id in our_kernels
                ):
                    ours = rec.kernel_id
                process = procs.get(h.pid) if h.pid is not None else None
                command = rec.command if rec is not None else None
                if command is None and process is not None:
                    command = process.command
                kernel_id = ours or h.kernel_id
                notebook = (paths.get(ours) if ours else None) or h.notebook_path
                holders.append(
                    {
                        "kind": h.kind,
                        "uuid": dev.uuid,
                        "label": dev.label,
                        "user": h.user,
                        "pid": h.pid,
                        "kernel_id": kernel_id,
                        "this_server": ours is not None,
                        "notebook_path": notebook,
                        "booked_bytes": h.booked_bytes,
                        "used_memory_bytes": h.used_memory_bytes,
                        "exclusive": h.exclusive,
                        "created_s": rec.created_s if rec is not None else None,
                        "command": redact(h.user, command, ctx.user, ctx.expose_commands),
                        "where": holder_where(notebook, kernel_id, h.pid) or "?",
                        "memory_text": holder_memory(
                            h.booked_bytes, h.used_memory_bytes, h.exclusive
                        ),
                    }
                )
    # each kernel's environment as it started: its allocation, the grant it would move within
    environs = {kid: process_environ(pid) for pid, kid in kernel_pids.items()}
    kernels = (
        kernel_infos(kernel_manager, sessions, snap, environs)
        if kernel_manager is not None
        else []
    )
    overloads = kernel_overloads(
        ctx, kernels, holders, snap, records, kernel_options(kernel_manager), environs
    )
    best_moves = kernel_best_moves(ctx, kernels, snap, kernel_options(kernel_manager))
    held_labels: dict[str, list[str]] = {}
    for entry in holders:
        kid = entry["kernel_id"]
        if entry["this_server"] and kid and entry["label"] not in held_labels.get(kid, []):
            held_labels.setdefault(kid, []).append(entry["label"])
    warnings = cull_warnings(ctx, kernel_manager, kernels, held_labels, snap)
    for info in kernels:
        found = overloads.get(info["kernel_id"])
        info["overload"] = found[0] if found else None
        info["better"] = found[1] if found else None
        info["waiting"] = info["kernel_id"] in waiting
        better = info["better"]
        # an overloaded kernel is offered the overload's better device (the warning's, the
        # notification's), named; else where the move plan for "best" would go
        info["best_move"] = (
            {"target": better["uuid"], "uuids": [better["uuid"]], "labels": [better["label"]]}
            if better is not None and info.get("movable")
            else best_moves.get(info["kernel_id"])
        )
        info["cull_warning"] = warnings.get(info["kernel_id"])
    return {
        "timestamp_s": snap.timestamp_s if snap is not None else time.time(),
        "simulated": snap.simulated if snap is not None else False,
        "user": ctx.user,
        "holders": holders,
        "kernels": kernels,
        "errors": errors,
    }


_SELECT_EXTRA = ("kernel_id",)


#: The largest request body a handler reads (a pick's options fit in a few hundred bytes).
MAX_BODY_BYTES = 64 * 1024


def parse_json_object(body: bytes | None, example: str) -> dict[str, object]:
    """A request body as a JSON object, bounded in size and depth.

    Raises
    ------
    UsageErrorBase
        Too large, not JSON, nested too deeply, or not an object; the message shows ``example``.
    """
    data = body or b"{}"
    if len(data) > MAX_BODY_BYTES:
        raise UsageErrorBase(
            f"request body too large ({len(data)} bytes, at most {MAX_BODY_BYTES}); expected a "
            f"small JSON object such as {example}"
        )
    try:
        value = json.loads(data)
    except RecursionError:
        raise UsageErrorBase(
            f"request body nested too deeply; expected a flat JSON object such as {example}"
        ) from None
    except ValueError:
        raise UsageErrorBase(
            f"request body is not JSON; expected an object such as {example}"
        ) from None
    if not isinstance(value, dict):
        raise UsageErrorBase(
            f"expected a JSON object such as {example}, got {short_repr(value)}"
        )
    return value


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (a message must stay one readable line)."""
    r = (
        repr(value)
        if not isinstance(value, (list, dict)) or len(value) < 20
        else type(value).__name__
    )
    return r if len(r) <= limit else r[: limit - 12] + "…" + r[-10:]


def parse_constraints(params: Mapping[str, object]) -> Constraints:
    """Constraints from query arguments or a JSON body: the one options boundary
    (:func:`autogpu_jupyter.core.options.parse`, JSON-style names), the magic's units and
    messages. ``kernel_id`` is accepted and left to :func:`parse_kernel_id`."""
    accept = [o.key for o in options.PICK_OPTIONS if o.key != "wait"]  # a dry run never waits
    return options.parse(params, style="key", ignore=_SELECT_EXTRA, accept=accept).constraints


def _candidate_json(c: Candidate) -> CandidateJSON:
    return {
        "uuid": c.device.uuid,
        "label": c.device.label,
        "name": c.device.name,
        "eligible": c.eligible,
        "reasons": list(c.reasons),
        "effective_free_bytes": c.effective_free_bytes,
        "smoothed_util_pct": c.smoothed_util_pct,
        "lease_count": c.lease_count,
    }


#: Kernel ids as Jupyter makes them (UUIDs), and as the move-request files accept them.
_KERNEL_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def parse_kernel_id(value: object) -> str | None:
    """The ``kernel_id`` parameter of ``select``: ``None`` when absent, else a safe id."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not _KERNEL_ID.fullmatch(value):
        raise UsageErrorBase(
            f"invalid kernel_id {value!r}: expected a kernel id such as "
            "'5e6f7a8b-1c2d-4e5f-8a9b-0c1d2e3f4a5b'"
        )
    return value


def select_payload(
    ctx: ServerContext,
    constraints: Constraints,
    ignore_kernel_id: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> SelectAnswer:
    """``select``: :func:`select_answer` over the sampler's latest sweep and the registry.

    A request nothing fits is a normal answer (``chosen`` empty, ``message`` says why), not an
    HTTP error. The registry is read for bookings, never written. ``ignore_kernel_id``: the
    leases of that kernel (of this server's user) are left out of the bookings, so that a
    notebook's recommendation does not count its own lease against the device it holds.
    ``environ``: that kernel's environment as it started, whose allocation bounds the answer (a
    notebook is never recommended a GPU its kernel cannot use); default the server's.
    """
    snap = latest_snapshot(ctx)
    if snap is None:
        raise NVMLUnavailableError(
            "no GPU data: " + ("; ".join(_sampler_errors(ctx)) or "the sampler has no sample yet")
        )
    sampler = ctx.sampler
    smoothed = None
    if sampler is not None and hasattr(sampler, "smoothed_util"):
        smoothed = sampler.smoothed_util(ctx.smoothing_window_s)
    registry = None
    notes: list[str] = []
    try:
        registry = ctx.store()
    except (AutoGPUError, OSError) as err:
        notes.append(f"lease registry unusable, bookings not counted: {err}")
    if environ is not None:
        environ = grant_environ(environ)
    return select_answer(
        snap, constraints, registry, smoothed, ignore_kernel_id, notes, environ=environ
    )


def select_answer(
    snap: FleetSnapshot,
    constraints: Constraints,
    registry: LeaseStore | None,
    smoothed: dict[str, float | None] | None = None,
    ignore_kernel_id: str | None = None,
    notes: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> SelectAnswer:
    """The ``select`` answer for ``snap``: a dry-run pick through the one decision pipeline."""
    backend = _LatestBackend(snap)
    notes = [] if notes is None else notes
    base: SelectAnswer = {
        "constraints": _constraints_json(constraints),
        "constraints_text": constraints.describe(),
        "simulated": snap.simulated,
        "timestamp_s": snap.timestamp_s,
        "notes": notes,
        "chosen": [],
        "candidates": [],
        "message": None,
    }
    if registry is not None and ignore_kernel_id is not None:
        registry = registry.hiding(kernel_id=ignore_kernel_id)
    try:
        result = pick(
            PickOptions(constraints), backend=backend, store=registry, dry_run=True,
            smoothed_util=smoothed, environ=environ,
        )
    except NoDeviceFitsError as err:
        candidates = err.candidates if isinstance(err.candidates, tuple) else ()
        base["candidates"] = [_candidate_json(c) for c in candidates]
        base["message"] = str(err).splitlines()[0]
        return base
    except NoDeviceGrantedError as err:  # the server's own allocation grants no GPU
        base["message"] = str(err)
        return base
    base["chosen"] = [{"uuid": d.uuid, "label": d.label, "name": d.name} for d in result.chosen]
    base["candidates"] = [_candidate_json(c) for c in result.candidates]
    base["allocation"] = result.allocation.describe()
    return base


def _constraints_json(constraints: Constraints) -> ConstraintsJSON:
    """``Constraints.to_json`` (core's untyped JSON) as the wire's type; schema.ConstraintsJSON
    names its fields (tests/unit/test_wire_schema.py holds the two together)."""
    return cast("ConstraintsJSON", constraints.to_json())


def cluster_payload(ctx: ServerContext, constraints: Constraints) -> ClusterAnswer:
    """``GET cluster``: every host Prometheus holds (``core.cluster.fetch_cluster``), ranked for
    ``constraints`` by the local pick's policy (``rank_hosts``). The view is the server's
    shared one (``core.cluster.ClusterCache``: Prometheus is asked at most once per half scrape
    interval however many sidebars poll), and so is its ranking for the same constraints.

    ``configured`` is false when ``c.AutoGPU.prometheus_url`` is empty; a Prometheus that cannot
    be asked gives no hosts and the reason in ``errors`` (the sidebar shows it).
    """
    settings = ctx.settings()
    url = settings.prometheus_url
    base: ClusterAnswer = {
        "configured": bool(url),
        "prometheus_url": url or None,
        "timestamp_s": time.time(),
        "constraints": _constraints_json(constraints),
        "constraints_text": constraints.describe(),
        "hosts": [],
        "ranking": [],
        "best": None,
        "errors": [],
    }
    if not url or ctx.cluster_cache is None:
        return base
    try:
        # shared by every sidebar: Prometheus is asked at most once per half scrape interval
        cached = ctx.cluster_cache.get(url, settings.prometheus_timeout_s)
    except AutoGPUError as err:
        base["errors"] = [str(err)]
        return base
    choices = cached.ranking(constraints)
    # ClusterView.to_dict: prometheus_url, timestamp_s, hosts (schema.ClusterHostJSON), errors
    view = cached.as_dict
    base["prometheus_url"] = view["prometheus_url"]
    base["timestamp_s"] = view["timestamp_s"]
    base["hosts"] = view["hosts"]
    base["errors"] = view["errors"]
    base["ranking"] = [
        {
            "hostname": c.host.hostname,
            "fits": c.fits,
            "chosen": [
                {"uuid": x.device.uuid, "label": x.device.label,
                 "effective_free_bytes": x.effective_free_bytes}
                for x in c.chosen
            ],
        }
        for c in choices
    ]
    base["best"] = choices[0].host.hostname if choices and choices[0].fits else None
    return base


def cluster_history_payload(ctx: ServerContext, seconds: float) -> ClusterHistoryAnswer:
    """``GET cluster/history?seconds=<s>``: each host's mean GPU utilisation and memory taken
    over the last ``seconds`` from Prometheus range queries (``core.cluster.fetch_history``)."""
    settings = ctx.settings()
    url = settings.prometheus_url
    base: ClusterHistoryAnswer = {
        "configured": bool(url),
        "prometheus_url": url or None,
        "seconds": seconds,
        "step_s": None,
        "hosts": [],
        "errors": [],
    }
    if not url:
        return base
    client = PrometheusClient(url, settings.prometheus_timeout_s)
    try:
        step, histories = fetch_history(client, seconds)
    except AutoGPUError as err:
        base["errors"] = [str(err)]
        return base
    base["step_s"] = step
    base["hosts"] = [_host_history_json(h.to_dict()) for h in histories]
    if client.rejected:  # a target's +Inf or NaN: left out of the history, and said so
        base["errors"] = [f"{len(client.rejected)} series had points that are not finite "
                          f"numbers, left out (e.g. {client.rejected[0].text()})"]
    return base



def _host_history_json(host: Mapping[str, object]) -> HostHistoryJSON:
    """``HostHistory.to_dict`` (core's untyped JSON) as the wire's type."""
    return cast("HostHistoryJSON", host)


def gpu_kernel_ids(ctx: ServerContext, kernel_manager: KernelSource) -> set[str]:
    """This server's kernels that hold a GPU: a live lease naming the kernel, a GPU process in
    the kernel's process tree (NVML), or the autogpu provisioner's pick at its start."""
    held: set[str] = set()
    ours = set(kernel_manager.list_kernel_ids())
    records, _ = _lease_records(ctx)
    # a lease's kernel id is its writer's claim: only our own uid's leases count, so that
    # another user cannot get one of our kernels culled early by naming it
    uid = os.geteuid()
    held.update(rec.kernel_id for rec in records if rec.kernel_id in ours and rec.uid == uid)
    snap = latest_snapshot(ctx)
    if snap is not None:
        pids = kernel_pid_map(kernel_manager)
        for dev in snap.devices:
            for proc in dev.processes or ():
                kid = owning_kernel(proc.pid, pids)
                if kid is not None:
                    held.add(kid)
    for kid in ours:
        try:
            prov = getattr(kernel_manager.get_kernel(kid), "provisioner", None)
        except KeyError:
            continue
        if isinstance(prov, ProvisionerState) and prov.autogpu_picked:
            held.add(kid)
    return held
