"""KV-cache memory: device memory whose address is fixed before it is backed, so an engine captures first and sizes
its KV cache after (``ReservedMemory``; on CUDA the driver's virtual memory management, in ``vmm``).  Not a graph
backend: the graphs only read and write it."""

from __future__ import annotations

from cgregistry.kvcache.reserved import ReservedMemory

__all__ = ["ReservedMemory"]
