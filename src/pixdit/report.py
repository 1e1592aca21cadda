"""Result tables for the benchmark and sweep scripts (GitHub markdown, as pasted into docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def markdown_table(
    rows: Sequence[dict],
    columns: Sequence[str] | None = None,
    cell: Callable[[str, Any], str] = lambda column, value: str(value),
) -> str:
    """One table row per dict; ``columns`` default to the first row's keys; ``cell(column, value)`` formats a cell
    (missing values are passed as "")."""
    columns = list(columns if columns is not None else rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(c, row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def time_median(fn: Callable[[], Any], warmup: int, repeats: int, device) -> tuple[float, float]:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls, and the peak GPU memory (GB) during
    the timed calls (nan on CPU). On CUDA the calls run back to back, each between two CUDA events, with one
    synchronisation at the end (as ``triton.testing.do_bench`` does): host work that overlaps the GPU's queue is not
    counted, host work that starves the GPU is."""
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
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1000 for start, end in events]
    else:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    peak_gb = torch.cuda.max_memory_allocated(device) / 1e9 if cuda else float("nan")
    return statistics.median(times), peak_gb
