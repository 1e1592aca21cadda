"""Block selection (pooled scores + exact top-k) on its own, then a sweep over K through VSA and SLA, in one run.

    python scripts/bench_topk.py                                  # selection table + K sweep (GPU)
    python scripts/bench_topk.py --baseline old/topk.py           # + another topk.py (A/B of a kernel change; with a
                                                                  #   row kernel there, also that kernel alone)
    python scripts/bench_topk.py --no-sweep                       # selection table only

Selection table: ``torch`` (chunked fp32 matmul + ``topk_desc_fast``), ``triton (<path>)`` (what ``pooled_topk``
runs by default, and which of its paths that is), the streaming kernel at 16 and 32 query rows per program wherever
it can run, and ``baseline`` (``--baseline``'s ``pooled_topk``), at the shapes the backends use: [batch*heads, rows, head_dim] fp32 pooled queries against as many
pooled keys (medians of 100 calls after 25 warm-up calls, CUDA events: ``pixdit.report.time_median``). Every variant's ids are checked against the
``torch`` row's (same exact selection up to fp32 near-ties, reported as a count of differing rows).

K sweep: ``vsa_attention`` and ``sla_attention`` forward + backward on [2, 2, 4096, 64] bf16 with 16-token tiles
(256 tiles) for K = 4, 8, ..., 256 in one process: the first call's seconds (compilation included: no K should
compile anything new after the first) and the warm median. The baseline is left out of the sweep (a topk.py that
compiles per K takes minutes there).
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import torch

from pixdit.kernels import sla_attention, topk, vsa_attention
from pixdit.kernels.blocks import exact_fp32_matmul
from pixdit.report import markdown_table, time_median

# (label, batch*heads, blocks, k): VSA/SLA at 128^2 (K=20) and 256^2 (K=16 / 32 / 64: the three streaming buckets),
# block 16, 6 heads; LLSA's coarsest level at 512^2 with L=2 (1,024 tokens, K=8)
SHAPES = [
    ("128² VSA/SLA", 48, 1024, 20),
    ("256² VSA/SLA", 12, 4096, 16),
    ("256² VSA/SLA", 12, 4096, 32),
    ("256² VSA/SLA", 12, 4096, 64),
    ("512² LLSA L=2 top", 6, 1024, 8),
]
SWEEP_SHAPE = (2, 2, 4096, 64)  # [batch, heads, tokens, head_dim]: 256 tiles of 16 tokens


def load_module(path: str):
    """Another topk.py, loaded as a module of pixdit.kernels so that its relative imports resolve."""
    spec = importlib.util.spec_from_file_location("pixdit.kernels._topk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def selection_table(baseline, head_dim: int) -> list[dict]:
    rows = []
    for label, bh, blocks, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(bh, blocks, head_dim, device="cuda", generator=g)
        kp = torch.randn(bh, blocks, head_dim, device="cuda", generator=g)
        out = torch.empty(bh, blocks, k, device="cuda", dtype=torch.int32)
        route = topk._route(blocks, head_dim, k, None)
        variants = {
            "torch": lambda: topk.pooled_topk(q, kp, k, impl="torch"),
            f"triton ({route})": lambda: topk.pooled_topk(q, kp, k, impl="triton"),
        }
        if route in ("two_pass", "streaming") and k <= topk.STREAM_MAX_K:  # the streaming kernel takes it too
            for rows_per_program in (16, 32):
                variants[f"streaming rows={rows_per_program}"] = lambda r=rows_per_program: topk._streaming_topk(
                    q, kp, k, out, r
                )
        if baseline is not None:
            variants["baseline"] = lambda: baseline.pooled_topk(q, kp, k, impl="triton")
        reference = variants["torch"]().clone()
        torch_ms = None
        for name, fn in variants.items():
            mismatched_rows = int((fn() != reference).any(-1).sum())
            ms = 1000 * time_median(fn, 25, 100, q.device)[0]
            torch_ms = torch_ms or ms
            rows.append(
                {
                    "shape": label,
                    "bh x blocks, k": f"{bh} x {blocks}, {k}",
                    "variant": name,
                    "ms": f"{ms:.3f}",
                    "x torch": f"{torch_ms / ms:.1f}x",
                    "rows differing": mismatched_rows,
                }
            )
            print(rows[-1], flush=True)
    return rows


# (label, rows, candidates, k, kind) for the row kernel alone: one 256 MiB chunk of scores where the rows are long
ROW_CASES = [
    ("128² VSA/SLA", 49152, 1024, 20, "scores"),
    ("256² VSA/SLA", 16384, 4096, 16, "scores"),
    ("256² VSA/SLA", 16384, 4096, 32, "scores"),
    ("256² VSA/SLA", 16384, 4096, 64, "scores"),
    ("256² VSA/SLA", 16384, 4096, 128, "scores"),
    ("256², rows sorted ascending", 16384, 4096, 32, "sorted"),
    ("256², integer scores in [-3, 3]", 16384, 4096, 32, "ties"),
    ("256² SLA's screened pass: block means of N(0, 1) tokens", 16384, 4096, 64, "pooled"),
    ("512² LLSA L=2 top", 6144, 1024, 8, "scores"),
    ("512² VSA", 16384, 16384, 32, "scores"),
]


def row_kernel_table(baseline) -> list[dict]:
    """The two-pass path's row kernel alone on the same precomputed fp32 scores, this one and ``--baseline``'s
    (continuous scores, the same sorted within each row, tie-heavy integer scores, and scores at SLA's scale: the
    row kernel's search took ~2 to ~12 steps depending on the scale before it started from a bracket)."""
    rows = []
    for label, n_rows, n, k, kind in ROW_CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        if kind == "ties":
            scores = torch.randint(-3, 4, (n_rows, n), device="cuda", generator=g).float()
        else:  # "pooled": like means of 16 N(0, 1) tokens, SLA's scores at their own scale (~N(0, 0.5^2))
            spread = 0.25 if kind == "pooled" else 1.0
            q = spread * torch.randn(n_rows // n, n, 64, device="cuda", generator=g)
            kp = spread * torch.randn(n_rows // n, n, 64, device="cuda", generator=g)
            with exact_fp32_matmul():
                scores = (q @ kp.transpose(-1, -2)).reshape(n_rows, n)
            if kind == "sorted":
                scores = scores.sort(-1).values
        scores = scores.contiguous()
        out = torch.empty(n_rows, k, device="cuda", dtype=torch.int32)
        times, ids = {}, {}
        for name, module in (("this", topk), ("baseline", baseline)):
            ids[name] = module._rows_topk(scores, k, out).clone()
            times[name] = 1000 * time_median(lambda m=module: m._rows_topk(scores, k, out), 10, 50, "cuda")[0]
        rows.append(
            {
                "scores": label,
                "rows x candidates, k": f"{n_rows} x {n}, {k}",
                "baseline ms": f"{times['baseline']:.3f}",
                "this ms": f"{times['this']:.3f}",
                "speed-up": f"{times['baseline'] / times['this']:.2f}x",
                "same ids": bool(torch.equal(ids["this"], ids["baseline"])),
            }
        )
        print(rows[-1], flush=True)
    return rows


def sweep_table() -> tuple[list[dict], float]:
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, up = (torch.randn(*SWEEP_SHAPE, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    methods = {
        "vsa": lambda kk: vsa_attention(q, k, v, block_size=16, topk=kk),
        "sla": lambda kk: sum(sla_attention(q, k, v, block_size=16, topk=kk)),
    }
    n_tiles = SWEEP_SHAPE[2] // 16
    rows, t_start = [], time.perf_counter()
    for kk in range(4, n_tiles + 1, 4):
        row = {"K": kk, "selection": topk._route(n_tiles, SWEEP_SHAPE[3], kk, None)}
        for name, method in methods.items():

            def step(method=method):
                torch.autograd.grad(method(kk), (q, k, v), up)

            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            row[f"{name} first call s"] = f"{time.perf_counter() - t0:.2f}"
            row[f"{name} fwd+bwd ms"] = f"{1000 * time_median(step, 5, 25, q.device)[0]:.3f}"
        rows.append(row)
        print(row, flush=True)
    return rows, time.perf_counter() - t_start


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=None, help="another topk.py to time next to this one")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-sweep", action="store_true", help="skip the K sweep through VSA and SLA")
    args = parser.parse_args(argv)
    baseline = load_module(args.baseline) if args.baseline else None
    selection = selection_table(baseline, args.head_dim)
    row_kernel = row_kernel_table(baseline) if baseline is not None and hasattr(baseline, "_rows_topk") else []
    sweep, seconds = sweep_table() if not args.no_sweep else ([], 0.0)
    print()
    print(markdown_table(selection))
    if row_kernel:
        print("\nThe two-pass path's row kernel alone, this topk.py vs --baseline's:\n")
        print(markdown_table(row_kernel))
    if sweep:
        print(f"\nK sweep, {SWEEP_SHAPE} bf16, 16-token tiles: {seconds:.1f} s in all (first calls included)\n")
        print(markdown_table(sweep))


if __name__ == "__main__":
    main()
