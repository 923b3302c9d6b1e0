"""The pick-options boundary, exactly: every message a bad option gets (flag and JSON styles),
how defaults merge, how switches and names read, and the argparse surface."""

from __future__ import annotations

import argparse

import pytest

from autogpu_jupyter.core import options
from autogpu_jupyter.core.options import OptionError, PickOptions, parse
from autogpu_jupyter.core.policy import Constraints
from autogpu_jupyter.core.units import DURATION_FORMS, PERCENT_FORMS, SIZE_FORMS
from autogpu_jupyter.errors import UsageErrorBase

GiB = 1024**3
NAMES = "model names, comma separated, e.g. A100 or L4,A100 (matched within the name)"
IDS = "NVML indices or UUIDs separated by commas, e.g. 0,2 or GPU-5a1b"
ALL_FLAGS = (
    "--count, --devices, --exclude, --exclusive, --max-util, --min-free, --model, --prefer, --wait"
)
ALL_KEYS = "count, devices, exclude, exclusive, max_util, min_free, model, prefer, wait"


def _error(values: dict[str, object], **kw: object) -> OptionError:
    with pytest.raises(OptionError) as err:
        parse(values, **kw)  # type: ignore[arg-type]
    return err.value


def test_every_option_has_its_flag_and_only_exclusive_is_a_switch() -> None:
    assert [(s.key, s.flag, s.is_switch) for s in options.PICK_OPTIONS] == [
        ("min_free", "--min-free", False),
        ("max_util", "--max-util", False),
        ("count", "--count", False),
        ("exclude", "--exclude", False),
        ("exclusive", "--exclusive", True),
        ("wait", "--wait", False),
        ("model", "--model", False),
        ("prefer", "--prefer", False),
        ("devices", "--devices", False),
    ]
    assert options.VALUE_OPTIONS == (
        "--min-free", "--max-util", "--count", "--exclude", "--wait", "--model", "--prefer",
        "--devices",
    )


@pytest.mark.parametrize(
    ("values", "style", "message", "option", "value"),
    [
        ({"max_util": ""}, "flag", f"invalid --max-util '': empty; expected {PERCENT_FORMS}",
         "--max-util", ""),
        ({"min_free": "  "}, "key", f"invalid min_free '  ': empty; expected {SIZE_FORMS}",
         "min_free", "  "),
        ({"wait": ""}, "flag", f"invalid --wait '': empty; expected {DURATION_FORMS}",
         "--wait", ""),
        ({"count": " "}, "flag", "invalid --count ' ': empty; expected a whole number >= 1, e.g. 2",
         "--count", " "),
        ({"model": ""}, "key", f"invalid model '': empty; expected {NAMES}", "model", ""),
        ({"prefer": "\t"}, "flag", f"invalid --prefer '\\t': empty; expected {NAMES}",
         "--prefer", "\t"),
        # exclude is read by the constraints, which name the empty id
        ({"exclude": ""}, "flag", f"invalid --exclude '': empty device id; expected {IDS}",
         "exclude", ""),
    ],
)
def test_an_option_given_as_empty_text_is_refused_not_read_as_no_limit(
    values: dict[str, object], style: str, message: str, option: str, value: object
) -> None:
    err = _error(values, style=style)
    assert (str(err), err.option, err.value) == (message, option, value)


def test_an_empty_exclusive_switch_means_false() -> None:
    assert parse({"exclusive": ""}).constraints.exclusive is False
    assert parse({"exclusive": ""}, style="key").constraints.exclusive is False


@pytest.mark.parametrize(
    ("raw", "want"),
    [(True, True), (False, False), (" TRUE ", True), ("Yes", True), ("on", True), ("1", True),
     ("OFF", False), (" no", False), ("0", False), ("false", False), ("  ", False)],
)
def test_switch_words(raw: object, want: bool) -> None:
    assert parse({"exclusive": raw}).constraints.exclusive is want


@pytest.mark.parametrize(
    ("raw", "style", "message"),
    [
        ("maybe", "flag", "invalid --exclusive 'maybe': expected true or false"),
        (1, "key", "invalid exclusive 1: expected true or false"),
        (None, "key", None),
    ],
)
def test_a_switch_that_is_no_yes_or_no_is_refused(
    raw: object, style: str, message: str | None
) -> None:
    if message is None:  # None: not given, the default (not exclusive)
        assert parse({"exclusive": raw}, style=style).constraints.exclusive is False
        return
    err = _error({"exclusive": raw}, style=style)
    assert (str(err), err.option, err.value) == (message, "exclusive", raw)


