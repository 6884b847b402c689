"""What a transformers user chooses about the graphs: how much is captured, and when."""

from __future__ import annotations

import attrs

import cgregistry as cg


def _non_negative(instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
        raise ValueError(f"GraphSettings.{attribute.name} must be None or a number of seconds >= 0, got {value!r}")


def _breakable_plan(instance: object, attribute: attrs.Attribute, value: cg.CapturePlan | None) -> None:
    if value is None:
        return
    if not isinstance(value, cg.CapturePlan):
        raise TypeError(f"GraphSettings.plan must be a cgregistry.CapturePlan, got {value!r}")
    others = sorted({entry.strategy for entry in value} - {"breakable"})
    if others:
        raise ValueError(f"GraphSettings.plan has keys of strategy {others}: the attention runs as an eager break "
                         "between graph segments, which only 'breakable' keys serve (build the plan with "
                         "mode='breakable')")


CAPTURE_WHEN = ("first use", "background", "at start")


def _size(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"GraphSettings.{attribute.name} must be None or an int >= 1, got {value!r}")


@attrs.frozen
class GraphSettings:
    """How cgregistry serves a continuous-batching manager.

    ``max_capture_size``: the largest token count captured (a batch above it runs eagerly); None: 128 tokens, or the
    manager's ``max_batch_tokens`` when smaller.  ``capture``: when keys are captured, on the manager's generation
    thread: "first use" (the default) captures each key inside the first step it is the best key for (that step waits
    for one capture, tens of ms; a key no batch needs is never captured); "background" captures the whole plan between
    steps from the first one, within ``capture_budget`` seconds a step (at least one piece: a key's warm-up or its
    recording; 5 ms by default, about one piece a step; None: an eager step's time; 0: never while serving), serving
    eagerly until a key is live; "at start" captures the whole plan at the first step.  ``plan``: a ``CapturePlan`` of
    your own (its strategies must run attention eagerly: ``breakable``).  ``debug``: the registry's debug mode.
    """

    max_capture_size: int | None = attrs.field(default=None, validator=_size)
    capture: str = attrs.field(default="first use", validator=attrs.validators.in_(CAPTURE_WHEN))
    capture_budget: float | None = attrs.field(default=0.005, validator=_non_negative)
    plan: cg.CapturePlan | None = attrs.field(default=None, validator=_breakable_plan)
    debug: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def plan_for(self, max_requests: int, max_batch_tokens: int) -> cg.CapturePlan:
        """The plan for a manager's limits: ``plan`` when given, else breakable keys up to ``max_capture_size``."""
        if self.plan is not None:
            return self.plan
        largest = min(self.max_capture_size or 128, max_batch_tokens)
        return cg.CapturePlan.build(max_num_seqs=max_requests, max_num_tokens=max_batch_tokens,
                                    max_capture_size=largest, mode="breakable")
