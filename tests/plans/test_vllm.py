"""Plans against vLLM's own CUDA-graph sizes and dispatch.

The reference is ``tests/vllm_reference.py``, re-expressed from vLLM's source (its docstring names
the files and versions): model runner V1's ``CudagraphDispatcher`` after
``adjust_cudagraph_sizes_for_spec_decode``, and model runner V2's ``CudaGraphManager``.  For every
batch, cgregistry's default plan must serve it no worse than each of them: a stronger strategy
(full > piecewise = breakable > eager), or the same one with no more token, request or LoRA
padding.

Why the reference this file held before agreed with worse plans: it was written from vLLM's
documentation, not its code.  It read the token ladder as request counts for uniform keys (so
cgregistry's request ladder 1, 2, 4, 8, 16, ... x q was the reference itself), while vLLM rounds
every capture size up to a multiple of ``q`` (a 24-token size is a 6-request graph at ``q = 4``);
and it gave FULL mode the unrounded ladder, while V1 rounds FULL mode's sizes too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cgregistry import BatchDescriptor as B
from cgregistry import CapturePlan, Matcher, PlanSettings
from cgregistry.plan import default_ladder, request_ladder
from tests.vllm_graph_table import table
from tests.vllm_reference import (
    MODE_OF,
    Served,
    V1Dispatcher,
    V2Manager,
    VllmSettings,
    capture_sizes,
    lora_cases,
    no_worse,
    round_sizes_for_spec_decode,
)

MODES = ["full", "piecewise", "breakable", "full_decode_only", "full_and_piecewise", "full_and_breakable"]


# ---------------------------------------------------------------------------- the reference, checked against the source


def test_reference_sizes_follow_vllm_set_cudagraph_sizes() -> None:
    """Values worked out by hand from ``_set_cudagraph_sizes`` for cases where the rules differ."""
    plain = VllmSettings("PIECEWISE", 256, 8192)
    assert capture_sizes(plain) == [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    # q = 3: the request ladder's widths 3 * (1, 2, 4, 8, 12) join the token ladder (max 72).
    spec = VllmSettings("FULL", 12, 1000, num_speculative_tokens=2)
    assert capture_sizes(spec) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 36, 40, 48, 56, 64, 72]
    assert capture_sizes(VllmSettings("FULL", 12, 1000, num_speculative_tokens=2, legacy_sizes=True)) == list(
        [1, 2, 4, *range(8, 73, 8)])
    # max_num_batched_tokens within the max is captured even off the ladder.
    assert capture_sizes(VllmSettings("PIECEWISE", 256, 100))[-3:] == [88, 96, 100]
    # An explicit max off the ladder: sizes stop at the last ladder value (vLLM truncates the max to it).
    assert capture_sizes(VllmSettings("FULL_DECODE_ONLY", 300, 700, 4, max_cudagraph_capture_size=264))[-2:] == [248, 256]
    # Explicit sizes are kept as given (off-ladder ones too), within max_num_batched_tokens.
    assert capture_sizes(VllmSettings("PIECEWISE", 8, 100, cudagraph_capture_sizes=(7, 5, 30, 500))) == [5, 7, 30]


def test_reference_rounding_follows_adjust_cudagraph_sizes_for_spec_decode() -> None:
    """q = 3 and q = 5 (not powers of two): sizes round up to multiples of q within the max; none left: [q] or an error."""
    ladder = [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert round_sizes_for_spec_decode(ladder, 3) == [3, 6, 9, 18, 24, 33, 42, 48]
    assert round_sizes_for_spec_decode(ladder, 5) == [5, 10, 20, 25, 35, 40]  # 48 -> 50 is over the max
    assert round_sizes_for_spec_decode([5, 7, 30], 4) == [8]  # explicit, off the ladder: 30 -> 32 is over the max, so 8 is
    assert round_sizes_for_spec_decode([1, 2], 2) == [2]
    with pytest.raises(ValueError, match="no capture size is left"):
        round_sizes_for_spec_decode([1, 2, 4], 5)


def test_reference_v1_rounds_in_full_mode_and_v2_does_not() -> None:
    """V1 rounds whenever its decode graphs are FULL (FULL mode too); V2 keeps the sizes and rounds per uniform descriptor."""
    settings = VllmSettings("FULL", 12, 1000, num_speculative_tokens=2)
    v1, v2 = V1Dispatcher(settings), V2Manager(settings)
    assert v1.sizes == [3, 6, 9, 12, 18, 24, 33, 36, 42, 48, 57, 66, 72] and not v1.decode_sizes
    assert v2.sizes == capture_sizes(settings) and not v2.decode_sizes
    piecewise = V1Dispatcher(VllmSettings("PIECEWISE", 12, 1000, num_speculative_tokens=2))
    assert piecewise.sizes == capture_sizes(settings), "no rounding without FULL decode graphs"
    fdo = VllmSettings("FULL_AND_PIECEWISE", 8, 256, num_speculative_tokens=3)
    assert V1Dispatcher(fdo).decode_sizes == V2Manager(fdo).decode_sizes == [4, 8, 16, 24, 32]


def test_reference_lora_cases_follow_get_captured_lora_counts() -> None:
    assert lora_cases(VllmSettings("FULL", 8, 64)) == [0]
    assert lora_cases(VllmSettings("FULL", 8, 64, max_loras=4)) == [0, 5]
    assert lora_cases(VllmSettings("FULL", 8, 64, max_loras=4, specialize_active_lora=True)) == [0, 1, 2, 4, 5]
    assert lora_cases(VllmSettings("FULL", 8, 64, max_loras=7, specialize_active_lora=True)) == [0, 1, 2, 4, 8]
    v1 = V1Dispatcher(VllmSettings("FULL_AND_PIECEWISE", 8, 64, max_loras=4))
    assert v1.dispatch(5, 5, True, active_loras=3).loras == 5 and v1.dispatch(5, 5, True).loras == 0


def test_reference_dispatch() -> None:
    v1 = V1Dispatcher(VllmSettings("FULL_AND_PIECEWISE", 8, 256, num_speculative_tokens=3))
    assert v1.dispatch(20, 5, True) == Served("full", 24, 6)
    assert v1.dispatch(20, 5, False) == Served("piecewise", 24)
    assert v1.dispatch(65, 9, False) == Served(None), "over the max capture size: eager"
    fdo = V1Dispatcher(VllmSettings("FULL_DECODE_ONLY", 8, 256, num_speculative_tokens=3))
    assert fdo.dispatch(20, 7, False) == Served(None), "no mixed graphs"
    assert V1Dispatcher(VllmSettings("FULL", 12, 1000, 2)).dispatch(57, 10, False) == Served("full", 57, 12)
    assert V2Manager(VllmSettings("FULL", 12, 1000, 2)).dispatch(57, 10, False) == Served("full", 64, 12)


# ---------------------------------------------------------------------------- cgregistry against the reference


def plan_for(mode: str, v: VllmSettings) -> CapturePlan:
    """cgregistry's default plan at vLLM's settings."""
    return CapturePlan.build(
        max_num_seqs=v.max_num_seqs, max_num_tokens=v.max_num_batched_tokens, mode=mode, spec_depths=(v.num_speculative_tokens,),
        capture_sizes=v.cudagraph_capture_sizes, max_capture_size=v.max_cudagraph_capture_size, max_loras=v.max_loras,
    )


def ours(matcher: Matcher, batch: B) -> Served:
    match = matcher.match(batch)
    if match is None:
        return Served(None)
    assert match.key.covers(batch), (match, batch)
    return Served(match.strategy, match.key.num_tokens, match.key.num_reqs, match.key.num_active_loras)


def batches(v: VllmSettings, top: int, loras: list[int]) -> Iterator[tuple[B, bool]]:
    """Every uniform decode/verify batch, and every mixed token count up to ``top`` at 1 and at the most requests, per LoRA count.

    The flag is vLLM's ``uniform_decode``: every request has ``q`` tokens.
    """
    k, n = v.num_speculative_tokens, v.max_num_seqs
    for active in loras:
        for r in range(1, min(n, v.max_num_batched_tokens // v.q) + 1):
            yield B.decode(r, k, active), True
        for t in range(1, min(top, v.max_num_batched_tokens) + 1):
            for r in {1, min(t, n)}:
                yield B(t, r, active), False


def worse(mode: str, v: VllmSettings, loras: list[int] | None = None) -> list[tuple[B, Served, Served, Served]]:
    """Batches cgregistry's plan serves worse than V1 or V2: (batch, ours, V1's, V2's)."""
    v1, v2 = V1Dispatcher(v), V2Manager(v)
    plan = plan_for(mode, v)
    matcher = Matcher((e.descriptor, e.strategy) for e in plan)
    top = max([*v1.sizes, *v2.sizes, 1]) + 1
    if loras is None:
        loras = [0] if v.max_loras is None else list(range(v.max_loras + 1))
    found = []
    for batch, uniform in batches(v, top, loras):
        shape = (batch.num_tokens, batch.num_reqs, batch.num_active_loras)
        mine = ours(matcher, batch)
        theirs = [ref.dispatch(*shape[:2], uniform, batch.num_active_loras) for ref in (v1, v2)]
        if not all(no_worse(mine, other, *shape) for other in theirs):
            found.append((batch, mine, *theirs))
    return found


