"""Interleaved A/B of ``llsa_attention``: another commit's kernel library against the installed one, in one process.

Separate benchmark processes with Triton autotuning differ by up to 20% on the H200 for the same kernels (the
timing-picked launch configuration and the card's state change between runs), more than a typical kernel change.
This script loads both libraries side by side (``kernel_ab.load_kernels_as``), alternates them for ``--rounds`` rounds
on the same inputs, and reports the median of the rounds' ``do_bench`` medians and their spread. Run it with
``PIXDIT_KERNELS_AUTOTUNE=0`` so that both sides use one fixed launch configuration.

    git archive HEAD~1 kernels | tar -x -C /tmp/base
    PIXDIT_KERNELS_AUTOTUNE=0 python scripts/ab_llsa.py --kernels-from /tmp/base/kernels
    python scripts/ab_llsa.py --kernels-from kernels --quick --device cpu   # CPU check of the script (PyTorch path)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from kernel_ab import load_kernels_as

import pixdit.kernels as current
from pixdit.report import markdown_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels-from", required=True, metavar="DIR", help="the other commit's kernels/ folder")
    p.add_argument("--cases", nargs="+", default=["128:2", "256:2", "256:3", "512:2"], help="SIDE:LEVELS")
    p.add_argument("--tokens-total", type=int, default=131072, help="batch = max(1, tokens_total // tokens)")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="CPU check: one 32^2 case, L=1, 2 rounds, tiny heads")
    return p.parse_args(argv)


def timer(args):
    if args.device.startswith("cuda"):
        import triton.testing

        return lambda fn, rep: triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    import time

    def wall_ms(fn, rep):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.quick:
        args.cases, args.tokens_total, args.heads, args.head_dim, args.rounds = ["32:1"], 1024, 1, 16, 2
    base = load_kernels_as(args.kernels_from, "pixdit_kernels_base")
    time_ms = timer(args)
    cases = [tuple(int(x) for x in case.split(":")) for case in args.cases]
    times = {}  # (side, levels, version) -> [(fwd ms, fwd+bwd ms) per round]
    for round_ in range(args.rounds):
        for side, levels in cases:
            n = side * side
            g = torch.Generator(device=args.device).manual_seed(round_)
            shape = (max(1, args.tokens_total // n), args.heads, n, args.head_dim)
            dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
            q, k, v = (
                torch.randn(shape, device=args.device, dtype=dtype, generator=g).requires_grad_() for _ in range(3)
            )
            do = torch.randn_like(q)
            for version, lib in (("before", base), ("after", current)):

                def forward(lib=lib):
                    return lib.llsa_attention(q, k, v, block_size=16, topk=8, num_levels=levels)

                def forward_backward(forward=forward):
                    return torch.autograd.grad(forward(), (q, k, v), do)

                entry = (time_ms(forward, 100), time_ms(forward_backward, 200))
                times.setdefault((side, levels, version), []).append(entry)
    rows = []
    for side, levels in cases:
        row = {"size": f"{side}²", "L": levels}
        for i, what in enumerate(("fwd", "fwd+bwd")):
            before = statistics.median(t[i] for t in times[(side, levels, "before")])
            after = statistics.median(t[i] for t in times[(side, levels, "after")])
            spread = [t[i] for t in times[(side, levels, "before")] + times[(side, levels, "after")]]
            row |= {f"before {what} ms": before, f"after {what} ms": after, f"{what} speed-up": before / after}
            row[f"{what} spread ms"] = f"{min(spread):.3f}-{max(spread):.3f}"
        rows.append(row)
    print(markdown_table(rows, cell=lambda c, v: f"{v:.3f}" if isinstance(v, float) else str(v)))
    return rows


if __name__ == "__main__":
    main()
