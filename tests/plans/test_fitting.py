"""Plan evaluation and exact fitting: checked against exhaustive search and on the bundled trace."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.plan.fit import evaluate, fit_sizes
from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule


def padding_with(sizes: list[int], weights: dict[int, int], unit: int) -> int:
    return sum(n * (min(s for s in sizes if s >= v) - v) * unit for v, n in weights.items())


@settings(max_examples=150, deadline=None)
@given(
    top=st.integers(1, 24),
    data=st.data(),
    unit=st.integers(1, 4),
)
def test_fit_sizes_matches_exhaustive_search(top: int, data: st.DataObject, unit: int) -> None:
    weights = data.draw(st.dictionaries(st.integers(1, top), st.integers(1, 20), max_size=7))
    result = fit_sizes(weights, top, unit)
    candidates = sorted(set(weights) | {top})
    assert sorted(result) == list(range(1, len(candidates) + 1))
    others = [c for c in candidates if c != top]
    for k, (cost, sizes) in result.items():
        brute = min(padding_with([*combo, top], weights, unit) for combo in itertools.combinations(others, k - 1))
        assert cost == brute
        assert len(sizes) == k and top in sizes and padding_with(sizes, weights, unit) == cost


def test_fit_sizes_rejects_sizes_above_top() -> None:
    with pytest.raises(ValueError, match=r"sizes \[9\] lie outside 1..8"):
        fit_sizes({3: 1, 9: 2}, 8)


def steps_of(*counts: tuple[B, int]) -> list[B]:
    return [b for b, n in counts for _ in range(n)]


def test_evaluate_counts_hand_checked() -> None:
    plan = cg.CapturePlan.of([(B.decode(4), "full"), (B(8), "piecewise")])
    steps = steps_of((B.decode(3), 2), (B.decode(4), 1), (B(5, 2), 1), (B(20, 4), 3))
    r = evaluate(plan, steps)
    assert (r.graphs, r.steps, r.graph_steps, r.eager_steps) == (2, 7, 4, 3)
    assert (r.real_tokens, r.padded_tokens, r.eager_tokens) == (3 + 3 + 4 + 5, 1 + 1 + 0 + 3, 60)
    assert r.by_tokens == {3: (2, 2), 4: (1, 0), 5: (1, 3)}
    assert r.hit_rate == pytest.approx(4 / 7) and r.padding_ratio == pytest.approx(5 / 20)
    assert r.largest_key_tokens == 8


def brute_force_plan(steps: list[B], max_graphs: int, max_num_seqs: int, max_capture: int) -> int:
    """Least padding of any full_and_piecewise plan within the budget that keeps the covering keys."""
    decode_opts = [r for r in range(1, max_num_seqs)]
    mixed_opts = [t for t in range(1, max_capture)]
    best = None
    for nd in range(0, max_graphs - 1):
        for decode in itertools.combinations(decode_opts, nd):
            for nm in range(0, max_graphs - 1 - nd):
                for mixed in itertools.combinations(mixed_opts, nm):
                    keys = [(B.decode(r), "full") for r in (*decode, max_num_seqs)]
                    keys += [(B(t), "piecewise") for t in (*mixed, max_capture)]
                    r = evaluate(cg.CapturePlan.of(keys), steps)
                    best = r.padded_tokens if best is None else min(best, r.padded_tokens)
    assert best is not None
    return best


@pytest.mark.parametrize("budget", [2, 3, 4, 5])
def test_fit_is_optimal_through_the_real_matcher(budget: int) -> None:
    steps = steps_of((B.decode(1), 5), (B.decode(2), 1), (B.decode(3), 4), (B(3, 2), 2), (B(5, 3), 6), (B(6, 1), 1), (B(7, 2), 3))
    plan = cg.CapturePlan.fit(steps, budget, max_num_seqs=4, max_num_tokens=8, mode="full_and_piecewise", max_capture_size=8)
    assert len(plan) <= budget
    assert B.decode(4) in plan.descriptors() and B(8) in plan.descriptors(), "covering keys stay"
    assert evaluate(plan, steps).padded_tokens == brute_force_plan(steps, budget, 4, 8)


def test_fit_keeps_covering_guarantees_and_budget() -> None:
    steps = [B.decode(3)] * 50 + [B(40, 9)] * 5 + [B.decode(2, 1)] * 7
    kwargs = {"max_num_seqs": 64, "max_num_tokens": 1024, "mode": "full_and_piecewise", "spec_depths": (0, 1), "lora_counts": (0, 2)}
    default = cg.CapturePlan.build(**kwargs)
    fitted = cg.CapturePlan.fit(steps, 12, **kwargs)
    assert len(fitted) <= 12
    for depth in (0, 1):
        assert any(d.uniform and d.spec_depth == depth and d.num_reqs == 64 for d in fitted.descriptors())
    assert max(d.num_tokens for d in fitted.descriptors() if not d.uniform) == max(d.num_tokens for d in default.descriptors() if not d.uniform)
    assert {g.key_class for g in fitted.uncovered()} <= {g.key_class for g in default.uncovered()} | {"mixed"}
    assert [g for g in fitted.uncovered() if g.key_class == "decode"] == []
    assert evaluate(fitted, steps).padded_tokens <= evaluate(default, steps).padded_tokens
    with pytest.raises(ValueError, match="max_graphs=3 cannot hold one graph per key family"):
        cg.CapturePlan.fit(steps, 3, **kwargs)


def test_fitted_plan_beats_default_on_the_bundled_trace_held_out() -> None:
    """Fit on the first half, judge on the second, no more graphs, <= 3% padding."""
    requests = read_trace()
    half = len(requests) // 2
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    first, second = list(schedule(requests[:half], config)), list(schedule(requests[half:], config))
    default = cg.CapturePlan.build(max_num_seqs=256, max_num_tokens=8192)
    fitted = cg.CapturePlan.fit(first, len(default), max_num_seqs=256, max_num_tokens=8192)
    judged_default, judged_fitted = evaluate(default, second), evaluate(fitted, second)
    assert len(fitted) <= len(default)
    assert judged_fitted.graph_steps == judged_default.graph_steps, "same coverage"
    assert judged_fitted.padding_ratio <= 0.03
    assert judged_fitted.padded_tokens < judged_default.padded_tokens