PADDING_ROWS = [
    # (mode, settings, batch, vLLM V1 and V2 serve it with, cgregistry before this change)
    ("full_decode_only", VllmSettings("FULL_DECODE_ONLY", 8, 256, 3), B.decode(5, 3), Served("full", 24, 6), B.decode(8, 3)),
    ("full_and_piecewise", VllmSettings("FULL_AND_PIECEWISE", 8, 256, 3), B.decode(5, 3), Served("full", 24, 6), B.decode(8, 3)),
    ("full_decode_only", VllmSettings("FULL_DECODE_ONLY", 20, 4096, 2), B.decode(10, 2), Served("full", 33, 11), B.decode(16, 2)),
    ("full_decode_only", VllmSettings("FULL_DECODE_ONLY", 300, 700, 4, max_cudagraph_capture_size=264), B.decode(7, 4),
     Served("full", 35, 7), B.decode(8, 4)),
    ("full", VllmSettings("FULL", 12, 1000, 2), B(57, 10), Served("full", 57, 12), B(64, 12)),
    ("full", VllmSettings("FULL", 12, 1000, 2), B(9, 9), Served("full", 9, 9), B(12, 12)),
]


@pytest.mark.parametrize(("mode", "v", "batch", "vllm", "before"), PADDING_ROWS, ids=[f"row{i + 1}" for i in range(len(PADDING_ROWS))])
def test_batches_vllm_v1_pads_least_get_the_same_key(mode: str, v: VllmSettings, batch: B, vllm: Served, before: B) -> None:
    """V1's graph for each batch of the table; the plan serves it with as little padding, where an earlier ladder padded more."""
    uniform = batch.uniform
    assert V1Dispatcher(v).dispatch(batch.num_tokens, batch.num_reqs, uniform) == vllm
    if uniform:
        assert V2Manager(v).dispatch(batch.num_tokens, batch.num_reqs, uniform) == vllm, "V2 agrees on uniform batches"
    shape = (batch.num_tokens, batch.num_reqs, 0)
    mine = ours(Matcher((e.descriptor, e.strategy) for e in plan_for(mode, v)), batch)
    assert no_worse(mine, vllm, *shape), (mine, vllm)
    assert (mine.tokens, mine.reqs) == (vllm.tokens, vllm.reqs)
    assert (mine.tokens, mine.reqs) != (before.num_tokens, before.num_reqs), "the earlier ladder (column before) padded more"
    assert not worse(mode, v), "and no other batch at these settings is worse"


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("mode", MODES)
def test_common_configs_are_never_worse(mode: str, k: int) -> None:
    """256 sequences / 8192 tokens at each spec depth, every batch, both model runners."""
    assert not worse(mode, VllmSettings(MODE_OF[mode], 256, 8192, k))


