"""The ``%gpu`` line magic and the ``%%gpu`` cell magic (the only IPython code of autogpu).

``%load_ext autogpu`` registers them (:func:`load_ipython_extension`); loading is cheap: no NVML,
pandas or ipywidgets import until a magic runs. Every :class:`~autogpu_jupyter.errors.AutoGPUError`
and every bad option becomes an IPython ``UsageError``: one clear line (or, when nothing fits, one
line per device saying why it was dropped), never a traceback, and ``os.environ`` unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from IPython import get_ipython
from IPython.core import magic_arguments as _magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

# IPython re-exports arg_split per platform without listing it (hence the ignore).
from IPython.utils.process import arg_split  # type: ignore[attr-defined]
from IPython.utils.text import dedent

from autogpu_jupyter.config import AutoGPU, set_default_settings
from autogpu_jupyter.core import (
    SIMULATE_ENV,
    KernelContract,
    cuda_state,
    hip_state,
    session,
    status_table,
    terminal_safe,
)
from autogpu_jupyter.core import cell_text as visible
from autogpu_jupyter.core import narrow_table as narrow
from autogpu_jupyter.core import options as _options
from autogpu_jupyter.core import table_html as to_html
from autogpu_jupyter.core import table_text as to_text
from autogpu_jupyter.errors import AutoGPUError, NoDeviceFitsError
from autogpu_jupyter.magics import hooks as _hooks

# What the magic class calls, by job; every name stays importable from here (F401: some only for
# the callers and tests that import them from autogpu_jupyter.magics).
from autogpu_jupyter.magics.hooks import (  # noqa: F401
    _lease_events,
    _overload_hook,
    _pick_note_once,
    _watch,
)
from autogpu_jupyter.magics.progress import _CellStats, _Progress
from autogpu_jupyter.magics.words import (  # noqa: F401
    _asked,
    _device_line,
    _env_line,
    _free,
    _no_fit,
    _one_line,
    _pct,
    _pending_move_text,
    format_pick,
    format_ranking,
    source_words,
)

if TYPE_CHECKING:
    from autogpu_jupyter.core import Constraints, PickResult, Sampler

__all__ = ["GPUMagics", "load_ipython_extension", "unload_ipython_extension"]

log = logging.getLogger(__name__)

SUBCOMMANDS = ("pick", "status", "release", "panel", "move")

#: What ``%gpu panel`` says where no notebook front end draws widgets (a terminal IPython).
PANEL_NEEDS_FRONTEND = (
    "autogpu: %gpu panel is a live widget and needs a notebook (JupyterLab, Notebook 7, VS Code); "
    "here, %gpu prints the same devices and holders as a table"
)
PICK_OPTIONS = ", ".join(
    [f"{o.flag} {o.metavar}" if o.metavar else o.flag for o in _options.PICK_OPTIONS]
    + ["--dry-run", "--force"]
)


# --------------------------------------------------------------------------- option parsing

# IPython's magic_arguments helpers carry no annotations: typed once here (mypy checks the rest).
magic_arguments: Callable[[], Callable[[Any], Any]] = _magic_arguments.magic_arguments
argument: Callable[..., Callable[[Any], Any]] = _magic_arguments.argument
construct_parser: Callable[[Any], argparse.ArgumentParser] = _magic_arguments.construct_parser


@magic_arguments()
@argument(
    "--dry-run",
    action="store_true",
    default=False,
    help="Only show the ranking with the reasons; change nothing.",
)
@argument(
    "--force",
    action="store_true",
    default=False,
    help="Set the variables even though CUDA is already initialised (no effect until the "
    "kernel restarts).",
)
def _pick_options(line: str) -> None:
    """Pick the best GPU(s) that fit and make them the only ones CUDA sees in this kernel."""


_PICK_PARSER = construct_parser(_pick_options)
_PICK_PARSER.prog = "%gpu pick"
# The pick options themselves are declared once, for the CLI and the magics alike; the
# devices may be named without a flag (%gpu pick 2, %gpu pick 0,3).
_options.add_arguments(_PICK_PARSER, positional=True)


def _parse_pick(argv: Sequence[str], where: str = "%gpu pick") -> argparse.Namespace:
    """Parse pick options; any problem is one line of ``UsageError`` (argparse never exits).

    A notebook repeats the same few lines: what a line parsed to is remembered (a bounded
    number of lines; failures are not remembered), and each call gets its own namespace.
    """
    try:
        return argparse.Namespace(**dict(_parsed(tuple(argv))))
    except UsageError as err:
        raise UsageError(f"{where}: {err}; accepted options: {PICK_OPTIONS} (see %gpu?)") from None
    except SystemExit:  # argparse paths that call exit() directly: never leave the kernel
        raise UsageError(
            f"{where}: invalid options {' '.join(argv)!r}; accepted options: "
            f"{PICK_OPTIONS} (see %gpu?)"
        ) from None


@functools.lru_cache(maxsize=64)
def _parsed(argv: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    """The pick options ``argv`` parse to (the values are strings, numbers, flags and None)."""
    return tuple(vars(_PICK_PARSER.parse_args(_options.join_negative_values(argv))).items())


def _split(line: str) -> list[str]:
    try:
        return list(_split_words(line))
    except ValueError as err:  # unbalanced quotes
        raise UsageError(f"%gpu: cannot read {line!r}: {err}") from None


@functools.lru_cache(maxsize=64)
def _split_words(line: str) -> tuple[str, ...]:
    """The words of a magic's line, remembered for a bounded number of lines (a notebook repeats
    the same few)."""
    # posix=True: quotes are removed, so --exclude "" is an empty value (rejected by name).
    return tuple(arg_split(line, posix=True, strict=True))


# --------------------------------------------------------------------------- the magics


@magics_class
class GPUMagics(Magics):
    """Pick a GPU from a notebook: ``%gpu pick``, ``%gpu status``, ``%gpu release``, ``%%gpu``.

    Examples
    --------
    Run these before anything initialises CUDA (``import torch`` is fine, ``torch.cuda`` is not)::

        %load_ext autogpu
        %gpu                              # status: every GPU, yours marked
        %gpu pick --min-free 10G          # the best GPU with 10 GiB free
        %gpu pick --min-free 25% --max-util 50 --count 2
        %gpu pick --exclude 0,3           # avoid GPU 0 and 3
        %gpu pick 2                       # GPU 2 (0,3: both; a UUID start or 0:1 works too)
        %gpu pick --min-free 40G --wait 10m   # wait in line (interrupt the kernel to cancel)
        %gpu pick --dry-run               # show the ranking and why; change nothing
        %gpu release                      # give the GPU back
        %gpu panel                        # live load chart of every GPU
        %gpu move --best                  # "Python 3 (autogpu)" kernel: move at next restart

    A cell magic picks if needed, runs the cell, then reports what it did on its GPU::

        %%gpu --min-free 10G
        model.fit(...)

    Defaults come from ``%config AutoGPU.min_free = "10G"`` (or ``ipython_config.py``, or
    ``AUTOGPU_MIN_FREE``); a flag on the magic wins.
    """

    def __init__(self, shell: Any, settings: AutoGPU) -> None:
        super().__init__(shell)
        self.settings = settings

    # -- dispatch ------------------------------------------------------------------------
    @line_cell_magic
    def gpu(self, line: str, cell: str | None = None) -> None:
        if cell is not None:
            return self._cell(line, cell)
        argv = _split(line)
        sub = argv[0] if argv else "status"
        rest = argv[1:]
        if sub == "pick":
            return self._pick(_parse_pick(rest))
        if sub in ("status", "release", "panel") and rest:
            raise UsageError(f"%gpu {sub} takes no options, got {' '.join(rest)!r}")
        if sub == "status":
            return self._status()
        if sub == "release":
            return self._release()
        if sub == "panel":
            return self._panel()
        if sub == "move":
            return self._move(rest)
        hint = f"; did you mean %gpu pick {line.strip()}?" if sub.startswith("-") else ""
        raise UsageError(
            f"%gpu: unknown subcommand {sub!r}; expected one of "
            f"{', '.join(SUBCOMMANDS)} (see %gpu?){hint}"
        )

    # -- pick ----------------------------------------------------------------------------
    def _run_pick(
        self, args: argparse.Namespace, where: str = "%gpu pick"
    ) -> tuple[PickResult, str | None]:
        # The pick machinery and the lease stores: first pick, not %load_ext.
        from autogpu_jupyter import api  # noqa: PLC0415

        with _Progress(self._in_kernel()) as progress:
            try:
                return api.pick_result(
                    api.pick_options(self.settings, _options.from_namespace(args)),
                    dry_run=args.dry_run,
                    force=args.force,
                    settings=self.settings,
                    on_progress=progress.update,
                    source="magic",
                )
            except KeyboardInterrupt:
                progress.done("cancelled")
                raise UsageError(
                    "pick cancelled (interrupted): no device picked, no lease "
                    "kept, environment unchanged"
                ) from None
            except NoDeviceFitsError as err:
                progress.done("gave up")
                raise _no_fit(err, args, where) from None
            except AutoGPUError as err:
                progress.done("gave up")
                raise UsageError(_one_line(err)) from None

    def _pick(self, args: argparse.Namespace) -> None:
        result, warning = self._run_pick(args)

        if args.dry_run:
            # a notebook's output area, or the terminal IPython runs in
            width = 120 if self._in_kernel() else shutil.get_terminal_size((100, 24)).columns
            text = format_ranking(result, width)
        else:
            text = format_pick(result, warning)
        if args.dry_run and result.chosen:
            mine = session.current()
            if mine is not None and set(mine.uuids) == {d.uuid for d in result.chosen}:
                labels = ", ".join(d.label for d in result.chosen)
                text += f"\n  you are already on the best device ({labels}): nothing to change"
        print(terminal_safe(text))
        if not args.dry_run:
            _watch()

    def _pick_one(self, uuid: str) -> tuple[bool, str, str]:
        """Pick device ``uuid`` for this kernel (the sidebar's pick): ``(ok, summary, details)``,
        worded as the user clicked it; the environment is unchanged when it fails."""
        # The API and the pick machinery come with the first pick, not with %load_ext.
        from autogpu_jupyter import api  # noqa: PLC0415

        try:
            snap = api.read_snapshot()
        except AutoGPUError as err:
            head, _, rest = _one_line(err).partition("\n")
            return False, f"autogpu: {head}", rest
        target = snap.by_uuid(uuid)
        if target is None:
            return False, f"autogpu: no device {uuid!r} on this host (the sidebar is stale?)", ""
        # every other device is left out, by UUID: a GPU's own MIG devices go with it, a MIG
        # device keeps its GPU (whose exclusion would take its MIG devices with it) but not its
        # siblings on that GPU
        family = {target.uuid} | {
            d.uuid for d in snap.devices if d.parent_uuid == target.uuid
        }
        if target.parent_uuid is not None:
            family.add(target.parent_uuid)
        others = ",".join(d.uuid for d in snap.devices if d.uuid not in family)
        try:
            result, warning = api.pick_result(
                api.pick_options(self.settings, {"exclude": others or None, "wait": 0}),
                settings=self.settings, source="sidebar",
            )
        except NoDeviceFitsError as err:
            cands = err.candidates if isinstance(err.candidates, tuple) else ()
            mine = [c for c in cands if c.device.uuid in family]
            why = "; ".join(r for c in mine for r in c.reasons) or "it does not fit"
            asked = _asked(api.pick_options(self.settings, {}).constraints)
            summary = f"autogpu: {target.label} cannot be picked: {why}"
            details = (
                f"asked: {asked} (this notebook's defaults, %config AutoGPU)\n"
                "nothing changed: no variable set, no lease taken"
            )
            return False, terminal_safe(summary), terminal_safe(details)
        except AutoGPUError as err:
            head, _, rest = _one_line(err).partition("\n")
            return False, f"autogpu: {head}", rest.strip()
        _watch()  # as after %gpu pick: the overload warning reaches the notebook's cells
        lines = format_pick(result, warning).splitlines()
        kept = [ln.strip() for ln in lines[1:] if not ln.strip().startswith("asked:")]
        return True, terminal_safe(lines[0]), terminal_safe("\n".join(kept))

    # -- status --------------------------------------------------------------------------
    def _status(self) -> None:
        from autogpu_jupyter import api  # noqa: PLC0415 (the API and pandas: first %gpu status)

        try:
            df = api.status(settings=self.settings)
        except AutoGPUError as err:
            raise UsageError(_one_line(err)) from None
        simulated = bool(df.attrs.get("simulated"))
        title = "GPUs on this host"
        if simulated:
            title += (
                f" — SIMULATED fleet ({SIMULATE_ENV}={os.environ.get(SIMULATE_ENV, '')})"
            )
        choice = session.current()
        if choice is None:
            mine = "this kernel: no GPU picked yet (%gpu pick)"
        else:
            marked = df.loc[df[""] == "▶", "gpu"] if len(df) else []
            labels = ", ".join(marked) or ", ".join(choice.uuids)
            how = source_words(choice.source)
            if choice.constraints_text and choice.source != "sidebar":
                # the sidebar's pick names its device; its --exclude is no option the user gave
                how += f", {choice.constraints_text}"
            mine = f"this kernel: ▶ {labels} ({how})"
        pending = _pending_move_text()
        if pending and len(df):
            for short, label in zip(df["uuid"], df["gpu"], strict=True):
                pending = pending.replace(str(short), str(label))
            mine += f" · {pending}"
        columns, rows, highlight = status_table(df)
        if self._in_kernel():
            text = "\n".join([title, *to_text(*narrow(columns, rows, 120), width=120), mine])
            # A notebook at 1366x768 with the sidebar open has about 900 px for outputs: the
            # short UUID (in the text) is the column it can do without; holders then wrap.
            keep = [i for i, c in enumerate(columns) if c.drop != 1]
            html = to_html(
                [columns[i] for i in keep], [tuple(r[i] for i in keep) for r in rows],
                caption=f"{title} · {mine}", highlight=highlight,
            )
            show: Callable[..., None] = display  # IPython's display() carries no annotations
            show({"text/plain": text, "text/html": html}, raw=True)
        else:

            width = shutil.get_terminal_size((100, 24)).columns
            print(visible(title))
            print("\n".join(to_text(*narrow(columns, rows, width), width=width)))
            print(visible(mine))

    # -- release -------------------------------------------------------------------------
    def _release(self) -> None:
        before = session.current()
        old = session.release()
        if old is None:
            if before is not None:  # the provisioner's choice, from the environment
                print(
                    "this kernel's GPU was picked by the autogpu kernelspec before it started: "
                    "its lease ends when the kernel stops (or restart it with another kernel)"
                )
                return
            print("autogpu: nothing to release (no GPU picked in this kernel)")
            return
        what = ", ".join(d.label for d in old.devices) or ", ".join(old.uuids)
        var = (
            "ROCR_VISIBLE_DEVICES"
            if any(d.vendor == "amd" for d in old.devices)
            else "CUDA_VISIBLE_DEVICES"
        )
        cvd = os.environ.get(var)
        restored = f"{var} is unset again" if cvd is None else f"{var} restored to {cvd!r}"
        lease = " and its lease" if old.lease is not None else ""
        print(f"autogpu: released {what}{lease}; {restored}")
        runtime = "CUDA"
        state = cuda_state()
        if not state.initialized:
            runtime, state = "HIP (ROCm)", hip_state()
        if state.initialized:
            print(
                f"  {runtime} is already initialised in this kernel: it keeps using {what} until "
                "you restart the kernel"
            )

    # -- panel / move --------------------------------------------------------------------
    def _panel(self) -> None:
        if not self._in_kernel():
            # A terminal IPython draws no widgets: display() would print the Panel's repr.
            print(PANEL_NEEDS_FRONTEND)
            return
        # The one front end the magics open: %gpu panel shows the panel (both run in this
        # kernel); ipywidgets loads only then.
        from autogpu_jupyter.widgets import Panel  # noqa: TID251, PLC0415

        show: Callable[..., None] = display  # IPython's display() carries no annotations
        show(Panel())

    def _move(self, argv: Sequence[str]) -> None:
        """``%gpu move [DEVICE|--best]``: ask the autogpu kernel provisioner to restart this
        kernel on another GPU (the target must fit now); the user then restarts the kernel."""
        # The pick machinery and the lease stores come with the first %gpu move.
        from autogpu_jupyter.core import moves  # noqa: PLC0415
        from autogpu_jupyter.core.leasing import store_for  # noqa: PLC0415

        if len(argv) != 1:
            raise UsageError(
                f"%gpu move takes one target, got {' '.join(argv) or 'none'!r}; expected a device "
                "(an NVML index like 2, or a UUID) or --best, e.g. %gpu move --best"
            )
        target = "best" if argv[0] in ("--best", "best") else argv[0]
        if target.startswith("-"):
            raise UsageError(f"%gpu move: unknown option {target!r}; expected a device or --best")
        try:
            plan = moves.request_move_from_kernel(target, store=store_for(self.settings))
        except AutoGPUError as err:
            raise UsageError(_one_line(err)) from None
        print(plan.message)

    # -- %%gpu ---------------------------------------------------------------------------
    def _cell(self, line: str, cell: str) -> None:
        args = _parse_pick(_split(line), where="%%gpu")
        if args.dry_run:
            raise UsageError("%%gpu: --dry-run is for %gpu pick (a dry run would not run the cell)")
        choice = session.current()
        if choice is None:
            result, warning = self._run_pick(args, where="%%gpu")
            print(format_pick(result, warning))
            choice = session.current()
        else:
            note = self._violations(choice.uuids, args)
            if note:
                print(note)
        uuids = choice.uuids if choice is not None else ()
        stats, sampler, simulated, labels = self._start_stats(uuids)
        t0 = time.perf_counter()
        try:
            assert self.shell is not None
            run_cell: Callable[..., Any] = self.shell.run_cell  # untyped in IPython
            res = run_cell(cell, store_history=False)
        finally:
            wall = time.perf_counter() - t0
            if sampler is not None:
                sampler.sample_now()  # the last reading covers the end of the cell
                sampler.unsubscribe(stats.add)
            print(
                stats.report(wall, labels, simulated)
                if sampler is not None
                else f"autogpu %%gpu: wall {wall:.2f}s · GPU not readable (no sampler)"
            )
        err = res.error_before_exec or res.error_in_exec
        if err is not None:
            # The inner run_cell already showed the traceback; fail this cell too (so "Run all"
            # stops) with the same exception, without printing its traceback a second time.
            with contextlib.suppress(AttributeError):  # exceptions without a __dict__
                err._render_traceback_ = lambda: [
                    f"{type(err).__name__}: {err} (in the %%gpu cell; traceback above)"
                ]
            raise err

    def _start_stats(self, uuids: tuple[str, ...]) -> tuple[_CellStats, Sampler | None, bool, str]:
        # Numpy: only once a sampler runs.
        from autogpu_jupyter.core import sampler as _sampler  # noqa: PLC0415

        stats = _CellStats(uuids=uuids, start_s=time.time())
        try:
            s = _sampler.get_sampler()
        except AutoGPUError as err:
            log.debug("no sampler for %%%%gpu: %s", err)
            return stats, None, False, ", ".join(uuids)
        latest = s.latest() or s.sample_now()
        # Samples from now on belong to the cell (the reading above is the state before it).
        stats.start_s = time.time()
        labels = (
            ", ".join((d.label if (d := latest.by_uuid(u)) is not None else u) for u in uuids)
            if latest is not None
            else ", ".join(uuids)
        )
        s.subscribe(stats.add)
        return stats, s, bool(latest is not None and latest.simulated), labels or "no GPU"

    def _violations(self, uuids: Sequence[str], args: argparse.Namespace) -> str | None:
        """Say so when the device this kernel already has violates the cell's options (the
        one decision pipeline's verdict, as ``%gpu pick`` would judge it)."""
        # The pick machinery and the lease stores: first %%gpu.
        from autogpu_jupyter import api  # noqa: PLC0415

        try:
            constraints: Constraints = api.pick_options(
                self.settings, _options.from_namespace(args)
            ).constraints
            mine = session.current() or session.Choice(uuids=tuple(uuids))
            _made, failing = api.current_fit(mine, constraints, self.settings)
        except AutoGPUError as err:
            raise UsageError(_one_line(err)) from None
        lines = []
        if constraints.count > len(uuids):
            lines.append(f"  it has {len(uuids)} device(s), {constraints.count} asked for")
        lines.extend(f"  {why}" for why in failing)
        if not lines:
            return None
        return (
            "autogpu: this kernel already has a GPU that does not meet "
            f"{constraints.describe()} (kept; to change: %gpu release, restart the kernel, "
            "%gpu pick):\n" + "\n".join(lines)
        )

    # -- helpers -------------------------------------------------------------------------
    def _in_kernel(self) -> bool:
        return getattr(self.shell, "kernel", None) is not None


# The docstring of the magic is what ``%gpu?`` shows: written for notebook users.
def _pick_help() -> str:
    """The pick options as plain text for ``%gpu?`` (magic_arguments' own help repeats itself
    and speaks reStructuredText)."""
    fmt = argparse.HelpFormatter("%gpu pick", width=90, max_help_position=24)
    actions = [a for a in _PICK_PARSER._actions if "-h" not in a.option_strings]
    # the pick options first (--min-free ...), the magic's own --dry-run and --force last
    actions.sort(key=lambda a: a.dest in ("dry_run", "force"))
    fmt.add_usage(None, actions, [], prefix="usage: ")
    fmt.start_section("pick options (also on top of a %%gpu cell)")
    fmt.add_arguments(actions)
    fmt.end_section()
    return fmt.format_help()


# Double backticks and "::" are reStructuredText for Sphinx; in ``%gpu?`` they are noise.
GPUMagics.gpu.__doc__ = (
    dedent(GPUMagics.__doc__ or "").replace("``", "").replace("::\n", ":\n") + "\n" + _pick_help()
)


# --------------------------------------------------------------------------- the sidebar's pick

#: The MIME type of the sidebar pick's answer: the sidebar reads it from the kernel's reply to
#: its own request; no notebook shows it.
SIDEBAR_PICK_MIME = "application/vnd.autogpu.pick+json"

def sidebar_pick(uuid: str) -> None:
    """The sidebar's "Pick for this notebook": ``%gpu pick`` in this kernel, on one device.

    The JupyterLab sidebar runs this in the notebook's own kernel, so the variables are set in
    the kernel's process, with a lease, and the pick is refused there if CUDA already started.
    It loads the extension if needed without IPython's "already loaded" message, never waits
    in line (a click is not a queue), and answers with one line and its details (a display of
    :data:`SIDEBAR_PICK_MIME` that only the sidebar reads). The overload warning that the next
    cell prints stays for the notebook.
    """
    ip = get_ipython()
    if ip is None:  # not in IPython: nothing to pick for
        return
    if id(ip) not in _loaded:
        # under its package name (the extension manager returns, never prints, "already
        # loaded"), so that a later `%load_ext autogpu` in the notebook stays quiet too
        ip.extension_manager.load_extension("autogpu_jupyter")
    magics = _loaded[id(ip)].magics
    ok, summary, details = magics._pick_one(str(uuid))
    # this request is the sidebar's: what the hook prints would reach the sidebar, not the
    # notebook, and a warning shown there would never be printed under a cell
    _hooks.skip_hook_once()
    show: Callable[..., None] = display  # IPython's display() carries no annotations
    show(
        {SIDEBAR_PICK_MIME: {"ok": ok, "summary": summary, "details": details},
         "text/plain": summary},
        raw=True,
    )


# --------------------------------------------------------------------------- load / unload


@dataclass
class _Loaded:
    magics: GPUMagics
    settings: AutoGPU
    hook: Callable[..., None]


_loaded: dict[int, _Loaded] = {}


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%gpu`` / ``%%gpu`` and the ``AutoGPU`` config (``%load_ext autogpu``).

    Loading twice (also as ``autogpu`` and ``autogpu_jupyter``) is a no-op. With
    ``c.AutoGPU.pick_on_load = True`` it picks at once, with the configured defaults.
    """
    if id(ipython) in _loaded:
        return
    settings = AutoGPU(parent=ipython)
    ipython.configurables.append(settings)
    magics = GPUMagics(ipython, settings)
    ipython.register_magics(magics)
    ipython.events.register("post_run_cell", _overload_hook)
    _loaded[id(ipython)] = _Loaded(magics, settings, _overload_hook)
    set_default_settings(settings)

    if KernelContract.read().provisioned:
        # numpy comes with the overload notice: only in a kernel the autogpu kernelspec started.
        from autogpu_jupyter.core import set_move_hint  # noqa: PLC0415

        set_move_hint("run %gpu move --best, then restart the kernel (its state is lost)")
    if session.current() is not None:  # e.g. picked by the kernel provisioner
        _watch()
    if settings.pick_on_load and session.current() is None:
        try:
            result, warning = magics._run_pick(_parse_pick([]))
            print(format_pick(result, warning))
            _watch()
        except (UsageError, NoDeviceFitsError) as err:
            print(f"autogpu: pick_on_load did not pick: {err}", file=sys.stderr)


def unload_ipython_extension(ipython: Any) -> None:
    """Unregister the magics, the hook and the config; stop the sampler thread.

    The pick itself stays (the variables keep their values); ``%gpu release`` drops it.
    """
    state = _loaded.pop(id(ipython), None)
    if state is None:
        return
    # Numpy: the sampler is stopped only if it ran.
    from autogpu_jupyter.core import stop_sampler  # noqa: PLC0415

    mm = ipython.magics_manager
    for kind in ("line", "cell"):
        if mm.magics[kind].get("gpu") is not None and _owned(mm.magics[kind]["gpu"], state.magics):
            del mm.magics[kind]["gpu"]
    mm.registry.pop(type(state.magics).__name__, None)
    with _suppress(ValueError):
        ipython.events.unregister("post_run_cell", state.hook)
    with _suppress(ValueError):
        ipython.configurables.remove(state.settings)
    set_default_settings(None)
    stop_sampler()
    from autogpu_jupyter.core import reset_pending  # noqa: PLC0415 (numpy: at unload)

    reset_pending()


def _owned(func: Any, magics: GPUMagics) -> bool:
    return getattr(func, "__self__", None) is magics


_suppress = contextlib.suppress
