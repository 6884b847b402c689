"""The model's attention implementation, switched to the graphs' one only for the steps cgregistry serves.

transformers' attention modules read the implementation from the model's (shared) config at every forward, so the
switch is made on the config: counted, so that two managers serving one model at once leave it as it was when the
last of their steps ends, and marked per thread, so that a forward of the model outside a served step meanwhile (on
another thread) attends through the model's own implementation."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

_in_step: contextvars.ContextVar[bool] = contextvars.ContextVar("cgregistry_transformers_in_step", default=False)
_lock = threading.Lock()
_switched: dict[int, list[Any]] = {}  # id(config) -> [steps in progress, the implementation before them]


def own_implementation(config: Any) -> str:
    """The attention implementation ``config`` has outside served steps."""
    with _lock:
        held = _switched.get(id(config))
        return held[1] if held is not None else config._attn_implementation


def in_served_step() -> bool:
    """Whether this thread is inside a step cgregistry serves (its capture, replay or eager run)."""
    return _in_step.get()


@contextlib.contextmanager
def served_step(config: Any, name: str) -> Iterator[None]:
    """Inside the block the model attends through ``name`` on this thread; the config gets its own implementation
    back when the last block in progress, on any thread, ends."""
    with _lock:
        held = _switched.get(id(config))
        if held is None:
            _switched[id(config)] = held = [0, config._attn_implementation]
            config._attn_implementation = name
        held[0] += 1
    token = _in_step.set(True)
    try:
        yield
    finally:
        _in_step.reset(token)
        with _lock:
            held[0] -= 1
            if held[0] == 0:
                config._attn_implementation = held[1]
                del _switched[id(config)]
