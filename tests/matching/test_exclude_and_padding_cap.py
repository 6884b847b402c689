"""At the registry: run(exclude=...) and the padding cap, with eager as the oracle."""

from __future__ import annotations

import json
import math

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


def _capped_oracle(keys: list, actual: B, cap: cg.key.PaddingCap) -> tuple | None:
    """Strategy by strategy in preference order: that strategy's least-padding key, if the cap allows it."""
    for rank, strategy in enumerate(STRATEGIES):
        pads = [key.padding(actual) for key, s in keys if s == strategy and key.covers(actual)]
        if pads:
            best = min(pads)
            if cap.allows(best.tokens, actual.num_tokens):
                return (rank, *best)
    return None


@settings(max_examples=300, deadline=None)
@given(
    keys=st.lists(st.tuples(descriptors(), st.sampled_from(STRATEGIES)), max_size=30, unique=True),
    actual=descriptors(),
    tokens=st.one_of(st.none(), st.integers(0, 20)),
    ratio=st.one_of(st.none(), st.floats(0, 3, allow_nan=False)),
)
def test_no_match_pads_more_than_the_cap(keys: list, actual: B, tokens: int | None, ratio: float | None) -> None:
    capped = Matcher(keys, STRATEGIES, max_padding_tokens=tokens, max_padding_ratio=ratio)
    cap = capped.cap
    got = capped.match(actual)
    want = _capped_oracle(keys, actual, cap)
    if got is None:
        assert want is None
    else:
        assert cap.allows(got.padding.tokens, actual.num_tokens), f"{got} pads more than {cap.describe()}"
        assert (STRATEGIES.index(got.strategy), *got.padding) == want
    explanation = capped.explain(actual)
    assert explanation.match == got
    for c in explanation.candidates:
        if "over the cap" in c.reason:
            assert c.covers and not cap.allows(c.padding.tokens, actual.num_tokens)
    if not cap:
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
