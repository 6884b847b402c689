"""At the registry: run(exclude=...) and the padding cap, with eager as the oracle."""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor, Matcher
from tests.matching.test_matcher import STRATEGIES, descriptors

B = BatchDescriptor
CAP = 32


def step(batch: B, x: torch.Tensor) -> torch.Tensor:
    """Row i depends on rows 0..i only, so padding rows never change the real ones."""
    return torch.sin(x) * 3 + x.cumsum(0)


def eager(actual: B, x: torch.Tensor) -> torch.Tensor:
    return step(actual, x)


def registry(**kwargs: object) -> cg.GraphRegistry:
    return cg.GraphRegistry(step, {"x": cg.StaticInput((CAP,), torch.float32)}, backend="cpu", **kwargs)  # type: ignore[arg-type]


def x_for(n: int) -> torch.Tensor:
    return torch.linspace(-1.0, 2.0, n)


def both(reg: cg.GraphRegistry, lazy: bool = False) -> cg.GraphRegistry:
    reg.capture([(B(k), s) for s in ("full", "breakable") for k in (8, 16)], lazy=lazy)
    return reg


def used(reg: cg.GraphRegistry) -> dict[str, int]:
    """Replays per strategy, strategies never replayed left out."""
    return {k: v for k, v in reg.stats().by_strategy.items() if v}


def reasons(reg: cg.GraphRegistry) -> dict[str, int]:
    return {k: v for k, v in reg.stats().misses_by_reason.items() if v}


# ---------------------------------------------------------------------------- item 5: exclude


def test_exclude_full_replays_the_next_strategy_and_equals_eager() -> None:
    reg = both(registry())
    x = x_for(5)
    torch.testing.assert_close(reg.run(B(5), x=x, exclude=("full",)), eager(B(5), x))
    assert used(reg) == {"breakable": 1}, "the excluded strategy is never replayed"
    assert reg.match(B(5), exclude=("full",)) == cg.inspection.Match(B(8), "breakable", cg.key.Padding(3, 0, 0))
    # a plain run of the same shape is unaffected: its own route, the preferred strategy
    torch.testing.assert_close(reg.run(B(5), x=x), eager(B(5), x))
    assert used(reg) == {"breakable": 1, "full": 1}
    assert reg.match(B(5)).strategy == "full"
    torch.testing.assert_close(reg.run(B(5), x=x, exclude=("full",)), eager(B(5), x))  # each kept its own route
    assert used(reg) == {"breakable": 2, "full": 1}
    s = reg.stats()
    assert (s.hits, s.misses) == (3, 0)


@pytest.mark.parametrize("exclude", [("full",), ["full"], {"full"}, frozenset({"full"})])
def test_exclude_accepts_tuples_lists_and_sets(exclude: object) -> None:
    reg = both(registry())
    torch.testing.assert_close(reg.run(B(12), x=x_for(12), exclude=exclude), eager(B(12), x_for(12)))
    assert used(reg) == {"breakable": 1}


def test_empty_exclude_is_a_plain_run() -> None:
    reg = both(registry())
    reg.run(B(3), x=x_for(3), exclude=())
    assert used(reg) == {"full": 1}


def test_every_covering_strategy_excluded_runs_eagerly_as_an_excluded_miss() -> None:
    reg = both(registry())
    x = x_for(7)
    torch.testing.assert_close(reg.run(B(7), x=x, exclude=("full", "breakable")), eager(B(7), x))
    torch.testing.assert_close(reg.run(B(20), x=x_for(20), exclude=("full",)), eager(B(20), x_for(20)))
    assert reasons(reg) == {"excluded": 1, "above_largest_key": 1}, "no key covers 20 tokens: not an exclusion miss"
    assert reg.stats().hits == 0 and reg.stats().eager_fallbacks == 2
    assert reg.match(B(7), exclude=("full", "breakable")) is None


def test_explain_lists_the_excluded_keys() -> None:
    reg = both(registry())
    explanation = reg.explain(B(5), exclude=("full",))
    assert explanation.match == reg.match(B(5), exclude=("full",))
    excluded = [c for c in explanation.candidates if "excluded" in c.reason]
    assert {(c.key, c.strategy) for c in excluded} == {(B(8), "full"), (B(16), "full")}
    assert not any(c.chosen for c in excluded)
    assert "strategy 'full' is excluded for this call" in str(explanation)
    assert reg.explain(B(5)).match.strategy == "full"


