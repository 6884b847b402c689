"""Plans against a reference of vLLM's documented capture ladder (issue 16).

The reference is written here from vLLM's documentation, not from its code:

* capture sizes: 1, 2, 4, then every 8 to 256, then every 16, up to
  ``max_cudagraph_capture_size = min(2 * max_num_seqs * q, 512)`` (capped by the token
  budget), where ``q = 1 + spec depth`` is the decode query length; the maximum itself
  is a size only when it lands on the ladder (off-stride maxima run eagerly in vLLM);
* mixed batches (FULL and PIECEWISE) use the smallest size at or above their tokens;
* a separate decode routine (FULL_DECODE_ONLY, FULL_AND_PIECEWISE) has uniform keys
  of ``r`` requests, ``r * q`` tokens, for ladder values ``r <= max_num_seqs`` with
  ``r * q <= max_cudagraph_capture_size`` (model runner V2's request ladder);
* a batch no key covers runs eagerly; in FULL_AND_PIECEWISE a uniform batch past the
  decode keys falls back to the piecewise sizes.

Compared by the matcher's own order: a more preferred strategy first, then fewer
padded tokens.  cgregistry's plan must never be worse on any batch the reference
serves, and may only add the graphs listed in ``extras``: keys that cover what the
reference leaves to eager (the widest uniform batch, an off-stride maximum) and the
uniform widths ``q * r`` its mixed keys serve.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cgregistry import BatchDescriptor as B
from cgregistry import CapturePlan, Matcher, PlanSettings
from cgregistry.plan import default_ladder

RANK = {"full": 0, "piecewise": 1, "breakable": 2}
EAGER = (99, 1 << 30)


def vllm_ladder(max_num_seqs: int, q: int, max_num_tokens: int, multiple: int = 1) -> list[int]:
    top = min(2 * max_num_seqs * q, 512, max_num_tokens)
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, top + 1, 16)]
    rounded = (-(-s // multiple) * multiple for s in ladder if s <= top)  # under sequence parallelism
    return sorted({s for s in rounded if s <= top})


def vllm_keys(mode: str, max_num_seqs: int, depth: int, max_num_tokens: int) -> list[tuple[B, str]]:
    """vLLM's keys for one spec depth, as cgregistry descriptors."""
    q = 1 + depth
    sizes = vllm_ladder(max_num_seqs, q, max_num_tokens)
    top = max(sizes)
    decode = [B.decode(r, depth) for r in sizes if r <= max_num_seqs and r * q <= top]
    if mode == "full":  # FULL: one set of token sizes for every batch
        return [(B(s), "full") for s in sizes]
    if mode == "piecewise":
        return [(B(s), "piecewise") for s in sizes]
    if mode == "full_decode_only":
        return [(d, "full") for d in decode]
    if mode == "full_and_piecewise":
        return [(d, "full") for d in decode] + [(B(s), "piecewise") for s in sizes]
    raise AssertionError(mode)


def score(matcher: Matcher, batch: B) -> tuple[int, int]:
    m = matcher.match(batch)
    if m is None:
        return EAGER
    assert m.key.covers(batch), (m, batch)
    return (RANK[m.strategy], m.padding.tokens)


