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

On an AMD host the same question is asked of ROCm (:func:`hip_state`): ``ROCR_VISIBLE_DEVICES``
is read once, when the ROCr runtime initialises (``hsa_init``, which HIP's initialisation
calls), and HIP reads ``HIP_VISIBLE_DEVICES`` right after. PyTorch's ROCm build maps
``libamdhip64.so`` (and with it ROCr's ``libhsa-runtime64.so``) at ``import torch`` without
initialising anything, so "mapped" is not "initialised". Decided, without initialising it:

1. This process holds ``/dev/kfd`` open (listed in ``/proc/self/fd``): initialised. ROCr's thunk
   (libhsakmt's ``hsaKmtOpenKFD``) opens it when ROCr initialises and keeps it open until the
   last ``hsa_shut_down``; nothing opens it before.
2. Neither ``libamdhip64.so*`` nor ``libhsa-runtime64.so*`` is mapped: not initialised.
3. ROCr is mapped: reopen it with ``RTLD_NOLOAD`` and call ``hsa_system_get_info``, which
   answers ``HSA_STATUS_ERROR_NOT_INITIALIZED`` (0x100B) before ``hsa_init`` and never
   initialises (ROCr's ``IS_OPEN`` check); anything else means ROCr has started.
4. What cannot be checked while a ROCm runtime is mapped counts as initialised (as for CUDA).

Both questions are asked before every pick, so the map of this process is read once for both,
and not at all while no shared object has been loaded or unloaded since it was last read: the
dynamic linker counts every object it adds and removes (``dlpi_adds`` / ``dlpi_subs`` of
``dl_iterate_phdr``, glibc and musl), and a driver can only be mapped through it. Read before
the map, the count can only make the remembered answer older than the map, never the reverse,
so a library loaded between two picks is always seen. Where the count cannot be read, the map
is read every time. The driver itself is still asked at every check once it is mapped
(``cuInit`` can run at any moment without loading anything).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from dataclasses import dataclass

__all__ = [
    "CudaState",
    "cuda_state",
    "too_late_message",
    "mapped_libcuda",
    "CUDA_ERRORS",
    "hip_state",
    "hip_too_late_message",
    "mapped_rocm",
]

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
#: This process's memory map (the default of every check here).
MAPS_PATH = "/proc/self/maps"
_CUDA_LIBRARIES = ("libcuda.so",)
_ROCM_LIBRARIES = ("libamdhip64.so", "libhsa-runtime64.so")


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


def mapped_libcuda(maps_path: str = MAPS_PATH) -> list[str] | None:
    """Paths of every ``libcuda.so*`` mapped into this process, in first-mapped order.

    Returns ``None`` when the maps file cannot be read (not Linux). ``libcudart`` and other
    ``libcuda…`` look-alikes do not count: only the driver library itself initialises CUDA.
    """
    mapped = _mapped(maps_path)
    return None if mapped is None else list(mapped[0])


def _scan_maps(raw: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mapped CUDA drivers and ROCm runtimes in a memory map, each in first-mapped order."""
    cuda: list[str] = []
    rocm: list[str] = []
    has_cuda = b"libcuda.so" in raw
    if not has_cuda and b"libamdhip64.so" not in raw and b"libhsa-runtime64.so" not in raw:
        return (), ()  # the common case, answered without splitting thousands of lines
    for line in raw.decode(errors="replace").splitlines():  # UTF-8
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip().removesuffix(" (deleted)")
        name = os.path.basename(path)
        if has_cuda and name.startswith(_CUDA_LIBRARIES) and path not in cuda:
            cuda.append(path)
        elif name.startswith(_ROCM_LIBRARIES) and path not in rocm:
            rocm.append(path)
    return tuple(cuda), tuple(rocm)


class _DlPhdrInfo(ctypes.Structure):
    """The start of ``struct dl_phdr_info`` (``<link.h>``), up to the load counters."""

    _fields_ = [
        ("dlpi_addr", ctypes.c_size_t),  # ElfW(Addr)
        ("dlpi_name", ctypes.c_char_p),
        ("dlpi_phdr", ctypes.c_void_p),
        ("dlpi_phnum", ctypes.c_uint16),  # ElfW(Half)
        ("dlpi_adds", ctypes.c_ulonglong),
        ("dlpi_subs", ctypes.c_ulonglong),
    ]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_DlPhdrInfo), ctypes.c_size_t, ctypes.c_void_p
)


class _LoadCount:
    """How many shared objects the dynamic linker has loaded and unloaded in this process
    (``dl_iterate_phdr``'s ``dlpi_adds`` and ``dlpi_subs``): unchanged, nothing was mapped or
    unmapped through it. ``None`` where the C library does not tell."""

    def __init__(self) -> None:
        self._seen = threading.local()  # each thread's answer: no lock (none held at a fork)
        self._callback = _PHDR_CALLBACK(self._first)
        self._iterate = None
        if sys.platform.startswith("linux"):
            try:
                self._iterate = ctypes.CDLL(None).dl_iterate_phdr
            except (OSError, AttributeError):  # a C library without it: read the map each time
                self._iterate = None
        if self._iterate is not None:
            self._iterate.restype = ctypes.c_int
            self._iterate.argtypes = [_PHDR_CALLBACK, ctypes.c_void_p]

    def _first(self, info: object, size: int, _data: object) -> int:
        # Only a C library whose struct reaches the counters reports them (glibc >= 2.4, musl).
        if size >= _DlPhdrInfo.dlpi_subs.offset + _DlPhdrInfo.dlpi_subs.size:
            entry = info.contents  # type: ignore[attr-defined]
            self._seen.count = (int(entry.dlpi_adds), int(entry.dlpi_subs))
        return 1  # the first object is enough: the counters are the linker's, not per object

    def __call__(self) -> tuple[int, int] | None:
        if self._iterate is None:
            return None
        self._seen.count = None
        self._iterate(self._callback, None)
        count: tuple[int, int] | None = self._seen.count
        return count


_load_count = _LoadCount()
_maps_lock = threading.Lock()
#: (pid, load count) -> what this process's map showed then; one entry, replaced when either
#: changes (after a fork the child reads its own map once).
_maps_memo: dict[tuple[int, int, int], tuple[tuple[str, ...], tuple[str, ...]]] = {}


def _mapped(maps_path: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The CUDA drivers and ROCm runtimes mapped, per :func:`_scan_maps`; ``None`` when the map
    cannot be read. This process's own map is re-read only when the linker's load count moved
    (see the module docstring); any other map (a test's) is read every time."""
    key = None
    if maps_path == MAPS_PATH:
        count = _load_count()  # before the map: a load in between only makes the memo older
        if count is not None:
            key = (os.getpid(), *count)
            with _maps_lock:
                known = _maps_memo.get(key)
            if known is not None:
                return known
    try:
        with open(maps_path, "rb") as fh:
            raw = fh.read()
    except OSError as err:
        log.debug("cannot read %s: %s", maps_path, err)
        return None
    found = _scan_maps(raw)
    if key is not None:
        with _maps_lock:
            _maps_memo.clear()
            _maps_memo[key] = found
    return found


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


def cuda_state(maps_path: str = MAPS_PATH) -> CudaState:
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


# --------------------------------------------------------------------------- ROCm / HIP

_HSA_NOT_INITIALIZED = 0x100B
_HSA_SYSTEM_INFO_VERSION_MAJOR = 0
#: This process's descriptors, and the device ROCr's thunk opens when it initialises.
FD_DIR = "/proc/self/fd"
KFD_PATH = "/dev/kfd"


def mapped_rocm(maps_path: str = MAPS_PATH) -> list[str] | None:
    """Paths of every HIP (``libamdhip64.so*``) and ROCr (``libhsa-runtime64.so*``) library
    mapped into this process, in first-mapped order; ``None`` when the maps cannot be read."""
    mapped = _mapped(maps_path)
    return None if mapped is None else list(mapped[1])


def kfd_open(fd_dir: str = FD_DIR) -> bool:
    """Whether this process holds ``/dev/kfd`` open (ROCr opened it: it is initialised).

    Where this host has no ``/dev/kfd`` (no amdgpu driver, or a container without it), no
    descriptor of ours can name it, and this process's descriptors are not listed.
    """
    if fd_dir == FD_DIR and not os.path.exists(KFD_PATH):
        return False
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(os.path.join(fd_dir, name)) == KFD_PATH:
                return True
        except OSError:
            continue  # closed meanwhile (the listing's own fd, among others)
    return False


def _ask_rocr(path: str) -> tuple[bool, str]:
    """Ask the already-loaded ROCr at ``path`` whether ``hsa_init`` ran."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        fn = lib.hsa_system_get_info
    except (OSError, AttributeError) as err:
        return True, (
            f"ROCr is mapped ({path}) but could not be asked ({err}); assuming HIP is initialised"
        )
    fn.restype = ctypes.c_int
    major = ctypes.c_uint16(0)
    rc = int(fn(_HSA_SYSTEM_INFO_VERSION_MAJOR, ctypes.byref(major)))
    if rc == _HSA_NOT_INITIALIZED:
        return False, (
            f"ROCr is mapped ({path}) but hsa_system_get_info returned "
            "HSA_STATUS_ERROR_NOT_INITIALIZED (0x100B): hsa_init has not run yet"
        )
    return True, f"hsa_system_get_info returned {rc:#x} from {path}: ROCr (HIP) has started"


def hip_state(maps_path: str = MAPS_PATH, fd_dir: str = FD_DIR) -> CudaState:
    """Whether the ROCm runtime (HIP / ROCr) is already initialised here, without initialising
    it (see the module docstring). Never raises.

    Parameters
    ----------
    maps_path, fd_dir
        This process's memory map and descriptor folder; tests may point them elsewhere.
    """
    framework, hint = _framework_hint()
    suffix = f" ({hint})" if hint else ""
    if kfd_open(fd_dir):
        return CudaState(
            True, "this process holds /dev/kfd open: the ROCr runtime has initialised" + suffix,
            framework,
        )
    paths = mapped_rocm(maps_path)
    if paths is None:
        return CudaState(False, f"cannot read {maps_path} (not Linux?): no sign of HIP", framework)
    if not paths:
        return CudaState(
            False, "no HIP or ROCr runtime mapped in this process: nothing has initialised HIP",
            framework,
        )
    rocr = [p for p in paths if os.path.basename(p).startswith("libhsa-runtime64.so")]
    if not rocr:
        return CudaState(
            True, f"HIP is mapped ({paths[0]}) without ROCr, which cannot be asked; assuming "
            "HIP is initialised" + suffix, framework,
        )
    verdicts = [_ask_rocr(p) for p in rocr]
    initialized = any(v for v, _ in verdicts)
    evidence = "; ".join(e for v, e in verdicts if v == initialized)
    return CudaState(initialized, evidence + suffix, framework)


def hip_too_late_message(state: CudaState, where: str = "this kernel") -> str:
    """What to tell someone whose pick came after HIP (ROCm) started."""
    before = (
        f"before importing {state.framework} or anything that uses the GPU"
        if state.framework
        else "before anything uses the GPU (torch.cuda..., a tensor on the GPU)"
    )
    culprit = f", probably by {state.framework}" if state.framework else ""
    return (
        f"HIP (ROCm) is already initialised in {where}{culprit} ({state.evidence}). "
        "ROCR_VISIBLE_DEVICES and HIP_VISIBLE_DEVICES are read once, when ROCm initialises, so "
        f"changing them now has no effect; nothing was changed. Restart the kernel and run "
        f"`%gpu pick` first, {before}, or start the notebook with the \"Python 3 (autogpu)\" "
        "kernel, which picks before the kernel starts."
    )
