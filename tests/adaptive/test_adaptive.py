"""The adaptation policy: refits on observed traffic reach the offline fit's padding, follow shifts, hold still on noise."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import attrs
import pluggy
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.plan.adapt import (
    REASONS,
    Adaptation,
    PlanChange,
    PlanScore,
    TrafficHistogram,
    propose,
    refit,
    replay,
)
from cgregistry.plan.fit import PlanReport, evaluate
from cgregistry.hooks.events import notify
from cgregistry.testing import make_plugins
from cgregistry.plan.workload import SchedulerConfig, read_trace, schedule

Pair = tuple[B, str]
ENGINE = {"max_num_seqs": 256, "max_num_tokens": 8192}
CONFIG = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)


def pairs(plan: Iterable[cg.plan.PlanEntry]) -> list[Pair]:
    return [(e.descriptor, e.strategy) for e in plan]


def applied(current: Sequence[Pair], change: PlanChange) -> list[Pair]:
    """The keys a registry holds after making ``change``."""
    gone = set(change.removed)
    return [p for p in current if p not in gone] + list(change.added)


def covering(settings: cg.PlanSettings) -> set[Pair]:
    """The keys every fitted plan keeps: fitted to no traffic, a plan holds nothing else."""
    return set(pairs(cg.CapturePlan.fit({}, 10**6, settings)))


@pytest.fixture(scope="module")
def steps() -> list[B]:
    """Every step of the bundled trace, in order."""
    return list(schedule(read_trace(), CONFIG))


@pytest.fixture(scope="module")
def trace(steps: list[B]) -> Counter[B]:
    """The bundled trace as one harvest."""
    return Counter(steps)


@pytest.fixture(scope="module")
def offline(steps: list[B]) -> PlanReport:
    """The plan fitted offline to the trace's steps (the expanded list) at the default plan's size, judged on them."""
    return evaluate(cg.CapturePlan.fit(steps, len(cg.CapturePlan.build(**ENGINE)), **ENGINE), steps)


# ---------------------------------------------------------------- adapting against an offline fit


@pytest.mark.parametrize("start", ["empty", "default"])
def test_a_refit_on_the_trace_pads_as_little_as_the_offline_fit(trace: Counter[B], offline: PlanReport, start: str) -> None:
    default = cg.CapturePlan.build(**ENGINE)
    budget = len(default)
    current = [] if start == "empty" else pairs(default)
    adaptation = Adaptation(max_graphs=budget, settings=ENGINE)
    change = propose(TrafficHistogram(trace), current, adaptation)
    assert change is not None
    assert change.reason == ("coverage" if start == "empty" else "padding")
    new = applied(current, change)
    assert len(new) <= budget
    adapted = evaluate(cg.CapturePlan.of(new), trace)
    assert adapted.padding_ratio <= 1.5 * offline.padding_ratio  # measured 1.0x: the same exact fit
    assert adapted.padded_tokens == offline.padded_tokens == change.after.padded_tokens
    assert adapted.graph_steps == offline.graph_steps == change.after.graph_steps
    if start == "default":
        assert change.before == PlanScore.of(evaluate(default, trace))
        assert change.gain > 0.9, "the default ladder pads the trace ~60x more than a fitted plan"


def test_adapting_online_through_the_trace_ends_within_the_target(steps: list[B]) -> None:
    """Harvests of 1000 steps, a refit when due with the default knobs (every 10000 steps, decay 0.9, min_gain 0.1):
    after the first 120000 steps of the trace the plan pads them within 1.5x of the plan fitted offline to them."""
    steps = steps[:120_000]
    default = cg.CapturePlan.build(**ENGINE)
    adaptation = Adaptation(max_graphs=len(default), settings=ENGINE)
    keep = covering(adaptation.settings)
    histogram, current, changes = TrafficHistogram(), pairs(default), []
    for i in range(0, len(steps), 1000):
        histogram.add(Counter(steps[i:i + 1000]))
        change = refit(histogram, current, adaptation)
        if change is not None:
            assert change.after.graph_steps >= change.before.graph_steps
            assert not keep & set(change.removed)
            current = applied(current, change)
            assert len(current) <= adaptation.max_graphs
            changes.append(change)
    assert histogram.observed == len(steps)
    assert 1 <= len(changes) < 12, [str(c) for c in changes]  # 12 refits; min_gain skips some
    offline = evaluate(cg.CapturePlan.fit(steps, len(default), **ENGINE), steps)
    adapted = evaluate(cg.CapturePlan.of(current), steps)
    assert adapted.graph_steps == offline.graph_steps
    assert adapted.padding_ratio <= 1.5 * offline.padding_ratio


def adapt_through(phases: Sequence[list[B]], adaptation: Adaptation) -> tuple[list[list[Pair]], list[PlanChange]]:
    """Harvests of 1000 steps through each phase in turn, from no keys, a refit whenever due: the keys after each phase."""
    histogram, current, after, changes = TrafficHistogram(), [], [], []
    for phase in phases:
        for i in range(0, len(phase), 1000):
            histogram.add(Counter(phase[i:i + 1000]))
            change = refit(histogram, current, adaptation)
            if change is not None:
                current = applied(current, change)
                changes.append(change)
        after.append(current)
    return after, changes


def test_a_shift_in_traffic_moves_the_plan_once_old_counts_decay() -> None:
    requests = read_trace()
    before = list(schedule(requests[:3000], CONFIG))
    # Then a smaller engine: at most 16 running, 512-token budget.
    after = list(schedule(requests[3000:6000], SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512)))
    offline = evaluate(cg.CapturePlan.fit(after, 30, **ENGINE), after).padded_tokens
    fading = Adaptation(max_graphs=30, settings=ENGINE, every_steps=5000, min_steps=5000, decay=0.5)
    (start, moved), changes = adapt_through([before, after], fading)
    assert changes[0].reason == "coverage" and len(start) == 30
    assert evaluate(cg.CapturePlan.of(start), after).padded_tokens > 2 * offline, "the first traffic's plan serves the new traffic badly"
    assert any(c.observed > len(before) for c in changes), "the plan moved after the shift"
    assert evaluate(cg.CapturePlan.of(moved), after).padded_tokens <= 1.5 * offline
    (_, held), _ = adapt_through([before, after], attrs.evolve(fading, decay=1.0))
    assert evaluate(cg.CapturePlan.of(held), after).padded_tokens > 1.5 * offline, "without decay the old traffic holds the plan back"


def test_min_gain_holds_a_plan_that_already_serves_the_traffic(steps: list[B]) -> None:
    half = len(steps) // 2
    first, second = Counter(steps[:half]), Counter(steps[half:])  # the same traffic, two samples of it
    current = pairs(cg.CapturePlan.fit(first, 40, **ENGINE))
    eager = propose(second, current, Adaptation(max_graphs=40, settings=ENGINE, min_gain=0.0))
    assert eager is not None and eager.reason == "padding" and 0 < eager.gain < 0.5  # a refit always looks better on its own sample
    assert propose(second, current, Adaptation(max_graphs=40, settings=ENGINE, min_gain=0.5)) is None
    assert propose(first, current, Adaptation(max_graphs=40, settings=ENGINE, min_gain=0.0)) is None, "the same fit: nothing to change"


def test_never_a_plan_that_serves_fewer_steps_from_graphs() -> None:
    """The fitter can propose one: the current keys reach 64 tokens, the settings' max capture size is 16."""
    wide = pairs(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=64, max_capture_size=64))
    steps = Counter({B(40, 4): 5, B(3, 2): 500, B(5, 3): 500, B.decode(3): 300})
    adaptation = Adaptation(max_graphs=4, settings={"max_num_seqs": 8, "max_num_tokens": 64})
    fitted = evaluate(cg.CapturePlan.fit(steps, 4, adaptation.settings), steps)
    held = evaluate(cg.CapturePlan.of(wide), steps)
    assert fitted.graph_steps < held.graph_steps and fitted.padded_tokens < held.padded_tokens, "the fit loses the 40-token steps"
    assert len(wide) > adaptation.max_graphs
    assert propose(steps, wide, adaptation) is None, "not even to get within max_graphs"
    narrow = [p for p in wide if p[0].num_tokens <= 16]
    change = propose(steps, narrow, adaptation)  # the 40-token steps run eagerly under both: the budget cut goes ahead
    assert change is not None and change.reason == "budget" and len(applied(narrow, change)) <= 4


