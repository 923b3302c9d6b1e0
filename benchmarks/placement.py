"""Placement benchmark: a stream of notebook jobs on a shared 4-GPU host, per placement policy.

A discrete-time simulation (step ``DT``), deterministic for a given ``--seed``:

* Jobs arrive in bursts (a class or a team starting together) plus a Poisson trickle. Three kinds,
  as the seed project described them: image processing (4 GiB, 2 units of GPU work), data
  analysis (10 GiB, 6 units), training (30 GiB, 25 units). GPUs have 80 GiB.
* The jobs on one GPU share its time equally (k jobs: each progresses at 1/k per unit).
* A job's memory shows up in NVML only ``CONTEXT_LAG`` after it starts (a kernel creates its CUDA
  context some time after the pick). When it shows up and does not fit, the job fails (OOM) and
  is retried ``RETRY_AFTER`` later, placed again by the same policy.

Policies:

* ``gpu0``          – always GPU 0 (what a notebook without any selection does);
* ``random``        – a uniformly random GPU;
* ``least-loaded``  – most free memory as NVML shows it now, then fewest processes (what
  nvitop / GPUtil / setGPU-style pickers do; no leases, so simultaneous starters herd);
* ``autogpu``       – the autogpu policy with leases: effective free memory = free minus what
  live leases booked and NVML does not show yet; only devices where the job fits; ranked by
  effective free memory (1 GiB steps), then live lease count, then UUID; when nothing fits, the
  job waits in line (FIFO) instead of failing.

Reported: makespan, mean job completion time (finish - arrival), failed starts, and the lower
bound max(total work / GPUs, latest arrival + its work).

Run::

    .venv/bin/python benchmarks/placement.py [--seed 1] [--jobs 240]
"""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, field

GIB = 1024**3
GPUS = 4
TOTAL = 80 * GIB
DT = 0.05
CONTEXT_LAG = 0.5
RETRY_AFTER = 2.0
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

    def visible_used(self, g: int) -> int:
        return sum(j.mem for j in self.jobs[g] if j.visible)

    def booked(self, g: int) -> int:
        return sum(j.mem for j in self.jobs[g] if not j.visible)


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
    if policy == "gpu0":
        return 0
    if policy == "random":
        return rng.randrange(GPUS)
    if policy == "least-loaded":
        return min(range(GPUS), key=lambda g: (host.visible_used(g),
                                               sum(1 for j in host.jobs[g] if j.visible), g))
    # autogpu: filter on effective free memory, rank by it, then by lease count, then identity.
    fits = []
    for g in range(GPUS):
        eff_free = TOTAL - host.visible_used(g) - host.booked(g)
        if eff_free >= job.mem:
            fits.append((-math.floor(eff_free / GIB), len(host.jobs[g]), g))
    return min(fits)[2] if fits else None


def simulate(policy: str, jobs_in: list[Job], seed: int) -> dict[str, float]:
    rng = random.Random(seed + 1)
    jobs = [Job(j.jid, j.kind, j.mem, j.work, j.arrival, left=j.work, ready_at=j.arrival)
            for j in jobs_in]
    host = Host()
    pending = sorted(jobs, key=lambda j: (j.ready_at, j.jid))  # arrival order = FIFO order
    failed = 0
    t = 0.0
    done = 0
    while done < len(jobs):
        # 1. placements (in arrival order; the autogpu line waits when nothing fits)
        still = []
        for j in pending:
            if j.ready_at > t + 1e-9:
                still.append(j)
                continue
            g = place(policy, j, host, rng)
            if g is None:
                still.append(j)
                continue
            j.gpu, j.started, j.visible = g, t, False
            host.jobs[g].append(j)
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
        pending.sort(key=lambda j: (j.ready_at, j.arrival, j.jid))
        # 3. processor sharing among the running (visible) jobs of each GPU
        for g in range(GPUS):
            running = [j for j in host.jobs[g] if j.visible]
            for j in running:
                j.left -= DT / len(running)
                if j.left <= 1e-9:
                    j.finish = t + DT
                    host.jobs[g].remove(j)
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
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=240)
    a = ap.parse_args()
    jobs = workload(a.jobs, a.seed)
    work = sum(j.work for j in jobs)
    mix = ", ".join(f"{k}: {sum(1 for j in jobs if j.kind == k)}" for k in KINDS)
    print(f"{len(jobs)} jobs on {GPUS} GPUs ({mix}), total work {work:.0f} units, seed {a.seed}")
    print(f"{'policy':<14}{'makespan':>10}{'vs bound':>10}{'mean JCT':>10}{'failed':>8}")
    lower = None
    for policy in ("gpu0", "random", "least-loaded", "autogpu"):
        r = simulate(policy, jobs, a.seed)
        lower = r["lower_bound"]
        print(f"{policy:<14}{r['makespan']:>10.1f}{r['makespan'] / lower:>9.2f}x"
              f"{r['mean_jct']:>10.1f}{r['failed_starts']:>8d}")
    print(f"{'lower bound':<14}{lower:>10.1f}{1.0:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
