"""A real container for the tests of notebooks in containers (issue 40): podman (rootful) with
runc, a root filesystem built from this host's files, no image and no registry.

Each :class:`Container` runs one command as uid 1000 (``jovyan``, as notebook images do) in its own
pid, network (``--network none``: loopback only), mount, IPC and UTS namespaces, optionally its
own user namespace (``userns=True``: the container's uids 0..65535 are mapped to a range of the
host's that no passwd entry and no ``/etc/subuid`` range holds, :func:`unused_uid_base`; podman's
``--userns auto`` needs a ``containers`` range in ``/etc/subuid``, which this harness does not
add). Mounted into it, read-only: the host's ``/usr`` (the system Python), the venv's
``site-packages`` and the checkout (on the same paths, on ``PYTHONPATH``), and a given host
directory at the default socket's directory (``/run/autogpu``): the broker's main socket
directory today, a tenant's directory from phase B on. ``/tmp`` is a fresh tmpfs (``HOME``,
Jupyter's runtime files).

:meth:`Container.kernel` runs ``tests/container_kernel.py`` inside: a real IPython kernel and its
``jupyter_client`` both inside the container (no TCP reaches the host), executing the cells and
answering with their outputs, then holding the kernel until :meth:`KernelInContainer.close`.

Podman's settings (docs in PODMAN.md of the test set-up): runc with the cgroupfs manager (crun
refuses this host's hybrid cgroups) and lower default ulimits (root here may not raise
``nofile`` past the hard limit); they live in a ``containers.conf`` of the harness's own
(``CONTAINERS_CONF``), nothing of the host's podman set-up is changed.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from autogpu_jupyter.core.leasing.brokerclient import DEFAULT_SOCKET

REPO = Path(__file__).resolve().parent.parent
UID = 1000
SOCKET_DIR = os.path.dirname(DEFAULT_SOCKET)
SYSTEM_PYTHON = "/usr/bin/python3"
_CONF = (
    '[containers]\ndefault_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]\n'
    '[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\n'
)

__all__ = ["Container", "KernelInContainer", "container_problem", "podman_env"]


def container_problem() -> str | None:
    """Why a container cannot run here (``None``: it can)."""
    if os.geteuid() != 0:
        return "needs root (rootful podman)"
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs podman and runc as root)"
    if not os.path.exists(SYSTEM_PYTHON):
        return f"{SYSTEM_PYTHON} is missing (the container's interpreter)"
    return None


def unused_uid_base() -> int:
    """The first host uid of 65,536 that no ``/etc/subuid`` or ``/etc/subgid`` range and no
    passwd entry overlaps (a multiple of 65,536 above 1,000,000)."""
    import pwd

    taken: list[tuple[int, int]] = [(pw.pw_uid, pw.pw_uid) for pw in pwd.getpwall()]
    for path in ("/etc/subuid", "/etc/subgid"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(path).read_text().splitlines():
                parts = line.split(":")
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
                    taken.append((int(parts[1]), int(parts[1]) + int(parts[2]) - 1))
    base = 1_048_576
    while any(first <= base + 65535 and base <= last for first, last in taken):
        base += 65536
    return base


def podman_env(workdir: Path) -> dict[str, str]:
    """The environment podman runs with: the harness's own ``containers.conf``."""
    conf = workdir / "containers.conf"
    if not conf.exists():
        conf.write_text(_CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def build_rootfs(path: Path) -> Path:
    """A root filesystem from local files: empty mount points, ``/bin`` etc. linked into the
    mounted ``/usr``, and ``/etc/passwd``/``group`` naming ``jovyan`` (uid 1000)."""
    for d in ("proc", "sys", "dev", "tmp", "etc", "run", "usr", "var/tmp", "home/jovyan"):
        (path / d).mkdir(parents=True, exist_ok=True)
    for d in ("bin", "lib", "lib64", "sbin"):
        link = path / d
        if not link.is_symlink():
            link.symlink_to(f"usr/{d}")
    (path / "etc" / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\njovyan:x:1000:100::/home/jovyan:/bin/sh\n")
    (path / "etc" / "group").write_text("root:x:0:\nusers:x:100:jovyan\n")
    (path / "etc" / "hosts").write_text("127.0.0.1 localhost\n")
    os.chmod(path / "tmp", 0o1777)
    os.chown(path / "home" / "jovyan", UID, 100)
    return path


class Container:
    """Runs commands in fresh containers (one per :meth:`run` / :meth:`kernel`).

    Parameters
    ----------
    workdir
        Unused by the container itself: the root filesystem and podman's settings go to a
        fresh directory in ``/var/tmp`` (mode 0755: a container with its own user namespace
        mounts them as an unprivileged uid, which pytest's 0700 directories would stop),
        removed by :meth:`remove` (or the ``with`` block's end).
    socket_dir
        The host directory mounted read-only at ``/run/autogpu`` in the container.
    env
        Extra environment inside the container (the simulated fleet, ``AUTOGPU_*``).
    mounts
        Extra read-only mounts, host path -> container path.
    userns
        Its own user namespace too (uids mapped from :func:`unused_uid_base`; ``host_uid``
        is then the host's uid of the container's uid 1000).
    """

    def __init__(self, workdir: Path, socket_dir: str | Path, env: Mapping[str, str] = (),
                 mounts: Mapping[str, str] = (), userns: bool = False) -> None:
        del workdir
        self.workdir = Path(tempfile.mkdtemp(prefix="autogpu-container-", dir="/var/tmp"))
        os.chmod(self.workdir, 0o755)
        self.rootfs = build_rootfs(self.workdir / "rootfs")
        self.socket_dir = str(socket_dir)
        self.env = dict(env)
        self.mounts = dict(mounts)
        self.userns = userns
        self.uid_base = unused_uid_base() if userns else 0
        #: The container's uid 1000 as the host (and the broker's ``SO_PEERCRED``) sees it.
        self.host_uid = self.uid_base + UID
        self.site = sysconfig.get_paths()["purelib"]

    def _mount_points(self, mounts: Mapping[str, str]) -> None:
        """Make every mount point in the root filesystem (a file for a file), owned by the
        container's root: with a user namespace it may not make them itself."""
        for source, target in mounts.items():
            point = self.rootfs / target.lstrip("/")
            if os.path.isdir(source):
                point.mkdir(parents=True, exist_ok=True)
            else:
                point.parent.mkdir(parents=True, exist_ok=True)
                point.touch(exist_ok=True)
        if self.userns:
            for top, dirs, files in os.walk(self.rootfs):
                for entry in [top, *(os.path.join(top, n) for n in dirs + files)]:
                    st = os.lstat(entry)
                    if st.st_uid < self.uid_base:
                        os.lchown(entry, self.uid_base + st.st_uid, self.uid_base + st.st_gid)

    def remove(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def argv(self, command: Sequence[str], name: str | None = None) -> list[str]:
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp",
            "PYTHONPATH": f"{REPO}:{self.site}",
            "JUPYTER_RUNTIME_DIR": "/tmp/jupyter-runtime",
            "IPYTHONDIR": "/tmp/ipython",
            "PYTHONDONTWRITEBYTECODE": "1",
            **self.env,
        }
        mounts = {"/usr": "/usr", self.site: self.site, str(REPO): str(REPO),
                  self.socket_dir: SOCKET_DIR, **self.mounts}
        self._mount_points(mounts)
        args = ["podman", "--runtime", "runc", "run", "--rm", "-i", "--network", "none",
                "--user", f"{UID}:100", "--tmpfs", "/tmp:rw,mode=1777", "--workdir", "/tmp"]
        if name:
            args += ["--name", name]
        if self.userns:
            args += ["--uidmap", f"0:{self.uid_base}:65536", "--gidmap", f"0:{self.uid_base}:65536"]
        for source, target in mounts.items():
            args += ["-v", f"{source}:{target}:ro"]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        return [*args, "--rootfs", str(self.rootfs), *command]

    def run(self, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``command`` in a fresh container, to its end."""
        return subprocess.run(self.argv(command), capture_output=True, text=True, check=False,
                              timeout=timeout, env=podman_env(self.workdir),
                              stdin=subprocess.DEVNULL)

    def kernel(self, cells: Sequence[str], timeout: float = 180) -> KernelInContainer:
        """A real kernel in a fresh container, ``cells`` executed in it (see
        :class:`KernelInContainer`)."""
        return KernelInContainer(self, cells, timeout)


class KernelInContainer:
    """``tests/container_kernel.py`` in a container: ``results`` holds each cell's outputs
    (``status``, ``stdout``, ``stderr``, ``texts``, ``error``) once the cells ran; the kernel
    (and whatever lease it holds) lives until :meth:`close`."""

    def __init__(self, container: Container, cells: Sequence[str], timeout: float) -> None:
        self.name = f"autogpu-test-{os.getpid()}-{time.monotonic_ns() % 10**9}"
        self.workdir = container.workdir
        self.proc = subprocess.Popen(
            container.argv([SYSTEM_PYTHON, str(REPO / "tests" / "container_kernel.py"),
                            json.dumps(list(cells))], name=self.name),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=podman_env(container.workdir), start_new_session=True,
        )
        self.results: list[dict[str, Any]] = []
        self._read(len(cells), timeout)

    def _read(self, n: int, timeout: float) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        deadline = time.monotonic() + timeout
        while len(self.results) < n:
            while b"\n" in buf and len(self.results) < n:
                line, _, buf = buf.partition(b"\n")
                with contextlib.suppress(ValueError):
                    self.results.append(json.loads(line))
            if len(self.results) >= n:
                break
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(fd, 65536) if ready else b""
            if not chunk:
                err = self.close()
                raise AssertionError(f"the kernel in the container gave {len(self.results)} of "
                                     f"{n} results: {err[-3000:]}")
            buf += chunk

    @property
    def pid(self) -> int | None:
        """The container's first process as the host sees it (``podman inspect``)."""
        out = subprocess.run(["podman", "inspect", "--format", "{{.State.Pid}}", self.name],
                             capture_output=True, text=True, check=False,
                             env=podman_env(self.workdir))
        return int(out.stdout) if out.returncode == 0 and out.stdout.strip().isdigit() else None

    def close(self, timeout: float = 30) -> str:
        """Shut the kernel down and end the container; what it wrote on stderr."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(["podman", "kill", self.name], capture_output=True, check=False,
                           env=podman_env(self.workdir))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        err = ""
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            err = self.proc.stderr.read().decode(errors="replace")
        for f in (self.proc.stdout, self.proc.stderr):
            if f is not None:
                f.close()
        return err
