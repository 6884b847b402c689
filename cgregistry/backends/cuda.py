"""The ``cuda`` backend: torch.cuda.CUDAGraph, every graph of a registry in one pool.

Captured outputs are held through non-owning aliases, so the pool may hand their memory to the next (smaller) capture;
an output is valid until the next replay of any graph in the pool, which is the registry's contract anyway.
"""

from __future__ import annotations

import contextlib
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from cgregistry.contracts import runtime
from cgregistry.contracts.markers import hookimpl

if TYPE_CHECKING:
    from cgregistry.contracts.registrars import BackendRegistrar

__all__ = ["CudaBackend", "CudaGraph", "CudaSegment", "DeviceSpan", "clear_cublas_workspaces", "direct_replay", "non_owning_alias"]


def _reserved_bytes() -> int:
    """What torch.cuda.memory_reserved() says, without flattening every allocator statistic (it is called per segment)."""
    return int(torch._C._cuda_memoryStats(torch.cuda.current_device())["reserved_bytes"]["all"]["current"])


class DeviceSpan:
    """A bare device address range, exposed through __cuda_array_interface__ and owning nothing (the tensors torch makes
    over it keep it alive, so a finalizer on it runs once the last of them is gone)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2,
                                         "strides": None}


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep the allocator block alive."""
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return t
    raw = torch.as_tensor(DeviceSpan(storage.data_ptr(), storage.nbytes()), device=t.device)
    return raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


_C_GRAPH = getattr(torch._C, "_CUDAGraph", None)
# The code of the torch CUDAGraph.replay wrappers known to do nothing but call the C++ replay when the graph has no
# input-liveness tracker: torch 2.11 (``super().replay()``) and 2.13 (the tracker check first).  Any other code,
# a decorated or patched wrapper included, is called as it is.
_KNOWN_WRAPPERS = frozenset({("super", "replay"), ("_tracker", "check_alive", "pool", "super", "replay")})


def _known_wrapper(wrapper: Any) -> bool:
    code = getattr(wrapper, "__code__", None)
    return (
        code is not None and code.co_names in _KNOWN_WRAPPERS and code.co_freevars == ("__class__",)
        and not any(isinstance(const, types.CodeType) for const in code.co_consts)
    )


def direct_replay(graph: Any, wrapper: Callable[..., None] | None = None, c_replay: Any = None) -> Callable[[], None]:
    """``graph``'s C++ replay as a bound method, without torch's Python wrapper where the wrapper has nothing to do.

    ``CUDAGraph.replay``'s only other work is the input-liveness check, never on here (its frame's cost: docs/
    performance.md).  Kept for a graph with a tracker, a subclass, and unknown wrapper code (a later torch, a patched
    ``replay``); decided once, after capture.  ``wrapper``/``c_replay``: stand-ins for tests."""
    if wrapper is None:
        if type(graph) is not torch.cuda.CUDAGraph:
            return graph.replay
        wrapper = torch.cuda.CUDAGraph.replay
    if c_replay is None:
        c_replay = getattr(_C_GRAPH, "replay", None)
    if c_replay is None or getattr(graph, "_tracker", None) is not None:
        return graph.replay
    if wrapper is not c_replay and not _known_wrapper(wrapper):
        return graph.replay
    return types.MethodType(c_replay, graph)  # a pybind11 function has no __get__: bind it this way


