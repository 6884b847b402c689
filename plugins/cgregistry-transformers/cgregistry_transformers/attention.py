"""Each layer's attention as an eager break: the graphs hold the projections, norms and MLP of every layer, and the
attention runs between graph segments through transformers' own paged attention on the live batch, so one set of
graphs serves every KV length (transformers' own graphs need one per padded KV length)."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cgregistry as cg

from .switch import in_served_step, own_implementation

NAME = "cgregistry_breakable"  # the attention implementation the graphs' step runs the model with
# What the model itself consumes of a batch's kwargs; the rest reaches every attention call as keyword arguments.
MODEL_ARGUMENTS = frozenset({"input_ids", "position_ids", "attention_mask", "use_cache", "logits_to_keep",
                             "past_key_values", "inputs_embeds"})


# Implementations that attend through a dense mask over the packed batch; on CUDA, in half precision, a model whose
# layers all attend fully is served by varlen flash attention over the same cache reads instead (see ``varlen``).
MASKED = frozenset({"sdpa", "paged|sdpa", "eager", "paged|eager"})


class TransformersAttention:
    """How the installed transformers attends one layer of a continuous batch, eagerly: the attention function of the
    implementation the manager chose, after the paged cache's update where the model (not that function) makes it.

    ``varlen``: the cache is written and read by transformers' own ``cache.update``, and the attention over what it
    read runs as torch's varlen flash kernel (``cu_seq_lens``, causal from the end of each request's keys) instead of
    SDPA over the dense mask: SDPA's default CUDA backend (cuDNN) plans each new shape on the host, tens of ms, and
    every step of continuous batching reads a new key length (transformers' own graphs freeze one padded shape)."""

    def __init__(self, implementation: str, cache: Any, config: Any, device: torch.device, dtype: torch.dtype) -> None:
        if implementation == NAME:
            raise ValueError(f"the model's attention implementation is already {NAME!r}: give the one transformers' "
                             "continuous batching chose for it ('sdpa', 'paged|sdpa', a flash implementation, ...)")
        self.function: Callable[..., tuple[torch.Tensor, Any]] = ALL_ATTENTION_FUNCTIONS[implementation]
        self.implementation = implementation
        self.cache = cache
        # Where the paged cache is written: releases whose cache.update takes the batch's kwargs have the attention
        # module call it before the attention function; earlier ones leave it to a "paged|" attention function.
        self.model_updates_cache = "kwargs" in inspect.signature(type(cache).update).parameters
        full = all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"]))
        plain = getattr(config, "attn_logit_softcapping", None) is None  # what the flash kernel does not apply
        self.varlen = (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and full and plain
                       and implementation in MASKED)

    def read_cache(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                   kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's keys and values, read every key each token sees: (keys, kv_heads, head_dim) each."""
        if self.model_updates_cache:
            key, value = self.cache.update(key, value, module.layer_idx, kwargs=kwargs)
            return key[0].transpose(0, 1), value[0].transpose(0, 1)
        return self.cache.update(key, value, module.layer_idx, kwargs["read_index"], kwargs["write_index"])

    def flash(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              kwargs: dict[str, Any], scaling: float | None) -> torch.Tensor:
        key, value = self.read_cache(module, key, value, kwargs)
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
        max_q = kwargs["max_length_q"] if "max_length_q" in kwargs else kwargs["max_seqlen_q"]
        max_k = kwargs["max_length_k"] if "max_length_k" in kwargs else kwargs["max_seqlen_k"]
        cu_k = cu_k["full_attention"] if isinstance(cu_k, dict) else cu_k
        max_k = max_k["full_attention"] if isinstance(max_k, dict) else max_k
        out = torch.ops.aten._flash_attention_forward(query[0].transpose(0, 1), key, value, cu_q, cu_k, max_q, max_k,
                                                      0.0, True, False, scale=scaling)[0]
        return out[None]  # (1, tokens, heads, head_dim)

    def layer_kwargs(self, batch_data: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments the model hands every attention call for this batch (what it does not consume)."""
        kwargs = {k: v for k, v in batch_data.items() if k not in MODEL_ARGUMENTS}
        if self.model_updates_cache:
            kwargs.pop("cache", None)  # a named argument of the model there, not forwarded to attention
        return kwargs

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 mask: Any, kwargs: Mapping[str, Any], scaling: float | None) -> torch.Tensor:
        """One layer's attention over ``query``'s tokens, (1, tokens, heads, head_dim), the cache written as it goes."""
        kwargs = dict(kwargs)  # cache.update narrows the per-layer-type entries in place: a fresh dict per layer
        if self.varlen:
            return self.flash(module, query, key, value, kwargs, scaling)
        if self.model_updates_cache:
            key, value = self.cache.update(key, value, module.layer_idx, kwargs=kwargs)
        if isinstance(mask, dict):  # one mask per layer type (sliding-window models)
            mask = mask[module.config.layer_types[module.layer_idx]]
        out, _ = self.function(module, query, key, value, mask, dropout=0.0, scaling=scaling, **kwargs)
        return out


class LiveBatch:
    """What the attention break reads of the batch being served (``run(..., context=...)``): its real token count, the
    kwargs transformers prepared for it (unpadded), its mask, and how to attend."""

    __slots__ = ("num_tokens", "kwargs", "mask", "attend")

    def __init__(self, batch_data: Mapping[str, Any], num_tokens: int, attend: TransformersAttention) -> None:
        self.num_tokens = num_tokens
        self.kwargs = attend.layer_kwargs(batch_data)
        self.mask = batch_data.get("attention_mask")
        self.attend = attend

    def attend_into(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    out: torch.Tensor, scaling: float | None) -> None:
        """Write this batch's attention for its real tokens into ``out``'s first rows (padded rows stay zero)."""
        n = self.num_tokens
        result = self.attend(module, query[:, :, :n], key[:, :, :n], value[:, :, :n], self.mask, self.kwargs, scaling)
        out[:, :n].copy_(result)


def _skip_during_capture(*args: Any) -> None:
    """While segments are recorded there is no live batch: nothing is attended and the KV cache is not touched."""


@cg.eager_break(capture_stub=_skip_during_capture, name="transformers paged attention")
def attend_live_batch(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      out: torch.Tensor, scaling: float | None) -> None:
    """The live batch's attention for its real tokens, into ``out``'s first rows (padded rows stay zero)."""
    live = cg.current_batch()
    batch = live.payload if live is not None else None
    if isinstance(batch, LiveBatch):  # else a capture's warm-up runs the all-padding batch: the cache stays as it is
        batch.attend_into(module, query, key, value, out, scaling)


def graph_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention implementation ``NAME``: an output buffer made inside the graph segment (zeroed at each replay),
    filled by the eager break; (1, tokens, heads, head_dim), as transformers' attention functions return.  Outside a
    served step (a forward of the model on another thread while a manager serves it) the model's own implementation."""
    if not in_served_step():
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)  # the model's own
        function = ALL_ATTENTION_FUNCTIONS.get_interface(own_implementation(module.config), eager)  # as the model looks
        return function(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = query.new_zeros((query.shape[0], query.shape[2], query.shape[1], value.shape[3]))
    attend_live_batch(module, query, key, value, out, scaling)
    return out, None


AttentionInterface.register(NAME, graph_attention)
