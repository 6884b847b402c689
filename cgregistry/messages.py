"""What the package tells the person reading it: warnings that point at the engine's line (the first frame outside
cgregistry, however deep the package's own calls), and plain-text tables for its human-readable output."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence

__all__ = ["text_table", "warn"]


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the nearest caller outside this package (the engine's call or line)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the frame that called warn()
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "cgregistry":
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows padded into aligned columns (two spaces apart), trailing blanks stripped."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
