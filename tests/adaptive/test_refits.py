"""Adaptation (GraphRegistry(adapt=...)) after a hostile review: each case here failed before its fix."""
from __future__ import annotations

import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.capture import refit as registry_module
from cgregistry.plan.adapt import Adaptation
from cgregistry.testing import make_plugins

W = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


def step(batch: B, x: torch.Tensor) -> torch.Tensor:
    return x @ W


def make(adapt: Adaptation, rows: int = 32, **kw: object) -> cg.GraphRegistry:
    return cg.GraphRegistry(step, {"x": cg.StaticInput((rows, 4), torch.float32)}, backend="cpu", adapt=adapt, **kw)


def serve(reg: cg.GraphRegistry, n: int, steps: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            reg.run(B.decode(n), x=torch.randn(n, 4))


def test_adaptation_never_captures_a_key_its_static_inputs_cannot_hold() -> None:
    adapt = Adaptation(max_graphs=4, settings=dict(max_num_seqs=16, max_num_tokens=8192, mode="full", max_capture_size=512),
                       every_steps=10, min_steps=10)
    with pytest.raises(ValueError, match=r"adapt: .*tokens=512.*does not fit the static inputs.*'x'.*32"):
        make(adapt, rows=32)
    make(adapt, rows=512)  # inputs that hold the widest key: accepted


def test_a_refit_is_queued_after_every_steps_steps() -> None:
    calls: list[int] = []
    propose = registry_module.propose

    def spy(weights, *a, **k):  # noqa: ANN001, ANN002, ANN003
        calls.append(sum(weights.values()))
        return propose(weights, *a, **k)

    adapt = Adaptation(max_graphs=4, settings=dict(max_num_seqs=16, max_num_tokens=32, mode="full"), every_steps=5000, min_steps=5000)
    reg = make(adapt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry_module, "propose", spy)
        serve(reg, 3, 5000)
        reg.wait_captured(timeout=30)
    assert calls, "no refit after every_steps=5000 = min_steps steps (the first comes at 8192)"


def test_lazy_keys_count_against_max_graphs() -> None:
    settings = dict(max_num_seqs=32, max_num_tokens=32, mode="full")
    adapt = Adaptation(max_graphs=3, settings=settings, every_steps=50, min_steps=50, decay=1.0, min_gain=0.0)
    reg = make(adapt)
    reg.capture(cg.CapturePlan.build(**settings), lazy=True)
    serve(reg, 3, 100)
    assert reg.wait_captured(timeout=60)
    assert len(reg) + len(reg.pending()) <= 3, (len(reg), reg.pending())


@pytest.mark.filterwarnings("ignore:.*pending capturing .* failed:RuntimeWarning")  # on purpose
def test_a_key_whose_capture_failed_is_not_recaptured_at_every_refit() -> None:
    def failing(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 3 and cg.current_batch().key is not None:  # capturing it (an eager step serves 3 tokens)
            raise RuntimeError("cannot capture 3 tokens")
        return x @ W

    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=50, min_steps=50)
    reg = cg.GraphRegistry(failing, {"x": cg.StaticInput((32, 4), torch.float32)}, backend="cpu", adapt=adapt)
    for _ in range(10):
        serve(reg, 3, 50)
        reg.wait_captured(timeout=60)
    again = [c for c in reg.plan_changes if any(k.num_tokens == 3 for k, _ in c.added)]
    assert len(again) == 1, f"{len(again)} plan changes added the failing key {B.decode(3)}: once is right"
    assert [key.num_tokens for key, _ in reg.failures()] == [3] and 3 not in [e.key.num_tokens for e in reg.entries()]


def test_match_inside_plan_changed_does_not_return_a_released_key() -> None:
    stale: list[object] = []

    class Watcher:
        @cg.plugin.hookimpl
        def cgregistry_plan_changed(self, registry, change):  # noqa: ANN001
            held = {(e.key, e.strategy) for e in registry.entries()}
            for key, _ in change.removed:
                m = registry.match(key)
                if m is not None and (m.key, m.strategy) not in held:
                    stale.append(m)

    adapt = Adaptation(max_graphs=2, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=50, min_steps=50,
                       decay=1.0, min_gain=0.0)
    reg = make(adapt, plugins=make_plugins(Watcher()))
    reg.capture([(B.decode(8), "full"), (B.decode(32), "full")])
    serve(reg, 3, 60)
    reg.wait_captured(timeout=60)
    assert reg.plan_changes and not stale, f"registry.match() in the hook returned released keys: {stale}"


def test_plan_change_observed_is_the_registrys_step_count() -> None:
    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=50, min_steps=50,
                       decay=0.5, min_gain=0.0)
    reg = make(adapt)
    served = 0
    for n in (3, 9, 17):   # the traffic moves, so each refit changes the plan
        serve(reg, n, 50)
        served += 50
        reg.wait_captured(timeout=60)
    observed = [c.observed for c in reg.plan_changes]
    assert observed[-1] == served, f"PlanChange.observed {observed} ('after N steps'), but the registry served {served} steps"