# ---------------------------------------------------------------- the rule, for random settings and traffic

MODES = ["full_and_piecewise", "full", "piecewise", "full_decode_only", "full_and_breakable"]


@st.composite
def engines(draw: st.DrawFn) -> dict:
    seqs = draw(st.integers(1, 10))
    out = {
        "max_num_seqs": seqs, "max_num_tokens": draw(st.integers(seqs * 3, 80)), "mode": draw(st.sampled_from(MODES)),
        "spec_depths": tuple(draw(st.sets(st.integers(0, 2), min_size=1))), "separate_decode": draw(st.booleans()),
    }
    if draw(st.booleans()):
        out["max_loras"] = draw(st.integers(1, 2))
    return out


def shapes(engine: dict) -> st.SearchStrategy[B]:
    seqs, tokens, loras = engine["max_num_seqs"], engine["max_num_tokens"], engine.get("max_loras", 0)
    uniform = st.builds(B.decode, st.integers(1, seqs), st.sampled_from(engine["spec_depths"]), st.integers(0, loras))
    mixed = st.integers(1, tokens).flatmap(lambda t: st.builds(B, st.just(t), st.integers(1, min(t, seqs)), st.integers(0, loras)))
    return st.one_of(uniform, mixed)


@settings(max_examples=200, deadline=None)
@given(engine=engines(), data=st.data(), min_gain=st.sampled_from([0.0, 0.05, 0.3, 0.9]))
def test_a_proposal_is_the_fit_and_keeps_what_it_must(engine: dict, data: st.DataObject, min_gain: float) -> None:
    least = len(covering(cg.PlanSettings(**engine)))  # one graph per key family and LoRA count
    budget = data.draw(st.integers(least, least + 12))
    adaptation = Adaptation(max_graphs=budget, settings=engine, min_gain=min_gain)
    steps = Counter(data.draw(st.dictionaries(shapes(engine), st.integers(1, 50), max_size=12)))
    others = pairs(cg.CapturePlan.build(**{**engine, "max_capture_size": engine["max_num_tokens"]}))  # some beyond the settings
    pool = list(dict.fromkeys(pairs(cg.CapturePlan.build(**engine)) + pairs(cg.CapturePlan.fit(steps, budget, adaptation.settings)) + others))
    current = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=30))
    change = propose(steps, current, adaptation)
    event(f"reason: {change.reason if change else None}")
    fitted = pairs(cg.CapturePlan.fit(steps, budget, adaptation.settings))
    before, after = evaluate(cg.CapturePlan.of(current), steps), evaluate(cg.CapturePlan.of(fitted), steps)
    saves = after.padded_tokens < before.padded_tokens and before.padded_tokens - after.padded_tokens >= min_gain * before.padded_tokens
    worth = len(current) > budget or after.graph_steps > before.graph_steps or saves
    if not steps or set(fitted) == set(current) or after.graph_steps < before.graph_steps or not worth:
        assert change is None
        return
    assert change is not None
    new = applied(current, change)
    assert sorted(new, key=repr) == sorted(fitted, key=repr) and len(new) <= budget
    assert set(change.removed) <= set(current) and not set(change.added) & set(current)
    assert change.added == tuple(p for p in fitted if p not in set(current)), "largest first, the plan's capture order"
    keep = covering(adaptation.settings)
    assert keep <= set(new) and not keep & set(change.removed)
    assert (change.before, change.after) == (PlanScore.of(before), PlanScore.of(after))
    assert change.after.graph_steps >= change.before.graph_steps
    assert change.reason == ("budget" if len(current) > budget else "coverage" if after.graph_steps > before.graph_steps else "padding")
    assert change.observed == sum(steps.values())


