"""A small decoder for demos, tests and benchmarks: RMSNorm, QKV, attention over a static KV cache, MLP.

Inputs are what a model runner hands a step: ``input_ids`` and ``req_idx`` (the request of each token) along the token
axis, ``seq_lens`` (cached context per request) along the request axis.  Each token attends to its request's cached keys
(masked by ``seq_lens``) and to itself, so its output depends on its own row only: padded rows never change real ones,
and a graph can be checked against eager row for row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from cgregistry.store.io import StaticInput
from cgregistry.key.descriptor import BatchDescriptor

__all__ = ["DemoConfig", "DemoDecoder", "attention_bias", "attention_core", "attention_kernel_into", "demo_inputs", "random_batch"]


@attrs.frozen(slots=True)
class DemoConfig:
    """Model size; ``for_device`` gives the GPU size (12 x 1024) or a CPU-friendly one."""

    layers: int = 12
    hidden: int = 1024
    heads: int = 16
    ffn: int = 2816
    vocab: int = 8192
    max_num_seqs: int = 256
    max_num_tokens: int = 2048
    context: int = 256  # cached tokens per request
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def for_device(cls, device: torch.device | str) -> DemoConfig:
        if torch.device(device).type == "cuda":
            return cls()
        return cls(layers=4, hidden=128, heads=4, ffn=352, vocab=512, max_num_seqs=32, max_num_tokens=256, context=32, dtype=torch.float32)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def attention_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_idx: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor,
) -> torch.Tensor:
    """Decode attention of each token over its request's cached keys (masked by length) and itself."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    keys = k_cache[req_idx]  # [T, C, H, D]
    values = v_cache[req_idx]
    cached = torch.einsum("thd,tchd->thc", q, keys).float() * scale
    cached = cached.masked_fill((positions[None, :] >= lens[:, None])[:, None, :], float("-inf"))
    own = (q * k).sum(-1, keepdim=True).float() * scale  # [T, H, 1]
    probs = torch.cat([cached, own], dim=-1).softmax(-1).to(q.dtype)
    return torch.einsum("thc,tchd->thd", probs[..., :-1], values) + probs[..., -1:] * v


def attention_kernel_into(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, out: torch.Tensor
) -> None:
    """The attention kernel alone, written into ``out``: the part an engine runs eagerly (the out-argument form an eager
    break of either library can take).  ``q`` is [T, H, 1, D], ``keys``/``values`` [T, H, C + 1, D], ``bias`` [T, 1, 1,
    C + 1], additive (0 or -inf), built once per step (``attention_bias``)."""
    out.copy_(nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias)[:, :, 0])


def attention_bias(lens: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of the cached keys (``positions < lens``) and each token's own key, [T, 1, 1, C + 1]: rows
    padded to a multiple of 8 elements (a view of the first C + 1), aligned as fused attention kernels want, so SDPA
    uses it as given instead of converting and padding it per call."""
    context = positions.shape[0]
    cached = torch.where(positions[None, :] < lens[:, None], 0.0, float("-inf")).to(dtype)  # [T, C]
    own_and_padding = cached.new_zeros(cached.shape[0], (context + 1 + 7) // 8 * 8 - context)  # column C: the token itself
    return torch.cat([cached, own_and_padding], dim=1)[:, None, None, : context + 1]


class _Layer(nn.Module):
    def __init__(self, cfg: DemoConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.head_dim = cfg.hidden // cfg.heads
        self.norm1 = _RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.norm2 = _RMSNorm(cfg.hidden)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)
        shape = (cfg.max_num_seqs, cfg.context, cfg.heads, self.head_dim)
        self.register_buffer("k_cache", torch.randn(shape) * 0.5, persistent=False)
        self.register_buffer("v_cache", torch.randn(shape) * 0.5, persistent=False)
        self.core: Callable[..., None] | None = None

    def attention(self, x: torch.Tensor, req_idx: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).view(t, 3, self.heads, self.head_dim).unbind(1)
        if self.core is None or bias is None:
            out = attention_core(q, k, v, self.k_cache, self.v_cache, req_idx, lens, positions)
        else:
            # Gather in the graph; only the attention kernel runs in ``core`` (an eager break, say).
            keys = torch.cat([self.k_cache[req_idx], k[:, None]], dim=1).transpose(1, 2)  # [T, H, C + 1, D]
            values = torch.cat([self.v_cache[req_idx], v[:, None]], dim=1).transpose(1, 2)
            out = torch.empty_like(q)
            self.core(q[:, :, None], keys, values, bias, out)
        return self.out(out.reshape(t, -1))

    def forward(self, x: torch.Tensor, req_idx: torch.Tensor, lens: torch.Tensor, positions: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), req_idx, lens, positions, bias)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class DemoDecoder(nn.Module):
    """The demo model; call it as a registry step: ``model(batch, input_ids=..., req_idx=..., seq_lens=...)``."""

    def __init__(
        self, cfg: DemoConfig, device: torch.device | str = "cpu", seed: int = 0, attention: Callable[..., None] | None = None
    ) -> None:
        """``attention``: an out-argument attention kernel (``attention_kernel_into`` marked as an
        eager break, say) that every layer calls instead of computing attention inline."""
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
            self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.layers))
            for layer in self.layers:
                layer.core = attention
            self.norm = _RMSNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=1.0 / math.sqrt(p.shape[-1]))
        self.register_buffer("positions", torch.arange(cfg.context), persistent=False)
        self.to(device=device, dtype=cfg.dtype)  # floating tensors only: positions stay int64
        self.eval()

    def forward(self, batch: BatchDescriptor, input_ids: torch.Tensor, req_idx: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        lens = seq_lens[req_idx]
        x = self.embed(input_ids)
        # The attention kernel's mask, once per step for every layer (as an engine builds its attention metadata).
        bias = attention_bias(lens, self.positions, x.dtype) if self.layers[0].core is not None else None
        for layer in self.layers:
            x = layer(x, req_idx, lens, self.positions, bias)
        return self.head(self.norm(x))


def demo_inputs(cfg: DemoConfig) -> dict[str, StaticInput]:
    """Static input declarations that fit ``cfg``."""
    return {
        "input_ids": StaticInput((cfg.max_num_tokens,), torch.long, fill=0),
        "req_idx": StaticInput((cfg.max_num_tokens,), torch.long, fill=0),  # padded tokens read request 0 (reads only)
        "seq_lens": StaticInput((cfg.max_num_seqs,), torch.long, axis="reqs", fill=1),
    }


def random_batch(cfg: DemoConfig, batch: BatchDescriptor, device: torch.device | str, generator: torch.Generator | None = None) -> dict[str, Any]:
    """Live inputs for ``batch``: random tokens, tokens spread over requests, random context lengths."""
    reqs = batch.num_reqs or 1
    tokens = batch.num_tokens
    if batch.uniform:
        req_idx = torch.arange(reqs).repeat_interleave(1 + batch.spec_depth)
    else:
        # every request gets at least one token, the rest go to random requests, kept sorted like a runner would
        extra = torch.randint(0, reqs, (tokens - reqs,), generator=generator)
        req_idx = torch.cat([torch.arange(reqs), extra]).sort().values
    return {
        "input_ids": torch.randint(0, cfg.vocab, (tokens,), generator=generator).to(device),
        "req_idx": req_idx.to(device),
        "seq_lens": torch.randint(1, cfg.context + 1, (reqs,), generator=generator).to(device),
    }