def test_exclude_is_checked_with_errors_that_name_the_value() -> None:
    reg = both(registry())
    with pytest.raises(TypeError, match=r"exclude must be a tuple, list or set of strategy names.*got 'full' \(str\); strategies: breakable, eager, full, piecewise"):
        reg.run(B(3), x=x_for(3), exclude="full")
    with pytest.raises(ValueError, match=r"exclude=\('fulll',\) names 'fulll', not a registered strategy; strategies: breakable, eager, full, piecewise"):
        reg.run(B(3), x=x_for(3), exclude=("fulll",))
    with pytest.raises(TypeError, match="exclude must hold strategy names"):
        reg.match(B(3), exclude=(1,))
    with pytest.raises(ValueError, match="names 'nope'"):
        reg.explain(B(3), exclude=["nope"])
    assert reg.stats().misses == 0 and reg.stats().hits == 0, "a refused call runs nothing"


def test_a_static_input_named_exclude_is_refused() -> None:
    with pytest.raises(ValueError, match=r"static input name 'exclude' is reserved for run\(\.\.\., exclude=\.\.\.\)"):
        cg.GraphRegistry(step, {"exclude": cg.StaticInput((8,), torch.float32)}, backend="cpu")


def test_exclude_with_lazy_keys_captures_only_what_it_uses() -> None:
    reg = both(registry(), lazy=True)
    torch.testing.assert_close(reg.run(B(5), x=x_for(5), exclude=("full",)), eager(B(5), x_for(5)))
    assert [(e.key, e.strategy) for e in reg.entries()] == [(B(8), "breakable")]
    assert reg.stats().lazy_captures == 1 and used(reg) == {"breakable": 1}
    torch.testing.assert_close(reg.run(B(5), x=x_for(5)), eager(B(5), x_for(5)))
    assert {(e.key, e.strategy) for e in reg.entries()} == {(B(8), "breakable"), (B(8), "full")}


def test_exclude_in_debug_mode_checks_stale_outputs_too() -> None:
    reg = both(registry(debug=True))
    first = reg.run(B(5), x=x_for(5), exclude=("full",))
    torch.testing.assert_close(first, eager(B(5), x_for(5)))
    second = reg.run(B(6), x=x_for(6) + 1, exclude=("full",))  # same breakable graph: overwrites `first`
    torch.testing.assert_close(second, eager(B(6), x_for(6) + 1))
    with pytest.raises(cg.StaleOutputError):
        first.sum()
    assert used(reg) == {"breakable": 2}


def test_exclude_with_a_group_matches_the_agreed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    import cgregistry.server as registry_module

    monkeypatch.setattr(registry_module, "agree", lambda actual, group: B(12))  # another rank holds 12 tokens
    reg = both(registry())
    torch.testing.assert_close(reg.run(B(4), x=x_for(4), group=object(), exclude=("full",)), eager(B(4), x_for(4)))
    torch.testing.assert_close(reg.run(B(4), x=x_for(4), group=object()), eager(B(4), x_for(4)))
    used = {(e.key, e.strategy): e.replays for e in reg.entries(used=True)}
    assert used == {(B(16), "breakable"): 1, (B(16), "full"): 1}, "both follow the agreed 12 tokens, not the own 4"
    assert reg.match(B(4), group=object(), exclude=("full",)).key == B(16)


# ---------------------------------------------------------------------------- item 4: padding cap


def test_a_capped_batch_goes_to_the_next_strategy_or_eager() -> None:
    reg = registry(max_padding_tokens=2)
    reg.capture([(B(8), "full"), (B(16), "full"), (B(6), "breakable")])
    torch.testing.assert_close(reg.run(B(5), x=x_for(5)), eager(B(5), x_for(5)))
    assert used(reg) == {"breakable": 1}, "full's best key (8) pads 3 > 2: breakable's 6 pads 1"
    torch.testing.assert_close(reg.run(B(7), x=x_for(7)), eager(B(7), x_for(7)))
    assert used(reg) == {"breakable": 1, "full": 1}, "7 in 8 pads 1: full serves it"
    torch.testing.assert_close(reg.run(B(10), x=x_for(10)), eager(B(10), x_for(10)))
    assert reasons(reg) == {"padding_cap": 1}, "10 in 16 pads 6, and no breakable key covers 10"
    text = str(reg.explain(B(10)))
    assert "every covering key is excluded or over the padding cap (runs eagerly)" in text
    assert "covers, but pads 6 tokens for 10: over the cap (max_padding_tokens=2)" in text
    assert reg.padding_cap == cg.key.PaddingCap(max_tokens=2)


