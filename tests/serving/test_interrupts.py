"""An asynchronous exception (a signal handler's KeyboardInterrupt) may land wherever the interpreter delivers one in
run(): as a function it calls starts or returns, at each call of a builtin, as run() itself starts.  The next run() is
served, correctly, and is never refused as if another run() were still in progress; nor is a call between steps."""

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
    """Run ``reg.run`` with a KeyboardInterrupt raised at the ``n``-th point of Server.run where CPython checks for a
    pending signal (the start of a call it makes, Python or builtin, and the return to it); whether it landed (False:
    the run had fewer such points)."""
    seen = [0]
    code = Server.run.__code__

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        ours = frame.f_code is code if event in ("c_call", "c_return") else (
            frame.f_code is code or (frame.f_back is not None and frame.f_back.f_code is code))
        if ours:
            seen[0] += 1
            if seen[0] == n:
                raise KeyboardInterrupt

    sys.setprofile(profile)
    try:
        reg.run(batch, x=x)
    except KeyboardInterrupt:
        return True
    finally:
        sys.setprofile(None)
    return False


def test_an_interrupt_anywhere_in_run_leaves_the_registry_serving() -> None:
    w = torch.randn(WIDTH, WIDTH)
    reg = cg.GraphRegistry(lambda batch, x: x @ w, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=[4, 8]))
    landed = 0
    for n in range(1, 200):
        for batch in (B.decode(3), B.decode(12)):  # a graph, and an eager miss
            x = torch.randn(batch.num_tokens, WIDTH)
            if not interrupted_at(reg, n, batch, x):
                continue
            landed += 1
            y = torch.randn(batch.num_tokens, WIDTH)
            torch.testing.assert_close(reg.run(batch, x=y), y @ w)  # not ConcurrentRunError, and the right result
            assert reg.wait_captured(timeout=0) and reg.refresh().recaptured == ()  # nor refused between steps
    assert landed > 20, "the interrupt landed at every point of both paths"