def test_the_padding_cap_is_scored_as_the_registry_serves() -> None:
    steps = Counter({B(9, 3): 10})
    current = [(B(16), "piecewise")]
    adaptation = Adaptation(max_graphs=3, settings={"max_num_seqs": 8, "max_num_tokens": 64, "mode": "piecewise"}, min_gain=0.0)
    capped = propose(steps, current, adaptation, max_padding_ratio=0.5)  # 7 padding tokens on 9 is over the cap: eager
    assert capped is not None and capped.reason == "coverage" and capped.before.graph_steps == 0
    uncapped = propose(steps, current, adaptation)
    assert uncapped is not None and uncapped.reason == "padding" and uncapped.before.graph_steps == 10


# ---------------------------------------------------------------- the histogram and the loop


def test_the_histogram_counts_decays_and_forgets_what_fades() -> None:
    h = TrafficHistogram()
    h.add({B(5, 2): 10, B(7, 3): 1})
    h.add([B(5, 2), B.decode(4)])
    assert dict(h) == {B(5, 2): 11.0, B(7, 3): 1.0, B.decode(4): 1.0} and h[B(5, 2)] == 11.0 and len(h) == 3
    assert (h.total, h.observed, h.fresh) == (13.0, 13, 13)
    h.decay(0.3)  # 11 -> 3.3; 1 -> 0.3, under half a step: forgotten
    assert dict(h) == {B(5, 2): pytest.approx(3.3)} and B(7, 3) not in h
    assert (h.observed, h.fresh) == (13, 0)
    h.add({B(5, 2): 0, B(3, 1): 2})
    assert h.steps() == {B(5, 2): 3, B(3, 1): 2}
    h.decay(1)
    assert h.steps() == {B(5, 2): 3, B(3, 1): 2}, "decay 1 keeps every count"
    h.decay(0.5)
    assert h.steps() == {B(5, 2): 2, B(3, 1): 1}, "1.65 and 1.0 rounded half up"
    with pytest.raises(ValueError, match=r"decay factor must be a number in \(0, 1\], got 0"):
        h.decay(0)
    with pytest.raises(ValueError, match=r"TrafficHistogram.add\(\): a workload mapping holds step counts \(ints >= 0\); Batch\(tokens=5, reqs=2\) has 1.5"):
        h.add({B(5, 2): 1.5})  # type: ignore[dict-item]
    assert "2 shapes" in repr(h)


