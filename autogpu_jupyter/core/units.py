"""Sizes, percentages and durations: the one place units are defined (design decision 7).

* ``K``, ``M``, ``G``, ``T``, ``Ki``…``Ti`` and ``KiB``…``TiB`` are binary (1024-based), as Slurm
  and Docker read ``10G``.
* ``KB``, ``MB``, ``GB``, ``TB`` are decimal (1000-based); ``B`` is bytes.
* ``25%`` is a fraction of the device's total memory, resolved per device.
* A bare number is rejected for sizes: ``10`` could mean bytes or GiB, so we ask.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from autogpu_jupyter.errors import UsageErrorBase

__all__ = [
    "Size",
    "parse_size",
    "parse_percent",
    "parse_duration",
    "format_bytes",
    "format_duration",
    "SIZE_FORMS",
]

SIZE_FORMS = (
    "a number with a unit, e.g. 10G, 10GiB, 512M, 0.5T, 16GB (decimal), "
    "or a share of the device like 25%"
)

_MULT: dict[str, int] = {"B": 1}
for _i, _p in enumerate("KMGT", start=1):
    _MULT[_p] = 1024**_i
    _MULT[_p + "I"] = 1024**_i
    _MULT[_p + "IB"] = 1024**_i
    _MULT[_p + "B"] = 1000**_i

#: The largest size accepted (1 EiB): far past any GPU, and well inside float and int64 range,
#: so that no later arithmetic (bookings, JSON, formatting) can overflow.
MAX_SIZE_BYTES = 2**60

_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*|%)\s*$")


@dataclass(frozen=True, slots=True)
class Size:
    """A memory requirement: an absolute byte count, or a fraction of a device's total.

    Exactly one of ``bytes`` and ``fraction`` is set. ``text`` is what the user typed.
    """

    bytes: int | None = None
    fraction: float | None = None
    text: str = ""

    def resolve(self, total_bytes: int | None) -> int | None:
        """Bytes this requirement means on a device of ``total_bytes`` (``None`` if unknown)."""
        if self.bytes is not None:
            return self.bytes
        if total_bytes is None or self.fraction is None:
            return None
        return math.ceil(self.fraction * total_bytes)

    def describe(self) -> str:
        """Human form of the parsed value, e.g. ``10.0 GiB`` or ``25% of the device``."""
        if self.bytes is not None:
            return format_bytes(self.bytes)
        assert self.fraction is not None
        return f"{self.fraction * 100:g}% of the device"

    def to_json(self) -> dict[str, object]:
        return {"bytes": self.bytes, "fraction": self.fraction, "text": self.text}


def parse_size(text: object) -> Size:
    """Parse a memory size such as ``"10G"``, ``"512MiB"``, ``"16GB"`` or ``"25%"``.

    Parameters
    ----------
    text
        What the user typed. An ``int`` is taken as bytes (the Python API may pass byte counts).

    Returns
    -------
    Size

    Raises
    ------
    UsageErrorBase
        For anything else, with the bad value and the accepted forms in the message.
    """
    if isinstance(text, bool):
        raise UsageErrorBase(f"invalid size {text!r}: expected {SIZE_FORMS}")
    if isinstance(text, int):
        if text < 0:
            raise UsageErrorBase(
                f"invalid size {text!r}: must not be negative; expected {SIZE_FORMS}"
            )
        _check_size(text, text)
        return Size(bytes=text, text=f"{text}B")
    if isinstance(text, Size):
        return text
    if not isinstance(text, str):
        raise UsageErrorBase(f"invalid size {text!r}: expected {SIZE_FORMS}")
    m = _SIZE_RE.match(text)
    if m is None:
        why = "must not be negative" if text.strip().startswith("-") else "not understood"
        raise UsageErrorBase(f"invalid size {_short(text)}: {why}; expected {SIZE_FORMS}")
    num = float(m.group("num"))
    unit = m.group("unit")
    if unit == "%":
        if not 0 <= num <= 100:
            raise UsageErrorBase(
                f"invalid size {text!r}: a share must be 0-100%; expected {SIZE_FORMS}"
            )
        return Size(fraction=num / 100.0, text=text.strip())
    if unit == "":
        raise UsageErrorBase(
            f"invalid size {text!r}: a bare number is ambiguous, add a unit; expected {SIZE_FORMS}"
        )
    mult = _MULT.get(unit.upper())
    if mult is None:
        raise UsageErrorBase(f"invalid size {text!r}: unknown unit {unit!r}; expected {SIZE_FORMS}")
    value = num * mult
    _check_size(value, text)
    return Size(bytes=round(value), text=text.strip())


def _check_size(value: float, text: object) -> None:
    if not value <= MAX_SIZE_BYTES:  # also catches inf from "999...9G"
        raise UsageErrorBase(
            f"invalid size {_short(text)}: too large (at most 1 EiB); expected {SIZE_FORMS}"
        )


def _short(text: object) -> str:
    """``repr`` of a user's value, cut to a readable length (a 400-digit number stays one line)."""
    r = repr(text) if not isinstance(text, int) or text < 10**40 else f"{str(text)[:12]}…"
    return r if len(r) <= 60 else r[:40] + "…" + r[-10:]


