"""Matcher against a brute-force oracle, plus preference and explain behaviour."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cgregistry import BatchDescriptor, CapturePlan, Matcher

B = BatchDescriptor
STRATEGIES = ("full", "piecewise", "breakable")


@st.composite
def descriptors(draw: st.DrawFn, max_tokens: int = 40) -> BatchDescriptor:
    loras = draw(st.integers(0, 3))
    depth = draw(st.integers(0, 3))
    if draw(st.booleans()):
        reqs = draw(st.integers(1, max_tokens // (1 + depth)))
        return BatchDescriptor.decode(reqs, depth, loras)
    tokens = draw(st.integers(1, max_tokens))
    reqs = draw(st.one_of(st.none(), st.integers(1, tokens)))
    return B(tokens, reqs, loras, depth, False)


def oracle(keys: list[tuple[BatchDescriptor, str]], actual: BatchDescriptor, preference: tuple[str, ...]) -> tuple | None:
    """The best achievable (strategy rank, token pad, request pad, lora pad), by scanning every key."""
    best = None
    for key, strategy in keys:
        if not key.covers(actual):
            continue
        reqs_pad = 0 if key.num_reqs is None else key.num_reqs - actual.num_reqs
        order = (preference.index(strategy), key.num_tokens - actual.num_tokens, reqs_pad, key.num_active_loras - actual.num_active_loras)
        best = order if best is None or order < best else best
    return best


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.tuples(descriptors(), st.sampled_from(STRATEGIES)), max_size=30, unique=True),
    actual=descriptors(),
    preference=st.permutations(STRATEGIES),
)
def test_match_covers_and_is_minimal(keys: list, actual: BatchDescriptor, preference: list[str]) -> None:
    pref = tuple(preference)
    matcher = Matcher(keys, pref)
    got = matcher.match(actual)
    want = oracle(keys, actual, pref)
    if want is None:
        assert got is None
        return
    assert got is not None
    assert (got.key, got.strategy) in keys
    assert got.key.covers(actual)
    assert got.padding == got.key.padding(actual)
    assert (pref.index(got.strategy), *got.padding) == want


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.tuples(descriptors(), st.sampled_from(STRATEGIES)), min_size=1, max_size=20, unique=True), actual=descriptors())
def test_explain_agrees_with_match(keys: list, actual: BatchDescriptor) -> None:
    matcher = Matcher(keys)
    explanation = matcher.explain(actual)
    chosen = [c for c in explanation.candidates if c.chosen]
    match = matcher.match(actual)
    assert explanation.match == match
    assert len(explanation.candidates) == len(keys)
    if match is None:
        assert not chosen and not any(c.covers for c in explanation.candidates)
    else:
        assert [(c.key, c.strategy) for c in chosen] == [(match.key, match.strategy)]
    for c in explanation.candidates:
        assert c.covers == c.key.covers(actual)


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.tuples(descriptors(), st.sampled_from(STRATEGIES)), min_size=1, max_size=20, unique=True),
       split=st.integers(0, 20), actual=descriptors(), cap=st.one_of(st.none(), st.integers(0, 8)))
def test_explain_lists_keys_pending_capture_and_the_one_the_batch_waits_for(
    keys: list, split: int, actual: BatchDescriptor, cap: int | None,
) -> None:
    live, capturing = keys[:split], keys[split:]
    explanation = Matcher(live, max_padding_tokens=cap).explain(actual, capturing=capturing)
    assert {(c.key, c.strategy) for c in explanation.candidates if c.capturing} == set(capturing)
    assert not any(c.chosen for c in explanation.candidates if c.capturing)
    assert explanation.match == Matcher(live, max_padding_tokens=cap).match(actual)  # pending keys serve nothing
    # the key the batch waits for: the one the pending keys alone would match, when no captured key serves it
    want = Matcher(capturing, max_padding_tokens=cap).match(actual) if explanation.match is None and capturing else None
    assert explanation.capturing == want
    assert ("runs eagerly until a key pending capture is captured" in str(explanation)) == (want is not None)


def test_preferred_strategy_beats_padding() -> None:
    keys = [(B(64), "piecewise"), (B(8), "breakable"), (B(128, 64), "full")]
    m = Matcher(keys)
    assert m.match(B(8, 4)).strategy == "full"
    assert Matcher(keys, ("breakable", "piecewise", "full")).match(B(8, 4)).key == B(8)
    assert Matcher(keys, ("piecewise",)).match(B(8, 4)).strategy == "piecewise", "unlisted strategies rank after listed ones"


def test_uniform_key_wins_a_tie() -> None:
    m = Matcher([(B(8, 8), "full"), (BatchDescriptor.decode(8), "full")])
    assert m.match(BatchDescriptor.decode(7)).key == BatchDescriptor.decode(8)
    assert m.match(B(7, 7)).key == B(8, 8)


def test_dynamic_spec_decode_shares_token_count() -> None:
    keys = [(BatchDescriptor.decode(8, 0), "full"), (BatchDescriptor.decode(4, 1), "full"), (BatchDescriptor.decode(2, 3), "full")]
    m = Matcher(keys)
    assert {k.num_tokens for k, _ in keys} == {8}
    for depth, reqs in [(0, 8), (1, 4), (3, 2)]:
        assert m.match(BatchDescriptor.decode(reqs, depth)).key.spec_depth == depth
    assert m.match(B(8, 3, spec_depth=1)) is None, "a non-uniform batch never gets a uniform key"


def test_explain_reasons_are_readable() -> None:
    keys = [(B(4, 4), "full"), (B(16), "piecewise"), (B(8, 2), "full"), (BatchDescriptor.decode(8), "full")]
    text = str(Matcher(keys).explain(B(6, 3)))
    assert "matched Batch(tokens=16, reqs=any) [piecewise]" in text
    assert "too few tokens: 4 < 6" in text
    assert "too few requests: 2 < 3" in text
    assert "uniform key cannot serve a non-uniform batch" in text
    none = str(Matcher(keys).explain(B(100, 3)))
    assert "no covering key (runs eagerly)" in none


def test_large_plans_match_like_small_ones() -> None:
    plan = CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="full_and_piecewise", spec_depths=(0, 1, 3), lora_counts=(0, 1, 2, 4, 8))
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    assert len(m) == len(plan)
    got = m.match(BatchDescriptor.decode(101, 1, 3))  # 202 tokens -> 208 on the ladder
    assert got.key == BatchDescriptor.decode(104, 1, 4) and got.strategy == "full"
    assert m.match(B(300, 40, 0)).key == B(304)
