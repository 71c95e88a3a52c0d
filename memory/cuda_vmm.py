"""CUDA memory that outlives its process: the driver's virtual memory management API, through
ctypes on libcuda.so.1 (no new dependency).

    arena = VmmArena.create(nbytes, device_index=0)     # cuMemCreate + reserve + map
    fd = arena.export_fd()                               # a POSIX descriptor of the memory
    other = VmmArena.import_fd(fd, nbytes, 0)            # here or in another process
    other.tensor()                                       # [nbytes] uint8 over the same memory

Memory from cuMemCreate with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR lives while any process
holds a handle to it: an allocation handle, a mapping, or the exported descriptor (which the
service manager's store can keep across a daemon restart, as it keeps the CPU pool's file).
cudaMalloc memory (today's CUDA IPC path, `kv_memory.py`) dies with the process that allocated
it. An arena reserves a virtual range, maps the allocation there and grants read-write access
to its device; `tensor()` views it through __cuda_array_interface__ (no copy), the arena owning
the mapping: close it only once no tensor is used (`owned_tensor()` closes it when the last view
is gone).

The daemon allocates its CUDA pool here with restore = auto (daemon/memory/kv_memory.py), and
runners import it (memory/attach.py, kind "cuda_vmm"). Not run in CI (no GPU here):
tests/memory/test_cuda_vmm.py and tests/daemon/memory/test_vmm_memory.py are gpu-marked, and
benchmarks/gpu_check.py runs them on a device.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

# CUmemAllocationType, CUmemAllocationHandleType, CUmemLocationType, CUmemAccess_flags,
# CUmemAllocationGranularity_flags: the values this module uses (cuda.h).
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CudaVmmError(RuntimeError):
    """A driver call failed; the message names it and its CUresult."""


class _Location(ctypes.Structure):
    """CUmemLocation."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    """CUmemAllocationProp.allocFlags."""

    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    """CUmemAllocationProp."""

    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""

    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaVmmError(f"no CUDA driver (libcuda.so.1): {exc}") from None


def _check(name: str, result: int) -> None:
    if result != 0:  # CUDA_SUCCESS
        raise CudaVmmError(f"{name} failed with CUresult {result}")


def _prop(device_index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _Location(CU_MEM_LOCATION_TYPE_DEVICE, device_index)
    return prop


class VmmArena:
    """One VMM allocation of `nbytes` (rounded up to the driver's granularity) mapped at a
    reserved virtual range of this process, readable and writable by its device."""

    def __init__(self, handle: int, nbytes: int, size: int, device_index: int) -> None:
        # The driver, the allocation handle (CUmemGenericAllocationHandle) and its device.
        self._cuda, self._handle, self.device_index = _driver(), handle, device_index
        # Bytes asked for, and bytes allocated and mapped (a multiple of the granularity).
        self.nbytes, self._size = nbytes, size
        # Start of the mapping (a CUdeviceptr); 0 once closed.
        self._address = self._map()

    @classmethod
    def create(cls, nbytes: int, device_index: int) -> VmmArena:
        """A new allocation of at least `nbytes` on device `device_index` (contents undefined:
        the caller zeroes it)."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        cuda, prop = _start(device_index), _prop(device_index)
        size = _granular_size(cuda, prop, nbytes)
        handle = ctypes.c_ulonglong()
        _check("cuMemCreate", cuda.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size),
                                               ctypes.byref(prop), ctypes.c_ulonglong(0)))
        return cls(handle.value, nbytes, size, device_index)

    @classmethod
    def import_fd(cls, fd: int, nbytes: int, device_index: int) -> VmmArena:
        """The allocation an exported descriptor `fd` names (the caller keeps `fd`)."""
        cuda, prop = _start(device_index), _prop(device_index)
        size = _granular_size(cuda, prop, nbytes)
        handle = ctypes.c_ulonglong()
        # For a POSIX descriptor the "OS handle" argument is the descriptor's value.
        _check("cuMemImportFromShareableHandle", cuda.cuMemImportFromShareableHandle(
            ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
        return cls(handle.value, nbytes, size, device_index)

    def export_fd(self) -> int:
        """A new POSIX descriptor of the allocation, owned by the caller."""
        fd = ctypes.c_int(-1)
        _check("cuMemExportToShareableHandle", self._cuda.cuMemExportToShareableHandle(
            ctypes.byref(fd), ctypes.c_ulonglong(self._handle),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0)))
        return fd.value

    def tensor(self) -> torch.Tensor:
        """The first nbytes of the mapping as a [nbytes] uint8 tensor of its device."""
        return torch.as_tensor(self._array(), device=torch.device("cuda", self.device_index))

    def owned_tensor(self) -> torch.Tensor:
        """`tensor()`, and the arena closed once no view of it is left (a runner's mapping of
        a pool it drops when its daemon is replaced: the old allocation is freed)."""
        array = self._array()
        weakref.finalize(array, self.close)  # torch holds `array` while any view is alive
        return torch.as_tensor(array, device=torch.device("cuda", self.device_index))

    def close(self) -> None:
        """Unmap, free the range and drop this process's handle; idempotent. The memory lives
        on while another handle, mapping or exported descriptor holds it."""
        if not self._address:
            return
        address, size = ctypes.c_ulonglong(self._address), ctypes.c_size_t(self._size)
        self._address = 0
        _check("cuMemUnmap", self._cuda.cuMemUnmap(address, size))
        _check("cuMemAddressFree", self._cuda.cuMemAddressFree(address, size))
        _check("cuMemRelease", self._cuda.cuMemRelease(ctypes.c_ulonglong(self._handle)))

    def _array(self) -> _CudaArray:
        if not self._address:
            raise ValueError("the VMM arena is closed")
        return _CudaArray(self._address, self.nbytes)

    def _map(self) -> int:
        """Reserve a range, map the allocation there, grant its device read-write access."""
        address, size = ctypes.c_ulonglong(), ctypes.c_size_t(self._size)
        _check("cuMemAddressReserve", self._cuda.cuMemAddressReserve(
            ctypes.byref(address), size, ctypes.c_size_t(0), ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0)))
        _check("cuMemMap", self._cuda.cuMemMap(address, size, ctypes.c_size_t(0),
                                               ctypes.c_ulonglong(self._handle),
                                               ctypes.c_ulonglong(0)))
        access = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.device_index),
                             CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        _check("cuMemSetAccess", self._cuda.cuMemSetAccess(address, size, ctypes.byref(access),
                                                           ctypes.c_size_t(1)))
        return address.value


class _CudaArray:
    """A device range in the __cuda_array_interface__ form torch.as_tensor reads (no copy)."""

    def __init__(self, address: int, nbytes: int) -> None:
        # The interface: one dimension of nbytes unsigned bytes at `address`, writable.
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 2,
            "strides": None}


def _start(device_index: int) -> ctypes.CDLL:
    """The driver, with torch's primary context of the device current on this thread."""
    torch.cuda.set_device(device_index)
    torch.empty(0, device=torch.device("cuda", device_index))  # makes the context current
    return _driver()


def _granular_size(cuda: ctypes.CDLL, prop: _AllocationProp, nbytes: int) -> int:
    granularity = ctypes.c_size_t()
    _check("cuMemGetAllocationGranularity", cuda.cuMemGetAllocationGranularity(
        ctypes.byref(granularity), ctypes.byref(prop), CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    step = granularity.value
    return -(-nbytes // step) * step