@pytest.mark.parametrize("mode", MODES)
def test_small_configs_are_never_worse(mode: str) -> None:
    """Few sequences and small token budgets, where the widest batch, the budget and the max capture size meet."""
    for n in (1, 2, 3, 5, 8, 12, 20, 33):
        for budget in (16, 64, 100, 1000):
            for k in range(5):
                v = VllmSettings(MODE_OF[mode], n, budget, k)
                assert not worse(mode, v), v


@pytest.mark.parametrize("specialize", [False, True])
@pytest.mark.parametrize("mode", ["full", "full_and_piecewise", "full_decode_only", "piecewise"])
def test_lora_configs_are_never_worse(mode: str, specialize: bool) -> None:
    """64 sequences / 2048 tokens with 3 adapters (a LoRA count off the powers of two), every active count."""
    assert not worse(mode, VllmSettings(MODE_OF[mode], 64, 2048, 2, max_loras=3, specialize_active_lora=specialize))


@st.composite
def engine_settings(draw: st.DrawFn) -> tuple[str, VllmSettings]:
    """A mode and vLLM settings cgregistry also accepts: explicit sizes (off the ladder too) or an explicit max within the budget."""
    mode = draw(st.sampled_from(MODES))
    k = draw(st.integers(0, 4))
    budget = draw(st.one_of(st.sampled_from([64, 100, 256, 700, 777, 1000, 2048, 8192]), st.integers(1 + k, 1200)))
    assume(budget >= 1 + k)
    explicit = draw(st.sampled_from(["default", "sizes", "max"]))
    sizes = top = None
    if explicit == "sizes":
        sizes = tuple(draw(st.lists(st.integers(1, min(budget, 600)), min_size=1, max_size=12)))
    elif explicit == "max":
        top = draw(st.integers(1, min(budget, 600)))
    loras = draw(st.one_of(st.none(), st.integers(1, 5)))
    v = VllmSettings(
        MODE_OF[mode], draw(st.integers(1, 300)), budget, k, sizes, top, loras, draw(st.booleans()), draw(st.booleans()),
    )
    return mode, v