def batches(max_num_seqs: int, max_num_tokens: int, depth: int) -> Iterable[B]:
    """Every uniform batch of ``depth`` and every mixed token count at its worst request counts."""
    q = 1 + depth
    for r in range(1, min(max_num_seqs, max_num_tokens // q) + 1):
        yield B.decode(r, depth)
    for t in range(1, min(max_num_tokens, 600) + 1):
        yield B(t, min(t, max_num_seqs))
        yield B(t, 1)


def compare(mode: str, max_num_seqs: int, depth: int, max_num_tokens: int) -> tuple[int, int, set[tuple[int, str]]]:
    """(our graphs, the reference's graphs, (token count, strategy) of our keys the reference has no key of)."""
    ours = CapturePlan.build(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, mode=mode, spec_depths=(depth,))
    ref = vllm_keys(mode, max_num_seqs, depth, max_num_tokens)
    mine, theirs = Matcher((e.descriptor, e.strategy) for e in ours), Matcher(ref)
    for batch in batches(max_num_seqs, max_num_tokens, depth):
        assert score(mine, batch) <= score(theirs, batch), (mode, max_num_seqs, depth, max_num_tokens, batch, mine.match(batch), theirs.match(batch))
    extra = {(e.descriptor.num_tokens, e.strategy) for e in ours} - {(k.num_tokens, st) for k, st in ref}
    return len(ours), len(ref), extra


def allowed_extras(mode: str, max_num_seqs: int, depth: int, max_num_tokens: int) -> set[int]:
    """Token counts we may capture beyond the reference: coverage it lacks, and the uniform widths of mixed keys."""
    s = PlanSettings(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, mode=mode, spec_depths=(depth,))
    q, top, w = 1 + depth, s.used_max_capture_size, s.widest[depth]
    allowed = {top, q * w}
    if mode in ("full", "piecewise"):
        allowed |= {q * r for r in s.decode_reqs[depth] if q * r <= top}
    return allowed


MODES = ["full", "piecewise", "full_decode_only", "full_and_piecewise"]


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from(MODES),
    max_num_seqs=st.integers(1, 300),
    depth=st.integers(0, 6),
    max_num_tokens=st.sampled_from([64, 100, 512, 777, 2048, 8192]),
)
def test_never_worse_than_vllm_and_extras_are_accounted_for(mode: str, max_num_seqs: int, depth: int, max_num_tokens: int) -> None:
    if max_num_tokens < 1 + depth:
        return
    graphs, ref_graphs, extra = compare(mode, max_num_seqs, depth, max_num_tokens)
    allowed = allowed_extras(mode, max_num_seqs, depth, max_num_tokens)
    assert {t for t, _ in extra} <= allowed, (extra, allowed)
    # Each extra (width, strategy) is one graph the reference has none of; nothing else is added.
    assert graphs <= ref_graphs + len(extra), (graphs, ref_graphs, extra)


@pytest.mark.parametrize(
    ("mode", "max_num_seqs", "depth", "max_num_tokens"),
    [("full", 256, 0, 8192), ("full_decode_only", 20, 2, 8192), ("piecewise", 100, 4, 8192), ("full_and_piecewise", 256, 0, 8192),
     ("full", 100, 4, 8192), ("full_and_piecewise", 48, 3, 2048), ("full_decode_only", 256, 0, 8192)],
)
def test_issue_configurations(mode: str, max_num_seqs: int, depth: int, max_num_tokens: int) -> None:
    graphs, ref_graphs, extra = compare(mode, max_num_seqs, depth, max_num_tokens)
    assert graphs == ref_graphs + len(extra)
    assert {t for t, _ in extra} <= allowed_extras(mode, max_num_seqs, depth, max_num_tokens)


def test_full_mode_captures_one_graph_per_shape() -> None:
    """Item 1: 51 graphs at max_num_seqs=256 like vLLM's FULL, 86 only when decode runs its own routine."""
    plan = CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="full")
    assert len(plan) == 51 and not any(d.uniform for d in plan.descriptors())
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(5)).key == B(8, 8), "a decode batch is served by the mixed key of its width"
    separate = CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="full", separate_decode=True)
    assert len(separate) == 86 and sum(d.uniform for d in separate.descriptors()) == 35
    shapes = [(d.num_tokens, d.num_reqs) for d in plan.descriptors()]
    assert len(shapes) == len(set(shapes))


def test_full_mode_with_speculation_keeps_uniform_keys_only_past_the_max_capture_size() -> None:
    plan = CapturePlan.build(max_num_seqs=256, max_num_tokens=8192, mode="full", spec_depths=(0, 2))
    uniform = [d for d in plan.descriptors() if d.uniform]
    assert uniform == [B.decode(256, 2)], "768 tokens is past the 512 max capture size: the widest verify batch keeps its key"
    tokens = [d.num_tokens for d in plan.descriptors()]
    assert len(tokens) == len(set(tokens)), "one graph per token count"
    assert {3, 6, 12} <= set(tokens), "small verify widths are mixed keys"


def test_request_ladder_for_speculative_decoding() -> None:
    """Item 2: a 4-request verify batch (k=2) pads to 12 tokens, not 18."""
    plan = CapturePlan.build(max_num_seqs=20, max_num_tokens=8192, mode="full_decode_only", spec_depths=(2,))
    assert [d.num_reqs for d in reversed(plan.descriptors())] == [1, 2, 4, 8, 16, 20]
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(4, 2)).padding.tokens == 0
    assert m.match(B.decode(3, 2)).key == B.decode(4, 2)


