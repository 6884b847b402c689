"""Helpers for tests that play an engine's threads against a registry: a call on a thread of its own, bounded in time,
and a small registry."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

import cgregistry as cg

HIDDEN = 16


def run_in_thread(fn: Callable[[], Any], timeout: float, name: str | None = None) -> tuple[bool, dict]:
    """Run ``fn`` on a daemon thread (as the engine's serving thread, or one named ``name``); True if it finished within
    ``timeout``.

    The result is ``{"value": ...}`` or ``{"error": exception}``: a hang fails the test instead of stalling the run."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True, name=name)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), result


def matmul_registry(step: Callable[..., Any], **kwargs: Any) -> cg.GraphRegistry:
    """A cpu registry of ``step(batch, x)`` with one static input ``x`` of 64 rows of ``HIDDEN``."""
    return cg.GraphRegistry(step, {"x": cg.StaticInput((64, HIDDEN), torch.float32)}, backend="cpu", **kwargs)
