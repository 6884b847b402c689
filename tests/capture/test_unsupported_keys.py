"""At the registry: a plan that gives a strategy a key of a class the strategy declares
it cannot serve (its ``unsupported_classes``) is refused before anything is captured or planned."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry import CapturePlan
from cgregistry.key.classes import class_of
from cgregistry.testing import make_plugins
from tests.plans.test_downgrade import LEVELS, Registers, vendor

CAP = 32


class Observer:
    """Counts capture_started calls: a refused plan must start none."""

    def __init__(self) -> None:
        self.started = 0

    @cg.plugin.hookimpl
    def cgregistry_capture_started(self, registry: Any, key: B, strategy: str) -> None:
        self.started += 1


PAYLOADS: list[object] = []  # what each capture of a registry() step saw as the capture context's payload


def step(batch: B, x: torch.Tensor) -> torch.Tensor:
    ctx = cg.current_batch()
    if ctx is not None and ctx.key is not None:
        PAYLOADS.append(ctx.payload)
    return x * 2 + 1


def registry(*strategies: object, observer: Observer | None = None) -> cg.GraphRegistry:
    plugins = make_plugins(Registers(*strategies), *([observer] if observer else []))
    return cg.GraphRegistry(step, {"x": cg.StaticInput((CAP,), torch.float32)}, backend="cpu",
                            plugins=plugins, preference=("vfull", "full", "vpw"))


def state(reg: cg.GraphRegistry) -> tuple[Any, ...]:
    """What a refused capture must leave as it was."""
    return ({(e.key, e.strategy) for e in reg.entries()}, reg.pending(), reg.stats())


@pytest.mark.parametrize("lazy", [False, True])
def test_a_hand_made_plan_with_an_unsupported_key_is_refused_before_any_capture(lazy: bool) -> None:
    observer = Observer()
    reg = registry(vendor("vfull", False, {"mixed"}), observer=observer)
    reg.capture([(B.decode(2), "vfull")], context="first")
    before = state(reg)
    started = observer.started
    # plan order is largest first: the decode key that vfull serves comes before the mixed key it cannot
    plan = CapturePlan.of([(B.decode(8), "vfull"), (B(4, 4), "vfull")])
    with pytest.raises(ValueError, match=(
        r"plan entry Batch\(tokens=4, reqs=4\) \[vfull\] is a mixed key, but strategy 'vfull' cannot serve mixed batches "
        r"\(prefill, chunked prefill, decode mixed with prefill\) \(its unsupported_classes: mixed\); give the key to a "
        r"strategy that serves it, or drop it"
    )):
        reg.capture(plan, lazy=lazy, context="second")
    assert state(reg) == before and observer.started == started, "nothing captured, planned or changed"
    PAYLOADS.clear()
    reg.capture([(B.decode(8), "vfull")], lazy=lazy)  # the servable part alone is fine
    assert B.decode(8) in {k for k, _ in reg.pending()} | {e.key for e in reg.entries()}
    reg.run(B.decode(7), x=torch.ones(7))  # captures it now if it was planned lazily
    assert PAYLOADS and set(PAYLOADS) == {"first"}, "the refused capture() left the capture context's payload as it was"


def test_pairs_and_spec_decode_keys_are_checked_too() -> None:
    reg = registry(vendor("vfull", False, {"mixed", "spec_decode"}), vendor("vpw", True))
    with pytest.raises(ValueError, match=r"Batch\(tokens=6, reqs=3, spec=1, uniform\) \[vfull\] is a spec_decode key"):
        reg.capture([(B.decode(4), "vfull"), (B.decode(3, 1), "vfull")])
    assert len(reg) == 0
    reg.capture([(B.decode(4), "vfull"), (B(8), "vpw"), (B.decode(3, 1), "vpw")])
    assert len(reg) == 3


def test_a_plan_built_with_the_same_plugins_is_never_refused() -> None:
    strategies = (vendor("vfull", False, {"mixed", "spec_decode"}), vendor("vpw", True))
    reg = registry(*strategies)
    plan = CapturePlan.build(max_num_seqs=4, max_num_tokens=CAP, mode=("vfull", "vpw"), spec_depths=(0, 1), plugins=reg.plugins)
    reg.capture(plan)
    assert {(class_of(e.key), e.strategy) for e in reg.entries()} == {("decode", "vfull"), ("mixed", "vpw")}


KEYS = [B.decode(1), B.decode(4), B.decode(2, 1), B.decode(4, 3), B(8, 4), B(16, 8), B(8), B(32)]


@settings(max_examples=40, deadline=None)
@given(
    levels=st.tuples(st.integers(0, 3), st.integers(0, 3)),
    chosen=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(["vfull", "vpw", "full"])), min_size=1, max_size=5, unique=True),
    lazy=st.booleans(),
)
def test_capture_succeeds_iff_every_strategy_serves_its_keys(levels: tuple[int, int], chosen: list[tuple[B, str]], lazy: bool) -> None:
    """Oracle: each entry's class against its strategy's declaration, written out here."""
    declared = {"vfull": set(LEVELS[levels[0]]), "vpw": set(LEVELS[levels[1]]), "full": set()}
    reg = registry(vendor("vfull", False, LEVELS[levels[0]]), vendor("vpw", True, LEVELS[levels[1]]))
    plan = CapturePlan.of(chosen)
    bad = [e for e in plan if class_of(e.descriptor) in declared[e.strategy]]
    if bad:
        with pytest.raises(ValueError, match=r"\[{}\] is a {} key".format(bad[0].strategy, class_of(bad[0].descriptor))):
            reg.capture(plan, lazy=lazy)
        assert len(reg) == 0 and reg.pending() == []
    else:
        reg.capture(plan, lazy=lazy)
        assert {(e.descriptor, e.strategy) for e in plan} == {(e.key, e.strategy) for e in reg.entries()} | set(reg.pending())
