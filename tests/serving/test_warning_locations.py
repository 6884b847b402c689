"""Every warning points at the engine's own line (the run() or capture() call that caused it), never at cgregistry's
internals or at ``sys:1``."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B

WIDTH = 8


def make(step=None) -> cg.GraphRegistry:  # type: ignore[no-untyped-def]
    return cg.GraphRegistry(step or (lambda b, x: x * 2), {"x": cg.StaticInput((16, WIDTH), torch.float32)}, backend="cpu")


def test_a_run_before_any_capture_warns_at_the_run_call() -> None:
    reg = make()
    with pytest.warns(RuntimeWarning, match="no graph captured or planned") as record:
        reg.run(B.decode(3), x=torch.ones(3, WIDTH))
    assert record[0].filename == __file__


def test_a_batch_larger_than_a_static_input_warns_at_the_run_call() -> None:
    reg = make()
    reg.capture([(B.decode(4), "full")])
    with pytest.warns(RuntimeWarning, match="enlarge that StaticInput") as record:
        reg.run(B(20, 1, uniform=False), x=torch.ones(20, WIDTH))
    assert record[0].filename == __file__


def test_a_failed_lazy_capture_warns_at_the_run_call() -> None:
    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 8 and cg.current_batch() is not None and cg.current_batch().key is not None:
            raise RuntimeError("cannot capture this one")
        return x * 2

    reg = make(step)
    reg.capture([(B.decode(8), "full")], lazy=True)
    with pytest.warns(RuntimeWarning, match="cannot capture this one") as record:
        reg.run(B.decode(5), x=torch.ones(5, WIDTH))
    assert record[0].filename == __file__
