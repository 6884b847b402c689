"""The micro-batch axis (dual-batch overlap): a step split into two micro-batches replays a graph captured for two,
never one captured for one, and the axis shows in plans, explain(), inspection and the distributed encoding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B

HIDDEN = 4


def split_step(batch: B, x: torch.Tensor) -> torch.Tensor:
    """A step that runs its rows as ``batch.num_ubatches`` micro-batches, each scaled by its own index (so a graph
    captured for another split gives another answer)."""
    parts = x.chunk(batch.num_ubatches)
    return torch.cat([part * 2 + index for index, part in enumerate(parts)])


def registry() -> cg.GraphRegistry:
    reg = cg.GraphRegistry(split_step, {"x": cg.StaticInput((64, HIDDEN), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, max_capture_size=64, mode="full", ubatch_threshold=32))
    return reg


def test_a_two_micro_batch_step_is_served_by_its_own_graph_equal_to_eager() -> None:
    reg = registry()
    x = torch.randn(32, HIDDEN)
    for ubatches in (1, 2):
        batch = B(32, 8, num_ubatches=ubatches)
        match = reg.match(batch)
        assert match is not None and match.key == B(32, 8, num_ubatches=ubatches)
        torch.testing.assert_close(reg.run(batch, x=x), split_step(batch, x))
    assert not torch.equal(split_step(B(32, 8, num_ubatches=2), x), split_step(B(32, 8), x)), "the split matters"
    by_class = reg.stats().by_class
    assert by_class["full/mixed-ub2/lora0"].replays == 1 and by_class["full/mixed/lora0"].replays == 1
    assert reg.match(B(16, 8, num_ubatches=2)).key == B(32, 8, num_ubatches=2), "a smaller split step pads up to a split key"


def test_a_split_step_without_a_split_key_runs_eagerly_not_on_a_one_micro_batch_graph() -> None:
    reg = cg.GraphRegistry(split_step, {"x": cg.StaticInput((64, HIDDEN), torch.float32)}, backend="cpu")
    reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, max_capture_size=64, mode="full"))
    batch, x = B(16, 8, num_ubatches=2), torch.randn(16, HIDDEN)
    assert reg.match(batch) is None
    explanation = reg.explain(batch)
    assert "ubatches=2" in str(explanation)
    assert "key runs 1 micro-batch(es), batch has 2" in str(explanation)
    torch.testing.assert_close(reg.run(batch, x=x), split_step(batch, x))
    assert reg.stats().eager_fallbacks == 1


def test_the_plan_gives_each_key_at_the_threshold_and_above_a_two_micro_batch_twin() -> None:
    plan = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, max_capture_size=64, mode="full", ubatch_threshold=40)
    ones = {e.descriptor.num_tokens for e in plan if e.descriptor.num_ubatches == 1}
    twos = {e.descriptor.num_tokens for e in plan if e.descriptor.num_ubatches == 2}
    assert twos == {t for t in ones if t >= 40} == {40, 48, 56, 64}
    assert all(e.descriptor.num_ubatches == 1 for e in cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64))
    with pytest.raises(ValueError, match="ubatch_threshold"):
        cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, ubatch_threshold=0)
    with pytest.raises(ValueError, match="ubatch_threshold must be at least 2, got 1"):
        cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, ubatch_threshold=1)  # a 1-token key cannot split
    with pytest.raises(ValueError, match="ubatch_threshold=32: CapturePlan.fit does not count the two-micro-batch keys"):
        cg.CapturePlan.fit([B(40, 8, num_ubatches=2)] * 5, 4, max_num_seqs=8, max_num_tokens=64, ubatch_threshold=32)


@pytest.mark.parametrize(("value", "error", "message"), [
    (0, ValueError, "num_ubatches must be positive, got 0"),
    (True, TypeError, "num_ubatches must be an int"),
    (9, ValueError, "num_ubatches=9 exceeds num_tokens=8"),
])
def test_bad_micro_batch_counts_name_themselves(value: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        B(8, 4, num_ubatches=value)  # type: ignore[arg-type]


def test_the_distributed_encoding_and_query_lengths_carry_the_split() -> None:
    for batch in (B(32, 8, num_ubatches=2), B(8, num_ubatches=2), B(8, 8, 0, 0, True, 2)):
        assert B.from_encoded(batch.encode()) == batch
    assert B.from_query_lens([1, 1, 1, 1], num_ubatches=2) == B(4, 4, 0, 0, True, 2)
    assert B.from_query_lens([3, 1], num_ubatches=2) == B(4, 2, num_ubatches=2)
    assert B.from_query_lens([1, 1]) is B.decode(2)


@st.composite
def descriptors(draw: st.DrawFn) -> B:
    tokens = draw(st.integers(2, 24))
    uniform = draw(st.booleans())
    ubatches = draw(st.integers(1, 2))
    if uniform:
        depth = draw(st.integers(0, 1))
        reqs = max(1, tokens // (1 + depth))
        return B(reqs * (1 + depth), reqs, 0, depth, True, ubatches)
    return B(tokens, draw(st.one_of(st.none(), st.integers(1, tokens))), 0, 0, False, ubatches)


@settings(max_examples=300, deadline=None)
@given(keys=st.lists(descriptors(), min_size=1, max_size=12, unique=True), actual=descriptors())
def test_the_matcher_never_crosses_micro_batch_counts(keys: list[B], actual: B) -> None:
    """Against a scan written from the fields: the least token padding among keys of the same split and form."""
    def fits(key: B) -> bool:
        return (key.num_ubatches == actual.num_ubatches and key.num_tokens >= actual.num_tokens
                and (key.num_reqs is None or (actual.num_reqs is not None and key.num_reqs >= actual.num_reqs))
                and (not key.uniform or (actual.uniform and key.spec_depth == actual.spec_depth)))
    fitting = [key for key in keys if fits(key)]
    match = cg.Matcher((key, "full") for key in keys).match(actual)
    if not fitting:
        assert match is None
        return
    assert match is not None and match.key.num_ubatches == actual.num_ubatches
    assert match.key.num_tokens - actual.num_tokens == min(key.num_tokens for key in fitting) - actual.num_tokens
