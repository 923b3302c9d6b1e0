"""``autogpu broker tenant add|list|remove``: the tenants table (:mod:`.tenants`) from a shell
(root). Usage errors are one line, as the rest of the CLI's."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping

from autogpu_jupyter.brokerd.tenants import (
    CONTAINER_SOCKET_DIR,
    DEFAULT_RULES,
    DEFAULT_SOCKET_ROOT,
    DEFAULT_STATE_DIR,
    MAIN_SOCKET,
    NAME_FORM,
    Tenant,
    TenantError,
    add_tenant,
    load_table,
    remove_tenant,
    rules_tenants,
    tenant_dir,
    tenant_socket,
    validate_name,
)
from autogpu_jupyter.core.leasing import admin
from autogpu_jupyter.errors import AutoGPUError, LeaseStoreUnreachableError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="autogpu broker tenant",
        description="Tenants (root): each is a name with its own broker socket; a connection on "
        f"it is that tenant, whatever its uid. Names: {NAME_FORM}. See docs/jupyterhub.md.",
    )
    common = _Parser(add_help=False)
    common.add_argument("--state-dir", default=DEFAULT_STATE_DIR, metavar="DIR",
                        help=f"the broker's state directory (default {DEFAULT_STATE_DIR})")
    common.add_argument("--socket-root", default=DEFAULT_SOCKET_ROOT, metavar="DIR",
                        help="where the tenants' socket directories live (default "
                        f"{DEFAULT_SOCKET_ROOT}, root's, mode 0700)")
    common.add_argument("--rules", default=DEFAULT_RULES, metavar="FILE",
                        help=f"the broker's rules file (default {DEFAULT_RULES})")
    common.add_argument("--socket", default=MAIN_SOCKET, metavar="PATH",
                        help="the running broker's main socket, told to serve the change "
                        f"(default {MAIN_SOCKET})")
    sub = p.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    add = sub.add_parser("add", parents=[common], help="add a tenant, or update its options")
    add.add_argument("name", metavar="NAME")
    add.add_argument("--group", action="append", default=[], metavar="G",
                     help="a group of the tenant (again for more)")
    add.add_argument("--max-devices", type=int, default=None, metavar="N",
                     help="devices the tenant may lease at once (0: no limit; default: the "
                     "rules' limit for its name or groups)")
    lst = sub.add_parser("list", parents=[common], help="list the tenants")
    lst.add_argument("--json", action="store_true", help="machine-readable output")
    rm = sub.add_parser("remove", parents=[common], help="remove a tenant and its socket")
    rm.add_argument("name", metavar="NAME")
    return p


def main(argv: list[str]) -> int:
    """``autogpu broker tenant add|list|remove``; returns the exit code (0; 1: refused, not
    root; 2: bad input)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.action is None:
        p.print_usage(sys.stderr)
        print("autogpu broker tenant: error: expected add, list or remove", file=sys.stderr)
        return 2
    try:
        if args.action == "add":
            # Bad input is named before any permission question.
            Tenant.make(args.name, args.group, args.max_devices)
        elif args.action == "remove":
            validate_name(args.name)
        if os.geteuid() != 0:
            raise TenantError(
                f"broker tenant {args.action} needs root: the tenants table in {args.state_dir} "
                "and the socket directories are root's (run it with sudo)", usage=False)
        rules = rules_tenants(args.rules)
        if args.action == "add":
            tenant, what = add_tenant(args.name, args.group, args.max_devices,
                                      state_dir=args.state_dir, socket_root=args.socket_root,
                                      rules=rules)
            print(f"tenant {tenant.name} {what} ({tenant.describe()}); its socket directory "
                  f"{tenant_dir(args.socket_root, tenant.name)} is mounted at "
                  f"{CONTAINER_SOCKET_DIR} in its container")
            print(tell_broker(args.socket))
        elif args.action == "remove":
            left = remove_tenant(args.name, state_dir=args.state_dir,
                                 socket_root=args.socket_root, rules=rules)
            print(f"tenant {args.name} removed" + (f"; {left}" if left else ""))
            print(tell_broker(args.socket))
        else:
            table = {**load_table(args.state_dir), **rules}
            _print_list(table, args.socket_root, args.json)
    except TenantError as err:
        print(f"autogpu: {err}", file=sys.stderr)
        return 2 if err.usage else 1
    except OSError as err:
        print(f"autogpu: broker tenant {args.action}: {err.strerror or err} "
              f"({err.filename or args.state_dir})", file=sys.stderr)
        return 1
    return 0


def _print_list(table: Mapping[str, Tenant], socket_root: str, as_json: bool) -> None:
    rows = [table[n] for n in sorted(table)]
    if as_json:
        print(json.dumps([{"name": t.name, **t.to_json(), "source": t.source,
                           "socket": tenant_socket(socket_root, t.name)} for t in rows], indent=2))
        return
    print(f"tenants: {len(rows)}")
    for t in rows:
        print(f"  {t.name}  {t.describe()}  ({t.source})  {tenant_socket(socket_root, t.name)}")


def tell_broker(path: str = MAIN_SOCKET) -> str:
    """Ask the running broker at ``path`` (its main socket; root's ``reload``) to read its
    tenants again; one line saying what happened."""
    try:
        admin.broker_at(path).reload_tenants()
    except LeaseStoreUnreachableError:
        return f"the broker is not running at {path}: it serves the tenants when it starts"
    except AutoGPUError as err:
        why = (str(err).splitlines() or ["?"])[0]
        return f"the broker at {path} did not reload: {why[:200]}"
    return f"the broker at {path} serves the change"
