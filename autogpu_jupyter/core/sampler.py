"""One background sampler per process: every device, at an interval, into a bounded history.

The sampler is shared by every panel in a kernel, by ``%%gpu`` and by :func:`status` (design
decision 8): :func:`get_sampler` returns the one :class:`Sampler` of the process, started on first
use in a daemon thread named ``autogpu-sampler``; :func:`stop_sampler` stops it (the extension's
unload calls it, and it is registered with :mod:`atexit`).

Memory is bounded whatever the uptime: the history is a ``collections.deque(maxlen=...)`` of one
compact tuple per sample, ``(timestamp_s, uuids, values)`` where ``uuids`` is a tuple shared
between samples while the device list does not change and ``values`` is a small ``float64`` numpy
array of shape ``(n_devices, len(METRICS))`` (``NaN`` = unknown). At the default 1 s interval and
900 s of history, 8 devices take well under 1 MiB.

NVML errors never stop the thread: a failed read is recorded in :attr:`Sampler.errors` and the next
interval tries again; a lost device is recorded with ``available = 0`` while the others keep
updating. Listeners (:meth:`Sampler.subscribe`) are called from the sampler thread after each
sample; they must only set values (never print or display).
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core import procfs
from autogpu_jupyter.core.backends import Backend, get_backend
from autogpu_jupyter.errors import AutoGPUError, UsageErrorBase

if TYPE_CHECKING:
    import pandas as pd

    from autogpu_jupyter.core.devices import FleetSnapshot

__all__ = [
    "METRICS",
    "THREAD_NAME",
    "DeviceSeries",
    "SampleError",
    "Sampler",
    "get_sampler",
    "stop_sampler",
    "current_sampler",
    "own_pids",
    "mean_util",
    "series_from_frame",
]

log = logging.getLogger(__name__)

#: Name of the sampler thread (tests count threads by it).
THREAD_NAME = "autogpu-sampler"

#: The metrics kept per device and sample, in the column order of the history arrays.
#: ``own_memory_bytes`` is the GPU memory of this process and its descendants;
#: ``available`` is 1.0, or 0.0 for a lost / unreadable device.
METRICS: tuple[str, ...] = (
    "utilization_pct",
    "memory_used_bytes",
    "memory_free_bytes",
    "memory_total_bytes",
    "temperature_c",
    "power_w",
    "own_memory_bytes",
    "available",
)
_COL = {name: i for i, name in enumerate(METRICS)}

MIN_INTERVAL_S = 0.1
#: Upper bound of samples kept, whatever ``history_s / interval_s`` asks for (memory ceiling).
MAX_SAMPLES = 20_000
_MAX_ERRORS = 50
#: How many levels below the root :func:`own_pids` looks for descendants.
_MAX_DEPTH = 63

Listener = Callable[["Sampler", "FleetSnapshot | None"], None]
#: One device's history from elsewhere (:meth:`Sampler.seed`): timestamps, utilisation, memory
#: used, memory total.
SeedSeries = tuple[
    Sequence[float], Sequence[float | None], Sequence[float | None], float | None
]


@dataclass(frozen=True, slots=True)
class SampleError:
    """A failed read of the whole fleet (``message`` says why)."""

    timestamp_s: float
    message: str


@dataclass(frozen=True, slots=True)
class DeviceSeries:
    """One device's history as numpy arrays (what the panel draws; no pandas per redraw).

    ``timestamps_s`` has shape ``(n,)``; ``values`` has shape ``(n, len(METRICS))``, columns in
    :data:`METRICS` order (``NaN`` = unknown). Treat both as read-only.
    """

    uuid: str
    timestamps_s: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return int(self.timestamps_s.shape[0])

    def column(self, metric: str) -> np.ndarray:
        """The values of one metric of :data:`METRICS` (e.g. ``"utilization_pct"``)."""
        return self.values[:, _COL[metric]]

    @classmethod
    def empty(cls, uuid: str) -> DeviceSeries:
        return cls(uuid, np.empty(0), np.empty((0, len(METRICS))))


def series_from_frame(frame: pd.DataFrame) -> dict[str, DeviceSeries]:
    """:class:`DeviceSeries` per UUID from a long table like :meth:`Sampler.history_frame`
    (metric columns it lacks read as unknown), in order of first appearance."""
    if not len(frame):
        return {}
    ts_all = frame["timestamp_s"].to_numpy(dtype=float)
    values_all = np.full((len(frame), len(METRICS)), np.nan)
    for i, name in enumerate(METRICS):
        if name in frame:
            values_all[:, i] = frame[name].to_numpy(dtype=float)
    uuids = frame["uuid"].to_numpy()
    out: dict[str, DeviceSeries] = {}
    for uuid in dict.fromkeys(uuids.tolist()):
        mask = uuids == uuid
        out[str(uuid)] = DeviceSeries(str(uuid), ts_all[mask], values_all[mask])
    return out


def own_pids(pids: Iterable[int], root_pid: int | None = None) -> frozenset[int]:
    """The subset of ``pids`` that are ``root_pid`` (default: this process) or its descendants.

    Walks each PID's parent chain in ``/proc``, at most :data:`_MAX_DEPTH` levels up; PIDs from
    another PID namespace (containers report host PIDs) are not found and so are not ours.
    """
    root = os.getpid() if root_pid is None else root_pid
    ours: set[int] = set()
    for pid in set(pids):
        cur: int | None = pid
        # The chain ends where /proc has no parent (pid 0's stat); the bound only guards
        # against a loop that PID reuse could make while we walk.
        for _ in range(_MAX_DEPTH + 1):
            if cur is None:
                break
            if cur == root:
                ours.add(pid)
                break
            cur = procfs.ppid(cur)
    return frozenset(ours)


def _num(value: float | int | None) -> float:
    return math.nan if value is None else float(value)


def _seed_num(value: object) -> float:
    """A number from history read elsewhere; anything else (``None``, text, inf) is unknown."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return math.nan
    f = float(value)
    return f if math.isfinite(f) else math.nan


