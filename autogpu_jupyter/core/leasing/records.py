"""The lease record format: what a lease or ticket file holds, written and read by one schema.

A record is one JSON object (at most :data:`MAX_RECORD_BYTES`), UTF-8, strict: unknown or
duplicate keys, non-finite numbers, lone surrogates, control characters in names, wrong types
and out-of-range numbers are rejected (:class:`Invalid`). The writers (the shared directory,
:mod:`core.leasing.directory`, and the broker) normalise their own values with
:func:`field_text` and check the exact bytes with the readers' parse before a lease counts, so
neither reports a lease that readers reject. Another user's record is untrusted input: it is
only ever parsed here, never executed or put in a shell.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from autogpu_jupyter.core.words import holder_where

__all__ = [
    "FIELD_CAPS",
    "LEASE_SUFFIX",
    "MAX_DEVICES",
    "MAX_ID_LIST",
    "MAX_RECORD_BYTES",
    "MAX_SEQ",
    "SCHEMA_VERSION",
    "TICKET_SUFFIX",
    "Invalid",
    "LeaseRecord",
    "capped_text",
    "cut_encoded",
    "encode",
    "field_text",
    "parse_checked",
    "parse_record",
    "record_from_fields",
]

LEASE_SUFFIX = ".lease"
TICKET_SUFFIX = ".ticket"
#: Records larger than this are ignored unread (another user's file is untrusted input).
MAX_RECORD_BYTES = 64 * 1024
SCHEMA_VERSION = 1

#: Ticket sequence numbers stay JSON-exact integers; a writer never goes past this (see
#: :meth:`Transaction.create_ticket`), so another user's huge ``seq`` cannot make ours unreadable.
MAX_SEQ = 2**53 - 1

_ID_RE = re.compile(r"^[0-9a-f]{16,64}$")
_UUID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_MAX_STR = 4096
#: Most devices a record names (a lease's devices, a request's count, exclude and allowed lists).
MAX_DEVICES = 64
#: The most entries of any list of ids in a record (devices, a ticket's ``exclude`` and
#: ``allowed_uuids``), and of the ids a message names.
MAX_ID_LIST = MAX_DEVICES
#: What a writer keeps of each free-text field, in *encoded* bytes (JSON with ``\u`` escapes,
#: as the record travels and is stored): 1 KiB of emoji is 12 KiB once escaped, so a cap in
#: characters bounds nothing. Readers accept up to :data:`_MAX_STR` characters (records of
#: older writers stay readable); the broker keeps to these (:func:`capped_text`).
FIELD_CAPS = {
    "notebook_path": 1024,
    "kernel_id": 64,
    "command": 1024,
    "user": 256,
    "host": 256,
    "holder_kind": 32,
}


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    """One lease or ticket as read from the registry (validated; fields of others are untrusted).

    ``requested_bytes`` is what the lease books on each device (``None``: nothing asked);
    ``device_requested_bytes`` gives it per device, in the order of ``device_uuids``.
    ``live`` says whether its holder still holds the ``flock``.
    """

    lease_id: str
    kind: str  # "lease" or "ticket"
    device_uuids: tuple[str, ...]
    device_requested_bytes: tuple[int | None, ...]
    exclusive: bool
    user: str
    uid: int
    host: str
    pid: int
    created_s: float
    kernel_id: str | None = None
    notebook_path: str | None = None
    command: str | None = None
    holder_kind: str = "process"
    seq: int | None = None
    constraints: Mapping[str, Any] | None = None
    live: bool = True
    path: str = ""

    @property
    def requested_bytes(self) -> int | None:
        """The most this lease books on any one of its devices (``None``: nothing asked)."""
        known = [b for b in self.device_requested_bytes if b is not None]
        return max(known) if known else None

    def requested_on(self, uuid: str) -> int | None:
        """Bytes booked on device ``uuid`` (``None`` if not asked or not one of its devices)."""
        for u, b in zip(self.device_uuids, self.device_requested_bytes, strict=False):
            if u == uuid:
                return b
        return None

    def holder_text(self) -> str:
        """Who holds it, in words: ``alice: analysis.ipynb`` or ``bob: kernel 1a2b3c4d``."""
        return f"{self.user}: {holder_where(self.notebook_path, self.kernel_id, self.pid)}"

    def to_dict(self, redact_command: bool = True) -> dict[str, Any]:
        """JSON-ready dict. ``redact_command`` hides the command line (other users' by default)."""
        return {
            "lease_id": self.lease_id,
            "kind": self.kind,
            "device_uuids": list(self.device_uuids),
            "device_requested_bytes": list(self.device_requested_bytes),
            "requested_bytes": self.requested_bytes,
            "exclusive": self.exclusive,
            "user": self.user,
            "uid": self.uid,
            "host": self.host,
            "pid": self.pid,
            "created_s": self.created_s,
            "kernel_id": self.kernel_id,
            "notebook_path": self.notebook_path,
            "command": None if redact_command else self.command,
            "holder_kind": self.holder_kind,
            "seq": self.seq,
            "live": self.live,
            "path": self.path,
        }

    def _payload(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "version": SCHEMA_VERSION,
            "kind": self.kind,
            "lease_id": self.lease_id,
            "device_uuids": list(self.device_uuids),
            "device_requested_bytes": list(self.device_requested_bytes),
            "exclusive": self.exclusive,
            "user": self.user,
            "uid": self.uid,
            "host": self.host,
            "pid": self.pid,
            "created_s": self.created_s,
            "kernel_id": self.kernel_id,
            "notebook_path": self.notebook_path,
            "command": self.command,
            "holder_kind": self.holder_kind,
        }
        if self.kind == "ticket":
            d["seq"] = self.seq
            d["constraints"] = dict(self.constraints or {})
        return d


class Invalid(Exception):
    """A record that fails the schema (the message says why; it is logged, never shown raw)."""


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise Invalid(f"duplicate key {k[:40]!r}")
        out[k] = v
    return out


def _bad_constant(name: str) -> Any:
    raise Invalid(f"non-finite number {name}")


def _str(
    d: Mapping[str, Any], key: str, *, optional: bool = False, control_ok: bool = False
) -> Any:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > _MAX_STR:
        raise Invalid(f"{key}: expected a string of at most {_MAX_STR} characters")
    if not control_ok and _CONTROL_RE.search(v):
        raise Invalid(f"{key}: control characters")
    return v


def _int(
    d: Mapping[str, Any], key: str, *, optional: bool = False, lo: int = 0, hi: int = 2**63 - 1
) -> Any:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise Invalid(f"{key}: expected an integer from {lo} to {hi}")
    return v


_LEASE_KEYS = {
    "version",
    "kind",
    "lease_id",
    "device_uuids",
    "device_requested_bytes",
    "exclusive",
    "user",
    "uid",
    "host",
    "pid",
    "created_s",
    "kernel_id",
    "notebook_path",
    "command",
    "holder_kind",
}
_TICKET_KEYS = _LEASE_KEYS | {"seq", "constraints"}
_CONSTRAINT_KEYS = {
    "min_free_bytes",
    "min_free_fraction",
    "max_util_pct",
    "count",
    "exclude",
    "exclusive",
    "allowed_uuids",
}
#: A request's keys that may be missing (a ticket written before they were kept: any model).
_OPTIONAL_CONSTRAINT_KEYS = {"models", "prefer"}
#: Most model names a request lists, and the longest (as the pick options accept them).
MAX_MODEL_NAMES = 64
_MAX_MODEL_NAME = 64


#: Validated records by their exact bytes and where they were found (see :func:`_parse_cached`).
_RECORD_CACHE: dict[tuple[bytes, str, str, int, str], LeaseRecord] = {}
_RECORD_CACHE_MAX = 16384  # above the most live records a scan reads (4 users x 4096)
_RECORD_CACHE_ENTRY_MAX = 2048  # bytes (a typical record is ~500): at most 32 MiB cached


def parse_checked(
    data: bytes, *, kind: str, name: str, path: str, dir_uid: int, real_user: str, live: bool
) -> LeaseRecord:
    """:func:`_parse_record` plus the ownership checks, memoised on the file's exact bytes.

    The key is the content itself (with kind, file name, directory uid and that uid's user
    name, the only other inputs of the checks), so a hit is exactly the record a fresh parse
    would give: nothing stale, nothing another user could steer. ``live`` and ``path`` are
    filled in per read. Raises :class:`Invalid` for a record that fails (never cached).
    """
    key = (data, kind, name, dir_uid, real_user)
    rec = _RECORD_CACHE.get(key)
    if rec is None:
        rec = parse_record(data, kind=kind, path=path, live=live)
        if rec.uid != dir_uid:
            raise Invalid(f"forged: record says uid {rec.uid}, file owned by uid {dir_uid}")
        if name != rec.lease_id + (TICKET_SUFFIX if kind == "ticket" else LEASE_SUFFIX):
            raise Invalid("forged: file name does not match its lease id")
        if real_user != str(dir_uid) and rec.user != real_user:
            raise Invalid(
                f"forged: record says user {rec.user[:40]!r}, uid {dir_uid} is {real_user}"
            )
        if len(data) <= _RECORD_CACHE_ENTRY_MAX:  # bounded memory: big records are re-parsed
            if len(_RECORD_CACHE) >= _RECORD_CACHE_MAX:
                _RECORD_CACHE.clear()
            _RECORD_CACHE[key] = rec
    if rec.live != live or rec.path != path:
        rec = replace(rec, live=live, path=path)
    return rec


def parse_record(data: bytes, *, kind: str, path: str, live: bool) -> LeaseRecord:
    """Strictly parse one record. Raises :class:`Invalid` on anything unexpected."""
    return _record(_json_object(data), kind=kind, path=path, live=live)


def record_from_fields(
    d: Mapping[str, Any], *, kind: str, path: str, live: bool
) -> LeaseRecord:
    """The record a writer built as the dict ``d`` of JSON values (the broker, from a client's
    message), held to exactly the rules :func:`parse_record` holds its bytes to, without the
    round trip through text: the same schema, and valid Unicode in every string (a message's
    ``"\\ud800"`` decodes to a lone surrogate that no file or reply could carry). A non-finite
    number fails the schema's range checks. Raises :class:`Invalid`."""
    rec = _record(d, kind=kind, path=path, live=live)
    _unicode_only(d)
    return rec


def _unicode_only(d: Mapping[str, Any]) -> None:
    """Every string in ``d`` (a record the schema passed: strings, numbers, flat lists and one
    nested object) encodes as UTF-8."""
    todo: list[Any] = [d]
    while todo:
        v = todo.pop()
        for x in v.values() if isinstance(v, dict) else v:
            if isinstance(x, str):
                if not x.isascii():
                    try:
                        x.encode("utf-8")
                    except UnicodeEncodeError:
                        raise Invalid("a lone surrogate (not valid Unicode text)") from None
            elif isinstance(x, (list, dict)):
                todo.append(x)


def _record(d: Mapping[str, Any], *, kind: str, path: str, live: bool) -> LeaseRecord:
    """The schema's checks of a parsed record (see :func:`parse_record`)."""
    _check_keys(d, kind)
    lease_id = _str(d, "lease_id")
    if not _ID_RE.match(lease_id):
        raise Invalid("lease_id: expected 16-64 lowercase hex digits")
    uuids, booked = _devices(d, kind)
    if not isinstance(d["exclusive"], bool):
        raise Invalid("exclusive: expected true or false")
    created = d["created_s"]
    if (
        not isinstance(created, (int, float))
        or isinstance(created, bool)
        or not math.isfinite(created)
    ):
        raise Invalid("created_s: expected a number")
    holder_kind = _str(d, "holder_kind")
    if len(holder_kind) > 32:
        raise Invalid("holder_kind: too long")
    command = _str(d, "command", optional=True, control_ok=True)
    if command is not None:
        command = _CONTROL_RE.sub("?", command)
    seq = None
    constraints = None
    if kind == "ticket":
        seq = _int(d, "seq", hi=MAX_SEQ)
        constraints = _parse_constraints(d["constraints"])
    return LeaseRecord(
        lease_id=lease_id,
        kind=kind,
        device_uuids=tuple(uuids),
        device_requested_bytes=tuple(booked),
        exclusive=d["exclusive"],
        user=_str(d, "user"),
        uid=_int(d, "uid"),
        host=_str(d, "host"),
        pid=_int(d, "pid", lo=1),
        created_s=float(created),
        kernel_id=_str(d, "kernel_id", optional=True),
        notebook_path=_str(d, "notebook_path", optional=True),
        command=command,
        holder_kind=holder_kind,
        seq=seq,
        constraints=constraints,
        live=live,
        path=path,
    )


def _json_object(data: bytes) -> dict[str, Any]:
    """Strict JSON (no duplicate keys, no NaN), an object, valid Unicode throughout."""
    try:
        text = data.decode("utf-8")
        d = json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_bad_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise Invalid(f"not valid JSON ({type(err).__name__})") from None
    if not isinstance(d, dict):
        raise Invalid("not a JSON object")
    if "\\u" not in text:
        # Strict UTF-8 never decodes to a surrogate: only a \u escape can make one.
        return d
    try:
        # "\ud800" is valid JSON, but a lone surrogate cannot be printed or encoded anywhere.
        json.dumps(d, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):
        raise Invalid("a lone surrogate (not valid Unicode text)") from None
    return d


def _check_keys(d: Mapping[str, Any], kind: str) -> None:
    """Exactly the schema's keys (the optional ones may be missing), this version, this kind."""
    allowed = _TICKET_KEYS if kind == "ticket" else _LEASE_KEYS
    extra = set(d) - allowed
    if extra:
        raise Invalid(f"unexpected keys {sorted(extra)[:5]}")
    missing = (allowed - {"kernel_id", "notebook_path", "command"}) - set(d)
    if missing:
        raise Invalid(f"missing keys {sorted(missing)}")
    if d["version"] != SCHEMA_VERSION:
        raise Invalid(f"unknown version {str(d['version'])[:20]}")
    if d["kind"] != kind:
        raise Invalid(f"kind {str(d['kind'])[:20]!r} in a {kind} file")


def _devices(d: Mapping[str, Any], kind: str) -> tuple[list[str], list[int | None]]:
    """Distinct device UUIDs (at least one for a lease), and one booking (bytes or null) each."""
    uuids = d["device_uuids"]
    if (
        not isinstance(uuids, list)
        or len(uuids) > MAX_DEVICES
        or (kind == "lease" and not uuids)
        or not all(isinstance(u, str) and _UUID_RE.match(u) for u in uuids)
        or len(set(uuids)) != len(uuids)
    ):
        raise Invalid("device_uuids: expected a list of distinct device UUIDs")
    booked = d["device_requested_bytes"]
    if not isinstance(booked, list) or len(booked) != len(uuids):
        raise Invalid("device_requested_bytes: expected one entry per device")
    for b in booked:
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < 2**62):
            raise Invalid("device_requested_bytes: expected byte counts or null")
    return uuids, booked


