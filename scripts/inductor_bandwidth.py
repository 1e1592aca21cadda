"""Which of Inductor's generated kernels leave memory bandwidth on the table: a ranked table from Inductor's own
bandwidth profiler.

    TORCHINDUCTOR_PROFILE=1 TORCHINDUCTOR_PROFILE_OUTPUT=bw.txt TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 \\
        python scripts/bench_train.py --compile --attention llsa:num_levels=2 --sizes 256 --warmup 1 --steps 1
    python scripts/inductor_bandwidth.py bw.txt                  # --peak-tbs 4.0 --top 25

With ``TORCHINDUCTOR_PROFILE=1`` every Triton kernel that Inductor generates is timed on its first call (``do_bench``)
and given the bytes Inductor estimated when it wrote the kernel; at the end of every call of a compiled graph, the
graph appends its table (each kernel call: ms, GB, GB/s, name) to ``TORCHINDUCTOR_PROFILE_OUTPUT``. The timings of
the benchmark itself mean nothing in such a run (every kernel is benchmarked where it first runs), and the profiler
sees only Inductor's own kernels, not cuBLAS or pixdit's custom ops. Any command works (``train.py``,
``bench_sampling.py``); without the cache switch a graph compiled earlier is reused without the profiler.

Known not to work with torch 2.11 (the GPU machine's image, 2026-12): with ``TORCHINDUCTOR_PROFILE_OUTPUT`` set, the
compile fails (``benchmark_compiled_module() missing 1 required positional argument: 'args'``: a whole-graph
benchmark Inductor runs at compile time when ``benchmark_harness`` is on), and with that benchmark switched off
(``torch._inductor.config.benchmark_harness = False``) the profiled training step and sampler hit an illegal memory
access on the H200. There, ``bench_train.py --profile`` / ``bench_sampling.py --profile`` (torch.profiler: every
kernel's time, no byte counts) is what works.

This script keeps the last table of each graph, adds up the calls of each kernel, and ranks the kernels by the time
they lose against a bandwidth floor: ``lost = ms - GB / peak``. The default peak, 4 TB/s, is a rate that streaming
kernels approach on an H200 (its HBM3e is rated 4.8 TB/s; the qk-norm + RoPE kernel and Inductor's faster LayerNorm
kernels reach ~3.5 in a compiled sampler); a kernel near or below zero lost time is about as fast as its bytes
allow, and only fewer bytes (fusion) make it faster.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

from pixdit.report import markdown_table

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # some torch versions colour the slow kernels' lines red, in the file too
HEADER = re.compile(r"^TRITON KERNELS BANDWIDTH INFO \((?P<graph>.*)\)\s*$")
# one kernel call: "0.123ms \t0.456 GB \t 3700.00GB/s \t 12.34% \t triton_red_fused_..." (tabs or spaces; the share
# of the graph's time is left out by some torch versions)
CALL = re.compile(r"^\s*(?P<ms>[\d.]+)ms\s+(?P<gb>[\d.]+)\s*GB\s+(?P<gbs>[\d.]+)\s*GB/s\s+(?:[\d.]+%\s+)?(?P<name>\S+)")


def parse(text: str) -> dict[str, list[tuple[str, float, float]]]:
    """{graph: [(kernel, ms, GB), ...]} from the last table each graph appended."""
    graphs: dict[str, list[tuple[str, float, float]]] = {}
    current = None
    for line in ANSI.sub("", text).splitlines():
        header = HEADER.match(line)
        if header:
            current = header.group("graph")
            graphs[current] = []  # a later call of the same graph replaces the earlier table
            continue
        call = CALL.match(line)
        if call and current is not None:
            graphs[current].append((call.group("name"), float(call.group("ms")), float(call.group("gb"))))
        elif line.startswith(("SUMMARY", "====")):
            current = None
    return graphs


def rank(graphs: dict[str, list[tuple[str, float, float]]], peak_tbs: float) -> list[dict]:
    """One row per kernel (all graphs, all calls), most lost time first."""
    calls, ms, gb = defaultdict(int), defaultdict(float), defaultdict(float)
    for table in graphs.values():
        for name, t, size in table:
            calls[name] += 1
            ms[name] += t
            gb[name] += size
    total = sum(ms.values()) or 1.0
    rows = []
    for name in ms:
        floor = gb[name] / peak_tbs  # GB / (TB/s) = ms
        rows.append(
            {
                "kernel": name,
                "calls": calls[name],
                "ms": ms[name],
                "GB": gb[name],
                "GB/s": gb[name] / ms[name] * 1e3 if ms[name] else 0.0,
                "floor ms": floor,
                "lost ms": ms[name] - floor,
                "share %": 100 * ms[name] / total,
            }
        )
    return sorted(rows, key=lambda row: -row["lost ms"])


def markdown(rows: list[dict], top: int, name_width: int = 90) -> str:
    def cell(column: str, value) -> str:
        if column == "kernel":
            return value[:name_width]
        return f"{value:,.0f}" if column == "GB/s" else f"{value:,.3f}" if isinstance(value, float) else str(value)

    ms, gb = sum(r["ms"] for r in rows), sum(r["GB"] for r in rows)
    floor, lost = sum(r["floor ms"] for r in rows), sum(r["lost ms"] for r in rows)
    return (
        f"{markdown_table(rows[:top], cell=cell)}\n\n{len(rows)} kernels, {ms:,.3f} ms, {gb:,.3f} GB "
        f"({gb / ms * 1e3 if ms else 0:,.0f} GB/s); floor {floor:,.3f} ms, lost {lost:,.3f} ms"
    )


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path, help="the TORCHINDUCTOR_PROFILE_OUTPUT file")
    parser.add_argument("--peak-tbs", type=float, default=4.0, help="the bandwidth floor's rate, TB/s (default 4)")
    parser.add_argument("--top", type=int, default=25, help="kernels in the table (default 25)")
    args = parser.parse_args(argv)
    if args.peak_tbs <= 0:
        sys.exit(f"error: --peak-tbs must be > 0 (TB/s), got {args.peak_tbs}")
    if not args.file.is_file():
        sys.exit(f"error: {args.file} does not exist: run the command with TORCHINDUCTOR_PROFILE_OUTPUT={args.file}")
    graphs = parse(args.file.read_text())
    if not any(graphs.values()):
        sys.exit(
            f"error: {args.file} holds no kernel table of Inductor's bandwidth profiler; set TORCHINDUCTOR_PROFILE=1 "
            "and TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 as well, and compile on a CUDA device"
        )
    rows = rank(graphs, args.peak_tbs)
    print(f"{len(graphs)} graphs from {args.file}; floor at {args.peak_tbs:g} TB/s; most lost time first\n")
    print(markdown(rows, args.top))
    return rows


if __name__ == "__main__":
    main()
