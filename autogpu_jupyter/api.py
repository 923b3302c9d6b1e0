"""The Python API: the seed's ``get_min_load_gpu`` / ``set_cuda_visible_devices`` /
``get_gpu_status``, done right.

>>> import autogpu_jupyter as ag
>>> ag.pick(min_free="10G")            # before importing torch / jax
>>> ag.status()                        # a pandas DataFrame
>>> ag.release()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.config import AutoGPU, default_settings
from autogpu_jupyter.core import (
    Constraints,
    PickOptions,
    PickResult,
    current_allocation,
    decision,
    format_bytes,
    get_backend,
    grant_environ,
    holders_by_device,
    matches_id,
    notebook_path,
    options,
    session,
    visible_env,
)
from autogpu_jupyter.core import pick as _pick
from autogpu_jupyter.core.leasing import LeaseRecord, LeaseStore, Requester, store_for
from autogpu_jupyter.errors import AutoGPUError, DeviceBoundError, UsageErrorBase

if TYPE_CHECKING:
    import pandas as pd

    from autogpu_jupyter.core import Decision, DeviceSnapshot, FleetSnapshot

__all__ = [
    "current",
    "pick",
    "pick_result",
    "release",
    "set_visible_devices",
    "status",
    "status_frame",
    "notebook_of_this_process",
    "requester_for_this_process",
    "read_snapshot",
]

log = logging.getLogger(__name__)

_KERNEL_FILE = re.compile(r"kernel-([0-9a-fA-F-]{8,})\.json$")


#: What VS Code's Jupyter extension defines in a Python kernel's namespace when it starts one: the
#: notebook's path. Its kernels get no ``JPY_SESSION_NAME`` (no Jupyter server starts them).
VSCODE_NOTEBOOK_VARIABLE = "__vsc_ipynb_file__"


def notebook_of_this_process() -> str | None:
    """The notebook this kernel runs, as far as the kernel can tell; ``None`` when none is known.

    ``JPY_SESSION_NAME``, which jupyter_server (2.x) gives the kernels it starts for a notebook
    (relative to the server's root: :func:`core.contract.notebook_path`), else VS Code's
    ``__vsc_ipynb_file__`` in the IPython user namespace (read only where IPython is already
    imported: a CLI process never imports it for this).
    """
    name = notebook_path()  # JPY_SESSION_NAME, relative to the Jupyter server's root
    if name:
        return name
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    value = getattr(shell, "user_ns", {}).get(VSCODE_NOTEBOOK_VARIABLE)
    return value if isinstance(value, str) and value else None


def requester_for_this_process(kind: str = "api") -> Requester:
    """Who we are, for a lease: pid, and the kernel id / notebook path inside a Jupyter kernel."""
    kernel_id = None
    for arg in sys.argv:
        m = _KERNEL_FILE.search(arg)
        if m:
            kernel_id = m.group(1)
            kind = "kernel"
            break
    return Requester(
        pid=os.getpid(),
        kernel_id=kernel_id,
        notebook_path=notebook_of_this_process(),
        kind=kind,
        command=" ".join(sys.argv)[:500] or None,
    )


def _running_sampler() -> Any:
    """The process's sampler if one runs (never starts one: a pick must not start a thread)."""
    # The sampler module imports numpy: only when a sampler may run, not at import.
    from autogpu_jupyter.core import sampler as _sampler  # noqa: PLC0415

    s = _sampler.current_sampler()
    return s if s is not None and s.running else None


def _smoothed_util() -> dict[str, float | None] | None:
    s = _running_sampler()
    return None if s is None else s.smoothed_util(30.0)


def pick_options(settings: AutoGPU, values: Mapping[str, Any]) -> PickOptions:
    """The validated options of a pick: ``values`` as given (``None``: not given) over the
    ``AutoGPU`` settings (config file, ``%config``, env vars): the one options boundary."""
    return options.parse(values, defaults=options.defaults_from(settings))


def pick_result(
    opts: PickOptions,
    *,
    dry_run: bool = False,
    force: bool = False,
    settings: AutoGPU | None = None,
    on_progress: Callable[[str], None] | None = None,
    source: str = "api",
) -> tuple[PickResult, str | None]:
    """Pick ``opts`` (:func:`pick_options`) and, unless ``dry_run``, apply; returns the result
    and a warning (``--force``) if any."""
    settings = settings or default_settings()
    constraints = opts.constraints
    warning = None
    mine = session.current()
    if mine is not None and mine.source == "provisioner" and mine.uuids and not dry_run:
        # Started by the autogpu kernelspec: this kernel holds a lease and its CUDA view was set
        # before it started. It can keep that device, never take a second lease on it.
        return _keep_provisioned(mine, constraints, settings), None
    if not dry_run:
        warning = session.check_not_too_late(force or not settings.refuse_when_initialized)
    result = _pick(
        opts,
        environ=session.original_environ(),
        store=own_store(settings, mine),
        requester=requester_for_this_process(source if source != "magic" else "kernel"),
        dry_run=dry_run,
        on_progress=on_progress,
        smoothed_util=_smoothed_util,
        visible_ids=settings.visible_ids,
    )
    if not dry_run:
        if mine is not None and mine.uuids:
            labels = {d.uuid: d.label for d in result.snapshot.devices}
            previous = ", ".join(labels.get(u, u) for u in mine.uuids)
            result = dataclasses.replace(result, previous=previous)
        session.apply(result, source=source, forced=warning is not None)
    return result, warning


def own_store(settings: AutoGPU, mine: session.Choice | None) -> LeaseStore | None:
    """The lease store the settings select, seen without this process's own lease: a re-pick
    replaces it (``session.apply`` releases it on success), so it must not book memory or
    hold "exclusive" against the new pick."""
    store = store_for(settings)
    if store is not None and mine is not None and mine.lease_id:
        store = store.hiding(lease_ids=[mine.lease_id])
    return store


def current_fit(
    mine: session.Choice, constraints: Constraints, settings: AutoGPU
) -> tuple[Decision, list[str]]:
    """Whether this process's device(s) meet ``constraints``, by the one decision pipeline:
    the decision over the grant (not the narrowed ``CUDA_VISIBLE_DEVICES``) with this process's
    own lease hidden, and why each of its devices that does not fit fails (``GPU 1: ...``; a
    device this host no longer lists says so)."""
    snap = read_snapshot()
    context = decision.gather(
        snap, environ=grant_environ(session.original_environ()), store=own_store(settings, mine),
        smoothed_util=_smoothed_util(), self_pids=(os.getpid(),),
    )
    made = decision.decide(context, constraints)
    failing = []
    for u in mine.uuids:
        c = made.candidate(u)
        if c is None:
            failing.append(f"{u}: not among this host's devices now")
        elif not c.eligible:
            failing.append(f"{c.device.label}: {'; '.join(c.reasons)}")
    return made, failing


def _keep_provisioned(
    mine: session.Choice, constraints: Constraints, settings: AutoGPU
) -> PickResult:
    """``%gpu pick`` in a kernel the autogpu kernelspec started: keep its device and lease when
    they meet ``constraints``; otherwise say which device would, and how to move there.

    The check is the one decision pipeline's, over the server's grant (not the kernel's narrowed
    ``CUDA_VISIBLE_DEVICES``) with this kernel's own lease hidden.
    """
    made, failing = current_fit(mine, constraints, settings)
    snap, context = made.context.snapshot, made.context
    labels = {d.uuid: d.label for d in snap.devices}
    here = ", ".join(labels.get(u, u) for u in mine.uuids)
    if not failing and len(mine.uuids) >= constraints.count:
        return PickResult(
            chosen=tuple(d for u in mine.uuids if (d := snap.by_uuid(u)) is not None),
            candidates=made.ranked,
            constraints=constraints,
            env={k: os.environ[k] for k in session.MANAGED_VARS if k in os.environ},
            allocation=context.allocation,
            snapshot=snap,
            kept=True,
        )
    why = "; ".join(failing) or (
        f"it has {len(mine.uuids)} device(s), {constraints.count} asked for"
    )
    better = ", ".join(c.device.label for c in made.chosen if c.device.uuid not in mine.uuids)
    hint = (
        f"{better} would fit: move there with %gpu move {better.replace('GPU ', '')} "
        "(restarts the kernel; its variables are lost)"
        if better
        else "no other device fits either right now (%gpu pick --dry-run shows why)"
    )
    raise DeviceBoundError(
        f"this kernel was started on {here} by the autogpu kernelspec and can use only that "
        f"(its CUDA_VISIBLE_DEVICES was set before it started), and {here} does not meet "
        f"{constraints.describe()} ({why}); {hint}. No second lease was taken."
    )


def pick(
    min_free: object = None,
    max_util: object = None,
    count: int | None = None,
    exclude: object = None,
    exclusive: bool | None = None,
    wait: object = None,
    dry_run: bool = False,
    force: bool = False,
    model: object = None,
    prefer: object = None,
    devices: object = None,
) -> list[DeviceSnapshot]:
    """Pick the best device(s) that fit, take a lease, set ``CUDA_VISIBLE_DEVICES``.

    Call it before anything initialises CUDA (``import torch`` is fine, ``torch.cuda.*`` is not).

    Parameters
    ----------
    min_free
        Free memory wanted per device: ``"10G"`` (binary), ``"16GB"`` (decimal), ``"25%"``.
    max_util
        Drop devices busier than this percentage.
    count
        How many devices.
    exclude
        NVML indices or UUIDs to avoid: ``"0,2"`` or ``["GPU-5a1b"]``.
    exclusive
        Take devices no other lease holds, and keep others off them.
    wait
        Wait in line up to this long (``"10m"``) for a device to fit.
    model
        Only these models (name contains it): ``"A100"`` or ``"H100,A100"``.
    prefer
        Prefer these models, in order, before load: ``"L4,A100"``.
    devices
        Only these devices, as ``%gpu pick 2`` names them: ``2``, ``"0,3"``, ``["GPU-5a1b"]``,
        ``"0:1"`` (a MIG device); ``count`` defaults to how many are named.
    dry_run
        Only rank; change nothing.
    force
        Set the variables even though CUDA is already initialised (they will have no effect
        until the kernel restarts).

    Returns
    -------
    list of DeviceSnapshot
        The chosen devices, best first.

    Raises
    ------
    AutoGPUError
        ``TooLateError``, ``NoDeviceFitsError``, ``NoDeviceGrantedError``, ``NVMLUnavailableError``
        or ``UsageErrorBase`` for bad input.
    """
    opts = pick_options(default_settings(), {
        "min_free": min_free, "max_util": max_util, "count": count, "exclude": exclude,
        "exclusive": exclusive, "wait": wait, "model": model, "prefer": prefer,
        "devices": devices,
    })
    result, warning = pick_result(opts, dry_run=dry_run, force=force)
    if warning:
        log.warning("%s", warning)
    return list(result.chosen)


def current() -> session.Choice | None:
    """This process's choice (device UUIDs, lease), or ``None``."""
    return session.current()


def release() -> session.Choice | None:
    """Drop this process's choice and lease and restore the variables as they were.

    CUDA, if already initialised, keeps using its device until the process restarts.
    """
    return session.release()


def read_snapshot() -> FleetSnapshot:
    """The freshest snapshot: the running sampler's if there is one, else one read."""
    s = _running_sampler()
    snap = s.latest() if s is not None else None
    return snap if snap is not None else get_backend().snapshot()


def set_visible_devices(ids: Sequence[str | int] | str | int, force: bool = False) -> list[str]:
    """Make exactly these devices visible (indices or UUIDs), validated, as full UUIDs.

    No lease is taken. Returns the UUIDs written to ``CUDA_VISIBLE_DEVICES``.
    """
    given = ids  # as typed, for the message
    if isinstance(ids, (str, int)):
        ids = list(str(ids).split(","))
    wanted = [str(i).strip() for i in ids]
    if not wanted or any(not w for w in wanted):
        raise UsageErrorBase(
            f"invalid device list {given!r}: expected NVML indices or UUIDs, "
            "e.g. [0, 2] or 'GPU-5a1b'"
        )
    snap = read_snapshot()
    allocation = current_allocation(snap.devices, session.original_environ())
    chosen: list[DeviceSnapshot] = []
    for w in wanted:
        matches = [d for d in snap.devices if matches_id(d, w)]
        if len(matches) != 1:
            known = ", ".join(str(d.index) for d in snap.devices if not d.is_mig)
            raise UsageErrorBase(
                f"unknown device id {w!r}: expected an NVML index ({known}) or a (unique) UUID"
            )
        if not allocation.allows(matches[0]):
            raise UsageErrorBase(
                f"{matches[0].label} is outside this process's allocation ({allocation.describe()})"
            )
        if matches[0] not in chosen:
            chosen.append(matches[0])
    if sum(d.is_mig for d in chosen) > 1:
        raise UsageErrorBase("a process can use only one MIG device")
    session.check_not_too_late(force)
    result = PickResult(
        chosen=tuple(chosen),
        candidates=(),
        constraints=Constraints(count=len(chosen)),
        env=visible_env([d.uuid for d in chosen], snap.devices, default_settings().visible_ids),
        allocation=allocation,
        snapshot=snap,
    )
    session.apply(result, source="api", forced=force)
    return [d.uuid for d in chosen]


def status(snapshot: FleetSnapshot | None = None, settings: AutoGPU | None = None) -> pd.DataFrame:
    """All devices as a DataFrame: this process's device marked, load, memory, holders.

    ``df.attrs["simulated"]`` is True on a simulated fleet (``AUTOGPU_SIMULATE``).
    """
    snap = snapshot or read_snapshot()
    return status_frame(snap, session.current(), live_leases(settings), own_pids=(os.getpid(),))


def live_leases(settings: AutoGPU | None = None) -> list[LeaseRecord]:
    """Every live lease on this host (none when leases are off or the store cannot be read)."""
    store = store_for(settings or default_settings())
    if store is None:
        return []
    try:
        return store.list_leases()
    except (AutoGPUError, OSError) as err:
        log.debug("lease store unreadable: %s", err)
        return []


_STATUS_COLUMNS = (
    "", "gpu", "name", "uuid", "util %", "mem used", "mem total", "mem free", "temp °C",
    "power W", "procs", "holders", "state",
)


def status_frame(
    snap: FleetSnapshot,
    choice: session.Choice | None,
    leases: Sequence[Any],
    own_pids: Sequence[int] = (),
) -> pd.DataFrame:
    """The status table (pure): one row per device; ``own_pids`` are "this kernel"."""
    import pandas as pd  # noqa: PLC0415 (pandas: only when a table is asked for)

    mine = set(choice.uuids) if choice else set()
    records = [getattr(lease, "record", lease) for lease in leases]
    holders = holders_by_device(snap, records, own_pids=own_pids)
    rows = []
    for d in snap.devices:
        rows.append(
            {
                "": "▶" if d.uuid in mine else "",
                "gpu": d.label,
                "name": d.name,
                "uuid": d.short_uuid,
                "util %": d.utilization_pct,
                "mem used": format_bytes(d.memory_used_bytes),
                "mem total": format_bytes(d.memory_total_bytes),
                "mem free": format_bytes(d.memory_free_bytes),
                "temp °C": d.temperature_c,
                "power W": d.power_w,
                "procs": None if d.processes is None else len(d.processes),
                "holders": ", ".join(h.text() for h in holders[d.uuid]),
                "state": "ok" if d.available else f"unavailable: {d.error}",
            }
        )
    # The columns are named even with no device (a host whose GPUs all vanished): callers
    # select by column, and an empty table must still have them.
    df = pd.DataFrame(rows, columns=_STATUS_COLUMNS)
    # Whole numbers stay whole when a lost device makes a column partly unknown (<NA>, not NaN).
    for col in ("temp °C", "procs"):
        if col in df:
            df[col] = pd.to_numeric(df[col]).round().astype("Int64")
    df.attrs["simulated"] = snap.simulated
    return df
