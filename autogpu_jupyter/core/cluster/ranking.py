"""Host ranking: which host of the cluster view a pick should go to, by the one decision
pipeline a local pick uses (:func:`autogpu_jupyter.core.decision.decide`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autogpu_jupyter.core.cluster.series import ClusterHost, ClusterView
from autogpu_jupyter.core.decision import Context, decide
from autogpu_jupyter.core.devices import FleetSnapshot
from autogpu_jupyter.core.policy import Booking, Candidate, Constraints
from autogpu_jupyter.core.visibility import Allocation


@dataclass(frozen=True, slots=True)
class HostChoice:
    """The policy's answer for one host: the device(s) a pick there would choose, if any fit."""

    host: ClusterHost
    chosen: tuple[Candidate, ...]
    candidates: tuple[Candidate, ...]

    @property
    def fits(self) -> bool:
        return bool(self.chosen)

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.host.hostname,
            "state": self.host.state,
            "as_of_s": self.host.as_of_s,
            "fits": self.fits,
            "chosen": [c.to_dict() for c in self.chosen],
            "candidates": [c.to_dict() for c in self.candidates],
            "note": self.host.note,
        }


def rank_hosts(view: ClusterView, constraints: Constraints) -> list[HostChoice]:
    """Hosts best first, by the policy a local pick uses (see the module docstring).

    Each ``ok`` host's devices go through :func:`decision.decide` with the bookings Prometheus
    holds; hosts whose selection fits come first, ordered by the policy key of the worst device
    they would give (for one device: its key) less the key's UUID tie-break, then by hostname;
    then hosts where nothing fits, stale and down hosts (never chosen), by hostname.
    """
    fitting: list[HostChoice] = []
    rest: list[HostChoice] = []
    for host in view.hosts:
        if host.state != "ok":
            rest.append(HostChoice(host, (), ()))
            continue
        snaps = tuple(d.snapshot for d in host.devices)
        # The one decision pipeline over what Prometheus holds: no allocation bounds a host
        # seen from outside (its scheduler grants inside it), the bookings are its exporter's.
        context = Context(
            snapshot=FleetSnapshot(snaps, view.timestamp_s, "prometheus"),
            allocation=Allocation(source=None, raw=None, uuids=None),
            bookings={
                d.snapshot.uuid: Booking(d.snapshot.uuid, d.lease_count, d.booked_bytes)
                for d in host.devices
            },
        )
        decision = decide(context, constraints)
        choice = HostChoice(host, decision.chosen, decision.ranked)
        (fitting if choice.fits else rest).append(choice)
    # The worst chosen device's key less its last term (the UUID, a local pick's tie-break
    # between devices), then the hostname: equally loaded hosts go by name.
    fitting.sort(key=lambda c: (max(x.key[:-1] for x in c.chosen), c.host.hostname))
    order = {"ok": 0, "stale": 1, "down": 2}
    rest.sort(key=lambda c: (order.get(c.host.state, len(order)), c.host.hostname))
    return fitting + rest
