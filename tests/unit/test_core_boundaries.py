"""Fast unit tests of the small core modules every surface leans on: the options boundary,
the holder model, the kernel contract and the terminal text guard (exact values, no processes)."""

from __future__ import annotations

import argparse
import json

import pytest

from autogpu_jupyter.core import options
from autogpu_jupyter.core.contract import KernelContract, ProvisionerState
from autogpu_jupyter.core.devices import DeviceSnapshot, FleetSnapshot, ProcessSnapshot
from autogpu_jupyter.core.holders import Holder, holders_by_device, holders_text
from autogpu_jupyter.core.leasing.records import LeaseRecord
from autogpu_jupyter.core.text import redact_command, terminal_safe
from autogpu_jupyter.errors import UsageErrorBase

GiB = 1024**3


# ---- core.text ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("plain name.ipynb", "plain name.ipynb"),
        ("tab\there", "tab\\x09here"),
        ("esc\x1b[2J", "esc\\x1b[2J"),
        ("csi\x9b2J", "csi\\x9b2J"),
        ("del\x7f", "del\\x7f"),
        ("rlo\u202egpj.ipynb", "rlo\\u202egpj.ipynb"),
        ("isolate\u2066x\u2069", "isolate\\u2066x\\u2069"),
        ("marks\u200e\u200f\u061c", "marks\\u200e\\u200f\\u061c"),
        ("lone\ud800", "lone\\ud800"),
        ("two\nlines", "two\nlines"),
        ("é ü 中文", "é ü 中文"),
    ],
)
def test_terminal_safe_spells_out_what_steers_a_terminal(raw: str, shown: str) -> None:
    assert terminal_safe(raw) == shown


def test_redact_command_shows_only_the_owners_unless_exposed() -> None:
    assert redact_command("alice", "python x.py", "alice") == "python x.py"
    assert redact_command("alice", "python x.py", "bob") is None
    assert redact_command(None, "python x.py", "bob") is None
    assert redact_command("alice", "python x.py", "bob", expose=True) == "python x.py"
    assert redact_command("alice", None, "alice") is None


# ---- core.options -------------------------------------------------------------------------


def test_parse_takes_defaults_for_what_is_not_given() -> None:
    opts = options.parse(
        {"min_free": None, "count": None},
        defaults={"min_free": "10G", "max_util": "50", "count": 2, "wait": "1m", "prefer": "L4"},
    )
    c = opts.constraints
    assert (c.min_free.bytes if c.min_free else None, c.max_util_pct, c.count) == (10 * GiB, 50, 2)
    assert (c.prefer, c.models, c.exclusive, opts.wait_s) == (("L4",), (), False, 60.0)
    assert opts.describe() == (
        "min free 10.0 GiB, max util 50%, 2 devices, preferring L4, waiting up to 1m"
    )


def test_given_values_win_over_defaults_and_empty_defaults_mean_none() -> None:
    opts = options.parse(
        {"min_free": "1G", "exclusive": True, "model": "A100,H100"},
        defaults={"min_free": "10G", "max_util": "", "exclusive": False, "model": ""},
    )
    c = opts.constraints
    assert (c.min_free.bytes if c.min_free else None, c.max_util_pct) == (GiB, None)
    assert (c.exclusive, c.models) == (True, ("A100", "H100"))


