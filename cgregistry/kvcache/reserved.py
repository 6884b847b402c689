"""Device memory whose address is fixed before it is backed: capture first, size the KV cache after.

Graphs bake in the addresses they read, so an engine allocates its KV cache before capture and must know what the
graphs will take (``reg.estimate_memory`` captures the plan once more).  ``ReservedMemory`` turns that round: reserve
the cache's whole address range with only a small head backed (the scratch block capture's padded rows write), capture,
then back as much as the device has left (``back_free``); the addresses never move, so the graphs stay valid.  On CUDA
this is the driver's virtual memory management (``cuMemAddressReserve``, ``cuMemCreate``, ``cuMemMap``, as in vLLM's
sleep mode; ``cgregistry.kvcache.vmm``, through the optional ``cuda-bindings``: ``pip install 'cgregistry[kvcache]'``).
On the ``cpu`` backend the range is one host allocation and backing is bookkeeping, so engine code runs in tests.

A kernel touching memory past ``backed_bytes`` faults on CUDA (the context is lost); newly backed memory holds
garbage, so zero what is read before it is written.  On CPU unbacked memory holds ``UNSET_BYTE`` (NaN in every float
dtype), so a test catches a read of a cell nobody wrote, and ``check_unbacked()`` a write where CUDA would fault.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import warnings
import threading
import weakref
from collections.abc import Sequence

import torch

from cgregistry.backends.cuda import DeviceSpan
from cgregistry.kvcache.vmm import CudaVmm

__all__ = ["CHUNK_BYTES", "CPU_GRANULARITY", "CPU_MARKED_MAX", "UNSET_BYTE", "ReservedMemory"]

# Physical memory is created in chunks of at most this many bytes, so that backing less gives whole chunks back.
CHUNK_BYTES = 1 << 30
# The granularity on the cpu backend: CUDA's usual one, so that rounding is exercised the same way in tests.
CPU_GRANULARITY = 2 << 20
# What newly backed host memory holds on the cpu backend (CUDA's is unspecified): 0xFF makes every float NaN.
UNSET_BYTE = 0xFF
# On the cpu backend, ranges up to this size also hold UNSET_BYTE where they are not backed, so that a write there (a
# fault on CUDA) is found by ``check_unbacked()`` and by the next ``back()``; a larger one is left untouched (filling
# it would make the whole host range resident).
CPU_MARKED_MAX = 1 << 30


def _round_up(nbytes: int, granularity: int) -> int:
    return -(-nbytes // granularity) * granularity


def _int_arg(name: str, value: object, least: int) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int (bytes), got {value!r}")
    try:
        value = operator.index(value)  # an int, or one of NumPy's
    except TypeError:
        raise TypeError(f"{name} must be an int (bytes), got {value!r}") from None
    if value < least:
        raise ValueError(f"{name} must be at least {least} bytes, got {value}")
    return value


class ReservedMemory:
    """``max_bytes`` of address space on ``device`` whose first ``backed_bytes`` are backed by memory; ``back()``
    and ``back_free()`` change how much is backed without moving anything.  ``view(dtype, shape)`` gives a tensor
    over the range from its start: hand it to the step before capture, back the rest after."""

    def __init__(self, max_bytes: int, device: torch.device | str | int = "cuda", backed_bytes: int = 0) -> None:
        self._max = _int_arg("max_bytes", max_bytes, 1)
        backed = _int_arg("backed_bytes", backed_bytes, 0)
        if backed > self._max:
            raise ValueError(f"backed_bytes={backed} is past the reserved range (max_bytes={self._max})")
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"device must be a cuda or cpu device, got {str(self.device)!r}")
        self._lock = threading.Lock()
        self._chunks: list[tuple[int, int, int]] = []  # (offset, bytes, driver handle; 0 on cpu), in address order
        self._vmm: CudaVmm | None = None
        if self.device.type == "cuda":
            self._vmm = vmm = CudaVmm(self.device.index)  # first: without cuda-bindings, ImportError saying what to install
            with torch.cuda.device(self.device):  # the device's primary context, current on this thread
                torch.cuda.mem_get_info(self.device)
                self.granularity = vmm.granularity()
                self._size = _round_up(self._max, self.granularity)
                self._ptr = vmm.reserve(self._size, self.granularity)
                self._release = weakref.finalize(self, _free_range, vmm, self._ptr, self._size, self._chunks, self.device)
                self._map_to(max(backed, 1))  # torch looks the pointer up: its first granule is backed
            self._span = DeviceSpan(self._ptr, self._max)
            self._tensor = torch.as_tensor(self._span, device=self.device)
            self._release.detach()
            self._finalizer = weakref.finalize(self._span, _free_range, vmm, self._ptr, self._size, self._chunks, self.device)
        else:
            self.granularity = CPU_GRANULARITY
            self._size = _round_up(self._max, self.granularity)
            self._tensor = torch.empty(self._max, dtype=torch.uint8)
            self._ptr = self._tensor.data_ptr()
            self._marked = self._max <= CPU_MARKED_MAX  # what is not backed holds UNSET_BYTE, so a write there is seen
            if self._marked:
                self._tensor.fill_(UNSET_BYTE)
            self._map_to(max(backed, 1))

    # ------------------------------------------------------------------ what it is

    @property
    def max_bytes(self) -> int:
        """The bytes the address range spans (``view`` may cover them all)."""
        return self._max

    @property
    def backed_bytes(self) -> int:
        """The bytes of the range, from its start, backed by memory (at most ``max_bytes``; the driver backs whole
        granules, so past ``max_bytes`` there may be more, outside the range)."""
        return min(self._mapped(), self._max)

    def _mapped(self) -> int:
        return self._chunks[-1][0] + self._chunks[-1][1] if self._chunks else 0

    def check_unbacked(self) -> None:
        """On the cpu backend, ranges up to ``CPU_MARKED_MAX``: raise ``RuntimeError`` naming the first byte past
        ``backed_bytes`` something wrote (a kernel doing that faults on CUDA)."""
        if self.device.type != "cpu" or not self._marked:
            return
        tail = self._tensor[self.backed_bytes:]
        written = (tail != UNSET_BYTE).nonzero()
        if written.numel():
            at = self.backed_bytes + int(written[0])
            raise RuntimeError(f"byte {at} of the reserved range was written, past backed_bytes={self.backed_bytes}: on "
                               "CUDA that write faults (back the memory first, and hand out only what is backed)")

    @property
    def data_ptr(self) -> int:
        """The range's first address: it never changes."""
        return self._ptr

    @property
    def tensor(self) -> torch.Tensor:
        """The whole range as bytes (uint8, ``max_bytes`` long)."""
        return self._tensor

    def view(self, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A tensor of ``dtype`` and ``shape`` over the range from its start (its bytes at most ``max_bytes``)."""
        shape = tuple(shape)
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in shape):
            raise ValueError(f"shape must be non-negative ints, got {shape}")
        need = math.prod(shape) * dtype.itemsize
        if need > self._max:
            raise ValueError(f"a {dtype} tensor of shape {shape} takes {need} bytes; the range is max_bytes={self._max}")
        return self._tensor[:need].view(dtype).view(shape)

    def __repr__(self) -> str:
        return (f"ReservedMemory({self.device}, {self.backed_bytes / 2**20:.1f} of {self._max / 2**20:.1f} MiB backed, "
                f"address {self._ptr:#x})")

    # ------------------------------------------------------------------ backing

    def back(self, nbytes: int) -> int:
        """Back the first ``nbytes`` (rounded up to the granularity; at least one granule) and return ``backed_bytes``.
        Less than now synchronizes the device, then gives back the chunks (at most ``CHUNK_BYTES`` each) wholly past
        ``nbytes``, their contents lost.  A failure (out of memory) leaves the backing as it was."""
        nbytes = _int_arg("nbytes", nbytes, 0)
        if nbytes > self._max:
            raise ValueError(f"nbytes={nbytes} is past the reserved range (max_bytes={self._max})")
        with self._lock:
            self._map_to(max(nbytes, 1))
            return self.backed_bytes

    def back_free(self, leave_bytes: int = 0) -> int:
        """Back as much more of the range as the device has free (as much as the driver gives), less ``leave_bytes``
        (what else the engine allocates: eager activations past the captured sizes); return ``backed_bytes``.  Free is
        ``torch.cuda.mem_get_info`` (call ``torch.cuda.empty_cache()`` first to hand over cached blocks), on CPU the
        host's available memory."""
        leave_bytes = _int_arg("leave_bytes", leave_bytes, 0)
        with self._lock:
            if self.device.type == "cuda":
                free = torch.cuda.mem_get_info(self.device)[0]
            else:
                try:
                    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                except (ValueError, OSError):  # a host that does not say: the whole range
                    free = self._size
            more = (max(free - leave_bytes, 0) // self.granularity) * self.granularity
            target = min(self._mapped() + more, self._size)
            if target > self._mapped():
                self._grow(target, as_far_as_it_goes=True)
            return self.backed_bytes

    def _map_to(self, nbytes: int) -> None:
        """Back exactly the chunks that cover the first ``nbytes`` (rounded up to the granularity)."""
        target = _round_up(nbytes, self.granularity)
        if target > self._mapped():
            self._grow(target)
        elif self._chunks and self._chunks[-1][0] >= target:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # nothing in flight reads what is given back
            while self._chunks and self._chunks[-1][0] >= target:
                offset, size, handle = self._chunks.pop()
                self._unmap(offset, size, handle)
            if self.device.type == "cpu" and self._marked:
                self._tensor[self.backed_bytes:].fill_(UNSET_BYTE)

    def _grow(self, target: int, as_far_as_it_goes: bool = False) -> None:
        """Back up to ``target``.  Out of memory: undo and raise, or (``as_far_as_it_goes``) try halves of the chunk
        down to one granule and keep what was backed (the driver refuses the last bytes ``mem_get_info`` calls free)."""
        if self.device.type == "cpu":
            self.check_unbacked()  # what is about to be backed must not have been written while it was not
        start = self._mapped()
        made: list[tuple[int, int, int]] = []
        try:
            offset = start
            while offset < target:
                size = min(CHUNK_BYTES, target - offset)
                while True:
                    try:
                        made.append((offset, size, self._map_chunk(offset, size)))
                        break
                    except torch.OutOfMemoryError:
                        if not as_far_as_it_goes:
                            raise
                        size = size // 2 // self.granularity * self.granularity
                        if size == 0:
                            break
                if size == 0:
                    break
                offset += size
        except BaseException:
            for offset, size, handle in reversed(made):
                self._unmap(offset, size, handle)
            raise
        self._chunks.extend(made)
        if self.device.type == "cpu" and not self._marked:
            self._tensor[start:self.backed_bytes].fill_(UNSET_BYTE)

    def _map_chunk(self, offset: int, size: int) -> int:
        if self._vmm is None:
            return 0
        with torch.cuda.device(self.device):
            return self._vmm.map(self._ptr + offset, size)

    def _unmap(self, offset: int, size: int, handle: int) -> None:
        if self._vmm is None:
            return
        with torch.cuda.device(self.device):
            self._vmm.unmap(self._ptr + offset, size, handle)


def _free_range(vmm: CudaVmm, ptr: int, size: int, chunks: list[tuple[int, int, int]], device: torch.device) -> None:
    """Unmap every chunk and give the address range back (no tensor over it is left).  Where that cannot be done
    safely (a capture in progress on this thread, which a device sync would break) or fails, the range is kept and a
    warning says so: memory lost, not memory freed under a running kernel."""
    try:
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError("a CUDA graph capture is in progress on this thread")
            torch.cuda.synchronize(device)  # nothing in flight reads it
            while chunks:
                offset, chunk, handle = chunks[-1]
                vmm.unmap(ptr + offset, chunk, handle)
                chunks.pop()
            vmm.free(ptr, size)
    except Exception as e:
        if not sys.is_finalizing():  # at interpreter exit the driver goes with the process
            warnings.warn(f"cgregistry: a ReservedMemory range at {ptr:#x} on {device} was not given back ({e}); its "
                          f"{sum(c[1] for c in chunks)} backed bytes stay taken", RuntimeWarning, stacklevel=2)
