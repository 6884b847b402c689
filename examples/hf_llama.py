"""A Hugging Face Llama served through cgregistry, as an engine would, every logit checked against HF.

A ``LlamaForCausalLM`` built from a ``LlamaConfig`` (random weights, no download) runs an engine
loop with continuous batching and chunked prefill over requests of the bundled Azure trace.  Its
attention is registered through transformers' attention interface: a paged KV cache with a scratch
slot for padded rows, varlen metadata (``query_start_loc``, ``seq_lens``, ``block_table``,
``slot_mapping``) as static inputs.  The attention is a torch custom op that declares the caches it writes
(so ``torch.compile`` and Inductor take it as it is), marked ``@eager_break``:

- inside a ``full`` graph it is captured like the rest (a static-shape kernel: each token gathers its
  request's cache through the block table); decode batches always use this kernel;
- for a mixed batch in a ``breakable`` or ``piecewise`` entry it runs eagerly between graph segments,
  in one pass sized by the host-side lengths the engine passes through ``run(..., context=...)``
  (``current_batch()``).  An eager engine (``--mode none``) makes the same choices, so the registry's
  speed-up is launch overhead removed, not a different kernel.

On CUDA, where Triton is importable, the static path runs as Triton kernels (one writes K and V, one attends over
the slots each token sees, one combines the context's splits at small batches); elsewhere it gathers each token's
slots and runs SDPA.  ``--fuse-projections`` serves with each layer's q/k/v and gate/up projections as one matmul
each (``fuse_projections``), as an engine's loader stacks them.

Every step's logits are compared with Hugging Face's own forward (its SDPA attention, no cache, HF's own modules)
over each request's tokens.  Needs the ``hf`` extra (``pip install -e '.[hf]'``).

``--tp N`` (under torchrun, one process a rank) serves the model tensor parallel, Megatron style
(``shard_model``): each rank keeps its share of the attention heads (and the KV heads they read,
in its own paged cache) and of the MLP columns; ``o_proj`` and ``down_proj`` each end in one
all-reduce, which ``full`` and ``breakable`` graphs hold (NCCL on GPUs, gloo on the cpu emulator).
Every rank schedules the same batches and serves them with ``run(..., group=...)``; logits are
checked against HF's forward of the full model (TP=1).  Background capture is single-process
(``--background`` is refused with ``--tp``); see docs/distributed.md.

``--gpu-memory-utilization F`` follows docs/integration.md's recipe: the model on its smallest cache, the plan
estimated (``reg.estimate_memory``), the KV cache given what is left of F of the GPU, then the capture.  With
``--capture-first`` there is no estimate: the cache's addresses are reserved with only its scratch block backed
(``ReservedMemory``), the plan captured, and the cache backed with what is left of F after the capture.

    python examples/hf_llama.py                          # tiny config on CPU, every strategy
    python examples/hf_llama.py --config llama-3.2-1b --mode full_and_piecewise --requests 64   # on a GPU
    python examples/hf_llama.py --config llama-3.2-1b --mode full --gpu-memory-utilization 0.5  # KV cache sized last
    python examples/hf_llama.py --config llama-3.2-1b --mode full --gpu-memory-utilization 0.9 --capture-first
    python examples/hf_llama.py --config llama-3.2-1b --mode full_and_piecewise --inductor       # one Inductor compile
    python examples/hf_llama.py --config llama-3.2-1b --mode full --inductor --fuse-projections  # the fast decode step
    torchrun --standalone --nproc-per-node 2 examples/hf_llama.py --tp 2          # TP=2: gloo on CPU, NCCL on GPUs

``llama-3.2-1b`` is GPU-sized (1.1 billion parameters): on a CPU it runs, but each mode takes many
minutes.  Work that takes longer than a few seconds reports its progress on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import math
import os
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, apply_rotary_pos_emb

import cgregistry as cg
from cgregistry.kvcache import ReservedMemory
from cgregistry.distributed import HostAgreement
from cgregistry.plan.workload import read_trace

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the attention's reference path serves
    triton = None

ATTENTION = "cgregistry_paged"
CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256, dtype=torch.float32),
    # Llama-3.2-1B's shape (its vocabulary cut to 32000), bf16
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, dtype=torch.bfloat16),
    # Llama-3.1-8B's shape, its whole vocabulary, bf16 (16 GB of weights: one H200 holds it at TP=1)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, dtype=torch.bfloat16),
}
# Which strategy serves decode (uniform) and mixed batches; "full" captures both.
MODES = ("full_and_breakable", "full_and_piecewise", "full", "breakable", "piecewise", "none")


class Progress:
    """Stage and progress lines on stderr for long work: a stage is announced once it has run for
    ``after`` seconds, then its progress every ``every`` seconds; quick work prints nothing."""

    def __init__(self, label: str, after: float = 5.0, every: float = 10.0) -> None:
        self.label, self.after, self.every = label, after, every
        self.stage, self.started, self.last = "", time.perf_counter(), 0.0

    def begin(self, stage: str) -> None:
        self.stage, self.started, self.last = stage, time.perf_counter(), 0.0

    def update(self, detail: str = "") -> None:
        now = time.perf_counter()
        elapsed = now - self.started
        if elapsed >= self.after and now - self.last >= self.every:
            self.last = now
            print(f"[{self.label}] {self.stage}{': ' + detail if detail else ''} ({elapsed:.0f} s)", file=sys.stderr, flush=True)


def quiet(detail: str = "") -> None:
    """A progress callback that reports nothing."""


# --------------------------------------------------------------------------- attention


@dataclass
class HostBatch:
    """Host-side lengths of the live batch: what a varlen kernel launches with (``run(context=...)``)."""

    query_starts: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    _rows: tuple[Any, torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    def token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each live token's request and position, on the host, built once for the lengths the batch holds (every
        layer reads them) in plain Python: a CPU tensor op such as ``repeat_interleave`` forks the intra-op thread
        pool, one thread per core, and such a pool stalls at its barrier whenever another thread (a capture thread
        beside the step) holds a core.  Lengths changed in place since are seen.  The tensors are shared by every call
        for the same lengths (on a CPU device, ``.to`` returns them as they are): read them, never write them."""
        lengths = (tuple(self.query_lens), tuple(self.seq_lens))
        rows = self._rows
        if rows is None or rows[0] != lengths:
            req = [i for i, n in enumerate(self.query_lens) for _ in range(n)]
            pos = [length - n + k for n, length in zip(self.query_lens, self.seq_lens) for k in range(n)]
            rows = self._rows = (lengths, torch.tensor(req, dtype=torch.long), torch.tensor(pos, dtype=torch.long))
        return rows[1], rows[2]


def capture_context(mode: str) -> HostBatch | None:
    """What the attention breaks see while a plan of ``mode`` is captured (``capture(context=...)``): one request of
    one token, where mixed keys run their attention eagerly (breakable, piecewise), so that warm-up and capture attend
    over one block instead of gathering the whole padded context for every token (a 512-token key: 1 GiB a layer in
    bf16, on the GPU between the serving steps during a background capture), for outputs no replay reads.  None for
    ``full``, whose mixed keys are one graph each: their attention is the static one, recorded."""
    return None if mode == "full" else HostBatch([0], [1], [1])


@torch.library.custom_op("cgregistry_hf::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
    scaling: float | None,
) -> torch.Tensor:
    """Write this step's K/V at ``slot_mapping`` (padded tokens write the scratch slot), then attend.  Query is
    (1, heads, tokens, head_dim); the result (tokens, heads, head_dim).  ``slots`` and ``lens``: the step's attention
    metadata (``attention_metadata``), built once for every layer.  A custom op that declares the caches it
    writes: dynamo and Inductor take it as it is (``torch.compile``, Inductor pieces, ``full`` over them)."""
    write_kv(k_cache, v_cache, slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))  # (tokens, kv_heads, d)
    q = query[0].transpose(0, 1)  # (tokens, heads, head_dim)
    batch = cg.current_batch()
    host = batch.payload if batch is not None else None
    # A uniform key's own capture may be a full graph's recording: static shapes only.  Anything else that runs this
    # Python with host-side lengths runs eagerly (a break between segments, a miss, a decode batch padded into a
    # mixed key's graph, a mixed key's capture): one pass sized by the lengths, not by the padded key.
    recording = batch is None or (batch.key is not None and batch.key.uniform and batch.actual == batch.key)
    caches = (k_cache, v_cache, block_size)
    if isinstance(host, HostBatch) and not recording:
        return varlen_attention(caches, q, host, block_table, scaling)
    return static_attention(caches, q, slots, lens, scaling)


@_paged_attention_op.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
      slot_mapping: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
      scaling: float | None) -> torch.Tensor:
    return query.new_empty((query.shape[2], query.shape[1], query.shape[3]))


# An eager break: between graph segments in a ``breakable`` entry, a split of a ``piecewise`` one, inside ``full``.
paged_attention_op = cg.eager_break(_paged_attention_op)