@pytest.mark.parametrize(
    ("values", "style", "message", "option"),
    [
        ({"max_util": ""}, "flag", "invalid --max-util '': empty; expected a number", "--max-util"),
        ({"wait": " "}, "key", "invalid wait ' ': empty; expected seconds", "wait"),
        ({"count": 0}, "flag", "invalid --count 0: expected a whole number >= 1, e.g. 2", "count"),
        ({"count": "two"}, "key", "invalid count 'two': expected a whole number >= 1", "count"),
        ({"count": 2.5}, "key", "invalid count 2.5: expected a whole number >= 1", "count"),
        ({"count": True}, "key", "invalid count True: expected a whole number >= 1", "count"),
        ({"model": "A100,"}, "flag", "invalid --model 'A100,': expected model names", "model"),
        ({"prefer": ["L4", 3]}, "key", "invalid prefer ['L4', 3]: expected model names", "prefer"),
        ({"exclusive": "maybe"}, "key", "invalid exclusive 'maybe': expected true or false",
         "exclusive"),
        ({"min_free": 10}, "key", 'invalid min_free=10: expected a string such as "10G"',
         "min_free"),
        ({"max_util": [50]}, "key", 'invalid max_util=[50]: expected a string such as "50"',
         "max_util"),
        ({"exclude": {"a": 1}}, "key", "invalid exclude {'a': 1}: expected ids like", "exclude"),
        ({"min_free": "10"}, "key", "invalid size '10': a bare number is ambiguous", "min_free"),
        ({"wait": "soon"}, "flag", "invalid duration 'soon': expected seconds", "wait"),
        ({"gpus": "2"}, "key", "unknown parameter 'gpus'; accepted: count, devices, exclude,",
         "gpus"),
    ],
)
def test_every_bad_value_is_one_message_naming_it(
    values: dict[str, object], style: str, message: str, option: str
) -> None:
    with pytest.raises(options.OptionError) as err:
        options.parse(values, style=style)
    assert str(err.value).startswith(message)
    assert err.value.option == option
    assert isinstance(err.value, UsageErrorBase)


def test_switches_read_json_and_query_strings() -> None:
    for raw, want in (("true", True), ("1", True), ("on", True), ("no", False), ("", False),
                      (False, False)):
        assert options.parse({"exclusive": raw}, style="key").constraints.exclusive is want


def test_accept_and_ignore_limit_what_a_surface_takes() -> None:
    with pytest.raises(options.OptionError) as err:
        options.parse({"wait": "1m"}, style="key", accept=["min_free"], ignore=["kernel_id"])
    assert str(err.value) == "unknown parameter 'wait'; accepted: kernel_id, min_free"
    got = options.parse({"kernel_id": "k", "min_free": "1G"}, style="key",
                        accept=["min_free"], ignore=["kernel_id"])
    assert got.constraints.min_free is not None


def test_add_arguments_declares_every_option_once() -> None:
    parser = argparse.ArgumentParser(prog="x")
    options.add_arguments(parser, skip=("exclude",))
    ns = parser.parse_args(["--min-free", "5G", "--exclusive", "--prefer", "L4"])
    values = options.from_namespace(ns)
    assert values == {"min_free": "5G", "max_util": None, "count": None, "exclude": None,
                      "exclusive": True, "wait": None, "model": None, "prefer": "L4",
                      "devices": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["--exclude", "0"])  # skipped for this parser
    assert "25%%" not in parser.format_help() and "25%" in parser.format_help()


@pytest.mark.parametrize(
    ("argv", "joined"),
    [
        (["--min-free", "-5G"], ["--min-free=-5G"]),
        (["--wait", "-.5m", "--count", "2"], ["--wait=-.5m", "--count", "2"]),
        (["--min-free", "5G", "--", "cmd", "--min-free", "-1"],
         ["--min-free", "5G", "--", "cmd", "--min-free", "-1"]),
        (["--exclusive", "-x"], ["--exclusive", "-x"]),
        (["--min-free"], ["--min-free"]),
    ],
)
def test_join_negative_values(argv: list[str], joined: list[str]) -> None:
    assert options.join_negative_values(argv) == joined


def test_defaults_from_settings() -> None:
    class S:
        min_free, max_util, count, exclusive, wait, model, prefer = "1G", "", 1, True, "", "", "L4"

    assert options.defaults_from(S()) == {"min_free": "1G", "max_util": "", "count": 1,
                                          "exclusive": True, "wait": "", "model": None,
                                          "prefer": "L4"}


# ---- core.holders -------------------------------------------------------------------------


def _rec(lease_id: str, uuid: str, pid: int, **kw: object) -> LeaseRecord:
    base: dict[str, object] = dict(
        lease_id=lease_id, kind="lease", device_uuids=(uuid,), device_requested_bytes=(4 * GiB,),
        exclusive=False, user="alice", uid=1000, host="h", pid=pid, created_s=1.0,
        notebook_path="train.ipynb",
    )
    base.update(kw)
    return LeaseRecord(**base)  # type: ignore[arg-type]


