"""Capture failures are kept and named the same way on every capture path, a key captured after a failure stops being
listed as failed, and neither the uniform hint nor a pending key offers a batch a key the call may not use."""

from __future__ import annotations

import warnings

import pytest
import torch

import cgregistry as cg
from cgregistry import BatchDescriptor as B
from tests.background.test_background import Engine, batch_inputs, eager, make
from tests.serving_threads import HIDDEN, matmul_registry


def test_a_batch_no_pending_key_may_serve_under_the_padding_cap_is_a_padding_cap_miss() -> None:
    """A batch that no pending key may serve under the padding cap runs eagerly, counted as a ``padding_cap`` miss
    (not ``capturing``), and moves no key to the front of the pending captures."""
    engine = Engine()
    reg = make(engine, max_padding_tokens=4, capture_budget=1e-9)
    reg.capture([(B.decode(64), "full"), (B.decode(8), "full")], background=True)
    batch, inputs = batch_inputs(2, 0)
    torch.testing.assert_close(reg.run(batch, **inputs), eager(engine, batch, inputs), atol=1e-5, rtol=1e-5)
    reasons = {k: v for k, v in reg.stats().misses_by_reason.items() if v}
    assert reasons == {"padding_cap": 1}, reasons
    assert engine.calls[0] == B.decode(64), "the largest key first, as planned: the batch moved no key ahead of it"


def test_the_uniform_hint_and_its_warning_respect_exclude() -> None:
    """The uniform hint (in ``explain`` and in the warning after repeated misses) names only keys the call may use:
    none when the uniform key's strategy is excluded."""
    weight = torch.randn(HIDDEN, HIDDEN)
    reg = matmul_registry(lambda batch, x: x @ weight)
    reg.capture([(B.decode(8), "full")])
    batch = B(4, 4)
    assert reg.match(B.decode(4), exclude=("full",)) is None
    hint = reg.explain(batch, exclude=("full",)).hint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(16):
            reg.run(batch, exclude=("full",), x=torch.randn(4, HIDDEN))
    warned = [str(w.message) for w in caught if "uniform keys would serve" in str(w.message)]
    assert hint is None and not warned, f"hint under exclude=('full',): {hint!r}; warnings: {warned}"


def test_a_foreground_capture_failure_is_kept_in_failures_as_a_pending_one_is() -> None:
    """A key whose ``capture(plan)`` fails in the foreground is kept as a pending key's failure is: in ``failures()``,
    in ``stats().entry_failures``, and the batches it would serve count as ``failed`` misses."""
    weight = torch.randn(HIDDEN, HIDDEN)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_tokens == 8:
            raise RuntimeError("no kernel for 8 tokens")
        return x @ weight

    key = (B.decode(8), "full")
    reg = matmul_registry(step)
    with pytest.raises(cg.CaptureError):
        reg.capture([key])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reg.run(B.decode(6), x=torch.randn(6, HIDDEN))
    misleading = [str(w.message) for w in caught if "no graph captured or planned" in str(w.message)]
    stats = reg.stats()
    assert key in reg.failures() and stats.entry_failures == 1 and stats.misses_by_reason["failed"] == 1 and not misleading, (
        f"failures()={reg.failures()}, entry_failures={stats.entry_failures}, "
        f"misses={ {k: v for k, v in stats.misses_by_reason.items() if v} }, warnings={misleading}"
    )


def test_a_plan_failure_names_what_each_failing_strategy_raised() -> None:
    """When several strategies of a plan fail, the CaptureError names each one's own cause (type and message), with
    the first failure's as ``__cause__``."""
    weight = torch.randn(HIDDEN, HIDDEN)

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if batch.num_reqs is None:
            raise ValueError("block table needs num_reqs")
        if batch.num_tokens == 8:
            raise RuntimeError("no full kernel for 8 tokens")
        return x @ weight

    reg = matmul_registry(step)
    with pytest.raises(cg.CaptureError) as info:
        reg.capture(cg.CapturePlan.build(max_num_seqs=8, max_num_tokens=16))
    assert "no full kernel for 8 tokens" in str(info.value), str(info.value)


def test_a_key_captured_after_a_failure_is_no_longer_listed_as_failed() -> None:
    """Once a key that failed to capture is captured, ``failures()`` no longer lists it and ``stats().entry_failures``
    no longer counts it."""
    weight = torch.randn(HIDDEN, HIDDEN)
    fail = [True]

    def step(batch: B, x: torch.Tensor) -> torch.Tensor:
        if fail[0] and batch.num_tokens == 8:
            raise torch.OutOfMemoryError("out of memory (transient)")
        return x @ weight

    reg = matmul_registry(step)
    key = (B.decode(8), "full")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg.capture([key], background=True)
        assert reg.wait_captured()
        assert key in reg.failures()
        fail[0] = False
        reg.capture([key], background=True)
        assert reg.wait_captured()
    x = torch.randn(8, HIDDEN)
    torch.testing.assert_close(reg.run(B.decode(8), x=x), x @ weight)
    assert reg.stats().hits == 1
    assert key not in reg.failures() and reg.stats().entry_failures == 0, (
        f"live key still listed as failed: {reg.failures()}, entry_failures={reg.stats().entry_failures}"
    )
