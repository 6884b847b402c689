"""Data-parallel agreement: every rank of a group replays the same key, with one small collective.

Ranks of a data-parallel group run different batches, but collectives inside
the step (an expert-parallel all-to-all, a tensor-parallel all-reduce within
each replica) need every rank to run the same graph.  ``agree`` all-reduces
the descriptor's encoding (MAX; ``BatchDescriptor.encode``) and returns the smallest descriptor every rank's batch fits
in: the most tokens, requests and LoRA slots any rank has, and uniform only if
every rank's batch is uniform with the same speculative depth.  Matching that
descriptor gives every rank the same key, padded to the largest need, of the
weakest kind any rank can use (a mixed batch anywhere means a mixed key
everywhere) -- provided every rank captured the same plan.
"""

from __future__ import annotations

from typing import Any

import torch

from cgregistry.key.descriptor import BatchDescriptor

__all__ = ["agree", "decode_descriptor", "encode_descriptor"]


def encode_descriptor(actual: BatchDescriptor) -> list[int]:
    """``actual`` as the integers ``agree()`` all-reduces with MAX (:meth:`BatchDescriptor.encode`)."""
    return actual.encode()


def decode_descriptor(values: list[int]) -> BatchDescriptor:
    """The descriptor of all-reduced integers: one that covers the batch of every rank encoded into them."""
    return BatchDescriptor.from_encoded(values)


def agree(actual: BatchDescriptor, group: Any = None) -> BatchDescriptor:
    """The descriptor covering every rank's ``actual`` in ``group`` (one all_reduce of a few int64s).

    The tensor lives on the current CUDA device for NCCL groups and on the CPU
    otherwise (gloo).  Every rank must call it, in the same order as its other
    collectives.
    """
    import torch.distributed as dist

    if not isinstance(actual, BatchDescriptor):
        raise TypeError(f"agree() needs a BatchDescriptor, got {actual!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("agree(group=...) needs torch.distributed to be initialised (init_process_group)")
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    values = torch.tensor(encode_descriptor(actual), dtype=torch.int64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return decode_descriptor(values.tolist())
