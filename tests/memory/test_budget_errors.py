"""Budgets given wrongly are refused with the error kind Python's own functions use (TypeError for a wrong type,
ValueError for a wrong value), a message that names the value and what was expected, and nothing longer."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.capture.memory import MemoryEstimate, Probe

SETTINGS = dict(max_num_seqs=16, max_num_tokens=64, mode="full_and_breakable")
ESTIMATE = MemoryEstimate("cpu", (), 640, 0, 0, (Probe(B(64), "full", 640, 64, 0, 0, 0.64),))


@pytest.mark.parametrize("budget", [True, 1.5, "1GiB"])
def test_a_memory_budget_that_is_no_int_is_a_type_error(budget: object) -> None:
    with pytest.raises(TypeError, match=rf"memory_budget must be an int byte count >= 0 or None, got {budget!r}"):
        cg.GraphRegistry(lambda b, x: x, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", memory_budget=budget)


def test_fit_with_a_max_bytes_that_is_no_int_says_so_briefly() -> None:
    with pytest.raises(TypeError, match=r"max_bytes must be an int byte count >= 0, got 1.5 \(float\)") as info:
        cg.CapturePlan.fit({8: 10}, None, max_bytes=1.5, memory=ESTIMATE, **SETTINGS)
    assert len(str(info.value)) < 200


def test_an_adaptation_priced_by_an_estimate_missing_a_strategy_names_it() -> None:
    with pytest.raises(ValueError, match=r"Adaptation: .*prices no key of strategy 'breakable' \(it prices \['full'\]\)"):
        cg.Adaptation(max_bytes=1 << 30, memory=ESTIMATE, settings=SETTINGS)
