"""What the server knows of its kernels: their sessions, environments, activity, overloads,
best moves and cull warnings, and which of them hold a GPU.

The answers in :mod:`autogpu_jupyter.server.payloads` read these (the holders answer lists every
kernel with them). Everything here except :func:`kernel_sessions` is blocking and runs on the
state's executor.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from traitlets import TraitError

from autogpu_jupyter.core import (
    Constraints,
    ProvisionerState,
    Thresholds,
    alternative_constraints,
    best_alternative,
    best_move_target,
    current_allocation,
    grant_environ,
    kernel_grant,
)
from autogpu_jupyter.core import detect_overload as detect
from autogpu_jupyter.errors import (
    AutoGPUError,
)
from autogpu_jupyter.server.schema import (
    BestMoveJSON,
    BetterDevice,
    HolderJSON,
    KernelJSON,
)
from autogpu_jupyter.server.state import (
    KernelSource,
    ServerContext,
    kernel_pid_map,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core import Alternative, FleetSnapshot, Overload
    from autogpu_jupyter.core.leasing import LeaseRecord

__all__ = [
    "SessionSource",
    "Sessions",
    "kernel_sessions",
    "kernel_infos",
    "kernel_activity",
    "kernel_options",
    "kernel_environ",
    "kernel_allowed_uuids",
    "process_environ",
    "kernel_overloads",
    "kernel_best_moves",
    "cull_warnings",
]


class SessionSource(Protocol):
    """What :func:`kernel_sessions` reads of jupyter_server's ``SessionManager``."""

    async def list_sessions(self) -> list[dict[str, Any]]: ...  # jupyter_server's JSON


#: Kernel id -> its session's ``path``, ``name`` and ``type`` (``None`` where not said).
Sessions = Mapping[str, Mapping[str, "str | None"]]


async def kernel_sessions(
    session_manager: SessionSource | None,
) -> dict[str, dict[str, str | None]]:
    """Kernel id -> ``{"path", "name", "type"}`` of this server's sessions (notebooks, consoles)."""
    out: dict[str, dict[str, str | None]] = {}
    if session_manager is None:
        return out
    for session in await session_manager.list_sessions():
        kernel = session.get("kernel") or {}
        kid = kernel.get("id")
        if kid:
            out[kid] = {key: _str_or_none(session.get(key)) for key in ("path", "name", "type")}
    return out


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _lease_records(
    ctx: ServerContext, include_tickets: bool = False
) -> tuple[list[LeaseRecord], list[str]]:
    try:
        registry = ctx.store()
        if registry is None:
            return [], []
        return registry.list_leases(include_tickets=include_tickets), []
    except AutoGPUError as err:
        return [], [f"lease registry: {err}"]
    except OSError as err:
        return [], [f"lease registry {ctx.registry_dir!r}: {err.strerror or err}"]


def _duration(seconds: float, countdown: bool = True) -> str:
    """``4 min``, ``2 h 5 min``; a countdown (rounded up) under a minute is ``less than a
    minute``, a length (rounded) ``45 s``."""
    if countdown and seconds <= 60:
        return "less than a minute"
    if not countdown and seconds < 59.5:
        return f"{round(seconds)} s"
    minutes = math.ceil(seconds / 60) if countdown else round(seconds / 60)
    if minutes < 120:
        return f"{minutes} min"
    hours, rest = divmod(minutes, 60)
    return f"{hours} h {rest} min" if rest else f"{hours} h"


