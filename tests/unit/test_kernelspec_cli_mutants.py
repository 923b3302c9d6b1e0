"""What the mutation run (issue 22) found unchecked in ``autogpu kernelspec``'s parser
(``kernelspec.add_cli``): the namespace each action reads, that is the action recorded, its
handler and every default of ``install``, ``list`` and ``remove``. The help texts are pinned
whole in test_cli_parser_kernelspec_mutants.py. In-process: the parser only, nothing installed.
"""

from __future__ import annotations

from typing import Any

import pytest

from autogpu_jupyter import cli as cli_mod
from autogpu_jupyter import kernelspec

#: What ``autogpu kernelspec ACTION`` reads when given nothing else (its defaults).
DEFAULTS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "install": ([], {
        "handler": kernelspec._cmd_install, "name": "python3-autogpu",
        "display_name": "Python 3 (autogpu)", "min_free": None, "max_util": None,
        "count": None, "exclusive": None, "wait": None, "model": None, "prefer": None,
        "devices": None, "on_no_device": None, "user": False, "sys_prefix": False, "prefix": None,
        "python": None, "no_extension": False}),
    "list": ([], {"handler": kernelspec._cmd_list, "json": False}),
    "remove": (["gpu-big"], {"handler": kernelspec._cmd_remove, "name": "gpu-big"}),
}


@pytest.mark.parametrize("action", sorted(DEFAULTS))
def test_each_kernelspec_action_is_recorded_and_starts_from_its_defaults(action: str) -> None:
    """``autogpu kernelspec ACTION`` reads exactly these values: the action under
    ``kernelspec_command``, the action's handler, and its documented defaults (the name and
    display name of the kernelspec, every pick option unset, no --exclude, which a kernelspec
    does not take). Caught (issue 22): the action's destination dropped or renamed; --exclude
    no longer skipped (dropped or misspelled skip), so the install namespace gained it."""
    extra, expected = DEFAULTS[action]
    seen = vars(cli_mod.build_parser().parse_args(["kernelspec", action, *extra]))
    del seen["_subparsers"]
    assert seen == {"command": "kernelspec", "kernelspec_command": action, **expected}