def test_refit_waits_for_min_steps_and_every_steps_and_decays_each_time() -> None:
    adaptation = Adaptation(max_graphs=6, settings={"max_num_seqs": 8, "max_num_tokens": 64}, every_steps=10, min_steps=25, decay=0.5)
    h, current = TrafficHistogram(), []
    seen = []
    for _ in range(5):
        h.add({B(5, 2): 6, B.decode(3): 6})
        change = refit(h, current, adaptation)
        seen.append((h.observed, change is not None, h.fresh))
        if change is not None:
            current = applied(current, change)
    # 12, 24: not yet min_steps; 36: a refit (coverage); 48: due again, nothing to change; 60: due again
    assert seen == [(12, False, 12), (24, False, 24), (36, True, 0), (48, False, 0), (60, False, 0)]
    assert h.total == pytest.approx(((36 * 0.5 + 12) * 0.5 + 12) * 0.5)


def test_a_million_step_histogram_is_not_expanded() -> None:
    small = Counter({B(5, 2): 3, B(9, 4): 1, B.decode(3): 7, B(30, 8): 2})
    huge = TrafficHistogram({s: n * 10**12 for s, n in small.items()})  # expanded, it would never finish
    adaptation = Adaptation(max_graphs=5, settings={"max_num_seqs": 8, "max_num_tokens": 64})
    change, reference = propose(huge, [], adaptation), propose(small, [], adaptation)
    assert change is not None and reference is not None
    assert change.added == reference.added and change.observed == 13 * 10**12


