"""Debug mode's stale-output clock and the serving-state test under the paths a third hostile review found.

Each case: a run() that raises after (or without) writing the static buffers, then the output of the
run before it is read.  Overwritten must mean ``StaleOutputError``; untouched must read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.capture import serving_state
from cgregistry.testing import make_plugins
from tests.serving.test_serving_safety import Tiny


def breakable_registry(in_break: Callable[[], None]) -> cg.GraphRegistry:
    """A debug registry whose step has an eager break that calls ``in_break()`` first."""

    @cg.eager_break
    def brk(h: torch.Tensor) -> torch.Tensor:
        in_break()
        return h + 0

    def step(batch: B, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return brk(y), y

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=make_plugins(), debug=True)
    reg.capture([(B(4), "breakable")], progress=False)
    return reg


def test_a_run_called_back_from_a_break_leaves_the_outputs_it_overwrote_stale() -> None:
    calls_back = [False]
    reg: cg.GraphRegistry

    def in_break() -> None:
        if calls_back[0]:
            reg.run(B(2), x=torch.zeros(2))  # refused: the outer run() holds the buffers

    reg = breakable_registry(in_break)
    before = reg.run(B(4), x=torch.ones(4))
    calls_back[0] = True
    with pytest.raises(cg.ConcurrentRunError, match="inside a run"):
        reg.run(B(4), x=torch.full((4,), 10.0))
    with pytest.raises(cg.StaleOutputError):
        before[1].clone()


def test_a_break_that_swallows_a_refused_call_back_and_fails_leaves_the_outputs_stale() -> None:
    bad = [False]
    reg: cg.GraphRegistry

    def in_break() -> None:
        if bad[0]:
            try:
                reg.run(B(2), x=torch.zeros(2))
            except cg.ConcurrentRunError:
                pass
            raise IndexError("token id out of range")  # the batch is bad: replay and eager both raise

    reg = breakable_registry(in_break)
    before = reg.run(B(4), x=torch.ones(4))
    bad[0] = True
    with pytest.raises(IndexError):
        reg.run(B(4), x=torch.full((4,), 10.0))
    with pytest.raises(cg.StaleOutputError):
        before[1].clone()


def test_an_interrupt_during_a_replay_leaves_the_outputs_stale() -> None:
    interrupt = [False]

    def in_break() -> None:
        if interrupt[0]:
            raise KeyboardInterrupt

    reg = breakable_registry(in_break)
    before = reg.run(B(4), x=torch.ones(4))
    interrupt[0] = True
    with pytest.raises(KeyboardInterrupt):
        reg.run(B(4), x=torch.full((4,), 10.0))
    interrupt[0] = False
    with pytest.raises(cg.StaleOutputError):
        before[1].clone()
    assert reg.run(B(4), x=torch.ones(4))[1].tolist() == [2.0] * 4  # and the registry serves on


@pytest.mark.parametrize("budget", [None, 0])
def test_a_refused_step_after_a_capture_piece_makes_earlier_outputs_stale_and_one_after_none_does_not(budget: float | None) -> None:
    """A capture piece run before a step resets the static buffers and records into the pool, so an output kept from
    an earlier run may be overwritten even when the step itself is then refused: debug mode says so.  With no piece
    (capture_budget=0), a refused step overwrites nothing."""

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 6:
            raise IndexError("token id out of range")
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu", plugins=make_plugins(),
                           debug=True, capture_budget=budget)
    reg.capture([(B(4), "full")], progress=False)
    before = reg.run(B(3), x=torch.ones(3))
    reg.capture([(B(8), "full")], background=True, progress=False)
    with pytest.raises(IndexError):
        reg.run(B(6), x=torch.ones(6))  # a piece of B(8) first, unless the budget is 0; the eager step refuses the batch
    if budget == 0:
        assert before.tolist() == [2.0] * 3
    else:
        with pytest.raises(cg.StaleOutputError):
            before.tolist()


@pytest.mark.parametrize("between", ["capture_pending", "handed capture", "release"])
def test_a_call_between_steps_that_changes_graphs_makes_earlier_outputs_stale(between: str) -> None:
    """capture_pending(), a capture handed over with call_on_owner() and release() reset the static buffers or record
    into (or free) the pool between steps: an output kept from the run before may be overwritten, and debug mode says
    so at its next read."""
    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((8,), torch.float32)}, backend="cpu",
                           plugins=make_plugins(), debug=True)
    reg.capture([(B(4), "full")], progress=False)
    before = reg.run(B(3), x=torch.ones(3))
    if between == "capture_pending":
        reg.capture([(B(8), "full")], background=True, progress=False)
        assert reg.capture_pending(None)
    elif between == "handed capture":
        reg.call_on_owner(reg.capture, [(B(8), "full")]).result(timeout=0)
    else:
        reg.release(B(4))
    with pytest.raises(cg.StaleOutputError):
        before.tolist()


def test_a_weight_change_on_another_thread_mid_check_does_not_let_a_cudnn_flag_change_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """The state test is read whole: a ``failing()`` from another thread between its parts must not mix them."""

    model = Tiny()
    real_guard = serving_state.GlobalStateGuard
    if real_guard is None:
        pytest.skip("this torch build has no GlobalStateGuard")
    switch_now = [False]

    class SwitchingGuard:
        """The real guard; once asked, another thread registers a buffer right after its check (a legal GIL switch)."""

        def __init__(self) -> None:
            self.guard = real_guard()

        def check(self) -> bool:
            result = self.guard.check()
            if switch_now[0]:
                switch_now[0] = False
                other = threading.Thread(target=lambda: model.register_buffer("adapter", None))
                other.start()
                other.join()
            return result

    monkeypatch.setattr(serving_state, "GlobalStateGuard", SwitchingGuard)
    was = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = False
        reg = cg.GraphRegistry(model, {"x": cg.StaticInput((8, 3), torch.float32)}, backend="cpu", plugins=make_plugins())
        reg.capture([(B(8), "full")], progress=False)
        x = torch.randn(5, 3)
        reg.run(B(5), x=x)
        torch.backends.cudnn.allow_tf32 = True
        switch_now[0] = True
        with pytest.raises(cg.ServingStateError, match="allow_tf32"):
            reg.run(B(5), x=x)
    finally:
        torch.backends.cudnn.allow_tf32 = was
