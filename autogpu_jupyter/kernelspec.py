"""``autogpu kernelspec install | list | remove``: a "Python 3 (autogpu)" kernel that picks first.

The kernelspec runs this Python's ``ipykernel`` with the ``autogpu`` IPython extension loaded and
names the autogpu kernel provisioner (:mod:`autogpu_jupyter.provisioner`) with the pick options
in ``metadata.kernel_provisioner.config``::

    autogpu kernelspec install --min-free 10G --max-util 50 --user
    autogpu kernelspec install --name gpu-big --display-name "Python 3 (big GPU)" --min-free 40G \\
        --exclusive --wait 10m --on-no-device fail --sys-prefix
    autogpu kernelspec list
    autogpu kernelspec remove gpu-big
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from typing import Any

from autogpu_jupyter.core import ON_NO_DEVICE, PROVISIONER_NAME, options
from autogpu_jupyter.core import add_pick_arguments as add_arguments
from autogpu_jupyter.core import options_from_namespace as from_namespace
from autogpu_jupyter.errors import UsageErrorBase

__all__ = ["DEFAULT_NAME", "DEFAULT_DISPLAY_NAME", "add_cli", "install", "list_specs", "remove",
           "spec_dict"]

DEFAULT_NAME = "python3-autogpu"
DEFAULT_DISPLAY_NAME = "Python 3 (autogpu)"


def spec_dict(
    display_name: str = DEFAULT_DISPLAY_NAME,
    options: dict[str, Any] | None = None,
    *,
    python: str | None = None,
    load_extension: bool = True,
) -> dict[str, Any]:
    """The ``kernel.json`` content (options validated first).

    Raises
    ------
    UsageErrorBase
        A bad option, naming it and the accepted forms.
    """
    opts = {k: v for k, v in (options or {}).items() if v is not None}
    _validate(opts)
    argv = [python or sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    if load_extension:
        # Loaded under its package name: a notebook's own `%load_ext autogpu` (as the README
        # says to write) then loads the `autogpu` shim, which finds the extension loaded and
        # returns quietly, instead of IPython's "The autogpu extension is already loaded".
        argv.append("--ext=autogpu_jupyter")
    return {
        "argv": argv,
        "display_name": display_name,
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {
            "debugger": True,
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": opts},
        },
    }


def _manager() -> Any:
    # Imported here: every `autogpu` command builds this module's parser, and jupyter_client
    # (with zmq and tornado) is for the kernelspec commands only; the broker and the exporter
    # run without it.
    from jupyter_client.kernelspec import KernelSpecManager  # noqa: PLC0415

    return KernelSpecManager()


def _validate(opts: dict[str, Any]) -> None:
    """The options a kernelspec gets, checked as the provisioner will read them (the one
    options boundary, JSON names)."""
    on_no = opts.get("on_no_device", "cpu")
    if on_no not in ON_NO_DEVICE:
        raise UsageErrorBase(
            f"invalid on_no_device {on_no!r}: expected \"cpu\" (start without a GPU) or \"fail\""
        )
    options.parse(opts, style="key", ignore=("on_no_device",))


def install(
    name: str = DEFAULT_NAME,
    display_name: str = DEFAULT_DISPLAY_NAME,
    options: dict[str, Any] | None = None,
    *,
    user: bool = False,
    prefix: str | None = None,
    python: str | None = None,
    load_extension: bool = True,
) -> str:
    """Install the kernelspec; returns the directory it was installed into."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise UsageErrorBase(
            f"invalid kernelspec name {name!r}: expected letters, digits, '.', '_' or '-', "
            "e.g. python3-autogpu"
        )
    spec = spec_dict(display_name, options, python=python, load_extension=load_extension)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "kernel.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f, indent=1)
        spec_ipykernel = importlib.util.find_spec("ipykernel")
        if spec_ipykernel is not None and spec_ipykernel.origin:
            resources = os.path.join(os.path.dirname(spec_ipykernel.origin), "resources")
            for logo in ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg"):
                src = os.path.join(resources, logo)
                if os.path.exists(src):
                    shutil.copy(src, tmp)
        try:
            dest: str = _manager().install_kernel_spec(
                tmp, kernel_name=name, user=user, prefix=prefix
            )
        except PermissionError as err:
            raise UsageErrorBase(
                f"cannot install kernelspec {name!r}: {err.strerror} ({err.filename}); "
                "use --user, --sys-prefix or --prefix DIR"
            ) from None
    return dest


def list_specs() -> list[dict[str, Any]]:
    """Every installed kernelspec that uses the autogpu provisioner."""
    out = []
    for name, info in sorted(_manager().get_all_specs().items()):
        spec = info.get("spec", {})
        prov = (spec.get("metadata") or {}).get("kernel_provisioner") or {}
        if prov.get("provisioner_name") != PROVISIONER_NAME:
            continue
        out.append({
            "name": name,
            "display_name": spec.get("display_name", name),
            "resource_dir": info.get("resource_dir"),
            "options": prov.get("config") or {},
        })
    return out


