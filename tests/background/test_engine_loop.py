"""Capture while serving keeps its promises under an engine's loop: run() called back to back with nothing between
steps gets a graph by its second step and every key captured in pieces, an adapting registry refits as the traffic
asks and serves most steps from graphs, the key a step needs goes first, and the loop's odd moments (a weight swap in
debug mode, hooks reading the registry, an interrupt from the step, bad arguments) are handled."""

from __future__ import annotations

import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.background.test_background import Engine, batch_inputs, make

WIDTH = 32


class Cheap:
    """Eight 32 x 32 matmuls: a step so cheap that an engine calls run() back to back, host-bound.  It logs the key
    of each call that captures (a warm-up or a recording) and the index of the step it ran in."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = [torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5 for _ in range(8)]
        self.step_index = 0
        self.captures: list[tuple[int, B]] = []

    def step(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        key = cg.current_batch().key
        if key is not None:
            self.captures.append((self.step_index, key))
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x

    def eager(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.tanh(x @ w)
        return x


def cheap_registry(model: Cheap, **kwargs: object) -> cg.GraphRegistry:
    return cg.GraphRegistry(model.step, {"x": cg.StaticInput((512, WIDTH), torch.float32)}, backend="cpu", **kwargs)


def test_back_to_back_runs_serve_a_graph_by_the_second_step_and_capture_every_key_in_pieces() -> None:
    """run() back to back over 11 keys, nothing between steps: the first step warms up the key its batch needs, the
    second records it and is served by it, and each step takes at least one piece, so every key is captured by the
    step after its pieces (two a key).  The wall-clock ratio to a foreground capture is benchmarks/test_busy_loop.py's."""
    model = Cheap()
    plan = cg.CapturePlan.of([(B.decode(n), "full") for n in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)])
    reg = cheap_registry(model)
    g = torch.Generator().manual_seed(1)
    sizes = torch.randint(1, 65, (400,), generator=g).tolist()
    reg.capture(plan, background=True)
    served: list[bool] = []
    for index, n in enumerate(sizes):
        model.step_index = index
        x = torch.randn(n, WIDTH, generator=g)
        hits = reg.stats().hits
        torch.testing.assert_close(reg.run(B.decode(n), x=x), model.eager(x), rtol=1e-5, atol=1e-5)
        served.append(reg.stats().hits > hits)
        if not reg.capturing():
            break
    assert served.index(True) <= 1, f"the first graph-served step was step {served.index(True) + 1}"
    assert model.captures[:2] == [(0, model.captures[0][1]), (1, model.captures[0][1])], "warm-up, then its recording"
    assert len(reg) == len(plan) and index < 2 * len(plan), f"{index + 1} steps for {len(plan)} keys"
    assert all(served[2 * len(plan):]), "once captured, every step is served by a graph"


def test_a_gapless_loop_of_an_adapting_registry_serves_most_steps_from_graphs_and_refits_as_traffic_asks() -> None:
    """6,000 steps back to back of a cheap host-bound step, an adapting registry, a 51-key plan captured while serving:
    at least 70% of the steps are served by graphs, and refits follow the traffic (more than one plan change)."""
    model = Cheap()
    settings = dict(max_num_seqs=256, max_num_tokens=512, mode="full")
    plan = cg.CapturePlan.build(**settings)
    assert len(plan) == 51
    adapt = cg.Adaptation(max_graphs=24, settings=settings, every_steps=500, min_steps=500, decay=0.5, min_gain=0.0)
    reg = cheap_registry(model, adapt=adapt)
    g = torch.Generator().manual_seed(2)
    xs = torch.randn(256, WIDTH, generator=g)
    reg.capture(plan, background=True)
    served = []
    for phase in range(3):  # the traffic shifts: small batches, then large, then small again
        low, high = ((1, 24), (96, 256), (1, 24))[phase]
        hits = reg.stats().hits
        for n in torch.randint(low, high + 1, (2000,), generator=g).tolist():
            reg.run(B.decode(n), x=xs[:n])
        served.append(reg.stats().hits - hits)
    x = xs[:7]
    torch.testing.assert_close(reg.run(B.decode(7), x=x), model.eager(x), rtol=1e-5, atol=1e-5)
    assert sum(served) >= 0.7 * 6000 and min(served) >= 1000, f"steps served by graphs in each 2,000: {served}"
    assert reg.stats().plan_changes >= 2, f"{reg.stats().plan_changes} refits"


