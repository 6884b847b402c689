"""The default plan serves a plain step (no compile), and a capture that cannot use one strategy keeps the other's keys."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B

WIDTH = 16


def plain_registry() -> tuple[cg.GraphRegistry, torch.Tensor]:
    w = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(0))
    reg = cg.GraphRegistry(lambda batch, x: torch.tanh(x @ w), {"x": cg.StaticInput((64, WIDTH), torch.float32)}, backend="cpu")
    return reg, w


def test_the_default_plan_captures_every_key_of_a_plain_step_and_serves_decode_and_mixed_batches() -> None:
    reg, w = plain_registry()
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64)
    assert {e.strategy for e in plan} == {"full", "breakable"}
    reg.capture(plan)
    assert len(reg) == len(plan)
    for batch in (B.decode(5), B(13, 3), B(16, 2)):  # the max capture size is 2 x max_num_seqs, as vLLM's
        x = torch.randn(batch.num_tokens, WIDTH)
        torch.testing.assert_close(reg.run(batch, x=x), torch.tanh(x @ w))
        assert reg.match(batch) is not None
    assert reg.stats().hits == 3 and reg.stats().misses == 0


def test_a_strategy_that_cannot_serve_the_step_keeps_the_other_strategys_keys() -> None:
    reg, w = plain_registry()
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode="full_and_piecewise")
    pieces = sum(1 for e in plan if e.strategy == "piecewise")
    assert plan.entries[0].strategy == "piecewise", "the first key in plan order is a piecewise one"
    with pytest.raises(cg.CaptureError, match=(
        rf"strategy 'piecewise' failed: PiecewiseError: the step ran no model compiled.*'breakable' strategy.*; "
        rf"{pieces - 1} later keys of strategy 'piecewise' not tried; {len(plan) - pieces} entries captured \(full\), and they stay"
    )) as info:
        reg.capture(plan)
    assert isinstance(info.value.__cause__, cg.errors.PiecewiseError)
    assert {e.strategy for e in reg.entries()} == {"full"} and len(reg) == len(plan) - pieces
    x = torch.randn(5, WIDTH)
    torch.testing.assert_close(reg.run(B.decode(5), x=x), torch.tanh(x @ w))
    assert reg.stats().hits == 1