@settings(max_examples=150, deadline=None)
@given(config=engine_settings(), data=st.data())
def test_never_worse_than_vllm(config: tuple[str, VllmSettings], data: st.DataObject) -> None:
    """Random settings, every batch (uniform and mixed, at a few LoRA counts): no batch served worse than V1 or V2."""
    mode, v = config
    try:
        V1Dispatcher(v), V2Manager(v)
    except ValueError:
        assume(False)  # vLLM refuses these settings
    loras = [0] if v.max_loras is None else sorted({0, v.max_loras, data.draw(st.integers(1, v.max_loras))})
    found = worse(mode, v, loras)
    assert not found, (mode, v, found[:3])


def needed_and_extra(mode: str, v: VllmSettings) -> tuple[set[tuple[str, int]], set[tuple[str, int]]]:
    """(what item 1 needs, what the plan captures beyond it) as (key class, token count), LoRA counts aside.

    Needed: every graph of V1 or V2 (the current sizes, a superset of the legacy ones), in the class of
    cgregistry key that must match it: a batch of exactly that shape is padded to nothing there, so a
    key of exactly that width is the only way not to be worse.  Folded ``full`` plans serve uniform
    batches with mixed keys.
    """
    v = dataclasses.replace(v, legacy_sizes=False)
    v1, v2 = V1Dispatcher(v), V2Manager(v)
    needed = {("uniform", t) for t in [*v1.decode_sizes, *v2.decode_sizes]}
    if MODE_OF[mode] in ("FULL", "PIECEWISE", "FULL_AND_PIECEWISE"):
        needed |= {("mixed", t) for t in [*v1.sizes, *v2.sizes]}
    have = {("uniform" if d.uniform else "mixed", d.num_tokens) for d in plan_for(mode, v).descriptors() if d.num_active_loras == 0}
    return needed, have - needed


def allowed_extra(mode: str, v: VllmSettings, key: tuple[str, int]) -> bool:
    """Graphs cgregistry keeps beyond vLLM's: coverage vLLM lacks, and the request ladder's widths with an explicit max."""
    v = dataclasses.replace(v, legacy_sizes=False)
    s = PlanSettings(max_num_seqs=v.max_num_seqs, max_num_tokens=v.max_num_batched_tokens, mode=mode,
                     spec_depths=(v.num_speculative_tokens,), capture_sizes=v.cudagraph_capture_sizes,
                     max_capture_size=v.max_cudagraph_capture_size)
    tokens = key[1]
    q, w, top = v.q, s.widest[v.num_speculative_tokens], s.used_max_capture_size
    vllm_top = max([*V1Dispatcher(v).sizes, *V2Manager(v).sizes, 0])
    if tokens > vllm_top or tokens in (top, q * w):
        return True  # batches vLLM runs eagerly (past its largest graph: its max is truncated to the ladder), the widest uniform batch
    # vLLM adds the request ladder's widths only when it derives the max itself; cgregistry whenever the sizes are the default.
    return v.cudagraph_capture_sizes is None and tokens in {q * r for r in request_ladder(top, q)}


