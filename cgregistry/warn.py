"""Warnings that point at the engine's line: the first frame outside cgregistry, however deep the package's own calls."""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn"]


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the nearest caller outside this package (the engine's call or line)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called warn()
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "cgregistry":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