def cull_warnings(
    ctx: ServerContext,
    kernel_manager: Any,
    kernels: Sequence[KernelJSON],
    held_labels: Mapping[str, Sequence[str]],
    snap: FleetSnapshot | None,
) -> dict[str, str]:
    """Kernel id -> the warning that the server will soon shut the idle kernel down and free
    its GPU (``c.AutoGPUServer.cull_idle_gpu_kernels_s``, :mod:`server.culling`), for the
    kernels that hold a GPU and are within ``cull_warning_s`` of their limit. The sidebar and
    the status bar show it as a notification (at most 140 characters, as JupyterLab keeps).

    It follows jupyter_server's culler, which judges these kernels: only an idle kernel is
    culled (``idle_s``, from its ``last_activity``), a busy one only with ``cull_busy``, a
    kernel with open connections only with ``cull_connected``.
    """
    if kernel_manager is None or not kernels:
        return {}
    lead = ctx.cull_warning_lead_s
    if lead <= 0:
        return {}
    limit = float(ctx.cull_idle_gpu_kernels_s)
    connected = bool(getattr(kernel_manager, "cull_connected", False))
    # jupyter_server's own count of each kernel's open websockets (what its culler reads)
    connections = getattr(kernel_manager, "_kernel_connections", None) or {}
    labels_of = {d.uuid: d.label for d in snap.devices} if snap is not None else {}
    out: dict[str, str] = {}
    for info in kernels:
        kid = info["kernel_id"]
        idle_s = info.get("idle_s")
        named = list(held_labels.get(kid) or ())
        try:  # the provisioner's pick counts, as for the culler (gpu_kernel_ids)
            prov = getattr(kernel_manager.get_kernel(kid), "provisioner", None)
        except KeyError:
            continue
        picked = prov.autogpu_picked if isinstance(prov, ProvisionerState) else None
        for uuid in picked or ():
            if labels_of.get(uuid, uuid) not in named:
                named.append(labels_of.get(uuid, uuid))
        label = ", ".join(named)
        if not label or idle_s is None:  # no GPU, or not idle (busy, starting, unknown)
            continue
        if not connected and connections.get(kid, 0) > 0:
            continue  # open in a browser: jupyter_server's culler leaves it alone
        remaining = limit - float(idle_s)
        if remaining > lead:
            continue
        out[kid] = (
            f"{label}: this idle kernel will be shut down in {_duration(remaining)} (idle "
            f"limit {_duration(limit, countdown=False)}), freeing the GPU. Run any cell to keep it."
        )
    return out


def kernel_best_moves(
    ctx: ServerContext,
    kernels: Sequence[KernelJSON],
    snap: FleetSnapshot | None,
    options: Mapping[str, Constraints],
) -> dict[str, BestMoveJSON]:
    """Kernel id -> ``{"target": "best", "uuids", "labels"}`` for this server's movable kernels
    that a move to "the best device" would take elsewhere now: the move plan's own question
    (:func:`core.moves.best_move_target`: the kernel's options, its own lease hidden, the
    server's grant and smoothing) over the latest sweep. A kernel on the best device already
    is not listed: the sidebar offers "Move to best GPU" only to the listed ones (issue 41's
    ping-pong: the best device's own card offered a move away from it)."""
    movable = [k for k in kernels if k.get("movable") and k.get("picked_uuids")]
    if snap is None or not movable:
        return {}
    sampler = ctx.sampler
    smoothed = None if sampler is None else sampler.smoothed_util(ctx.smoothing_window_s)
    try:
        registry = ctx.store()
    except (AutoGPUError, OSError):
        registry = None
    out: dict[str, BestMoveJSON] = {}
    for info in movable:
        kid = info["kernel_id"]
        try:
            target = best_move_target(
                snap, info["picked_uuids"], options.get(kid) or Constraints(),
                store=None if registry is None else registry.hiding(kernel_id=kid),
                smoothed_util=smoothed,
            )
        except (AutoGPUError, OSError):  # the registry unreadable: no offer, the errors say why
            continue
        if target:
            out[kid] = {
                "target": "best",
                "uuids": [d.uuid for d in target],
                "labels": [d.label for d in target],
            }
    return out