class CudaGraph:
    """One captured torch.cuda.CUDAGraph; ``replay`` is its C++ replay, bound (``direct_replay``)."""

    __slots__ = ("graph", "replay", "memory_bytes")

    def __init__(self, graph: torch.cuda.CUDAGraph, memory_bytes: int) -> None:
        self.graph = graph
        self.replay = direct_replay(graph)
        self.memory_bytes = memory_bytes


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces, so the next GEMM allocates a fresh one.  A captured GEMM bakes in its
    workspace's address, left to cuBLAS an eager block of a per-stream cache that other code clears (``reduce-overhead``
    compiles, newer torch on graph destruction), after which a replay writes into whatever owns it.  Cleared before a
    capture, the workspace comes from the registry's pool (alive as long as its graphs); cleared after, eager work does
    not keep using a block of the pool."""
    torch._C._cuda_clearCublasWorkspaces()


def _wait_for(stream: torch.cuda.Stream) -> None:
    """Wait for what a capture queued: the whole device in a capture() of the engine's own (between steps, nothing
    queued it would wait for), only the capture's own ``stream`` for a capture between the engine's steps (a piece
    inside ``run()``), where a device-wide sync would wait for every step the engine has queued."""
    if runtime.between_steps.get():
        stream.synchronize()
    else:
        torch.cuda.synchronize()


# What CUDA says when a side stream forked from the capture stream was not joined back before the capture ended
# (cudaErrorStreamCaptureUnjoined: "capture sequence contains a fork that was not joined to the primary stream").
_UNJOINED = ("not joined", "unjoined", "StreamCaptureUnjoined")


class CudaSegment:
    """One capture in progress: ``end()`` finishes it, ``abort()`` abandons it after an error.  Captured in thread-local
    mode: other threads' allocations, replays and stream syncs stay legal; a device-wide sync on any thread while a
    segment is open fails in CUDA (docs/background.md lists what an engine must not do during a capture)."""

    def __init__(self, backend: CudaBackend, pool: object) -> None:
        self.backend = backend
        self.pool = pool
        self.before = _reserved_bytes()
        self.graph = torch.cuda.CUDAGraph()
        clear_cublas_workspaces()  # this capture allocates its own, in the pool
        self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")

    def end(self) -> CudaGraph:
        clock, began = runtime.phase_clock.get(), time.perf_counter()
        try:
            self.graph.capture_end()
        except RuntimeError as exc:
            self.backend._poisoned.add(self.pool)
            if any(word in str(exc) for word in _UNJOINED):
                raise RuntimeError(
                    f"a side stream forked from the capture stream was not joined back before the capture ended ({exc}); "
                    "call torch.cuda.current_stream().wait_stream(side) after the side stream's work") from exc
            raise
        except BaseException:
            self.backend._poisoned.add(self.pool)
            raise
        finally:
            if clock is not None:  # inline: a capture walks no more modules for it
                clock["instantiate"] += time.perf_counter() - began
            clear_cublas_workspaces()  # eager work after the capture must not use a block of the pool
        # The allocator may give cached blocks back to the driver mid-capture (retrying an allocation): never below 0.
        return CudaGraph(self.graph, max(0, _reserved_bytes() - self.before))

    def abort(self) -> None:
        """End a capture the step broke; remember the pool if the capture was invalidated."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "The CUDA Graph is empty": expected when the step failed early
                self.graph.capture_end()
        except Exception:  # invalidated by the step's own error, which is the news
            self.backend._poisoned.add(self.pool)
        finally:
            clear_cublas_workspaces()


