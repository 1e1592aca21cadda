"""Interleaved A/B of the attention's prologue in sampling: the qkv projection and the qk-norm + RoPE kernel as two
launches (cuBLAS's ``F.linear``, then ``qk_norm_rope`` with the block means and v left in qkv: what the sampler runs)
against one Triton GEMM with the kernel's work in its epilogue (``pixdit.kernels.qkv_norm_rope``), in one process.

    python scripts/ab_qkv_gemm.py                                   # DiT-S: 256², batch 32 and 128², batch 64
    python scripts/ab_qkv_gemm.py --shapes 256:140 --heads 12 --head-dim 64      # DiT-B at the sampler's 256² batch
    TRITON_INTERPRET=1 python scripts/ab_qkv_gemm.py --quick --device cpu        # CPU check (the kernel interpreted)

Rounds alternate the forms' order; a cell is the median over rounds of a ``do_bench`` median. "products" times the
fused kernel's GEMM alone on the same tiles (bias added, qkv stored, no norm): what the epilogue costs is the
difference to "one GEMM", and what the tiles lose to cuBLAS is the difference of "products" to ``F.linear`` alone.
", TMA": the same with x and W loaded by TMA (``qkv_norm_rope.TMA_LOADS``, off in the library). The last column: the
largest difference of q, k, v and the means between the fused forms and the two launches, relative to the largest
value.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from kernel_ab import interleaved_ms, rel_diff

from pixdit.kernels import qk_norm_rope
from pixdit.kernels import qkv_norm_rope as fused_module
from pixdit.kernels.qkv_norm_rope import qkv_norm_rope, qkv_norm_rope_products
from pixdit.report import markdown_table

FORMS = ("F.linear", "two launches", "products", "one GEMM", "products, TMA", "one GEMM, TMA")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["256:32", "128:64"], help="SIDE:BATCH, side² tokens per image")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--pool", type=int, default=16, help="LLSA's block size: the block means' pool")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="CPU check: 8², batch 2, 2 heads of 16, 1 round")
    args = p.parse_args(argv)
    try:
        shapes = [tuple(int(v) for v in s.split(":")) for s in args.shapes]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise SystemExit(f"--shapes: each must be SIDE:BATCH, two ints >= 1, got {' '.join(args.shapes)}")
    args.shapes = shapes
    if args.quick:
        args.shapes, args.heads, args.head_dim, args.rounds = [(8, 2)], 2, 16, 1
    return args


def calls(args, side: int, batch: int) -> dict:
    """The forms of ``FORMS`` on one set of inputs, each returning the tensors to compare (or to time)."""
    g = torch.Generator(device=args.device).manual_seed(0)
    n, h, d = side * side, args.heads, args.head_dim
    dim = h * d
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float16
    x = torch.randn(batch, n, dim, device=args.device, generator=g).to(dtype)
    weight = (torch.randn(3 * dim, dim, device=args.device, generator=g) / dim**0.5).to(dtype)
    bias = (torch.randn(3 * dim, device=args.device, generator=g) * 0.1).to(dtype)
    norm = [1 + 0.1 * torch.randn(d, device=args.device, generator=g) for _ in range(2)]
    angles = torch.rand(n, d // 2, device=args.device, generator=g) * 6.28
    cos, sin = angles.cos(), angles.sin()
    impl = "auto" if args.device.startswith("cuda") else "triton"  # the interpreter on CPU

    def two_launches():
        qkv = F.linear(x, weight, bias)
        return qk_norm_rope(qkv, h, *norm, cos, sin, pool_block=args.pool, v_view=True, impl=impl)

    def products():
        return (qkv_norm_rope_products(x, weight, bias),)

    def one_gemm():
        return qkv_norm_rope(x, weight, bias, *norm, cos, sin, h, pool_block=args.pool, impl=impl)

    def by_tma(fn):  # the same call with x and W loaded by TMA (``qkv_norm_rope.TMA_LOADS``)
        def call():
            fused_module.TMA_LOADS = True
            try:
                return fn()
            finally:
                fused_module.TMA_LOADS = False

        return call

    forms = (lambda: (F.linear(x, weight, bias),), two_launches, products, one_gemm, by_tma(products), by_tma(one_gemm))
    return dict(zip(FORMS, forms))


@torch.no_grad()
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for side, batch in args.shapes:
        forms = calls(args, side, batch)
        outputs = {name: fn() for name, fn in forms.items()}
        worst = max(
            rel_diff(a, b)
            for fused in ("one GEMM", "one GEMM, TMA")
            for a, b in zip(outputs[fused], outputs["two launches"])
        )
        ms = interleaved_ms(forms, args.rounds, args.device)
        row = {"shape": f"{side}², batch {batch}", **{f"{name} ms": ms[name] for name in FORMS}}
        row["speed-up"] = ms["two launches"] / ms["one GEMM"]
        row["speed-up, TMA"] = ms["two launches"] / ms["one GEMM, TMA"]
        row["products / F.linear"] = ms["products"] / ms["F.linear"]
        row["products TMA / F.linear"] = ms["products, TMA"] / ms["F.linear"]
        row["max rel. diff"] = f"{worst:.1e}"
        rows.append(row)
        del forms, outputs
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"the attention's prologue in sampling, {args.heads} heads of {args.head_dim}, pool {args.pool}, {device}")
    print(markdown_table(rows, cell=lambda c, v: f"{v:.3f}" if isinstance(v, float) else str(v)))
    return rows


if __name__ == "__main__":
    main()
