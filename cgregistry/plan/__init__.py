"""Plans: the keys to capture, built from an engine's settings, fitted to a workload, adapted to the traffic served."""

from __future__ import annotations

from cgregistry.plan.build import (
    BUILTIN_RELAXES, KEY_CLASSES, MODES, CapturePlan, Downgrade, PlanEntry, PlanSettings, UncoveredRange,
    default_ladder, lora_ladder, mode_preference, request_ladder, rounded_sizes, whole_requests,
)

__all__ = [
    "BUILTIN_RELAXES", "KEY_CLASSES", "MODES", "CapturePlan", "Downgrade", "PlanEntry", "PlanSettings", "UncoveredRange",
    "default_ladder", "lora_ladder", "mode_preference", "request_ladder", "rounded_sizes",
    "whole_requests",
]
