"""One rank of the multi-process tests (gloo on CPU, NCCL on GPUs): data, tensor and pipeline parallel.

Run by tests/distributed/test_distributed.py through torch.multiprocessing; each scenario
checks itself against eager and raises on any mismatch, which fails the parent.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as all_reduce_alias  # bound before any capture
from torch.utils._python_dispatch import _disable_current_modes

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins

D = 12  # divisible by 2 and 3 ranks


def weights(device: torch.device, seed: int) -> torch.Tensor:
    return torch.randn(D, D, generator=torch.Generator().manual_seed(seed)).to(device)


def data_parallel(rank: int, world: int, device: torch.device, backend: str) -> None:
    """Different batches per rank; with group=..., every rank replays the same key, padded to the largest need."""
    w = weights(device, 0)
    keys_seen: list[object] = [None] * world

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((32, D), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture(cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=32, mode="full_and_breakable"))
    g = torch.Generator().manual_seed(100 + rank)
    cases = [
        [B.decode(3), B.decode(5), B.decode(2)],  # all uniform: a uniform key for the largest
        [B.decode(3), B(7, 4), B.decode(1)],  # one mixed batch: a mixed key for everyone
        [B.decode(2, spec_depth=1), B.decode(2), B.decode(1)],  # different depths: mixed
    ]
    padding = 0
    for case in cases:
        mine = case[rank % len(case)]
        x = torch.randn(mine.num_tokens, D, generator=g).to(device)
        match = reg.match(mine, group=dist.group.WORLD)
        dist.all_gather_object(keys_seen, (match.key, match.strategy) if match else None)
        assert len(set(keys_seen)) == 1, f"ranks disagree on the key: {keys_seen}"
        wanted = [c for c in case[:world]] + [case[i % len(case)] for i in range(len(case), world)]
        for other in wanted:
            assert match.key.covers(other), f"{match.key} does not cover {other}"
        if any(not c.uniform for c in wanted) or len({c.spec_depth for c in wanted}) > 1:
            assert not match.key.uniform, "a mixed batch on any rank means a mixed key on every rank"
        out = reg.run(mine, x=x, group=dist.group.WORLD)
        torch.testing.assert_close(out, step(mine, x))
        padding += match.key.num_tokens - mine.num_tokens  # this rank's own padding, not the agreed one's
        assert reg.match(mine) is not None
    stats = reg.stats()
    assert stats.hits == len(cases) and stats.misses == 0, stats
    assert sum(e.padded_tokens for e in reg.entries()) == padding


def tensor_parallel(rank: int, world: int, device: torch.device, backend: str) -> None:
    """A row-parallel layer: each rank holds a slice of the weight, the step all-reduces inside the graph."""
    full_w = weights(device, 1)
    cols = D // world
    w_rank = full_w[rank * cols : (rank + 1) * cols].contiguous()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        partial = x[:, rank * cols : (rank + 1) * cols] @ w_rank
        dist.all_reduce(partial)  # captured into the graph on every rank
        return torch.relu(partial)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16, D), torch.float32)}, backend=backend, plugins=make_plugins())
    # Capture order rule: every rank captures the same plan in the same order.
    reg.capture([(B(n), "full") for n in (16, 8, 4)])
    for n, seed in ((3, 1), (8, 2), (13, 3)):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed)).to(device)  # same on every rank
        out = reg.run(B(n), x=x)
        torch.testing.assert_close(out, torch.relu(x @ full_w), rtol=1e-4, atol=1e-4)


def pipeline_parallel(rank: int, world: int, device: torch.device, backend: str) -> None:
    """Two stages: rank 0's step output is sent as is; rank 1 takes it as a static input of its step."""
    if rank > 1:
        return
    w0, w1 = weights(device, 2), weights(device, 3)
    if rank == 0:
        reg = cg.GraphRegistry(lambda b, x: torch.tanh(x @ w0), {"x": cg.StaticInput((16, D), torch.float32)},
                               backend=backend, plugins=make_plugins())
    else:
        reg = cg.GraphRegistry(lambda b, hidden: hidden @ w1, {"hidden": cg.StaticInput((16, D), torch.float32)},
                               backend=backend, plugins=make_plugins())
    reg.capture([(B(n), "full") for n in (16, 8)])
    for n, seed in ((5, 4), (16, 5), (2, 6)):
        x = torch.randn(n, D, generator=torch.Generator().manual_seed(seed)).to(device)
        if rank == 0:
            hidden = reg.run(B(n), x=x)  # a view of graph memory: send it before the next run()
            dist.send(hidden.contiguous(), dst=1)
        else:
            hidden = torch.empty(n, D, device=device)
            dist.recv(hidden, src=0)
            out = reg.run(B(n), hidden=hidden)
            torch.testing.assert_close(out, torch.tanh(x @ w0) @ w1, rtol=1e-4, atol=1e-4)


def emulator_records_collectives_and_refuses_one_it_could_not_see(rank: int, world: int, device: torch.device,
                                                                   backend: str) -> None:
    """On the cpu emulator a collective is recorded however it is called (an alias bound before any capture
    included) and replays; one that ran where the emulator could not see it is a capture error, never a silent skip
    at replay."""
    if backend != "cpu":
        return

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        all_reduce_alias(y)
        return y

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture([(B(8), "full")])
    x = torch.full((8,), float(rank + 1))
    torch.testing.assert_close(reg.run(B(8), x=x), torch.full((8,), 2.0 * sum(range(1, world + 1))))
    assert reg.stats().hits == 1

    def hidden(batch: B, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        with _disable_current_modes():  # out of the emulator's sight
            dist.all_reduce(y)
        return y

    reg = cg.GraphRegistry(hidden, {"x": cg.StaticInput((8,), torch.float32)}, backend=backend, plugins=make_plugins())
    with pytest.raises(cg.CaptureError, match=r"1 collective\(s\) ran on the default process group during capture but the emulator recorded 0"):
        reg.capture([(B(8), "full")])
    assert len(reg) == 0


def join(rank: int, world: int, comm: str, init_file: str) -> tuple[torch.device, str]:
    """This process as ``rank`` of the group (NCCL: its own GPU), and the device and cgregistry backend it serves on."""
    if comm == "nccl":
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "cuda"
    else:
        device, backend = torch.device("cpu"), "cpu"
    dist.init_process_group(comm, init_method=f"file://{init_file}", rank=rank, world_size=world)
    return device, backend


def main(rank: int, world: int, comm: str, init_file: str) -> None:
    device, backend = join(rank, world, comm, init_file)
    try:
        for scenario in (data_parallel, tensor_parallel, pipeline_parallel, emulator_records_collectives_and_refuses_one_it_could_not_see):
            scenario(rank, world, device, backend)
            dist.barrier()
    finally:
        gc.collect()  # registries (reference cycles) holding the group go while it is up, not at interpreter exit
        dist.destroy_process_group()
    if os.environ.get("CGREGISTRY_DIST_VERBOSE"):
        print(f"rank {rank}/{world} ({comm}): data, tensor and pipeline parallel checks passed", flush=True)
