"""Capability downgrade.  The engine (``unsupported``) or a strategy itself
(``unsupported_classes``) declares key classes a strategy cannot serve; the plan moves them to the
mode's other strategy, or leaves them eager."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor, CapturePlan, Matcher
from cgregistry.cli import main
from cgregistry.plan.fit import evaluate
from cgregistry.key.classes import declared_unsupported
from cgregistry.plan import MODES, Downgrade
from cgregistry.testing import make_plugins

B = BatchDescriptor
LEVELS = [(), ("mixed",), ("mixed", "spec_decode"), ("mixed", "spec_decode", "decode")]  # nested, like vLLM's support levels


def batch_class(d: BatchDescriptor) -> str:
    if not d.uniform:
        return "mixed"
    return "spec_decode" if d.spec_depth > 0 else "decode"


def pairs(plan: CapturePlan) -> list[tuple[BatchDescriptor, str]]:
    return [(e.descriptor, e.strategy) for e in plan]


def test_full_without_mixed_or_spec_decode_downgrades_to_piecewise() -> None:
    kw = dict(max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise", spec_depths=(0, 2))
    base = CapturePlan.build(**kw)
    plan = CapturePlan.build(**kw, unsupported={"full": ["mixed", "spec_decode"]})
    assert plan.downgrades == (Downgrade("spec_decode", "full", "piecewise"),)
    assert "spec_decode batches: full -> piecewise keys, because full cannot serve uniform spec-decode batches" in str(plan.downgrades[0])
    assert {(e.strategy, e.descriptor.spec_depth) for e in plan if e.descriptor.uniform} == {("full", 0)}
    assert {e.descriptor for e in base if e.strategy == "full" and e.descriptor.spec_depth == 0} == {
        e.descriptor for e in plan if e.strategy == "full"
    }, "plain decode keeps its full graphs"
    assert plan.uncovered() == base.uncovered(), "piecewise keys now serve the spec-decode batches"
    m = Matcher(pairs(plan))
    for r in range(1, 17):
        assert m.match(B.decode(r, 2)).strategy == "piecewise"
        assert m.match(B.decode(r)).strategy == "full"
    assert {3 * r for r in (1, 2, 4, 8, 16)} <= {e.descriptor.num_tokens for e in plan if e.strategy == "piecewise"}, (
        "the uniform widths of depth 2 join the piecewise sizes, so a verify step pads no more than before"
    )


def test_full_mode_without_mixed_keeps_full_decode_and_runs_mixed_eagerly() -> None:
    plan = CapturePlan.build(max_num_seqs=16, max_num_tokens=256, mode="full", unsupported={"full": ("mixed",)})
    assert plan.downgrades == (Downgrade("mixed", "full", None),)
    assert all(e.descriptor.uniform and e.strategy == "full" for e in plan) and len(plan) > 0
    gaps = plan.uncovered()
    assert [(g.key_class, g.min_tokens, g.max_tokens) for g in gaps] == [("mixed", 1, 256)]


def test_full_and_piecewise_with_no_full_graphs_is_the_piecewise_plan() -> None:
    kw = dict(max_num_seqs=24, max_num_tokens=512, spec_depths=(0, 1))
    plan = CapturePlan.build(**kw, mode="full_and_piecewise", unsupported={"full": LEVELS[3]})
    assert pairs(plan) == pairs(CapturePlan.build(**kw, mode="piecewise"))
    assert {(d.key_class, d.to) for d in plan.downgrades} == {("decode", "piecewise"), ("spec_decode", "piecewise")}


def test_a_class_the_mode_never_puts_on_the_strategy_changes_nothing() -> None:
    kw = dict(max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise")
    plan = CapturePlan.build(**kw, unsupported={"full": ["mixed"], "breakable": ["mixed"]})
    assert plan.downgrades == () and pairs(plan) == pairs(CapturePlan.build(**kw))


@pytest.mark.parametrize(
    ("unsupported", "message"),
    [
        ({"full": ["bogus"]}, r"unsupported\['full'\]: unknown key class 'bogus'; expected some of mixed, spec_decode, decode"),
        ({"full": ["spec_decode"]}, r"cannot serve 'spec_decode' cannot serve 'mixed' either .* add 'mixed'"),
        ({"full": ["decode", "mixed"]}, r"cannot serve 'decode' cannot serve 'spec_decode' either"),
        ({"fulll": ["mixed"]}, r"unsupported names strategy 'fulll', which is not registered"),
        (["full"], r"unsupported must map strategy names to key classes, e.g. \{'full': \('mixed',\)\}, got \['full'\]"),
        ({"full": 3}, r"unsupported\['full'\] must be key class names, got 3"),
    ],
)
def test_unsupported_is_checked(unsupported: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CapturePlan.build(max_num_seqs=4, max_num_tokens=16, unsupported=unsupported)


@settings(max_examples=60, deadline=None)
@given(
    max_num_seqs=st.integers(1, 48),
    mode=st.sampled_from([m for m in MODES if m != "none"]),
    depths=st.sampled_from([(0,), (0, 1), (0, 3), (2,)]),
    level=st.integers(0, 3),
    separate=st.booleans(),
    data=st.data(),
)
def test_no_batch_is_served_by_a_strategy_that_cannot_serve_it(
    max_num_seqs: int, mode: str, depths: tuple[int, ...], level: int, separate: bool, data: st.DataObject
) -> None:
    kw = dict(max_num_seqs=max_num_seqs, max_num_tokens=256, mode=mode, spec_depths=depths, separate_decode=separate)
    cannot = {"full": LEVELS[level]}
    base = CapturePlan.build(**kw)
    plan = CapturePlan.build(**kw, unsupported=cannot)
    if level == 0:
        assert pairs(plan) == pairs(base) and plan.downgrades == ()
    m, mb = Matcher(pairs(plan)), Matcher(pairs(base))
    eager_classes = {d.key_class for d in plan.downgrades if d.to is None}
    top = plan_top = max((e.descriptor.num_tokens for e in base), default=1)
    for _ in range(20):
        if data.draw(st.booleans()):
            depth = data.draw(st.sampled_from(depths))
            batch = B.decode(data.draw(st.integers(1, min(max_num_seqs, 256 // (1 + depth)))), depth)
        else:
            t = data.draw(st.integers(1, plan_top))
            batch = B(t, min(t, max_num_seqs))
        got = m.match(batch)
        if got is not None:
            assert batch_class(batch) not in cannot.get(got.strategy, ()), f"{batch} served by {got.strategy}"
        elif mb.match(batch) is not None:
            assert batch_class(batch) in eager_classes, f"{batch} lost its graph without a downgrade to eager saying so"
    assert top >= 1


def test_fit_respects_unsupported() -> None:
    steps = [B.decode(r, 1) for r in (1, 3, 5, 9)] + [B(t, min(t, 8)) for t in (20, 40, 60)]  # max capture size: 64
    plan = CapturePlan.fit(steps, 12, max_num_seqs=16, max_num_tokens=256, mode="full_and_piecewise", spec_depths=(0, 1),
                           unsupported={"full": ["mixed", "spec_decode"]})
    assert not any(e.strategy == "full" and e.descriptor.spec_depth > 0 for e in plan)
    m = Matcher(pairs(plan))
    assert all(m.match(s) is not None and m.match(s).strategy == "piecewise" for s in steps)


def test_cli_plan_prints_each_downgrade_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--max-num-seqs", "16", "--max-num-tokens", "256", "--spec-depths", "0,2", "--unsupported", "full:mixed,full:spec_decode",
            "--mode", "full_and_piecewise"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--unsupported      full:mixed, full:spec_decode" in out
    assert "downgraded         spec_decode batches: full -> piecewise keys, because full cannot serve uniform spec-decode batches" in out
    assert "full/uniform-d2" not in out and "piecewise/mixed" in out
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["downgrades"] == [
        {"key_class": "spec_decode", "strategy": "full", "to": "piecewise", "declared_by": "engine",
         "reason": "spec_decode batches: full -> piecewise keys, because full cannot serve uniform spec-decode batches (spec depth > 0); "
                   "declared by the engine (unsupported)"}
    ]
    assert doc["settings"]["unsupported"] == {"full": ["mixed", "spec_decode"]}


def test_cli_refuses_a_malformed_unsupported(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--unsupported", "full"])
    assert "expected STRATEGY:CLASS,... (e.g. full:mixed), got 'full'" in capsys.readouterr().err
    assert cg.plan.KEY_CLASSES.keys() == {"mixed", "spec_decode", "decode"}


# ---------------------------------------------------------------------------- strategies that declare it themselves


def vendor(name: str, relaxed: bool, classes: object = ()) -> Any:
    """A third-party strategy declaring ``classes`` unsupported: full's capture, or breakable's when ``relaxed``."""
    base = cg.plugin.BreakableStrategy if relaxed else cg.plugin.FullStrategy
    return type(f"Vendor_{name}", (base,), {"name": name, "relaxes_num_reqs": relaxed, "unsupported_classes": classes})()


class Registers:
    """A plugin that registers the strategies it is given."""

    def __init__(self, *strategies: object) -> None:
        self.strategies = strategies

    @cg.plugin.hookimpl
    def cgregistry_register_strategies(self, register):  # type: ignore[no-untyped-def]
        for s in self.strategies:
            register(s)


def test_a_plugin_strategy_declares_what_it_cannot_serve() -> None:
    plugins = make_plugins(Registers(vendor("vfull", False, {"mixed", "spec_decode"})))
    kw = dict(max_num_seqs=16, max_num_tokens=256, mode=("vfull", "piecewise"), spec_depths=(0, 2), plugins=plugins)
    plan = CapturePlan.build(**kw)
    assert plan.downgrades == (Downgrade("spec_decode", "vfull", "piecewise", "strategy"),)
    assert str(plan.downgrades[0]).endswith("; declared by strategy 'vfull' itself (unsupported_classes)")
    assert cg.PlanSettings(**kw).strategy_unsupported == {"vfull": frozenset({"mixed", "spec_decode"})}
    assert {(e.strategy, e.descriptor.spec_depth) for e in plan if e.descriptor.uniform} == {("vfull", 0)}
    m = Matcher(pairs(plan), preference=("vfull", "piecewise"))
    assert m.match(B.decode(4, 2)).strategy == "piecewise" and m.match(B.decode(4)).strategy == "vfull"
    both = CapturePlan.build(**kw, unsupported={"vfull": ["mixed", "spec_decode"]})
    assert pairs(both) == pairs(plan) and both.downgrades[0].declared_by == "both"
    assert "declared by the engine (unsupported) and strategy 'vfull' itself" in str(both.downgrades[0])


def test_built_in_strategies_declare_nothing_and_need_no_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    for strategy in make_plugins().strategies.values():
        assert declared_unsupported(strategy) == frozenset(), strategy.name
    monkeypatch.setattr(cg.hooks.manager, "make_plugin_manager", lambda *a, **k: pytest.fail("a built-in mode looked up plugins"))
    assert CapturePlan.build(max_num_seqs=8, max_num_tokens=64, mode="full_and_piecewise", spec_depths=(0, 1)).downgrades == ()


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ({"spec_decode"}, r"unsupported_classes of strategy 'bad' = \['spec_decode'\]: .* cannot serve 'mixed' either .* add 'mixed'"),
        ({"mixed", "prefill"}, r"unsupported_classes of strategy 'bad': unknown key class 'prefill'; expected some of mixed, spec_decode, decode"),
        (3, r"unsupported_classes of strategy 'bad' must be key class names, got 3"),
    ],
)
def test_a_bad_declaration_is_refused_at_registration_naming_the_plugin(classes: object, message: str) -> None:
    with pytest.raises(cg.PluginError, match=r"plugin '.*Registers' registered an invalid strategy .*: " + message):
        make_plugins(Registers(vendor("bad", False, classes)))


def test_a_bare_class_name_is_one_class() -> None:
    plugins = make_plugins(Registers(vendor("vfull", False, "mixed")))
    s = cg.PlanSettings(max_num_seqs=8, max_num_tokens=64, mode=("vfull", "vfull"), plugins=plugins)
    assert s.strategy_unsupported == {"vfull": frozenset({"mixed"})}
    assert s.downgrades == (Downgrade("mixed", "vfull", None, "strategy"),)


def test_downgrade_declared_by_is_checked() -> None:
    with pytest.raises(ValueError, match="Downgrade.declared_by must be one of engine, strategy, both, got 'user'"):
        Downgrade("mixed", "full", None, "user")


@settings(max_examples=80, deadline=None)
@given(
    max_num_seqs=st.integers(1, 40),
    shape=st.sampled_from(["pair", "same", "decode_only", "mixed_only"]),
    depths=st.sampled_from([(0,), (0, 1), (0, 3), (2,)]),
    own=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    engine=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    separate=st.booleans(),
)
def test_a_strategys_declaration_counts_as_the_engines(
    max_num_seqs: int, shape: str, depths: tuple[int, ...], own: tuple[int, int], engine: tuple[int, int], separate: bool
) -> None:
    """Oracle: the same strategies declaring nothing, with the engine declaring both sets, give the same plan."""
    declaring = make_plugins(Registers(vendor("vfull", False, LEVELS[own[0]]), vendor("vpw", True, LEVELS[own[1]])))
    silent = make_plugins(Registers(vendor("vfull", False), vendor("vpw", True)))
    mode = {"pair": ("vfull", "vpw"), "same": ("vfull", "vfull"), "decode_only": ("vfull", None), "mixed_only": (None, "vpw")}[shape]
    told = {"vfull": LEVELS[engine[0]], "vpw": LEVELS[engine[1]]}
    merged = {"vfull": {*told["vfull"], *LEVELS[own[0]]}, "vpw": {*told["vpw"], *LEVELS[own[1]]}}
    kw = dict(max_num_seqs=max_num_seqs, max_num_tokens=256, mode=mode, spec_depths=depths, separate_decode=separate)
    plan = CapturePlan.build(**kw, plugins=declaring, unsupported=told)
    oracle = CapturePlan.build(**kw, plugins=silent, unsupported=merged)
    assert pairs(plan) == pairs(oracle)
    assert [(d.key_class, d.strategy, d.to) for d in plan.downgrades] == [(d.key_class, d.strategy, d.to) for d in oracle.downgrades]
    mine = dict(zip(("vfull", "vpw"), (LEVELS[own[0]], LEVELS[own[1]])))
    for d in plan.downgrades:
        by_engine, by_strategy = d.key_class in told[d.strategy], d.key_class in mine[d.strategy]
        assert d.declared_by == {(True, True): "both", (True, False): "engine", (False, True): "strategy"}[(by_engine, by_strategy)]
    for e in plan:
        assert batch_class(e.descriptor) not in merged[e.strategy], f"{e.descriptor} planned on {e.strategy}"


def test_cli_plan_says_a_strategy_declared_it(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    plugin = Registers(vendor("vfull", False, {"mixed", "spec_decode"}))
    real = cg.plugin.make_plugin_manager
    monkeypatch.setattr(cg.hooks.manager, "make_plugin_manager", lambda *a, **k: real([plugin], autoload=False))  # what Plugins() finds
    args = ["plan", "--max-num-seqs", "16", "--max-num-tokens", "256", "--spec-depths", "0,2", "--mode", "vfull,piecewise"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "strategy-declared  vfull:mixed, vfull:spec_decode (the strategies' own unsupported_classes)" in out
    assert ("downgraded         spec_decode batches: vfull -> piecewise keys, because vfull cannot serve uniform spec-decode "
            "batches (spec depth > 0); declared by strategy 'vfull' itself (unsupported_classes)") in out
    assert main([*args, "--unsupported", "vfull:mixed", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["strategy_unsupported"] == {"vfull": ["mixed", "spec_decode"]}
    assert doc["settings"]["unsupported"] == {"vfull": ["mixed"]}
    assert [(d["key_class"], d["declared_by"]) for d in doc["settings"]["downgrades"]] == [("spec_decode", "strategy")]


# ---------------------------------------------------------------------------- fit under downgrades


@settings(max_examples=60, deadline=None)
@given(
    max_num_seqs=st.integers(1, 40),
    max_num_tokens=st.sampled_from([32, 64, 256]),
    mode=st.sampled_from([m for m in MODES if m != "none"]),
    depths=st.sampled_from([(0,), (0, 1), (0, 3), (2,)]),
    levels=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    separate=st.booleans(),
    size_multiple=st.sampled_from([1, 1, 2]),
    data=st.data(),
)
def test_fit_splits_classes_as_build_does_and_pads_no_more_at_its_graph_count(
    max_num_seqs: int, max_num_tokens: int, mode: str, depths: tuple[int, ...], levels: tuple[int, int], separate: bool,
    size_multiple: int, data: st.DataObject,
) -> None:
    others = {"piecewise", "breakable"} & set(MODES[mode])
    cannot = {"full": LEVELS[levels[0]], **{name: LEVELS[levels[1]] for name in others}}
    kw = dict(max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens, mode=mode, spec_depths=depths,
              separate_decode=separate, size_multiple=size_multiple, unsupported=cannot)
    try:
        s = cg.PlanSettings(**kw)
    except ValueError as exc:
        assert "size_multiple" in str(exc)
        return
    built = CapturePlan.build(s)
    if not len(built):
        return
    steps = []
    for _ in range(data.draw(st.integers(1, 30))):
        if data.draw(st.booleans()):
            depth = data.draw(st.sampled_from(depths))
            steps.append(B.decode(data.draw(st.integers(1, s.widest[depth])), depth))
        else:
            t = data.draw(st.integers(1, max_num_tokens))
            steps.append(B(t, data.draw(st.integers(1, min(t, max_num_seqs)))))
    fitted = CapturePlan.fit(steps, len(built), s)
    assert len(fitted) <= len(built)
    for e in fitted:
        assert batch_class(e.descriptor) not in cannot.get(e.strategy, ()), f"fit put {e.descriptor} on {e.strategy}"
    assert {(batch_class(e.descriptor), e.strategy) for e in fitted} == {(batch_class(e.descriptor), e.strategy) for e in built}
    assert fitted.downgrades == built.downgrades
    rb, rf = evaluate(built, steps), evaluate(fitted, steps)
    assert rf.graph_steps == rb.graph_steps, "the fitted plan serves every step the built one does, no more"
    if not (separate and s.decode_strategy == s.mixed_strategy):  # there the fitted padding is an upper bound (documented)
        assert rf.padded_tokens <= rb.padded_tokens


def downgraded_plans(budget: int) -> Iterator[CapturePlan]:
    """Every full_and_piecewise plan (4 sequences, 8 tokens, spec depths 0 and 1) with full unable to serve
    mixed or spec-decode batches, within ``budget`` graphs, that keeps the covering keys (4 requests, 8 tokens)."""
    for nd in range(budget - 1):
        for decode in itertools.combinations(range(1, 4), nd):
            for nm in range(budget - 1 - nd):
                for mixed in itertools.combinations(range(1, 8), nm):
                    yield CapturePlan.of([(B.decode(r), "full") for r in (*decode, 4)] + [(B(t), "piecewise") for t in (*mixed, 8)])


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.builds(B.decode, st.integers(1, 4), st.sampled_from([0, 1])),
            st.integers(1, 8).flatmap(lambda t: st.builds(B, st.just(t), st.integers(1, min(t, 4)))),
        ),
        min_size=1, max_size=12,
    ),
    budget=st.integers(2, 5),
)
def test_fit_under_a_downgrade_is_optimal_against_exhaustive_search(steps: list[BatchDescriptor], budget: int) -> None:
    fitted = CapturePlan.fit(steps, budget, max_num_seqs=4, max_num_tokens=8, mode="full_and_piecewise", spec_depths=(0, 1),
                             max_capture_size=8, unsupported={"full": ["mixed", "spec_decode"]})
    assert len(fitted) <= budget
    assert all(e.strategy == "piecewise" or (e.descriptor.uniform and e.descriptor.spec_depth == 0) for e in fitted)
    best = min(evaluate(p, steps).padded_tokens for p in downgraded_plans(budget))
    report = evaluate(fitted, steps)
    assert report.padded_tokens == best and report.eager_steps == 0


def test_fit_takes_a_strategys_own_declaration_as_the_engines() -> None:
    steps = [B.decode(r, 1) for r in (1, 3, 5, 9)] + [B.decode(r) for r in (2, 7)] + [B(t, min(t, 8)) for t in (20, 40, 60)]
    kw = dict(max_num_seqs=16, max_num_tokens=256, mode=("vfull", "vpw"), spec_depths=(0, 1))
    declaring = make_plugins(Registers(vendor("vfull", False, {"mixed", "spec_decode"}), vendor("vpw", True)))
    silent = make_plugins(Registers(vendor("vfull", False), vendor("vpw", True)))
    own = CapturePlan.fit(steps, 12, **kw, plugins=declaring)
    told = CapturePlan.fit(steps, 12, **kw, plugins=silent, unsupported={"vfull": ["mixed", "spec_decode"]})
    assert pairs(own) == pairs(told) and not any(e.strategy == "vfull" and e.descriptor.spec_depth > 0 for e in own)
    assert [d.declared_by for d in own.downgrades] == ["strategy"]
