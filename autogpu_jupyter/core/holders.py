"""One holder model: who holds a GPU, the same in every view (design decision 13).

A holder is a lease, a process, or both matched (the lease's pid is the process NVML lists on
that device): user, pid, kernel and notebook where known, memory booked (the lease) and used
(the process). ``%gpu status``, ``autogpu list``, the panel's table and the server's
``/autogpu/holders`` (the sidebar) all build their holder lists here and word them with
:func:`Holder.text` (the words themselves are :mod:`autogpu_jupyter.core.words`').
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from autogpu_jupyter.core.words import NOBODY, holder_memory, holder_where, holder_who

if TYPE_CHECKING:
    from autogpu_jupyter.core.devices import FleetSnapshot
    from autogpu_jupyter.core.leasing.records import LeaseRecord

__all__ = ["NOBODY", "Holder", "holders_by_device"]

@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (part of) one device."""

    uuid: str
    user: str | None
    pid: int | None
    kernel_id: str | None = None
    notebook_path: str | None = None
    booked_bytes: int | None = None
    used_memory_bytes: int | None = None
    lease_id: str | None = None
    exclusive: bool = False
    mine: bool = False

    @property
    def kind(self) -> Literal["lease", "process", "lease+process"]:
        """``lease``, ``process`` or ``lease+process`` (a lease whose holder uses the GPU)."""
        if self.lease_id is not None and self.used_memory_bytes is not None:
            return "lease+process"
        return "lease" if self.lease_id is not None else "process"

    def who(self) -> str:
        """``alice: train.ipynb``, ``bob: kernel 1a2b3c4d``, ``carol: pid 4242``, ``pid 4242``."""
        if self.mine:
            return "this kernel"
        return holder_who(
            self.user, holder_where(self.notebook_path, self.kernel_id, self.pid) or "?"
        )

    def memory(self) -> str:
        """``10.0 GiB booked, 3.2 GiB used`` (what is known)."""
        return holder_memory(self.booked_bytes, self.used_memory_bytes, self.exclusive)

    def text(self) -> str:
        """The holder in words, as every view shows it: ``alice: train.ipynb (10.0 GiB
        booked, 3.2 GiB used)``."""
        mem = self.memory()
        return f"{self.who()} ({mem})" if mem else self.who()


def holders_by_device(
    snapshot: FleetSnapshot,
    leases: Iterable[LeaseRecord],
    *,
    own_pids: Iterable[int] = (),
    kernel_of_pid: Mapping[int, str] | None = None,
    notebook_of_kernel: Mapping[str, str] | None = None,
) -> dict[str, list[Holder]]:
    """Every device's holders: leases, processes, and the two matched by pid.

    Parameters
    ----------
    snapshot
        The devices, with NVML's processes per device.
    leases
        Live lease records (the registry's).
    own_pids
        PIDs of the caller (a kernel and its children): shown as "this kernel".
    kernel_of_pid, notebook_of_kernel
        What a Jupyter server knows: which of its kernels a pid belongs to, and that kernel's
        notebook (so processes of a kernel that set ``CUDA_VISIBLE_DEVICES`` itself, with no
        lease, are named too).
    """
    ours = set(own_pids)
    kernels = kernel_of_pid or {}
    notebooks = notebook_of_kernel or {}
    records = list(leases)
    out: dict[str, list[Holder]] = {}
    for dev in snapshot.devices:
        procs = {p.pid: p for p in (dev.processes or ())}
        found: list[Holder] = []
        for rec in records:
            if dev.uuid not in rec.device_uuids:
                continue
            proc = procs.pop(rec.pid, None)
            found.append(
                Holder(
                    uuid=dev.uuid,
                    user=rec.user,
                    pid=rec.pid,
                    kernel_id=rec.kernel_id,
                    notebook_path=rec.notebook_path,
                    booked_bytes=rec.requested_on(dev.uuid),
                    used_memory_bytes=None if proc is None else proc.used_memory_bytes,
                    lease_id=rec.lease_id,
                    exclusive=rec.exclusive,
                    mine=rec.pid in ours,
                )
            )
        for proc in procs.values():
            kid = kernels.get(proc.pid)
            found.append(
                Holder(
                    uuid=dev.uuid,
                    user=proc.user,
                    pid=proc.pid,
                    kernel_id=kid,
                    notebook_path=notebooks.get(kid) if kid else None,
                    used_memory_bytes=proc.used_memory_bytes,
                    mine=proc.pid in ours,
                )
            )
        out[dev.uuid] = found
    return out


def holders_text(holders: Sequence[Holder]) -> str:
    """A device's holders on one line (:data:`NOBODY` when nobody holds it)."""
    return ", ".join(h.text() for h in holders) if holders else NOBODY
