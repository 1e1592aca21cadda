"""Result tables for the benchmark and sweep scripts (GitHub markdown, as pasted into docs/benchmarks.md), the timers
they share (``time_median``, ``kernel_ms``, ``kernel_events``) and ``kernel_table``, a profiler run grouped by kind
of kernel."""

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


def kernel_ms(fn: Callable[[], Any], calls: int = 20, warmup: int = 3) -> float:
    """GPU time of ``fn()`` in milliseconds per call: the summed durations of the CUDA kernels, copies and fills it
    launches (torch.profiler over ``calls`` calls after ``warmup``). Host work and the gaps it leaves between
    kernels are not counted, so this is the kernels' speed where an eager call is host-bound. (A CUDA-graph replay
    would measure the same without a profiler, but capturing an autograd backward fails on the H200 image with
    torch 2.11: "operation failed due to a previous error during capture", for SDPA's backward as for ours.)"""
    return sum(kernel_breakdown(fn, calls, warmup).values())


def kernel_breakdown(fn: Callable[[], Any], calls: int = 20, warmup: int = 3) -> dict[str, float]:
    """``kernel_ms`` by kernel: {CUDA kernel, copy or fill name: milliseconds per call of ``fn()``}."""
    per_name: dict[str, float] = {}
    for name, ms in kernel_events(fn, calls, warmup):
        per_name[name] = per_name.get(name, 0.0) + ms / calls
    if sum(per_name.values()) == 0:
        raise RuntimeError("kernel_ms: the profiler recorded no CUDA kernel (is fn running on the GPU?)")
    return per_name


def kernel_events(fn: Callable[[], Any], calls: int = 20, warmup: int = 3) -> list[tuple[str, float]]:
    """(name, milliseconds) of every CUDA kernel, copy and fill of ``calls`` calls of ``fn()`` after ``warmup``, in
    the order they ran (torch.profiler)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us() / 1000) for e in events]


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


# Kernel (or op, on CPU) names -> the part of a training step or sampling forward they belong to, first match wins.
# The Triton kernels of pixdit.kernels keep their function names; Inductor's fused kernels are triton_poi/red/per_*.
KERNEL_CATEGORIES = (
    ("qk-norm + RoPE", r"norm_rope"),  # Inductor's and pixdit.kernels.qk_norm_rope's kernels
    ("sparse attention (pixdit.kernels)", r"_fwd_kernel|_dq_kernel|_dkdv_kernel|_dk_dv_kernel|_feature_sums_kernel"),
    # the sparse backends' pooled q, k, v: Inductor's fused means (their names also carry "topk_select" when fused
    # next to the selection) or ATen's mean kernel in eager mode
    ("block means (pooling)", r"triton_\w+_fused_mean|MeanOps"),
    ("block selection (top-k)", r"topk|_select|bitonic|sort"),
    ("dense attention (SDPA / flash)", r"flash|fmha|scaled_dot_product|attention"),
    ("matmul", r"gemm|nvjet|cutlass|sm90_|xmma|cublas|aten::(mm|addmm|bmm|matmul|linear)"),
    ("optimizer + EMA (foreach)", r"multi_tensor|foreach|adam|lerp"),
    ("Inductor fused elementwise", r"triton_(poi|red|per)"),
)


def _self_time(event, cuda: bool) -> float:
    """Self time in microseconds on the device (CUDA) or the CPU; the attribute names changed in torch 2.4+."""
    if not cuda:
        return event.self_cpu_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def kernel_table(prof, cuda: bool) -> list[dict]:
    """Self time of what ``prof`` (a torch.profiler run) recorded, grouped by KERNEL_CATEGORIES, in milliseconds and as
    a share of the total: the kernels' device time, or on CPU the ops' CPU time. Ranges named ``step/...`` (the
    phases of scripts/bench_train.py) are not counted."""
    import re

    groups: dict[str, float] = {}
    for event in prof.key_averages(group_by_input_shape=False):
        if event.key.startswith("step/") or (cuda and str(getattr(event, "device_type", "")).endswith("CPU")):
            continue  # device time is counted at the kernels, not again at the CPU ops that launched them
        name = next((g for g, pattern in KERNEL_CATEGORIES if re.search(pattern, event.key)), "other")
        groups[name] = groups.get(name, 0.0) + _self_time(event, cuda) / 1000
    total = sum(groups.values()) or 1.0
    return [
        {"part": name, "ms": ms, "share %": 100 * ms / total}
        for name, ms in sorted(groups.items(), key=lambda item: -item[1])
    ]