def test_holders_match_a_lease_and_its_process_and_word_them_once() -> None:
    gpu0 = DeviceSnapshot(index=0, uuid="GPU-0", name="A100", processes=(
        ProcessSnapshot(pid=10, used_memory_bytes=2 * GiB, user="alice"),
        ProcessSnapshot(pid=20, used_memory_bytes=GiB, user="bob"),
        ProcessSnapshot(pid=30, used_memory_bytes=None, user=None),
    ))
    gpu1 = DeviceSnapshot(index=1, uuid="GPU-1", name="A100", processes=())
    snap = FleetSnapshot(devices=(gpu0, gpu1), timestamp_s=1.0, backend="test")
    leases = [
        _rec("a" * 32, "GPU-0", 10),
        _rec("b" * 32, "GPU-1", 99, exclusive=True, notebook_path=None, kernel_id="1a2b3c4d5e6f",
             user="carol"),
    ]
    by = holders_by_device(snap, leases, own_pids=[30], kernel_of_pid={20: "kid-bob"},
                           notebook_of_kernel={"kid-bob": "bob.ipynb"})
    texts = [h.text() for h in by["GPU-0"]]
    assert texts == [
        "alice: train.ipynb (4.0 GiB booked, 2.0 GiB used)",
        "bob: bob.ipynb (1.0 GiB used)",
        "this kernel",
    ]
    assert [h.kind for h in by["GPU-0"]] == ["lease+process", "process", "process"]
    (carol,) = by["GPU-1"]
    assert (carol.kind, carol.text()) == (
        "lease", "carol: kernel 1a2b3c4d (4.0 GiB booked, exclusive)"
    )
    assert holders_text(by["GPU-1"]) == "carol: kernel 1a2b3c4d (4.0 GiB booked, exclusive)"
    assert holders_text([]) == "nobody"
    assert Holder(uuid="x", user=None, pid=None).who() == "?"
    assert Holder(uuid="x", user=None, pid=7).who() == "pid 7"


# ---- core.contract ------------------------------------------------------------------------


def test_kernel_contract_reads_the_provisioners_variables() -> None:
    env = {
        "AUTOGPU_PROVISIONED": "1", "AUTOGPU_PICKED": "GPU-1,GPU-2,", "AUTOGPU_LEASE_ID": "abc",
        "AUTOGPU_PICK_NOTE": "  started on GPU 1  ", "AUTOGPU_PICK_OPTIONS": json.dumps(
            {"min_free": "10G"}), "AUTOGPU_GRANT_CVD": "0,1", "AUTOGPU_MOVE_FILE": " /run/x.json",
        "AUTOGPU_LEASE_FD": " 7 ",
    }
    c = KernelContract.read(env)
    assert (c.provisioned, c.picked, c.lease_id, c.note) == (
        True, ("GPU-1", "GPU-2"), "abc", "started on GPU 1")
    assert (c.options, c.grant_cvd, c.move_file, c.lease_fd) == (
        {"min_free": "10G"}, "0,1", "/run/x.json", 7)
    assert KernelContract.read({"AUTOGPU_PICKED": " GPU-1 , ,GPU-2"}).picked == ("GPU-1", "GPU-2")
    empty = KernelContract.read({"AUTOGPU_PICK_OPTIONS": "not json", "AUTOGPU_MOVE_FILE": "  "})
    assert (empty.provisioned, empty.picked, empty.lease_id, empty.note, empty.options,
            empty.move_file, empty.lease_fd) == (False, (), None, None, {}, None, None)
    for bad in ("", "x", "-1", "\u0663", "1.5"):
        assert KernelContract.read({"AUTOGPU_LEASE_FD": bad}).lease_fd is None
    assert KernelContract.read({"AUTOGPU_PICK_OPTIONS": "[1]"}).options == {}


def test_provisioner_state_is_a_structural_protocol() -> None:
    class Prov:
        autogpu_picked = ("GPU-1",)
        autogpu_constraints = None
        autogpu_note = None
        autogpu_lease_id = None
        autogpu_move_file = "/x"

    class Plain:
        pid = 4

    assert isinstance(Prov(), ProvisionerState)
    assert not isinstance(Plain(), ProvisionerState)
