"""Multi-process runs (gloo on CPU here, NCCL on two GPUs where present) and the agreement rule's oracle."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from cgregistry import BatchDescriptor as B
from cgregistry.distributed import decode_descriptor, encode_descriptor

from tests import distributed_worker


def _spawn(comm: str, world: int, tmp_path: object) -> None:
    init_file = str(tmp_path / "init")  # type: ignore[operator]
    mp.start_processes(distributed_worker.main, args=(world, comm, init_file), nprocs=world, join=True, start_method="spawn")


@pytest.mark.slow  # three spawned processes, each importing torch
def test_data_tensor_and_pipeline_parallel_with_gloo(tmp_path: object) -> None:
    _spawn("gloo", 3, tmp_path)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_data_tensor_and_pipeline_parallel_with_nccl(tmp_path: object) -> None:
    _spawn("nccl", 2, tmp_path)


descriptors = st.one_of(
    st.builds(lambda r, d, l: B.decode(r, spec_depth=d, num_active_loras=l), st.integers(1, 8), st.integers(0, 2), st.integers(0, 3)),
    st.builds(lambda t, r, l: B(t, min(r, t), l), st.integers(1, 24), st.integers(1, 24), st.integers(0, 3)),
    st.builds(lambda t: B(t), st.integers(1, 24)),
)


def _agreed(batches: list[B]) -> B:
    return decode_descriptor([max(column) for column in zip(*(encode_descriptor(b) for b in batches))])


@settings(max_examples=300, deadline=None)
@given(st.lists(descriptors, min_size=1, max_size=4))
def test_agreed_descriptor_is_the_least_one_covering_every_rank(batches: list[B]) -> None:
    agreed = _agreed(batches)
    for b in batches:
        # covering as a key would: any key that covers ``agreed`` then covers every rank's batch
        assert agreed.num_tokens >= b.num_tokens and agreed.num_active_loras >= b.num_active_loras
        assert agreed.num_reqs is None or (b.num_reqs is not None and agreed.num_reqs >= b.num_reqs)
        if agreed.uniform:
            assert b.uniform and b.spec_depth == agreed.spec_depth
    # least: brute force over candidate descriptors no larger in any field
    assert agreed.num_tokens == max(b.num_tokens for b in batches)
    assert agreed.num_active_loras == max(b.num_active_loras for b in batches)
    if all(b.num_reqs is not None for b in batches):
        assert agreed.num_reqs == max(b.num_reqs for b in batches)  # type: ignore[type-var]
    else:
        assert agreed.num_reqs is None
    all_uniform_same_depth = all(b.uniform for b in batches) and len({b.spec_depth for b in batches}) == 1
    assert agreed.uniform == all_uniform_same_depth
    assert _agreed(batches) == _agreed(batches[::-1]), "rank order does not matter"


def test_one_rank_agrees_with_itself() -> None:
    for b in (B.decode(4), B(9, 3), B(5), B.decode(2, spec_depth=2, num_active_loras=1)):
        assert _agreed([b]) == b