class Sampler:
    """Reads every device at an interval into a bounded history. Thread-safe.

    Parameters
    ----------
    backend
        Where snapshots come from; default :func:`autogpu_jupyter.core.backends.get_backend`
        (resolved on the first sample, so a missing driver is recorded, not raised).
    interval_s
        Seconds between samples (>= 0.1; NVML utilisation means nothing much faster than 1 s).
    history_s
        Seconds of history kept; the ring buffer holds ``history_s / interval_s`` samples
        (at most :data:`MAX_SAMPLES`).
    clock
        Wall clock in seconds (``time.time``); the timestamps of the history.
    """

    def __init__(
        self,
        backend: Backend | None = None,
        interval_s: float = 1.0,
        history_s: float = 900.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._backend = backend
        self._clock = clock
        self._lock = threading.RLock()
        self._interval_s = self._check_interval(interval_s)
        self._history_s = self._check_history(history_s)
        self._buffer: deque[tuple[float, tuple[str, ...], np.ndarray]] = deque(
            maxlen=self._capacity()
        )
        self._labels: dict[str, str] = {}
        self._latest: FleetSnapshot | None = None
        self._latest_own_pids: frozenset[int] = frozenset()
        self._errors: deque[SampleError] = deque(maxlen=_MAX_ERRORS)
        self._listeners: tuple[Listener, ...] = ()
        self._sample_count = 0
        self._paused = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        # smoothed_util's last answer: (window, first entry, newest entry, length, answer)
        self._smoothed: tuple[float, object, object, int, dict[str, float | None]] | None = None

    # -- configuration -------------------------------------------------------------------
    @staticmethod
    def _check_interval(interval_s: float) -> float:
        try:
            value = float(interval_s)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value < MIN_INTERVAL_S:
            raise UsageErrorBase(
                f"invalid sampler interval {interval_s!r}: expected a number of seconds >= "
                f"{MIN_INTERVAL_S}, e.g. 1 or 0.5"
            )
        return value

    @staticmethod
    def _check_history(history_s: float) -> float:
        try:
            value = float(history_s)
        except (TypeError, ValueError):
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise UsageErrorBase(
                f"invalid sampler history {history_s!r}: expected a positive number of seconds, "
                "e.g. 900"
            )
        return value

    def _capacity(self) -> int:
        return max(2, min(MAX_SAMPLES, math.ceil(self._history_s / self._interval_s) + 1))

    @property
    def interval_s(self) -> float:
        """Seconds between samples."""
        return self._interval_s

    @property
    def history_s(self) -> float:
        """Seconds of history kept (within :data:`MAX_SAMPLES` samples)."""
        return self._history_s

    @property
    def capacity(self) -> int:
        """The ring buffer's size in samples."""
        return self._buffer.maxlen or 0

    def set_interval(self, interval_s: float) -> None:
        """Change the interval (takes effect at once; the ring buffer is resized to keep
        ``history_s``). Raises :class:`UsageErrorBase` below 0.1 s."""
        value = self._check_interval(interval_s)
        with self._lock:
            self._interval_s = value
            self._resize()
        self._wake.set()

    def set_history(self, history_s: float) -> None:
        """Change how many seconds of history are kept (the newest samples are preserved)."""
        value = self._check_history(history_s)
        with self._lock:
            self._history_s = value
            self._resize()

    def _resize(self) -> None:
        cap = self._capacity()
        if cap != self._buffer.maxlen:
            self._buffer = deque(self._buffer, maxlen=cap)

    # -- thread --------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the sampler thread is alive."""
        t = self._thread
        return t is not None and t.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    def start(self) -> None:
        """Start the daemon thread (no-op when it runs)."""
        with self._lock:
            if self.running:
                return
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and wait for it (up to ``timeout_s``)."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def pause(self) -> None:
        """Stop taking samples until :meth:`resume` (the thread stays, idle)."""
        self._paused = True

    def resume(self) -> None:
        """Take samples again."""
        self._paused = False
        self._wake.set()

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            if not self._paused:
                self.sample_now()
            # One interval on; after falling behind (a slow read, a suspended host) at once,
            # without catching up. A wait of no time or less returns at once.
            next_t = max(next_t + self._interval_s, time.monotonic())
            if self._wake.wait(next_t - time.monotonic()):
                self._wake.clear()
                next_t = time.monotonic()

    # -- sampling ------------------------------------------------------------------------
    def _get_backend(self) -> Backend:
        if self._backend is None:
            self._backend = get_backend()
        return self._backend

    def sample_now(self) -> FleetSnapshot | None:
        """Take one sample now (the thread calls this; tests and the first panel draw may too).

        Returns the snapshot, or ``None`` when the read failed (the error is recorded).
        """
        try:
            snapshot = self._get_backend().snapshot()
        except AutoGPUError as err:
            self._record_error(str(err))
            return None
        except Exception as err:  # the thread must survive any backend failure; keep it visible
            log.warning("sampler: reading the devices failed", exc_info=True)
            self._record_error(f"{type(err).__name__}: {err}")
            return None
        self.add(snapshot)
        return snapshot

    def _record_error(self, message: str) -> None:
        with self._lock:
            self._errors.append(SampleError(float(self._clock()), message))
            listeners = self._listeners
        self._notify(listeners, None)

    def add(self, snapshot: FleetSnapshot, *, own: Iterable[int] | None = None) -> None:
        """Append one snapshot to the history and notify listeners.

        ``own`` are the PIDs counted as this process (default: this process and its
        descendants, found in ``/proc``).
        """
        procs = [p.pid for d in snapshot.devices for p in (d.processes or ())]
        ours = own_pids(procs) if own is None else frozenset(own)
        values = np.full((len(snapshot.devices), len(METRICS)), np.nan)
        uuids = tuple(d.uuid for d in snapshot.devices)
        for row, dev in enumerate(snapshot.devices):
            if not dev.available:
                values[row, _COL["available"]] = 0.0
                continue
            own_mem = None
            if dev.processes is not None:
                own_mem = sum(p.used_memory_bytes or 0 for p in dev.processes if p.pid in ours)
            values[row] = (
                _num(dev.utilization_pct),
                _num(dev.memory_used_bytes),
                _num(dev.memory_free_bytes),
                _num(dev.memory_total_bytes),
                _num(dev.temperature_c),
                _num(dev.power_w),
                _num(own_mem),
                1.0,
            )
        with self._lock:
            if self._buffer and self._buffer[-1][1] == uuids:
                uuids = self._buffer[-1][1]  # share one tuple between samples
            else:
                for dev in snapshot.devices:
                    self._labels[dev.uuid] = dev.label
            self._buffer.append((float(snapshot.timestamp_s), uuids, values))
            self._latest = snapshot
            self._latest_own_pids = ours
            self._sample_count += 1
            listeners = self._listeners
        self._notify(listeners, snapshot)

    def seed(self, series: Mapping[str, SeedSeries]) -> int:
        """Put history read elsewhere (the Jupyter server's sampler) before this one's own
        samples, so that a fresh panel starts with the minutes the server already has.

        ``series`` maps a UUID to ``(timestamps_s, utilization_pct, memory_used_bytes,
        memory_total_bytes)`` (lists, oldest first; ``None`` = unknown). Only the devices of
        this sampler's newest snapshot, only samples older than its oldest and within
        ``history_s`` of its newest, and no more than its buffer has room for (the newest of
        them) are kept; a device without a value at a timestamp is unknown there. Returns the
        number of samples added (0: nothing to seed, e.g. before the first sample).
        """
        with self._lock:
            if not self._buffer or self._latest is None:
                return 0
            uuids = self._buffer[0][1]
            oldest = self._buffer[0][0]
            cutoff = self._buffer[-1][0] - self._history_s
            room = (self._buffer.maxlen or 0) - len(self._buffer)
        rows: dict[float, np.ndarray] = {}
        index = {u: i for i, u in enumerate(uuids)}
        for uuid, (ts, util, used, total) in series.items():
            row_of = index.get(uuid)
            if row_of is None:
                continue
            n = min(len(ts), len(util), len(used))
            for k in range(n):
                t = _seed_num(ts[k])
                if not (cutoff <= t < oldest):
                    continue
                values = rows.get(t)
                if values is None:
                    values = np.full((len(uuids), len(METRICS)), np.nan)
                    rows[t] = values
                u, m = _seed_num(util[k]), _seed_num(used[k])
                tot = _seed_num(total)
                values[row_of] = (
                    u, m, tot - m, tot, np.nan, np.nan, np.nan,
                    1.0 if not (np.isnan(u) and np.isnan(m)) else np.nan,
                )
        stamps = sorted(rows)[-room:] if room > 0 else []
        with self._lock:
            # the buffer may have moved on meanwhile: still only before its oldest sample
            if not self._buffer or self._buffer[0][1] != uuids:
                return 0
            first = self._buffer[0][0]
            added = [t for t in stamps if t < first]
            room = (self._buffer.maxlen or 0) - len(self._buffer)
            added = added[-room:] if room > 0 else []
            for t in reversed(added):
                self._buffer.appendleft((t, uuids, rows[t]))
        return len(added)

    def _notify(self, listeners: tuple[Listener, ...], snapshot: FleetSnapshot | None) -> None:
        for cb in listeners:
            try:
                cb(self, snapshot)
            except Exception:  # one broken listener must not stop the sampler or the others
                log.warning("sampler listener %r failed", cb, exc_info=True)

    # -- listeners -----------------------------------------------------------------------
    def subscribe(self, callback: Listener) -> None:
        """Call ``callback(sampler, snapshot)`` from the sampler thread after each sample
        (``snapshot`` is ``None`` after a failed read). It must only set values, never print."""
        with self._lock:
            if callback not in self._listeners:
                self._listeners = (*self._listeners, callback)

    def unsubscribe(self, callback: Listener) -> None:
        """Stop calling ``callback`` (no error when it was not subscribed)."""
        with self._lock:
            self._listeners = tuple(cb for cb in self._listeners if cb != callback)

    @property
    def listener_count(self) -> int:
        return len(self._listeners)

    # -- reading -------------------------------------------------------------------------
    @property
    def sample_count(self) -> int:
        """Samples taken since the sampler was created (keeps growing; the buffer does not)."""
        return self._sample_count

    @property
    def errors(self) -> tuple[SampleError, ...]:
        """The most recent failed reads (at most 50), oldest first."""
        with self._lock:
            return tuple(self._errors)

    def latest(self) -> FleetSnapshot | None:
        """The newest snapshot (with processes), or ``None`` before the first good read."""
        return self._latest

    def latest_own_pids(self) -> frozenset[int]:
        """The PIDs of the newest snapshot that are this process or its descendants."""
        return self._latest_own_pids

    def __len__(self) -> int:
        return len(self._buffer)

    def history_frame(self, since_s: float | None = None) -> pd.DataFrame:
        """The history as a long table: one row per sample and device.

        Parameters
        ----------
        since_s
            Only the last ``since_s`` seconds (relative to the newest sample); ``None`` = all.

        Returns
        -------
        pandas.DataFrame
            Columns ``timestamp_s`` (float, Unix seconds), ``time`` (UTC datetime), ``uuid``,
            ``label`` and one float column per name in :data:`METRICS` (``NaN`` = unknown;
            ``available`` is 1.0, or 0.0 for a lost device). Use ``pivot`` for a wide table.
            Sorted by time, then in device order.
        """
        import pandas as pd  # noqa: PLC0415 (pandas: only for a frame)

        samples = self._window(since_s)
        with self._lock:
            labels = dict(self._labels)
        # The leading empty arrays give an empty history the same columns and dtypes.
        ts = np.concatenate([np.empty(0), *(np.full(len(u), t) for t, u, _ in samples)])
        values = np.concatenate([np.empty((0, len(METRICS))), *(v for _, _, v in samples)])
        uuids = [u for _, us, _ in samples for u in us]
        data: dict[str, Any] = {
            "timestamp_s": ts,
            "time": pd.to_datetime(ts, unit="s", utc=True),
            "uuid": pd.Series(uuids, dtype=str),
            "label": pd.Series([labels[u] for u in uuids], dtype=str),  # add() labels them all
        }
        for i, name in enumerate(METRICS):
            data[name] = values[:, i]
        return pd.DataFrame(data)  # columns in the order of ``data``

    def _window(self, since_s: float | None) -> list[tuple[float, tuple[str, ...], np.ndarray]]:
        with self._lock:
            buf = self._buffer
            if not buf:
                return []
            if since_s is None:
                return list(buf)
            cutoff = buf[-1][0] - float(since_s)
            # the buffer is in time order: walk back from the newest sample only as far as needed
            n = 0
            for t, _, _ in reversed(buf):
                if t < cutoff:
                    break
                n += 1
            return list(buf)[len(buf) - n :]

    def history_series(self, since_s: float | None = None) -> dict[str, DeviceSeries]:
        """The history per device as numpy arrays (cheap: what the panel redraws from).

        Parameters
        ----------
        since_s
            Only the last ``since_s`` seconds (relative to the newest sample); ``None`` = all.

        Returns
        -------
        dict[str, DeviceSeries]
            By UUID, devices in order of first appearance; each series in time order.
        """
        return _series(self._window(since_s))

    def smoothed_util(self, window_s: float = 60.0) -> dict[str, float | None]:
        """Mean utilisation per device UUID over the last ``window_s`` seconds.

        ``None`` where no sample in the window knows the utilisation (NOT_SUPPORTED, lost).
        Devices of the newest sample only. Computed once per sample: every pick asks it, and
        the window only moves when a sample is added (or the history trimmed or backfilled).
        """
        with self._lock:
            buf = self._buffer
            if not buf:
                return {}
            ends = (buf[0], buf[-1], len(buf))
            known = self._smoothed
            # Entries are never changed in place, only added or dropped at the ends: the same
            # first and newest entry objects and the same length are the same samples.
            if (
                known is not None
                and known[0] == window_s
                and known[1] is ends[0]
                and known[2] is ends[1]
                and known[3] == ends[2]
            ):
                return dict(known[4])
            samples = self._window(window_s)
            answer = mean_util(_series(samples), samples[-1][1])
            self._smoothed = (window_s, *ends, answer)
            return dict(answer)


def _series(
    samples: list[tuple[float, tuple[str, ...], np.ndarray]],
) -> dict[str, DeviceSeries]:
    """Group samples into per-device arrays: one ``np.stack`` per run of samples that share
    their device list (usually the whole window)."""
    parts: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    i = 0
    while i < len(samples):
        uuids = samples[i][1]
        j = i + 1
        while j < len(samples) and samples[j][1] == uuids:  # add() shares the tuple: cheap
            j += 1
        run = samples[i:j]
        ts = np.array([t for t, _, _ in run])  # add() stores float timestamps
        block = np.stack([v for _, _, v in run])  # (samples, devices, metrics)
        for k, uuid in enumerate(uuids):
            tl, vl = parts.setdefault(uuid, ([], []))
            tl.append(ts)
            vl.append(block[:, k, :])
        i = j
    return {
        u: DeviceSeries(u, np.concatenate(tl), np.concatenate(vl)) for u, (tl, vl) in parts.items()
    }


def mean_util(series: dict[str, DeviceSeries], uuids: Iterable[str]) -> dict[str, float | None]:
    """Mean known utilisation of each of ``uuids`` over ``series`` (rounded to 3 decimals;
    ``None`` where no sample knows it)."""
    out: dict[str, float | None] = {}
    for u in uuids:
        s = series.get(u)
        col = s.column("utilization_pct") if s is not None else np.empty(0)
        known = col[~np.isnan(col)]
        out[u] = round(float(known.sum()) / len(known), 3) if len(known) else None
    return out


_global_lock = threading.Lock()
_sampler: Sampler | None = None
_atexit_registered = False


def _defaults() -> tuple[float, float]:
    cfg = AutoGPU()
    return float(cfg.sample_interval_s), float(cfg.history_s)


def get_sampler(interval_s: float | None = None, history_s: float | None = None) -> Sampler:
    """The process's one sampler, started on first use (thread ``autogpu-sampler``).

    Parameters
    ----------
    interval_s, history_s
        When given, change the running sampler's interval / history; defaults come from
        ``AutoGPU.sample_interval_s`` / ``AutoGPU.history_s`` (env ``AUTOGPU_SAMPLE_INTERVAL``).

    Raises
    ------
    UsageErrorBase
        For an interval below 0.1 s or a non-positive history.
    """
    global _sampler, _atexit_registered
    with _global_lock:
        if _sampler is None:
            d_interval, d_history = _defaults()
            _sampler = Sampler(
                interval_s=d_interval if interval_s is None else interval_s,
                history_s=d_history if history_s is None else history_s,
            )
        else:
            if interval_s is not None and interval_s != _sampler.interval_s:
                _sampler.set_interval(interval_s)
            if history_s is not None and history_s != _sampler.history_s:
                _sampler.set_history(history_s)
        if not _atexit_registered:
            atexit.register(stop_sampler)
            _atexit_registered = True
        _sampler.start()
        return _sampler


def current_sampler() -> Sampler | None:
    """The process's sampler if one was started (and not stopped), without starting one."""
    return _sampler


def stop_sampler() -> None:
    """Stop and forget the process's sampler (unload, exit). The next :func:`get_sampler`
    starts a fresh one. Safe to call when none runs."""
    global _sampler
    with _global_lock:
        sampler, _sampler = _sampler, None
    if sampler is not None:
        sampler.stop()
