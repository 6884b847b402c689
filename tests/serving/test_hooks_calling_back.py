"""Hooks that call back into the registry mid-capture see the registry as it is: a run() from a capture_finished hook
of a foreground capture serves its lazy key once, captured once."""

from __future__ import annotations

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins

WIDTH, MAX_TOKENS = 8, 32


def test_a_run_from_a_capture_finished_hook_captures_a_lazy_key_once() -> None:
    captures: list[int] = []
    calls: list[torch.Tensor] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if captures.count(4) > 3:  # stop a runaway loop: the test then fails on the count below
            raise RuntimeError("captured the same key again and again")
        return x * 2

    class RunFromHook:
        @cg.plugin.hookimpl
        def cgregistry_capture_started(self, registry, key, strategy):  # noqa: ANN001
            captures.append(key.num_tokens)

        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            if key.num_tokens == 16 and not calls:
                calls.append(reg.run(B.decode(3), x=torch.ones(3, WIDTH)).clone())

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu",
                           plugins=make_plugins(RunFromHook()))
    small = cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4])
    reg.capture(small, lazy=True)
    reg.capture(cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[16, 32]))
    assert captures.count(4) == 1 and reg.stats().lazy_captures == 1
    torch.testing.assert_close(calls[0], torch.full((3, WIDTH), 2.0))
    assert reg.failures() == {} and len(reg) == 3
