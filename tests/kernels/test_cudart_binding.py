"""The ctypes layer of paging, without a GPU: library discovery, version branching, and the marshalling of every
call into a stub libcudart compiled here with the CUDA 12 and the CUDA 13 prototypes (the C compiler that the
compiled CPU path already needs). The stub records what it receives, so a wrong argtype or a struct passed the
wrong way shows up as a wrong recorded value."""

import contextlib
import ctypes
import shutil
import subprocess

import pytest
import torch

from hf_optim.paging import cudart, managed

STUB = r"""
#include <stdlib.h>
#include <stddef.h>

struct location { int type; int id; };
struct attributes { int type; int device; void *device_pointer; void *host_pointer; };

static size_t last_count, last_size;
static void *last_ptr, *last_stream, *last_freed;
static int last_device, last_location_type, last_flags = -1;
static unsigned last_alloc_flags;

int cudaRuntimeGetVersion(int *version) { *version = RUNTIME_VERSION; return 0; }
const char *cudaGetErrorString(int code) { return code == 2 ? "out of memory" : "stub error"; }
int cudaMallocManaged(void **ptr, size_t size, unsigned flags) {
    if (size > ((size_t)1 << 40)) return 2;
    last_size = size; last_alloc_flags = flags; *ptr = malloc(size); return 0;
}
int cudaFree(void *ptr) { last_freed = ptr; free(ptr); return 0; }
int cudaDeviceGetAttribute(int *value, int attribute, int device) { *value = attribute * 10 + device; return 0; }
int cudaPointerGetAttributes(struct attributes *out, const void *ptr) {
    out->type = 3; out->device = 1; out->device_pointer = (void *)ptr; out->host_pointer = (void *)ptr; return 0;
}
#if RUNTIME_VERSION >= 13000
int cudaMemPrefetchAsync(const void *ptr, size_t count, struct location where, unsigned flags, void *stream) {
    last_ptr = (void *)ptr; last_count = count; last_location_type = where.type; last_device = where.id;
    last_flags = (int)flags; last_stream = stream; return 0;
}
#else
int cudaMemPrefetchAsync(const void *ptr, size_t count, int device, void *stream) {
    last_ptr = (void *)ptr; last_count = count; last_device = device; last_stream = stream; return 0;
}
#endif
void *stub_last_ptr(void) { return last_ptr; }
size_t stub_last_count(void) { return last_count; }
int stub_last_device(void) { return last_device; }
int stub_last_location_type(void) { return last_location_type; }
int stub_last_flags(void) { return last_flags; }
void *stub_last_stream(void) { return last_stream; }
void *stub_last_freed(void) { return last_freed; }
size_t stub_last_size(void) { return last_size; }
unsigned stub_last_alloc_flags(void) { return last_alloc_flags; }
"""


@pytest.fixture(scope="module", params=[12080, 13000], ids=["cuda12", "cuda13"])
def stub(request, tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stub runtime")
    directory = tmp_path_factory.mktemp(f"cudart{request.param}")
    source, library = directory / "stub.c", directory / "libcudart_stub.so"
    source.write_text(STUB)
    subprocess.run(
        [compiler, "-shared", "-fPIC", f"-DRUNTIME_VERSION={request.param}", "-o", str(library), str(source)],
        check=True,
    )
    runtime = cudart.CudaRuntime(str(library))
    probe = ctypes.CDLL(str(library))
    for name in ("stub_last_ptr", "stub_last_stream", "stub_last_freed"):
        getattr(probe, name).restype = ctypes.c_void_p
    for name in ("stub_last_count", "stub_last_size"):
        getattr(probe, name).restype = ctypes.c_size_t
    probe.stub_last_alloc_flags.restype = ctypes.c_uint
    return runtime, probe


def test_runtime_version_selects_the_prefetch_prototype(stub):
    runtime, _ = stub
    takes_location = runtime.version >= 13000
    assert (cudart.MemLocation in runtime._lib.cudaMemPrefetchAsync.argtypes) is takes_location


def test_prefetch_passes_pointer_size_device_and_stream(stub):
    runtime, probe = stub
    runtime.prefetch(0x7F0000001000, 3 << 30, 2, 0xABC0)
    assert probe.stub_last_ptr() == 0x7F0000001000
    assert probe.stub_last_count() == 3 << 30  # size_t: sizes above 4 GiB survive
    assert probe.stub_last_device() == 2
    assert probe.stub_last_stream() == 0xABC0
    if runtime.version >= 13000:
        assert probe.stub_last_location_type() == cudart.MEM_LOCATION_TYPE_DEVICE and probe.stub_last_flags() == 0
    runtime.prefetch(0x1000, 10, 0, 0)  # torch's default stream is handle 0: passed as NULL
    assert probe.stub_last_stream() is None


def test_malloc_free_attributes_and_errors(stub):
    runtime, probe = stub
    ptr = runtime.malloc_managed(4096)
    assert ptr and probe.stub_last_size() == 4096 and probe.stub_last_alloc_flags() == cudart.MEM_ATTACH_HOST
    assert runtime.pointer_type(ptr) == cudart.MEMORY_TYPE_MANAGED
    runtime.free(ptr)
    assert probe.stub_last_freed() == ptr
    assert runtime.device_attribute(cudart.DEV_ATTR_CONCURRENT_MANAGED_ACCESS, 3) == 89 * 10 + 3
    with pytest.raises(cudart.CudaRuntimeError, match=r"cudaMallocManaged\(2199023255552\) failed with CUDA error "
                       r"2: out of memory"):
        runtime.malloc_managed(2 << 40)


def test_managed_buffer_registers_wraps_and_frees(stub, monkeypatch):
    runtime, probe = stub
    current = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: current.append(index) or contextlib.nullcontext())
    buffer = managed.ManagedBuffer(runtime, 5000, device=1)
    ptr = buffer.ptr
    assert current == [1] and managed.live_buffers()[ptr] == 5000
    assert buffer.__cuda_array_interface__ == {"shape": (5000,), "typestr": "|u1", "data": (ptr, False), "version": 2}
    del buffer
    assert ptr not in managed.live_buffers() and probe.stub_last_freed() == ptr


def test_prefetch_arguments_by_version():
    old = cudart.prefetch_arguments(12040, 0x10, 256, 1, 7)
    assert old == (0x10, 256, 1, 7)
    new = cudart.prefetch_arguments(13000, 0x10, 256, 1, 0)
    assert new[:2] == (0x10, 256) and new[3:] == (0, None)
    assert (new[2].type, new[2].id) == (cudart.MEM_LOCATION_TYPE_DEVICE, 1)
    assert ctypes.sizeof(cudart.MemLocation) == 8


def test_candidates_prefer_the_runtime_torch_mapped():
    maps = "\n".join([
        "7f00-7f10 r-xp 00000000 08:01 123   /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12",
        "7f10-7f20 r--p 00010000 08:01 123   /opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12",
        "7f20-7f30 rw-p 00000000 00:00 0",
        "7f30-7f40 r-xp 00000000 08:01 124   /usr/lib/libcudart_static_helper.so",
    ])
    assert cudart.cudart_candidates(maps, "12.8", [], platform="linux") == [
        "/opt/venv/nvidia/cuda_runtime/lib/libcudart.so.12", "libcudart.so.12"
    ]
    assert cudart.cudart_candidates("", "13.0", [], platform="linux") == ["libcudart.so.13"]
    assert cudart.cudart_candidates("", None, [], platform="linux") == []