def _parse_constraints(c: Any) -> dict[str, Any]:
    if not isinstance(c, dict) or not (
        _CONSTRAINT_KEYS <= set(c) <= _CONSTRAINT_KEYS | _OPTIONAL_CONSTRAINT_KEYS
    ):
        raise Invalid(
            f"constraints: expected the keys {sorted(_CONSTRAINT_KEYS)} and optionally "
            f"{sorted(_OPTIONAL_CONSTRAINT_KEYS)}"
        )
    _int(c, "min_free_bytes", optional=True)
    frac = c["min_free_fraction"]
    if frac is not None and (
        not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 <= frac <= 1
    ):
        raise Invalid("constraints.min_free_fraction: expected a number in [0, 1] or null")
    util = c["max_util_pct"]
    if util is not None and (
        not isinstance(util, (int, float)) or isinstance(util, bool) or not 0 <= util <= 100
    ):
        raise Invalid("constraints.max_util_pct: expected a number in [0, 100] or null")
    count = _int(c, "count", lo=1)
    if count > MAX_DEVICES:
        raise Invalid("constraints.count: too large")
    if not isinstance(c["exclusive"], bool):
        raise Invalid("constraints.exclusive: expected true or false")
    for key in ("exclude", "allowed_uuids"):
        v = c[key]
        if v is None and key == "allowed_uuids":
            continue
        if (
            not isinstance(v, list)
            or len(v) > MAX_DEVICES
            or not all(
                isinstance(x, str) and len(x) <= 128 and not _CONTROL_RE.search(x) for x in v
            )
        ):
            raise Invalid(f"constraints.{key}: expected a short list of device ids")
    for key in _OPTIONAL_CONSTRAINT_KEYS & set(c):
        v = c[key]
        if (
            not isinstance(v, list)
            or len(v) > MAX_MODEL_NAMES
            or not all(
                isinstance(x, str) and 0 < len(x) <= _MAX_MODEL_NAME and not _CONTROL_RE.search(x)
                for x in v
            )
        ):
            raise Invalid(f"constraints.{key}: expected a short list of model names")
    return dict(c)