def test_a_padding_ratio_is_padding_tokens_per_real_token() -> None:
    m = Matcher([(B(20), "full"), (B(24), "full")], max_padding_ratio=0.25)
    assert m.match(B(16)).key == B(20)  # 4 <= 0.25 * 16
    m = Matcher([(B(24), "full")], max_padding_ratio=0.25)
    assert m.match(B(16)) is None  # 8 > 4
    assert Matcher([(B(24), "full")], max_padding_ratio=0.5).match(B(16)).key == B(24)
    both_caps = Matcher([(B(20), "full")], max_padding_ratio=1.0, max_padding_tokens=3)
    assert both_caps.match(B(16)) is None, "with both, a key must meet both"


def test_the_cap_also_bounds_what_a_choice_plugin_is_offered() -> None:
    m = Matcher([(B(8), "full"), (B(32), "full"), (B(16), "breakable")], max_padding_tokens=10)
    assert [(c.key, c.strategy) for c in m.candidates(B(7))] == [(B(8), "full"), (B(16), "breakable")]
    assert [(c.key, c.strategy) for c in m.candidates(B(9))] == [(B(16), "breakable")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_padding_tokens": -1}, r"max_padding_tokens must be an int >= 0 or None, got -1"),
        ({"max_padding_tokens": 1.5}, r"max_padding_tokens must be an int >= 0 or None, got 1.5"),
        ({"max_padding_tokens": True}, r"got True"),
        ({"max_padding_ratio": -0.1}, r"max_padding_ratio must be a finite number >= 0 .* got -0.1"),
        ({"max_padding_ratio": math.inf}, r"got inf"),
        ({"max_padding_ratio": math.nan}, r"got nan"),
        ({"max_padding_ratio": "0.5"}, r"got '0.5'"),
    ],
)
def test_padding_caps_are_checked(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry(**kwargs)
    with pytest.raises(ValueError, match=message):
        Matcher([], **kwargs)


def within_documented_cap(pad_tokens: int, actual_tokens: int, max_tokens: int | None, max_ratio: float | None) -> bool:
    """The padding cap as docs/plans-and-workloads.md states it, in exact arithmetic and without the code under test:
    at most ``max_tokens`` padding token slots and at most ``max_ratio`` padding tokens per real token (the ratio
    as written: ``0.1`` is one tenth); with both, a key must meet both; None: no limit of that kind."""
    if max_tokens is not None and pad_tokens > max_tokens:
        return False
    return max_ratio is None or Fraction(pad_tokens, actual_tokens) <= Fraction(str(max_ratio))


# Ratios a float holds exactly (k/8), and a few written in decimal: the matcher's float product and the exact
# ratio agree on all of them for batches of up to 40 tokens.
RATIOS = st.one_of(st.integers(0, 24).map(lambda k: k / 8), st.sampled_from([0.1, 0.3, 0.2, 0.6, 0.75, 1.5]))


def test_padding_equal_to_the_cap_is_allowed_and_one_more_is_not() -> None:
    """The cap is inclusive: a key padding exactly ``max_padding_tokens`` slots, or exactly ``max_padding_ratio``
    padding tokens per real token, serves; one slot more runs eagerly as a ``padding_cap`` miss."""
    reg = registry(max_padding_tokens=4)
    reg.capture([(B(16), "full")])
    torch.testing.assert_close(reg.run(B(12), x=x_for(12)), eager(B(12), x_for(12)))  # pads 4 = the cap
    torch.testing.assert_close(reg.run(B(11), x=x_for(11)), eager(B(11), x_for(11)))  # pads 5
    assert (reg.stats().hits, reasons(reg)) == (1, {"padding_cap": 1})

    reg = registry(max_padding_ratio=0.25)
    reg.capture([(B(20), "full")])
    torch.testing.assert_close(reg.run(B(16), x=x_for(16)), eager(B(16), x_for(16)))  # 4 for 16: 0.25 = the cap
    torch.testing.assert_close(reg.run(B(15), x=x_for(15)), eager(B(15), x_for(15)))  # 5 for 15: 0.33
    assert (reg.stats().hits, reasons(reg)) == (1, {"padding_cap": 1})


def test_a_key_serves_a_batch_exactly_when_its_padding_is_within_the_documented_cap() -> None:
    """Every batch of 1..32 tokens against every single key of 1..32 tokens under a grid of caps (either kind,
    both, neither): ``match``, ``candidates`` and ``explain`` take the key exactly when the documented cap allows
    its padding, boundaries included."""
    for max_tokens in (None, 0, 1, 4, 9):
        for max_ratio in (None, 0, 0.125, 0.25, 0.5, 1, 2.5, 0.1, 0.3):
            for key_tokens in range(1, 33):
                m = Matcher([(B(key_tokens), "full")], max_padding_tokens=max_tokens, max_padding_ratio=max_ratio)
                for tokens in range(1, key_tokens + 1):
                    want = within_documented_cap(key_tokens - tokens, tokens, max_tokens, max_ratio)
                    case = f"{tokens} tokens in a {key_tokens}-token key, max_padding_tokens={max_tokens}, max_padding_ratio={max_ratio}"
                    assert (m.match(B(tokens)) is not None) == want, case
                    assert len(m.candidates(B(tokens))) == want, case
                    assert ("over the cap" in m.explain(B(tokens)).candidates[0].reason) == (not want), case


def _capped_oracle(keys: list, actual: B, max_tokens: int | None, max_ratio: float | None) -> tuple | None:
    """Strategy by strategy in preference order: that strategy's least-padding key, if the documented cap allows it."""
    for rank, strategy in enumerate(STRATEGIES):
        pads = [key.padding(actual) for key, s in keys if s == strategy and key.covers(actual)]
        if pads:
            best = min(pads)
            if within_documented_cap(best.tokens, actual.num_tokens, max_tokens, max_ratio):
                return (rank, *best)
    return None


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.tuples(descriptors(), st.sampled_from(STRATEGIES)), max_size=30, unique=True),
    actual=descriptors(),
    tokens=st.one_of(st.none(), st.integers(0, 20)),
    ratio=st.one_of(st.none(), RATIOS),
)
def test_no_match_pads_more_than_the_cap(keys: list, actual: B, tokens: int | None, ratio: float | None) -> None:
    """The capped match is the first strategy (in preference order) whose least-padding key is within the
    documented cap; explain marks as over the cap exactly the covering keys the cap refuses."""
    capped = Matcher(keys, STRATEGIES, max_padding_tokens=tokens, max_padding_ratio=ratio)
    got = capped.match(actual)
    want = _capped_oracle(keys, actual, tokens, ratio)
    if got is None:
        assert want is None
    else:
        assert within_documented_cap(got.padding.tokens, actual.num_tokens, tokens, ratio), f"{got} pads more than the cap"
        assert (STRATEGIES.index(got.strategy), *got.padding) == want
    explanation = capped.explain(actual)
    assert explanation.match == got
    for c in explanation.candidates:
        refused = c.covers and not within_documented_cap(c.key.num_tokens - actual.num_tokens, actual.num_tokens, tokens, ratio)
        assert ("over the cap" in c.reason) == refused, c
    if tokens is None and ratio is None:
        assert got == Matcher(keys, STRATEGIES).match(actual), "without a cap, the matcher is the one it was"


