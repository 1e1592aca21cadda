"""Result tables for the benchmark and sweep scripts (GitHub markdown, as pasted into docs/benchmarks.md), the timers
they share (``time_median``, ``kernel_ms``, ``kernel_events``), ``kernel_table``, a profiler run grouped by kind
of kernel, and ``bandwidth_table``, the same run's Inductor kernels ranked by the time they lose against a
bandwidth floor."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
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
    """GPU time of ``fn()`` in milliseconds per call: the time during which at least one of the CUDA kernels, copies
    and fills it launches runs (torch.profiler over ``calls`` calls after ``warmup``). On one stream that is the sum
    of their durations; kernels that run at once on two streams count once. Host work and the gaps it leaves
    between kernels are not counted, so this is the kernels' speed where an eager call is host-bound. (A CUDA-graph
    replay would measure the same without a profiler, but capturing an autograd backward fails on the H200 image
    with torch 2.11: "operation failed due to a previous error during capture", for SDPA's backward as for ours.)"""
    busy, end = 0.0, float("-inf")
    for _, start, stop in _kernel_spans(fn, calls, warmup):  # in the order they started
        if stop > end:
            busy, end = busy + stop - max(start, end), stop
    return busy / calls


def kernel_breakdown(fn: Callable[[], Any], calls: int = 20, warmup: int = 3) -> dict[str, float]:
    """The summed durations of ``fn()``'s kernels by kernel: {CUDA kernel, copy or fill name: milliseconds per call}."""
    per_name: dict[str, float] = {}
    for name, ms in kernel_events(fn, calls, warmup):
        per_name[name] = per_name.get(name, 0.0) + ms / calls
    return per_name


def kernel_events(fn: Callable[[], Any], calls: int = 20, warmup: int = 3) -> list[tuple[str, float]]:
    """(name, milliseconds) of every CUDA kernel, copy and fill of ``calls`` calls of ``fn()`` after ``warmup``, in
    the order they started (torch.profiler)."""
    return [(name, stop - start) for name, start, stop in _kernel_spans(fn, calls, warmup)]


def _kernel_spans(fn: Callable[[], Any], calls: int, warmup: int) -> list[tuple[str, float, float]]:
    """(name, start, end) in milliseconds of every CUDA kernel, copy and fill of ``calls`` calls of ``fn()``, in the
    order they started."""
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
    if not events:
        raise RuntimeError("the profiler recorded no CUDA kernel of fn (is fn running on the GPU?)")
    return [(e.name, e.time_range.start / 1000, e.time_range.end / 1000) for e in events]


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
    # the walks, LLSA's slot sums, SLA's feature sums, VSA's gated sum of its two stages, the lists' transpose by
    # counts (blocks.CSC_BY_COUNTS; the sort it replaces falls under the selection's "sort"), LLSA's Gluon passes
    (
        "sparse attention (pixdit.kernels)",
        r"_fwd_kernel|_dq_kernel|_dkdv_kernel|_sum_slots_kernel|_feature_sums_kernel|_combine_\w+_kernel"
        r"|_csc_\w+_kernel|_pooled_forward_kernel|_pooled_dq_kernel",
    ),
    # the sparse backends' pooled q, k, v: pixdit.kernels.blocks' kernel, LLSA's pyramid levels above the first (with
    # its bank), Inductor's fused means (their names also carry "topk_select" when fused next to the selection) or
    # ATen's mean kernel in eager mode
    ("block means (pooling)", r"_block_means_kernel|_next_level_kernel|triton_\w+_fused_mean|MeanOps"),
    ("block selection (top-k)", r"topk|_select|_rescore_kernel|bitonic|sort"),
    ("adaLN joint backward (pixdit.kernels)", r"_joint_bwd_kernel"),
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