def remove(name: str) -> str:
    """Remove an autogpu kernelspec; returns the directory removed.

    Raises
    ------
    UsageErrorBase
        No such kernelspec, or it does not use the autogpu provisioner (not ours to remove).
    """
    mgr = _manager()
    specs = mgr.find_kernel_specs()
    if name not in specs:
        ours = ", ".join(s["name"] for s in list_specs()) or "none installed"
        raise UsageErrorBase(f"no kernelspec named {name!r} (autogpu kernelspecs: {ours})")
    if name not in {s["name"] for s in list_specs()}:
        raise UsageErrorBase(
            f"kernelspec {name!r} does not use the autogpu provisioner; remove it with "
            f"`jupyter kernelspec remove {name}`"
        )
    try:
        return str(mgr.remove_kernel_spec(name))
    except PermissionError as err:
        raise UsageErrorBase(
            f"cannot remove kernelspec {name!r}: {err.strerror} ({err.filename})"
        ) from None


# --------------------------------------------------------------------------------------------
# CLI


def _options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {
        k: v for k, v in from_namespace(args).items() if v is not None and k != "exclude"
    }
    if opts.get("exclusive") is False:
        del opts["exclusive"]
    if "count" in opts:
        try:
            opts["count"] = int(opts["count"])
        except ValueError:
            raise UsageErrorBase(
                f"invalid --count {opts['count']!r}: expected a whole number >= 1, e.g. 2"
            ) from None
    # Checked here first so that a bad value is named by the flag the user typed; install()
    # checks again as the provisioner reads it (JSON keys).
    options.parse(opts, style="flag")
    if args.on_no_device is not None:
        opts["on_no_device"] = args.on_no_device
    return opts


def _cmd_install(args: argparse.Namespace) -> int:
    prefix = args.prefix
    if args.sys_prefix:
        prefix = sys.prefix
    dest = install(
        args.name, args.display_name, _options_from_args(args), user=args.user, prefix=prefix,
        python=args.python, load_extension=not args.no_extension,
    )
    opts = _options_from_args(args)
    shown = ", ".join(f"{k}={v}" for k, v in opts.items()) or "the server's defaults (c.AutoGPU)"
    print(f"installed kernelspec {args.name!r} ({args.display_name}) in {dest}")
    print(f"pick options: {shown}")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    specs = list_specs()
    if args.json:
        print(json.dumps(specs, indent=2))
        return 0
    if not specs:
        print("no autogpu kernelspecs installed (autogpu kernelspec install --user)")
        return 0
    for s in specs:
        opts = ", ".join(f"{k}={v}" for k, v in s["options"].items()) or "defaults"
        print(f"{s['name']:<24} {s['display_name']:<28} {opts:<30} {s['resource_dir']}")
    return 0


def _cmd_remove(args: argparse.Namespace) -> int:
    path = remove(args.name)
    print(f"removed kernelspec {args.name!r} ({path})")
    return 0


def add_cli(subparsers: Any) -> None:
    """Add ``autogpu kernelspec {install,list,remove}`` to the ``autogpu`` CLI."""
    p = subparsers.add_parser(
        "kernelspec", help="install / list / remove the \"Python 3 (autogpu)\" kernelspec",
        description="A kernelspec whose provisioner picks the GPU before the kernel starts; the "
        "lease lives exactly as long as the kernel process.",
    )
    sub = p.add_subparsers(dest="kernelspec_command", metavar="ACTION",
                           parser_class=type(p))
    p.set_defaults(handler=lambda _a: (p.print_help(), 2)[1])

    inst = sub.add_parser("install", help="install an autogpu kernelspec")
    inst.add_argument("--name", default=DEFAULT_NAME,
                      help=f"kernelspec name (default {DEFAULT_NAME})")
    inst.add_argument("--display-name", default=DEFAULT_DISPLAY_NAME,
                      help=f"name shown in the launcher (default {DEFAULT_DISPLAY_NAME!r})")
    # The pick options are declared once (core.options), less --exclude: a kernelspec serves
    # many kernels, and device ids to avoid belong to one pick, not to the spec.
    add_arguments(inst, skip=("exclude",))
    inst.add_argument("--on-no-device", choices=ON_NO_DEVICE,
                      help="nothing fits: start CPU-only with a note (cpu, default) "
                      "or refuse to start (fail)")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user only")
    where.add_argument("--sys-prefix", action="store_true",
                       help=f"install into this Python's prefix ({sys.prefix})")
    where.add_argument("--prefix", metavar="DIR", help="install into DIR/share/jupyter/kernels")
    inst.add_argument("--python", metavar="EXE",
                      help=f"the Python that runs the kernel (default {sys.executable})")
    inst.add_argument("--no-extension", action="store_true",
                      help="do not load the autogpu IPython extension (%%gpu) in the kernel")
    inst.set_defaults(handler=_cmd_install)

    lst = sub.add_parser("list", help="list the installed autogpu kernelspecs")
    lst.add_argument("--json", action="store_true", help="machine-readable output")
    lst.set_defaults(handler=_cmd_list)

    rm = sub.add_parser("remove", help="remove an autogpu kernelspec")
    rm.add_argument("name", help="the kernelspec name")
    rm.set_defaults(handler=_cmd_remove)
