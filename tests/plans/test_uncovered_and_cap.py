"""In plans: ``CapturePlan.uncovered`` (and ``evaluate``, ``cgregistry plan``) with the padding
cap a registry refuses batches by, against a brute-force oracle, the Matcher and a real registry."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor, CapturePlan, Matcher
from cgregistry.cli import main
from cgregistry.plan.fit import evaluate
from cgregistry.plan import MODES, UncoveredRange
from tests.matching.test_exclude_and_padding_cap import within_documented_cap
from tests.matching.test_matcher import STRATEGIES, descriptors

B = BatchDescriptor
TOKENS = 40  # descriptors() draws keys of at most 40 tokens

caps = st.tuples(st.one_of(st.none(), st.integers(0, 12)), st.one_of(st.none(), st.sampled_from([0, 0.1, 0.25, 0.5, 1.0, 3.0])))


def shapes(plan: CapturePlan, widest: dict[int, int]) -> Iterator[tuple[tuple[str, int, int | None, int], BatchDescriptor]]:
    """Every shape ``uncovered`` checks, by (key class, LoRA count, spec depth, tokens), written out from its docstring."""
    assert plan.max_num_seqs is not None and plan.max_num_tokens is not None
    for loras in range(max((e.descriptor.num_active_loras for e in plan), default=0) + 1):
        for depth, reqs in widest.items():
            for r in range(1, reqs + 1):
                yield ("decode", loras, depth, r * (1 + depth)), B.decode(r, depth, loras)
        for t in range(1, plan.max_num_tokens + 1):
            yield ("mixed", loras, None, t), B(t, min(t, plan.max_num_seqs), loras)


def reported(gaps: list[UncoveredRange], widest: dict[int, int]) -> dict[tuple[str, int, int | None, int], str]:
    """The uncovered ranges as one reason per shape."""
    out = {}
    for g in gaps:
        q = 1 if g.key_class == "mixed" else 1 + g.spec_depth  # type: ignore[operator]
        for tokens in range(g.min_tokens, g.max_tokens + 1, q):
            shape = (g.key_class, g.num_active_loras, g.spec_depth, tokens)
            assert shape not in out, f"{shape} reported twice"
            out[shape] = g.reason
    return out


def check_against_oracle(plan: CapturePlan, widest: dict[int, int], max_tokens: int | None, max_ratio: float | None) -> None:
    keys = [(e.descriptor, e.strategy) for e in plan]
    matcher = Matcher(keys, max_padding_tokens=max_tokens, max_padding_ratio=max_ratio)
    gaps = plan.uncovered(max_padding_tokens=max_tokens, max_padding_ratio=max_ratio)
    got = reported(gaps, widest)
    expected = {}
    for shape, actual in shapes(plan, widest):
        covering = [k for k, _ in keys if k.covers(actual)]
        served = any(within_documented_cap(k.num_tokens - actual.num_tokens, actual.num_tokens, max_tokens, max_ratio) for k in covering)
        assert served == (matcher.match(actual) is not None), f"the oracle and the capped Matcher disagree on {actual}"
        if not served:
            expected[shape] = "padding_cap" if covering else "no_key"
    assert got == expected
    for a, b in zip(gaps, gaps[1:]):  # runs are maximal: two runs of one key class and reason never touch
        q = 1 if a.key_class == "mixed" else 1 + a.spec_depth  # type: ignore[operator]
        same = (a.key_class, a.num_active_loras, a.spec_depth, a.reason) == (b.key_class, b.num_active_loras, b.spec_depth, b.reason)
        assert not (same and b.min_tokens == a.max_tokens + q), f"{a} and {b} should be one run"


@settings(max_examples=150, deadline=None)
@given(
    keys=st.lists(st.tuples(descriptors(), st.sampled_from(STRATEGIES)), max_size=12, unique=True),
    max_num_seqs=st.integers(1, TOKENS),
    cap=caps,
)
def test_uncovered_with_a_cap_is_exactly_what_the_capped_matcher_refuses(
    keys: list[tuple[BatchDescriptor, str]], max_num_seqs: int, cap: tuple[int | None, float | None]
) -> None:
    widest = {d: min(max_num_seqs, TOKENS // (1 + d)) for d in range(4)}
    plan = CapturePlan.of(keys, max_num_seqs=max_num_seqs, max_num_tokens=TOKENS, decode_widest=widest)
    check_against_oracle(plan, widest, *cap)


@settings(max_examples=40, deadline=None)
@given(
    max_num_seqs=st.integers(1, 32),
    mode=st.sampled_from([m for m in MODES if m != "none"]),
    depths=st.sampled_from([(0,), (0, 1), (0, 3)]),
    cap=caps,
)
def test_uncovered_with_a_cap_on_built_plans(max_num_seqs: int, mode: str, depths: tuple[int, ...], cap: tuple[int | None, float | None]) -> None:
    plan = CapturePlan.build(max_num_seqs=max_num_seqs, max_num_tokens=96, mode=mode, spec_depths=depths)
    assert plan.decode_widest is not None
    check_against_oracle(plan, dict(plan.decode_widest), *cap)
    if cap == (None, None):
        assert all(g.reason == "no_key" for g in plan.uncovered())


def test_a_cap_turns_covered_shapes_into_padding_cap_gaps() -> None:
    plan = CapturePlan.build(max_num_seqs=8, max_num_tokens=32, mode="full")  # mixed keys of 1, 2, 4, 8, 16 tokens
    assert plan.uncovered() == [UncoveredRange("mixed", 0, None, 17, 32)]
    gaps = plan.uncovered(max_padding_ratio=0.25)
    assert [(g.key_class, g.min_tokens, g.max_tokens, g.reason) for g in gaps] == [
        ("decode", 3, 3, "padding_cap"), ("decode", 5, 6, "padding_cap"),
        ("mixed", 3, 3, "padding_cap"), ("mixed", 5, 6, "padding_cap"), ("mixed", 9, 12, "padding_cap"),
        ("mixed", 17, 32, "no_key"),
    ]
    assert plan.uncovered(max_padding_tokens=100) == plan.uncovered(), "a cap nothing reaches changes nothing"
    with pytest.raises(ValueError, match=r"max_padding_ratio must be a finite number >= 0 .* got -1"):
        plan.uncovered(max_padding_ratio=-1)
    with pytest.raises(ValueError, match=r"max_padding_tokens must be an int >= 0 or None, got 2.5"):
        plan.uncovered(max_padding_tokens=2.5)  # type: ignore[arg-type]


def test_the_registry_refuses_exactly_the_padding_cap_gaps() -> None:
    plan = CapturePlan.build(max_num_seqs=8, max_num_tokens=32, mode="full_and_breakable")
    reg = cg.GraphRegistry(lambda batch, x: x * 2, {"x": cg.StaticInput((32,), torch.float32)}, backend="cpu",
                           max_padding_tokens=3, max_padding_ratio=0.5)
    reg.capture(plan)
    capped = reported(plan.uncovered(max_padding_tokens=3, max_padding_ratio=0.5), dict(plan.decode_widest or {}))
    assert "padding_cap" in capped.values()
    for shape, actual in shapes(plan, dict(plan.decode_widest or {})):
        assert (reg.match(actual) is None) == (shape in capped), actual
        if capped.get(shape) == "padding_cap":
            before = reg.stats().misses_by_reason["padding_cap"]
            torch.testing.assert_close(reg.run(actual, x=torch.ones(actual.num_tokens)), torch.full((actual.num_tokens,), 2.0))
            assert reg.stats().misses_by_reason["padding_cap"] == before + 1


def test_evaluate_counts_steps_over_the_cap_as_eager() -> None:
    plan = CapturePlan.of([(B(8), "piecewise"), (B(16), "piecewise")])
    steps = [B(5, 2), B(8, 3), B(9, 3), B(15, 4)]
    plain, capped = evaluate(plan, steps), evaluate(plan, steps, max_padding_tokens=2)
    assert (plain.graph_steps, plain.padded_tokens) == (4, 3 + 0 + 7 + 1)
    assert (capped.graph_steps, capped.eager_steps, capped.padded_tokens, capped.eager_tokens) == (2, 2, 0 + 1, 5 + 9)


def test_cli_plan_lists_padding_cap_gaps(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--max-num-seqs", "8", "--max-num-tokens", "32", "--mode", "full"]
    assert main([*args, "--max-padding-ratio", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "  padding cap        --max-padding-ratio=0.25\n" in out
    assert ("uncovered (runs eagerly): mixed batches of 9..12 tokens, 0 LoRA, over the padding cap: every covering key "
            "pads more (--max-padding-ratio=0.25)") in out
    assert "uncovered (runs eagerly): mixed batches of 17..32 tokens, 0 LoRA\n" in out
    assert main(args) == 0
    assert "  padding cap        none (--max-padding-tokens, --max-padding-ratio)  (default)" in capsys.readouterr().out
    assert main([*args, "--max-padding-tokens", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["padding_cap"] == {"max_padding_tokens": 2, "max_padding_ratio": None}
    assert {"key_class": "mixed", "num_active_loras": 0, "spec_depth": None, "min_tokens": 9, "max_tokens": 13,
            "reason": "padding_cap"} in doc["uncovered"]
    with pytest.raises(SystemExit):
        main([*args, "--max-padding-ratio", "-1"])
    assert "argument --max-padding-ratio: expected a finite number >= 0, got -1" in capsys.readouterr().err


def test_cli_plan_judges_a_trace_with_the_cap(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--max-num-seqs", "16", "--max-num-tokens", "256", "--trace", "bundled", "--limit", "60", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--max-padding-tokens", "0"]) == 0
    capped = json.loads(capsys.readouterr().out)
    assert capped["padding_cap"] == {"max_padding_tokens": 0, "max_padding_ratio": None}
    p, c = plain["plans"]["default"], capped["plans"]["default"]
    assert c["padded_tokens"] == 0 and c["eager_steps"] > p["eager_steps"] and c["steps"] == p["steps"]


def test_uncovered_asks_the_matcher_a_few_times_per_key_whatever_the_token_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranges come from the keys' edges (and the cap's), so a budget of 10^12 tokens costs what 512 do."""
    calls: list[BatchDescriptor] = []
    match = Matcher.match
    monkeypatch.setattr(Matcher, "match", lambda self, actual, *a: calls.append(actual) or match(self, actual, *a))
    counts = {}
    for budget in (512, 10**12):
        calls.clear()
        plan = CapturePlan.build(max_num_seqs=256, max_num_tokens=budget, max_loras=2)  # the same 512-token keys
        gaps = plan.uncovered(max_padding_tokens=6, max_padding_ratio=0.25)
        counts[budget] = len(calls)
    assert [g for g in gaps if g.reason == "no_key"] == [UncoveredRange("mixed", n, None, 513, 10**12, "no_key") for n in (0, 1, 2)]
    assert counts[10**12] <= counts[512] + 3 * 2 * 4, counts  # the budget's own edge: a few sizes per LoRA count
    assert counts[512] < 32 * len(plan), counts
