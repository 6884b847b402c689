"""A stateful oracle for what a graph was captured under: weight updates in place and by assignment (announced or not;
of the same layout or another; loaded in place by reg.load_weights), watch() at any time, refresh() in the foreground
and the background with injected capture failures, new keys, sleep, wake, clear and release, and autocast / inference
mode around run(), on the cpu emulator and on one that keeps its pool usable once the graphs in it died, as cuda does.
Every output equals eager under the same state, or run() is refused with a named error; no key is ever lost; nothing
keeps a pool while asleep."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from cgregistry.testing import make_plugins
from tests.lifecycle.test_keys import Flaky  # a model whose capture fails while fail_at names the key's size
from tests.memory.test_pool_reuse import KeptPools  # the emulator with kept pools, streams per pool and a fence

MAX_TOKENS = 16
WIDTH = 8  # Flaky's
SIZES = (2, 4, 8, 16)
REFUSALS = (cg.WeightsMovedError, cg.ServingStateError)


def key_of(size: int) -> tuple[B, str]:
    return (B(size, size), "full")


@contextlib.contextmanager
def state(autocast: bool, inference: bool) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        if autocast:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        stack.enter_context(torch.inference_mode() if inference else torch.no_grad())
        yield


class CapturedUnder(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.net = Flaky()
        self.closure = False
        self.reg: cg.GraphRegistry | None = None
        self.kept: KeptPools | None = None
        self.keys: set[tuple[B, str]] = set()  # every key asked for and not released or cleared since
        self.asleep = False

    @rule(closure=st.booleans(), kept=st.booleans())
    @precondition(lambda self: self.reg is None)
    def build(self, closure: bool, kept: bool) -> None:
        net = self.net
        self.closure = closure
        step = (lambda batch, x: net(batch, x)) if closure else net
        inputs = {"x": cg.StaticInput((MAX_TOKENS, WIDTH), torch.float32)}
        if kept:
            self.kept = KeptPools()
            self.reg = cg.GraphRegistry(step, inputs, backend=self.kept.name, plugins=make_plugins(self.kept))
        else:
            self.reg = cg.GraphRegistry(step, inputs, backend="cpu")

    @rule(sizes=st.sets(st.sampled_from(SIZES), min_size=1), lazy=st.booleans(), background=st.booleans(),
          autocast=st.booleans())
    @precondition(lambda self: self.reg is not None)
    def capture(self, sizes: set[int], lazy: bool, background: bool, autocast: bool) -> None:
        pairs = [key_of(s) for s in sorted(sizes, reverse=True)]
        try:
            with state(autocast, inference=True):
                self.reg.capture(pairs, lazy=lazy, background=background and not lazy)
        except (cg.ServingStateError, RuntimeError) as exc:  # another state than the held graphs', or asleep
            assert isinstance(exc, cg.ServingStateError) or "sleeps" in str(exc), exc
            return
        self.keys |= set(pairs)

    @rule(factor=st.floats(0.5, 2.0))
    def update_in_place(self, factor: float) -> None:
        with torch.no_grad():
            self.net.linear.weight.mul_(factor)

    @rule(seed=st.integers(0, 1000), inference=st.booleans())
    @precondition(lambda self: self.reg is not None)
    def load_weights(self, seed: int, inference: bool) -> None:
        """A trainer's sync streamed in place: no graph goes stale, none is captured."""
        g = torch.Generator().manual_seed(seed)
        state = {k: torch.randn(v.shape, generator=g) for k, v in self.net.state_dict().items()}
        with torch.inference_mode() if inference else torch.no_grad():
            assert self.reg.load_weights(iter(state.items()), module=self.net) == tuple(state)

    @rule(seed=st.integers(0, 1000), column_major=st.booleans())
    def update_by_assignment(self, seed: int, column_major: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        state = {k: torch.randn(v.shape, generator=g) for k, v in self.net.linear.state_dict().items()}
        if column_major:  # another layout: a replay would read it wrongly, captured again
            state["weight"] = state["weight"].t().contiguous().t()
        self.net.linear.load_state_dict(state, assign=True)

    @rule(seed=st.integers(0, 1000), column_major=st.booleans(), background=st.booleans())
    @precondition(lambda self: self.reg is not None)
    def weight_sync(self, seed: int, column_major: bool, background: bool) -> None:
        """An engine's sync: every weight assigned, then refresh()."""
        self.update_by_assignment(seed, column_major)
        self.capture_again(lambda: self.reg.refresh(background=background), background, None)

    @rule(seed=st.integers(0, 1000))
    def replace_data_unannounced(self, seed: int) -> None:
        self.net.linear.weight.data = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(seed))

    @rule()
    @precondition(lambda self: self.reg is not None)
    def watch(self) -> None:
        self.reg.watch(self.net)

    @rule(background=st.booleans(), fail=st.sampled_from((None, *SIZES)))
    @precondition(lambda self: self.reg is not None)
    def refresh(self, background: bool, fail: int | None) -> None:
        self.capture_again(lambda: self.reg.refresh(background=background), background, fail)

    def capture_again(self, call: Callable[[], object], background: bool, fail: int | None) -> None:
        """``call`` (a refresh or a wake) while captures of the ``fail`` size fail (a transient out-of-memory)."""
        self.net.fail_at = set() if fail is None else {fail}
        try:
            call()
            if background:
                assert self.reg.wait_captured(timeout=60)
        except cg.CaptureError as exc:
            assert "out of memory" in str(exc)
        finally:
            self.net.fail_at = set()

    @rule()
    @precondition(lambda self: self.reg is not None)
    def sleep(self) -> None:
        self.reg.sleep()
        self.asleep = True

    @rule(background=st.booleans(), fail=st.sampled_from((None, *SIZES)))
    @precondition(lambda self: self.reg is not None)
    def wake(self, background: bool, fail: int | None) -> None:
        self.asleep = False
        self.capture_again(lambda: self.reg.wake(background=background), background, fail)

    @rule()
    @precondition(lambda self: self.reg is not None)
    def clear(self) -> None:
        self.reg.clear()
        self.keys.clear()

    @rule(size=st.sampled_from(SIZES))
    @precondition(lambda self: self.reg is not None)
    def release(self, size: int) -> None:
        try:
            self.reg.release(key_of(size)[0])
        except KeyError:
            assert key_of(size) not in self.keys or key_of(size) in self.reg.failures()
        self.keys.discard(key_of(size))

    @rule(n=st.integers(1, MAX_TOKENS), autocast=st.booleans(), inference=st.booleans(), seed=st.integers(0, 99))
    @precondition(lambda self: self.reg is not None)
    def run(self, n: int, autocast: bool, inference: bool, seed: int) -> None:
        x = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))
        with state(autocast, inference):
            try:
                out = self.reg.run(B(n, n), x=x).clone()
            except REFUSALS:
                return
            want = self.net(B(n, n), x)
        assert out.dtype == want.dtype, (out.dtype, want.dtype)
        tolerance = 2e-2 if autocast else 1e-5
        torch.testing.assert_close(out, want, rtol=tolerance, atol=tolerance)

    @invariant()
    def no_key_is_lost(self) -> None:
        if self.reg is None:
            return
        reg = self.reg
        held = {(e.key, e.strategy) for e in reg.entries()} | set(reg.pending()) | set(reg.capturing()) | set(reg.failures())
        if self.asleep:  # sleep() while asleep hands back the plan wake() will take up
            slept = reg.sleep()
            held |= set(slept.keys) | set(slept.lazy)
        lost = self.keys - held
        assert not lost, f"keys lost: {sorted(map(str, lost))}"

    @invariant()
    def asleep_nothing_keeps_a_pool(self) -> None:
        if self.asleep and self.kept is not None:
            assert self.kept.alive(collect=False) == 0, "a pool is kept while asleep"

    def teardown(self) -> None:
        if self.reg is not None:
            self.reg.wait_captured(timeout=60)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], stateful_step_count=30)


def test_captured_under_quick() -> None:
    run = CapturedUnder.TestCase
    run.settings = settings(max_examples=12, **SETTINGS)
    run().runTest()


@pytest.mark.slow
def test_captured_under() -> None:
    run = CapturedUnder.TestCase
    run.settings = settings(max_examples=150, **SETTINGS)
    run().runTest()
