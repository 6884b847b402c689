"""Capture first, size the KV cache after: an address range reserved before capture and backed after it keeps
the graphs valid, on the cpu backend and on CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cgregistry as cg
import cgregistry.kvcache.reserved as reserved
import cgregistry.kvcache.vmm as vmm
from cgregistry.kvcache import ReservedMemory
from cgregistry.kvcache.vmm import CudaVmm
from tests.conftest import BACKENDS, device_of

MiB = 1 << 20
ROOT = Path(__file__).parent.parent.parent


def test_backing_rounds_to_the_granularity_and_never_moves_the_address() -> None:
    memory = ReservedMemory(64 * MiB, device="cpu")
    start, view = memory.data_ptr, memory.view(torch.float32, (16 * MiB // 4, 4))
    assert memory.backed_bytes == memory.granularity == reserved.CPU_GRANULARITY, "one granule is backed from the start"
    assert memory.back(5 * MiB + 1) == 6 * MiB
    assert memory.back_free() == 64 * MiB, "what the host has free, at most the whole range"
    assert memory.data_ptr == start == view.data_ptr() == memory.tensor.data_ptr()
    assert view.shape == (4 * MiB, 4) and memory.view(torch.bfloat16, (32 * MiB,)).data_ptr() == start


def test_giving_back_keeps_the_chunks_that_cover_what_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reserved, "CHUNK_BYTES", 4 * MiB)
    memory = ReservedMemory(32 * MiB, device="cpu")
    assert memory.back(10 * MiB) == 10 * MiB  # chunks of 2 (the first granule), 4, 4 MiB
    assert memory.back(5 * MiB) == 6 * MiB, "the chunk holding byte 5 MiB stays whole"
    assert memory.back(0) == 2 * MiB, "the first granule stays backed"
    assert memory.back(30 * MiB) == 30 * MiB


def test_newly_backed_memory_holds_no_zeros_on_cpu() -> None:
    """CUDA gives no promise about what new memory holds; the cpu backend fills it with NaN bytes, so a step that reads
    a cache cell nobody wrote fails its test instead of reading a lucky zero."""
    memory = ReservedMemory(8 * MiB, device="cpu")
    cache = memory.view(torch.float32, (2 * MiB,))
    cache[: memory.backed_bytes // 4].zero_()
    before = memory.backed_bytes
    memory.back(8 * MiB)
    assert cache[: before // 4].eq(0).all(), "what was backed keeps its contents"
    assert cache[before // 4:].isnan().all()


def test_a_write_past_what_is_backed_is_found_on_cpu_as_cuda_would_fault_on_it() -> None:
    """On CUDA a kernel touching memory not backed faults; on the cpu backend the unbacked bytes hold a mark, so
    ``check_unbacked()`` and the next ``back()`` name the first byte written there, and memory given back is marked
    again."""
    memory = ReservedMemory(8 * MiB, device="cpu")
    memory.check_unbacked()
    memory.tensor[memory.backed_bytes + 10] = 0
    with pytest.raises(RuntimeError, match=rf"byte {2 * MiB + 10} of the reserved range was written, past backed_bytes="):
        memory.check_unbacked()
    with pytest.raises(RuntimeError, match=rf"byte {2 * MiB + 10} "):
        memory.back(4 * MiB)
    memory.tensor[memory.backed_bytes + 10] = reserved.UNSET_BYTE
    memory.back(6 * MiB)
    memory.tensor[: memory.backed_bytes].zero_()
    memory.back(2 * MiB)  # chunks of 2 and 4 MiB: the second is given back, and marked again
    memory.check_unbacked()
    assert memory.view(torch.float32, (2 * MiB,))[MiB // 2:].isnan().all(), "what was given back reads as unset"


def test_backed_bytes_never_counts_past_the_range_and_leave_bytes_is_kept_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """A range that is no whole number of granules reports the bytes of it backed, not the granule past its end (a
    row count taken from it would index past the tensor); back_free() leaves what it is asked to (of a host that says
    it has 40 MiB available: the real figure moves with every other process)."""
    memory = ReservedMemory(1000 * 256, device="cpu")
    assert memory.back_free() == memory.max_bytes == 256_000
    rows = memory.view(torch.float32, (1000, 64))
    assert memory.backed_bytes // (64 * 4) == rows.shape[0]

    class Size:  # an integer type of another library (NumPy's int64, say)
        def __index__(self) -> int:
            return 4 * MiB

    page = 4096
    monkeypatch.setattr(reserved.os, "sysconf", lambda name: {"SC_AVPHYS_PAGES": 40 * MiB // page, "SC_PAGE_SIZE": page}[name])
    large = ReservedMemory(64 * MiB, device="cpu")
    backed = large.backed_bytes
    assert large.back_free(leave_bytes=16 * MiB) == backed + 24 * MiB, "what the host has, less what it keeps, backed more"
    assert ReservedMemory(64 * MiB, device="cpu").back(Size()) == 4 * MiB


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda: ReservedMemory(True, device="cpu"), TypeError, r"max_bytes must be an int \(bytes\), got True"),
    (lambda: ReservedMemory(0, device="cpu"), ValueError, r"max_bytes must be at least 1 bytes, got 0"),
    (lambda: ReservedMemory(MiB, device="cpu", backed_bytes=-1), ValueError, r"backed_bytes must be at least 0 bytes, got -1"),
    (lambda: ReservedMemory(MiB, device="cpu", backed_bytes=MiB + 1), ValueError,
     r"backed_bytes=1048577 is past the reserved range \(max_bytes=1048576\)"),
    (lambda: ReservedMemory(MiB, device="meta"), ValueError, r"device must be a cuda or cpu device, got 'meta'"),
    (lambda: ReservedMemory(4 * MiB, device="cpu").back(5 * MiB), ValueError, r"nbytes=5242880 is past the reserved range"),
    (lambda: ReservedMemory(4 * MiB, device="cpu").back(1.5), TypeError, r"nbytes must be an int \(bytes\), got 1.5"),
    (lambda: ReservedMemory(4 * MiB, device="cpu").back_free(-1), ValueError, r"leave_bytes must be at least 0 bytes"),
    (lambda: ReservedMemory(4 * MiB, device="cpu").view(torch.float32, (MiB + 1,)), ValueError,
     r"takes 4194308 bytes; the range is max_bytes=4194304"),
    (lambda: ReservedMemory(4 * MiB, device="cpu").view(torch.float32, (2, -1)), ValueError, r"shape must be non-negative ints"),
])
def test_bad_arguments_name_themselves(call, error, message) -> None:
    with pytest.raises(error, match=message):
        call()


def test_a_cuda_reservation_without_cuda_bindings_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda-bindings is an optional dependency: the cpu backend never imports it, and a CUDA reservation without it
    raises ImportError naming what to install, before it touches the device (so here too, without a GPU)."""
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # importing it now fails, as where it is not installed
    assert ReservedMemory(4 * MiB, device="cpu").back(4 * MiB) == 4 * MiB
    with pytest.raises(ImportError, match=r"through NVIDIA's cuda-bindings, which cannot be imported .*"
                                          r"pip install 'cgregistry\[kvcache\]', or cuda-bindings of the driver's CUDA major"):
        ReservedMemory(4 * MiB, device="cuda:0")


