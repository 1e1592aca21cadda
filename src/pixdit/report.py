"""Result tables for the benchmark and sweep scripts (GitHub markdown, as pasted into docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None,
                   cell: Callable[[str, Any], str] = lambda column, value: str(value)) -> str:
    """One table row per dict; ``columns`` default to the first row's keys; ``cell(column, value)`` formats a cell
    (missing values are passed as "")."""
    columns = list(columns if columns is not None else rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)
