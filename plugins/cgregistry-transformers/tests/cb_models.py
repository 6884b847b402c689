"""A tiny Llama in fp32 and the oracles the plugin's tokens are checked against."""

from __future__ import annotations

import logging

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil notes on CPU, sizing warnings
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 96


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """Two layers, grouped KV heads, sdpa; weights wide enough that greedy choices are rarely near ties."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.1, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def greedy(new_tokens: int) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)


def cb_config(max_batch_tokens: int = 64, max_requests: int = 4, num_blocks: int = 16) -> ContinuousBatchingConfig:
    """Sized by hand: on a CPU, transformers cannot size the cache from free memory."""
    return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                    max_requests_per_batch=max_requests)


def prompts_of(lengths: list[int], seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@torch.no_grad()
def generate_oracle(model: LlamaForCausalLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' ``generate()``, greedy, one prompt at a time."""
    outs = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), generation_config=greedy(new_tokens))
        outs.append(out[0, len(prompt):].tolist())
    return outs


def tokens(results: dict) -> list[list[int]]:
    """``generate_batch``'s results in request order."""
    return [list(r.generated_tokens) for r in results.values()]
