"""The CUDA driver's virtual memory management, as ``ReservedMemory`` uses it, through NVIDIA's ``cuda-bindings``.

Reserve an address range (``cuMemAddressReserve``), create memory in chunks (``cuMemCreate``), map each into the
range (``cuMemMap``), make it device-readable and -writable (``cuMemSetAccess``); unmap, release and free to give it
back.  Every call acts on the calling thread's current context: the caller makes the device's primary context current
(``with torch.cuda.device(...)``).  ``cuda-bindings`` (``pip install 'cgregistry[kvcache]'``; torch's CUDA 13 Linux
wheels require it) is imported at the first CUDA reservation; its major version is the driver's CUDA major version.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

__all__ = ["CudaVmm", "driver"]


def driver() -> ModuleType:
    """``cuda.bindings.driver``, or ``ImportError`` saying what to install."""
    try:
        from cuda.bindings import driver as module
    except ImportError as e:
        raise ImportError("ReservedMemory on a CUDA device calls the CUDA driver through NVIDIA's cuda-bindings, which "
                          f"cannot be imported ({e}): pip install 'cgregistry[kvcache]', or cuda-bindings of the "
                          "driver's CUDA major version (torch's CUDA 13 wheels for Linux bring it along)") from e
    return module


class CudaVmm:
    """The calls for one device: pinned device memory of ``device_index``, readable and writable from it."""

    def __init__(self, device_index: int) -> None:
        self.driver = drv = driver()
        self.prop = drv.CUmemAllocationProp()
        self.prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device_index
        self.access = drv.CUmemAccessDesc()
        self.access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.location.id = device_index
        self.access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def check(self, result: tuple[Any, ...], call: str) -> Any:
        """The value a driver call returned with its ``CUresult`` (``None`` for a call that returns only the result), or
        its failure raised: ``torch.OutOfMemoryError`` where the driver is out of memory (a caller may back less and
        try again), ``RuntimeError`` otherwise; the message names ``call`` and the driver's error."""
        err, *values = result
        if err == self.driver.CUresult.CUDA_SUCCESS:
            return values[0] if values else None
        text = f"{call} failed: {getattr(err, 'name', err)}"
        if err == self.driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise torch.OutOfMemoryError(text)
        raise RuntimeError(text)

    def granularity(self) -> int:
        """The driver's recommended granularity: sizes, offsets and addresses here are multiples of it."""
        recommended = self.driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        result = self.driver.cuMemGetAllocationGranularity(self.prop, recommended)
        return int(self.check(result, "cuMemGetAllocationGranularity"))

    def reserve(self, size: int, alignment: int) -> int:
        """A new range of ``size`` bytes of address space, nothing mapped: its first address."""
        result = self.driver.cuMemAddressReserve(size, alignment, 0, 0)
        return int(self.check(result, f"cuMemAddressReserve({size} bytes)"))

    def free(self, ptr: int, size: int) -> None:
        """Give back a range ``reserve`` made (nothing in it mapped any more)."""
        self.check(self.driver.cuMemAddressFree(ptr, size), "cuMemAddressFree")

    def map(self, ptr: int, size: int) -> int:
        """Create ``size`` bytes of memory, map them at ``ptr`` and make them accessible: the allocation's handle (for
        ``unmap``).  A failure leaves nothing created or mapped."""
        drv = self.driver
        handle = self.check(drv.cuMemCreate(size, self.prop, 0), f"cuMemCreate({size} bytes)")
        try:
            self.check(drv.cuMemMap(ptr, size, 0, handle, 0), "cuMemMap")
            try:
                self.check(drv.cuMemSetAccess(ptr, size, [self.access], 1), "cuMemSetAccess")
            except BaseException:
                drv.cuMemUnmap(ptr, size)  # the error raised is the one above, whatever this returns
                raise
        except BaseException:
            drv.cuMemRelease(handle)
            raise
        return int(handle)

    def unmap(self, ptr: int, size: int, handle: int) -> None:
        """Unmap what ``map`` mapped at ``ptr`` and release its memory."""
        self.check(self.driver.cuMemUnmap(ptr, size), "cuMemUnmap")
        self.check(self.driver.cuMemRelease(handle), "cuMemRelease")
