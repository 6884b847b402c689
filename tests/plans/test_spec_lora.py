"""Dynamic speculative decoding and LoRA specialisation: matching rules against brute force."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.plan import lora_ladder
from cgregistry.plan.workload import Request, SchedulerConfig, schedule

MAX_SEQS = 24


def plan_for(depths: object, loras: tuple[int, ...], mode: str = "full_and_piecewise") -> cg.CapturePlan:
    return cg.CapturePlan.build(max_num_seqs=MAX_SEQS, max_num_tokens=512, mode=mode, spec_depths=depths, lora_counts=loras)


def test_one_key_per_depth_at_the_same_token_count() -> None:
    plan = plan_for((0, 1, 3), (0,), mode="full_decode_only")
    at8 = sorted((d.spec_depth, d.num_reqs) for d in plan.descriptors() if d.num_tokens == 8)
    assert at8 == [(0, 8), (1, 4), (3, 2)]


@settings(max_examples=200, deadline=None)
@given(
    depths=st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True),
    loras=st.lists(st.integers(0, 6), min_size=1, max_size=4, unique=True),
    depth_pick=st.integers(0, 10),
    reqs=st.integers(1, MAX_SEQS),
    k=st.integers(0, 6),
)
def test_uniform_batches_get_their_own_depth_and_smallest_lora_slot(depths: list[int], loras: list[int], depth_pick: int, reqs: int, k: int) -> None:
    plan = plan_for(tuple(depths), tuple(loras))
    matcher = cg.Matcher((e.descriptor, e.strategy) for e in plan)
    depth = depths[depth_pick % len(depths)]
    actual = B.decode(reqs, depth, k)
    got = matcher.match(actual)
    slots = [c for c in loras if c >= k]
    if not slots:
        assert got is None, "no key has enough LoRA slots"
        return
    assert got is not None and got.strategy == "full"
    assert got.key.uniform and got.key.spec_depth == depth, "the batch's own depth"
    assert got.key.num_active_loras == min(slots), "the smallest captured count at or above k"
    assert got.key.num_reqs == min(d.num_reqs for d in plan.descriptors() if d.uniform and d.spec_depth == depth and d.num_reqs >= reqs)


@settings(max_examples=150, deadline=None)
@given(depths=st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True), tokens=st.integers(2, 48), reqs=st.integers(1, 24), depth=st.integers(0, 3))
def test_non_uniform_batch_never_gets_a_uniform_key(depths: list[int], tokens: int, reqs: int, depth: int) -> None:
    plan = plan_for(tuple(depths), (0,), mode="full")
    actual = B(tokens, min(reqs, tokens), spec_depth=depth)
    got = cg.Matcher((e.descriptor, e.strategy) for e in plan).match(actual)
    assert got is None or not got.key.uniform


def test_no_lora_batch_uses_no_lora_graphs() -> None:
    plan = cg.CapturePlan.build(max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise", max_loras=4)
    assert sorted({d.num_active_loras for d in plan.descriptors()}) == [0, 1, 2, 4]
    m = cg.Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(5)).key.num_active_loras == 0
    assert m.match(B(30, 7)).key.num_active_loras == 0
    assert m.match(B.decode(5, num_active_loras=3)).key.num_active_loras == 4


def test_lora_ladder() -> None:
    assert lora_ladder(1) == (0, 1)
    assert lora_ladder(6) == (0, 1, 2, 4, 6)
    assert lora_ladder(8) == (0, 1, 2, 4, 8)
    with pytest.raises(ValueError, match="max_loras must be a positive int, got 0"):
        lora_ladder(0)
    with pytest.raises(ValueError, match=r"lora_counts \[0, 2\] do not reach max_loras=4"):
        cg.CapturePlan.build(max_num_seqs=4, max_num_tokens=64, lora_counts=(0, 2), max_loras=4)


def test_depth_schedule_limits_deep_keys_to_small_batches() -> None:
    plan = cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=1024, mode="full_decode_only", spec_depths={8: (0, 1, 3), 64: (0, 1)})
    widest = {}
    for d in plan.descriptors():
        widest[d.spec_depth] = max(widest.get(d.spec_depth, 0), d.num_reqs)
    assert widest == {0: 64, 1: 64, 3: 8}
    assert [g for g in plan.uncovered() if g.key_class == "decode"] == [], "the widest batch of each depth is covered"
    m = cg.Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(7, 3)).key == B.decode(8, 3)


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({8: (0, 3)}, "schedule ends at 8 requests; it must reach max_num_seqs=64"),
        ({0: (0,), 64: (0,)}, "keys are request counts >= 1, got 0"),
        ({64: (-1,)}, r"spec_depths\[64\] must hold ints >= 0, got -1"),
        ({}, "schedule must not be empty"),
    ],
)
def test_bad_schedules(schedule: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        cg.CapturePlan.build(max_num_seqs=64, max_num_tokens=1024, spec_depths=schedule)


def test_scheduler_switches_depth_with_batch_size() -> None:
    reqs = [Request(0.0, 1, 9) for _ in range(3)]
    config = SchedulerConfig(max_num_seqs=8, spec_schedule={2: 3, 8: 1})
    steps = list(schedule(reqs, config))
    assert steps[0] == B(3, 3, spec_depth=3)  # three prefills; nobody decoding yet, so the small-batch depth
    assert steps[1] == B.decode(3, 1), "3 decoding requests: depth 1"
    assert all(s.uniform for s in steps[1:])
    assert config.depth_for(2) == 3 and config.depth_for(5) == 1 and config.depth_for(100) == 0
    with pytest.raises(ValueError, match="spec_schedule maps request counts >= 1 to depths >= 0"):
        SchedulerConfig(spec_schedule={0: 1})
