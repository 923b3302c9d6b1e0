"""The one pick-options boundary: every input form becomes one validated :class:`PickOptions`.

The options a pick takes are declared once (:data:`PICK_OPTIONS`). Each surface hands over what
the user gave, in its own form, and gets the same value type, validated the same way:

* ``%gpu pick`` / ``%%gpu`` / ``autogpu pick|run`` -- argparse arguments declared by
  :func:`add_arguments`, read with :func:`from_namespace`;
* ``autogpu_jupyter.pick(...)`` -- keyword arguments;
* ``GET|POST /autogpu/select`` -- query arguments or a JSON object (:func:`parse`, ``style="key"``);
* a kernelspec's ``metadata.kernel_provisioner.config`` -- a JSON object (the same);
* ``c.AutoGPU.*`` / ``AUTOGPU_*`` -- the defaults (:func:`defaults_from`), used for what a
  request leaves out.

Bad values get one message that names the option (``--max-util`` on the command line,
``max_util`` in JSON), the value and the accepted forms; an explicit ``''`` is refused, not read
as "no limit".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autogpu_jupyter.core.policy import DEVICE_IDS_FORMS, Constraints
from autogpu_jupyter.core.units import (
    DURATION_FORMS,
    PERCENT_FORMS,
    SIZE_FORMS,
    format_duration,
    parse_duration,
)
from autogpu_jupyter.errors import UsageErrorBase

__all__ = [
    "PICK_OPTIONS",
    "VALUE_OPTIONS",
    "OptionError",
    "OptionSpec",
    "POSITIONAL_IDS",
    "PickOptions",
    "add_arguments",
    "defaults_from",
    "from_namespace",
    "join_negative_values",
    "parse",
    "reject_empty",
]


@dataclass(frozen=True, slots=True)
class OptionSpec:
    """One pick option: its key (``min_free``), flag (``--min-free``), metavar and help."""

    key: str
    metavar: str | None
    help: str
    forms: str

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return self.metavar is None


_NAMES_FORMS = "model names, comma separated, e.g. A100 or L4,A100 (matched within the name)"

#: Every option a pick takes, declared once.
PICK_OPTIONS: tuple[OptionSpec, ...] = (
    OptionSpec(
        "min_free",
        "SIZE",
        "Free memory wanted per device: 10G / 10GiB (binary), 16GB "
        "(decimal) or 25% of the device. Default: AutoGPU.min_free.",
        SIZE_FORMS,
    ),
    OptionSpec(
        "max_util",
        "PCT",
        "Drop devices busier than this utilisation, 0-100. Default: AutoGPU.max_util.",
        PERCENT_FORMS,
    ),
    OptionSpec(
        "count",
        "N",
        "How many devices (default 1; at most one MIG device).",
        "a whole number >= 1, e.g. 2",
    ),
    OptionSpec(
        "exclude",
        "IDS",
        "NVML indices or UUIDs to avoid, comma separated: 0,2 or GPU-5a1b.",
        "NVML indices or UUIDs separated by commas, e.g. 0,2 or GPU-5a1b",
    ),
    OptionSpec(
        "exclusive",
        None,
        "Take devices no other lease holds, and keep others off them.",
        "true or false",
    ),
    OptionSpec(
        "wait",
        "DURATION",
        "Wait in line up to this long for a device to fit: 30s, 10m, "
        "1h. Interrupt the kernel to cancel.",
        DURATION_FORMS,
    ),
    OptionSpec(
        "model",
        "NAMES",
        "Only devices whose model name contains one of these: A100 or "
        "H100,A100. Default: AutoGPU.model.",
        _NAMES_FORMS,
    ),
    OptionSpec(
        "prefer",
        "NAMES",
        "Prefer these models, in this order, before load: L4,A100 "
        "(others after them). Default: AutoGPU.prefer (an admin's order).",
        _NAMES_FORMS,
    ),
    OptionSpec(
        "devices",
        "IDS",
        "Only these devices, comma separated: 2, 0,3, a UUID or its start (GPU-5a1b), a MIG "
        "device (3:1). Default --count: how many are named. %gpu pick 2 / autogpu pick 2 say "
        "the same.",
        DEVICE_IDS_FORMS,
    ),
)
_SPECS = {s.key: s for s in PICK_OPTIONS}
#: Pick options that take a value (as flags).
VALUE_OPTIONS = tuple(s.flag for s in PICK_OPTIONS if not s.is_switch)
_NEGATIVE = re.compile(r"^-[0-9.]")


class OptionError(UsageErrorBase):
    """A bad pick option: ``option`` (its key), ``value`` and why (the message)."""

    def __init__(self, message: str, option: str, value: object) -> None:
        super().__init__(message)
        self.option = option
        self.value = value


@dataclass(frozen=True, slots=True)
class PickOptions:
    """A validated pick request: the constraints, and how long it may wait in line."""

    constraints: Constraints
    wait_s: float = 0.0

    def describe(self) -> str:
        """In words, e.g. ``min free 10.0 GiB, exclusive, waiting up to 10m``."""
        text = self.constraints.describe()
        if self.wait_s:
            text += f", waiting up to {format_duration(self.wait_s)}"
        return text


def _label(key: str, style: str) -> str:
    return _SPECS[key].flag if style == "flag" else key


def _short(value: object) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:48] + "…" + r[-10:]


def reject_empty(value: object, option: str, forms: str) -> None:
    """An option given explicitly as ``''`` is a mistake, not "no limit": say so."""
    if isinstance(value, str) and not value.strip():
        raise OptionError(f"invalid {option} {value!r}: empty; expected {forms}", option, value)


def _names(value: object, key: str, style: str) -> tuple[str, ...]:
    if value is None or value == ():
        return ()
    if isinstance(value, str):
        parts = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        parts = list(value)
    else:
        raise OptionError(
            f"invalid {_label(key, style)} {_short(value)}: expected {_NAMES_FORMS}", key, value
        )
    names = tuple(p.strip() for p in parts)
    if not names or any(not n or len(n) > 64 for n in names):
        raise OptionError(
            f"invalid {_label(key, style)} {_short(value)}: expected {_NAMES_FORMS}", key, value
        )
    return names


def _switch(value: object, key: str, style: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if isinstance(value, str) and value.strip().lower() in {"0", "false", "no", "off", ""}:
        return False
    raise OptionError(
        f"invalid {_label(key, style)} {_short(value)}: expected true or false", key, value
    )


def parse(
    values: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any] | None = None,
    style: str = "flag",
    ignore: Iterable[str] = (),
    accept: Iterable[str] | None = None,
) -> PickOptions:
    """Validate ``values`` (what the user gave; ``None`` = not given) over ``defaults``.

    Parameters
    ----------
    values
        Option key -> value, in any input form (strings, numbers, lists, booleans).
    defaults
        What an option left out takes (:func:`defaults_from` of the settings).
    style
        ``"flag"``: messages name ``--min-free``; ``"key"``: ``min_free`` (JSON, kernelspecs).
    ignore
        Keys of ``values`` that belong to the caller (``kernel_id``, ``on_no_device``).
    accept
        The option keys this surface takes (default: all); others are unknown parameters.

    Raises
    ------
    OptionError
        An unknown option, or a bad value; the message names it and the accepted forms.
    """
    skip = set(ignore)
    known = set(_SPECS) if accept is None else set(accept) & set(_SPECS)
    unknown = sorted(k for k in values if k not in known and k not in skip)
    if unknown:
        accepted = sorted({*(_label(k, style) for k in known), *skip})
        raise OptionError(
            f"unknown parameter {_short(unknown[0])}; accepted: {', '.join(accepted)}",
            unknown[0],
            values[unknown[0]],
        )
    given = {k: v for k, v in values.items() if k in _SPECS and v is not None}
    for k, v in given.items():
        if k not in ("exclusive", "exclude", "devices"):
            reject_empty(v, _label(k, style), _SPECS[k].forms)
    merged = {**{k: v for k, v in (defaults or {}).items() if v not in (None, "")}, **given}
    if style == "key":
        _check_json_types(merged)
    # Each value alone first, so that an error names its option (``OptionError.option``).
    if "count" in merged:
        _count(merged["count"], style)
    for key in ("min_free", "max_util", "exclude"):
        if key in merged:
            _attributed(
                key, merged[key], lambda k=key: Constraints.parse(**{k: merged[k]}), style
            )
    named = _attributed(
        "devices", merged.get("devices"), lambda: Constraints.parse(devices=merged.get("devices")),
        style,
    ).devices
    count = merged.get("count", 1)
    if named and "count" not in given:
        count = len(named)  # naming devices asks for them, unless --count says how many of them
    elif named and _count(count, style) > len(named):
        label = "--count" if style == "flag" else "count"
        raise OptionError(
            f"invalid {label} {_short(count)}: more than the {len(named)} device(s) named "
            f"({','.join(named)}); expected at most {len(named)}",
            "count",
            count,
        )
    exclusive = _switch(merged.get("exclusive", False), "exclusive", style)
    constraints = Constraints.parse(
        min_free=merged.get("min_free"),
        max_util=merged.get("max_util"),
        count=count,
        devices=named or None,
        exclude=merged.get("exclude"),
        exclusive=exclusive,
        models=_names(merged.get("model"), "model", style),
        prefer=_names(merged.get("prefer"), "prefer", style),
    )
    wait = merged.get("wait")
    wait_s = (
        0.0 if wait is None else _attributed("wait", wait, lambda: parse_duration(wait), style)
    )
    return PickOptions(constraints, wait_s)


def _count(value: object, style: str) -> int:
    try:
        # str() of a bool ("True") or a float ("2.0", "inf") is no whole number: refused too
        n = int(str(value).strip())
    except ValueError:
        n = 0
    if n < 1:
        label = "--count" if style == "flag" else "count"
        raise OptionError(
            f"invalid {label} {_short(value)}: expected a whole number >= 1, e.g. 2", "count", value
        )
    return n


def _attributed(key: str, value: object, check: Any, style: str) -> Any:
    try:
        return check()
    except OptionError:
        raise
    except UsageErrorBase as err:
        # The checks below name the command-line flag; a JSON surface names its key instead.
        flag = f"invalid {_SPECS[key].flag} "
        message = str(err)
        if style == "key" and message.startswith(flag):
            message = f"invalid {key} " + message[len(flag):]
        raise OptionError(message, key, value) from None


_EXAMPLES = {"min_free": '"10G"', "max_util": '"50"', "wait": '"10m"'}


def _check_json_types(merged: Mapping[str, Any]) -> None:
    for key, example in _EXAMPLES.items():
        v = merged.get(key)
        # A number is a byte count to the Python API, but in JSON "10" is ambiguous: strings.
        number_ok = key != "min_free"
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, (str, int, float) if number_ok else str)
        ):
            raise OptionError(
                f"invalid {key}={_short(v)}: expected a string such as {example}", key, v
            )
    count = merged.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, (int, str))):
        raise OptionError(
            f"invalid count {_short(count)}: expected a whole number >= 1", "count", count
        )
    for key in ("exclude", "devices"):
        ids = merged.get(key)
        if ids is not None and not (
            isinstance(ids, str)
            or (isinstance(ids, list) and all(isinstance(x, (str, int)) for x in ids))
            # {"devices": 2}: one device by index
            or (key == "devices" and isinstance(ids, int) and not isinstance(ids, bool))
        ):
            raise OptionError(
                f'invalid {key} {_short(ids)}: expected ids like "0,2" or a list', key, ids
            )


def defaults_from(settings: Any) -> dict[str, Any]:
    """The pick defaults of an ``AutoGPU`` configuration (config file, ``%config``, env)."""
    return {
        "min_free": settings.min_free,
        "max_util": settings.max_util,
        "count": settings.count,
        "exclusive": settings.exclusive,
        "wait": settings.wait,
        "model": getattr(settings, "model", "") or None,
        "prefer": getattr(settings, "prefer", "") or None,
    }


#: The positional form of ``--devices`` (``%gpu pick 2``, ``autogpu pick 0,3``).
POSITIONAL_IDS = "ids"


def add_arguments(
    parser: Any,
    *,
    escape_percent: bool = True,
    skip: Sequence[str] = (),
    positional: bool = False,
) -> None:
    """Declare every pick option on an argparse parser (the CLI's, the magics', the kernelspec
    installer's), less the keys in ``skip``; with ``positional``, the devices may also be named
    without a flag (``pick 2``: where no command follows)."""
    if positional:
        parser.add_argument(
            POSITIONAL_IDS,
            nargs="?",
            metavar="IDS",
            default=None,
            help="the devices to pick from, as --devices (e.g. 2 or 0,3)",
        )
    for spec in PICK_OPTIONS:
        if spec.key in skip:
            continue
        text = spec.help.replace("%", "%%") if escape_percent else spec.help
        if spec.is_switch:
            parser.add_argument(spec.flag, action="store_true", default=None, help=text)
        else:
            parser.add_argument(spec.flag, metavar=spec.metavar, help=text)


def from_namespace(ns: Any) -> dict[str, Any]:
    """The pick options an argparse namespace holds (``None``: not given); devices named
    without a flag are ``devices`` too.

    Raises
    ------
    OptionError
        Devices named both ways (``pick 2 --devices 3``).
    """
    values = {spec.key: getattr(ns, spec.key, None) for spec in PICK_OPTIONS}
    ids = getattr(ns, POSITIONAL_IDS, None)
    if ids is not None:
        if values.get("devices") is not None:
            raise OptionError(
                f"devices named twice ({ids!r} and --devices {values['devices']!r}): name them "
                f"once, e.g. pick 0,3 or pick --devices 0,3",
                "devices",
                ids,
            )
        values["devices"] = ids
    return values


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