def field_text(value: str | None, limit: int = _MAX_STR) -> str | None:
    """A string as our writer stores it: what every reader accepts (see :func:`_parse_record`).

    Control characters (a TAB in a notebook name) become ``?``, text that is not valid Unicode
    (a lone surrogate from an undecodable file name) is spelled out with backslashes, and the
    length is capped: a value the readers would reject must never reach a lease file, or the
    writer would believe it holds a lease that every reader ignores (silent double booking).
    """
    if value is None:
        return None
    text = str(value).encode("utf-8", "backslashreplace").decode("utf-8")
    return _CONTROL_RE.sub("?", text)[:limit]


def capped_text(value: str | None, field: str) -> str | None:
    """:func:`field_text`, cut to :data:`FIELD_CAPS` ``[field]`` *encoded* bytes (each
    character counted as ``json.dumps`` writes it: 1, 2 for ``"`` and ``\\``, 6 for other
    non-ASCII, 12 beyond the BMP)."""
    limit = FIELD_CAPS[field]
    text = field_text(value, limit)
    return None if text is None else cut_encoded(text, limit)


def cut_encoded(text: str, limit: int) -> str:
    """The longest start of ``text`` that ``json.dumps`` writes in at most ``limit`` bytes."""
    if len(text) <= limit and text.isascii() and '"' not in text and "\\" not in text:
        return text  # one byte per character
    size = 0
    for i, ch in enumerate(text[:limit]):
        size += _encoded_len(ch)
        if size > limit:
            return text[:i]
    return text[:limit]


def _encoded_len(ch: str) -> int:
    """Bytes of one character in ``json.dumps`` (``ensure_ascii``) output."""
    if ch in '"\\':
        return 2
    code = ord(ch)
    if code < 0x80:
        return 1
    return 6 if code < 0x10000 else 12


def encode(record: LeaseRecord) -> bytes:
    """The exact bytes a record is stored as."""
    return json.dumps(record._payload(), separators=(",", ":")).encode()