def paged_attention(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
    scaling: float | None = None, dropout: float = 0.0, *, cg_slot_mapping: torch.Tensor, cg_slots: torch.Tensor,
    cg_lens: torch.Tensor, cg_block_table: torch.Tensor, **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over the layer's paged cache (``paged_attention_op``)."""
    out = paged_attention_op(query, key, value, module.k_cache, module.v_cache, cg_slot_mapping, cg_slots, cg_lens,
                             cg_block_table, module.block_size, scaling)
    return out[None], None  # (1, tokens, heads, head_dim), as HF's own attention functions return


Caches = tuple[torch.Tensor, torch.Tensor, int]  # a layer's K and V caches and its block size


def attention_metadata(
    positions: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The static attention's metadata, once a step for every layer (as an engine builds it): the cache slot of each
    token's context, (tokens, context), through ``query_start_loc`` and ``block_table``; and how many of them it
    sees, (tokens,): the positions up to its own, within its request's length.  Padded tokens see one slot (no NaN)."""
    t = torch.arange(positions.shape[0], device=positions.device)
    # Each token's request: how many requests after the first start at or before it.  Tokens past the last request's
    # (padding) count the same as its own.  (A count, not a search over a slice of query_start_loc: Inductor's lowering
    # of that slice fails on CUDA with the token count symbolic.)
    starts = torch.arange(query_start_loc.shape[0], device=positions.device)
    later = (starts >= 1) & (starts < query_start_loc.shape[0] - 1)
    req = ((query_start_loc[None, :] <= t[:, None]) & later[None, :]).sum(1)
    j = torch.arange(block_table.shape[1] * block_size, device=positions.device)
    slots = block_table[req][:, j // block_size] * block_size + j % block_size
    lens = torch.minimum(positions + 1, seq_lens[req]).clamp_(min=1)
    return slots, lens


def static_attention(caches: Caches, q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Every token attends over the first ``lens`` of its ``slots`` (``attention_metadata``): Triton kernels on CUDA
    (``decode_attention``), else each token's whole slot row gathered and masked, then SDPA."""
    k_cache, v_cache, _ = caches
    if uses_kernels(q, k_cache, v_cache):
        return decode_attention(k_cache, v_cache, q, slots, lens, scaling)
    k, v = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # (tokens, kv_heads, ctx, d)
    visible = torch.arange(slots.shape[1], device=q.device)[None, :] < lens[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], k, v, attn_mask=visible[:, None, None, :], scale=scaling, enable_gqa=True)
    return out[:, :, 0, :]


def varlen_attention(
    caches: Caches, q: torch.Tensor, host: HostBatch, block_table: torch.Tensor, scaling: float | None,
) -> torch.Tensor:
    """With host-side lengths: every token gathers its request's context, cut to the longest request's (a shape
    known only on the host), and sees the positions up to its own, in one pass (a per-request loop launches ~10
    kernels a request and layer).  Padded tokens (past the batch's own): zeros."""
    k_cache, v_cache, block = caches
    out = torch.zeros_like(q)
    used = sum(host.query_lens)
    req, pos = (rows.to(q.device, non_blocking=True) for rows in host.token_rows())
    blocks = math.ceil(max(host.seq_lens) / block)
    j = torch.arange(blocks * block, device=q.device)
    slots = block_table[req][:, j // block] * block + j % block  # (tokens, context)
    k, v = k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2)  # (tokens, kv_heads, ctx, d)
    visible = j[None, :] <= pos[:, None]  # a request's own positions only: the later ones are not written yet
    attended = F.scaled_dot_product_attention(q[:used, :, None, :], k, v, attn_mask=visible[:, None, None, :], scale=scaling, enable_gqa=True)
    out[:used] = attended[:, :, 0, :]
    return out


# --------------------------------------------------------------------------- Triton kernels (CUDA)
#
# The static attention in two kernels a layer, as an engine's own attention backend would: one writes the step's K
# and V rows, one attends over the paged cache, each (token, KV head) reading only the slots it sees, its query
# heads (the GQA group) as the rows of one tile.  Where a batch has too few (token, KV head) pairs to fill the GPU
# (decode at small batches) the context splits across programs and a third kernel combines their partial softmaxes.

KERNELS = True  # False: the CUDA path runs the gather-and-SDPA reference instead (for A/B measurements and tests)
DECODE_BLOCK = 128  # context slots a program reads per loop step
MAX_SPLITS = 16


def uses_kernels(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the Triton kernels take this layer: CUDA, Triton importable, a power-of-two head size of 16 or more,
    both caches contiguous and alike (rows addressed by slot), and the attention's K and V tiles, in Triton's three
    pipeline stages, within the device's shared memory (else the launch would fail: the reference path serves)."""
    dim = q.shape[-1]
    return (KERNELS and triton is not None and q.is_cuda and dim >= 16 and dim & (dim - 1) == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype == q.dtype
            and k_cache.shape == v_cache.shape
            and 3 * 2 * DECODE_BLOCK * dim * q.element_size() <= shared_memory_per_block(q.device))


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    """The most shared memory one program may take on ``device`` (its opt-in limit; 99 KiB where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 99 * 1024)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
    """Each token's K and V rows (tokens, kv_heads, d) into the caches at ``slot_mapping``: one kernel on CUDA.  A slot
    off the cache raises on the reference path; the kernel, inside a graph where nothing can raise, writes nothing."""
    tokens, heads, dim = k_new.shape
    if uses_kernels(k_new, k_cache, v_cache) and k_new.stride(-1) == 1 and v_new.stride(-1) == 1:
        slot_mapping = slot_mapping if slot_mapping.stride(0) == 1 else slot_mapping.contiguous()
        _write_kv_kernel[(tokens,)](
            k_new, v_new, k_cache, v_cache, slot_mapping, k_cache.shape[0],
            k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), k_cache.stride(0), k_cache.stride(1),
            HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), DIM=dim,
        )
        return
    k_cache.index_copy_(0, slot_mapping, k_new)
    v_cache.index_copy_(0, slot_mapping, v_new)


def context_splits(pairs: int, context: int, device: torch.device) -> int:
    """How many programs share one (token, KV head)'s context: enough for about two programs an SM, at most
    ``MAX_SPLITS`` and one per ``DECODE_BLOCK`` slots.  It depends on shapes only, so a graph replays its choice."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, -(-2 * sms // pairs), -(-context // DECODE_BLOCK)))


def decode_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                     scaling: float | None) -> torch.Tensor:
    """``static_attention`` on CUDA: q (tokens, heads, d) over the first ``lens[t]`` of ``slots[t]``; (tokens, heads, d)."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    q = q if q.stride(-1) == 1 else q.contiguous()
    slots = slots if slots.stride(-1) == 1 else slots.contiguous()
    lens = lens if lens.stride(0) == 1 else lens.contiguous()
    out = torch.empty((tokens, heads, dim), dtype=q.dtype, device=q.device)
    splits = context_splits(tokens * kv_heads, slots.shape[1], q.device)
    if splits > 1:
        m = torch.empty((tokens, heads, splits), dtype=torch.float32, device=q.device)
        partial = torch.empty((tokens, heads, splits, dim), dtype=torch.float32, device=q.device)
        l_sum = torch.empty_like(m)
    else:
        m = l_sum = partial = out  # not read: the kernel writes the output itself
    _decode_attention_kernel[(tokens, kv_heads, splits)](
        q, k_cache, v_cache, slots, lens, slots.shape[1], out, m, l_sum, partial,
        scaling if scaling is not None else dim ** -0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), slots.stride(0), out.stride(0), out.stride(1),
        GROUP=group, ROWS=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK=DECODE_BLOCK, SPLIT=splits > 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if splits > 1:
        _combine_splits_kernel[(tokens, heads)](m, l_sum, partial, out, out.stride(0), out.stride(1), splits,
                                                HEADS=heads, SPLITS_P2=triton.next_power_of_2(MAX_SPLITS), DIM=dim)
    return out


if triton is not None:
    @triton.jit
    def _write_kv_kernel(k_new, v_new, k_cache, v_cache, slot_mapping, num_slots, k_stride_t, k_stride_h, v_stride_t,
                         v_stride_h, c_stride_s, c_stride_h, HEADS: tl.constexpr, HEADS_P2: tl.constexpr, DIM: tl.constexpr):
        token = tl.program_id(0)
        slot = tl.load(slot_mapping + token)
        heads = tl.arange(0, HEADS_P2)[:, None]
        dims = tl.arange(0, DIM)[None, :]
        live = (heads < HEADS) & (slot >= 0) & (slot < num_slots)  # a slot off the cache writes nothing
        into = slot * c_stride_s + heads * c_stride_h + dims
        tl.store(k_cache + into, tl.load(k_new + token * k_stride_t + heads * k_stride_h + dims, mask=live), mask=live)
        tl.store(v_cache + into, tl.load(v_new + token * v_stride_t + heads * v_stride_h + dims, mask=live), mask=live)

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_cache, v_cache, slots_ptr, lens_ptr, width, out_ptr, m_ptr, l_ptr, partial_ptr, scale,
        q_stride_t, q_stride_h, c_stride_s, c_stride_h, slots_stride_t, out_stride_t, out_stride_h,
        GROUP: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        splits = tl.num_programs(2)
        rows = tl.arange(0, ROWS)
        dims = tl.arange(0, DIM)
        live = rows < GROUP  # the group's query heads; the tile's other rows are zeros, never stored
        heads = kv_head * GROUP + rows
        q = tl.load(q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :], mask=live[:, None], other=0.0)
        seen = tl.minimum(tl.load(lens_ptr + token), width)  # never past the token's row of slots
        chunk = tl.cdiv(tl.cdiv(seen, splits), BLOCK) * BLOCK
        start = split * chunk
        stop = tl.minimum(start + chunk, seen)
        top = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, DIM], tl.float32)
        for first in range(start, stop, BLOCK):
            cols = first + tl.arange(0, BLOCK)
            inside = cols < stop
            slot = tl.load(slots_ptr + token * slots_stride_t + cols, mask=inside, other=0)
            at = slot[:, None] * c_stride_s + kv_head * c_stride_h + dims[None, :]
            k = tl.load(k_cache + at, mask=inside[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(inside[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            p = tl.exp(scores - new_top[:, None])
            rescale = tl.exp(top - new_top)
            v = tl.load(v_cache + at, mask=inside[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            total = total * rescale + tl.sum(p, 1)
            top = new_top
        if SPLIT:  # partial softmax of this split: its maximum, its sum and its unnormalized output
            row = (token * tl.num_programs(1) * GROUP + heads) * splits + split
            tl.store(m_ptr + row, top, mask=live)
            tl.store(l_ptr + row, total, mask=live)
            tl.store(partial_ptr + row[:, None] * DIM + dims[None, :], acc, mask=live[:, None])
        else:
            out = acc / total[:, None]
            tl.store(out_ptr + token * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _combine_splits_kernel(m_ptr, l_ptr, partial_ptr, out_ptr, out_stride_t, out_stride_h, splits,
                               HEADS: tl.constexpr, SPLITS_P2: tl.constexpr, DIM: tl.constexpr):
        token, head = tl.program_id(0), tl.program_id(1)
        each = tl.arange(0, SPLITS_P2)
        live = each < splits
        at = (token * HEADS + head) * splits + each
        top = tl.load(m_ptr + at, mask=live, other=float("-inf"))
        weight = tl.exp(top - tl.max(top, 0))  # an empty split (maximum -inf) weighs 0
        total = tl.sum(tl.load(l_ptr + at, mask=live, other=0.0) * weight, 0)
        dims = tl.arange(0, DIM)
        partial = tl.load(partial_ptr + at[:, None] * DIM + dims[None, :], mask=live[:, None], other=0.0)
        out = tl.sum(partial * weight[:, None], 0) / total
        tl.store(out_ptr + token * out_stride_t + head * out_stride_h + dims, out.to(out_ptr.dtype.element_ty))



AttentionInterface.register(ATTENTION, paged_attention)  # no mask function registered: HF builds no mask for it


# --------------------------------------------------------------------------- model and cache


@dataclass(frozen=True)
class EngineShape:
    """The engine's limits: they size the static inputs and the KV cache.

    Block 0 of the cache is the scratch block: never given to a request, padded rows write its first slot.  So the
    fills do not depend on the cache's size, and the cache can be sized after the registry is built and its plan
    estimated (``size_kv_cache``).  ``kv_blocks``: the cache's blocks, the scratch block included (default: every
    request at full context, plus the scratch block).
    """

    max_num_seqs: int = 8
    max_num_tokens: int = 64
    block_size: int = 8
    max_blocks_per_req: int = 8  # context up to block_size * max_blocks_per_req tokens
    kv_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.kv_blocks is not None and self.kv_blocks < self.min_blocks:
            raise ValueError(f"kv_blocks={self.kv_blocks}: the cache needs at least {self.min_blocks} blocks (the scratch "
                             f"block and one request at full context, {self.max_blocks_per_req} blocks)")

    @property
    def max_context(self) -> int:
        return self.block_size * self.max_blocks_per_req

    @property
    def min_blocks(self) -> int:
        return 1 + self.max_blocks_per_req

    @property
    def num_blocks(self) -> int:
        return self.kv_blocks if self.kv_blocks is not None else 1 + self.max_num_seqs * self.max_blocks_per_req

    @property
    def scratch_slot(self) -> int:
        return 0  # the first slot of the scratch block: padded rows write here


def build_model(config: str, device: torch.device, shape: EngineShape, seed: int = 0) -> LlamaForCausalLM:
    """A random-weight Llama whose attention layers each hold a paged K/V cache (plus the scratch slot)."""
    options = dict(CONFIGS[config])
    dtype = options.pop("dtype")
    cfg = LlamaConfig(max_position_embeddings=max(shape.max_context, 256), **options)
    cfg._attn_implementation = ATTENTION
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built where it serves, in its dtype: an 8B model never exists in float32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    resize_kv_cache(model, shape)
    return model


def resize_kv_cache(model: LlamaForCausalLM, shape: EngineShape) -> None:
    """Every attention layer's K/V cache allocated anew for ``shape.num_blocks`` blocks (zeros).  Before any capture:
    graphs read the cache at the address it had when they were captured."""
    _set_kv_caches(model, shape, shape.num_blocks, lambda kv_shape, weight: torch.zeros(kv_shape, dtype=weight.dtype,
                                                                                         device=weight.device))


def _set_kv_caches(model: LlamaForCausalLM, shape: EngineShape, blocks: int, make: Any) -> None:
    """Every attention layer's K and V cache made anew by ``make(kv_shape, weight)`` for ``blocks`` blocks (the old
    ones go before the new ones are made)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        weight = attn.o_proj.weight
        attn.block_size = shape.block_size
        heads = attn.k_proj.weight.shape[0] // attn.head_dim  # this rank's KV heads where the model is sharded
        kv_shape = (blocks * shape.block_size, heads, attn.head_dim)
        for name in ("k_cache", "v_cache"):
            if getattr(attn, name, None) is not None:
                setattr(attn, name, None)
            attn.register_buffer(name, make(kv_shape, weight), persistent=False)


def kv_block_bytes(model: LlamaForCausalLM, shape: EngineShape) -> int:
    """Device bytes of one cache block over every layer, K and V."""
    attn = model.model.layers[0].self_attn
    per_slot = attn.k_cache.shape[1] * attn.k_cache.shape[2] * attn.k_cache.element_size()
    return 2 * len(model.model.layers) * shape.block_size * per_slot


def size_kv_cache(model: LlamaForCausalLM, shape: EngineShape, budget_bytes: int, estimate: cg.capture.memory.MemoryEstimate | None) -> EngineShape:
    """The recipe of docs/integration.md: the KV cache gets what ``budget_bytes`` (what the graphs and the cache may
    still take) leaves after the graphs' ``estimate`` (None: no graphs), at most what every request at full context
    needs.  Call it with the model on its smallest cache (``kv_blocks=shape.min_blocks``) and nothing captured yet;
    it resizes the cache and returns the engine's new shape."""
    graphs = estimate.capture_bytes if estimate is not None else 0
    per_block = kv_block_bytes(model, shape)
    blocks = min((budget_bytes - graphs) // per_block, 1 + shape.max_num_seqs * shape.max_blocks_per_req)
    if blocks < shape.min_blocks:
        raise ValueError(
            f"{budget_bytes / 2**20:.0f} MiB for the graphs and the KV cache: the plan's graphs take {graphs / 2**20:.0f} MiB "
            f"(estimated), which leaves room for {max(blocks, 0)} blocks of {per_block / 2**20:.3f} MiB; the engine needs at "
            f"least {shape.min_blocks} (raise the memory utilization, or capture fewer keys: CapturePlan.fit(..., max_bytes=...))")
    sized = EngineShape(shape.max_num_seqs, shape.max_num_tokens, shape.block_size, shape.max_blocks_per_req, kv_blocks=int(blocks))
    resize_kv_cache(model, sized)
    return sized


def reserve_kv_cache(model: LlamaForCausalLM, shape: EngineShape) -> list[ReservedMemory]:
    """Every attention layer's K/V cache over an address range reserved for the most blocks the engine can use
    (every request at full context, plus the scratch block), with only the scratch block (which capture writes and
    reads) backed and zeroed.  Capture next, then ``back_kv_cache``: the graphs keep the addresses."""
    reservations = []

    def reserve(kv_shape: tuple[int, int, int], weight: torch.Tensor) -> torch.Tensor:
        block_bytes = math.prod(kv_shape[1:]) * shape.block_size * weight.element_size()
        memory = ReservedMemory(math.prod(kv_shape) * weight.element_size(), device=weight.device, backed_bytes=block_bytes)
        memory.tensor[: memory.backed_bytes].zero_()
        reservations.append(memory)
        return memory.view(weight.dtype, kv_shape)

    _set_kv_caches(model, shape, 1 + shape.max_num_seqs * shape.max_blocks_per_req, reserve)
    return reservations


def back_kv_cache(model: LlamaForCausalLM, shape: EngineShape, reservations: list[ReservedMemory], kv_bytes: int) -> EngineShape:
    """After capture: back (and zero) as many blocks of every reserved cache as ``kv_bytes`` (what is left for the
    KV cache, the part backed already included) holds, at most what every request at full context needs; returns the
    engine's shape with that many blocks."""
    per_block = kv_block_bytes(model, shape)
    share = kv_bytes // len(reservations) // reservations[0].granularity * reservations[0].granularity
    blocks = min(share // (per_block // len(reservations)), 1 + shape.max_num_seqs * shape.max_blocks_per_req)
    if blocks < shape.min_blocks:
        raise ValueError(f"{kv_bytes / 2**20:.0f} MiB left for the KV cache after capture holds {max(blocks, 0)} blocks of "
                         f"{per_block / 2**20:.3f} MiB; the engine needs at least {shape.min_blocks}")
    for memory in reservations:
        before = memory.backed_bytes
        memory.back(blocks * (per_block // len(reservations)))
        memory.tensor[before: memory.backed_bytes].zero_()
    return EngineShape(shape.max_num_seqs, shape.max_num_tokens, shape.block_size, shape.max_blocks_per_req, kv_blocks=int(blocks))


# --------------------------------------------------------------------------- fused projections


class FusedProjections(nn.Module):
    """What ``FusedAttention`` and ``FusedMLP`` share: the fused weight (``<fused>_weight``, ``<fused>_bias``) whose
    rows the projections ``names`` view.  The links survive what moves parameters (``.to``, ``to_empty``, ``deepcopy``,
    pickling): the projections' parameters, the same objects, are pointed at their rows again.  ``split``: what no
    longer reads through the fused weight (a parameter that could not be copied in), refused by every step."""

    names: tuple[str, ...]
    fused: str
    projections: dict[str, nn.Module]  # the projection modules the fused weight stands for
    links: list[tuple[str, str | None, str, torch.Tensor, int]]  # label, its projection (None: this module), name, it, address
    split: set[str]

    def relink(self) -> None:
        """Point each projection's parameters (the same objects: references an engine holds stay good) at their rows of
        the fused ones, and note what they are."""
        self.projections = {name: getattr(self, name) for name in self.names}
        self.links = []
        for attr in ("weight", "bias"):
            whole = getattr(self, f"{self.fused}_{attr}")
            if whole is None:
                continue
            parts = [getattr(linear, attr) for linear in self.projections.values()]
            if whole.shape[0] != sum(p.shape[0] for p in parts) or any(p.shape[1:] != whole.shape[1:] for p in parts):
                raise ValueError(f"fuse_projections: {self.fused}_{attr} of shape {tuple(whole.shape)} does not stack "
                                 f"{', '.join(f'{n}.{attr} {tuple(p.shape)}' for n, p in zip(self.names, parts))}")
            start = 0
            for (name, linear), part in zip(self.projections.items(), parts):
                part.data = whole.detach()[start : start + part.shape[0]]
                self.links.append((f"{name}.{attr}", name, attr, part, part.data_ptr()))
                _projection_of[linear] = (weakref.ref(self), name)
                start += part.shape[0]
            self.links.append((f"{self.fused}_{attr}", None, f"{self.fused}_{attr}", whole, whole.data_ptr()))

    def _held(self, projection: str | None, name: str) -> Any:
        owner = self if projection is None else getattr(self, projection, None)
        return getattr(owner, name, None)

    def linked(self) -> bool:
        """Whether every projection still reads through the fused weight."""
        return (not self.split and all(getattr(self, name, None) is linear for name, linear in self.projections.items())
                and all(self._held(projection, name) is param and param.data_ptr() == at
                        for _, projection, name, param, at in self.links))

    def unlinked(self, by_address: bool = True) -> list[str]:
        """The projections (and fused parameters) that no longer read through the fused weight; without
        ``by_address``, only what was split or replaced (in a copy, addresses say nothing)."""
        moved = set(self.split)
        moved.update(name for name, linear in self.projections.items() if getattr(self, name, None) is not linear)
        moved.update(label for label, projection, name, param, at in self.links
                     if self._held(projection, name) is not param or (by_address and param.data_ptr() != at))
        return sorted(moved)

    def _moved(self, broken: list[str]) -> None:
        """After the parameters moved: views again where the layer was whole; a layer already split keeps what it
        holds, and what was split, for ``fuse_projections`` to settle."""
        if not broken:
            self.relink()
            return
        self.links = [(label, projection, name, param, param.data_ptr()) for label, projection, name, param, _ in self.links]
        self.split.update(broken)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        broken = self.unlinked()
        out = super()._apply(fn, recurse)  # each parameter converted on its own: the views are copies now
        self._moved(broken)
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:  # deepcopy and unpickling: the views were copied apart
        super().__setstate__(state)
        self._moved(self.unlinked(by_address=False))


class FusedAttention(FusedProjections, LlamaAttention):
    """HF's Llama attention with its q, k and v projections as one matmul (``fuse_projections``).  Served through the
    paged attention only: under any other attention implementation (the HF check's SDPA) it is HF's own forward,
    reading ``q/k/v_proj``, whose weights are views of the fused one."""

    qkv_weight: nn.Parameter
    qkv_bias: nn.Parameter | None

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: Any = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        if self.config._attn_implementation != ATTENTION:
            return super().forward(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
        tokens = hidden_states.shape[:-1]
        q, k, v = F.linear(hidden_states, self.qkv_weight, self.qkv_bias).split(self.qkv_sizes, dim=-1)
        q, k, v = (x.view(*tokens, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))
        cos, sin = position_embeddings  # type: ignore[misc]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out, _ = paged_attention(self, q, k, v, attention_mask, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*tokens, -1)), None


class FusedMLP(FusedProjections, LlamaMLP):
    """HF's Llama MLP with its gate and up projections as one matmul (``fuse_projections``); HF's own forward under
    any attention implementation but the paged one, as ``FusedAttention``."""

    gate_up_weight: nn.Parameter
    gate_up_bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config._attn_implementation != ATTENTION:
            return super().forward(x)
        gate, up = F.linear(x, self.gate_up_weight, self.gate_up_bias).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")


def fuse_projections(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Fuse, in place, each layer's q/k/v projections into one matmul and its gate/up projections into another, as an
    engine's loader does (at decode batch 1 a small matmul is latency-bound: fewer, larger ones read the weights
    faster); return ``model``.  Each fused weight is a new parameter (``qkv_weight``, ``gate_up_weight``); the
    projections' own weights become views of it, so HF's names still load (a strict load of an HF checkpoint too)
    and HF's check reads the same memory.

    A weight sync is a copy into that memory, whichever way it comes: ``load_state_dict`` (with ``assign=True``
    too), ``copy_``, or a new ``nn.Parameter`` assigned to a projection or to a fused weight (its values are copied in
    and the parameter already there stays, so graphs keep reading it).  What cannot be copied in (another shape,
    dtype or device), a projection module replaced (a LoRA or quantized wrapper), or a ``.data`` swap is refused by
    every step (``unfused_projections`` names it) until ``fuse_projections`` runs again, which fuses the layers it
    finds split (from the fused weight where only it changed, else from the projections).  ``.to``, ``to_empty``,
    ``deepcopy`` and pickling keep the views and the parameter objects.

    Limits: an assigned tensor is copied, never shared (an engine that shares a trainer's memory by
    ``assign=True`` must serve unfused); a projection's forward hooks do not run in the fused matmul; a ``.data``
    swap of a projection is refused by eager steps and captures, but a graph captured before it keeps reading the
    fused weight (the registry sees the projection unread) until ``fuse_projections`` and ``refresh()``; the
    state_dict holds the fused weights and the projections' views of them, which safetensors (``save_pretrained``)
    refuses: save an unfused model.  Call it after ``shard_model``."""
    fused: list[FusedProjections] = []
    for i, layer in enumerate(model.model.layers):
        for module, names, kind, prefix, part in ((layer.self_attn, QKV, FusedAttention, "qkv", "self_attn"),
                                                  (layer.mlp, GATE_UP, FusedMLP, "gate_up", "mlp")):
            path = f"model.layers.{i}.{part}"
            broken = set(module.unlinked()) if isinstance(module, kind) else None
            whole = {f"{prefix}_weight", f"{prefix}_bias"}
            if broken is None or (broken and not broken & whole):
                _fuse(module, names, kind, prefix, path)  # the projections hold what the fused weight should
            elif broken and broken <= whole:
                module.split.clear()  # the fused weight itself changed: the projections follow it
                module.relink()
            elif broken:
                raise ValueError(f"fuse_projections: both {path}'s fused weight and its projections changed "
                                 f"({', '.join(sorted(broken))}): load one of them by copy")
            fused.append(module)
    model.fused_projections = fused
    return model


def _fuse(module: nn.Module, names: tuple[str, ...], kind: type[FusedProjections], prefix: str, path: str) -> None:
    """Stack the weights (and biases) of ``module``'s linear layers ``names`` into one new parameter each, make
    ``module`` a ``kind`` and the layers' own parameters views of the stacked ones."""
    linears = [getattr(module, name) for name in names]
    wrapped = [f"{path}.{name}" for name, linear in zip(names, linears) if type(linear) is not nn.Linear]
    if wrapped:
        raise ValueError(f"fuse_projections: {', '.join(wrapped)} is not a plain nn.Linear (a wrapper's weights are not "
                         "all it computes); fuse before wrapping, or serve unfused")
    for attr in ("weight", "bias"):
        parts = [getattr(linear, attr) for linear in linears]
        if any(p is None for p in parts) and not all(p is None for p in parts):
            raise ValueError(f"fuse_projections: of {', '.join(f'{path}.{n}' for n in names)}, only "
                             f"{[n for n, p in zip(names, parts) if p is not None]} have a {attr}; expected all or none")
        whole = None if parts[0] is None else nn.Parameter(torch.cat([p.detach() for p in parts]), requires_grad=False)
        with rewiring():
            module.register_parameter(f"{prefix}_{attr}", whole)
    if not isinstance(module, kind):
        module.__class__ = kind
        module.register_load_state_dict_post_hook(_fused_keys_optional)
    module.names, module.fused, module.split = names, prefix, set()
    if kind is FusedAttention:
        module.qkv_sizes = [linear.weight.shape[0] for linear in linears]
    module.relink()


_projection_of: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[Any], str]] = weakref.WeakKeyDictionary()


def _fused_keys_optional(module: nn.Module, incompatible: Any) -> None:
    """A checkpoint without the fused weights (HF's own) loads strictly: the projections it has are their rows."""
    for key in [k for k in incompatible.missing_keys if k.rsplit(".", 1)[-1] in ("qkv_weight", "qkv_bias", "gate_up_weight", "gate_up_bias")]:
        incompatible.missing_keys.remove(key)


def unfused_projections(model: LlamaForCausalLM) -> list[str]:
    """What of a fused model no longer reads through its fused weights, by module path; empty for an unfused model."""
    problems = []
    for i, layer in enumerate(model.model.layers):
        for module, part in ((layer.self_attn, "self_attn"), (layer.mlp, "mlp")):
            if isinstance(module, FusedProjections):
                problems += [f"model.layers.{i}.{part}.{name}" for name in module.unlinked()]
    return problems


def check_fused(model: LlamaForCausalLM) -> None:
    """Raise if what a fused model's projections hold no longer reaches its fused weights (``unfused_projections``):
    the step's check, at every eager step and capture (about 5 µs a layer on a CPU core; replays do not run it)."""
    if not all(module.linked() for module in getattr(model, "fused_projections", ())):
        raise RuntimeError(f"{', '.join(unfused_projections(model))}: no longer read through the fused weights "
                           "(fuse_projections): load weights into the parameters already there, or call "
                           "fuse_projections(model) again")


_rewiring = threading.local()  # fuse_projections placing its own parameters on this thread: no assignment to copy or note


@contextlib.contextmanager
def rewiring() -> Any:
    """While ``fuse_projections`` itself places the fused parameters, on this thread."""
    _rewiring.depth = getattr(_rewiring, "depth", 0) + 1
    try:
        yield
    finally:
        _rewiring.depth -= 1


def _copy_into_fused(module: nn.Module, name: str, param: Any) -> Any:
    """A parameter assigned to a fused projection or to a fused weight is copied into the one already there, which
    stays (graphs keep reading it).  One that cannot be copied in (another shape, dtype or device) is noted as split."""
    if getattr(_rewiring, "depth", 0):
        return None
    owner = _projection_of.get(module)
    if owner is not None and name in ("weight", "bias"):
        fused, label = owner[0](), f"{owner[1]}.{name}"
    elif isinstance(module, FusedProjections) and name in (f"{module.fused}_weight", f"{module.fused}_bias"):
        fused, label = module, name
    else:
        return None
    if fused is None or getattr(fused, "links", None) is None:
        return None
    current = getattr(module, name, None)
    if (isinstance(param, torch.Tensor) and current is not None and param.shape == current.shape
            and param.dtype == current.dtype and param.device == current.device and fused.linked()):
        with torch.inference_mode():  # a model built under inference mode holds inference tensors
            current.copy_(param)
        return current
    fused.split.add(label)
    return None


def _note_replaced_projection(module: nn.Module, name: str, submodule: Any) -> None:
    """A projection module of a fused layer replaced: the fused matmul would not compute what it computes."""
    if isinstance(module, FusedProjections) and name in getattr(module, "names", ()) and getattr(module, name, None) is not submodule:
        module.split.add(name)


torch.nn.modules.module.register_module_parameter_registration_hook(_copy_into_fused)
torch.nn.modules.module.register_module_module_registration_hook(_note_replaced_projection)


# --------------------------------------------------------------------------- tensor parallel


class RowParallelLinear(nn.Module):
    """The second layer of a Megatron-style pair (``o_proj``, ``down_proj``): this rank's input columns of the
    weight, then one all-reduce (SUM) over the tensor-parallel group.  The collective is called as
    ``torch.distributed.all_reduce(...)``: inside a captured graph on CUDA (NCCL), recorded by the cpu emulator."""

    def __init__(self, full: nn.Linear, start: int, stop: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight[:, start:stop].clone(), requires_grad=False)
        self.bias = None if full.bias is None else nn.Parameter(full.bias.clone(), requires_grad=False)  # added once, after the sum
        self.group = group
        self.handle = group_handle(group)  # what a traced graph passes to all_reduce_partial (an int constant)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output: summed over the ranks it is the full layer's output (less its bias)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce_partial(self.partial(x), self.handle)
        return out if self.bias is None else out + self.bias


# Process groups by handle (a traced graph (piecewise) passes the handle, a constant), held weakly: a group kept
# alive until interpreter exit can abort the process there (release_process_group).  -1 is the default group.
_groups: list[weakref.ref[Any]] = []


def group_handle(group: Any) -> int:
    """A small integer standing for ``group`` (None: the default group) in ``all_reduce_partial`` calls."""
    if group is None:
        return -1
    for handle, known in enumerate(_groups):
        if known() is group:
            return handle
    _groups.append(weakref.ref(group))  # a handle never stands for two groups: a freed group's slot is not reused
    return len(_groups) - 1


def all_reduce_partial(out: torch.Tensor, handle: int) -> torch.Tensor:
    """Sum ``out`` over the group (in place) and return it.  Under ``piecewise`` modes it is a splitting op: dynamo
    records it as one call, and it runs eagerly between the pieces (``build_registry``)."""
    if is_fake(out):  # dynamo propagating shapes through the opaque call: no communication
        return out
    group = None if handle < 0 else _groups[handle]()
    if group is None and handle >= 0:
        raise RuntimeError(f"process group handle {handle}: the group was destroyed and freed; this layer cannot reduce")
    torch.distributed.all_reduce(out, group=group)
    return out


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def column_parallel(full: nn.Linear, start: int, stop: int) -> nn.Linear:
    """The first layer of a pair (``q/k/v_proj``, ``gate/up_proj``): rows ``start:stop`` of the weight, no collective."""
    part = nn.Linear(full.in_features, stop - start, bias=full.bias is not None, device=full.weight.device, dtype=full.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(full.weight[start:stop])
        if full.bias is not None:
            part.bias.copy_(full.bias[start:stop])
    return part.requires_grad_(False)


@dataclass(frozen=True)
class TensorParallelShard:
    """What rank ``rank`` of ``world`` holds: attention heads, KV heads and MLP columns, as [start, stop) ranges.

    Query heads split evenly.  KV heads split evenly when there are at least as many as ranks; with fewer (GQA at
    a high TP), each rank holds the one KV head its query heads read, replicated over ``world // kv_heads`` ranks
    (as vLLM does).  Embeddings, norms and the LM head are replicated.
    """

    rank: int
    world: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]

    @classmethod
    def of(cls, config: LlamaConfig | dict[str, Any], rank: int, world: int) -> TensorParallelShard:
        """The shard of a Llama config (a ``LlamaConfig`` or one of ``CONFIGS``); a ValueError names what does not split."""
        get = config.get if isinstance(config, dict) else lambda name: getattr(config, name)
        heads, kv, inter = get("num_attention_heads"), get("num_key_value_heads"), get("intermediate_size")
        problems = []
        if heads % world:
            problems.append(f"{heads} attention heads")
        if kv % world and world % kv:
            problems.append(f"{kv} KV heads (neither a multiple nor a divisor of the ranks)")
        if inter % world:
            problems.append(f"an MLP of {inter} columns")
        if problems:
            raise ValueError(f"tensor parallel size {world} does not divide {' and '.join(problems)}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0..{world - 1}")
        per_rank = heads // world
        first = rank * per_rank
        group_size = heads // kv  # query heads per KV head
        kv_range = (first // group_size, (first + per_rank - 1) // group_size + 1)  # the KV heads these query heads read
        step = inter // world
        return cls(rank, world, (first, first + per_rank), kv_range, (rank * step, (rank + 1) * step))


def shard_model(model: LlamaForCausalLM, rank: int, world: int, group: Any = None) -> LlamaForCausalLM:
    """Shard ``model`` in place for rank ``rank`` of a tensor-parallel group of ``world`` ranks (``group``; None: the
    default group), and return it.

    Each attention layer keeps its query heads and the KV heads they read (``q/k/v_proj`` split by rows, the paged
    K/V cache by heads) and its ``o_proj`` becomes a :class:`RowParallelLinear`; each MLP keeps its columns
    (``gate/up_proj`` by rows) and its ``down_proj`` becomes one: two all-reduces per decoder layer.  Every rank
    must start from the same weights (``build_model`` with the same seed).  The config still describes the full model.
    """
    if isinstance(model.model.layers[0].self_attn, FusedProjections):
        raise ValueError("shard_model: the model's projections are fused; shard it first, then fuse_projections")
    shard = TensorParallelShard.of(model.config, rank, world)
    (h0, h1), (k0, k1), (i0, i1) = shard.heads, shard.kv_heads, shard.intermediate
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        d = attn.head_dim
        attn.q_proj = column_parallel(attn.q_proj, h0 * d, h1 * d)
        attn.k_proj = column_parallel(attn.k_proj, k0 * d, k1 * d)
        attn.v_proj = column_parallel(attn.v_proj, k0 * d, k1 * d)
        attn.o_proj = RowParallelLinear(attn.o_proj, h0 * d, h1 * d, group)
        attn.num_key_value_groups = (h1 - h0) // (k1 - k0)  # what HF's own attention functions read
        if hasattr(attn, "k_cache"):
            attn.k_cache = attn.k_cache[:, k0:k1].clone()  # a buffer: assignment keeps it one
            attn.v_cache = attn.v_cache[:, k0:k1].clone()
        mlp.gate_proj = column_parallel(mlp.gate_proj, i0, i1)
        mlp.up_proj = column_parallel(mlp.up_proj, i0, i1)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, i0, i1, group)
    model.tensor_parallel = shard
    return model


def static_inputs(shape: EngineShape) -> dict[str, cg.StaticInput]:
    """The step's inputs and their fills: index inputs fill with the scratch slot or a harmless row."""
    t, r = shape.max_num_tokens, shape.max_num_seqs
    return {
        "input_ids": cg.StaticInput((t,), torch.long, fill=0),
        "positions": cg.StaticInput((t,), torch.long, fill=0),
        "slot_mapping": cg.StaticInput((t,), torch.long, fill=shape.scratch_slot),  # padded tokens write here only
        "query_start_loc": cg.StaticInput((r + 1,), torch.long, axis="reqs+1"),  # padding repeats the last offset
        "seq_lens": cg.StaticInput((r,), torch.long, axis="reqs", fill=1),  # padded requests see one slot
        "block_table": cg.StaticInput((r, shape.max_blocks_per_req), torch.long, axis="reqs", fill=0),  # read only
        "logits_indices": cg.StaticInput((r,), torch.long, axis="reqs", fill=0),
    }


OUTPUT_AXES = {"hidden": "tokens", "logits": "reqs"}  # hidden states per token, logits per request


def make_step(model: LlamaForCausalLM, forward: Any) -> Any:
    """The registry's step: the decoder (``forward``: the model itself or its piecewise compilation),
    then the LM head on each request's last token."""

    def step(batch: cg.BatchDescriptor, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
             query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
             logits_indices: torch.Tensor) -> dict[str, torch.Tensor]:
        if not torch.compiler.is_compiling():
            check_fused(model)
        hidden = forward(input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_table)
        return {"hidden": hidden, "logits": model.lm_head(hidden[logits_indices])}

    return step


def decoder(model: LlamaForCausalLM) -> Any:
    """The decoder stack on one flattened token batch; the attention metadata, built once a step, reaches every layer's
    attention as keyword arguments."""
    attn = model.model.layers[0].self_attn  # its block size and cache, read per call: a resized cache may change them

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                seq_lens: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        slots, lens = attention_metadata(positions, query_start_loc, seq_lens, block_table, attn.block_size)
        out = model.model(
            input_ids=input_ids[None], position_ids=positions[None], use_cache=False, cg_slot_mapping=slot_mapping,
            cg_slots=slots, cg_lens=lens, cg_block_table=block_table,
        )
        return out.last_hidden_state[0]

    return forward


def build_registry(
    model: LlamaForCausalLM, shape: EngineShape, mode: str, backend: str = "auto", background: bool = False,
    adapt: cg.Adaptation | None = None, progress: bool | None = None, plugins: cg.Plugins | None = None, inductor: bool = False,
) -> cg.GraphRegistry | None:
    """A registry for ``mode`` with its plan captured (None for mode 'none': the engine runs eagerly).

    ``background``: capture between the steps the engine serves (graphs go live one by one).
    ``adapt``: refit the plan to the steps served (``docs/background.md``).  ``progress``: a capture progress
    bar (None: where stderr is a terminal).
    """
    if mode == "none":
        return None
    reg, plan = new_registry(model, shape, mode, backend, adapt, plugins, inductor=inductor)
    with torch.inference_mode():
        reg.capture(plan, background=background, progress=progress, context=capture_context(mode))
    return reg


def new_registry(
    model: LlamaForCausalLM, shape: EngineShape, mode: str, backend: str = "auto", adapt: cg.Adaptation | None = None,
    plugins: cg.Plugins | None = None, inductor: bool = False,
) -> tuple[cg.GraphRegistry, cg.CapturePlan]:
    """``build_registry`` without the capture: the registry (watching the model's weights) and its plan.

    ``inductor``: the decoder compiled once, by Inductor in pieces around the attention op, and every key served by
    those pieces: ``full`` keys with the attention inline in one graph, ``piecewise`` ones with it eager between them
    (CUDA only: the cpu emulator cannot record Inductor's kernels)."""
    preference = ("full", "piecewise", "breakable")
    # The step makes nothing on a first run (the KV cache exists before capture): keys captured again after a weight
    # sync or a wake are recorded without a warm-up (docs/lifecycle.md).
    options: dict[str, Any] = {"preference": preference, "name": f"hf-{mode}", "plugins": plugins, "warm_up_again": False}
    reg: cg.GraphRegistry
    forward = decoder(model)
    if "piecewise" in mode or inductor:
        holder: dict[str, Any] = {}
        reg = cg.GraphRegistry(make_step(model, lambda *a: holder["compiled"](*a)), static_inputs(shape),
                               backend=backend, output_axis=OUTPUT_AXES, **options)
        sharded = any(isinstance(m, RowParallelLinear) for m in model.modules())
        # A sharded model's all-reduces split the pieces too (they run eagerly between them): dynamo cannot trace the
        # cpu emulator's recorded collective, and a split keeps every backend the same.
        holder["compiled"] = (reg.compile(forward, [all_reduce_partial], include_marked=True, inductor=inductor) if sharded
                              else reg.compile(forward, inductor=inductor))
    else:
        reg = cg.GraphRegistry(make_step(model, forward), static_inputs(shape), backend=backend,
                               output_axis=OUTPUT_AXES, adapt=adapt, **options)
    plan = cg.CapturePlan.build(
        max_num_seqs=shape.max_num_seqs, max_num_tokens=shape.max_num_tokens, max_capture_size=shape.max_num_tokens, mode=mode
    )
    reg.watch(model)  # its weights: a moved one is caught at the next replay (reg.refresh() after a weight update)
    return reg, plan


# --------------------------------------------------------------------------- the engine


@dataclass
class Sequence:
    """One request: its tokens so far, how many are in the cache, its blocks, the logits it produced."""

    rid: int
    tokens: list[int]
    max_new: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V is in the cache
    generated: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> logits predicting the next token


@dataclass
class EngineResult:
    steps: int
    tokens: int
    seconds: float
    finished: list[Sequence]
    max_abs_error: float = float("nan")
    kv_reserved: list[ReservedMemory] = field(default_factory=list)  # the cache's ranges, with capture_first


class Engine:
    """Continuous batching with chunked prefill; one registry (or none) serves every step.

    ``group``: the tensor-parallel process group of a sharded model (``shard_model``).  Every rank runs the same
    scheduler over the same requests, so every rank builds the same batch; the ranks still check it on the host
    before each step (``run(..., group=agreement)``, a ``HostAgreement(group, same_batch=True)``: shared memory, no
    device sync), so a rank handed another batch is refused on every rank instead of replaying another graph and
    leaving the others waiting in its all-reduces; the sampled tokens are broadcast from the group's first rank (one
    small broadcast a step) so the schedules cannot drift apart on a tie.  Constructing it is collective over the group.
    """

    def __init__(self, model: LlamaForCausalLM, shape: EngineShape, registry: cg.GraphRegistry | None, keep_logits: bool,
                 group: Any = None) -> None:
        self.model, self.shape, self.reg, self.keep_logits, self.group = model, shape, registry, keep_logits, group
        self.device = next(model.parameters()).device
        self.step_fn = make_step(model, decoder(model))
        self.free_blocks = deque(range(1, shape.num_blocks))  # block 0 is the scratch block
        self.agreement = None if group is None else HostAgreement(group, same_batch=True)

    def serve(self, requests: list[Sequence], max_steps: int | None = None, progress: Any = quiet) -> EngineResult:
        """Serve ``requests`` to the end (or ``max_steps``); ``progress(detail)`` is called after every step."""
        waiting, running, finished = deque(requests), [], []
        steps = tokens = 0
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            while (waiting or running) and (max_steps is None or steps < max_steps):
                batch = self._schedule(waiting, running)
                logits = self.run_step(batch)
                tokens += self._advance(batch, logits, running, finished)
                steps += 1
                progress(f"step {steps}, {len(finished)} of {len(requests)} requests finished")
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return EngineResult(steps, tokens, time.perf_counter() - started, finished + running)

    def _schedule(self, waiting: deque[Sequence], running: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Decodes first, then prefill chunks, admitting requests while the token budget and the blocks last."""
        budget, batch = self.shape.max_num_tokens, []
        for seq in sorted(running, key=lambda s: len(s.tokens) - s.computed):
            n = min(len(seq.tokens) - seq.computed, budget)
            if n:
                batch.append((seq, n))
                budget -= n
        while waiting and budget and len(running) < self.shape.max_num_seqs:
            seq = waiting[0]
            need = math.ceil((len(seq.tokens) + seq.max_new) / self.shape.block_size)
            if need > len(self.free_blocks):
                break
            waiting.popleft()
            seq.blocks = [self.free_blocks.popleft() for _ in range(need)]
            running.append(seq)
            n = min(len(seq.tokens), budget)
            batch.append((seq, n))
            budget -= n
        return batch

    def run_step(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor:
        """One engine step: the batch's inputs built on the host, then the registry (or the model eagerly); its logits."""
        block, width = self.shape.block_size, self.shape.max_blocks_per_req
        ids, pos, slots, starts, lens, table = [], [], [], [0], [], []
        for seq, n in batch:
            p = list(range(seq.computed, seq.computed + n))
            ids += seq.tokens[seq.computed : seq.computed + n]
            pos += p
            slots += [seq.blocks[i // block] * block + i % block for i in p]
            starts.append(starts[-1] + n)
            lens.append(seq.computed + n)
            table.append(seq.blocks + [0] * (width - len(seq.blocks)))
        def dev(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
        inputs = {
            "input_ids": dev(ids), "positions": dev(pos), "slot_mapping": dev(slots), "query_start_loc": dev(starts),
            "seq_lens": dev(lens), "block_table": dev(table), "logits_indices": dev([s - 1 for s in starts[1:]]),
        }
        actual = cg.BatchDescriptor(len(ids), len(batch), uniform=all(n == 1 for _, n in batch))
        host = HostBatch(starts[:-1], [n for _, n in batch], lens)
        if self.reg is None:
            with cg.eager_batch(actual, host):
                return self.step_fn(actual, **inputs)["logits"]
        if self.agreement is not None:
            return self.reg.run(actual, context=host, group=self.agreement, **inputs)["logits"]
        return self.reg.run(actual, context=host, **inputs)["logits"]

    def _advance(self, batch: list[tuple[Sequence, int]], logits: torch.Tensor, running: list[Sequence], finished: list[Sequence]) -> int:
        """Sample greedily for every request whose known tokens are all in the cache now; retire finished ones."""
        sampled = logits.argmax(-1)
        if self.group is not None:
            torch.distributed.broadcast(sampled, src=torch.distributed.get_global_rank(self.group, 0), group=self.group)
        next_tokens = sampled.tolist()
        produced = 0
        for row, ((seq, n), token) in enumerate(zip(batch, next_tokens, strict=True)):
            seq.computed += n
            if seq.computed < len(seq.tokens):
                continue  # a prefill chunk: more prompt to come
            if self.keep_logits:
                seq.logits[seq.computed - 1] = logits[row].to("cpu", torch.float32, copy=True)  # graph memory: copy it out
            seq.tokens.append(token)
            seq.generated += 1
            produced += 1
            if seq.generated == seq.max_new:
                running.remove(seq)
                finished.append(seq)
                self.free_blocks.extend(seq.blocks)
        return produced


def trace_requests(count: int, shape: EngineShape, vocab: int, max_prompt: int, max_new: int, seed: int = 0) -> list[Sequence]:
    """Requests shaped by the bundled trace (its prompt and output lengths, folded into the engine's limits: a prompt
    leaves room in the context for at least one new token)."""
    if max_prompt < 1 or max_new < 1:
        raise ValueError(f"trace_requests: max_prompt and max_new must be at least 1, got {max_prompt} and {max_new}")
    longest = min(max_prompt, shape.max_context - 1)
    g = torch.Generator().manual_seed(seed)
    out = []
    for rid, req in enumerate(read_trace(limit=count)):
        prompt = 1 + (req.prompt_tokens - 1) % longest
        new = 1 + (req.output_tokens - 1) % max_new
        new = min(new, shape.max_context - prompt)
        out.append(Sequence(rid, torch.randint(0, vocab, (prompt,), generator=g).tolist(), new))
    return out


def check_against_hf(model: LlamaForCausalLM, sequences: list[Sequence]) -> float:
    """Largest difference between the engine's logits and HF's own forward (SDPA, no cache) over each request.

    It switches the model's attention implementation to SDPA while it runs: not while a registry may be capturing
    this model (``reg.wait_captured()`` first), or the capture thread would run, and capture, HF's SDPA attention."""
    worst = 0.0
    model.config._attn_implementation = "sdpa"
    try:
        with torch.inference_mode():
            device = next(model.parameters()).device
            for seq in sequences:
                if not seq.logits:
                    continue
                ids = torch.tensor([seq.tokens[: max(seq.logits) + 1]], device=device)
                want = model(input_ids=ids, use_cache=False).logits[0].float().cpu()
                for position, got in seq.logits.items():
                    worst = max(worst, (got - want[position]).abs().max().item())
    finally:
        model.config._attn_implementation = ATTENTION
    return worst


def serve(config: str, mode: str, *, device: torch.device, shape: EngineShape, requests: int, max_prompt: int,
          max_new: int, backend: str = "auto", check: bool = True, progress: Progress | None = None,
          group: Any = None, background: bool = False, gpu_memory_utilization: float | None = None,
          graph_and_kv_bytes: int | None = None, inductor: bool = False, capture_first: bool = False,
          fuse: bool = False) -> tuple[EngineResult, cg.GraphRegistry | None]:
    """Build, capture and serve ``requests`` trace requests in ``mode``; with ``check``, compare with HF.

    ``progress``: reports each stage that runs long (model, capture, serving, the HF check) on stderr.
    ``group``: serve tensor parallel over this initialized process group (every rank of it calls ``serve`` with the
    same arguments): each rank builds the same full model, keeps its shard (``shard_model``), and the check compares
    every logit with HF's forward of the full model, TP=1; ``max_abs_error`` is the largest over the ranks.
    ``background``: capture while serving (refused by the registry with a process group of more than one rank).
    ``gpu_memory_utilization``: the KV cache sized after the model and the plan's estimated graphs, so that they take
    this share of the GPU's memory (``size_kv_cache``); ``graph_and_kv_bytes``: the same with the bytes given.
    ``inductor``: the decoder compiled once by Inductor, in pieces around the attention, for every key (``new_registry``).
    ``capture_first`` (with a budget): no estimate; the KV cache's addresses reserved (``reserve_kv_cache``), the plan
    captured, then the cache backed with what the budget has left (``back_kv_cache``).
    ``fuse``: the q/k/v and gate/up projections fused (``fuse_projections``; HF's check still runs HF's own modules).
    """
    report = progress or Progress(mode, after=float("inf"))
    sizing = gpu_memory_utilization is not None or graph_and_kv_bytes is not None
    if capture_first and (not sizing or background):
        raise ValueError("capture_first sizes the KV cache after a foreground capture: give gpu_memory_utilization or "
                         f"graph_and_kv_bytes, without background (got background={background})")
    if sizing:
        shape = EngineShape(shape.max_num_seqs, shape.max_num_tokens, shape.block_size, shape.max_blocks_per_req, kv_blocks=shape.min_blocks)
    report.begin(f"building {config} on {device}")
    model = reference = build_model(config, device, shape)
    if group is not None:
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        model = shard_model(copy.deepcopy(model) if check else model, rank, world, group)
    report.update(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} billion parameters")
    if fuse:
        fuse_projections(model)
    report.begin("capturing")
    bar = None if config == "tiny" else group is None or torch.distributed.get_rank(group) == 0  # a bar for long captures
    if capture_first:
        reservations = reserve_kv_cache(model, shape)
        reg, plan = new_registry(model, shape, mode, backend, inductor=inductor) if mode != "none" else (None, None)
        if reg is not None:
            with torch.inference_mode():
                reg.capture(plan, progress=bar, context=capture_context(mode))
        backed = sum(memory.backed_bytes for memory in reservations)
        if graph_and_kv_bytes is not None:
            kv_bytes = graph_and_kv_bytes - (reg.memory_bytes() if reg is not None else 0)
        else:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            kv_bytes = int(gpu_memory_utilization * total) - (total - free) + backed  # type: ignore[operator]
        shape = back_kv_cache(model, shape, reservations, kv_bytes)
        report.update(f"KV cache {shape.num_blocks} blocks ({shape.num_blocks * kv_block_bytes(model, shape) / 2**20:.0f} MiB), "
                      f"backed after the capture")
    elif sizing:
        reg, plan = new_registry(model, shape, mode, backend, inductor=inductor) if mode != "none" else (None, None)
        if graph_and_kv_bytes is None:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(device)
            graph_and_kv_bytes = int(gpu_memory_utilization * total) - (total - free)  # type: ignore[operator]
        with torch.inference_mode():
            estimate = reg.estimate_memory(plan, context=capture_context(mode)) if reg is not None else None
        shape = size_kv_cache(model, shape, graph_and_kv_bytes, estimate)
        report.update(f"KV cache {shape.num_blocks} blocks ({shape.num_blocks * kv_block_bytes(model, shape) / 2**20:.0f} MiB), "
                      f"graphs estimated at {(estimate.capture_bytes if estimate else 0) / 2**20:.0f} MiB")
        if reg is not None:
            with torch.inference_mode():
                reg.capture(plan, background=background, progress=bar, context=capture_context(mode))
    else:
        reg = build_registry(model, shape, mode, backend, background=background, progress=bar, inductor=inductor)
    engine = Engine(model, shape, reg, keep_logits=check, group=group)
    report.begin(f"serving {requests} requests")
    result = engine.serve(trace_requests(requests, shape, model.config.vocab_size, max_prompt, max_new), progress=report.update)
    if capture_first:
        result.kv_reserved = reservations
    if check:
        if reg is not None:
            reg.wait_captured()  # the check switches the model's attention to SDPA: never while a capture runs the model
        report.begin("checking every logit against Hugging Face's forward" + (" of the full model" if group is not None else ""))
        result.max_abs_error = check_against_hf(reference, result.finished)
        if group is not None:
            result.max_abs_error = group_max(result.max_abs_error, group, device)
        report.update()
    return result, reg


def group_max(value: float, group: Any, device: torch.device) -> float:
    """The largest ``value`` over the ranks of ``group`` (one all-reduce; a NaN on any rank gives NaN)."""
    nan = math.isnan(value)
    t = torch.tensor([-math.inf if nan else value, float(nan)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
    return float("nan") if t[1].item() else t[0].item()


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def device_arg(parser: argparse.ArgumentParser, text: str) -> torch.device:
    """``--device``: a torch device this machine has (a parser error naming the value otherwise)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"argument --device: expected a torch device such as cpu, cuda or cuda:1, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"argument --device: {text!r}, but this torch ({torch.__version__}) sees no CUDA device; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        parser.error(f"argument --device: {text!r}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def tensor_parallel_launch(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> tuple[int, torch.device]:
    """Check ``--tp`` against the config and the launcher before any work; this process's rank and device."""
    try:
        TensorParallelShard.of(CONFIGS[args.config], 0, args.tp)
    except ValueError as exc:
        parser.error(f"argument --tp: {exc} ({args.config})")
    if args.background:
        parser.error(f"argument --background: not with --tp {args.tp}: the registry refuses capture(background=True) with "
                     "torch.distributed initialized with more than one rank (the capture thread's warm-up collectives "
                     "would interleave with the serving thread's on the same communicator); capture in the foreground")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.tp:
        how = "not started by torchrun" if "WORLD_SIZE" not in os.environ else f"started with WORLD_SIZE={world}"
        parser.error(f"argument --tp: {args.tp} ranks need {args.tp} processes, one a rank, and this one was {how}: "
                     f"torchrun --standalone --nproc-per-node {args.tp} examples/hf_llama.py --tp {args.tp} ...")
    rank = int(os.environ["RANK"])
    if device.type == "cuda":
        if device.index is not None:
            parser.error(f"argument --device: {str(device)!r} with --tp {args.tp}: give cuda, and each rank takes cuda:LOCAL_RANK")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        if device.index >= torch.cuda.device_count():
            parser.error(f"argument --tp: rank {rank} wants {device}, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return rank, device


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny",
                        help="model shape (default: tiny; llama-3.2-1b is GPU-sized: many minutes a mode on a CPU)")
    parser.add_argument("--mode", choices=MODES, action="append", help="default: every mode")
    parser.add_argument("--requests", type=positive_int, default=12, help="requests taken from the bundled trace (default: 12)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor parallel ranks, one process each, under torchrun: heads and MLP split, two all-reduces "
                             "a layer, inside the graphs; NCCL on cuda, gloo on cpu (default: 1)")
    parser.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                        help="size the KV cache after the model and the plan's estimated graphs, so that everything takes "
                             "this share of the GPU's memory (0 < F <= 1; cuda, one process)")
    parser.add_argument("--capture-first", action="store_true",
                        help="with --gpu-memory-utilization: no estimate; reserve the KV cache's addresses, capture, then "
                             "back the cache with what is left")
    parser.add_argument("--inductor", action="store_true",
                        help="compile the decoder once with Inductor, in pieces around the attention op, for every key "
                             "(full keys: the pieces and the attention in one graph); cuda only")
    parser.add_argument("--fuse-projections", action="store_true",
                        help="serve with each layer's q/k/v and gate/up projections fused into one matmul each, as an "
                             "engine's loader does (HF's check still runs HF's own modules over the same weights)")
    parser.add_argument("--background", action="store_true",
                        help="capture between the steps it serves (one process only: not with --tp > 1)")
    args = parser.parse_args(argv)
    device = device_arg(parser, args.device)
    utilization = args.gpu_memory_utilization
    if utilization is not None:
        if not 0 < utilization <= 1:
            parser.error(f"argument --gpu-memory-utilization: expected a share of the GPU's memory, 0 < F <= 1, got {utilization}")
        if device.type != "cuda":
            parser.error(f"argument --gpu-memory-utilization: needs a CUDA device (device memory to share), got {str(device)!r}")
        if args.tp > 1:
            parser.error(f"argument --gpu-memory-utilization: not with --tp {args.tp}: each rank would size its own cache "
                         "and the ranks' schedulers could admit different batches")
    if args.capture_first and (utilization is None or args.background):
        parser.error("argument --capture-first: sizes the KV cache after a foreground capture: needs "
                     "--gpu-memory-utilization, and not --background")
    if args.inductor and device.type != "cuda":
        parser.error(f"argument --inductor: needs a CUDA device (the cpu emulator cannot record Inductor's kernels), got {str(device)!r}")
    rank = 0
    if args.tp > 1:
        rank, device = tensor_parallel_launch(parser, args, device)
    tiny = args.config == "tiny"
    if not tiny and device.type == "cpu" and rank == 0:
        print(f"note: {args.config} is GPU-sized (1.1 billion parameters, bf16); on a CPU each mode takes many minutes. "
              "Progress goes to stderr.", file=sys.stderr, flush=True)
    shape = EngineShape() if tiny else EngineShape(max_num_seqs=64, max_num_tokens=512, block_size=16, max_blocks_per_req=64)
    max_prompt, max_new = (24, 8) if tiny else (768, 128)
    tolerance = 1e-3 if CONFIGS[args.config]["dtype"] == torch.float32 else 0.25
    backend = "cuda" if device.type == "cuda" else "cpu"
    group = None
    if args.tp > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
        group = torch.distributed.group.WORLD
        shard = TensorParallelShard.of(CONFIGS[args.config], rank, args.tp)
        if rank == 0:
            print(f"tensor parallel: {args.tp} ranks ({torch.distributed.get_backend(group)}); each holds "
                  f"{shard.heads[1] - shard.heads[0]} of {CONFIGS[args.config]['num_attention_heads']} attention heads, "
                  f"{shard.kv_heads[1] - shard.kv_heads[0]} of {CONFIGS[args.config]['num_key_value_heads']} KV heads, "
                  f"{shard.intermediate[1] - shard.intermediate[0]} of {CONFIGS[args.config]['intermediate_size']} MLP columns; "
                  "logits checked against HF's forward of the full model (TP=1)", flush=True)
    try:
        for mode in args.mode or MODES:
            result, reg = serve(args.config, mode, device=device, shape=shape, requests=args.requests, max_prompt=max_prompt,
                                max_new=max_new, backend=backend, progress=Progress(mode if rank == 0 else "", after=5.0 if rank == 0 else math.inf),
                                group=group, background=args.background, gpu_memory_utilization=utilization,
                                inductor=args.inductor, capture_first=args.capture_first, fuse=args.fuse_projections)
            stats = reg.stats() if reg is not None else None
            served = f"{stats.hits} graph steps, {stats.misses} eager" if stats else "eager"
            if rank == 0:
                print(f"{mode:19} {result.steps} steps ({served}), {result.tokens} tokens, "
                      f"max |logit - HF| {result.max_abs_error:.2e}", flush=True)
            if not result.max_abs_error <= tolerance:
                sys.exit(f"{mode}: logits differ from Hugging Face's forward by {result.max_abs_error:.3g} (tolerance {tolerance})")
            if len(result.finished) != args.requests or not all(s.generated == s.max_new for s in result.finished):
                sys.exit(f"{mode}: {len(result.finished)} of {args.requests} requests finished with all their tokens")
    finally:
        if group is not None:
            group = result = reg = stats = None  # this frame's references to the group and the last registry
            release_process_group()


def release_process_group(subgroups: list[weakref.ref[Any]] | None = None) -> None:
    """Destroy the process group, and make sure nothing keeps it until interpreter exit: a gloo group freed while the
    interpreter finalizes can abort the process ("terminate called without an active exception"; 15 of 25 runs of a
    two-rank script that kept the group in a global, 0 of 25 when it dropped it first).  Registries live in reference
    cycles and their graphs hold the group's collectives, so they are collected here, while the interpreter is whole.
    The caller drops its own references first; called from a ``finally`` while an error propagates, the error's
    frames are cleared (the traceback still prints)."""
    if not torch.distributed.is_initialized():
        return
    if sys.exc_info()[2] is not None:  # called while a failure propagates: its frames (model, registry) hold the group
        traceback.clear_frames(sys.exc_info()[2])
    released = [weakref.ref(torch.distributed.group.WORLD), *(subgroups or [])]  # subgroups: the caller's new_group()s
    gc.collect()
    torch.distributed.destroy_process_group()
    if any(ref() is not None for ref in released):
        print("warning: the process group is still referenced after destroy_process_group(); drop every registry "
              "and model that holds it first (a gloo group freed at interpreter exit can abort the process)",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
