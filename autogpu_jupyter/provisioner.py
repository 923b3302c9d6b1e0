"""The autogpu kernel provisioner: pick the GPU before the kernel process exists.

A kernelspec whose ``metadata.kernel_provisioner`` names ``autogpu-provisioner`` (``autogpu
kernelspec install`` writes one) starts kernels through :class:`AutoGPUProvisioner`, a
``jupyter_client`` :class:`~jupyter_client.provisioning.LocalProvisioner` that, in ``pre_launch``:

1. validates the options of the kernelspec (``metadata.kernel_provisioner.config``): ``min_free``,
   ``max_util``, ``count``, ``exclusive``, ``wait``, ``on_no_device`` (``"cpu"`` or ``"fail"``);
   the server's ``c.AutoGPU.*`` settings (and ``AUTOGPU_*`` variables) fill what it leaves out;
2. picks within the server's own grant (its ``CUDA_VISIBLE_DEVICES`` / ``NVIDIA_VISIBLE_DEVICES``
   / Slurm variables) through :func:`autogpu_jupyter.core.picker.pick`, taking a lease for the
   kernel, and honours a move request (:mod:`autogpu_jupyter.core.moves`) or else prefers the
   kernel's previous device on a restart;
3. launches the kernel with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, ``CUDA_VISIBLE_DEVICES=<UUIDs>``,
   ``AUTOGPU_PICKED``, ``AUTOGPU_LEASE_ID`` and ``AUTOGPU_PICK_NOTE`` set, and the lease's file
   descriptor passed to the kernel (``pass_fds``); the server closes its own copy right after the
   launch. The ``flock`` then belongs to the kernel process alone: a kernel that exits, crashes or
   is killed frees its lease with no cleanup step, and a restart picks again without a leak.

When nothing fits (after ``wait``), ``on_no_device="cpu"`` (the default) starts the kernel with
``CUDA_VISIBLE_DEVICES=""`` and a note saying why; ``"fail"`` refuses to start it with that
message. Bad options always refuse to start, with one message naming the bad value.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from jupyter_client.provisioning.local_provisioner import LocalProvisioner
from jupyter_core.paths import jupyter_runtime_dir

from autogpu_jupyter.config import AutoGPU
from autogpu_jupyter.core import (
    GRANT_ENV,
    GRANT_ROCM_ENV,
    LEASE_ENV,
    LEASE_FD_ENV,
    MOVE_FILE_ENV,
    NOTE_ENV,
    ON_NO_DEVICE,
    OPTIONS_ENV,
    PICKED_ENV,
    PROVISIONED_ENV,
    PROVISIONER_NAME,
    ROCM_GRANT_VARS,
    SIMULATE_ENV,
    Constraints,
    PickOptions,
    PickResult,
    format_duration,
    get_backend,
    moves,
    notebook_path,
    pick,
)
from autogpu_jupyter.core import options as pick_options
from autogpu_jupyter.core.leasing import HeldLease, LeaseStore, Requester, store_for
from autogpu_jupyter.errors import (
    AutoGPUError,
    LeaseLimitError,
    NoDeviceFitsError,
    NoDeviceGrantedError,
    NVMLUnavailableError,
    UsageErrorBase,
)

__all__ = ["AutoGPUProvisioner", "PROVISIONER_NAME", "OPTION_NAMES", "validate_options"]

log = logging.getLogger(__name__)

#: The options a kernelspec may set in ``metadata.kernel_provisioner.config``.
OPTION_NAMES = (*(o.key for o in pick_options.PICK_OPTIONS if o.key != "exclude"), "on_no_device")


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated provisioner options: the pick's (one :class:`PickOptions`, as every front end
    hands to the picker), and what to do when nothing fits."""

    pick: PickOptions
    on_no_device: str
    raw: Mapping[str, Any]

    @property
    def constraints(self) -> Constraints:
        return self.pick.constraints

    @property
    def wait_s(self) -> float:
        return self.pick.wait_s