@settings(max_examples=60, deadline=None)
@given(config=engine_settings())
def test_no_graph_beyond_what_vllm_needs_except_coverage(config: tuple[str, VllmSettings]) -> None:
    """Item 2: every graph is one V1 or V2 has (so needed to be no worse on that exact shape), or a listed extra."""
    mode, v = config
    try:
        _, extra = needed_and_extra(mode, v)
    except ValueError:
        assume(False)  # vLLM refuses these settings
    assert all(allowed_extra(mode, v, key) for key in extra), sorted(k for k in extra if not allowed_extra(mode, v, k))


def test_docs_graph_table_is_current() -> None:
    """The graph counts in docs/plans-and-workloads.md are what the plans and the reference give today."""
    page = (Path(__file__).parents[2] / "docs" / "plans-and-workloads.md").read_text()
    assert table() in page, "regenerate the table with: python -m tests.vllm_graph_table"


SWEEP_EXTRAS = [
    {}, {"legacy_sizes": True}, {"max_cudagraph_capture_size": 264}, {"max_cudagraph_capture_size": 100},
    {"cudagraph_capture_sizes": (5, 7, 30, 63)}, {"cudagraph_capture_sizes": (1, 3, 17, 100, 250)},
    {"max_loras": 3}, {"max_loras": 3, "specialize_active_lora": True},
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_exhaustive_sweep(mode: str) -> None:
    """Many settings per mode, every batch and LoRA count (run with ``-m slow``; about a minute a mode on 2 cores)."""
    for n in (1, 2, 3, 5, 8, 12, 20, 33, 64, 100, 256, 300):
        for budget in (16, 64, 256, 700, 1000, 8192):
            for k in range(5):
                for extra in SWEEP_EXTRAS:
                    if budget < 1 + k or max(extra.get("cudagraph_capture_sizes", ()), default=0) > budget:
                        continue
                    if extra.get("max_cudagraph_capture_size", 0) > budget:
                        continue
                    v = VllmSettings(MODE_OF[mode], n, budget, k, **extra)
                    try:
                        V1Dispatcher(v), V2Manager(v)
                    except ValueError:
                        continue
                    found = worse(mode, v)
                    assert not found, (mode, v, found[:3])


# ---------------------------------------------------------------------------- plans' own shape


def test_full_mode_captures_one_graph_per_shape() -> None:
    """51 graphs at max_num_seqs=256 like vLLM's FULL, 86 only when decode runs its own routine."""
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
    assert {3, 6, 9, 12, 33, 57} <= set(tokens), "verify widths and the ladder rounded up to whole requests are mixed keys"


def test_uniform_keys_for_speculative_decoding() -> None:
    """The request ladder and the token ladder rounded up to whole requests (vLLM's uniform sizes), and the widest.

    The request ladder alone ([1, 2, 4, 8, 16, 20]) padded a 10-request k=2 verify batch to 16
    requests where vLLM pads it to 11 (33 tokens, its 32-token size rounded up); the test pinned that.
    """
    plan = CapturePlan.build(max_num_seqs=20, max_num_tokens=8192, mode="full_decode_only", spec_depths=(2,))
    assert [d.num_reqs for d in reversed(plan.descriptors())] == [1, 2, 3, 4, 6, 8, 11, 14, 16, 19, 20]
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(4, 2)).padding.tokens == 0
    assert m.match(B.decode(10, 2)).key == B.decode(11, 2)


