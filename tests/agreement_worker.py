"""One rank of the host-agreement tests (gloo on CPU, NCCL on GPUs): tensor-parallel serving through a
``HostAgreement``, a rank handed another batch, a rank that does not come, data-parallel padding.

Run by tests/distributed/test_host_agreement.py through torch.multiprocessing; each scenario checks itself and
raises on any mismatch, which fails the parent.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.distributed import HostAgreement, decode_descriptor, encode_descriptor
from cgregistry.errors import AgreementError
from cgregistry.testing import make_plugins
from tests.distributed_worker import join

D = 12  # divisible by 2, 3 and 4 ranks


def tensor_parallel(rank: int, world: int, device: torch.device, backend: str, transport: str) -> None:
    """Every rank is handed the same batch; one all-reduce inside the graph; agreement on the host."""
    full_w = torch.randn(D, D, generator=torch.Generator().manual_seed(1)).to(device)
    cols = D // world
    w_rank = full_w[rank * cols : (rank + 1) * cols].contiguous()

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        partial = x[:, rank * cols : (rank + 1) * cols] @ w_rank
        dist.all_reduce(partial)
        return torch.relu(partial)

    agreement = HostAgreement(dist.group.WORLD, same_batch=True, transport=transport)
    assert agreement.transport == transport, agreement
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16, D), torch.float32)}, backend=backend, plugins=make_plugins())
    reg.capture([(B(n), "full") for n in (16, 8, 4)])
    g = torch.Generator().manual_seed(7)  # the same batches on every rank
    for _ in range(12):
        n = int(torch.randint(1, 17, (1,), generator=g))
        x = torch.randn(n, D, generator=g).to(device)
        out = reg.run(B(n), x=x, group=agreement)
        torch.testing.assert_close(out, torch.relu(x @ full_w))
    hits = reg.stats().hits
    assert hits == 12, reg.stats()

    # one rank handed another batch: every rank raises, naming each rank's batch, and nothing is replayed
    mine = B(5) if rank != world - 1 else B(6)
    x = torch.randn(mine.num_tokens, D).to(device)
    with pytest.raises(AgreementError, match=rf"rank {world - 1}: Batch\(tokens=6") as info:
        reg.run(mine, x=x, group=agreement)
    assert "different batches" in str(info.value), info.value
    assert reg.stats().hits == hits
    # the group goes on serving after the refused step
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(3)).to(device)
    torch.testing.assert_close(reg.run(B(3), x=x, group=agreement), torch.relu(x @ full_w))


def data_parallel(rank: int, world: int, device: torch.device, backend: str, transport: str) -> None:
    """Different batches per rank: every rank gets the least descriptor covering all of them, the same key."""
    agreement = HostAgreement(dist.group.WORLD, transport=transport)
    cases = [
        [B.decode(3), B.decode(5), B.decode(2), B.decode(1)],
        [B.decode(3), B(7, 4), B.decode(1), B.decode(2)],
        [B.decode(2, spec_depth=1), B.decode(2), B.decode(1), B(1)],
        [B(9, 2, 1), B.decode(4, num_active_loras=2), B(3), B(1, 1)],
    ]
    for case in cases:
        agreed = agreement.agree(case[rank])
        oracle = decode_descriptor([max(column) for column in zip(*(encode_descriptor(b) for b in case[:world]))])
        assert agreed == oracle, (rank, agreed, oracle)


def late_rank(rank: int, world: int, device: torch.device, backend: str, transport: str) -> None:
    """A rank that never reaches a step: the others raise after the timeout instead of hanging (on shared memory,
    naming it); one that comes after the others gave up raises too, and so does every later step on every rank."""
    group = dist.new_group(list(range(world)), backend="gloo")  # a group of its own: a timed-out one serves no more
    agreement = HostAgreement(group, same_batch=True, timeout=1.0, transport=transport)
    if rank != world - 1:
        # on shared memory: the first to time out names the late rank; the others may see it give up first
        named = rf"rank\(s\) {world - 1} of the group, which did not reach this step|gave up" if transport == "shm" else "waited 1 s"
        with pytest.raises(AgreementError, match=named):
            agreement.agree(B.decode(2))
    if transport == "shm":  # the late rank comes, after the others gave up: it does not go on alone
        dist.barrier()
        with pytest.raises(AgreementError, match="gave up at its step|did not reach this step"):
            agreement.agree(B.decode(2))
        with pytest.raises(AgreementError):
            agreement.agree(B.decode(2))


def bad_arguments(rank: int, world: int, device: torch.device, backend: str, transport: str) -> None:
    """Arguments and descriptors the agreement cannot carry are named (no collective is entered for them)."""
    with pytest.raises(ValueError, match="timeout=True"):
        HostAgreement(dist.group.WORLD, timeout=True)
    with pytest.raises(TypeError, match="same_batch='no'"):
        HostAgreement(dist.group.WORLD, same_batch="no")  # type: ignore[arg-type]
    if backend == "cuda":  # an NCCL group: the group transport is refused for what it is
        with pytest.raises(ValueError, match="transport='group'\\) agrees by one all-reduce a step on the CPU, which "
                                             "needs a gloo group .*; this group's backend is 'nccl'"):
            HostAgreement(dist.group.WORLD, transport="group")
    agreement = HostAgreement(dist.group.WORLD, transport="shm")
    with pytest.raises(TypeError, match="needs a BatchDescriptor"):
        agreement.agree(5)  # type: ignore[arg-type]
    # a mixed batch's speculative depth is not part of its key: the ranks get what the integers decode to, alike
    assert agreement.agree(B(8, 4, spec_depth=3) if rank else B(8, 4)) == B(8, 4)
    # a descriptor too large for the page: that rank is told why, the others do not wait out the timeout
    if rank == 0:
        with pytest.raises(ValueError, match="32-bit"):
            agreement.agree(B(2**31))
    else:
        with pytest.raises(AgreementError, match="gave up"):
            agreement.agree(B(4))


def main(rank: int, world: int, comm: str, init_file: str) -> None:
    device, backend = join(rank, world, comm, init_file)
    try:
        transports = ("shm", "group") if comm == "gloo" else ("shm",)
        for transport in transports:
            for scenario in (tensor_parallel, data_parallel):
                scenario(rank, world, device, backend, transport)
                dist.barrier()
        bad_arguments(rank, world, device, backend, "shm")
        dist.barrier()
        for transport in transports:  # last: a timed-out gloo group may not serve another collective
            late_rank(rank, world, device, backend, transport)
    finally:
        gc.collect()
        dist.destroy_process_group()