def enable_inductor_kernel_bytes() -> Path:
    """Have Inductor record each generated kernel's byte estimate, in output code written under a fresh directory
    (returned; read by ``inductor_kernel_gb``). Call it before the first compiled call. The kernels are unchanged;
    the fresh cache directory (``TORCHINDUCTOR_CACHE_DIR``) also keeps Inductor from reusing a graph compiled
    earlier without the estimates."""
    import os
    import tempfile

    import torch._inductor.config as inductor_config

    inductor_config.benchmark_kernel = True
    directory = Path(tempfile.mkdtemp(prefix="pixdit_inductor_"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)  # read at every compile
    return directory


def inductor_kernel_gb(sources: Path | Sequence[str]) -> dict[str, float | None]:
    """{kernel name: GB one call reads and writes, Inductor's own estimate} for every Triton kernel in ``sources``:
    the text of Inductor's output code, or a directory from ``enable_inductor_kernel_bytes`` (its ``*.py`` files:
    Inductor writes all its output code under its cache directory). None where two kernels of one name (from
    different graphs) differ in their estimate.

    Inductor writes the estimate into each kernel's metadata (``'kernel_num_gb'`` next to ``'kernel_name'``) only
    with ``torch._inductor.config.benchmark_kernel`` on. It is read from the source text, which every torch version
    writes the same way, because the kernel objects a graph holds at run time differ between versions. (Inductor's
    other route, its bandwidth profiler, ``TORCHINDUCTOR_PROFILE=1``, fails to compile a training step on torch
    2.11.)"""
    import re

    if isinstance(sources, Path):
        sources = [path.read_text() for path in sorted(sources.rglob("*.py")) if path.is_file()]
    meta = re.compile(r"'kernel_name': '(\w+)'[^\n]*?'kernel_num_gb': ([0-9.eE+-]+)")
    found: dict[str, set[float]] = {}
    for source in sources:
        for name, gb in meta.findall(source):
            found.setdefault(name, set()).add(float(gb))
    return {name: next(iter(values)) if len(values) == 1 else None for name, values in found.items()}


def bandwidth_table(prof, kernel_gb: dict[str, float | None], peak_tbs: float = 4.0) -> list[dict]:
    """Inductor's kernels in ``prof`` (a torch.profiler run on CUDA), most time lost first: per kernel name its calls,
    device milliseconds, GB moved (``kernel_gb`` per call, from ``inductor_kernel_gb``), GB/s, the bandwidth floor
    ``GB / peak_tbs`` and the time lost against it. A kernel near zero lost time moves its bytes about as fast as
    HBM allows (4 TB/s is what streaming kernels reach on an H200, rated 4.8): only fewer bytes (fusion) can make
    it faster; one far above it is bound by something else (its arithmetic, a looped reduction, L2 misses)."""
    rows = []
    for event in prof.key_averages(group_by_input_shape=False):
        if event.key not in kernel_gb or str(getattr(event, "device_type", "")).endswith("CPU"):
            continue
        ms, gb_per_call = _self_time(event, True) / 1000, kernel_gb[event.key]
        row = {"kernel": event.key, "calls": event.count, "ms": ms}
        if gb_per_call is not None:
            gb = gb_per_call * event.count
            floor = gb / peak_tbs  # GB / (TB/s) = ms
            row.update({"GB": gb, "GB/s": gb / ms * 1e3 if ms else 0.0, "floor ms": floor, "lost ms": ms - floor})
        rows.append(row)
    return sorted(rows, key=lambda row: -row.get("lost ms", row["ms"]))


def bandwidth_markdown(rows: list[dict], top: int = 25) -> str:
    """The first ``top`` rows of a ``bandwidth_table`` as markdown, and a line for all of them: kernels, their time,
    bytes, the floor (and its rate, from the rows' own floors) and the time lost."""

    def cell(column: str, value) -> str:
        if value == "":
            return "?"  # two kernels of this name in different graphs, with different byte counts
        if column == "kernel":
            return value[:90]  # Inductor's names list every fused op
        return f"{value:,.0f}" if column == "GB/s" else f"{value:,.3f}" if isinstance(value, float) else str(value)

    columns = ["kernel", "calls", "ms", "GB", "GB/s", "floor ms", "lost ms"]
    known = [row for row in rows if "GB" in row]
    ms, gb = sum(row["ms"] for row in rows), sum(row["GB"] for row in known)
    floor, lost = sum(row["floor ms"] for row in known), sum(row["lost ms"] for row in known)
    rate = f" at {gb / floor:g} TB/s" if floor else ""
    unknown = len(rows) - len(known)
    return (
        f"{markdown_table(rows[:top], columns, cell=cell)}\n\n{len(rows)} Inductor kernels, {ms:,.3f} ms, {gb:,.3f} GB; "
        f"floor{rate} {floor:,.3f} ms, lost {lost:,.3f} ms"
        + (f" ({unknown} kernels without one byte count)" if unknown else "")
    )


def bandwidth_report(prof, directory: Path | None, top: int = 25) -> tuple[list[dict], str]:
    """``bandwidth_table`` of ``prof`` with the byte estimates under ``directory`` (``enable_inductor_kernel_bytes``;
    None: not compiled with them) and its first ``top`` rows as titled markdown; ([], "") without estimates."""
    kernel_gb = inductor_kernel_gb(directory) if directory is not None else {}
    if not kernel_gb:
        return [], ""
    rows = bandwidth_table(prof, kernel_gb)
    title = f"Inductor's kernels, most time lost against the bandwidth floor first (top {top}):"
    return rows, f"{title}\n\n{bandwidth_markdown(rows, top)}"