def test_piecewise_includes_uniform_widths() -> None:
    """Piecewise, max_num_seqs=100, k=4: a 5-token step pads to 5, not 8 (vLLM adds these widths too)."""
    plan = CapturePlan.build(max_num_seqs=100, max_num_tokens=8192, mode="piecewise", spec_depths=(4,))
    m = Matcher((e.descriptor, e.strategy) for e in plan)
    assert m.match(B.decode(1, 4)).padding.tokens == 0
    assert m.match(B(5, 2)).padding.tokens == 0
    ladder = set(default_ladder(512))
    extra = sorted({d.num_tokens for d in plan.descriptors()} - ladder)
    assert extra == [5, 10, 20, 280, 360, 440, 500]
    explicit = CapturePlan.build(max_num_seqs=100, max_num_tokens=8192, mode="piecewise", spec_depths=(4,), capture_sizes=[8, 64, 512])
    assert [d.num_tokens for d in explicit.descriptors()] == [512, 64, 8], "sizes given are taken as given"


def test_mixed_keys_round_up_with_full_decode_graphs() -> None:
    """With uniform graphs of their own, mixed keys also get the sizes rounded up to whole requests (V1's sizes), beside the ladder (V2's)."""
    plan = CapturePlan.build(max_num_seqs=8, max_num_tokens=256, mode="full_and_piecewise", spec_depths=(3,), capture_sizes=[5, 7, 30])
    assert sorted(e.descriptor.num_tokens for e in plan if e.strategy == "piecewise") == [5, 7, 8, 30]
    assert sorted(e.descriptor.num_reqs for e in plan if e.descriptor.uniform) == [2, 8], "5 and 7 tokens -> 2 requests (30 -> 32 is over); the widest"


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
    assert not [g for g in plan.uncovered() if g.key_class == "decode"] or s.decode_strategy is None
    if s.mixed_strategy is not None:
        assert [(g.min_tokens, g.max_tokens) for g in plan.uncovered() if g.key_class == "mixed"] in (
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


def sp_sizes(max_num_seqs: int, depth: int, budget: int, multiple: int) -> list[int]:
    """vLLM's piecewise sizes made multiples of the tensor-parallel size (vLLM drops the others under sequence
    parallelism; rounding them up instead is the stricter reference)."""
    sizes = capture_sizes(VllmSettings("PIECEWISE", max_num_seqs, budget, depth))
    return sorted({-(-s // multiple) * multiple for s in sizes if -(-s // multiple) * multiple <= sizes[-1]})


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from([*MODES, "full_and_breakable"]),
    multiple=st.sampled_from([2, 4, 8]),
    max_num_seqs=st.integers(1, 64),
    depth=st.integers(0, 3),
    separate=st.booleans(),
)
def test_size_multiple_applies_to_every_key(mode: str, multiple: int, max_num_seqs: int, depth: int, separate: bool) -> None:
    """Every token count a multiple of size_multiple, in build and fit, coverage kept."""
    step = multiple // math.gcd(multiple, 1 + depth)
    max_num_seqs = -(-max_num_seqs // step) * step
    kwargs = dict(max_num_seqs=max_num_seqs, max_num_tokens=4096, mode=mode, spec_depths=(depth,), separate_decode=separate, size_multiple=multiple)
    plan = CapturePlan.build(**kwargs)
    assert all(d.num_tokens % multiple == 0 for d in plan.descriptors())
    plain = CapturePlan.build(**{**kwargs, "size_multiple": 1})
    assert [g for g in plan.uncovered() if g.key_class == "decode"] == [g for g in plain.uncovered() if g.key_class == "decode"]
    steps = [B.decode(r, depth) for r in range(1, max_num_seqs + 1)] + [B(t, 1) for t in range(1, 100, 7)]
    fitted = CapturePlan.fit(steps, 2 * len(plan), **kwargs)
    assert all(d.num_tokens % multiple == 0 for d in fitted.descriptors())
    assert [g for g in fitted.uncovered() if g.key_class == "decode"] == [g for g in plain.uncovered() if g.key_class == "decode"]
    if mode != "full_decode_only":  # never more padding for mixed batches than vLLM's sizes made multiples
        sizes = sp_sizes(max_num_seqs, depth, 4096, multiple)
        ref = Matcher([(B(t), "piecewise") for t in sizes])
        mine = Matcher((e.descriptor, "piecewise") for e in plan if not e.descriptor.uniform)
        for t in range(1, max(sizes) + 1):
            assert mine.match(B(t, 1)).padding.tokens <= ref.match(B(t, 1)).padding.tokens


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
    from cgregistry.plan.fit import evaluate

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
    """At the matcher: exclude=("full",) is vLLM's disable_full, one matcher for both."""
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
