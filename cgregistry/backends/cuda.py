"""The ``cuda`` backend: torch.cuda.CUDAGraph, every graph of a registry in one pool.

Captured outputs are held through non-owning aliases, so the pool may hand
their memory to the next (smaller) capture; an output is valid until the next
replay of any graph in the pool, which is the registry's contract anyway.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from cgregistry.hookspecs import hookimpl

_CG_INTERNAL = True

__all__ = ["CudaBackend", "CudaGraph", "non_owning_alias"]


class _DeviceSpan:
    """A bare device address range, exposed through __cuda_array_interface__ and owning nothing."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 2,
            "strides": None,
        }


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep the allocator block alive."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return t
    raw = torch.as_tensor(_DeviceSpan(storage.data_ptr(), storage.nbytes()), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


class CudaGraph:
    """One captured torch.cuda.CUDAGraph; ``replay`` is the graph's own bound method."""

    __slots__ = ("graph", "replay", "memory_bytes")

    def __init__(self, graph: torch.cuda.CUDAGraph, memory_bytes: int) -> None:
        self.graph = graph
        self.replay = graph.replay
        self.memory_bytes = memory_bytes


class CudaBackend:
    """CUDA graphs on the current device, warm-up and capture on one side stream."""

    name = "cuda"

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._poisoned: set[object] = set()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def warmup(self, fn: Callable[[], Any], runs: int) -> Any:
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        out = None
        with torch.cuda.stream(stream):
            for _ in range(max(runs, 1)):
                out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return out

    def capture(self, fn: Callable[[], Any], pool: object) -> tuple[CudaGraph, Any]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=pool)
            try:
                out = fn()
            except BaseException:
                self._abandon(graph, pool)
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._poisoned.add(pool)
                raise
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        return CudaGraph(graph, torch.cuda.memory_reserved() - before), out

    def _abandon(self, graph: torch.cuda.CUDAGraph, pool: object) -> None:
        """End a capture the step broke; remember the pool if the capture was invalidated."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty": expected when the step failed early
                graph.capture_end()
        except Exception:  # invalidated by the step's own error, which is the news
            self._poisoned.add(pool)

    def recover_pool(self, pool: object) -> object:
        # An invalidated capture (a host sync inside it, say) makes CUDAGraph.capture_end
        # raise before the caching allocator is told the capture is over; every later
        # capture into that pool then fails with "already recording to mempool_id"
        # (seen on torch 2.11).  Graphs already captured keep the old pool; new ones get
        # a fresh pool, at the cost of not sharing memory with the old one.
        if pool in self._poisoned:
            self._poisoned.discard(pool)
            return self.new_pool()
        return pool

    def share_outputs(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        return [non_owning_alias(t) for t in leaves]

    def synchronize(self) -> None:
        torch.cuda.synchronize()


@hookimpl
def cgregistry_register_backends(register: Callable[[Any], None]) -> None:
    register(CudaBackend())
