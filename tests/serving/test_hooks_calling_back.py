"""Hooks that call back into the registry mid-capture: a run() or a change to graphs from a capture_finished hook of a
foreground capture is refused as a call from inside the capture (the hook's error is warned about and ignored), and
the capture goes on to the end with nothing lost."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins

WIDTH, MAX_TOKENS = 8, 32


@pytest.mark.parametrize("call", ["run", "release", "capture"])
def test_a_call_back_from_a_capture_finished_hook_is_refused_and_the_capture_goes_on(call: str) -> None:
    captures: list[int] = []
    refused: list[BaseException] = []

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    calls = {
        "run": lambda: reg.run(B.decode(3), x=torch.ones(3, WIDTH)),
        "release": lambda: reg.release(B.decode(16)),
        "capture": lambda: reg.capture([(B.decode(8), "full")]),
    }

    class CallFromHook:
        @cg.plugin.hookimpl
        def cgregistry_capture_started(self, registry, key, strategy):  # noqa: ANN001
            captures.append(key.num_tokens)

        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            if key.num_tokens == 16 and not refused:
                try:
                    calls[call]()
                except cg.ConcurrentRunError as exc:
                    refused.append(exc)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu",
                           plugins=make_plugins(CallFromHook()))
    small = cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4])
    reg.capture(small, lazy=True)
    reg.capture(cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[16, 32]))
    assert len(refused) == 1 and "from inside" in str(refused[0]), refused
    assert captures == [32, 16], "the hook's call ran nothing: no lazy capture, no extra key"
    assert reg.failures() == {} and len(reg) == 2 and reg.stats().lazy_captures == 0
    torch.testing.assert_close(reg.run(B.decode(3), x=torch.ones(3, WIDTH)), torch.full((3, WIDTH), 2.0))
    assert reg.stats().lazy_captures == 1 and len(reg) == 3, "after capture() the lazy key is captured at its first run"