def test_the_key_a_step_needs_is_captured_next_unless_the_next_one_serves_it() -> None:
    engine = Engine()
    plan = cg.CapturePlan.of([(B.decode(n), "full") for n in (2, 4, 8, 16, 32, 64)])
    reg = make(engine, capture_budget=1e-9, max_padding_tokens=8)
    reg.capture(plan, background=True)  # order: 64 first (it covers every batch, padded), then 2, 4, 8, ...
    batch, inputs = batch_inputs(60, 0)
    reg.run(batch, **inputs)  # the next key (64) serves it: nothing moves
    batch, inputs = batch_inputs(11, 1)
    reg.run(batch, **inputs)  # 64 recorded (its warm-up ran); 64 pads 11 past the cap: 16 goes next
    reg.run(batch, **inputs)  # 16 warmed up
    reg.run(batch, **inputs)  # 16 recorded: it serves the step
    assert [key.num_tokens for key in engine.calls if key is not None] == [64, 64, 16, 16]
    assert reg.match(batch).key == B.decode(16) and reg.stats().hits == 1
    assert [k.num_tokens for k, _ in reg.capturing()] == [2, 4, 8, 32]


def test_debug_mode_after_a_weight_swap_before_any_capture_has_no_false_alarm() -> None:
    model = torch.nn.Linear(8, 8)
    model.weight = torch.nn.Parameter(torch.randn(8, 8))  # replaced before any capture: nothing reads the old one

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16, 8), torch.float32)}, backend="cpu", debug=True)
    reg.watch(model, prefix="model.")
    model.weight = torch.nn.Parameter(torch.randn(8, 8))
    reg.capture([(B.decode(16), "full")], background=True)
    assert reg.wait_captured()
    x = torch.randn(5, 8)
    torch.testing.assert_close(reg.run(B.decode(5), x=x), model(x))
    model.weight = torch.nn.Parameter(torch.randn(8, 8))  # after capture: the graph reads the old tensor
    with pytest.raises(cg.DebugError, match="model.weight moved"):
        reg.run(B.decode(5), x=x)


def test_hooks_read_the_registry_while_pending_keys_are_captured() -> None:
    problems: list[str] = []

    class Reader:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            registry.stats()
            registry.entries()
            registry.snapshot()

    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=64, mode="full")
    engine = Engine()
    reg = make(engine, plugins=make_plugins(Reader()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg.capture(plan, background=True)
        for i in range(100):
            batch, inputs = batch_inputs(1 + i % 64, i)
            reg.run(batch, **inputs)
        reg.wait_captured()
    problems += [str(w.message) for w in caught if "Reader" in str(w.message)]
    assert problems == [] and len(reg) == len(plan)


def test_an_interrupt_from_the_step_in_a_piece_reaches_the_caller_and_leaves_the_key_pending() -> None:
    raised = [False]

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 8 and cg.current_batch().key is not None and not raised[0]:
            raised[0] = True
            raise KeyboardInterrupt
        return x * 2

    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((16,), torch.float32)}, backend="cpu", capture_budget=1e-9)
    reg.capture([(B(8), "full"), (B(16), "full")], background=True)  # 16 first (the largest), then 8
    x = torch.ones(4)
    for _ in range(2):
        reg.run(B(4), x=x)  # 16: warm-up, recording
    with pytest.raises(KeyboardInterrupt):
        reg.run(B(4), x=x)  # 8's warm-up, interrupted
    assert reg.capturing() == [(B(8), "full")] and reg.failures() == {}
    assert reg.wait_captured() and len(reg) == 2
    torch.testing.assert_close(reg.run(B(4), x=x), x * 2)


def test_wait_capture_pending_and_budget_arguments_are_checked() -> None:
    reg = make(Engine())
    reg.capture([(B.decode(4), "full")], background=True)
    assert reg.wait_captured(timeout=float("inf")) is True
    with pytest.raises(TypeError, match=r"wait_captured\(timeout=...\) takes seconds .* got '5'"):
        reg.wait_captured(timeout="5")  # type: ignore[arg-type]
    for negative in (-1, float("nan")):
        with pytest.raises(ValueError, match=r"wait_captured\(timeout=...\) takes seconds >= 0 .* got (-1|nan)"):
            reg.wait_captured(timeout=negative)
    with pytest.raises(TypeError, match=r"capture_pending\(seconds=...\) takes seconds .* got True"):
        reg.capture_pending(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"capture\(background=...\) takes a bool, got 'yes'"):
        reg.capture([(B.decode(2), "full")], background="yes")  # type: ignore[arg-type]
    for bad, error in ((-0.5, ValueError), ("1", TypeError), (float("nan"), ValueError), (True, TypeError)):
        with pytest.raises(error, match=r"capture_budget takes seconds"):
            reg.capture_budget = bad  # type: ignore[assignment]
        with pytest.raises(error, match=r"capture_budget takes seconds"):
            make(Engine(), capture_budget=bad)
    reg.capture_budget = 0
    assert reg.capture_budget == 0 and reg.capturing() == [] and len(reg) == 1