def test_piecewise_includes_uniform_widths() -> None:
    """Item 3: piecewise, max_num_seqs=100, k=4: a 5-token step pads to 5, not 8."""
    plan = CapturePlan.build(max_num_seqs=100, max_num_tokens=8192, mode="piecewise", spec_depths=(4,))
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(1, 4)).padding.tokens == 0
    assert m.match(B(5, 2)).padding.tokens == 0
    ladder = set(default_ladder(512))
    extra = sorted({d.num_tokens for d in plan.descriptors()} - ladder)
    assert extra == [5, 10, 20, 280, 360, 440, 500]
    explicit = CapturePlan.build(max_num_seqs=100, max_num_tokens=8192, mode="piecewise", spec_depths=(4,), capture_sizes=[8, 64, 512])
    assert [d.num_tokens for d in explicit.descriptors()] == [512, 64, 8], "sizes given are taken as given"


@settings(max_examples=60, deadline=None)
@given(
    mode=st.sampled_from([*MODES, "full_and_breakable"]),
    max_num_seqs=st.integers(1, 300),
    depths=st.sets(st.integers(0, 5), min_size=1, max_size=3),
    max_num_tokens=st.sampled_from([64, 100, 512, 2048, 8192]),
    separate=st.booleans(),
    data=st.data(),
)
def test_no_key_fails_to_cover_and_coverage_is_kept(
    mode: str, max_num_seqs: int, depths: set[int], max_num_tokens: int, separate: bool, data: st.DataObject
) -> None:
    if max_num_tokens < 1 + max(depths):
        return
    s = PlanSettings(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, mode=mode, spec_depths=tuple(depths), separate_decode=separate)
    plan = CapturePlan.build(s)
    assert not [g for g in plan.uncovered() if g.kind == "decode"] or s.decode_strategy is None
    if s.mixed_strategy is not None:
        assert [(g.min_tokens, g.max_tokens) for g in plan.uncovered() if g.kind == "mixed"] in (
            [], [(s.used_max_capture_size + 1, max_num_tokens)]
        ) or max(d.num_tokens for d in plan.descriptors()) > s.used_max_capture_size
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    for _ in range(50):
        if data.draw(st.booleans()):
            d = data.draw(st.sampled_from(sorted(depths)))
            batch = B.decode(data.draw(st.integers(1, s.widest[d])), d)
        else:
            t = data.draw(st.integers(1, max_num_tokens))
            batch = B(t, data.draw(st.integers(1, min(t, max_num_seqs))))
        match = m.match(batch)
        assert match is None or match.key.covers(batch)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from([*MODES, "full_and_breakable"]),
    multiple=st.sampled_from([2, 4, 8]),
    max_num_seqs=st.integers(1, 64),
    depth=st.integers(0, 3),
    separate=st.booleans(),
)
def test_size_multiple_applies_to_every_key(mode: str, multiple: int, max_num_seqs: int, depth: int, separate: bool) -> None:
    """Item 6: every token count a multiple of size_multiple, in build and fit, coverage kept."""
    import math

    step = multiple // math.gcd(multiple, 1 + depth)
    max_num_seqs = -(-max_num_seqs // step) * step
    kwargs = dict(max_num_seqs=max_num_seqs, max_num_tokens=4096, mode=mode, spec_depths=(depth,), separate_decode=separate, size_multiple=multiple)
    plan = CapturePlan.build(**kwargs)
    assert all(d.num_tokens % multiple == 0 for d in plan.descriptors())
    plain = CapturePlan.build(**{**kwargs, "size_multiple": 1})
    assert [g for g in plan.uncovered() if g.kind == "decode"] == [g for g in plain.uncovered() if g.kind == "decode"]
    steps = [B.decode(r, depth) for r in range(1, max_num_seqs + 1)] + [B(t, 1) for t in range(1, 100, 7)]
    fitted = CapturePlan.fit(steps, 2 * len(plan), **kwargs)
    assert all(d.num_tokens % multiple == 0 for d in fitted.descriptors())
    assert [g for g in fitted.uncovered() if g.kind == "decode"] == [g for g in plain.uncovered() if g.kind == "decode"]
    # Against the reference rounded the way vLLM rounds under sequence parallelism: never more padding for mixed batches.
    if mode in ("full", "piecewise", "full_and_piecewise"):
        sizes = vllm_ladder(max_num_seqs, 1 + depth, 4096, multiple)
        ref = Matcher([(B(t), "piecewise") for t in sizes])
        mine = Matcher((e.descriptor, "piecewise") for e in plan if not e.descriptor.uniform)
        for t in range(1, max(sizes) + 1):
            assert score(mine, B(t, 1))[1] <= score(ref, B(t, 1))[1]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"size_multiple": 0}, "size_multiple must be a positive int, got 0"),
        ({"size_multiple": 4, "capture_sizes": [4, 6, 8]}, r"capture_sizes \[6\] are not multiples of size_multiple=4"),
        ({"size_multiple": 4, "max_capture_size": 30}, "max_capture_size=30 is not a multiple of size_multiple=4"),
        ({"size_multiple": 4, "max_num_seqs": 18}, r"size_multiple=4: uniform keys of spec depth 0 \(1 token a request\) need "
                                                   r"request counts that are multiples of 4, but the widest uniform batch, 18"),
        ({"size_multiple": 2048}, "size_multiple=2048 exceeds max_num_tokens=1024"),
        ({"separate_decode": 1}, "separate_decode must be True or False, got 1"),
    ],
)
def test_bad_settings_name_their_values(kwargs: dict, message: str) -> None:
    settings = {"max_num_seqs": 8, "max_num_tokens": 1024, "mode": "full", **kwargs}
    with pytest.raises(ValueError, match=message):
        CapturePlan.build(**settings)