# ---------------------------------------------------------------- values, records, the hook


@pytest.mark.parametrize("field, value, message", [
    ("max_graphs", 0, r"Adaptation.max_graphs must be an int >= 1, got 0"),
    ("max_graphs", 4.0, r"Adaptation.max_graphs must be an int >= 1, got 4.0"),
    ("max_graphs", 1, r"Adaptation: max_graphs=1 cannot hold one graph per key family \(2 families"),
    ("every_steps", 0, r"Adaptation.every_steps must be an int >= 1, got 0"),
    ("min_steps", -1, r"Adaptation.min_steps must be an int >= 0, got -1"),
    ("min_steps", True, r"Adaptation.min_steps must be an int >= 0, got True"),
    ("decay", 0, r"Adaptation.decay must be a number in \(0, 1\], got 0"),
    ("decay", 1.5, r"Adaptation.decay must be a number in \(0, 1\], got 1.5"),
    ("decay", math.nan, r"Adaptation.decay must be a number in \(0, 1\], got nan"),
    ("decay", "0.5", r"Adaptation.decay must be a number in \(0, 1\], got '0.5'"),
    ("min_gain", 1, r"Adaptation.min_gain must be a number in \[0, 1\), got 1"),
    ("min_gain", -0.1, r"Adaptation.min_gain must be a number in \[0, 1\), got -0.1"),
    ("settings", "full", r"Adaptation.settings must be a PlanSettings or a mapping of its fields .* got 'full'"),
    ("settings", {"max_num_seqs": 0, "max_num_tokens": 64}, r"max_num_seqs must be a positive int, got 0"),
])
def test_bad_values_name_themselves(field: str, value: object, message: str) -> None:
    fields = {"max_graphs": 8, "settings": {"max_num_seqs": 8, "max_num_tokens": 64}, field: value}
    with pytest.raises(ValueError, match=message):
        Adaptation(**fields)  # type: ignore[arg-type]


def test_bad_current_keys_name_themselves() -> None:
    adaptation = Adaptation(max_graphs=4, settings={"max_num_seqs": 8, "max_num_tokens": 64})
    with pytest.raises(TypeError, match=r"current\[1\] is \(Batch\(tokens=8, reqs=any\),\)"):
        propose({B(3, 1): 1}, [(B(8), "full"), (B(8),)], adaptation)  # type: ignore[list-item]


def spec_lora_change() -> PlanChange:
    engine = {"max_num_seqs": 8, "max_num_tokens": 64, "spec_depths": (0, 2), "max_loras": 2}
    # 5 verify requests: a width the default plan has no uniform key of (it has 1, 2, 3, 4, 6 and 8), so the refit adds one.
    change = propose({B.decode(5, 2, 1): 40, B(11, 4): 9, B.decode(2): 5}, pairs(cg.CapturePlan.build(**engine)),
                     Adaptation(max_graphs=18, settings=engine))
    assert change is not None
    return change


def test_a_change_round_trips_through_json() -> None:
    change = spec_lora_change()
    assert any(k.uniform and k.spec_depth for k, _ in change.added) and any(k.num_reqs is None for k, _ in change.removed)
    data = json.loads(json.dumps(change.to_dict()))
    assert data == change.to_dict()
    assert PlanChange.from_dict(data) == change
    assert data["reason"] in REASONS and data["gain"] == change.gain
    assert str(change).startswith(f"plan change ({change.reason}: ") and f"+{len(change.added)} -{len(change.removed)} keys" in str(change)


