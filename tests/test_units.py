"""Sizes, percentages and durations (design decision 7)."""

from __future__ import annotations

import pytest

from autogpu_jupyter.core.units import (
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


def test_describe_echoes_the_parsed_value() -> None:
    assert parse_size("10G").describe() == "10.0 GiB"
    assert parse_size("16GB").describe() == "14.9 GiB"


@pytest.mark.parametrize(("text", "expected"), [("50", 50.0), ("50%", 50.0), (" 0 ", 0.0), (100, 100.0)])
def test_parse_percent(text: object, expected: float) -> None:
    assert parse_percent(text) == expected


@pytest.mark.parametrize("text", ["150", "-1", "abc", "", "nan"])
def test_parse_percent_rejects(text: str) -> None:
    with pytest.raises(UsageErrorBase, match=r"invalid percentage .*expected a number from 0 to 100"):
        parse_percent(text)


@pytest.mark.parametrize(
    ("text", "seconds"), [("10m", 600.0), ("30s", 30.0), ("1.5h", 5400.0), ("90", 90.0), ("1d", 86400.0)]
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