def test_driver_failures_name_the_call_and_the_error() -> None:
    """The allocation properties are cuda-bindings' own structures, and a failed driver call raises naming the call
    and the driver's error: out of memory as torch.OutOfMemoryError (what back_free() backs less on), anything else
    as RuntimeError."""
    driver = pytest.importorskip("cuda.bindings.driver")
    calls = CudaVmm(3)
    assert (calls.prop.type, calls.prop.location.type, calls.prop.location.id) == (
        driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED, driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE, 3)
    assert (calls.access.location.id, calls.access.flags) == (3, driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    assert calls.check((driver.CUresult.CUDA_SUCCESS, 7), "cuMemCreate") == 7
    assert calls.check((driver.CUresult.CUDA_SUCCESS,), "cuMemUnmap") is None
    with pytest.raises(torch.OutOfMemoryError, match=r"^cuMemCreate\(4096 bytes\) failed: CUDA_ERROR_OUT_OF_MEMORY$"):
        calls.check((driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemCreate(4096 bytes)")
    with pytest.raises(RuntimeError, match=r"^cuMemMap failed: CUDA_ERROR_INVALID_VALUE$") as raised:
        calls.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,), "cuMemMap")
    assert not isinstance(raised.value, torch.OutOfMemoryError)


class RecordingDriver:
    """cuda.bindings.driver's types, with driver calls that record their arguments and fail where ``fail`` says."""

    def __init__(self, real: object, fail: dict[str, str]) -> None:
        self.real, self.fail, self.calls = real, fail, []

    def __getattr__(self, name: str) -> object:
        if not name.startswith("cuMem"):
            return getattr(self.real, name)

        def call(*args: object) -> tuple[object, ...]:
            self.calls.append((name, args))
            err = getattr(self.real.CUresult, self.fail.get(name, "CUDA_SUCCESS"))
            return (err, self.real.CUmemGenericAllocationHandle(77)) if name == "cuMemCreate" else (err,)

        return call


@pytest.mark.parametrize(("fail", "error", "message", "undone"), [
    ({}, None, None, []),
    ({"cuMemCreate": "CUDA_ERROR_OUT_OF_MEMORY"}, torch.OutOfMemoryError, r"cuMemCreate\(4194304 bytes\) failed", []),
    ({"cuMemMap": "CUDA_ERROR_OUT_OF_MEMORY"}, torch.OutOfMemoryError, r"cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY",
     ["cuMemRelease"]),
    ({"cuMemSetAccess": "CUDA_ERROR_INVALID_DEVICE", "cuMemUnmap": "CUDA_ERROR_INVALID_VALUE"}, RuntimeError,
     r"cuMemSetAccess failed: CUDA_ERROR_INVALID_DEVICE", ["cuMemUnmap", "cuMemRelease"]),
])
def test_a_chunk_that_fails_to_map_leaves_nothing_created_or_mapped(monkeypatch: pytest.MonkeyPatch, fail, error, message,
                                                                     undone) -> None:
    """Backing a chunk is three calls (create, map, set access); where one fails, what the others did is undone and its
    own error is the one raised (a failed undo does not hide it), so a failed back() keeps no memory."""
    driver = RecordingDriver(pytest.importorskip("cuda.bindings.driver"), fail)
    monkeypatch.setattr(vmm, "driver", lambda: driver)
    calls, ptr, size = CudaVmm(0), 0x7F0000000000, 4 * MiB
    if error is None:
        assert calls.map(ptr, size) == 77
    else:
        with pytest.raises(error, match=message):
            calls.map(ptr, size)
    made = ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    made = made[: made.index(next(iter(fail))) + 1] if fail else made
    assert [name for name, _ in driver.calls] == made + undone
    args = dict(driver.calls)
    assert args["cuMemCreate"] == (size, calls.prop, 0)
    if "cuMemMap" in args:
        assert args["cuMemMap"][:3] == (ptr, size, 0) and int(args["cuMemMap"][3]) == 77 and args["cuMemMap"][4] == 0
    if "cuMemSetAccess" in args:
        assert args["cuMemSetAccess"] == (ptr, size, [calls.access], 1)
    if "cuMemRelease" in args:
        assert int(args["cuMemRelease"][0]) == 77


def _paged_step(cache: torch.Tensor):
    """An engine's step over a paged cache: write each token's row at its slot, read back every row of its request's
    slots (a toy attention), so a cell written at the wrong address or never backed shows in the output."""

    def step(batch: cg.BatchDescriptor, x: torch.Tensor, slots: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(0, slots, x * 2.0)
        return cache[ctx].sum(1) + x

    return step


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphs_captured_before_the_cache_was_backed_serve_it_after(backend: str) -> None:
    """The engine recipe: the cache reserved for its most rows with only the scratch row's granule backed, the plan
    captured, then the rest backed (and zeroed) and requests served at rows far past what was backed at capture:
    every step equals the same step run eagerly on a cache allocated whole."""
    device, width = device_of(backend), 256
    rows = 8192  # 8 MiB of float32 rows: four granules past the first
    memory = ReservedMemory(rows * width * 4, device=device)
    cache = memory.view(torch.float32, (rows, width))
    cache[: memory.backed_bytes // (width * 4)].zero_()  # row 0: the scratch row padded tokens write
    inputs = {"x": cg.StaticInput((8, width), torch.float32, axis="tokens"),
              "slots": cg.StaticInput((8,), torch.int64, axis="tokens", fill=0),
              "ctx": cg.StaticInput((8, 4), torch.int64, axis="tokens", fill=0)}
    reg = cg.GraphRegistry(_paged_step(cache), inputs, backend=backend)
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=8, mode="full"))
    first = memory.backed_bytes
    assert memory.back_free() == memory.max_bytes > first
    cache[first // (width * 4):].zero_()
    oracle = torch.zeros(rows, width, device=device)
    eager = _paged_step(oracle)
    gen = torch.Generator().manual_seed(0)
    for n in (3, 5, 8, 1):
        slots = torch.randperm(rows - 1, generator=gen)[:n].add(1).to(device)
        ctx = torch.cat([slots[:, None], torch.randint(0, rows, (n, 3), generator=gen).to(device)], 1)
        x = torch.randn(n, width, generator=gen).to(device)
        got = reg.run(cg.BatchDescriptor.decode(n), x=x, slots=slots, ctx=ctx).clone()
        want = eager(cg.BatchDescriptor.decode(n), x, slots, ctx)
        torch.testing.assert_close(got, want)
    assert reg.stats().hits == 4 and reg.stats().misses == 0
    torch.testing.assert_close(cache, oracle)


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", [
    "device_memory_follows_the_backing_and_comes_back_when_the_last_view_goes",
    "back_free_takes_what_the_device_has_left_to_the_granule",
    "back_refuses_more_than_the_device_has_and_backs_nothing_more",
])
def test_device_memory_measured_in_a_process_of_its_own(scenario: str) -> None:
    """Device memory follows back() and back_free() to the granule and comes back with the last view; a back()
    past what the device has backs nothing more (tests/memory/reserved_memory_worker.py, one process each: what
    other tests free meanwhile would move the measurement)."""
    done = subprocess.run([sys.executable, "-m", "tests.memory.reserved_memory_worker", scenario], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
