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
import unicodedata

__all__ = ["cells", "ljust", "rjust", "terminal_safe", "redact_command", "wrap_words"]

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


def _cell(ch: str) -> int:
    if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0  # drawn on the character before it (accents), or not drawn (ZWJ, ZWSP)
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cells(text: str) -> int:
    """How many terminal cells ``text`` takes: a CJK character or a full-width form takes two,
    a combining mark none (as ``wcwidth`` counts, from the Unicode database alone)."""
    if text.isascii():
        return len(text)
    return sum(_cell(ch) for ch in text)


def ljust(text: str, width: int) -> str:
    """``text`` padded with spaces to ``width`` terminal cells (:func:`cells`)."""
    return text + " " * max(width - cells(text), 0)


def rjust(text: str, width: int) -> str:
    """``text`` right-aligned in ``width`` terminal cells (:func:`cells`)."""
    return " " * max(width - cells(text), 0) + text


def _split_cells(word: str, width: int) -> list[str]:
    """A word too long for a line, cut into pieces of at most ``width`` cells."""
    pieces, cur, used = [], "", 0
    for ch in word:
        w = _cell(ch)
        if cur and used + w > width:
            pieces.append(cur)
            cur, used = "", 0
        cur += ch
        used += w
    return [*pieces, cur] if cur else pieces


def wrap_words(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width`` terminal cells, broken at spaces only (a no-break
    space, U+00A0, holds two words together); a word longer than a line is cut."""
    width = max(width, 1)
    lines: list[str] = []
    cur, used = "", 0
    for word in text.split(" "):
        if not word:
            continue
        w = cells(word)
        if cur and used + 1 + w <= width:
            cur, used = f"{cur} {word}", used + 1 + w
            continue
        if cur:
            lines.append(cur)
        if w <= width:
            cur, used = word, w
        else:
            *full, cur = _split_cells(word, width)
            lines.extend(full)
            used = cells(cur)
    if cur:
        lines.append(cur)
    return lines or [""]