def test_the_plan_changed_hook_takes_the_registry_and_the_change() -> None:
    seen = []

    class Watcher:
        @cg.plugin.hookimpl
        def cgregistry_plan_changed(self, registry, change):  # type: ignore[no-untyped-def]
            seen.append((registry, change.to_dict()))

    class Misspelt:
        @cg.plugin.hookimpl
        def cgregistry_plan_changed(self, registry, changes):  # type: ignore[no-untyped-def]
            pass

    change = spec_lora_change()
    plugins = make_plugins(Watcher())
    notify(plugins.pm, "cgregistry_plan_changed", registry="reg", change=change)
    assert seen == [("reg", change.to_dict())]
    with pytest.raises(pluggy.PluginValidationError, match="changes"):
        make_plugins(Misspelt())


# ---------------------------------------------------------------- replay: the loop over recorded steps


def test_replay_without_a_due_refit_scores_each_window_with_the_start_keys(steps: list[B]) -> None:
    steps = steps[:2500]
    start = pairs(cg.CapturePlan.build(**ENGINE))
    never = Adaptation(max_graphs=len(start), settings=ENGINE, min_steps=10**9)
    result = replay(steps, never, start, harvest=300, window=1000)  # harvests straddle windows
    assert result.changes == () and list(result.keys) == start and result.window == 1000
    expected = [PlanScore.of(evaluate(cg.CapturePlan.of(start), steps[i:i + 1000])) for i in (0, 1000, 2000)]
    assert list(result.windows) == expected  # the last window holds the 500 steps left
    assert sum(w.steps for w in result.windows) == len(steps)


def test_replay_makes_the_changes_of_the_refit_loop(steps: list[B]) -> None:
    steps = steps[:6000]
    adaptation = Adaptation(max_graphs=12, settings=ENGINE, every_steps=1000, min_steps=1000, decay=0.5)
    (held,), changes = adapt_through([steps], adaptation)  # harvests of 1000 steps, as here
    result = replay(steps, adaptation, harvest=1000, window=1000)
    assert list(result.changes) == changes and list(result.keys) == held
    assert result.windows[0].graphs == 0 and result.windows[0].graph_steps == 0, "no keys before the first refit"
    # the keys of a change serve from the next harvest on: window i is served by the keys after change i - 1
    for i in range(1, len(result.windows)):
        keys = adapt_through([steps[: i * 1000]], adaptation)[0][0]
        assert result.windows[i] == PlanScore.of(evaluate(cg.CapturePlan.of(keys), steps[i * 1000:(i + 1) * 1000]))


def test_replay_shows_the_warm_up_lag_and_waiting_it_out(steps: list[B]) -> None:
    """docs/adaptive.md: refits during the warm-up pad larger batches up to the covering keys; min_steps past it avoids that."""
    warmup = steps[:10_000]
    default = pairs(cg.CapturePlan.build(**ENGINE))
    early = replay(warmup, Adaptation(max_graphs=8, settings=ENGINE, every_steps=500, min_steps=500), default, window=500)
    waited = replay(warmup, Adaptation(max_graphs=8, settings=ENGINE, every_steps=500, min_steps=5000), default, window=500)
    ladder = [PlanScore.of(evaluate(cg.CapturePlan.of(default), warmup[i:i + 500])) for i in range(0, 5000, 500)]
    assert list(waited.windows[:10]) == ladder, "until min_steps the registry serves from the keys it captured"
    assert max(early.padding_per_real_token()[1:9]) > 8 > 0.35 > max(waited.padding_per_real_token())


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"harvest": 0}, "replay() harvest must be an int >= 1 (steps), got 0"),
    ({"window": 2.5}, "replay() window must be an int >= 1 (steps), got 2.5"),
])
def test_replay_names_a_bad_argument(kwargs: dict, message: str) -> None:
    adaptation = Adaptation(max_graphs=4, settings={"max_num_seqs": 8, "max_num_tokens": 64})
    with pytest.raises(ValueError, match=re.escape(message)):
        replay([B(3, 2)], adaptation, **kwargs)
    with pytest.raises(TypeError, match=r"replay\(\) takes BatchDescriptors; steps\[1\] is 'x'"):
        replay([B(3, 2), "x"], adaptation)