@pytest.mark.parametrize(
    ("raw", "models"),
    [
        ("A100", ("A100",)),
        (" A100 , H100 ", ("A100", "H100")),
        (["L4", " A100"], ("L4", "A100")),
        (("H100",), ("H100",)),
        ((), ()),
        ("x" * 64, ("x" * 64,)),
    ],
)
def test_model_names_read_from_text_or_lists(raw: object, models: tuple[str, ...]) -> None:
    assert parse({"model": raw}).constraints.models == models
    assert parse({"prefer": raw}, style="key").constraints.prefer == models


@pytest.mark.parametrize(
    ("raw", "style", "shown"),
    [
        ("A100,,H100", "flag", "--model 'A100,,H100'"),
        ([], "key", "model []"),
        (["A100", ""], "flag", "--model ['A100', '']"),
        (["A100", 3], "key", "model ['A100', 3]"),
        (7, "flag", "--model 7"),
        ({"A100"}, "key", "model {'A100'}"),
        ("x" * 65, "flag", "--model '" + "x" * 47 + "…" + "x" * 9 + "'"),
    ],
)
def test_bad_model_names_name_the_option_and_the_forms(raw: object, style: str, shown: str) -> None:
    err = _error({"model": raw}, style=style)
    assert (str(err), err.option, err.value) == (f"invalid {shown}: expected {NAMES}", "model", raw)


def test_long_values_are_shortened_in_messages_from_61_characters() -> None:
    sixty = "y" * 58  # its repr is 60 characters: shown whole
    assert str(_error({"exclusive": sixty})) == (
        f"invalid --exclusive '{sixty}': expected true or false"
    )
    sixty_one = "z" * 59
    assert str(_error({"exclusive": sixty_one})) == (
        "invalid --exclusive '" + "z" * 47 + "…" + "z" * 9 + "': expected true or false"
    )


@pytest.mark.parametrize(
    ("raw", "count"),
    [(1, 1), (2, 2), ("3", 3), (" 4 ", 4), ("+5", 5)],
)
def test_count_reads_whole_numbers(raw: object, count: int) -> None:
    assert parse({"count": raw}).constraints.count == count


@pytest.mark.parametrize(
    ("raw", "style", "shown"),
    [
        (0, "flag", "--count 0"),
        (-1, "key", "count -1"),
        ("1.0", "flag", "--count '1.0'"),
        ("two", "key", "count 'two'"),
        (True, "flag", "--count True"),
        (2.0, "flag", "--count 2.0"),
        (float("inf"), "flag", "--count inf"),
        (1e20, "flag", "--count 1e+20"),
        (False, "flag", "--count False"),
        ([2], "flag", "--count [2]"),
    ],
)
def test_a_count_that_is_no_whole_number_from_one_is_refused(
    raw: object, style: str, shown: str
) -> None:
    err = _error({"count": raw}, style=style)
    assert str(err) == f"invalid {shown}: expected a whole number >= 1, e.g. 2"
    assert (err.option, err.value) == ("count", raw)


@pytest.mark.parametrize(
    ("values", "message", "option"),
    [
        ({"min_free": 10}, 'invalid min_free=10: expected a string such as "10G"', "min_free"),
        ({"min_free": True}, 'invalid min_free=True: expected a string such as "10G"',
         "min_free"),
        ({"max_util": False}, 'invalid max_util=False: expected a string such as "50"',
         "max_util"),
        ({"max_util": [50]}, 'invalid max_util=[50]: expected a string such as "50"', "max_util"),
        ({"wait": {"s": 1}}, "invalid wait={'s': 1}: expected a string such as \"10m\"", "wait"),
        ({"wait": True}, 'invalid wait=True: expected a string such as "10m"', "wait"),
        ({"count": True}, "invalid count True: expected a whole number >= 1", "count"),
        ({"count": 2.0}, "invalid count 2.0: expected a whole number >= 1", "count"),
        ({"count": [2]}, "invalid count [2]: expected a whole number >= 1", "count"),
        ({"exclude": 3}, 'invalid exclude 3: expected ids like "0,2" or a list', "exclude"),
        ({"exclude": ("0",)}, "invalid exclude ('0',): expected ids like \"0,2\" or a list",
         "exclude"),
        ({"exclude": [0, 1.5]}, 'invalid exclude [0, 1.5]: expected ids like "0,2" or a list',
         "exclude"),
    ],
)
def test_json_values_of_the_wrong_type_are_refused_with_an_example(
    values: dict[str, object], message: str, option: str
) -> None:
    err = _error(values, style="key")
    assert (str(err), err.option) == (message, option)
    assert err.value == next(iter(values.values()))


