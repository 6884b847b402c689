from __future__ import annotations

import pytest

from cgregistry import BatchDescriptor, CapturePlan
from cgregistry.plan import PlanEntry, UncoveredRange
from cgregistry.plan import MODES, default_ladder

B = BatchDescriptor


def test_ladder_matches_engine_convention() -> None:
    ladder = default_ladder(512)
    assert ladder[:5] == [1, 2, 4, 8, 16]
    assert [s for s in ladder if s <= 256] == [1, 2, 4, *range(8, 257, 8)]
    assert [s for s in ladder if s > 256] == list(range(272, 513, 16))
    assert default_ladder(300)[-2:] == [288, 300], "the maximum itself is always a key"


def test_default_max_capture_size() -> None:
    plan = CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="piecewise")
    assert max(d.num_tokens for d in plan.descriptors()) == 512
    small = CapturePlan.build(max_num_seqs=8, max_num_tokens=8192, mode="piecewise")
    assert max(d.num_tokens for d in small.descriptors()) == 16  # 2 * 8 * 1
    spec = CapturePlan.build(max_num_seqs=8, max_num_tokens=8192, mode="piecewise", spec_depths=(0, 3))
    assert max(d.num_tokens for d in spec.descriptors()) == 64  # 2 * 8 * 4
    clamped = CapturePlan.build(max_num_seqs=256, max_num_tokens=100, mode="piecewise")
    assert max(d.num_tokens for d in clamped.descriptors()) == 100


def test_full_and_piecewise_keys() -> None:
    plan = CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="full_and_piecewise")
    full = [e.descriptor for e in plan if e.strategy == "full"]
    piecewise = [e.descriptor for e in plan if e.strategy == "piecewise"]
    assert all(d.uniform and d.num_reqs == d.num_tokens for d in full)
    assert max(d.num_reqs for d in full) == 256
    assert all(d.num_reqs is None and not d.uniform for d in piecewise)
    assert sorted(d.num_tokens for d in piecewise) == default_ladder(512)


def test_plan_is_sorted_largest_first() -> None:
    plan = CapturePlan.build(max_num_seqs=64, max_num_tokens=2048, mode="full_and_piecewise", spec_depths=(0, 1))
    tokens = [d.num_tokens for d in plan.descriptors()]
    assert tokens == sorted(tokens, reverse=True)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_speculative_decode_keys_are_multiples_and_cover_widest(depth: int) -> None:
    plan = CapturePlan.build(max_num_seqs=48, max_num_tokens=8192, mode="full_decode_only", spec_depths=(0, depth))
    q = 1 + depth
    keys = [d for d in plan.descriptors() if d.spec_depth == depth]
    assert keys and all(d.uniform and d.num_tokens % q == 0 and d.num_tokens == d.num_reqs * q for d in keys)
    assert max(d.num_tokens for d in keys) == 48 * q, "the widest speculative batch is a key"
    assert all(d.num_reqs <= 48 for d in keys)
    assert not [g for g in plan.uncovered() if g.key_class == "decode"], "every uniform batch is covered"


def test_lora_counts_multiply_keys() -> None:
    base = CapturePlan.build(max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise")
    lora = CapturePlan.build(max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise", lora_counts=(0, 1, 4))
    assert len(lora) == 3 * len(base)
    assert {d.num_active_loras for d in lora.descriptors()} == {0, 1, 4}


def test_modes() -> None:
    kwargs = {"max_num_seqs": 16, "max_num_tokens": 256}
    assert len(CapturePlan.build(mode="none", **kwargs)) == 0
    strategies = {m: {e.strategy for e in CapturePlan.build(mode=m, **kwargs)} for m in MODES if m != "none"}
    assert strategies == {
        "full": {"full"}, "piecewise": {"piecewise"}, "breakable": {"breakable"}, "full_decode_only": {"full"},
        "full_and_piecewise": {"full", "piecewise"}, "full_and_breakable": {"full", "breakable"},
    }
    full = CapturePlan.build(mode="full", **kwargs)
    mixed = [d for d in full.descriptors() if not d.uniform]
    assert mixed and all(d.num_reqs == min(d.num_tokens, 16) for d in mixed), "full mixed keys carry a request count"


def test_explicit_sizes() -> None:
    plan = CapturePlan.build(max_num_seqs=8, max_num_tokens=512, mode="piecewise", capture_sizes=[3, 100, 40])
    assert [d.num_tokens for d in plan.descriptors()] == [100, 40, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capture_sizes": [8, 600], "max_capture_size": 512}, r"capture_sizes \[600\] exceed max_capture_size=512"),
        ({"capture_sizes": [8, 2000]}, r"capture_sizes \[2000\] exceed max_num_tokens=1024"),
        ({"capture_sizes": [8, 64], "max_capture_size": 32}, r"capture_sizes \[64\] exceed max_capture_size=32"),
        ({"max_capture_size": 2000}, "max_capture_size=2000 exceeds max_num_tokens=1024"),
        ({"capture_sizes": [0, 8]}, "capture_sizes must hold ints >= 1, got 0"),
        ({"mode": "fulll"}, "unknown mode 'fulll'"),
        ({"spec_depths": (-1,)}, "spec_depths must hold ints >= 0, got -1"),
        ({"lora_counts": ()}, "lora_counts must not be empty"),
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive int, got 0"),
    ],
)
def test_conflicting_settings_are_errors(kwargs: dict, message: str) -> None:
    settings = {"max_num_seqs": 8, "max_num_tokens": 1024, "mode": "piecewise", **kwargs}
    with pytest.raises(ValueError, match=message):
        CapturePlan.build(**settings)


def test_duplicate_entries_are_an_error() -> None:
    with pytest.raises(ValueError, match="twice"):
        CapturePlan.of([(B(8), "full"), (B(8), "full")])


def test_uncovered_reports_gaps() -> None:
    plan = CapturePlan.build(max_num_seqs=8, max_num_tokens=100, mode="full_decode_only")
    assert plan.uncovered() == [UncoveredRange("mixed", 0, None, 1, 100)]
    plan = CapturePlan.build(max_num_seqs=8, max_num_tokens=100, mode="full_and_piecewise")
    assert plan.uncovered() == [UncoveredRange("mixed", 0, None, 17, 100)]
    custom = CapturePlan.of([(B(4), "piecewise"), (B(16), "piecewise")], max_num_seqs=4, max_num_tokens=20)
    assert custom.uncovered() == [UncoveredRange("mixed", 0, None, 17, 20)]


def test_iterates_plan_entries() -> None:
    plan = CapturePlan.build(max_num_seqs=2, max_num_tokens=8, mode="full_decode_only")
    assert all(isinstance(e, PlanEntry) for e in plan)
    assert [(e.descriptor, e.strategy) for e in plan] == [(BatchDescriptor.decode(2), "full"), (BatchDescriptor.decode(1), "full")]
