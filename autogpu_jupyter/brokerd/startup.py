"""What the broker checks before it serves: the admin's rules file and its state directory.

Both refuse with one line (``SystemExit``) naming the path and what is wrong, never a traceback:

* **The rules file.** ``--rules FILE`` names the admin's limits and reservations; a file that
  is named but missing or unreadable would start a broker with no limits at all, silently. The
  default (:data:`DEFAULT_RULES`) is read when it exists; ``--rules ''`` reads none.
* **The state directory.** Root writes the journal there (``journal.log``, replaced by
  rename). A directory that another user can rename or replace, anywhere on its path, lets
  them swap a component for a symlink and make root write where it points. So every component
  must be a real directory (no symlink: the message names the real path to use instead), owned
  by root or by the broker's own uid, and writable by nobody else unless it is sticky
  (``/tmp``: a sticky directory's entries can be renamed by their owners only); the state
  directory itself is the broker's own, mode 0700. Missing components are created (mode 0755,
  the last 0700) only under components that passed.
"""

from __future__ import annotations

import os
import stat

__all__ = ["DEFAULT_RULES", "check_rules_file", "check_state_dir", "rules_to_read"]

#: The admin's rules file read when ``--rules`` is not given (and it exists).
DEFAULT_RULES = "/etc/autogpu/broker.json"


def rules_to_read(path: str | None) -> str | None:
    """The rules file to read: ``path`` as ``--rules`` names it (``''``: none), or
    :data:`DEFAULT_RULES` when not given and it exists (a dangling symlink there counts as
    named). Raises ``SystemExit`` for a file that is named but cannot be read."""
    if path is None:
        if not os.path.lexists(DEFAULT_RULES):
            return None
        path = DEFAULT_RULES
    if not path:
        return None
    check_rules_file(path)
    return path


def check_rules_file(path: str) -> None:
    """Refuse (``SystemExit``, one line) a rules file that is missing, not a regular file or
    unreadable: the broker would otherwise start with no limits."""
    fix = "name the admin's rules file (JSON, see docs/admin-broker.md), or --rules '' for none"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SystemExit(
            f"autogpu broker: rules file {path} does not exist: refused (the broker would start "
            f"with no limits); {fix}"
        ) from None
    except OSError as err:
        raise SystemExit(
            f"autogpu broker: rules file {path} cannot be read ({err.strerror}): refused; {fix}"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise SystemExit(
            f"autogpu broker: rules file {path} is not a regular file ({_kind(st.st_mode)}): "
            f"refused; {fix}"
        )
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise SystemExit(
            f"autogpu broker: rules file {path} cannot be read ({err.strerror}): refused; {fix}"
        ) from None


def check_state_dir(path: str) -> None:
    """Make sure ``path`` is a state directory no other user can redirect (see the module
    docstring), creating what is missing; raises ``SystemExit`` (one line) otherwise."""
    full = os.path.abspath(path)
    _check_components(path, full)
    if not os.path.isdir(full):
        old = os.umask(0o022)
        try:
            os.makedirs(full, mode=0o700, exist_ok=True)
        except OSError as err:
            raise SystemExit(
                f"autogpu broker: state directory {path} cannot be created ({err.strerror})"
            ) from None
        finally:
            os.umask(old)
        _check_components(path, full)
    st = os.lstat(full)
    if st.st_uid != os.geteuid():
        raise SystemExit(
            f"autogpu broker: state directory {path} is owned by uid {st.st_uid}, not by the "
            f"broker's uid {os.geteuid()}: refused; use a directory of its own, e.g. "
            "/var/lib/autogpu-broker"
        )
    if stat.S_IMODE(st.st_mode) & 0o022:  # sticky (the components passed): shared with others
        raise SystemExit(
            f"autogpu broker: state directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: "
            "refused (other users may write in it); use a directory of the broker's own, e.g. "
            "/var/lib/autogpu-broker"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(full, 0o700)


def _check_components(path: str, full: str) -> None:
    """Every existing component of ``full`` (the absolute ``path``), from ``/`` down."""
    me = os.geteuid()
    parts = [p for p in full.split("/") if p]
    here = "/"
    for i in range(len(parts) + 1):
        if i:
            here = os.path.join(here, parts[i - 1])
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            return  # created by the caller, under components that passed
        except OSError as err:
            raise SystemExit(
                f"autogpu broker: state directory {path}: {here} cannot be examined "
                f"({err.strerror}): refused"
            ) from None
        if stat.S_ISLNK(st.st_mode):
            raise SystemExit(
                f"autogpu broker: state directory {path}: {here} is a symlink: refused (root "
                "would write the journal wherever it points); name the real path, "
                f"--state-dir {os.path.realpath(full)}"
            )
        if not stat.S_ISDIR(st.st_mode):
            raise SystemExit(
                f"autogpu broker: state directory {path}: {here} is not a directory "
                f"({_kind(st.st_mode)}): refused"
            )
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, me) or (mode & 0o022 and not mode & stat.S_ISVTX):
            raise SystemExit(
                f"autogpu broker: state directory {path}: {here} is owned by uid {st.st_uid} "
                f"with mode {mode:04o}: refused (another user could replace it and make root "
                "write the journal elsewhere); use a path whose every directory only root can "
                "write, e.g. /var/lib/autogpu-broker"
            )


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a special file"
