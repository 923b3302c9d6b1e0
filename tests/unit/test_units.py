"""Sizes, percentages and durations (design decision 7)."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.units import (
    Size,
    format_bytes,
    format_duration,
    parse_duration,
    parse_percent,
    parse_size,
)
from autogpu_jupyter.errors import UsageErrorBase

GiB = 1024**3


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10G", 10 * GiB),
        ("10g", 10 * GiB),
        ("10Gi", 10 * GiB),
        ("10GiB", 10 * GiB),
        ("512M", 512 * 1024**2),
        ("512MiB", 512 * 1024**2),
        ("0.5T", 512 * GiB),
        ("16GB", 16 * 10**9),
        ("1KB", 1000),
        ("1K", 1024),
        ("100B", 100),
        (" 2 G ", 2 * GiB),
        (".5G", GiB // 2),
        (1234, 1234),
    ],
)
def test_parse_size_bytes(text: object, expected: int) -> None:
    size = parse_size(text)
    assert size.bytes == expected
    assert size.fraction is None


def test_parse_size_percent_resolves_per_device() -> None:
    size = parse_size("25%")
    assert size.fraction == 0.25
    assert size.bytes is None
    assert size.resolve(80 * GiB) == 20 * GiB
    assert size.resolve(None) is None
    assert size.describe() == "25% of the device"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("10Q", "unknown unit 'Q'"),
        ("-5G", "must not be negative"),
        ("", "not understood"),
        ("10", "a bare number is ambiguous"),
        ("ten", "not understood"),
        ("150%", "a share must be 0-100%"),
        ("1.2.3G", "not understood"),
    ],
)
def test_parse_size_rejects_with_value_and_forms(text: str, why: str) -> None:
    with pytest.raises(UsageErrorBase) as info:
        parse_size(text)
    message = str(info.value)
    assert message.startswith(f"invalid size {text!r}: {why}")
    assert "10G, 10GiB, 512M, 0.5T, 16GB (decimal)" in message
    assert "25%" in message
    assert "\n" not in message


def test_to_json_is_what_the_server_sends() -> None:
    assert parse_size(" 10G ").to_json() == {"bytes": 10 * GiB, "fraction": None, "text": "10G"}
    assert parse_size("25%").to_json() == {"bytes": None, "fraction": 0.25, "text": "25%"}


def test_describe_echoes_the_parsed_value() -> None:
    assert parse_size("10G").describe() == "10.0 GiB"
    assert parse_size("16GB").describe() == "14.9 GiB"


@pytest.mark.parametrize(
    ("text", "expected"), [("50", 50.0), ("50%", 50.0), (" 0 ", 0.0), (100, 100.0)]
)
def test_parse_percent(text: object, expected: float) -> None:
    assert parse_percent(text) == expected


@pytest.mark.parametrize("text", ["150", "-1", "abc", "", "nan"])
def test_parse_percent_rejects(text: str) -> None:
    with pytest.raises(
        UsageErrorBase, match=r"invalid percentage .*expected a number from 0 to 100"
    ):
        parse_percent(text)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10m", 600.0), ("30s", 30.0), ("1.5h", 5400.0), ("90", 90.0), ("1d", 86400.0)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["-1m", "10x", "soon", ""])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(UsageErrorBase, match=r"invalid duration .*e\.g\. 90, 30s, 10m, 1\.5h"):
        parse_duration(text)


def test_format() -> None:
    assert format_bytes(None) == "?"
    assert format_bytes(0) == "0 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(80 * GiB) == "80.0 GiB"
    assert format_bytes(3 * 1024 * GiB) == "3.0 TiB"
    assert format_duration(600) == "10m"
    assert format_duration(90) == "1m30s"
    assert format_duration(5) == "5s"
    assert format_duration(3660) == "1h1m"


@pytest.mark.parametrize("value", [-5, -1])
def test_parse_size_refuses_a_negative_byte_count(value: int) -> None:
    with pytest.raises(UsageErrorBase) as info:
        parse_size(value)
    assert str(info.value) == (
        f"invalid size {value}: must not be negative; expected a number with a unit, e.g. 10G, "
        "10GiB, 512M, 0.5T, 16GB (decimal), or a share of the device like 25%"
    )


@pytest.mark.parametrize(
    ("share", "total", "expected"),
    [("25%", 10**9 + 1, 250_000_001), ("50%", 81, 41), ("25%", 80 * GiB, 20 * GiB)],
)
def test_a_share_of_an_odd_byte_count_rounds_up(share: str, total: int, expected: int) -> None:
    # Rounding down would accept a device one byte short of the share asked for.
    assert parse_size(share).resolve(total) == expected


SIZE_TAIL = (
    "expected a number with a unit, e.g. 10G, 10GiB, 512M, 0.5T, 16GB (decimal), "
    "or a share of the device like 25%"
)
PERCENT_TAIL = "expected a number from 0 to 100, optionally followed by %, e.g. 50 or 50%"
DURATION_TAIL = "expected seconds or a number with s, m, h or d, e.g. 90, 30s, 10m, 1.5h"


@pytest.mark.parametrize(
    ("text", "size"),
    [
        (0, Size(bytes=0, text="0B")),
        (2**60, Size(bytes=2**60, text="1152921504606846976B")),
        ("1048576T", Size(bytes=2**60, text="1048576T")),
        (" 2 G ", Size(bytes=2 * GiB, text="2 G")),
        ("0%", Size(fraction=0.0, text="0%")),
        (" 100% ", Size(fraction=1.0, text="100%")),
    ],
)
def test_parse_size_edges_are_accepted_and_echo_what_was_typed(text: object, size: Size) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (True, "invalid size True: "),
        (None, "invalid size None: "),
        (2**60 + 1, "invalid size 1152921504606846977: too large (at most 1 EiB); "),
        (10**40, "invalid size 100000000000…: too large (at most 1 EiB); "),
        ("1048577T", "invalid size '1048577T': too large (at most 1 EiB); "),
        ("100.5%", "invalid size '100.5%': a share must be 0-100%; "),
        ("x" * 58, f"invalid size '{'x' * 58}': not understood; "),
        ("x" * 59, f"invalid size '{'x' * 39}…{'x' * 9}': not understood; "),
    ],
)
def test_parse_size_refusals_name_the_value(text: object, why: str) -> None:
    with pytest.raises(UsageErrorBase) as info:
        parse_size(text)
    assert str(info.value) == why + SIZE_TAIL


@pytest.mark.parametrize(("text", "expected"), [(0.5, 0.5), ("100%", 100.0), (" 0% ", 0.0)])
def test_parse_percent_edges(text: object, expected: float) -> None:
    assert parse_percent(text) == expected


@pytest.mark.parametrize(
    ("text", "what", "message"),
    [
        (True, "percentage", f"invalid percentage True: {PERCENT_TAIL}"),
        ([50], "percentage", f"invalid percentage [50]: {PERCENT_TAIL}"),
        ("abc", "--max-util", f"invalid --max-util 'abc': {PERCENT_TAIL}"),
        (100.5, "percentage", f"invalid percentage 100.5: must be 0-100; {PERCENT_TAIL}"),
        (10**400, "percentage", f"invalid percentage 100000000000…: must be 0-100; {PERCENT_TAIL}"),
    ],
)
def test_parse_percent_refusals_name_the_value(text: object, what: str, message: str) -> None:
    with pytest.raises(UsageErrorBase) as info:
        parse_percent(text, what)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "seconds"), [(0, 0.0), (0.5, 0.5), (90, 90.0), (1.5, 1.5), (31_536_000, 31_536_000.0)]
)
def test_parse_duration_numbers(text: float, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (True, f"invalid duration True: {DURATION_TAIL}"),
        (None, f"invalid duration None: {DURATION_TAIL}"),
        (-1, f"invalid duration -1: {DURATION_TAIL}"),
        (float("nan"), f"invalid duration nan: {DURATION_TAIL}"),
        ("soon", f"invalid duration 'soon': {DURATION_TAIL}"),
        (31_536_001, f"invalid duration 31536001: too long (at most 365d); {DURATION_TAIL}"),
        (10**400, f"invalid duration 100000000000…: too long (at most 365d); {DURATION_TAIL}"),
        ("366d", f"invalid duration '366d': too long (at most 365d); {DURATION_TAIL}"),
    ],
)
def test_parse_duration_refusals_name_the_value(text: object, message: str) -> None:
    with pytest.raises(UsageErrorBase) as info:
        parse_duration(text)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(5.25, "5.2s"), (59.5, "59.5s"), (60, "1m"), (60.5, "1m"), (3599, "59m59s"), (3600, "1h"),
     (7200, "2h")],
)
def test_format_duration_edges(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_format_bytes_mib() -> None:
    assert format_bytes(5 * 1024**2) == "5.0 MiB"
