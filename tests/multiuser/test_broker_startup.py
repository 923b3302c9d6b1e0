"""``autogpu broker`` refuses to start on a rules file or a state directory it cannot trust
(issue 39, break 7), through the real command as root, with a real user owning a directory.

A rules file that is named but missing or unreadable started a broker with no limits, silently;
a state directory under a directory a user owns could be swapped for a symlink (root then
wrote ``journal.log`` where it points). Each is now one line naming the path and what is wrong,
and a non-zero exit, before the broker listens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.brokerhelpers import REPO, Area
from tests.leasehelpers import SYSTEM_PYTHON, ensure_user, shared_area

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="needs runuser (util-linux)"),
]

USER = "agtest-carol"


@pytest.fixture(scope="module")
def user() -> tuple[int, int]:
    return ensure_user(USER)


@pytest.fixture
def area(user: tuple[int, int]) -> Iterator[Area]:
    with shared_area("autogpu-start") as root:
        yield Area(root)


def _serve(area: Area, *args: str, as_user: str | None = None) -> tuple[int | str, str]:
    """``autogpu broker --foreground ARGS`` (as root, or ``as_user``): its exit status and
    stderr, or ``"listening"`` (and what it said) once it says it listens (then stopped)."""
    env = {"PATH": "/usr/bin:/bin", "AUTOGPU_SIMULATE": str(area.fleet),
           "PYTHONPATH": str(REPO) if as_user is None else area.env()["PYTHONPATH"]}
    sock = area.root / ("run" if as_user is None else as_user) / "b.sock"
    sock.parent.mkdir(mode=0o755, exist_ok=True)
    cmd = [sys.executable if as_user is None else SYSTEM_PYTHON, "-m", "autogpu_jupyter.cli",
           "broker", "--foreground", "--socket", str(sock), *args]
    if as_user is not None:
        uid = ensure_user(as_user)[0]
        os.chown(sock.parent, uid, -1)
        cmd = [shutil.which("runuser") or "runuser", "-u", as_user, "--", "env", "-i",
               *(f"{k}={v}" for k, v in env.items()), *cmd]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(REPO))
    assert proc.stderr is not None
    said = []
    guard = threading.Timer(60, proc.kill)  # neither a refusal nor listening: fail, not hang
    guard.start()
    try:
        for line in proc.stderr:
            said.append(line)
            if "listening on" in line:
                proc.terminate()
                proc.wait(30)
                return "listening", "".join(said)
        return proc.wait(30), "".join(said)
    finally:
        guard.cancel()
        proc.stderr.close()


def _one_line(said: str) -> str:
    assert "Traceback" not in said, said
    lines = said.strip().splitlines()
    assert len(lines) == 1, said
    return lines[0]


# ---- the rules file --------------------------------------------------------------------------

FIX = "name the admin's rules file (JSON, see docs/admin-broker.md), or --rules '' for none"


def test_a_rules_file_that_is_named_but_missing_stops_the_broker(area: Area) -> None:
    missing = area.root / "broker.json"
    rc, said = _serve(area, "--state-dir", "", "--rules", str(missing))
    assert rc not in (0, "listening"), said  # before issue 39: started with no limits
    assert _one_line(said) == (
        f"autogpu broker: rules file {missing} does not exist: refused (the broker would start "
        f"with no limits); {FIX}"
    )
    # a dangling symlink is as missing
    (area.root / "link.json").symlink_to(missing)
    rc, said = _serve(area, "--state-dir", "", "--rules", str(area.root / "link.json"))
    assert rc not in (0, "listening"), said
    assert "does not exist: refused" in _one_line(said)


def test_a_rules_file_that_cannot_be_read_stops_the_broker(area: Area) -> None:
    rules_dir = area.root / "rules.d"
    rules_dir.mkdir()
    rc, said = _serve(area, "--state-dir", "", "--rules", str(rules_dir))
    assert rc not in (0, "listening"), said
    assert _one_line(said) == (
        f"autogpu broker: rules file {rules_dir} is not a regular file (a directory): refused; "
        f"{FIX}"
    )
    # a file its (non-root) broker may not read
    secret = area.root / "secret.json"
    secret.write_text(json.dumps({"max_devices_per_user": 1}))
    os.chmod(secret, 0o600)
    rc, said = _serve(area, "--state-dir", "", "--rules", str(secret), as_user=USER)
    assert rc not in (0, "listening"), said
    assert _one_line(said) == (
        f"autogpu broker: rules file {secret} cannot be read (Permission denied): refused; {FIX}"
    )


def test_rules_named_empty_and_a_readable_file_start_the_broker(area: Area) -> None:
    rc, said = _serve(area, "--state-dir", "", "--rules", "")
    assert rc == "listening", said
    rules = area.root / "rules.json"
    rules.write_text(json.dumps({"max_devices_per_user": 1}))
    rc, said = _serve(area, "--state-dir", "", "--rules", str(rules))
    assert rc == "listening", said


# ---- the state directory ---------------------------------------------------------------------


def _users_dir(area: Area, uid: int) -> Path:
    home = area.root / "home"
    home.mkdir(mode=0o755)
    os.chown(home, uid, -1)
    return home


def test_a_state_dir_under_a_users_directory_is_refused(
    area: Area, user: tuple[int, int]
) -> None:
    home = _users_dir(area, user[0])
    state = home / "state"
    rc, said = _serve(area, "--state-dir", str(state))
    assert rc not in (0, "listening"), said  # before issue 39: started, journal in there
    assert _one_line(said) == (
        f"autogpu broker: state directory {state}: {home} is owned by uid {user[0]} with mode "
        "0755: refused (another user could replace it and make root write the journal "
        "elsewhere); use a path whose every directory only root can write, e.g. "
        "/var/lib/autogpu-broker"
    )
    assert not state.exists()


def test_a_state_dir_through_a_users_symlink_is_refused_and_nothing_is_written(
    area: Area, user: tuple[int, int]
) -> None:
    """The user swapped a directory of theirs for a symlink to root's directory: root would
    have made ``state/`` there and written its journal into it."""
    home = _users_dir(area, user[0])
    victim = area.root / "victim"
    victim.mkdir(mode=0o755)
    (home / "x").symlink_to(victim)
    os.lchown(home / "x", user[0], user[1])
    rc, said = _serve(area, "--state-dir", str(home / "x" / "state"))
    assert rc not in (0, "listening"), said
    assert f"{home} is owned by uid {user[0]}" in _one_line(said)
    assert list(victim.iterdir()) == []


def test_a_state_dir_with_a_symlinked_component_is_refused_naming_the_real_path(
    area: Area,
) -> None:
    real = area.root / "real"
    real.mkdir(mode=0o755)
    (area.root / "lnk").symlink_to(real)
    rc, said = _serve(area, "--state-dir", str(area.root / "lnk" / "state"))
    assert rc not in (0, "listening"), said  # before issue 39: started, journal in real/state
    assert _one_line(said) == (
        f"autogpu broker: state directory {area.root / 'lnk' / 'state'}: {area.root / 'lnk'} "
        "is a symlink: refused (root would write the journal wherever it points); name the "
        f"real path, --state-dir {real / 'state'}"
    )
    assert list(real.iterdir()) == []
    # the real path it names works: made 0700, the broker listens
    rc, said = _serve(area, "--state-dir", str(real / "state"))
    assert rc == "listening", said
    assert os.stat(real / "state").st_mode & 0o7777 == 0o700