def kernel_overloads(
    ctx: ServerContext,
    kernels: Sequence[KernelJSON],
    holders: Sequence[HolderJSON],
    snap: FleetSnapshot | None,
    records: Sequence[LeaseRecord] = (),
    options: Mapping[str, Constraints] | None = None,
    environs: Mapping[str, Mapping[str, str] | None] | None = None,
) -> dict[str, tuple[str, BetterDevice | None]]:
    """Kernel id -> the overload warning for the GPU(s) it holds (the panel's own words, from
    :func:`core.overload.detect` over the server's sampler history) and the better device, for
    this server's kernels whose GPU other processes overload. The sidebar turns the warning
    into a JupyterLab notification and names the same better device on top.

    The better device is asked as the kernel itself asks it
    (:func:`core.overload.best_alternative` with :func:`~core.overload.alternative_constraints`
    of the kernel's lease, the kernel's own lease hidden, the server's grant), so the warning
    printed in the notebook, the notification and the sidebar name the same device. The grant
    is the kernel's own (its environment as it started, from ``environs``), else the server's.

    Each kernel's question is ranked once per request (:func:`core.decision.decide` through
    ``best_alternative``), however many of its devices are overloaded: :func:`core.overload.detect`
    asks it once per overloaded device, with the same devices.
    """
    sampler = ctx.sampler
    if snap is None or sampler is None or not kernels:
        return {}
    held: dict[str, list[str]] = {}
    own: dict[str, set[int]] = {}
    for h in holders:
        kid = h["kernel_id"]
        if not kid or not h["this_server"]:
            continue
        if h["uuid"] not in held.setdefault(kid, []):
            held[kid].append(h["uuid"])
        pid = h["pid"]
        if h["used_memory_bytes"] is not None and pid is not None:
            own.setdefault(kid, set()).add(int(pid))
    for info in kernels:
        for uuid in info["picked_uuids"] or ():
            if uuid not in held.setdefault(info["kernel_id"], []):
                held[info["kernel_id"]].append(uuid)
    if not held:
        return {}
    try:
        thresholds = Thresholds.from_config(ctx.settings())
    except (ValueError, TypeError, TraitError):  # a bad threshold in the config: the defaults
        thresholds = Thresholds()
    history = sampler.history_series(since_s=thresholds.window_s + 3 * ctx.interval_s)
    smoothed = sampler.smoothed_util(60.0)
    options = options or {}
    environs = environs or {}
    uid = os.geteuid()
    try:
        registry = ctx.store()
    except (AutoGPUError, OSError):
        registry = None
    out: dict[str, tuple[str, BetterDevice | None]] = {}
    for kid, uuids in held.items():
        lease = next(
            (r for r in records if r.kernel_id == kid and r.uid == uid), None
        )
        pids = own.get(kid, set())

        asked: dict[tuple[str, ...], Alternative | None] = {}

        def alternative(kernel_uuids: Sequence[str], kid: str = kid,
                        lease: LeaseRecord | None = lease, pids: set[int] = pids,
                        asked: dict[tuple[str, ...], Alternative | None] = asked,
                        ) -> Alternative | None:
            key = tuple(kernel_uuids)
            if key not in asked:  # the same question for each overloaded device: ranked once
                view = registry.hiding(kernel_id=kid) if registry is not None else None
                grant = kernel_grant(snap, key, environs.get(kid))
                asked[key] = best_alternative(
                    snap, key, smoothed,
                    constraints=alternative_constraints(lease, options.get(kid)),
                    store=view, environ=grant, self_pids=pids,
                )
            return asked[key]

        found = detect(history, snap, uuids, pids, thresholds, alternative=alternative)
        if found:
            better = next((w.alternative for w in found if w.alternative is not None), None)
            out[kid] = (
                " ".join(_overload_summary(w) for w in found),
                None if better is None else {"uuid": better.uuid, "label": better.label},
            )
    return out


def _overload_summary(w: Overload) -> str:
    """The overload in one short sentence (JupyterLab notifications keep 140 characters):
    "GPU 0 (this kernel's GPU) is overloaded: memory 98% full, 1 other process. Better: GPU 1."
    """
    cause = w.causes[0].split(" (over ")[0] if w.causes else "busy"
    n = w.other_process_count
    better = f" Better now: {w.alternative.label}." if w.alternative is not None else ""
    return (
        f"{w.label} (this kernel's GPU) is overloaded: {cause}, "
        f"{n} other process{'es' if n != 1 else ''}.{better}"
    )


def kernel_activity(km: object, now_s: float | None = None) -> tuple[str | None, float | None]:
    """A kernel's ``execution_state`` and how long it has been idle, in seconds, from
    jupyter_server's own bookkeeping (``last_activity``, the clock its idle culler uses).
    ``idle_s`` is ``None`` unless the kernel is idle now (busy is not idle; unknown is unknown)."""
    state = getattr(km, "execution_state", None)
    last = getattr(km, "last_activity", None)
    if state != "idle" or last is None or not hasattr(last, "timestamp"):
        return (state if isinstance(state, str) else None), None
    now = time.time() if now_s is None else now_s
    return state, max(0.0, round(now - float(last.timestamp()), 1))


