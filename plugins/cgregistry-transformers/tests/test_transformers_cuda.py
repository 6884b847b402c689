"""On a GPU, in bf16: each step's logits through the graphs (varlen flash attention in the breaks) against the same
step of transformers' own eager continuous batching."""

from __future__ import annotations

import pytest
import torch
from cb_models import cb_config, greedy, prompts_of, tiny_llama

import cgregistry_transformers as cgt
from cgregistry_transformers.runner import Logits

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("when", cgt.settings.CAPTURE_WHEN)
def test_every_step_matches_transformers_eager_step_in_bf16(when):
    model = tiny_llama().to("cuda", torch.bfloat16)
    manager = cgt.init_continuous_batching(model, greedy(8), cb_config(max_batch_tokens=32, max_requests=4),
                                           graphs=cgt.GraphSettings(capture=when))
    runner = manager.batch_processor.model_runner
    assert runner.attention.varlen
    served, errors = runner.forward, []

    def against_eager(**batch_data):
        ours = served(**batch_data).logits.float().clone()
        with torch.no_grad():  # transformers' own step on the same batch (it writes the same K/V again)
            theirs = model(**batch_data).logits.float()
        errors.append(((ours - theirs).abs().max() / theirs.abs().max()).item())
        return Logits(ours)

    runner.forward = against_eager
    model._cached_continuous_batching_manager = manager
    try:
        results = model.generate_batch(prompts_of([7, 40, 3, 19, 26]), generation_config=greedy(8))
    finally:
        model.__dict__.pop("_cached_continuous_batching_manager", None)
    assert all(len(r.generated_tokens) == 8 and r.error is None for r in results.values())
    assert len(errors) > 8 and max(errors) < 2e-2, errors
