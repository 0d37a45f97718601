"""The seven CUDA runtime calls paging needs, made through ctypes on the libcudart that torch already loaded.

Why ctypes on torch's own runtime rather than a binding library (cuda-python / cuda-bindings):

* No new dependency and nothing to build: every CUDA build of torch ships libcudart and has it mapped into the
  process before hf_optim asks for it. cuda-bindings would be one more wheel whose CUDA major version has to match
  the driver, for the sake of seven functions.
* The very runtime torch uses: device ordinals and stream handles (``torch.cuda.current_stream().cuda_stream``)
  are handed over as they are, with no question of two runtimes disagreeing.
* The C ABI of these functions is stable, with one exception that is handled here: CUDA 13 changed
  ``cudaMemPrefetchAsync(ptr, count, int device, stream)`` into ``cudaMemPrefetchAsync(ptr, count,
  cudaMemLocation location, unsigned flags, stream)`` (and dropped 12.x's ``_v2`` spelling). The loaded runtime is
  asked its version (``cudaRuntimeGetVersion``) and the prototype is declared to match.

The price of ctypes is that no header checks the prototypes: they are declared by hand below, from the CUDA
runtime API reference, and ``tests/kernels/test_cudart_binding.py`` checks the marshalling (the by-value
``cudaMemLocation`` included) against a stub library compiled with both prototypes.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
from collections.abc import Iterable

CUDA_SUCCESS = 0
MEM_ATTACH_GLOBAL = 0x01
MEM_ATTACH_HOST = 0x02
"""``cudaMallocManaged`` flags. bitsandbytes attaches paged buffers to the host; so does hf_optim."""

DEV_ATTR_MANAGED_MEMORY = 83
DEV_ATTR_CONCURRENT_MANAGED_ACCESS = 89
"""``cudaDeviceAttr`` values: managed memory at all, and prefetch/oversubscription (Linux, Pascal and later)."""

MEMORY_TYPE_MANAGED = 3
"""``cudaMemoryType`` of a ``cudaMallocManaged`` pointer, as ``cudaPointerGetAttributes`` reports it."""

MEM_LOCATION_TYPE_DEVICE = 1
LOCATION_API_VERSION = 13000
"""From this runtime version on, ``cudaMemPrefetchAsync`` takes a ``cudaMemLocation`` and flags."""


class CudaRuntimeError(RuntimeError):
    """A CUDA runtime call returned an error code."""


class MemLocation(ctypes.Structure):
    """``struct cudaMemLocation { enum cudaMemLocationType type; int id; }`` (passed by value)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class PointerAttributes(ctypes.Structure):
    """``struct cudaPointerAttributes`` as of CUDA 11+ (``type``, ``device``, two pointers).

    The trailing padding leaves room should a later runtime append fields: the runtime writes only what it
    knows, and a too-small buffer would be overwritten silently.
    """

    _fields_ = [
        ("type", ctypes.c_int),
        ("device", ctypes.c_int),
        ("device_pointer", ctypes.c_void_p),
        ("host_pointer", ctypes.c_void_p),
        ("_reserved", ctypes.c_char * 64),
    ]


def prefetch_argtypes(runtime_version: int) -> list:
    """ctypes argument types of ``cudaMemPrefetchAsync`` in the runtime of ``runtime_version`` (e.g. 12080)."""
    if runtime_version >= LOCATION_API_VERSION:
        return [ctypes.c_void_p, ctypes.c_size_t, MemLocation, ctypes.c_uint, ctypes.c_void_p]
    return [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]


def prefetch_arguments(runtime_version: int, ptr: int, nbytes: int, device: int, stream: int) -> tuple:
    """Arguments of ``cudaMemPrefetchAsync`` moving ``[ptr, ptr + nbytes)`` to GPU ``device`` on ``stream``."""
    if runtime_version >= LOCATION_API_VERSION:
        return (ptr, nbytes, MemLocation(MEM_LOCATION_TYPE_DEVICE, device), 0, stream or None)
    return (ptr, nbytes, device, stream or None)