def kernel_options(kernel_manager: KernelSource | None) -> dict[str, Constraints]:
    """Kernel id -> the pick options of this server's autogpu kernels (their provisioners')."""
    out: dict[str, Constraints] = {}
    if kernel_manager is None:
        return out
    for kid in list(kernel_manager.list_kernel_ids()):
        try:
            prov = getattr(kernel_manager.get_kernel(kid), "provisioner", None)
        except KeyError:
            continue
        if isinstance(prov, ProvisionerState) and prov.autogpu_constraints is not None:
            out[kid] = prov.autogpu_constraints
    return out


def process_environ(pid: int | None, proc_root: str = "/proc") -> dict[str, str] | None:
    """The environment process ``pid`` started with (``/proc/<pid>/environ``, at most 1 MiB),
    or ``None`` when it cannot be read (no pid, gone, another user's)."""
    if pid is None:
        return None
    try:
        with open(os.path.join(proc_root, str(pid), "environ"), "rb") as fh:
            raw = fh.read(1 << 20)
    except OSError:
        return None
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def kernel_environ(
    kernel_manager: KernelSource | None, kernel_id: str | None
) -> dict[str, str] | None:
    """The environment one of this server's kernels started with (see
    :func:`process_environ`); ``None`` for an unknown kernel or an unreadable one."""
    if kernel_manager is None or not kernel_id:
        return None
    pid = {kid: pid for pid, kid in kernel_pid_map(kernel_manager).items()}.get(kernel_id)
    return process_environ(pid)


def kernel_allowed_uuids(
    snap: FleetSnapshot | None, env: Mapping[str, str] | None
) -> list[str] | None:
    """The devices a kernel may use: the allocation its process started with
    (``CUDA_VISIBLE_DEVICES``, ``NVIDIA_VISIBLE_DEVICES``, Slurm's, from its environment
    ``env`` as CUDA reads them). ``None`` when that is unknown (an unreadable process): the
    sidebar then offers every device, as the server's own grant allows."""
    if snap is None or env is None:
        return None
    env = grant_environ(env)  # an autogpu kernel: the grant it picked within, not its pick
    try:
        allocation = current_allocation(snap.devices, env)
    except AutoGPUError:  # a value CUDA would not read either: no device is offered
        return []
    return [d.uuid for d in snap.devices if allocation.allows(d)]


def kernel_infos(
    kernel_manager: KernelSource,
    sessions: Sessions,
    snap: FleetSnapshot | None = None,
    environs: Mapping[str, Mapping[str, str] | None] | None = None,
) -> list[KernelJSON]:
    """This server's kernels: which can be moved (started by the autogpu provisioner) and where,
    their ``execution_state`` and ``idle_s`` (see :func:`kernel_activity`).

    ``movable`` is true for a kernel whose provisioner records move requests
    (``autogpu_move_file``); ``picked_uuids`` is the provisioner's choice at the last (re)start
    (empty: CPU-only, or not an autogpu kernel); ``note`` its message, if any;
    ``allowed_uuids`` the devices its process may use (:func:`kernel_allowed_uuids` of its
    environment in ``environs``).
    """
    environs = environs or {}
    out: list[KernelJSON] = []
    for kid in list(kernel_manager.list_kernel_ids()):
        try:
            km = kernel_manager.get_kernel(kid)
        except KeyError:
            continue
        prov = getattr(km, "provisioner", None)  # jupyter_client's attribute
        state = prov if isinstance(prov, ProvisionerState) else None
        movable = state is not None and state.autogpu_move_file is not None
        picked = state.autogpu_picked if state is not None else ()
        constraints = state.autogpu_constraints if state is not None else None
        execution_state, idle_s = kernel_activity(km)
        out.append(
            {
                "kernel_id": kid,
                "notebook_path": (sessions.get(kid) or {}).get("path"),
                "execution_state": execution_state,
                "idle_s": idle_s,
                "movable": movable,
                "picked_uuids": [str(u) for u in picked] if movable else [],
                "constraints_text": constraints.describe() if movable and constraints else None,
                "note": state.autogpu_note if state is not None and movable else None,
                "allowed_uuids": kernel_allowed_uuids(snap, environs.get(kid)),
                # said by holders_payload, which knows the overloads and the waiting line
                "overload": None,
                "better": None,
                "waiting": False,
                "best_move": None,
                "cull_warning": None,
            }
        )
    return out