@pytest.mark.parametrize(
    ("values", "flag_words", "key_words"),
    [
        ({"max_util": "x"}, "invalid --max-util 'x': expected a number from 0 to 100",
         "invalid max_util 'x': expected a number from 0 to 100"),
        ({"exclude": "x,"}, "invalid --exclude 'x,': empty device id",
         "invalid exclude 'x,': empty device id"),
        ({"min_free": "x"}, "invalid size 'x': not understood", "invalid size 'x': not understood"),
    ],
)
def test_a_bad_value_is_named_as_the_surface_spells_it(
    values: dict[str, object], flag_words: str, key_words: str
) -> None:
    """The command line names ``--max-util``; JSON (the server's select, a kernelspec) names
    ``max_util``. Caught: the JSON surfaces' messages named the command-line flag."""
    for style, words in (("flag", flag_words), ("key", key_words)):
        err = _error(values, style=style)
        assert str(err).startswith(words), (style, str(err))
        assert (err.option, err.value) == (next(iter(values)), next(iter(values.values())))


def test_json_numbers_are_fine_where_they_are_not_ambiguous() -> None:
    got = parse({"max_util": 50, "wait": 90, "count": 2, "exclude": [0, "GPU-1"]}, style="key")
    c = got.constraints
    assert (c.max_util_pct, got.wait_s, c.count, c.exclude) == (50.0, 90.0, 2, ("0", "GPU-1"))
    got = parse({"max_util": 12.5, "count": "3", "exclude": "1"}, style="key")
    assert (got.constraints.max_util_pct, got.constraints.count) == (12.5, 3)
    # the Python API takes a number of bytes
    assert parse({"min_free": 10}).constraints.min_free.bytes == 10  # type: ignore[union-attr]


def test_json_type_checks_apply_to_defaults_too() -> None:
    err = _error({}, style="key", defaults={"count": True})
    assert (str(err), err.option) == ("invalid count True: expected a whole number >= 1", "count")


@pytest.mark.parametrize(
    ("values", "message", "option"),
    [
        ({"min_free": "-5G"}, f"invalid size '-5G': must not be negative; expected {SIZE_FORMS}",
         "min_free"),
        ({"wait": "soon"}, f"invalid duration 'soon': expected {DURATION_FORMS}", "wait"),
        ({"max_util": "150"}, f"invalid --max-util '150': must be 0-100; expected {PERCENT_FORMS}",
         "max_util"),
    ],
)
def test_a_bad_value_is_attributed_to_its_option(
    values: dict[str, object], message: str, option: str
) -> None:
    err = _error(values)
    assert (str(err), err.option, err.value) == (message, option, next(iter(values.values())))
    assert isinstance(err, UsageErrorBase)


@pytest.mark.parametrize(
    ("wait", "seconds"),
    [(None, 0.0), ("", 0.0), (0, 0.0), ("0", 0.0), ("90s", 90.0), (5, 5.0), (1, 1.0)],
)
def test_wait_reads_a_duration_and_nothing_means_no_wait(wait: object, seconds: float) -> None:
    assert parse({}, defaults={"wait": wait}).wait_s == seconds


def test_every_option_left_empty_in_the_settings_means_not_set() -> None:
    # A site's settings file may leave any option as "" (the traitlets default): no limit.
    defaults = {"min_free": "", "max_util": "", "count": "", "exclude": "", "exclusive": "",
                "model": "", "prefer": "", "wait": ""}
    assert parse({}, defaults=defaults) == PickOptions(Constraints.parse(), 0.0)
    assert parse({}, defaults=defaults, style="key") == PickOptions(Constraints.parse(), 0.0)


@pytest.mark.parametrize(
    ("style", "shown"), [("flag", "--prefer ['L4', 2]"), ("key", "prefer ['L4', 2]")]
)
def test_bad_preferred_models_name_the_option_in_the_callers_style(style: str, shown: str) -> None:
    err = _error({"prefer": ["L4", 2]}, style=style)
    assert (str(err), err.option) == (f"invalid {shown}: expected {NAMES}", "prefer")


