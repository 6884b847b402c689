"""Two registries in one graph pool (a drafter beside its target): both capture into it one at a time, both serve what
eager computes, and the pool is renewed only when neither holds a graph."""

from __future__ import annotations

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.capture.pool import GraphPool
from cgregistry.testing import make_plugins
from tests.conftest import device_of

PLAN = cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=8, mode="full")


def pair(backend: str) -> tuple[cg.GraphRegistry, cg.GraphRegistry, torch.nn.Module, torch.nn.Module]:
    device = device_of(backend)
    target_layer, draft_layer = torch.nn.Linear(16, 16, device=device), torch.nn.Linear(16, 16, device=device)
    spec = {"x": cg.StaticInput((8, 16), torch.float32)}
    target = cg.GraphRegistry(lambda batch, x: target_layer(x).relu(), spec, backend=backend, name="target")
    drafter = cg.GraphRegistry(lambda batch, x: draft_layer(x) * 3, spec, backend=backend, name="drafter", pool=target.pool)
    return target, drafter, target_layer, draft_layer


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_drafter_in_its_targets_pool_serves_what_eager_computes(backend: str) -> None:
    target, drafter, target_layer, draft_layer = pair(backend)
    assert drafter.pool is target.pool
    with torch.inference_mode():
        target.capture(PLAN)
        drafter.capture(PLAN)
        assert target.pool.live_graphs == drafter.pool.live_graphs == 2 * len(PLAN)
        for n in (1, 3, 8):
            x = torch.randn(n, 16, device=device_of(backend))
            proposed = drafter.run(B.decode(n), x=x)  # valid until the next replay of either registry: one pool
            torch.testing.assert_close(proposed, draft_layer(x) * 3)
            want = target_layer(proposed).relu()
            torch.testing.assert_close(target.run(B.decode(n), x=proposed), want)
    assert target.stats().misses == drafter.stats().misses == 0


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_the_pool_is_renewed_only_when_no_registry_sharing_it_holds_a_graph(backend: str) -> None:
    target, drafter, _, draft_layer = pair(backend)
    with torch.inference_mode():
        target.capture(PLAN)
        drafter.capture(PLAN)
        handle = target.pool.handle
        target.clear()
        assert target.pool.handle is handle, "the drafter's graphs still live in the pool"
        x = torch.randn(5, 16, device=device_of(backend))
        torch.testing.assert_close(drafter.run(B.decode(5), x=x), draft_layer(x) * 3)
        target.capture(PLAN)  # back into the same pool, beside the drafter's graphs
        assert target.pool.handle is handle
        target.clear()
        drafter.clear()
        assert target.pool.handle is not handle, "nothing holds the old pool: its memory can go back"
        drafter.capture(PLAN)
        torch.testing.assert_close(drafter.run(B.decode(5), x=x), draft_layer(x) * 3)


def calling_the_drafter_from_the_targets_capture(*calls: str) -> tuple[cg.GraphRegistry, cg.GraphRegistry, list[BaseException]]:
    """A target whose capture_started hook calls each of ``calls`` (a method name, or "capture" of one key) on a drafter
    that shares its pool, once; the RuntimeErrors they raise."""
    errors: list[BaseException] = []
    drafters: list[cg.GraphRegistry] = []
    actions = {"capture": lambda d: d.capture([(B(4, 4), "full")]), "wait_captured": lambda d: d.wait_captured(),
               "estimate_memory": lambda d: d.estimate_memory(PLAN)}

    class CallTheDrafterFromAHook:
        @cg.plugin.hookimpl
        def cgregistry_capture_started(self, registry: object, key: B, strategy: str) -> None:
            if getattr(registry, "name", None) == "target" and not errors:
                for call in calls:
                    try:
                        actions[call](drafters[0])
                    except RuntimeError as exc:
                        errors.append(exc)

    spec = {"x": cg.StaticInput((8, 16), torch.float32)}
    target = cg.GraphRegistry(lambda batch, x: x * 2, spec, backend="cpu", name="target",
                              plugins=make_plugins(CallTheDrafterFromAHook()))
    drafters.append(cg.GraphRegistry(lambda batch, x: x * 3, spec, backend="cpu", name="drafter", pool=target.pool))
    return target, drafters[0], errors


