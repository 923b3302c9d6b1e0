"""The magics' event hooks: what runs after each cell (``post_run_cell``): the kernel
provisioner's note once, what the lease broker said on this kernel's lease connection, and a
pending overload warning; and the start of the kernel's sampler after a pick (:func:`_watch`).
Main thread only: the hook prints, the sampler thread never does.
"""

from __future__ import annotations

import logging
from typing import Any

from autogpu_jupyter.core import KernelContract, session
from autogpu_jupyter.errors import AutoGPUError

log = logging.getLogger("autogpu_jupyter.magics")

_skip_hook_once = False


def skip_hook_once() -> None:
    """Let the next ``post_run_cell`` pass silently: the request that just ran was the
    sidebar's, whose output goes to the sidebar; the notebook's next cell prints what is
    pending."""
    global _skip_hook_once
    _skip_hook_once = True


_note_shown = False


def _watch() -> None:
    """Start the kernel's one sampler once it has a device, so that the overload warning
    reaches users without the panel too (the cell hook reads it; it never starts a thread)."""
    # Numpy: only once a sampler runs.
    from autogpu_jupyter.core import get_sampler  # noqa: PLC0415

    try:
        sampler = get_sampler()
    except AutoGPUError as err:  # no driver: nothing to watch
        log.debug("sampler not started: %s", err)
        return
    if sampler.latest() is None:
        # the first reading now, not whenever the thread gets to it: the next cell's hook then
        # sees what the GPU looks like right after the pick
        sampler.sample_now()


def _pick_note_once() -> None:
    """Show the kernel provisioner's note (e.g. "started CPU-only because ...") once: what a
    kernel prints while it starts never reaches the notebook, so the first cell carries it."""
    global _note_shown

    note = KernelContract.read().note or ""
    if note and not _note_shown:
        _note_shown = True
        print(f"autogpu: {note}")


def _lease_events() -> None:
    """Tell the notebook what the lease broker said on this kernel's lease connection (a
    revoke), once, after the cell that was running."""
    fds = []
    choice = session.current()
    lease = getattr(choice, "lease", None)
    if lease is not None and getattr(lease, "held", False):
        fds.append(lease.fileno())
    inherited = KernelContract.read().lease_fd
    if inherited is not None:
        fds.append(inherited)
    if not fds:
        return
    # The lease stores come with a lease: never for a kernel that holds none.
    from autogpu_jupyter.core.leasing import lease_events  # noqa: PLC0415

    for fd in fds:
        if fd in _ended_lease_fds:
            continue
        lines = lease_events(fd)
        if lines:
            _ended_lease_fds.add(fd)  # said once: the connection is over
        for line in lines[:1]:
            print(f"autogpu: {line}")


_ended_lease_fds: set[int] = set()

_cull_said = False


def cull_notice(environ: Any = None) -> str | None:
    """What the notebook is told, once, under the first cell that ran with a GPU when its
    server shuts idle GPU kernels down (the server extension sets :data:`SERVER_CULL_ENV` for
    the kernels it starts): the limit, where the warning before it appears, and how to keep
    the kernel. ``None``: no culling, no GPU, or a limit that is not a number."""
    import os  # noqa: PLC0415

    from autogpu_jupyter.core import (  # noqa: PLC0415
        SERVER_CULL_ENV,
        SERVER_CULL_WARNING_ENV,
        format_duration,
    )

    env = os.environ if environ is None else environ
    try:
        limit = float(env.get(SERVER_CULL_ENV, "0") or 0)
        lead = float(env.get(SERVER_CULL_WARNING_ENV, "0") or 0)
    except ValueError:
        return None
    choice = session.current()
    if not (limit > 0) or limit == float("inf") or choice is None or not choice.uuids:
        return None
    gpus = ", ".join(d.label for d in choice.devices) if choice.devices else "its GPU"
    warned = (f"; the sidebar and the status bar warn {format_duration(lead)} before"
              if lead > 0 and lead != float("inf") else "")
    return (f"autogpu: this server shuts down a kernel that holds a GPU after "
            f"{format_duration(limit)} idle, freeing {gpus}{warned}. Running any cell keeps it.")


def _cull_notice_once() -> None:
    global _cull_said
    if _cull_said:
        return
    text = cull_notice()
    if text:
        _cull_said = True
        print(text)


def _overload_hook(*_args: Any) -> None:
    """``post_run_cell``: print the provisioner's note once and a pending overload warning (main
    thread; never from a thread). Not after the sidebar's own request: its output goes to the
    sidebar, and the notebook's next cell prints what is pending."""
    global _skip_hook_once
    if _skip_hook_once:
        _skip_hook_once = False
        return
    _pick_note_once()
    _lease_events()
    _cull_notice_once()
    from autogpu_jupyter.core import pending_warning  # noqa: PLC0415 (numpy: a cell ran)

    try:
        text = pending_warning()
    except AutoGPUError as err:
        log.debug("overload check failed: %s", err)
        return
    if text:
        print(text)