def test_unknown_parameters_list_what_is_accepted_in_the_callers_style() -> None:
    err = _error({"zeta": 1, "alpha": 2})
    assert str(err) == f"unknown parameter 'alpha'; accepted: {ALL_FLAGS}"
    assert (err.option, err.value) == ("alpha", 2)
    err = _error({"gpus": "x" * 70}, style="key")
    assert str(err) == f"unknown parameter 'gpus'; accepted: {ALL_KEYS}"
    err = _error({"q": 1}, style="key", accept=["wait", "bogus"], ignore=["kernel_id"])
    assert str(err) == "unknown parameter 'q'; accepted: kernel_id, wait"
    err = _error({"bogus": 1}, accept=["wait", "bogus"])
    assert str(err) == "unknown parameter 'bogus'; accepted: --wait"
    long_key = "k" * 70
    err = _error({long_key: 1}, accept=[])
    assert str(err) == "unknown parameter '" + "k" * 47 + "…" + "k" * 9 + "'; accepted: "


def test_values_not_given_take_the_defaults_and_empty_defaults_are_no_limit() -> None:
    got = parse(
        {"count": None, "kernel_id": "k1", "wait": None},
        defaults={"min_free": "", "max_util": None, "count": 3, "exclusive": "yes", "wait": "1m",
                  "model": "A100", "prefer": None},
        ignore=["kernel_id"],
    )
    assert got == PickOptions(
        Constraints.parse(count=3, exclusive=True, models=("A100",)), wait_s=60.0
    )
    assert got.constraints.min_free is None and got.constraints.max_util_pct is None
    assert parse({}) == PickOptions(Constraints.parse(), 0.0)
    assert parse({}, defaults=None).constraints.count == 1


def test_describe_mentions_the_wait_only_when_there_is_one() -> None:
    assert parse({"count": 2}).describe() == "2 devices"
    assert parse({"count": 2, "wait": "90"}).describe() == "2 devices, waiting up to 1m30s"
    assert PickOptions(Constraints.parse()).wait_s == 0.0


def test_an_option_error_carries_its_option_and_value() -> None:
    err = OptionError("bad", "wait", [1])
    assert (str(err), err.option, err.value) == ("bad", "wait", [1])
    assert isinstance(err, UsageErrorBase)


def test_defaults_from_settings_without_model_settings() -> None:
    class Old:
        min_free, max_util, count, exclusive, wait = "", "50", 2, False, "10m"

    class New(Old):
        model, prefer = "A100", ""

    assert options.defaults_from(Old()) == {
        "min_free": "", "max_util": "50", "count": 2, "exclusive": False, "wait": "10m",
        "model": None, "prefer": None,
    }
    assert options.defaults_from(New())["model"] == "A100"
    assert options.defaults_from(New())["prefer"] is None


def _actions(parser: argparse.ArgumentParser) -> dict[str, tuple[object, ...]]:
    return {
        a.option_strings[0]: (a.dest, a.metavar, a.default, a.nargs, a.help)
        for a in parser._actions
        if a.option_strings and a.option_strings[0] != "-h"
    }


def test_add_arguments_declares_each_option_with_its_metavar_and_help() -> None:
    parser = argparse.ArgumentParser(prog="x")
    options.add_arguments(parser)
    got = _actions(parser)
    assert list(got) == [s.flag for s in options.PICK_OPTIONS]
    assert got["--min-free"] == (
        "min_free", "SIZE", None, None,
        "Free memory wanted per device: 10G / 10GiB (binary), 16GB (decimal) or 25%% of the "
        "device. Default: AutoGPU.min_free.",
    )
    assert got["--exclusive"] == (
        "exclusive", None, None, 0,
        "Take devices no other lease holds, and keep others off them.",
    )
    assert got["--count"][:3] == ("count", "N", None)
    ns = parser.parse_args([])
    assert options.from_namespace(ns) == dict.fromkeys(s.key for s in options.PICK_OPTIONS)
    ns = parser.parse_args(["--exclusive", "--wait", "1m", "--count", "2"])
    assert options.from_namespace(ns)["exclusive"] is True
    assert parse(options.from_namespace(ns)) == PickOptions(
        Constraints.parse(count=2, exclusive=True), 60.0
    )


