"""Checks of the arguments a registry's public calls take, and the facade's delegated attributes.

The facade checks every argument before it hands a call to a part: the errors name the argument, the value and what is
expected.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from cgregistry.capture.pool import GraphPool
from cgregistry.contracts.protocols import Backend
from cgregistry.store.io import StaticInput

__all__ = ["RESERVED_INPUT_NAMES", "Delegated", "check_budget", "check_capture_budget", "check_flag", "check_inputs", "check_pool", "check_timeout"]

RESERVED_INPUT_NAMES = ("context", "group", "exclude")  # keyword arguments of run() itself


def check_pool(pool: object, backend: Backend) -> GraphPool:
    """``pool`` as another registry's graph pool, on the same backend and device as this registry's."""
    if not isinstance(pool, GraphPool):
        raise TypeError(f"pool must be another registry's pool (registry.pool, a GraphPool), got {pool!r}")
    if pool.backend.name != backend.name or pool.device != backend.device():
        raise ValueError(f"pool is on backend {pool.backend.name!r} ({pool.device}); this registry captures on "
                         f"{backend.name!r} ({backend.device()}): a pool is shared on one backend and device")
    return pool


def check_flag(call: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{call}({name}=...) takes a bool, got {value!r}")


def check_budget(value: object) -> None:
    if value is not None and type(value) is not int:
        raise TypeError(f"memory_budget must be an int byte count >= 0 or None, got {value!r} ({type(value).__name__})")
    if value is not None and value < 0:
        raise ValueError(f"memory_budget must be a byte count >= 0 or None, got {value!r}")


def check_timeout(call: str, timeout: object, name: str = "timeout") -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{call}({name}=...) takes seconds (an int or float, inf allowed) or None, got {timeout!r}")
    if not timeout >= 0:
        raise ValueError(f"{call}({name}=...) takes seconds >= 0 (inf allowed) or None, got {timeout!r}")


def check_capture_budget(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"capture_budget takes seconds (an int or float) or None (an eager step's time), got {value!r}")
    if not value >= 0:
        raise ValueError(f"capture_budget takes seconds >= 0 (an int or float; 0: no capture while serving) or None (an "
                         f"eager step's time), got {value!r}")


def check_inputs(inputs: Mapping[str, object]) -> None:
    """Static inputs are ``StaticInput`` declarations, under names ``run()`` does not take for itself."""
    for name, spec in inputs.items():
        if not isinstance(spec, StaticInput):
            raise TypeError(f"inputs[{name!r}] must be a cgregistry.StaticInput, got {spec!r}")
        if name in RESERVED_INPUT_NAMES:
            raise ValueError(f"static input name {name!r} is reserved for run(..., {name}=...); give the input another name")


class Delegated:
    """A facade attribute read from (and, with ``check``, written to after the check) one of its parts."""

    def __init__(self, part: str, name: str, check: Callable[[Any], None] | None = None) -> None:
        self.part, self.name, self.check = part, name, check

    def __get__(self, registry: Any, owner: type | None = None) -> Any:
        return self if registry is None else getattr(getattr(registry, self.part), self.name)

    def __set__(self, registry: Any, value: Any) -> None:
        if self.check is None:
            raise AttributeError(f"{self.name} is read-only")
        self.check(value)
        setattr(getattr(registry, self.part), self.name, value)
