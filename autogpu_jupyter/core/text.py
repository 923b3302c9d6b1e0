"""Text from others, made safe to show: terminal control characters, and command lines.

Lease records, process names and notebook paths are written by other users of the host. Before
such text reaches a terminal, every character that could steer it is spelled out: C0 and C1
control characters (a C1 CSI, U+009B, starts an escape sequence on many terminals, as ESC does),
DEL, the bidirectional overrides and isolates (U+202A-U+202E, U+2066-U+2069, U+200E/F, U+061C,
which can make ``evil.ipynb`` print as something else) and lone surrogates. HTML surfaces escape
with :func:`html.escape` (or ``textContent`` in the sidebar); this module is for plain text.
"""

from __future__ import annotations

import re

__all__ = ["terminal_safe", "redact_command"]

_UNSAFE = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _spell(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def terminal_safe(text: str) -> str:
    """``text`` with every terminal-steering character spelled out (``\\x9b``, ``\\u202e``).

    Newlines are kept (our own output is line-based; a record's fields never hold one).
    """
    return _UNSAFE.sub(_spell, text)


def redact_command(
    owner: str | None, command: str | None, me: str, expose: bool = False
) -> str | None:
    """``command`` unless it is another user's and the admin did not opt in to showing it."""
    if command is None:
        return None
    if expose or (owner is not None and owner == me):
        return command
    return None