def test_add_arguments_for_a_parser_that_does_not_format_percent() -> None:
    parser = argparse.ArgumentParser(prog="x")
    options.add_arguments(parser, escape_percent=False, skip=("count", "wait"))
    got = _actions(parser)
    assert "--count" not in got and "--wait" not in got
    assert "25% of the device" in str(got["--min-free"][4])
    assert "25%%" not in str(got["--min-free"][4])


def test_from_namespace_reads_missing_options_as_not_given() -> None:
    ns = argparse.Namespace(min_free="1G", exclusive=True)
    assert options.from_namespace(ns) == {
        "min_free": "1G", "max_util": None, "count": None, "exclude": None,
        "exclusive": True, "wait": None, "model": None, "prefer": None, "devices": None,
    }


@pytest.mark.parametrize(
    ("argv", "joined"),
    [
        (["--count", "-1", "--max-util", "-0.5"], ["--count=-1", "--max-util=-0.5"]),
        (["--exclude", "-5", "x"], ["--exclude=-5", "x"]),
        (["-5", "--wait", "5m"], ["-5", "--wait", "5m"]),
        (["--model", "-a100"], ["--model", "-a100"]),
        (["--", "--count", "-1"], ["--", "--count", "-1"]),
        (["--count", "--", "-1"], ["--count", "--", "-1"]),
        ([], []),
    ],
)
def test_negative_values_are_joined_to_their_option(argv: list[str], joined: list[str]) -> None:
    assert options.join_negative_values(argv) == joined


def test_join_negative_values_for_other_options() -> None:
    assert options.join_negative_values(["--gpus", "-1", "--count", "-1"], ["--gpus"]) == [
        "--gpus=-1", "--count", "-1"
    ]


# ---- naming devices (issue 41) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "style", "devices", "count"),
    [
        ({"devices": "2"}, "flag", ("2",), 1),
        ({"devices": "0,3"}, "flag", ("0", "3"), 2),  # naming two asks for both
        ({"devices": "0,3", "count": "1"}, "flag", ("0", "3"), 1),  # or the best one of them
        ({"devices": [0, "3:1"]}, "key", ("0", "3:1"), 2),
        ({"devices": 2}, "key", ("2",), 1),  # JSON's number
    ],
)
def test_named_devices_and_how_many_of_them(
    values: dict[str, object], style: str, devices: tuple[str, ...], count: int
) -> None:
    got = parse(values, defaults={"count": 1}, style=style).constraints
    assert (got.devices, got.count) == (devices, count)


def test_more_devices_than_named_is_refused_in_the_callers_style() -> None:
    err = _error({"devices": "0,3", "count": 3})
    assert str(err) == (
        "invalid --count 3: more than the 2 device(s) named (0,3); expected at most 2")
    assert err.option == "count"
    err = _error({"devices": [0, 3], "count": 3}, style="key")
    assert str(err).startswith("invalid count 3: more than")


@pytest.mark.parametrize(
    ("values", "style", "message"),
    [
        ({"devices": ""}, "flag", "invalid --devices '': empty device id; expected device "
                                  "indices, UUIDs (or their first 6 or more characters) or MIG "
                                  "ids such as 3:1, separated by commas, e.g. 2 or 0,3 or "
                                  "GPU-5a1b"),
        ({"devices": "1,"}, "key", "invalid devices '1,': empty device id; expected device"),
        ({"devices": {"a": 1}}, "key", "invalid devices {'a': 1}: expected ids like \"0,2\" or "
                                       "a list"),
    ],
)
def test_bad_named_devices_are_one_message_naming_the_value_and_the_forms(
    values: dict[str, object], style: str, message: str
) -> None:
    err = _error(values, style=style)
    assert str(err).startswith(message)
    assert err.option == "devices"


def test_devices_named_without_a_flag_read_as_devices_and_only_once() -> None:
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, positional=True)
    ns = parser.parse_args(["0,3", "--min-free", "1G"])
    assert options.from_namespace(ns)["devices"] == "0,3"
    assert options.from_namespace(parser.parse_args(["--devices", "2"]))["devices"] == "2"
    with pytest.raises(OptionError) as err:
        options.from_namespace(parser.parse_args(["2", "--devices", "3"]))
    assert str(err.value) == (
        "devices named twice ('2' and --devices '3'): name them once, e.g. pick 0,3 or pick "
        "--devices 0,3")