def _bad(name: str, value: object, why: str, spec: str | None) -> UsageErrorBase:
    where = f"kernelspec {spec!r}" if spec else "the kernelspec"
    return UsageErrorBase(
        f"autogpu: {where} has a bad option in metadata.kernel_provisioner.config: "
        f"{name}={value!r}: {why}. Fix it with `autogpu kernelspec install --name {spec or 'NAME'} "
        "[--min-free 10G] [--max-util 50] [--count 1] [--exclusive] [--wait 10m] "
        "[--on-no-device cpu|fail]`."
    )


def validate_options(
    config: Mapping[str, Any], settings: AutoGPU | None = None, *, spec: str | None = None
) -> Options:
    """Check a kernelspec's provisioner options; the settings fill what it leaves out.

    Raises
    ------
    UsageErrorBase
        Naming the bad (or unknown) option, its value and the accepted forms.
    """
    settings = settings or AutoGPU()
    unknown = sorted(set(config) - set(OPTION_NAMES))
    if unknown:
        raise _bad(
            unknown[0], config[unknown[0]],
            f"unknown option; accepted: {', '.join(OPTION_NAMES)}", spec,
        )
    raw = dict(config)

    def get(name: str, fallback: Any) -> Any:
        v = raw.get(name)
        return fallback if v is None else v

    on_no = get("on_no_device", "cpu")
    try:
        opts = pick_options.parse(
            {k: v for k, v in raw.items() if k != "on_no_device"},
            defaults=pick_options.defaults_from(settings),
            style="key",
        )
    except pick_options.OptionError as err:
        raise _bad(err.option, err.value, str(err), spec) from None
    if not isinstance(on_no, str) or on_no.strip().lower() not in ON_NO_DEVICE:
        raise _bad(
            "on_no_device", on_no, "expected \"cpu\" (start without a GPU) or \"fail\"", spec
        )
    return Options(pick=opts, on_no_device=on_no.strip().lower(), raw=raw)


