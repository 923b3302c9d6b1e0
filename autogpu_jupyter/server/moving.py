"""``POST kernels/<kernel_id>/move``: restart one of this server's kernels on another GPU.

The sidebar's "Move to best GPU" / "Move here" buttons call it. What happens
(:mod:`autogpu_jupyter.core.moves` has the mechanism):

1. the kernel must have been started by the autogpu kernel provisioner (its provisioner object
   carries ``autogpu_move_file``); the server reads the provisioner's state through the typed
   :class:`~autogpu_jupyter.core.contract.ProvisionerState` protocol and never imports
   :mod:`autogpu_jupyter.provisioner`;
2. :func:`~autogpu_jupyter.core.moves.request_move` checks the target against the devices now
   (the kernel's own pick options, the server's grant, other holders' leases) and records the
   request; ``dry_run`` only plans, which the sidebar shows in its confirmation dialog;
3. the handler restarts the kernel; the provisioner honours the request in ``pre_launch``, with
   the old kernel's lease gone with its process. The kernel's state is lost.

Everything here is blocking (NVML, the registry, the request file) and runs on the state's
executor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autogpu_jupyter.core import ProvisionerState, moves
from autogpu_jupyter.errors import UsageErrorBase
from autogpu_jupyter.server.payloads import parse_json_object, short_repr
from autogpu_jupyter.server.schema import MoveAnswer

if TYPE_CHECKING:
    from autogpu_jupyter.server.state import ServerContext

__all__ = [
    "MoveBody", "cancel", "is_movable", "parse_move_body", "pending", "pending_payload",
    "plan_or_request", "result_payload",
]

_ACCEPTED = ("target", "dry_run", "restart")
_EXAMPLE = '{"target": "best"} or {"target": "2"}'


class MoveBody:
    """A parsed request body: ``target`` (``"best"``, an NVML index or a UUID), ``dry_run``, and
    ``restart`` (false: record the move and let the client restart the kernel, as the sidebar
    does through JupyterLab's own restart so that the notebook follows it)."""

    __slots__ = ("dry_run", "restart", "target")

    def __init__(self, target: str, dry_run: bool, restart: bool = True) -> None:
        self.target = target
        self.dry_run = dry_run
        self.restart = restart


def parse_move_body(body: bytes) -> MoveBody:
    """Validate the JSON body of a move request.

    Raises
    ------
    UsageErrorBase
        Not JSON, not an object, an unknown key, or a missing / malformed ``target``; the message
        names the bad value and the accepted forms.
    """
    data = parse_json_object(body, _EXAMPLE)
    unknown = sorted(set(data) - set(_ACCEPTED))
    if unknown:
        raise UsageErrorBase(
            f"unknown parameter {short_repr(unknown[0])}; accepted: {', '.join(_ACCEPTED)}"
        )
    raw = data.get("target")
    if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0:
        target = str(raw)
    elif isinstance(raw, str) and raw.strip():
        target = raw.strip()
    else:
        raise UsageErrorBase(
            f"invalid target {short_repr(raw)}: expected \"best\", an NVML index such as \"2\", "
            "or a GPU UUID"
        )
    if target.lower() == "--best":
        target = moves.BEST
    flags = {}
    for key, default in (("dry_run", False), ("restart", True)):
        value = data.get(key, default)
        if not isinstance(value, bool):
            raise UsageErrorBase(f"invalid {key} {short_repr(value)}: expected true or false")
        flags[key] = value
    return MoveBody(target, flags["dry_run"], flags["restart"])


def is_movable(provisioner: Any) -> bool:
    """Whether the kernel was started by the autogpu provisioner (which honours move requests):
    it exposes the kernel contract's :class:`~autogpu_jupyter.core.contract.ProvisionerState`."""
    return isinstance(provisioner, ProvisionerState) and provisioner.autogpu_move_file is not None


def plan_or_request(
    ctx: ServerContext, provisioner: Any, kernel_id: str, body: MoveBody
) -> moves.MovePlan:
    """Plan the move (``dry_run``) or plan and record it for the kernel's next restart.

    The server's own environment bounds the target (its ``CUDA_VISIBLE_DEVICES`` grant, as the
    provisioner's pick); the registry the sidebar shows gives the other holders' bookings.

    Raises
    ------
    UsageErrorBase
        Unknown device, outside the grant, already there, or the target does not fit.
    NoDeviceFitsError
        ``best`` and no other device fits.
    """
    registry = ctx.store()
    if registry is not None:  # the kernel's own lease does not count against its move
        registry = registry.hiding(kernel_id=kernel_id)
    sampler = ctx.sampler
    kwargs: dict[str, Any] = {
        "current_uuids": tuple(provisioner.autogpu_picked or ()),
        "constraints": provisioner.autogpu_constraints,
        "kernel_id": kernel_id,
        "store": registry,
        "source": "server",
        "smoothed_util": None if sampler is None else sampler.smoothed_util(
            ctx.smoothing_window_s
        ),
    }
    if body.dry_run:
        return moves.plan_move(body.target, **kwargs)
    return moves.request_move(provisioner.autogpu_move_file, body.target, **kwargs)


def cancel(provisioner: Any) -> None:
    """Drop a recorded request (the restart failed: no later restart should move by surprise)."""
    path = provisioner.autogpu_move_file if isinstance(provisioner, ProvisionerState) else None
    if path:
        moves.cancel_move(path)


def _labels(uuids: tuple[str, ...], known: Mapping[str, str]) -> str:
    return ", ".join(known.get(u, u) for u in uuids) or "no GPU"


def result_payload(
    plan: moves.MovePlan, provisioner: Any, dry_run: bool,
    labels: Mapping[str, str] | None = None,
) -> MoveAnswer:
    """The endpoint's answer, with the message the sidebar shows (``pending`` false: the move
    is planned or done; :func:`pending_payload` answers while it waits).

    ``target`` is where the plan meant to go; ``picked`` is where the restarted kernel is now
    (the provisioner's pick, which differs from the plan only if the devices changed in between:
    ``note`` then says why).
    """
    planned = tuple(d.uuid for d in plan.target)
    known = {**(labels or {}), **{d.uuid: d.label for d in plan.target}}
    out: MoveAnswer = {
        "dry_run": dry_run,
        "pending": False,
        "plan": plan.message,
        "target": list(planned),
        "target_labels": [d.label for d in plan.target],
        "message": plan.message,
        "picked": None,
        "note": None,
    }
    if dry_run:
        return out
    state = provisioner if isinstance(provisioner, ProvisionerState) else None
    picked = tuple(state.autogpu_picked or ()) if state is not None else ()
    note = state.autogpu_note if state is not None else None
    if picked == planned:
        message = (
            f"The kernel restarted on {_labels(picked, known)}; its state (variables) was lost."
        )
    else:
        # the note says why (the provisioner's words, e.g. the planned device no longer fits);
        # that the state was lost is said once
        why = (note or "").split(": the kernel's state was lost")[0]
        message = (
            f"The kernel restarted on {_labels(picked, known)}, not on "
            f"{_labels(planned, known)} as planned"
            + (f": {why}" if why else "")
            + ". Its state (variables) was lost."
        )
    out["message"] = message
    out["picked"] = list(picked)
    out["note"] = note
    return out


def pending(provisioner: Any) -> bool:
    """Whether a recorded move of this kernel still waits for its restart."""
    path = provisioner.autogpu_move_file if isinstance(provisioner, ProvisionerState) else None
    return bool(path) and path is not None and moves.read_move(path) is not None


def pending_payload(plan: moves.MovePlan) -> MoveAnswer:
    """The answer while a recorded move waits for the kernel's restart."""
    labels = ", ".join(d.label for d in plan.target)
    return {
        "dry_run": False,
        "pending": True,
        "plan": plan.message,
        "target": [d.uuid for d in plan.target],
        "target_labels": [d.label for d in plan.target],
        "message": f"The move to {labels} waits for the kernel's restart.",
        "picked": None,
        "note": None,
    }
