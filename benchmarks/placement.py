"""Placement benchmark: a stream of notebook jobs on a shared 4-GPU host, per placement policy.

A discrete-time simulation (step ``DT``), deterministic for a given ``--seed``:

* Jobs arrive in bursts (a class or a team starting together) plus a Poisson trickle. Three kinds,
  as the seed project described them: image processing (4 GiB, 2 units of GPU work), data
  analysis (10 GiB, 6 units), training (30 GiB, 25 units). GPUs have 80 GiB.
* The jobs on one GPU share its time equally (k jobs: each progresses at 1/k per unit).
* A job's memory shows up in NVML only ``CONTEXT_LAG`` after it starts (a kernel creates its CUDA
  context some time after the pick). When it shows up and does not fit, the job fails (OOM) and
  is retried ``RETRY_AFTER`` later, placed again by the same policy.

Policies (none of them may look into the future; each sees only what its tool would see):

* ``gpu0``          – always GPU 0 (what a notebook without any selection does);
* ``random``        – a uniformly random GPU;
* ``gputil``        – GPUtil's ``getAvailable(order='memory', limit=1)`` rule with its load and
  memory caps off: the lowest used/total memory as NVML shows it now, first index on ties;
* ``least-loaded``  – ``nvitop.select_devices(min_count=1, max_count=1, min_free_memory=job)``
  exactly: keep devices whose NVML free memory fits the job, then sort by free memory
  (descending), used memory (descending), GPU utilisation, memory utilisation (ascending),
  highest index first; when none fits, the job waits and asks again (no failed start: the
  strongest lease-less baseline). No leases, so starters herd onto memory that is about to go;
* ``autogpu``       – the real policy: ``core.policy.rank`` + ``select`` with
  ``Constraints(min_free=Size(bytes=job memory))`` over :class:`DeviceSnapshot` s of the
  simulated host and the :class:`Booking` s that ``core.decision.bookings_for`` folds from one
  live lease per placed job (booked until "NVML" lists the job's pid, then its real use counts);
  when nothing fits, the job waits in line (FIFO, arrival order, as ``--wait`` does).

What "NVML" shows of a simulated GPU: memory used = the memory of the jobs whose context exists
(``CONTEXT_LAG`` after their start), their pids in the process list; utilisation = 100 % x
min(1, running jobs), since jobs that share a GPU's time keep it busy (the model has no idle
time inside a job); memory-bandwidth utilisation = the same.

Reported: makespan, mean job completion time (finish - arrival), failed starts, and the lower
bound max(total work / GPUs, latest arrival + its work).

Run::

    .venv/bin/python benchmarks/placement.py [--seed 1] [--jobs 240]
    .venv/bin/python benchmarks/placement.py --seeds 1,2,3,4,5 --markdown
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autogpu_jupyter.core.decision import bookings_for
from autogpu_jupyter.core.devices import DeviceSnapshot, ProcessSnapshot
from autogpu_jupyter.core.leasing import LeaseRecord
from autogpu_jupyter.core.policy import Constraints, rank, select
from autogpu_jupyter.core.units import Size

GIB = 1024**3
GPUS = 4
TOTAL = 80 * GIB
DT = 0.05
CONTEXT_LAG = 0.5
RETRY_AFTER = 2.0
UUIDS = [f"GPU-{g:08x}-sim0-sim0-sim0-{g:012x}" for g in range(GPUS)]
POLICIES = ("gpu0", "random", "gputil", "least-loaded", "autogpu")
KINDS = {  # name: (memory bytes, work units, share of jobs)
    "image": (4 * GIB, 2.0, 0.5),
    "analysis": (10 * GIB, 6.0, 0.35),
    "training": (30 * GIB, 25.0, 0.15),
}


@dataclass
class Job:
    jid: int
    kind: str
    mem: int
    work: float
    arrival: float
    left: float = 0.0
    gpu: int | None = None
    started: float | None = None
    visible: bool = False
    finish: float | None = None
    failures: int = 0
    ready_at: float = 0.0


@dataclass
class Host:
    jobs: list[list[Job]] = field(default_factory=lambda: [[] for _ in range(GPUS)])
    version: int = 0  # bumped on every change a picker could see
    _cache: tuple[int, tuple[DeviceSnapshot, ...], dict] | None = None

    def visible_used(self, g: int) -> int:
        return sum(j.mem for j in self.jobs[g] if j.visible)

    def running(self, g: int) -> int:
        return sum(1 for j in self.jobs[g] if j.visible)

    def util_pct(self, g: int) -> float:
        return 100.0 * min(1, self.running(g))

    def nvml_view(self) -> tuple[tuple[DeviceSnapshot, ...], dict]:
        """What NVML shows now (snapshots) and the live leases folded per device (bookings)."""
        if self._cache is not None and self._cache[0] == self.version:
            return self._cache[1], self._cache[2]
        devices = []
        leases = []
        for g in range(GPUS):
            used = self.visible_used(g)
            util = self.util_pct(g)
            devices.append(DeviceSnapshot(
                index=g, uuid=UUIDS[g], name="NVIDIA A100-SXM4-80GB",
                memory_total_bytes=TOTAL, memory_used_bytes=used, memory_free_bytes=TOTAL - used,
                utilization_pct=util, memory_utilization_pct=util, compute_mode="DEFAULT",
                mig_enabled=False,
                processes=tuple(ProcessSnapshot(pid=_pid(j), used_memory_bytes=j.mem)
                                for j in self.jobs[g] if j.visible),
            ))
            leases.extend(LeaseRecord(
                lease_id=f"{j.jid:032x}", kind="lease", device_uuids=(UUIDS[g],),
                device_requested_bytes=(j.mem,), exclusive=False, user="sim", uid=1000,
                host="sim", pid=_pid(j), created_s=j.started or 0.0,
            ) for j in self.jobs[g])
        snaps = tuple(devices)
        bookings = bookings_for(snaps, leases)
        self._cache = (self.version, snaps, bookings)
        return snaps, bookings


def _pid(job: Job) -> int:
    return 10_000 + job.jid


def workload(n: int, seed: int) -> list[Job]:
    rng = random.Random(seed)
    kinds = list(KINDS)
    weights = [KINDS[k][2] for k in kinds]
    jobs: list[Job] = []
    t = 0.0
    while len(jobs) < n:
        if rng.random() < 0.25:  # a burst: 8-16 kernels start at the same instant
            for _ in range(rng.randint(8, 16)):
                jobs.append(_job(len(jobs), rng.choices(kinds, weights)[0], t))
        else:
            jobs.append(_job(len(jobs), rng.choices(kinds, weights)[0], t))
        t += rng.expovariate(1 / 3.0)
    return jobs[:n]


def _job(jid: int, kind: str, t: float) -> Job:
    mem, work, _ = KINDS[kind]
    return Job(jid, kind, mem, work, t, left=work, ready_at=t)


def place(policy: str, job: Job, host: Host, rng: random.Random) -> int | None:
    """The GPU ``policy`` picks for ``job`` now, or ``None``: nothing fits, wait and ask again."""
    if policy == "gpu0":
        return 0
    if policy == "random":
        return rng.randrange(GPUS)
    if policy == "gputil":
        return min(range(GPUS), key=lambda g: (host.visible_used(g) / TOTAL, g))
    if policy == "least-loaded":
        fits = [g for g in range(GPUS) if TOTAL - host.visible_used(g) >= job.mem]
        if not fits:
            return None
        return min(fits, key=lambda g: (-(TOTAL - host.visible_used(g)), -host.visible_used(g),
                                         host.util_pct(g), host.util_pct(g), -g))
    devices, bookings = host.nvml_view()
    chosen = select(rank(devices, Constraints(min_free=Size(bytes=job.mem)), bookings=bookings), 1)
    return chosen[0].device.index if chosen else None


def simulate(policy: str, jobs_in: list[Job], seed: int) -> dict[str, float]:
    rng = random.Random(seed + 1)
    jobs = [Job(j.jid, j.kind, j.mem, j.work, j.arrival, left=j.work, ready_at=j.arrival)
            for j in jobs_in]
    host = Host()
    pending = sorted(jobs, key=lambda j: (j.ready_at, j.jid))  # arrival order = FIFO order
    asked: dict[int, int] = {}  # job id -> host version when nothing fitted (same answer again)
    failed = 0
    t = 0.0
    done = 0
    while done < len(jobs):
        # 1. placements (in arrival order; the autogpu line waits when nothing fits)
        still = []
        for j in pending:
            if j.ready_at > t + 1e-9 or asked.get(j.jid) == host.version:
                still.append(j)
                continue
            g = place(policy, j, host, rng)
            if g is None:
                asked[j.jid] = host.version
                still.append(j)
                continue
            j.gpu, j.started, j.visible = g, t, False
            host.jobs[g].append(j)
            host.version += 1
        pending = still
        # 2. contexts appear; a job that does not fit fails and retries later
        for g in range(GPUS):
            for j in list(host.jobs[g]):
                if not j.visible and t - (j.started or 0.0) >= CONTEXT_LAG - 1e-9:
                    if host.visible_used(g) + j.mem > TOTAL:
                        host.jobs[g].remove(j)
                        failed += 1
                        j.failures += 1
                        j.left = j.work
                        j.ready_at = t + RETRY_AFTER
                        pending.append(j)
                    else:
                        j.visible = True
                    host.version += 1
        pending.sort(key=lambda j: (j.ready_at, j.arrival, j.jid))
        # 3. processor sharing among the running (visible) jobs of each GPU
        for g in range(GPUS):
            running = [j for j in host.jobs[g] if j.visible]
            for j in running:
                j.left -= DT / len(running)
                if j.left <= 1e-9:
                    j.finish = t + DT
                    host.jobs[g].remove(j)
                    host.version += 1
                    done += 1
        t += DT
    makespan = max(j.finish or 0.0 for j in jobs)
    total_work = sum(j.work for j in jobs)
    lower = max(total_work / GPUS, max(j.arrival + j.work for j in jobs))
    return {
        "makespan": makespan,
        "mean_jct": sum((j.finish or 0.0) - j.arrival for j in jobs) / len(jobs),
        "failed_starts": failed,
        "lower_bound": lower,
        "jct_by_kind": {
            k: sum((j.finish or 0.0) - j.arrival for j in jobs if j.kind == k)
            / max(1, sum(1 for j in jobs if j.kind == k))
            for k in KINDS
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=None, help="one seed (default 1)")
    ap.add_argument("--seeds", default=None, help="several seeds, e.g. 1,2,3")
    ap.add_argument("--jobs", type=int, default=240)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else [a.seed or 1]
    policies = a.policies.split(",")
    unknown = set(policies) - set(POLICIES)
    if unknown:
        ap.error(f"unknown policy(ies) {sorted(unknown)}: expected some of {', '.join(POLICIES)}")
    md = ["| seed | policy | makespan | vs bound | mean JCT | failed starts "
          "| mean JCT image / analysis / training |", "|---|---|---|---|---|---|---|"]
    for seed in seeds:
        jobs = workload(a.jobs, seed)
        work = sum(j.work for j in jobs)
        mix = ", ".join(f"{k}: {sum(1 for j in jobs if j.kind == k)}" for k in KINDS)
        print(f"{len(jobs)} jobs on {GPUS} GPUs ({mix}), total work {work:.0f} units, seed {seed}")
        print(f"{'policy':<14}{'makespan':>10}{'vs bound':>10}{'mean JCT':>10}{'failed':>8}"
              f"   mean JCT by kind ({', '.join(KINDS)})")
        lower = None
        for policy in policies:
            r = simulate(policy, jobs, seed)
            lower = r["lower_bound"]
            print(f"{policy:<14}{r['makespan']:>10.1f}{r['makespan'] / lower:>9.3f}x"
                  f"{r['mean_jct']:>10.1f}{r['failed_starts']:>8d}   "
                  + " / ".join(f"{v:.1f}" for v in r["jct_by_kind"].values()), flush=True)
            md.append(f"| {seed} | {policy} | {r['makespan']:.1f} | {r['makespan'] / lower:.3f}× | "
                      f"{r['mean_jct']:.1f} | {r['failed_starts']} | "
                      + " / ".join(f"{v:.1f}" for v in r["jct_by_kind"].values()) + " |")
        print(f"{'lower bound':<14}{lower:>10.1f}{1.0:>9.3f}x")
        md.append(f"| {seed} | *lower bound* | {lower:.1f} | 1× | | | |")
    if a.markdown:
        print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
