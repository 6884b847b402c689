"""Child process for tests/memory/test_reserved_memory.py: device memory measured around ReservedMemory calls, in a
process of its own (memory other tests' graphs and threads free meanwhile moves ``mem_get_info``).

``python -m tests.memory.reserved_memory_worker SCENARIO``; exits 0 when every assertion holds.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from cgregistry.kvcache import ReservedMemory

MiB = 1 << 20


def _free(device: torch.device) -> int:
    """The device's free bytes, the caching allocator's idle blocks handed back first."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _change(device: torch.device, call: object) -> int:
    """The device memory ``call()`` takes (negative: gives back), measured just around it: the device is shared with
    other processes (a test run's own), so a window as short as the call keeps their work out of the figure."""
    before = _free(device)
    call()  # type: ignore[operator]
    return before - _free(device)


def device_memory_follows_the_backing_and_comes_back_when_the_last_view_goes() -> None:
    device = torch.device("cuda")
    memory = ReservedMemory(1 << 30, device=device)
    view = memory.view(torch.uint8, (1 << 30,))
    taken = _change(device, lambda: memory.back(512 * MiB))
    assert 510 * MiB <= taken <= 510 * MiB + 32 * MiB, taken / MiB  # (the first granule was backed already)
    given = -_change(device, lambda: memory.back(0))
    assert 510 * MiB - 32 * MiB <= given <= 510 * MiB + 32 * MiB, given / MiB
    memory.back(256 * MiB)
    view[: 256 * MiB].fill_(3)
    assert int(view[: 256 * MiB].sum(dtype=torch.int64)) == 3 * 256 * MiB
    refs = [memory]
    memory = None
    assert abs(_change(device, refs.clear)) <= 32 * MiB, "a view keeps the memory it reads"
    views = [view]
    view = None
    assert -_change(device, views.clear) >= 256 * MiB - 32 * MiB, "the last view gone, the range goes back"


def back_free_takes_what_the_device_has_left_to_the_granule() -> None:
    device = torch.device("cuda")
    total = torch.cuda.mem_get_info(device)[1]
    for leave in (1 << 30, 0):
        held = [ReservedMemory(total, device=device)]
        held[0].back_free(leave_bytes=leave)
        left = _free(device)
        assert leave <= left <= leave + 64 * MiB, f"{left / MiB:.0f} MiB left, asked to leave {leave / MiB:.0f}"
        backed = held[0].backed_bytes
        held[0].tensor[backed - MiB: backed].fill_(1)  # the last backed bytes are memory
        torch.cuda.synchronize(device)
        assert -_change(device, held.clear) >= backed - 64 * MiB, "dropped, the memory goes back"


def back_refuses_more_than_the_device_has_and_backs_nothing_more() -> None:
    device = torch.device("cuda")
    total = torch.cuda.mem_get_info(device)[1]
    memory = ReservedMemory(2 * total, device=device)

    def too_much() -> None:
        with pytest.raises(torch.OutOfMemoryError, match="cuMemCreat"):
            memory.back(total + (1 << 30))

    assert abs(_change(device, too_much)) <= 32 * MiB and memory.backed_bytes == memory.granularity, "a failed back() keeps nothing"
    memory.back_free()
    assert _free(device) <= 64 * MiB, "back_free backs what the driver gives, and keeps it"


if __name__ == "__main__":
    globals()[sys.argv[1]]()
