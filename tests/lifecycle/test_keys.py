"""No key is lost across refresh(), sleep() and wake(): each key of the plan is captured, lazy (pending), queued, or
in failures(); and what sleep() keeps is exactly what was there (lazy keys stay lazy, cleared ones stay gone)."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins

WIDTH, MAX_TOKENS = 8, 32
SIZES = [4, 8, 16, 32]
PLAN = cg.CapturePlan.build(max_num_seqs=MAX_TOKENS, max_num_tokens=MAX_TOKENS, mode="full", capture_sizes=SIZES)
PAIRS = {(e.descriptor, e.strategy) for e in PLAN}


def key_of(tokens: int) -> tuple[B, str]:
    return next(p for p in PAIRS if p[0].num_tokens == tokens)


class Flaky(torch.nn.Module):
    """A step whose capture fails while ``fail_at`` names its token count (a transient OOM, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.fail_at: set[int] = set()

    def forward(self, batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens in self.fail_at and cg.current_batch() is not None and cg.current_batch().key is not None:
            raise torch.OutOfMemoryError("transient: out of memory")
        return self.linear(x)


def make() -> tuple[cg.GraphRegistry, Flaky]:
    model = Flaky()
    return cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu"), model


def accounted(reg: cg.GraphRegistry) -> set[tuple[B, str]]:
    return {(e.key, e.strategy) for e in reg.entries()} | set(reg.pending()) | set(reg.capturing()) | set(reg.failures())


def serve(reg: cg.GraphRegistry, model: Flaky, n: int) -> None:
    x = torch.randn(n, WIDTH)
    with torch.inference_mode():
        torch.testing.assert_close(reg.run(B.decode(n), x=x), model(B.decode(n), x))


@pytest.mark.parametrize("path", ["refresh", "wake"])
def test_a_transient_failure_while_capturing_again_loses_no_key(path: str) -> None:
    reg, model = make()
    reg.capture(PLAN)
    if path == "refresh":
        model.linear.load_state_dict({k: torch.randn_like(v) for k, v in model.linear.state_dict().items()}, assign=True)
    else:
        reg.sleep()
    model.fail_at = {16}  # the second key in capture order (largest first): the smaller ones are not tried
    with pytest.raises(cg.CaptureError, match=r"later keys? of strategy 'full' not tried \(planned lazily"):
        reg.refresh() if path == "refresh" else reg.wake(background=False)
    assert accounted(reg) == PAIRS, "every key is captured, lazy or failed"
    assert key_of(16) in reg.failures()
    model.fail_at = set()
    serve(reg, model, 3)  # a lazy key is captured at its first use
    assert reg.stats().lazy_captures == 1


def test_clear_while_asleep_empties_the_plan_wake_captures() -> None:
    reg, _ = make()
    reg.capture(PLAN)
    reg.sleep()
    assert reg.clear() == len(PLAN)
    assert reg.wake(background=False) == () and len(reg) == 0


def test_release_while_asleep_takes_the_key_out_of_the_plan() -> None:
    reg, _ = make()
    reg.capture(PLAN)
    reg.sleep()
    assert reg.release(key_of(8)[0]) == 1
    with pytest.raises(KeyError, match=r"no entry for Batch\(tokens=8.* in the plan slept with"):
        reg.release(key_of(8)[0])
    reg.wake(background=False)
    assert {(e.key, e.strategy) for e in reg.entries()} == PAIRS - {key_of(8)}


def test_sleep_and_wake_keep_lazy_keys_lazy() -> None:
    reg, model = make()
    reg.capture(PLAN, lazy=True)
    serve(reg, model, 3)  # captures the 4-token key alone
    reg.sleep()
    assert reg.wake(background=False) == (key_of(4),)
    assert len(reg) == 1 and set(reg.pending()) == PAIRS - {key_of(4)}


def test_wake_under_a_budget_evicts_nothing_that_was_not_held() -> None:
    reg, model = make()
    reg.capture(PLAN)
    per_key = max(e.memory_bytes for e in reg.entries())
    budgeted = cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu",
                                memory_budget=per_key)
    budgeted.capture(PLAN)
    evictions = budgeted.stats().evictions
    assert evictions > 0 and len(budgeted) < len(PLAN)
    budgeted.sleep()
    budgeted.wake(background=False)
    assert budgeted.stats().evictions == evictions, "wake captures what was held, not what had been evicted"
    assert accounted(budgeted) == PAIRS


def test_adapters_loaded_and_unloaded_are_forgotten_at_refresh() -> None:
    reg, model = make()
    reg.capture(PLAN)
    watched = len(reg.watched())
    assert "step.linear.weight" in reg.watched()
    for i in range(2):
        adapter = torch.nn.Linear(WIDTH, 2, bias=False)
        setattr(model, f"lora_{i}", adapter)  # registered: the next replay compares addresses
        reg.refresh()
        delattr(model, f"lora_{i}")
        reg.refresh()
        serve(reg, model, 3)
    assert len(reg.watched()) == watched


def test_oversize_eager_batches_of_every_size_keep_no_state_per_size_in_the_static_inputs() -> None:
    """Every distinct large prefill runs eagerly: the static inputs' checks keep nothing per size (the route cache is
    bounded on its own)."""
    import tracemalloc

    reg, _ = make()
    reg.capture(PLAN)
    tracemalloc.start()
    try:
        for n in range(MAX_TOKENS + 1, MAX_TOKENS + 2001):
            with torch.inference_mode():
                reg.run(B(n, 1, uniform=False), x=torch.zeros(n, WIDTH))
        kept = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*cgregistry*buffers.py")])
    finally:
        tracemalloc.stop()
    assert sum(stat.size for stat in kept.statistics("filename")) < 20_000


def test_a_key_whose_pending_capture_failed_is_listed_in_failures_as_the_piece_ends() -> None:
    listed: list[tuple[bool, bool]] = []

    class Finished:
        @cg.plugin.hookimpl
        def cgregistry_capture_finished(self, registry, key, strategy, entry, error):  # noqa: ANN001
            if error is not None:
                listed.append((key_of(16) in registry.capturing(), key_of(16) in registry.failures()))

    model = Flaky()
    model.fail_at = {16}
    reg = cg.GraphRegistry(model, {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}, backend="cpu",
                           plugins=make_plugins(Finished()))
    reg.capture([key_of(16)], background=True)
    with pytest.warns(RuntimeWarning, match="pending capturing"):
        assert reg.capture_pending(None)
    assert listed == [(True, False)], "while its hook runs the key is still pending"
    assert key_of(16) in reg.failures() and key_of(16) not in reg.capturing()
