"""Every token cgregistry's graphs serve equals transformers' own eager continuous batching and ``generate()``."""

from __future__ import annotations

import pytest
import torch
from cb_models import cb_config, generate_oracle, greedy, prompts_of, tiny_llama, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cgregistry as cg
import cgregistry_transformers as cgt


def served(model, prompts, new_tokens, config, graphs=None):
    """generate_batch through the registry, with every step's batch and whether a graph served it."""
    steps: list[tuple[cg.BatchDescriptor, bool]] = []
    manager = cgt.init_continuous_batching(model, greedy(new_tokens), config,
                                           graphs=graphs or cgt.GraphSettings(capture="at start"))
    runner = manager.batch_processor.model_runner
    forward = runner.forward

    def recorded(**batch_data):
        hits = runner.registry.stats().hits
        out = forward(**batch_data)
        io = runner.io
        actual = cg.BatchDescriptor.from_query_lens([f.query_length for f in io.requests_in_batch])
        steps.append((actual, runner.registry.stats().hits > hits))
        return out

    runner.forward = recorded
    model._cached_continuous_batching_manager = manager
    try:
        results = model.generate_batch(prompts, generation_config=greedy(new_tokens))
    finally:
        model.__dict__.pop("_cached_continuous_batching_manager", None)
    return tokens(results), steps


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_decode_only_batches_replay_graphs_and_match(model):
    prompts = prompts_of([3, 9, 5, 12])
    got, steps = served(model, prompts, 10, cb_config(max_batch_tokens=64, max_requests=4))
    assert got == generate_oracle(model, prompts, 10)
    assert got == tokens(model.generate_batch(prompts, generation_config=greedy(10), continuous_batching_config=cb_config()))
    decode = [(batch, hit) for batch, hit in steps if batch.uniform]
    assert len(decode) >= 9 and all(hit for _, hit in decode)  # every decode-only step came from a graph


def test_mixed_prefill_and_decode_batches_match(model):
    prompts = prompts_of([7, 20, 4, 15, 11, 2])
    got, steps = served(model, prompts, 6, cb_config(max_batch_tokens=24, max_requests=3))
    assert got == generate_oracle(model, prompts, 6)
    mixed = [batch for batch, hit in steps if hit and not batch.uniform and batch.num_reqs > 1]
    assert mixed, f"no mixed batch of prefill and decode was served by a graph: {steps}"


def test_a_long_prompt_is_split_in_chunks_and_matches(model):
    prompts = prompts_of([90, 5])
    got, steps = served(model, prompts, 5, cb_config(max_batch_tokens=16, max_requests=2))
    assert got == generate_oracle(model, prompts, 5)
    assert sum(1 for batch, _ in steps if batch.num_tokens == 16) >= 5  # the prompt went through in 16-token chunks


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), new_tokens=st.integers(1, 5),
       max_batch_tokens=st.sampled_from([8, 16, 32]), max_requests=st.integers(1, 4), seed=st.integers(0, 3))
def test_any_prompt_lengths_and_batch_mix_match_generate(model, lengths, new_tokens, max_batch_tokens, max_requests,
                                                         seed):
    prompts = prompts_of(lengths, seed)
    got, _ = served(model, prompts, new_tokens, cb_config(max_batch_tokens, max_requests))
    assert got == generate_oracle(model, prompts, new_tokens)
