"""Move requests: "restart this kernel on a better GPU".

A kernel's device is fixed once CUDA starts, so a move is a restart: the request is recorded,
the kernel is restarted, and the kernel provisioner (:mod:`autogpu_jupyter.provisioner`) reads
the request in ``pre_launch`` and picks there, with the old kernel's lease already gone (its
process, which held the lease's ``flock``, has exited). The kernel's state is lost.

Where a request lives: one small JSON file per kernel in the server user's Jupyter runtime
directory, ``<runtime dir>/autogpu-move-<kernel id>.json`` (:func:`move_file_for`). The runtime
directory is private to the user (``jupyter --runtime-dir``, mode 0700), so no other user can read
or plant a request. The provisioner computes the path (``autogpu_move_file`` on the provisioner
object, for the server) and gives it to the kernel as ``AUTOGPU_MOVE_FILE``.

Three callers, one module:

* ``%gpu move [DEVICE|--best]`` in the kernel: :func:`request_move_from_kernel`, then tell the user
  to restart (the message says the state will be lost);
* the server endpoint ``POST /autogpu/kernels/<id>/move`` (the sidebar's button):
  :func:`request_move`, then ``await kernel_manager.restart_kernel(id)``;
* the provisioner at (re)start: :func:`take_move` and :func:`move_constraints`.

The environment a provisioned kernel gets (:func:`kernel_env`) also carries what the kernel needs
to plan a move itself: the provisioner's options (``AUTOGPU_PICK_OPTIONS``) and the grant it
picked within (``AUTOGPU_GRANT_CVD``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core import decision
from autogpu_jupyter.core.backends import Backend, get_backend
from autogpu_jupyter.core.contract import ROCM_GRANT_VARS, KernelContract
from autogpu_jupyter.core.leasing.store import LeaseStore, RecordView
from autogpu_jupyter.core.options import PICK_OPTIONS, parse
from autogpu_jupyter.core.picker import explain_drops
from autogpu_jupyter.core.policy import Constraints, matches_id
from autogpu_jupyter.core.units import format_bytes
from autogpu_jupyter.errors import AutoGPUError, NoDeviceFitsError, UsageErrorBase

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot

__all__ = [
    "BEST",
    "MovePlan",
    "MoveRequest",
    "best_move_target",
    "cancel_move",
    "grant_environ",
    "pending_move_text",
    "kernel_constraints",
    "move_constraints",
    "move_file_for",
    "plan_move",
    "read_move",
    "request_move",
    "request_move_from_kernel",
    "take_move",
]

log = logging.getLogger(__name__)

#: The target that means "the policy's best device other than the current one(s)".
BEST = "best"
_MAX_BYTES = 4096
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_UUID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


@dataclass(frozen=True, slots=True)
class MoveRequest:
    """A recorded request to restart a kernel on other device(s).

    ``target_uuids`` empty means "the best other device" (``from_uuids`` are then avoided).
    """

    kernel_id: str | None
    target_uuids: tuple[str, ...]
    from_uuids: tuple[str, ...]
    requested_s: float
    source: str  # "magic", "server"

    @property
    def best(self) -> bool:
        return not self.target_uuids

    def to_dict(self) -> dict[str, Any]:
        return {
            "kernel_id": self.kernel_id,
            "target_uuids": list(self.target_uuids),
            "from_uuids": list(self.from_uuids),
            "requested_s": self.requested_s,
            "source": self.source,
        }


@dataclass(frozen=True, slots=True)
class MovePlan:
    """What a move will do, checked against the devices now: shown to the user."""

    request: MoveRequest
    target: tuple[DeviceSnapshot, ...]
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request.to_dict(),
            "target": [d.to_dict() for d in self.target],
            "message": self.message,
        }


# --------------------------------------------------------------------------------------------
# Where requests live


def move_file_for(runtime_dir: str | os.PathLike[str], kernel_id: str) -> Path:
    """The move-request path of kernel ``kernel_id``: ``<runtime_dir>/autogpu-move-<id>.json``.

    Parameters
    ----------
    runtime_dir
        The user's private Jupyter runtime directory (``jupyter_core.paths.jupyter_runtime_dir()``
        in the server process, mode 0700).
    kernel_id
        The kernel id.
    """
    if not _SAFE_ID.fullmatch(kernel_id):
        raise UsageErrorBase(f"invalid kernel id {kernel_id!r}: expected letters, digits and '-'")
    return Path(runtime_dir) / f"autogpu-move-{kernel_id}.json"


def _kernel_move_file(contract: KernelContract) -> Path | None:
    return Path(contract.move_file) if contract.move_file else None


# --------------------------------------------------------------------------------------------
# Reading and writing


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp + rename), mode 0600, never via a symlink."""
    directory = path.parent
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(dfd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & (stat.S_IWGRP | stat.S_IWOTH):
            raise AutoGPUError(
                f"refusing to write a move request into {directory}: it is not a private directory "
                "of this user (expected the Jupyter runtime directory, mode 0700)"
            )
        tmp = f".{path.name}.{os.getpid()}.tmp"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
            dir_fd=dfd,
        )
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        try:
            os.rename(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
    finally:
        os.close(dfd)


def _parse(data: bytes) -> MoveRequest:
    d = json.loads(data.decode("utf-8"))
    if not isinstance(d, dict):
        raise ValueError("not an object")
    targets = d.get("target_uuids", [])
    froms = d.get("from_uuids", [])
    for seq in (targets, froms):
        if not isinstance(seq, list) or len(seq) > 64 or not all(
            isinstance(u, str) and _UUID.fullmatch(u) for u in seq
        ):
            raise ValueError("bad device list")
    kid = d.get("kernel_id")
    if kid is not None and (not isinstance(kid, str) or not _SAFE_ID.fullmatch(kid)):
        raise ValueError("bad kernel id")
    when = d.get("requested_s")
    if not isinstance(when, (int, float)) or isinstance(when, bool):
        raise ValueError("bad time")
    source = d.get("source", "")
    if not isinstance(source, str) or len(source) > 32:
        raise ValueError("bad source")
    return MoveRequest(
        kernel_id=kid, target_uuids=tuple(targets), from_uuids=tuple(froms),
        requested_s=float(when), source=source,
    )


def read_move(path: str | os.PathLike[str]) -> MoveRequest | None:
    """The request recorded at ``path``, or ``None`` (none, unreadable or malformed: logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        log.warning("ignoring move request %s: %s", path, err.strerror)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            log.warning("ignoring move request %s: not a regular file of this user", path)
            return None
        data = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_BYTES:
        log.warning("ignoring move request %s: larger than %d bytes", path, _MAX_BYTES)
        return None
    try:
        return _parse(data)
    except (ValueError, UnicodeDecodeError) as err:
        log.warning("ignoring malformed move request %s: %s", path, err)
        return None


def cancel_move(path: str | os.PathLike[str]) -> bool:
    """Remove the request at ``path``; ``True`` if there was one."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def take_move(path: str | os.PathLike[str]) -> MoveRequest | None:
    """Read and remove the request at ``path`` (the provisioner, at the kernel's next start)."""
    req = read_move(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return req


def pending_move_text(environ: Mapping[str, str] | None = None) -> str | None:
    """In a kernel of the autogpu kernelspec: the move it asked for (``%gpu move``, the
    sidebar) that its next restart will carry out, in words; ``None`` when there is none."""
    path = _kernel_move_file(KernelContract.read(environ))
    req = read_move(path) if path is not None else None
    if req is None:
        return None
    where = ", ".join(u[:12] for u in req.target_uuids) or "the best device"
    return f"move to {where} pending: restart the kernel (Kernel > Restart Kernel) to move"


# --------------------------------------------------------------------------------------------
# Planning


def grant_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as the provisioner saw it: its grant, not the kernel's narrowed CVD.

    In a provisioned kernel ``CUDA_VISIBLE_DEVICES`` holds the provisioner's pick; the grant it
    picked within is ``AUTOGPU_GRANT_CVD`` (absent: the server had no ``CUDA_VISIBLE_DEVICES``).
    On an AMD host the pick is in the ROCm variables too, and ``AUTOGPU_GRANT_ROCM`` holds the
    server's (those that were set); where it is missing or malformed the kernel's own ROCm
    variables stay, so they bound a move (it fails closed, never widens). Elsewhere the
    environment is returned as is.
    """
    env = dict(os.environ if environ is None else environ)
    contract = KernelContract.read(env)
    if contract.provisioned:
        if contract.grant_cvd is None:
            env.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            env["CUDA_VISIBLE_DEVICES"] = contract.grant_cvd
        if contract.grant_rocm is not None:
            for var in ROCM_GRANT_VARS:
                if var in contract.grant_rocm:
                    env[var] = contract.grant_rocm[var]
                else:
                    env.pop(var, None)
    return env


def kernel_constraints(environ: Mapping[str, str] | None = None) -> Constraints:
    """The provisioner's pick options as seen in a provisioned kernel (``AUTOGPU_PICK_OPTIONS``)."""
    opts = KernelContract.read(environ).options
    known = {o.key for o in PICK_OPTIONS}
    try:
        return parse({k: v for k, v in opts.items() if k in known}, style="key").constraints
    except UsageErrorBase:  # the provisioner validated them; a hand-edited variable picks plainly
        return Constraints()


def _resolve_target(target: str, devices: Sequence[DeviceSnapshot]) -> list[DeviceSnapshot]:
    wanted = [t.strip() for t in target.split(",")]
    out: list[DeviceSnapshot] = []
    for w in wanted:
        matches = [d for d in devices if w and matches_id(d, w)]
        if len(matches) != 1:
            known = ", ".join(str(d.index) for d in devices if not d.is_mig)
            raise UsageErrorBase(
                f"unknown device {w!r} for a move: expected an NVML index ({known}), a (unique) "
                "UUID, or --best"
            )
        if matches[0] not in out:
            out.append(matches[0])
    return out


def _best_target(
    context: decision.Context, current: Sequence[str], constraints: Constraints
) -> tuple[tuple[DeviceSnapshot, ...], bool]:
    """Where a move to "the best device" goes: the one decision for the kernel's own options,
    its current device(s) included, and whether that is "the best *other* device" (its current
    device no longer fits: overloaded, excluded, lost).

    Raises
    ------
    UsageErrorBase
        The decision names the kernel's own device(s): it is already on the best device.
    NoDeviceFitsError
        Its device no longer fits and no other device does.
    """
    snap = context.snapshot
    present = tuple(u for u in current if snap.by_uuid(u) is not None)
    made = decision.decide(context, constraints)
    chosen = tuple(c.device for c in made.chosen)
    mine = [made.candidate(u) for u in present]
    still_fits = bool(present) and all(c is not None and c.eligible for c in mine)
    # A device that ranks only by its UUID ahead of the kernel's own (identical idle GPUs) is
    # no better: the kernel stays, or every move would invite the next one.
    if still_fits and chosen and (
        {d.uuid for d in chosen} == set(present)
        or sorted(c.key[:-1] for c in mine if c is not None)
        == sorted(c.key[:-1] for c in made.chosen)
    ):
        labels = ", ".join(
            f"{c.device.label} ({c.device.name}, {format_bytes(c.effective_free_bytes)} free)"
            for c in mine if c is not None
        )
        raise UsageErrorBase(
            f"the kernel is already on the best device: {labels}; nothing to move"
        )
    if still_fits and chosen:
        return chosen, False
    # the current device(s) no longer fit (or the kernel has none): the best of the others
    cons = replace(constraints, exclude=tuple(constraints.exclude) + present)
    made = decision.decide(context, cons)
    if not made.chosen:
        raise NoDeviceFitsError(
            f"no better device to move to ({constraints.describe()}; "
            "the current one excluded):\n"
            + explain_drops(list(made.ranked)),
            candidates=tuple(made.ranked),
        )
    return tuple(c.device for c in made.chosen), bool(present)


def best_move_target(
    snapshot: FleetSnapshot,
    current_uuids: Sequence[str],
    constraints: Constraints,
    *,
    environ: Mapping[str, str] | None = None,
    store: RecordView | None = None,
    smoothed_util: Mapping[str, float | None] | None = None,
) -> tuple[DeviceSnapshot, ...]:
    """Where :func:`plan_move` ``"best"`` would move a kernel on ``current_uuids`` now, on
    ``snapshot`` (the server's latest sweep): empty when it is already on the best device, or
    when nothing fits. The sidebar offers "Move to best GPU" only when this names a device."""
    context = decision.gather(
        snapshot, environ=environ, store=store, smoothed_util=smoothed_util
    )
    try:
        return _best_target(context, tuple(current_uuids), constraints)[0]
    except AutoGPUError:
        return ()


def plan_move(
    target: str,
    *,
    current_uuids: Sequence[str],
    constraints: Constraints,
    kernel_id: str | None = None,
    backend: Backend | None = None,
    environ: Mapping[str, str] | None = None,
    store: LeaseStore | None = None,
    source: str = "magic",
    smoothed_util: Mapping[str, float | None] | None = None,
) -> MovePlan:
    """Check a move against the devices now and say what it will do (records nothing).

    Parameters
    ----------
    target
        ``"best"`` / ``"--best"``: the best device(s) for the kernel's options (the one
        decision); the best *other* device(s) where the current ones no longer fit; else NVML
        indices or UUIDs (``"2"``, ``"GPU-5a1b"``; ``count`` of them, comma-separated).
    current_uuids
        The kernel's device(s) now (``AUTOGPU_PICKED``); empty for a CPU-only kernel.
    constraints
        The kernel's pick options: the target must fit them.
    environ
        The environment whose grant bounds the target (the server's; in a kernel
        :func:`grant_environ`).
    store
        The lease store (other holders' bookings count).

    Raises
    ------
    UsageErrorBase
        Unknown device, outside the grant, already there (also ``best`` when the decision names
        the current device(s): "already on the best device"), or the target does not fit.
    NoDeviceFitsError
        ``best`` and no other device fits.
    """
    if backend is None:
        backend = get_backend()
    snap = backend.snapshot()
    context = decision.gather(
        snap, environ=environ, store=store, smoothed_util=smoothed_util
    )
    allocation = context.allocation
    current = tuple(current_uuids)
    # Our own lease books memory on the current device(s); other devices are judged as they are.
    text = target.strip()
    best = text.lower() in (BEST, "--best")
    if best:
        target_devs, other = _best_target(context, current, constraints)
        # The plan names the devices it was shown with ("Restart on GPU 3"): the restart goes
        # there while they still fit, not to whatever ranks first a moment later.
        req = MoveRequest(
            kernel_id, tuple(d.uuid for d in target_devs), current, time.time(), source
        )
    else:
        devs = _resolve_target(text, snap.devices)
        if len(devs) != constraints.count:
            raise UsageErrorBase(
                f"this kernel uses {constraints.count} device(s); name as many for the move "
                f"(got {len(devs)}: {text!r}), or use --best"
            )
        for d in devs:
            if not allocation.allows(d):
                raise UsageErrorBase(
                    f"{d.label} is outside this server's GPU grant ({allocation.describe()})"
                )
        if current and {d.uuid for d in devs} == set(current):
            raise UsageErrorBase(f"the kernel already runs on {', '.join(d.label for d in devs)}")
        ranked = list(decision.decide(context, replace(constraints, exclude=())).ranked)
        by_uuid = {c.device.uuid: c for c in ranked}
        for d in devs:
            cand = by_uuid[d.uuid]  # every device of the snapshot is ranked
            if not cand.eligible:
                raise UsageErrorBase(
                    f"{d.label} does not fit this kernel's options "
                    f"({constraints.describe()}): {'; '.join(cand.reasons)}"
                )
        target_devs = tuple(devs)
        req = MoveRequest(kernel_id, tuple(d.uuid for d in devs), current, time.time(), source)
    labels = ", ".join(
        f"{d.label} ({d.name}, {format_bytes(d.memory_free_bytes)} free)" for d in target_devs
    )
    if not best:
        where = "the requested device"
    elif other:
        where = "the best other device"
    else:
        where = "the best device" if len(target_devs) == 1 else "the best devices"
    message = (
        f"The kernel will restart on {labels}, {where} now. Restarting loses the kernel's state "
        "(variables, imports, data in memory): save what you need first."
    )
    return MovePlan(request=req, target=target_devs, message=message)


def request_move(
    path: str | os.PathLike[str],
    target: str,
    *,
    current_uuids: Sequence[str],
    constraints: Constraints,
    kernel_id: str | None = None,
    backend: Backend | None = None,
    environ: Mapping[str, str] | None = None,
    store: LeaseStore | None = None,
    source: str = "server",
    smoothed_util: Mapping[str, float | None] | None = None,
) -> MovePlan:
    """Plan a move (:func:`plan_move`) and record it at ``path`` for the next (re)start.

    The caller restarts the kernel (the server endpoint: ``kernel_manager.restart_kernel``; the
    magic: tells the user to). A newer request replaces an older one.
    """
    plan = plan_move(
        target, current_uuids=current_uuids, constraints=constraints, kernel_id=kernel_id,
        backend=backend, environ=environ, store=store, source=source,
        smoothed_util=smoothed_util,
    )
    _write_private(Path(path), json.dumps(plan.request.to_dict()).encode())
    log.info("move requested for kernel %s: %s", kernel_id, plan.message)
    return plan


def request_move_from_kernel(
    target: str,
    *,
    environ: Mapping[str, str] | None = None,
    backend: Backend | None = None,
    store: LeaseStore | None = None,
) -> MovePlan:
    """``%gpu move`` inside a kernel: plan, record, and return the plan (its ``message``).

    The returned message ends with how to restart; the magic prints it.

    Raises
    ------
    UsageErrorBase
        The kernel was not started by the autogpu kernel provisioner (no restart would honour a
        request), or the move does not fit.
    """
    env = os.environ if environ is None else environ
    contract = KernelContract.read(env)
    path = _kernel_move_file(contract)
    if not contract.provisioned or path is None:
        raise UsageErrorBase(
            "%gpu move needs a kernel started with the autogpu kernelspec (its provisioner "
            "picks at each restart). Install one with `autogpu kernelspec install` and choose "
            "\"Python 3 (autogpu)\" as this notebook's kernel; here, `%gpu pick` in a fresh kernel "
            "does the same."
        )
    current = contract.picked
    kernel_id = path.name.removeprefix("autogpu-move-").removesuffix(".json")
    plan = request_move(
        path, target, current_uuids=current, constraints=kernel_constraints(env),
        kernel_id=kernel_id if _SAFE_ID.fullmatch(kernel_id) else None, backend=backend,
        environ=grant_environ(env),
        store=store, source="magic",
    )
    return replace(
        plan,
        message=plan.message + " Restart the kernel now (Kernel > Restart Kernel) to move; "
        "until then nothing changes.",
    )


def move_constraints(
    request: MoveRequest, base: Constraints, devices: Sequence[DeviceSnapshot]
) -> tuple[Constraints, str]:
    """The constraints a (re)start uses to honour ``request``, and a note for the user.

    A named target: every other device excluded (so only the target can be chosen), and the
    devices the kernelspec named (``devices``) no longer bound it: the user named the target.
    Best: the devices the kernel moved away from excluded.
    """
    present = {d.uuid for d in devices}
    if request.target_uuids:
        base = replace(base, devices=())
        keep = set(request.target_uuids)
        exclude = tuple(
            d.uuid for d in devices
            if d.uuid not in keep and not (d.parent_uuid is not None and d.parent_uuid in keep)
            and not any(m.parent_uuid == d.uuid for m in devices if m.uuid in keep)
        )
        note = "moved at your request"
    else:
        exclude = tuple(u for u in request.from_uuids if u in present)
        note = "moved to the best other device at your request"
    return replace(base, exclude=tuple(base.exclude) + exclude), note
