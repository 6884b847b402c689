"""What one agreement costs on the CPU: the host agreement's page against its gloo fallback, and a bare gloo all-reduce.

Spawns ``--ranks`` processes (default 2) on one gloo group, one thread each; every rank makes ``--calls`` calls of each
way, back to back (each after a barrier and a warm-up), timing each call; rank 0 prints the median, 90th percentile
and mean of its own calls:

- a bare ``dist.all_reduce`` (MAX) of 16 int64s: what ``transport="group"`` is built on;
- ``HostAgreement(transport="group").agree()``: that all-reduce, with its timeout and the descriptor's encoding;
- ``HostAgreement(transport="shm").agree()``: the shared-memory page.

    PYTHONPATH=. python benchmarks/agreement_cpu.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cgregistry import BatchDescriptor as B
from cgregistry.distributed import HostAgreement


def timed(call: Callable[[], object], calls: int) -> str:
    """Median, 90th percentile and mean of ``calls`` calls, in microseconds."""
    for _ in range(300):
        call()
    dist.barrier()
    ns = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        call()
        ns.append(time.perf_counter_ns() - start)
    ns.sort()
    return f"p50 {ns[calls // 2] / 1e3:8.1f} us   p90 {ns[calls * 9 // 10] / 1e3:8.1f} us   mean {sum(ns) / calls / 1e3:8.1f} us"


def rank_main(rank: int, world: int, init_file: str, calls: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        values, batch = torch.zeros(16, dtype=torch.int64), B.decode(4)
        group, shm = HostAgreement(same_batch=True, transport="group"), HostAgreement(same_batch=True, transport="shm")
        rows = [
            ("gloo all_reduce, 16 int64", timed(lambda: dist.all_reduce(values, op=dist.ReduceOp.MAX), calls)),
            ("HostAgreement(transport='group')", timed(lambda: group.agree(batch), calls)),
            ("HostAgreement(transport='shm')", timed(lambda: shm.agree(batch), calls)),
        ]
        if rank == 0:
            print(f"{world} ranks, {calls} calls each, load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
            for name, row in rows:
                print(f"{name:34} {row}", flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(args.ranks, os.path.join(tmp, "init"), args.calls), nprocs=args.ranks,
                           join=True, start_method="spawn")


if __name__ == "__main__":
    main()
