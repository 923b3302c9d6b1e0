"""The broker's checks before it serves (autogpu_jupyter/brokerd/startup.py), in this process:
what the multi-user tests (tests/multiuser/test_broker_startup.py) cannot make as easily."""

from __future__ import annotations

import os
import socket
import stat
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


# --- Mutation run of 2026-12-07 after the house's cut (issue 42, seed 71) -------------------------
# The state directory's path checks, read where users meet them: the one refusal line.


def test_a_state_directory_under_a_directory_others_may_write_is_refused(tmp_path: Path) -> None:
    """Mutation run of 2026-12-07 found the group/other-writable test of a component unpinned
    (``not mode & S_ISVTX`` read as ``not mode | S_ISVTX`` passed): a directory of root's that
    anyone may write, not sticky, lets another user rename the state directory away."""
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    path = str(open_dir / "state")
    assert _refusal(startup.check_state_dir, path) == (
        f"autogpu broker: state directory {path}: {open_dir} is owned by uid {os.geteuid()} "
        "with mode 0777: refused (another user could replace it and make root write the "
        "journal elsewhere); use a path whose every directory only root can write, e.g. "
        "/var/lib/autogpu-broker"
    )
    assert not (open_dir / "state").exists()


def test_a_state_directory_below_a_socket_or_a_device_names_what_it_met(tmp_path: Path) -> None:
    """Mutation run of 2026-12-07 found the kind named for a socket and a block device
    unpinned (only a regular file's and a FIFO's were)."""
    sock_path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))
        path = str(sock_path / "state")
        assert _refusal(startup.check_state_dir, path) == (
            f"autogpu broker: state directory {path}: {sock_path} is not a directory "
            "(a socket): refused"
        )
    block = tmp_path / "b"  # the tests run as root (CONTRIBUTING.md): a block device node
    os.mknod(block, stat.S_IFBLK | 0o600, os.makedev(7, 0))
    path = str(block / "state")
    assert _refusal(startup.check_state_dir, path) == (
        f"autogpu broker: state directory {path}: {block} is not a directory (a device): refused"
    )