def cudart_candidates(
    maps_text: str, cuda_version: str | None, search_dirs: Iterable[str], platform: str = sys.platform
) -> list[str]:
    """Where to look for the CUDA runtime, best first.

    1. a libcudart already mapped into this process (``maps_text`` is ``/proc/self/maps``): the one torch uses;
    2. the versioned soname (``libcudart.so.12``), which the dynamic loader resolves to the loaded copy;
    3. runtime libraries shipped next to torch or in the ``nvidia-cuda-runtime`` wheel (``search_dirs``).
    """
    candidates: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if re.search(r"/libcudart\.so(\.\d+)*$", path) and path not in candidates:
            candidates.append(path)
    major = (cuda_version or "").split(".")[0]
    if platform.startswith("win"):
        patterns = [f"cudart64_{major}*.dll"] if major else ["cudart64_*.dll"]
    else:
        if major:
            candidates.append(f"libcudart.so.{major}")
        patterns = [f"libcudart.so.{major}*" if major else "libcudart.so*"]
    for directory in search_dirs:
        for pattern in patterns:
            for path in sorted(glob.glob(os.path.join(directory, pattern))):
                if path not in candidates:
                    candidates.append(path)
    return candidates


def _search_dirs() -> list[str]:
    import torch

    dirs = [os.path.join(os.path.dirname(torch.__file__), "lib")]
    for entry in sys.path:
        dirs.append(os.path.join(entry, "nvidia", "cuda_runtime", "lib"))
        dirs.append(os.path.join(entry, "nvidia", "cu13", "lib"))
    return [d for d in dirs if os.path.isdir(d)]


class CudaRuntime:
    """The CUDA runtime library at ``path``, with the prototypes hf_optim uses declared for its version.

    Args:
        path: file name or path that ``ctypes.CDLL`` can open (default: found with :func:`cudart_candidates`).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lib = lib = ctypes.CDLL(path)
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaRuntimeGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaMallocManaged.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cudaPointerGetAttributes.argtypes = [ctypes.POINTER(PointerAttributes), ctypes.c_void_p]
        for function in ("cudaRuntimeGetVersion", "cudaMallocManaged", "cudaFree", "cudaDeviceGetAttribute",
                         "cudaPointerGetAttributes", "cudaMemPrefetchAsync"):
            getattr(lib, function).restype = ctypes.c_int  # cudaError_t
        version = ctypes.c_int(0)
        self._check(lib.cudaRuntimeGetVersion(ctypes.byref(version)), "cudaRuntimeGetVersion")
        self.version = version.value
        lib.cudaMemPrefetchAsync.argtypes = prefetch_argtypes(self.version)

    def _check(self, code: int, call: str) -> None:
        if code != CUDA_SUCCESS:
            message = self._lib.cudaGetErrorString(code)
            text = message.decode(errors="replace") if message else "unknown error"
            raise CudaRuntimeError(f"{call} failed with CUDA error {code}: {text} (runtime {self.path})")

    def malloc_managed(self, nbytes: int, flags: int = MEM_ATTACH_HOST) -> int:
        """``cudaMallocManaged``: a managed allocation of ``nbytes`` on the current device; returns its address."""
        ptr = ctypes.c_void_p()
        self._check(self._lib.cudaMallocManaged(ctypes.byref(ptr), nbytes, flags), f"cudaMallocManaged({nbytes})")
        return int(ptr.value or 0)

    def free(self, ptr: int) -> None:
        """``cudaFree`` (synchronizes the device, as cudaFree always does)."""
        self._check(self._lib.cudaFree(ptr), "cudaFree")

    def prefetch(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        """``cudaMemPrefetchAsync`` of ``[ptr, ptr + nbytes)`` to GPU ``device``, ordered on ``stream``."""
        arguments = prefetch_arguments(self.version, ptr, nbytes, device, stream)
        self._check(self._lib.cudaMemPrefetchAsync(*arguments), "cudaMemPrefetchAsync")

    def device_attribute(self, attribute: int, device: int) -> int:
        value = ctypes.c_int(0)
        self._check(self._lib.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device), "cudaDeviceGetAttribute")
        return value.value

    def pointer_type(self, ptr: int) -> int:
        """``cudaPointerGetAttributes(ptr).type`` (3 = managed, 2 = device, 1 = host, 0 = unregistered)."""
        attributes = PointerAttributes()
        self._check(self._lib.cudaPointerGetAttributes(ctypes.byref(attributes), ptr), "cudaPointerGetAttributes")
        return attributes.type


def load_cudart() -> CudaRuntime:
    """The CUDA runtime torch uses, or :class:`CudaRuntimeError` naming every place that was tried."""
    import torch

    try:
        with open("/proc/self/maps") as maps:
            maps_text = maps.read()
    except OSError:
        maps_text = ""
    tried = []
    for candidate in cudart_candidates(maps_text, torch.version.cuda, _search_dirs()):
        try:
            return CudaRuntime(candidate)
        except (OSError, AttributeError, CudaRuntimeError) as error:
            tried.append(f"{candidate}: {error}")
    raise CudaRuntimeError("no usable CUDA runtime library found; tried " + ("; ".join(tried) or "nothing"))