class CudaBackend:
    """CUDA graphs on the current device, warm-up and capture on one side stream."""

    name = "cuda"

    def __init__(self) -> None:
        self._streams = threading.local()  # .bound: the streams of the pool this thread captures into (streams_of)
        self._poisoned: set[object] = set()
        self._owned: weakref.WeakKeyDictionary[Any, types.SimpleNamespace] = weakref.WeakKeyDictionary()
        self._keeper_lock = threading.Lock()
        self._keeper_streams: dict[int, torch.cuda.Stream] = {}  # per device

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def new_pool(self) -> object:
        return torch.cuda.graph_pool_handle()

    def keep_pool(self, pool: object) -> Any:
        """What keeps ``pool`` taking captures while it lives, whatever its graphs do (a pool whose graphs all died takes
        no capture): a one-kernel graph captured into it on this thread's device, which holds it in the device and
        pinned host allocators alike (a ``torch.cuda.MemPool`` holds only the device one)."""
        keeper, cell = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda")
        with self._keeper_lock:  # one stream a device for every keeper (a new one each time would cycle through
            device = torch.cuda.current_device()  # torch's stream pool onto streams other threads launch on)
            stream = self._keeper_streams.get(device)
            if stream is None:
                stream = self._keeper_streams[device] = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                keeper.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    cell.add_(1)
                finally:
                    keeper.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
        return keeper, cell

    @contextlib.contextmanager
    def streams_of(self, owner: Any) -> Iterator[None]:
        """This thread warms up and captures on the streams kept for ``owner`` (a pool, whose lock lets one capture
        at a time use them), made on first use: the caching allocator hands a capture only the free blocks of its
        pool that came from the same stream, so captures on one thread's streams and then another's would not
        reuse each other's memory."""
        streams = self._owned.get(owner)
        if streams is None:
            streams = self._owned[owner] = types.SimpleNamespace()
        before = getattr(self._streams, "bound", None)
        self._streams.bound = streams
        try:
            yield
        finally:
            self._streams.bound = before

    def _side_stream(self) -> torch.cuda.Stream:
        streams = getattr(self._streams, "bound", None) or self._streams
        stream = getattr(streams, "side", None)
        if stream is None:
            stream = streams.side = torch.cuda.Stream()
        return stream

    def warmup(self, fn: Callable[[], Any], runs: int) -> Any:
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        out = None
        with torch.cuda.stream(stream):
            for _ in range(max(runs, 1)):
                out = fn()
        torch.cuda.current_stream().wait_stream(stream)
        _wait_for(stream)
        return out

    @contextlib.contextmanager
    def capture_context(self) -> Iterator[None]:
        """Run capture (and the eager work between segments) on the side stream, then join it back."""
        _wait_for(torch.cuda.current_stream())
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            torch.cuda.current_stream().wait_stream(stream)
            _wait_for(stream)

    def begin_capture(self, pool: object) -> CudaSegment:
        """Start capturing into ``pool`` on the current stream; ``end()`` gives the graph."""
        return CudaSegment(self, pool)

    def capture(self, fn: Callable[[], Any], pool: object) -> tuple[CudaGraph, Any]:
        with self.capture_context():
            segment = self.begin_capture(pool)
            try:
                out = fn()
            except BaseException:
                segment.abort()
                raise
            graph = segment.end()
        return graph, out

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

    def hold_intermediates(self, tensors: list[torch.Tensor], pool: object) -> list[torch.Tensor]:
        """Non-owning aliases for the tensors in ``pool`` (its graphs own them); the rest as they are."""
        pool_id = tuple(pool)  # type: ignore[call-overload]
        spans = [
            (seg["address"], seg["address"] + seg["total_size"])
            for seg in torch.cuda.memory_snapshot()
            if tuple(seg.get("segment_pool_id", ())) == pool_id
        ]

        def in_pool(t: torch.Tensor) -> bool:
            ptr = t.untyped_storage().data_ptr()
            return t.is_cuda and any(start <= ptr < end for start, end in spans)

        return [non_owning_alias(t) if in_pool(t) else t for t in tensors]

    def synchronize(self) -> None:
        _wait_for(torch.cuda.current_stream())

    def device_memory(self) -> tuple[int, int]:
        """Bytes in use on the device (``mem_get_info``: every allocation, the driver's own included) and bytes the caching
        allocator holds (``memory_reserved``)."""
        free, total = torch.cuda.mem_get_info()
        return total - free, _reserved_bytes()

    def live_bytes(self) -> int:
        """Bytes of live tensors in the caching allocator (``memory_allocated``): what a capture keeps alive, such as the
        results kept between eager breaks, shows here and not in a pool's growth."""
        return torch.cuda.memory_allocated()

    def release_cached(self) -> None:
        """The caching allocator's unused blocks back to the driver (after a registry freed its graphs and inputs)."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@hookimpl
def cgregistry_register_backends(register: BackendRegistrar) -> None:
    register(CudaBackend())