class AutoGPUProvisioner(LocalProvisioner):
    """Picks GPU(s) for the kernel before it starts; the lease lives as long as the kernel process.

    Kernelspec options (``metadata.kernel_provisioner.config``): ``min_free`` (``"10G"``,
    ``"25%"``),
    ``max_util`` (percent), ``count``, ``exclusive``, ``wait`` (``"10m"``), ``on_no_device``
    (``"cpu"``: start CPU-only with a note; ``"fail"``: refuse to start).

    Attributes for the server (read with ``getattr``; the server never imports this module):
    ``autogpu_picked`` (UUIDs), ``autogpu_constraints``, ``autogpu_note``, ``autogpu_lease_id``,
    ``autogpu_move_file``.
    """

    def __init__(self, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k not in ("kernel_id", "kernel_spec",
                                                                      "parent", "config", "log")}
        super().__init__(**kwargs)
        self._options_raw: dict[str, Any] = options
        self._lease: HeldLease | None = None
        self._store: LeaseStore | None = None
        self.autogpu_picked: tuple[str, ...] = ()
        self.autogpu_constraints: Constraints | None = None
        self.autogpu_note: str | None = None
        self.autogpu_lease_id: str | None = None
        self.autogpu_move_file: str | None = None

    # -- helpers ---------------------------------------------------------------------------------

    def _move_file(self) -> str | None:
        """Where a move request for this kernel is recorded (the user's private runtime dir)."""
        try:
            runtime = jupyter_runtime_dir()
            os.makedirs(runtime, mode=0o700, exist_ok=True)
            return str(moves.move_file_for(runtime, str(self.kernel_id)))
        except (OSError, UsageErrorBase) as err:
            self.log.warning("autogpu: moves unavailable for kernel %s: %s", self.kernel_id, err)
            return None

    def _spec_name(self) -> str | None:
        km = self.parent
        name = getattr(km, "kernel_name", None) if km is not None else None
        return str(name) if name else None

    def _settings(self) -> AutoGPU:
        # The server's config (c.AutoGPU.* in jupyter_server_config.py) reaches us through parent.
        try:
            return AutoGPU(parent=self)
        except Exception:  # a parent without config: use the env defaults
            return AutoGPU()

    def _pick_blocking(
        self, options: Options, environ: dict[str, str], requester: Requester,
        move_file: str | None,
    ) -> tuple[PickResult | None, str | None]:
        """Pick (in a worker thread: NVML and the store's lock never block the server loop)."""
        settings = self._settings()
        store = store_for(settings)
        self._store = store
        constraints = options.constraints
        request = moves.take_move(move_file) if move_file else None
        previous = self.autogpu_picked
        moved_note = None
        backend = get_backend(environ.get(SIMULATE_ENV))
        ids = settings.visible_ids  # c.AutoGPU.visible_ids of the server: uuid or index

        def progress(line: str) -> None:
            log.info("kernel %s: %s", self.kernel_id, line)

        try:
            if request is not None:
                snap = backend.snapshot()
                moved, moved_note = moves.move_constraints(request, constraints, snap.devices)
                try:
                    result = pick(PickOptions(moved), backend=backend, environ=environ,
                                  store=store, requester=requester, visible_ids=ids)
                    return result, f"{moved_note}: the kernel's state was lost"
                except (NoDeviceFitsError, LeaseLimitError) as err:
                    moved_note = (f"the requested move could not be honoured ({_first_line(err)}); "
                                  "picked again as usual")
            elif previous and constraints.count == len(previous):
                # A restart: stay on the same device(s) if they still fit (no churn).
                snap = backend.snapshot()
                keep = set(previous)
                others = tuple(
                    d.uuid for d in snap.devices
                    if d.uuid not in keep and d.parent_uuid not in keep
                    and not any(m.parent_uuid == d.uuid for m in snap.devices if m.uuid in keep)
                )
                if all(snap.by_uuid(u) is not None for u in previous):
                    same = dataclasses.replace(constraints, exclude=constraints.exclude + others)
                    with contextlib.suppress(NoDeviceFitsError, LeaseLimitError):
                        return pick(PickOptions(same), backend=backend, environ=environ,
                                    store=store, requester=requester, visible_ids=ids), None
            result = pick(options.pick, backend=backend, environ=environ, store=store,
                          requester=requester, on_progress=progress, visible_ids=ids)
            return result, moved_note
        except (NoDeviceFitsError, NoDeviceGrantedError, LeaseLimitError) as err:
            waited = f" (waited {format_duration(options.wait_s)})" if options.wait_s else ""
            reason = str(err)
            if options.on_no_device == "fail":
                raise type(err)(
                    f"autogpu: kernel not started: {reason}{waited}. The kernelspec says "
                    "on_no_device=\"fail\"; try again later, or use a kernelspec with other "
                    "options."
                ) from None
            return None, (f"no device fits: kernel started CPU-only (CUDA_VISIBLE_DEVICES=\"\") "
                          f"because {reason}{waited}")
        except NVMLUnavailableError as err:
            if options.on_no_device == "fail":
                raise NVMLUnavailableError(f"autogpu: kernel not started: {err}") from None
            return None, f"no GPU pick: {err}; kernel started with the environment unchanged"

    # -- the provisioner protocol ------------------------------------------------------------------

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Pick, take the lease for the kernel, and set the kernel's environment."""
        try:
            options = validate_options(self._options_raw, self._settings(), spec=self._spec_name())
        except UsageErrorBase as err:
            self.log.error("%s", err)
            raise
        base_env = dict(kwargs.get("env") or os.environ)
        kwargs = await super().pre_launch(**kwargs)
        move_file = self._move_file()
        requester = Requester(
            pid=os.getpid(), kernel_id=self.kernel_id,
            notebook_path=notebook_path(base_env), kind="kernel",
        )
        loop = asyncio.get_running_loop()
        self._drop_lease()
        try:
            result, note = await loop.run_in_executor(
                None,
                functools.partial(self._pick_blocking, options, base_env, requester, move_file),
            )
        except AutoGPUError as err:
            self.log.error("%s", err)
            raise
        lease = None if result is None else result.lease
        self._lease = lease
        env: dict[str, str] = kwargs["env"]
        for var in (PICKED_ENV, LEASE_ENV, NOTE_ENV, LEASE_FD_ENV, GRANT_ENV):
            env.pop(var, None)
        if "CUDA_VISIBLE_DEVICES" in base_env:
            env[GRANT_ENV] = base_env["CUDA_VISIBLE_DEVICES"]
        # An AMD host's grant is in the ROCm variables: a move picks within them again.
        env[GRANT_ROCM_ENV] = json.dumps(
            {var: base_env[var] for var in ROCM_GRANT_VARS if var in base_env}
        )
        env[PROVISIONED_ENV] = "1"
        env[OPTIONS_ENV] = json.dumps({
            "min_free": options.raw.get("min_free", self._settings().min_free or None),
            "max_util": options.constraints.max_util_pct,
            "count": options.constraints.count,
            "exclusive": options.constraints.exclusive,
        })
        if move_file:
            env[MOVE_FILE_ENV] = move_file
        if self._settings().visible_ids.strip().lower() == "index":
            # the kernel's own picks (%gpu pick, a move) write indices too
            env.setdefault("AUTOGPU_VISIBLE_IDS", "index")
        if result is not None:
            env.update(result.env)
            env[PICKED_ENV] = ",".join(d.uuid for d in result.chosen)
            if result.lease_note:
                note = f"{note}; {result.lease_note}" if note else result.lease_note
        elif note and note.startswith("no device fits"):
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = ""
            # On an AMD host an empty CUDA_VISIBLE_DEVICES hides nothing (HIP reads it as unset):
            # an empty ROCR_VISIBLE_DEVICES does (docs/internals.md, "ROCm visibility").
            env["ROCR_VISIBLE_DEVICES"] = ""
            env[PICKED_ENV] = ""
        if lease is not None:
            fd = lease.fileno()
            env[LEASE_ENV] = lease.record.lease_id
            env[LEASE_FD_ENV] = str(fd)
            kwargs["pass_fds"] = (*tuple(kwargs.get("pass_fds", ())), fd)
        if note:
            env[NOTE_ENV] = note
        self.autogpu_picked = () if result is None else tuple(d.uuid for d in result.chosen)
        self.autogpu_constraints = options.constraints
        self.autogpu_note = note
        self.autogpu_lease_id = None if lease is None else lease.record.lease_id
        self.autogpu_move_file = move_file
        chosen = ", ".join(f"{d.label} {d.uuid}" for d in result.chosen) if result else "no GPU"
        self.log.info(
            "autogpu: kernel %s gets %s (%s)%s", self.kernel_id, chosen,
            options.constraints.describe(), f"; {note}" if note else "",
        )
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        """Launch, then hand the lease to the kernel: close our copy, record the kernel's pid."""
        try:
            info = await super().launch_kernel(cmd, **kwargs)
        except BaseException:
            self._drop_lease(unlink=True)
            raise
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                if self.pid is not None:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(None, lease.set_pid, int(self.pid))
            except (OSError, AutoGPUError) as err:
                self.log.warning("autogpu: could not record the kernel pid in its lease: %s", err)
            finally:
                # Our copy only: the kernel holds the same open file description (pass_fds), so
                # the lease stays; never unlock here, that would unlock the kernel's too.
                lease.detach()
        return info

    async def cleanup(self, restart: bool = False) -> None:
        """Remove this user's dead lease files (the kernel process, which held ours, is gone)."""
        self._drop_lease(unlink=True)
        store = self._store
        if store is not None:
            loop = asyncio.get_running_loop()
            with contextlib.suppress(AutoGPUError, OSError):
                await loop.run_in_executor(None, store.prune)
        if not restart and self.autogpu_move_file:
            moves.cancel_move(self.autogpu_move_file)
        await super().cleanup(restart=restart)

    def _drop_lease(self, unlink: bool = False) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            if unlink:
                lease.release()
            else:
                lease.detach()

    async def get_provisioner_info(self) -> dict[str, Any]:
        info: dict[str, Any] = await super().get_provisioner_info()
        info["autogpu_picked"] = list(self.autogpu_picked)
        info["autogpu_lease_id"] = self.autogpu_lease_id
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.autogpu_picked = tuple(provisioner_info.get("autogpu_picked") or ())
        self.autogpu_lease_id = provisioner_info.get("autogpu_lease_id")


def _first_line(err: BaseException) -> str:
    return str(err).splitlines()[0] if str(err) else type(err).__name__