def test_a_capture_of_the_other_registry_from_inside_a_capture_is_refused_not_a_hang() -> None:
    target, drafter, errors = calling_the_drafter_from_the_targets_capture("capture")
    target.capture([(B(2, 2), "full")])
    assert len(errors) == 1
    assert "from inside a capture of registry 'target', which shares its pool" in str(errors[0])
    assert len(target.entries()) == 1 and drafter.entries() == []
    drafter.capture([(B(4, 4), "full")])  # afterwards, it captures
    assert len(drafter.entries()) == 1


def test_waiting_on_the_other_registry_from_inside_a_capture_is_refused_not_a_hang() -> None:
    target, drafter, errors = calling_the_drafter_from_the_targets_capture("wait_captured", "estimate_memory")
    drafter.capture(PLAN, background=True)
    target.capture([(B(2, 2), "full")])
    assert [str(e).split(" on registry")[0] for e in errors] == ["wait_captured()", "estimate_memory()"]
    assert all("from inside a capture of registry 'target'" in str(e) for e in errors)
    assert drafter.wait_captured(timeout=60) and len(drafter.entries()) == len(PLAN)


def test_back_to_back_steps_of_both_while_the_drafter_captures_in_the_background_equal_eager() -> None:
    """The serving loop of a speculative engine: draft, verify, draft, ... with nothing between steps, under autocast
    and inference mode, while the drafter's graphs are captured beside it into the target's pool."""
    target, drafter, target_layer, draft_layer = pair("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        target.capture(PLAN)
        drafter.capture(PLAN, background=True)
        for step in range(60):
            n = 1 + step % 8
            x = torch.randn(n, 16)
            draft = drafter.run(B.decode(n), x=x)
            torch.testing.assert_close(draft, draft_layer(x) * 3)
            proposed = draft.float()  # the target's input is declared float32
            want = target_layer(proposed).relu()
            torch.testing.assert_close(target.run(B.decode(n), x=proposed), want)
        assert drafter.wait_captured(timeout=60)
        assert len(drafter.entries()) == len(target.entries()) == len(PLAN)
        assert draft.dtype == torch.bfloat16, "served under the autocast the graphs were captured in"
    assert target.stats().misses == 0 and drafter.stats().hits > 0


def test_a_pool_argument_is_checked() -> None:
    spec = {"x": cg.StaticInput((8, 16), torch.float32)}
    with pytest.raises(TypeError, match="pool must be another registry's pool .* got 3"):
        cg.GraphRegistry(lambda batch, x: x, spec, backend="cpu", pool=3)
    cpu = cg.GraphRegistry(lambda batch, x: x, spec, backend="cpu")
    assert isinstance(cpu.pool, GraphPool)


def debug_pair(backend: str = "cpu") -> tuple[cg.GraphRegistry, cg.GraphRegistry, torch.nn.Module, torch.nn.Module]:
    device = device_of(backend)
    target_layer, draft_layer = torch.nn.Linear(16, 16, device=device), torch.nn.Linear(16, 16, device=device)
    spec = {"x": cg.StaticInput((8, 16), torch.float32)}
    target = cg.GraphRegistry(lambda batch, x: target_layer(x).relu(), spec, backend=backend, name="target", debug=True)
    drafter = cg.GraphRegistry(lambda batch, x: draft_layer(x) * 3, spec, backend=backend, name="drafter", debug=True,
                               pool=target.pool)
    with torch.inference_mode():
        target.capture(PLAN, progress=False)
        drafter.capture(PLAN, progress=False)
    return target, drafter, target_layer, draft_layer


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_debug_mode_refuses_a_draft_read_after_the_target_replayed_into_the_shared_pool(backend: str) -> None:
    target, drafter, target_layer, draft_layer = debug_pair(backend)
    x = torch.randn(3, 16, device=device_of(backend))
    with torch.inference_mode():
        draft = drafter.run(B.decode(3), x=x)
        kept = draft.clone()
        verified = target.run(B.decode(3), x=draft)  # the draft as the target's input: read before the replay, fine
        torch.testing.assert_close(verified, target_layer(kept).relu())
        with pytest.raises(cg.StaleOutputError, match=r"output of run 1 of registry 'drafter' was read \(by .*\) after "
                                                      r"run 1 of registry 'target' overwrote it; .*graph pool"):
            draft.sum()  # on CUDA the target's graph may have reused this memory
        with pytest.raises(cg.StaleOutputError):
            draft[:1].clone()
        torch.testing.assert_close(kept, draft_layer(x) * 3)  # the clone is the caller's
        verified.sum()  # the target's own output: valid until the next replay in the pool
        drafter.run(B.decode(3), x=x)
        with pytest.raises(cg.StaleOutputError, match="after run 2 of registry 'drafter' overwrote it"):
            verified.sum()


def test_the_cpu_emulation_keeps_pool_partners_memory_apart_so_only_debug_mode_shows_the_stale_read() -> None:
    target, drafter, _, draft_layer = pair("cpu")
    with torch.inference_mode():
        target.capture(PLAN, progress=False)
        drafter.capture(PLAN, progress=False)
        x = torch.randn(3, 16)
        draft = drafter.run(B.decode(3), x=x)
        target.run(B.decode(3), x=torch.randn(3, 16))
        torch.testing.assert_close(draft, draft_layer(x) * 3)  # intact on cpu (on CUDA it may not be): the contract
        # is the same on both backends, which is why debug mode refuses the read above on cpu too


def test_a_change_to_the_partners_graphs_stales_the_draft_and_an_eager_step_does_not() -> None:
    target, drafter, _, _ = debug_pair()
    x = torch.randn(3, 16)
    with torch.inference_mode():
        draft = drafter.run(B.decode(3), x=x)
        target.run(B(20, 2), x=torch.randn(20, 16))  # larger than any key: an eager step, no graph memory written
        assert target.stats().eager_fallbacks == 1
        draft.sum()  # still valid: the pool's graphs did not run
        target.release(B(8, 8))  # a change to the target's graphs between steps
        with pytest.raises(cg.StaleOutputError, match="after a change to the graphs of registry 'target' after its run 1"):
            draft.sum()
        mine = drafter.run(B.decode(3), x=x)
        drafter.run(B(20, 2), x=torch.randn(20, 16))  # an eager step of its own registry: valid until its next run()
        with pytest.raises(cg.StaleOutputError, match="after run 3 of registry 'drafter' overwrote it"):
            mine.sum()


def test_debug_registries_with_a_pool_each_do_not_stale_each_other() -> None:
    spec = {"x": cg.StaticInput((8, 16), torch.float32)}
    a = cg.GraphRegistry(lambda batch, x: x * 2, spec, backend="cpu", debug=True)
    b = cg.GraphRegistry(lambda batch, x: x * 3, spec, backend="cpu", debug=True)
    a.capture(PLAN, progress=False)
    b.capture(PLAN, progress=False)
    out = a.run(B.decode(2), x=torch.ones(2, 16))
    b.run(B.decode(2), x=torch.ones(2, 16))
    assert float(out.sum()) == 64.0


def test_a_pool_shared_by_registries_in_debug_mode_and_not_is_warned_about() -> None:
    spec = {"x": cg.StaticInput((8, 16), torch.float32)}
    target = cg.GraphRegistry(lambda batch, x: x, spec, backend="cpu", name="target")
    with pytest.warns(RuntimeWarning, match=r"'drafter' \(debug=True\) and 'target' \(debug=False\) share one graph pool"):
        cg.GraphRegistry(lambda batch, x: x, spec, backend="cpu", name="drafter", debug=True, pool=target.pool)
