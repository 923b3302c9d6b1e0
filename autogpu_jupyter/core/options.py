"""Pick options as typed by people: argument-list fixes shared by the magics and the CLI.

(The one pick-options boundary of the design grows here; today it holds what both command-line
surfaces must read the same way.)
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["VALUE_OPTIONS", "join_negative_values", "reject_empty"]

#: Pick options that take a value.
VALUE_OPTIONS = ("--min-free", "--max-util", "--count", "--exclude", "--wait")

_NEGATIVE = re.compile(r"^-[0-9.]")


def join_negative_values(argv: Sequence[str], options: Sequence[str] = VALUE_OPTIONS) -> list[str]:
    """``--min-free -5G`` -> ``--min-free=-5G``, so the value reaches our own validation.

    argparse reads ``-5G`` as an unknown option and answers "expected one argument", which
    names neither the value nor the accepted forms. Stops at ``--`` (what follows is a command).
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out.extend(argv[i:])
            break
        if arg in options and i + 1 < len(argv) and _NEGATIVE.match(argv[i + 1]):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def reject_empty(value: object, option: str, forms: str) -> None:
    """An option given explicitly as ``''`` is a mistake, not "no limit": say so."""
    from autogpu_jupyter.errors import UsageErrorBase

    if isinstance(value, str) and not value.strip():
        raise UsageErrorBase(f"invalid {option} {value!r}: empty; expected {forms}")
