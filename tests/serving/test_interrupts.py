"""An asynchronous exception (a signal handler's KeyboardInterrupt) may land at any instruction of run(): the next run()
is served, correctly, and is never refused as if another run() were still in progress."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.server import Server

WIDTH, MAX_TOKENS = 8, 16


def interrupted_at(reg: cg.GraphRegistry, n: int, batch: B, x: torch.Tensor) -> bool:
    """Run ``reg.run`` with a KeyboardInterrupt raised at the ``n``-th instruction of Server.run's own frame; whether
    it landed (False: the run had fewer instructions)."""
    seen = [0]
    code = Server.run.__code__

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is code:
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(tracer)
    try:
        reg.run(batch, x=x)
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
    return False


def test_an_interrupt_anywhere_in_run_leaves_the_registry_serving() -> None:
    w = torch.randn(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: x @ w, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4, 8]))
    landed = 0
    for n in range(1, 400):
        for batch in (B.decode(3), B.decode(12)):  # a graph, and an eager miss
            x = torch.randn(batch.num_tokens, WIDTH)
            if not interrupted_at(reg, n, batch, x):
                continue
            landed += 1
            y = torch.randn(batch.num_tokens, WIDTH)
            torch.testing.assert_close(reg.run(batch, x=y), y @ w)  # not ConcurrentRunError, and the right result
    assert landed > 20, "the interrupt landed at every instruction of both paths"
