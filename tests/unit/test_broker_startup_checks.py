"""The broker's checks before it serves (autogpu_jupyter/brokerd/startup.py), in this process:
what the multi-user tests (tests/multiuser/test_broker_startup.py) cannot make as easily."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from autogpu_jupyter.brokerd import startup


def _refusal(fn: Callable[..., object], *args: object) -> str:
    with pytest.raises(SystemExit) as err:
        fn(*args)
    return str(err.value)


def test_a_shared_sticky_state_directory_is_refused_not_made_private(tmp_path: Path) -> None:
    """``--state-dir /tmp``-like: sticky and open to all. Made 0700 it would break every other
    user of it; left as it is, others could plant files beside the journal."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    assert _refusal(startup.check_state_dir, str(shared)) == (
        f"autogpu broker: state directory {shared} has mode 1777: refused (other users may "
        "write in it); use a directory of the broker's own, e.g. /var/lib/autogpu-broker"
    )
    assert os.stat(shared).st_mode & 0o7777 == 0o1777


def test_a_state_directory_below_a_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    path = str(tmp_path / "f" / "state")
    assert _refusal(startup.check_state_dir, path) == (
        f"autogpu broker: state directory {path}: {tmp_path / 'f'} is not a directory "
        "(a regular file): refused"
    )


def test_a_state_directory_under_a_sticky_directory_is_made(tmp_path: Path) -> None:
    """/tmp and /var/tmp: only an entry's owner may rename it there, so a directory of root's
    under them is safe."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    startup.check_state_dir(str(sticky / "a" / "state"))
    assert os.stat(sticky / "a" / "state").st_mode & 0o7777 == 0o700
    assert os.stat(sticky / "a").st_mode & 0o7777 == 0o755


def test_a_rules_fifo_is_refused_without_opening_it(tmp_path: Path) -> None:
    """Opening a FIFO would block the broker's start forever."""
    fifo = tmp_path / "rules.json"
    os.mkfifo(fifo)
    assert _refusal(startup.rules_to_read, str(fifo)) == (
        f"autogpu broker: rules file {fifo} is not a regular file (a FIFO): refused; name the "
        "admin's rules file (JSON, see docs/admin-broker.md), or --rules '' for none"
    )


def test_no_rules_named_reads_the_default_only_where_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = tmp_path / "broker.json"
    monkeypatch.setattr(startup, "DEFAULT_RULES", str(default))
    assert startup.rules_to_read(None) is None
    assert startup.rules_to_read("") is None
    default.write_text("{}")
    assert startup.rules_to_read(None) == str(default)
    assert startup.rules_to_read("") is None
    default.unlink()
    default.symlink_to(tmp_path / "gone.json")  # a dangling default is named, and missing
    assert "does not exist: refused" in _refusal(startup.rules_to_read, None)
