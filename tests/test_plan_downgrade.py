"""Issue 16, item 7: capability downgrade.  A strategy declares key classes it cannot serve
(``unsupported``); the plan moves them to the mode's other strategy, or leaves them eager."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor, CapturePlan, Matcher
from cgregistry.cli import main
from cgregistry.plan import MODES, Downgrade

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
    assert [(g.kind, g.min_tokens, g.max_tokens) for g in gaps] == [("mixed", 1, 256)]


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
    args = ["plan", "--max-num-seqs", "16", "--max-num-tokens", "256", "--spec-depths", "0,2", "--unsupported", "full:mixed,full:spec_decode"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "--unsupported      full:mixed, full:spec_decode" in out
    assert "downgraded         spec_decode batches: full -> piecewise keys, because full cannot serve uniform spec-decode batches" in out
    assert "full/uniform-d2" not in out and "piecewise/mixed" in out
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["settings"]["downgrades"] == [
        {"key_class": "spec_decode", "strategy": "full", "to": "piecewise",
         "reason": "spec_decode batches: full -> piecewise keys, because full cannot serve uniform spec-decode batches (spec depth > 0)"}
    ]
    assert doc["settings"]["unsupported"] == {"full": ["mixed", "spec_decode"]}


def test_cli_refuses_a_malformed_unsupported(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--unsupported", "full"])
    assert "expected STRATEGY:CLASS,... (e.g. full:mixed), got 'full'" in capsys.readouterr().err
    assert cg.plan.KEY_CLASSES.keys() == {"mixed", "spec_decode", "decode"}
