"""Agreement on the host (``HostAgreement``): several processes on gloo (CPU) and NCCL (GPUs), and its arguments."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from cgregistry.distributed import HostAgreement

from tests import agreement_worker


def _spawn(comm: str, world: int, tmp_path: object) -> None:
    init_file = str(tmp_path / "init")  # type: ignore[operator]
    mp.start_processes(agreement_worker.main, args=(world, comm, init_file), nprocs=world, join=True, start_method="spawn")


@pytest.mark.slow  # spawned processes, each importing torch
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_the_host_refuse_different_batches_and_a_late_rank(world: int, tmp_path: object) -> None:
    _spawn("gloo", world, tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ranks_agree_on_the_host_with_nccl(tmp_path: object) -> None:
    _spawn("nccl", 2, tmp_path)


def test_it_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match="needs torch.distributed to be initialised"):
        HostAgreement()
