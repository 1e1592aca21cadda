"""Block selection (pooled scores + exact top-k) on its own: the Triton kernels of ``pixdit.kernels.topk`` against the
PyTorch path, at the shapes the backends use, in one run (medians of 200 calls after 25 warm-up calls, CUDA events:
``pixdit.report.time_median``).

    python scripts/bench_topk.py                                  # VSA/SLA at 128^2 and 256^2, LLSA 512^2 L=2 top level
    python scripts/bench_topk.py --baseline old/topk.py           # + another version of topk.py (A/B of a kernel change)

Rows: ``torch`` (chunked fp32 matmul + ``topk_desc_fast``), ``triton`` (what ``pooled_topk`` runs by default), and
the streaming kernel at 16 and 32 query rows per program. Every variant's
ids are checked against the ``torch`` row's (same exact selection up to fp32 near-ties, reported as a mismatch
count). Shapes: [batch*heads, rows, head_dim] pooled queries against as many pooled keys, fp32, head_dim 64.
"""

from __future__ import annotations

import argparse
import importlib.util

import torch

from pixdit.kernels import topk
from pixdit.report import markdown_table, time_median

# (label, batch*heads, blocks, k): VSA/SLA at 128^2 (K=20) and 256^2 (K=32), block 16, 6 heads; LLSA's coarsest
# level at 512^2 with L=2 (1,024 tokens, K=8)
SHAPES = [("128² VSA/SLA", 48, 1024, 20), ("256² VSA/SLA", 12, 4096, 32), ("512² LLSA L=2 top", 6, 1024, 8)]


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("topk_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=None, help="another topk.py to time next to this one")
    parser.add_argument("--head-dim", type=int, default=64)
    args = parser.parse_args(argv)
    baseline = load_module(args.baseline) if args.baseline else None

    rows = []
    for label, bh, blocks, k in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(bh, blocks, args.head_dim, device="cuda", generator=g)
        kp = torch.randn(bh, blocks, args.head_dim, device="cuda", generator=g)
        out = torch.empty(bh, blocks, k, device="cuda", dtype=torch.int32)
        variants = {"torch": lambda: topk.pooled_topk(q, kp, k, impl="torch"),
                    "triton": lambda: topk.pooled_topk(q, kp, k, impl="triton")}
        for rows_per_program in (16, 32):
            variants[f"streaming rows={rows_per_program}"] = (
                lambda r=rows_per_program: topk._streaming_topk(q, kp, k, out, r))
        if baseline is not None:
            variants["baseline"] = lambda: baseline.pooled_topk(q, kp, k, impl="triton")
        reference = variants["torch"]().clone()
        torch_ms = None
        for name, fn in variants.items():
            mismatched_rows = int((fn() != reference).any(-1).sum())
            ms = 1000 * time_median(fn, warmup=25, repeats=200, device="cuda")[0]
            torch_ms = torch_ms or ms
            rows.append({"shape": label, "bh x blocks, k": f"{bh} x {blocks}, {k}", "variant": name,
                         "ms": f"{ms:.3f}", "x torch": f"{torch_ms / ms:.1f}x", "rows differing": mismatched_rows})
            print(rows[-1], flush=True)
    print()
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
