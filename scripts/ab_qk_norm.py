"""Interleaved A/B of the qk-norm + RoPE kernel (``pixdit.kernels.qk_norm_rope``, the attention's prologue): another
commit's kernel library against the installed one, in one process, at a model's shape (default: DiT-S, 6 heads of
64, 256² tokens, batch 32 as the sampler runs it).

    git archive HEAD~1 kernels | tar -x -C /tmp/base
    python scripts/ab_qk_norm.py --kernels-from /tmp/base/kernels                 # 256², batch 32
    python scripts/ab_qk_norm.py --kernels-from /tmp/base/kernels --batch 4       # a 256² training step's batch
    python scripts/ab_qk_norm.py --kernels-from kernels --quick --device cpu      # CPU check of the script

Three calls per library, each as the model makes it, with LLSA's block means (``--pool``): "sampling", the forward
without autograd and v left in qkv (``v_view``); "forward", with v written (training's forward); "forward+backward",
that plus the backward of random upstream gradients of q, k, v. Rounds alternate the libraries' order; a cell is the
median over rounds of a ``do_bench`` median. GB: the bytes a forward must move (qkv read once; q, k, and v where it is
written, stored once; the fp32 means), TB/s: those over the installed library's time. The last column compares the
two libraries' outputs and gradients: the largest difference relative to the largest value, 0 = bit for bit.
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from kernel_ab import load_kernels_as, rel_diff, timer

import pixdit.kernels as current
from pixdit.report import markdown_table

CALLS = ("sampling", "forward", "forward+backward")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernels-from", required=True, metavar="DIR", help="the other commit's kernels/ folder")
    p.add_argument("--side", type=int, default=256, help="image side: side² tokens (patch 1)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--pool", type=int, default=16, help="LLSA's block size: the block means' pool")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="CPU check: 32², batch 2, 2 heads of 16, 2 rounds")
    args = p.parse_args(argv)
    if args.quick:
        args.side, args.batch, args.heads, args.head_dim, args.rounds = 32, 2, 2, 16, 2
    for name in ("side", "batch", "heads", "head_dim", "rounds"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    pool = args.pool
    if pool < 1 or pool > 128 or pool & (pool - 1) or args.side**2 % pool:
        raise SystemExit(f"--pool must be a power of two up to 128 that divides side² = {args.side**2}, got {pool}")
    return args


def make_inputs(args):
    """qkv [batch, tokens, 3 * heads * head_dim] and the two norm weights (all with gradients), the RoPE tables, and
    random upstream gradients of q, k, v."""
    g = torch.Generator(device=args.device).manual_seed(0)
    n, h, d = args.side**2, args.heads, args.head_dim
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32

    def randn(*shape, dtype=dtype):
        return torch.randn(shape, device=args.device, dtype=dtype, generator=g)

    qkv = randn(args.batch, n, 3 * h * d).requires_grad_()
    weights = [(1 + 0.1 * randn(d, dtype=torch.float32)).requires_grad_() for _ in range(2)]
    angles = torch.rand(n, d // 2, device=args.device, generator=g) * (2 * math.pi)
    upstream = [randn(args.batch, h, n, d) for _ in range(3)]
    return qkv, weights, angles.cos(), angles.sin(), upstream


def library_calls(lib, args, qkv, weights, cos, sin, upstream) -> dict:
    """The three calls of ``CALLS`` with the library ``lib``, each returning the tensors to compare."""

    def prologue(**options):
        return lib.qk_norm_rope(qkv, args.heads, *weights, cos, sin, pool_block=args.pool, **options)

    def sampling():
        with torch.no_grad():
            return prologue(v_view=True)

    def forward_backward():
        q, k, v, means = prologue()
        return (q, k, means, *torch.autograd.grad((q, k, v), (qkv, *weights), upstream))

    return dict(zip(CALLS, (sampling, prologue, forward_backward)))


def forward_gb(args, call: str, element_bytes: int) -> float | None:
    """The bytes a forward must move, in GB (None for forward+backward)."""
    if call == "forward+backward":
        return None
    tokens, width = args.batch * args.side**2, args.heads * args.head_dim
    written = 2 if call == "sampling" else 3  # q, k (and v)
    means = 3 * tokens // args.pool * width * 4
    return ((3 + written) * tokens * width * element_bytes + means) / 1e9


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    base = load_kernels_as(args.kernels_from, "pixdit_kernels_base")
    qkv, weights, cos, sin, upstream = make_inputs(args)
    versions = {
        name: library_calls(lib, args, qkv, weights, cos, sin, upstream)
        for name, lib in (("before", base), ("after", current))
    }
    outputs = {name: {call: fn() for call, fn in calls.items()} for name, calls in versions.items()}
    time_ms = timer(args.device)
    times = {(name, call): [] for name in versions for call in CALLS}
    for round_ in range(args.rounds):
        order = list(versions) if round_ % 2 == 0 else list(versions)[::-1]
        for call in CALLS:
            for name in order:
                times[(name, call)].append(time_ms(versions[name][call], 200))
    rows = []
    for call in CALLS:
        before, after = (statistics.median(times[(name, call)]) for name in ("before", "after"))
        spread = times[("before", call)] + times[("after", call)]
        gb = forward_gb(args, call, qkv.element_size())
        worst = max(rel_diff(a, b) for a, b in zip(outputs["before"][call], outputs["after"][call]))
        rows.append(
            {
                "call": call,
                "before ms": before,
                "after ms": after,
                "speed-up": before / after,
                "spread ms": f"{min(spread):.3f}-{max(spread):.3f}",
                "GB": "-" if gb is None else f"{gb:.2f}",
                "TB/s after": "-" if gb is None else f"{gb / after:.2f}",
                "max rel. diff": f"{worst:.1e}",
            }
        )
    shape = f"{args.side}², batch {args.batch}, {args.heads} heads of {args.head_dim}, pool {args.pool}"
    print(f"qk-norm + RoPE, {shape}, {qkv.dtype}; before = {args.kernels_from}, after = the installed library")
    print(
        markdown_table(
            rows, cell=lambda c, v: f"{v:.4f}" if c == "speed-up" else f"{v:.3f}" if isinstance(v, float) else str(v)
        )
    )
    return rows


if __name__ == "__main__":
    main()