def test_fit_in_full_mode_is_exact_over_one_family() -> None:
    """Folded plans fit uniform and mixed batches together: the fitted padding is what the matcher gives."""
    from cgregistry.fitting import evaluate

    steps = [B.decode(3)] * 9 + [B.decode(5)] * 4 + [B(7, 2)] * 3 + [B(12, 4)] * 2
    plan = CapturePlan.fit(steps, 3, max_num_seqs=8, max_num_tokens=16, mode="full")
    assert len(plan) <= 3 and not any(d.uniform for d in plan.descriptors())
    assert max(d.num_tokens for d in plan.descriptors()) == 16, "the max capture size stays a key"
    best = min(
        evaluate(CapturePlan.of([(B(a, min(a, 8)), "full"), (B(b, min(b, 8)), "full"), (B(16, 8), "full")]), steps).padded_tokens
        for a in range(1, 16) for b in range(a + 1, 16)
    )
    assert evaluate(plan, steps).padded_tokens == best


def test_matcher_exclusion_per_call() -> None:
    """Item 5 (matcher level): exclude=("full",) is vLLM's disable_full, one matcher for both."""
    plan = CapturePlan.build(max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise")
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    batch = B.decode(5)
    assert m.match(batch).strategy == "full"
    off = m.match(batch, exclude=("full",))
    assert off is not None and off.strategy == "piecewise" and off.key == B(8)
    assert m.match(batch).strategy == "full", "the plain memo is untouched"
    assert m.match(batch, exclude=("full", "piecewise")) is None
    assert m.candidates(batch, exclude=("full",))[0] == off
    text = str(m.explain(batch, exclude=["full"]))
    assert "strategy 'full' is excluded for this call" in text and "matched Batch(tokens=8, reqs=any) [piecewise]" in text
    assert m.explain(batch, exclude=["full"]).match == off
    with pytest.raises(TypeError, match="exclude must be a collection of strategy names, e.g. \\('full',\\); got 'full'"):
        m.match(batch, exclude="full")
    with pytest.raises(TypeError, match="exclude must hold strategy names"):
        m.match(batch, exclude=(1,))


@settings(max_examples=40, deadline=None)
@given(max_num_seqs=st.integers(1, 64), depth=st.integers(0, 3), t=st.integers(1, 400), data=st.data())
def test_exclusion_is_the_matcher_without_those_strategies(max_num_seqs: int, depth: int, t: int, data: st.DataObject) -> None:
    plan = CapturePlan.build(max_num_seqs=max_num_seqs, max_num_tokens=512, mode="full_and_piecewise", spec_depths=(depth,))
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    without = Matcher((e.descriptor, e.strategy) for e in plan if e.strategy != "full")
    batch = B.decode(data.draw(st.integers(1, min(max_num_seqs, 512 // (1 + depth)))), depth) if data.draw(st.booleans()) else B(t, min(t, max_num_seqs))
    assert m.match(batch, exclude=("full",)) == without.match(batch)
