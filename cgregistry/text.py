"""Plain-text tables for the registry's human-readable output."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows padded into aligned columns (two spaces apart), trailing blanks stripped."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