PERCENT_FORMS = "a number from 0 to 100, optionally followed by %, e.g. 50 or 50%"


def parse_percent(text: object, what: str = "percentage") -> float:
    """Parse a utilisation threshold such as ``"50"`` or ``"50%"`` into a float in [0, 100].

    Raises
    ------
    UsageErrorBase
        Outside 0-100 or not a number; the message names the value and the accepted forms.
    """
    if isinstance(text, bool):
        raise UsageErrorBase(f"invalid {what} {_short(text)}: expected {PERCENT_FORMS}")
    if isinstance(text, (int, float)):
        value = float(text) if -1e300 < text < 1e300 else math.inf
    elif isinstance(text, str):
        s = text.strip().removesuffix("%").strip()
        try:
            value = float(s)
        except ValueError:
            raise UsageErrorBase(
                f"invalid {what} {_short(text)}: expected {PERCENT_FORMS}"
            ) from None
    else:
        raise UsageErrorBase(f"invalid {what} {_short(text)}: expected {PERCENT_FORMS}")
    if not (0.0 <= value <= 100.0) or math.isnan(value):
        raise UsageErrorBase(
            f"invalid {what} {_short(text)}: must be 0-100; expected {PERCENT_FORMS}"
        )
    return value


DURATION_FORMS = "seconds or a number with s, m, h or d, e.g. 90, 30s, 10m, 1.5h"
_DUR = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_DUR_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")


def parse_duration(text: object) -> float:
    """Parse a wait time (``"10m"``, ``"30s"``, ``"1h"``, ``90``) into seconds.

    Raises
    ------
    UsageErrorBase
        Negative, unknown unit, or not a number.
    """
    if isinstance(text, bool):
        raise UsageErrorBase(f"invalid duration {text!r}: expected {DURATION_FORMS}")
    if isinstance(text, (int, float)):
        if text < 0 or (isinstance(text, float) and math.isnan(text)):
            raise UsageErrorBase(f"invalid duration {_short(text)}: expected {DURATION_FORMS}")
        return _check_duration(float(text) if text <= MAX_DURATION_S else math.inf, text)
    if not isinstance(text, str):
        raise UsageErrorBase(f"invalid duration {text!r}: expected {DURATION_FORMS}")
    m = _DUR_RE.match(text)
    if m is None or m.group("unit").lower() not in _DUR:
        raise UsageErrorBase(f"invalid duration {_short(text)}: expected {DURATION_FORMS}")
    return _check_duration(float(m.group("num")) * _DUR[m.group("unit").lower()], text)


#: The longest wait accepted: a year (timers and deadlines overflow on "inf").
MAX_DURATION_S = 365 * 86400.0


def _check_duration(seconds: float, text: object) -> float:
    if not seconds <= MAX_DURATION_S:
        raise UsageErrorBase(
            f"invalid duration {_short(text)}: too long (at most 365d); expected {DURATION_FORMS}"
        )
    return seconds


def format_bytes(n: int | float | None) -> str:
    """``10737418240`` -> ``"10.0 GiB"``; ``None`` -> ``"?"`` (unknown)."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024.0:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024.0
    return f"{value:.1f} TiB"


def format_duration(seconds: float) -> str:
    """``600`` -> ``"10m"``; ``90`` -> ``"1m30s"``; ``5.25`` -> ``"5.2s"``."""
    if seconds < 60:
        return f"{seconds:.1f}s" if seconds != int(seconds) else f"{int(seconds)}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs}s" if secs else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m" if minutes else f"{hours}h"