@pytest.mark.filterwarnings("ignore:.*with no graph captured or planned:RuntimeWarning")  # on purpose
def test_adaptation_is_refused_with_collectives_across_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=50, min_steps=50)
    reg = make(adapt)  # made before the process group: the first due refit turns adaptation off, with a warning
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(RuntimeError, match=r"GraphRegistry\(adapt=...\) with torch.distributed initialized \(world size 2\)"):
        make(adapt)
    with pytest.warns(RuntimeWarning, match="adaptation is off from now on"):
        for _ in range(60):
            reg.run(B.decode(3), x=torch.randn(3, 4))
    reg.wait_captured(timeout=30)
    assert not reg.plan_changes and reg.stats().background_captures == 0


def test_policy_inputs_are_checked() -> None:
    from cgregistry.plan.adapt import PlanChange, refit

    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=1, min_steps=1)
    with pytest.raises(TypeError, match="refit\\(\\) takes a TrafficHistogram .* got dict"):
        refit({B.decode(3): 5}, [], adapt)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mode 'none'"):
        Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="none"))
    change = cg.plan.adapt.propose({B.decode(3): 5}, [], adapt)
    assert change is not None
    data = change.to_dict()
    assert PlanChange.from_dict(data) == change
    with pytest.raises(ValueError, match="reason must be one of .* got 'bogus'"):
        PlanChange.from_dict({**data, "reason": "bogus"})
    with pytest.raises(ValueError, match="observed must be an int >= 0 .* got -5"):
        PlanChange.from_dict({**data, "observed": -5})


def test_plan_changes_are_kept_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module, "PLAN_CHANGES_KEPT", 2)
    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=50, min_steps=50,
                       decay=0.5, min_gain=0.0)
    reg = make(adapt)
    for n in (3, 9, 17, 5):
        serve(reg, n, 50)
        reg.wait_captured(timeout=60)
    assert reg.stats().plan_changes >= 3 and len(reg.plan_changes) == 2
    assert len(cg.load_snapshot(reg.snapshot()).plan_changes) == 2


def test_an_interrupt_during_a_refit_leaves_it_to_run_again_and_adaptation_goes_on() -> None:
    """Ctrl-C while a refit runs between steps: the refit runs again at a later step, and its change is applied."""
    propose = registry_module.propose
    interrupts = [1]

    def interrupted(*a, **k):  # noqa: ANN002, ANN003, ANN202
        if interrupts[0]:
            interrupts[0] -= 1
            raise KeyboardInterrupt
        return propose(*a, **k)

    adapt = Adaptation(max_graphs=3, settings=dict(max_num_seqs=32, max_num_tokens=32, mode="full"), every_steps=50,
                       min_steps=50, min_gain=0.0)
    reg = make(adapt)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry_module, "propose", interrupted)
        with pytest.raises(KeyboardInterrupt):
            serve(reg, 3, 200)
        assert interrupts == [0] and reg.stats().plan_changes == 0
        serve(reg, 3, 20)
        assert reg.wait_captured(timeout=60)
    assert reg.stats().plan_changes >= 1 and len(reg) >= 1 and reg.match(B.decode(3)) is not None