def test_a_choice_plugin_is_offered_neither_excluded_nor_capped_keys() -> None:
    from cgregistry.hooks.manager import make_plugin_manager

    offered: list[list[tuple[B, str]]] = []

    class Widest:
        @cg.plugin.hookimpl
        def cgregistry_choose_match(self, registry: object, actual: B, candidates: list) -> object:
            offered.append([(c.key, c.strategy) for c in candidates])
            return max(candidates, key=lambda m: m.key.num_tokens)

    plugins = cg.Plugins(make_plugin_manager([Widest()], autoload=False))
    reg = cg.GraphRegistry(step, {"x": cg.StaticInput((CAP,), torch.float32)}, backend="cpu", plugins=plugins, max_padding_tokens=12)
    reg.capture([(B(k), s) for s in ("full", "breakable") for k in (8, 16, 32)])
    torch.testing.assert_close(reg.run(B(5), x=x_for(5), exclude=("full",)), eager(B(5), x_for(5)))
    assert offered == [[(B(8), "breakable"), (B(16), "breakable")]], "no full key, and not the 32-token one (pads 27 > 12)"
    assert used(reg) == {"breakable": 1} and reg.entries(used=True)[0].key == B(16)


def test_a_snapshot_keeps_the_cap_so_offline_explain_refuses_the_same_keys() -> None:
    reg = registry(max_padding_tokens=2, max_padding_ratio=0.5)
    reg.capture([(B(8), "full"), (B(16), "full")])
    snap = cg.load_snapshot(json.loads(json.dumps(reg.snapshot())))
    assert (snap.max_padding_tokens, snap.max_padding_ratio) == (2, 0.5)
    assert snap.explain(B(10)).to_dict() == reg.explain(B(10)).to_dict()
    assert "over the cap (max_padding_tokens=2, max_padding_ratio=0.5)" in str(snap.explain(B(10)))
    assert cg.load_snapshot(json.loads(json.dumps(registry().snapshot()))).max_padding_ratio is None
    data = registry().snapshot()
    with pytest.raises(cg.SnapshotError, match=r"snapshot field max_padding_ratio: expected a finite number >= 0, got -1"):
        cg.load_snapshot({**data, "max_padding_ratio": -1})
