"""Has this process initialised CUDA? Decided without initialising it (design decision 4).

``CUDA_VISIBLE_DEVICES`` is read once, by ``cuInit``. Once anything in the process (torch, jax,
cupy, a library imported along the way) has called it, changing the variable does nothing, and a
pick must refuse rather than pretend. Framework flags are not proof: ``torch.cuda.is_available()``
calls ``cuInit`` but leaves ``torch.cuda.is_initialized()`` False, and several libraries initialise
CUDA at import. So the driver itself is asked:

1. No ``libcuda.so*`` mapped in ``/proc/self/maps``: nothing can have called ``cuInit``.
2. Mapped: open that same file with ``RTLD_NOLOAD`` (which never loads a library that is not
   already loaded) and call ``cuDeviceGetCount``. ``CUDA_ERROR_NOT_INITIALIZED`` (3) means
   ``cuInit`` has not run and ``CUDA_VISIBLE_DEVICES`` can still take effect; success, or an error
   that only ``cuInit`` produces (``CUDA_ERROR_NO_DEVICE``, ...), means it has run.
3. Anything that cannot be checked while libcuda is mapped counts as initialised: refusing a pick
   that would have worked costs a kernel restart; accepting one that silently does nothing costs
   a run on the wrong GPU.

Framework modules already imported (torch, jax, cupy, tensorflow; never imported here) only
name the culprit in the message.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from dataclasses import dataclass

__all__ = ["CudaState", "cuda_state", "too_late_message", "mapped_libcuda", "CUDA_ERRORS"]

log = logging.getLogger(__name__)

#: The CUresult codes that matter here, by number.
CUDA_ERRORS = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}
_NOT_INITIALIZED = 3
_FRAMEWORKS = ("torch", "jax", "cupy", "tensorflow")


@dataclass(frozen=True, slots=True)
class CudaState:
    """Whether CUDA is initialised in this process, and how that was decided.

    Attributes
    ----------
    initialized
        True when ``cuInit`` has run (or that cannot be ruled out): ``CUDA_VISIBLE_DEVICES``
        no longer has any effect in this process.
    evidence
        How it was decided, in words: ``"no libcuda mapped in this process"``,
        ``"cuDeviceGetCount returned CUDA_SUCCESS (0)"``, ...
    framework
        An imported framework that probably initialised it (``"torch"``, ``"jax"``, ``"cupy"``,
        ``"tensorflow"``), only to word messages; ``None`` when none is imported.
    """

    initialized: bool
    evidence: str
    framework: str | None = None


def mapped_libcuda(maps_path: str = "/proc/self/maps") -> list[str] | None:
    """Paths of every ``libcuda.so*`` mapped into this process, in first-mapped order.

    Returns ``None`` when the maps file cannot be read (not Linux). ``libcudart`` and other
    ``libcuda…`` look-alikes do not count: only the driver library itself initialises CUDA.
    """
    try:
        with open(maps_path, "rb") as fh:
            raw = fh.read()
    except OSError as err:
        log.debug("cannot read %s: %s", maps_path, err)
        return None
    paths: list[str] = []
    if b"libcuda.so" not in raw:  # the common case, answered without splitting thousands of lines
        return paths
    for line in raw.decode(errors="replace").splitlines():  # UTF-8
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if os.path.basename(path).startswith("libcuda.so") and path not in paths:
            paths.append(path)
    return paths


def _framework_hint() -> tuple[str | None, str | None]:
    """The first imported framework and, for torch, what its own flag says (a hint only)."""
    for name in _FRAMEWORKS:
        if name not in sys.modules:
            continue
        if name == "torch":
            tc = getattr(sys.modules[name], "cuda", None)
            is_init = getattr(tc, "is_initialized", None)
            if callable(is_init):
                try:
                    flag = bool(is_init())
                except Exception as err:  # a hint must never break the check
                    return name, f"torch.cuda.is_initialized() failed: {err}"
                return name, f"torch.cuda.is_initialized() is {flag}"
        return name, None
    return None, None


def _ask_driver(path: str) -> tuple[bool, str]:
    """Ask the already-loaded driver at ``path`` whether ``cuInit`` ran."""
    mode = os.RTLD_NOLOAD | os.RTLD_LAZY  # on Linux (only there can the maps file be read)
    try:
        lib = ctypes.CDLL(path, mode=mode)
    except OSError as err:
        return True, (
            f"libcuda is mapped ({path}) but could not be reopened with RTLD_NOLOAD ({err}); "
            "assuming CUDA is initialised"
        )
    try:
        fn = lib.cuDeviceGetCount
    except AttributeError:
        return True, (
            f"libcuda is mapped ({path}) but has no cuDeviceGetCount; assuming CUDA is initialised"
        )
    fn.restype = ctypes.c_int
    count = ctypes.c_int(-1)  # passed by reference: the int* cuDeviceGetCount takes
    rc = int(fn(ctypes.byref(count)))
    name = CUDA_ERRORS.get(rc, "an unknown CUresult")
    if rc == _NOT_INITIALIZED:
        return False, (
            f"libcuda is mapped ({path}) but cuDeviceGetCount returned {name} ({rc}): "
            "cuInit has not run yet"
        )
    if rc == 0:
        return True, (
            f"cuDeviceGetCount returned CUDA_SUCCESS (0, {count.value} device(s)) from {path}: "
            "cuInit has run"
        )
    return True, f"cuDeviceGetCount returned {name} ({rc}) from {path}: cuInit has run"


def cuda_state(maps_path: str = "/proc/self/maps") -> CudaState:
    """Whether CUDA is already initialised in this process, without initialising it.

    Parameters
    ----------
    maps_path
        The memory map to read; tests may point it elsewhere. Defaults to this process's.

    Returns
    -------
    CudaState
        Never raises: what cannot be checked while libcuda is mapped counts as initialised.
    """
    framework, hint = _framework_hint()
    paths = mapped_libcuda(maps_path)
    if paths is None:
        evidence = f"cannot read {maps_path} (not Linux?): no sign of CUDA"
        return CudaState(False, evidence + (f"; {hint}" if hint else ""), framework)
    if not paths:
        return CudaState(
            False, "no libcuda mapped in this process: nothing has called cuInit", framework
        )
    verdicts = [_ask_driver(p) for p in paths]
    initialized = any(v for v, _ in verdicts)
    evidence = "; ".join(e for v, e in verdicts if v == initialized)
    if hint:
        evidence += f" ({hint})"
    return CudaState(initialized, evidence, framework)


def too_late_message(state: CudaState, where: str = "this kernel") -> str:
    """What to tell someone whose pick came after CUDA started.

    Parameters
    ----------
    state
        The result of :func:`cuda_state` (``initialized`` True).
    where
        ``"this kernel"`` in a notebook, ``"this process"`` elsewhere.
    """
    before = (
        f"before importing {state.framework} or anything that uses CUDA"
        if state.framework
        else "before importing torch, jax, cupy, tensorflow or anything that uses CUDA"
    )
    culprit = f", probably by {state.framework}" if state.framework else ""
    return (
        f"CUDA is already initialised in {where}{culprit} ({state.evidence}). "
        "CUDA_VISIBLE_DEVICES is read once, when CUDA initialises, so changing it now has no "
        f"effect; nothing was changed. Restart the kernel and run `%gpu pick` first, {before}, "
        'or start the notebook with the "Python 3 (autogpu)" kernel, which picks before the '
        "kernel starts."
    )
