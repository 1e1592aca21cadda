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


def time_median(fn: Callable[[], Any], warmup: int, repeats: int, device) -> tuple[float, float]:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls, and the peak GPU memory (GB) during
    the timed calls (nan on CPU). On CUDA each call is timed with CUDA events (device time, launch queue drained)."""
    import statistics
    import time

    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else float("nan")
    return statistics.median(times), peak_gb
